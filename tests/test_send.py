"""`table.send(fields)`: claim, write and publish as one step, whole or not at all."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, NamedTuple

import pytest
import torch
from conftest import SMALL, row_bytes, small_row

from shmslots import (
    Field,
    InvalidArgument,
    SchemaError,
    ShmSlotsError,
    SlotsExhausted,
    SlotTable,
    TableClosed,
)


def _read(t: SlotTable) -> tuple[int, int | float, list[float], list[float]]:
    lease = t.take()
    assert lease is not None
    with lease:
        return (
            lease.tag,
            lease.item("id"),
            lease.copy("p").tolist(),
            lease.copy("h").float().flatten().tolist(),
        )


def test_a_sent_row_is_what_claim_write_publish_delivers(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=4, strict=True) as t:
        assert t._core.send(t, small_row(3), 9) is True  # the plain case is the compiled step
        assert t._core.send(t, tuple(small_row(4).values()), 5) is True  # by position too
        t.send(small_row(4), tag=5)
        with t.claim(tag=5) as ws:
            ws.write(**small_row(4))
            ws.publish()
        assert _read(t) == (9, 3, [3.0] * 4, [3.0] * 16)
        assert _read(t) == _read(t) == _read(t) == (5, 4, [4.0] * 4, [4.0] * 16)
        assert t.take() is None and t.stats().owned == 0 and t.check_consistency() == []


def test_a_lease_s_views_are_sent_on_into_another_table(name: str) -> None:
    """The echo of a round trip: the reply copied from the request's own row."""
    with (
        SlotTable.create(name, SMALL, slots=2) as req,
        SlotTable.create(name + "-r", SMALL, slots=2) as resp,
    ):
        req.send(small_row(7))
        lease = req.take()
        assert lease is not None
        names = tuple(req.schema.slots)
        resp.send(lease.views(names), tag=2)  # by position, in schema order
        views = dict(zip(names, lease.views(names), strict=True))
        resp.send(views, tag=3)  # by name
        del views
        lease.release()
        assert _read(resp) == (2, 7, [7.0] * 4, [7.0] * 16)
        assert _read(resp) == (3, 7, [7.0] * 4, [7.0] * 16)
        assert resp.stats().owned == req.stats().owned == 0


def _bad_rows() -> list[tuple[str, Any, type[ShmSlotsError]]]:
    wrong_dtype = small_row(1) | {"p": torch.ones(4, dtype=torch.float64)}
    wrong_shape = small_row(1) | {"p": torch.ones(5)}
    short = torch.empty(0).set_(torch.ones(4).untyped_storage(), 2, (4,), (1,))
    short.untyped_storage().resize_(4 * 4)  # offset 2 + 4 elements > the 4 it holds
    unknown = small_row(1) | {"nope": 1}
    missing = {k: v for k, v in small_row(1).items() if k != "h"}
    return [
        ("dtype", wrong_dtype, SchemaError),
        ("shape", wrong_shape, SchemaError),
        ("storage smaller than it claims", small_row(1) | {"p": short}, ShmSlotsError),
        ("unknown field", unknown, SchemaError),
        ("a field missing", missing, SchemaError),
        ("not a mapping or a tuple", list(small_row(1).items()), InvalidArgument),
        ("a tuple too short", tuple(small_row(1).values())[:2], SchemaError),
        ("a tuple too long", (*small_row(1).values(), 1), SchemaError),
        ("a tuple out of order", tuple(small_row(1).values())[::-1], ShmSlotsError),
        ("a tuple of a wrong dtype", tuple((small_row(1) | wrong_dtype).values()), SchemaError),
        ("an id out of int64", small_row(1) | {"id": 1 << 70}, ShmSlotsError),
    ]


def _everything(t: SlotTable) -> tuple[object, ...]:
    """What a refused send must leave as it was: every row's bytes, every slot's word (its
    state and generation), the queue, and the counters of claims, aborts and publishes."""
    stats = t.stats()
    words = [t._own.word(slot) for slot in range(t.slots)]
    return [row_bytes(t, slot) for slot in range(t.slots)], words, stats.queued, stats.counters


@pytest.mark.parametrize(("why", "fields", "error"), _bad_rows(), ids=[b[0] for b in _bad_rows()])
def test_bad_input_is_refused_with_nothing_changed(
    name: str, why: str, fields: Any, error: type[ShmSlotsError]
) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        t.send(small_row(5))  # a row queued before: still the only one after
        before = _everything(t)
        with pytest.raises(error):
            t.send(fields)
        assert _everything(t) == before  # not even a slot claimed and aborted
        assert t.check_consistency() == []
        assert _read(t)[1] == 5 and t.take() is None
        t.send(small_row(6))  # both slots claimable: the refused send handed its slot back
        t.send(small_row(7))
        assert [_read(t)[1], _read(t)[1]] == [6, 7]


