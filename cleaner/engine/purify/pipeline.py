"""The purify stage as functions over records (docs/architecture.md §4, §6, §7); no disk I/O here.

    rollouts + segments --render per config--> rows (old_logprobs 0) --ONE scorer call--> rows
    (IS-gated configs: render, score, render again while a decision was assumed)

Design decisions:
- `render_iteration` renders one config: each rollout is purified iff its rollback_draw < p (4.3)
  and, with purify_when = "positive", its advantage is > 0 (reward above its group mean; a group of
  one or of equal rewards has advantage 0 and stays raw). Everything else is rendered raw.
- The advantage is the config's estimator's (advantages.py). Its group stage decides purify_when;
  reinforce_plus_plus_baseline then whitens over the loss tokens of the config's own renderings,
  so each config of an ablation whitens its rows, and the negative-sample pushes are added to the
  whitened advantage.
- `purify_iteration` renders every config first, then sends the rows of ALL configs to ONE
  `scorer.score_rows` call, so a prefix trie shares a rollout's prompt and unchanged spans across
  configs. Identical (token_ids, start) requests are sent once (raw renderings repeat across
  configs); the scores are then scattered back: old_logprobs[t] = score of token t for loss_mask 1,
  0.0 elsewhere.
- IS-gated configs (rollback_is_threshold > 0) ask a `ScoreCache` for the old-policy log-probs of
  each merge's tokens; the first round sends those requests in the same scorer call as the rows,
  and a rendering that assumed an unknown value is rendered again after the call, until none is
  assumed (one extra round per decision that turned a chain raw; the cache shares every score).
- Negative samples (negative_samples): each recovered failure becomes a row of its own, scored in
  the same call; the SimPO-style pushes (negatives.py) then set per-token advantages.
- Edit mask (docs/architecture.md §4): the same SAAR decisions, the raw tokens, the dropped ones
  untrained. A masked row's tokens are the raw rendering's, so its scores are the raw row's (the
  requests are keyed by their tokens: an ablation of replace and mask scores each raw row once).
  Its tokens are on-policy only where the agent loop saw the raw view: masking rollouts collected
  with the purified view logs a warning.
- The premise diagnostic (`cleaner.engine.saar.premise`) is computed once per call: clean, recovered and
  unrecovered rollouts with their accuracy and mean advantage.
- Scoring starts at prompt_len: prompt tokens are never trained, so their logprobs are not needed.
- errors_by_type counts the failed tool calls in the input rollouts by error_type (tool_status when
  the type is unknown), most frequent first: what SAAR had to deal with, per config for the report.
- `cleaner.report.tables.stats_table` is the per-reason counter report (datatrove style) that `cleaner purify` and
  `cleaner ablate` print: one line per config.
- A rollout that an infrastructure fault ended (`infra_fault`) gets advantage 0 and is left out of
  its group's statistics; its row is still rendered and stored (the trainer skips it), and the
  stats count it.
- Segments whose rollout is missing (e.g. a crash between writing segments and rollouts) are
  skipped with a warning; a rollout without segments is an error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.config import Edit, PurifyConfig, PurifyWhen
from cleaner.engine.model.base import RowScorer
from cleaner.engine.purify.advantages import GroupStage, group_stage, whitened
from cleaner.engine.purify.negatives import dpo_push, with_pushes
from cleaner.engine.purify.selection import select
from cleaner.engine.saar.gate import ScoreCache
from cleaner.engine.saar.premise import (
    PremiseStats,
    RolloutClass,
    classify,
    failed_call_tokens,
    premise_stats,
)
from cleaner.engine.saar.walk import RAW, Decode, NegativeSample, Rendered, render, view_for
from cleaner.records import (
    CollectView,
    FinishReason,
    PurifiedRow,
    Rollout,
    Segment,
    SegmentKind,
    ToolStatus,
)

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class PurifyStats:
    config_id: str
    n_rollouts: int
    n_rolled_back: int  # rollouts rendered with the purified view
    n_shallow: int
    n_deep: int
    n_unrecovered: int
    tokens_removed: int  # relative to the raw view, summed over rollouts
    errors_by_type: tuple[tuple[str, int], ...]  # failed tool calls in the input, by type
    n_infra_fault: int = 0  # rollouts an infrastructure fault ended: advantage 0, out of group stats
    n_gated: int = 0  # merges the IS gate rejected
    n_negatives: int = 0  # negative-sample rows
    premise: PremiseStats | None = None  # clean / recovered / unrecovered rollouts (saar/premise.py)
    tokens_masked: int = 0  # edit mask: trained tokens of the raw view left untrained, summed over rollouts
    n_dropped: int = 0  # rollouts down-sampling left out (their rows stored, never trained)
    n_void: int = 0  # rollouts with a void turn, masked by the void-turn filter (selection.py)


@dataclass(frozen=True)
class UnscoredRow:
    """One rollout rendered under one config, before scoring."""

    rollout: Rollout
    advantage: float
    rolled_back: bool  # rendered with the purified view (SAAR applied)
    rendered: Rendered
    infra_fault: bool  # see `infra_fault`
    dropped: bool = False  # down-sampling left it out: advantage 0, never trained
    void_turn: bool = False  # it holds a void turn, and the config's void-turn filter masks it

    @property
    def trained(self) -> bool:
        """Whether any of its tokens can train, hence need old log-probs."""
        return not (self.dropped or self.void_turn)


@dataclass(frozen=True)
class PurifyPlan:
    """One config's renderings before scoring."""

    config: PurifyConfig
    drafts: tuple[UnscoredRow, ...]
    stats: PurifyStats


