"""The slot state machine: the one place that says which transition is legal.

A slot's state lives in one 64-bit word, changed only by compare-and-swap: generation,
owner and state, whose bits csrc/core.h defines (docs/protocol.md draws them).

Who may move a word on, the bitmap rule and every ordering: docs/protocol.md.
"""

from __future__ import annotations

from enum import IntEnum

from ._core import WORD_BITS
from .errors import OwnershipError


class State(IntEnum):
    FREE = 0
    RESERVED = 1  # a consumer booked the slot; a producer may open it for writing
    WRITING = 2  # a producer is filling the row
    READY = 3  # published, ownerless; queued in the ready ring (or about to be)
    HELD = 4  # a consumer holds a lease
    RECLAIMING = 5  # on its way to FREE from a state another process could take it from
    QUARANTINED = 6  # an aborted transfer's slot, closed to everyone until its window passes


class Event(IntEnum):
    CLAIM = 0
    RESERVE = 1  # a slot just claimed, fully set up, becomes a reservation
    OPEN_RESERVED = 2
    PUBLISH = 3
    TAKE = 4
    RELEASE = 5
    ABORT = 6
    RECLAIM = 7  # a reaper takes a dead owner's slot (or a dead reaper's RECLAIMING) over
    REDELIVER = 8  # a HELD slot goes back to READY (its consumer died or dropped it)
    FINISH = 9  # RECLAIMING -> FREE, by the one who began it
    CANCEL = 10  # a READY slot's request was cancelled before pickup
    KEEP = 11  # a writer holds its own row, unqueued (a transfer committed where it is read)
    QUARANTINE = 12  # its owner closes an aborted transfer's slot until its window passes
    EXPIRE = 13  # anyone frees a QUARANTINED slot whose window has passed


# (state, event) -> next state.  Absent pairs are illegal.  Why every way back to FREE
# passes through RECLAIMING: docs/protocol.md (Transitions).
TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.FREE, Event.CLAIM): State.WRITING,
    (State.WRITING, Event.RESERVE): State.RESERVED,
    (State.RESERVED, Event.OPEN_RESERVED): State.WRITING,
    (State.WRITING, Event.PUBLISH): State.READY,
    (State.READY, Event.TAKE): State.HELD,
    (State.WRITING, Event.KEEP): State.HELD,
    (State.HELD, Event.REDELIVER): State.READY,
    (State.RESERVED, Event.ABORT): State.RECLAIMING,
    (State.WRITING, Event.ABORT): State.RECLAIMING,
    (State.HELD, Event.RELEASE): State.RECLAIMING,
    (State.HELD, Event.ABORT): State.RECLAIMING,
    (State.READY, Event.CANCEL): State.RECLAIMING,
    (State.RESERVED, Event.RECLAIM): State.RECLAIMING,
    (State.WRITING, Event.RECLAIM): State.RECLAIMING,
    (State.HELD, Event.RECLAIM): State.RECLAIMING,
    (State.RECLAIMING, Event.RECLAIM): State.RECLAIMING,
    (State.RESERVED, Event.QUARANTINE): State.QUARANTINED,
    (State.WRITING, Event.QUARANTINE): State.QUARANTINED,
    (State.QUARANTINED, Event.ABORT): State.RECLAIMING,
    (State.QUARANTINED, Event.EXPIRE): State.RECLAIMING,
    (State.QUARANTINED, Event.RECLAIM): State.RECLAIMING,
    (State.RECLAIMING, Event.FINISH): State.FREE,
}

KNOWN_STATES = frozenset(int(s) for s in State)
# Events by which a participant takes a slot that nobody owns (FREE or READY).
_ACQUIRING = frozenset({Event.CLAIM, Event.TAKE, Event.CANCEL})
# Events by which one participant acts on a slot another one owns: a producer opening a
# reservation, a reaper acting for a dead owner (reapers of one owner are serialized by
# its registry lock, membership.py), or anyone freeing a quarantined slot whose window has
# passed (the compiled step checks the deadline).  A table closing applies them to its own
# slots too.
_TAKEOVER = frozenset({Event.OPEN_RESERVED, Event.RECLAIM, Event.REDELIVER, Event.EXPIRE})

# The word's bits, as csrc/core.h defines them (the one definition, C and Python alike).
_OWNER_SHIFT = WORD_BITS["OWNER_SHIFT"]
_GEN_SHIFT = WORD_BITS["GEN_SHIFT"]
_STATE_MASK = _OWNER_MASK = (1 << WORD_BITS["FIELD_BITS"]) - 1
GEN_MASK = (1 << WORD_BITS["GEN_BITS"]) - 1


def pack(generation: int, owner: int, state: int) -> int:
    return ((generation & GEN_MASK) << _GEN_SHIFT) | (owner << _OWNER_SHIFT) | state


def state_of(word: int) -> State:
    return State(word & _STATE_MASK)


def known(word: int) -> bool:
    """Whether `word`'s state bits name a state (a corrupt word's may not)."""
    return word & _STATE_MASK in KNOWN_STATES


def state_name(word: int) -> str:
    """The name of `word`'s state, or INVALID(bits) for a corrupt word; never raises."""
    return State(word & _STATE_MASK).name if known(word) else f"INVALID({word & _STATE_MASK:#x})"


def in_state(word: int, state: State) -> bool:
    """Whether `word` is in `state`; never raises, whatever the word (corruption included)."""
    return word & _STATE_MASK == state


def owner_of(word: int) -> int:
    return (word >> _OWNER_SHIFT) & _OWNER_MASK


def generation_of(word: int) -> int:
    return word >> _GEN_SHIFT


# The same table with plain ints: enum construction costs more than a CAS.
_NEXT = {(int(s), int(e)): int(t) for (s, e), t in TRANSITIONS.items()}
OWNER_CHECKED = frozenset(int(e) for e in Event) - _ACQUIRING - _TAKEOVER


def next_word(word: int, event: int, actor: int) -> int:
    """The word after `actor` (an owner id) applies `event` to `word`, or OwnershipError.

    Returning to FREE bumps the generation, so every stale handle to the
    previous occupant (lease, write slot, reservation, queue entry) is refused.
    """
    state = word & _STATE_MASK
    target = _NEXT.get((state, event))
    if target is None:
        raise OwnershipError(
            f"cannot {Event(event).name.lower()} a slot that is {State(state).name}"
        )
    if event in OWNER_CHECKED and (word >> _OWNER_SHIFT) & _OWNER_MASK != actor:
        owner = (word >> _OWNER_SHIFT) & _OWNER_MASK
        raise OwnershipError(
            f"cannot {Event(event).name.lower()} a {State(state).name} slot "
            f"owned by participant {owner - 1}"
        )
    generation = word >> _GEN_SHIFT
    if target == State.FREE:
        return ((generation + 1) & GEN_MASK) << _GEN_SHIFT
    if target == State.READY:
        return (generation << _GEN_SHIFT) | target
    return (generation << _GEN_SHIFT) | (actor << _OWNER_SHIFT) | target
