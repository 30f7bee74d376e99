/* The per-request methods of the type-state handles, compiled.
 *
 * leases.py defines WriteSlot, Reservation and Lease with every rule and
 * error message; this file only makes their common case fast.  Each method
 * here does the plain case — an open handle of an open table, a known field,
 * no view left behind, a transition that succeeds — and otherwise calls the
 * handle's Python method for the step (`_write_slow`, `_alloc_slow`, `_publish_slow`,
 * `_abort_slow`, `_view_slow`, `_item_slow`, `_copy_slow`, `_tensor_slow`, `_end`) before
 * changing anything, which does the checks in Python and raises the error.  Slots still move
 * only through hotpath.c's steps (hot_*) and rows only through rowcodec.c's (codec_*), called
 * directly: nothing here adds to the protocol, and no step calls Python.
 *
 * Nothing is owned by nobody: a handle is made in the same C call as the
 * transition that gives it its slot (and the transition is undone if it cannot
 * be made), a handle's last transition and the end of its ownership are one
 * call (`_hand_back`), and a handle that is garbage-collected while it still
 * owns its slot hands it back (`hand_back_dropped`, with a ResourceWarning).
 *
 * WatchedTensors, the views handed out with the reference counts they have
 * at rest, lives here too, because every release checks it.
 */
#include "core.h"
#include <structmember.h>
#include <time.h>

static PyTypeObject *tensor_type, *storage_type; /* torch.Tensor, torch.UntypedStorage */
/* torch.Tensor's own untyped_storage, called with the tensor: a method set on the instance
 * (tensors have a __dict__) must not stand in for it. */
static PyObject *tensor_untyped_storage;
static PyObject *s_untyped_storage, *s_core, *s_write_slow, *s_alloc_slow, *s_publish_slow, *s_abort_slow,
    *s_view_slow, *s_item_slow, *s_copy_slow, *s_tensor_slow, *s_end, *s_release, *s_abort,
    *s_timeout, *s_idle, *default_timeout;

/* Call self.<name>(*args): the Python path of a step. */
static PyObject *
slow(PyObject *self, PyObject *name, PyObject *arg1, PyObject *arg2)
{
    PyObject *stack[3] = {self, arg1, arg2};
    size_t n = arg1 ? (arg2 ? 3 : 2) : 1;
    return PyObject_VectorcallMethod(name, stack, n | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* The handle's Python method `name` with the call's own arguments, keywords included. */
static PyObject *
slow_call(PyObject *h, PyObject *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[4], **stack = n < 4 ? small : PyMem_Malloc((size_t)(n + 1) * sizeof *stack);
    if (!stack)
        return PyErr_NoMemory();
    stack[0] = h;
    memcpy(stack + 1, args, (size_t)n * sizeof *stack);
    PyObject *r = PyObject_VectorcallMethod(name, stack, (size_t)(nargs + 1), kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return r;
}

/* -- WatchedTensors ------------------------------------------------------------------------ */

/* A tensor at rest.  Three counts rise while anything outside still uses it: references to
 * the tensor object (weak ones too), to its storage object (torch keeps one per storage while
 * it lives), and uses of the storage (every view or slice derived from the tensor holds it).  The data
 * pointer changes if the storage was moved out of the row (share_memory_, or pickling it
 * for another process), after which the tensor no longer shows the row at all. */
typedef struct {
    PyObject *tensor, *storage;
    Py_ssize_t refs, storage_refs, uses;
    void *data;
    int weak, storage_weak; /* weak references to the tensor, its storage object at rest */
} Rest;

enum { AT_REST = 0, REFERENCED = 1, MOVED = 2 };

typedef struct {
    PyObject_HEAD
    char ready;        /* __init__ succeeded: every Rest is filled */
    PyObject *tensors; /* dict name -> tensor: this object's own copy, never handed out */
    PyObject *index;   /* dict name -> position in rest */
    Rest *rest;
    Py_ssize_t n;
} Watched;

static PyTypeObject WatchedType;

/* Whether anything holds a weak reference to `o` (its weakref list is not empty); CPython's
 * own lookup, which also finds 3.12's managed list before the object. */
static int
weakly_held(PyObject *o)
{
    Py_ssize_t offset = Py_TYPE(o)->tp_weaklistoffset;
    return offset != 0 && *(PyObject **)((char *)o + offset) != NULL;
}

/* The tensor's first element as torch's C++ objects show it; NULL with no error set when it
 * has no data to show (no storage, or not strided), NULL with an error set on failure. */
static void *
data_of(PyObject *tensor)
{
    TensorFacts f;
    if (tensor_api->facts(tensor, &f) < 0)
        return NULL;
    return f.readable ? f.data : NULL;
}

/* Fill r for `tensor` (a strong reference is taken); 0 ok, -1 error. */
static int
rest_watch(Rest *r, PyObject *tensor)
{
    if (Py_TYPE(tensor) != tensor_type) {
        PyErr_Format(PyExc_TypeError, "WatchedTensors takes torch.Tensor values, got %.100s",
                     Py_TYPE(tensor)->tp_name);
        return -1;
    }
    r->tensor = Py_NewRef(tensor);
    r->storage = PyObject_CallOneArg(tensor_untyped_storage, tensor);
    if (!r->storage)
        return -1;
    if (Py_TYPE(r->storage) != storage_type) { /* its storage's use count is read */
        PyErr_SetString(PyExc_TypeError, "untyped_storage() is not a torch.UntypedStorage");
        return -1;
    }
    r->data = data_of(tensor);
    return PyErr_Occurred() ? -1 : 0;
}

static void
rest_clear(Rest *r)
{
    Py_CLEAR(r->tensor);
    Py_CLEAR(r->storage);
}

/* torch's types, looked up on first use (a WatchedTensors or HandleCore made), with
 * bind_tensors() (core.h says why then).  0, or -1 with an error set. */
static int
bind_torch(void)
{
    if (tensor_untyped_storage)
        return 0;
    if (bind_tensors() < 0)
        return -1;
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch)
        return -1;
    tensor_type = (PyTypeObject *)PyObject_GetAttrString(torch, "Tensor");
    storage_type = (PyTypeObject *)PyObject_GetAttrString(torch, "UntypedStorage");
    Py_DECREF(torch);
    if (!tensor_type || !storage_type)
        goto failed;
    if (!PyType_Check(tensor_type) || !PyType_Check(storage_type)) {
        PyErr_SetString(PyExc_TypeError, "torch.Tensor or torch.UntypedStorage is not a type");
        goto failed;
    }
    if (!(tensor_untyped_storage = PyObject_GetAttr((PyObject *)tensor_type, s_untyped_storage)))
        goto failed;
    return 0;
failed:
    Py_CLEAR(tensor_type);
    Py_CLEAR(storage_type);
    return -1;
}

static int
watched_init(Watched *w, PyObject *args, PyObject *kwds)
{
    PyObject *given;
    if (bind_torch() < 0)
        return -1;
    if (w->tensors) {
        PyErr_SetString(PyExc_RuntimeError, "WatchedTensors already initialized");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!:WatchedTensors", &PyDict_Type, &given))
        return -1;
    /* A private copy: nothing the calls below run can change it under us. */
    PyObject *tensors = PyDict_Copy(given), *index = PyDict_New();
    Py_ssize_t n = tensors ? PyDict_GET_SIZE(tensors) : 0;
    Rest *rest = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Rest));
    if (!tensors || !index || !rest) {
        if (tensors && index)
            PyErr_NoMemory();
        goto fail;
    }
    w->tensors = tensors, w->index = index, w->rest = rest;
    Py_ssize_t pos = 0;
    PyObject *name, *tensor;
    while (w->n < n && PyDict_Next(tensors, &pos, &name, &tensor)) {
        PyObject *at = PyLong_FromSsize_t(w->n);
        int bad = !at || PyDict_SetItem(index, name, at) < 0;
        Py_XDECREF(at);
        if (bad || rest_watch(&rest[w->n++], tensor) < 0)
            return -1; /* dealloc clears what was filled */
    }
    /* Counts at rest: this object's own references, plus whatever holds the tensors for good.
     * The caller's dict is about to go: its one reference to each tensor is not counted. */
    pos = 0;
    for (Py_ssize_t i = 0; i < w->n && PyDict_Next(tensors, &pos, &name, &tensor); i++) {
        Rest *r = &rest[i]; /* same order: the copy has not changed since */
        PyObject *theirs = PyDict_GetItemWithError(given, name);
        if (!theirs && PyErr_Occurred())
            return -1;
        r->refs = Py_REFCNT(r->tensor) - (theirs == r->tensor);
        r->storage_refs = Py_REFCNT(r->storage);
        r->weak = weakly_held(r->tensor);
        r->storage_weak = weakly_held(r->storage);
        if ((r->uses = tensor_api->storage_uses(r->storage)) < 0)
            return -1;
    }
    w->ready = 1;
    return 0;
fail:
    Py_XDECREF(tensors);
    Py_XDECREF(index);
    PyMem_Free(rest);
    return -1;
}

/* Clear the error if it is what torch raises for a tensor without storage or data (sparse,
 * swapped in): exactly RuntimeError or NotImplementedError, not RecursionError or anything
 * else.  1 cleared, 0 some other error, left set. */
static int
clear_no_storage(void)
{
    PyObject *type = PyErr_Occurred();
    if (type != PyExc_RuntimeError && type != PyExc_NotImplementedError)
        return 0;
    PyErr_Clear();
    return 1;
}

/* Whether `tensor` still stands on the watched storage object: 1, 0, or -1 with an error set.
 * torch hands out one storage object per storage while it lives, and we hold ours. */
static int
on_storage(PyObject *tensor, PyObject *storage)
{
    PyObject *now = PyObject_CallOneArg(tensor_untyped_storage, tensor);
    if (!now)
        return clear_no_storage() ? 0 : -1;
    Py_DECREF(now);
    return now == storage;
}

/* AT_REST, or REFERENCED and/or MOVED (bits); -1 with an error set.
 *
 * MOVED: the tensor no longer shows its field — its storage was moved out of the row
 * (share_memory_, pickling), or the tensor was pointed elsewhere (`.data =`, set_,
 * as_strided_, swap_tensors).  A writer must hear that its writes missed the field.
 * REFERENCED: something outside may still reach the row through it: a reference (weak ones
 * too) to the tensor or its storage object, or a use of the storage beyond the watched
 * tensor's own — a slice, or after a swap the object now holding the row.  Both can hold
 * at once: an alias taken before a move (numpy(), dlpack) still points at the row. */
static int
rest_state(Rest *r, int thorough)
{
    int state = AT_REST, redirected = 0, still = 1;
    void *data = data_of(r->tensor);
    int no_data = PyErr_Occurred() != NULL;
    if (no_data && !clear_no_storage()) /* no data pointer at all: not the field */
        return -1;
    int elsewhere = no_data || data != r->data;
    /* `thorough` also catches a tensor moved onto another storage over the same memory (one
     * more call): the release fast path skips it, the checks Python asks for do not. */
    if ((elsewhere || thorough) && (still = on_storage(r->tensor, r->storage)) < 0)
        return -1;
    if (elsewhere || !still) {
        state |= MOVED;
        redirected = !still; /* the tensor left the storage: it no longer uses it itself */
    }
    if (Py_REFCNT(r->tensor) > r->refs || Py_REFCNT(r->storage) > r->storage_refs ||
        weakly_held(r->tensor) > r->weak || weakly_held(r->storage) > r->storage_weak)
        return state | REFERENCED;
    Py_ssize_t uses = tensor_api->storage_uses(r->storage);
    if (uses < 0)
        return -1;
    return uses > r->uses - redirected ? state | REFERENCED : state;
}

/* The Rest of `name`, or NULL: KeyError if `strict`, else no error when it is not watched. */
static Rest *
rest_of(Watched *w, PyObject *name, int strict)
{
    if (!w->ready) {
        PyErr_SetString(PyExc_ValueError, "WatchedTensors not initialized");
        return NULL;
    }
    PyObject *at = PyDict_GetItemWithError(w->index, name);
    if (!at) {
        if (strict && !PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "%R is not watched", name);
        return NULL;
    }
    return &w->rest[PyLong_AsSsize_t(at)];
}

/* Whether w's tensor at position i is not at rest: 1, 0, or -1 error. */
static int
unsettled_at(Watched *w, Py_ssize_t i)
{
    int state = rest_state(&w->rest[i], 0);
    return state < 0 ? -1 : state != AT_REST;
}

/* Whether any of w's tensors is not at rest: 1, 0, or -1 error. */
static int
watched_any_unsettled(Watched *w)
{
    int found = 0;
    for (Py_ssize_t i = 0; !found && i < w->n; i++)
        found = unsettled_at(w, i);
    return found;
}

/* The position of `name` among w's tensors (w ready): >= 0, -1 not watched (no error), -2 error. */
static Py_ssize_t
position_of(Watched *w, PyObject *name)
{
    PyObject *at = PyDict_GetItemWithError(w->index, name);
    return at ? PyLong_AsSsize_t(at) : PyErr_Occurred() ? -2 : -1;
}

/* Whether any tensor at the positions of `bits` is not at rest: 1, 0, or -1 error. */
static int
watched_bits_unsettled(Watched *w, uint64_t bits)
{
    int found = 0;
    for (Py_ssize_t i = 0; !found && bits && i < w->n; i++, bits >>= 1)
        found = bits & 1 ? unsettled_at(w, i) : 0;
    return found ? found : bits != 0; /* a bit past the tensors: the slow path says why */
}

/* The names among `names`, sorted, whose state has the bit `want`. */
static PyObject *
names_in(Watched *w, PyObject *names, int want)
{
    PyObject *found = PyList_New(0), *it = PyObject_GetIter(names), *name;
    if (!found || !it)
        goto fail;
    while ((name = PyIter_Next(it))) {
        Rest *r = rest_of(w, name, 1);
        int state = r ? rest_state(r, 1) : -1;
        int bad = state < 0 || ((state & want) && PyList_Append(found, name) < 0);
        Py_DECREF(name);
        if (bad)
            goto fail;
    }
    if (PyErr_Occurred() || PyList_Sort(found) < 0)
        goto fail;
    Py_DECREF(it);
    return found;
fail:
    Py_XDECREF(it);
    Py_XDECREF(found);
    return NULL;
}

static PyObject *
watched_leaked(Watched *w, PyObject *names)
{
    return names_in(w, names, REFERENCED);
}

static PyObject *
watched_moved(Watched *w, PyObject *names)
{
    return names_in(w, names, MOVED);
}

static int
watched_traverse(Watched *w, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < w->n; i++) {
        Py_VISIT(w->rest[i].tensor);
        Py_VISIT(w->rest[i].storage);
    }
    Py_VISIT(w->tensors);
    Py_VISIT(w->index);
    return 0;
}