@dataclass(frozen=True)
class PurifyResult:
    config: PurifyConfig
    rows: list[PurifiedRow]  # with old_logprobs from the scorer
    stats: PurifyStats


# ----------------------------------------------------------------------------------------------
# Rendering one config


def _segments_by_rollout(
    rollouts: Sequence[Rollout], segments: Sequence[Segment]
) -> dict[str, list[Segment]]:
    wanted = {rollout.rollout_id for rollout in rollouts}
    grouped: dict[str, list[Segment]] = defaultdict(list)
    orphans = 0
    for segment in segments:
        if segment.rollout_id in wanted:
            grouped[segment.rollout_id].append(segment)
        else:
            orphans += 1
    if orphans:
        logger.warning("skipping %d segments whose rollout is not in the input", orphans)
    missing = [rollout_id for rollout_id in wanted if not grouped[rollout_id]]
    if missing:
        raise ValueError(f"rollouts without segments: {sorted(missing)[:5]}")
    return grouped


def infra_fault(rollout: Rollout, segments: Sequence[Segment]) -> bool:
    """True if an infrastructure fault, not the policy, decided the rollout's outcome: its
    generation failed (finish_reason `error`) or a call still failed with `infra_error` after the
    sandbox's transparent retries."""
    return rollout.finish_reason == FinishReason.ERROR or any(
        segment.kind == SegmentKind.TOOL and segment.tool_status == ToolStatus.INFRA_ERROR for segment in segments)


def errors_by_type(segments: Sequence[Segment]) -> tuple[tuple[str, int], ...]:
    counts = Counter(
        segment.error_type or segment.tool_status
        for segment in segments
        if segment.kind == SegmentKind.TOOL and segment.failed
    )
    return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def stats_from_rows(config_id: str, rows: Sequence[PurifiedRow],
                    errors_by_type: tuple[tuple[str, int], ...] = (),
                    premise: PremiseStats | None = None, tokens_masked: int = 0) -> PurifyStats:
    """The stats of a config from its stored rows (for configs purified in an earlier run);
    `tokens_masked` from `masked_tokens` for a config with edit mask."""
    rows_ = [r for r in rows if not r.is_negative]
    return PurifyStats(
        config_id=config_id, n_rollouts=len(rows_), n_rolled_back=sum(r.rolled_back for r in rows_),
        n_shallow=sum(r.n_shallow for r in rows_), n_deep=sum(r.n_deep for r in rows_),
        n_unrecovered=sum(r.n_unrecovered for r in rows_),
        tokens_removed=sum(r.tokens_removed for r in rows_), errors_by_type=errors_by_type,
        n_infra_fault=sum(r.infra_fault for r in rows_), n_gated=sum(r.n_gated for r in rows_),
        n_negatives=len(rows) - len(rows_), premise=premise, tokens_masked=tokens_masked,
        n_dropped=sum(r.dropped for r in rows_), n_void=sum(r.void_turn for r in rows_),
    )


def masked_tokens(rows: Sequence[PurifiedRow], segments: Sequence[Segment]) -> int:
    """The tokens edit mask left untrained in its rows: a masked row holds the raw tokens, so it
    is every assistant token of the rollout less the row's trained ones."""
    assistant: Counter[str] = Counter()
    for segment in segments:
        if segment.kind == SegmentKind.ASSISTANT:
            assistant[segment.rollout_id] += len(segment.token_ids)
    return sum(assistant[row.rollout_id] - sum(row.loss_mask) for row in rows if not row.is_negative)


