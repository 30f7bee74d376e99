/* The rules a tensor must pass before its bytes are copied into shared memory, row writes,
 * and row checksums, compiled.
 *
 * rows.py owns the row format and every error message; this file holds the rules (below:
 * every path that copies a tensor into a row or the arena asks them, so they are written
 * once) and makes the common write fast.  `write(slot, fields)` copies a dict of values into
 * a row when every value is the plain case (a tensor the rules call plain, or a Python number
 * for a scalar int or float32 field), checking all of them before the first byte moves.  For
 * anything else (an unknown name, a refused tensor, a ref field, one torch must first
 * copy, a number that does not fit) it writes nothing and returns False, and rows.py takes
 * its checked path, which raises the error or handles the case.
 *
 * The row checksum itself is rowhash.c's.
 */
#include "core.h"
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_FIELDS 64
#define MAX_DIMS 8 /* dimensions of a field that copy() makes its tensor for */
#define BIG_COPY (1 << 20) /* bytes from which a copy lets other threads run (copy_start) */

/* How a field is written from a Python number (`scalar`) and read as one (`item`); the
 * 16-bit floats are read only. */
enum scalar {
    NO_SCALAR = 0, S_INT64, S_INT32, S_UINT8, S_FLOAT32, REF, S_FLOAT16, S_BFLOAT16,
    S_UINT64, S_INT16, S_INT8, S_BOOL
};
/* The kinds a field of shape () is written in from a Python number (write_scalar's cases):
 * the first four; the rest are read only. */
#define WRITTEN_FROM_NUMBERS(kind) ((kind) >= S_INT64 && (kind) <= S_FLOAT32)
/* Each kind by the dtype name rows.py knows it by (exported as SCALARS). */
static const struct {
    const char *dtype;
    int kind;
} scalar_kinds[] = {
    {"int64", S_INT64}, {"int32", S_INT32}, {"uint8", S_UINT8}, {"float32", S_FLOAT32},
    {"ref", REF}, {"float16", S_FLOAT16}, {"bfloat16", S_BFLOAT16}, {"uint64", S_UINT64},
    {"int16", S_INT16}, {"int8", S_INT8}, {"bool", S_BOOL},
};

/* -- the rules ------------------------------------------------------------------------------
 *
 * What a tensor must be before its bytes are copied into shared memory, written once: the
 * compiled write below, rows.py's checked path, the arena copy of a ref field and every
 * copy rows.py makes all ask check() (rows.py only words the refusals).  A tensor passes when
 * it has the field's dtype and shape, lives on the CPU or a CUDA GPU, has strided storage,
 * and that storage holds every element its sizes, strides and storage offset reach (a storage
 * freed or resized down does not: torch itself would read past it).  It is *plain* -- its
 * bytes may be copied as they are -- when it is moreover an exact torch.Tensor on the CPU,
 * contiguous, and not lazily negated.  (A lazily conjugated view exists only for complex
 * dtypes, which no field has: the dtype rule refuses it.)  A tensor whose storage torch will
 * not show (sparse, mkldnn and nested layouts, a __torch_dispatch__ subclass) is refused as
 * having none.  The facts are read from torch's C++ objects (tensors.h): no Python runs, so
 * neither a subclass, a torch-function mode nor a method set on the instance answers for the
 * tensor, and no Python runs between the checks and the copy.  A big copy lets other threads
 * run; copy_start pins the tensor for it, so its bytes stay where the checks found them.
 */

/* Reason codes, exported as REASONS (add_enums).  0: plain.  Positive: acceptable once torch has made a
 * plain copy; the bits say why not plain.  Negative: refused. */
enum {
    T_PLAIN = 0,
    T_STRIDED = 1,
    T_NEGATED = 2, /* lazily negated */
    T_ON_GPU = 4,
    T_SUBCLASS = 8,
    T_LAZY = 16, /* a lazy clone's storage, shared with another tensor until written */
    T_NOT_TENSOR = -1,
    T_DTYPE = -2,
    T_SHAPE = -3,
    T_DEVICE = -4,
    T_NO_STORAGE = -5,
    T_SHORT_STORAGE = -6,
    T_TOO_BIG = -7,
    T_ERROR = -100, /* an exception is set */
};

typedef struct {
    PyObject_HEAD
    PyObject *tensor_type; /* torch.Tensor */
} Rules;

static PyObject *s_itemsize;

/* Do the tensor's `ndim` sizes fit `want` (a tuple of ints, None for a free dimension)?
 * T_PLAIN (setting *numel), T_SHAPE, T_TOO_BIG or T_ERROR. */
static int
shape_fits(int ndim, const int64_t *sizes, PyObject *want, Py_ssize_t *numel)
{
    Py_ssize_t n = PyTuple_GET_SIZE(want), count = 1;
    if (ndim != n)
        return T_SHAPE;
    int too_big = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyTuple_GET_ITEM(want, i);
        if (w != Py_None) {
            Py_ssize_t dim = PyLong_AsSsize_t(w);
            if (dim == -1 && PyErr_Occurred())
                return T_ERROR;
            if (dim != sizes[i])
                return T_SHAPE;
        }
        too_big |= __builtin_mul_overflow(count, sizes[i], &count);
    }
    *numel = count;
    return too_big ? T_TOO_BIG : T_PLAIN;
}

/* The farthest element the strides reach, plus one; PY_SSIZE_T_MAX (which no storage holds)
 * for a negative stride or one that overflows. */
static Py_ssize_t
strided_span(const TensorFacts *f)
{
    Py_ssize_t span = 1, reach;
    for (int i = 0; i < f->ndim; i++)
        if (f->strides[i] < 0 || __builtin_mul_overflow(f->sizes[i] - 1, f->strides[i], &reach) ||
            __builtin_add_overflow(span, reach, &span))
            return PY_SSIZE_T_MAX;
    return span;
}

/* The rules for `v` against a field of `dtype` (torch's ScalarType number; itemsize bytes an
 * element) and `shape`.  For a plain tensor, *src is where its bytes start (NULL when there
 * are none), *nbytes how many. */
