"""Typed records that flow from stage to stage.

One frozen dataclass per warehouse row kind (DESIGN.md section 3). Field names ARE the column names;
the Arrow schemas that store them live in `cleaner/warehouse/schema.py` and nowhere else, and the
conversion between records and Arrow tables lives in `cleaner/warehouse/` too.

Token sequences are tuples so records stay immutable and hashable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

# Segment kinds, in the order they appear in a trajectory.
PROMPT, ASSISTANT, TOOL = "prompt", "assistant", "tool"
SEGMENT_KINDS = (PROMPT, ASSISTANT, TOOL)

# Tool outcomes. Every status but OK counts as a failed call for SAAR.
OK, ERROR, TIMEOUT, FORMAT_ERROR, INFRA_ERROR = "ok", "error", "timeout", "format_error", "infra_error"
TOOL_STATUSES = (OK, ERROR, TIMEOUT, FORMAT_ERROR, INFRA_ERROR)

# Why a rollout ended.
FINISH_REASONS = ("answer", "max_turns", "max_tokens", "error")

# Which rendering the agent loop used as context for later turns (DESIGN.md 4.4).
COLLECT_VIEWS = ("raw", "purified")


@dataclass(frozen=True)
class Segment:
    """One contiguous token span of a raw trajectory, in generation order."""

    rollout_id: str
    iteration: int
    seq: int  # 0,1,2,... position in the raw trajectory
    kind: str  # prompt | assistant | tool
    step: int | None  # tool-call step; a retry shares the step of the call it retries; None for prompt
    attempt: int | None  # 0 = first attempt at the step, 1..K = retries
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # behaviour logprobs of assistant tokens; None otherwise
    text: str
    call_start: int | None = None  # index into token_ids where the tool call begins
    tool_code: str | None = None  # assistant: the parsed code argument; tool: the code that was run
    tool_status: str | None = None  # on tool segments: one of TOOL_STATUSES
    error_type: str | None = None  # e.g. "NameError"
    exec_ms: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind {self.kind!r} is not one of {SEGMENT_KINDS}")
        if self.tool_status is not None and self.tool_status not in TOOL_STATUSES:
            raise ValueError(f"tool_status {self.tool_status!r} is not one of {TOOL_STATUSES}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"segment {self.rollout_id}#{self.seq}: {len(self.logprobs)} logprobs "
                f"for {len(self.token_ids)} tokens"
            )

    @property
    def has_call(self) -> bool:
        """True for an assistant segment that contains a tool call."""
        return self.kind == ASSISTANT and self.call_start is not None

    @property
    def failed(self) -> bool:
        """True for a tool segment whose call did not succeed."""
        return self.kind == TOOL and self.tool_status != OK


@dataclass(frozen=True)
class Rollout:
    """One trajectory's summary row."""

    rollout_id: str
    iteration: int
    group_id: str  # GRPO group: same prompt, same iteration
    prompt_id: str
    sample_index: int
    policy_version: str
    data_source: str
    ground_truth: str
    answer: str | None  # extracted final answer, None if none
    reward: float
    correct: bool
    finish_reason: str  # one of FINISH_REASONS
    rollback_draw: float  # u in [0,1); SAAR applies iff u < p
    collect_view: str  # raw | purified
    collect_config_id: str
    n_assistant_segments: int
    n_tool_calls: int
    n_failed_calls: int
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if self.collect_view not in COLLECT_VIEWS:
            raise ValueError(f"collect_view {self.collect_view!r} is not one of {COLLECT_VIEWS}")
        if not 0.0 <= self.rollback_draw < 1.0:
            raise ValueError(f"rollback_draw {self.rollback_draw} is outside [0, 1)")


@dataclass(frozen=True)
class PurifiedRow:
    """One rendered trajectory under one purify config: a training row."""

    config_id: str
    iteration: int
    rollout_id: str
    group_id: str
    token_ids: tuple[int, ...]  # prompt + response
    prompt_len: int
    loss_mask: tuple[int, ...]  # 1 = policy token that is trained
    behavior_logprobs: tuple[float, ...]  # aligned with token_ids; 0 where loss_mask = 0
    old_logprobs: tuple[float, ...]  # recomputed under THIS rendering; 0 where loss_mask = 0
    reward: float
    advantage: float
    rolled_back: bool
    n_shallow: int
    n_deep: int
    n_unrecovered: int
    tokens_removed: int
    scorer_version: str
    infra_fault: bool = False  # an infrastructure fault ended or broke the rollout: advantage 0, not trained

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "behavior_logprobs", "old_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"purified row {self.rollout_id}: {name} is not aligned with token_ids")


@dataclass(frozen=True)
class PurifyConfigRow:
    config_id: str
    gamma: float
    rollback_prob: float
    similarity_on: str
    purify_when: str
    params_json: str
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))


@dataclass(frozen=True)
class IterationRow:
    iteration: int
    policy_in: str
    policy_out: str | None
    collect_config_json: str
    purify_config_json: str
    train_config_json: str
    collect_s: float
    purify_s: float
    train_s: float
    accuracy: float
    first_attempt_error_rate: float
    failures_per_trajectory: float
    n_shallow: int
    n_deep: int
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))


@dataclass(frozen=True)
class TrainStepRow:
    iteration: int
    step: int  # optimiser step within the iteration, from 0
    optimizer_step: int  # run-wide optimiser step, from 0; continues across iterations
    loss: float
    clip_fraction: float
    approx_kl: float
    entropy: float
    grad_norm: float
    lr: float
    tokens: int
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))
