/* The bytes of a ref field, and opening an arena ref as a tensor, compiled.
 *
 * A ref field's item holds, little-endian:
 *
 *   u16 length            bytes that follow (the rest of the item is slack)
 *   u8  kind              REF_ARENA or REF_CUDA
 *   arena:  u8 dtype (index in schema.DTYPE_CODES), u8 ndim, u8 table_len,
 *           u64 offset (in the segment), u64 nbytes, ndim x u64 sizes, table_len bytes of
 *           the table's name (refs point into their own table's arena only)
 *   cuda:   the IPC description as msgpack (cuda_ipc.py opens it)
 *
 * The format is read and written here only: ref_codec.py (the CLI's decode), refs.py
 * (encode, and the slow path of open) and leases.c (a lease's tensor()) all call this file.
 * Whether an arena ref may be opened (its table, its bounds, its size, its dtype) is
 * codec_open_ref's rule, also in one place; Python words its refusal codes.
 */
#include "core.h"
#include <string.h>

#define REF_HEAD 2             /* u16 length */
#define ARENA_FIXED (4 + 8 + 8) /* kind, dtype, ndim, table_len; offset; nbytes */

enum { REF_ARENA = 1, REF_CUDA = 2 };

typedef struct {
    int kind, dtype, ndim;
    uint64_t offset, nbytes;
    int64_t sizes[REF_MAX_DIMS];
    const char *table, *payload;
    Py_ssize_t table_len, payload_len;
} Ref;

static uint64_t
le64(const char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | (unsigned char)p[i];
    return v;
}

static void
put64(char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++, v >>= 8)
        p[i] = (char)(v & 0xFF);
}

/* Parse an item of `len` bytes: REF_OK (ref filled) or REF_MALFORMED, no error set. */
static int
parse(const char *raw, Py_ssize_t len, Ref *ref)
{
    if (len < REF_HEAD + 1)
        return REF_MALFORMED;
    Py_ssize_t body = (unsigned char)raw[0] | ((Py_ssize_t)(unsigned char)raw[1] << 8);
    if (body < 1 || body > len - REF_HEAD)
        return REF_MALFORMED; /* never written, or overwritten */
    const char *p = raw + REF_HEAD;
    ref->kind = (unsigned char)p[0];
    if (ref->kind == REF_CUDA) {
        ref->payload = p + 1;
        ref->payload_len = body - 1;
        return REF_OK;
    }
    if (ref->kind != REF_ARENA || body < ARENA_FIXED)
        return REF_MALFORMED;
    ref->dtype = (unsigned char)p[1];
    ref->ndim = (unsigned char)p[2];
    ref->table_len = (unsigned char)p[3];
    if (ref->ndim > REF_MAX_DIMS || body != ARENA_FIXED + 8 * ref->ndim + ref->table_len)
        return REF_MALFORMED;
    ref->offset = le64(p + 4);
    ref->nbytes = le64(p + 12);
    for (int d = 0; d < ref->ndim; d++) {
        uint64_t size = le64(p + ARENA_FIXED + 8 * d);
        if (size > INT64_MAX)
            return REF_MALFORMED;
        ref->sizes[d] = (int64_t)size;
    }
    ref->table = p + ARENA_FIXED + 8 * ref->ndim;
    return REF_OK;
}

int
ref_open_arena(const char *raw, Py_ssize_t len, const RefPlace *place, int dtype,
               Py_ssize_t itemsize, const RefShape *shape, uint64_t *offset, uint64_t *nbytes,
               int *ndim, int64_t *sizes)
{
    Ref ref;
    int code = parse(raw, len, &ref);
    if (code != REF_OK)
        return code;
    if (ref.kind == REF_CUDA)
        return REF_IS_CUDA;
    if (ref.table_len != place->table_len || memcmp(ref.table, place->table, (size_t)ref.table_len))
        return REF_NOT_OURS;
    if (ref.dtype != dtype)
        return REF_DTYPE;
    /* Every size counts, an empty dimension included: torch refuses a shape whose other
     * sizes overflow even when it holds no element. */
    uint64_t nonzero = 1, count, end;
    int empty = 0;
    for (int d = 0; d < ref.ndim; d++) {
        uint64_t size = (uint64_t)ref.sizes[d];
        if (!size)
            empty = 1;
        else if (__builtin_mul_overflow(nonzero, size, &nonzero) || nonzero > INT64_MAX)
            return REF_SIZE;
    }
    count = empty ? 0 : nonzero;
    if (__builtin_mul_overflow(count, (uint64_t)itemsize, &count) || count != ref.nbytes)
        return REF_SIZE;
    if (ref.offset < place->lo || __builtin_add_overflow(ref.offset, ref.nbytes, &end) ||
        end > place->hi)
        return REF_OUTSIDE;
    /* the field's rank, and each of its fixed sizes */
    if (ref.ndim != shape->ndim)
        return REF_SHAPE;
    for (int d = 0; d < ref.ndim; d++)
        if (shape->dims[d] >= 0 && (int64_t)ref.sizes[d] != shape->dims[d])
            return REF_SHAPE;
    *offset = ref.offset;
    *nbytes = ref.nbytes;
    *ndim = ref.ndim;
    memcpy(sizes, ref.sizes, sizeof(int64_t) * (size_t)ref.ndim);
    return REF_OK;
}

/* -- Python's face --------------------------------------------------------------------------- */

/* parse_ref(raw) -> ("shm", dtype index, offset, nbytes, shape, table) | ("cuda", payload);
 * ValueError if the bytes hold no ref. */