static int
check(Rules *r, PyObject *v, int dtype, Py_ssize_t itemsize, PyObject *shape, const void **src,
      Py_ssize_t *nbytes)
{
    PyTypeObject *tensor = (PyTypeObject *)r->tensor_type;
    if (!PyObject_TypeCheck(v, tensor))
        return T_NOT_TENSOR;
    int code = Py_TYPE(v) == tensor ? T_PLAIN : T_SUBCLASS, fit;
    TensorFacts f;
    if (tensor_api->facts(v, &f) < 0)
        return T_ERROR;
    if (f.dtype != dtype)
        return T_DTYPE;
    if (f.ndim < 0) /* facts not read: a __torch_dispatch__ subclass's are torch's to copy */
        return code == T_SUBCLASS ? T_SUBCLASS : T_NO_STORAGE;
    Py_ssize_t numel = 0, span, end;
    if ((fit = shape_fits(f.ndim, f.sizes, shape, &numel)) != T_PLAIN)
        return fit;
    if (__builtin_mul_overflow(numel, itemsize, nbytes))
        return T_TOO_BIG;
    if (f.device == DEVICE_CUDA)
        code |= T_ON_GPU;
    else if (f.device != DEVICE_CPU)
        return T_DEVICE; /* meta has no data; other devices cannot be shared */
    *src = NULL;
    if (numel == 0) /* nothing to read: no storage needed */
        return code;
    if (!f.readable)
        return T_NO_STORAGE;
    if (f.contiguous)
        span = numel;
    else {
        code |= T_STRIDED;
        span = strided_span(&f);
    }
    if (f.storage_offset < 0 || __builtin_add_overflow(f.storage_offset, span, &end) ||
        __builtin_mul_overflow(end, itemsize, &end) || end > f.storage_nbytes)
        return T_SHORT_STORAGE;
    if (f.negated)
        code |= T_NEGATED;
    if (f.lazy) /* its bytes may be read, but a copy into it would land in the other's too */
        code |= T_LAZY;
    if (code == T_PLAIN) {
        if (!f.data) /* the storage holds the elements, so this cannot happen: refuse */
            return T_NO_STORAGE;
        *src = f.data;
    }
    return code;
}

/* The bytes an element of `dtype` takes; -1: error set. */
static Py_ssize_t
itemsize_of(PyObject *dtype)
{
    PyObject *x = PyObject_GetAttr(dtype, s_itemsize);
    if (!x)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(x);
    Py_DECREF(x);
    if (n <= 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "dtype with no itemsize");
    return n <= 0 ? -1 : n;
}

static PyObject *
code_or_error(int code)
{
    return code == T_ERROR ? NULL : PyLong_FromLong(code);
}

/* A field's dtype as check() takes it: its ScalarType number and its itemsize.  0, or -1 with
 * an error set. */
static int
dtype_arg(PyObject *dtype, int *number, Py_ssize_t *itemsize)
{
    return (*number = tensor_api->dtype_of(dtype)) < 0 || (*itemsize = itemsize_of(dtype)) < 0 ? -1
                                                                                            : 0;
}

/* check(value, dtype, shape) -> reason code */
static PyObject *
rules_check(Rules *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (!r->tensor_type) {
        PyErr_SetString(PyExc_ValueError, "Rules not initialized");
        return NULL;
    }
    if (nargs != 3 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "check(value, dtype, shape: tuple)");
        return NULL;
    }
    Py_ssize_t itemsize, nbytes;
    int dtype;
    const void *src;
    if (dtype_arg(args[1], &dtype, &itemsize) < 0)
        return NULL;
    return code_or_error(check(r, args[0], dtype, itemsize, args[2], &src, &nbytes));
}

/* Copies of BIG_COPY bytes or more let other threads run.  One of them may close the table
 * meanwhile: an export of the buffer, held for the copy, makes the mapping refuse to unmap.
 * Another may free the bytes of a tensor the copy reads or fills (resize_ its storage, set_
 * the tensor to another, drop its last reference): each such tensor is pinned for the copy
 * (tensors.h), so resize_ raises and the rest leave the bytes to the pin.  A table object is
 * one thread's (README, Use): a thread of its own, with its own attach, cannot hand these
 * handles back. */
typedef struct {
    Py_buffer keep;
    PyThreadState *saved; /* NULL: a small copy, the GIL kept */
    Py_ssize_t npins;
    void *pins[MAX_FIELDS];
} CopyWindow;

static void
unpin_all(CopyWindow *w)
{
    while (w->npins)
        tensor_api->unpin(w->pins[--w->npins]);
}

/* Before a copy of `total` bytes out of or into `buffer`, from or to the `n` `tensors` (up
 * to MAX_FIELDS; NULL entries are not tensors): 0 (copy_done after it), or -1 with an error
 * set. */
static int
copy_start(PyObject *buffer, Py_ssize_t total, PyObject *const *tensors, Py_ssize_t n,
           CopyWindow *w)
{
    w->saved = NULL;
    w->npins = 0;
    if (total < BIG_COPY)
        return 0;
    for (Py_ssize_t j = 0; j < n; j++)
        if (tensors[j]) {
            void *pin = tensor_api->pin(tensors[j]);
            if (!pin) {
                unpin_all(w);
                return -1;
            }
            w->pins[w->npins++] = pin;
        }
    if (PyObject_GetBuffer(buffer, &w->keep, PyBUF_SIMPLE) < 0) {
        unpin_all(w);
        return -1;
    }
    w->saved = PyEval_SaveThread();
    return 0;
}

static void
copy_done(CopyWindow *w)
{
    if (!w->saved)
        return;
    PyEval_RestoreThread(w->saved);
    PyBuffer_Release(&w->keep);
    unpin_all(w);
}

/* copy_into(buffer, offset, nbytes, value, dtype, shape) -> reason code: copies the value's
 * nbytes bytes to buffer[offset:] if it is plain (0), else writes nothing. */
static PyObject *
rules_copy_into(Rules *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (!r->tensor_type) {
        PyErr_SetString(PyExc_ValueError, "Rules not initialized");
        return NULL;
    }
    if (nargs != 6 || !PyTuple_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_into(buffer, offset, nbytes, value, dtype, shape: tuple)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]), want = PyLong_AsSsize_t(args[2]), nbytes;
    Py_ssize_t itemsize;
    int dtype;
    if (PyErr_Occurred() || dtype_arg(args[4], &dtype, &itemsize) < 0)
        return NULL;
    const void *src;
    int code = check(r, args[3], dtype, itemsize, args[5], &src, &nbytes);
    if (code != T_PLAIN)
        return code_or_error(code);
    if (nbytes != want)
        return PyLong_FromLong(T_SHAPE);
    /* Our own export of the buffer for the whole copy: a mapping cannot be unmapped under
     * it, even while other threads run during a big one. */
    Py_buffer dst;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0)
        return NULL;
    if (offset < 0 || offset > dst.len - nbytes) {
        PyBuffer_Release(&dst);
        PyErr_Format(PyExc_IndexError, "copy of %zd bytes at %zd is outside the buffer", nbytes,
                     offset);
        return NULL;
    }
    CopyWindow w;
    if (copy_start(args[0], nbytes, &args[3], 1, &w) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (nbytes) /* memmove: the source may be a view of the buffer */
        memmove((char *)dst.buf + offset, src, (size_t)nbytes);
    copy_done(&w);
    PyBuffer_Release(&dst);
    return PyLong_FromLong(T_PLAIN);
}

