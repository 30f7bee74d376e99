"""Stand-ins for the two packages SGLang 0.5.23 imports that have no CPU build, each strict:
importing works and any attribute can be named, but calling anything raises, so a run that
gets through proves SGLang never used it.

- `torchvision`: PyPI's build is CUDA's and fails beside CPU torch ("operator
  torchvision::nms does not exist").  SGLang imports it at module level for multimodal models
  (`srt/multimodal/internvl_utils.py:5`); a text model never calls it.  transformers is asked
  first, so it caches "no torchvision" and takes its own text-only paths.
- `sgl_kernel`: PyPI's `sgl-kernel` is CUDA-only.  SGLang imports it at module level
  (`kernels/ops/kvcache/cache_move.py:10`) and reads `scalar_types.uint4b8` at import
  (`srt/layers/quantization/utils.py:521`); on a CPU without AMX every op it would run takes
  `forward_native` (`kernels/fused_op.py` `_platform_key()`).  The eight CPU ops the
  speculative path calls are real: torch ports (spec_kernels.py).

And one CPU workaround, for SGLang's own Mooncake backend only (shmslots' sender says the
same itself): Mooncake's sender claims host tensor indices (`mooncake/conn.py:3312`), for
which the prefill makes a pinned tensor and a `torch.cuda.Event()`
(`disaggregation/prefill.py:1746-1761`); CPU torch has neither, so it is set to False once
that module is imported, and the prefill takes its plain path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from . import spec_kernels, spec_standins

ROOTS = ("torchvision", "sgl_kernel")
MOONCAKE_CONN = "sglang.srt.disaggregation.mooncake.conn"


class _Placeholder:
    """Any attribute is another placeholder; calling one raises, naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self._name} was called: it is a stand-in (no CPU build)")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(torchvision.Something)`: defining it is not calling it


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...], ops: dict[str, Callable[..., None]]) -> None:
        self.roots, self.ops = roots, ops

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__version__ = "0+stand-in"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        if module.__name__ == "sgl_kernel":
            vars(module).update(self.ops)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Imports `name` as usual, then applies `fix` to it."""

    def __init__(self, name: str, fix: Callable[[types.ModuleType], None]) -> None:
        self.name, self.fix = name, fix

    def find_spec(self, name: str, path: Any = None, target: object = None) -> Any:
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.abc.Loader):
            run = spec.loader.exec_module

            def exec_then_fix(module: types.ModuleType) -> None:
                run(module)
                self.fix(module)

            spec.loader.exec_module = exec_then_fix  # type: ignore[method-assign]
        return spec


def _no_host_tensor_indices(conn: types.ModuleType) -> None:
    conn.MooncakeKVSender.supports_host_tensor_indices = False


def install(roots: tuple[str, ...] = ROOTS) -> None:
    """Before SGLang is imported: transformers answers "no torchvision" (cached), then
    imports of `roots` find placeholders; `sgl_kernel` carries the ports of the CPU ops
    speculative decoding calls (spec_kernels.py)."""
    import transformers.utils.import_utils as transformers_imports

    transformers_imports.is_torchvision_available()
    transformers_imports.is_torchvision_v2_available()
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIns(roots, spec_kernels.OPS))


def install_cpu_workarounds() -> None:
    """The servers' one workaround (this module's docstring), set when its module loads."""
    after_import({MOONCAKE_CONN: _no_host_tensor_indices})


def install_spec() -> None:
    """What STANDALONE speculative decoding needs on this CPU (spec_standins.py)."""
    after_import(spec_standins.PATCHES)


def after_import(fixes: Mapping[str, Callable[[types.ModuleType], None]]) -> None:
    present = {f.name for f in sys.meta_path if isinstance(f, _AfterImport)}
    for name, fix in fixes.items():
        if name not in present:
            sys.meta_path.insert(0, _AfterImport(name, fix))
