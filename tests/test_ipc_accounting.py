"""Each IPC share of a ref field's tensor is released exactly once, by its producer.

torch's CUDA IPC counts references: a share the producer makes stays counted
(its block kept from reuse) until someone releases it.  These tests drive the
real pin / unpin / collect / open flow of RefStore through every fate a
ref can have — aborted, overwritten, cancelled, never opened, opened in the
producer, opened twice by another process, redelivered after its reader died,
or its table closed — and count shares and releases on IpcLedger.

Only torch's calls are stood in for (no GPU here): `ShmIpc` shares a CPU tensor
as a POSIX shared-memory object of its own, which a release unlinks.  So the
counts are observable across processes: a share never released is an object
left in /dev/shm (the `name` fixture's leak check fails on it), and a second
release of one share fails to unlink it.  The CUDA path itself is checked by
tools/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import gc
import mmap
import os
import signal
from multiprocessing.queues import Queue
from typing import Any

import posix_ipc
import pytest
import torch
from conftest import SPAWN, Children

from shmslots import Field, SlotTable, State
from shmslots.cuda_ipc import IpcLedger
from shmslots.torch_dtypes import DTYPE_NAMES, DTYPES

FIELDS = (Field("id", "int64"), Field("blob", "float32", (None,), kind="ref"))


class ShmIpc:
    """torch's IPC calls, on the CPU: one POSIX shared-memory object per share."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._made = 0

    def takes(self, tensor: torch.Tensor) -> bool:
        return True

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        self._made += 1
        name = f"{self._prefix}-ipc-{os.getpid()}-{self._made}"
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=len(data))
        with mmap.mmap(shm.fd, len(data)) as mm:
            mm[:] = data
        os.close(shm.fd)
        dtype, shape = DTYPE_NAMES[tensor.dtype], list(tensor.shape)
        # every key a CUDA ref must hold (ref_codec checks them), "seg" naming the stand-in's
        return {
            "b": "cuda", "pid": os.getpid(), "uuid": "cpu", "handle": b"", "size": len(data),
            "soff": 0, "event": b"", "sync": False, "off": 0, "shape": shape,
            "stride": [1] * len(shape), "dtype": dtype, "seg": name,
        }  # fmt: skip

    def release(self, description: dict[str, Any]) -> None:
        posix_ipc.unlink_shared_memory("/" + description["seg"])  # twice: ExistentialError

    def open(self, description: dict[str, Any]) -> torch.Tensor:
        shm = posix_ipc.SharedMemory("/" + description["seg"])
        mm = mmap.mmap(shm.fd, os.fstat(shm.fd).st_size)
        os.close(shm.fd)
        dtype = DTYPES[description["dtype"]]
        return torch.frombuffer(mm, dtype=dtype).view(description["shape"])


def _shm_ipc(table: SlotTable) -> IpcLedger:
    """Stand ShmIpc in for torch's calls in this table's RefStore."""
    ledger = table._refs.ipc = IpcLedger(ShmIpc(table.name))
    return ledger


def _shares_left(table_name: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{table_name}-ipc-")]


def _blob(tag: int) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32) + tag


def _released_once(t: SlotTable, ledger: IpcLedger) -> None:
    t.collect()
    assert ledger.released == ledger.shared and not _shares_left(t.name)
    assert t._refs.pinned() == (0, 0)


def test_every_share_is_released_once_whatever_becomes_of_the_ref(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=4) as t:
        ledger = _shm_ipc(t)

        t.claim().write(id=1, blob=_blob(1)).abort()  # never published
        _released_once(t, ledger)

        ws = t.claim(tag=2).write(id=2, blob=_blob(0))
        ws.write(blob=_blob(2))  # the first ref, overwritten, is let go at once
        assert (ledger.shared, ledger.released) == (3, 2)
        ws.publish()
        assert t.cancel(2) == 1  # cancelled before anyone took it
        _released_once(t, ledger)

        t.claim(tag=3).write(id=3, blob=_blob(3)).publish()
        lease = t.take()
        assert lease is not None
        lease.release()  # taken, never opened
        _released_once(t, ledger)

        t.claim(tag=4).write(id=4, blob=_blob(4)).publish()
        lease = t.take()
        assert lease is not None
        assert torch.equal(lease.tensor("blob"), _blob(4))  # opened in the producer itself
        assert torch.equal(lease.copy("blob"), _blob(4))  # and again
        lease.release()
        assert ledger.released == ledger.shared - 1  # kept until the producer sees it
        _released_once(t, ledger)
        assert ledger.shared == 5


