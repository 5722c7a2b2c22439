/* BlockIndex.touch_prefix and BlockIndex.insert_chain with the ARC policy, in C: the inner loops of
 * `aiokv replay --policy arc` (every block reference of a trace goes through one of them).
 *
 * They do exactly what the generic Python loops of BlockIndex.touch_prefix and BlockIndex.insert_chain
 * (aiokv/tiers/_index.py) do with ARCPolicy.touch, ARCPolicy.insert and ARCPolicy._pop_victim
 * (aiokv/tiers/_policies.py), in the same order, on the same objects: the index's slot dict, state bytearray,
 * free-slot and depth arrays, key and parent lists, and the policy's lists (T1 and T2 are _RecencyList objects:
 * an OrderedDict key -> parent, the open run as a dict and the last key pushed; B1 and B2 are OrderedDicts).
 * The target size ``p`` is computed with the same float operations in the same order. The index's
 * _FAST_PATHS hook calls them; they return None, having changed nothing, when a structure is not of the
 * expected type (then the Python loops run). The Python code stays the definition; tests/tiers/
 * test_arc_native.py compares both on random operation sequences.
 *
 * References: items read from the dicts are borrowed, so anything held across a mutation is INCREF'd first
 * (a key popped from T1, a victim popped from the lists, the parent read from T1 before T1 drops it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define READY 2

static PyObject *s_slots, *s_state, *s_free, *s_keys, *s_parent, *s_depth, *s_on_evict;
static PyObject *s_t1, *s_t2, *s_b1, *s_b2, *s_p, *s_capacity, *s_order, *s_run, *s_last;
static PyObject *s_move_to_end, *s_popitem, *s_pop;
static PyObject *ready_obj; /* the int 2 */
static PyTypeObject *odict_type;

/* ------------------------------------------------------------------------------------------- helpers */

/* A bound method, looked up on first use and kept for the call. */
static PyObject *bound(PyObject **cache, PyObject *obj, PyObject *name) {
    if (*cache == NULL) *cache = PyObject_GetAttr(obj, name);
    return *cache;
}

