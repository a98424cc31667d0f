"""Fakes of the agent loop's tests (collect, user tools, reward files, bring-your-own-task): a
character-level tokenizer with the ChatML/tool special tokens wrapped in the real ChatFormat, a
backend whose output for a request is looked up by its seed (the loop's own `turn_seed`, so a script
says "rollout r, turn t writes X"), and a sandbox whose outcome is read from the code: `oops` ->
NameError, `CRASH` -> the sandbox itself raises, anything else succeeds and prints the code. Both
answer the loop's awaited requests; `waves` records how many requests arrived together (within one
turn of the event loop), which is what tells lock step from each rollout on its own clock.

Also the chains of docs/architecture.md §4 for the Python tool (CHAINS) and for the example's unit
converter (UNIT_CHAINS, examples/units), whose failures SAAR must merge alike.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from cleaner.config import CollectConfig
from cleaner.engine.collect.agent import turn_seed
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import Task
from cleaner.engine.model.base import LENGTH, STOP, Generation
from cleaner.engine.model.chat import ChatFormat, format_call, format_tool_call
from cleaner.sandbox import ExecResult, ExecStatus
from cleaner.tools import Toolbox, load_tools
from tests.factories import RequestsOverBatch, RunAsync

SPECIALS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>")

# ---------------------------------------------------------------------------------------------
# Fakes


class CharTokenizer:
    """One id per character; the special tokens are single ids 0..5."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in SPECIALS if text.startswith(s, i)), None)
            if special is not None:
                ids.append(SPECIALS.index(special))
                i += len(special)
            else:
                ids.append(100 + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(SPECIALS[i] if i < len(SPECIALS) else chr(i - 100) for i in ids)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + "<|im_start|>assistant\n")


CHAT = ChatFormat(CharTokenizer())


def call(reasoning: str, code: str) -> str:
    return reasoning + format_call(code)


def answer(text: str) -> str:
    return text + "<|im_end|>"


def fake_score(sequences, starts):
    """A deterministic old policy: log pi(s[t] | s[:t]) depends on the token and its position."""
    return [[-0.002 * ((s[t] * 7 + t) % 97) - 0.05 for t in range(start, len(s))]
            for s, start in zip(sequences, starts, strict=True)]


class Waves:
    """Counts the requests that arrive together: each waits one turn of the event loop, and the
    first to wake closes its wave."""

    def __init__(self):
        self.sizes: list[int] = []  # requests per wave, in order
        self.limits: list[set[int]] = []  # the max_new_tokens asked for in each wave
        self._open: list[int] = []

    async def arrive(self, limit: int = 0) -> None:
        self._open.append(limit)
        await asyncio.sleep(0)
        if self._open:
            self.sizes.append(len(self._open))
            self.limits.append(set(self._open))
            self._open = []


class ScriptedBackend(RequestsOverBatch):
    """Request with seed s writes script[s]; logprob of token k of any request is -(k + 1) / 100."""

    policy_version = "fake-policy@1"
    context_length = None  # no model: prompts are not checked against a context

    def __init__(self, scripts: dict[tuple[str, int], list[str]], config: CollectConfig,
                 raise_on: set[tuple[str, int, int]] = frozenset()):
        self.texts, self.raise_seeds = {}, set()
        for (prompt_id, sample_index), texts in scripts.items():
            for turn, text in enumerate(texts):
                seed = turn_seed(config.seed, config.iteration, prompt_id, sample_index, turn)
                self.texts[seed] = text
        for prompt_id, sample_index, turn in raise_on:
            self.raise_seeds.add(turn_seed(config.seed, config.iteration, prompt_id, sample_index, turn))
        self.waves = Waves()
        self.scored: list[int] = []  # sequences per score call

    async def generate_async(self, prompt, params, seed, session=None):
        await self.waves.arrive(params.max_new_tokens)
        return await super().generate_async(prompt, params, seed, session)

    def generate(self, prompts, params, seeds):
        if self.raise_seeds & set(seeds):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return [self._one(self.texts[seed], params) for seed in seeds]

    def score(self, sequences, starts):
        self.scored.append(len(sequences))
        return fake_score(sequences, starts)

    @staticmethod
    def _one(text, params):
        ids = CHAT.encode(text)
        stop = next((k for k, t in enumerate(ids) if t in params.stop_token_ids), None)
        if stop is not None and stop < params.max_new_tokens:
            ids, reason = ids[: stop + 1], STOP
        else:
            ids, reason = ids[: params.max_new_tokens], LENGTH
        return Generation(tuple(ids), tuple(-(k + 1) / 100 for k in range(len(ids))), reason)