/* Rules(torch.Tensor) */
static int
rules_init(Rules *r, PyObject *args, PyObject *kwds)
{
    PyObject *tensor_type;
    if (r->tensor_type) {
        PyErr_SetString(PyExc_RuntimeError, "Rules already initialized");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!", &PyType_Type, &tensor_type) || bind_tensors() < 0)
        return -1;
    r->tensor_type = Py_NewRef(tensor_type);
    return 0;
}

static void
rules_dealloc(Rules *r)
{
    Py_XDECREF(r->tensor_type);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef rules_methods[] = {
    {"check", (PyCFunction)(void (*)(void))rules_check, METH_FASTCALL,
     "check(value, dtype, shape) -> reason code: 0 plain, > 0 needs a plain copy, < 0 refused"},
    {"copy_into", (PyCFunction)(void (*)(void))rules_copy_into, METH_FASTCALL,
     "copy_into(buffer, offset, nbytes, value, dtype, shape) -> reason code; copies if 0"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RulesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.Rules",
    .tp_doc = "The checks on a tensor before its bytes are copied into shared memory.",
    .tp_basicsize = sizeof(Rules),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)rules_init,
    .tp_dealloc = (destructor)rules_dealloc,
    .tp_methods = rules_methods,
};

/* -- the codec ----------------------------------------------------------------------------- */

/* A field's column: slot i's item is at column + item_len * i (schema.py's addressing
 * rule); the item's first nbytes are the field's. */
typedef struct {
    Py_ssize_t column, item_len, nbytes, itemsize;
    int scalar, item;
    int dtype;        /* torch's ScalarType number */
    PyObject *shape;  /* borrowed from specs, which the codec keeps alive */
    int dtype_index;  /* in schema.DTYPE_CODES, as refs store it */
    int ndim;         /* the shape's, as copied() makes its tensor (up to MAX_DIMS) */
    int64_t dims[MAX_DIMS];
} Spec;

struct RowCodec {
    PyObject_HEAD
    Py_buffer buf;
    int held;
    char *base;
    Py_ssize_t seals, nslots; /* seals: slots x 16 bytes, generation u64 + checksum u32 */
    Py_ssize_t nfields;
    Spec spec[MAX_FIELDS];
    PyObject *specs; /* the tuple the Spec pointers borrow from */
    PyObject *index; /* field name -> index */
    Rules *rules;
};

/* -- construction -------------------------------------------------------------------------- */

static int
rc_init(RowCodec *r, PyObject *args, PyObject *kwds)
{
    PyObject *buffer, *specs, *rules;
    Py_ssize_t seals, nslots;
    if (r->specs) {
        PyErr_SetString(PyExc_RuntimeError, "RowCodec already initialized");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OnnO!O!", &buffer, &seals, &nslots, &PyTuple_Type, &specs,
                          &RulesType, &rules))
        return -1;
    if (!((Rules *)rules)->tensor_type) {
        PyErr_SetString(PyExc_ValueError, "Rules not initialized");
        return -1;
    }
    if (seals < 0 || nslots < 0 || nslots > PY_SSIZE_T_MAX / 16) {
        PyErr_SetString(PyExc_ValueError, "bad row geometry");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(specs);
    if (n > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "too many fields");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &r->buf, PyBUF_WRITABLE) < 0)
        return -1;
    Py_ssize_t len = r->buf.len;
    PyObject *index = PyDict_New();
    if (!index)
        goto fail;
    if (seals > len - 16 * nslots) {
        PyErr_SetString(PyExc_ValueError, "seals do not fit the buffer");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name, *dtype, *at = NULL;
        Spec *s = &r->spec[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(specs, i), "UnnniiOiO!", &name, &s->column,
                              &s->item_len, &s->nbytes, &s->scalar, &s->item, &dtype,
                              &s->dtype_index, &PyTuple_Type, &s->shape) ||
            !(at = PyLong_FromSsize_t(i)) || PyDict_SetItem(index, name, at) < 0) {
            Py_XDECREF(at);
            goto fail;
        }
        Py_DECREF(at);
        if (dtype_arg(dtype, &s->dtype, &s->itemsize) < 0)
            goto fail;
        Py_ssize_t elements = 1;
        s->ndim = (int)Py_MIN(PyTuple_GET_SIZE(s->shape), MAX_DIMS + 1);
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(s->shape); d++) {
            PyObject *size = PyTuple_GET_ITEM(s->shape, d);
            if (s->scalar == REF && size == Py_None) { /* a ref field's free dimension */
                if (d < MAX_DIMS)
                    s->dims[d] = -1;
                continue;
            }
            Py_ssize_t dim = PyLong_AsSsize_t(size);
            if (dim < 0 || (dim && elements > PY_SSIZE_T_MAX / dim)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "bad field shape");
                goto fail;
            }
            if (d < MAX_DIMS)
                s->dims[d] = dim;
            elements *= dim;
        }
        if (s->scalar != REF && (elements > PY_SSIZE_T_MAX / s->itemsize ||
                                    s->nbytes != elements * s->itemsize)) {
            PyErr_SetString(PyExc_ValueError, "a field's bytes are not its dtype times its shape");
            goto fail;
        }
        /* sizes are checked by division and subtraction, so nothing overflows */
        if (s->column < 0 || s->nbytes < 0 || s->item_len < s->nbytes ||
            (nslots && s->item_len > (len - s->column) / nslots) || s->column > len) {
            PyErr_SetString(PyExc_ValueError, "a field's column does not fit the buffer");
            goto fail;
        }
    }
    r->seals = seals;
    r->nslots = nslots;
    r->base = r->buf.buf;
    r->nfields = n;
    r->specs = Py_NewRef(specs);
    r->index = index;
    r->rules = (Rules *)Py_NewRef(rules);
    r->held = 1;
    return 0;
fail:
    Py_XDECREF(index);
    PyBuffer_Release(&r->buf);
    return -1;
}

static inline char *item_at(RowCodec *r, const Spec *s, Py_ssize_t slot)
{
    return r->base + s->column + slot * s->item_len;
}

