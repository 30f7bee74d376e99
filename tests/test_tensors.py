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
from shmslots._core import REASONS, REF_REFUSALS, mapped
from shmslots.rows import RULES

f32 = torch.float32


class _Refusing(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass that refuses every torch function."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Refusing:
        made: _Refusing = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        raise KeyError(f"the wrapper was asked {func}")


def test_a_dispatch_subclass_is_copied_by_torch_or_refused_in_words(name: str) -> None:
    """A __torch_dispatch__ subclass answers size and storage queries through Python, so its
    facts are not read: torch copies it (a TwoTensor, a DTensor's local part) and the copy is
    checked; one that cannot be copied (a fake tensor, one refusing torch) is a SchemaError."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    two = TwoTensor(torch.arange(3, dtype=f32), torch.arange(3, dtype=f32))  # type: ignore[no-untyped-call]
    with FakeTensorMode():
        fake = torch.ones(3)
    for value in (two, fake, _Refusing(torch.ones(3))):
        assert RULES.check(value, f32, (3,)) == REASONS["SUBCLASS"]
    with SlotTable.create(name, (Field("vec", "float32", (3,)),), slots=1) as table:
        ws = table.claim()
        ws.write(vec=two)
        assert ws.view("vec").tolist() == [0.0, 1.0, 2.0]
        for value in (fake, _Refusing(torch.ones(3))):
            with pytest.raises(SchemaError, match="torch could not copy"):
                ws.write(vec=value)
        ws.abort()


def test_a_lazy_clone_is_read_but_never_written_through(name: str) -> None:
    """A lazy clone shares its source's storage until written: copying from it reads the
    shared bytes, and it is refused as an `out`, whose bytes would land in the source."""
    with SlotTable.create(name, (Field("vec", "float32", (4,)),), slots=1) as table:
        source = torch.arange(4, dtype=f32)
        table.claim().write(vec=torch.full((4,), 7.0)).publish()
        lease = table.take()
        assert lease is not None
        out = torch._lazy_clone(source)
        assert RULES.check(out, f32, (4,)) == REASONS["LAZY"]
        with pytest.raises(SchemaError, match="its own storage"):
            lease.copy("vec", out=out)
        assert source.tolist() == [0.0, 1.0, 2.0, 3.0]
        lease.release()
        ws = table.claim()
        ws.write(vec=torch._lazy_clone(source))
        assert ws.view("vec").tolist() == [0.0, 1.0, 2.0, 3.0]
        ws.abort()


def test_copy_and_tensor_take_their_arguments_by_name(name: str) -> None:
    with SlotTable.create(name, (Field("vec", "float32", (4,)),), slots=1) as table:
        table.claim().write(vec=torch.ones(4)).publish()
        lease = table.take()
        assert lease is not None
        out = torch.zeros(4)
        assert lease.copy(name="vec").tolist() == [1.0] * 4
        assert lease.copy(out=out, name="vec") is out and out.tolist() == [1.0] * 4
        assert lease.copy("vec", out=None).tolist() == [1.0] * 4
        assert lease.tensor(name="vec").tolist() == [1.0] * 4
        with pytest.raises(TypeError):
            lease.copy("vec", nothing=1)  # type: ignore[call-arg]
        lease.release()


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
    """Built against one torch, shmslots will not load its C++ beside another: torch's C++
    API has no stable ABI, and a mismatch would crash later, or fail on a missing symbol
    that names no cause."""
    code = (
        "import torch; torch.__version__ = '0.0.1'\n"
        "try:\n    import shmslots.rows\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "built against torch" in out.stdout and "0.0.1" in out.stdout, out
