"""LoRA (cleaner/engine/train/lora.py) on a tiny random Qwen3: only the adapters train, the KL
reference is the base with them disabled, the checkpoint holds the merged weights and the adapter,
and a LoRA checkpoint continues its adapters on their base."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.engine.train.lora import (
    ADAPTER_DIR,
    AdapterReference,
    LoraError,
    adapter_parameters,
    check_setup,
    meta_model,
    targeted,
    with_adapters,
)
from cleaner.engine.train.naive import full_logits_micro_batch_loss
from cleaner.engine.train.packing import pack_rows
from cleaner.engine.train.policy import TrainablePolicy, training
from cleaner.engine.train.step import batch_totals, forward_micro_batch
from cleaner.engine.train.trainer import train_iteration
from tests.factories import train_batch
from tests.helpers import tiny_qwen3

LORA = dict(lora_rank=4, lora_alpha=8)
ALL_TERMS = dict(kl_coef=0.3, rollout_is="token", entropy_coef=0.01)
TOLERANCE = 1e-5
FLOAT32_UNIT = 2.0**-24  # float32's unit roundoff


def _shifted(rows):
    """Behaviour log-probs away from the old ones, so rollout correction's IS weights move the loss."""
    return [dataclasses.replace(row, behavior_logprobs=tuple(lp + (0.3 if t % 2 else -1.0) for t, lp in
                                                             enumerate(row.old_logprobs))) for row in rows]


def _adapted(seed: int = 0, **config):
    """A PeftModel over tiny_qwen3(seed) with B drawn too (peft starts B at 0, so A would get no
    gradient), and an independent copy of its base: the reference, computed without peft."""
    base = tiny_qwen3(seed=seed)
    model = with_adapters(tiny_qwen3(seed=seed), TrainConfig(**LORA, **config), "base")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model, base.eval().requires_grad_(False)


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_a_lora_step_equals_the_same_peft_model_driven_directly(checkpointing):
    """The packed, chunked step over a PeftModel, its KL reference the same module with the adapters
    disabled, against the full-logits step (naive.py) on that PeftModel with the KL to an independent
    copy of the base: loss, metrics and every gradient within 1e-5, and gradients for the adapters only."""
    torch.set_num_threads(1)
    model, base = _adapted()
    config = TrainConfig(**LORA, **ALL_TERMS, logits_chunk_tokens=5, gradient_checkpointing=checkpointing)
    rows = _shifted(train_batch(base))
    total = batch_totals(rows, config)
    model.train()
    full = full_logits_micro_batch_loss(model, base, rows, config, total)
    full.loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    policy = TrainablePolicy(model, config, entropy_grad=True)
    with training(policy, config):
        part = forward_micro_batch(policy, AdapterReference(policy, policy), rows, pack_rows(rows), config, total)
        part.loss.backward()
    assert part.loss.item() == pytest.approx(full.loss.item(), abs=TOLERANCE)
    for metric in ("clip_fraction", "approx_kl", "entropy"):
        assert float(getattr(part, metric)) == pytest.approx(float(getattr(full, metric)), abs=TOLERANCE), metric
    got = _grads(model)
    assert got.keys() == expected.keys() and all(".lora_" in name for name in got) and len(got) == 2 * 14
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=TOLERANCE, rtol=1e-4, msg=name)
    assert policy.entropy and policy.entropy_grad  # the reference's forward left the policy as it was


def test_the_layers_checked_are_the_layers_peft_adapts_and_the_adapters_are_counted():
    config = TrainConfig(**LORA)
    for targets in ("all-linear", "q_proj,v_proj", "layers.1.mlp.down_proj"):
        model = tiny_qwen3()
        expected = set(targeted(model, targets))
        adapted = with_adapters(model, dataclasses.replace(config, lora_target_modules=targets), "base")
        found = {name.removeprefix("base_model.model.").removesuffix(".lora_A.default")
                 for name, _ in adapted.named_modules() if name.endswith(".lora_A.default")}
        assert found == expected, targets
        trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        with torch.device("meta"):  # counted without weights, as the memory estimate counts them
            structure = tiny_qwen3()
        assert adapter_parameters(structure, dataclasses.replace(config, lora_target_modules=targets)) \
            == trainable == adapter_parameters(adapted, config)
    assert len(targeted(tiny_qwen3(), "all-linear")) == 2 * 7  # q k v o gate up down, two layers; no lm_head