/* Whether the codec is held and `slot` one of its rows; error set if not. */
static int
slot_in_range(RowCodec *r, Py_ssize_t slot)
{
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "RowCodec released");
        return 0;
    }
    if (slot < 0 || slot >= r->nslots) {
        PyErr_SetString(PyExc_IndexError, "slot out of range");
        return 0;
    }
    return 1;
}

/* The slot named by args[0], after checking the argument count; -1: error set. */
static Py_ssize_t
slot_arg(RowCodec *r, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return -1;
    return slot_in_range(r, slot) ? slot : -1;
}

/* The checksum of one slot's row: its fields' items, chained in field order. */
static uint32_t
row_checksum(RowCodec *r, Py_ssize_t slot)
{
    uint64_t h = row_hash_seed();
    for (Py_ssize_t i = 0; i < r->nfields; i++)
        h = row_hash_span(item_at(r, &r->spec[i], slot), r->spec[i].nbytes, h, -1);
    return row_hash_fold(h);
}

/* -- write --------------------------------------------------------------------------------- */

typedef struct {
    char *dst;
    Py_ssize_t nbytes;
    const void *src;
    union { int64_t i64; int32_t i32; uint8_t u8; float f32; } value;
} Copy;

/* Is `v` a plain number for scalar field `s`? 1 yes (fills c->value), 0 no, -1 error. */
static int
plain_number(Spec *s, PyObject *v, Copy *c)
{
    if (s->scalar == S_FLOAT32) {
        double d;
        if (PyFloat_CheckExact(v))
            d = PyFloat_AS_DOUBLE(v);
        else if (PyLong_CheckExact(v)) {
            d = PyLong_AsDouble(v);
            if (d == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
        } else
            return 0;
        if (isfinite(d) && fabs(d) > FLT_MAX)
            return 0; /* struct.pack would refuse it: let Python say so */
        c->value.f32 = (float)d;
        c->src = &c->value;
        return 1;
    }
    if (!PyLong_CheckExact(v))
        return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow)
        return 0;
    switch (s->scalar) {
    case S_INT64: c->value.i64 = (int64_t)x; break;
    case S_INT32:
        if (x < INT32_MIN || x > INT32_MAX)
            return 0;
        c->value.i32 = (int32_t)x;
        break;
    case S_UINT8:
        if (x < 0 || x > 255)
            return 0;
        c->value.u8 = (uint8_t)x;
        break;
    default: return 0;
    }
    c->src = &c->value;
    return 1;
}

int
codec_write_picked(RowCodec *r, PyObject *fields, SlotPick pick, void *ctx, Py_ssize_t *slot)
{
    *slot = -1;
    int by_position = PyTuple_CheckExact(fields); /* every field's value, in schema order */
    Py_ssize_t n = by_position ? PyTuple_GET_SIZE(fields) : PyDict_GET_SIZE(fields);
    if (n > MAX_FIELDS || (by_position && n != r->nfields))
        return 0;
    /* Strong references first, so nothing the checks run can free a value under us. */
    PyObject *held[MAX_FIELDS];
    Spec *spec[MAX_FIELDS];
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    int result = 0;
    for (; by_position && k < n; k++) {
        spec[k] = &r->spec[k];
        held[k] = Py_NewRef(PyTuple_GET_ITEM(fields, k));
    }
    while (!by_position && k < n && PyDict_Next(fields, &pos, &key, &value)) {
        PyObject *i = PyUnicode_CheckExact(key) ? PyDict_GetItemWithError(r->index, key) : NULL;
        if (!i) {
            result = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        spec[k] = &r->spec[PyLong_AsSsize_t(i)];
        held[k++] = Py_NewRef(value);
    }
    Copy copies[MAX_FIELDS];
    PyObject *tensors[MAX_FIELDS]; /* the values copied as bytes (NULL: a number) */
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        Spec *s = spec[j];
        Copy *c = &copies[j];
        c->nbytes = s->nbytes;
        total += s->nbytes;
        PyObject *v = held[j];
        int ok;
        tensors[j] = NULL;
        if (s->scalar == REF)
            ok = 0;
        else if (Py_TYPE(v) == (PyTypeObject *)r->rules->tensor_type) {
            Py_ssize_t nbytes; /* the shape fixes it to c->nbytes */
            int code = check(r->rules, v, s->dtype, s->itemsize, s->shape, &c->src, &nbytes);
            ok = code == T_PLAIN ? 1 : code == T_ERROR ? -1 : 0;
            tensors[j] = v;
        } else if (s->scalar != NO_SCALAR)
            ok = plain_number(s, v, c);
        else
            ok = 0; /* a subclass: Python's path has torch make a plain copy */
        if (ok != 1) {
            result = ok < 0 ? -1 : 0;
            goto done;
        }
    }
    if (!r->held) { /* a value's conversion may have run Python, which may have closed it */
        PyErr_SetString(PyExc_ValueError, "RowCodec released");
        result = -1;
        goto done;
    }
    int got = pick(ctx, slot); /* every value passed: only now is a slot asked for */
    if (got != 1) {
        *slot = -1;
        result = got < 0 ? -1 : 0;
        goto done;
    }
    if (!slot_in_range(r, *slot)) {
        result = -1;
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++)
        copies[j].dst = item_at(r, spec[j], *slot);
    CopyWindow w;
    if (copy_start(r->buf.obj, total, tensors, k, &w) < 0) {
        result = -1;
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) /* memmove: a source may be a view of a row */
        if (copies[j].nbytes)
            memmove(copies[j].dst, copies[j].src, (size_t)copies[j].nbytes);
    copy_done(&w);
    result = 1;
done:
    for (Py_ssize_t j = 0; j < k; j++)
        Py_DECREF(held[j]);
    return result;
}

/* codec_write's pick: the slot it was given. */
static int
given_slot(void *ctx, Py_ssize_t *slot)
{
    *slot = *(const Py_ssize_t *)ctx;
    return 1;
}

int
codec_write(RowCodec *r, Py_ssize_t slot, PyObject *fields)
{
    Py_ssize_t written_to;
    return slot_in_range(r, slot) ? codec_write_picked(r, fields, given_slot, &slot, &written_to)
                                  : -1;
}

static PyObject *
rc_write(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot = slot_arg(r, args, nargs, 2, "write(slot, fields: dict)");
    if (slot < 0)
        return NULL;
    if (!PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "write(slot, fields: dict)");
        return NULL;
    }
    int written = codec_write(r, slot, args[1]);
    return written < 0 ? NULL : PyBool_FromLong(written);
}

