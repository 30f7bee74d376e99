/* shmslots._tensors: what the C files learn of a torch tensor, and the tensors they make,
 * through torch's C++ objects (tensors.cpp) instead of a Python call per attribute.
 *
 * The module exports one capsule, API (TENSORS_CAPSULE), of the functions below; core.h's
 * `tensor_api` points at it once bind_tensors() has run, which loads the module beside the
 * torch it was built against only (SHMSLOTS_TORCH_VERSION).  A fact read here runs no Python: no
 * subclass's __torch_function__, no mode and no method set on the instance answers for the
 * tensor.  What the facts *mean* (which tensors may be copied as bytes) is rowcodec.c's
 * rules; this file only reads.
 */
#ifndef SHMSLOTS_TENSORS_H
#define SHMSLOTS_TENSORS_H

#include <Python.h>
#include <stdint.h>

#define TENSORS_CAPSULE "shmslots._tensors.API"

enum { DEVICE_CPU, DEVICE_CUDA, DEVICE_OTHER };

typedef struct {
    int dtype;              /* torch's ScalarType number */
    int ndim;
    const int64_t *sizes;   /* ndim each, valid while the tensor is not changed */
    const int64_t *strides; /* NULL when `readable` is 0 */
    int device;             /* DEVICE_* */
    /* 1: strided, its storage shown (not sparse, nested, a __torch_dispatch__ subclass or
     * one whose storage access throws); the fields below are then filled. */
    int readable;
    int contiguous, negated;
    int lazy;               /* a lazy clone's storage, shared until written (torch._lazy_clone) */
    int64_t storage_offset; /* in elements */
    int64_t storage_nbytes;
    char *data;             /* the first element (NULL for a storage with no data) */
} TensorFacts;

typedef struct {
    /* The facts of `tensor`, an instance of torch.Tensor (the caller checks the type).
     * 0, or -1 with an error set (an undefined tensor). */
    int (*facts)(PyObject *tensor, TensorFacts *f);
    /* A new contiguous CPU tensor, made by torch's CPU allocator directly (no dispatch: no
     * mode answers with another tensor); NULL with an error set. */
    PyObject *(*empty)(int dtype, int ndim, const int64_t *sizes);
    /* A contiguous CPU tensor over `data`, with a storage of its own and no base; `done(ctx)`
     * runs, with the GIL taken, when that storage is freed (at once if this fails). */
    PyObject *(*over)(char *data, int dtype, int ndim, const int64_t *sizes,
                      void (*done)(void *ctx), void *ctx);
    /* The ScalarType number of a torch.dtype, or -1 with an error set. */
    int (*dtype_of)(PyObject *dtype);
    /* The use count of a torch.UntypedStorage's storage, or -1 with an error set. */
    Py_ssize_t (*storage_uses)(PyObject *storage);
    /* Keep `tensor`'s bytes where they are while a copy reads them with the GIL released:
     * a reference to its storage (so neither its last tensor nor set_ frees it) and, while
     * any pin holds it, the storage made not resizable (so resize_ raises instead of freeing
     * it).  Both run with the GIL held, which orders the pins; unpin(pin(t)) once each.
     * NULL with an error set. */
    void *(*pin)(PyObject *tensor);
    void (*unpin)(void *pinned);
} TensorApi;

#endif
