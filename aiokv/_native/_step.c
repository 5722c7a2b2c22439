/* The hot path of Request.step() and Offloader.step_batch(), in C.
 *
 * Every engine step calls step() once per running request, so its fixed cost is paid millions of times a
 * minute; in Python the checks alone (thread, state, types, ranges, block membership) were most of aiokv's
 * per-step cost. This module only *accelerates*: the Python method stays the one definition of what a step
 * means. The C path takes the common case -- a running request fed exact ints in exact lists or tuples that
 * pass every check -- and applies it exactly as the Python fast path does; on anything else it changes
 * nothing and calls the Python method, which decides it the usual way and raises the usual errors.
 * tests/core/test_native_step.py drives both paths with the same random schedules and compares them.
 *
 * The request's attributes are __slots__: configure() reads their offsets from the class's member
 * descriptors once, so reading one here is a load, not a dictionary lookup.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>

enum {
    S_STATE,
    S_ABORT,
    S_HIT,
    S_COMPUTED,
    S_TOKENS,
    S_BLOCKS,
    S_HELD,
    S_UPTO,
    S_OFF,
    S_TID,
    S_BS,
    S_NBLK,
    S_COUNT
};

static const char *const slot_names[S_COUNT] = {
    "_state", "_abort_requested", "_hit_blocks", "num_computed_tokens", "_token_ids", "_blocks", "_block_set",
    "_stored_upto", "_off", "_tid", "_bs", "_nblk",
};

/* Set by configure(); until then every call takes the Python path. */
static PyTypeObject *request_type = NULL;
static PyObject *running_state = NULL;
static PyObject *store_hook = NULL; /* interned "_step_store" */
static Py_ssize_t slot_offset[S_COUNT];

#define SLOT(obj, i) (*(PyObject **)((char *)(obj) + slot_offset[i]))

/* The value of an exact int that fits a long long; 0 (with no exception set) when it is not one. */
static inline int as_ll(PyObject *v, long long *out) {
    if (v == NULL || !PyLong_CheckExact(v)) return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return 0;
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = x;
    return 1;
}

static inline int set_slot(PyObject *obj, int i, PyObject *value) {
    PyObject *old = SLOT(obj, i);
    Py_INCREF(value);
    SLOT(obj, i) = value;
    Py_XDECREF(old);
    return 0;
}

/* Returns 1 when the step was applied, 0 when it must go to the Python method (nothing was changed), -1 on
 * an error raised while applying (the store hook's, or memory). Mirrors Request.step's Python fast path. */
