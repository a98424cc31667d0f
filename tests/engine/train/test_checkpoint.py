"""Atomic checkpoints (cleaner/engine/train/checkpoint.py, cleaner/outputs.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cleaner.config import DEFAULT_POLICY
from cleaner.engine.model.loading import load_policy, load_tokenizer_if_present
from cleaner.engine.train.checkpoint import save_checkpoint_atomic
from cleaner.errors import WriteError
from cleaner.outputs import MARKER, OutputError, atomic_directory, check_replaceable
from tests.factories import make_rollout, make_segments
from tests.helpers import tiny_qwen3, tree_digest


def _tiny_model(seed: int):
    return tiny_qwen3(seed=seed, num_hidden_layers=1)


def _same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _siblings(out_path):
    return sorted(p.name for p in out_path.parent.iterdir())


def test_existing_checkpoint_is_replaced_whole(tmp_path):
    out_path = tmp_path / "policy"
    save_checkpoint_atomic(_tiny_model(0), None, out_path, extra_files={"stale.txt": "from the old checkpoint"})
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
    with pytest.raises(WriteError, match=f"^{out_path}: cannot write it \\(disk full\\)$"):
        save_checkpoint_atomic(new_model, None, out_path)
    assert sorted(p.name for p in out_path.iterdir()) == before
    assert _same_weights(load_policy(out_path), old_model)
    assert _siblings(out_path) == ["policy"]


def test_failure_on_a_fresh_path_leaves_nothing(tmp_path):
    out_path = tmp_path / "nested" / "policy"
    with pytest.raises(RuntimeError):
        with atomic_directory(out_path, "checkpoint") as temp_dir:
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


# ---------------------------------------------------------------------------
# Replacing only what cleaner wrote


def test_a_checkpoint_lists_what_it_holds_in_its_marker(tmp_path):
    out_path = save_checkpoint_atomic(_tiny_model(0), None, tmp_path / "policy", extra_files={"note.txt": "n"})
    marker = json.loads((out_path / MARKER).read_text())
    assert marker == {"written_by": "cleaner", "kind": "checkpoint",
                      "entries": ["config.json", "generation_config.json", "model.safetensors", "note.txt"]}


def _refused_untouched(out_path, match: str, kind: str = "checkpoint") -> None:
    """Saving at out_path raises OutputError before the model is asked to save, and leaves
    out_path and its parent exactly as they were."""
    before, parent_before = tree_digest(out_path), sorted(p.name for p in out_path.parent.iterdir())
    model = _tiny_model(0)
    with pytest.raises(OutputError, match=match):
        if kind == "checkpoint":
            save_checkpoint_atomic(model, None, out_path)
        else:
            with atomic_directory(out_path, kind):
                pytest.fail("the block ran although the output is refused")
    assert tree_digest(out_path) == before
    assert sorted(p.name for p in out_path.parent.iterdir()) == parent_before  # no temp or aside left


def test_a_warehouse_is_never_replaced(tmp_path):
    from cleaner.warehouse import Warehouse

    warehouse = Warehouse(tmp_path / "warehouse")
    warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    _refused_untouched(warehouse.root, "cleaner did not write it .no .cleaner-output.json; it holds .warehouse.json, rollouts, segments")


def test_a_directory_with_a_user_file_is_never_replaced(tmp_path):
    out_path = tmp_path / "mine"
    out_path.mkdir()
    (out_path / "notes.txt").write_text("my notes")
    _refused_untouched(out_path, "no .cleaner-output.json; it holds notes.txt")


def test_a_file_is_never_replaced(tmp_path):
    out_path = tmp_path / "model.txt"
    out_path.write_text("not a directory")
    _refused_untouched(out_path, "it exists and is a file")


def test_a_file_added_to_a_checkpoint_keeps_it(tmp_path):
    out_path = save_checkpoint_atomic(_tiny_model(0), None, tmp_path / "policy")
    (out_path / "notes.txt").write_text("added by the user")
    _refused_untouched(out_path, "it holds what cleaner did not write there: notes.txt")


def test_a_checkpoint_is_not_replaced_by_a_report(tmp_path):
    out_path = save_checkpoint_atomic(_tiny_model(0), None, tmp_path / "policy")
    _refused_untouched(out_path, "it is a checkpoint cleaner wrote, not a report", kind="report")


def test_an_empty_directory_is_taken(tmp_path):
    (tmp_path / "policy").mkdir()
    model = _tiny_model(0)
    assert _same_weights(load_policy(save_checkpoint_atomic(model, None, tmp_path / "policy")), model)


def test_a_checkpoint_written_before_the_marker_is_replaced(tmp_path):
    """The shipped policies have no marker; their files say they are cleaner's checkpoints."""
    old = tmp_path / "tiny-policy"
    shutil.copytree(DEFAULT_POLICY, old)
    assert not (old / MARKER).exists()
    check_replaceable(old, "checkpoint")
    model = _tiny_model(1)
    save_checkpoint_atomic(model, None, old)
    assert _same_weights(load_policy(old), model) and not (old / "tokenizer.json").exists()


