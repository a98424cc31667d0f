"""Typed records that flow from stage to stage.

One frozen dataclass per warehouse row kind (docs/architecture.md §3), and the closed sets of
values some of their columns take, as StrEnums (they compare equal to, and store as, their strings). Field names ARE the column names;
the Arrow schemas that store them live in `cleaner/warehouse/schema.py` and nowhere else, and the
conversion between records and Arrow tables lives in `cleaner/warehouse/` too.

Token sequences are tuples so records stay immutable and hashable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum


class SegmentKind(StrEnum):
    """What a segment of a raw trajectory is, in the order they appear."""

    PROMPT = "prompt"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ToolStatus(StrEnum):
    """How a tool call ended. Every status but OK counts as a failed call for SAAR."""

    OK = "ok"
    ERROR = "error"  # the code raised
    TIMEOUT = "timeout"  # wall clock or CPU time ran out
    FORMAT_ERROR = "format_error"  # the call did not parse; nothing ran
    INFRA_ERROR = "infra_error"  # the sandbox itself failed, after its transparent retries


class FinishReason(StrEnum):
    """Why a rollout ended."""

    ANSWER = "answer"  # a generation without a tool call
    MAX_TURNS = "max_turns"  # the step budget ran out
    MAX_TOKENS = "max_tokens"  # the response budget ran out
    ERROR = "error"  # the generation failed (a backend fault)


class CollectView(StrEnum):
    """Which rendering the agent loop used as context for later turns (docs/architecture.md §4)."""

    RAW = "raw"
    PURIFIED = "purified"


def enum_value(enum: type[StrEnum], value: object, name: str) -> StrEnum:
    """`value` as a member of `enum`, or ValueError naming the field and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in enum]}, got {value!r}") from None


@dataclass(frozen=True)
class Segment:
    """One contiguous token span of a raw trajectory, in generation order."""

    rollout_id: str
    iteration: int
    seq: int  # 0,1,2,... position in the raw trajectory
    kind: SegmentKind
    step: int | None  # tool-call step; a retry shares the step of the call it retries; None for prompt
    attempt: int | None  # 0 = first attempt at the step, 1..K = retries
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # behaviour logprobs of assistant tokens; None otherwise
    text: str
    call_start: int | None = None  # index into token_ids where the tool call begins
    tool_code: str | None = None  # assistant: the parsed code argument; tool: the code that was run
    tool_status: ToolStatus | None = None  # on tool segments
    error_type: str | None = None  # e.g. "NameError"
    exec_ms: float | None = None
    tool_name: str | None = None  # the tool a call names (assistant) or that answered (tool); None: no call, or none named

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", enum_value(SegmentKind, self.kind, "segment kind"))
        if self.tool_status is not None:
            object.__setattr__(self, "tool_status", enum_value(ToolStatus, self.tool_status, "tool_status"))
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"segment {self.rollout_id}#{self.seq}: {len(self.logprobs)} logprobs "
                f"for {len(self.token_ids)} tokens"
            )

    @property
    def has_call(self) -> bool:
        """True for an assistant segment that contains a tool call."""
        return self.kind == SegmentKind.ASSISTANT and self.call_start is not None

    @property
    def failed(self) -> bool:
        """True for a tool segment whose call did not succeed."""
        return self.kind == SegmentKind.TOOL and self.tool_status != ToolStatus.OK


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
    finish_reason: FinishReason
    rollback_draw: float  # u in [0,1); SAAR applies iff u < p
    collect_view: CollectView
    collect_config_id: str
    n_assistant_segments: int
    n_tool_calls: int
    n_failed_calls: int
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))
    reward_details: str | None = None  # a reward function's dict beyond `score`, as JSON; None: a number or the built-in grader

    def __post_init__(self) -> None:
        object.__setattr__(self, "finish_reason", enum_value(FinishReason, self.finish_reason, "finish_reason"))
        object.__setattr__(self, "collect_view", enum_value(CollectView, self.collect_view, "collect_view"))
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
    n_gated: int = 0  # merges the IS gate rejected (their chains render raw from there)
    negative_seq: int | None = None  # a negative sample: the raw seq of the failed attempt it pushes down
    token_advantages: tuple[float, ...] | None = None  # per token, when they differ from `advantage`
    dropped: bool = False  # down-sampling (RoC, uniform) left it out of its group: advantage 0, not trained
    void_turn: bool = False  # a void turn, masked by the void-turn filter: loss mask 0, in its group's statistics

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "behavior_logprobs", "old_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"purified row {self.rollout_id}: {name} is not aligned with token_ids")
        if self.token_advantages is not None and len(self.token_advantages) != n:
            raise ValueError(f"purified row {self.rollout_id}: token_advantages is not aligned with token_ids")

    @property
    def is_negative(self) -> bool:
        return self.negative_seq is not None


