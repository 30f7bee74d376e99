/* blockcopy.c: the same-host engine's host copies (shmslots/sglang/samehost/engine.py).
 *
 * A job's blocks, (source, target, length) between addresses of this process that the
 * engine's planner has placed inside registered memory, are copied in one call.  The GIL is
 * let go once around them all, and only where they move enough bytes for other threads to
 * gain from it.  ctypes.memmove let it go at every block, and each block then waited to get
 * it back behind any busy Python thread of the process: a 14-block aux row took about 8 ms
 * beside one such thread, against 50 us without it.
 *
 * Large blocks are written with non-temporal stores where the CPU has them (SSE2: every
 * x86-64).  The target is another process's memory, which this one never reads back: a
 * cached store first reads each target line (a read for ownership) and then evicts this
 * process's own working set to hold it.  Here a 16 MiB request's 128 KiB pages went at 6.8
 * GB/s a core with memmove and 10-11 GB/s streamed (25 GB/s on two cores against 13).
 */
#include "core.h"

#include <string.h>

/* Below this many bytes a call keeps the GIL: its copies take a few microseconds, less than
 * waiting to get the GIL back could. */
#define RELEASE_BYTES (256 * 1024)

/* A block of at least this many bytes is streamed past the cache: below it the fence at
 * the end costs more than the reads it saves, and a small block (an aux row's field) is
 * read by its receiver at once, from cache if it stays there.  0: no streaming built. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define STREAM_BYTES (64 * 1024)
#else
#define STREAM_BYTES 0
#endif

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

#if STREAM_BYTES
/* memcpy of disjoint ranges with non-temporal stores: 16-byte aligned target stores after an
 * unaligned head; the caller fences once after its last. */
static void
stream_copy(char *target, const char *source, size_t length)
{
    size_t head = (16 - ((uintptr_t)target & 15)) & 15;
    if (head > length)
        head = length;
    memcpy(target, source, head);
    size_t i = head;
    for (; i + 64 <= length; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(source + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(source + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(source + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(source + i + 48));
        _mm_stream_si128((__m128i *)(target + i), a);
        _mm_stream_si128((__m128i *)(target + i + 16), b);
        _mm_stream_si128((__m128i *)(target + i + 32), c);
        _mm_stream_si128((__m128i *)(target + i + 48), d);
    }
    memcpy(target + i, source + i, length - i);
}

/* Whether a block is streamed: long enough, and its source and target apart (by modular
 * differences: no pointer arithmetic past either range, no wrap). */
static int
streams(const Block *b)
{
    uintptr_t t = (uintptr_t)b->target, s = (uintptr_t)b->source;
    return b->length >= STREAM_BYTES && t - s >= b->length && s - t >= b->length;
}
#endif

/* Copy every block, in order; streamed ones are fenced before this returns, so that the
 * copies are as visible to the receiver, once the caller says they are done, as memmove's. */
static void
copy_all(const Block *all, Py_ssize_t count)
{
#if STREAM_BYTES
    int streamed = 0;
#endif
    for (Py_ssize_t i = 0; i < count; i++) {
        const Block *b = &all[i];
#if STREAM_BYTES
        if (streams(b)) {
            stream_copy(b->target, b->source, b->length);
            streamed = 1;
            continue;
        }
#endif
        memmove(b->target, b->source, b->length);
    }
#if STREAM_BYTES
    if (streamed) /* here: a locked instruction (the engine's fence()) orders no stream */
        _mm_sfence();
#endif
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
    /* a block's source and target may overlap (the planner allows it): those are memmoved */
    if (total >= RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_all(all, count);
        Py_END_ALLOW_THREADS
    } else {
        copy_all(all, count);
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
    if (PyModule_AddIntConstant(m, "COPY_STREAM_BYTES", STREAM_BYTES) < 0)
        return -1;
    return PyModule_AddFunctions(m, blockcopy_methods);
}