def test_a_model_that_cleaner_did_not_train_is_not_taken_for_a_checkpoint(tmp_path):
    """config.json and weights alone (any save_pretrained) are not enough: an earlier cleaner
    always saved its train or bootstrap config beside them."""
    other = tmp_path / "downloaded"
    _tiny_model(0).save_pretrained(other)
    _refused_untouched(other, "no .cleaner-output.json")


def test_a_parent_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a directory"):
        save_checkpoint_atomic(_tiny_model(0), None, tmp_path / "file" / "policy")


# ---------------------------------------------------------------------------
# A writer killed mid-write, and the room a checkpoint needs


KILLED_WRITER = """
import sys, time
from pathlib import Path
from cleaner.outputs import atomic_directory
with atomic_directory(Path(sys.argv[1]), "checkpoint") as temp_dir:
    (temp_dir / "model.safetensors").write_bytes(bytes(2**20))
    print(temp_dir.name, flush=True)
    time.sleep(120)
"""


def test_the_next_save_removes_what_a_killed_writer_left_and_nothing_else(tmp_path):
    """A SIGKILL mid-save leaves its hidden temporary directory (a whole model's size on a real
    model); the next save to that path removes it, but not a live writer's, nor another host's."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    out_path = tmp_path / "policy"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out_path)], stdout=subprocess.PIPE, text=True)
    left = tmp_path / writer.stdout.readline().strip()
    assert left.name.startswith(f".policy.tmp-{writer.pid}@{socket.gethostname()}@") and left.is_dir()
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    live = tmp_path / f".policy.tmp-{os.getpid()}@{socket.gethostname()}@abc"  # this process: alive
    elsewhere = tmp_path / f".policy.tmp-{writer.pid}@another-host@abc"  # cannot be checked from here
    other_output = tmp_path / f".report.tmp-{writer.pid}@{socket.gethostname()}@abc"  # another path's
    for directory in (live, elsewhere, other_output):
        directory.mkdir()
    save_checkpoint_atomic(tiny_qwen3(0), None, out_path)
    assert not left.exists()
    assert _siblings(out_path) == sorted([live.name, elsewhere.name, other_output.name, "policy"])


def test_the_room_a_checkpoint_needs_is_what_it_takes(tmp_path):
    """The estimate train checks before training (space.py), against a checkpoint the trainer's
    way of saving writes: float32 weights, AdamW's two float32 moments, the tokenizer."""
    from cleaner.engine.train import space
    from cleaner.engine.train.optim import STATE_PATH

    model = tiny_qwen3(0, vocab_size=512)
    n = sum(p.numel() for p in model.parameters())
    # 512 x 32 tied embedding; per layer q, k, v, o (1024 + 512 + 512 + 1024), q and k norms (8 + 8),
    # MLP (3 x 32 x 64) and two layer norms (32 + 32): 9,296; the final norm 32
    assert space.model_parameters(model) == n == 16_384 + 2 * 9_296 + 32
    policy = tmp_path / "policy"
    save_checkpoint_atomic(model, load_tokenizer_if_present(DEFAULT_POLICY), policy)
    assert space.stored_parameters(policy) == n
    moments = {"exp_avg": [torch.zeros_like(p) for p in model.parameters()],
               "exp_avg_sq": [torch.zeros_like(p) for p in model.parameters()]}
    out = tmp_path / "out"
    save_checkpoint_atomic(model, load_tokenizer_if_present(policy), out, state_files={STATE_PATH: moments})
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    estimate = space.checkpoint_bytes(n, "float32", "torch", space.other_bytes(policy))
    assert n * 12 <= estimate and abs(estimate - written) / written < 0.05
    on_disk = sum(f.stat().st_blocks * 512 for f in out.rglob("*") if f.is_file())  # rounded to blocks
    assert estimate < on_disk <= space.needed_bytes(estimate)  # the content alone is short; the room asked is not
    assert space.checkpoint_bytes(1000, "bfloat16") == 1000 * (2 + 8 + 4)  # + the float32 master weights
    assert space.checkpoint_bytes(1000, "float32", "deepspeed") == 1000 * (4 + 12)
    assert space.stored_parameters(tmp_path / "absent") is None