/* -- scalar read ---------------------------------------------------------------------------- */

/* read(slot, name) -> int | float for a field of one number (shape (), (1,), ...), None for
 * any other field or name (leases.py says why not). */
PyObject *
codec_read(RowCodec *r, Py_ssize_t slot, PyObject *name)
{
    if (!slot_in_range(r, slot))
        return NULL;
    PyObject *i = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(r->index, name) : NULL;
    if (!i) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Spec *s = &r->spec[PyLong_AsSsize_t(i)];
    const char *at = item_at(r, s, slot);
    switch (s->item) {
    case S_INT64: { int64_t v; memcpy(&v, at, 8); return PyLong_FromLongLong(v); }
    case S_INT32: { int32_t v; memcpy(&v, at, 4); return PyLong_FromLong(v); }
    case S_UINT8: return PyLong_FromLong(*(const uint8_t *)at);
    case S_UINT64: { uint64_t v; memcpy(&v, at, 8); return PyLong_FromUnsignedLongLong(v); }
    case S_INT16: { int16_t v; memcpy(&v, at, 2); return PyLong_FromLong(v); }
    case S_INT8: return PyLong_FromLong(*(const int8_t *)at);
    case S_BOOL: return PyBool_FromLong(*(const uint8_t *)at != 0);
    case S_FLOAT32: { float v; memcpy(&v, at, 4); return PyFloat_FromDouble(v); }
    case S_FLOAT16: {
        double v = PyFloat_Unpack2(at, 1);
        return v == -1.0 && PyErr_Occurred() ? NULL : PyFloat_FromDouble(v);
    }
    case S_BFLOAT16: { /* the high half of a float32 */
        uint16_t half;
        memcpy(&half, at, 2);
        uint32_t bits = (uint32_t)half << 16;
        float v;
        memcpy(&v, &bits, 4);
        return PyFloat_FromDouble(v);
    }
    default: Py_RETURN_NONE;
    }
}

static PyObject *
rc_read(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot = slot_arg(r, args, nargs, 2, "read(slot, name)");
    return slot < 0 ? NULL : codec_read(r, slot, args[1]);
}

/* -- gather and scatter ------------------------------------------------------------------- */

/* Is `t` a plain tensor for `n` rows of field `s` — shape (n, *shape), or the field's own
 * shape if not `batched` — by the rules every copy into or out of a row follows (exact
 * torch.Tensor, the field's dtype, CPU, contiguous, not negated, a storage that holds every
 * byte)?  1 yes (sets *data to its bytes), 0 no, -1 error. */
static int
plain_rows(RowCodec *r, Spec *s, PyObject *t, Py_ssize_t n, int batched, char **data)
{
    PyObject *shape = s->shape;
    if (batched) {
        PyObject *first = PyLong_FromSsize_t(n), *head = first ? PyTuple_Pack(1, first) : NULL;
        Py_XDECREF(first);
        shape = head ? PySequence_Concat(head, s->shape) : NULL;
        Py_XDECREF(head);
        if (!shape)
            return -1;
    }
    const void *at = NULL;
    Py_ssize_t nbytes = 0;
    int code = check(r->rules, t, s->dtype, s->itemsize, shape, &at, &nbytes);
    if (batched)
        Py_DECREF(shape);
    if (code == T_ERROR)
        return -1;
    *data = (char *)at;
    return code == T_PLAIN;
}

/* The spec of field `name` if it may be copied in or out here: 1 (*spec set), 0 (no such
 * field, or a ref field: the caller's own path copies), -1 (error set). */
static int
plain_field(RowCodec *r, PyObject *name, Spec **spec)
{
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "RowCodec released");
        return -1;
    }
    PyObject *i = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(r->index, name) : NULL;
    if (!i)
        return PyErr_Occurred() ? -1 : 0;
    Spec *s = &r->spec[PyLong_AsSsize_t(i)];
    *spec = s;
    return s->scalar != REF;
}

/* Copy field `s` of each of the n slots (a tuple if `batched`, else one int) between its
 * item and row k of `flat` (contiguous, n x nbytes; the bytes of `tensor`, or of no tensor
 * when NULL): out of the rows if `out`, else into them.  Every slot is checked before the first copy; -1 (error set) if one is out of
 * range or the codec was released (the checks before may have run Python, which may have
 * closed the table), and nothing was copied. */
static int
move_items(RowCodec *r, Spec *s, PyObject *slots, Py_ssize_t n, int batched, char *flat,
           PyObject *tensor, int out)
{
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "RowCodec released");
        return -1;
    }
    Py_ssize_t local[64], *at = n <= 64 ? local : PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    if (!at) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t slot = PyLong_AsSsize_t(batched ? PyTuple_GET_ITEM(slots, k) : slots);
        if ((slot == -1 && PyErr_Occurred()) || slot < 0 || slot >= r->nslots) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "slot out of range");
            if (at != local)
                PyMem_Free(at);
            return -1;
        }
        at[k] = s->column + slot * s->item_len;
    }
    char *base = r->base;
    size_t nbytes = (size_t)s->nbytes, total = (size_t)n * nbytes;
    if (!total) { /* nothing to move (and `flat` may be NULL) */
        if (at != local)
            PyMem_Free(at);
        return 0;
    }
    /* `flat` may be a view of the rows themselves.  memmove covers one row over its own
     * item; a batch spanning other slots' items would see rows already moved (row k+1 read
     * after item k was written over it), so such a batch goes through a copy of its own. */
    char *stage = NULL;
    uintptr_t lo = (uintptr_t)flat, map = (uintptr_t)base;
    if (lo < map + (uintptr_t)r->buf.len && map < lo + total && !(stage = PyMem_Malloc(total))) {
        if (at != local)
            PyMem_Free(at);
        PyErr_NoMemory();
        return -1;
    }
    char *rows = stage ? stage : flat;
    CopyWindow w;
    if (copy_start(r->buf.obj, (Py_ssize_t)total, &tensor, 1, &w) < 0) {
        PyMem_Free(stage);
        if (at != local)
            PyMem_Free(at);
        return -1;
    }
    if (stage && !out)
        memcpy(stage, flat, total);
    for (Py_ssize_t k = 0; k < n; k++) {
        char *row = rows + (size_t)k * nbytes, *item = base + at[k];
        if (out)
            memmove(row, item, nbytes);
        else
            memmove(item, row, nbytes);
    }
    if (stage && out)
        memmove(flat, stage, total);
    copy_done(&w);
    PyMem_Free(stage);
    if (at != local)
        PyMem_Free(at);
    return 0;
}

