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
#include <stdint.h>
#include <string.h>

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
    S_EPOCH,
    S_EVENTS,
    S_WAITER,
    S_CAP,
    S_FAILED,
    S_HASHES,
    S_TENANT,
    S_PRIO,
    S_INFLIGHT,
    S_COUNT
};

static const char *const slot_names[S_COUNT] = {
    "_state", "_abort_requested", "_hit_blocks", "num_computed_tokens", "_token_ids", "_blocks", "_block_set",
    "_stored_upto", "_off", "_tid", "_bs", "_nblk", "_epoch", "_events", "_waiter", "_store_cap", "_failed_epoch",
    "_hashes", "_tenant", "priority", "_in_flight",
};

/* Set by configure(); until then every call takes the Python path. */
static PyTypeObject *request_type = NULL;
static PyObject *running_state = NULL;
static PyObject *store_hook = NULL; /* interned "_step_store" */
static PyObject *str_device, *str_deferred, *str_executor, *str_schedule_flush, *str_done, *str_pop;
static Py_ssize_t slot_offset[S_COUNT];

#define SLOT(obj, i) (*(PyObject **)((char *)(obj) + slot_offset[i]))

/* The value of an exact int that fits a long long; 0 (with no exception set) when it is not one. Token ids,
 * block ids and counts are almost always one-digit ints: read inline, without a call. */
static inline int as_ll(PyObject *v, long long *out) {
    if (v == NULL || !PyLong_CheckExact(v)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)v);
        return 1;
    }
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size == 0 || size == 1 || size == -1) {
        *out = (long long)size * (long long)((PyLongObject *)v)->ob_digit[0];
        return 1;
    }
#endif
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

/* list.append for a list this module owns the growth of: the same as PyList_Append, except that a full list
 * grows by half its size rather than CPython's eighth, so a request's token list, appended to on every step,
 * is reallocated (and copied) a third as often. */
static inline int append_grow(PyObject *list, PyObject *item) {
    PyListObject *l = (PyListObject *)list;
    Py_ssize_t n = Py_SIZE(l);
    if (n < l->allocated) {
        Py_INCREF(item);
        l->ob_item[n] = item;
        Py_SET_SIZE(l, n + 1);
        return 0;
    }
    if (n >= 64 && n < PY_SSIZE_T_MAX / (2 * (Py_ssize_t)sizeof(PyObject *))) {
        Py_ssize_t want = n + (n >> 1);
        PyObject **items = PyMem_Realloc(l->ob_item, (size_t)want * sizeof(PyObject *));
        if (items != NULL) {
            l->ob_item = items;
            l->allocated = want;
            Py_INCREF(item);
            items[n] = item;
            Py_SET_SIZE(l, n + 1);
            return 0;
        }
    }
    return PyList_Append(list, item);
}

/* The loop's thread id as the requests hold it: one int object shared by every request of an offloader
 * (Request._tid = off.thread), so its value is cached by identity. */
static PyObject *tid_obj = NULL; /* a strong reference: its address is not reused while it is cached */
static unsigned long tid_val = 0;

static inline int set_slot(PyObject *obj, int i, PyObject *value) {
    PyObject *old = SLOT(obj, i);
    Py_INCREF(value);
    SLOT(obj, i) = value;
    Py_XDECREF(old);
    return 0;
}

/* Request._step_store(upto, full), inline for the CPU backend (the case every decode step of a CPU engine
 * takes): the store joins the tick's deferred stores (``off.deferred``), and the first of a tick makes sure the
 * executor flushes at its end. Anything else (a device binding, an unexpected host) calls the Python method,
 * the definition. Returns 0, or -1 with an exception set. */
