"""Frozen configuration dataclasses shared by the CLI and the library (docs/architecture.md §9).

Every field is a `setting`: its default, its flag's help, and whether it counts toward the config's
id; invariants are checked in `__post_init__` so a bad value fails at construction time with a
message naming the field. `to_json()` gives the resolved config saved next to every output. The
sandbox's config lives with the sandbox (cleaner/sandbox/config.py); CollectConfig nests it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cleaner.config.groups import (
    Edit,
    Group,
    SaarMerge,
    SaarRollback,
    SaarSettings,
    _check,
    _check_fields,
    _set,
    group_values,
    redeclared,
    setting,
)
from cleaner.plugins import resolved_path, resolved_spec, resolved_specs
from cleaner.records import CollectView
from cleaner.sandbox.config import SandboxConfig

# The committed tiny default policy (docs/architecture.md §11): package data (cleaner/assets/), so
# an installed wheel has it too.
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_POLICY = ASSETS_DIR / "tiny-policy"
# The second tiny policy, on which CLEANER's premise holds (docs/architecture.md §11).
ENV_POLICY = ASSETS_DIR / "tiny-policy-env"
# The third, on which outcome-only GRPO gives failed calls positive credit (docs/architecture.md §11).
RECOVER_POLICY = ASSETS_DIR / "tiny-policy-recover"


LORA_ALL_LINEAR = "all-linear"  # peft's and verl's name for every linear layer but the output head

# The most rollouts one iteration plans (the paper's iterations hold 2,048): what a collection keeps
# per planned rollout (its id, to resume) must fit in memory.
MAX_ROLLOUTS_PER_ITERATION = 1_000_000

REWARD_NAME = "compute_score"  # verl's custom_reward_function.name default: a file alone means it


def _digest(fields: dict) -> str:
    """12 hex digits of the sha256 of the fields as sorted JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