static int
watched_clear(Watched *w)
{
    for (Py_ssize_t i = 0; i < w->n; i++)
        rest_clear(&w->rest[i]);
    w->n = 0;
    w->ready = 0; /* methods now say "not initialized" */
    PyMem_Free(w->rest);
    w->rest = NULL;
    Py_CLEAR(w->tensors);
    Py_CLEAR(w->index);
    return 0;
}

static void
watched_dealloc(Watched *w)
{
    PyObject_GC_UnTrack(w);
    watched_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *
watched_get_tensors(Watched *w, void *unused)
{
    if (!w->ready) {
        PyErr_SetString(PyExc_ValueError, "WatchedTensors not initialized");
        return NULL;
    }
    return PyDictProxy_New(w->tensors);
}

static PyMethodDef watched_methods[] = {
    {"leaked", (PyCFunction)watched_leaked, METH_O,
     "leaked(names) -> the names, sorted, whose tensor something outside still references"},
    {"moved", (PyCFunction)watched_moved, METH_O,
     "moved(names) -> the names, sorted, whose tensor no longer shows the memory it watched"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef watched_getset[] = {
    {"tensors", (getter)watched_get_tensors, NULL, "name -> tensor, read only", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WatchedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.WatchedTensors",
    .tp_doc = "Tensors handed out to callers, with the reference counts they have at rest.",
    .tp_basicsize = sizeof(Watched),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)watched_init,
    .tp_dealloc = (destructor)watched_dealloc,
    .tp_traverse = (traverseproc)watched_traverse,
    .tp_clear = (inquiry)watched_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = watched_methods,
    .tp_getset = watched_getset,
};

/* -- HandleCore: what a table's handles share -------------------------------------------- */

typedef struct {
    PyObject_HEAD
    char ready;       /* __init__ succeeded: every field below is set */
    char closed;
    char plain_claim; /* no ref fields: a claim has no pins to collect first */
    char strict;      /* views are also checked for in-place changes, in Python */
    char redeliver_dropped; /* a lease collected unreleased goes back to READY (else FREE) */
    RefPlace place;          /* where this table's arena refs may point (refs.RefStore.place) */
    PyObject *table_name;    /* the str place.table is of */
    long long idle_every_ns;   /* how often a reader finding nothing runs parts.idle() */
    long long idle_due_ns;     /* CLOCK_MONOTONIC ns of the next such run */
    Py_ssize_t nfields;
    HotPath *hot;                            /* this participant's steps */
    RowCodec *codec;                         /* the table's row copies */
    PyObject *parts;                         /* the table's TableParts, set once it exists */
    PyObject *views;                         /* Rows' per-slot WatchedTensors (or None) list */
    PyTypeObject *write_slot, *lease, *reservation; /* the classes leases.py defines */
    PyObject *arena;                         /* this process's Arena (csrc/arena.c), or None */
    PyObject *pin;                           /* refs.Pin: what a write slot keeps of a loan */
} Core;

static PyTypeObject CoreType, HandleType, WriteSlotType, LeaseType;
static int usable_core(Core *c);

static void
table_closed(void)
{
    table_closed_error("the table is closed");
}
static void undo(Core *c, PyObject *culprit, Py_ssize_t slot, uint64_t gen, int state, int event);

static int
core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"hot", "codec", "views", "write_slot", "lease", "reservation",
                         "nfields", "plain_claim", "strict", "redeliver_dropped",
                         "idle_every_ns", "ref_place", "arena", "pin", NULL};
    PyObject *hot, *codec, *views, *write_slot, *lease, *reservation, *arena, *pin;
    Py_ssize_t nfields;
    int plain_claim, strict, redeliver_dropped;
    long long idle_every_ns;
    unsigned long long lo, hi;
    PyObject *table_name;
    if (c->ready) {
        PyErr_SetString(PyExc_RuntimeError, "HandleCore already initialized");
        return -1;
    }
    if (bind_torch() < 0)
        return -1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "O!O!O!O!O!O!$npppL(KKU)OO", kw, &HotPathType, &hot, &RowCodecType,
            &codec, &PyList_Type, &views, &PyType_Type, &write_slot, &PyType_Type, &lease,
            &PyType_Type, &reservation, &nfields, &plain_claim, &strict, &redeliver_dropped,
            &idle_every_ns, &lo, &hi, &table_name, &arena, &pin))
        return -1;
    const char *table = PyUnicode_AsUTF8AndSize(table_name, &c->place.table_len);
    if (!table)
        return -1;
    if (!PyType_IsSubtype((PyTypeObject *)write_slot, &WriteSlotType) ||
        !PyType_IsSubtype((PyTypeObject *)lease, &LeaseType) ||
        !PyType_IsSubtype((PyTypeObject *)reservation, &HandleType)) {
        PyErr_SetString(PyExc_TypeError, "handle classes must derive from the cores");
        return -1;
    }
    c->hot = (HotPath *)Py_NewRef(hot);
    c->codec = (RowCodec *)Py_NewRef(codec);
    c->views = Py_NewRef(views);
    c->write_slot = (PyTypeObject *)Py_NewRef(write_slot);
    c->lease = (PyTypeObject *)Py_NewRef(lease);
    c->reservation = (PyTypeObject *)Py_NewRef(reservation);
    c->nfields = nfields;
    c->plain_claim = (char)plain_claim;
    c->strict = (char)strict;
    c->redeliver_dropped = (char)redeliver_dropped;
    c->idle_every_ns = idle_every_ns;
    c->idle_due_ns = 0;
    c->table_name = Py_NewRef(table_name);
    c->arena = Py_NewRef(arena);
    c->pin = Py_NewRef(pin);
    c->place.table = table;
    c->place.lo = lo;
    c->place.hi = hi;
    c->ready = 1;
    return 0;
}

/* Every reference a core holds, for traverse, clear and dealloc alike. */
#define CORE_REFS(c)                                                                          \
    {(PyObject **)&(c)->hot, (PyObject **)&(c)->codec, &(c)->parts, &(c)->views,              \
     (PyObject **)&(c)->write_slot, (PyObject **)&(c)->lease,                                 \
     (PyObject **)&(c)->reservation, &(c)->table_name, &(c)->arena, &(c)->pin}
#define COUNT(a) (sizeof(a) / sizeof(*(a)))

static int
core_traverse(Core *c, visitproc visit, void *arg)
{
    PyObject **refs[] = CORE_REFS(c);
    for (size_t i = 0; i < COUNT(refs); i++)
        Py_VISIT(*refs[i]);
    return 0;
}

static int
core_clear(Core *c)
{
    PyObject **refs[] = CORE_REFS(c);
    c->ready = 0; /* handles of it now refuse to act */
    for (size_t i = 0; i < COUNT(refs); i++)
        Py_CLEAR(*refs[i]);
    return 0;
}