/* A scatter's values as a list (or tuple) of n Python numbers for a scalar field, each the
 * plain case write() takes (plain_number, the one rule for numbers): 1 with *packed the
 * field's n items (PyMem_Free it), 0 not that case (nothing made), -1 error. */
static int
plain_numbers(Spec *s, PyObject *values, Py_ssize_t n, char **packed)
{
    if (!WRITTEN_FROM_NUMBERS(s->scalar) ||
        !(PyList_CheckExact(values) || PyTuple_CheckExact(values)) ||
        PySequence_Fast_GET_SIZE(values) != n)
        return 0;
    char *items = PyMem_Malloc(n ? (size_t)(n * s->nbytes) : 1);
    if (!items) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **numbers = PySequence_Fast_ITEMS(values); /* exact ints and floats: no Python */
    for (Py_ssize_t k = 0; k < n; k++) {
        Copy c;
        int ok = plain_number(s, numbers[k], &c);
        if (ok != 1) {
            PyMem_Free(items);
            return ok;
        }
        memcpy(items + k * s->nbytes, c.src, (size_t)s->nbytes);
    }
    *packed = items;
    return 1;
}

/* One field of the given slots moved between the rows and one plain tensor `t` (n, *shape)
 * (or the field's shape, for one slot given as an int): out of the rows (gather) or into
 * them (scatter, which also takes a list of numbers, plain_numbers).  True having moved every
 * row; False having moved nothing (no such field, a ref field, or `t` not plain: the
 * caller's path). */
PyObject *
codec_move(RowCodec *r, PyObject *slots, PyObject *name, PyObject *flat_tensor, int out)
{
    int batched = PyTuple_Check(slots);
    Py_ssize_t n = batched ? PyTuple_GET_SIZE(slots) : 1;
    Spec *s;
    int ok = plain_field(r, name, &s);
    char *flat = NULL, *packed = NULL;
    if (ok == 1) {
        int numbers = !out && batched ? plain_numbers(s, flat_tensor, n, &packed) : 0;
        if (numbers)
            ok = numbers, flat = packed;
        else /* a subclass is not plain: the caller's path has torch copy it first */
            ok = Py_TYPE(flat_tensor) != (PyTypeObject *)r->rules->tensor_type
                     ? 0
                     : plain_rows(r, s, flat_tensor, n, batched, &flat);
    }
    if (ok != 1)
        return ok < 0 ? NULL : Py_NewRef(Py_False);
    ok = move_items(r, s, slots, n, batched, flat, packed ? NULL : flat_tensor, out);
    PyMem_Free(packed);
    return ok < 0 ? NULL : Py_NewRef(Py_True);
}

/* gather(slots, name, out) and scatter(slots, name, values): codec_move. */
static PyObject *
move_call(RowCodec *r, PyObject *const *args, Py_ssize_t nargs, int out, const char *usage)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    return codec_move(r, args[0], args[1], args[2], out);
}

static PyObject *
rc_gather(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    return move_call(r, args, nargs, 1, "gather(slots, name, out)");
}

static PyObject *
rc_scatter(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    return move_call(r, args, nargs, 0, "scatter(slots, name, values)");
}

PyObject *
codec_copy(RowCodec *r, Py_ssize_t slot, PyObject *name)
{
    Spec *s;
    int ok = plain_field(r, name, &s);
    if (ok != 1 || s->ndim > MAX_DIMS)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *out = tensor_api->empty(s->dtype, s->ndim, s->dims);
    TensorFacts f;
    if (!out || tensor_api->facts(out, &f) < 0 || !slot_in_range(r, slot)) {
        Py_XDECREF(out);
        return NULL;
    }
    CopyWindow w; /* the slot was checked after the allocation, which may have run Python */
    if (copy_start(r->buf.obj, s->nbytes, NULL, 0, &w) < 0) /* `out` is ours alone */
        Py_CLEAR(out);
    else {
        memcpy(f.data, item_at(r, s, slot), (size_t)s->nbytes);
        copy_done(&w);
    }
    return out;
}

/* A mask of fields is good for codec_zero: a bit for each field at most, nothing beyond. */
int
codec_mask_fits(RowCodec *r, uint64_t mask)
{
    return r->nfields >= 64 || !(mask >> r->nfields);
}

int
codec_zero(RowCodec *r, Py_ssize_t slot, uint64_t mask)
{
    if (!slot_in_range(r, slot))
        return -1;
    for (Py_ssize_t i = 0; mask; i++, mask >>= 1)
        if (mask & 1)
            memset(item_at(r, &r->spec[i], slot), 0, (size_t)r->spec[i].item_len);
    return 0;
}

/* -- checksum and seal ---------------------------------------------------------------------- */

static PyObject *
rc_checksum(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot = slot_arg(r, args, nargs, 1, "checksum(slot)");
    if (slot < 0)
        return NULL;
    return PyLong_FromUnsignedLong(row_checksum(r, slot));
}

/* The seal: generation (u64), checksum (u32), as layout.py's SEAL_* offsets place them. */
int
codec_seal(RowCodec *r, Py_ssize_t slot, uint64_t generation)
{
    if (!slot_in_range(r, slot))
        return -1;
    uint32_t sum = row_checksum(r, slot);
    char *seal = r->base + r->seals + 16 * slot;
    memcpy(seal, &generation, 8);
    memcpy(seal + 8, &sum, 4);
    return 0;
}

static PyObject *
rc_seal(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot = slot_arg(r, args, nargs, 2, "seal(slot, generation)");
    if (slot < 0)
        return NULL;
    unsigned long long generation = PyLong_AsUnsignedLongLong(args[1]);
    if (generation == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return codec_seal(r, slot, generation) < 0 ? NULL : Py_NewRef(Py_None);
}

/* row_hash(items) -> the checksum of a row whose fields' items are `items`, in field order:
 * what a row sealed from those bytes carries (the CLI and remote writers compute it so). */
static PyObject *
items_hash(PyObject *arg, int by)
{
    PyObject *items = PySequence_Fast(arg, "row_hash takes a sequence of buffers");
    if (!items)
        return NULL;
    uint64_t h = row_hash_seed();
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, i), &view, PyBUF_SIMPLE) < 0) {
            Py_DECREF(items);
            return NULL;
        }
        h = row_hash_span(view.buf, view.len, h, by);
        PyBuffer_Release(&view);
    }
    Py_DECREF(items);
    return PyLong_FromUnsignedLong(row_hash_fold(h));
}

