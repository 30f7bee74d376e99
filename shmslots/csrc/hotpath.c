/* Every transition of the slot protocol, compiled: one C call each.
 *
 * A call here runs with the GIL held and calls no Python code, so a signal,
 * KeyboardInterrupt or exception can land only before or after it, never
 * between its steps; only SIGKILL can, and every such window leaves a state
 * the protocol recovers from (docs/protocol.md says which).  The steps:
 *
 *   acquire        FREE -> WRITING (claim), or -> WRITING -> RESERVED (reserve) once
 *                  the slot is set up, so nobody can open a half-made reservation
 *   open_reserved  RESERVED(anyone) -> WRITING(me)
 *   publish        WRITING -> READY, then queue it ("ready first": no reader ever
 *                  waits on a publisher's progress; see requeue_stranded)
 *   keep           WRITING -> HELD by the writer itself, never queued: a row landed
 *                  for this process's own later use (committed where it is consumed)
 *   quarantine     RESERVED or WRITING -> QUARANTINED until a deadline: an aborted
 *                  transfer's slot, which a late write by address may still reach
 *   expire         QUARANTINED -> RECLAIMING -> FREE once the deadline passed, by anyone
 *                  (acquire does it when it finds no FREE slot)
 *   take           READY -> HELD of the oldest queued slot; counts the delivery and
 *                  how long the row waited READY
 *   free           owned -> RECLAIMING -> FREE (release, abort); a HELD slot's hold time
 *                  goes into its histogram (bucket and sum)
 *   redeliver      HELD -> READY, queued again
 *   cancel         READY -> RECLAIMING -> FREE for every slot of a tag
 *   reclaim_owner  every slot of one owner: a closing table's own, or a dead one's
 *   reap_entry     lock a dead participant's registry entry, reclaim, free, unlock
 *   requeue_stranded  queue READY slots whose queueing a dead or stopped process
 *                  never finished
 *
 * Nothing here defines the protocol's data: the transition table comes from
 * states.py and every offset from layout.py, both passed in by ownership.py at
 * construction (which checks at import that STATES and EVENTS below match states.py,
 * and passes each of COUNTERS its offset by name).  tests/test_hotpath.py holds the compiled transitions against
 * states.next_word for every state, event and actor.
 *
 * The slot word and the ready ring's cell are defined in core.h; the ring's steps and the
 * memory ordering are stated in docs/protocol.md (The ready ring, Memory ordering).  The
 * steps a handle makes (hot_*) are declared there too, for leases.c to call directly.
 */
#include "core.h"
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NSTATES 16
#define NEVENTS 16
#define NONE 0xFF
#define NO_POS UINT64_MAX
#define REG_ACTIVE 1
#define REG_FREE 0
#define HIST_MAX_BOUNDS 31

/* The names of core.h's numbering, exported for ownership.py to check against states.py. */
static const char *state_names[] = {"FREE", "RESERVED",   "WRITING",    "READY",
                                    "HELD", "RECLAIMING", "QUARANTINED"};
static const char *event_names[] = {"CLAIM",     "RESERVE", "OPEN_RESERVED", "PUBLISH", "TAKE",
                                    "RELEASE",   "ABORT",   "RECLAIM",       "REDELIVER",
                                    "FINISH",    "CANCEL",  "KEEP",          "QUARANTINE",
                                    "EXPIRE"};
/* Counters this file bumps, in the order of the `counters` offsets passed in. */
enum {
    C_CLAIMS, C_RESERVES, C_PUBLISHES, C_TAKES, C_RELEASES, C_ABORTS, C_CANCELS,
    C_RECLAIMED_WRITING, C_RECLAIMED_RESERVED, C_RECLAIMED_HELD_DROPPED, C_REDELIVERED,
    C_PARTICIPANTS_REAPED, C_QUARANTINED, C_QUARANTINES_ENDED, C_COUNT
};
static const char *counter_names[] = {
    "claims", "reserves", "publishes", "takes", "releases", "aborts", "cancels",
    "reclaimed_writing", "reclaimed_reserved", "reclaimed_held_dropped", "redelivered",
    "participants_reaped", "quarantined", "quarantines_ended"};

struct HotPath {
    PyObject_HEAD
    Py_buffer buf;
    int held;
    char *base;
    /* layout (absolute offsets) */
    Py_ssize_t bitmap, nwords, entries, entry_size, nslots;
    Py_ssize_t tag_off, stamp_off, qpos_off, deliveries_off, deadline_off;
    Py_ssize_t ring, ring_cap, head, tail;
    Py_ssize_t publish_seq, readers_waiting, readers_until;
    Py_ssize_t release_seq, claimers_waiting, claimers_until;
    Py_ssize_t registry, reg_entry, reg_capacity, reg_state;
    Py_ssize_t counter[C_COUNT];
    /* histograms: bucket i counts observations <= bounds[i] (and > bounds[i-1]); the
     * bucket after the last bound counts the rest; the u64 at hist_sum (relative to each
     * histogram) adds up the nanoseconds observed */
    Py_ssize_t hist_held, hist_ready, hist_sum;
    uint64_t bounds[HIST_MAX_BOUNDS];
    int nbounds;
    uint64_t tail_mask;
    /* protocol */
    uint64_t me;
    uint8_t next[NSTATES][NEVENTS];
    uint32_t owner_checked; /* bit e set: event e requires actor == owner */
    Py_ssize_t hint;
    int left; /* leave() has run: this participant's registry entry is no longer ours */
    PyObject *corrupt; /* exception class for a segment that breaks the protocol's rules */
};

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

/* states.next_word, table driven; returns 0 and sets *out, or -1 if illegal. */
static int
transition(HotPath *h, uint64_t word, int event, uint64_t actor, uint64_t *out)
{
    unsigned state = state_of(word);
    uint64_t gen = generation_of(word);
    if (state >= NSTATES || event < 0 || event >= NEVENTS || h->next[state][event] == NONE)
        return -1;
    if ((h->owner_checked >> event & 1) && owner_of(word) != actor)
        return -1;
    unsigned target = h->next[state][event];
    if (target == S_FREE)
        *out = owned_word(gen + 1, 0, S_FREE);
    else if (target == S_READY)
        *out = owned_word(gen, 0, target);
    else
        *out = owned_word(gen, actor, target);
    return 0;
}

/* Wake sleepers on `seq` if any may be asleep: counted, and inside the deadline the last
 * one announced.  A sleeper killed in its sleep stays counted, but its deadline passes
 * within a nap, so it never makes every later wake a syscall. */