class _Config:
    """Mixin: JSON round trip and a stable id over the fields that count (`setting`'s identity)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    def identity(self) -> dict:
        """The fields that count toward the id, as `to_dict` gives them."""
        values = self.to_dict()
        return {item.name: values[item.name] for item in dataclasses.fields(self)  # type: ignore[arg-type]
                if (rule := item.metadata.get("identity", "always")) == "always"
                or (rule == "away-from-default" and values[item.name] != item.default)}

    @functools.cached_property  # works on frozen dataclasses: it writes __dict__ directly
    def config_id(self) -> str:
        """12 hex digits of the sha256 of the identity as sorted JSON."""
        return _digest(self.identity())

    @classmethod
    def from_json(cls, saved_json: str):
        """A saved config as this version reads it (a field it predates at its default, one unknown left out)."""
        return _known(cls, json.loads(saved_json))


def _known(cls: type, saved: dict):
    """`cls` of the fields of `saved` it has (a nested config's likewise)."""
    hints = typing.get_type_hints(cls)
    return cls(**{item.name: _known(hints[item.name], saved[item.name]) if dataclasses.is_dataclass(hints[item.name])
                  else saved[item.name] for item in dataclasses.fields(cls) if item.name in saved})


class DownSample(StrEnum):
    """Which rollouts of a group a purify config trains (docs/architecture.md §7)."""

    NONE = "none"  # every rollout
    ROC = "roc"  # GRPO-RoC (rStar2-Agent): the positives with the fewest tool errors, the negatives in proportion
    UNIFORM = "uniform"  # down_sample_to of the group, uniformly: RoC's control


class Schedule(StrEnum):
    """How collect runs its rollouts (docs/architecture.md §5)."""

    ASYNC = "async"  # each rollout on its own clock, up to max_concurrent_rollouts in flight (the default)
    LOCKSTEP = "lockstep"  # a batch's rollouts turn by turn together: debugging and the benchmarks' baseline


class PromptStyle(StrEnum):
    """How a dataset's problem becomes the user message (docs/architecture.md §12)."""

    REFERENCE = "reference"  # the reference's per-source preambles and answer formats
    BARE = "bare"  # the problem text alone, as the tiny policies were trained


class DpoCap(StrEnum):
    """How the negative-sample push is capped per token (docs/architecture.md §7)."""

    RELATIVE = "relative"  # dpo_max_adjustment_ratio * |advantage of the purified row|
    ABSOLUTE = "absolute"  # dpo_max_adjustment_ratio itself, as the reference's code


class AdvEstimator(StrEnum):
    """How purify turns a group's rewards into advantages, named as verl's `algorithm.adv_estimator`
    (docs/architecture.md §7)."""

    GRPO = "grpo"  # (r - the group's mean) / (its std + eps); without the std: Dr.GRPO
    RLOO = "rloo"  # r - the mean of the group's other rewards
    # r - the group's mean, whitened over the iteration's loss tokens
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"


class LossMode(StrEnum):
    """The policy loss, named as verl's `actor.policy_loss.loss_mode` (docs/architecture.md §7)."""

    VANILLA = "vanilla"  # PPO's clipped surrogate per token, clip-higher and the dual clip
    GSPO = "gspo"  # GSPO: the sequence's geometric-mean ratio on every token, aggregated seq-mean-token-mean
    CISPO = "cispo"  # CISPO: the clipped ratio, gradient stopped, times the advantage and the log-probability
    GEO_MEAN = "geo_mean"  # GMPO: the geometric mean of the clipped token ratios per row, a mean over rows


# verl's `actor.loss_agg_mode`: how a term's per-token values become the mini batch's scalar
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GSPO_AGG_MODE = "seq-mean-token-mean"  # what verl's gspo forces on its policy loss


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
    max_tool_response_chars: int | None = setting(None, identity="away-from-default", check=">= 2", help="a longer "
        "tool response keeps its first and last halves around \"...(truncated)...\" (verl's max_tool_response_length, "
        "256 in its recipes); none: whole")
    max_turns: int = setting(8, check=">= 1", help="steps per rollout (tool calls and the answer; retries do not "
        "count)")
    max_retries: int = setting(3, check=">= 0", help="K: retries per failed tool-call step")
    max_new_tokens: int = setting(160, check=">= 1", help="tokens per generation")
    max_response_tokens: int = setting(768, help="token budget for everything after the prompt")
    temperature: float = setting(1.0, check=">= 0", help="sampling temperature; greedy never shows errors")
    top_p: float = setting(1.0, check="in (0, 1]", help="nucleus sampling")
    seed: int = setting(0, help="base seed; per-rollout seeds derive from (iteration, prompt_id, sample_index)")
    batch_rollouts: int = setting(64, identity="never", check=">= 1", help="finished rollouts committed per part (the "
        "unit of resume; lock step: per batch)")
    max_concurrent_rollouts: int = setting(1024, identity="never", check=">= 1", help="rollouts in flight, each on its "
        "own clock: enough to keep an SGLang engine's running batch (a few hundred on a GPU) full while others wait on "
        "tools")
    schedule: Schedule = setting(Schedule.ASYNC, identity="never", help="async (each rollout on its own clock) | "
        "lockstep (a batch turn by turn together: debugging, benchmarks)")
    backend: str = setting("torch", choices=("torch", "sglang"), help="torch (this process) | sglang (an engine here, "
        "or the server at --sglang-url)")
    sglang_url: str | None = setting(None, identity="never", help="a running SGLang server or router (with --backend "
        "sglang); none: in-process")
    sglang_request_timeout_s: float | None = setting(None, identity="never", help="a request to an SGLang server "
        "unanswered past this is tried on another, the server benched; none: 60 s + 0.05 s per token asked for + 0.005 "
        "s per prompt token")
    deterministic_inference: bool = setting(True, identity="away-from-default", help="an SGLang engine on a GPU: "
        "batch-invariant kernels, so seeds hold whatever the schedule (slower; docs/running.md)")
    sglang_mem_fraction: float | None = setting(None, identity="never", check="in (0, 1)", help="an SGLang engine on a "
        "GPU: its share of GPU memory for weights and KV cache; none: SGLang's default")
    device: str = setting("cpu", help="torch device: cpu, cuda, cuda:1, ... (an SGLang engine's first GPU)")
    sandbox: SandboxConfig = setting(default_factory=SandboxConfig, help="the python tool's sandbox")
    test_timeout_s: float = setting(4.0, help="per-test limit when grading programs (code data sources)")
    reward_timeout_s: float = setting(60.0, identity="never", help="a reward (the built-in grader's or --reward-fn's) "
        "past this stops the collection or evaluation, resumable")

    def _check_group(self) -> None:
        _set(self, reward_fn=resolved_spec(self.reward_fn, REWARD_NAME), tools=resolved_path(self.tools),
             tool=resolved_specs(self.tool))
        _check(self.max_response_tokens >= self.max_new_tokens, "max_response_tokens must be >= max_new_tokens")
        _check(self.multi_turn or (self.tools is None and self.tool is None),
               "multi_turn off runs without any tool: drop tools and tool")
        self._check_engine()

    def _check_engine(self) -> None:
        """The schedule, the backend and its server."""
        _check(self.sglang_mem_fraction is None or self.backend == "sglang",
               f"sglang_mem_fraction is for backend sglang, got backend {self.backend!r}")
        _check(self.sglang_url is None or self.backend == "sglang",
               f"sglang_url is for backend sglang, got backend {self.backend!r}")
        _check(self.sglang_url is None or self.sglang_url.startswith(("http://", "https://")),
               f"sglang_url must start with http:// or https://, got {self.sglang_url!r}")
        _check(self.sglang_request_timeout_s is None or self.sglang_url is not None,
               "sglang_request_timeout_s is for the servers at sglang_url")


@dataclass(frozen=True)
class CollectConfig(_Config, SaarRollback, RolloutSettings):
    """`cleaner collect`: the rollouts of one iteration; its SAAR builds each rollout's context."""

    model: str = setting(str(DEFAULT_POLICY), help="the policy: a Hugging Face model directory or hub id, or a "
        "checkpoint")
    data: str | None = setting(None, help="a dataset Parquet (verl RL or an eval layout); none: the toy tasks")
    iteration: int = setting(0, check=">= 0", help="the iteration to collect (its number in the warehouse)")
    n_prompts: int = setting(64, check=">= 1", help="prompts per iteration")
    skip_settled_prompts: int = setting(0, identity="away-from-default", help="a prompt of --data whose last group was "
        "all correct or all wrong is not collected for this many iterations after it (-1: for the rest of the run), "
        "the dataset's next prompts taken instead; 0 = off")
    group_size: int = setting(8, check=">= 1", help="samples per prompt (one GRPO group)")
    truncate_prompts: bool = setting(False, help="a prompt longer than the context minus the budget keeps its end; "
        "off: an error")
    collect_view: CollectView = setting(CollectView.PURIFIED, help="context of later turns: SAAR's (the paper) or raw")
    rollout_dtype: str | None = setting(None, identity="away-from-default", help="the policy's dtype while it "
        "generates (torch backend, SGLang engine): float32 | bfloat16 | float16 (the reference's); none: float32, or a "
        "GPU engine's checkpoint dtype")

    def differences(self, saved_json: str) -> list[tuple[str, object, object]]:
        """(field, saved value, this config's value) for every field of the identity that differs
        from a saved config's, a nested one named `sandbox_<field>` as its flag is."""
        saved, mine = ({f"{key}_{inner}" if inner else key: item for key, value in identity.items()
                        for inner, item in (value.items() if isinstance(value, dict) else [(None, value)])}
                       for identity in (json.loads(json.dumps(config.identity(), default=str))
                                        for config in (self.from_json(saved_json), self)))
        return [(name, saved.get(name), mine.get(name)) for name in sorted(saved.keys() | mine.keys())
                if saved.get(name) != mine.get(name)]

    def __post_init__(self) -> None:
        _check_fields(self)
        _set(self, model=resolved_path(self.model, always=False), data=resolved_path(self.data))
        self.check_groups()
        _check(self.skip_settled_prompts >= -1,
               f"skip_settled_prompts must be >= 0, or -1 for the rest of the run, got {self.skip_settled_prompts}")
        _check(self.skip_settled_prompts == 0 or self.data is not None,
               "skip_settled_prompts needs --data: the toy tasks are new prompts every iteration")
        _check(self.n_prompts * self.group_size <= MAX_ROLLOUTS_PER_ITERATION,
               f"n_prompts x group_size must be at most {MAX_ROLLOUTS_PER_ITERATION:,} rollouts, "
               f"got {self.n_prompts:,} x {self.group_size:,}")
        _check(self.rollout_dtype in (None, "float32", "bfloat16", "float16"),
               f"rollout_dtype must be float32, bfloat16, float16 or none, got {self.rollout_dtype!r}")


@dataclass(frozen=True)
class PurifyConfig(_Config, SaarSettings):
    """`cleaner purify`: the rows trained on, rendered under every SAAR setting."""

    negative_samples: bool = setting(False, help="pair each fixed failure with its fix, push them apart (the "
        "reference's DPO)")
    dpo_beta: float = setting(0.1, check="> 0", help="beta of the negative-sample term")
    dpo_max_adjustment_ratio: float = setting(0.1, check=">= 0", help="cap of the negative-sample push per token (see "
        "--dpo-cap)")
    dpo_cap: DpoCap = setting(DpoCap.RELATIVE, help="the cap: relative (x |advantage|) or absolute (the reference's "
        "code)")
    advantage_eps: float = setting(1e-6, check="> 0", help="GRPO: (r - mean) / (std + eps)")
    down_sample: DownSample = setting(DownSample.NONE, identity="away-from-default", help="the rollouts of a group "
        "trained: all | roc (GRPO-RoC) | uniform (RoC's control); the advantages are the kept rows'")
    down_sample_to: int | None = setting(None, identity="away-from-default", check=">= 1", help="rows kept per group "
        "with --down-sample (rStar's down_sample_to_n): fewer than the iteration's group size")
    roc_min_negatives: int = setting(2, identity="away-from-default", help="RoC keeps at least this many negatives "
        "(reward <= 0) where the group has them (rStar's min_zero_reward_trace_num)")
    roc_min_positives: int = setting(2, identity="away-from-default", help="RoC keeps at least this many positives "
        "where the group has them (rStar's min_non_zero_reward_trace_num)")
    roc_error_ratio: bool = setting(True, identity="away-from-default", help="RoC ranks positives by their failed tool "
        "calls over their tool calls (rStar's roc_error_ratio)")
    roc_answer_format: bool = setting(True, identity="away-from-default", help="RoC ranks positives by missing or "
        "repeated final answers too (rStar's roc_answer_format, for \\boxed{})")
    void_turn_filter: bool = setting(False, identity="away-from-default", help="SimpleTIR: a trajectory with a void "
        "turn (neither a complete call nor a final answer) is not trained; its row stays, masked")
    adv_estimator: AdvEstimator = setting(AdvEstimator.GRPO, identity="away-from-default", help="the advantage (verl's "
        "algorithm.adv_estimator): grpo | rloo | reinforce_plus_plus_baseline (whitened over the whole iteration: not "
        "with --shard)")
    norm_adv_by_std: bool = setting(True, identity="away-from-default", help="grpo divides by the group's std (verl's "
        "norm_adv_by_std_in_grpo); off: Dr.GRPO's r - mean")
    # How purify scores, not what it computes: outside the id, so a config scored anywhere is one config.
    # A run scores with the backend it collects with, so there these follow collect's (RunConfig).
    backend: str = setting("torch", identity="never", help="torch (this process) | sglang (an SGLang engine here, or "
        "the server at --sglang-url)")
    sglang_url: str | None = setting(None, identity="never", help="a running SGLang server or router, e.g. "
        "http://host:30000 (with --backend sglang)")
    device: str = setting("cpu", identity="never", help="torch device: cpu, cuda, cuda:1, ...")
    scorer_memory_gb: float | None = setting(None, identity="never", help="on a GPU, what the torch scorer's caches "
        "may take (GB); none: half of a naive forward of the longest row, within what is free")


    @property
    def whole_batch(self) -> bool:
        """Whether the advantages need every row of the iteration at once (a shard sees only its own)."""
        return self.adv_estimator == AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE

    def __post_init__(self) -> None:
        _check_fields(self)
        self.check_groups()
        # A masked row keeps the failed call in the sequence, untrained; a negative sample trains it
        # in a row of its own, paired with a fix spliced into a purified row that mask never builds.
        _check(not (self.edit == Edit.MASK and self.negative_samples),
               "edit 'mask' does not combine with negative_samples: masking keeps each failed call in "
               "its row untrained, and a negative sample pairs it with a fix in a purified row")
        _check((self.down_sample == DownSample.NONE) == (self.down_sample_to is None),
               "down_sample_to is the group size down_sample (roc or uniform) keeps: give both or neither")
        _check(self.roc_min_negatives >= 0 and self.roc_min_positives >= 0,
               f"roc_min_negatives and roc_min_positives must be >= 0, got {self.roc_min_negatives} and "
               f"{self.roc_min_positives}")
        _check(self.down_sample != DownSample.ROC or self.roc_min_negatives + self.roc_min_positives
               <= self.down_sample_to, f"roc_min_negatives + roc_min_positives must be <= down_sample_to "
               f"({self.down_sample_to}), got {self.roc_min_negatives} + {self.roc_min_positives}")
        _check(self.norm_adv_by_std or self.adv_estimator == AdvEstimator.GRPO,
               f"norm_adv_by_std off is GRPO's (verl's norm_adv_by_std_in_grpo), and {self.adv_estimator.value} "
               "divides by no std: drop it, or use adv_estimator grpo")


@dataclass(frozen=True)
class TrainConfig(_Config):
    lr: float = setting(1e-6, check="> 0", help="AdamW learning rate (the reference: 2e-6 for 4B; the tiny policy: "
        "1e-4)")
    warmup_steps: int = setting(0, check=">= 0", help="linear warmup from 0 over this many optimiser steps; 0 = "
        "constant lr")
    weight_decay: float = setting(0.0, check=">= 0", help="AdamW weight decay")
    clip_eps_low: float = setting(0.2, check="in [0, 1)", help="DAPO lower clip")
    clip_eps_high: float = setting(0.28, check=">= 0", help="DAPO upper clip (clip-higher)")
    clip_ratio_c: float = setting(10.0, help="dual clip for negative advantages (the reference script's); 0 = off")
    kl_coef: float = setting(0.0, check=">= 0", help="KL to the reference policy; 0 = off (DAPO)")
    entropy_coef: float = setting(0.0, check=">= 0", help="entropy bonus: minus this x the entropy (aggregated as the "
        "loss) in the loss; 0 = off")
    loss_mode: LossMode = setting(LossMode.VANILLA, identity="away-from-default", help="the policy loss (verl's "
        "policy_loss.loss_mode): vanilla | gspo | cispo | geo_mean")
    loss_agg_mode: str | None = setting(None, identity="away-from-default", choices=LOSS_AGG_MODES, help="verl's "
        "loss_agg_mode for the policy, KL and entropy terms: token-mean | seq-mean-token-sum | seq-mean-token-mean | "
        "seq-mean-token-sum-norm; none: the loss mode's (gspo: seq-mean-token-mean, else token-mean)")
    loss_scale_factor: int | None = setting(None, identity="away-from-default", check="> 0",
                                            help="seq-mean-token-sum-norm divides each row's token sum by this "
                                            "constant (verl's loss_scale_factor); none: max_response_tokens")
    rollout_is: str | None = setting(None, help="verl's rollout correction: importance weights old/behaviour per token "
        "or sequence, truncated; none: off (CLEANER: off)")
    rollout_is_threshold: float = setting(2.0, check="> 0", help="the IS weights' truncation (above only)")
    rollout_is_batch_normalize: bool = setting(False, help="divide the truncated IS weights by their mean over the "
        "iteration")
    rollout_rs: str | None = setting(None, help="rejection sampling by the old/behaviour ratio: token | sequence | "
        "geometric; none: off")
    rollout_rs_threshold: float | None = setting(None, help="rejection's upper bound on the ratio")
    rollout_rs_threshold_lower: float | None = setting(None, help="rejection's lower bound; none: 1 / the upper")
    rollout_token_veto_threshold: float | None = setting(None, check="in (0, 1)", help="reject a row with any token "
        "whose ratio is below this; none: off")
    dynamic_sampling: bool = setting(False, help="drop groups whose rewards are all equal")
    overlong_buffer: int = setting(0, check=">= 0", help="DAPO overlong shaping buffer in tokens; 0 = off")
    max_response_tokens: int = setting(768, help="DAPO overlong: the response length the buffer counts back from")
    mini_batch_size: int = setting(64, check=">= 1", help="sequences per optimiser step")
    micro_batch_size: int = setting(8, check=">= 1", help="sequences per forward/backward (gradient accumulation)")
    max_tokens_per_micro_batch: int | None = setting(None, check=">= 1", help="pack micro batches by tokens, at most "
        "this many (a longer row alone); replaces micro_batch_size")
    logits_chunk_tokens: int = setting(512, check=">= 1", help="tokens per lm_head chunk: the step never holds more "
        "logits than this x vocabulary")
    gradient_checkpointing: bool = setting(False, help="recompute each decoder layer in backward (non-reentrant): "
        "activations grow with layers x tokens x hidden only")
    compute_dtype: str = setting("auto", choices=("auto", "float32", "bfloat16", "float16"), help="auto (bfloat16 on a "
        "GPU, as verl; float32 on the CPU) | float32 | bfloat16 | float16 (with dynamic loss scaling: the "
        "reference's): autocast compute; weights, optimiser and log-softmax stay float32")
    save_dtype: str = setting("float32", choices=("float32", "bfloat16", "float16"), help="float32 | bfloat16 | "
        "float16: the checkpoint's weights (what a backend reloads); the optimiser state stays float32")
    epochs: int = setting(1, check=">= 1", help="passes over the iteration's rows")
    max_grad_norm: float = setting(1.0, check="> 0", help="gradient clipping")
    engine: str = setting("torch", choices=("torch", "deepspeed"), help="torch | deepspeed (ZeRO over the ranks "
        "torchrun starts)")
    deepspeed_config: str | None = setting(None, help="DeepSpeed JSON (ZeRO stage, offload, precision) for --engine "
        "deepspeed")
    device: str = setting("cpu", help="torch device")
    seed: int = setting(0, help="shuffling and dropout seed")
    lora_rank: int = setting(0, identity="away-from-default", help="LoRA: train rank-r adapters (peft) instead of the "
        "weights, the KL reference the base with them disabled (verl's lora_rank); 0 = off")
    lora_alpha: int = setting(16, identity="away-from-default", help="LoRA's scale is lora_alpha / lora_rank (verl's "
        "lora_alpha)")
    lora_target_modules: str = setting(LORA_ALL_LINEAR, identity="away-from-default", help="the linear layers that get "
        "adapters: comma-separated module names (q_proj,v_proj) or all-linear, every one but the lm_head (verl's "
        "target_modules)")


    @property
    def aggregation(self) -> str:
        """The loss_agg_mode the terms are aggregated with: the one given, else the loss mode's."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return GSPO_AGG_MODE if self.loss_mode == LossMode.GSPO else "token-mean"

    @property
    def scale_factor(self) -> int:
        """seq-mean-token-sum-norm's constant: the one given, else the response budget (verl's
        default is the padded response length, which is that budget)."""
        return self.loss_scale_factor if self.loss_scale_factor is not None else self.max_response_tokens

    def compute_dtype_on(self, device_type: str) -> str:
        """The compute dtype on a device of this type ("cuda", "cpu"): `auto` resolved."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        return "bfloat16" if device_type == "cuda" else "float32"

    def __post_init__(self) -> None:
        _check_fields(self)
        _check(self.clip_ratio_c == 0 or self.clip_ratio_c > 1,
               f"clip_ratio_c must be > 1, or 0 for off, got {self.clip_ratio_c}")
        self._check_objective()
        _check(self.rollout_is in (None, "token", "sequence"),
               f"rollout_is must be token, sequence or none, got {self.rollout_is!r}")
        _check(self.rollout_rs in (None, "token", "sequence", "geometric"),
               f"rollout_rs must be token, sequence, geometric or none, got {self.rollout_rs!r}")
        _check(self.rollout_rs is None or (self.rollout_rs_threshold or 0) > 0,
               "rollout_rs needs rollout_rs_threshold > 0")
        _check(self.rollout_rs is not None
               or (self.rollout_rs_threshold is None and self.rollout_rs_threshold_lower is None),
               "rollout_rs_threshold and rollout_rs_threshold_lower bound rejection sampling: set rollout_rs "
               "(token, sequence or geometric) too, or drop them")
        _check(self.rollout_is is not None or not self.rollout_is_batch_normalize,
               "rollout_is_batch_normalize normalises the IS weights: set rollout_is (token or sequence) too")
        _check(self.rollout_rs_threshold_lower is None or 0 < self.rollout_rs_threshold_lower <= (
            self.rollout_rs_threshold or float("inf")),
            "rollout_rs_threshold_lower must be in (0, rollout_rs_threshold]")
        _check(self.overlong_buffer <= self.max_response_tokens,
               "overlong_buffer must be <= max_response_tokens")
        _check(self.max_tokens_per_micro_batch is not None or self.mini_batch_size >= self.micro_batch_size,
               f"mini_batch_size ({self.mini_batch_size}) must be >= micro_batch_size ({self.micro_batch_size})")
        _check(self.engine != "deepspeed" or self.deepspeed_config is not None,
               "engine deepspeed needs deepspeed_config")
        _check_lora(self)

    def _check_objective(self) -> None:
        """The loss mode, its aggregation and the aggregation's constant."""
        _check(self.loss_mode != LossMode.GSPO or self.loss_agg_mode in (None, GSPO_AGG_MODE),
               f"loss_mode gspo aggregates its policy loss {GSPO_AGG_MODE}, as verl forces it whatever "
               f"loss_agg_mode says: drop loss_agg_mode {self.loss_agg_mode!r}, or set it to {GSPO_AGG_MODE}")
        _check(self.loss_scale_factor is None or self.aggregation == "seq-mean-token-sum-norm",
               "loss_scale_factor is the constant of loss_agg_mode seq-mean-token-sum-norm: set that mode too, "
               "or drop it")