static int defer_store(PyObject *req, PyObject *upto, PyObject *full) {
    PyObject *off = SLOT(req, S_OFF), *deferred = NULL;
    PyObject *device = off == NULL ? NULL : PyObject_GetAttr(off, str_device);
    if (device == NULL) return -1;
    int on_device = device != Py_None;
    Py_DECREF(device);
    if (!on_device) {
        deferred = PyObject_GetAttr(off, str_deferred);
        if (deferred == NULL) return -1;
    }
    if (on_device || !PyList_CheckExact(deferred)) {
        Py_XDECREF(deferred);
        PyObject *r = PyObject_CallMethodObjArgs(req, store_hook, upto, full, NULL);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    if (PyList_GET_SIZE(deferred) == 0) {
        PyObject *executor = PyObject_GetAttr(off, str_executor);
        PyObject *r = executor == NULL ? NULL : PyObject_CallMethodNoArgs(executor, str_schedule_flush);
        Py_XDECREF(executor);
        if (r == NULL) {
            Py_DECREF(deferred);
            return -1;
        }
        Py_DECREF(r);
    }
    PyObject *blocks = SLOT(req, S_BLOCKS), *epoch = SLOT(req, S_EPOCH);
    PyObject *entry = (blocks == NULL || epoch == NULL) ? NULL : PyTuple_Pack(5, req, upto, full, blocks, epoch);
    int rc = entry == NULL ? -1 : PyList_Append(deferred, entry);
    if (entry == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "request slot unset");
    Py_XDECREF(entry);
    Py_DECREF(deferred);
    return rc;
}

/* Returns 1 when the step was applied, 0 when it must go to the Python method (nothing was changed), -1 on
 * an error raised while applying (the store hook's, or memory). Mirrors Request.step's Python fast path. */
static int fast_step(PyObject *req, PyObject *n, PyObject *toks, PyObject *ids) {
    long long nv, computed, bs, nblk, upto;
    if (running_state == NULL) return 0;
    /* With many requests the token list and the block table are rarely in cache: start loading them now, so
     * the misses overlap with the checks below instead of following them. */
    __builtin_prefetch(SLOT(req, S_TOKENS));
    __builtin_prefetch(SLOT(req, S_BLOCKS));
    /* The loop's thread: any other thread goes to the Python method, which raises WrongThreadError. */
    PyObject *tid = SLOT(req, S_TID);
    unsigned long want;
    if (tid != NULL && tid == tid_obj) {
        want = tid_val;
    } else {
        if (tid == NULL || !PyLong_CheckExact(tid)) return 0;
        want = PyLong_AsUnsignedLong(tid);
        if (want == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    if (want != PyThread_get_thread_ident()) return 0;
    if (tid != tid_obj) {
        /* Cache it (kept alive here, so its address cannot be reused by another int). */
        Py_INCREF(tid);
        Py_XSETREF(tid_obj, tid);
        tid_val = want;
    }
    if (SLOT(req, S_STATE) != running_state || SLOT(req, S_ABORT) != Py_False || SLOT(req, S_HIT) != Py_None)
        return 0;
    if (!as_ll(n, &nv) || !as_ll(SLOT(req, S_COMPUTED), &computed) || nv < computed) return 0;
    if (!(PyList_CheckExact(toks) || PyTuple_CheckExact(toks)) || !(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)))
        return 0;
    if (!as_ll(SLOT(req, S_BS), &bs) || bs <= 0 || !as_ll(SLOT(req, S_NBLK), &nblk)) return 0;
    if (!as_ll(SLOT(req, S_UPTO), &upto)) return 0;
    PyObject *token_ids = SLOT(req, S_TOKENS), *blocks = SLOT(req, S_BLOCKS), *held = SLOT(req, S_HELD);
    if (token_ids == NULL || !PyList_CheckExact(token_ids) || blocks == NULL || !PyList_CheckExact(blocks)) return 0;
    /* Where the token is appended (read before the checks finish, for the same reason). */
    __builtin_prefetch(((PyListObject *)token_ids)->ob_item + PyList_GET_SIZE(token_ids), 1);
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
        if (ni > 32 || held == NULL || !PySet_CheckExact(held)) return 0; /* the set is read only for new blocks */
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
        if (append_grow(token_ids, tok_items[i]) < 0) return -1;
    }
    set_slot(req, S_COMPUTED, n);
    /* nv / bs > upto, without the division on the steps that complete no block (15 of 16 at block 16). */
    long long next_edge;
    if (upto >= 0 && upto < LLONG_MAX && !__builtin_mul_overflow(upto + 1, bs, &next_edge) && nv < next_edge) return 1;
    long long full = nv / bs;
    if (full > upto) {
        PyObject *old = PyLong_FromLongLong(upto), *new_full = PyLong_FromLongLong(full);
        if (old == NULL || new_full == NULL) {
            Py_XDECREF(old);
            Py_XDECREF(new_full);
            return -1;
        }
        set_slot(req, S_UPTO, new_full);
        /* On a device the KV of this step may still be queued on the compute stream: the Python hook takes the
         * ordering mark. */
        int rc = defer_store(req, old, new_full);
        Py_DECREF(old);
        Py_DECREF(new_full);
        if (rc < 0) return -1;
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


/* ------------------------------------------------------------------ the tick's decode stores */

#define PENDING 1 /* aiokv/tiers/_index.py's _PENDING */

/* The index's structures flush_plain writes, read once per call. */
typedef struct {
    PyObject *slots, *state, *free, *key_of, *parent_of;
    Py_buffer depth, prio;
    int have_depth, have_prio;
} IndexView;

static void index_view_release(IndexView *v) {
    Py_XDECREF(v->slots);
    Py_XDECREF(v->state);
    Py_XDECREF(v->free);
    Py_XDECREF(v->key_of);
    Py_XDECREF(v->parent_of);
    if (v->have_depth) PyBuffer_Release(&v->depth);
    if (v->have_prio) PyBuffer_Release(&v->prio);
}

static int index_view(PyObject *index, IndexView *v) {
    memset(v, 0, sizeof(*v));
    v->slots = PyObject_GetAttrString(index, "_slots");
    v->state = PyObject_GetAttrString(index, "_state");
    v->free = PyObject_GetAttrString(index, "_free");
    v->key_of = PyObject_GetAttrString(index, "_keys");
    v->parent_of = PyObject_GetAttrString(index, "_parent");
    PyObject *depth = PyObject_GetAttrString(index, "_depth"), *prio = PyObject_GetAttrString(index, "_prio");
    int ok = v->slots && v->state && v->free && v->key_of && v->parent_of && depth && prio;
    if (ok && PyObject_GetBuffer(depth, &v->depth, PyBUF_WRITABLE | PyBUF_FORMAT) == 0) v->have_depth = 1;
    if (ok && v->have_depth && PyObject_GetBuffer(prio, &v->prio, PyBUF_WRITABLE | PyBUF_FORMAT) == 0) v->have_prio = 1;
    Py_XDECREF(depth);
    Py_XDECREF(prio);
    if (!ok || !v->have_depth || !v->have_prio) {
        index_view_release(v);
        return -1;
    }
    Py_ssize_t n = PyByteArray_Check(v->state) ? PyByteArray_GET_SIZE(v->state) : -1;
    if (!PyDict_CheckExact(v->slots) || n < 0 || !PyList_CheckExact(v->key_of) || !PyList_CheckExact(v->parent_of) ||
        PyList_GET_SIZE(v->key_of) != n || PyList_GET_SIZE(v->parent_of) != n || v->depth.itemsize != 4 ||
        v->depth.format == NULL || strcmp(v->depth.format, "I") != 0 || v->depth.len != 4 * n ||
        v->prio.itemsize != 1 || v->prio.format == NULL || strcmp(v->prio.format, "b") != 0 || v->prio.len != n) {
        index_view_release(v);
        PyErr_SetString(PyExc_TypeError, "flush_plain(): unexpected index structures");
        return -1;
    }
    return 0;
}

/* flush_plain(entries, start, block_size, chain, index, keys, slots, ids, owners) -> (next, reserved)
 *
 * Offloader._flush_deferred's loop for its common entries, in C: one decode block ``(req, i, i + 1, blocks,
 * epoch)`` of an idle running request whose block is absent from the CPU tier, which has a free slot. For each
 * such entry from ``start`` on, in order, it does what the Python loop does: computes the request's chain up
 * to the block (``chain`` is aiokv._hashing's unchecked chain function), reserves a slot exactly as
 * BlockIndex.reserve does for a tier without quotas (slot dict, key, parent, state, depth, priority), and
 * appends the key, the slot, the engine block and the request to the four lists. It stops, before changing
 * anything for that entry, at the first entry that needs anything else (events queued, a busy task, an abort,
 * a cap, a failed epoch, a present key, no free slot, an unexpected type): the Python loop takes that one and
 * calls again for the rest, so the order is the Python loop's. Returns the index it stopped at and how many
 * slots it reserved (the caller adds them to the index's pending count). */
static PyObject *flush_plain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "flush_plain() takes 9 arguments");
        return NULL;
    }
    PyObject *entries = args[0], *chain = args[3], *index = args[4];
    PyObject *keys_out = args[5], *slots_out = args[6], *ids_out = args[7], *owners = args[8];
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    long long bs;
    if (i < 0 || !as_ll(args[2], &bs) || bs <= 0 || !PyList_CheckExact(entries) || !PyList_CheckExact(keys_out) ||
        !PyList_CheckExact(slots_out) || !PyList_CheckExact(ids_out) || !PyList_CheckExact(owners)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "flush_plain(): bad arguments");
        return NULL;
    }
    if (request_type == NULL) return Py_BuildValue("(nn)", i, (Py_ssize_t)0);
    IndexView v;
    if (index_view(index, &v) < 0) return NULL;
    uint32_t *depths = (uint32_t *)v.depth.buf;
    signed char *prios = (signed char *)v.prio.buf;
    Py_ssize_t num_slots = PyByteArray_GET_SIZE(v.state), reserved = 0;
    Py_INCREF(entries);
    for (; i < PyList_GET_SIZE(entries); i++) {
        PyObject *e = PyList_GET_ITEM(entries, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 5) break;
        PyObject *req = PyTuple_GET_ITEM(e, 0), *blocks = PyTuple_GET_ITEM(e, 3), *epoch = PyTuple_GET_ITEM(e, 4);
        long long start, end, cap;
        if (!Py_IS_TYPE(req, request_type) || !as_ll(PyTuple_GET_ITEM(e, 1), &start) ||
            !as_ll(PyTuple_GET_ITEM(e, 2), &end) || start < 0 || end != start + 1 || !PyList_CheckExact(blocks) ||
            start >= PyList_GET_SIZE(blocks))
            break;
        /* The request's task must be idle: no events queued, waiting on a pending waiter. */
        PyObject *events = SLOT(req, S_EVENTS), *waiter = SLOT(req, S_WAITER);
        if (events == NULL || waiter == NULL || waiter == Py_None) break;
        Py_ssize_t queued = PyObject_Size(events);
        if (queued != 0) {
            if (queued < 0) PyErr_Clear();
            break;
        }
        PyObject *done = PyObject_CallMethodNoArgs(waiter, str_done);
        if (done == NULL) {
            PyErr_Clear();
            break;
        }
        Py_DECREF(done);
        if (done != Py_False) break;
        if (SLOT(req, S_ABORT) != Py_False || !as_ll(SLOT(req, S_CAP), &cap) || end > cap / bs) break;
        PyObject *failed = SLOT(req, S_FAILED);
        if (failed == NULL || epoch == failed) break;
        int same = PyObject_RichCompareBool(epoch, failed, Py_EQ);
        if (same != 0) {
            if (same < 0) PyErr_Clear();
            break;
        }
        /* The chain up to the block (Request._chain; extending it is what the Python loop would do too). */
        PyObject *hashes = SLOT(req, S_HASHES), *token_ids = SLOT(req, S_TOKENS);
        if (hashes == NULL || !PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) == 0 || token_ids == NULL) break;
        Py_ssize_t have = PyList_GET_SIZE(hashes);
        if (have < end) {
            PyObject *a1 = PyLong_FromLongLong((long long)have * bs), *a2 = PyLong_FromLongLong(bs);
            PyObject *a3 = PyLong_FromLongLong(end - (long long)have), *new = NULL;
            if (a1 != NULL && a2 != NULL && a3 != NULL) {
                PyObject *cargs[5] = {PyList_GET_ITEM(hashes, have - 1), token_ids, a1, a2, a3};
                new = PyObject_Vectorcall(chain, cargs, 5, NULL);
            }
            Py_XDECREF(a1);
            Py_XDECREF(a2);
            Py_XDECREF(a3);
            if (new == NULL) {
                PyErr_Clear();
                break;
            }
            int rc = PyList_CheckExact(new) ? PyList_SetSlice(hashes, have, have, new) : -1;
            Py_DECREF(new);
            if (rc < 0) {
                PyErr_Clear();
                break;
            }
            if (PyList_GET_SIZE(hashes) < end) break;
        }
        PyObject *key = PyList_GET_ITEM(hashes, start);
        PyObject *parent = start ? PyList_GET_ITEM(hashes, start - 1) : Py_None;
        PyObject *tenant = SLOT(req, S_TENANT);
        long long prio;
        if (!PyBytes_CheckExact(key) || tenant == NULL || !(tenant == Py_None || PyBytes_CheckExact(tenant)) ||
            !as_ll(SLOT(req, S_PRIO), &prio) || prio < -128 || prio > 127)
            break;
        /* BlockIndex.reserve for an absent key with a free slot; anything else is the Python loop's. */
        PyObject *present = PyDict_GetItemWithError(v.slots, key);
        if (present != NULL || PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        Py_ssize_t n_free = PyObject_Length(v.free);
        if (n_free <= 0) {
            if (n_free < 0) PyErr_Clear();
            break;
        }
        PyObject *block_id = PyList_GET_ITEM(blocks, start);
        Py_INCREF(block_id);
        PyObject *slot_obj = PyObject_CallMethodNoArgs(v.free, str_pop);
        if (slot_obj == NULL) goto fail_block;
        Py_ssize_t slot = PyLong_AsSsize_t(slot_obj);
        if (slot < 0 || slot >= num_slots) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "flush_plain(): free slot out of range");
            Py_DECREF(slot_obj);
            goto fail_block;
        }
        if (PyDict_SetItem(v.slots, key, slot_obj) < 0) {
            Py_DECREF(slot_obj);
            goto fail_block;
        }
        Py_INCREF(key);
        Py_SETREF(PyList_GET_ITEM(v.key_of, slot), key);
        Py_INCREF(parent);
        Py_SETREF(PyList_GET_ITEM(v.parent_of, slot), parent);
        PyByteArray_AS_STRING(v.state)[slot] = PENDING;
        depths[slot] = (uint32_t)start;
        prios[slot] = (signed char)prio;
        reserved++;
        int rc = PyList_Append(keys_out, key) | PyList_Append(slots_out, slot_obj) | PyList_Append(ids_out, block_id);
        Py_DECREF(slot_obj);
        Py_DECREF(block_id);
        /* One entry per request and tick at most in practice; the Python loop appends each entry's owner. */
        if (rc < 0 || PyList_Append(owners, req) < 0) goto fail;
        continue;
    fail_block:
        Py_DECREF(block_id);
        goto fail;
    }
    Py_DECREF(entries);
    index_view_release(&v);
    return Py_BuildValue("(nn)", i, reserved);