static void
core_dealloc(Core *c)
{
    PyObject_GC_UnTrack(c);
    core_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* -- handles --------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Core *core;
    PyObject *parts; /* the table's TableParts (parts.py): all a handle uses of it */
    PyObject *owner; /* the table, held only so that it lives while a handle of it does */
    PyObject *slot, *generation, *tag, *deliveries; /* ints */
    char open;
    char listed; /* set while a batch call checks its list: a handle listed twice is refused */
    PyObject *written;          /* WriteSlot: the set of field names written, made on first use */
    PyObject *watched;          /* the slot's WatchedTensors its views came from */
    uint64_t viewed;            /* fields viewed: bit i for position i of `watched` */
    PyObject *pins, *opened;    /* WriteSlot: pinned handles; Lease: opened handles */
} Handle;

static Handle *
new_handle(PyTypeObject *type, Core *core, PyObject *owner, PyObject *slot, PyObject *generation,
           PyObject *tag)
{
    Handle *h = (Handle *)type->tp_alloc(type, 0);
    if (!h)
        return NULL;
    if (!core->parts) { /* the allocation ran a collection, whose callbacks closed the table */
        Py_DECREF(h);
        table_closed();
        return NULL;
    }
    h->core = (Core *)Py_NewRef(core);
    h->parts = Py_NewRef(core->parts);
    h->owner = Py_NewRef(owner);
    h->slot = Py_NewRef(slot);
    h->generation = Py_NewRef(generation);
    h->tag = Py_NewRef(tag);
    h->open = 1;
    return h;
}

/* Handle(table, slot, generation, tag): for the rare handles made in Python. */
static int
handle_init(Handle *h, PyObject *args, PyObject *kwds)
{
    PyObject *table, *slot, *generation, *tag;
    if (PyObject_TypeCheck(h, &LeaseType)) { /* HandleBase.__init__ called on a Lease */
        PyErr_SetString(PyExc_TypeError, "a Lease comes from table.take() or table.poll()");
        return -1;
    }
    if (h->core) {
        PyErr_SetString(PyExc_RuntimeError, "handle already initialized");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!O!O!", &table, &PyLong_Type, &slot, &PyLong_Type, &generation,
                          &PyLong_Type, &tag))
        return -1;
    PyObject *core = PyObject_GetAttr(table, s_core);
    if (!core)
        return -1;
    if (!PyObject_TypeCheck(core, &CoreType) || !((Core *)core)->ready || !((Core *)core)->parts) {
        Py_DECREF(core);
        PyErr_SetString(PyExc_TypeError, "table._core is not an initialized HandleCore");
        return -1;
    }
    h->core = (Core *)core;
    h->parts = Py_NewRef(((Core *)core)->parts);
    h->owner = Py_NewRef(table);
    h->slot = Py_NewRef(slot);
    h->generation = Py_NewRef(generation);
    h->tag = Py_NewRef(tag);
    h->open = 1;
    return 0;
}

#define HANDLE_REFS(h)                                                                        \
    {(PyObject **)&(h)->core, &(h)->parts, &(h)->owner, &(h)->slot, &(h)->generation, &(h)->tag, \
     &(h)->deliveries, &(h)->written, &(h)->watched, &(h)->pins, &(h)->opened}

static int
handle_traverse(Handle *h, visitproc visit, void *arg)
{
    PyObject **refs[] = HANDLE_REFS(h);
    for (size_t i = 0; i < COUNT(refs); i++)
        Py_VISIT(*refs[i]);
    return 0;
}

static void hand_back_dropped(Handle *h);

static int
handle_clear(Handle *h)
{
    hand_back_dropped(h); /* cyclic garbage: cleared before it is deallocated */
    PyObject **refs[] = HANDLE_REFS(h);
    for (size_t i = 0; i < COUNT(refs); i++)
        Py_CLEAR(*refs[i]);
    h->viewed = 0; /* positions in the WatchedTensors just let go */
    return 0;
}