def _check_lora(config: TrainConfig) -> None:
    """LoRA's fields: a rank >= 0, and with a rank (0 is off, as verl's) a scale and the layers;
    without one, neither (they would shape adapters that are not trained)."""
    targets = ",".join(name.strip() for name in config.lora_target_modules.split(","))
    _set(config, lora_target_modules=targets)
    _check(config.lora_rank >= 0, f"lora_rank must be >= 0 (0 = off), got {config.lora_rank}")
    _check(config.lora_rank == 0 or config.lora_alpha > 0,
           f"lora_alpha must be > 0 with lora_rank {config.lora_rank}, got {config.lora_alpha}")
    _check(all(targets.split(",")), f"lora_target_modules takes comma-separated module names or "
           f"{LORA_ALL_LINEAR}, got {config.lora_target_modules!r}")
    _check(targets == LORA_ALL_LINEAR or LORA_ALL_LINEAR not in targets.split(","),
           f"lora_target_modules: {LORA_ALL_LINEAR} already names every linear layer, got {targets!r}")
    changed = [name for name in ("lora_alpha", "lora_target_modules")
               if getattr(config, name) != getattr(TrainConfig, name)]
    _check(config.lora_rank > 0 or not changed,
           f"{' and '.join(changed)} shape LoRA adapters, which lora_rank 0 turns off: set lora_rank > 0 too, "
           "or drop them")


