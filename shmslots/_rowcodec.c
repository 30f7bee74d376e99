/* Row writes and row checksums, compiled.
 *
 * rows.py owns the row format and every error message; this file only makes
 * its common case fast.  `write(slot, fields)` copies a dict of values into a
 * row when every value is the plain case (a contiguous CPU torch.Tensor of the
 * field's exact dtype and shape, or a Python number for a scalar int or
 * float32 field), checking all of them before the first byte moves.  For
 * anything else (an unknown name, a wrong dtype or shape, a handle field, a
 * strided tensor, a number that does not fit) it writes nothing and returns
 * False, and rows.py takes its checked Python path, which raises the error
 * or handles the case.
 *
 * The row checksum is the wyhash construction (below), folded to 32 bits: a
 * row that is not byte for byte the one sealed fails with probability about
 * 1 - 2^-32, the purpose zlib.crc32 served at a tenth of the speed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_FIELDS 64

/* How a field is written from a Python number (`scalar`) and read as one (`item`); the
 * 16-bit floats are read only. */
enum scalar { NO_SCALAR = 0, S_INT64, S_INT32, S_UINT8, S_FLOAT32, HANDLE, S_FLOAT16, S_BFLOAT16 };

typedef struct {
    Py_ssize_t offset, nbytes;
    int scalar, item;
    PyObject *dtype; /* borrowed from specs, which the codec keeps alive */
    PyObject *shape;
} Spec;

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int held;
    char *base;
    Py_ssize_t rows, row_size, nslots, header;
    Py_ssize_t nfields;
    Spec spec[MAX_FIELDS];
    PyObject *specs;   /* the tuple the Spec pointers borrow from */
    PyObject *index;   /* field name -> index */
    PyObject *tensor_type;
    PyObject *modes_on; /* torch._C._is_torch_function_mode_enabled */
    /* The class's own methods, called with the tensor: a method set on the instance (a
     * tensor has a __dict__) would otherwise run Python between the checks and the copy. */
    PyObject *is_contiguous, *is_neg, *data_ptr;
    /* torch.Tensor.untyped_storage; torch.UntypedStorage, its data_ptr and nbytes: gather's
     * check that an out tensor's storage holds every byte written */
    PyObject *untyped_storage, *storage_type, *storage_data_ptr, *storage_nbytes;
} RowCodec;

static PyObject *s_dtype, *s_shape, *s_is_cpu, *s_is_contiguous, *s_is_neg, *s_data_ptr,
    *s_untyped_storage, *s_nbytes;

/* -- checksum ------------------------------------------------------------------------------ */

/* The wyhash construction (final4 constants): a 64x64->128-bit multiply folds 16 bytes at a
 * time, three independent lanes per 48 bytes, so a row costs one multiply per 16 bytes. */
static const uint64_t S0 = UINT64_C(0x2d358dccaa6c78a5), S1 = UINT64_C(0x8bb84b93962eacc9),
                      S2 = UINT64_C(0x4b33a62ed433d4a3), S3 = UINT64_C(0x4d5a2da51de1aa47);

