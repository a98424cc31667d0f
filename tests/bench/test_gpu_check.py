"""bench/gpu_check.py (`make gpu-check`) runs where the device image runs: torch, transformers and
pyarrow, without polars, duckdb, deepspeed, sglang or peft. Here it runs on CPU at a small shape from a
python without cleaner installed, those five packages absent from its path (the LoRA probe says it
was skipped; tests/bench/test_lora_memory.py runs it where peft is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("polars", "duckdb", "deepspeed", "sglang", "peft")


def bare_python(tmp_path: Path, hidden: tuple[str, ...] = ()) -> Path:
    """A python with this venv's packages but not cleaner (as the device image has torch,
    transformers and pyarrow, and nothing of this checkout installed) nor the `hidden` ones: a venv
    whose one .pth adds a directory of links to the site-packages' entries, less the hidden
    packages' and less the .pth files (cleaner's editable install among them). A hidden package is
    absent, as on the image: importlib finds nothing (accelerate, for one, imports deepspeed
    wherever it finds it)."""
    import site

    bare, packages = tmp_path / "bare", tmp_path / "bare-site"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    packages.mkdir()
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if entry.suffix != ".pth" and not entry.name.lower().lstrip("_").startswith(hidden):
            (packages / entry.name).symlink_to(entry)
    (next(bare.glob("lib/python3*/site-packages")) / "packages.pth").write_text(f"{packages}\n")
    return bare / "bin" / "python"


def _without_cleaner() -> dict[str, str]:
    """This environment less a PYTHONPATH (the tests' own may name this checkout)."""
    return {**{key: value for key, value in os.environ.items() if key != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}


def test_gpu_check_runs_from_a_bare_checkout_on_the_cpu_proxy(tmp_path):
    python = bare_python(tmp_path, HIDDEN)
    env = _without_cleaner()
    missing = subprocess.run([str(python), "-c", "import cleaner"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "No module named 'cleaner'" in missing.stderr  # what the device image's python says
    refused = subprocess.run([str(python), "-c", "import torch, transformers, polars"], env=env, cwd=tmp_path,
                             capture_output=True, text=True)
    assert "No module named 'polars'" in refused.stderr  # torch and transformers import

    out = tmp_path / "out"
    done = subprocess.run([str(python), str(ROOT / "bench" / "gpu_check.py"), "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [p["name"] for p in report["probes"]] == [
        "equality full", "equality chunked", "bf16 96", "fp32 96", "bf16 192", "fp32 192",
        "bf16 no checkpointing 96", "full-logits bf16 96", "fit proxy 64", "fit proxy 72 KL off", "lora bf16 96"]
    assert all("error" not in p for p in report["probes"]), report["probes"]
    assert report["probes"][-1]["skipped"] == "skipped: peft is not installed here (pip install peft)"
    assert [p["probe"] for p in report["side"]] == ["scorer trie", "scorer naive", "float16 step"]
    assert all("error" not in p for p in report["side"]), report["side"]
    verdicts = {t["name"]: t["holds"] for t in report["targets"]}
    assert verdicts[next(name for name in verdicts if name.startswith("chunked step equals"))] is True
    assert verdicts["T=192 completes in float32 and in bfloat16"] is True
    assert verdicts[next(name for name in verdicts if name.startswith("trie scorer"))] is True  # values, on a CPU
    float16 = [name for name in verdicts if "float16" in name.replace("bfloat16", "")]  # the paper's dtype holds on the CPU proxy too
    assert len(float16) == 3 and all(verdicts[name] is True for name in float16), float16
    assert sum(holds is None for holds in verdicts.values()) == 10  # GPU memory, speed, rollouts, MFU, LoRA: n/a here
    text = (out / "gpu_check.md").read_text()
    assert "| target | measured | holds |" in text and "| n/a |" in text and "does not hold" not in text
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
    two iterations, each collection's tokens/s, and the phases it went through; from a python
    without cleaner installed, as the device image's, so every process it starts (the sandbox's
    workers among them) finds cleaner in this checkout as the script itself does."""
    import gpu_colocated

    out = tmp_path / "out"
    done = subprocess.run([str(bare_python(tmp_path)), str(ROOT / "bench" / "gpu_colocated.py"), "--device", "cpu",
                           "--shape", "small", "--prompts", "2", "--out", str(out)], cwd=tmp_path,
                          env=_without_cleaner(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "gpu_colocated.json").read_text())
    assert report["backend"] == "torch" and [c["iteration"] for c in report["collects"]] == [0, 1]
    assert all(c["tokens"] > 0 and c["tokens_per_s"] > 0 for c in report["collects"])
    text = (out / "gpu_colocated.md").read_text()
    assert "| collect of iteration | seconds | generated tokens | tokens/s |" in text
    assert gpu_colocated.missing("cuda") is not None  # no sglang or CUDA here: the GPU run says why