static void
handle_dealloc(Handle *h)
{
    PyObject_GC_UnTrack(h);
    handle_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* The handle's WatchedTensors if it has a ready one (Python may have put anything there). */
static Watched *
watched_of(Handle *h)
{
    PyObject *w = h->watched;
    return w && Py_TYPE(w) == &WatchedType && ((Watched *)w)->ready ? (Watched *)w : NULL;
}

/* `tensor` (a new reference, given up), watched on its own in the handle's `_opened` under
 * `name`: the tensor, or NULL with an error set.  Its counts at rest are taken with the
 * dict that brings it the only other reference, as `WatchedTensors({name: tensor})`. */
static PyObject *
watch_opened(Handle *h, PyObject *name, PyObject *tensor)
{
    PyObject *given = PyDict_New(), *w = NULL, *t = NULL;
    if (given && PyDict_SetItem(given, name, tensor) == 0) {
        Py_CLEAR(tensor);
        w = PyObject_CallOneArg((PyObject *)&WatchedType, given);
    }
    Py_XDECREF(tensor);
    Py_XDECREF(given);
    if (!w)
        return NULL;
    if (!h->opened || h->opened == Py_None)
        Py_XSETREF(h->opened, PyDict_New());
    if (h->opened && PyDict_SetItem(h->opened, name, w) == 0)
        t = Py_XNewRef(PyDict_GetItemWithError(((Watched *)w)->tensors, name));
    Py_DECREF(w);
    return t;
}

/* Whether the tensors this handle opened or loaned (its `_opened`: name -> WatchedTensors)
 * are all at rest, by the same check as its views: 1 yes (none opened included), 0 one is
 * not (the slow path words it), -1 error. */
static int
opened_at_rest(Handle *h)
{
    if (!h->opened || h->opened == Py_None)
        return 1;
    if (!PyDict_CheckExact(h->opened))
        return 0;
    PyObject *opened = PyDict_Values(h->opened); /* a list of our own: the checks hold it */
    if (!opened)
        return -1;
    int settled = 1;
    for (Py_ssize_t i = 0; settled == 1 && i < PyList_GET_SIZE(opened); i++) {
        PyObject *w = PyList_GET_ITEM(opened, i);
        if (Py_TYPE(w) != &WatchedType || !((Watched *)w)->ready)
            settled = 0;
        else {
            int unsettled = watched_any_unsettled((Watched *)w);
            settled = unsettled < 0 ? -1 : !unsettled;
        }
    }
    Py_DECREF(opened);
    return settled;
}

/* A new lease of a slot joins the slot's views if Rows has made them (Python makes them on
 * first use, never here).  The list item is read now, after the lease was allocated: a
 * borrowed item held across an allocation could be replaced, and freed, by what a garbage
 * collection runs. */
static void
join_views(Core *c, Handle *lease)
{
    Py_ssize_t i = PyLong_AsSsize_t(lease->slot); /* HotPath gave it: an int in range */
    PyObject *w = i >= 0 && i < PyList_GET_SIZE(c->views) ? PyList_GET_ITEM(c->views, i) : NULL;
    if (w && Py_TYPE(w) == &WatchedType && ((Watched *)w)->ready)
        lease->watched = Py_NewRef(w);
}

static int
usable(Handle *h)
{
    return h->open && !h->core->closed;
}

/* A handle made without __init__ has no table: refuse it before anything else. */
static int
made(Handle *h)
{
    if (h->core && h->core->ready)
        return 1;
    PyErr_SetString(PyExc_TypeError, "handle was never initialized");
    return 0;
}

static PyObject *
lazy_set(PyObject **where)
{
    if (!*where && !(*where = PySet_New(NULL)))
        return NULL;
    return *where;
}

/* `_viewed`: the names of the fields viewed, a new set (the bits read through `watched`). */
static PyObject *
get_viewed(Handle *h, void *unused)
{
    PyObject *names = PySet_New(NULL);
    if (!names || !h->viewed)
        return names;
    Watched *w = watched_of(h);
    if (!w) { /* bits with no WatchedTensors to name them: never made so */
        Py_DECREF(names);
        PyErr_SetString(PyExc_RuntimeError, "viewed fields without their WatchedTensors");
        return NULL;
    }
    Py_INCREF(w); /* held while its names are read: nothing below may drop it */
    uint64_t bits = h->viewed;
    Py_ssize_t pos = 0;
    PyObject *name, *at;
    int failed = 0;
    while (!failed && PyDict_Next(w->index, &pos, &name, &at)) {
        Py_ssize_t i = PyLong_AsSsize_t(at);
        failed = i >= 0 && i < 64 && (bits >> i & 1) && PySet_Add(names, name) < 0;
    }
    Py_DECREF(w);
    if (failed)
        Py_CLEAR(names);
    return names;
}

static PyObject *
get_watched(Handle *h, void *unused)
{
    return Py_NewRef(h->watched ? h->watched : Py_None);
}

/* `_watched = w`: the views' WatchedTensors; views noted through another one are forgotten,
 * since the bits are positions in this one. */
static int
set_watched(Handle *h, PyObject *value, void *unused)
{
    if (value == Py_None)
        value = NULL;
    if (value && Py_TYPE(value) != &WatchedType) {
        PyErr_SetString(PyExc_TypeError, "_watched takes a WatchedTensors or None");
        return -1;
    }
    if (value != h->watched)
        h->viewed = 0;
    Py_XSETREF(h->watched, Py_XNewRef(value));
    return 0;
}

/* The bits of `names` (an iterable of str) in the handle's WatchedTensors: 0 with *bits set,
 * -1 error (TypeError: a name not a str; ValueError: no WatchedTensors, or a name it does not
 * watch, unless `lenient`, which skips such names).  The names are listed first, so that no
 * Python runs once the WatchedTensors is read: the bits are positions in that one. */
static int
bits_of(Handle *h, PyObject *names, int lenient, uint64_t *bits)
{
    *bits = 0;
    PyObject *listed = PySequence_Fast(names, "a handle's viewed names must be iterable");
    if (!listed)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(listed);
    PyObject **items = PySequence_Fast_ITEMS(listed);
    int result = 0;
    for (Py_ssize_t k = 0; k < n; k++)
        if (!PyUnicode_CheckExact(items[k])) {
            PyErr_Format(PyExc_TypeError, "a field name must be a str, not %R", items[k]);
            result = -1;
            break;
        }
    Watched *w = result ? NULL : watched_of(h);
    if (!result && !w && !lenient) {
        PyErr_SetString(PyExc_ValueError, "no views made for this handle");
        result = -1;
    }
    for (Py_ssize_t k = 0; w && !result && k < n; k++) { /* exact str keys: no Python runs */
        Py_ssize_t i = position_of(w, items[k]);
        if (i == -2)
            result = -1;
        else if (i >= 64 || (i == -1 && !lenient)) {
            PyErr_Format(PyExc_ValueError, "%R is not a watched field", items[k]);
            result = -1;
        } else if (i >= 0)
            *bits |= (uint64_t)1 << i;
    }
    Py_DECREF(listed);
    return result;
}

/* _note_viewed(names): these fields' views were handed out (by the slow paths). */
static PyObject *
handle_note_viewed(Handle *h, PyObject *names)
{
    uint64_t bits;
    if (bits_of(h, names, 0, &bits) < 0)
        return NULL;
    h->viewed |= bits;
    Py_RETURN_NONE;
}

/* _unview(names): nothing of these fields' views is left to check (names not viewed: none). */
static PyObject *
handle_unview(Handle *h, PyObject *names)
{
    uint64_t bits;
    if (bits_of(h, names, 1, &bits) < 0)
        return NULL;
    h->viewed &= ~bits;
    Py_RETURN_NONE;
}

static PyObject *
get_written(Handle *h, void *unused)
{
    return Py_XNewRef(lazy_set(&h->written));
}

/* The slot's state while this handle owns it, by the handle's kind. */
static int
held_state(Handle *h)
{
    if (PyObject_TypeCheck(h, &WriteSlotType))
        return S_WRITING;
    return PyObject_TypeCheck(h, &LeaseType) ? S_HELD : S_RESERVED;
}

/* The handle's slot and generation as the steps take them (hotpath.c checks their range);
 * 0 with an error set if Python made the handle with numbers that are no slot's. */
static int
ids(Handle *h, Py_ssize_t *slot, uint64_t *gen)
{
    *slot = PyLong_AsSsize_t(h->slot);
    if (*slot == -1 && PyErr_Occurred())
        return 0;
    *gen = PyLong_AsUnsignedLongLong(h->generation);
    return !(*gen == (uint64_t)-1 && PyErr_Occurred());
}

/* The handle's last transition and the end of its ownership, in one step that runs no Python
 * code: `event` is E_PUBLISH (a WriteSlot), E_REDELIVER (a Lease handed back: `unread` if its
 * caller never saw the row, which takes back the take's delivery), or E_RELEASE or E_ABORT.
 * STEP_DONE (the handle is closed), STEP_REFUSED (not this handle's slot any more: nothing
 * changed), STEP_QUEUE_FULL (publish: nothing changed),
 * STEP_ERROR (error set). */
static int
step(Handle *h, int event, int unread)
{
    HotPath *hot = h->core->hot;
    Py_ssize_t slot;
    uint64_t gen;
    int code;
    if (!ids(h, &slot, &gen))
        return STEP_ERROR;
    if (event == E_PUBLISH)
        code = hot_publish(hot, slot, gen);
    else if (event == E_REDELIVER)
        code = hot_redeliver(hot, slot, gen, unread);
    else /* E_RELEASE or E_ABORT; hot_free refuses any other event with an error */
        code = hot_free(hot, slot, gen, held_state(h), event);
    if (code == STEP_DONE)
        h->open = 0;
    return code;
}

/* _hand_back(event) -> 0 done | -1 refused | -2 ready queue full: `step` for the Python side. */
static PyObject *
handle_hand_back(Handle *h, PyObject *event)
{
    if (!made(h))
        return NULL;
    if (!PyLong_Check(event)) {
        PyErr_SetString(PyExc_TypeError, "_hand_back takes an event number");
        return NULL;
    }
    long number = PyLong_AsLong(event);
    if (number == -1 && PyErr_Occurred())
        return NULL;
    if (!usable(h))
        return PyLong_FromLong(STEP_REFUSED);
    /* the table hands leases back before their caller sees them: unread */
    int code = step(h, number < 0 || number >= E_COUNT ? -1 : (int)number, 1);
    return code == STEP_ERROR ? NULL : PyLong_FromLong(code);
}

/* A handle collected while it still owns its slot hands it back, from its dealloc (or its
 * clear, for cyclic garbage), where no Python code runs: a write slot or reservation is
 * aborted, a lease redelivered (or dropped, as the table's policy for a dead reader says),
 * and views it handed out are not given to the slot's next owner.  Then a ResourceWarning
 * says so, as Python does for an unclosed file.  Any error is reported, never raised. */
static void
hand_back_dropped(Handle *h)
{
    if (!h->core || !h->core->ready || !usable(h))
        return;
    Core *c = h->core;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    Py_ssize_t slot = PyLong_AsSsize_t(h->slot);
    if (h->viewed && slot >= 0 && slot < PyList_GET_SIZE(c->views))
        PyList_SetItem(c->views, slot, Py_NewRef(Py_None));
    PyErr_Clear();
    int lease = PyObject_TypeCheck(h, &LeaseType);
    int done = step(h, lease && c->redeliver_dropped ? E_REDELIVER : E_ABORT, 0);
    if (done == STEP_DONE &&
        PyErr_WarnFormat(PyExc_ResourceWarning, 1,
                         "%s of slot %S (tag %S) was garbage-collected while it still owned its "
                         "slot; it was handed back",
                         _PyType_Name(Py_TYPE(h)), h->slot, h->tag) < 0)
        done = STEP_ERROR;
    if (done == STEP_ERROR)
        PyErr_WriteUnraisable(NULL);
    PyErr_Restore(type, value, tb);
}

/* Between a handle's check that it is open and a RowCodec copy into (or out of) its row, no
 * Python may run: code that hands the handle back there (its slot then free, or another
 * owner's) would have the copy land in a row that is not this handle's.  The copy itself
 * runs none for a plain tensor, but any allocation may start a garbage collection, whose
 * callbacks and finalizers are Python: collection is held off from the check to the copy.
 * Returns whether it was on, for collection_back. */
static int
hold_collection(void)
{
    return PyGC_Disable();
}

static void
collection_back(int was_on)
{
    if (was_on)
        PyGC_Enable();
}

/* -- WriteSlot ------------------------------------------------------------------------------ */

static PyObject *
ws_write(Handle *h, PyObject *args, PyObject *kwargs)
{
    if (!made(h))
        return NULL;
    if (PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "write() takes fields as keyword arguments only");
        return NULL;
    }
    int gc_was = hold_collection(); /* from the check that h is open to the copy */
    Py_ssize_t slot;
    uint64_t gen;
    if (kwargs && usable(h)) {
        int written_all = ids(h, &slot, &gen) ? codec_write(h->core->codec, slot, kwargs) : -1;
        collection_back(gc_was);
        if (written_all < 0)
            return NULL;
        if (written_all) {
            PyObject *written = lazy_set(&h->written), *name, *value;
            Py_ssize_t pos = 0;
            if (!written)
                return NULL;
            while (PyDict_Next(kwargs, &pos, &name, &value))
                if (PySet_Add(written, name) < 0)
                    return NULL;
            return Py_NewRef(h);
        }
    } else {
        collection_back(gc_was);
    }
    PyObject *fields = kwargs ? Py_NewRef(kwargs) : PyDict_New();
    if (!fields)
        return NULL;
    PyObject *result = slow((PyObject *)h, s_write_slow, fields, NULL);
    Py_DECREF(fields);
    return result;
}

/* `name`'s entry in a handle's dict of pins or opened loans: 1 there, 0 not (no dict yet
 * included), -1 error or not the plain case (Python may have put anything there). */
static int
listed(PyObject *dict, PyObject *name)
{
    if (!dict || dict == Py_None)
        return 0;
    return PyDict_CheckExact(dict) ? PyDict_Contains(dict, name) : -1;
}

/* alloc(name, shape): a loan of the arena for ref field `name` (see leases.WriteSlot), in one
 * call: the block (arena.c), its ref in the row and the tensor over it (codec_loan), the pin
 * the write slot keeps of it, the loan watched.  The plain case is a first loan of the field
 * in this write slot, a tuple of ints its shape takes, and room in the arena; anything else
 * (a replacement, a list, an error to word, a full arena to collect) is `_alloc_slow`. */
static PyObject *
ws_alloc(Handle *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!made(h))
        return NULL;
    Core *c = h->core;
    if (nargs != 2 || kwnames || !usable(h) || c->arena == Py_None)
        return slow_call((PyObject *)h, s_alloc_slow, args, nargs, kwnames);
    PyObject *name = args[0], *tensor = NULL, *pin = NULL;
    int before = PyUnicode_CheckExact(name) ? listed(h->pins, name) : -1;
    if (!before)
        before = listed(h->opened, name);
    if (before)
        return before < 0 && PyErr_Occurred() ? NULL : slow_call((PyObject *)h, s_alloc_slow,
                                                                   args, nargs, kwnames);
    Py_ssize_t slot, offset;
    uint64_t gen, nbytes;
    int gc_was = hold_collection(); /* from the check that h is open to the tensor */
    int lent = usable(h) && ids(h, &slot, &gen)
                   ? codec_loan(c->codec, slot, gen, name, args[1], c->arena, &c->place, &tensor,
                                &offset, &nbytes)
                   : (PyErr_Occurred() ? -1 : 0);
    collection_back(gc_was);
    if (lent <= 0)
        return lent < 0 ? NULL : slow_call((PyObject *)h, s_alloc_slow, args, nargs, kwnames);
    PyObject *at = PyLong_FromSsize_t(offset), *size = PyLong_FromUnsignedLongLong(nbytes);
    if (at && size) {
        PyObject *fields[] = {h->slot, h->generation, name, at, size};
        pin = PyObject_Vectorcall(c->pin, fields, COUNT(fields), NULL);
    }
    Py_XDECREF(at);
    Py_XDECREF(size);
    if (pin && (!h->pins || h->pins == Py_None)) /* else a dict: listed() said so */
        Py_XSETREF(h->pins, PyDict_New());
    if (pin && h->pins && PyDict_SetItem(h->pins, name, pin) == 0) {
        PyObject *loan = watch_opened(h, name, tensor); /* takes the tensor */
        PyObject *written = loan ? lazy_set(&h->written) : NULL;
        if (written && PySet_Add(written, name) == 0) {
            Py_DECREF(pin);
            return loan;
        }
        Py_XDECREF(loan);
        tensor = NULL;
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        if (h->opened && PyDict_CheckExact(h->opened) && PyDict_DelItem(h->opened, name) < 0)
            PyErr_Clear();
        if (PyDict_DelItem(h->pins, name) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, trace);
    }
    Py_XDECREF(pin);
    Py_XDECREF(tensor);
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    arena_give_back(c->arena, offset, slot, gen); /* lent just now: found, given back */
    PyErr_Restore(type, value, trace);
    return NULL;
}

/* The one sealing order, for publish and keep alike: prove the slot is still this handle's
 * WRITING one, seal its row, and only then make the transition.  Killed between the seal and
 * the transition, the slot is a dead writer's WRITING one, which a reaper frees: nothing
 * committed is lost and nothing is delivered under a stale seal.  A slot that is not ours any
 * more (reaped while this process was taken for dead) never gets our seal over its new
 * owner's: only a reaper moves a live owner's slot, and only for the dead.  1 sealed, 0 not
 * this participant's WRITING slot at `gen` (nothing written), -1 error set. */