# ---------------------------------------------------------------------------
# Permissions and racing writers


@pytest.mark.parametrize("umask", [0o022, 0o077], indirect=True)
def test_a_checkpoint_is_made_as_mkdir_and_open_make_them(tmp_path, umask):
    """Under umask 022 a server or a colleague under another account reads it (folders 755, files
    644); under 077 it stays private (700, 600)."""
    from tests.helpers import wrong_modes

    out_path = save_checkpoint_atomic(_tiny_model(0), None, tmp_path / "policy",
                                      state_files={"optimizer/state.pt": {"step": 1}})
    assert (out_path / "optimizer" / "state.pt").is_file()
    assert wrong_modes(out_path, umask) == []


def test_an_output_that_appeared_while_writing_is_kept_and_the_later_writer_fails(tmp_path):
    """Two writers of one new path: the first to finish wins; the other leaves it as it is and says
    so in one line, and leaves nothing of its own behind."""
    out_path = tmp_path / "policy"
    with pytest.raises(OutputError, match="another writer put a checkpoint there while this one was writing"):
        with atomic_directory(out_path, "checkpoint") as late:
            (late / "config.json").write_text("late")
            save_checkpoint_atomic(_tiny_model(0), None, out_path, extra_files={"note.txt": "first"})
    assert (out_path / "note.txt").read_text() == "first"
    assert _siblings(out_path) == ["policy"]


def test_an_output_replaced_while_writing_is_kept(tmp_path):
    """--overwrite of an existing output: one that another writer replaced meanwhile is not
    replaced again."""
    out_path = tmp_path / "policy"
    save_checkpoint_atomic(_tiny_model(0), None, out_path, extra_files={"note.txt": "old"})
    with pytest.raises(OutputError, match="another writer put a checkpoint there"):
        with atomic_directory(out_path, "checkpoint") as late:
            (late / "config.json").write_text("late")
            save_checkpoint_atomic(_tiny_model(1), None, out_path, extra_files={"note.txt": "replaced"})
    assert (out_path / "note.txt").read_text() == "replaced"
    assert _siblings(out_path) == ["policy"]


def test_a_directory_that_appears_between_the_check_and_the_rename_is_kept(tmp_path, monkeypatch):
    """The rename itself refuses a non-empty directory (every output holds its marker): the second
    guard, for a writer that finished in the instant after the identity check."""
    import cleaner.outputs as outputs

    out_path = tmp_path / "policy"
    checked, others = outputs.check_replaceable, []

    def finish_another_first(path, kind):
        checked(path, kind)
        if not others:  # the late writer's check in its swap: another one finishes now
            others.append(True)
            save_checkpoint_atomic(_tiny_model(0), None, out_path, extra_files={"note.txt": "first"})

    with pytest.raises(OutputError, match="another writer put a checkpoint there"):
        with atomic_directory(out_path, "checkpoint") as late:
            (late / "config.json").write_text("late")
            monkeypatch.setattr(outputs, "check_replaceable", finish_another_first)
    assert (out_path / "note.txt").read_text() == "first"
    assert _siblings(out_path) == ["policy"]