static int fast_step(PyObject *req, PyObject *n, PyObject *toks, PyObject *ids) {
    long long nv, computed, bs, nblk, upto;
    if (running_state == NULL) return 0;
    /* The loop's thread: any other thread goes to the Python method, which raises WrongThreadError. */
    PyObject *tid = SLOT(req, S_TID);
    if (tid == NULL || !PyLong_CheckExact(tid)) return 0;
    unsigned long want = PyLong_AsUnsignedLong(tid);
    if (want == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (want != PyThread_get_thread_ident()) return 0;
    if (SLOT(req, S_STATE) != running_state || SLOT(req, S_ABORT) != Py_False || SLOT(req, S_HIT) != Py_None)
        return 0;
    if (!as_ll(n, &nv) || !as_ll(SLOT(req, S_COMPUTED), &computed) || nv < computed) return 0;
    if (!(PyList_CheckExact(toks) || PyTuple_CheckExact(toks)) || !(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)))
        return 0;
    if (!as_ll(SLOT(req, S_BS), &bs) || bs <= 0 || !as_ll(SLOT(req, S_NBLK), &nblk)) return 0;
    if (!as_ll(SLOT(req, S_UPTO), &upto)) return 0;
    PyObject *token_ids = SLOT(req, S_TOKENS), *blocks = SLOT(req, S_BLOCKS), *held = SLOT(req, S_HELD);
    if (token_ids == NULL || !PyList_CheckExact(token_ids) || blocks == NULL || !PyList_CheckExact(blocks) ||
        held == NULL || !PySet_CheckExact(held))
        return 0;
    /* The new tokens or blocks being one of the lists they are appended to (or one appended to first) would
     * move the items while they are read. */
    if (toks == token_ids || toks == blocks || ids == token_ids || ids == blocks) return 0;

    Py_ssize_t nt = PySequence_Fast_GET_SIZE(toks), ni = PySequence_Fast_GET_SIZE(ids);
    PyObject **tok_items = PySequence_Fast_ITEMS(toks), **id_items = PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t i = 0; i < nt; i++) {
        long long t;
        if (!as_ll(tok_items[i], &t)) return 0; /* not an exact int in the int64 range */
    }
    long long capacity_blocks = (long long)PyList_GET_SIZE(blocks);
    if (ni) {
        /* Small batches of new blocks (a decode step brings at most one) are checked pairwise; larger ones go
         * to the Python method, which builds a set. */
        if (ni > 32) return 0;
        long long seen[32];
        for (Py_ssize_t i = 0; i < ni; i++) {
            long long b;
            if (!as_ll(id_items[i], &b) || b < 0 || b >= nblk) return 0;
            int in_held = PySet_Contains(held, id_items[i]);
            if (in_held != 0) {
                if (in_held < 0) PyErr_Clear();
                return 0;
            }
            for (Py_ssize_t j = 0; j < i; j++)
                if (seen[j] == b) return 0;
            seen[i] = b;
        }
        capacity_blocks += ni;
    }
    if (nv > (long long)PyList_GET_SIZE(token_ids) + nt || nv > capacity_blocks * bs) return 0;

    /* Every check passed: apply, in the Python method's order. */
    for (Py_ssize_t i = 0; i < ni; i++) {
        if (PyList_Append(blocks, id_items[i]) < 0 || PySet_Add(held, id_items[i]) < 0) return -1;
    }
    for (Py_ssize_t i = 0; i < nt; i++) {
        if (PyList_Append(token_ids, tok_items[i]) < 0) return -1;
    }
    set_slot(req, S_COMPUTED, n);
    long long full = nv / bs;
    if (full > upto) {
        PyObject *old = PyLong_FromLongLong(upto), *new_full = PyLong_FromLongLong(full);
        if (old == NULL || new_full == NULL) {
            Py_XDECREF(old);
            Py_XDECREF(new_full);
            return -1;
        }
        set_slot(req, S_UPTO, new_full);
        /* The KV of this step may still be queued on the compute stream: the hook takes the ordering mark. */
        PyObject *r = PyObject_CallMethodObjArgs(req, store_hook, old, new_full, NULL);
        Py_DECREF(old);
        Py_DECREF(new_full);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 1;
}

/* ------------------------------------------------------------------ StepMethod: a method descriptor */

typedef struct {
    PyObject_HEAD
    PyObject *func; /* the Python step(self, num_computed_tokens, new_token_ids=(), new_block_ids=()) */
    vectorcallfunc vectorcall;
} StepMethod;

static PyObject *empty_tuple = NULL;

/* The parameter names of step(self, num_computed_tokens, new_token_ids=(), new_block_ids=()), interned by
 * the module's init; a keyword is matched by identity first (the compiler interns the names in a call), then
 * by value. */
static PyObject *param_names[3];

static inline int param_index(PyObject *name) {
    for (int i = 0; i < 3; i++)
        if (name == param_names[i]) return i;
    for (int i = 0; i < 3; i++)
        if (PyUnicode_CheckExact(name) && PyUnicode_Compare(name, param_names[i]) == 0) return i;
    if (PyErr_Occurred()) PyErr_Clear();
    return -1;
}

