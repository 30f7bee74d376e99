/* Atomic operations and futex wait/wake on a shared-memory mapping.
 *
 * Why compiled: a pure-Python CAS costs 15-25 us, more than a whole
 * cross-process round trip; this one costs ~40 ns.  Why our own: futex
 * wait/wake on a shared word gives a blocking wait that no dead process can
 * leave locked, which no package offers.
 *
 * Memory ordering is explicit: loads are SEQ_CST (a plain load on x86, LDAR on
 * Arm), stores are RELEASE, read-modify-writes are SEQ_CST so the waiter/waker
 * handshake (increment a waiter count, then read a sequence word) is ordered.
 * load_acquire/store_release work on any buffer, for one-off publications
 * such as a table's magic, which a read-only mapping must be able to read.
 *
 * Every access is bounds- and alignment-checked against the exported buffer,
 * so a wrong offset raises instead of corrupting memory.
 */
#include "core.h"
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int held;
} AtomicView;

static PyTypeObject AtomicViewType;

/* The `width`-byte word at byte offset off_obj of buf, checked; NULL: error set. */
static char *
word_in(Py_buffer *buf, PyObject *off_obj, Py_ssize_t width)
{
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || off > buf->len - width ||
        ((uintptr_t)buf->buf + (uintptr_t)off) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd out of range or misaligned for a %zd-byte word", off, width);
        return NULL;
    }
    return (char *)buf->buf + off;
}

static char *
addr_of(AtomicView *self, PyObject *off_obj, Py_ssize_t width)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "AtomicView is released");
        return NULL;
    }
    return word_in(&self->buf, off_obj, width);
}

static int
nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return 0;
    }
    return 1;
}

int
as_u64(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = (uint64_t)v;
    return 1;
}

static PyObject *
av_load(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 1, "load")) return NULL;
    uint64_t *p = (uint64_t *)addr_of(self, args[0], 8);
    if (!p) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_SEQ_CST));
}

static PyObject *
av_store(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t v;
    if (!nargs_ok(nargs, 2, "store")) return NULL;
    uint64_t *p = (uint64_t *)addr_of(self, args[0], 8);
    if (!p || !as_u64(args[1], &v)) return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *
av_cas(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expected, desired;
    if (!nargs_ok(nargs, 3, "cas")) return NULL;
    uint64_t *p = (uint64_t *)addr_of(self, args[0], 8);
    if (!p || !as_u64(args[1], &expected) || !as_u64(args[2], &desired)) return NULL;
    int ok = __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

static PyObject *
av_add(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 2, "add")) return NULL;
    long long delta = PyLong_AsLongLong(args[1]); /* first: __index__ may run Python */
    if (delta == -1 && PyErr_Occurred()) return NULL;
    uint64_t *p = (uint64_t *)addr_of(self, args[0], 8);
    if (!p) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_fetch_add(p, (uint64_t)delta, __ATOMIC_SEQ_CST));
}

static PyObject *
av_or(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t mask;
    if (!nargs_ok(nargs, 2, "fetch_or")) return NULL;
    uint64_t *p = (uint64_t *)addr_of(self, args[0], 8);
    if (!p || !as_u64(args[1], &mask)) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_fetch_or(p, mask, __ATOMIC_SEQ_CST));
}

static PyObject *
av_and(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t mask;
    if (!nargs_ok(nargs, 2, "fetch_and")) return NULL;
    uint64_t *p = (uint64_t *)addr_of(self, args[0], 8);
    if (!p || !as_u64(args[1], &mask)) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_fetch_and(p, mask, __ATOMIC_SEQ_CST));
}

static PyObject *
av_load32(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 1, "load32")) return NULL;
    uint32_t *p = (uint32_t *)addr_of(self, args[0], 4);
    if (!p) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_SEQ_CST));
}

static PyObject *
av_add32(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 2, "add32")) return NULL;
    long delta = PyLong_AsLong(args[1]); /* first: __index__ may run Python */
    if (delta == -1 && PyErr_Occurred()) return NULL;
    uint32_t *p = (uint32_t *)addr_of(self, args[0], 4);
    if (!p) return NULL;
    return PyLong_FromUnsignedLong(__atomic_fetch_add(p, (uint32_t)delta, __ATOMIC_SEQ_CST));
}

/* `count` consecutive 64-bit words at byte offset `off` of AtomicView `view`, checked: the
 * view is one and still held, the words aligned and inside it.  NULL with an error set. */
uint64_t *
atomic_words(PyObject *view, Py_ssize_t off, Py_ssize_t count)
{
    if (!PyObject_TypeCheck(view, &AtomicViewType)) {
        PyErr_SetString(PyExc_TypeError, "an AtomicView is needed");
        return NULL;
    }
    AtomicView *self = (AtomicView *)view;
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "AtomicView is released");
        return NULL;
    }
    if (count < 0 || count > PY_SSIZE_T_MAX / 8 || off < 0 || off > self->buf.len - 8 * count ||
        ((uintptr_t)self->buf.buf + (uintptr_t)off) % 8 != 0) {
        PyErr_Format(PyExc_IndexError, "%zd words at offset %zd are not in the buffer", count,
                     off);
        return NULL;
    }
    return (uint64_t *)((char *)self->buf.buf + off);
}

/* futex_wait(off, expected, timeout_s) -> bool
 * Sleeps while the 32-bit word at off equals expected, at most timeout_s
 * seconds.  Returns False on timeout, True otherwise (woken, value changed,
 * or interrupted by a signal with no Python exception pending). */
