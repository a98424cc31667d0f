"""Installs the CPU test shims (site/) into the running interpreter's site-packages and checks
that SGLang imports. Run by `make sglang-cpu` with .venv-sglang's python; not project code."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
PTH = "zz_cleaner_tv_cpu_shim.pth"  # after other .pth files, before any import of torchvision


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    shutil.rmtree(site / "sgl_kernel", ignore_errors=True)
    shutil.copytree(HERE / "site" / "sgl_kernel", site / "sgl_kernel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(HERE / "site" / "tv_cpu_shim.py", site / "tv_cpu_shim.py")
    (site / PTH).write_text("import tv_cpu_shim\n")
    # the check runs in a fresh interpreter, so the .pth hook is active as it will be in use
    check = ("import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'; import torch, torchvision, "
             "triton, sglang, sglang.srt.entrypoints.engine, sglang_router; "
             "print('sglang', sglang.__version__, 'torch', torch.__version__, 'on CPU: ok')")
    subprocess.run([sys.executable, "-c", check], check=True)


if __name__ == "__main__":
    main()
