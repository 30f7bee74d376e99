"""The compiled handle steps (csrc/leases.c): they agree with the Python rules and refuse misuse."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import SMALL, small_row

from shmslots import (
    Field,
    LeakedViewError,
    LeakedViewWarning,
    SchemaError,
    SlotTable,
    StaleLeaseError,
    State,
)
from shmslots._core import HandleBase, HandleCore, WatchedTensors
from shmslots.leases import Lease, WriteSlot


def _delivered(t: SlotTable, i: int) -> Lease:
    """small_row(i) published, and taken back as a Lease."""
    t.claim().write(**small_row(i)).publish()
    lease = t.take()
    assert lease is not None
    return lease


def test_one_plain_reference_to_a_view_is_a_leak(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        for field in ("id", "p", "h"):
            lease = _delivered(t, 1)
            kept = lease.view(field)
            lease.view(field)  # viewing again hands out the same tensor, nothing new
            with pytest.raises(LeakedViewError, match=field):
                lease.release()
            del kept
            lease.release()
        assert t.slot_info(0)[0] is State.FREE


def test_leak_warning_points_at_the_callers_line(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        lease = _delivered(t, 1)
        kept = lease.view("p")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lease.release()
        (warning,) = caught
        assert warning.category is LeakedViewWarning
        assert warning.filename == __file__
        del kept


def test_handle_identity_cannot_be_rewritten(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        ws = t.claim(tag=5)
        for attribute, value in (("slot", 1), ("generation", 9), ("tag", 6), ("_table", None)):
            with pytest.raises(AttributeError):
                setattr(ws, attribute, value)
        ws.write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None
        with pytest.raises(AttributeError):
            lease.deliveries = 0  # type: ignore[misc]
        assert (lease.slot, lease.tag, lease.deliveries) == (ws.slot, 5, 0)
        lease.release()


def test_call_shapes_are_refused_before_anything_changes(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim()
        with pytest.raises(TypeError, match="keyword"):
            ws.write(small_row(1))  # type: ignore[call-arg]
        ws.write(**small_row(1))
        with pytest.raises(TypeError, match="timeout"):
            ws.publish(timeout=1.0, wait=True)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="timeout"):
            ws.publish(1.0, 2.0)  # type: ignore[call-arg]
        assert t.slot_info(0)[0] is State.WRITING
        ws.publish(timeout=0.5)
        lease = t.take()
        assert lease is not None
        with pytest.raises(SchemaError, match="no inline field"):
            lease.view(7)  # type: ignore[arg-type]
        lease.release()


def test_uninitialized_handles_and_cores_are_refused(name: str) -> None:
    for handle in (WriteSlot.__new__(WriteSlot), Lease.__new__(Lease)):
        with pytest.raises(TypeError, match="never initialized"):
            handle.abort()
    with pytest.raises(TypeError, match="never initialized"):
        Lease.__new__(Lease).view("p")
    with SlotTable.create(name, SMALL, slots=1) as t:
        with pytest.raises(RuntimeError, match="already initialized"):
            HandleCore.__init__(t._core, *[None] * 6)  # type: ignore[arg-type, call-arg]
        ws = t.claim()
        with pytest.raises(RuntimeError, match="already initialized"):
            ws.__init__(t, 0, 0, 0)  # type: ignore[misc]
        with pytest.raises(TypeError):
            WriteSlot(t, "0", 0, 0)  # type: ignore[arg-type]
        assert t.slot_info(0)[0] is State.WRITING  # the claim above is still this process's
        ws.abort()


def test_watched_tensors_count_each_field_alone() -> None:
    watched = WatchedTensors({"a": torch.zeros(4), "b": torch.ones(4)})
    assert watched.leaked(["a", "b"]) == []
    a = watched.tensors["a"]
    assert watched.leaked(["b", "a"]) == ["a"]
    del a
    slice_of_b = watched.tensors["b"][1:]
    assert watched.leaked(["a", "b"]) == ["b"]
    del slice_of_b
    assert watched.leaked({"b"}) == []
    with pytest.raises(KeyError, match="'c' is not watched"):
        watched.leaked(["c"])
    with pytest.raises(RuntimeError, match="already initialized"):
        watched.__init__({})  # type: ignore[misc]


def test_closed_table_handles_fail_in_python_terms(name: str) -> None:
    t = SlotTable.create(name, SMALL, slots=2)
    try:
        ws = t.claim()
        ws.write(**small_row(1))
        other = t.claim()
        other.write(**small_row(2)).publish()
        lease = t.take()
        assert lease is not None
    finally:
        t.close()
        t.unlink()
    for step in (ws.publish, ws.abort, lambda: ws.write(id=1), lease.release, lease.abort):
        with pytest.raises(StaleLeaseError, match="was closed"):
            step()
    with pytest.raises(StaleLeaseError, match="was closed"):
        lease.view("p")


SCALARS = ("int64", "int32", "uint8", "float32", "float16", "bfloat16")


def test_item_reads_every_scalar_dtype_as_the_view_does(name: str) -> None:

    fields = [Field(dtype, dtype) for dtype in SCALARS] + [Field("vec", "float32", (2,))]
    values = {"int64": -(2**40), "int32": -7, "uint8": 200, "float32": 0.1, "float16": 1.5}
    with SlotTable.create(name, fields, slots=1) as t:
        t.claim().write(
            **values, bfloat16=torch.tensor(-2.0, dtype=torch.bfloat16), vec=torch.ones(2)
        ).publish()
        lease = t.take()
        assert lease is not None
        for dtype in SCALARS:
            got = lease.item(dtype)
            assert type(got) is type(lease.view(dtype).item())
            assert got == lease.view(dtype).item()
        assert lease.item("int64") == -(2**40) and lease.item("float32") == pytest.approx(0.1)
        refusals = (("vec", "inline of shape \\(2,\\)"), ("nope", "no field"), (3, "no field"))
        for bad, message in refusals:
            with pytest.raises(SchemaError, match=message):
                lease.item(bad)  # type: ignore[arg-type]
        lease.release()
        with pytest.raises(StaleLeaseError):
            lease.item("int64")


def test_views_have_no_base_and_a_held_storage_is_a_leak(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        assert lease.view("p")._base is None  # no second way to the row that counts miss
        storage = lease.view("p").untyped_storage()
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        del storage
        lease.release()


def test_a_view_moved_out_of_the_row_is_replaced_for_the_next_reader(name: str) -> None:
    from multiprocessing.reduction import ForkingPickler

    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        ForkingPickler.dumps(lease.view("p"))  # what a torch.multiprocessing queue does
        with pytest.warns(LeakedViewWarning, match="no longer show the row"):
            lease.release()
        lease = _delivered(t, 7)
        assert torch.equal(lease.view("p"), torch.full((4,), 7.0))
        lease.release()


def test_writes_through_a_moved_view_are_refused_at_publish(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim().write(id=1, h=small_row(1)["h"])
        view = ws.view("p")
        view.share_memory_()  # type: ignore[no-untyped-call]  # now a private copy, not the row
        view.fill_(5.0)
        del view
        with pytest.raises(SchemaError, match="write those fields again"):
            ws.publish()
        with pytest.raises(SchemaError, match="never written"):
            ws.publish()
        ws.view("p").fill_(5.0)  # a fresh view of the row
        ws.publish()
        lease = t.take()
        assert lease is not None
        assert torch.equal(lease.view("p"), torch.full((4,), 5.0))
        lease.release()


def test_leak_warning_from_a_with_block_points_at_the_block(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        lease = _delivered(t, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lease:
                kept = lease.view("p")
        (warning,) = caught
        assert warning.filename == __file__
        del kept


def test_handles_need_a_ready_core_and_leases_come_from_take(name: str) -> None:
    class NotATable:
        _closed = False
        _core = HandleCore.__new__(HandleCore)

    with pytest.raises(TypeError, match="initialized HandleCore"):
        WriteSlot(NotATable(), 0, 0, 0)  # type: ignore[arg-type]
    with SlotTable.create(name, SMALL, slots=1) as t:
        with pytest.raises(TypeError, match=r"take\(\) or table\.poll"):
            Lease(t, 0, 0, 0)
        assert t.slot_info(0)[0] is State.FREE


def test_watched_tensors_take_plain_tensors_and_stay_read_only() -> None:
    class Sub(torch.Tensor):
        pass

    for value in (object(), torch.zeros(2).as_subclass(Sub)):
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            WatchedTensors({"x": value})  # type: ignore[dict-item]
    watched = WatchedTensors({"x": torch.zeros(2)})
    with pytest.raises(TypeError):
        watched.tensors["y"] = torch.zeros(2)  # type: ignore[index]


def test_cycles_through_handles_are_collected(name: str) -> None:
    import gc
    import weakref

    class Marker:
        pass

    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim()
        marker = Marker()
        # stands in for a pinned CUDA tensor whose attributes refer back to its handle
        ws._pins = {"x": [ws, marker]}  # type: ignore[dict-item]
        gone = weakref.ref(marker)
        ws.abort()
        del ws, marker
        gc.collect()
        assert gone() is None


def test_aliases_of_one_storage_are_watched_apart() -> None:
    from shmslots.refs import alias

    shared = torch.arange(8.0)  # one producer allocation, two ref fields
    first = WatchedTensors({"k": alias(shared[:4])})
    second = WatchedTensors({"v": alias(shared[4:])})
    assert first.leaked(["k"]) == [] and second.leaked(["v"]) == []
    kept = first.tensors["k"][1:]
    assert first.leaked(["k"]) == ["k"] and second.leaked(["v"]) == []
    del kept
    second.tensors["v"][0] = -1.0  # still the same memory
    assert shared[4] == -1.0


def test_a_writer_keeps_checking_its_own_views_after_one_moved(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        ws = t.claim().write(id=1)
        held = ws.view("h")
        moved = ws.view("p")
        moved.share_memory_()  # type: ignore[no-untyped-call]
        del moved
        with pytest.raises(LeakedViewError, match="h"):  # the held view is still caught
            ws.publish()
        del held
        with pytest.raises(SchemaError, match="no longer show the row"):
            ws.publish()
        ws.write(p=torch.ones(4)).publish()
        lease = t.take()
        assert lease is not None and lease.verify()
        lease.release()


def test_a_moved_writer_view_still_held_is_refused_in_default_mode(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim().write(id=1, h=small_row(1)["h"])
        view = ws.view("p")
        view.share_memory_()  # type: ignore[no-untyped-call]
        view.fill_(42.0)
        with (
            pytest.warns(LeakedViewWarning, match="still referenced"),  # as an alias could be
            pytest.raises(SchemaError, match="no longer show the row"),
        ):
            ws.publish()
        assert t.slot_info(0)[0] is State.WRITING
        del view
        ws.abort()


def test_strict_mode_gives_fresh_views_after_one_was_changed_in_place(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        for change in (
            lambda v: v.unsqueeze_(0),
            lambda v: v.resize_(2),
            lambda v: v.requires_grad_(),
            lambda v: setattr(v, "note", 1),
        ):
            lease = _delivered(t, 1)
            change(lease.view("p"))
            with pytest.warns(LeakedViewWarning, match="changed in place"):
                lease.release()
            lease = _delivered(t, 2)
            view = lease.view("p")
            assert view.shape == (4,) and not view.requires_grad and not view.__dict__
            del view
            lease.release()


def test_a_swapped_view_object_is_a_leak(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        other = torch.zeros(4)  # swapped in below: `other` then shows the row
        torch.utils.swap_tensors(lease.view("p"), other)  # type: ignore[no-untyped-call]
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        torch.utils.swap_tensors(lease.view("p"), other)  # type: ignore[no-untyped-call]
        del other
        lease.release()


def test_views_held_only_by_torch_are_leaks(name: str) -> None:
    from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]

    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        capsule = to_dlpack(lease.view("p"))  # torch >= 2.13 counts this on the view
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        del capsule
        lease.release()


def test_half_made_watched_tensors_and_views_are_refused(name: str) -> None:
    bare = WatchedTensors.__new__(WatchedTensors)
    with pytest.raises(TypeError):
        bare.__init__({"a": 5})  # type: ignore[misc]
    for use in (lambda: bare.leaked(["a"]), lambda: bare.moved(["a"]), lambda: bare.tensors):
        with pytest.raises(ValueError, match="not initialized"):
            use()
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim().write(**small_row(1)).publish()
        t._rows._views[0] = WatchedTensors.__new__(WatchedTensors)
        taken = t.take()  # a take never uses a half-made cache entry: the lease has no views
        assert taken is not None
        with pytest.raises(ValueError, match="not initialized"):
            taken.view("p")
        t._rows.forget_views(0)
        taken.release()
        lease = Lease.__new__(Lease)
        with pytest.raises(TypeError, match="take"):
            HandleBase.__init__(lease, t, 0, 1, 0)


def test_a_weak_reference_to_a_view_is_a_leak(name: str) -> None:
    import weakref

    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        ref = weakref.ref(lease.view("p"))  # ref() would give the row after release
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        del ref
        lease.release()


def test_a_view_pointed_elsewhere_misses_the_row(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim().write(id=1, h=small_row(1)["h"])
        view = ws.view("p")
        view.data = torch.zeros(4)  # the view object now shows other memory
        view.fill_(42.0)
        del view
        with pytest.raises(SchemaError, match="no longer show the row"):
            ws.publish()
        ws.write(p=torch.full((4,), 42.0)).publish()
        lease = t.take()
        assert lease is not None
        lease.release()
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        lease.view("p").data = torch.zeros(4)
        with pytest.warns(LeakedViewWarning, match="no longer show the row"):
            lease.release()  # once: nothing the reader could undo
        lease = _delivered(t, 3)
        assert torch.equal(lease.view("p"), torch.full((4,), 3.0))
        lease.release()


def test_an_alias_taken_before_a_move_is_a_leak(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        alias = lease.view("p").numpy()  # a raw pointer into the row
        lease.view("p").share_memory_()  # type: ignore[no-untyped-call]
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        del alias
        with pytest.warns(LeakedViewWarning, match="no longer show the row"):
            lease.release()


def test_weak_references_to_a_views_storage_are_leaks(name: str) -> None:
    import weakref

    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        ref = weakref.ref(lease.view("p").untyped_storage())
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        del ref
        lease.release()


def test_strict_in_place_checks_cover_dtype_and_grad_and_report_once(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        changes: tuple[Callable[[torch.Tensor], None], ...] = (
            lambda v: setattr(v, "data", v.view(torch.int32)),
            lambda v: setattr(v, "grad", torch.ones(4)),
        )
        for change in changes:
            lease = _delivered(t, 1)
            change(lease.view("p"))
            before = t.stats().counters["leaked_views"]
            with warnings.catch_warnings():
                warnings.simplefilter("error", LeakedViewWarning)
                with pytest.raises(LeakedViewWarning, match="changed in place"):
                    lease.release()
                lease.release()  # reported once; the retry goes through
            assert t.stats().counters["leaked_views"] == before + 1
            lease = _delivered(t, 2)
            view = lease.view("p")
            assert view.dtype == torch.float32 and view.grad is None
            del view
            lease.release()


def test_ending_without_a_check_leaves_no_bad_view_cached(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim()
        ws.view("p").share_memory_()  # type: ignore[no-untyped-call]
        ws.abort()  # nothing delivered, nothing to redo; the cache must not keep it
        with pytest.raises(RuntimeError, match="boom"), t.claim() as ws:
            ws.view("p").share_memory_()  # type: ignore[no-untyped-call]
            raise RuntimeError("boom")
        lease = _delivered(t, 5)
        with pytest.raises(RuntimeError, match="boom"), lease:
            lease.view("p").share_memory_()  # type: ignore[no-untyped-call]
            raise RuntimeError("boom")
        lease = _delivered(t, 6)
        assert torch.equal(lease.view("p"), torch.full((4,), 6.0))
        lease.release()


def test_a_handle_recast_as_a_lease_cannot_reach_bad_views(name: str) -> None:
    """A handle's views come from a WatchedTensors or nothing: anything else is refused when
    set, so a write slot recast as a lease has nothing else to read views from."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim()
        with pytest.raises(TypeError, match="WatchedTensors"):
            ws._watched = 12345  # type: ignore[assignment]
        assert ws._watched is None
        ws.__class__ = Lease  # type: ignore[assignment]
        view = ws.view("p")  # the slot's own view, through the slot's WatchedTensors
        assert view.shape == (4,) and ws._viewed == {"p"}
        assert ws._watched is not None and ws._watched.tensors["p"] is view
        ws.__class__ = WriteSlot
        del view
        ws.abort()


