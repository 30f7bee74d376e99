/* blockcopy.c: the same-host engine's host copies (shmslots/sglang/samehost/engine.py).
 *
 * A job's blocks, (source, target, length) between addresses of this process that the
 * engine's planner has placed inside registered memory, are copied in one call.  The GIL is
 * let go once around them all, and only where they move enough bytes for other threads to
 * gain from it.  ctypes.memmove let it go at every block, and each block then waited to get
 * it back behind any busy Python thread of the process: a 14-block aux row took about 8 ms
 * beside one such thread, against 50 us without it.
 */
#include "core.h"

#include <string.h>

/* Below this many bytes a call keeps the GIL: its copies take a few microseconds, less than
 * waiting to get the GIL back could. */
#define RELEASE_BYTES (256 * 1024)

typedef struct {
    char *target;
    const char *source;
    size_t length;
} Block;

/* One (source, target, length) tuple of ints: 1, or 0 with an error set. */
static int
block_of(PyObject *item, Block *block)
{
    uint64_t source, target, length;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_blocks(): each block is (source, target, length)");
        return 0;
    }
    if (!as_u64(PyTuple_GET_ITEM(item, 0), &source) ||
        !as_u64(PyTuple_GET_ITEM(item, 1), &target) || !as_u64(PyTuple_GET_ITEM(item, 2), &length))
        return 0;
    block->source = (const char *)(uintptr_t)source;
    block->target = (char *)(uintptr_t)target;
    block->length = (size_t)length;
    return 1;
}

static PyObject *
copy_blocks(PyObject *module, PyObject *blocks)
{
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "copy_blocks() takes a list of (source, target, length)");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(blocks);
    Block *all = PyMem_New(Block, count ? count : 1);
    if (!all)
        return PyErr_NoMemory();
    size_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!block_of(PyList_GET_ITEM(blocks, i), &all[i])) {
            PyMem_Free(all);
            return NULL;
        }
        total = all[i].length > SIZE_MAX - total ? SIZE_MAX : total + all[i].length;
    }
    /* memmove: a block's source and target may overlap (the planner allows it) */
    if (total >= RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            memmove(all[i].target, all[i].source, all[i].length);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            memmove(all[i].target, all[i].source, all[i].length);
    }
    PyMem_Free(all);
    Py_RETURN_NONE;
}

static PyMethodDef blockcopy_methods[] = {
    {"copy_blocks", copy_blocks, METH_O,
     "copy_blocks(blocks): memmove each (source, target, length) of a list, addresses of this "
     "process, the GIL let go once around them all when they move 256 KiB or more"},
    {NULL, NULL, 0, NULL},
};

int
blockcopy_add(PyObject *m)
{
    return PyModule_AddFunctions(m, blockcopy_methods);
}
