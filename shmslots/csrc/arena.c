/* The arena's pages, and this process's book of the blocks it lent (arena.py says why).
 *
 * Each arena page has one 64-bit owner word in the segment: 0 when free, else
 * (slot + 1) << 32 | generation of the write slot that took it.  A block is live exactly while
 * its slot is still at that generation, so the arena needs no lock and no cooperation from a
 * process that died: once the slot's generation moves on, anyone may free the block's pages.
 *
 * What is here and nowhere else: the search (first fit from a start page; a page lost to a
 * racing allocator gives back what was taken of that run, and the search goes on past it), the
 * start page (the block of this size this process last freed after its row was consumed, still
 * warm in its cache; else next fit), and the book of the blocks this process lent, freed when
 * their slot's generation moves on.  Why compiled: a loan's pages, its pin and a claim's
 * release of the last loan were about 10 us of Python glue around two compiled calls.
 *
 * The book is this object's alone and every method runs under the GIL, so it needs no lock;
 * the page words are shared and only ever changed by a CAS from the value that was read.
 */
#include "core.h"

#include <string.h>

#define TAG_GEN UINT64_C(0xFFFFFFFF)
#define WARM_BLOCKS 8 /* blocks this process freed, remembered for a next block of their size */

typedef struct {
    Py_ssize_t slot, first, count;
    uint64_t tag;
    uint64_t nbytes;
} Block;

typedef struct {
    Py_ssize_t pages, first;
} WarmBlock;

typedef struct {
    PyObject_HEAD
    PyObject *view; /* the AtomicView over the segment */
    Py_ssize_t table, pages, page_size, data; /* page words at `table`; pages at `data` */
    Py_ssize_t entries, entry_size, slots;    /* slot words: their generations */
    Py_ssize_t hint;                          /* next fit: the page after the last such block */
    WarmBlock warm[WARM_BLOCKS];              /* the newest last */
    int nwarm;
    Block *lent;
    Py_ssize_t nlent, cap;
} Arena;

static PyTypeObject ArenaType;

static uint64_t
page_tag(Py_ssize_t slot, uint64_t generation)
{
    return ((uint64_t)(slot + 1) << 32) | (generation & TAG_GEN);
}

/* An Arena made without __init__ (or whose __init__ failed) has no view: refuse it. */
static int
made(Arena *a)
{
    if (a->view)
        return 1;
    PyErr_SetString(PyExc_TypeError, "Arena was never initialized");
    return 0;
}

/* The slot words' generations, or NULL with an error set (the view released). */
static const char *
slot_words(Arena *a)
{
    if (!made(a))
        return NULL;
    return (const char *)atomic_words(a->view, a->entries, a->slots * (a->entry_size / 8));
}

static uint64_t
generation_now(Arena *a, const char *entries, Py_ssize_t slot)
{
    const uint64_t *word = (const uint64_t *)(entries + slot * a->entry_size);
    return generation_of(__atomic_load_n(word, __ATOMIC_SEQ_CST));
}

/* The first of `need` consecutive words of `p[0:count]`, each swapped from 0 to `tag` here, or
 * -1.  First fit from `start`, then from 0. */
static Py_ssize_t
take_run(uint64_t *p, Py_ssize_t count, Py_ssize_t need, Py_ssize_t start, uint64_t tag)
{
    if (start > count - need)
        start = 0;
    for (Py_ssize_t from = start;; from = 0) {
        Py_ssize_t run = 0;
        for (Py_ssize_t i = from; i < count; i++) {
            if (__atomic_load_n(p + i, __ATOMIC_ACQUIRE) != 0) {
                run = 0;
                continue;
            }
            if (++run < need)
                continue;
            Py_ssize_t first = i + 1 - need, taken = 0;
            uint64_t free_word = 0;
            while (taken < need &&
                   __atomic_compare_exchange_n(p + first + taken, &free_word, tag, 0,
                                               __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                taken++;
                free_word = 0;
            }
            if (taken == need)
                return first;
            for (Py_ssize_t k = 0; k < taken; k++) { /* give back; ours, so no CAS can fail */
                uint64_t mine = tag;
                __atomic_compare_exchange_n(p + first + k, &mine, 0, 0, __ATOMIC_SEQ_CST,
                                            __ATOMIC_SEQ_CST);
            }
            i = first + taken; /* the lost word: the search goes on after it */
            run = 0;
        }
        if (from == 0)
            return -1;
    }
}

/* Each of `count` words from `p` that still holds `tag` set to 0: a block given back.  Words
 * another process already freed (its slot moved on) are left as they are. */
static Py_ssize_t
give_back(uint64_t *p, Py_ssize_t count, uint64_t tag)
{
    Py_ssize_t freed = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t want = tag;
        freed += __atomic_compare_exchange_n(p + i, &want, 0, 0, __ATOMIC_SEQ_CST,
                                             __ATOMIC_SEQ_CST);
    }
    return freed;
}