static int
seal_writing(Core *c, Py_ssize_t slot, uint64_t gen)
{
    int mine = hot_writing(c->hot, slot, gen);
    if (mine <= 0)
        return mine < 0 ? -1 : 0;
    return codec_seal(c->codec, slot, gen) < 0 ? -1 : 1;
}

/* seal_writing for a write slot's own slot. */
static int
seal_mine(Handle *h)
{
    Py_ssize_t slot;
    uint64_t gen;
    return ids(h, &slot, &gen) ? seal_writing(h->core, slot, gen) : -1;
}

/* _seal_mine() -> bool: seal_mine for the Python path of publish (leases.py). */
static PyObject *
ws_seal_mine(Handle *h, PyObject *unused)
{
    if (!made(h))
        return NULL;
    int sealed = usable(h) ? seal_mine(h) : 0;
    return sealed < 0 ? NULL : PyBool_FromLong(sealed);
}

/* publish(timeout=1.0) */
static PyObject *
ws_publish(Handle *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!made(h))
        return NULL;
    PyObject *timeout = default_timeout;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1 ||
        (nkw && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_timeout) != 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "publish() takes one argument, timeout");
        return NULL;
    }
    if (nargs + nkw)
        timeout = args[0];
    Core *c = h->core;
    Py_ssize_t written = h->written ? PySet_GET_SIZE(h->written) : 0;
    if (usable(h) && written == c->nfields && !h->viewed) {
        int settled = opened_at_rest(h);
        if (settled < 0)
            return NULL;
        int sealed = settled && usable(h) ? seal_mine(h) : 0;
        if (sealed < 0)
            return NULL;
        if (sealed) {
            kill_point(KILL_PUBLISH_SEALED);
            Py_CLEAR(h->opened); /* loans: the reader's from now on */
            int code = step(h, E_PUBLISH, 0);
            if (code == STEP_ERROR)
                return NULL;
            if (code == STEP_DONE)
                Py_RETURN_NONE;
        }
    }
    return slow((PyObject *)h, s_publish_slow, timeout, NULL);
}

static PyObject *
ws_abort(Handle *h, PyObject *unused)
{
    if (!made(h))
        return NULL;
    int settled = usable(h) && !h->viewed ? opened_at_rest(h) : 0;
    if (settled < 0)
        return NULL;
    if (settled && usable(h)) {
        int code = step(h, E_ABORT, 0);
        if (code == STEP_ERROR)
            return NULL;
        if (code == STEP_DONE) {
            Py_CLEAR(h->opened);
            Py_RETURN_NONE;
        }
    }
    return slow((PyObject *)h, s_abort_slow, NULL, NULL);
}

/* _keep() -> Lease | None: seal the row and hold it oneself (WRITING -> HELD), in the one
 * sealing order (seal_mine), and hand the ownership from this write slot to a new lease, in
 * one call; None if the slot is not this handle's any more (nothing changed, its seal
 * included).  leases.WriteSlot.keep checks everything first. */
static PyObject *
ws_keep(Handle *h, PyObject *unused)
{
    if (!made(h))
        return NULL;
    if (!usable(h))
        Py_RETURN_NONE;
    Core *c = h->core;
    Py_ssize_t slot;
    uint64_t gen;
    int sealed = seal_mine(h);
    if (sealed <= 0)
        return sealed < 0 ? NULL : Py_NewRef(Py_None);
    kill_point(KILL_KEEP_SEALED);
    ids(h, &slot, &gen); /* seal_mine converted them */
    int code = hot_keep(c->hot, slot, gen);
    if (code != STEP_DONE)
        return code == STEP_ERROR ? NULL : Py_NewRef(Py_None);
    h->open = 0;
    kill_point(KILL_KEEP_HELD);
    Handle *lease = new_handle(c->lease, c, h->owner, h->slot, h->generation, h->tag);
    PyObject *before = lease ? PyLong_FromLong(0) : NULL;
    if (!before) { /* out of memory: the kept row is aborted rather than owned by nobody */
        undo(c, (PyObject *)h, slot, gen, S_HELD, E_ABORT);
        if (lease)
            lease->open = 0;
        Py_XDECREF(lease);
        return NULL;
    }
    lease->deliveries = before;
    join_views(c, lease);
    return (PyObject *)lease;
}

/* -- Lease ---------------------------------------------------------------------------------- */

static PyObject *
lease_view(Handle *h, PyObject *name)
{
    if (!made(h))
        return NULL;
    Watched *w = watched_of(h);
    if (usable(h) && w && PyUnicode_CheckExact(name)) {
        Py_ssize_t i = position_of(w, name);
        if (i >= 0 && i < 64) {
            h->viewed |= (uint64_t)1 << i;
            return Py_NewRef(w->rest[i].tensor);
        }
        if (i == -2)
            return NULL;
    }
    return slow((PyObject *)h, s_view_slow, name, NULL);
}

/* views(names) -> tuple: view(name) for each of `names` (a tuple; None gives None), in one
 * call, each counted as viewed exactly as view() counts it: a row handed out whole. */
static PyObject *
lease_views(Handle *h, PyObject *names)
{
    if (!made(h))
        return NULL;
    if (!PyTuple_CheckExact(names)) {
        PyErr_SetString(PyExc_TypeError, "views() takes a tuple of field names");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    PyObject *row = PyTuple_New(n);
    for (Py_ssize_t i = 0; row && i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        PyObject *view = name == Py_None ? Py_NewRef(Py_None) : lease_view(h, name);
        if (!view)
            Py_CLEAR(row);
        else
            PyTuple_SET_ITEM(row, i, view);
    }
    return row;
}

static PyObject *
lease_item(Handle *h, PyObject *name)
{
    if (!made(h))
        return NULL;
    Py_ssize_t slot;
    uint64_t gen;
    if (usable(h)) {
        PyObject *number = ids(h, &slot, &gen) ? codec_read(h->core->codec, slot, name) : NULL;
        if (number != Py_None)
            return number; /* the value, or NULL with the error */
        Py_DECREF(number);
    }
    return slow((PyObject *)h, s_item_slow, name, NULL);
}

/* Whether a call takes the fast path: its one argument given by position, on a handle of an
 * open table; *slot and *gen set.  Anything else goes to the handle's Python method. */
static int
one_name(Handle *h, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t *slot, uint64_t *gen)
{
    return nargs == 1 && !kwnames && usable(h) && ids(h, slot, gen);
}

/* tensor(name): a ref field opened (an arena ref in one compiled call, watched on its own
 * as leases.py's Lease.tensor says), or an inline field's view; a CUDA ref, a refusal to
 * word or a closed lease is `_tensor_slow`'s. */
static PyObject *
lease_tensor(Handle *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!made(h))
        return NULL;
    Py_ssize_t slot;
    uint64_t gen;
    if (one_name(h, nargs, kwnames, &slot, &gen) && PyUnicode_CheckExact(args[0])) {
        PyObject *name = args[0];
        PyObject *opened = h->opened && PyDict_CheckExact(h->opened) ? h->opened : NULL;
        PyObject *w = opened ? PyDict_GetItemWithError(opened, name) : NULL;
        if (w) { /* opened before, by this lease */
            PyObject *t = Py_TYPE(w) == &WatchedType && ((Watched *)w)->ready
                              ? PyDict_GetItemWithError(((Watched *)w)->tensors, name)
                              : NULL;
            if (t || PyErr_Occurred())
                return t ? Py_NewRef(t) : NULL;
        } else if (PyErr_Occurred())
            return NULL;
        else {
            PyObject *got = codec_open_ref(h->core->codec, slot, name, &h->core->place);
            if (got == Py_None) {
                Py_DECREF(got);
                return lease_view(h, name);
            }
            if (got && !PyLong_Check(got) && usable(h)) /* still: making it may run Python */
                return watch_opened(h, name, got);
            if (!got)
                return NULL;
            Py_DECREF(got); /* a CUDA ref, a refusal, or a lease just ended: Python's */
        }
    }
    return slow_call((PyObject *)h, s_tensor_slow, args, nargs, kwnames);
}

/* copy(name, out=None): an owned copy of an inline field in one compiled call when only the
 * name is given; anything else (an `out`, keywords, a ref field, an unknown name, a closed
 * lease) is `_copy_slow`'s, which copies or words the refusal. */
static PyObject *
lease_copy(Handle *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!made(h))
        return NULL;
    Py_ssize_t slot;
    uint64_t gen;
    if (one_name(h, nargs, kwnames, &slot, &gen)) {
        PyObject *made_copy = codec_copy(h->core->codec, slot, args[0]);
        if (made_copy != Py_None && (!made_copy || usable(h)))
            return made_copy; /* the copy, or NULL with the error */
        /* None, or the allocation ran Python that ended the lease: the slow path says so */
        Py_DECREF(made_copy);
    }
    return slow_call((PyObject *)h, s_copy_slow, args, nargs, kwnames);
}

static PyObject *
lease_end(Handle *h, int release)
{
    if (!made(h))
        return NULL;
    int event = release ? E_RELEASE : E_ABORT;
    uint64_t viewed = h->viewed;
    if (usable(h) && (!viewed || watched_of(h)) && !(viewed && h->core->strict)) {
        int leaked = 0;
        if (viewed) { /* the check may run torch's Python: hold what it reads */
            PyObject *watched = Py_NewRef(h->watched);
            leaked = watched_bits_unsettled((Watched *)watched, viewed);
            Py_DECREF(watched);
        }
        if (!leaked) {
            int settled = opened_at_rest(h);
            leaked = settled < 0 ? -1 : !settled;
        }
        if (leaked < 0)
            return NULL;
        if (!leaked && usable(h)) {
            int code = step(h, event, 0);
            if (code == STEP_ERROR)
                return NULL;
            if (code == STEP_DONE) {
                Py_CLEAR(h->opened);
                Py_RETURN_NONE;
            }
        }
    }
    PyObject *number = PyLong_FromLong(event);
    PyObject *r = number ? slow((PyObject *)h, s_end, number, release ? s_release : s_abort) : NULL;
    Py_XDECREF(number);
    return r;
}

static PyObject *
lease_release(Handle *h, PyObject *unused)
{
    return lease_end(h, 1);
}

static PyObject *
lease_abort(Handle *h, PyObject *unused)
{
    return lease_end(h, 0);
}

/* -- HandleCore methods: how a handle is made, in the call that gives it its slot ------------ */

