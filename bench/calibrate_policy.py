"""Calibrate the tiny policy: sample toy prompts at T=1 through a minimal agent loop, print rates.

Self-contained on purpose (transformers `generate`, not the project's agent loop, which is built
separately), so the policy can be calibrated while the loop is written. Per rollout: generate until
`</tool_call>` or `<|im_end|>`, run the call (the real sandbox when `cleaner.sandbox` imports and
works, else `local_exec` in a child process: trusted tiny-model output only, not a sandbox), append
the tool segment, and go on for up to --max-turns generations and --max-retries retries per failed
step. Prints:
  well-formed calls   share of generated calls whose JSON parses to code
  first-call errors   share of rollouts whose first call failed (typo-like: NameError/SyntaxError,
                      approach-like: ModuleNotFoundError/ImportError)
  recovery            share of rollouts with a failed call that later made a successful call
  accuracy            share of rollouts whose final \\boxed{} answer is right

    .venv/bin/python bench/calibrate_policy.py --model cleaner/assets/tiny-policy --n 256 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import logging
import subprocess
from dataclasses import dataclass, field

import torch

from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.model.chat import ChatFormat, parse_tool_call
from cleaner.tools.responses import format_tool_response

TYPO_ERRORS = {"NameError", "SyntaxError", "IndentationError"}
APPROACH_ERRORS = {"ModuleNotFoundError", "ImportError"}


@dataclass
class Rollout:
    ground_truth: str
    token_ids: list[int]
    prompt_len: int
    done: bool = False
    retries_at_step: int = 0
    calls: list[tuple[bool, bool, str | None]] = field(default_factory=list)  # (well_formed, ok, error_type)


# ---------------------------------------------------------------------------------------------
# Tool execution


def _worded(result) -> tuple[bool, str, str | None]:
    """(ok, response, error_type) of a sandbox result, worded as the collect loop words it."""
    ok = result.status == "ok"
    response = format_tool_response(ok, result.stdout, result.stderr, None if ok else str(result.status))
    return ok, response, result.error_type


def make_executor():
    """(codes) -> [(ok, response, error_type)]; the real sandbox if available."""
    try:
        from cleaner.sandbox import SandboxConfig, make_sandbox

        sandbox = make_sandbox(SandboxConfig())
        probe = sandbox.run("print(6 * 7)")
        if "42" not in probe.stdout:
            raise RuntimeError(f"sandbox probe answered {probe!r}")
        logging.info("executing calls in the real sandbox")

        def run_sandbox(codes):
            return [_worded(result) for result in sandbox.run_many(codes)]
        return run_sandbox
    except (ImportError, AttributeError, RuntimeError, TypeError) as error:
        logging.info("real sandbox unavailable (%s); using local_exec", error)
    from cleaner.toys.local_exec import run_snippets

    def run_local(codes):
        try:
            results = run_snippets(codes, timeout_s=10 + 0.05 * len(codes))
        except subprocess.TimeoutExpired:
            results = []
            for code in codes:
                try:
                    results += run_snippets([code], timeout_s=4)
                except subprocess.TimeoutExpired:
                    results.append(None)
        return [(r.ok, r.response, r.error_type) if r else
                (False, format_tool_response(False, "", "", "timeout"), "Timeout") for r in results]
    return run_local


# ---------------------------------------------------------------------------------------------
# Loop


def generate_turn(model, chat: ChatFormat, rollouts: list[Rollout], args) -> list[list[int]]:
    pad_id = chat.tokenizer.pad_token_id
    length = max(len(r.token_ids) for r in rollouts)
    input_ids = torch.full((len(rollouts), length), pad_id, dtype=torch.long)  # (B, T) left-padded
    attention_mask = torch.zeros_like(input_ids)  # (B, T)
    for row, rollout in enumerate(rollouts):
        input_ids[row, length - len(rollout.token_ids):] = torch.tensor(rollout.token_ids)
        attention_mask[row, length - len(rollout.token_ids):] = 1
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
            temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
            eos_token_id=list(chat.stop_token_ids), pad_token_id=pad_id,
        )
    generated = []
    for row in output[:, length:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in chat.stop_token_ids), len(row))
        generated.append(row[:cut])
    return generated


def step_rollouts(model, chat, rollouts, execute, args) -> None:
    active = [r for r in rollouts if not r.done]
    for start in range(0, len(active), args.batch):
        batch = active[start:start + args.batch]
        pending = []
        for rollout, new_ids in zip(batch, generate_turn(model, chat, batch, args), strict=True):
            rollout.token_ids += new_ids
            if not new_ids or new_ids[-1] != chat.tool_call_close_id:
                rollout.done = True
                continue
            call = parse_tool_call(chat.decode(new_ids))
            pending.append((rollout, call))
        codes = [call.code for _, call in pending if call is not None and call.code is not None]
        results = iter(execute(codes))
        for rollout, call in pending:
            if call is None or call.code is None:
                reason = call.error if call else "no tool call"
                ok, response, error_type = False, format_tool_response(False, "", reason, "format_error"), "FormatError"
                rollout.calls.append((False, False, error_type))
            else:
                ok, response, error_type = next(results)
                rollout.calls.append((True, ok, error_type))
            rollout.retries_at_step = 0 if ok else rollout.retries_at_step + 1
            rollout.token_ids += chat.tool_response_ids(response)
            if rollout.retries_at_step > args.max_retries or len(rollout.token_ids) > 1024 - args.max_new_tokens:
                rollout.done = True


def report(chat, rollouts) -> dict[str, float]:
    calls = [c for r in rollouts for c in r.calls]
    with_call = [r for r in rollouts if r.calls]
    first_failed = [r for r in with_call if not r.calls[0][1]]
    kinds = collections.Counter(r.calls[0][2] for r in first_failed)
    recovered = [r for r in first_failed if any(ok for _, ok, _ in r.calls[1:])]
    any_failed = [r for r in with_call if any(not ok for _, ok, _ in r.calls)]
    later_ok = [r for r in any_failed
                if any(ok for _, ok, _ in r.calls[next(i for i, c in enumerate(r.calls) if not c[1]) + 1:])]
    correct = [compute_reward(chat.decode(r.token_ids[r.prompt_len:]), r.ground_truth, "toy").correct
               for r in rollouts]
    rates = {
        "well_formed_calls": sum(c[0] for c in calls) / max(1, len(calls)),
        "first_call_error_rate": len(first_failed) / max(1, len(with_call)),
        "first_errors_typo_like": sum(kinds[k] for k in TYPO_ERRORS) / max(1, len(with_call)),
        "first_errors_approach_like": sum(kinds[k] for k in APPROACH_ERRORS) / max(1, len(with_call)),
        "recovery_after_failure": len(later_ok) / max(1, len(any_failed)),
        "first_failure_recovered": len(recovered) / max(1, len(first_failed)),
        "accuracy": sum(correct) / len(rollouts),
        "rollouts_with_call": len(with_call) / len(rollouts),
        "calls_per_rollout": len(calls) / len(rollouts),
    }
    print(f"first-call error types: {dict(kinds)}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="cleaner/assets/tiny-policy")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--show", type=int, default=0, help="print this many failed-first-call rollouts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    chat = ChatFormat(tokenizer)
    rollouts = []
    for task in toy_tasks(args.n, args.seed):
        prompt = chat.prompt_ids(task.messages)
        rollouts.append(Rollout(task.ground_truth, list(prompt), len(prompt)))
    execute = make_executor()
    for _ in range(args.max_turns):
        if all(r.done for r in rollouts):
            break
        step_rollouts(model, chat, rollouts, execute, args)
    for rollout in [r for r in rollouts if r.calls and not r.calls[0][1]][: args.show]:
        print("=" * 80 + "\n" + chat.decode(rollout.token_ids[rollout.prompt_len:]))
    for name, value in report(chat, rollouts).items():
        print(f"{name:28s} {value:.3f}")


if __name__ == "__main__":
    main()