static uint64_t *
page_words(Arena *a)
{
    if (!made(a))
        return NULL;
    return atomic_words(a->view, a->table, a->pages);
}

/* The pages `nbytes` takes (at least one), for an Arena that was made. */
static Py_ssize_t
pages_for(Arena *a, uint64_t nbytes)
{
    uint64_t size = (uint64_t)a->page_size, n = nbytes / size + (nbytes % size != 0);
    return n ? (Py_ssize_t)(n > (uint64_t)PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : n) : 1;
}

/* The index in the warm list of the block of `need` pages this process freed last, or -1. */
static int
warm_index(Arena *a, Py_ssize_t need)
{
    for (int i = a->nwarm - 1; i >= 0; i--)
        if (a->warm[i].pages == need)
            return i;
    return -1;
}

static void
forget_warm(Arena *a, int i)
{
    memmove(&a->warm[i], &a->warm[i + 1], (size_t)(a->nwarm - i - 1) * sizeof(WarmBlock));
    a->nwarm--;
}

static void
remember_warm(Arena *a, Py_ssize_t pages, Py_ssize_t first)
{
    if (a->nwarm == WARM_BLOCKS) {
        memmove(&a->warm[0], &a->warm[1], (WARM_BLOCKS - 1) * sizeof(WarmBlock));
        a->nwarm--;
    }
    a->warm[a->nwarm++] = (WarmBlock){pages, first};
}

static int
as_slot(Arena *a, PyObject *o, Py_ssize_t *slot)
{
    *slot = PyLong_AsSsize_t(o);
    if (*slot == -1 && PyErr_Occurred())
        return 0;
    if (*slot < 0 || *slot >= a->slots) {
        PyErr_Format(PyExc_ValueError, "slot %zd is not one of the table's %zd", *slot, a->slots);
        return 0;
    }
    return 1;
}

/* `o` as an Arena that was made, or NULL with an error set: for callers in C. */
static Arena *
arena_of(PyObject *o)
{
    if (!PyObject_TypeCheck(o, &ArenaType)) {
        PyErr_SetString(PyExc_TypeError, "an Arena is needed");
        return NULL;
    }
    return made((Arena *)o) ? (Arena *)o : NULL;
}

/* core.h: lend a block.  First fit from the block of this size this process last freed after its
 * row was consumed: a producer's next loan of a shape then fills warm memory, as a ring reusing
 * one cell does.  Otherwise next fit past its last such block, so that a block of another size
 * does not split a freed hole. */
int
arena_lend(PyObject *arena, uint64_t nbytes, Py_ssize_t slot, uint64_t generation,
           Py_ssize_t *offset)
{
    Arena *self = arena_of(arena);
    if (!self)
        return -1;
    if (slot < 0 || slot >= self->slots) {
        PyErr_Format(PyExc_ValueError, "slot %zd is not one of the table's %zd", slot, self->slots);
        return -1;
    }
    Py_ssize_t need = pages_for(self, nbytes);
    if (need > self->pages)
        return 0;
    if (self->nlent == self->cap) { /* first: a failure here leaves nothing taken */
        Py_ssize_t cap = self->cap ? 2 * self->cap : 16;
        Block *grown = PyMem_Realloc(self->lent, (size_t)cap * sizeof(Block));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        self->lent = grown;
        self->cap = cap;
    }
    uint64_t *words = page_words(self);
    if (!words)
        return -1;
    uint64_t tag = page_tag(slot, generation);
    int warm = warm_index(self, need); /* forgotten once used: a failed search keeps it */
    Py_ssize_t start = warm < 0 ? self->hint : self->warm[warm].first;
    Py_ssize_t first = take_run(words, self->pages, need, start, tag);
    if (first < 0)
        return 0;
    if (warm < 0)
        self->hint = first + need;
    else
        forget_warm(self, warm);
    self->lent[self->nlent++] = (Block){slot, first, need, tag, nbytes};
    *offset = self->data + first * self->page_size;
    return 1;
}

/* core.h: give a block back before publish (a ref overwritten, a loan replaced).  Its pages take
 * no warm start: the replaced loan may still be referenced, and would then overlap this row's
 * next block. */