def test_viewed_fields_are_positions_in_the_handles_own_watched_tensors(name: str) -> None:
    """The fields a handle viewed name positions in its WatchedTensors: another one set in
    its place forgets them, names it does not watch are refused (or skipped, to forget),
    and a name must be a str."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        lease = _delivered(t, 1)
        with pytest.raises(ValueError, match="no views made"):
            lease._note_viewed(["p"])
        lease._unview(["p"])  # nothing viewed, nothing to forget
        view = lease.view("p")
        assert lease._viewed == {"p"}
        with pytest.raises(ValueError, match="'nope' is not a watched field"):
            lease._note_viewed(["h", "nope"])
        with pytest.raises(TypeError, match="must be a str"):
            lease._note_viewed([b"h"])  # type: ignore[list-item]
        assert lease._viewed == {"p"}  # a refused call notes nothing
        lease._unview({"p", "nope"})
        assert lease._viewed == set()
        lease._note_viewed(("p", "h"))
        mine = lease._watched
        lease._watched = WatchedTensors({"p": torch.zeros(4)})
        assert lease._viewed == set()  # its bits were positions in the other one
        lease._watched = mine
        assert lease._viewed == set()
        del view
        lease.release()


def test_alias_accepts_tensors_that_require_grad() -> None:
    from shmslots.refs import alias

    x = torch.ones(3, requires_grad=True)
    a = alias(x)
    assert a.data_ptr() == x.data_ptr() and not a.requires_grad


def test_a_moved_field_stays_unwritten_when_a_warning_is_an_error(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim().write(id=1, h=small_row(1)["h"])
        view = ws.view("p")
        view.share_memory_()  # type: ignore[no-untyped-call]
        with warnings.catch_warnings():
            warnings.simplefilter("error", LeakedViewWarning)
            with pytest.raises(LeakedViewWarning):
                ws.publish()
            with pytest.raises(SchemaError, match="never written"):
                ws.publish()
        del view
        ws.abort()


def test_views_repointed_inside_their_storage_are_reported_once(name: str) -> None:
    repoint: tuple[Callable[[torch.Tensor], object], ...] = (
        lambda v: v.as_strided_((3,), (1,), 1),
        lambda v: v.set_(v.untyped_storage(), 1, (3,), (1,)),
        lambda v: torch.utils.swap_tensors(v, torch.zeros(4).to_sparse()),  # type: ignore[no-untyped-call]
    )
    for strict in (True, False):
        with SlotTable.create(name, SMALL, slots=1, strict=strict) as t:
            for change in repoint:
                lease = _delivered(t, 1)
                change(lease.view("p"))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    lease.release()
                assert len(caught) == 1 and "no longer show the row" in str(caught[0].message)
                lease = _delivered(t, 2)
                assert torch.equal(lease.view("p"), torch.full((4,), 2.0))
                lease.release()


def test_a_with_block_hands_its_slot_back_even_when_a_view_is_kept(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        kept = []
        with pytest.raises(LeakedViewError), t.claim() as ws:
            kept.append(ws.view("p"))
        assert t.slot_info(0)[0] is State.FREE
        assert t.stats().counters["leaked_views"] == 1  # handed back while the view lives
        lease = _delivered(t, 1)
        with pytest.raises(LeakedViewError), lease:
            kept.append(lease.view("h"))
        assert t.slot_info(0)[0] is State.FREE
        assert t.stats().counters["leaked_views"] == 2
        del kept
        lease = _delivered(t, 2)  # the slot is usable, with fresh views
        assert torch.equal(lease.view("p"), torch.full((4,), 2.0))
        lease.release()


def test_methods_set_on_a_tensor_instance_are_not_trusted(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        bad_pointer = torch.full((4,), 3.0)
        bad_pointer.data_ptr = lambda: 0x10  # type: ignore[method-assign]
        strided = torch.arange(8.0)[::2]
        strided.is_contiguous = lambda *a, **k: True  # type: ignore[method-assign]
        for value, want in ((bad_pointer, [3.0] * 4), (strided, [0.0, 2.0, 4.0, 6.0])):
            t.claim().write(id=1, p=value, h=small_row(1)["h"]).publish()
            lease = t.take()
            assert lease is not None
            assert lease.view("p").tolist() == want
            lease.release()
        ws = t.claim().write(id=1, h=small_row(1)["h"])
        view = ws.view("p")
        view.share_memory_()  # type: ignore[no-untyped-call]
        view.data_ptr = lambda: 0  # type: ignore[method-assign]
        del view
        with pytest.raises(SchemaError, match="no longer show the row"):
            ws.publish()
        ws.abort()


def test_strict_mode_sees_a_view_moved_onto_another_storage_over_the_row(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        lease = _delivered(t, 1)
        view = lease.view("p")
        part = view[:]
        alias = torch.from_numpy(part.numpy())  # a second storage over the same row bytes
        del part
        view.set_(alias.untyped_storage(), 0, (4,), (1,))
        del view
        with pytest.raises(LeakedViewError, match="p"):
            lease.release()
        del alias
        lease.view("p").set_()  # type: ignore[call-overload]  # it held the alias: drop it
        with pytest.warns(LeakedViewWarning, match="no longer show the row"):
            lease.release()


def test_with_blocks_hand_back_their_slot_when_a_warning_is_an_error(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t, warnings.catch_warnings():
        warnings.simplefilter("error", LeakedViewWarning)
        kept = []
        with pytest.raises(LeakedViewWarning), t.claim() as ws:
            kept.append(ws.view("p"))
        assert t.slot_info(0)[0] is State.FREE
        lease = _delivered(t, 1)
        with pytest.raises(LeakedViewWarning), lease:
            kept.append(lease.view("p"))
        assert t.slot_info(0)[0] is State.FREE


def test_a_kept_ref_tensor_is_reported_once(name: str) -> None:
    fields = (Field("id", "int64"), Field("x", "float32", (None,), kind="ref"))
    with SlotTable.create(name, fields, slots=1, arena_bytes=1 << 16) as t:
        t.claim().write(id=1, x=torch.ones(4)).publish()
        lease = t.take()
        assert lease is not None
        kept = lease.tensor("x")
        with warnings.catch_warnings():
            warnings.simplefilter("error", LeakedViewWarning)
            with pytest.raises(LeakedViewWarning, match="x"):
                lease.release()
            lease.release()
        assert t.stats().counters["leaked_views"] == 1
        del kept