@dataclass(frozen=True)
class Shard:
    """The `index`-th of `count` disjoint shares of an iteration's prompts (docs/architecture.md §5).

    A prompt belongs to the share its id hashes to, so a share is a set of whole GRPO groups,
    decided by the prompt alone: no shard needs to know the others, the task order, or how many
    prompts there are, and collect and purify with the same i/N cover the same groups. Not part of
    any config: every shard of an iteration runs the same config.
    """

    index: int = 0  # this shard, 0 <= index < count
    count: int = 1  # shards of the iteration; 1 = unsharded

    def __post_init__(self) -> None:
        _check(self.count >= 1 and 0 <= self.index < self.count,
               f"--shard takes i/N with 0 <= i < N, got '{self}'")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`i/N` -> Shard(i, N); ValueError naming the expected form."""
        index, slash, count = text.strip().partition("/")
        if not (slash and index.strip().isdigit() and count.strip().isdigit()):
            raise ValueError(f"--shard takes i/N with 0 <= i < N, got {text!r}")
        return cls(int(index), int(count))

    def owns(self, prompt_id: str) -> bool:
        digest = hashlib.sha256(prompt_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.count == self.index

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


UNSHARDED = Shard()


# PurifyConfig's fields that say where it scores, which a run takes from its collect config
SCORED_AS_COLLECTED = ("backend", "sglang_url", "device")


@dataclass(frozen=True)
class RunConfig(_Config):
    run_dir: str = setting("runs/default", help="holds warehouse/ and checkpoints/")
    iterations: int = setting(3, check=">= 1", help="collect -> purify -> train iterations to run")
    collect: CollectConfig = setting(default_factory=CollectConfig, help="iteration and model are set per iteration")
    purify: PurifyConfig = setting(default_factory=PurifyConfig, help="the config trained on")
    train: TrainConfig = setting(default_factory=TrainConfig, help="the training of each iteration")

    def __post_init__(self) -> None:
        _check_fields(self)
        # the run's one backend collects and scores: purify's are collect's (a layer naming others is refused)
        _set(self, purify=dataclasses.replace(self.purify, **{name: getattr(self.collect, name)
                                                              for name in SCORED_AS_COLLECTED}))
        _check(self.purify.down_sample_to is None or self.purify.down_sample_to < self.collect.group_size,
               f"down_sample_to ({self.purify.down_sample_to}) must be smaller than group_size "
               f"({self.collect.group_size}): nothing to choose; GRPO-RoC collects 2N to keep N")


@dataclass(frozen=True)
class EvalConfig(_Config, SaarMerge, RolloutSettings):
    """`cleaner eval`: every model on every dataset under every SAAR setting (docs/architecture.md §12).

    Defaults are the reference's evaluation settings (temperature 1, top-p 0.6, 16 turns, 16
    samples, a 20480-token response). Each (model, dataset, setting) runs as one collect config
    (`collect_config`), whose id is the evaluation's id.
    """

    models: tuple[str, ...] = setting((str(DEFAULT_POLICY),), help="Hugging Face model directories or hub ids, or "
        "checkpoints")
    datasets: tuple[tuple[str, str], ...] = setting((), help="(name, Parquet path) in any layout of datasets.py")
    saar: tuple[bool, ...] = setting((True,), help="SAAR settings to run: True = purified context (the paper's test "
        "time)")
    n: int = setting(16, check=">= 1", help="samples per problem")
    limit: int | None = setting(None, check=">= 1", help="evaluate the first N problems of each dataset; none: all")
    # the reference's evaluation settings, where they differ from collect's
    top_p: float = redeclared(RolloutSettings, "top_p", 0.6)
    max_turns: int = redeclared(RolloutSettings, "max_turns", 16)
    max_new_tokens: int = redeclared(RolloutSettings, "max_new_tokens", 20480)
    max_response_tokens: int = redeclared(RolloutSettings, "max_response_tokens", 20480)

    def __post_init__(self) -> None:
        _check_fields(self)
        _set(self, models=tuple(resolved_path(model, always=False) for model in self.models),
             datasets=tuple((name, resolved_path(path)) for name, path in self.datasets))
        self.check_groups()
        _check(len(self.models) >= 1, "give at least one model")
        _check(len(self.datasets) >= 1, "give at least one dataset as NAME=PATH")
        names = [name for name, _ in self.datasets]
        _check(len(set(names)) == len(names), f"dataset names must differ, got {names}")
        _check(len(self.saar) >= 1 and len(set(self.saar)) == len(self.saar),
               f"saar must hold each setting once, got {self.saar}")
        self.collect_config(self.models[0], self.datasets[0][1], self.saar[0], 1)  # checks the rest

    def collect_config(self, model: str, data: str, saar: bool, problems: int) -> CollectConfig:
        """The collect config of one evaluation: `problems` prompts, n samples each, at iteration 0,
        every field the two configs share as this one's."""
        shared = group_values(self, RolloutSettings) | group_values(self, SaarMerge)
        return CollectConfig(**shared, model=model, data=data, iteration=0, n_prompts=problems, group_size=self.n,
                             collect_view=CollectView.PURIFIED if saar else CollectView.RAW, rollback_prob=1.0)