def test_a_closed_table_releases_the_shares_it_still_held(name: str) -> None:
    t = SlotTable.create(name, FIELDS, slots=2)
    ledger = _shm_ipc(t)
    t.claim().write(id=1, blob=_blob(1)).publish()
    t.close()
    t.unlink()
    assert ledger.released == 0 and len(_shares_left(name)) == 1
    del t
    gc.collect()
    assert ledger.released == 1 and not _shares_left(name)


def _open_twice_and_release(name: str, opened: Queue[float]) -> None:
    with SlotTable.attach(name, "consumer") as t:
        reader = _shm_ipc(t)
        lease = t.take(timeout=30)
        assert lease is not None
        first = float(lease.tensor("blob")[0])
        again = float(lease.copy("blob")[0])  # a second open of the same ref
        lease.release()
        assert (reader.shared, reader.released) == (0, 0)  # a consumer releases nothing
        opened.put(first + again)


def _open_and_die(name: str, opened: Queue[float]) -> None:
    t = SlotTable.attach(name, "consumer")
    _shm_ipc(t)
    lease = t.take(timeout=30)
    assert lease is not None
    opened.put(float(lease.tensor("blob")[0]))
    opened.close()
    opened.join_thread()  # sent before dying
    os.kill(os.getpid(), signal.SIGKILL)  # holding the lease: it is redelivered


def test_readers_in_other_processes_release_nothing(name: str, children: Children) -> None:
    opened: Queue[float] = SPAWN.Queue()
    with SlotTable.create(name, FIELDS, slots=2) as t:
        ledger = _shm_ipc(t)
        t.claim(tag=5).write(id=5, blob=_blob(5)).publish()
        children.start(_open_twice_and_release, name, opened)
        assert opened.get(timeout=60) == 10.0
        _released_once(t, ledger)  # opened twice there, released once here
        t.claim(tag=6).write(id=6, blob=_blob(6)).publish()
        proc = children.start(_open_and_die, name, opened)
        assert opened.get(timeout=60) == 6.0
        proc.join(30)
        children.join_all(30)
        t.collect()
        assert ledger.released == 1 and len(_shares_left(name)) == 1  # its reader died holding it
        t.reap()
        lease = t.take()
        assert lease is not None and lease.deliveries == 1
        assert float(lease.tensor("blob")[0]) == 6.0  # the redelivered ref, opened again
        lease.release()
        assert [t.slot_info(s)[0] for s in range(2)] == [State.FREE, State.FREE]
        _released_once(t, ledger)
        assert ledger.shared == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_refs_give_their_memory_back_whatever_becomes_of_them(name: str) -> None:
    """torch keeps a shared block out of reuse while its counter is above 0: once every
    ref is let go and the tensor dropped, what it took must be free again."""
    with SlotTable.create(name, FIELDS, slots=2) as t:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        x = torch.ones(16 << 20, device="cuda")  # 64 MiB
        t.claim().write(id=1, blob=x).abort()  # never published
        ws = t.claim().write(id=2, blob=x)
        ws.write(blob=x)  # overwritten before publish
        ws.publish()
        lease = t.take()
        assert lease is not None
        assert float(lease.tensor("blob")[0]) == 1.0  # opened in the producer itself
        lease.release()
        t.claim(tag=3).write(id=3, blob=x).publish()
        assert t.cancel(3) == 1
        t.collect()
        assert t._refs.ipc.shared == t._refs.ipc.released == 4
        del x
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
