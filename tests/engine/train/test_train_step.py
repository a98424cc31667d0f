"""The train step at real shapes against the full-logits step it replaces (policy.py, packing.py,
logprobs.py against naive.py): packed rows, log-probs and entropy from hidden states in chunks,
token-budget micro batches, gradient checkpointing, bfloat16 compute and save dtype.

Every equality is on the loss, each reported metric and every parameter's gradient, within 1e-5 in
float32, on the tiny policy and on a proxy with Qwen's real 151,936-token vocabulary."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch
from safetensors import safe_open

from cleaner.config import TrainConfig
from cleaner.engine.model.head import UnsupportedModelError
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.naive import full_logits_micro_batch_loss
from cleaner.engine.train.optim import STATE_PATH, load_optimization
from cleaner.engine.train.packing import pack_rows
from cleaner.engine.train.policy import TrainablePolicy, training
from cleaner.engine.train.step import ReferenceLogProbs, batch_totals, forward_micro_batch
from cleaner.engine.train.trainer import train_iteration
from tests.factories import train_batch, train_row, with_old_logprobs
from tests.helpers import tiny_qwen3

REAL_VOCAB = 151_936
TOLERANCE = 1e-5


def _shifted_behaviour(rows):
    """Behaviour log-probs away from the old ones (IS weights e^-0.3 and e^1 -> capped), so the
    truncated-IS term changes the loss."""
    return [dataclasses.replace(row, behavior_logprobs=tuple(
        lp + (0.3 if t % 2 else -1.0) for t, lp in enumerate(row.old_logprobs))) for row in rows]


def _step(model, reference, rows, config, chunked: bool):
    """Loss, metrics and every parameter's gradient of one micro batch."""
    total = batch_totals(rows, config)
    model.zero_grad(set_to_none=True)
    if chunked:
        policy = TrainablePolicy(model, config, entropy_grad=config.entropy_coef > 0)
        ref = (ReferenceLogProbs.compute(TrainablePolicy(reference, config, entropy=False), rows, config, "cpu")
               if reference is not None else None)
        with training(policy, config):
            part = forward_micro_batch(policy, ref, rows, pack_rows(rows), config, total)
            part.loss.backward()
    else:
        model.train()
        part = full_logits_micro_batch_loss(model, reference, rows, config, total)
        part.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return part, grads


def _assert_same_step(model, reference, rows, config, baseline=None):
    full, full_grads = baseline or _step(model, reference, rows, config, chunked=False)
    chunked, chunked_grads = _step(model, reference, rows, config, chunked=True)
    assert chunked.loss.item() == pytest.approx(full.loss.item(), abs=TOLERANCE)
    for metric in ("clip_fraction", "approx_kl", "entropy", "pg_loss", "kl_loss", "ppo_kl", "clip_fraction_lower"):
        assert float(getattr(chunked, metric)) == pytest.approx(float(getattr(full, metric)), abs=TOLERANCE), metric
    assert chunked_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=TOLERANCE, rtol=1e-4, msg=name)


ALL_TERMS = dict(kl_coef=0.3, rollout_is="token", entropy_coef=0.01)
# sequence-level objectives: the padded (B, T) path sums each row as the packed one does
ROW_TERMS = {"gspo": dict(loss_mode="gspo", kl_coef=0.3, entropy_coef=0.01),
             "geo_mean-norm": dict(loss_mode="geo_mean", loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.3,
                                   entropy_coef=0.01, loss_scale_factor=7)}


@pytest.fixture(scope="module")
def tiny():
    """The tiny policy (random, vocabulary 64), a different reference, and rows that move away from
    ratio 1 (the old log-probs are the reference's)."""
    torch.set_num_threads(1)
    model, reference = tiny_qwen3(seed=0), tiny_qwen3(seed=1).eval().requires_grad_(False)
    rows = _shifted_behaviour(with_old_logprobs(reference, train_batch(model)))
    return model, reference, rows