fail:
    Py_DECREF(entries);
    index_view_release(&v);
    return NULL;
}

/* track(owners, tf): Request._track(tf) for each request of ``owners`` (the tick's copy joins each one's
 * in-flight set). A set that has grown to 16 goes to the Python method, which prunes it. */
static PyObject *str_track;

static PyObject *track(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "track(owners, tf): owners must be a list");
        return NULL;
    }
    PyObject *owners = args[0], *tf = args[1];
    Py_INCREF(owners);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(owners); i++) {
        PyObject *req = PyList_GET_ITEM(owners, i);
        Py_INCREF(req);
        PyObject *in_flight = request_type != NULL && Py_IS_TYPE(req, request_type) ? SLOT(req, S_INFLIGHT) : NULL;
        int rc;
        if (in_flight != NULL && PySet_CheckExact(in_flight) && PySet_GET_SIZE(in_flight) < 16) {
            rc = PySet_Add(in_flight, tf);
        } else {
            PyObject *r = PyObject_CallMethodOneArg(req, str_track, tf);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(req);
        if (rc < 0) {
            Py_DECREF(owners);
            return NULL;
        }
    }
    Py_DECREF(owners);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(request_class, running_state): read the slot offsets the fast path uses."},
    {"step_batch", (PyCFunction)(void (*)(void))step_batch, METH_FASTCALL,
     "step_batch(off, updates, fallback): Offloader.step_batch with a C fast path per update."},
    {"flush_plain", (PyCFunction)(void (*)(void))flush_plain, METH_FASTCALL,
     "flush_plain(entries, start, block_size, chain, index, keys, slots, ids, owners) -> (next, reserved)"},
    {"track", (PyCFunction)(void (*)(void))track, METH_FASTCALL, "track(owners, tf): Request._track for each."},
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
    if ((str_device = PyUnicode_InternFromString("device")) == NULL ||
        (str_deferred = PyUnicode_InternFromString("deferred")) == NULL ||
        (str_executor = PyUnicode_InternFromString("executor")) == NULL ||
        (str_schedule_flush = PyUnicode_InternFromString("schedule_flush")) == NULL ||
        (str_done = PyUnicode_InternFromString("done")) == NULL || (str_pop = PyUnicode_InternFromString("pop")) == NULL ||
        (str_track = PyUnicode_InternFromString("_track")) == NULL)
        return NULL;
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