@dataclass(frozen=True)
class PurifyConfigRow:
    config_id: str
    gamma: float
    rollback_prob: float
    similarity_on: str
    purify_when: str
    params_json: str
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))
    edit: str = "replace"  # replace | mask (a part written before the column reads as replace)


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
    # The premise diagnostic of the iteration (cleaner.engine.saar.premise): per class, its rollouts,
    # their accuracy and mean advantage (None for an empty class).
    clean_rollouts: int = 0
    clean_accuracy: float | None = None
    clean_advantage: float | None = None
    recovered_rollouts: int = 0
    recovered_accuracy: float | None = None
    recovered_advantage: float | None = None
    unrecovered_rollouts: int = 0
    unrecovered_accuracy: float | None = None
    unrecovered_advantage: float | None = None
    n_gated: int = 0  # merges the IS gate rejected
    # The credit of failed calls (cleaner.engine.saar.premise.FailedCallCredit): assistant tokens of the
    # attempts whose call failed, their mean advantage, the share in positive-advantage rollouts.
    # None in rows written before these columns, and for the two means when there are no such tokens.
    failed_call_tokens: int | None = None
    failed_call_advantage: float | None = None
    failed_call_positive_share: float | None = None


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
    # Which training wrote the row: the purify config it trained on and the checkpoint it wrote
    # (absolute path); a rerun of the same pair replaces its rows. None in rows written before.
    config_id: str | None = None
    checkpoint: str | None = None
    seconds: float | None = None  # the step's wall time (its micro batches, clipping and AdamW); None before
    mfu: float | None = None  # model FLOPs utilisation (engine/train/flops.py); None on a CPU or an unknown GPU
    rollout_corr: str | None = None  # the iteration's rollout-correction metrics, JSON (verl's rollout_corr/* names)
    # verl's actor/* terms and metrics (engine/train/loss.py); None in rows written before them
    pg_loss: float | None = None  # the policy loss alone: `loss` less the KL and entropy terms
    kl_loss: float | None = None  # the aggregated k3 KL to the reference; None also without a KL term
    ppo_kl: float | None = None  # the token mean of log pi_old - log pi (verl's ppo_kl)
    clip_fraction_lower: float | None = None  # share of loss tokens the dual clip capped (verl's pg_clipfrac_lower)
    train_config_id: str | None = None  # the train config that trained it: configs/train-config=<id>.json



@dataclass(frozen=True)
class EvalRunRow:
    """One evaluation: a model on a dataset under one SAAR setting, and its metrics."""

    eval_id: str  # the config id of its rollouts (`eval_rollouts.collect_config_id`)
    model: str
    policy_version: str
    dataset: str  # the name given on the command line
    data_path: str
    data_source: str  # of its problems (comma-separated if several)
    prompt_style: str
    saar: bool  # the context was rendered with SAAR after each recovery
    n: int  # samples per problem
    problems: int
    rollouts: int
    avg_at_n: float
    pass_at_k: tuple[tuple[int, float], ...]  # (k, pass@k), k = 1, 2, 4, ... and n
    maj_at_n: float
    tool_calls_per_trajectory: float
    failures_per_trajectory: float
    first_call_error_rate: float  # NaN without calls
    recovery_rate: float  # NaN without failed steps
    seconds: float  # wall time of generation and grading in the session that completed it
    rollouts_generated: int  # rollouts that session generated (fewer than `rollouts` after a resume)
    seed: int
    temperature: float
    top_p: float
    max_turns: int
    config_json: str  # the resolved collect config of its rollouts
    created_at: datetime = field(default_factory=lambda: datetime.now().replace(microsecond=0))