@pytest.mark.parametrize("terms", [{}, ALL_TERMS, *ROW_TERMS.values()], ids=["plain", "kl+is+entropy", *ROW_TERMS])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
def test_chunked_step_equals_the_full_logits_step_on_the_tiny_policy(tiny, terms, chunk_tokens):
    model, reference, rows = tiny
    config = TrainConfig(logits_chunk_tokens=chunk_tokens, **terms)
    _assert_same_step(model, reference, rows, config)


@pytest.fixture(scope="module")
def real_vocabulary():
    """A Qwen3 proxy with the real vocabulary (hidden 32, one layer) and two rows of 300 and 75
    tokens: the (B, T, V) logits are 91M floats."""
    torch.set_num_threads(1)
    model = tiny_qwen3(seed=0, vocab_size=REAL_VOCAB, num_hidden_layers=1)
    reference = tiny_qwen3(seed=1, vocab_size=REAL_VOCAB, num_hidden_layers=1).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(3)
    rows = [train_row(f"r{i}", "g", torch.randint(0, REAL_VOCAB, (length,), generator=generator).tolist(),
                      length // 4, float(i), 1.0 - 2 * i) for i, length in enumerate((300, 75))]
    return model, reference, _shifted_behaviour(with_old_logprobs(reference, rows))


def test_chunked_step_equals_the_full_logits_step_at_the_real_vocabulary(real_vocabulary):
    model, reference, rows = real_vocabulary
    config = TrainConfig(logits_chunk_tokens=128, **ALL_TERMS)
    baseline = _step(model, reference, rows, config, chunked=False)
    _assert_same_step(model, reference, rows, config, baseline)
    # the same with gradient checkpointing: recomputed layers, the same numbers
    _assert_same_step(model, reference, rows, dataclasses.replace(config, gradient_checkpointing=True), baseline)


def test_gradient_checkpointing_gives_the_same_step_and_is_switched_off_after(tiny):
    model, reference, rows = tiny
    config = TrainConfig(gradient_checkpointing=True, **ALL_TERMS)
    _assert_same_step(model, reference, rows, config)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert not model.training and model.config._attn_implementation == "sdpa"  # its own attention back
    with torch.inference_mode():  # the backend generates this way; no hook left to break it
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_packed_rows_never_attend_across_rows(tiny):
    """A row's log-probs are the same alone as packed behind other rows in one decoder call (no
    cross-row attention, positions restart at each row)."""
    model, _, rows = tiny
    policy = TrainablePolicy(model, TrainConfig())
    with torch.no_grad():
        together = policy(pack_rows(rows)).log_probs
        alone = torch.cat([policy(pack_rows([row])).log_probs for row in rows])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)


def _alone(model, row) -> torch.Tensor:
    """The model's own forward of one row, unpacked: log pi of its loss tokens. (M,)"""
    with torch.no_grad():
        ids = torch.tensor([row.token_ids])
        logits = model(input_ids=ids).logits[0, :-1].float()
        picked = logits.gather(-1, ids[0, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    return picked[torch.tensor(row.loss_mask[1:], dtype=torch.bool)]


def test_positions_restart_at_each_packed_row():
    """A model whose output depends on the absolute position (GPT-2's learned position embeddings):
    packed rows give each row's own log-probs only because positions restart per row, and globally
    numbered positions would not (checked, so this test can fail)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       eos_token_id=0, bos_token_id=0)).eval()
    rows = train_batch(tiny_qwen3(seed=0))[:3]
    policy = TrainablePolicy(model, TrainConfig())
    packed = pack_rows(rows)
    with torch.no_grad():
        together = policy(packed).log_probs
        globally = policy(dataclasses.replace(packed, position_ids=torch.arange(len(packed.token_ids)))).log_probs
    alone = torch.cat([_alone(model, row) for row in rows])
    torch.testing.assert_close(together, alone, atol=TOLERANCE, rtol=0)
    assert (globally - alone).abs().max() > 1e-2  # the model does read absolute positions


def test_a_sliding_window_model_is_packed_exactly_within_its_window_and_refused_beyond():
    """Within its window sliding attention is causal attention: packed rows of at most 8 tokens give
    the model's own unpacked log-probs; a row past the window is refused by name before training."""
    from cleaner.engine.model.head import check_attention

    model = tiny_qwen3(seed=2, layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                       use_sliding_window=True).eval()
    assert model.model.layers[1].self_attn.sliding_window == 8
    rows = [train_row(f"r{i}", "g", [3 + i, 5, 7, 9, 11, 13, 15, 17][: 6 + i % 3], 2, 1.0, 0.5) for i in range(4)]
    policy = TrainablePolicy(model, TrainConfig())
    with torch.no_grad():
        together = policy(pack_rows(rows)).log_probs
    torch.testing.assert_close(together, torch.cat([_alone(model, row) for row in rows]), atol=TOLERANCE, rtol=0)
    long_rows = rows + [train_row("long", "g", list(range(1, 13)), 2, 1.0, 0.5)]
    with pytest.raises(UnsupportedModelError, match=r"sliding window of 8 tokens \(config layer_types, sliding_window\)"):
        check_attention(model, max(len(r.token_ids) for r in long_rows))
    with pytest.raises(UnsupportedModelError, match="longer than the layer's sliding window of 8"):
        with torch.no_grad():
            policy(pack_rows(long_rows))  # and the attention itself refuses, should a caller skip the check


def test_gradient_checkpointing_really_recomputes_the_layers(tiny):
    """With --gradient-checkpointing each decoder layer runs again in backward; without it, never."""
    model, reference, rows = tiny
    calls = []
    # on the layer's first submodule, with a pre hook: transformers checkpoints a layer's forward
    # (its own hooks stay outside), and a recomputation stops once it has what backward needs
    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
             for layer in model.model.layers]
    try:
        for checkpointing in (False, True):
            calls.clear()
            config = TrainConfig(gradient_checkpointing=checkpointing)
            policy = TrainablePolicy(model, config)
            with training(policy, config):
                out = policy(pack_rows(rows))
                forwards = len(calls)
                out.log_probs.sum().backward()
            assert forwards == len(model.model.layers)
            assert len(calls) - forwards == (len(model.model.layers) if checkpointing else 0), checkpointing
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)


def test_bfloat16_chunked_gradients_equal_bfloat16_full_logits_ones(tiny):
    """The chunked head in bfloat16 against the full-logits step in bfloat16 autocast: loss and every
    gradient, the head's weight included, within bfloat16's rounding (a dropped head gradient or a
    float32 head would be far outside it)."""
    model, reference, rows = tiny
    config = TrainConfig(compute_dtype="bfloat16")
    chunked, chunked_grads = _step(model, reference, rows, config, chunked=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, full_grads = _step(model, reference, rows, config, chunked=False)
    assert chunked.loss.item() == pytest.approx(full.loss.item(), abs=2e-2)
    assert "lm_head.weight" in chunked_grads or "model.embed_tokens.weight" in chunked_grads
    for name, grad in full_grads.items():
        scale = grad.abs().max().item()
        assert (chunked_grads[name] - grad).abs().max().item() <= 0.05 * scale + 1e-6, name


def test_bfloat16_compute_stays_close_and_keeps_float32_weights_and_log_softmax(tiny):
    model, reference, rows = tiny
    config = TrainConfig(**ALL_TERMS)
    fp32, _ = _step(model, reference, rows, config, chunked=True)
    bf16, grads = _step(model, reference, rows, dataclasses.replace(config, compute_dtype="bfloat16"),
                        chunked=True)
    assert bf16.loss.dtype == torch.float32 and bf16.loss.item() != fp32.loss.item()  # bf16 did run
    assert bf16.loss.item() == pytest.approx(fp32.loss.item(), abs=2e-2)
    assert float(bf16.entropy) == pytest.approx(float(fp32.entropy), rel=2e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_a_model_whose_logits_are_not_its_head_is_refused():
    model = tiny_qwen3(seed=0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping = 30.0"):
        TrainablePolicy(model, TrainConfig())


# ---------------------------------------------------------------------------
# Whole iterations: token budgets, save dtype, the KL and IS terms


def _weights_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max((p.float() - q.float()).abs().max().item() for p, q in pairs)


def test_token_budget_micro_batches_give_the_update_of_fixed_micro_batches(policy_dir, tmp_path):
    rows = train_batch(load_policy(policy_dir))  # 9, 12, 7 and 10 tokens
    base = TrainConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=1)
    fixed = train_iteration(rows, policy_dir, tmp_path / "fixed", base, 0, progress=False)
    budget = dataclasses.replace(base, max_tokens_per_micro_batch=20)  # [12, 7], [10, 9]
    packed = train_iteration(rows, policy_dir, tmp_path / "packed", budget, 0, progress=False)
    tiny_budget = dataclasses.replace(base, max_tokens_per_micro_batch=5)  # every row alone, untruncated
    alone = train_iteration(rows, policy_dir, tmp_path / "alone", tiny_budget, 0, progress=False)
    for result in (packed, alone):
        step, want = result.steps[0], fixed.steps[0]
        assert (step.loss, step.entropy, step.tokens) == pytest.approx((want.loss, want.entropy, want.tokens),
                                                                       abs=TOLERANCE)
        assert step.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
        assert _weights_difference(result.model, fixed.model) < TOLERANCE


def test_kl_and_rollout_is_terms_reach_the_step_loss(policy_dir, tmp_path):
    """The step's loss equals the hand-assembled objective, -sum(A w)/N + kl_coef sum(k3)/N, with the
    IS weights w and the reference's log-probs computed here independently; both terms are material,
    so deleting either branch from the train step fails this test."""
    from tests.helpers import naive_logprobs

    model = load_policy(policy_dir)
    with torch.no_grad():  # the trained policy moves away from the reference (the checkpoint)
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    rows = _shifted_behaviour(train_batch(model))  # old log-probs = the moved policy's: ratio 1
    config = TrainConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=2, kl_coef=0.5, rollout_is="token",
                         rollout_is_threshold=2.0)
    result = train_iteration(rows, policy_dir, tmp_path / "out", config, 0, model=model, progress=False)

    reference = load_policy(policy_dir)
    surrogate, kl, count = 0.0, 0.0, 0
    for row in rows:
        reference_lp = [0.0, *naive_logprobs(reference, list(row.token_ids))]
        for t in range(1, len(row.token_ids)):
            if not row.loss_mask[t]:
                continue
            weight = min(float(torch.tensor(row.old_logprobs[t] - row.behavior_logprobs[t]).exp()), 2.0)
            surrogate += -row.advantage * weight
            d = reference_lp[t] - row.old_logprobs[t]
            kl += float(torch.tensor(d).exp()) - d - 1.0
            count += 1
    plain = -sum(row.advantage * sum(row.loss_mask[1:]) for row in rows) / count
    assert abs(surrogate / count - plain) > 1e-2 and kl / count > 1e-3  # both terms matter here
    assert result.steps[0].loss == pytest.approx(surrogate / count + 0.5 * kl / count, abs=1e-5)
    assert result.steps[0].approx_kl == pytest.approx(0.0, abs=1e-6)  # ratio 1 to the old policy


def test_the_reference_runs_once_per_iteration_in_the_compute_dtype_then_is_freed(policy_dir, tmp_path,
                                                                                 monkeypatch):
    """Two epochs of micro batches of two rows: the reference forwards each row once (not per micro
    batch and epoch), in bfloat16 under --compute-dtype bfloat16, and no reference model is alive
    when the policy trains."""
    import gc
    import weakref

    import cleaner.engine.train.step as step

    loaded, forwarded = [], []
    original = step.load_reference

    def load(path, config, device):
        reference = original(path, config, device)
        loaded.append((weakref.ref(reference), {p.dtype for p in reference.parameters()}))
        reference.register_forward_hook(lambda module, args, out: forwarded.append(len(args[0].row_lengths)))
        return reference

    monkeypatch.setattr(step, "load_reference", load)
    rows = train_batch(load_policy(policy_dir))
    config = TrainConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=2, kl_coef=0.5, epochs=2,
                         compute_dtype="bfloat16")
    alive = []
    monkeypatch.setattr(step.StepMetrics, "add", lambda self, part, weight=1.0, _add=step.StepMetrics.add: (
        gc.collect(), alive.append(loaded[0][0]() is not None), _add(self, part, weight))[2])
    train_iteration(rows, policy_dir, tmp_path / "out", config, 0, progress=False)
    assert len(loaded) == 1 and loaded[0][1] == {torch.bfloat16}
    assert sum(forwarded) == len(rows)  # every row once, over 2 epochs of 2-row micro batches
    assert alive and not any(alive)  # freed before the first micro batch of the policy


def test_bfloat16_checkpoint_is_served_in_bfloat16_and_resumes_exactly(policy_dir, tmp_path):
    """--save-dtype bfloat16: the weights on disk are bfloat16 and config.json says so; resuming from
    that checkpoint continues from the float32 master weights, as if training had not stopped."""
    model = load_policy(policy_dir)
    rows = train_batch(model)
    config = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2, save_dtype="bfloat16")
    first = train_iteration(rows, policy_dir, tmp_path / "one", config, 0, model=model, progress=False)
    with safe_open(first.out_path / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
        assert "lm_head.weight" not in weights.keys()  # tied to the embedding: saved once
    assert json.loads((first.out_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert "master_weights" in torch.load(first.out_path / STATE_PATH, weights_only=True)
    on = train_iteration(rows, first.out_path, tmp_path / "on", config, 1, model=first.model,
                         optimization=first.optimization, progress=False)
    resumed = train_iteration(rows, first.out_path, tmp_path / "resumed", config, 1, progress=False)
    assert resumed.model.dtype == torch.float32
    assert _weights_difference(resumed.model, on.model) == 0.0
    # the bfloat16 weights alone would not continue exactly
    assert _weights_difference(load_policy(first.out_path), first.model) > 0


def test_a_float16_iteration_equals_float32_within_its_rounding_and_a_nonfinite_step_is_skipped(policy_dir, tmp_path):
    """--compute-dtype float16 (the reference's) on a stored iteration's rows: float16 autocast with
    a GradScaler. The loss of every step within 2e-2 of float32's and the weights it writes within
    2e-3 of float32's (lr 1e-3, two steps: float16's 11-bit mantissa, against float32's rounding);
    the logged gradient norms are the true ones (unscaled before clipping), within 5% of float32's;
    the scaler is verl's (growth interval 400). A step whose scaled gradients overflow is skipped
    (weights unchanged, grad norm non-finite in its row), the schedule still moves on, the scale
    halves, and a checkpoint's scale is resumed through load_optimization."""
    model = load_policy(policy_dir)
    rows = train_batch(model)
    base = TrainConfig(lr=1e-3, mini_batch_size=2, micro_batch_size=2, save_dtype="float16")
    fp32 = train_iteration(rows, policy_dir, tmp_path / "fp32", dataclasses.replace(base, compute_dtype="float32"), 0,
                           model=load_policy(policy_dir), progress=False)
    fp16 = train_iteration(rows, policy_dir, tmp_path / "fp16", dataclasses.replace(base, compute_dtype="float16"), 0,
                           model=load_policy(policy_dir), progress=False)
    assert [s.loss for s in fp16.steps] != [s.loss for s in fp32.steps]  # float16 did run
    assert [s.loss for s in fp16.steps] == pytest.approx([s.loss for s in fp32.steps], abs=2e-2)
    assert _weights_difference(fp16.model, fp32.model) < 2e-3
    assert [s.grad_norm for s in fp16.steps] == pytest.approx([s.grad_norm for s in fp32.steps], rel=5e-2)
    assert fp16.optimization.scaler.state_dict()["growth_interval"] == 400  # verl's ShardedGradScaler's
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())  # master weights stay float32
    saved = torch.load(fp16.out_path / STATE_PATH, weights_only=True)
    assert saved["scaler"]["scale"] == fp16.optimization.scaler.get_scale() > 0
    with safe_open(fp16.out_path / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float16}
    # an overflow: the scale at float16's largest value makes any gradient infinite
    optimization = fp16.optimization
    optimization.scaler.update(65504.0 * 2**10)
    before = {name: p.detach().clone() for name, p in fp16.model.named_parameters()}
    step_before = optimization.step
    again = train_iteration(rows[:2], fp16.out_path, tmp_path / "overflow", dataclasses.replace(
        base, compute_dtype="float16"), 1, model=fp16.model, optimization=optimization, progress=False)
    assert not math.isfinite(again.steps[0].grad_norm)
    assert all(torch.equal(p, before[name]) for name, p in again.model.named_parameters())
    assert optimization.scaler.get_scale() == 65504.0 * 2**10 / 2
    assert again.steps[0].optimizer_step == step_before and optimization.step == step_before + 1
    resumed = load_optimization(load_policy(again.out_path), dataclasses.replace(base, compute_dtype="float16"),
                                again.out_path)
    assert resumed.scaler.state_dict() == optimization.scaler.state_dict()
    assert resumed.step == optimization.step


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU; not run in this project's CI)


@pytest.mark.gpu
def test_flash_attention_runs_packed_rows_as_varlen_and_equals_the_cpu_step():
    """On CUDA with flash-attn and bfloat16 the packed rows go through flash attention's varlen
    kernel; the log-probs equal the float32 CPU step's (packed SDPA) within bfloat16's precision."""
    pytest.importorskip("flash_attn")
    from cleaner.engine.train.policy import FLASH_ATTENTION, packed_attention_for

    model = tiny_qwen3(seed=0)
    rows = train_batch(model)
    with torch.no_grad():
        cpu = TrainablePolicy(model, TrainConfig())(pack_rows(rows)).log_probs
        config = TrainConfig(compute_dtype="bfloat16", device="cuda")
        assert packed_attention_for(torch.device("cuda"), torch.bfloat16) == FLASH_ATTENTION
        cuda = TrainablePolicy(model.cuda(), config)(pack_rows(rows, "cuda")).log_probs.cpu()
    torch.testing.assert_close(cuda, cpu, atol=3e-2, rtol=3e-2)


def test_the_fused_causal_attention_equals_transformers_sdpa_on_grouped_heads():
    """fused_causal_attention (what packed rows use on a GPU: K/V copied per query head, fused
    kernels only) computes what transformers' SDPA path does; here on the CPU, whose flash kernel is
    one of the fused ones."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from cleaner.engine.train.policy import fused_causal_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 37, 16, generator=generator)
    key, value = torch.randn(1, 2, 37, 16, generator=generator), torch.randn(1, 2, 37, 16, generator=generator)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    expected, _ = sdpa_attention_forward(module, query, key, value, None, is_causal=True, scaling=0.25)
    torch.testing.assert_close(fused_causal_attention(query, key, value, 0.25), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_on_a_gpu_never_builds_the_scores(dtype):
    """A 16,384-token row of 16 heads over 8 KV heads: the math kernel would allocate 16 GiB of
    float32 scores; the fused kernels stay within a few hundred MB."""
    from cleaner.engine.train.policy import fused_causal_attention

    query = torch.randn(1, 16, 16_384, 128, device="cuda", dtype=dtype)
    key, value = (torch.randn(1, 8, 16_384, 128, device="cuda", dtype=dtype) for _ in range(2))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fused_causal_attention(query, key, value, None)
    torch.cuda.synchronize()
    assert out.shape == (1, 16_384, 16, 128)
    assert torch.cuda.max_memory_allocated() - before < 2 * 2**30