int
arena_give_back(PyObject *arena, Py_ssize_t offset, Py_ssize_t slot, uint64_t generation)
{
    Arena *self = arena_of(arena);
    if (!self)
        return -1;
    uint64_t tag = page_tag(slot, generation);
    for (Py_ssize_t i = self->nlent - 1; i >= 0; i--) {
        Block *b = &self->lent[i];
        if (b->tag != tag || self->data + b->first * self->page_size != offset)
            continue;
        uint64_t *words = page_words(self);
        if (!words)
            return -1;
        give_back(words + b->first, b->count, tag);
        memmove(b, b + 1, (size_t)(self->nlent - i - 1) * sizeof(Block));
        self->nlent--;
        return 1;
    }
    return 0;
}

/* loan(nbytes, slot, generation) -> offset | None: arena_lend (core.h) from Python. */
static PyObject *
arena_loan(Arena *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t nbytes, generation;
    Py_ssize_t slot, offset;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "loan() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!made(self))
        return NULL;
    if (!as_u64(args[0], &nbytes) || !as_slot(self, args[1], &slot) ||
        !as_u64(args[2], &generation))
        return NULL;
    int lent = arena_lend((PyObject *)self, nbytes, slot, generation, &offset);
    if (lent < 0)
        return NULL;
    return lent ? PyLong_FromSsize_t(offset) : Py_NewRef(Py_None);
}

/* unpin(offset, slot, generation) -> bool: arena_give_back (core.h) from Python. */
static PyObject *
arena_unpin(Arena *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t offset, slot;
    uint64_t generation;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "unpin() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!made(self))
        return NULL;
    offset = PyLong_AsSsize_t(args[0]);
    if ((offset == -1 && PyErr_Occurred()) || !as_slot(self, args[1], &slot) ||
        !as_u64(args[2], &generation))
        return NULL;
    int given = arena_give_back((PyObject *)self, offset, slot, generation);
    return given < 0 ? NULL : PyBool_FromLong(given);
}

/* collect_own() -> int
 * Free the blocks in this process's book whose slot has moved past their generation (the row
 * was released, aborted or reclaimed); each then gives the next block of its size a warm start.
 * How many were freed.  O(blocks lent), one load each. */
static PyObject *
arena_collect_own(Arena *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->nlent)
        return PyLong_FromLong(0);
    const char *entries = slot_words(self);
    uint64_t *words = entries ? page_words(self) : NULL;
    if (!words)
        return NULL;
    Py_ssize_t kept = 0, freed = 0;
    for (Py_ssize_t i = 0; i < self->nlent; i++) {
        Block b = self->lent[i];
        if (generation_now(self, entries, b.slot) == (b.tag & TAG_GEN)) {
            self->lent[kept++] = b;
            continue;
        }
        give_back(words + b.first, b.count, b.tag);
        remember_warm(self, b.count, b.first);
        freed++;
    }
    self->nlent = kept;
    return PyLong_FromSsize_t(freed);
}

/* collect() -> int
 * Free every page, of any process, whose slot has moved past the generation that took it (a
 * dead producer's, say); a tag naming no slot is freed too.  How many pages.  This process's
 * own book is left to collect_own, whose give-back then finds those pages already free. */
static PyObject *
arena_collect(Arena *self, PyObject *Py_UNUSED(ignored))
{
    const char *entries = slot_words(self);
    uint64_t *words = entries ? page_words(self) : NULL;
    if (!words)
        return NULL;
    Py_ssize_t freed = 0;
    for (Py_ssize_t page = 0; page < self->pages; page++) {
        uint64_t tag = __atomic_load_n(words + page, __ATOMIC_SEQ_CST);
        if (!tag)
            continue;
        uint64_t slot = (tag >> 32) - 1;
        if (slot < (uint64_t)self->slots &&
            generation_now(self, entries, (Py_ssize_t)slot) == (tag & TAG_GEN))
            continue;
        freed += __atomic_compare_exchange_n(words + page, &tag, 0, 0, __ATOMIC_SEQ_CST,
                                             __ATOMIC_SEQ_CST);
    }
    return PyLong_FromSsize_t(freed);
}

/* usage() -> (pages in use, blocks in use): a block is a run of pages with one tag. */
static PyObject *
arena_usage(Arena *self, PyObject *Py_UNUSED(ignored))
{
    uint64_t *words = page_words(self);
    if (!words)
        return NULL;
    Py_ssize_t pages = 0, blocks = 0;
    uint64_t previous = 0;
    for (Py_ssize_t page = 0; page < self->pages; page++) {
        uint64_t tag = __atomic_load_n(words + page, __ATOMIC_SEQ_CST);
        pages += tag != 0;
        blocks += tag != 0 && tag != previous;
        previous = tag;
    }
    return Py_BuildValue("(nn)", pages, blocks);
}

