/* The ready ring of shmslots/csrc/hotpath.c and the slot words it queues, for Spin.
 *
 * Every shared access is one atomic step, as in the C code: a load, a store, or a
 * compare-and-swap (an `atomic` block).  Spin explores every interleaving of each of four
 * casts (init picks one) of publishers, readers (one hands its row back: REDELIVER), a
 * canceller and a sweeper (requeue_stranded at age 0, so it races publishers still
 * queueing), and one process may die at any of the marked points (CRASH).  Then the survivors' recovery runs — a reaper
 * for the dead, one sweep — and a reader drains the ring.  Checked:
 *
 *   - no publication is delivered twice (the take's assertion);
 *   - head is at most one past tail and the ring never holds more than CAP entries
 *     (SHAPE, at every move of either);
 *   - no row is lost: once recovery has run, every READY row is delivered (the drain,
 *     with the sweeps idle readers make);
 *   - nothing blocks for good (Spin's invalid end states), and no retry loop spins for
 *     ever (the livelock search, -DNP).
 *
 * What the model leaves out, and why: docs/protocol.md (The model).
 * Run: bash tools/ring_model/check.sh
 */

#define NSLOTS 2
#define CAP 4             /* ring_capacity = 2 * slots (layout.py) */
#define NO_POS 255
#define MAX_CRASHES 1

#define FREE 0
#define WRITING 2
#define READY 3
#define HELD 4
#define RECLAIMING 5

#define REAPER 9          /* the owner id recovery acts under */

/* A cell: (position, filled, slot); empty cells hold slot 0, as empty_cell() does. */
typedef Cell { byte pos; bool filled; byte slot };
Cell ring[CAP];
byte head, tail;

/* The slot word, split: state, generation, owner (one CAS changes all three). */
byte state[NSLOTS], gen[NSLOTS], owner[NSLOTS];
byte qpos[NSLOTS];        /* SLOT_QUEUE_POS */

/* Ghosts: what the checks read, never the protocol. */
byte pub[NSLOTS];         /* publications of the slot so far (publish, redeliver) */
byte taken[NSLOTS];       /* the publication last taken */
byte crashes;
byte cast;                /* which cast this run plays (init) */
bool recovering;          /* recovery runs: nobody dies any more */

/* A process may die here (at most MAX_CRASHES in one run). */
#define CRASH if :: !recovering && crashes < MAX_CRASHES -> crashes++; goto dead :: true fi

/* The ring-full test.  -DWRAPPING_FULL_CHECK restores the one before the model found that
 * head can pass tail (check.sh holds the model to finding that). */
#ifdef WRAPPING_FULL_CHECK
#define RING_FULL(t, h) ((t) < (h) || (t) - (h) >= CAP)
#define HAS_ROOM(t, h) ((t) >= (h) && (t) - (h) < CAP)
#else
#define RING_FULL(t, h) ((t) >= (h) && (t) - (h) >= CAP)
#define HAS_ROOM(t, h) ((t) < (h) || (t) - (h) < CAP)
#endif

#define CELL_IS(c, p, f, s) (ring[(c) % CAP].pos == (p) && ring[(c) % CAP].filled == (f) && \
                             ring[(c) % CAP].slot == (s))

/* The ring's shape holds after every move of head or tail: head at most one past tail,
 * and at most CAP entries between them. */
#define SHAPE assert(head <= tail + 1 && (head > tail || tail - head <= CAP))
inline cas_head(x) { atomic { if :: head == x -> head = x + 1; SHAPE :: else fi } }
inline cas_tail(x) { atomic { if :: tail == x -> tail = x + 1; SHAPE :: else fi } }

/* CAS on a slot word: (st, g, o) as read -> (nst, no); READY words are ownerless, and
 * becoming READY is a new publication. */
inline cas_word(cs, st, g, o, nst, no) {
    atomic {
        if
        :: state[cs] == st && gen[cs] == g && owner[cs] == o ->
           state[cs] = nst; owner[cs] = no; ok = 1;
           if :: nst == READY -> pub[cs]++ :: else fi
        :: else -> ok = 0
        fi
    }
}

/* help_head: the cell at head shows position h consumed (a popper stopped before moving
 * head, or the cell was reused a lap later): move head. */
inline help_head(x) {
    if
    :: ring[x % CAP].pos == x + CAP -> cas_head(x); helped = 1
    :: else -> helped = 0
    fi
}

