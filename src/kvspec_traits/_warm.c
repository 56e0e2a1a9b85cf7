/* The warm path of Registry.traits_of in C: one dict lookup by object identity.
 *
 * A Python function costs a frame on every call, which alone is more than an isinstance
 * check; connectors ask traits per layer, so the lookup has to cost about what the
 * isinstance tuple it replaces costs. WarmCache(by_id, resolve)(spec) returns
 * by_id[id(spec)] when present, else resolve(spec). The registry keeps every cached spec
 * alive, so an id in by_id cannot belong to another live object. Optional: without a C
 * compiler the pure-Python closure in _registry.py is used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    PyObject *by_id;   /* dict: int -> traits */
    PyObject *resolve; /* callable(spec) -> traits */
    vectorcallfunc vectorcall;
} WarmCache;

static PyObject *
warm_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    WarmCache *self = (WarmCache *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "traits_of() takes exactly one spec argument");
        return NULL;
    }
    PyObject *key = PyLong_FromVoidPtr((void *)args[0]);
    if (key == NULL) {
        return NULL;
    }
    PyObject *hit = PyDict_GetItemWithError(self->by_id, key); /* borrowed */
    Py_DECREF(key);
    if (hit != NULL) {
        Py_INCREF(hit);
        return hit;
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    return PyObject_CallOneArg(self->resolve, args[0]);
}

static PyObject *
warm_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *by_id, *resolve;
    static char *kwlist[] = {"by_id", "resolve", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O:WarmCache", kwlist, &PyDict_Type,
                                     &by_id, &resolve)) {
        return NULL;
    }
    if (!PyCallable_Check(resolve)) {
        PyErr_SetString(PyExc_TypeError, "WarmCache: resolve must be callable");
        return NULL;
    }
    WarmCache *self = (WarmCache *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_INCREF(by_id);
    Py_INCREF(resolve);
    self->by_id = by_id;
    self->resolve = resolve;
    self->vectorcall = warm_vectorcall;
    return (PyObject *)self;
}

static int
warm_traverse(WarmCache *self, visitproc visit, void *arg)
{
    Py_VISIT(self->by_id);
    Py_VISIT(self->resolve);
    return 0;
}

static int
warm_clear(WarmCache *self)
{
    Py_CLEAR(self->by_id);
    Py_CLEAR(self->resolve);
    return 0;
}

static void
warm_dealloc(WarmCache *self)
{
    PyObject_GC_UnTrack(self);
    warm_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject WarmCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvspec_traits._warm.WarmCache",
    .tp_doc = "traits_of(spec) -> KVLayoutTraits: the verified traits of a vLLM KV cache spec.\n\n"
              "Raises UnsupportedSpecError when no adapter can answer for its class and\n"
              "TraitsMismatchError when its adapter contradicts the spec's own byte math.\n"
              "The first call per distinct spec resolves and verifies; later calls for the\n"
              "same object are one dict lookup (this C object: by_id[id(spec)], else\n"
              "resolve(spec)).",
    .tp_basicsize = sizeof(WarmCache),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = warm_new,
    .tp_dealloc = (destructor)warm_dealloc,
    .tp_traverse = (traverseproc)warm_traverse,
    .tp_clear = (inquiry)warm_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(WarmCache, vectorcall),
};

static struct PyModuleDef warm_module = {
    PyModuleDef_HEAD_INIT, "kvspec_traits._warm", "C warm path of Registry.traits_of.", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__warm(void)
{
    if (PyType_Ready(&WarmCacheType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&warm_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&WarmCacheType);
    if (PyModule_AddObject(m, "WarmCache", (PyObject *)&WarmCacheType) < 0) {
        Py_DECREF(&WarmCacheType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