static inline void
wake(HotPath *h, Py_ssize_t seq, Py_ssize_t waiting, Py_ssize_t until, uint64_t now)
{
    __atomic_fetch_add((uint32_t *)(h->base + seq), 1, __ATOMIC_SEQ_CST);
    if (ld(h, waiting) && ld(h, until) > now)
        syscall(SYS_futex, h->base + seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void wake_readers(HotPath *h, uint64_t now) { wake(h, h->publish_seq, h->readers_waiting, h->readers_until, now); }
static inline void wake_claimers(HotPath *h, uint64_t now) { wake(h, h->release_seq, h->claimers_waiting, h->claimers_until, now); }
static inline void count(HotPath *h, int which) { __atomic_fetch_add(w64(h, h->counter[which]), 1, __ATOMIC_SEQ_CST); }
/* One observation: one atomic add on its bucket, one on the sum.  Relaxed: a reader may see
 * one before the other, a scrape's sum and count differing by an observation in flight. */
static inline void
observe(HotPath *h, Py_ssize_t hist, uint64_t since, uint64_t now)
{
    uint64_t ns = now > since ? now - since : 0;
    int i = 0;
    while (i < h->nbounds && ns > h->bounds[i])
        i++;
    __atomic_fetch_add(w64(h, hist + 8 * i), 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(w64(h, hist + h->hist_sum), ns, __ATOMIC_RELAXED);
}
static inline void set_bit(HotPath *h, Py_ssize_t slot) { __atomic_fetch_or(w64(h, h->bitmap + 8 * (slot >> 6)), UINT64_C(1) << (slot & 63), __ATOMIC_SEQ_CST); }
static inline void clear_bit(HotPath *h, Py_ssize_t slot) { __atomic_fetch_and(w64(h, h->bitmap + 8 * (slot >> 6)), ~(UINT64_C(1) << (slot & 63)), __ATOMIC_SEQ_CST); }

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
    if (value == empty_cell(head + (uint64_t)h->ring_cap) || cell_pos(value) == next_lap) {
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
        uint64_t head = ld(h, h->head), tail = ld(h, h->tail);
        /* Full, unless head lags behind a consumed cell.  Head may be one past tail: a
         * reader popped the entry of a pusher that stopped before moving tail (the cell
         * check below moves tail on); unsigned, that would read as a full ring forever. */
        if (tail >= head && tail - head >= cap) {
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
        } else if (((value & FULL) && cell_pos(value) == (tail & POS_MASK)) ||
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
        if ((value & FULL) && cell_pos(value) == (head & POS_MASK)) {
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

static void
ring_pop(HotPath *h, uint64_t pos, Py_ssize_t slot)
{
    Py_ssize_t cell = h->ring + 8 * (Py_ssize_t)(pos % (uint64_t)h->ring_cap);
    cas(h, cell, full_cell(pos, (uint64_t)slot), empty_cell(pos + (uint64_t)h->ring_cap));
    cas(h, h->head, pos, pos + 1);
}

/* Whether the ring holds `slot`'s entry at the slot's recorded position. */
static int
queued_at_its_position(HotPath *h, Py_ssize_t slot)
{
    uint64_t pos = ld(h, entry_of(h, slot) + h->qpos_off);
    return pos != NO_POS && cell_at(h, pos) == full_cell(pos, (uint64_t)slot);
}

/* Whether the head entry is one a reader would deliver (a READY slot queued there). */
static int
head_is_live(HotPath *h, uint64_t pos, Py_ssize_t slot)
{
    if (slot >= h->nslots)
        return 0;
    Py_ssize_t entry = entry_of(h, slot);
    return state_of(ld(h, entry)) == S_READY && ld(h, entry + h->qpos_off) == pos;
}

static int drop_stale_heads(HotPath *h);

/* Room for one more entry: 1, 0 (full of live entries), or RING_CORRUPT.  Stale entries
 * at the head are dropped to make room. */
static int
ring_room(HotPath *h)
{
    for (long attempt = 0; attempt < RING_RETRIES; attempt++) {
        uint64_t head = ld(h, h->head), tail = ld(h, h->tail);
        if (tail < head || tail - head < (uint64_t)h->ring_cap) /* tail < head: ring_push */
            return 1;
        if (help_head(h, head))
            continue;
        int dropped = drop_stale_heads(h);
        if (dropped != 1)
            return dropped; /* 0: every entry up to the first is live, so the ring is full */
    }
    return RING_CORRUPT;
}

/* Pop the stale entries at the head (cancelled, reclaimed or doubled publications), up to the
 * first live one: 1 if any was popped, 0 if none, RING_CORRUPT. */
static int
drop_stale_heads(HotPath *h)
{
    int dropped = 0;
    for (long attempt = 0; attempt < RING_RETRIES; attempt++) {
        uint64_t pos;
        Py_ssize_t slot;
        int peeked = ring_peek(h, &pos, &slot);
        if (peeked == RING_CORRUPT)
            return RING_CORRUPT;
        if (peeked < 0 || head_is_live(h, pos, slot))
            return dropped;
        ring_pop(h, pos, slot);
        dropped = 1;
    }
    return RING_CORRUPT;
}

static PyObject *
corrupt_ring(HotPath *h)
{
    PyErr_SetString(h->corrupt, "the ready ring never settles: its head, tail or cells are corrupt");
    return NULL;
}

/* -- the steps, for any caller inside this file ------------------------------------------ */

/* Queue a slot that has just turned READY.  A full ring (only possible with stale entries
 * piling up in a race) leaves it stranded for requeue_stranded; 1 queued, 0 stranded, or
 * RING_CORRUPT. */
static int
queue_ready(HotPath *h, Py_ssize_t slot, uint64_t now)
{
    int64_t pushed = ring_push(h, slot);
    if (pushed == RING_CORRUPT)
        return RING_CORRUPT;
    if (pushed < 0)
        return 0;
    wake_readers(h, now);
    return 1;
}

/* Hand back a slot the caller may act for (its own, or a dead owner's under the reaper's
 * lock) that is in `word` now: `event` takes it to RECLAIMING under our id, the bit is
 * cleared, FINISH makes it FREE.  1 done, 0 the word changed first (nothing done). */
static int
to_free(HotPath *h, Py_ssize_t slot, uint64_t word, int event)
{
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t closing, freed;
    if (transition(h, word, event, h->me, &closing) != 0 || state_of(closing) != S_RECLAIMING ||
        transition(h, closing, E_FINISH, h->me, &freed) != 0)
        return 0;
    if (!cas(h, entry, word, closing))
        return 0;
    kill_point(KILL_RECLAIMING);
    /* Read while RECLAIMING(me): once FREE, a claimer may stamp the slot first. */
    uint64_t taken = ld(h, entry + h->stamp_off);
    clear_bit(h, slot);
    uint64_t now = now_ns();
    st(h, entry + h->stamp_off, now); /* still ours: a later owner's stamp is never overwritten */
    /* Nobody else may change RECLAIMING(me): this cannot fail. */
    cas(h, entry, closing, freed);
    if (state_of(word) == S_HELD) /* its stamp was the take's */
        observe(h, h->hist_held, taken, now);
    if (state_of(word) == S_QUARANTINED) /* a free killed before this is finished uncounted */
        count(h, C_QUARANTINES_ENDED);
    wake_claimers(h, now);
    return 1;
}

/* HELD(owner) -> READY and queued again: 1, 0 if the word is not `word`, RING_CORRUPT.
 * `unread`: the take that made it HELD handed nothing to its caller, so its delivery is
 * taken back while the slot is still held (no reader can count one meanwhile). */
static int
redeliver(HotPath *h, Py_ssize_t slot, uint64_t word, int unread)
{
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t ready;
    if (state_of(word) != S_HELD || transition(h, word, E_REDELIVER, h->me, &ready) != 0)
        return 0;
    uint64_t now = now_ns();
    /* Its old entry (if a reader died before popping it) goes stale first. */
    st(h, entry + h->qpos_off, NO_POS);
    st(h, entry + h->stamp_off, now);
    uint64_t *deliveries = w64(h, entry + h->deliveries_off);
    unread = unread && __atomic_load_n(deliveries, __ATOMIC_SEQ_CST) > 0;
    if (unread)
        __atomic_fetch_sub(deliveries, 1, __ATOMIC_SEQ_CST);
    if (!cas(h, entry, word, ready)) {
        if (unread) /* still HELD by someone: no reader counted anything since */
            __atomic_fetch_add(deliveries, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    count(h, C_REDELIVERED);
    return queue_ready(h, slot, now) == RING_CORRUPT ? RING_CORRUPT : 1;
}

typedef struct {
    long writing, reserved, held_dropped, redelivered, quarantined;
} Reclaimed;

/* Reclaim every slot whose word names `owner`: 0, or -1 with an error set. */
static int
reclaim_owner(HotPath *h, uint64_t owner, int drop_held, Reclaimed *done)
{
    for (Py_ssize_t slot = 0; slot < h->nslots; slot++) {
        uint64_t word = ld(h, entry_of(h, slot));
        if (owner_of(word) != owner || state_of(word) == S_FREE || state_of(word) == S_READY)
            continue;
        switch (state_of(word)) {
        case S_WRITING:
            done->writing += to_free(h, slot, word, E_RECLAIM);
            break;
        case S_RESERVED: /* a producer may open it first: then it is the producer's */
            done->reserved += to_free(h, slot, word, E_RECLAIM);
            break;
        case S_QUARANTINED: /* its owner's engine died with it (to_free counts it ended) */
            done->quarantined += to_free(h, slot, word, E_RECLAIM);
            break;
        case S_RECLAIMING: /* its owner, or a reaper, died half way: finish */
            to_free(h, slot, word, E_RECLAIM);
            break;
        case S_HELD:
            if (drop_held) {
                done->held_dropped += to_free(h, slot, word, E_RECLAIM);
            } else {
                int r = redeliver(h, slot, word, 0); /* its reader may have read it */
                if (r == RING_CORRUPT) {
                    corrupt_ring(h);
                    return -1;
                }
                done->redelivered += r;
            }
            break;
        default:
            PyErr_Format(h->corrupt,
                         "slot %zd has state word %#llx: no state this version knows", slot,
                         (unsigned long long)word);
            return -1;
        }
    }
    if (done->writing) __atomic_fetch_add(w64(h, h->counter[C_RECLAIMED_WRITING]), done->writing, __ATOMIC_SEQ_CST);
    if (done->reserved) __atomic_fetch_add(w64(h, h->counter[C_RECLAIMED_RESERVED]), done->reserved, __ATOMIC_SEQ_CST);
    if (done->held_dropped) __atomic_fetch_add(w64(h, h->counter[C_RECLAIMED_HELD_DROPPED]), done->held_dropped, __ATOMIC_SEQ_CST);
    return 0;
}

static PyObject *
reclaimed_tuple(Reclaimed *done)
{
    return Py_BuildValue("(lllll)", done->writing, done->reserved, done->held_dropped,
                         done->redelivered, done->quarantined);
}

/* Free every QUARANTINED slot, anyone's, whose window ended by `now`: how many.  The scan
 * is skipped only when no slot can be QUARANTINED: `quarantined` is counted before a slot
 * turns so and `quarantines_ended` after it is freed, so ended < quarantined whenever one
 * is (a kill between the two steps of either leaves the gap wider: more scans, never
 * fewer).  The word is read before its deadline, so a deadline read belongs to that word's
 * quarantine, to none yet (0, "not yet": the claim's, until its owner stores it just after
 * the CAS), or to a later one, whose CAS against the word read then fails. */
static long
expire_quarantined(HotPath *h, uint64_t now)
{
    uint64_t ended = ld(h, h->counter[C_QUARANTINES_ENDED]);
    if (ended >= ld(h, h->counter[C_QUARANTINED]))
        return 0;
    long freed = 0;
    for (Py_ssize_t slot = 0; slot < h->nslots; slot++) {
        Py_ssize_t entry = entry_of(h, slot);
        uint64_t word = ld(h, entry);
        if (state_of(word) != S_QUARANTINED)
            continue;
        uint64_t deadline = ld(h, entry + h->deadline_off);
        if (deadline && deadline <= now)
            freed += to_free(h, slot, word, E_EXPIRE);
    }
    return freed;
}

/* -- argument checks -------------------------------------------------------------------- */

int
hot_member(HotPath *h)
{
    return h->held && !h->left;
}

/* Whether this participant may act through `h`; TableClosed set if not: a participant that
 * has left is a closed table to every call of it, the ones racing its close included. */
static int
acting(HotPath *h)
{
    if (!hot_member(h)) {
        table_closed_error(h->left ? "this participant has left the table (it was closed)"
                                   : "the table is closed (its hot path released)");
        return 0;
    }
    return 1;
}

static int
in_range(HotPath *h, Py_ssize_t slot)
{
    if (slot < 0 || slot >= h->nslots) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range", slot);
        return 0;
    }
    return 1;
}

/* A generation is the slot word's 32 bits (core.h); error set if `gen` is not one. */
static int
generation_fits(uint64_t gen)
{
    if (gen > GEN_MASK) {
        PyErr_SetString(PyExc_OverflowError, "generation is 32 bits");
        return 0;
    }
    return 1;
}

/* What every step a handle makes checks first (core.h). */
static int
may_step(HotPath *h, Py_ssize_t slot, uint64_t gen)
{
    return acting(h) && in_range(h, slot) && generation_fits(gen);
}

static int
need(HotPath *h, Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (!acting(h))
        return 0;
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
    return in_range(h, *slot);
}

static int
gen_arg(PyObject *o, uint64_t *gen)
{
    *gen = PyLong_AsUnsignedLongLong(o);
    return !PyErr_Occurred() && generation_fits(*gen);
}

/* -- methods ---------------------------------------------------------------------------- */

/* One scan of the bitmap for a FREE slot to take by `event`: the slot, or -1 if none (then
 * *skipped says whether a FREE slot was passed over for its entry still in the ring). */
static Py_ssize_t
acquire_scan(HotPath *h, int event, uint64_t tag, uint64_t *generation, int *skipped)
{
    for (Py_ssize_t step = 0; step < h->nwords; step++) {
        Py_ssize_t wi = (h->hint + step) % h->nwords;
        uint64_t bits = ld(h, h->bitmap + 8 * wi);
        if (wi == h->nwords - 1)
            bits |= h->tail_mask;
        uint64_t free_bits = ~bits;
        while (free_bits) {
            uint64_t low = free_bits & (~free_bits + 1);
            Py_ssize_t slot = wi * 64 + __builtin_ctzll(free_bits);
            Py_ssize_t entry = entry_of(h, slot);
            uint64_t word = ld(h, entry), mine;
            free_bits ^= low;
            if (state_of(word) != S_FREE)
                continue;
            /* A slot whose last queue entry is still in the ring (a cancelled or
             * reclaimed publication) waits until readers pass it: at most one entry
             * per slot, so stale entries can never fill the ring. */
            if (queued_at_its_position(h, slot)) {
                *skipped = 1;
                continue;
            }
            if (transition(h, word, E_CLAIM, h->me, &mine) != 0 || !cas(h, entry, word, mine))
                continue;
            set_bit(h, slot);
            st(h, entry + h->tag_off, tag);
            st(h, entry + h->qpos_off, NO_POS);
            st(h, entry + h->deliveries_off, 0);
            st(h, entry + h->stamp_off, now_ns());
            if (event == E_RESERVE) {
                uint64_t booked;
                /* WRITING(me) is ours alone: neither step can fail. */
                transition(h, mine, E_RESERVE, h->me, &booked);
                cas(h, entry, mine, booked);
            }
            count(h, event == E_RESERVE ? C_RESERVES : C_CLAIMS);
            h->hint = wi;
            *generation = generation_of(mine);
            return slot;
        }
    }
    return -1;
}

/* CLAIM: FREE -> WRITING(me).  RESERVE: the same, then -> RESERVED(me) once the bit, tag
 * and queue position are set, so no producer can open a reservation still being made.
 * FREE slots held back by stale entries at the ring's head are freed up by popping those,
 * and QUARANTINED ones whose window has ended by expiring them. */
int
hot_acquire(HotPath *h, int event, uint64_t tag, Py_ssize_t *slot, uint64_t *gen)
{
    if (!acting(h))
        return STEP_ERROR;
    if (event != E_CLAIM && event != E_RESERVE) {
        PyErr_SetString(PyExc_ValueError, "acquire takes CLAIM or RESERVE");
        return STEP_ERROR;
    }
    int skipped = 0;
    *slot = acquire_scan(h, event, tag, gen, &skipped);
    if (*slot < 0 && skipped) {
        int dropped = drop_stale_heads(h);
        if (dropped == RING_CORRUPT) {
            corrupt_ring(h);
            return STEP_ERROR;
        }
        if (dropped)
            *slot = acquire_scan(h, event, tag, gen, &skipped);
    }
    if (*slot < 0 && expire_quarantined(h, now_ns()))
        *slot = acquire_scan(h, event, tag, gen, &skipped);
    return *slot >= 0;
}

/* acquire(event, tag) -> (slot, generation) | None: hot_acquire. */
static PyObject *
hp_acquire(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 2, "acquire")) return NULL;
    int event = (int)PyLong_AsLong(args[0]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t slot;
    uint64_t gen = 0;
    int got = hot_acquire(h, event, tag, &slot, &gen);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *pair = Py_BuildValue("(nK)", slot, (unsigned long long)gen);
    if (!pair) /* out of memory: the slot goes back rather than stay owned by nobody */
        to_free(h, slot, owned_word(gen, h->me, event == E_RESERVE ? S_RESERVED : S_WRITING),
                E_ABORT);
    return pair;
}

/* RESERVED(anyone, generation) -> WRITING(me). */
int
hot_open_reserved(HotPath *h, Py_ssize_t slot, uint64_t gen, uint64_t *tag)
{
    uint64_t mine;
    if (!may_step(h, slot, gen))
        return STEP_ERROR;
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t word = ld(h, entry);
    if (state_of(word) != S_RESERVED || generation_of(word) != gen ||
        transition(h, word, E_OPEN_RESERVED, h->me, &mine) != 0 || !cas(h, entry, word, mine))
        return 0;
    st(h, entry + h->stamp_off, now_ns());
    *tag = ld(h, entry + h->tag_off);
    return 1;
}

/* open_reserved(slot, generation) -> tag | None (not reserved at that generation: nothing
 * changed). */
static PyObject *
hp_open_reserved(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen, tag;
    if (!need(h, nargs, 2, "open_reserved") || !slot_arg(h, args[0], &slot) ||
        !gen_arg(args[1], &gen))
        return NULL;
    int opened = hot_open_reserved(h, slot, gen, &tag);
    if (opened <= 0)
        return opened < 0 ? NULL : Py_NewRef(Py_None);
    return PyLong_FromUnsignedLongLong(tag);
}

/* A step's code as the Python methods return it: NULL for STEP_ERROR (error set). */
static PyObject *
code(int step)
{
    return step == STEP_ERROR ? NULL : PyLong_FromLong(step);
}

/* WRITING(me) -> READY, then queued: STEP_DONE, STEP_REFUSED (not this participant's WRITING
 * slot), STEP_QUEUE_FULL (the ring full of live entries: nothing changed). */
int
hot_publish(HotPath *h, Py_ssize_t slot, uint64_t gen)
{
    uint64_t ready;
    if (!may_step(h, slot, gen))
        return STEP_ERROR;
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t mine = owned_word(gen, h->me, S_WRITING);
    if (ld(h, entry) != mine || transition(h, mine, E_PUBLISH, h->me, &ready) != 0)
        return STEP_REFUSED;
    int room = ring_room(h);
    if (room == RING_CORRUPT) {
        corrupt_ring(h);
        return STEP_ERROR;
    }
    if (!room)
        return STEP_QUEUE_FULL;
    uint64_t now = now_ns();
    st(h, entry + h->stamp_off, now);
    if (!cas(h, entry, mine, ready))
        return STEP_REFUSED;
    count(h, C_PUBLISHES);
    if (queue_ready(h, slot, now) == RING_CORRUPT) {
        corrupt_ring(h);
        return STEP_ERROR;
    }
    return STEP_DONE;
}

/* publish(slot, generation) -> 0 published, -1 not this participant's WRITING slot,
 * -2 ready ring full of live entries (nothing changed). */
static PyObject *
hp_publish(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen;
    if (!need(h, nargs, 2, "publish") || !slot_arg(h, args[0], &slot) || !gen_arg(args[1], &gen))
        return NULL;
    return code(hot_publish(h, slot, gen));
}

/* WRITING(me) -> HELD(me): STEP_DONE, or STEP_REFUSED if not this participant's WRITING
 * slot (nothing changed).  Counted as a publish and a take, so counters read as if it went
 * through the ring. */
int
hot_keep(HotPath *h, Py_ssize_t slot, uint64_t gen)
{
    uint64_t held;
    if (!may_step(h, slot, gen))
        return STEP_ERROR;
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t mine = owned_word(gen, h->me, S_WRITING);
    if (ld(h, entry) != mine || transition(h, mine, E_KEEP, h->me, &held) != 0)
        return STEP_REFUSED;
    /* Before the CAS, as publish stamps before it, while the slot is still our WRITING one:
     * after it, a SIGKILL between the CAS and these stores would leave a HELD row that a
     * reaper redelivers saying it was never delivered. */
    st(h, entry + h->stamp_off, now_ns());
    st(h, entry + h->deliveries_off, 1); /* delivered once: to its writer */
    if (!cas(h, entry, mine, held))
        return STEP_REFUSED;
    count(h, C_PUBLISHES);
    count(h, C_TAKES);
    return STEP_DONE;
}

/* keep(slot, generation) -> 0 kept, -1 not this participant's WRITING slot. */
static PyObject *
hp_keep(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen;
    if (!need(h, nargs, 2, "keep") || !slot_arg(h, args[0], &slot) || !gen_arg(args[1], &gen))
        return NULL;
    return code(hot_keep(h, slot, gen));
}

/* quarantine(slot, generation, state, deadline_ns) -> 0, or -1 if the slot is not this
 * participant's RESERVED or WRITING one (`state`) at `generation` (nothing changed): the
 * slot of an aborted transfer is closed to every writer and reader until CLOCK_MONOTONIC
 * `deadline_ns`.  The CAS comes first: before it, a producer may open a RESERVED slot and
 * publish it, and stores into its entry would corrupt that row.  After it the slot is ours
 * alone: its deadline word (the deliveries count, which no stale step writes) still holds
 * the claim's 0, "not yet", which nobody expires, until the store, the last step. */
static PyObject *
hp_quarantine(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen, closed;
    if (!need(h, nargs, 4, "quarantine") || !slot_arg(h, args[0], &slot) ||
        !gen_arg(args[1], &gen))
        return NULL;
    long state = PyLong_AsLong(args[2]);
    unsigned long long deadline = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (state != S_RESERVED && state != S_WRITING) {
        PyErr_SetString(PyExc_ValueError, "quarantine takes a RESERVED or WRITING slot");
        return NULL;
    }
    Py_ssize_t entry = entry_of(h, slot);
    uint64_t mine = owned_word(gen, h->me, (unsigned)state);
    if (ld(h, entry) != mine || transition(h, mine, E_QUARANTINE, h->me, &closed) != 0)
        return PyLong_FromLong(-1);
    count(h, C_QUARANTINED); /* first: see expire_quarantined */
    if (!cas(h, entry, mine, closed)) {
        /* its producer opened it first: counted as a quarantine that ended at once, so both
         * counters only grow (they are Prometheus counters) */
        count(h, C_QUARANTINES_ENDED);
        return PyLong_FromLong(-1);
    }
    kill_point(KILL_QUARANTINED);
    st(h, entry + h->stamp_off, now_ns());
    st(h, entry + h->deadline_off, deadline ? deadline : 1); /* 0 means "not yet" */
    return PyLong_FromLong(0);
}

/* expire() -> slots freed: every QUARANTINED slot whose window has ended, whoever owns it. */
static PyObject *
hp_expire(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 0, "expire")) return NULL;
    return PyLong_FromLong(expire_quarantined(h, now_ns()));
}

/* Whether the slot is this participant's WRITING one at `gen`: the proof the one sealing
 * order (leases.c, seal_mine) asks for first. */
int
hot_writing(HotPath *h, Py_ssize_t slot, uint64_t gen)
{
    if (!may_step(h, slot, gen))
        return STEP_ERROR;
    return ld(h, entry_of(h, slot)) == owned_word(gen, h->me, S_WRITING);
}

/* writing(slot, generation) -> bool: hot_writing. */
static PyObject *
hp_writing(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen;
    if (!need(h, nargs, 2, "writing") || !slot_arg(h, args[0], &slot) || !gen_arg(args[1], &gen))
        return NULL;
    int mine = hot_writing(h, slot, gen);
    return mine < 0 ? NULL : PyBool_FromLong(mine);
}

/* READY -> HELD(me) of the oldest queued slot: 1 (*slot, *gen, *tag and *before, the
 * deliveries before this one, set), 0 nothing ready, STEP_ERROR. */
int
hot_take(HotPath *h, Py_ssize_t *slot, uint64_t *gen, uint64_t *tag, uint64_t *before)
{
    if (!acting(h))
        return STEP_ERROR;
    for (;;) {
        uint64_t pos;
        int peeked = ring_peek(h, &pos, slot);
        if (peeked == RING_CORRUPT) {
            corrupt_ring(h);
            return STEP_ERROR;
        }
        if (peeked < 0)
            return 0;
        if (head_is_live(h, pos, *slot)) {
            Py_ssize_t entry = entry_of(h, *slot);
            uint64_t word = ld(h, entry), held;
            if (state_of(word) == S_READY && transition(h, word, E_TAKE, h->me, &held) == 0 &&
                cas(h, entry, word, held)) {
                ring_pop(h, pos, *slot);
                uint64_t now = now_ns();
                /* The stamp is the publish's (or the redelivery's): the row's wait. */
                observe(h, h->hist_ready, ld(h, entry + h->stamp_off), now);
                st(h, entry + h->stamp_off, now);
                /* Counted in the step that delivers: a second delivery always says so. */
                *before = __atomic_fetch_add(w64(h, entry + h->deliveries_off), 1,
                                             __ATOMIC_SEQ_CST);
                count(h, C_TAKES);
                *gen = generation_of(word);
                *tag = ld(h, entry + h->tag_off);
                return 1;
            }
            continue;
        }
        ring_pop(h, pos, *slot); /* stale: taken, cancelled or queued again elsewhere */
        if (*slot < h->nslots && state_of(ld(h, entry_of(h, *slot))) == S_FREE)
            wake_claimers(h, now_ns()); /* claimable again (see acquire) */
    }
}

/* take() -> (slot, generation, tag, deliveries before this one) | None (nothing ready). */
static PyObject *
hp_take(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 0, "take")) return NULL;
    Py_ssize_t slot;
    uint64_t gen, tag, before;
    int took = hot_take(h, &slot, &gen, &tag, &before);
    if (took <= 0)
        return took < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *got = Py_BuildValue("(nKKK)", slot, (unsigned long long)gen,
                                  (unsigned long long)tag, (unsigned long long)before);
    if (!got) /* out of memory: back to READY rather than owned by nobody */
        redeliver(h, slot, owned_word(gen, h->me, S_HELD), 1);
    return got;
}

/* Owned -> RECLAIMING -> FREE, by RELEASE or ABORT: STEP_DONE, or STEP_REFUSED if the slot is
 * not this participant's in `state` at `gen` (nothing changed). */
int
hot_free(HotPath *h, Py_ssize_t slot, uint64_t gen, int state, int event)
{
    if (!may_step(h, slot, gen))
        return STEP_ERROR;
    if (state < 0 || state >= S_COUNT || (event != E_RELEASE && event != E_ABORT)) {
        PyErr_SetString(PyExc_ValueError, "free takes an owned state and RELEASE or ABORT");
        return STEP_ERROR;
    }
    uint64_t mine = owned_word(gen, h->me, (unsigned)state);
    if (ld(h, entry_of(h, slot)) != mine || !to_free(h, slot, mine, event))
        return STEP_REFUSED;
    if (state != S_QUARANTINED) /* its abort was the quarantine (counted as such) */
        count(h, event == E_RELEASE ? C_RELEASES : C_ABORTS);
    return STEP_DONE;
}

/* free(slot, generation, state, event) -> 0, or -1 (not this participant's slot). */
static PyObject *
hp_free(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen;
    if (!need(h, nargs, 4, "free") || !slot_arg(h, args[0], &slot) || !gen_arg(args[1], &gen))
        return NULL;
    long state = PyLong_AsLong(args[2]);
    long event = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    /* out of int's range: a number hot_free refuses, never one wrapped into its range */
    return code(hot_free(h, slot, gen, state < 0 || state > S_COUNT ? -1 : (int)state,
                         event < 0 || event > E_COUNT ? -1 : (int)event));
}

/* HELD(me) -> READY, queued again: a lease handed back.  `unread` (its caller never saw the
 * row: a strict check refused a batch, a handle could not be made) takes back the delivery
 * its take counted.  STEP_DONE, or STEP_REFUSED if not HELD by this participant at `gen`. */
int
hot_redeliver(HotPath *h, Py_ssize_t slot, uint64_t gen, int unread)
{
    if (!may_step(h, slot, gen))
        return STEP_ERROR;
    uint64_t mine = owned_word(gen, h->me, S_HELD);
    if (ld(h, entry_of(h, slot)) != mine)
        return STEP_REFUSED;
    int r = redeliver(h, slot, mine, unread);
    if (r == RING_CORRUPT) {
        corrupt_ring(h);
        return STEP_ERROR;
    }
    return r ? STEP_DONE : STEP_REFUSED;
}

/* redeliver(slot, generation, unread) -> 0, or -1 (not HELD by this participant). */
static PyObject *
hp_redeliver(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t gen;
    if (!need(h, nargs, 3, "redeliver") || !slot_arg(h, args[0], &slot) ||
        !gen_arg(args[1], &gen))
        return NULL;
    int unread = PyObject_IsTrue(args[2]);
    if (unread < 0)
        return NULL;
    return code(hot_redeliver(h, slot, gen, unread));
}

/* cancel(tag) -> slots cancelled: every READY slot carrying `tag` goes to FREE. */
static PyObject *
hp_cancel(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 1, "cancel")) return NULL;
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[0]);
    if (PyErr_Occurred()) return NULL;
    long cancelled = 0;
    for (Py_ssize_t slot = 0; slot < h->nslots; slot++) {
        Py_ssize_t entry = entry_of(h, slot);
        uint64_t word = ld(h, entry);
        /* The generation in the word guards the tag: a slot reused since fails the CAS. */
        if (state_of(word) == S_READY && ld(h, entry + h->tag_off) == tag &&
            to_free(h, slot, word, E_CANCEL)) {
            count(h, C_CANCELS);
            count(h, C_ABORTS);
            cancelled++;
        }
    }
    return PyLong_FromLong(cancelled);
}

