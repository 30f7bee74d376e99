"""shmslots._tensors: what the rules learn of a tensor through torch's C++ objects, the
tensors made over a mapping, and the module's refusal to load beside another torch."""

from __future__ import annotations

import mmap
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shmslots import Field, SchemaError, SlotTable
from shmslots._core import REF_REFUSALS, mapped
from shmslots.rows import REASONS, RULES

f32 = torch.float32


class _Wrapper(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass, as FakeTensor and DTensor are: no storage of
    its own that torch will show, sizes answered through Python."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        made: _Wrapper = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )
        made.inner = inner  # type: ignore[attr-defined]
        return made

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError(f"the wrapper was asked {func}")


def test_a_tensor_torch_shows_no_storage_of_is_refused_as_having_none(name: str) -> None:
    """A wrapper subclass is refused without asking it anything (its __torch_dispatch__
    raises if asked); so is a fake tensor, whose data lives nowhere."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wrapped = _Wrapper(torch.ones(3))
    with FakeTensorMode():
        fake = torch.ones(3)
    for value in (wrapped, fake):
        assert RULES.check(value, f32, (3,)) == REASONS["NO_STORAGE"]
    with SlotTable.create(name, (Field("vec", "float32", (3,)),), slots=1) as table:
        ws = table.claim()
        for value in (wrapped, fake):
            with pytest.raises(SchemaError):
                ws.write(vec=value)
        ws.abort()


def test_the_facts_are_the_tensor_s_own() -> None:
    """Dtype, shape, strides, storage bounds and negation, as torch's own answers would
    have them: a strided view is not plain, a view past its storage's end is refused."""
    base = torch.arange(12, dtype=f32)
    assert RULES.check(base, f32, (12,)) == REASONS["PLAIN"]
    assert RULES.check(base.view(3, 4).t(), f32, (4, 3)) == REASONS["STRIDED"]
    assert RULES.check(base[::2], f32, (6,)) == REASONS["STRIDED"]
    assert RULES.check(torch._neg_view(base), f32, (12,)) == REASONS["NEGATED"]
    assert RULES.check(base, torch.float64, (12,)) == REASONS["DTYPE"]
    assert RULES.check(base, f32, (11,)) == REASONS["SHAPE"]
    assert RULES.check(torch.zeros(3, device="meta"), f32, (3,)) == REASONS["DEVICE"]
    tail = base[8:]
    tail.untyped_storage().resize_(32)  # the first 8 elements only: the tail is past it
    assert RULES.check(tail, f32, (4,)) == REASONS["SHORT_STORAGE"]
    assert RULES.check(torch.ones(1).expand(5), f32, (5,)) == REASONS["STRIDED"]
    assert RULES.check(torch.ones(0, 3), f32, (0, 3)) == REASONS["PLAIN"]
    assert RULES.check(torch.zeros(3, 4).to_sparse(), f32, (3, 4)) == REASONS["NO_STORAGE"]


def test_copy_makes_its_tensor_without_asking_a_dispatch_mode(name: str) -> None:
    class Watching(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.asked: list[Any] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.asked.append(func)
            return func(*args, **(kwargs or {}))

    with SlotTable.create(name, (Field("vec", "float32", (4,)),), slots=1) as table:
        table.claim().write(vec=torch.arange(4, dtype=f32)).publish()
        lease = table.take()
        assert lease is not None
        with Watching() as mode:
            made = lease.copy("vec")
        assert mode.asked == [] and made.tolist() == [0.0, 1.0, 2.0, 3.0]
        lease.release()


def test_a_mapped_tensor_holds_the_mapping_and_stays_inside_it() -> None:
    mm = mmap.mmap(-1, 4096)
    pin = memoryview(mm)
    with pytest.raises(IndexError):
        mapped(pin, 4096 - 8, f32, (4,))  # 16 bytes from 8 before the end
    with pytest.raises(IndexError):
        mapped(pin, -4, f32, (1,))
    with pytest.raises(ValueError):
        mapped(pin, 0, f32, (2**62, 2**62))  # bytes overflow
    tensor = mapped(pin, 64, f32, (2, 3))
    assert tensor.shape == (2, 3) and tensor.stride() == (3, 1) and tensor._base is None
    storage = tensor.untyped_storage()
    alone = torch._C._storage_Use_Count(storage._cdata)
    sliced = tensor[1:]  # a view of its own storage: the count shows it
    assert torch._C._storage_Use_Count(storage._cdata) == alone + 1
    del sliced, storage
    tensor.fill_(2.0)
    assert bytes(mm[64:68]) == torch.tensor([2.0]).numpy().tobytes()
    assert mapped(pin, 4096, f32, (0,)).numel() == 0  # nothing past the end is touched
    with pytest.raises(BufferError):
        pin.release()  # the tensor's export keeps the mapping
    del tensor
    pin.release()
    mm.close()


def test_the_refusal_codes_are_worded() -> None:
    from shmslots.ref_codec import refusal

    for reason, code in REF_REFUSALS.items():
        if reason != "IS_CUDA":
            assert "'blob'" in str(refusal(code, "blob"))


def test_the_module_refuses_another_torch() -> None:
    """Built against one torch, it will not load beside another: torch's C++ API has no
    stable ABI, and a mismatch would crash later, not fail here."""
    code = (
        "import torch; torch.__version__ = '0.0.1'\n"
        "try:\n    import shmslots._tensors\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "built against torch" in out.stdout and "0.0.1" in out.stdout, out