static inline uint64_t load64(const char *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint64_t load32(const char *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* Both halves of a * b, folded. */
static inline uint64_t mix(uint64_t a, uint64_t b)
{
    unsigned __int128 r = (unsigned __int128)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static uint32_t
row_hash(const char *p, Py_ssize_t n)
{
    size_t len = (size_t)n, i = len;
    uint64_t seed = mix(S0, S1), a, b;
    if (len <= 16) {
        if (len >= 4) {
            a = (load32(p) << 32) | load32(p + ((len >> 3) << 2));
            b = (load32(p + len - 4) << 32) | load32(p + len - 4 - ((len >> 3) << 2));
        } else if (len > 0) {
            a = ((uint64_t)(unsigned char)p[0] << 16) | ((uint64_t)(unsigned char)p[len >> 1] << 8) |
                (unsigned char)p[len - 1];
            b = 0;
        } else {
            a = b = 0;
        }
    } else {
        if (i >= 48) {
            uint64_t see1 = seed, see2 = seed;
            do {
                seed = mix(load64(p) ^ S1, load64(p + 8) ^ seed);
                see1 = mix(load64(p + 16) ^ S2, load64(p + 24) ^ see1);
                see2 = mix(load64(p + 32) ^ S3, load64(p + 40) ^ see2);
                p += 48;
                i -= 48;
            } while (i >= 48);
            seed ^= see1 ^ see2;
        }
        while (i > 16) {
            seed = mix(load64(p) ^ S1, load64(p + 8) ^ seed);
            i -= 16;
            p += 16;
        }
        a = load64(p + i - 16);
        b = load64(p + i - 8);
    }
    unsigned __int128 r = (unsigned __int128)(a ^ S1) * (b ^ seed);
    uint64_t h = mix((uint64_t)r ^ S0 ^ len, (uint64_t)(r >> 64) ^ S1);
    return (uint32_t)(h ^ (h >> 32));
}

/* -- construction -------------------------------------------------------------------------- */

static int
rc_init(RowCodec *r, PyObject *args, PyObject *kwds)
{
    PyObject *buffer, *specs, *tensor_type, *modes_on, *storage_type;
    Py_ssize_t rows, row_size, nslots, header;
    if (r->specs) {
        PyErr_SetString(PyExc_RuntimeError, "RowCodec already initialized");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OnnnnO!OOO", &buffer, &rows, &row_size, &nslots, &header,
                          &PyTuple_Type, &specs, &tensor_type, &modes_on, &storage_type))
        return -1;
    /* 12 header bytes are sealed; sizes are checked by subtraction, so nothing overflows */
    if (header < 12 || row_size < header || rows < 0 || nslots < 0 ||
        (nslots && row_size > (PY_SSIZE_T_MAX - rows) / nslots)) {
        PyErr_SetString(PyExc_ValueError, "bad row geometry");
        return -1;
    }
    PyObject **methods[] = {&r->is_contiguous, &r->is_neg, &r->data_ptr, &r->untyped_storage,
                            &r->storage_data_ptr, &r->storage_nbytes};
    PyObject *owners[] = {tensor_type, tensor_type, tensor_type, tensor_type, storage_type,
                          storage_type};
    PyObject *names[] = {s_is_contiguous, s_is_neg, s_data_ptr, s_untyped_storage, s_data_ptr,
                         s_nbytes};
    for (size_t m = 0; m < sizeof(methods) / sizeof(*methods); m++) {
        Py_CLEAR(*methods[m]); /* a retry after a failed __init__ */
        if (!(*methods[m] = PyObject_GetAttr(owners[m], names[m])))
            return -1; /* dealloc drops what was set */
    }
    Py_XSETREF(r->storage_type, Py_NewRef(storage_type));
    Py_ssize_t n = PyTuple_GET_SIZE(specs);
    if (n > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "too many fields");
        return -1;
    }
    PyObject *index = PyDict_New();
    if (!index)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name, *at = NULL;
        Spec *s = &r->spec[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(specs, i), "UnniiOO!", &name, &s->offset,
                              &s->nbytes, &s->scalar, &s->item, &s->dtype, &PyTuple_Type,
                              &s->shape) ||
            !(at = PyLong_FromSsize_t(i)) || PyDict_SetItem(index, name, at) < 0) {
            Py_XDECREF(at);
            Py_DECREF(index);
            return -1;
        }
        Py_DECREF(at);
        if (s->offset < header || s->nbytes < 0 || s->nbytes > row_size - s->offset) {
            Py_DECREF(index);
            PyErr_SetString(PyExc_ValueError, "field does not fit the row");
            return -1;
        }
    }
    if (PyObject_GetBuffer(buffer, &r->buf, PyBUF_WRITABLE) < 0) {
        Py_DECREF(index);
        return -1;
    }
    if (rows + nslots * row_size > r->buf.len) {
        PyBuffer_Release(&r->buf);
        Py_DECREF(index);
        PyErr_SetString(PyExc_ValueError, "rows do not fit the buffer");
        return -1;
    }
    r->rows = rows;
    r->row_size = row_size;
    r->nslots = nslots;
    r->header = header;
    r->base = r->buf.buf;
    r->nfields = n;
    r->specs = Py_NewRef(specs);
    r->index = index;
    r->tensor_type = Py_NewRef(tensor_type);
    r->modes_on = Py_NewRef(modes_on);
    r->held = 1;
    return 0;
}