/* ring_push: queue `ps`, its position stored in its entry before its cell is filled. */
inline ring_push(ps) {
    res = NO_POS;
    do
    :: h = head; t = tail;
       if
       :: RING_FULL(t, h) ->
          help_head(h);
          if :: !helped -> break :: else fi
       :: else ->
          if
          :: CELL_IS(t, t, 0, 0) ->
             qpos[ps] = t;
             CRASH;
             atomic {
                if
                :: CELL_IS(t, t, 0, 0) -> ring[t % CAP].filled = 1; ring[t % CAP].slot = ps; ok = 1
                :: else -> ok = 0
                fi
             }
             if :: ok -> CRASH; cas_tail(t); res = t; break :: else fi
          :: (ring[t % CAP].filled && ring[t % CAP].pos == t) ||
             (!ring[t % CAP].filled && ring[t % CAP].pos == t + CAP) -> cas_tail(t)
          :: else -> skip
          fi
       fi
    od
}

/* ring_peek: (pos, slot) at head, or pos = NO_POS when empty. */
inline ring_peek() {
    do
    :: h = head;
       if
       :: ring[h % CAP].filled && ring[h % CAP].pos == h -> pos = h; slot = ring[h % CAP].slot; break
       :: !ring[h % CAP].filled && ring[h % CAP].pos == h -> pos = NO_POS; break
       :: else -> help_head(h)
       fi
    od
}

inline ring_pop() {
    atomic {
        if
        :: CELL_IS(pos, pos, 1, slot) ->
           ring[pos % CAP].pos = pos + CAP; ring[pos % CAP].filled = 0; ring[pos % CAP].slot = 0
        :: else
        fi
    }
    CRASH;
    cas_head(pos)
}

inline queued_at_its_position(qs) {
    p = qpos[qs];
    yes = (p != NO_POS && CELL_IS(p, p, 1, qs))
}

inline head_is_live() {
    live = (state[slot] == READY);
    live = live && qpos[slot] == pos
}

/* ring_room and drop_stale_heads: room for one more entry, stale heads dropped for it. */
inline ring_room() {
    do
    :: h = head; t = tail;
       if
       :: HAS_ROOM(t, h) -> room = 1; break
       :: else ->
          help_head(h);
          if
          :: !helped ->
             dropped = 0;
             do
             :: ring_peek();
                if :: pos == NO_POS -> break :: else fi;
                head_is_live();
                if :: live -> break :: else fi;
                ring_pop(); dropped = 1
             od;
             if :: !dropped -> room = 0; break :: else fi
          :: else
          fi
       fi
    od
}

/* owned -> RECLAIMING(me) -> FREE, generation + 1: release, abort, cancel, reclaim. */
inline to_free(fs, fst, fg, fo, fme) {
    cas_word(fs, fst, fg, fo, RECLAIMING, fme);
    if
    :: ok -> CRASH; atomic { state[fs] = FREE; owner[fs] = 0; gen[fs] = (gen[fs] + 1) % 4 }
    :: else
    fi
}

/* HELD(o) -> READY, queued again (a lease handed back, or a dead reader's, by a reaper). */
inline redeliver(rs, rg, ro) {
    qpos[rs] = NO_POS;
    CRASH;
    cas_word(rs, HELD, rg, ro, READY, 0);
    if :: ok -> CRASH; ring_push(rs) :: else fi
}

/* The locals every process declares (inline bodies use them). */
#define LOCALS byte s, g, st, res, h, t, p, pos, slot, n; bool ok, helped, yes, live, room, dropped

/* claim (FREE -> WRITING(me)), then publish: READY first, queued after. */
proctype Publisher(byte me; byte rows) {
    LOCALS;
    do
    :: n == rows -> break
    :: else ->
       s = 0;
       do
       :: s == NSLOTS -> goto dead   /* nothing claimable: this publisher is done */
       :: else ->
          st = state[s]; g = gen[s];
          if
          :: st == FREE ->
             queued_at_its_position(s);
             if
             :: !yes -> cas_word(s, FREE, g, 0, WRITING, me); if :: ok -> break :: else fi
             :: else
             fi
          :: else
          fi;
          s++
       od;
       ring_room();
       if
       :: !room -> to_free(s, WRITING, g, me, me)   /* "ready queue full": aborted */
       :: else ->
          cas_word(s, WRITING, g, me, READY, 0);
          if :: ok -> CRASH; ring_push(s) :: else fi
       fi;
       n++
    od;
dead: skip
}

