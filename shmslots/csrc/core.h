/* shmslots._core: what its files share.
 *
 * One extension, nine files, one job each: atomic.c (atomics and futexes on a mapping),
 * arena.c (the arena's pages and the blocks this process lent), hotpath.c (the slot
 * protocol's transitions and the ready ring), rowcodec.c (the rules a tensor must pass and the
 * row copies), rowhash.c (the row checksum), refcodec.c (a ref field's bytes), leases.c (the
 * type-state handles' fast paths), blockcopy.c (the same-host engine's host copies); module.c
 * joins them.  leases.c calls the others through the functions declared here, C to C: a
 * handle's step makes no Python call between two compiled steps.  What they learn of torch
 * tensors comes from shmslots._tensors, a C++ module against the installed torch, through the
 * capsule tensors.h describes.
 *
 * The slot word and the ring cell are defined here and nowhere else: the module exports their
 * bits (WORD_BITS, CELL_BITS), from which states.py builds the word's Python accessors, and
 * ownership.py checks at import that STATES and EVENTS (exported from hotpath.c) number the
 * states and events as states.py does.  docs/protocol.md states the rules.
 */
#ifndef SHMSLOTS_CORE_H
#define SHMSLOTS_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "tensors.h"

/* -- the slot word: generation (32 bits) | owner (16) | state (16) -------------------------- */

enum { S_FREE, S_RESERVED, S_WRITING, S_READY, S_HELD, S_RECLAIMING, S_QUARANTINED, S_COUNT };
enum {
    E_CLAIM, E_RESERVE, E_OPEN_RESERVED, E_PUBLISH, E_TAKE, E_RELEASE, E_ABORT, E_RECLAIM,
    E_REDELIVER, E_FINISH, E_CANCEL, E_KEEP, E_QUARANTINE, E_EXPIRE, E_COUNT
};

#define OWNER_SHIFT 16
#define GEN_SHIFT 32
#define FIELD_MASK UINT64_C(0xFFFF)    /* state, owner */
#define GEN_MASK UINT64_C(0xFFFFFFFF)

static inline unsigned state_of(uint64_t word) { return (unsigned)(word & FIELD_MASK); }
static inline uint64_t owner_of(uint64_t word) { return (word >> OWNER_SHIFT) & FIELD_MASK; }
static inline uint64_t generation_of(uint64_t word) { return word >> GEN_SHIFT; }
static inline uint64_t owned_word(uint64_t gen, uint64_t owner, unsigned state)
{
    return ((gen & GEN_MASK) << GEN_SHIFT) | (owner << OWNER_SHIFT) | state;
}

/* -- the ready ring's cell: position (43 bits) | full (1) | slot (20) ----------------------- */

#define POS_SHIFT 21
#define POS_BITS (64 - POS_SHIFT)
#define POS_MASK ((UINT64_C(1) << POS_BITS) - 1)
#define FULL (UINT64_C(1) << (POS_SHIFT - 1))
#define SLOT_MASK (FULL - 1)

static inline uint64_t empty_cell(uint64_t pos) { return (pos & POS_MASK) << POS_SHIFT; }
static inline uint64_t full_cell(uint64_t pos, uint64_t slot)
{
    return ((pos & POS_MASK) << POS_SHIFT) | FULL | slot;
}
static inline uint64_t cell_pos(uint64_t cell) { return cell >> POS_SHIFT; }

/* -- test-only kill points: SIGKILL inside a step (_kill_at, KILL_POINTS) -------------------
 * Compiled only into the test build (SHMSLOTS_KILL_POINTS, setup.py); elsewhere each point is
 * nothing and the module has neither name. */

enum {
    KILL_NONE, KILL_QUARANTINED, KILL_RECLAIMING, KILL_PUBLISH_SEALED, KILL_KEEP_SEALED,
    KILL_KEEP_HELD, KILL_COUNT
};
#ifdef SHMSLOTS_KILL_POINTS
void kill_point(int point);
#else
#define kill_point(point) ((void)(point))
#endif

/* -- hotpath.c: the transitions a handle makes ------------------------------------------------
 * Each checks that the participant may act and that `slot` is in range (error set, STEP_ERROR
 * returned otherwise).  Codes: STEP_DONE, STEP_REFUSED (not this participant's slot in that
 * state at that generation: nothing changed), STEP_QUEUE_FULL (publish: nothing changed),
 * STEP_ERROR (error set, a corrupt ring included). */

enum { STEP_DONE = 0, STEP_REFUSED = -1, STEP_QUEUE_FULL = -2, STEP_ERROR = -3 };

typedef struct HotPath HotPath;
extern PyTypeObject HotPathType;

