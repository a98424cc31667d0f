"""Atomic checkpoints (cleaner/engine/train/checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

from cleaner.engine.models import load_policy, load_tokenizer_if_present
from cleaner.engine.train.checkpoint import atomic_directory, save_checkpoint_atomic
from tests.helpers import tiny_qwen3


def _tiny_model(seed: int):
    return tiny_qwen3(seed=seed, num_hidden_layers=1)


def _same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _siblings(out_path):
    return sorted(p.name for p in out_path.parent.iterdir())


def test_existing_checkpoint_is_replaced_whole(tmp_path):
    out_path = tmp_path / "policy"
    save_checkpoint_atomic(_tiny_model(0), None, out_path)
    (out_path / "stale.txt").write_text("from the old checkpoint")
    new_model = _tiny_model(1)
    save_checkpoint_atomic(new_model, None, out_path, extra_files={"note.txt": "new"})
    assert not (out_path / "stale.txt").exists()
    assert (out_path / "note.txt").read_text() == "new"
    assert _same_weights(load_policy(out_path), new_model)
    assert _siblings(out_path) == ["policy"]  # no temp or aside directories left


def test_failure_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    out_path = tmp_path / "policy"
    old_model = _tiny_model(0)
    save_checkpoint_atomic(old_model, None, out_path)
    before = sorted(p.name for p in out_path.iterdir())

    new_model = _tiny_model(1)

    def crash(self, save_directory, **kwargs):
        (save_directory / "partial.bin").write_bytes(b"half")  # something was written, then...
        raise OSError("disk full")

    monkeypatch.setattr(type(new_model), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint_atomic(new_model, None, out_path)
    assert sorted(p.name for p in out_path.iterdir()) == before
    assert _same_weights(load_policy(out_path), old_model)
    assert _siblings(out_path) == ["policy"]


def test_failure_on_a_fresh_path_leaves_nothing(tmp_path):
    out_path = tmp_path / "nested" / "policy"
    with pytest.raises(RuntimeError):
        with atomic_directory(out_path) as temp_dir:
            (temp_dir / "weights").write_text("x")
            raise RuntimeError("crash")
    assert not out_path.exists()
    assert list(out_path.parent.iterdir()) == []


def test_tokenizer_is_optional(tmp_path):
    out_path = save_checkpoint_atomic(_tiny_model(0), None, tmp_path / "policy")
    assert load_tokenizer_if_present(out_path) is None


def test_tokenizer_travels_with_the_checkpoint(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(
        models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    )
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    source = tmp_path / "source"
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]").save_pretrained(source)
    tokenizer = load_tokenizer_if_present(source)
    out_path = save_checkpoint_atomic(_tiny_model(0), tokenizer, tmp_path / "policy")
    assert load_tokenizer_if_present(out_path).encode("world hello") == [2, 1]