def iteration_premise(rollouts: Sequence[Rollout], segments: Sequence[Segment],
                      rows: Sequence[PurifiedRow]) -> PremiseStats:
    """The premise diagnostic of an iteration, with the advantages of one config's stored rows."""
    grouped = _segments_by_rollout(rollouts, segments)
    advantage = {r.rollout_id: r.advantage for r in rows if not r.is_negative}
    return premise_stats(rollouts, _classes(rollouts, grouped), [advantage.get(r.rollout_id, 0.0) for r in rollouts],
                         _failed_tokens(rollouts, grouped))


def _failed_tokens(rollouts: Sequence[Rollout], grouped: dict[str, list[Segment]]) -> list[int]:
    return [failed_call_tokens(grouped[r.rollout_id]) for r in rollouts]


def _classes(rollouts: Sequence[Rollout], grouped: dict[str, list[Segment]]) -> list[RolloutClass | None]:
    """Each rollout's premise class; None for one an infrastructure fault decided."""
    return [None if infra_fault(r, grouped[r.rollout_id]) else classify(grouped[r.rollout_id]) for r in rollouts]


def render_iteration(
    rollouts: Sequence[Rollout],
    segments: Sequence[Segment],
    config: PurifyConfig,
    decode: Decode | None,
) -> tuple[list[PurifiedRow], PurifyStats]:
    """Render every rollout under one config; old_logprobs are zeros until scored. An IS-gated
    config or negative samples need the scorer: use `purify_iteration`."""
    if config.rollback_is_threshold > 0 or config.negative_samples:
        raise ValueError("IS gating and negative samples need old log-probs: use purify_iteration")
    grouped = _segments_by_rollout(rollouts, segments)
    plan = _plan(rollouts, grouped, config, decode, {}, _input_errors(grouped), ScoreCache(),
                 _classes(rollouts, grouped), _failed_tokens(rollouts, grouped))
    return [_row(plan.config, draft, None, "") for draft in plan.drafts], plan.stats


def _plan(
    rollouts: Sequence[Rollout],
    grouped: dict[str, list[Segment]],
    config: PurifyConfig,
    decode: Decode | None,
    renders: dict,  # (rollout_id, view, negatives) -> Rendered, shared by the configs of one call
    errors: tuple[tuple[str, int], ...],  # errors_by_type of the input
    cache: ScoreCache,  # old log-probs known so far, for the IS gate
    classes: Sequence[RolloutClass | None],  # the premise class of each rollout (None: infra fault)
    failed_tokens: Sequence[int],  # the failed-call tokens of each rollout (the premise's credit)
) -> PurifyPlan:
    faults = [cls is None for cls in classes]
    selection = select(rollouts, grouped, config, faults)  # down-sampling and void turns (selection.py)
    stage = group_stage(config, [r.group_id for r in rollouts], [r.reward for r in rollouts],
                        counted=[not fault and kept for fault, kept in zip(faults, selection.kept, strict=True)])
    masked = [config.void_turn_filter and void for void in selection.void]
    drafts = []
    for index, (rollout, advantage, fault) in enumerate(zip(rollouts, stage.advantages, faults, strict=True)):
        eligible = config.purify_when == PurifyWhen.ALWAYS or advantage > 0
        view = view_for(rollout.rollback_draw, eligible, config)
        chain = grouped[rollout.rollout_id]
        failed = any(s.kind == SegmentKind.TOOL and s.failed for s in chain)
        key = (rollout.rollout_id, view if failed else RAW, config.negative_samples and failed)
        rendered = renders.get(key)
        if rendered is None:  # a rollout without a failed call renders raw under every view
            rendered = render(chain, view, decode, oracle=cache, negatives=key[2])
            if not rendered.provisional:
                renders[key] = rendered
        drafts.append(UnscoredRow(rollout, advantage, view.purified, rendered, fault, not selection.kept[index],
                                  masked[index]))
    if config.whole_batch:
        drafts = _whitened(drafts, stage)
    advantages = [draft.advantage for draft in drafts]
    counts = [draft.rendered.stats for draft in drafts]
    stats = PurifyStats(
        config_id=config.config_id, n_rollouts=len(drafts),
        n_rolled_back=sum(draft.rolled_back for draft in drafts),
        n_shallow=sum(c.n_shallow for c in counts), n_deep=sum(c.n_deep for c in counts),
        n_unrecovered=sum(c.n_unrecovered for c in counts),
        tokens_removed=sum(c.tokens_removed for c in counts),
        errors_by_type=errors,
        n_infra_fault=sum(faults),
        n_gated=sum(c.n_gated for c in counts),
        n_negatives=sum(len(draft.rendered.negatives) for draft in drafts),
        tokens_masked=sum(c.tokens_masked for c in counts),
        premise=premise_stats(rollouts, classes, advantages, failed_tokens),
        n_dropped=sum(draft.dropped for draft in drafts), n_void=sum(masked),
    )
    return PurifyPlan(config, tuple(drafts), stats)


