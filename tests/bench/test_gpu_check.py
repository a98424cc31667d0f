"""bench/gpu_check.py (`make gpu-check`) runs where the device image runs: torch, transformers and
pyarrow, without polars, duckdb, deepspeed or sglang. Here it runs on CPU at a small shape with
those four packages hidden behind stand-ins that refuse to import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("polars", "duckdb", "deepspeed", "sglang")


def test_gpu_check_runs_without_polars_duckdb_deepspeed_or_sglang(tmp_path):
    hidden = tmp_path / "hidden"
    for name in HIDDEN:
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the device image')\n")
    env = {**os.environ, "PYTHONPATH": str(hidden), "OMP_NUM_THREADS": "1"}  # cleaner: found by the script
    refused = subprocess.run([sys.executable, "-c", "import polars"], env=env, capture_output=True, text=True)
    assert "polars is not on the device image" in refused.stderr  # the stand-ins do hide them

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--shape",
                           "proxy", "--vocab", "512", "--tokens", "96", "--small-tokens", "48", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    probes = report["probes"]
    assert [(p["path"], p["tokens"], p["rows"], p["optimizer"]) for p in probes] == [
        ("full", 48, [48, 12], False), ("chunked", 48, [48, 12], False), ("chunked+gc+bf16", 96, [96, 24], True),
        ("chunked+bf16", 96, [96, 24], True), ("chunked+gc", 96, [96, 24], True), ("full+bf16", 96, [96, 24], True)]
    equality = report["equality"]
    assert equality["holds"] and abs(equality["full_loss"] - equality["chunked_loss"]) < 1e-5
    # checkpointing recomputes the same bfloat16 forward: the same loss as without it
    assert abs(probes[2]["loss"] - probes[3]["loss"]) < 1e-6
    text = (out / "gpu_check.md").read_text()
    assert "| chunked+gc+bf16 | 96 | yes |" in text and "| static GB | step above static GB |" in text
    assert "Co-located collect -> train -> collect: skipped: duckdb, polars not installed here" in text


def test_gpu_check_says_in_one_line_that_transformers_is_too_old(tmp_path):
    fake = tmp_path / "old" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '4.57.1'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "old")}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path / "o")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("error: gpu check: transformers 4.57.1 is installed; the train step needs 5.0 "
                                   "or newer (pip install 'transformers>=5.0')")


def test_the_colocated_check_runs_its_loop_on_cpu_and_reports_each_phase(tmp_path):
    """On CPU the co-located check runs `cleaner run` on the torch backend (no GPU memory to watch):
    two iterations, each collection's tokens/s, and the phases it went through."""
    import gpu_colocated

    report = gpu_colocated.main(["--device", "cpu", "--shape", "small", "--prompts", "2", "--out", str(tmp_path)])
    assert report["backend"] == "torch" and [c["iteration"] for c in report["collects"]] == [0, 1]
    assert all(c["tokens"] > 0 and c["tokens_per_s"] > 0 for c in report["collects"])
    text = (tmp_path / "gpu_colocated.md").read_text()
    assert "| collect of iteration | seconds | generated tokens | tokens/s |" in text
    assert gpu_colocated.missing("cuda") is not None  # no sglang or CUDA here: the GPU run says why