def test_bad_input_into_a_full_table_is_refused_at_once(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.send(small_row(1))
        before = _everything(t)
        started = time.monotonic()
        with pytest.raises(SchemaError):  # not SlotsExhausted after the timeout
            t.send(small_row(2) | {"p": torch.ones(4, dtype=torch.float64)}, timeout=5)
        assert time.monotonic() - started < 2 and _everything(t) == before
        assert _read(t)[1] == 1


class Row(NamedTuple):
    h: torch.Tensor  # not the schema's order: a namedtuple goes by name
    p: torch.Tensor
    id: int


def test_values_that_are_not_the_plain_case_take_one_claim(name: str) -> None:
    """Strided tensors (a slice, an expanded scalar), a namedtuple: each is copied plain,
    then sent with one claim and one publish, as claim, write and publish would do it."""
    with SlotTable.create(name, SMALL, slots=2) as t:
        h = torch.arange(16, dtype=torch.bfloat16)
        rows: list[Any] = [
            {"id": 1, "p": torch.arange(8.0)[::2], "h": h.reshape(8, 2).t()},
            Row(h=h.reshape(2, 8).flip(1), p=torch.tensor(2.0).expand(4), id=2),
        ]
        expected = [
            (1, 1, [0.0, 2.0, 4.0, 6.0], [*range(0, 16, 2), *range(1, 16, 2)]),
            (2, 2, [2.0] * 4, [*range(7, -1, -1), *range(15, 7, -1)]),
        ]
        for i, (row, want) in enumerate(zip(rows, expected, strict=True), 1):
            counters = t.stats().counters
            t.send(row, tag=i)
            after = t.stats().counters
            assert [after[k] - counters[k] for k in ("claims", "aborts", "publishes")] == [1, 0, 1]
            assert _read(t) == want


class Reordered(NamedTuple):
    h: torch.Tensor
    p: torch.Tensor
    id: int


def test_a_namedtuple_is_taken_by_name_whatever_its_order(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        row = small_row(3)
        t.send(Reordered(h=row["h"], p=row["p"], id=3), tag=1)
        assert _read(t) == (1, 3, [3.0] * 4, [3.0] * 16)


def _close_when(go: threading.Event, table: SlotTable) -> None:
    go.wait()
    table.close()


@pytest.mark.timeout(60)
def test_a_table_closed_by_another_thread_during_a_big_copy_raises_table_closed(
    name: str,
) -> None:
    """A copy of 1 MiB or more lets other threads run; one that closes the table then makes
    the send fail as a closed table does, never with the hot path's own ValueError."""
    schema = (Field("id", "int64"), Field("x", "float32", (4 << 20,)))
    x = torch.ones(4 << 20)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the closer runs only when the copy lets the GIL go
    closed_in_send = 0
    try:
        for attempt in range(20):  # until the closer has run inside one send
            if closed_in_send:
                break
            t = SlotTable.create(f"{name}-{attempt}", schema, slots=1)
            go = threading.Event()
            closer = threading.Thread(target=_close_when, args=(go, t))
            closer.start()
            go.set()  # the closer wakes, then waits for the GIL: the copy lets it go
            try:
                t.send({"id": 1, "x": x})
            except TableClosed:
                closed_in_send += 1  # the closer ran while the copy let it
            finally:
                closer.join(30)
                t.close()
                t.unlink()
    finally:
        sys.setswitchinterval(switch)
    assert closed_in_send, "the closer never ran inside a send: the race was not tried"


@pytest.mark.parametrize("tag", [-1, 1 << 64, "7", None])
def test_a_bad_tag_is_refused_as_claim_refuses_it(name: str, tag: object) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        with pytest.raises(InvalidArgument):
            t.send(small_row(1), tag=tag)  # type: ignore[arg-type]
        assert t.stats().owned == 0 and t.take() is None


@pytest.mark.timeout(30)
def test_a_full_table_waits_up_to_timeout_then_takes_the_freed_slot(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.send(small_row(1))
        started = time.monotonic()
        with pytest.raises(SlotsExhausted):
            t.send(small_row(2), timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 5

        def consume_later() -> None:
            time.sleep(0.2)
            lease = t.take()
            assert lease is not None
            lease.release()

        reader = threading.Thread(target=consume_later)
        reader.start()
        t.send(small_row(3), timeout=10)  # waits for the reader to free the one slot
        reader.join(10)
        assert _read(t)[1] == 3


def test_a_closed_table_refuses_send(name: str) -> None:
    t = SlotTable.create(name, SMALL, slots=1)
    t.close()
    t.unlink()
    with pytest.raises(TableClosed):
        t.send(small_row(1))
    with pytest.raises(TableClosed):  # the table's state first, then the values
        t.send(small_row(1) | {"p": torch.ones(4, dtype=torch.float64)})


def test_a_table_with_a_ref_field_sends_through_the_same_steps(name: str) -> None:
    schema = (Field("id", "int64"), Field("x", "float32", (None,), kind="ref"))
    with SlotTable.create(name, schema, slots=2, arena_bytes=1 << 20) as t:
        payload = torch.arange(1024, dtype=torch.float32)
        t.send({"id": 4, "x": payload}, tag=3)
        lease = t.take()
        assert lease is not None
        with lease:
            assert lease.tag == 3 and lease.item("id") == 4
            got = lease.tensor("x")
            assert torch.equal(got, payload)
            del got
        with pytest.raises(SchemaError):
            t.send({"id": 5, "x": payload, "y": 1})
        assert t.stats().owned == 0 and t.take() is None
