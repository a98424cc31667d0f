"""CPU TEST SHIM, not project code: lets `import torchvision` succeed next to the CPU torch wheel.

PyPI ships only CUDA builds of torchvision, whose `_C` extension cannot load against the CPU torch;
`import torchvision` then dies in `torchvision._meta_registrations` (register_fake on the missing
ops `torchvision::nms` / `qnms`), and SGLang imports torchvision unconditionally. This import hook
declares those two op schemas (no kernel) just before that module runs; `torchvision.ops.nms`
itself stays unusable. It edits no installed file: `make sglang-cpu` installs it with a `.pth`
line in `.venv-sglang` (tools/sglang-cpu/README.md).
"""

import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    done = False
    library = None  # kept alive: dropping the Library object would undefine the ops

    def find_spec(self, name, path, target=None):
        if name == "torchvision._meta_registrations" and not _DeclareTorchvisionOps.done:
            _DeclareTorchvisionOps.done = True
            import torch

            try:
                _ = torch.ops.torchvision.nms  # declared already (a torchvision whose _C loads)
            except (AttributeError, RuntimeError):
                library = torch.library.Library("torchvision", "FRAGMENT")
                library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _DeclareTorchvisionOps.library = library
        return None  # the normal import machinery loads the module


sys.meta_path.insert(0, _DeclareTorchvisionOps())