/* take() the oldest READY row; then release it, or hand it back (`handback`). */
inline take(me) {
    do
    :: ring_peek();
       if
       :: pos == NO_POS -> break
       :: else ->
          head_is_live();
          if
          :: live ->
             g = gen[slot];
             atomic {
                if
                :: state[slot] == READY && gen[slot] == g && owner[slot] == 0 ->
                   state[slot] = HELD; owner[slot] = me; ok = 1;
                   assert(taken[slot] != pub[slot]);   /* no publication delivered twice */
                   taken[slot] = pub[slot]
                :: else -> ok = 0
                fi
             }
             if :: ok -> CRASH; ring_pop(); break :: else fi
          :: else -> ring_pop()   /* stale: taken, cancelled or queued again elsewhere */
          fi
       fi
    od
}

proctype Reader(byte me; byte rows; bool handback) {
    LOCALS;
    do
    :: n == rows -> break
    :: else ->
       take(me);
       if
       :: pos == NO_POS -> break
       :: handback -> redeliver(slot, g, me)
       :: else -> to_free(slot, HELD, g, me, me)
       fi;
       n++
    od;
dead: skip
}

/* cancel(tag): every READY slot -> RECLAIMING -> FREE; its entry goes stale. */
proctype Canceller(byte me) {
    LOCALS;
    for (s : 0 .. NSLOTS - 1) {
        st = state[s]; g = gen[s];
        if :: st == READY -> to_free(s, READY, g, 0, me) :: else fi
    }
dead: skip
}

/* requeue_stranded(0): READY slots in no entry at their position are queued again. */
inline sweep() {
    for (s : 0 .. NSLOTS - 1) {
        if
        :: state[s] == READY -> queued_at_its_position(s); if :: !yes -> ring_push(s) :: else fi
        :: else
        fi
    }
}

proctype Sweeper() {
    LOCALS;
    sweep();
dead: skip
}

init {
    LOCALS;
    for (t : 0 .. CAP - 1) { ring[t].pos = t }
    for (s : 0 .. NSLOTS - 1) { qpos[s] = NO_POS }
    /* Four casts, one chosen per run, so one search explores them all (check.sh's
     * livelock search leaves out cast 3, its largest: -DSAFETY_ONLY_CAST3). */
    if
    :: cast = 1
    :: cast = 2
#ifndef SAFETY_ONLY_CAST3
    :: cast = 3
#endif
    :: cast = 4
    fi;
    atomic {
        if
        :: cast == 1 ->   /* publishers racing for the tail */
           run Publisher(1, 2); run Publisher(2, 1); run Reader(3, 3, false)
        :: cast == 2 ->   /* readers racing for the head */
           run Publisher(1, 2); run Reader(3, 1, false); run Reader(4, 1, false)
        :: cast == 3 ->   /* rows handed back (REDELIVER) while others publish and take */
           run Publisher(1, 2); run Reader(3, 2, true); run Reader(4, 2, false)
        :: cast == 4 ->   /* cancels and a sweep racing a publisher still queueing */
           run Publisher(1, 2); run Canceller(5); run Sweeper()
        fi
    }
    (_nr_pr == 1);   /* every other process finished or died */
    recovering = 1;
    /* Recovery, as a reaper does it: a dead owner's slots come back (HELD redelivered,
     * WRITING freed, RECLAIMING finished), then one sweep queues stranded READY rows. */
    for (s : 0 .. NSLOTS - 1) {
        st = state[s]; g = gen[s]; p = owner[s];
        if
        :: st == HELD -> redeliver(s, g, p)
        :: st == WRITING || st == RECLAIMING -> to_free(s, st, g, p, REAPER)
        :: else
        fi
    }
    /* Then readers take all there is, and sweep when they find nothing (as an idle reader
     * does every STRANDED_CHECK_S): a row stranded by a full ring is queued once the
     * drain has made room. */
    for (n : 1 .. 2) {
        sweep();
        do
        :: take(REAPER);
           if :: pos == NO_POS -> break :: else -> to_free(slot, HELD, g, REAPER, REAPER) fi
        od
    }
    for (s : 0 .. NSLOTS - 1) { assert(state[s] != READY) }   /* no row lost */
dead: skip
}