/* reclaim_owner(owner, drop_held) -> (writing, reserved, held dropped, redelivered,
 * quarantined):
 * hand back every slot of `owner`.  Only for this participant's own id (a table closing, or
 * one that took over a dead participant's registry entry); reap_entry does it for others. */
static PyObject *
hp_reclaim_owner(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 2, "reclaim_owner")) return NULL;
    unsigned long owner = PyLong_AsUnsignedLong(args[0]);
    int drop_held = PyObject_IsTrue(args[1]);
    if (PyErr_Occurred() || drop_held < 0) return NULL;
    if (owner != h->me) {
        PyErr_SetString(PyExc_ValueError, "reclaim_owner is for this participant's own slots");
        return NULL;
    }
    Reclaimed done = {0};
    if (reclaim_owner(h, owner, drop_held, &done) < 0)
        return NULL;
    return reclaimed_tuple(&done);
}

static int
entry_lock(int fd, Py_ssize_t index, short kind)
{
    struct flock fl = {.l_type = kind, .l_whence = SEEK_SET, .l_start = index, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* reap_entry(fd, index, drop_held) -> (writing, reserved, held dropped, redelivered,
 * quarantined) | None:
 * take registry entry `index`'s liveness lock (on `fd`, an open file description of this
 * participant's), and if the entry is still ACTIVE, its holder is dead: reclaim its slots,
 * free the entry, drop the lock.  None if the lock is held (alive, or another reaper) or
 * the entry is no longer active.  One call, so no interrupt can leave the lock held. */
static PyObject *
hp_reap_entry(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 3, "reap_entry")) return NULL;
    int fd = (int)PyLong_AsLong(args[0]);
    Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    int drop_held = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred() || drop_held < 0) return NULL;
    if (index < 0 || index >= h->reg_capacity || (uint64_t)index + 1 == h->me) {
        PyErr_Format(PyExc_IndexError, "registry entry %zd cannot be reaped here", index);
        return NULL;
    }
    if (entry_lock(fd, index, F_WRLCK) < 0) {
        if (errno == EAGAIN || errno == EACCES)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_ssize_t state = h->registry + index * h->reg_entry + h->reg_state;
    PyObject *result = Py_None;
    Reclaimed done = {0};
    if (ld(h, state) == REG_ACTIVE) {
        if (reclaim_owner(h, (uint64_t)index + 1, drop_held, &done) < 0) {
            result = NULL;
        } else {
            st(h, state, REG_FREE);
            count(h, C_PARTICIPANTS_REAPED);
            result = reclaimed_tuple(&done);
        }
    } else {
        Py_INCREF(result);
    }
    int saved = errno;
    entry_lock(fd, index, F_UNLCK);
    errno = saved;
    return result;
}

