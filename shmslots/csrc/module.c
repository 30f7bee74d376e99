/* shmslots._core: the module, made of its files (core.h says which does what), and, in
 * the test build only, the kill points that SIGKILL this process inside a compiled step. */
#include "core.h"
#include <signal.h>
#include <string.h>

const TensorApi *tensor_api;

/* The torch imported is the one shmslots._tensors was built against, or ImportError saying
 * so: torch's C++ API has no stable ABI, and a mismatch could crash later or fail to load
 * with a missing symbol, which says nothing of the cause.  0, or -1 with the error set. */
static int
same_torch(void)
{
    PyObject *torch = PyImport_ImportModule("torch"); /* its libraries _tensors links, too */
    PyObject *version = torch ? PyObject_GetAttrString(torch, "__version__") : NULL;
    Py_XDECREF(torch);
    if (!version)
        return -1;
    const char *running = PyUnicode_Check(version) ? PyUnicode_AsUTF8(version) : NULL;
    int same = running && strcmp(running, SHMSLOTS_TORCH_VERSION) == 0;
    if (!same && !PyErr_Occurred())
        PyErr_Format(PyExc_ImportError,
                     "shmslots was built against torch %s, but torch %s is installed: build it "
                     "again against this one (from a checkout: pip install --no-build-isolation "
                     "-e .; from an index: pip install --force-reinstall --no-deps "
                     "--no-cache-dir --no-binary shmslots --no-build-isolation shmslots)",
                     SHMSLOTS_TORCH_VERSION, running ? running : "of an unknown version");
    Py_DECREF(version);
    return same ? 0 : -1;
}

int
bind_tensors(void)
{
    if (tensor_api)
        return 0;
    if (same_torch() < 0)
        return -1;
    PyObject *m = PyImport_ImportModule("shmslots._tensors"); /* PyCapsule_Import does not */
    if (!m)
        return -1;
    Py_DECREF(m);
    tensor_api = PyCapsule_Import(TENSORS_CAPSULE, 0);
    return tensor_api ? 0 : -1;
}

#ifdef SHMSLOTS_KILL_POINTS
static int kill_at = KILL_NONE;

void
kill_point(int point)
{
    if (kill_at == point)
        raise(SIGKILL);
}

/* _kill_at(point): SIGKILL at that point of a later step (KILL_POINTS names them); for
 * tests, which set it in a child; 0 is never a point. */
static PyObject *
core_kill_at(PyObject *module, PyObject *point)
{
    long p = PyLong_AsLong(point);
    if (p == -1 && PyErr_Occurred())
        return NULL;
    if (p < KILL_NONE || p >= KILL_COUNT)
        return PyErr_Format(PyExc_ValueError, "no kill point %ld", p);
    kill_at = (int)p;
    Py_RETURN_NONE;
}

/* KILL_POINTS, each point by name; 0, or -1 with an error set. */
static int
add_kill_points(PyObject *m)
{
    return add_owned(m, "KILL_POINTS",
                     Py_BuildValue("{sisisisisi}", "QUARANTINED", KILL_QUARANTINED, "RECLAIMING",
                                   KILL_RECLAIMING, "PUBLISH_SEALED", KILL_PUBLISH_SEALED,
                                   "KEEP_SEALED", KILL_KEEP_SEALED, "KEEP_HELD", KILL_KEEP_HELD));
}
#else
static int
add_kill_points(PyObject *m)
{
    return 0;
}
#endif

void
table_closed_error(const char *message)
{
    PyObject *errors = PyImport_ImportModule("shmslots.errors");
    PyObject *type = errors ? PyObject_GetAttrString(errors, "TableClosed") : NULL;
    Py_XDECREF(errors);
    PyErr_Clear();
    PyErr_SetString(type ? type : PyExc_ValueError, message);
    Py_XDECREF(type);
}

int
add_owned(PyObject *m, const char *name, PyObject *value)
{
    int rc = value ? PyModule_AddObjectRef(m, name, value) : -1;
    Py_XDECREF(value);
    return rc;
}

static PyMethodDef module_methods[] = {
#ifdef SHMSLOTS_KILL_POINTS
    {"_kill_at", core_kill_at, METH_O, "_kill_at(point): SIGKILL inside a step (tests)"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shmslots._core",
    "The compiled core: atomics, the slot protocol's steps, row copies, handle fast paths.", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    if (atomic_add(m) < 0 || arena_add(m) < 0 || hotpath_add(m) < 0 || rowcodec_add(m) < 0 ||
        refcodec_add(m) < 0 || leases_add(m) < 0 || blockcopy_add(m) < 0 ||
        add_kill_points(m) < 0 ||
        PyModule_AddIntConstant(m, "STEP_DONE", STEP_DONE) < 0 ||
        PyModule_AddIntConstant(m, "STEP_REFUSED", STEP_REFUSED) < 0 ||
        PyModule_AddIntConstant(m, "STEP_QUEUE_FULL", STEP_QUEUE_FULL) < 0 ||
        add_owned(m, "WORD_BITS",
                  Py_BuildValue("{sisisisi}", "OWNER_SHIFT", OWNER_SHIFT, "GEN_SHIFT", GEN_SHIFT,
                                "FIELD_BITS", 16, "GEN_BITS", 32)) < 0 ||
        add_owned(m, "CELL_BITS",
                  Py_BuildValue("{sisisi}", "POS_SHIFT", POS_SHIFT, "POS_BITS", POS_BITS,
                                "FULL_BIT", POS_SHIFT - 1)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