/* pinned() -> (blocks, bytes) this process keeps lent. */
static PyObject *
arena_pinned(Arena *self, PyObject *Py_UNUSED(ignored))
{
    if (!made(self))
        return NULL;
    unsigned long long bytes = 0;
    for (Py_ssize_t i = 0; i < self->nlent; i++)
        bytes += self->lent[i].nbytes;
    return Py_BuildValue("(nK)", self->nlent, bytes);
}

/* pages_for(nbytes) -> the pages a block of `nbytes` takes (at least one). */
static PyObject *
arena_pages_for(Arena *self, PyObject *arg)
{
    uint64_t nbytes;
    if (!made(self) || !as_u64(arg, &nbytes))
        return NULL;
    return PyLong_FromSsize_t(pages_for(self, nbytes));
}

static int
arena_init(Arena *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"view", "table", "pages", "page_size", "data", "entries",
                             "entry_size", "slots", NULL};
    PyObject *view;
    Py_ssize_t table, pages, page_size, data, entries, entry_size, slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O$nnnnnnn", kwlist, &view, &table, &pages,
                                     &page_size, &data, &entries, &entry_size, &slots))
        return -1;
    if (self->view) {
        PyErr_SetString(PyExc_TypeError, "an Arena is made once");
        return -1;
    }
    if (pages < 1 || page_size < 8 || page_size % 8 || slots < 1 || entry_size < 8 ||
        entry_size % 8 || slots > (Py_ssize_t)(UINT32_MAX - 1) ||
        entry_size / 8 > PY_SSIZE_T_MAX / 8 / slots || page_size / 8 > PY_SSIZE_T_MAX / 8 / pages) {
        PyErr_SetString(PyExc_ValueError, "an arena needs pages, a page size and slot words");
        return -1;
    }
    /* every span in the view: the page words and the slot words, checked again at every use
     * (the view may be released), and the pages themselves */
    if (!atomic_words(view, table, pages) ||
        !atomic_words(view, entries, slots * (entry_size / 8)) ||
        !atomic_words(view, data, pages * (page_size / 8)))
        return -1;
    Py_INCREF(view);
    self->view = view;
    self->table = table;
    self->pages = pages;
    self->page_size = page_size;
    self->data = data;
    self->entries = entries;
    self->entry_size = entry_size;
    self->slots = slots;
    return 0;
}

static void
arena_dealloc(Arena *self)
{
    Py_XDECREF(self->view);
    PyMem_Free(self->lent);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
arena_get_pages(Arena *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->pages);
}

static PyObject *
arena_get_page_size(Arena *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->page_size);
}

static PyGetSetDef arena_getset[] = {
    {"pages", (getter)arena_get_pages, NULL, "pages in the arena", NULL},
    {"page_size", (getter)arena_get_page_size, NULL, "bytes a page", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef arena_methods[] = {
    {"loan", (PyCFunction)(void (*)(void))arena_loan, METH_FASTCALL,
     "loan(nbytes, slot, generation) -> offset of a block lent to it, or None"},
    {"unpin", (PyCFunction)(void (*)(void))arena_unpin, METH_FASTCALL,
     "unpin(offset, slot, generation) -> whether a lent block was given back"},
    {"collect_own", (PyCFunction)arena_collect_own, METH_NOARGS,
     "collect_own() -> blocks lent here freed because their slot moved on"},
    {"collect", (PyCFunction)arena_collect, METH_NOARGS,
     "collect() -> pages of any process freed because their slot moved on"},
    {"usage", (PyCFunction)arena_usage, METH_NOARGS, "usage() -> (pages, blocks) in use"},
    {"pinned", (PyCFunction)arena_pinned, METH_NOARGS, "pinned() -> (blocks, bytes) lent here"},
    {"pages_for", (PyCFunction)arena_pages_for, METH_O, "pages_for(nbytes) -> pages"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.Arena",
    .tp_doc = "The arena's pages and this process's book of the blocks it lent (csrc/arena.c).",
    .tp_basicsize = sizeof(Arena),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)arena_init,
    .tp_dealloc = (destructor)arena_dealloc,
    .tp_methods = arena_methods,
    .tp_getset = arena_getset,
};

int
arena_add(PyObject *m)
{
    if (PyType_Ready(&ArenaType) < 0 ||
        PyModule_AddObjectRef(m, "Arena", (PyObject *)&ArenaType) < 0)
        return -1;
    return PyModule_AddIntConstant(m, "WARM_BLOCKS", WARM_BLOCKS);
}
