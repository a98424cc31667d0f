"""The train step's objectives against verl's (tests/verl_core_algos.py, and verl itself where it is
installed): for every loss mode and aggregation, with and without the KL, entropy and rollout-IS
terms, the value of each reported term (verl's actor/pg_loss, kl_loss, entropy, pg_clipfrac,
ppo_kl, pg_clipfrac_lower) and the gradient of the loss, through step.py's micro-batch loss over
packed micro batches of unequal sizes, several mini batches and two simulated DeepSpeed ranks,
equal those of verl's functions applied to each mini batch as verl's padded (B, T) batch with its
global batch information. The rows are the warehouse's shape: multi-token prompts, tool spans
masked, SAAR's per-token advantages, a rejected row and a one-token row (tests/factories.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from cleaner.config import LOSS_AGG_MODES, LossMode, TrainConfig
from cleaner.engine.train.deepspeed_engine import rank_loss_scale, rank_micro_batches
from cleaner.engine.train.packing import micro_batches, pack_rows
from cleaner.engine.train.step import (
    METRICS,
    ReferenceLogProbs,
    StepMetrics,
    batch_totals,
    forward_micro_batch,
    iter_mini_batches,
    prepare,
)
from cleaner.records import PurifiedRow
from tests import verl_core_algos as verl
from tests.factories import TablePolicy, objective_rows, with_table_old_logprobs

ORACLES = [None]
if verl.verl_core_algos() is not None:  # tools/verl-reference/setup.sh's environment
    ORACLES.append(verl.verl_core_algos())
NO_DUAL_CLIP = 1e12  # verl cannot switch its dual clip off: a bound no loss reaches

# (loss mode, aggregation) pairs verl runs: gspo forces its own, geo_mean's policy term ignores it
OBJECTIVES = [(mode, agg) for mode in LossMode for agg in LOSS_AGG_MODES
              if mode != LossMode.GSPO or agg == "seq-mean-token-mean"]
TERMS = {
    "plain": {},
    "kl+entropy+is": {"kl_coef": 0.3, "entropy_coef": 0.05, "rollout_is": "token", "rollout_is_threshold": 1.5},
    "sequence-is+dual-clip-off": {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "clip_ratio_c": 0.0,
                                  "kl_coef": 0.1},
}
SHAPES = {  # 16 rows: mini batches of 7, 7, 2; micro batches of 3, 3, 1 rows, or first-fit by 40 tokens
    "rows": {"mini_batch_size": 7, "micro_batch_size": 3},
    "tokens": {"mini_batch_size": 7, "max_tokens_per_micro_batch": 40},
}


def _config(mode: str, agg: str, terms: dict, shape: dict) -> TrainConfig:
    norm = {"loss_scale_factor": 24} if agg == "seq-mean-token-sum-norm" else {}
    return TrainConfig(loss_mode=mode, loss_agg_mode=agg, **{"clip_ratio_c": 3.0, **norm, **shape, **terms})


# ---------------------------------------------------------------------------
# cleaner: step.py over packed micro batches, ranks simulated as DeepSpeed's engine runs them


def _micro_batches(mini_rows: Sequence[PurifiedRow], config: TrainConfig, rank: int, world_size: int):
    if world_size == 1:  # the torch engine's
        return [(rows, 1.0) for rows in micro_batches(mini_rows, config.micro_batch_size,
                                                      config.max_tokens_per_micro_batch)]
    return rank_micro_batches(mini_rows, rank, world_size, config)


def cleaner_step(policy: TablePolicy, reference: ReferenceLogProbs | None, mini_rows, weights, config: TrainConfig,
                 world_size: int) -> tuple[dict[str, float], list[torch.Tensor]]:
    """The step's reported values (summed over micro batches and ranks) and the gradient DeepSpeed's
    mean over ranks would apply (the torch engine's with one rank)."""
    totals = batch_totals(mini_rows, config)
    metrics, gradient = StepMetrics(), [torch.zeros_like(p) for p in policy.parameters()]
    for rank in range(world_size):
        policy.zero_grad(set_to_none=True)
        for rows, weight in _micro_batches(mini_rows, config, rank, world_size):
            part = forward_micro_batch(policy, reference, rows, pack_rows(rows, "cpu", weights), config, totals)
            (part.loss * rank_loss_scale(weight, world_size)).backward()
            metrics.add(part, weight)
        gradient = [g + (p.grad if p.grad is not None else 0) / world_size
                    for g, p in zip(gradient, policy.parameters(), strict=True)]
    return dict(zip(METRICS, metrics.tensor("cpu").tolist(), strict=True)), gradient


# ---------------------------------------------------------------------------
# verl: its functions on the mini batch as its padded batch


def _padded(rows: Sequence[PurifiedRow], values, fill: float = 0.0) -> torch.Tensor:
    """Each row's response (tokens after its prompt) of per-token `values(row)`, right-padded. (B, T)"""
    length = max(len(row.token_ids) - row.prompt_len for row in rows)
    out = torch.full((len(rows), length), fill, dtype=torch.float64)
    for index, row in enumerate(rows):
        response = torch.as_tensor(values(row)[row.prompt_len:], dtype=torch.float64)
        out[index, : len(response)] = response
    return out


def _float32(values) -> torch.Tensor:
    """As the packed batch holds them (float32), in float64."""
    return torch.tensor(list(values), dtype=torch.float32).double()


def verl_step(module, policy: TablePolicy, reference: TablePolicy | None, mini_rows, weights,
              config: TrainConfig) -> tuple[dict[str, float], list[torch.Tensor]]:
    """verl's ppo_loss on the mini batch in one piece (dp_size 1, its global batch information)."""
    mask = _padded(mini_rows, lambda row: row.loss_mask)  # (B, T) response_mask
    tokens = _padded(mini_rows, lambda row: row.token_ids).long()
    previous = _padded(mini_rows, lambda row: (0, *row.token_ids[:-1])).long()
    log_prob = policy.log_probs(tokens, previous)  # (B, T), differentiable
    old = _padded(mini_rows, lambda row: _float32(row.old_logprobs))
    advantages = _padded(mini_rows, lambda row: _float32(row.token_advantages or (row.advantage,) * len(row.token_ids)))
    is_weights = _padded(mini_rows, lambda row: _float32(weights[id(row)])) * mask if weights else None
    info = {"dp_size": 1, "batch_num_tokens": mask.sum(), "global_batch_size": len(mini_rows),
            "loss_scale_factor": config.scale_factor}
    actor = verl.ActorConfig(clip_ratio_low=config.clip_eps_low, clip_ratio_high=config.clip_eps_high,
                             clip_ratio_c=config.clip_ratio_c or NO_DUAL_CLIP, global_batch_info=info)
    pg_loss, metrics = verl.policy_loss_of(module)(config.loss_mode.value, old_log_prob=old, log_prob=log_prob,
                                                   advantages=advantages, response_mask=mask,
                                                   loss_agg_mode=config.aggregation, config=actor,
                                                   rollout_is_weights=is_weights)
    agg = (module or verl).agg_loss
    entropy = agg(loss_mat=policy.entropy(tokens), loss_mask=mask, loss_agg_mode=config.aggregation, **info)
    loss = pg_loss - entropy * config.entropy_coef
    kl_loss = torch.zeros(())
    if reference is not None:
        with torch.no_grad():
            ref = reference.log_probs(tokens, previous).float().double()
        kl_loss = agg(loss_mat=(module or verl).kl_penalty(log_prob, ref, "low_var_kl"), loss_mask=mask,
                      loss_agg_mode=config.aggregation, **info)
        loss = loss + kl_loss * config.kl_coef
    policy.zero_grad(set_to_none=True)
    loss.backward()
    values = {"loss": loss.item(), "pg_loss": pg_loss.item(), "kl_loss": kl_loss.item(), "entropy": entropy.item(),
              "clip_fraction": metrics["actor/pg_clipfrac"], "clip_fraction_lower": metrics["actor/pg_clipfrac_lower"],
              "ppo_kl": metrics["actor/ppo_kl"]}
    return values, [p.grad.clone() for p in policy.parameters()]


# ---------------------------------------------------------------------------
# The comparison


def _batch(config: TrainConfig, seed: int):
    policy = TablePolicy(seed)
    rows = with_table_old_logprobs(policy, objective_rows(seed), seed)
    prepared = prepare(rows, config)
    reference_policy = TablePolicy(seed + 100) if config.kl_coef > 0 else None
    reference = ReferenceLogProbs(reference_policy.at_loss_tokens(prepared.rows)) if reference_policy else None
    return policy, reference_policy, reference, prepared


@pytest.mark.parametrize("module", ORACLES, ids=["transcribed", "verl"][: len(ORACLES)])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("terms", TERMS.values(), ids=TERMS.keys())
@pytest.mark.parametrize(("mode", "agg"), OBJECTIVES, ids=[f"{m.value}-{a}" for m, a in OBJECTIVES])
def test_every_term_and_the_gradient_equal_verls(mode, agg, terms, shape, world_size, module):
    config = _config(mode, agg, terms, shape)
    for seed in range(2):
        _compare(config, seed, world_size, module)


def test_the_objectives_on_one_batch_equal_verls():
    """The comparison above in one test on one batch: every objective with every term, on two ranks
    (what `make mutants` runs for loss.py and aggregation.py)."""
    for mode, agg in OBJECTIVES:
        for terms in TERMS.values():
            for shape in SHAPES.values():
                _compare(_config(mode, agg, terms, shape), 0, 2, None)


def _compare(config: TrainConfig, seed: int, world_size: int, module) -> None:
    policy, reference_policy, reference, prepared = _batch(config, seed)
    steps = list(iter_mini_batches(prepared.rows, config, iteration=0))
    assert [len(mini) for mini in steps] == [7, 7, 2]
    for index, mini_rows in enumerate(steps):
        ours, our_gradient = cleaner_step(policy, reference, mini_rows, prepared.is_weights, config, world_size)
        theirs, their_gradient = verl_step(module, policy, reference_policy, mini_rows, prepared.is_weights, config)
        where = (config.loss_mode.value, config.aggregation, seed, index)
        for name, value in theirs.items():
            assert ours[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (*where, name)
        for got, want in zip(our_gradient, their_gradient, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}")


def test_the_batches_hold_the_warehouses_shapes():
    """What the comparison runs on: a rejected row, a one-token row, per-token advantages, tool spans,
    micro batches of unequal sizes, a rank padded with a zero-weight micro batch."""
    config = _config(LossMode.VANILLA, "token-mean", {}, SHAPES["tokens"])
    _, _, _, prepared = _batch(config, 0)
    counts = sorted(sum(row.loss_mask[1:]) for row in prepared.rows)
    assert counts[0] == 0 and counts[1] == 1
    assert any(row.token_advantages is not None for row in prepared.rows)
    assert any(0 in row.loss_mask[row.prompt_len:] for row in prepared.rows)  # a tool span inside a response
    for shape in SHAPES.values():
        config = _config(LossMode.VANILLA, "token-mean", {}, shape)
        minis = list(iter_mini_batches(prepared.rows, config, 0))
        sizes = {len(rows) for mini in minis
                 for rows in micro_batches(mini, config.micro_batch_size, config.max_tokens_per_micro_batch)}
        assert len(sizes) > 1, shape
    rows_config = _config(LossMode.VANILLA, "token-mean", {}, SHAPES["rows"])
    first = list(iter_mini_batches(prepared.rows, rows_config, 0))[0]  # 4 and 3 rows: 2 and 1 micro batches
    assert [weight for _, weight in rank_micro_batches(first, 1, 2, rows_config)] == [1.0, 0.0]


def test_a_micro_batchs_shares_add_up_to_the_mini_batchs_value_whatever_the_packing():
    """Packing a mini batch otherwise (one micro batch, one row each) changes no value and no
    gradient: every share is normalised by the mini batch's totals."""
    for mode, agg in OBJECTIVES:
        config = _config(mode, agg, TERMS["kl+entropy+is"], SHAPES["rows"])
        policy, _, reference, prepared = _batch(config, 3)
        mini = list(iter_mini_batches(prepared.rows, config, 0))[0]
        whole, whole_gradient = cleaner_step(policy, reference, mini, prepared.is_weights,
                                             dataclasses.replace(config, micro_batch_size=7), 1)
        single, single_gradient = cleaner_step(policy, reference, mini, prepared.is_weights,
                                               dataclasses.replace(config, micro_batch_size=1), 1)
        assert single == pytest.approx(whole, rel=1e-12), (mode, agg)
        for got, want in zip(single_gradient, whole_gradient, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