/* Undo a transition whose handle could not be made, or whose next step failed: hand the slot
 * (in `state`) back through a handle-less step, `event` E_ABORT or E_REDELIVER (a taken lease,
 * unread), keeping the error that got us here; a failure of the step itself is reported as
 * `culprit`'s.  On a table closed meanwhile (by what an allocation ran, or by another thread
 * while a copy let it run) its close did it. */
static void
undo(Core *c, PyObject *culprit, Py_ssize_t slot, uint64_t gen, int state, int event)
{
    if (!usable_core(c) || !hot_member(c->hot)) /* left: its leave handed every slot back */
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int code = event == E_REDELIVER ? hot_redeliver(c->hot, slot, gen, 1)
                                    : hot_free(c->hot, slot, gen, state, event);
    if (code == STEP_ERROR)
        PyErr_WriteUnraisable(culprit);
    PyErr_Restore(type, value, tb);
}

/* A handle of `type` for a slot just acquired, or NULL with the slot handed back. */
static PyObject *
own(Core *c, PyTypeObject *type, PyObject *owner, Py_ssize_t slot, uint64_t gen, uint64_t tag,
    int state)
{
    PyObject *slot_o = PyLong_FromSsize_t(slot), *gen_o = PyLong_FromUnsignedLongLong(gen);
    PyObject *tag_o = PyLong_FromUnsignedLongLong(tag);
    Handle *h = slot_o && gen_o && tag_o ? new_handle(type, c, owner, slot_o, gen_o, tag_o)
                                         : NULL;
    Py_XDECREF(slot_o);
    Py_XDECREF(gen_o);
    Py_XDECREF(tag_o);
    if (!h)
        undo(c, (PyObject *)c, slot, gen, state, state == S_HELD ? E_REDELIVER : E_ABORT);
    return (PyObject *)h;
}

/* Whether the core may make handles: initialized, its table open and its parts given. */
static int
usable_core(Core *c)
{
    return c->ready && !c->closed && c->parts;
}

/* usable_core, or 0 with the error every call that needs an open table raises. */
static int
open_core(Core *c)
{
    if (usable_core(c))
        return 1;
    table_closed();
    return 0;
}

/* A handle for a slot acquired by `event` (E_CLAIM: WriteSlot, E_RESERVE: Reservation)
 * carrying `tag`, the items of the fields in `zeroed` (a mask codec_mask_fits) zeroed before
 * anyone else can see the slot; Py_None if no slot is FREE, or NULL with an error. */
static PyObject *
acquire_one(Core *c, PyObject *table, int event, uint64_t tag, uint64_t zeroed)
{
    Py_ssize_t slot;
    uint64_t gen;
    int got = hot_acquire(c->hot, event, tag, &slot, &gen);
    if (got <= 0)
        return got < 0 ? NULL : Py_NewRef(Py_None);
    int reserve = event == E_RESERVE;
    int state = reserve ? S_RESERVED : S_WRITING;
    if (zeroed && codec_zero(c->codec, slot, zeroed) < 0) {
        undo(c, (PyObject *)c, slot, gen, state, E_ABORT);
        return NULL;
    }
    return own(c, reserve ? c->reservation : c->write_slot, table, slot, gen, tag, state);
}

/* The tag of a claim or reservation as the slot word's entry holds it; 0 with an error set. */
static int
tag_arg(PyObject *o, uint64_t *tag)
{
    *tag = PyLong_AsUnsignedLongLong(o);
    return !(*tag == (uint64_t)-1 && PyErr_Occurred());
}

/* acquire(table, event, tag, zeroed=0) -> WriteSlot (CLAIM) | Reservation (RESERVE) | None
 * (none FREE), the fields of mask `zeroed` zeroed in the same step.  The tag and the mask must
 * already be checked (Python words their errors; a mask beyond the fields is refused here). */
static PyObject *
core_acquire(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "acquire(table, event, tag, zeroed=0)");
        return NULL;
    }
    if (!open_core(c))
        return NULL;
    long event = PyLong_AsLong(args[1]);
    uint64_t tag, zeroed = 0;
    if ((event == -1 && PyErr_Occurred()) || !tag_arg(args[2], &tag) ||
        (nargs == 4 && !as_u64(args[3], &zeroed)))
        return NULL;
    if (!codec_mask_fits(c->codec, zeroed)) {
        PyErr_SetString(PyExc_ValueError, "acquire: a zeroed mask beyond the table's fields");
        return NULL;
    }
    /* out of int's range: a number hot_acquire refuses, never one wrapped into its range */
    return acquire_one(c, args[0], event < 0 || event > E_COUNT ? -1 : (int)event, tag, zeroed);
}

/* claim(table, tag) -> WriteSlot | None: a FREE slot claimed now, or None (none free, a
 * closed table, a tag that is not a plain int, ref fields): Python's claim takes over. */
static PyObject *
core_claim(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "claim(table, tag)");
        return NULL;
    }
    PyObject *tag = args[1];
    if (!usable_core(c) || !c->plain_claim || !PyLong_CheckExact(tag))
        Py_RETURN_NONE;
    uint64_t number;
    if (!tag_arg(tag, &number)) { /* negative or over 64 bits: Python's check words the error */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return acquire_one(c, args[0], E_CLAIM, number, 0);
}

/* send's pick (codec_write_picked): a FREE slot claimed for `tag`, its generation kept. */
typedef struct {
    HotPath *hot;
    uint64_t tag, gen;
} Claim;

static int
claim_slot(void *ctx, Py_ssize_t *slot)
{
    Claim *claim = ctx;
    return hot_acquire(claim->hot, E_CLAIM, claim->tag, slot, &claim->gen);
}

/* send(table, fields, tag) -> True | None: claim, write and publish a row in one call that
 * runs no Python, so no exception can split it, and no write slot is made.  `fields` (a dict
 * of every field, or a tuple of their values in schema order) is checked whole first; only
 * then is a FREE slot claimed, the row copied into it, sealed in the one sealing order
 * (seal_writing) and published.  None, with nothing changed (no slot claimed), where the
 * compiled case does not apply: ref fields, not exactly the schema's number of fields, a
 * value that is not the plain case or is refused (the slow path words why), a tag that is
 * not a plain int, no slot FREE.  None too, the slot handed back, for a full ready queue or
 * a slot reaped meanwhile.  The table's send then claims, writes and publishes, with their
 * waits and their errors.  Killed between the steps, the slot is a dead writer's WRITING
 * one, which a reaper frees. */
static PyObject *
core_send(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(table, fields, tag)");
        return NULL;
    }
    PyObject *fields = args[1], *tag = args[2];
    Py_ssize_t given = PyDict_CheckExact(fields)    ? PyDict_GET_SIZE(fields)
                       : PyTuple_CheckExact(fields) ? PyTuple_GET_SIZE(fields)
                                                    : -1;
    if (!usable_core(c) || !c->plain_claim || given != c->nfields || !PyLong_CheckExact(tag))
        Py_RETURN_NONE;
    Claim claim = {c->hot, 0, 0};
    if (!tag_arg(tag, &claim.tag)) { /* negative or over 64 bits: claim words the error */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t slot;
    int gc_was = hold_collection(); /* from the claim to the publish: no Python between */
    /* every field written: a dict's keys are distinct, each one the codec knows */
    int written = codec_write_picked(c->codec, fields, claim_slot, &claim, &slot);
    if (written == 1 && !usable_core(c)) { /* closed by a thread a big copy let run */
        table_closed();
        written = -1;
    }
    int sealed = written == 1 ? seal_writing(c, slot, claim.gen) : written;
    int code, give_back;
    if (sealed == 1) {
        kill_point(KILL_PUBLISH_SEALED);
        code = hot_publish(c->hot, slot, claim.gen);
        give_back = code == STEP_ERROR || code == STEP_QUEUE_FULL;
    } else { /* not written (no slot, or an error after the claim), or reaped meanwhile */
        code = sealed < 0 ? STEP_ERROR : STEP_REFUSED;
        give_back = slot >= 0 && (written != 1 || sealed < 0);
    }
    if (give_back)
        undo(c, args[0], slot, claim.gen, S_WRITING, E_ABORT);
    collection_back(gc_was);
    if (code == STEP_DONE)
        Py_RETURN_TRUE;
    return code == STEP_ERROR ? NULL : Py_NewRef(Py_None);
}

/* open_reserved(table, slot, generation) -> WriteSlot | None (not reserved at generation). */
static PyObject *
core_open_reserved(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "open_reserved(table, slot, generation)");
        return NULL;
    }
    if (!open_core(c))
        return NULL;
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    uint64_t gen, tag;
    if ((slot == -1 && PyErr_Occurred()) || !tag_arg(args[2], &gen))
        return NULL;
    int opened = hot_open_reserved(c->hot, slot, gen, &tag);
    if (opened <= 0)
        return opened < 0 ? NULL : Py_NewRef(Py_None);
    return own(c, c->write_slot, args[0], slot, gen, tag, S_WRITING);
}

/* keep_reserved(reservation) -> Lease | None: a reservation whose row a writer filled by
 * address (a transfer engine), taken as written, sealed and held by this process, in one call
 * that runs no Python: RESERVED -> WRITING (open_reserved), the seal (seal_mine's order),
 * WRITING -> HELD (keep), and the reservation's ownership handed to a new lease, which carries
 * the slot's tag as open_reserved's write slot would.  None when the compiled path does not
 * apply (ref fields, a handle that is not this core's open reservation) or a step is refused
 * (not reserved at its generation any more; a reaper took the slot meanwhile): Python's
 * open_reserved(...).written_in_place().keep() then does it, or words why not.  Killed
 * between the steps, the slot is a dead writer's WRITING one, which a reaper frees. */
static PyObject *
core_keep_reserved(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "keep_reserved(reservation)");
        return NULL;
    }
    if (!open_core(c))
        return NULL;
    Handle *h = (Handle *)args[0];
    if (!c->plain_claim || !PyObject_TypeCheck(args[0], c->reservation) || h->core != c ||
        !usable(h))
        Py_RETURN_NONE;
    Py_ssize_t slot;
    uint64_t gen, tag;
    if (!ids(h, &slot, &gen))
        return NULL;
    int opened = hot_open_reserved(c->hot, slot, gen, &tag);
    if (opened <= 0)
        return opened < 0 ? NULL : Py_NewRef(Py_None);
    int code = codec_seal(c->codec, slot, gen) < 0 ? STEP_ERROR : hot_keep(c->hot, slot, gen);
    if (code == STEP_ERROR) { /* the seal failed: the reservation ends with its slot */
        undo(c, args[0], slot, gen, S_WRITING, E_ABORT);
        h->open = 0;
        return NULL;
    }
    if (code != STEP_DONE) /* a reaper took the slot for a dead one's: Python says so */
        return Py_NewRef(Py_None);
    h->open = 0; /* the slot is HELD now: the reservation is over */
    PyObject *tag_o = PyLong_FromUnsignedLongLong(tag);
    Handle *lease = tag_o ? new_handle(c->lease, c, h->owner, h->slot, h->generation, tag_o)
                          : NULL;
    Py_XDECREF(tag_o);
    if (lease)
        lease->deliveries = PyLong_FromLong(0);
    if (!lease || !lease->deliveries) { /* out of memory: the row is aborted, not ownerless */
        undo(c, args[0], slot, gen, S_HELD, E_ABORT);
        if (lease)
            lease->open = 0;
        Py_XDECREF(lease);
        return NULL;
    }
    join_views(c, lease);
    return (PyObject *)lease;
}

