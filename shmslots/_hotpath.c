/* The hot transitions of the slot protocol, compiled.
 *
 * ownership.py describes the protocol and runs its rare steps (reclaim,
 * cancel, open_reserved); the four steps every request takes — acquire a
 * FREE slot, publish it, take it, hand it back — and the ready ring they use
 * run here, one C call each, because in Python they cost more than a whole
 * cross-process hand-off.
 *
 * Nothing here defines the protocol's data: the transition table comes from
 * states.py and every offset from layout.py, both passed in by ownership.py
 * at construction.  tests/test_hotpath.py checks that the compiled
 * transitions agree with states.next_word for every state, event and actor.
 *
 * Ready ring (a bounded queue of published slots, crash-safe): cells are
 * 64-bit, tagged with the position they hold,
 *     bits 63..21 position (mod 2**43) | bit 20 full | bits 19..0 slot,
 * `empty(p)` may receive position p, `full(p, s)` holds slot s queued at p.
 * Each step is one CAS on a cell or on head/tail, and whoever finds head or
 * tail lagging behind a cell moves it on, so a process killed between two
 * steps blocks no one.  The slot's own state word decides delivery: an
 * entry whose slot is no longer READY at that position is stale, dropped.
 *
 * Memory ordering: CAS and read-modify-write are SEQ_CST, loads SEQ_CST,
 * stores RELEASE (as in _atomic.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NSTATES 16
#define NEVENTS 16
#define NONE 0xFF
#define POS_BITS 43
#define POS_MASK ((UINT64_C(1) << POS_BITS) - 1)
#define FULL (UINT64_C(1) << 20)
#define SLOT_MASK (FULL - 1)

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int held;
    char *base;
    /* layout (absolute offsets) */
    Py_ssize_t bitmap, nwords, entries, entry_size, nslots;
    Py_ssize_t tag_off, stamp_off, qpos_off, deliveries_off;
    Py_ssize_t ring, ring_cap, head, tail;
    Py_ssize_t publish_seq, readers_waiting, release_seq, claimers_waiting;
    Py_ssize_t publishes_counter, takes_counter;
    uint64_t tail_mask;
    /* protocol */
    uint64_t me;
    uint8_t next[NSTATES][NEVENTS];
    uint32_t owner_checked;  /* bit e set: event e requires actor == owner */
    int ev_claim, ev_publish, ev_take, st_free, st_writing, st_ready, st_held;
    uint32_t pending_states; /* bit s set: a queued slot in state s is still coming */
    Py_ssize_t hint;
    PyObject *corrupt; /* exception class raised for a ring that never settles */
} HotPath;