def _whitened(drafts: list[UnscoredRow], stage: GroupStage) -> list[UnscoredRow]:
    """The drafts with their advantages whitened over the loss tokens of their renderings
    (reinforce_plus_plus_baseline; advantages.py), the infrastructure faults and the rows that do
    not train (dropped by down-sampling, masked by the void-turn filter) left out."""
    loss_tokens = [sum(draft.rendered.loss_mask[1:]) for draft in drafts]
    values = whitened(stage, loss_tokens, [not draft.infra_fault and draft.trained for draft in drafts])
    return [dataclasses.replace(draft, advantage=value) for draft, value in zip(drafts, values, strict=True)]


def _input_errors(grouped: dict[str, list[Segment]]) -> tuple[tuple[str, int], ...]:
    return errors_by_type([segment for group in grouped.values() for segment in group])


def _row(config: PurifyConfig, draft: UnscoredRow, old_logprobs: tuple[float, ...] | None,
         scorer_version: str, token_advantages: tuple[float, ...] | None = None) -> PurifiedRow:
    """The stored row of a draft; old_logprobs None = zeros (not scored yet)."""
    rendered, rollout = draft.rendered, draft.rollout
    zeros = (0,) * len(rendered.token_ids)
    return PurifiedRow(
        config_id=config.config_id, iteration=rollout.iteration,
        rollout_id=rollout.rollout_id, group_id=rollout.group_id,
        token_ids=rendered.token_ids, prompt_len=rendered.prompt_len,
        loss_mask=rendered.loss_mask if draft.trained else zeros,
        behavior_logprobs=rendered.behavior_logprobs if draft.trained else (0.0,) * len(zeros),
        old_logprobs=(0.0,) * len(rendered.token_ids) if old_logprobs is None else old_logprobs,
        reward=rollout.reward, advantage=draft.advantage, rolled_back=draft.rolled_back,
        n_shallow=rendered.stats.n_shallow, n_deep=rendered.stats.n_deep,
        n_unrecovered=rendered.stats.n_unrecovered,
        tokens_removed=rendered.stats.tokens_removed, scorer_version=scorer_version,
        infra_fault=draft.infra_fault, n_gated=rendered.stats.n_gated, token_advantages=token_advantages,
        dropped=draft.dropped, void_turn=draft.void_turn,
    )


# ----------------------------------------------------------------------------------------------
# Scoring every config in one call


def purify_iteration(
    rollouts: Sequence[Rollout],
    segments: Sequence[Segment],
    configs: Sequence[PurifyConfig],
    scorer: RowScorer,
    decode: Decode | None,
    scorer_version: str,
) -> list[PurifyResult]:
    """Render under every config, score all rows in ONE scorer call (more rounds only for IS
    decisions that changed a rendering), scatter old_logprobs back, add negative samples."""
    grouped = _segments_by_rollout(rollouts, segments)
    _warn_masking_purified(rollouts, configs)
    renders: dict = {}
    errors, classes, cache = _input_errors(grouped), _classes(rollouts, grouped), ScoreCache()
    failed_tokens = _failed_tokens(rollouts, grouped)  # the input's facts, the same under every config and round
    while True:
        plans = [_plan(rollouts, grouped, config, decode, renders, errors, cache, classes, failed_tokens)
                 for config in configs]
        for draft in (draft for plan in plans for draft in plan.drafts if draft.trained):  # the others train nothing
            cache.get(draft.rendered.token_ids, _start(draft.rendered))  # wanted unless scored
            for negative in draft.rendered.negatives:
                cache.get(negative.token_ids, negative.call_start)
        cache.fill(scorer.score_rows)
        if not any(draft.rendered.provisional for plan in plans for draft in plan.drafts):
            break
    results, scattered = [], {}  # (id of scores, loss_mask) -> old_logprobs: raw rows repeat across configs
    for plan in plans:
        rows = []
        for draft in plan.drafts:
            if not draft.trained:  # dropped or masked: zeros, no negative samples (nothing of it trains)
                rows.append(_row(plan.config, draft, None, scorer_version))
                continue
            rendered = draft.rendered
            scores = cache.get(rendered.token_ids, _start(rendered))
            old_logprobs = scattered.get((id(scores), rendered.loss_mask))
            if old_logprobs is None:
                old_logprobs = scattered[id(scores), rendered.loss_mask] = _scatter(
                    draft.rollout.rollout_id, rendered, scores)
            rows += _rows_with_negatives(plan.config, draft, old_logprobs, cache, scorer_version)
        results.append(PurifyResult(plan.config, rows, plan.stats))
    return results