/* One READY slot as a Lease (new reference), Py_None (new reference) if nothing is ready, or
 * NULL with an error.  The Lease is made in the same call that takes the slot; the slot's
 * views join it if they exist already (Python makes them on first use, never here). */
static PyObject *
take_one(Core *c, PyObject *table)
{
    Py_ssize_t slot;
    uint64_t gen, tag, before;
    int took = hot_take(c->hot, &slot, &gen, &tag, &before);
    if (took <= 0)
        return took < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *deliveries = PyLong_FromUnsignedLongLong(before);
    Handle *h = deliveries ? (Handle *)own(c, c->lease, table, slot, gen, tag, S_HELD) : NULL;
    if (!h) {
        if (!deliveries)
            undo(c, (PyObject *)c, slot, gen, S_HELD, E_REDELIVER);
        Py_XDECREF(deliveries);
        return NULL;
    }
    join_views(c, h);
    h->deliveries = deliveries;
    return (PyObject *)h;
}

/* Nothing was ready: now and then (every idle_every_ns) let the table look after what other
 * processes may have left undone (`parts.idle()`), so the check costs a reader that busy-polls
 * one clock read per empty poll, not a Python call.  0, or -1 with an error set. */
static int
idle(Core *c)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (now < c->idle_due_ns)
        return 0;
    c->idle_due_ns = now + c->idle_every_ns;
    PyObject *r = PyObject_CallMethodNoArgs(c->parts, s_idle);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* take(table) -> Lease | None (nothing queued). */
static PyObject *
core_take(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "take(table)");
        return NULL;
    }
    if (!open_core(c))
        return NULL;
    PyObject *lease = take_one(c, args[0]);
    if (lease == Py_None && idle(c) < 0)
        Py_CLEAR(lease);
    return lease;
}

/* A batch that cannot be returned: hand back `one` (the handle that could not join it, or
 * NULL) and every handle of `list` through `event` (leases unread: nobody saw them),
 * keeping the error that got us here. */
static void
hand_back_all(PyObject *one, PyObject *list, int event)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (one && step((Handle *)one, event, 1) == STEP_ERROR)
        PyErr_WriteUnraisable(one);
    for (Py_ssize_t j = 0; list && j < PyList_GET_SIZE(list); j++)
        if (step((Handle *)PyList_GET_ITEM(list, j), event, 1) == STEP_ERROR)
            PyErr_WriteUnraisable(PyList_GET_ITEM(list, j));
    PyErr_Restore(type, value, tb);
}

/* poll(table, max_n) -> [Lease, ...]: up to max_n READY slots in one call.  If the list cannot
 * be grown, every lease taken is handed back unread before the error is raised. */
static PyObject *
core_poll(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "poll(table, max_n)");
        return NULL;
    }
    Py_ssize_t max_n = PyLong_AsSsize_t(args[1]);
    if ((max_n == -1 && PyErr_Occurred()) || !open_core(c))
        return NULL;
    PyObject *leases = PyList_New(0);
    for (Py_ssize_t k = 0; leases && k < max_n; k++) {
        PyObject *lease = take_one(c, args[0]);
        if (lease == Py_None) {
            Py_DECREF(lease);
            if (!k && idle(c) < 0)
                Py_CLEAR(leases);
            break;
        }
        if (!lease || PyList_Append(leases, lease) < 0) {
            hand_back_all(lease, leases, E_REDELIVER);
            Py_XDECREF(lease);
            Py_CLEAR(leases);
        } else {
            Py_DECREF(lease); /* the list holds it */
        }
    }
    return leases;
}

/* -- batch calls: one compiled call for many handles -------------------------------------- */

/* The handles of `seq` as a tuple (new reference): every one of `type`, of this table, open,
 * and (if `once`) listed once.  NULL with *bad set to the index of the first that is not (no
 * error set: Python words it, nothing having changed), or NULL with an error set. */
static PyObject *
listed_handles(Core *c, PyObject *seq, PyTypeObject *type, int once, Py_ssize_t *bad)
{
    *bad = -1;
    if (!open_core(c))
        return NULL;
    PyObject *items = PySequence_Tuple(seq); /* ours: Python run later cannot change it */
    if (!items)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items), i;
    for (i = 0; i < n; i++) {
        Handle *h = (Handle *)PyTuple_GET_ITEM(items, i);
        if (!PyObject_TypeCheck((PyObject *)h, type) || h->core != c || !usable(h) ||
            (once && h->listed))
            break;
        h->listed = (char)once;
    }
    for (Py_ssize_t j = 0; j < i; j++)
        ((Handle *)PyTuple_GET_ITEM(items, j))->listed = 0;
    if (i < n) {
        *bad = i;
        Py_CLEAR(items);
    }
    return items;
}

/* A batch failed at item `done` (the ones before it are done): say how far it got, as the
 * error's `batch_done`, for Python to word. */
static PyObject *
failed_at(Py_ssize_t done)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *n = PyLong_FromSsize_t(done);
    if (!n || !value || PyObject_SetAttrString(value, "batch_done", n) < 0)
        PyErr_Clear(); /* the error itself still goes up */
    Py_XDECREF(n);
    PyErr_Restore(type, value, tb);
    return NULL;
}

/* The result of a batch refused before it started: the bad index, or the error. */
static PyObject *
refused(Py_ssize_t bad)
{
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(bad);
}

/* end_all(leases, release: bool) -> None | index: release (or abort) every lease, each as
 * lease.release() would (its checks and errors included).  An index: that item is not an
 * open Lease of this table listed once, and nothing changed.  An error from item k leaves
 * items before it handed back and the rest held, and carries batch_done = k. */
static PyObject *
core_end_all(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "end_all(leases, release)");
        return NULL;
    }
    int release = PyObject_IsTrue(args[1]);
    if (release < 0)
        return NULL;
    Py_ssize_t bad;
    PyObject *items = listed_handles(c, args[0], c->lease, 1, &bad);
    if (!items)
        return refused(bad);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *r = lease_end((Handle *)PyTuple_GET_ITEM(items, i), release);
        if (!r) {
            Py_DECREF(items);
            return failed_at(i);
        }
        Py_DECREF(r);
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
}

/* publish_all(write_slots, timeout) -> None | index: publish each, as ws.publish(timeout)
 * would.  An index: that item is not an open WriteSlot of this table listed once with every
 * field written, and nothing changed.  An error from item k: as end_all. */