static inline uint64_t *w64(HotPath *h, Py_ssize_t off) { return (uint64_t *)(h->base + off); }
static inline uint64_t ld(HotPath *h, Py_ssize_t off) { return __atomic_load_n(w64(h, off), __ATOMIC_SEQ_CST); }
static inline void st(HotPath *h, Py_ssize_t off, uint64_t v) { __atomic_store_n(w64(h, off), v, __ATOMIC_RELEASE); }
static inline int cas(HotPath *h, Py_ssize_t off, uint64_t expected, uint64_t desired)
{
    return __atomic_compare_exchange_n(w64(h, off), &expected, desired, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}
static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
static inline Py_ssize_t entry_of(HotPath *h, Py_ssize_t slot) { return h->entries + slot * h->entry_size; }
static inline uint64_t empty_cell(uint64_t pos) { return (pos & POS_MASK) << 21; }
static inline uint64_t full_cell(uint64_t pos, uint64_t slot) { return ((pos & POS_MASK) << 21) | FULL | slot; }

/* states.next_word, table driven; returns 0 and sets *out, or -1 if illegal. */
static int
transition(HotPath *h, uint64_t word, int event, uint64_t actor, uint64_t *out)
{
    unsigned state = (unsigned)(word & 0xFFFF);
    uint64_t owner = (word >> 16) & 0xFFFF;
    uint64_t gen = word >> 32;
    if (state >= NSTATES || event < 0 || event >= NEVENTS || h->next[state][event] == NONE)
        return -1;
    if ((h->owner_checked >> event & 1) && owner != actor)
        return -1;
    unsigned target = h->next[state][event];
    if ((int)target == h->st_free)
        *out = ((gen + 1) & 0xFFFFFFFFu) << 32;
    else if ((int)target == h->st_ready)
        *out = (gen << 32) | target;
    else
        *out = (gen << 32) | (actor << 16) | target;
    return 0;
}

static inline void
wake(HotPath *h, Py_ssize_t seq, Py_ssize_t waiting)
{
    __atomic_fetch_add((uint32_t *)(h->base + seq), 1, __ATOMIC_SEQ_CST);
    if (ld(h, waiting))
        syscall(SYS_futex, h->base + seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Bump a counter; a negative offset means "count nothing". */
static inline void
count(HotPath *h, Py_ssize_t counter)
{
    if (counter >= 0)
        __atomic_fetch_add(w64(h, counter), 1, __ATOMIC_SEQ_CST);
}

static int
counter_ok(HotPath *h, Py_ssize_t counter)
{
    if (counter < -1 || counter > h->buf.len - 8 || (counter >= 0 && counter % 8)) {
        PyErr_SetString(PyExc_IndexError, "bad counter offset");
        return 0;
    }
    return 1;
}

/* -- ready ring -------------------------------------------------------------------- */

/* Loops below retry only while another process makes progress; a ring that
 * never settles (a corrupt segment) is reported instead of spun on forever
 * with the GIL held. */
#define RING_RETRIES 1000000
#define RING_CORRUPT (-2)

static inline uint64_t cell_at(HotPath *h, uint64_t pos)
{
    return ld(h, h->ring + 8 * (Py_ssize_t)(pos % (uint64_t)h->ring_cap));
}

/* The cell at `head` shows that position `head` was already consumed (its popper
 * stopped before moving head, or the cell was even reused a lap later): move head. */
static int
help_head(HotPath *h, uint64_t head)
{
    uint64_t value = cell_at(h, head);
    uint64_t next_lap = (head + (uint64_t)h->ring_cap) & POS_MASK;
    if (value == empty_cell(head + (uint64_t)h->ring_cap) || (value >> 21) == next_lap) {
        cas(h, h->head, head, head + 1);
        return 1;
    }
    return 0;
}

/* Queue `slot`, storing its position in the slot entry before filling the cell.
 * Returns the position, -1 when the ring is full, RING_CORRUPT if it never settles. */
static int64_t
ring_push(HotPath *h, Py_ssize_t slot)
{
    Py_ssize_t qpos = entry_of(h, slot) + h->qpos_off;
    uint64_t cap = (uint64_t)h->ring_cap;
    for (long attempt = 0; attempt < RING_RETRIES; attempt++) {
        uint64_t tail = ld(h, h->tail), head = ld(h, h->head);
        if (tail - head >= cap) { /* full, unless head lags behind a consumed cell */
            if (!help_head(h, head))
                return -1;
            continue;
        }
        Py_ssize_t cell = h->ring + 8 * (Py_ssize_t)(tail % cap);
        uint64_t value = ld(h, cell);
        if (value == empty_cell(tail)) {
            st(h, qpos, tail);
            if (cas(h, cell, value, full_cell(tail, (uint64_t)slot))) {
                cas(h, h->tail, tail, tail + 1);
                return (int64_t)tail;
            }
        } else if (((value & FULL) && (value >> 21) == (tail & POS_MASK)) ||
                   value == empty_cell(tail + cap)) {
            cas(h, h->tail, tail, tail + 1); /* a pusher stopped before moving tail */
        }
    }
    return RING_CORRUPT;
}

/* (position, slot) at the head: 0 if found, -1 if the ring is empty, RING_CORRUPT. */
static int
ring_peek(HotPath *h, uint64_t *pos, Py_ssize_t *slot)
{
    for (long attempt = 0; attempt < RING_RETRIES; attempt++) {
        uint64_t head = ld(h, h->head);
        uint64_t value = cell_at(h, head);
        if ((value & FULL) && (value >> 21) == (head & POS_MASK)) {
            *pos = head;
            *slot = (Py_ssize_t)(value & SLOT_MASK);
            return 0;
        }
        if (value == empty_cell(head))
            return -1;
        help_head(h, head);
    }
    return RING_CORRUPT;
}

static PyObject *
corrupt_ring(HotPath *h)
{
    PyErr_SetString(h->corrupt, "the ready ring never settles: its head, tail or cells are corrupt");
    return NULL;
}

/* ring_peek for the methods: 0 found, -1 empty, -2 with the corrupt-ring error set. */
static int
peek_or_raise(HotPath *h, uint64_t *pos, Py_ssize_t *slot)
{
    int peeked = ring_peek(h, pos, slot);
    if (peeked == RING_CORRUPT)
        corrupt_ring(h);
    return peeked;
}

static void
ring_pop(HotPath *h, uint64_t pos, Py_ssize_t slot)
{
    Py_ssize_t cell = h->ring + 8 * (Py_ssize_t)(pos % (uint64_t)h->ring_cap);
    cas(h, cell, full_cell(pos, (uint64_t)slot), empty_cell(pos + (uint64_t)h->ring_cap));
    cas(h, h->head, pos, pos + 1);
}

/* -- methods --------------------------------------------------------------------------- */

static int
need(HotPath *h, Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (!h->held) {
        PyErr_SetString(PyExc_ValueError, "HotPath is released");
        return 0;
    }
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return 0;
    }
    return 1;
}

static int
slot_arg(HotPath *h, PyObject *o, Py_ssize_t *slot)
{
    *slot = PyLong_AsSsize_t(o);
    if (*slot == -1 && PyErr_Occurred())
        return 0;
    if (*slot < 0 || *slot >= h->nslots) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range", *slot);
        return 0;
    }
    return 1;
}

/* acquire(event, tag, counter_off) -> (slot, generation) | None
 * Take any FREE slot by `event` (CLAIM or RESERVE): CAS its word, then set its bit. */
static PyObject *
hp_acquire(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 3, "acquire")) return NULL;
    int event = (int)PyLong_AsLong(args[0]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t counter = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred() || !counter_ok(h, counter)) return NULL;
    for (Py_ssize_t step = 0; step < h->nwords; step++) {
        Py_ssize_t wi = (h->hint + step) % h->nwords;
        Py_ssize_t woff = h->bitmap + 8 * wi;
        uint64_t bits = ld(h, woff);
        if (wi == h->nwords - 1)
            bits |= h->tail_mask;
        uint64_t free_bits = ~bits;
        while (free_bits) {
            uint64_t low = free_bits & (~free_bits + 1);
            Py_ssize_t slot = wi * 64 + __builtin_ctzll(free_bits);
            Py_ssize_t entry = entry_of(h, slot);
            uint64_t word = ld(h, entry), mine;
            /* A slot whose last queue entry may still be in the ring (a cancelled or
             * reclaimed publication) waits until head passes it: at most one entry
             * per slot, so stale entries can never fill the ring. */
            uint64_t queued_at = ld(h, entry + h->qpos_off);
            int entry_gone = queued_at == UINT64_MAX || queued_at < ld(h, h->head);
            if ((int)(word & 0xFFFF) == h->st_free && entry_gone &&
                transition(h, word, event, h->me, &mine) == 0 && cas(h, entry, word, mine)) {
                __atomic_fetch_or(w64(h, woff), low, __ATOMIC_SEQ_CST);
                st(h, entry + h->tag_off, (uint64_t)tag);
                st(h, entry + h->qpos_off, UINT64_MAX);
                st(h, entry + h->deliveries_off, 0);
                st(h, entry + h->stamp_off, now_ns());
                count(h, counter);
                h->hint = wi;
                return Py_BuildValue("(nK)", slot, (unsigned long long)(mine >> 32));
            }
            free_bits ^= low;
        }
    }
    Py_RETURN_NONE;
}