/* The row named by args[0] (a slot), after checking the argument count; NULL: error set. */
static char *
row_arg(RowCodec *r, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "RowCodec released");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (slot < 0 || slot >= r->nslots) {
        PyErr_SetString(PyExc_IndexError, "slot out of range");
        return NULL;
    }
    return r->base + r->rows + slot * r->row_size;
}

/* -- write --------------------------------------------------------------------------------- */

typedef struct {
    Py_ssize_t offset, nbytes;
    const void *src;
    union { int64_t i64; int32_t i32; uint8_t u8; float f32; } value;
} Copy;

/* Does method(v) return `want`? 1 yes, 0 no, -1 error. */
static int
gives(PyObject *method, PyObject *v, PyObject *want)
{
    PyObject *x = PyObject_CallOneArg(method, v);
    if (!x)
        return -1;
    int same = x == want;
    Py_DECREF(x);
    return same;
}

/* Is `v` the plain tensor for `s`? 1 yes (sets *src), 0 no, -1 error. */
static int
plain_tensor(RowCodec *r, Spec *s, PyObject *v, const void **src)
{
    if (Py_TYPE(v) != (PyTypeObject *)r->tensor_type)
        return 0;
    PyObject *x = PyObject_GetAttr(v, s_dtype);
    if (!x)
        return -1;
    int ok = x == s->dtype;
    Py_DECREF(x);
    if (!ok)
        return 0;
    if (!(x = PyObject_GetAttr(v, s_shape)))
        return -1;
    ok = PyObject_RichCompareBool(x, s->shape, Py_EQ);
    Py_DECREF(x);
    if (ok != 1)
        return ok;
    if (!(x = PyObject_GetAttr(v, s_is_cpu)))
        return -1;
    ok = x == Py_True;
    Py_DECREF(x);
    if (!ok)
        return 0;
    if ((ok = gives(r->is_contiguous, v, Py_True)) != 1 ||
        (ok = gives(r->is_neg, v, Py_False)) != 1) /* is_neg: a lazily negated view */
        return ok;
    if (!(x = PyObject_CallOneArg(r->data_ptr, v)))
        return -1;
    *src = PyLong_AsVoidPtr(x);
    Py_DECREF(x);
    if (PyErr_Occurred())
        return -1;
    return *src != NULL; /* no storage (freed, or a zero tensor): Python's path decides */
}

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