def test_new_adapters_are_drawn_from_the_seed_alone():
    """Whatever drew from torch's generator before, the adapters are the seed's (so both engines and
    every rank start from the same), and the caller's generator is left where it was."""
    def adapters(seed: int, draws: int) -> dict[str, torch.Tensor]:
        model = tiny_qwen3()
        torch.rand(draws)
        after = torch.random.get_rng_state()
        adapted = with_adapters(model, TrainConfig(**LORA, seed=seed), "base")
        assert torch.equal(torch.random.get_rng_state(), after)
        return {name: p.detach().clone() for name, p in adapted.named_parameters() if "lora_A" in name}

    first, second, other = adapters(0, 1), adapters(0, 7), adapters(1, 1)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)


@pytest.mark.parametrize(("targets", "expected"), [
    ("q_proj,qkv,c_attn", "has no module qkv or c_attn; its linear layers are down_proj, gate_proj, k_proj, "
                          "o_proj, q_proj, up_proj, v_proj"),
    ("lm_head", "has lm_head as its lm_head, whose weight the chunked head reads itself"),
    ("self_attn", "has self_attn as a Qwen3Attention (model.layers.0.self_attn), not a linear layer"),
])
def test_target_modules_the_model_lacks_are_named_with_what_it_has(targets, expected):
    with pytest.raises(LoraError) as raised:
        targeted(tiny_qwen3(), targets)
    assert expected in str(raised.value) and f"--lora-target-modules {targets}: model type 'qwen3'" in str(raised.value)


# ---------------------------------------------------------------------------
# The trainer: what trains, what is saved


def _trained(policy_dir, tmp_path, name="out", **changes):
    model = load_policy(policy_dir)
    config = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2, kl_coef=0.2, **LORA, **changes)
    return train_iteration(train_batch(model), policy_dir, tmp_path / name, config, 0, progress=False), config


def test_lora_training_moves_only_the_adapters_and_its_optimiser_holds_only_them(policy_dir, tmp_path):
    result, _ = _trained(policy_dir, tmp_path)
    assert len(result.steps) == 2 and all(s.grad_norm > 0 for s in result.steps)
    assert result.steps[1].approx_kl > 0  # the second step's policy moved: the KL has a value
    base = dict(load_policy(policy_dir).named_parameters())
    for name, parameter in result.model.named_parameters():
        if ".lora_" in name:
            continue
        assert torch.equal(parameter, base[name.removeprefix("base_model.model.").replace(".base_layer.", ".")]), name
    adapters = [p for name, p in result.model.named_parameters() if ".lora_" in name]
    assert {id(p) for group in result.optimization.optimizer.param_groups for p in group["params"]} == \
        {id(p) for p in adapters}
    state = result.optimization.optimizer.state
    assert len(state) == len(adapters) == 28 and all(state[p]["exp_avg"].shape == p.shape for p in adapters)
    assert not any(p.requires_grad for name, p in result.model.named_parameters() if ".lora_" not in name)


