"""CPU TEST SHIM, not project code and not the real sgl-kernel: a placeholder module that lets
SGLang's CPU path import on machines without the CPU build of sgl-kernel (PyPI ships only CUDA
builds; the CPU kernels are built from SGLang's repository).

SGLang's CPU code imports a handful of names from `sgl_kernel` at import time
(copy_all_layer_kv_cache_cpu, assign_req_to_token_pool_cpu, ...) and, on a CPU without Intel AMX,
calls none of them: every layer falls back to its PyTorch-native forward. Each name here is a
function that raises when called, so a kernel that is ever used shows up as an error, never as a
silent wrong answer. `SGL_STUB_LOG=FILE` records the names imported and called.

`make sglang-cpu` copies this package into `.venv-sglang`'s site-packages (tools/sglang-cpu/README.md).
"""

import os

__version__ = "0.0.0+cpu-test-shim"
_LOG = os.environ.get("SGL_STUB_LOG")


def _log(message: str) -> None:
    if _LOG:
        with open(_LOG, "a") as file:
            file.write(f"{os.getpid()} {message}\n")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    _log(f"import {name}")

    def missing(*args, **kwargs):
        _log(f"CALL {name}")
        raise NotImplementedError(f"sgl_kernel.{name} is the CPU test shim's placeholder "
                                  "(no CPU build of sgl-kernel is installed here)")

    missing.__name__ = name
    return missing