static PyObject *
rc_write(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    char *row = row_arg(r, args, nargs, 2, "write(slot, fields: dict)");
    if (!row)
        return NULL;
    PyObject *fields = args[1];
    if (!PyDict_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "write(slot, fields: dict)");
        return NULL;
    }
    /* Under a torch-function mode the tensor calls below would run Python code between
       the checks and the copies: leave that to Python's path. */
    PyObject *on = PyObject_CallNoArgs(r->modes_on);
    if (!on)
        return NULL;
    int modes = on != Py_False;
    Py_DECREF(on);
    Py_ssize_t n = PyDict_GET_SIZE(fields);
    if (modes || n > MAX_FIELDS)
        Py_RETURN_FALSE;
    /* Strong references first, so nothing the checks run can free a value under us. */
    PyObject *held[MAX_FIELDS];
    Spec *spec[MAX_FIELDS];
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value, *result = Py_False;
    while (k < n && PyDict_Next(fields, &pos, &key, &value)) {
        PyObject *i = PyUnicode_CheckExact(key) ? PyDict_GetItemWithError(r->index, key) : NULL;
        if (!i) {
            result = PyErr_Occurred() ? NULL : Py_False;
            goto done;
        }
        spec[k] = &r->spec[PyLong_AsSsize_t(i)];
        held[k++] = Py_NewRef(value);
    }
    Copy copies[MAX_FIELDS];
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        Spec *s = spec[j];
        Copy *c = &copies[j];
        c->offset = s->offset;
        c->nbytes = s->nbytes;
        total += s->nbytes;
        int ok;
        if (s->scalar == HANDLE)
            ok = 0;
        else if (s->scalar != NO_SCALAR && Py_TYPE(held[j]) != (PyTypeObject *)r->tensor_type)
            ok = plain_number(s, held[j], c);
        else
            ok = plain_tensor(r, s, held[j], &c->src);
        if (ok != 1) {
            result = ok < 0 ? NULL : Py_False;
            goto done;
        }
    }
    if (total >= (1 << 20)) { /* big copies let other threads run, as _atomic's copy_in does */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < k; j++)
            memmove(row + copies[j].offset, copies[j].src, (size_t)copies[j].nbytes);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t j = 0; j < k; j++) /* memmove: a source may be a view of a row */
            memmove(row + copies[j].offset, copies[j].src, (size_t)copies[j].nbytes);
    }
    result = Py_True;
done:
    for (Py_ssize_t j = 0; j < k; j++)
        Py_DECREF(held[j]);
    return Py_XNewRef(result);
}

/* -- scalar read ---------------------------------------------------------------------------- */

/* read(slot, name) -> int | float for a field of one number (shape (), (1,), ...), None for
 * any other field or name (leases.py says why not). */