def test_a_lora_checkpoint_holds_the_merged_weights_at_its_root_and_the_adapter_apart(policy_dir, tmp_path):
    """The root: W + (alpha / r) B A for every adapted layer within float32's rounding of that sum,
    every other tensor the base's bit for bit, no adapter_config.json (a plain from_pretrained loads
    the merged model); adapter/: peft's layout, naming the base, loadable by PeftModel.from_pretrained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, config = _trained(policy_dir, tmp_path)
    out = result.out_path
    assert not (out / "adapter_config.json").exists() and (out / ADAPTER_DIR / "adapter_config.json").is_file()
    saved = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (saved["base_model_name_or_path"], saved["r"], saved["lora_alpha"]) == (str(policy_dir.resolve()), 4, 8)
    merged = load_file(out / "model.safetensors")
    base = load_file(policy_dir / "model.safetensors")
    adapter = load_file(out / ADAPTER_DIR / "adapter_model.safetensors")
    scaling = config.lora_alpha / config.lora_rank
    adapted = {key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
               for key in adapter if key.endswith(".lora_A.weight")}
    assert merged.keys() == base.keys() and len(adapted) == 14
    for name, weight in base.items():
        layer = name.removesuffix(".weight")
        if layer not in adapted:
            assert torch.equal(merged[name], weight), name
            continue
        a = adapter[f"base_model.model.{layer}.lora_A.weight"].double()  # (r, in)
        b = adapter[f"base_model.model.{layer}.lora_B.weight"].double()  # (out, r)
        exact = weight.double() + scaling * (b @ a)
        bound = FLOAT32_UNIT * (exact.abs() + (config.lora_rank + 2) * scaling * (b.abs() @ a.abs()))
        assert ((merged[name].double() - exact).abs() <= bound).all(), name
        assert not torch.equal(merged[name], weight)  # B moved off zero: the merge changes W
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name in plain.state_dict())
    reloaded = PeftModel.from_pretrained(load_policy(policy_dir), out / ADAPTER_DIR)
    trained = {name: p for name, p in result.model.named_parameters() if ".lora_" in name}
    assert all(torch.equal(p, trained[name]) for name, p in reloaded.named_parameters() if ".lora_" in name)
    ids = torch.tensor([train_batch(plain)[0].token_ids])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_two_lora_iterations_equal_one_continuous_training(policy_dir, tmp_path):
    """Iteration 1 from iteration 0's checkpoint (its base and adapter loaded, its adapters'
    optimiser resumed, the KL reference still the base) trains what the in-memory PeftModel and its
    AdamW train going on: the same adapters and step rows."""
    model = load_policy(policy_dir)
    rows = train_batch(model)
    config = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2, kl_coef=0.5, warmup_steps=3, **LORA)
    first = train_iteration(rows, policy_dir, tmp_path / "1", config, 0, progress=False)
    kept = {name: p.detach().clone() for name, p in first.model.named_parameters()}
    going_on = train_iteration(rows, tmp_path / "1", tmp_path / "2-memory", config, 1, model=first.model,
                               optimization=first.optimization, progress=False)
    from_disk = train_iteration(rows, tmp_path / "1", tmp_path / "2-disk", config, 1, progress=False)
    assert [s.loss for s in from_disk.steps] == [s.loss for s in going_on.steps]
    assert [s.optimizer_step for s in from_disk.steps] == [2, 3]
    assert [s.lr for s in from_disk.steps] == [s.lr for s in going_on.steps]
    for name, p in from_disk.model.named_parameters():
        assert torch.equal(p, dict(going_on.model.named_parameters())[name]), name
    moved = [name for name, p in going_on.model.named_parameters() if not torch.equal(p, kept[name])]
    assert moved and all(".lora_" in name for name in moved)
    assert json.loads((tmp_path / "2-disk" / ADAPTER_DIR / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(policy_dir.resolve())  # the original base, not iteration 1's merge


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lora_trains_in_16_bits_within_their_rounding_of_float32(policy_dir, tmp_path, dtype):
    """float16 (with its GradScaler, on the adapters alone) and bfloat16 autocast with gradient
    checkpointing: losses within 2e-2 and gradient norms within 5% of float32's, the base untouched."""
    fp32, _ = _trained(policy_dir, tmp_path, "fp32", gradient_checkpointing=True, compute_dtype="float32")
    low, _ = _trained(policy_dir, tmp_path, dtype, gradient_checkpointing=True, compute_dtype=dtype)
    assert [s.loss for s in low.steps] != [s.loss for s in fp32.steps]  # the 16-bit compute did run
    assert [s.loss for s in low.steps] == pytest.approx([s.loss for s in fp32.steps], abs=2e-2)
    assert [s.grad_norm for s in low.steps] == pytest.approx([s.grad_norm for s in fp32.steps], rel=5e-2)
    assert (low.optimization.scaler is not None) == (dtype == "float16")
    base = load_file(policy_dir / "model.safetensors")
    for name, p in low.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base[name.removeprefix("base_model.model.").replace(".base_layer.", ".")]), name


# ---------------------------------------------------------------------------
# Settings that cannot train the policy


