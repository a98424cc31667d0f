"""Compat shim: let verl 0.7 (Open-CLEANER's vendored copy) import under transformers>=5.

verl/utils/model.py does `from transformers import AutoModelForVision2Seq`; transformers 5
removed that name (it is AutoModelForImageTextToText now). Setting the attribute on the
`transformers` module is not enough: transformers.processing_utils re-executes
transformers/__init__.py (direct_transformers_import), which replaces sys.modules["transformers"]
with a fresh _LazyModule. So we patch the _LazyModule *class*: an unknown
`AutoModelForVision2Seq` on the top-level module falls back to AutoModelForImageTextToText.
Lazy: nothing is imported until something imports transformers. No-op on transformers 4.x.
"""
import importlib.abc
import importlib.machinery
import sys

_OLD, _NEW = "AutoModelForVision2Seq", "AutoModelForImageTextToText"


def _patch_lazy_module():
    from transformers.utils import import_utils

    cls = import_utils._LazyModule
    if getattr(cls, "_verl_v2s_patched", False):
        return
    orig = cls.__getattr__

    def __getattr__(self, name):
        try:
            return orig(self, name)
        except AttributeError:
            if name == _OLD and self.__name__ == "transformers":
                return orig(self, _NEW)
            raise

    cls.__getattr__ = __getattr__
    cls._verl_v2s_patched = True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
            _patch_lazy_module()

        spec.loader.exec_module = exec_and_patch
        return spec


def install():
    if "transformers" in sys.modules:
        _patch_lazy_module()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
