"""Settings groups: each setting declared once, with its check beside it (docs/architecture.md §9).

A group is a frozen dataclass base whose fields are `setting`s and whose `_check_group` checks
them; a config holds the groups it uses by inheriting them, so its fields stay flat: the flags
(`--gamma`), TOML keys, stored JSON and ids are the fields' names, and `CollectConfig(gamma=0.7)`
builds as before.

Design decisions:
- Inheritance, not nesting: a nested group would rename every flag and key (`--saar-gamma`) and
  change every stored id.
- Group fields are keyword-only (positional construction would depend on the order bases are listed).
- `check_groups` runs each group class's own `_check_group` once, base groups first, whatever
  the diamond of bases (SaarSettings reaches SaarMerge twice): a field is checked once, where
  declared, with one message for every holder.
- The SAAR group comes in parts, because the holders use different parts: collect the merge, the
  draw and the IS gate (SaarRollback); purify all of it (SaarSettings); eval the merge; a view
  (`RenderSettings`, engine/saar/walk.py, and `cleaner show`) the merge, the gate and the edit,
  but not p or purify_when, which decide whether a rollout is purified, not how (SaarView).
- RolloutSettings is what collect and eval both run with; eval re-declares a few defaults
  (`redeclared`), keeping each field's help and identity.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from cleaner.plugins import PluginError, split_spec
from cleaner.records import enum_value
from cleaner.sandbox.config import SandboxConfig

REWARD_NAME = "compute_score"  # verl's custom_reward_function.name default: a file alone means it

# The longest limit a `*_s` option takes: a day. A limit past it is no limit (a run would wait days on
# a hung call), and clocks and timestamps overflow far beyond it (`inf`, 1e10).
MAX_SECONDS = 86_400.0

# ---------------------------------------------------------------------------------------------
# Declaring and checking a field


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name} must be one of {choices}, got {value!r}")


def _set(config, **values) -> None:
    for name, value in values.items():
        object.__setattr__(config, name, value)  # a frozen dataclass's own __post_init__


def _enum_field(config: object, name: str, enum: type[StrEnum]) -> None:
    """Store field `name` of a frozen config as a member of `enum` (ValueError naming the choices)."""
    object.__setattr__(config, name, enum_value(enum, getattr(config, name), name))


def _check_numbers(config: object) -> None:
    """Every number of a config, before its own checks: a float field finite (`inf` and `nan` pass
    most comparisons, or none, and would be trained or waited on), a `*_s` field a duration in
    (0, MAX_SECONDS]. Nested configs check their own."""
    for item in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, item.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        _check(math.isfinite(value), f"{item.name} must be a finite number, got {value}")
        _check(not item.name.endswith("_s") or 0 < value <= MAX_SECONDS,
               f"{item.name} must be in (0, {MAX_SECONDS:,.0f}] seconds, got {value}")


def setting(default=dataclasses.MISSING, *, help: str, identity: str = "always", default_factory=dataclasses.MISSING):
    """A config field with its flag's help and how it counts toward its config's id: `always`;
    `away-from-default`, a field stored configs predate (at its default, theirs keep their ids);
    `never`, how something runs, not what it computes (a schedule, a server's address)."""
    _check_choice("identity", identity, ("always", "away-from-default", "never"))
    return field(default=default, default_factory=default_factory, metadata={"help": help, "identity": identity})


def redeclared(group: type, name: str, default: object):
    """Field `name` of `group` with another default, its help and identity as declared there."""
    return field(default=default, metadata=group.__dataclass_fields__[name].metadata)


def group_values(holder: object, group: type) -> dict:
    """{field: value} of `holder` for each field of `group` it has."""
    return {item.name: getattr(holder, item.name) for item in dataclasses.fields(group) if hasattr(holder, item.name)}


class Group:
    """Base of every settings group: `check_groups` runs each group's own checks once (a group alone
    runs them on construction; a config runs them from its own `__post_init__`)."""

    def __post_init__(self) -> None:
        self.check_groups()

    def check_groups(self) -> None:
        for cls in reversed(type(self).__mro__):
            own = vars(cls).get("_check_group")
            if own is not None:
                own(self)


# ---------------------------------------------------------------------------------------------
# The SAAR group (docs/architecture.md §4)


class SimilarityOn(StrEnum):
    """What SAAR compares to choose a shallow or a deep merge (docs/architecture.md §4)."""

    CODE = "code"  # the two calls' code arguments (ours; the default)
    CALL = "call"  # the decoded call tokens, as the reference does


class PurifyWhen(StrEnum):
    """Which rollouts SAAR may purify."""

    ALWAYS = "always"  # every rollout whose draw is below p (the paper)
    POSITIVE = "positive"  # only rollouts whose reward is above their group's mean (ours)


class Edit(StrEnum):
    """What a purify config does to the attempts SAAR takes out (docs/architecture.md §4)."""

    REPLACE = "replace"  # CLEANER: the row is SAAR's rendering, the failed attempts spliced out
    MASK = "mask"  # the row is the raw rendering; what replace drops is not trained (loss mask 0)


class IsMode(StrEnum):
    """How the IS gate aggregates a merge's per-token log-ratios (docs/architecture.md §4)."""

    SUM = "sum"  # IS = exp(sum): the gate as docs/architecture.md §4 defines it, and the reference's first code
    MEAN = "mean"  # IS = exp(mean): the per-token geometric mean of the reference's later code


@dataclass(frozen=True, kw_only=True)
class SaarMerge(Group):
    """How SAAR merges a failed attempt with its retry."""

    gamma: float = setting(0.5, help="SAAR: shallow merge iff similarity >= gamma (gamma > 1: always deep)")
    similarity_on: SimilarityOn = setting(SimilarityOn.CODE, help="what SAAR compares")

    def _check_group(self) -> None:
        _check(self.gamma >= 0, f"gamma must be >= 0, got {self.gamma}")
        _enum_field(self, "similarity_on", SimilarityOn)


@dataclass(frozen=True, kw_only=True)
class SaarGate(Group):
    """The IS gate over each merge (docs/architecture.md §4)."""

    rollback_is_threshold: float = setting(0.0, help="tau: a merge whose IS < tau keeps its chain raw; 0 = off")
    rollback_is_mode: IsMode = setting(IsMode.SUM, help="the IS gate over the retry's tokens: sum (its definition) or "
        "mean (the reference's later code)")

    def _check_group(self) -> None:
        _check(self.rollback_is_threshold >= 0,
               f"rollback_is_threshold must be >= 0, got {self.rollback_is_threshold}")
        _enum_field(self, "rollback_is_mode", IsMode)


@dataclass(frozen=True, kw_only=True)
class SaarEdit(Group):
    """What becomes of the attempts a merge takes out (docs/architecture.md §4)."""

    edit: Edit = setting(Edit.REPLACE, help="replace (SAAR's sequence) | mask (the raw one, what replace drops "
        "untrained)")

    def _check_group(self) -> None:
        _enum_field(self, "edit", Edit)


@dataclass(frozen=True, kw_only=True)
class SaarView(SaarEdit, SaarGate, SaarMerge):
    """How a purified rollout renders: what `RenderSettings` and `cleaner show` hold."""


@dataclass(frozen=True, kw_only=True)
class SaarRollback(SaarGate, SaarMerge):
    """SAAR during collection: the merge, the gate, and p."""

    rollback_prob: float = setting(1.0, help="p: SAAR applies to a rollout iff its stored draw u < p")

    def _check_group(self) -> None:
        _check(0 <= self.rollback_prob <= 1, f"rollback_prob must be in [0, 1], got {self.rollback_prob}")


@dataclass(frozen=True, kw_only=True)
class SaarSettings(SaarEdit, SaarRollback):
    """Every SAAR setting: what a purify config holds."""

    purify_when: PurifyWhen = setting(PurifyWhen.ALWAYS, help="which rollouts SAAR may purify: all (the paper) or "
        "positive ones")

    def _check_group(self) -> None:
        _enum_field(self, "purify_when", PurifyWhen)


# ---------------------------------------------------------------------------------------------
# What collect and eval run with


def local_path(value: str) -> bool:
    """Whether a model, dataset or file argument names a local path (a hub id such as
    Qwen/Qwen3-4B does not): one that exists, or is spelt as a path."""
    return Path(value).expanduser().exists() or value.startswith((os.sep, "./", "../", "~"))


def resolved_path(value: str | None, always: bool = True) -> str | None:
    """A path made absolute (from the working directory, `~` expanded): a config stored in a
    warehouse names the same files wherever it is read from. Without `always`, only a local one
    (a model argument may be a hub id)."""
    if value is None or not (always or local_path(value)):
        return value
    return os.path.abspath(os.path.expanduser(value))


def resolved_spec(spec: str | None, default_name: str | None = None) -> str | None:
    """A `PATH.py[:NAME]` spec with its file made absolute and its name written out (so equivalent
    spellings are one spec); a module's spec, or one that does not parse, as it is."""
    if spec is None:
        return None
    try:
        where, name = split_spec(spec, default_name)
    except PluginError:
        return spec  # its loader says what is wrong with it
    if not (where.endswith(".py") or "/" in where):
        return spec
    return f"{os.path.abspath(os.path.expanduser(where))}:{name}"


def resolved_specs(specs: str | None) -> str | None:
    """Comma-separated `PATH.py:NAME` specs (`--tool`), each resolved."""
    if specs is None:
        return None
    return ",".join(resolved_spec(part.strip()) for part in specs.split(",") if part.strip())


class Schedule(StrEnum):
    """How collect runs its rollouts (docs/architecture.md §5)."""

    ASYNC = "async"  # each rollout on its own clock, up to max_concurrent_rollouts in flight (the default)
    LOCKSTEP = "lockstep"  # a batch's rollouts turn by turn together: debugging and the benchmarks' baseline


class PromptStyle(StrEnum):
    """How a dataset's problem becomes the user message (docs/architecture.md §12)."""

    REFERENCE = "reference"  # the reference's per-source preambles and answer formats
    BARE = "bare"  # the problem text alone, as the tiny policies were trained


@dataclass(frozen=True, kw_only=True)
class RolloutSettings(Group):
    """How rollouts are prompted, sampled, graded and run: collect's and eval's alike."""

    prompt_style: PromptStyle = setting(PromptStyle.REFERENCE, help="prompts of --data: the paper's or the problem "
        "alone")
    reward_fn: str | None = setting(None, identity="away-from-default", help="the reward: PATH.py:NAME, a verl "
        "compute_score(data_source, solution_str, ground_truth, extra_info); none: the built-in grader")
    tools: str | None = setting(None, identity="away-from-default", help="tools beside Python: a verl tool config, "
        "PATH.yaml (class_name, config, tool_schema)")
    tool: str | None = setting(None, identity="away-from-default", help="tools beside Python: PATH.py:NAME, a "
        "cleaner.tools.Tool or a documented function (comma-separated for several)")
    multi_turn: bool = setting(True, identity="away-from-default", help="tool calls run, turn after turn; off: verl's "
        "multi_turn.enable=False, the reference's no-tool baseline (no tool in the template, its no-tool prompts, one "
        "generation)")
    max_tool_response_chars: int | None = setting(None, identity="away-from-default", help="a longer tool response "
        "keeps its first and last halves around \"...(truncated)...\" (verl's max_tool_response_length, 256 in its "
        "recipes); none: whole")
    max_turns: int = setting(8, help="steps per rollout (tool calls and the answer; retries do not count)")
    max_retries: int = setting(3, help="K: retries per failed tool-call step")
    max_new_tokens: int = setting(160, help="tokens per generation")
    max_response_tokens: int = setting(768, help="token budget for everything after the prompt")
    temperature: float = setting(1.0, help="sampling temperature; greedy never shows errors")
    top_p: float = setting(1.0, help="nucleus sampling")
    seed: int = setting(0, help="base seed; per-rollout seeds derive from (iteration, prompt_id, sample_index)")
    batch_rollouts: int = setting(64, identity="never", help="finished rollouts committed per part (the unit of "
        "resume; lock step: per batch)")
    max_concurrent_rollouts: int = setting(1024, identity="never", help="rollouts in flight, each on its own clock: "
        "enough to keep an SGLang engine's running batch (a few hundred on a GPU) full while others wait on tools")
    schedule: Schedule = setting(Schedule.ASYNC, identity="never", help="async (each rollout on its own clock) | "
        "lockstep (a batch turn by turn together: debugging, benchmarks)")
    backend: str = setting("torch", help="torch (this process) | sglang (an engine here, or the server at "
        "--sglang-url)")
    sglang_url: str | None = setting(None, identity="never", help="a running SGLang server or router (with --backend "
        "sglang); none: in-process")
    sglang_request_timeout_s: float | None = setting(None, identity="never", help="a request to an SGLang server "
        "unanswered past this is tried on another, the server benched; none: 60 s + 0.05 s per token asked for + 0.005 "
        "s per prompt token")
    deterministic_inference: bool = setting(True, identity="away-from-default", help="an SGLang engine on a GPU: "
        "batch-invariant kernels, so seeds hold whatever the schedule (slower; docs/running.md)")
    sglang_mem_fraction: float | None = setting(None, identity="never", help="an SGLang engine on a GPU: its share of "
        "GPU memory for weights and KV cache; none: SGLang's default")
    device: str = setting("cpu", help="torch device: cpu, cuda, cuda:1, ... (an SGLang engine's first GPU)")
    sandbox: SandboxConfig = setting(default_factory=SandboxConfig, help="the python tool's sandbox")
    test_timeout_s: float = setting(4.0, help="per-test limit when grading programs (code data sources)")
    reward_timeout_s: float = setting(60.0, identity="never", help="a reward (the built-in grader's or --reward-fn's) "
        "past this stops the collection or evaluation, resumable")

    def _check_group(self) -> None:
        _set(self, reward_fn=resolved_spec(self.reward_fn, REWARD_NAME), tools=resolved_path(self.tools),
             tool=resolved_specs(self.tool))
        _enum_field(self, "prompt_style", PromptStyle)
        _check(self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}")
        _check(self.max_retries >= 0, f"max_retries must be >= 0, got {self.max_retries}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.max_response_tokens >= self.max_new_tokens, "max_response_tokens must be >= max_new_tokens")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.multi_turn or (self.tools is None and self.tool is None),
               "multi_turn off runs without any tool: drop tools and tool")
        _check(self.max_tool_response_chars is None or self.max_tool_response_chars >= 2,
               f"max_tool_response_chars must be >= 2, got {self.max_tool_response_chars}")
        self._check_engine()

    def _check_engine(self) -> None:
        """The schedule, the backend and its server."""
        _check(self.batch_rollouts >= 1, f"batch_rollouts must be >= 1, got {self.batch_rollouts}")
        _check(self.max_concurrent_rollouts >= 1,
               f"max_concurrent_rollouts must be >= 1, got {self.max_concurrent_rollouts}")
        _enum_field(self, "schedule", Schedule)
        _check(self.sglang_mem_fraction is None or 0 < self.sglang_mem_fraction < 1,
               f"sglang_mem_fraction must be in (0, 1), got {self.sglang_mem_fraction}")
        _check_choice("backend", self.backend, ("torch", "sglang"))
        _check(self.sglang_mem_fraction is None or self.backend == "sglang",
               f"sglang_mem_fraction is for backend sglang, got backend {self.backend!r}")
        _check(self.sglang_url is None or self.backend == "sglang",
               f"sglang_url is for backend sglang, got backend {self.backend!r}")
        _check(self.sglang_url is None or self.sglang_url.startswith(("http://", "https://")),
               f"sglang_url must start with http:// or https://, got {self.sglang_url!r}")
        _check(self.sglang_request_timeout_s is None or self.sglang_url is not None,
               "sglang_request_timeout_s is for the servers at sglang_url")