static PyObject *rc_hash(PyObject *module, PyObject *arg) { return items_hash(arg, -1); }

/* row_hash by each way this CPU has (rowhash.c), slowest first: the tests hold them equal. */
static PyObject *
rc_hash_ways(PyObject *module, PyObject *arg)
{
    PyObject *sums = PyTuple_New(row_hash_ways());
    for (Py_ssize_t by = 0; sums && by < PyTuple_GET_SIZE(sums); by++) {
        PyObject *sum = items_hash(arg, (int)by);
        if (!sum)
            Py_CLEAR(sums);
        else
            PyTuple_SET_ITEM(sums, by, sum);
    }
    return sums;
}

static PyObject *
rc_release(RowCodec *r, PyObject *unused)
{
    if (r->held) {
        PyBuffer_Release(&r->buf);
        r->held = 0;
    }
    Py_RETURN_NONE;
}

static void
rc_dealloc(RowCodec *r)
{
    if (r->held)
        PyBuffer_Release(&r->buf);
    Py_XDECREF(r->specs);
    Py_XDECREF(r->index);
    Py_XDECREF(r->rules);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* -- tensors over a mapping ------------------------------------------------------------------ */

/* What a mapped tensor holds: an export of the buffer, so the mapping cannot be unmapped
 * while the tensor lives (mmap.close refuses with exports; Segment.close waits). */
static void
release_export(void *ctx)
{
    if (!Py_IsInitialized()) /* a tensor outliving the interpreter: the mapping goes with it */
        return;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyBuffer_Release((Py_buffer *)ctx);
    PyMem_Free(ctx);
    PyGILState_Release(gil);
}

/* A contiguous CPU tensor of `nbytes` at `offset` of `buffer`, holding an export of it for
 * as long as it lives; IndexError if they are not all inside it. */
static PyObject *
tensor_over(PyObject *buffer, Py_ssize_t offset, Py_ssize_t nbytes, int dtype, int ndim,
            const int64_t *sizes)
{
    Py_buffer *view = PyMem_Malloc(sizeof *view);
    if (!view)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(buffer, view, PyBUF_SIMPLE) < 0) {
        PyMem_Free(view);
        return NULL;
    }
    if (offset < 0 || nbytes < 0 || offset > view->len - nbytes) {
        PyErr_Format(PyExc_IndexError, "%zd bytes at %zd are outside the buffer", nbytes, offset);
        PyBuffer_Release(view);
        PyMem_Free(view);
        return NULL;
    }
    return tensor_api->over((char *)view->buf + offset, dtype, ndim, sizes, release_export, view);
}

/* mapped(buffer, offset, dtype, shape) -> a contiguous CPU tensor over buffer[offset:], with
 * a storage of its own and no base (_core.pyi says why). */
static PyObject *
rc_mapped(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[3]) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "mapped(buffer, offset, dtype, shape: tuple)");
        return NULL;
    }
    if (bind_tensors() < 0)
        return NULL;
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]), itemsize, nbytes = 1;
    int dtype, ndim = (int)PyTuple_GET_SIZE(args[3]);
    int64_t sizes[MAX_DIMS];
    if ((offset == -1 && PyErr_Occurred()) || dtype_arg(args[2], &dtype, &itemsize) < 0)
        return NULL;
    for (int d = 0; d < ndim; d++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[3], d));
        if (size == -1 && PyErr_Occurred())
            return NULL;
        if (size < 0 || __builtin_mul_overflow(nbytes, size, &nbytes))
            return PyErr_Format(PyExc_ValueError, "bad shape %R", args[3]);
        sizes[d] = size;
    }
    if (__builtin_mul_overflow(nbytes, itemsize, &nbytes))
        return PyErr_Format(PyExc_ValueError, "bad shape %R", args[3]);
    return tensor_over(args[0], offset, nbytes, dtype, ndim, sizes);
}

PyObject *
codec_open_ref(RowCodec *r, Py_ssize_t slot, PyObject *name, const RefPlace *place)
{
    if (!slot_in_range(r, slot))
        return NULL;
    PyObject *i = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(r->index, name) : NULL;
    if (!i)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Spec *s = &r->spec[PyLong_AsSsize_t(i)];
    if (s->scalar != REF)
        return Py_NewRef(Py_None);
    uint64_t offset, nbytes;
    int ndim;
    int64_t sizes[REF_MAX_DIMS];
    /* a rank past MAX_DIMS matches no ref (REF_MAX_DIMS at most) */
    RefShape shape = {s->ndim <= MAX_DIMS ? s->ndim : -1, s->dims};
    int code = ref_open_arena(item_at(r, s, slot), s->nbytes, place, s->dtype_index, s->itemsize,
                              &shape, &offset, &nbytes, &ndim, sizes);
    if (code != REF_OK)
        return PyLong_FromLong(code);
    /* inside the place, which lies inside the buffer: tensor_over checks that too */
    return tensor_over(r->buf.obj, (Py_ssize_t)Py_MIN(offset, (uint64_t)PY_SSIZE_T_MAX),
                       (Py_ssize_t)Py_MIN(nbytes, (uint64_t)PY_SSIZE_T_MAX), s->dtype, ndim,
                       sizes);
}

int
codec_loan(RowCodec *r, Py_ssize_t slot, uint64_t generation, PyObject *name, PyObject *shape,
           PyObject *arena, const RefPlace *place, PyObject **tensor, Py_ssize_t *offset,
           uint64_t *nbytes)
{
    if (!r->held || slot < 0 || slot >= r->nslots)
        return 0; /* the slow path words it */
    PyObject *i = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(r->index, name) : NULL;
    if (!i)
        return PyErr_Occurred() ? -1 : 0;
    Spec *s = &r->spec[PyLong_AsSsize_t(i)];
    if (s->scalar != REF || s->ndim > REF_MAX_DIMS || !PyTuple_CheckExact(shape) ||
        PyTuple_GET_SIZE(shape) != s->ndim || place->table_len > 255 ||
        ref_arena_len(s->ndim, place->table_len) > s->nbytes)
        return 0;
    int64_t sizes[REF_MAX_DIMS];
    uint64_t nonzero = 1, count; /* as ref_open_arena counts: every size, an empty one too */
    int empty = 0;
    for (int d = 0; d < s->ndim; d++) {
        PyObject *o = PyTuple_GET_ITEM(shape, d);
        int overflow = 0;
        long long size = PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;
        if (size < 0 || overflow || (s->dims[d] >= 0 && size != s->dims[d]))
            return 0; /* the slow path words it */
        if (!size)
            empty = 1;
        else if (__builtin_mul_overflow(nonzero, (uint64_t)size, &nonzero) || nonzero > INT64_MAX)
            return 0;
        sizes[d] = size;
    }
    if (__builtin_mul_overflow(empty ? 0 : nonzero, (uint64_t)s->itemsize, &count))
        return 0;
    int lent = arena_lend(arena, count, slot, generation, offset);
    if (lent <= 0)
        return lent;
    ref_put_arena(item_at(r, s, slot), s->dtype_index, (uint64_t)*offset, count, s->ndim, sizes,
                  place->table, place->table_len);
    PyObject *t = codec_open_ref(r, slot, name, place); /* the block, as a reader will see it */
    if (t && !PyLong_Check(t)) {
        *tensor = t;
        *nbytes = count;
        return 1;
    }
    if (t) { /* the ref just written refused: a place that is not the arena's */
        PyErr_Format(PyExc_SystemError, "a loan's own ref is refused (code %R)", t);
        Py_DECREF(t);
    }
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    arena_give_back(arena, *offset, slot, generation); /* ours, lent just now: it is found */
    PyErr_Restore(type, value, trace);
    return -1;
}