/* leave(fd, drop_held) -> (writing, reserved, held dropped, redelivered,
 * quarantined) | None: this
 * participant detaches — its slots are handed back as if it had died, its registry entry
 * marked free, its liveness lock dropped — in one call, once: a second call (a close()
 * retried after an interrupt) does nothing, so it can never free an entry that another
 * participant has taken since, and every other step is refused from then on, so nothing is
 * taken under an owner id that may already be someone else's. */
static PyObject *
hp_leave(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (h->left) /* before need(), which refuses every other step from now on */
        Py_RETURN_NONE;
    if (!need(h, nargs, 2, "leave")) return NULL;
    int fd = (int)PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    int drop_held = PyObject_IsTrue(args[1]);
    if (drop_held < 0) return NULL;
    Reclaimed done = {0};
    if (reclaim_owner(h, h->me, drop_held, &done) < 0)
        return NULL;
    PyObject *counts = reclaimed_tuple(&done);
    if (!counts)
        return NULL;
    Py_ssize_t index = (Py_ssize_t)h->me - 1;
    st(h, h->registry + index * h->reg_entry + h->reg_state, REG_FREE);
    entry_lock(fd, index, F_UNLCK); /* FREE first: ACTIVE always means locked or dead */
    h->left = 1;
    return counts;
}