static PyObject *
rc_read(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    const char *row = row_arg(r, args, nargs, 2, "read(slot, name)");
    if (!row)
        return NULL;
    PyObject *i = PyUnicode_CheckExact(args[1]) ? PyDict_GetItemWithError(r->index, args[1]) : NULL;
    if (!i) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Spec *s = &r->spec[PyLong_AsSsize_t(i)];
    const char *at = row + s->offset;
    switch (s->item) {
    case S_INT64: { int64_t v; memcpy(&v, at, 8); return PyLong_FromLongLong(v); }
    case S_INT32: { int32_t v; memcpy(&v, at, 4); return PyLong_FromLong(v); }
    case S_UINT8: return PyLong_FromLong(*(const uint8_t *)at);
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

/* -- gather ------------------------------------------------------------------------------- */

/* method(v) as a pointer-sized integer; 0 with an error set on failure. */
static uintptr_t
address_of(PyObject *method, PyObject *v)
{
    PyObject *x = PyObject_CallOneArg(method, v);
    if (!x)
        return 0;
    uintptr_t a = (uintptr_t)PyLong_AsVoidPtr(x);
    Py_DECREF(x);
    return a;
}

/* Is `out` a plain CPU tensor for `n` rows of field `s` — shape (n, *shape), or the field's
 * own shape if not `batched` — whose storage holds every byte of it?  1 yes (sets *dst), 0
 * no, -1 error. */
static int
plain_out(RowCodec *r, Spec *s, PyObject *out, Py_ssize_t n, int batched, char **dst)
{
    if (Py_TYPE(out) != (PyTypeObject *)r->tensor_type)
        return 0;
    PyObject *x = PyObject_GetAttr(out, s_dtype);
    if (!x)
        return -1;
    int ok = x == s->dtype;
    Py_DECREF(x);
    if (!ok)
        return 0;
    if (!(x = PyObject_GetAttr(out, s_shape)))
        return -1;
    Py_ssize_t dims = PyTuple_GET_SIZE(s->shape);
    ok = PyTuple_Check(x) && PyTuple_GET_SIZE(x) == dims + batched;
    if (ok && batched)
        ok = PyLong_AsSsize_t(PyTuple_GET_ITEM(x, 0)) == n;
    for (Py_ssize_t d = 0; ok == 1 && d < dims; d++)
        ok = PyObject_RichCompareBool(PyTuple_GET_ITEM(x, d + batched),
                                      PyTuple_GET_ITEM(s->shape, d), Py_EQ);
    Py_DECREF(x);
    if (ok != 1)
        return PyErr_Occurred() ? -1 : 0;
    if (!(x = PyObject_GetAttr(out, s_is_cpu)))
        return -1;
    ok = x == Py_True;
    Py_DECREF(x);
    if (!ok)
        return 0;
    if ((ok = gives(r->is_contiguous, out, Py_True)) != 1 ||
        (ok = gives(r->is_neg, out, Py_False)) != 1)
        return ok;
    uintptr_t at = address_of(r->data_ptr, out);
    if (PyErr_Occurred())
        return -1;
    *dst = (char *)at;
    if (!n || !s->nbytes)
        return 1; /* nothing to copy */
    /* Every byte inside the storage: not freed or resized under the tensor. */
    PyObject *storage = PyObject_CallOneArg(r->untyped_storage, out);
    if (!storage)
        return -1;
    if (Py_TYPE(storage) != (PyTypeObject *)r->storage_type) {
        Py_DECREF(storage);
        return 0;
    }
    uintptr_t start = address_of(r->storage_data_ptr, storage);
    PyObject *size = PyErr_Occurred() ? NULL : PyObject_CallOneArg(r->storage_nbytes, storage);
    Py_DECREF(storage);
    Py_ssize_t have = size ? PyLong_AsSsize_t(size) : -1;
    Py_XDECREF(size);
    if (PyErr_Occurred())
        return -1;
    return at && at >= start && (uintptr_t)have >= at - start &&
           (Py_ssize_t)((uintptr_t)have - (at - start)) / n >= s->nbytes;
}

/* gather(slots, name, out) -> True | False: field `name` of each slot copied into `out`, row
 * after row, in one loop.  `slots` is a tuple (out has shape (n, *shape)) or one slot (out
 * has the field's shape).  False, having written nothing, for a handle field, an unknown
 * name, an `out` that is not the plain case, or a torch-function mode: rows.py's path. */
static PyObject *
rc_gather(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "gather(slots, name, out)");
        return NULL;
    }
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "RowCodec released");
        return NULL;
    }
    PyObject *slots = args[0];
    int batched = PyTuple_Check(slots);
    Py_ssize_t n = batched ? PyTuple_GET_SIZE(slots) : 1;
    PyObject *i = PyUnicode_CheckExact(args[1]) ? PyDict_GetItemWithError(r->index, args[1]) : NULL;
    if (!i)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    Spec *s = &r->spec[PyLong_AsSsize_t(i)];
    if (s->scalar == HANDLE)
        Py_RETURN_FALSE;
    PyObject *on = PyObject_CallNoArgs(r->modes_on); /* a mode would run Python in the checks */
    if (!on)
        return NULL;
    int modes = on != Py_False;
    Py_DECREF(on);
    char *dst;
    int ok = modes ? 0 : plain_out(r, s, args[2], n, batched, &dst);
    if (ok != 1)
        return ok < 0 ? NULL : Py_NewRef(Py_False);
    /* Every slot checked, as the offset of its field, before the first copy. */
    Py_ssize_t local[64], *src = n <= 64 ? local : PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    if (!src)
        return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t slot = PyLong_AsSsize_t(batched ? PyTuple_GET_ITEM(slots, k) : slots);
        if ((slot == -1 && PyErr_Occurred()) || slot < 0 || slot >= r->nslots) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "slot out of range");
            if (src != local)
                PyMem_Free(src);
            return NULL;
        }
        src[k] = r->rows + slot * r->row_size + s->offset;
    }
    char *base = r->base;
    size_t nbytes = (size_t)s->nbytes;
    if (n * s->nbytes >= (1 << 20)) { /* big copies let other threads run, as write does */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n; k++)
            memmove(dst + (size_t)k * nbytes, base + src[k], nbytes);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t k = 0; k < n; k++) /* memmove: out may be a view of a row */
            memmove(dst + (size_t)k * nbytes, base + src[k], nbytes);
    }
    if (src != local)
        PyMem_Free(src);
    Py_RETURN_TRUE;
}