MAX_CURATE_SEED = 2**32 - 1 - 1001  # a draw's seed is seed (+ 1) + int(1000 rate), below 2**32


@dataclass(frozen=True)
class CurateConfig(_Config):
    """`cleaner curate`: pass statistics from a warehouse or a file, and a dataset filtered by them as
    the paper filters its own (docs/architecture.md §16). Each output needs its inputs: `stats_out`
    a warehouse's iterations or evaluations; `out` a dataset and statistics (a file or the warehouse)."""

    stats: str | None = setting(None, help="a statistics file, JSON Lines as the paper ships it (uid, data_source, "
        "successes, attempts, success_rate, avg_score, keep); none: the warehouse's --iteration / --eval")
    iterations: tuple[int, ...] = setting((), help="collected iterations whose rollouts are pooled per prompt")
    evals: tuple[str, ...] = setting((), help="evaluations (eval_runs.eval_id) whose rollouts are pooled too")
    stats_out: str | None = setting(None, help="write the warehouse's statistics to this file, in the paper's format")
    data: str | None = setting(None, help="the dataset to filter: a verl RL Parquet (prompt, data_source, "
        "reward_model, extra_info, ...)")
    success_rate_ratios: str | None = setting(None, help="share kept per success rate: \"0.0:0.0,0.125:0.8,...\" or "
        "nine ratios for 0/8 .. 8/8; a rate not named keeps all; none: every rate whole")
    retain_code: bool = setting(False, help="code prompts (by data source, the paper's table) are filtered at success "
        "rate 0 only")
    seed: int = setting(42, help="the draws' seed: code prompts at rate r draw with seed + int(1000 r), the rest seed "
        "+ 1 + int(1000 r) (42: the paper's)")
    out: str | None = setting(None, help="the filtered dataset (Parquet, the input's columns and row order), its "
        "summary beside it (.curate.md, .curate.json)")
    overwrite: bool = setting(False, help="replace an --out (or --stats-out) that curate wrote")

    def __post_init__(self) -> None:
        _check_fields(self)
        _set(self, iterations=tuple(self.iterations), evals=tuple(self.evals), stats=resolved_path(self.stats),
             stats_out=resolved_path(self.stats_out), data=resolved_path(self.data), out=resolved_path(self.out))
        warehouse = bool(self.iterations or self.evals)
        _check(not (warehouse and self.stats), "give statistics from a file (stats) or from the warehouse "
               "(iterations, evals), not both")
        _check(self.stats_out is None or warehouse, "stats_out writes a warehouse's statistics: give iterations "
               "or evals")
        _check(self.stats_out is not None or self.out is not None, "nothing to write: give out (a filtered "
               "dataset, with data) or stats_out (the warehouse's statistics)")
        _check(self.out is None or self.data is not None, "out needs data: the dataset to filter")
        _check(self.out is None or warehouse or self.stats, "out needs statistics: a stats file, or iterations "
               "or evals of the warehouse")
        _check(self.out is not None
               or (self.data is None and self.success_rate_ratios is None and not self.retain_code),
               "data, success_rate_ratios and retain_code filter a dataset: give out too")
        _check(len(set(self.iterations)) == len(self.iterations) and all(i >= 0 for i in self.iterations),
               f"iterations must be distinct and >= 0, got {list(self.iterations)}")
        _check(len(set(self.evals)) == len(self.evals), f"evals must be distinct, got {list(self.evals)}")
        _check(0 <= self.seed <= MAX_CURATE_SEED, f"seed must be in [0, {MAX_CURATE_SEED}] (numpy's seeds are below "
               f"2**32, and a rate adds up to 1,001), got {self.seed}")