def _warn_masking_purified(rollouts: Sequence[Rollout], configs: Sequence[PurifyConfig]) -> None:
    """Masked rows keep the raw tokens; a rollout collected with the purified view sampled its later
    turns after a rendered context, so its raw row is off-policy after every merge."""
    purified = sum(rollout.collect_view == CollectView.PURIFIED for rollout in rollouts)
    if purified and any(config.edit == Edit.MASK for config in configs):
        logger.warning("edit mask on rollouts collected with the purified view (%d of %d): their turns after a "
                       "failed call were sampled in SAAR's context, so the raw rows mask trains are off-policy "
                       "there; collect with --collect-view raw (cleaner run --edit mask does)",
                       purified, len(rollouts))


def _rows_with_negatives(config: PurifyConfig, draft: UnscoredRow, old_logprobs: tuple[float, ...],
                         cache: ScoreCache, scorer_version: str) -> list[PurifiedRow]:
    """The draft's row, then one row per negative sample, with the pairs' pushes applied."""
    rendered = draft.rendered
    if not rendered.negatives:
        return [_row(config, draft, old_logprobs, scorer_version)]
    fix_pushes, negative_rows = [], []
    for negative in rendered.negatives:
        failed_old = cache.get(negative.token_ids, negative.call_start)
        push = dpo_push(old_logprobs[negative.fix_start:negative.fix_end], failed_old, config.dpo_beta,
                        config.dpo_max_adjustment_ratio, config.dpo_cap, draft.advantage)
        fix_pushes.append((negative.fix_start, negative.fix_end, push.fix))
        negative_rows.append(_negative_row(config, draft, negative, failed_old, push.failed, scorer_version))
    token_advantages = with_pushes(draft.advantage, len(rendered.token_ids), fix_pushes)
    return [_row(config, draft, old_logprobs, scorer_version, token_advantages), *negative_rows]


def _negative_row(config: PurifyConfig, draft: UnscoredRow, negative: NegativeSample, failed_old: Sequence[float],
                  push: float, scorer_version: str) -> PurifiedRow:
    """A negative sample's row: trained on the failed call's tokens only, advantage -push there."""
    length, start = len(negative.token_ids), negative.call_start
    mask = (0,) * start + (1,) * (length - start)
    return PurifiedRow(
        config_id=config.config_id, iteration=draft.rollout.iteration, rollout_id=draft.rollout.rollout_id,
        group_id=draft.rollout.group_id, token_ids=negative.token_ids, prompt_len=draft.rendered.prompt_len,
        loss_mask=mask, behavior_logprobs=(0.0,) * start + negative.behavior_logprobs[start:],
        old_logprobs=(0.0,) * start + tuple(failed_old), reward=draft.rollout.reward, advantage=0.0,
        rolled_back=True, n_shallow=0, n_deep=0, n_unrecovered=0, tokens_removed=0,
        scorer_version=scorer_version, negative_seq=negative.seq,
        token_advantages=with_pushes(0.0, length, [(start, length, -push)]),
    )


def _start(row: Rendered) -> int:
    """First scored position: the prompt is never trained, and position 0 has no context."""
    return max(row.prompt_len, 1)


def _scatter(rollout_id: str, row: Rendered, scores: Sequence[float]) -> tuple[float, ...]:
    """old_logprobs aligned with token_ids: the score where loss_mask is 1, 0.0 elsewhere."""
    start = _start(row)
    if len(scores) != len(row.token_ids) - start:
        raise ValueError(f"rollout {rollout_id}: scorer returned {len(scores)} logprobs for "
                         f"{len(row.token_ids) - start} tokens after position {start}")
    if any(row.loss_mask[:start]):
        raise ValueError(f"rollout {rollout_id}: trained tokens before position {start}")
    return (0.0,) * start + tuple([  # lengths checked above
        float(score) if mask else 0.0 for score, mask in zip(scores, row.loss_mask[start:], strict=True)
    ])