def test_a_lora_checkpoint_continues_only_with_its_own_adapters_on_its_base(policy_dir, tmp_path):
    result, config = _trained(policy_dir, tmp_path)
    checkpoint = result.out_path
    check_setup(checkpoint, config)  # its own settings continue it
    with pytest.raises(LoraError, match="a LoRA checkpoint .rank 4 adapters on .*: continue it with --lora-rank 4 "
                                        "--lora-alpha 8 --lora-target-modules all-linear"):
        check_setup(checkpoint, TrainConfig())
    for other in (dict(lora_rank=8), dict(lora_alpha=16), dict(lora_target_modules="q_proj")):
        with pytest.raises(LoraError, match="are not the ones these settings train.* continue them with --lora-rank 4 "
                                            "--lora-alpha 8 --lora-target-modules all-linear"):
            check_setup(checkpoint, dataclasses.replace(config, **other))
    narrow = _trained(policy_dir, tmp_path, "narrow", lora_target_modules="layers.1.self_attn.q_proj,v_proj")[0]
    with pytest.raises(LoraError, match="continue it with --lora-rank 4 --lora-alpha 8 --lora-target-modules "
                                        "model.layers.0.self_attn.v_proj,model.layers.1.self_attn.q_proj,"
                                        "model.layers.1.self_attn.v_proj,"):
        check_setup(narrow.out_path, TrainConfig())
    check_setup(narrow.out_path, dataclasses.replace(config, lora_target_modules=(
        "model.layers.0.self_attn.v_proj,model.layers.1.self_attn.q_proj,model.layers.1.self_attn.v_proj")))
    settings = json.loads((checkpoint / ADAPTER_DIR / "adapter_config.json").read_text())
    settings["base_model_name_or_path"] = str(tmp_path / "gone")
    (checkpoint / ADAPTER_DIR / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(LoraError, match="continue on their base .*gone .*which cannot be loaded"):
        check_setup(checkpoint, config)
    with pytest.raises(LoraError, match="has no module wq"):
        check_setup(policy_dir, dataclasses.replace(config, lora_target_modules="wq"))
    assert isinstance(meta_model(policy_dir).model.embed_tokens.weight, torch.Tensor)


# ---------------------------------------------------------------------------
# What the backends serve


@pytest.mark.sglang
def test_the_sglang_engine_serves_a_merged_lora_checkpoint_as_the_torch_backend_does(sglang_engine, tiny_qwen3_dir,
                                                                                     tmp_path):
    """`make test-sglang`: the real SGLang engine on CPU loads a LoRA checkpoint's root (the merged
    weights; adapter/ beside them is not read) and scores its rows as the torch backend does from
    the same directory (within 1e-4), and as peft's base + adapter does: the adapters' policy, not the base."""
    from peft import PeftModel

    from cleaner.engine.model.torch_backend import TorchBackend
    from tests.helpers import assert_rows_close, naive_logprobs

    rows = train_batch(load_policy(tiny_qwen3_dir))
    config = TrainConfig(lr=1e-2, mini_batch_size=2, micro_batch_size=2, **LORA)
    checkpoint = train_iteration(rows, tiny_qwen3_dir, tmp_path / "lora", config, 0, progress=False).out_path
    sequences, starts = [list(row.token_ids) for row in rows], [row.prompt_len for row in rows]
    torch_backend = TorchBackend(checkpoint)
    try:
        expected = torch_backend.score(sequences, starts)
    finally:
        torch_backend.close()
    sglang_engine.adopt(checkpoint)
    try:
        served = sglang_engine.score(sequences, starts)
    finally:
        sglang_engine.adopt(tiny_qwen3_dir)  # the session's engine back on its weights
    assert_rows_close(served, expected, atol=1e-4)
    adapted = PeftModel.from_pretrained(load_policy(tiny_qwen3_dir), checkpoint / ADAPTER_DIR).eval()
    assert_rows_close(served, [naive_logprobs(adapted, s)[p - 1:] for s, p in zip(sequences, starts, strict=True)])
    base = [naive_logprobs(load_policy(tiny_qwen3_dir), s)[p - 1:] for s, p in zip(sequences, starts, strict=True)]
    assert max(abs(a - b) for got, want in zip(served, base, strict=True) for a, b in zip(got, want, strict=True)) > 1e-3


def test_the_room_a_lora_checkpoint_needs_is_what_it_takes(policy_dir, tmp_path):
    """space.py's estimate with LoRA: the merged weights, the adapter (float32) and its AdamW state
    alone; a LoRA checkpoint the trainer writes fits the room asked for, below a full checkpoint's."""
    from cleaner.engine.train import space

    assert space.checkpoint_bytes(1000, "float32", "torch", adapters=100) == 1000 * 4 + 100 * (4 + 8)
    assert space.checkpoint_bytes(1000, "bfloat16", "deepspeed", adapters=100) == 1000 * 2 + 100 * (4 + 12)
    result, config = _trained(policy_dir, tmp_path)
    written = sum(f.stat().st_size for f in result.out_path.rglob("*") if f.is_file())
    n = space.stored_parameters(policy_dir)
    estimate = space.checkpoint_bytes(n, "float32", "torch", space.other_bytes(policy_dir),
                                      adapter_parameters(result.model, config))
    full = space.checkpoint_bytes(n, "float32", "torch", space.other_bytes(policy_dir))
    # the tiny model's files are mostly headers, configs and peft's model card: the margin covers them
    assert estimate < written <= space.needed_bytes(estimate) and written < full


def test_the_train_job_asks_a_lora_checkpoint_its_own_room(policy_dir, tmp_path, monkeypatch):
    """Free space between a LoRA checkpoint's need and a full one's: the LoRA job goes on, the other
    is refused before training."""
    from cleaner.engine.train import space
    from cleaner.engine.train.job import TrainRequest, _check_room
    from cleaner.errors import JobError

    n, other = space.stored_parameters(policy_dir), space.other_bytes(policy_dir)
    lora = TrainConfig(**LORA)
    adapters = adapter_parameters(meta_model(policy_dir), lora)
    monkeypatch.setattr(space, "free_bytes", lambda path: space.needed_bytes(
        space.checkpoint_bytes(n, "float32", "torch", other, adapters)))
    _check_room(TrainRequest(0, "c", policy_dir, tmp_path / "out", lora), None)
    with pytest.raises(JobError, match="the checkpoint needs about"):
        _check_room(TrainRequest(0, "c", policy_dir, tmp_path / "out", TrainConfig()), None)