static PyObject *step_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (request_type != NULL && nargs >= 1 && nargs <= 4 && Py_IS_TYPE(args[0], request_type)) {
        /* Every documented convention: positional, keywords, or both. A keyword the method does not know, or
         * one given twice (by position and by name), goes to the Python method, which raises the TypeError. */
        PyObject *given[3] = {NULL, NULL, NULL};
        int ok = 1;
        for (Py_ssize_t i = 1; i < nargs; i++) given[i - 1] = args[i];
        if (kwnames != NULL) {
            Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
            for (Py_ssize_t k = 0; k < nk && ok; k++) {
                int at = param_index(PyTuple_GET_ITEM(kwnames, k));
                if (at < 0 || given[at] != NULL)
                    ok = 0;
                else
                    given[at] = args[nargs + k];
            }
        }
        if (ok && given[0] != NULL) {
            int r = fast_step(args[0], given[0], given[1] != NULL ? given[1] : empty_tuple,
                              given[2] != NULL ? given[2] : empty_tuple);
            if (r > 0) Py_RETURN_NONE;
            if (r < 0) return NULL;
        }
    }
    return PyObject_Vectorcall(((StepMethod *)self)->func, args, nargsf, kwnames);
}

static PyObject *StepMethod_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *func;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "StepMethod() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:StepMethod", &func)) return NULL;
    if (!PyCallable_Check(func)) {
        PyErr_SetString(PyExc_TypeError, "StepMethod() needs a callable");
        return NULL;
    }
    StepMethod *self = (StepMethod *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(func);
    self->func = func;
    self->vectorcall = step_vectorcall;
    return (PyObject *)self;
}

static int StepMethod_traverse(StepMethod *self, visitproc visit, void *arg) {
    Py_VISIT(self->func);
    return 0;
}

static int StepMethod_clear(StepMethod *self) {
    Py_CLEAR(self->func);
    return 0;
}

static void StepMethod_dealloc(StepMethod *self) {
    PyObject_GC_UnTrack(self);
    StepMethod_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *StepMethod_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type)) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

/* What introspection asks of a function (docs, inspect.signature via __wrapped__, help()) is the Python
 * method's. */
static PyObject *StepMethod_getattro(PyObject *self, PyObject *name) {
    PyObject *r = PyObject_GenericGetAttr(self, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    return PyObject_GetAttr(((StepMethod *)self)->func, name);
}

static PyObject *StepMethod_doc(StepMethod *self, void *Py_UNUSED(closure)) {
    return PyObject_GetAttrString(self->func, "__doc__");
}

static PyObject *StepMethod_repr(StepMethod *self) {
    return PyUnicode_FromFormat("<native step of %R>", self->func);
}

static PyMemberDef StepMethod_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(StepMethod, func), READONLY, "the Python method this accelerates"},
    {NULL},
};

static PyGetSetDef StepMethod_getset[] = {
    {"__doc__", (getter)StepMethod_doc, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject StepMethod_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aiokv._native._step.StepMethod",
    .tp_basicsize = sizeof(StepMethod),
    .tp_dealloc = (destructor)StepMethod_dealloc,
    .tp_vectorcall_offset = offsetof(StepMethod, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = (reprfunc)StepMethod_repr,
    .tp_getattro = StepMethod_getattro,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "Request.step with a C fast path; everything else goes to the wrapped Python method.",
    .tp_traverse = (traverseproc)StepMethod_traverse,
    .tp_clear = (inquiry)StepMethod_clear,
    .tp_members = StepMethod_members,
    .tp_getset = StepMethod_getset,
    .tp_descr_get = StepMethod_get,
    .tp_new = StepMethod_new,
};

/* ------------------------------------------------------------------ module functions */

static PyObject *configure(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *cls, *running;
    if (!PyArg_ParseTuple(args, "O!O:configure", &PyType_Type, &cls, &running)) return NULL;
    PyObject *dict = ((PyTypeObject *)cls)->tp_dict;
    Py_ssize_t offsets[S_COUNT];
    for (int i = 0; i < S_COUNT; i++) {
        PyObject *d = PyDict_GetItemString(dict, slot_names[i]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "configure(): %s.%s must be a __slots__ attribute",
                         ((PyTypeObject *)cls)->tp_name, slot_names[i]);
            return NULL;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "configure(): %s is not an object slot", slot_names[i]);
            return NULL;
        }
        offsets[i] = m->offset;
    }
    for (int i = 0; i < S_COUNT; i++) slot_offset[i] = offsets[i];
    Py_INCREF(cls);
    Py_XSETREF(request_type, (PyTypeObject *)cls);
    Py_INCREF(running);
    Py_XSETREF(running_state, running);
    Py_RETURN_NONE;
}