/* publish(slot, generation) -> 0 published, -1 not this participant's WRITING slot,
 * -2 ready ring full (nothing changed). Queues the slot, then turns it READY. */
static PyObject *
hp_publish(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    if (!need(h, nargs, 2, "publish") || !slot_arg(h, args[0], &slot)) return NULL;
    unsigned long long gen = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t mine = ((uint64_t)(gen & 0xFFFFFFFFu) << 32) | (h->me << 16) | (uint64_t)h->st_writing;
    uint64_t ready;
    if (ld(h, entry) != mine || transition(h, mine, h->ev_publish, h->me, &ready) != 0)
        return PyLong_FromLong(-1);
    int64_t pushed = ring_push(h, slot);
    if (pushed == RING_CORRUPT)
        return corrupt_ring(h);
    if (pushed < 0)
        return PyLong_FromLong(-2);
    if (!cas(h, entry, mine, ready))
        return PyLong_FromLong(-1);
    st(h, entry + h->stamp_off, now_ns());
    count(h, h->publishes_counter);
    wake(h, h->publish_seq, h->readers_waiting);
    return PyLong_FromLong(0);
}

/* take() -> (slot, generation, tag, deliveries) | None (empty) | int (owner id of an
 * unfinished publication at the head). */
static PyObject *
hp_take(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 0, "take")) return NULL;
    for (;;) {
        uint64_t pos;
        Py_ssize_t slot;
        int peeked = peek_or_raise(h, &pos, &slot);
        if (peeked == RING_CORRUPT)
            return NULL;
        if (peeked < 0)
            Py_RETURN_NONE;
        if (slot >= h->nslots) { /* a cell naming no slot: drop it, never follow it */
            ring_pop(h, pos, slot);
            continue;
        }
        Py_ssize_t entry = entry_of(h, slot);
        uint64_t word = ld(h, entry);
        unsigned state = (unsigned)(word & 0xFFFF);
        if (ld(h, entry + h->qpos_off) == pos) {
            uint64_t held;
            if ((int)state == h->st_ready && transition(h, word, h->ev_take, h->me, &held) == 0) {
                if (cas(h, entry, word, held)) {
                    ring_pop(h, pos, slot);
                    st(h, entry + h->stamp_off, now_ns());
                    count(h, h->takes_counter);
                    return Py_BuildValue("(nKKK)", slot, (unsigned long long)(word >> 32),
                                         (unsigned long long)ld(h, entry + h->tag_off),
                                         (unsigned long long)ld(h, entry + h->deliveries_off));
                }
                continue;
            }
            if (state < 32 && (h->pending_states >> state & 1))
                return PyLong_FromUnsignedLongLong((word >> 16) & 0xFFFF);
        }
        ring_pop(h, pos, slot); /* stale: taken, cancelled or queued again elsewhere */
        if ((int)state == h->st_free)
            wake(h, h->release_seq, h->claimers_waiting); /* claimable again (see acquire) */
    }
}