class FakeSandbox(RunAsync):
    def __init__(self):
        self.codes: list[str] = []  # every run, in order
        self.waves = Waves()

    async def run_async(self, code, stdin=None):
        await self.waves.arrive()
        return await super().run_async(code, stdin)

    def run(self, code, stdin=None):
        self.codes.append(code)
        if "CRASH" in code:
            raise ConnectionError("worker lost")
        if "oops" in code:
            stderr = "NameError: name 'oops' is not defined"
            return ExecResult(ExecStatus.ERROR, "NameError", "", stderr, 1.5)
        return ExecResult(ExecStatus.OK, None, code, "", 2.5)


@dataclass(frozen=True)
class Reward:
    reward: float
    correct: bool
    answer: str | None


def fake_reward(text, ground_truth, data_source):
    correct = ground_truth in text
    return Reward(float(correct), correct, ground_truth if correct else None)


def task(prompt_id: str) -> Task:
    return Task(prompt_id, ({"role": "user", "content": f"Question {prompt_id}?"},), "42", "toy")


# ---------------------------------------------------------------------------------------------
# The chains of docs/architecture.md §4 (K = 3)

BASE = CollectConfig(group_size=1, max_turns=8, max_retries=3, max_new_tokens=120,
                     max_response_tokens=2000, batch_rollouts=8, collect_view="purified")

CHAINS = {
    # shallow retry: similar code, so the merged turn keeps "Let me compute." and takes the new call
    ("shallow", 0): [call("Let me compute.", "print(6*7+oops)"), call("Fixed.", "print(6*7)"),
                     answer("The answer is 42.")],
    # deep retry (dissimilar code), then a second step that succeeds at once, then the answer
    ("deep", 0): [call("Try a name.", "x = undefined_oops"), call("New plan.", "print(42)"),
                  call("Check.", "print(40+2)"), answer("So 42.")],
    # exhausted: attempts 0..3 all fail, then a new step succeeds, then the answer
    ("exhausted", 0): [call(f"Try {i}.", f"print(oops{i})") for i in range(4)]
    + [call("Again.", "print(42)"), answer("42.")],
    # a retry that answers instead of calling
    ("gives_up", 0): [call("Compute.", "print(oops)"), answer("I think 41.")],
}


# ---------------------------------------------------------------------------------------------
# The same chains with the example's second tool (examples/units/tools.yaml)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"
UNITS = load_tools(str(EXAMPLE / "tools.yaml"), None)
UNIT_CHAT = ChatFormat(CharTokenizer(), Toolbox(UNITS).schemas)


def convert(reasoning: str, value: float, from_unit: str, to_unit: str) -> str:
    return reasoning + format_tool_call("convert_units", {"value": value, "from_unit": from_unit, "to_unit": to_unit})


def arguments(value, from_unit, to_unit) -> str:
    """A call's tool_code: its arguments as sorted JSON."""
    return json.dumps({"from_unit": from_unit, "to_unit": to_unit, "value": value}, sort_keys=True)


UNIT_CHAINS = {
    # shallow retry: a misspelt unit, then the same call spelt right (similar arguments)
    ("shallow", 0): [convert("Let me convert.", 3.5, "kms", "m"), convert("Fixed.", 3.5, "km", "m"),
                     answer("The answer is 3500.")],
    # deep retry: units of two kinds, then Python instead (dissimilar calls); a second step succeeds at once
    ("deep", 0): [convert("Try mass.", 2, "kg", "m"), call("New plan.", "print(2000 / 1000)"),
                  convert("Check.", 2, "km", "m"), answer("So 2000.")],
    # exhausted: attempts 0..3 all fail (similar misspellings), then a new step succeeds, then the answer
    ("exhausted", 0): [convert(f"Try {i}.", 1, f"mi{'l' * (i + 1)}", "km") for i in range(4)]
    + [convert("Again.", 1, "mi", "km"), answer("1.609.")],
    # a retry that answers instead of calling
    ("gives_up", 0): [convert("Convert.", 5, "ft", "lbs"), answer("I think 60.")],
}


def collect_parts(*args, **kwargs) -> list:
    """The parts a collection writes, in the order it writes them."""
    parts = []
    collect(*args, write=parts.append, **kwargs)
    return parts


def run_units(config, scripts=UNIT_CHAINS, **kwargs):
    """(rollouts, segments, {rollout_id: every context it was generated on}) of the unit chains."""
    prompt_ids = list(dict.fromkeys(prompt_id for prompt_id, _ in scripts))
    contexts: dict[str, list[list[int]]] = {}
    batches = collect_parts([task(p) for p in prompt_ids], config, ScriptedBackend(scripts, config), FakeSandbox(),
                            UNIT_CHAT, reward_fn=fake_reward, progress=False, toolbox=Toolbox(UNITS),
                            on_context=lambda rid, ctx: contexts.setdefault(rid, []).append(ctx), **kwargs)
    return [r for b in batches for r in b.rollouts], [s for b in batches for s in b.segments], contexts
