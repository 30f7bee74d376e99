// shmslots._tensors: a tensor's facts, and new tensors, through torch's C++ objects.
//
// rowcodec.c's rules once asked torch's Python API about ten attributes per tensor (~0.7 us,
// most of a small row's write); here the same facts cost one C++ read each.  The module is
// built against the torch it is installed beside (setup.py), and _core loads it beside that
// torch only: torch's C++ API has no stable ABI.  tensors.h says what each function promises.
#include "tensors.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COW.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <exception>
#include <new>
#include <unordered_map>

namespace {

// The C callers see Python errors only: what torch threw is worded as one (without the C++
// backtrace torch's errors carry).
void set_error(const std::exception &e)
{
    auto torch_error = dynamic_cast<const c10::Error *>(&e);
    if (dynamic_cast<const std::bad_alloc *>(&e) || dynamic_cast<const c10::OutOfMemoryError *>(&e))
        PyErr_NoMemory();
    else
        PyErr_SetString(PyExc_RuntimeError,
                        torch_error ? torch_error->what_without_backtrace() : e.what());
}

int device_of(c10::DeviceType type)
{
    switch (type) {
    case c10::DeviceType::CPU: return DEVICE_CPU;
    case c10::DeviceType::CUDA: return DEVICE_CUDA;
    default: return DEVICE_OTHER;
    }
}

// The storage facts, when torch shows them; `readable` stays 0 when it throws instead
// (a storage that refuses access, symbolic sizes).
void read_storage(c10::TensorImpl *impl, TensorFacts *f)
{
    if (impl->layout() != c10::kStrided || !impl->has_storage())
        return;
    try {
        f->strides = impl->strides().data();
        f->contiguous = impl->is_contiguous();
        f->negated = impl->is_neg();
        f->storage_offset = impl->storage_offset();
        const c10::Storage &storage = impl->storage();
        f->storage_nbytes = static_cast<int64_t>(storage.nbytes());
        f->lazy = c10::impl::cow::is_cow_data_ptr(storage.data_ptr());
        const char *base = static_cast<const char *>(storage.data());
        f->data = base ? const_cast<char *>(base) + f->storage_offset * impl->itemsize() : nullptr;
        f->readable = 1;
    } catch (const c10::Error &) {
        f->strides = nullptr;
    }
}

int facts(PyObject *tensor, TensorFacts *f)
{
    *f = TensorFacts{};
    const at::Tensor &t = THPVariable_Unpack(tensor);
    if (!t.defined()) {
        PyErr_SetString(PyExc_RuntimeError, "an undefined tensor");
        return -1;
    }
    c10::TensorImpl *impl = t.unsafeGetTensorImpl();
    f->dtype = static_cast<int>(impl->dtype().toScalarType());
    f->device = device_of(impl->device_type());
    f->ndim = -1;
    // A __torch_dispatch__ subclass answers size and storage queries in Python, if at all:
    // its facts are not read (ndim -1: no shape, no storage).
    if (impl->is_python_dispatch())
        return 0;
    try {
        c10::IntArrayRef sizes = impl->sizes();
        f->sizes = sizes.data();
        f->ndim = static_cast<int>(sizes.size());
    } catch (const c10::Error &) { // nested tensors have no sizes
        return 0;
    }
    read_storage(impl, f);
    return 0;
}

PyObject *empty(int dtype, int ndim, const int64_t *sizes)
{
    try {
        at::TensorBase made = at::detail::empty_cpu(
            c10::IntArrayRef(sizes, static_cast<size_t>(ndim)), static_cast<c10::ScalarType>(dtype));
        return THPVariable_Wrap(std::move(made));
    } catch (const std::exception &e) {
        set_error(e);
        return nullptr;
    }
}

PyObject *over(char *data, int dtype, int ndim, const int64_t *sizes, void (*done)(void *),
               void *ctx)
{
    // The DataPtr owns `ctx` from its first line: whatever fails after, `done` runs once.
    c10::DataPtr bytes(data, ctx, done, c10::Device(c10::DeviceType::CPU));
    try {
        auto type = static_cast<c10::ScalarType>(dtype);
        c10::IntArrayRef shape(sizes, static_cast<size_t>(ndim));
        size_t nbytes = c10::elementSize(type);
        for (int64_t size : shape)
            nbytes *= static_cast<size_t>(size);
        c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(bytes), nullptr,
                             false);
        at::Tensor made = at::detail::make_tensor<c10::TensorImpl>(
            std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
            c10::scalarTypeToTypeMeta(type));
        made.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
        return THPVariable_Wrap(std::move(made));
    } catch (const std::exception &e) {
        set_error(e);
        return nullptr;
    }
}

int dtype_of(PyObject *dtype)
{
    if (!THPDtype_Check(dtype)) {
        PyErr_Format(PyExc_TypeError, "not a torch.dtype: %.100s", Py_TYPE(dtype)->tp_name);
        return -1;
    }
    return static_cast<int>(reinterpret_cast<THPDtype *>(dtype)->scalar_type);
}

Py_ssize_t storage_uses(PyObject *storage)
{
    if (!THPStorage_Check(storage)) {
        PyErr_Format(PyExc_TypeError, "not a torch.UntypedStorage: %.100s",
                     Py_TYPE(storage)->tp_name);
        return -1;
    }
    return static_cast<Py_ssize_t>(THPStorage_Unpack(storage).use_count());
}

// The storages pinned now, each with its pins and whether it was resizable before the first.
// Only touched with the GIL held.
struct Pinned {
    c10::Storage storage;
    Py_ssize_t pins;
    bool was_resizable;
};
std::unordered_map<c10::StorageImpl *, Pinned> *pinned;

void *pin(PyObject *tensor)
{
    try {
        if (!pinned)
            pinned = new std::unordered_map<c10::StorageImpl *, Pinned>();
        const c10::Storage &storage = THPVariable_Unpack(tensor).storage();
        c10::StorageImpl *impl = storage.unsafeGetStorageImpl();
        auto [at, first] = pinned->try_emplace(impl, Pinned{storage, 0, impl->resizable()});
        if (first)
            impl->set_resizable(false);
        at->second.pins++;
        return impl;
    } catch (const std::exception &e) {
        set_error(e);
        return nullptr;
    }
}

void unpin(void *handle)
{
    auto at = pinned->find(static_cast<c10::StorageImpl *>(handle));
    if (--at->second.pins)
        return;
    c10::Storage storage = std::move(at->second.storage);
    if (at->second.was_resizable)
        storage.unsafeGetStorageImpl()->set_resizable(true);
    pinned->erase(at);
} // `storage` goes last, after the map is done: it may free the storage, its tensors gone

const TensorApi api = {facts, empty, over, dtype_of, storage_uses, pin, unpin};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmslots._tensors",
    "A tensor's facts and new tensors through torch's C++ objects (capsule API).",
    -1, nullptr, nullptr, nullptr, nullptr, nullptr,
};

} // namespace

// Loaded by _core's bind_tensors only, once it has checked that the torch imported is the
// one this was built against (SHMSLOTS_TORCH_VERSION, given to both modules by setup.py).
extern "C" __attribute__((visibility("default"))) PyObject *PyInit__tensors(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return nullptr;
    PyObject *capsule = PyCapsule_New(const_cast<TensorApi *>(&api), TENSORS_CAPSULE, nullptr);
    int failed = !capsule || PyModule_AddObjectRef(m, "API", capsule) < 0;
    Py_XDECREF(capsule);
    if (failed)
        Py_CLEAR(m);
    return m;
}