/* free(slot, generation, state, event, counter_off) -> 0, or -1 if the slot is not
 * this participant's in `state` at `generation` (nothing changed).
 * Clears the bit first, then CASes the word to FREE (generation + 1). */
static PyObject *
hp_free(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    if (!need(h, nargs, 5, "free") || !slot_arg(h, args[0], &slot)) return NULL;
    unsigned long long gen = PyLong_AsUnsignedLongLong(args[1]);
    long state = PyLong_AsLong(args[2]);
    int event = (int)PyLong_AsLong(args[3]);
    Py_ssize_t counter = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred() || !counter_ok(h, counter)) return NULL;
    if (state < 0 || state >= NSTATES) {
        PyErr_SetString(PyExc_ValueError, "bad state");
        return NULL;
    }
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t mine = ((uint64_t)(gen & 0xFFFFFFFFu) << 32) | (h->me << 16) | (uint64_t)state;
    uint64_t freed;
    if (ld(h, entry) != mine || transition(h, mine, event, h->me, &freed) != 0 ||
        (int)(freed & 0xFFFF) != h->st_free)
        return PyLong_FromLong(-1);
    Py_ssize_t woff = h->bitmap + 8 * (slot >> 6);
    uint64_t bit = UINT64_C(1) << (slot & 63);
    __atomic_fetch_and(w64(h, woff), ~bit, __ATOMIC_SEQ_CST);
    if (!cas(h, entry, mine, freed)) {
        if ((int)(ld(h, entry) & 0xFFFF) != h->st_free) /* never set the bit of a FREE slot */
            __atomic_fetch_or(w64(h, woff), bit, __ATOMIC_SEQ_CST);
        return PyLong_FromLong(-1);
    }
    st(h, entry + h->stamp_off, now_ns());
    count(h, counter);
    wake(h, h->release_seq, h->claimers_waiting);
    return PyLong_FromLong(0);
}

/* push(slot) -> position | -1 (ring full): queue a slot (redelivery uses this). */
static PyObject *
hp_push(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    if (!need(h, nargs, 1, "push") || !slot_arg(h, args[0], &slot)) return NULL;
    int64_t pushed = ring_push(h, slot);
    if (pushed == RING_CORRUPT)
        return corrupt_ring(h);
    return PyLong_FromLongLong(pushed < 0 ? -1 : pushed);
}