static PyObject *call1(PyObject *f, PyObject *arg) {
    PyObject *a[2] = {NULL, arg};
    return PyObject_Vectorcall(f, a + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static int call1_discard(PyObject *f, PyObject *arg) {
    PyObject *r = call1(f, arg);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The truth of Python's ``a != b`` (no identity shortcut except where the type has one: bytes). */
static int ne_obj(PyObject *a, PyObject *b) {
    if (PyBytes_CheckExact(a)) {
        if (a == b) return 0;
        if (PyBytes_CheckExact(b)) {
            Py_ssize_t n = PyBytes_GET_SIZE(a);
            if (n != PyBytes_GET_SIZE(b)) return 1;
            return memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) != 0;
        }
        if (b == Py_None) return 1;
    }
    PyObject *r = PyObject_RichCompare(a, b, Py_NE);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* ``d.pop(key)`` for an exact dict: a new reference, or NULL with KeyError (or the lookup's error) set. */
static PyObject *dict_pop(PyObject *d, PyObject *key) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *v;
    int rc = PyDict_Pop(d, key, &v);
    if (rc == 0) PyErr_SetObject(PyExc_KeyError, key);
    return rc > 0 ? v : NULL;
#else
    return _PyDict_Pop(d, key, NULL); /* NULL default: KeyError(key) when absent */
#endif
}

/* ``state[slot] == _READY`` for a slot object read from the slot dict: 1, 0 or -1 (error, as Python raises). */
static int is_ready(PyObject *state, PyObject *slot) {
    if (PyLong_CheckExact(slot)) {
        Py_ssize_t s = PyLong_AsSsize_t(slot);
        if (s >= 0 && s < PyByteArray_GET_SIZE(state))
            return (unsigned char)PyByteArray_AS_STRING(state)[s] == READY;
        if (s == -1 && PyErr_Occurred()) PyErr_Clear();
    }
    Py_INCREF(slot);
    PyObject *v = PyObject_GetItem(state, slot); /* negative indexes, IndexError, TypeError: as in Python */
    Py_DECREF(slot);
    if (v == NULL) return -1;
    int eq = PyObject_RichCompareBool(v, ready_obj, Py_EQ);
    Py_DECREF(v);
    return eq;
}

/* --------------------------------------------------------------------------- _RecencyList operations */

typedef struct {
    PyObject *obj;     /* the _RecencyList */
    PyObject *order;   /* its _order: an OrderedDict key -> parent */
    PyObject *run;     /* its _run: a dict */
    PyObject *last;    /* its _last, as the loop updates it (written back at the end) */
    PyObject *last0;   /* its _last as read */
    PyObject *move;    /* order.move_to_end, looked up on first use */
    PyObject *popitem; /* order.popitem, looked up on first use */
} RList;

/* 1: loaded, 0: not an expected structure (no error set), -1: error. All references owned. */
static int rl_load(RList *r, PyObject *policy, PyObject *name) {
    r->obj = PyObject_GetAttr(policy, name);
    if (r->obj == NULL) return -1;
    r->order = PyObject_GetAttr(r->obj, s_order);
    if (r->order == NULL) return -1;
    r->run = PyObject_GetAttr(r->obj, s_run);
    if (r->run == NULL) return -1;
    r->last = PyObject_GetAttr(r->obj, s_last);
    if (r->last == NULL) return -1;
    Py_INCREF(r->last);
    r->last0 = r->last;
    return Py_IS_TYPE(r->order, odict_type) && PyDict_CheckExact(r->run);
}

static void rl_clear(RList *r) {
    Py_CLEAR(r->obj);
    Py_CLEAR(r->order);
    Py_CLEAR(r->run);
    Py_CLEAR(r->last);
    Py_CLEAR(r->last0);
    Py_CLEAR(r->move);
    Py_CLEAR(r->popitem);
}

/* Close the open run: its keys take the order they iterate in (reversed), then the run is empty. */
static int rl_close_run(RList *r) {
    if (PyDict_GET_SIZE(r->run) > 1) {
        PyObject *keys = PyDict_Keys(r->run);
        if (keys == NULL) return -1;
        PyObject *move = bound(&r->move, r->order, s_move_to_end);
        if (move == NULL) {
            Py_DECREF(keys);
            return -1;
        }
        for (Py_ssize_t i = PyList_GET_SIZE(keys) - 1; i >= 0; i--) {
            if (call1_discard(move, PyList_GET_ITEM(keys, i)) < 0) {
                Py_DECREF(keys);
                return -1;
            }
        }
        Py_DECREF(keys);
    }
    PyDict_Clear(r->run);
    return 0;
}

/* _RecencyList.push(key, parent). The caller keeps ``key`` and ``parent`` alive. ``same`` says that ``key`` is
 * in ``order`` with ``parent`` as its value (a hit on a T2 key): ``order[key] = parent`` changes nothing then. */
static int rl_push(RList *r, PyObject *key, PyObject *parent, int same) {
    int close = parent == Py_None;
    if (!close) {
        close = ne_obj(parent, r->last);
        if (close < 0) return -1;
    }
    if (!close) {
        close = PyDict_Contains(r->run, key);
        if (close < 0) return -1;
    }
    if (close && rl_close_run(r) < 0) return -1;
    /* order[key] = parent; order.move_to_end(key): a new key is appended (the length grows), so only a key
     * that was present moves */
    int was = same;
    if (!same) {
        Py_ssize_t before = PyDict_GET_SIZE(r->order);
        if (PyObject_SetItem(r->order, key, parent) < 0) return -1;
        was = PyDict_GET_SIZE(r->order) == before;
    }
    if (was) {
        PyObject *move = bound(&r->move, r->order, s_move_to_end);
        if (move == NULL || call1_discard(move, key) < 0) return -1;
    }
    if (PyDict_SetItem(r->run, key, Py_None) < 0) return -1;
    Py_INCREF(key);
    Py_SETREF(r->last, key);
    return 0;
}

/* _RecencyList.pop(key). The caller keeps ``key`` alive. */
static int rl_pop(RList *r, PyObject *key) {
    if (PyObject_DelItem(r->order, key) < 0) return -1;
    int in_run = PyDict_Contains(r->run, key);
    if (in_run < 0) return -1;
    if (in_run && PyDict_DelItem(r->run, key) < 0) return -1;
    return 0;
}

/* _RecencyList.pop_first(): a new reference. */
static PyObject *rl_pop_first(RList *r) {
    PyObject *popitem = bound(&r->popitem, r->order, s_popitem);
    if (popitem == NULL) return NULL;
    PyObject *item;
    if (PyDict_GET_SIZE(r->order) > PyDict_GET_SIZE(r->run)) { /* the least recent key is not in the run */
        item = call1(popitem, Py_False);
    } else { /* only the open run is left: its last key comes first */
        PyObject *x = PyObject_CallMethodNoArgs(r->run, s_popitem);
        if (x == NULL) return NULL;
        Py_DECREF(x);
        item = PyObject_CallNoArgs(popitem);
    }
    if (item == NULL) return NULL;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 1) {
        Py_DECREF(item);
        PyErr_SetString(PyExc_TypeError, "popitem() did not return an item");
        return NULL;
    }
    PyObject *key = PyTuple_GET_ITEM(item, 0);
    Py_INCREF(key);
    Py_DECREF(item);
    return key;
}

/* --------------------------------------------------------------------------------- ARCPolicy state */

typedef struct {
    PyObject *policy; /* borrowed: the caller's argument */
    RList t1, t2;
    PyObject *b1, *b2; /* OrderedDicts of ghost keys */
    PyObject *b1_popitem, *b2_popitem;
    double p, p0; /* p as the loop updates it (written back at the end), and as read */
    Py_ssize_t cap;
    double capf; /* float(capacity) */
} Arc;

static void arc_clear(Arc *a) {
    rl_clear(&a->t1);
    rl_clear(&a->t2);
    Py_CLEAR(a->b1);
    Py_CLEAR(a->b2);
    Py_CLEAR(a->b1_popitem);
    Py_CLEAR(a->b2_popitem);
}

/* 1: loaded, 0: a state not covered (no error set; the caller returns None), -1: error. */
static int arc_load(Arc *a, PyObject *policy) {
    memset(a, 0, sizeof(*a));
    a->policy = policy;
    int ok = rl_load(&a->t1, policy, s_t1);
    if (ok > 0) ok = rl_load(&a->t2, policy, s_t2);
    if (ok <= 0) goto out;
    if ((a->b1 = PyObject_GetAttr(policy, s_b1)) == NULL || (a->b2 = PyObject_GetAttr(policy, s_b2)) == NULL) {
        ok = -1;
        goto out;
    }
    if (!Py_IS_TYPE(a->b1, odict_type) || !Py_IS_TYPE(a->b2, odict_type)) {
        ok = 0;
        goto out;
    }
    PyObject *p = PyObject_GetAttr(policy, s_p);
    if (p == NULL) {
        ok = -1;
        goto out;
    }
    ok = PyFloat_CheckExact(p);
    if (ok) a->p = a->p0 = PyFloat_AS_DOUBLE(p);
    Py_DECREF(p);
    if (!ok) goto out;
    PyObject *c = PyObject_GetAttr(policy, s_capacity);
    if (c == NULL) {
        ok = -1;
        goto out;
    }
    ok = PyLong_CheckExact(c);
    if (ok) {
        a->cap = PyLong_AsSsize_t(c);
        /* c, 2 * c and the sums of list lengths compared with them must not overflow */
        if ((a->cap == -1 && PyErr_Occurred()) || a->cap < 0 || a->cap > PY_SSIZE_T_MAX / 8) {
            PyErr_Clear();
            ok = 0;
        } else {
            a->capf = PyLong_AsDouble(c);
        }
    }
    Py_DECREF(c);
out:
    if (ok < 0 && (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_TypeError))) {
        PyErr_Clear(); /* not the expected objects: the Python loop runs (and raises as it does) */
        ok = 0;
    }
    if (ok <= 0) arc_clear(a);
    return ok;
}

/* Write p and the lists' _last back (when changed), release everything; keeps a pending exception. */
static int arc_finish(Arc *a) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    int rc = 0;
    if (a->t1.last != a->t1.last0 && PyObject_SetAttr(a->t1.obj, s_last, a->t1.last) < 0) rc = -1;
    if (rc == 0 && a->t2.last != a->t2.last0 && PyObject_SetAttr(a->t2.obj, s_last, a->t2.last) < 0) rc = -1;
    if (rc == 0 && memcmp(&a->p, &a->p0, sizeof(double)) != 0) {
        PyObject *p = PyFloat_FromDouble(a->p);
        if (p == NULL || PyObject_SetAttr(a->policy, s_p, p) < 0) rc = -1;
        Py_XDECREF(p);
    }
    arc_clear(a);
    if (et != NULL) {
        if (rc < 0) PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return rc;
}

static int ghost_pop_first(PyObject **cache, PyObject *ghosts) {
    PyObject *popitem = bound(cache, ghosts, s_popitem);
    if (popitem == NULL) return -1;
    return call1_discard(popitem, Py_False);
}

/* ARCPolicy._trim_ghosts */
static int arc_trim(Arc *a) {
    Py_ssize_t c = a->cap;
    Py_ssize_t n1 = PyDict_GET_SIZE(a->t1.order);
    while (PyDict_GET_SIZE(a->b1) && n1 + PyDict_GET_SIZE(a->b1) > c)
        if (ghost_pop_first(&a->b1_popitem, a->b1) < 0) return -1;
    Py_ssize_t n12 = n1 + PyDict_GET_SIZE(a->t2.order);
    while (n12 + PyDict_GET_SIZE(a->b1) + PyDict_GET_SIZE(a->b2) > 2 * c) {
        int rc = PyDict_GET_SIZE(a->b2) ? ghost_pop_first(&a->b2_popitem, a->b2)
                                        : ghost_pop_first(&a->b1_popitem, a->b1);
        if (rc < 0) return -1;
    }
    return 0;
}

/* ARCPolicy.touch(key). The caller keeps ``key`` alive. */
static int arc_touch(Arc *a, PyObject *key) {
    PyObject *parent = PyDict_GetItemWithError(a->t1.order, key);
    if (parent != NULL) {
        Py_INCREF(parent); /* T1 drops it */
        int rc = rl_pop(&a->t1, key) < 0 || rl_push(&a->t2, key, parent, 0) < 0 ? -1 : 0;
        Py_DECREF(parent);
        return rc;
    }
    if (PyErr_Occurred()) return -1;
    parent = PyDict_GetItemWithError(a->t2.order, key);
    if (parent != NULL) {
        Py_INCREF(parent);
        int rc = rl_push(&a->t2, key, parent, 1);
        Py_DECREF(parent);
        return rc;
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* ARCPolicy.insert(key, parent). The caller keeps ``key`` and ``parent`` alive. */
static int arc_insert(Arc *a, PyObject *key, PyObject *parent) {
    int in_b1 = PyDict_GET_SIZE(a->b1) ? PyDict_Contains(a->b1, key) : 0; /* (``key`` is hashable: in slots) */
    if (in_b1 < 0) return -1;
    if (in_b1) {
        /* p = min(float(c), p + max(len(b2) / len(b1), 1.0)) */
        double m = (double)PyDict_GET_SIZE(a->b2) / (double)PyDict_GET_SIZE(a->b1);
        if (1.0 > m) m = 1.0;
        double v = a->p + m;
        a->p = v < a->capf ? v : a->capf;
        if (PyObject_DelItem(a->b1, key) < 0 || rl_push(&a->t2, key, parent, 0) < 0) return -1;
        return arc_trim(a);
    }
    int in_b2 = PyDict_GET_SIZE(a->b2) ? PyDict_Contains(a->b2, key) : 0;
    if (in_b2 < 0) return -1;
    if (in_b2) {
        /* p = max(0.0, p - max(len(b1) / len(b2), 1.0)) */
        double m = (double)PyDict_GET_SIZE(a->b1) / (double)PyDict_GET_SIZE(a->b2);
        if (1.0 > m) m = 1.0;
        double v = a->p - m;
        a->p = v > 0.0 ? v : 0.0;
        if (PyObject_DelItem(a->b2, key) < 0 || rl_push(&a->t2, key, parent, 0) < 0) return -1;
        return arc_trim(a);
    }
    if (rl_push(&a->t1, key, parent, 0) < 0) return -1;
    return arc_trim(a);
}

/* ARCPolicy._pop_victim(): a new reference, or NULL (with an error set, or none for "no victim"). */
static PyObject *arc_pop_victim(Arc *a) {
    Py_ssize_t n1 = PyDict_GET_SIZE(a->t1.order), n2 = PyDict_GET_SIZE(a->t2.order);
    PyObject *key, *ghosts;
    if (n1 && ((double)n1 > a->p || !n2)) {
        key = rl_pop_first(&a->t1);
        ghosts = a->b1;
    } else if (n2) {
        key = rl_pop_first(&a->t2);
        ghosts = a->b2;
    } else {
        return NULL;
    }
    if (key == NULL) return NULL;
    /* the trim _pop_victim calls only when a bound is exceeded does nothing otherwise */
    if (PyObject_SetItem(ghosts, key, Py_None) < 0 || arc_trim(a) < 0) {
        Py_DECREF(key);
        return NULL;
    }
    return key;
}

/* ------------------------------------------------------------------------------------------ entries */

/* ``start`` as a Py_ssize_t >= 0, or -1 for anything else (the Python loop handles it). */
static Py_ssize_t get_start(PyObject *o) {
    if (!PyLong_Check(o)) return -1;
    Py_ssize_t s = PyLong_AsSsize_t(o);
    if (s == -1 && PyErr_Occurred()) PyErr_Clear();
    return s < 0 ? -1 : s;
}

/* An attribute of the index that must be of an exact type; NULL without an error when it is not. */
static PyObject *get_exact(PyObject *index, PyObject *name, PyTypeObject *type) {
    PyObject *o = PyObject_GetAttr(index, name);
    if (o == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (type != NULL && !Py_IS_TYPE(o, type)) {
        Py_DECREF(o);
        return NULL;
    }
    return o;
}

static PyObject *index_error(PyObject *keys) {
    PyErr_SetString(PyExc_IndexError, PyList_Check(keys) ? "list index out of range" : "tuple index out of range");
    return NULL;
}

/* touch_prefix(index, policy, keys, start) -> n, or None */
static PyObject *touch_prefix(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "touch_prefix() takes 4 arguments");
        return NULL;
    }
    PyObject *index = args[0], *policy = args[1], *keys = args[2];
    Py_ssize_t start = get_start(args[3]);
    if (start < 0 || !(PyList_CheckExact(keys) || PyTuple_CheckExact(keys))) Py_RETURN_NONE;
    PyObject *slots = get_exact(index, s_slots, &PyDict_Type);
    PyObject *state = slots ? get_exact(index, s_state, &PyByteArray_Type) : NULL;
    if (state == NULL) {
        Py_XDECREF(slots);
        Py_RETURN_NONE;
    }
    Arc a;
    int ok = arc_load(&a, policy);
    if (ok <= 0) {
        Py_DECREF(slots);
        Py_DECREF(state);
        if (ok < 0) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(keys);
    Py_ssize_t n = 0, n_keys = PySequence_Fast_GET_SIZE(keys);
    for (Py_ssize_t i = start; i < n_keys; i++) {
        if (i >= PySequence_Fast_GET_SIZE(keys)) {
            index_error(keys);
            goto fail;
        }
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        Py_INCREF(key);
        PyObject *slot = PyDict_GetItemWithError(slots, key);
        int r;
        if (slot == NULL || slot == Py_None) {
            r = PyErr_Occurred() ? -1 : 0;
        } else {
            r = is_ready(state, slot);
            if (r > 0 && arc_touch(&a, key) < 0) r = -1;
        }
        Py_DECREF(key);
        if (r < 0) goto fail;
        if (!r) break;
        n++;
    }
    Py_DECREF(keys);
    Py_DECREF(slots);
    Py_DECREF(state);
    if (arc_finish(&a) < 0) return NULL;
    return PyLong_FromSsize_t(n);
fail:
    Py_DECREF(keys);
    Py_DECREF(slots);
    Py_DECREF(state);
    arc_finish(&a);
    return NULL;
}

/* insert_chain(index, policy, keys, start) -> (inserted, evicted, rejected), or None */
static PyObject *insert_chain(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "insert_chain() takes 4 arguments");
        return NULL;
    }
    PyObject *index = args[0], *policy = args[1], *keys = args[2];
    Py_ssize_t start = get_start(args[3]);
    if (start < 0 || !(PyList_CheckExact(keys) || PyTuple_CheckExact(keys))) Py_RETURN_NONE;
    Py_ssize_t n_keys = PySequence_Fast_GET_SIZE(keys);
    if (start > n_keys) Py_RETURN_NONE; /* keys[start - 1] raises IndexError in the Python loop */
    PyObject *slots = NULL, *state = NULL, *free_slots = NULL, *key_of = NULL, *parent_of = NULL;
    PyObject *depth_of = NULL, *on_evict = NULL, *free_pop = NULL, *parent = NULL;
    Py_buffer depth = {0};
    int have_depth = 0, loaded = 0;
    Arc a;
    if ((slots = get_exact(index, s_slots, &PyDict_Type)) == NULL ||
        (state = get_exact(index, s_state, &PyByteArray_Type)) == NULL ||
        (free_slots = get_exact(index, s_free, NULL)) == NULL ||
        (key_of = get_exact(index, s_keys, &PyList_Type)) == NULL ||
        (parent_of = get_exact(index, s_parent, &PyList_Type)) == NULL ||
        (depth_of = get_exact(index, s_depth, NULL)) == NULL || (on_evict = get_exact(index, s_on_evict, NULL)) == NULL ||
        (on_evict != Py_None && !PyList_CheckExact(on_evict)))
        goto none;
    if (PyObject_GetBuffer(depth_of, &depth, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        goto none;
    }
    have_depth = 1;
    if (depth.itemsize != 4 || depth.format == NULL || strcmp(depth.format, "I") != 0) goto none;
    int ok = arc_load(&a, policy);
    if (ok < 0) goto error;
    if (ok == 0) goto none;
    loaded = 1;
    uint32_t *depths = (uint32_t *)depth.buf;
    Py_ssize_t n_depth = depth.len / 4;
    Py_ssize_t inserted = 0, evicted = 0, rejected = 0;
    Py_INCREF(keys);
    parent = start > 0 ? PySequence_Fast_GET_ITEM(keys, start - 1) : Py_None;
    Py_INCREF(parent); /* owned: a key, alive while it is the parent */
    for (Py_ssize_t i = start; i < n_keys; i++) {
        if (i >= PySequence_Fast_GET_SIZE(keys)) {
            index_error(keys);
            goto fail;
        }
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        Py_INCREF(key);
        PyObject *slot_obj = PyDict_GetItemWithError(slots, key);
        if (slot_obj != NULL && slot_obj != Py_None) { /* present: touched when READY */
            int r = is_ready(state, slot_obj);
            if (r < 0 || (r > 0 && arc_touch(&a, key) < 0)) {
                Py_DECREF(key);
                goto fail;
            }
            Py_SETREF(parent, key);
            continue;
        }
        if (slot_obj == NULL && PyErr_Occurred()) {
            Py_DECREF(key);
            goto fail;
        }
        Py_ssize_t n_free = PyObject_Size(free_slots);
        if (n_free < 0) {
            Py_DECREF(key);
            goto fail;
        }
        if (n_free) {
            if (bound(&free_pop, free_slots, s_pop) == NULL || (slot_obj = PyObject_CallNoArgs(free_pop)) == NULL) {
                Py_DECREF(key);
                goto fail;
            }
        } else {
            PyObject *victim = arc_pop_victim(&a);
            if (victim == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(key);
                    goto fail;
                }
                rejected++;
                Py_SETREF(parent, key);
                continue;
            }
            slot_obj = dict_pop(slots, victim); /* slots.pop(victim) */
            if (slot_obj == NULL) {
                Py_DECREF(victim);
                Py_DECREF(key);
                goto fail;
            }
            evicted++;
            int rc = on_evict != Py_None ? PyList_Append(on_evict, victim) : 0;
            Py_DECREF(victim);
            if (rc < 0) {
                Py_DECREF(slot_obj);
                Py_DECREF(key);
                goto fail;
            }
        }
        /* slot_obj is owned here */
        int rc = PyDict_SetItem(slots, key, slot_obj);
        Py_ssize_t s = -1;
        if (rc == 0 && PyLong_CheckExact(slot_obj)) {
            s = PyLong_AsSsize_t(slot_obj);
            if (s == -1 && PyErr_Occurred()) PyErr_Clear();
        }
        if (rc < 0) {
        } else if (s >= 0 && s < PyList_GET_SIZE(key_of) && s < PyList_GET_SIZE(parent_of) &&
                   s < PyByteArray_GET_SIZE(state) && s < n_depth && (uint64_t)i <= UINT32_MAX) {
            Py_INCREF(key);
            Py_SETREF(PyList_GET_ITEM(key_of, s), key);
            PyByteArray_AS_STRING(state)[s] = READY;
            Py_INCREF(parent);
            Py_SETREF(PyList_GET_ITEM(parent_of, s), parent);
            depths[s] = (uint32_t)i;
        } else { /* the Python statements, with their errors */
            PyObject *io = NULL;
            rc = PyObject_SetItem(key_of, slot_obj, key) < 0 || PyObject_SetItem(state, slot_obj, ready_obj) < 0 ||
                         PyObject_SetItem(parent_of, slot_obj, parent) < 0 || (io = PyLong_FromSsize_t(i)) == NULL ||
                         PyObject_SetItem(depth_of, slot_obj, io) < 0
                     ? -1
                     : 0;
            Py_XDECREF(io);
        }
        Py_DECREF(slot_obj);
        if (rc < 0 || arc_insert(&a, key, parent) < 0) {
            Py_DECREF(key);
            goto fail;
        }
        inserted++;
        Py_SETREF(parent, key);
    }
    Py_DECREF(keys);
    Py_DECREF(parent);
    Py_XDECREF(free_pop);
    PyBuffer_Release(&depth);
    Py_DECREF(slots);
    Py_DECREF(state);
    Py_DECREF(free_slots);
    Py_DECREF(key_of);
    Py_DECREF(parent_of);
    Py_DECREF(depth_of);
    Py_DECREF(on_evict);
    if (arc_finish(&a) < 0) return NULL;
    return Py_BuildValue("(nnn)", inserted, evicted, rejected);
fail:
    Py_DECREF(keys);
    Py_DECREF(parent);
error:
    Py_XDECREF(free_pop);
    if (have_depth) PyBuffer_Release(&depth);
    Py_XDECREF(slots);
    Py_XDECREF(state);
    Py_XDECREF(free_slots);
    Py_XDECREF(key_of);
    Py_XDECREF(parent_of);
    Py_XDECREF(depth_of);
    Py_XDECREF(on_evict);
    if (loaded) arc_finish(&a);
    return NULL;
none:
    if (have_depth) PyBuffer_Release(&depth);
    Py_XDECREF(slots);
    Py_XDECREF(state);
    Py_XDECREF(free_slots);
    Py_XDECREF(key_of);
    Py_XDECREF(parent_of);
    Py_XDECREF(depth_of);
    Py_XDECREF(on_evict);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"touch_prefix", (PyCFunction)(void (*)(void))touch_prefix, METH_FASTCALL,
     "touch_prefix(index, policy, keys, start) -> n, or None: BlockIndex.touch_prefix with ARCPolicy.touch."},
    {"insert_chain", (PyCFunction)(void (*)(void))insert_chain, METH_FASTCALL,
     "insert_chain(index, policy, keys, start) -> (inserted, evicted, rejected), or None: BlockIndex.insert_chain"
     " with ARCPolicy.insert, .touch and ._pop_victim."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aiokv._native._arc",
    .m_doc = "BlockIndex's ARC replay loops (touch_prefix, insert_chain) in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__arc(void) {
    struct {
        PyObject **p;
        const char *s;
    } names[] = {
        {&s_slots, "_slots"},   {&s_state, "_state"},   {&s_free, "_free"},       {&s_keys, "_keys"},
        {&s_parent, "_parent"}, {&s_depth, "_depth"},   {&s_on_evict, "on_evict"}, {&s_t1, "_t1"},
        {&s_t2, "_t2"},         {&s_b1, "_b1"},         {&s_b2, "_b2"},           {&s_p, "p"},
        {&s_capacity, "capacity"}, {&s_order, "_order"}, {&s_run, "_run"},        {&s_last, "_last"},
        {&s_move_to_end, "move_to_end"}, {&s_popitem, "popitem"}, {&s_pop, "pop"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL) return NULL;
    }
    if (ready_obj == NULL && (ready_obj = PyLong_FromLong(READY)) == NULL) return NULL;
    if (odict_type == NULL) {
        PyObject *collections = PyImport_ImportModule("collections");
        if (collections == NULL) return NULL;
        PyObject *od = PyObject_GetAttrString(collections, "OrderedDict");
        Py_DECREF(collections);
        if (od == NULL) return NULL;
        if (!PyType_Check(od)) {
            Py_DECREF(od);
            PyErr_SetString(PyExc_TypeError, "collections.OrderedDict is not a type");
            return NULL;
        }
        odict_type = (PyTypeObject *)od; /* kept for the life of the process */
    }
    return PyModule_Create(&moduledef);
}
