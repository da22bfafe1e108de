"""The one import stub SGLang 0.5.23 needs on a CPU: ``torchvision``.

``sglang.srt.configs`` imports torchvision at module load (for multimodal processors that the radix
cache never uses).  The PyPI torchvision build does not work beside torch ``+cpu``, so the sglang
venv does not install it; this module puts a permissive stand-in on ``sys.modules`` instead.  It has
a ``__version__`` because ``transformers`` parses torchvision's version when it sees the package.
Nothing the cache calls ever touches the stub (measured: the cache path has no torchvision call).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from unittest import mock

STUBBED = ("torchvision",)
STUB_VERSION = "0.0.0+stub"


class _StubModule(types.ModuleType):
    """A package whose every missing attribute is a MagicMock (import-time uses only)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__version__ = STUB_VERSION
        self.__path__ = []  # a package, so `import torchvision.x.y` resolves through the finder

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = mock.MagicMock(name=f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        return None


_installed = False


def install() -> None:
    """Idempotent: registers the stub finder first on ``sys.meta_path`` and sets offline HF."""
    global _installed
    # MambaComponent would otherwise try to download the HF config of the dummy model path.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if _installed:
        return
    sys.meta_path.insert(0, _StubFinder())
    _installed = True