static PyObject *
core_publish_all(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "publish_all(write_slots, timeout)");
        return NULL;
    }
    Py_ssize_t bad;
    PyObject *items = listed_handles(c, args[0], c->write_slot, 1, &bad);
    if (!items)
        return refused(bad);
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) { /* unwritten fields are bad input: refuse up front */
        Handle *h = (Handle *)PyTuple_GET_ITEM(items, i);
        if ((h->written ? PySet_GET_SIZE(h->written) : 0) != c->nfields) {
            Py_DECREF(items);
            return PyLong_FromSsize_t(i);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = ws_publish((Handle *)PyTuple_GET_ITEM(items, i), args + 1, 1, NULL);
        if (!r) {
            Py_DECREF(items);
            return failed_at(i);
        }
        Py_DECREF(r);
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
}

/* claim_n(table, n, tag) -> [WriteSlot, ...]: up to n FREE slots claimed now, in one call.
 * The tag must already be checked.  If the list cannot be grown, every slot claimed is
 * aborted before the error is raised. */
static PyObject *
core_claim_n(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "claim_n(table, n, tag)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    uint64_t tag;
    if ((n == -1 && PyErr_Occurred()) || !open_core(c) || !tag_arg(args[2], &tag))
        return NULL;
    PyObject *slots = PyList_New(0);
    for (Py_ssize_t k = 0; slots && k < n; k++) {
        PyObject *ws = acquire_one(c, args[0], E_CLAIM, tag, 0);
        if (ws == Py_None) {
            Py_DECREF(ws);
            break;
        }
        if (!ws || PyList_Append(slots, ws) < 0) {
            hand_back_all(ws, slots, E_ABORT);
            Py_XDECREF(ws);
            Py_CLEAR(slots);
        } else {
            Py_DECREF(ws);
        }
    }
    return slots;
}

/* The slots of `items` (handles) as a tuple, for codec_move; NULL: error set. */
static PyObject *
slots_of(PyObject *items)
{
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *slots = PyTuple_New(n);
    for (Py_ssize_t i = 0; slots && i < n; i++)
        PyTuple_SET_ITEM(slots, i, Py_NewRef(((Handle *)PyTuple_GET_ITEM(items, i))->slot));
    return slots;
}

/* codec_move, out of the rows (`out`: gather) or into them (scatter), on the slots of the handles listed in
 * args[0] — each of `type`, of this table, open, and (if `once`) listed once — with args[1]
 * and args[2]; no garbage collection runs from the check that they are open to the end of
 * the copy.  The codec's answer (True, or False having moved nothing), an index (that item
 * refused, nothing done), or NULL; *items: the handles, when the codec was called. */
static PyObject *
codec_on_listed(Core *c, PyObject *const *args, Py_ssize_t nargs, PyTypeObject *type, int once,
                int out, const char *usage, PyObject **items)
{
    *items = NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    Py_ssize_t bad;
    PyObject *seq = PySequence_Tuple(args[0]); /* may run Python: before the checks */
    if (!seq)
        return NULL;
    int gc_was = hold_collection();
    PyObject *listed = listed_handles(c, seq, type, once, &bad), *r = NULL;
    if (listed) {
        PyObject *slots = slots_of(listed);
        if (slots) {
            r = codec_move(c->codec, slots, args[1], args[2], out);
            Py_DECREF(slots);
        }
    }
    collection_back(gc_was);
    Py_DECREF(seq);
    if (!listed)
        return refused(bad);
    *items = listed;
    return r;
}

/* gather(leases, name, out) -> True | False | index: one field of every lease copied into
 * `out` by RowCodec.gather in one loop.  An index: that item is not an open Lease of this
 * table; False: the field or `out` is not the plain case; either way nothing was written. */
static PyObject *
core_gather(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *items;
    PyObject *r = codec_on_listed(c, args, nargs, c->lease, 0, 1,
                                  "gather(leases, name, out)", &items);
    Py_XDECREF(items);
    return r;
}

/* scatter(write_slots, name, values) -> True | False | index: row k of `values` copied into
 * field `name` of write slot k by RowCodec.scatter in one loop, the field then counted as
 * written in each, as write() counts it.  An index: that item is not an open WriteSlot of
 * this table listed once; False: the field or `values` is not the plain case; either way
 * nothing was written. */
static PyObject *
core_scatter(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *items;
    PyObject *r = codec_on_listed(c, args, nargs, c->write_slot, 1, 0,
                                  "scatter(write_slots, name, values)", &items);
    for (Py_ssize_t i = 0; r == Py_True && i < PyTuple_GET_SIZE(items); i++) {
        PyObject *written = lazy_set(&((Handle *)PyTuple_GET_ITEM(items, i))->written);
        if (!written || PySet_Add(written, args[1]) < 0) /* then publish refuses it: unwritten */
            Py_CLEAR(r);
    }
    Py_XDECREF(items);
    return r;
}

/* close(): the table is closing; its handles go stale, and the core lets go of the parts
 * (which hold it: the cycle goes with the table, not with the next collection). */
static PyObject *
core_close(Core *c, PyObject *unused)
{
    c->closed = 1;
    Py_CLEAR(c->parts);
    Py_RETURN_NONE;
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef core_methods[] = {
    FAST("claim", core_claim, "claim(table, tag) -> WriteSlot | None"),
    FAST("acquire", core_acquire, "acquire(table, event, tag) -> WriteSlot | Reservation | None"),
    FAST("open_reserved", core_open_reserved, "open_reserved(table, slot, gen) -> WriteSlot | None"),
    FAST("keep_reserved", core_keep_reserved, "keep_reserved(reservation) -> Lease | None"),
    FAST("take", core_take, "take(table) -> Lease | None"),
    FAST("poll", core_poll, "poll(table, max_n) -> [Lease, ...]"),
    FAST("send", core_send, "send(table, fields, tag) -> True | None"),
    FAST("claim_n", core_claim_n, "claim_n(table, n, tag) -> [WriteSlot, ...]"),
    FAST("end_all", core_end_all, "end_all(leases, release) -> None | index refused"),
    FAST("publish_all", core_publish_all, "publish_all(write_slots, timeout) -> None | index"),
    FAST("gather", core_gather, "gather(leases, name, out) -> True | False | index refused"),
    FAST("scatter", core_scatter, "scatter(write_slots, name, values) -> True | False | index"),
    {"close", (PyCFunction)core_close, METH_NOARGS, "close(): the table closes"},
    {NULL, NULL, 0, NULL},
};

/* parts: the table's TableParts, which every handle of it is given; set once, by the table
 * that made both (handles made before would keep another). */
static PyObject *
core_get_parts(Core *c, void *unused)
{
    return Py_NewRef(c->parts ? c->parts : Py_None);
}

static int
core_set_parts(Core *c, PyObject *parts, void *unused)
{
    if (c->parts || c->closed || !parts || parts == Py_None) {
        PyErr_SetString(PyExc_AttributeError, "a HandleCore's parts are set once, while open");
        return -1;
    }
    c->parts = Py_NewRef(parts);
    return 0;
}

static PyGetSetDef core_getset[] = {
    {"parts", (getter)core_get_parts, (setter)core_set_parts, "the table's TableParts", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef core_members[] = {
    {"closed", T_BOOL, offsetof(Core, closed), READONLY,
     "set by close(), when the table closes: its handles go stale"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.HandleCore",
    .tp_doc = "What one table's handles share: its compiled steps, rows and closed flag.",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
};

#define MEMBER(name, type, field, flags) {name, type, offsetof(Handle, field), flags, NULL}
static PyMemberDef handle_members[] = {
    MEMBER("_parts", T_OBJECT, parts, READONLY),
    /* what a Quarantined made from the handle keeps alive, as the handle did */
    MEMBER("_owner", T_OBJECT, owner, READONLY),
    MEMBER("slot", T_OBJECT, slot, READONLY),
    MEMBER("generation", T_OBJECT, generation, READONLY),
    MEMBER("tag", T_OBJECT, tag, READONLY),
    MEMBER("_open", T_BOOL, open, 0),
    /* tensors handed out beside the row's views, each watched on its own: a Lease's opened
     * ref fields, a WriteSlot's loaned arena tensors */
    MEMBER("_opened", T_OBJECT, opened, 0),
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef handle_getset[] = {
    {"_viewed", (getter)get_viewed, NULL, "names of fields viewed (a new set)", NULL},
    {"_watched", (getter)get_watched, (setter)set_watched,
     "the slot's WatchedTensors the views came from, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef handle_methods[] = {
    {"_note_viewed", (PyCFunction)handle_note_viewed, METH_O,
     "_note_viewed(names): these fields' views were handed out"},
    {"_unview", (PyCFunction)handle_unview, METH_O,
     "_unview(names): nothing of these fields' views is left to check"},
    {"_hand_back", (PyCFunction)handle_hand_back, METH_O,
     "_hand_back(event) -> 0 done | -1 not this handle's slot | -2 ready queue full"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.HandleBase",
    .tp_doc = "A slot owned through one handle: its table's parts, slot, generation, tag, open or not.",
    .tp_basicsize = sizeof(Handle),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)handle_init,
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_clear = (inquiry)handle_clear,
    .tp_free = PyObject_GC_Del,
    .tp_members = handle_members,
    .tp_getset = handle_getset,
    .tp_methods = handle_methods,
};

static PyMethodDef ws_methods[] = {
    {"write", (PyCFunction)(void (*)(void))ws_write, METH_VARARGS | METH_KEYWORDS,
     "write(**fields): copy values into the row (see leases.WriteSlot)"},
    {"alloc", (PyCFunction)(void (*)(void))ws_alloc, METH_FASTCALL | METH_KEYWORDS,
     "alloc(name, shape) -> a tensor of the arena to fill in place (see leases.WriteSlot)"},
    {"publish", (PyCFunction)(void (*)(void))ws_publish, METH_FASTCALL | METH_KEYWORDS,
     "publish(timeout=1.0): seal, queue and make READY"},
    {"abort", (PyCFunction)ws_abort, METH_NOARGS, "abort(): hand the slot back unpublished"},
    {"_keep", (PyCFunction)ws_keep, METH_NOARGS,
     "_keep() -> Lease | None: seal, hold the row oneself, hand ownership to a lease"},
    {"_seal_mine", (PyCFunction)ws_seal_mine, METH_NOARGS,
     "_seal_mine() -> bool: seal the row if the slot is still this write slot's"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ws_members[] = {
    MEMBER("_pins", T_OBJECT, pins, 0),
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef ws_getset[] = {
    {"_written", (getter)get_written, NULL, "names of fields written", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WriteSlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.WriteSlotCore",
    .tp_doc = "The compiled steps of a WriteSlot.",
    .tp_basicsize = sizeof(Handle),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_base = &HandleType,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_clear = (inquiry)handle_clear,
    .tp_methods = ws_methods,
    .tp_members = ws_members,
    .tp_getset = ws_getset,
};

static PyMethodDef lease_methods[] = {
    {"view", (PyCFunction)lease_view, METH_O, "view(name): zero-copy tensor over an inline field"},
    {"views", (PyCFunction)lease_views, METH_O, "views(names): view() of each name (None: None)"},
    {"item", (PyCFunction)lease_item, METH_O, "item(name): a scalar field as a Python number"},
    {"tensor", (PyCFunction)(void (*)(void))lease_tensor, METH_FASTCALL | METH_KEYWORDS,
     "tensor(name): the field as a tensor, inline or ref; zero copy, valid while the lease\n"
     "is held.  A ref is opened once per lease: an arena view, or the CUDA tensor rebuilt\n"
     "on this process's device with the same UUID."},
    {"copy", (PyCFunction)(void (*)(void))lease_copy, METH_FASTCALL | METH_KEYWORDS,
     "copy(name, out=None): an owned copy of the field that outlives the lease, returned;\n"
     "with `out` (a CPU tensor of the field's dtype and shape) the bytes go there"},
    {"release", (PyCFunction)lease_release, METH_NOARGS, "release(): consumed; the slot is FREE"},
    {"abort", (PyCFunction)lease_abort, METH_NOARGS, "abort(): not consumed; the slot is FREE"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef lease_members[] = {
    MEMBER("deliveries", T_OBJECT, deliveries, READONLY),
    {NULL, 0, 0, 0, NULL},
};

/* Leases come from take() and poll() only: one made by hand would own no slot. */
static int
lease_init(Handle *h, PyObject *args, PyObject *kwds)
{
    PyErr_SetString(PyExc_TypeError, "a Lease comes from table.take() or table.poll()");
    return -1;
}

static PyTypeObject LeaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.LeaseCore",
    .tp_doc = "The compiled steps of a Lease.",
    .tp_basicsize = sizeof(Handle),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_base = &HandleType,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_clear = (inquiry)handle_clear,
    .tp_init = (initproc)lease_init,
    .tp_methods = lease_methods,
    .tp_members = lease_members,
};

/* -- module ------------------------------------------------------------------------------------ */

int
leases_add(PyObject *m)
{
    struct { PyObject **at; const char *text; } names[] = {
        {&s_untyped_storage, "untyped_storage"}, {&s_core, "_core"},
        {&s_write_slow, "_write_slow"}, {&s_alloc_slow, "_alloc_slow"},
        {&s_publish_slow, "_publish_slow"},
        {&s_abort_slow, "_abort_slow"}, {&s_view_slow, "_view_slow"}, {&s_item_slow, "_item_slow"},
        {&s_copy_slow, "_copy_slow"}, {&s_tensor_slow, "_tensor_slow"},
        {&s_end, "_end"},
        {&s_release, "release"}, {&s_abort, "abort"}, {&s_timeout, "timeout"},
        {&s_idle, "idle"},
    };
    for (size_t i = 0; i < COUNT(names); i++)
        if (!(*names[i].at = PyUnicode_InternFromString(names[i].text)))
            return -1;
    if (!(default_timeout = PyFloat_FromDouble(1.0)))
        return -1;
    PyTypeObject *types[] = {&WatchedType, &CoreType, &HandleType, &WriteSlotType, &LeaseType};
    for (size_t i = 0; i < COUNT(types); i++)
        if (PyType_Ready(types[i]) < 0)
            return -1;
    const char *exported[] = {"WatchedTensors", "HandleCore", "HandleBase", "WriteSlotCore",
                              "LeaseCore"};
    for (size_t i = 0; i < COUNT(types); i++)
        if (PyModule_AddObjectRef(m, exported[i], (PyObject *)types[i]) < 0)
            return -1;
    return 0;
}