/* drop_stale_head() -> bool: remove the head entry if its slot no longer waits there. */
static PyObject *
hp_drop_stale_head(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 0, "drop_stale_head")) return NULL;
    uint64_t pos;
    Py_ssize_t slot;
    int peeked = peek_or_raise(h, &pos, &slot);
    if (peeked == RING_CORRUPT)
        return NULL;
    if (peeked < 0)
        Py_RETURN_FALSE;
    if (slot < h->nslots) {
        Py_ssize_t entry = entry_of(h, slot);
        unsigned state = (unsigned)(ld(h, entry) & 0xFFFF);
        int waiting = (int)state == h->st_ready || (state < 32 && (h->pending_states >> state & 1));
        if (ld(h, entry + h->qpos_off) == pos && waiting)
            Py_RETURN_FALSE;
    }
    ring_pop(h, pos, slot);
    Py_RETURN_TRUE;
}

/* forget_position(slot): clear the slot's queue position if no entry of it sits
 * there (a publisher died between recording the position and filling the cell).
 * Only the slot's owner (a reaper finishing it) may call this. */
static PyObject *
hp_forget_position(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    if (!need(h, nargs, 1, "forget_position") || !slot_arg(h, args[0], &slot)) return NULL;
    Py_ssize_t qpos = entry_of(h, slot) + h->qpos_off;
    uint64_t pos = ld(h, qpos);
    if (pos != UINT64_MAX && cell_at(h, pos) != full_cell(pos, (uint64_t)slot))
        st(h, qpos, UINT64_MAX);
    Py_RETURN_NONE;
}

/* init_ring(): every cell empty for its first position, and no slot queued anywhere
 * (table creation only). */
static PyObject *
hp_init_ring(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 0, "init_ring")) return NULL;
    for (Py_ssize_t pos = 0; pos < h->ring_cap; pos++)
        st(h, h->ring + 8 * pos, empty_cell((uint64_t)pos));
    for (Py_ssize_t slot = 0; slot < h->nslots; slot++)
        st(h, entry_of(h, slot) + h->qpos_off, UINT64_MAX);
    Py_RETURN_NONE;
}

/* queued() -> entries between head and tail (stale ones included). */
static PyObject *
hp_queued(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 0, "queued")) return NULL;
    uint64_t head = ld(h, h->head), tail = ld(h, h->tail);
    return PyLong_FromUnsignedLongLong(tail > head ? tail - head : 0);
}

/* transition(word, event, actor) -> new word | None: the compiled state machine,
 * exposed so tests can hold it against states.next_word. */
static PyObject *
hp_transition(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "transition() takes 3 arguments");
        return NULL;
    }
    unsigned long long word = PyLong_AsUnsignedLongLong(args[0]);
    int event = (int)PyLong_AsLong(args[1]);
    unsigned long long actor = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    uint64_t out;
    if (transition(h, (uint64_t)word, event, (uint64_t)actor & 0xFFFF, &out) != 0)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(out);
}

static PyObject *
hp_release(HotPath *h, PyObject *Py_UNUSED(ignored))
{
    if (h->held) {
        PyBuffer_Release(&h->buf);
        h->held = 0;
    }
    Py_RETURN_NONE;
}