/* -- checksum and seal ---------------------------------------------------------------------- */

static PyObject *
rc_checksum(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    const char *row = row_arg(r, args, nargs, 1, "checksum(slot)");
    if (!row)
        return NULL;
    return PyLong_FromUnsignedLong(row_hash(row + r->header, r->row_size - r->header));
}

/* Header: generation (u64), checksum (u32), as rows.py's _ROW_HEADER reads them. */
static PyObject *
rc_seal(RowCodec *r, PyObject *const *args, Py_ssize_t nargs)
{
    char *row = row_arg(r, args, nargs, 2, "seal(slot, generation)");
    if (!row)
        return NULL;
    unsigned long long generation = PyLong_AsUnsignedLongLong(args[1]);
    if (generation == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    uint64_t g = generation;
    uint32_t sum = row_hash(row + r->header, r->row_size - r->header);
    memcpy(row, &g, 8);
    memcpy(row + 8, &sum, 4);
    Py_RETURN_NONE;
}

static PyObject *
rc_hash(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t sum = row_hash(view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(sum);
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
    Py_XDECREF(r->tensor_type);
    Py_XDECREF(r->modes_on);
    Py_XDECREF(r->is_contiguous);
    Py_XDECREF(r->is_neg);
    Py_XDECREF(r->data_ptr);
    Py_XDECREF(r->untyped_storage);
    Py_XDECREF(r->storage_type);
    Py_XDECREF(r->storage_data_ptr);
    Py_XDECREF(r->storage_nbytes);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

#define FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef rc_methods[] = {
    FAST("write", rc_write, "write(slot, fields) -> True, or False having written nothing"),
    FAST("gather", rc_gather, "gather(slots, name, out) -> True, or False having written nothing"),
    FAST("read", rc_read, "read(slot, name) -> the scalar field as a number, or None"),
    FAST("checksum", rc_checksum, "checksum(slot) -> the row payload's 32-bit checksum"),
    FAST("seal", rc_seal, "seal(slot, generation): write the row header"),
    {"release", (PyCFunction)rc_release, METH_NOARGS, "release the buffer export"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RowCodecType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._rowcodec.RowCodec",
    .tp_doc = "Plain-case row writes and row checksums over one buffer of rows.",
    .tp_basicsize = sizeof(RowCodec),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)rc_init,
    .tp_dealloc = (destructor)rc_dealloc,
    .tp_methods = rc_methods,
};

static PyMethodDef module_methods[] = {
    {"row_hash", rc_hash, METH_O, "row_hash(buffer) -> the 32-bit checksum of its bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shmslots._rowcodec", "Compiled plain-case row writes and checksums.",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__rowcodec(void)
{
    if (!(s_dtype = PyUnicode_InternFromString("dtype")) ||
        !(s_shape = PyUnicode_InternFromString("shape")) ||
        !(s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
        !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) ||
        !(s_is_neg = PyUnicode_InternFromString("is_neg")) ||
        !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
        !(s_untyped_storage = PyUnicode_InternFromString("untyped_storage")) ||
        !(s_nbytes = PyUnicode_InternFromString("nbytes")))
        return NULL;
    if (PyType_Ready(&RowCodecType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&RowCodecType);
    if (PyModule_AddObject(m, "RowCodec", (PyObject *)&RowCodecType) < 0) {
        Py_DECREF(&RowCodecType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