static PyObject *
parse_ref(PyObject *module, PyObject *arg)
{
    Py_buffer raw;
    if (PyObject_GetBuffer(arg, &raw, PyBUF_SIMPLE) < 0)
        return NULL;
    Ref ref;
    PyObject *result = NULL;
    if (parse(raw.buf, raw.len, &ref) != REF_OK)
        PyErr_SetString(PyExc_ValueError, "row holds no valid ref (never written, or overwritten)");
    else if (ref.kind == REF_CUDA)
        result = Py_BuildValue("(sy#)", "cuda", ref.payload, ref.payload_len);
    else {
        PyObject *shape = PyTuple_New(ref.ndim);
        for (int d = 0; shape && d < ref.ndim; d++) {
            PyObject *size = PyLong_FromLongLong(ref.sizes[d]);
            if (!size)
                Py_CLEAR(shape);
            else
                PyTuple_SET_ITEM(shape, d, size);
        }
        if (shape)
            result = Py_BuildValue("(siKKNs#)", "shm", ref.dtype, (unsigned long long)ref.offset,
                                   (unsigned long long)ref.nbytes, shape, ref.table,
                                   ref.table_len);
    }
    PyBuffer_Release(&raw);
    return result;
}

/* The bytes of a ref item: length, kind, then `body` (n bytes); NULL with an error set. */
static PyObject *
item_bytes(int kind, Py_ssize_t n, char **body)
{
    if (1 + n > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "a ref of more than 65535 bytes");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, REF_HEAD + 1 + n);
    if (!out)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    p[0] = (char)((1 + n) & 0xFF);
    p[1] = (char)((1 + n) >> 8);
    p[2] = (char)kind;
    *body = p + 3;
    return out;
}

Py_ssize_t
ref_arena_len(int ndim, Py_ssize_t table_len)
{
    return REF_HEAD + ARENA_FIXED + 8 * (Py_ssize_t)ndim + table_len;
}

void
ref_put_arena(char *item, int dtype, uint64_t offset, uint64_t nbytes, int ndim,
              const int64_t *sizes, const char *table, Py_ssize_t table_len)
{
    Py_ssize_t body = ref_arena_len(ndim, table_len) - REF_HEAD;
    item[0] = (char)(body & 0xFF);
    item[1] = (char)(body >> 8);
    char *p = item + REF_HEAD;
    p[0] = (char)REF_ARENA;
    p[1] = (char)dtype;
    p[2] = (char)ndim;
    p[3] = (char)table_len;
    put64(p + 4, offset);
    put64(p + 12, nbytes);
    for (int d = 0; d < ndim; d++)
        put64(p + ARENA_FIXED + 8 * d, (uint64_t)sizes[d]);
    memcpy(p + ARENA_FIXED + 8 * ndim, table, (size_t)table_len);
}

/* arena_ref(dtype index, offset, nbytes, shape, table) -> the ref's item bytes */
static PyObject *
arena_ref(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_Check(args[3]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "arena_ref(dtype: int, offset: int, nbytes: int, shape: tuple, table: str)");
        return NULL;
    }
    long dtype = PyLong_AsLong(args[0]);
    if (dtype == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[1]), nbytes;
    if (offset == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if ((nbytes = PyLong_AsUnsignedLongLong(args[2])) == (unsigned long long)-1 &&
        PyErr_Occurred())
        return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(args[3]), table_len;
    const char *table = PyUnicode_AsUTF8AndSize(args[4], &table_len);
    if (!table)
        return NULL;
    if (dtype < 0 || dtype > 255 || ndim > REF_MAX_DIMS || table_len > 255) {
        PyErr_SetString(PyExc_ValueError, "a ref's dtype index, dimensions or table name is too big");
        return NULL;
    }
    int64_t sizes[REF_MAX_DIMS];
    for (Py_ssize_t d = 0; d < ndim; d++) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], d));
        if (size < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a negative size");
            return NULL;
        }
        sizes[d] = size;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, ref_arena_len((int)ndim, table_len));
    if (out)
        ref_put_arena(PyBytes_AS_STRING(out), (int)dtype, offset, nbytes, (int)ndim, sizes, table,
                      table_len);
    return out;
}

/* cuda_ref(payload) -> the ref's item bytes around an IPC description */
static PyObject *
cuda_ref(PyObject *module, PyObject *arg)
{
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "cuda_ref(payload: bytes)");
        return NULL;
    }
    char *p;
    PyObject *out = item_bytes(REF_CUDA, PyBytes_GET_SIZE(arg), &p);
    if (out)
        memcpy(p, PyBytes_AS_STRING(arg), (size_t)PyBytes_GET_SIZE(arg));
    return out;
}

static PyMethodDef refcodec_methods[] = {
    {"parse_ref", parse_ref, METH_O, "parse_ref(raw) -> ('shm', dtype, offset, nbytes, shape, "
                                     "table) | ('cuda', payload); ValueError if none"},
    {"arena_ref", (PyCFunction)(void (*)(void))arena_ref, METH_FASTCALL,
     "arena_ref(dtype, offset, nbytes, shape, table) -> a ref item's bytes"},
    {"cuda_ref", cuda_ref, METH_O, "cuda_ref(payload) -> a ref item's bytes"},
    {NULL, NULL, 0, NULL},
};

int
refcodec_add(PyObject *m)
{
    if (PyModule_AddFunctions(m, refcodec_methods) < 0)
        return -1;
    return add_owned(m, "REF_REFUSALS",
                     Py_BuildValue("{sisisisisisisi}", "MALFORMED", REF_MALFORMED, "IS_CUDA",
                                   REF_IS_CUDA, "NOT_OURS", REF_NOT_OURS, "DTYPE", REF_DTYPE,
                                   "SIZE", REF_SIZE, "OUTSIDE", REF_OUTSIDE, "SHAPE",
                                   REF_SHAPE));
}