static PyObject *
av_futex_wait(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 3, "futex_wait")) return NULL;
    unsigned long expected = PyLong_AsUnsignedLong(args[1]);
    if (expected == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    double timeout = PyFloat_AsDouble(args[2]); /* before the word: __float__ may run Python */
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    uint32_t *p = (uint32_t *)addr_of(self, args[0], 4);
    if (!p) return NULL;
    if (timeout < 0) timeout = 0;
    struct timespec ts;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, p, FUTEX_WAIT, (uint32_t)expected, &ts, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0 || err == EAGAIN) Py_RETURN_TRUE;
    if (err == ETIMEDOUT) Py_RETURN_FALSE;
    if (err == EINTR) {
        if (PyErr_CheckSignals() < 0) return NULL;
        Py_RETURN_TRUE;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *
av_futex_wake(AtomicView *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_ok(nargs, 2, "futex_wake")) return NULL;
    long n = PyLong_AsLong(args[1]); /* first: __index__ may run Python */
    if (n == -1 && PyErr_Occurred()) return NULL;
    uint32_t *p = (uint32_t *)addr_of(self, args[0], 4);
    if (!p) return NULL;
    if (n < 0 || n > INT_MAX) n = INT_MAX;
    long rc = syscall(SYS_futex, p, FUTEX_WAKE, (int)n, NULL, NULL, 0);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

static PyObject *
av_release(AtomicView *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->buf);
        self->held = 0;
    }
    Py_RETURN_NONE;
}

static int
av_init(AtomicView *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &obj))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->buf);
        self->held = 0;
    }
    if (PyObject_GetBuffer(obj, &self->buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (((uintptr_t)self->buf.buf % 8) != 0) {
        PyBuffer_Release(&self->buf);
        PyErr_SetString(PyExc_ValueError, "buffer is not 8-byte aligned");
        return -1;
    }
    self->held = 1;
    return 0;
}

static void
av_dealloc(AtomicView *self)
{
    if (self->held)
        PyBuffer_Release(&self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef av_methods[] = {
    {"load", (PyCFunction)(void (*)(void))av_load, METH_FASTCALL, "load(off) -> u64"},
    {"store", (PyCFunction)(void (*)(void))av_store, METH_FASTCALL, "store(off, value)"},
    {"cas", (PyCFunction)(void (*)(void))av_cas, METH_FASTCALL, "cas(off, expected, new) -> bool"},
    {"add", (PyCFunction)(void (*)(void))av_add, METH_FASTCALL, "add(off, delta) -> old u64"},
    {"fetch_or", (PyCFunction)(void (*)(void))av_or, METH_FASTCALL, "fetch_or(off, mask) -> old"},
    {"fetch_and", (PyCFunction)(void (*)(void))av_and, METH_FASTCALL, "fetch_and(off, mask) -> old"},
    {"load32", (PyCFunction)(void (*)(void))av_load32, METH_FASTCALL, "load32(off) -> u32"},
    {"add32", (PyCFunction)(void (*)(void))av_add32, METH_FASTCALL, "add32(off, delta) -> old u32"},
    {"futex_wait", (PyCFunction)(void (*)(void))av_futex_wait, METH_FASTCALL,
     "futex_wait(off, expected, timeout_s) -> False on timeout"},
    {"futex_wake", (PyCFunction)(void (*)(void))av_futex_wake, METH_FASTCALL,
     "futex_wake(off, n) -> number woken"},
    {"release", (PyCFunction)av_release, METH_NOARGS, "release the buffer export"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AtomicViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmslots._core.AtomicView",
    .tp_doc = "Atomic 64/32-bit words and futexes over a writable buffer.",
    .tp_basicsize = sizeof(AtomicView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)av_init,
    .tp_dealloc = (destructor)av_dealloc,
    .tp_methods = av_methods,
};

/* load_acquire(buffer, off) -> u64, from any buffer (a read-only mapping too), and
 * store_release(buffer, off, value): the pair that publishes what was written before the
 * store to whoever sees the stored value -- on weak-memory CPUs (Arm) as well as x86. */
static PyObject *
mod_load_acquire(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer buf;
    if (!nargs_ok(nargs, 2, "load_acquire")) return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t *p = (uint64_t *)word_in(&buf, args[1], 8);
    PyObject *result = p ? PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE)) : NULL;
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *
mod_store_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer buf;
    uint64_t v;
    if (!nargs_ok(nargs, 3, "store_release") || !as_u64(args[2], &v)) return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_WRITABLE) < 0) return NULL;
    uint64_t *p = (uint64_t *)word_in(&buf, args[1], 8);
    if (p)
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    PyBuffer_Release(&buf);
    if (!p) return NULL;
    Py_RETURN_NONE;
}

/* fence(): a full memory barrier, for the orders acquire and release do not give: a
 * seqlock's writer's stores after its odd sequence number, its reader's loads before the
 * re-check, and a store followed by a load of another word (store buffering). */
static PyObject *
mod_fence(PyObject *module, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"fence", (PyCFunction)mod_fence, METH_NOARGS, "fence(): a full memory barrier"},
    {"load_acquire", (PyCFunction)(void (*)(void))mod_load_acquire, METH_FASTCALL,
     "load_acquire(buffer, off) -> u64, an acquire load"},
    {"store_release", (PyCFunction)(void (*)(void))mod_store_release, METH_FASTCALL,
     "store_release(buffer, off, value): a release store"},
    {NULL, NULL, 0, NULL},
};

int
atomic_add(PyObject *m)
{
    if (PyType_Ready(&AtomicViewType) < 0 ||
        PyModule_AddObjectRef(m, "AtomicView", (PyObject *)&AtomicViewType) < 0 ||
        PyModule_AddFunctions(m, module_methods) < 0)
        return -1;
    return 0;
}