/* requeue_stranded(min_age_ns) -> slots queued: READY slots that are in no ring entry and
 * have been READY at least `min_age_ns` (a publisher or reaper died, or is stopped, between
 * turning a slot READY and queueing it).  A queueing still in flight may be doubled; the
 * slot's queue position names the one entry that can deliver it. */
static PyObject *
hp_requeue_stranded(HotPath *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (!need(h, nargs, 1, "requeue_stranded")) return NULL;
    unsigned long long min_age = PyLong_AsUnsignedLongLong(args[0]);
    if (PyErr_Occurred()) return NULL;
    uint64_t now = now_ns();
    long queued = 0;
    for (Py_ssize_t slot = 0; slot < h->nslots; slot++) {
        Py_ssize_t entry = entry_of(h, slot);
        if (state_of(ld(h, entry)) != S_READY || queued_at_its_position(h, slot))
            continue;
        uint64_t stamp = ld(h, entry + h->stamp_off);
        if (now > stamp && now - stamp < min_age)
            continue;
        int done = queue_ready(h, slot, now);
        if (done == RING_CORRUPT)
            return corrupt_ring(h);
        queued += done;
    }
    return PyLong_FromLong(queued);
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
        st(h, entry_of(h, slot) + h->qpos_off, NO_POS);
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
    if (transition(h, (uint64_t)word, event, (uint64_t)actor & FIELD_MASK, &out) != 0)
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
        "tag_off", "stamp_off", "qpos_off", "deliveries_off", "deadline_off", "ring", "ring_cap", "head",
        "tail", "publish_seq", "readers_waiting", "readers_until", "release_seq",
        "claimers_waiting", "claimers_until", "registry", "reg_entry", "reg_capacity",
        "reg_state", "counters", "hist_held", "hist_ready", "hist_sum", "hist_bounds", "me",
        "transitions", "owner_checked", "corrupt", NULL,
    };
    PyObject *obj, *counters, *bounds, *corrupt;
    unsigned long long tail_mask, me;
    Py_buffer table;
    unsigned int owner_checked;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "O$nnKnnnnnnnnnnnnnnnnnnnnnnO!nnnO!Ky*IO", kw, &obj, &h->bitmap, &h->nwords,
            &tail_mask, &h->entries, &h->entry_size, &h->nslots, &h->tag_off, &h->stamp_off,
            &h->qpos_off, &h->deliveries_off, &h->deadline_off, &h->ring, &h->ring_cap, &h->head, &h->tail,
            &h->publish_seq, &h->readers_waiting, &h->readers_until, &h->release_seq,
            &h->claimers_waiting, &h->claimers_until, &h->registry, &h->reg_entry,
            &h->reg_capacity, &h->reg_state, &PyTuple_Type, &counters, &h->hist_held,
            &h->hist_ready, &h->hist_sum, &PyTuple_Type, &bounds, &me, &table,
            &owner_checked, &corrupt))
        return -1;
    int bad = table.len != NSTATES * NEVENTS;
    if (!bad) memcpy(h->next, table.buf, sizeof(h->next));
    PyBuffer_Release(&table);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "transitions must be 16 x 16 bytes");
        return -1;
    }
    if (!PyExceptionClass_Check(corrupt)) {
        PyErr_SetString(PyExc_TypeError, "corrupt must be an exception class");
        return -1;
    }
    if (PyTuple_GET_SIZE(counters) != C_COUNT) {
        PyErr_Format(PyExc_ValueError, "counters must be %d offsets", C_COUNT);
        return -1;
    }
    Py_ssize_t nbounds = PyTuple_GET_SIZE(bounds);
    if (nbounds > HIST_MAX_BOUNDS) {
        PyErr_Format(PyExc_ValueError, "at most %d histogram bounds", HIST_MAX_BOUNDS);
        return -1;
    }
    uint64_t bound[HIST_MAX_BOUNDS] = {0};
    for (Py_ssize_t i = 0; i < nbounds; i++) {
        bound[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(bounds, i));
        if (PyErr_Occurred())
            return -1;
        if (i && bound[i] <= bound[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "histogram bounds must increase");
            return -1;
        }
    }
    Py_ssize_t counter[C_COUNT];
    for (int i = 0; i < C_COUNT; i++)
        if ((counter[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(counters, i))) == -1 && PyErr_Occurred())
            return -1;
    Py_INCREF(corrupt);
    Py_XSETREF(h->corrupt, corrupt);
    memcpy(h->bounds, bound, sizeof(bound));
    h->nbounds = (int)nbounds;
    h->tail_mask = tail_mask;
    h->me = me & FIELD_MASK;
    h->owner_checked = owner_checked;
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
    ok = ok && h->reg_capacity > 0 && h->registry >= 0 && h->reg_entry % 8 == 0 &&
         h->reg_state >= 0 && h->reg_state % 8 == 0 && h->reg_state + 8 <= h->reg_entry &&
         h->registry + h->reg_capacity * h->reg_entry <= len;
    Py_ssize_t words[] = {h->tag_off, h->stamp_off, h->qpos_off, h->deliveries_off,
                          h->deadline_off};
    for (int i = 0; i < 5; i++)
        ok = ok && words[i] >= 8 && words[i] % 8 == 0 && words[i] + 8 <= h->entry_size;
    Py_ssize_t singles[6 + 3 + C_COUNT] = {h->head, h->tail, h->publish_seq, h->readers_waiting,
                                          h->readers_until, h->release_seq, h->claimers_waiting,
                                          h->claimers_until, h->registry};
    for (int i = 0; i < C_COUNT; i++)
        singles[9 + i] = h->counter[i] = counter[i];
    for (size_t i = 0; i < sizeof(singles) / sizeof(*singles); i++)
        ok = ok && singles[i] >= 0 && singles[i] % 8 == 0 && singles[i] + 8 <= len;
    /* the sum lies after the buckets, inside the buffer */
    ok = ok && h->hist_sum % 8 == 0 && h->hist_sum >= 8 * (nbounds + 1) && h->hist_sum <= len - 8;
    Py_ssize_t hists[] = {h->hist_held, h->hist_ready};
    for (int i = 0; i < 2; i++)
        ok = ok && hists[i] >= 0 && hists[i] % 8 == 0 && hists[i] <= len - 8 - h->hist_sum;
    if (!ok) {
        PyBuffer_Release(&h->buf);
        PyErr_SetString(PyExc_ValueError, "HotPath layout does not fit the buffer");
        return -1;
    }
    h->held = 1;
    h->hint = 0;
    h->left = 0;
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
    FAST("acquire", hp_acquire, "acquire(event, tag) -> (slot, gen) | None"),
    FAST("open_reserved", hp_open_reserved, "open_reserved(slot, gen) -> tag | None"),
    FAST("publish", hp_publish, "publish(slot, gen) -> 0 | -1 not owner | -2 ring full"),
    FAST("keep", hp_keep, "keep(slot, gen) -> 0 | -1 not owner"),
    FAST("quarantine", hp_quarantine, "quarantine(slot, gen, state, deadline_ns) -> 0 | -1 not owner"),
    FAST("expire", hp_expire, "expire() -> QUARANTINED slots freed, their windows ended"),
    FAST("writing", hp_writing, "writing(slot, gen) -> this participant's WRITING slot?"),
    FAST("take", hp_take, "take() -> (slot, gen, tag, deliveries) | None"),
    FAST("free", hp_free, "free(slot, gen, state, event) -> 0 | -1"),
    FAST("redeliver", hp_redeliver, "redeliver(slot, gen) -> 0 | -1"),
    FAST("cancel", hp_cancel, "cancel(tag) -> slots cancelled"),
    FAST("reclaim_owner", hp_reclaim_owner, "reclaim_owner(me, drop_held) -> counts"),
    FAST("reap_entry", hp_reap_entry, "reap_entry(fd, index, drop_held) -> counts | None"),
    FAST("requeue_stranded", hp_requeue_stranded, "requeue_stranded(min_age_ns) -> count"),
    FAST("leave", hp_leave, "leave(fd, drop_held) -> counts | None (left already)"),
    FAST("transition", hp_transition, "transition(word, event, actor) -> word | None"),
    FAST("init_ring", hp_init_ring, "init_ring(): mark every ring cell empty"),
    FAST("queued", hp_queued, "queued() -> entries in the ready ring"),
    {"release", (PyCFunction)hp_release, METH_NOARGS, "release the buffer export"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject HotPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.HotPath",
    .tp_doc = "Every slot transition of one participant, compiled.",
    .tp_basicsize = sizeof(HotPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hp_init,
    .tp_dealloc = (destructor)hp_dealloc,
    .tp_methods = hp_methods,
};

/* name -> number, for ownership.py to hold against states.py. */
static PyObject *
numbering(const char **names, int n, int as_tuple)
{
    PyObject *out = as_tuple ? PyTuple_New(n) : PyDict_New();
    for (int i = 0; out && i < n; i++) {
        PyObject *name = PyUnicode_FromString(names[i]), *value = PyLong_FromLong(i);
        int bad = !name || !value;
        if (!bad && as_tuple)
            PyTuple_SET_ITEM(out, i, Py_NewRef(name));
        else if (!bad)
            bad = PyDict_SetItem(out, name, value) < 0;
        Py_XDECREF(name);
        Py_XDECREF(value);
        if (bad)
            Py_CLEAR(out);
    }
    return out;
}

int
hotpath_add(PyObject *m)
{
    if (PyType_Ready(&HotPathType) < 0 ||
        PyModule_AddObjectRef(m, "HotPath", (PyObject *)&HotPathType) < 0 ||
        add_owned(m, "STATES", numbering(state_names, S_COUNT, 0)) < 0 ||
        add_owned(m, "EVENTS", numbering(event_names, E_COUNT, 0)) < 0 ||
        add_owned(m, "COUNTERS", numbering(counter_names, C_COUNT, 1)) < 0)
        return -1;
    return 0;
}