static int
hp_init(HotPath *h, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {
        "buffer", "bitmap", "nwords", "tail_mask", "entries", "entry_size", "nslots",
        "tag_off", "stamp_off", "qpos_off", "deliveries_off", "ring", "ring_cap", "head",
        "tail", "publish_seq", "readers_waiting", "release_seq", "claimers_waiting",
        "publishes_counter", "takes_counter", "me", "transitions", "owner_checked",
        "events", "states", "pending_states", "corrupt", NULL,
    };
    PyObject *obj;
    unsigned long long tail_mask, me;
    Py_buffer table;
    unsigned int owner_checked, pending;
    PyObject *corrupt;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "O$nnKnnnnnnnnnnnnnnnnnKy*I(iii)(iiii)IO", kw, &obj, &h->bitmap, &h->nwords,
            &tail_mask, &h->entries, &h->entry_size, &h->nslots, &h->tag_off, &h->stamp_off,
            &h->qpos_off, &h->deliveries_off, &h->ring, &h->ring_cap, &h->head, &h->tail,
            &h->publish_seq, &h->readers_waiting, &h->release_seq, &h->claimers_waiting,
            &h->publishes_counter, &h->takes_counter, &me, &table, &owner_checked, &h->ev_claim,
            &h->ev_publish, &h->ev_take, &h->st_free, &h->st_writing, &h->st_ready, &h->st_held,
            &pending, &corrupt))
        return -1;
    if (!PyExceptionClass_Check(corrupt)) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_TypeError, "corrupt must be an exception class");
        return -1;
    }
    Py_INCREF(corrupt);
    Py_XSETREF(h->corrupt, corrupt);
    int bad = table.len != NSTATES * NEVENTS;
    if (!bad) memcpy(h->next, table.buf, sizeof(h->next));
    PyBuffer_Release(&table);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "transitions must be 16 x 16 bytes");
        return -1;
    }
    h->tail_mask = tail_mask;
    h->me = me & 0xFFFF;
    h->owner_checked = owner_checked;
    h->pending_states = pending;
    if (h->held) {
        PyBuffer_Release(&h->buf);
        h->held = 0;
    }
    if (PyObject_GetBuffer(obj, &h->buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    h->base = h->buf.buf;
    Py_ssize_t len = h->buf.len;
    /* Every region must lie inside the buffer: a wrong layout raises here, not later. */
    int ok = h->nslots > 0 && h->nwords == (h->nslots + 63) / 64 && h->entry_size >= 40 &&
             h->ring_cap > 0 && ((uintptr_t)h->base % 8) == 0;
    ok = ok && h->bitmap >= 0 && h->bitmap % 8 == 0 && h->bitmap + 8 * h->nwords <= len;
    ok = ok && h->entries >= 0 && h->entries % 8 == 0 && h->entry_size % 8 == 0 &&
         h->entries + h->nslots * h->entry_size <= len;
    ok = ok && h->ring >= 0 && h->ring % 8 == 0 && h->ring + 8 * h->ring_cap <= len;
    Py_ssize_t words[] = {h->tag_off, h->stamp_off, h->qpos_off, h->deliveries_off};
    for (int i = 0; i < 4; i++)
        ok = ok && words[i] >= 8 && words[i] % 8 == 0 && words[i] + 8 <= h->entry_size;
    Py_ssize_t singles[] = {h->head, h->tail, h->publish_seq, h->readers_waiting,
                            h->release_seq, h->claimers_waiting, h->publishes_counter,
                            h->takes_counter};
    for (int i = 0; i < 8; i++)
        ok = ok && singles[i] >= 0 && singles[i] % 8 == 0 && singles[i] + 8 <= len;
    if (!ok) {
        PyBuffer_Release(&h->buf);
        PyErr_SetString(PyExc_ValueError, "HotPath layout does not fit the buffer");
        return -1;
    }
    h->held = 1;
    h->hint = 0;
    return 0;
}

static void
hp_dealloc(HotPath *h)
{
    if (h->held)
        PyBuffer_Release(&h->buf);
    Py_XDECREF(h->corrupt);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef hp_methods[] = {
    FAST("acquire", hp_acquire, "acquire(event, tag, counter_off) -> (slot, gen) | None"),
    FAST("publish", hp_publish, "publish(slot, gen) -> 0 | -1 not owner | -2 ring full"),
    FAST("take", hp_take, "take() -> (slot, gen, tag, deliveries) | None | blocking owner id"),
    FAST("free", hp_free, "free(slot, gen, state, event, counter_off) -> 0 | -1"),
    FAST("push", hp_push, "push(slot) -> position | -1 when the ring is full"),
    FAST("drop_stale_head", hp_drop_stale_head, "drop_stale_head() -> bool"),
    FAST("transition", hp_transition, "transition(word, event, actor) -> word | None"),
    FAST("init_ring", hp_init_ring, "init_ring(): mark every ring cell empty"),
    FAST("forget_position", hp_forget_position, "forget_position(slot): drop a dangling position"),
    FAST("queued", hp_queued, "queued() -> entries in the ready ring"),
    {"release", (PyCFunction)hp_release, METH_NOARGS, "release the buffer export"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HotPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._hotpath.HotPath",
    .tp_doc = "The per-request slot transitions of one participant, compiled.",
    .tp_basicsize = sizeof(HotPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hp_init,
    .tp_dealloc = (destructor)hp_dealloc,
    .tp_methods = hp_methods,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shmslots._hotpath", "Compiled hot path of the slot protocol.", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    if (PyType_Ready(&HotPathType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&HotPathType);
    if (PyModule_AddObject(m, "HotPath", (PyObject *)&HotPathType) < 0) {
        Py_DECREF(&HotPathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