/* Whether this participant may still act (it has not left: its slots are its own). */
int hot_member(HotPath *h);
/* 1 acquired (*slot, *gen set), 0 none FREE, STEP_ERROR. */
int hot_acquire(HotPath *h, int event, uint64_t tag, Py_ssize_t *slot, uint64_t *gen);
/* 1 opened (*tag set), 0 not reserved at `gen`, STEP_ERROR. */
int hot_open_reserved(HotPath *h, Py_ssize_t slot, uint64_t gen, uint64_t *tag);
int hot_publish(HotPath *h, Py_ssize_t slot, uint64_t gen);
int hot_keep(HotPath *h, Py_ssize_t slot, uint64_t gen);
/* 1 it is this participant's WRITING slot at `gen`, 0 not, STEP_ERROR. */
int hot_writing(HotPath *h, Py_ssize_t slot, uint64_t gen);
/* 1 taken (all out-values set), 0 nothing ready, STEP_ERROR. */
int hot_take(HotPath *h, Py_ssize_t *slot, uint64_t *gen, uint64_t *tag, uint64_t *before);
int hot_free(HotPath *h, Py_ssize_t slot, uint64_t gen, int state, int event);
int hot_redeliver(HotPath *h, Py_ssize_t slot, uint64_t gen, int unread);

/* -- refcodec.c: a ref field's bytes ------------------------------------------------------- */

#define REF_MAX_DIMS 8 /* of a ref's tensor */

/* Why an arena ref may not be opened (exported as REF_REFUSALS; Python words them). */
enum { REF_OK, REF_MALFORMED, REF_IS_CUDA, REF_NOT_OURS, REF_DTYPE, REF_SIZE, REF_OUTSIDE, REF_SHAPE };
/* Where this table's arena refs may point: [lo, hi) of the segment, and the table's name. */
typedef struct {
    uint64_t lo, hi;
    const char *table;
    Py_ssize_t table_len;
} RefPlace;
/* The shape a ref field declares: `ndim` sizes, -1 for its free dimension. */
typedef struct {
    int ndim;
    const int64_t *dims;
} RefShape;
/* The arena ref in an item of `len` bytes, checked against `place` and a field of `dtype`
 * (its index in schema.DTYPE_CODES), `itemsize` and `shape`: REF_OK with *offset, *nbytes,
 * *ndim and sizes (up to REF_MAX_DIMS) set, else a refusal.  No error is set either way. */
int ref_open_arena(const char *raw, Py_ssize_t len, const RefPlace *place, int dtype,
                   Py_ssize_t itemsize, const RefShape *shape, uint64_t *offset,
                   uint64_t *nbytes, int *ndim, int64_t *sizes);
/* The bytes of an arena ref to `nbytes` at `offset` with `ndim` sizes, in table `table` (at
 * most REF_MAX_DIMS sizes and 255 bytes of name, the caller's check): ref_arena_len of them,
 * written to `item` by ref_put_arena. */
Py_ssize_t ref_arena_len(int ndim, Py_ssize_t table_len);
void ref_put_arena(char *item, int dtype, uint64_t offset, uint64_t nbytes, int ndim,
                   const int64_t *sizes, const char *table, Py_ssize_t table_len);
int refcodec_add(PyObject *m);

/* -- rowhash.c: the row checksum ----------------------------------------------------------- */

/* A row's checksum: row_hash_fold of the seed chained through row_hash_span of each field's
 * item, in field order.  `by` picks one of the row_hash_ways() ways this CPU can compute it,
 * slowest first, all giving the same value (the tests hold them equal); -1 is the fastest. */
uint64_t row_hash_seed(void);
uint64_t row_hash_span(const char *p, Py_ssize_t n, uint64_t seed, int by);
uint32_t row_hash_fold(uint64_t h);
int row_hash_ways(void);

/* -- rowcodec.c: a row's copies --------------------------------------------------------------- */

typedef struct RowCodec RowCodec;
extern PyTypeObject RowCodecType;

/* `fields`: a dict of name -> value, or a tuple of every field's value in schema order.
 * 1 every field given written, 0 not the plain case (nothing written), -1 error set. */
int codec_write(RowCodec *r, Py_ssize_t slot, PyObject *fields);
/* The slot for a write whose values have all passed their checks: 1 (*slot set), 0 none to
 * be had, -1 (or a STEP_ code below 0) error set. */
typedef int (*SlotPick)(void *ctx, Py_ssize_t *slot);
/* codec_write into the slot `pick` gives, asked for only once every value has passed, so a
 * value refused or not the plain case takes no slot: 1 written into *slot, 0 not the plain
 * case or no slot to be had (*slot -1), -1 error set (*slot the slot picked, or -1). */
int codec_write_picked(RowCodec *r, PyObject *fields, SlotPick pick, void *ctx,
                       Py_ssize_t *slot);
