"""The compiled hot path agrees with the state machine of states.py, word for word."""

from __future__ import annotations

import itertools
import mmap

import pytest

from shmslots import Field, OwnershipError, State
from shmslots import layout as L
from shmslots.ownership import hot_path
from shmslots.schema import RowSchema
from shmslots.states import Event, next_word, pack


def test_compiled_transitions_match_states_next_word() -> None:
    lay = L.Layout.compute(4, RowSchema([Field("x", "int64")]).row_size, 4, 64)
    with mmap.mmap(-1, lay.total_size) as mm:
        hot = hot_path(mm, lay, me=3)
        checked = 0
        for state, event, owner, actor, generation in itertools.product(
            State, Event, (0, 3, 7), (3, 7), (0, 5, 2**32 - 1)
        ):
            word = pack(generation, owner, state)
            try:
                want: int | None = next_word(word, int(event), actor)
            except OwnershipError:
                want = None
            assert hot.transition(word, int(event), actor) == want, (state, event, owner, actor)
            checked += 1
        assert checked == len(State) * len(Event) * 3 * 2 * 3
        hot.release()


def test_hot_path_refuses_a_layout_that_does_not_fit() -> None:
    lay = L.Layout.compute(4, 64, 4, 64)
    with mmap.mmap(-1, lay.columns) as mm, pytest.raises(ValueError, match="does not fit"):
        hot_path(mm, L.Layout.compute(4096, 64, 4, 64), me=1)


@pytest.mark.parametrize("hist_sum", [8, L.HIST_SUM + 4, 2**62, -8])
def test_hot_path_refuses_a_histogram_sum_over_buckets_or_outside(
    hist_sum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = L.Layout.compute(4, 64, 4, 64)
    monkeypatch.setattr(L, "HIST_SUM", hist_sum)
    with mmap.mmap(-1, lay.total_size) as mm, pytest.raises(ValueError, match="does not fit"):
        hot_path(mm, lay, me=1)