/* step_batch(off, updates, fallback): Offloader.step_batch. ``fallback(off, updates)`` is the Python
 * implementation: called for the whole batch when it is not a list or tuple or the thread is not the loop's,
 * and for each update the C path does not take (it raises that update's error, or applies it). */
static PyObject *step_batch(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "step_batch() takes 3 arguments");
        return NULL;
    }
    PyObject *off = args[0], *updates = args[1], *fallback = args[2];
    if (request_type == NULL || !(PyList_CheckExact(updates) || PyTuple_CheckExact(updates)))
        return PyObject_CallFunctionObjArgs(fallback, off, updates, NULL);
    /* Called from another thread, the Python implementation raises WrongThreadError (even for no updates). */
    PyObject *thread = PyObject_GetAttrString(off, "thread");
    if (thread == NULL) return NULL;
    unsigned long want = PyLong_Check(thread) ? PyLong_AsUnsignedLong(thread) : 0;
    Py_DECREF(thread);
    if (PyErr_Occurred()) PyErr_Clear();
    if (want == 0 || want != PyThread_get_thread_ident())
        return PyObject_CallFunctionObjArgs(fallback, off, updates, NULL);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(updates); i++) {
        /* Re-read every time: a hook may have changed the list (its items are borrowed only briefly). */
        PyObject *u = PySequence_Fast_GET_ITEM(updates, i);
        Py_INCREF(u);
        int r = 0;
        if (PyTuple_CheckExact(u) && PyTuple_GET_SIZE(u) == 4) {
            PyObject *req = PyTuple_GET_ITEM(u, 0);
            if (Py_IS_TYPE(req, request_type) && SLOT(req, S_OFF) == off)
                r = fast_step(req, PyTuple_GET_ITEM(u, 1), PyTuple_GET_ITEM(u, 2), PyTuple_GET_ITEM(u, 3));
        }
        if (r == 0) {
            PyObject *one = PyTuple_Pack(1, u);
            PyObject *res = one == NULL ? NULL : PyObject_CallFunctionObjArgs(fallback, off, one, NULL);
            Py_XDECREF(one);
            if (res == NULL) r = -1;
            Py_XDECREF(res);
        }
        Py_DECREF(u);
        if (r < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(request_class, running_state): read the slot offsets the fast path uses."},
    {"step_batch", (PyCFunction)(void (*)(void))step_batch, METH_FASTCALL,
     "step_batch(off, updates, fallback): Offloader.step_batch with a C fast path per update."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aiokv._native._step",
    .m_doc = "C fast path of Request.step and Offloader.step_batch.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__step(void) {
    if (PyType_Ready(&StepMethod_Type) < 0) return NULL;
    empty_tuple = PyTuple_New(0);
    store_hook = PyUnicode_InternFromString("_step_store");
    if (empty_tuple == NULL || store_hook == NULL) return NULL;
    static const char *const params[3] = {"num_computed_tokens", "new_token_ids", "new_block_ids"};
    for (int i = 0; i < 3; i++)
        if ((param_names[i] = PyUnicode_InternFromString(params[i])) == NULL) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&StepMethod_Type);
    if (PyModule_AddObject(m, "StepMethod", (PyObject *)&StepMethod_Type) < 0) {
        Py_DECREF(&StepMethod_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