/* 0 sealed, -1 error set. */
int codec_seal(RowCodec *r, Py_ssize_t slot, uint64_t gen);
/* The value (new reference), Py_None (new reference: not the plain case), or NULL. */
PyObject *codec_read(RowCodec *r, Py_ssize_t slot, PyObject *name);
/* Whether `mask` (bit i: field i) names fields of the codec only. */
int codec_mask_fits(RowCodec *r, uint64_t mask);
/* Zero the whole item of each field in `mask` (which codec_mask_fits) in `slot`: 0, or -1 with
 * an error set (a released codec, a slot out of range).  Which fields may be zeroed is
 * rows.py's rule (Rows.zero_mask). */
int codec_zero(RowCodec *r, Py_ssize_t slot, uint64_t mask);
/* A new CPU tensor holding the field's item (made by torch's CPU allocator directly, so no
 * mode answers with another), Py_None (new reference: a ref field, no such field, or more
 * dimensions than it makes: the caller's path), or NULL. */
PyObject *codec_copy(RowCodec *r, Py_ssize_t slot, PyObject *name);
/* Field `name` of `slot` opened as ref_open_arena allows: a tensor over the arena (holding
 * an export of the mapping), Py_None (new reference: not a ref field), a refusal code (a
 * new int: REF_*), or NULL with an error set. */
PyObject *codec_open_ref(RowCodec *r, Py_ssize_t slot, PyObject *name, const RefPlace *place);
/* Ref field `name` of `slot` (at `generation`) given a block of the arena (an Arena) for a
 * tensor of `shape`, its ref written into the row and opened as codec_open_ref opens it: 1 with
 * *tensor (a new reference), *offset and *nbytes set; 0 not the plain case (a slot out of
 * range, not a ref field, a shape it does not take, a ref over its budget, no room in the
 * arena): nothing changed;
 * -1 error set, the block given back. */
int codec_loan(RowCodec *r, Py_ssize_t slot, uint64_t generation, PyObject *name, PyObject *shape,
               PyObject *arena, const RefPlace *place, PyObject **tensor, Py_ssize_t *offset,
               uint64_t *nbytes);
/* Py_True moved, Py_False not the plain case (nothing moved), or NULL: gather (`out`) copies
 * field `name` of each of `slots` into `flat`, scatter the other way. */
PyObject *codec_move(RowCodec *r, PyObject *slots, PyObject *name, PyObject *flat, int out);

/* -- torch, through shmslots._tensors (tensors.h) ----------------------------------------- */

/* The capsule's functions once bind_tensors() has run (a Rules, WatchedTensors or HandleCore
 * made): the module itself serves torch-free callers (snapshot, the CLI, reap) too, which
 * must not pay torch's import.  0, or -1 with an error set. */
extern const TensorApi *tensor_api;
int bind_tensors(void);

/* -- atomic.c: the words of a mapping ---------------------------------------------------------- */

/* `count` 64-bit words at byte offset `off` of AtomicView `view`, checked (an AtomicView, still
 * held, the words aligned and inside it); NULL with an error set. */
uint64_t *atomic_words(PyObject *view, Py_ssize_t off, Py_ssize_t count);
/* An int argument as a u64: 1, or 0 with an error set (a negative or too big number, or not an
 * int; no Python runs). */
int as_u64(PyObject *o, uint64_t *out);

/* -- arena.c: the blocks this process lends ---------------------------------------------------- */

/* `nbytes` of arena pages lent to (slot, generation) and entered in `arena`'s book (an Arena):
 * 1 with *offset (in the segment) set, 0 no run of free pages that long, -1 error set.  The
 * search, where it starts and the book are arena.c's: csrc/arena.c says why. */
int arena_lend(PyObject *arena, uint64_t nbytes, Py_ssize_t slot, uint64_t generation,
               Py_ssize_t *offset);
/* The block lent at `offset` to (slot, generation) given back before its row was published:
 * 1 given back, 0 no such block in the book, -1 error set. */
int arena_give_back(PyObject *arena, Py_ssize_t offset, Py_ssize_t slot, uint64_t generation);

/* -- each file adds its types and functions to the module ------------------------------------ */

int atomic_add(PyObject *m);
int arena_add(PyObject *m);
int hotpath_add(PyObject *m);
int rowcodec_add(PyObject *m);
int leases_add(PyObject *m);
int blockcopy_add(PyObject *m);

/* PyModule_AddObjectRef, taking `value`'s reference whatever happens (3.13's PyModule_Add). */
int add_owned(PyObject *m, const char *name, PyObject *value);
/* shmslots.errors.TableClosed (a ValueError) set as the error, with `message`; ValueError if
 * it cannot be had.  Looked up when raised: a closed table is no hot path. */
void table_closed_error(const char *message);

#endif