/* open_ref(slot, name, lo, hi, table) -> codec_open_ref's answer */
static PyObject *
rc_open_ref(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot = slot_arg(r, args, nargs, 5, "open_ref(slot, name, lo, hi, table)");
    if (slot < 0)
        return NULL;
    RefPlace place;
    if (!PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "open_ref: table must be a str");
        return NULL;
    }
    if ((place.lo = PyLong_AsUnsignedLongLong(args[2])) == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if ((place.hi = PyLong_AsUnsignedLongLong(args[3])) == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (!(place.table = PyUnicode_AsUTF8AndSize(args[4], &place.table_len)))
        return NULL;
    return codec_open_ref(r, slot, args[1], &place);
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef rc_methods[] = {
    FAST("write", rc_write, "write(slot, fields) -> True, or False having written nothing"),
    FAST("gather", rc_gather, "gather(slots, name, out) -> True, or False having written nothing"),
    FAST("scatter", rc_scatter, "scatter(slots, name, values) -> True, or False, nothing written"),
    FAST("open_ref", rc_open_ref,
         "open_ref(slot, name, lo, hi, table) -> a tensor over the arena, None, or a refusal"),
    FAST("read", rc_read, "read(slot, name) -> the scalar field as a number, or None"),
    FAST("checksum", rc_checksum, "checksum(slot) -> the row's 32-bit checksum"),
    FAST("seal", rc_seal, "seal(slot, generation): write the row's seal"),
    {"release", (PyCFunction)rc_release, METH_NOARGS, "release the buffer export"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject RowCodecType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.RowCodec",
    .tp_doc = "Plain-case row writes and row checksums over the columns of one buffer.",
    .tp_basicsize = sizeof(RowCodec),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)rc_init,
    .tp_dealloc = (destructor)rc_dealloc,
    .tp_methods = rc_methods,
};

static PyMethodDef module_methods[] = {
    {"row_hash", rc_hash, METH_O, "row_hash(items) -> the 32-bit checksum of a row of these items"},
    {"_row_hash_ways", rc_hash_ways, METH_O, "_row_hash_ways(items) -> row_hash by each way this CPU has"},
    {"mapped", (PyCFunction)(void (*)(void))rc_mapped, METH_FASTCALL,
     "mapped(buffer, offset, dtype, shape) -> a tensor over buffer[offset:], holding an export"},
    {NULL, NULL, 0, NULL},
};

/* The enums, exported so that rows.py names them from here instead of copying them:
 * REASONS (reason codes of Rules.check), SCALARS (how a field of one element is written or
 * read, by dtype name; "ref" for a ref field) and NUMBER_WRITES (the dtypes whose
 * kind is WRITTEN_FROM_NUMBERS). */
static int
add_enums(PyObject *m)
{
    PyObject *reasons = Py_BuildValue(
        "{si,si,si,si,si,si,si,si,si,si,si,si,si,si}", "PLAIN", T_PLAIN, "STRIDED", T_STRIDED,
        "NEGATED", T_NEGATED, "ON_GPU", T_ON_GPU, "SUBCLASS", T_SUBCLASS, "LAZY", T_LAZY,
        "NOT_TENSOR",
        T_NOT_TENSOR, "DTYPE", T_DTYPE, "SHAPE", T_SHAPE, "DEVICE", T_DEVICE, "NO_STORAGE",
        T_NO_STORAGE, "SHORT_STORAGE", T_SHORT_STORAGE, "TOO_BIG", T_TOO_BIG, "ERROR", T_ERROR);
    PyObject *scalars = PyDict_New();
    PyObject *writes = PyList_New(0);
    int rc = reasons && scalars && writes ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < sizeof scalar_kinds / sizeof scalar_kinds[0]; i++) {
        PyObject *kind = PyLong_FromLong(scalar_kinds[i].kind);
        PyObject *dtype = PyUnicode_FromString(scalar_kinds[i].dtype);
        if (!kind || !dtype || PyDict_SetItem(scalars, dtype, kind) < 0 ||
            (WRITTEN_FROM_NUMBERS(scalar_kinds[i].kind) && PyList_Append(writes, dtype) < 0))
            rc = -1;
        Py_XDECREF(kind);
        Py_XDECREF(dtype);
    }
    PyObject *written = rc == 0 ? PyList_AsTuple(writes) : NULL;
    if (!written || PyModule_AddObjectRef(m, "REASONS", reasons) < 0 ||
        PyModule_AddObjectRef(m, "SCALARS", scalars) < 0 ||
        PyModule_AddObjectRef(m, "NUMBER_WRITES", written) < 0)
        rc = -1;
    Py_XDECREF(reasons);
    Py_XDECREF(scalars);
    Py_XDECREF(writes);
    Py_XDECREF(written);
    return rc;
}

int
rowcodec_add(PyObject *m)
{
    if (!(s_itemsize = PyUnicode_InternFromString("itemsize")))
        return -1;
    if (PyType_Ready(&RulesType) < 0 || PyType_Ready(&RowCodecType) < 0 ||
        PyModule_AddObjectRef(m, "RowCodec", (PyObject *)&RowCodecType) < 0 ||
        PyModule_AddObjectRef(m, "Rules", (PyObject *)&RulesType) < 0 || add_enums(m) < 0 ||
        PyModule_AddFunctions(m, module_methods) < 0)
        return -1;
    return 0;
}
