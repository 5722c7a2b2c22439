/* BlockIndex.touch_prefix and BlockIndex.insert_chain with the LRU policy, in C: the inner loops of
 * `aiokv replay` (every block reference of a trace goes through one of them).
 *
 * They do exactly what BlockIndex._touch_prefix_lru and BlockIndex._insert_chain_lru (aiokv/tiers/_index.py)
 * do, on the same objects: the index's slot dict, state bytearray, free-slot and depth arrays, key and parent
 * lists, and the policy's recency list (an OrderedDict key -> parent, the open run as a dict, the last key).
 * The Python methods stay the definition and run when the extension is not built; tests/tiers/
 * test_index_fastpath.py compares both with a list-based reference on random operation sequences.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define READY 2

static PyObject *str_move_to_end, *str_popitem, *str_pop;

static int move_to_end(PyObject *order, PyObject *key) {
    PyObject *args[2] = {order, key};
    PyObject *r = PyObject_VectorcallMethod(str_move_to_end, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Close the open run: its keys take the order they iterate in (reversed), then the run is empty. */
static int close_run(PyObject *order, PyObject *run) {
    if (PyDict_GET_SIZE(run) > 1) {
        PyObject *keys = PyDict_Keys(run);
        if (keys == NULL) return -1;
        for (Py_ssize_t i = PyList_GET_SIZE(keys) - 1; i >= 0; i--) {
            if (move_to_end(order, PyList_GET_ITEM(keys, i)) < 0) {
                Py_DECREF(keys);
                return -1;
            }
        }
        Py_DECREF(keys);
    }
    PyDict_Clear(run);
    return 0;
}

/* The recency list's push(key, parent) for a key already in ``order``: ``*last`` is updated (borrowed; the
 * caller keeps the keys alive). */
static int push_present(PyObject *order, PyObject *run, PyObject *key, PyObject **last) {
    PyObject *p = PyDict_GetItemWithError(order, key); /* OrderedDict is a dict: reading is a dict read */
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    int close = p == Py_None || *last == Py_None;
    if (!close) {
        int ne = PyObject_RichCompareBool(p, *last, Py_NE);
        if (ne < 0) return -1;
        close = ne;
    }
    if (!close) {
        int in_run = PyDict_Contains(run, key);
        if (in_run < 0) return -1;
        close = in_run;
    }
    if (close && close_run(order, run) < 0) return -1;
    if (move_to_end(order, key) < 0) return -1;
    if (PyDict_SetItem(run, key, Py_None) < 0) return -1;
    *last = key;
    return 0;
}

static int check_state(PyObject *slots, PyObject *state, PyObject *order, PyObject *run) {
    if (!PyDict_CheckExact(slots) || !PyByteArray_CheckExact(state) || !PyDict_Check(order) ||
        !PyDict_CheckExact(run)) {
        PyErr_SetString(PyExc_TypeError, "unexpected index or policy structures");
        return -1;
    }
    return 0;
}

/* The arguments both loops share: ``keys`` a list or tuple, ``start`` an index >= 0, and the structures. */
static int check_args(PyObject *keys, PyObject *start_obj, PyObject *slots, PyObject *state, PyObject *order,
                      PyObject *run, Py_ssize_t *start) {
    *start = PyLong_AsSsize_t(start_obj);
    if (*start < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return -1;
    }
    if (!(PyList_CheckExact(keys) || PyTuple_CheckExact(keys))) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list or tuple");
        return -1;
    }
    return check_state(slots, state, order, run);
}

/* The state byte of ``slot`` (an int object from the slot dict), or -1 when it is out of range. */
static inline int state_of(PyObject *state, PyObject *slot_obj) {
    Py_ssize_t s = PyLong_AsSsize_t(slot_obj);
    if (s < 0 || s >= PyByteArray_GET_SIZE(state)) {
        PyErr_Clear();
        return -1;
    }
    return (unsigned char)PyByteArray_AS_STRING(state)[s];
}

/* touch_prefix(keys, start, slots, state, order, run, last) -> (n, last) */
static PyObject *touch_prefix(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "touch_prefix() takes 7 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *slots = args[2], *state = args[3], *order = args[4], *run = args[5];
    PyObject *last = args[6];
    Py_ssize_t start;
    if (check_args(keys, args[1], slots, state, order, run, &start) < 0) return NULL;
    Py_INCREF(keys); /* the list's items are borrowed below */
    Py_ssize_t n = 0;
    for (Py_ssize_t i = start; i < PySequence_Fast_GET_SIZE(keys); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *slot = PyDict_GetItemWithError(slots, key);
        if (slot == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (state_of(state, slot) != READY) break;
        if (push_present(order, run, key, &last) < 0) goto fail;
        n++;
    }
    PyObject *out = Py_BuildValue("(nO)", n, last);
    Py_DECREF(keys);
    return out;
fail:
    Py_DECREF(keys);
    return NULL;
}

/* insert_chain(keys, start, slots, state, free, key_of, parent_of, depth_of, on_evict, order, run, last)
 *   -> (inserted, evicted, rejected, last) */
static PyObject *insert_chain(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "insert_chain() takes 12 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *slots = args[2], *state = args[3], *free_slots = args[4], *key_of = args[5];
    PyObject *parent_of = args[6], *depth_of = args[7], *on_evict = args[8], *order = args[9], *run = args[10];
    PyObject *last = args[11];
    Py_ssize_t start;
    if (check_args(keys, args[1], slots, state, order, run, &start) < 0) return NULL;
    if (!PyList_CheckExact(key_of) || !PyList_CheckExact(parent_of) || (on_evict != Py_None && !PyList_Check(on_evict))) {
        PyErr_SetString(PyExc_TypeError, "unexpected index structures");
        return NULL;
    }
    Py_buffer depth;
    if (PyObject_GetBuffer(depth_of, &depth, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
    if (depth.itemsize != 4 || depth.format == NULL || strcmp(depth.format, "I") != 0) {
        PyBuffer_Release(&depth);
        PyErr_SetString(PyExc_TypeError, "depth_of must be an array('I')");
        return NULL;
    }
    uint32_t *depths = (uint32_t *)depth.buf;
    Py_ssize_t num_slots = depth.len / 4;
    Py_ssize_t n_keys = PySequence_Fast_GET_SIZE(keys);
    Py_ssize_t inserted = 0, evicted = 0, rejected = 0;
    Py_INCREF(keys);
    /* ``last`` and ``parent`` are always the caller's argument, None or an item of ``keys``: borrowed. */
    PyObject *parent = start > 0 && start <= n_keys ? PySequence_Fast_GET_ITEM(keys, start - 1) : Py_None;
    for (Py_ssize_t i = start; i < n_keys; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *slot_obj = PyDict_GetItemWithError(slots, key);
        if (slot_obj != NULL) {
            if (state_of(state, slot_obj) == READY && push_present(order, run, key, &last) < 0) goto fail;
            parent = key;
            continue;
        }
        if (PyErr_Occurred()) goto fail;
        Py_ssize_t slot;
        Py_ssize_t n_free = PyObject_Length(free_slots);
        if (n_free < 0) goto fail;
        if (n_free) {
            PyObject *s = PyObject_CallMethodNoArgs(free_slots, str_pop);
            if (s == NULL) goto fail;
            slot = PyLong_AsSsize_t(s);
            Py_DECREF(s);
            if (slot < 0 && PyErr_Occurred()) goto fail;
        } else {
            Py_ssize_t n_order = PyDict_GET_SIZE(order), n_run = PyDict_GET_SIZE(run);
            PyObject *item;
            if (n_order > n_run) { /* the least recent key outside the run */
                PyObject *a[2] = {order, Py_False};
                item = PyObject_VectorcallMethod(str_popitem, a, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            } else if (n_order) { /* only the open run is left: its last key comes first */
                PyObject *r = PyObject_CallMethodNoArgs(run, str_popitem);
                if (r == NULL) goto fail;
                Py_DECREF(r);
                item = PyObject_CallMethodNoArgs(order, str_popitem);
            } else {
                rejected++;
                parent = key;
                continue;
            }
            if (item == NULL) goto fail;
            PyObject *victim = PyTuple_GET_ITEM(item, 0);
            PyObject *vslot = PyDict_GetItemWithError(slots, victim);
            if (vslot == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, victim);
                Py_DECREF(item);
                goto fail;
            }
            slot = PyLong_AsSsize_t(vslot);
            if ((slot < 0 && PyErr_Occurred()) || PyDict_DelItem(slots, victim) < 0 ||
                (on_evict != Py_None && PyList_Append(on_evict, victim) < 0)) {
                Py_DECREF(item);
                goto fail;
            }
            /* ``last`` may be the victim: it stays what it was (as in Python), alive through ``keys`` or the
             * caller's argument, the only places ``last`` comes from. */
            Py_DECREF(item);
            evicted++;
        }
        if (slot < 0 || slot >= num_slots || slot >= PyList_GET_SIZE(key_of) || slot >= PyList_GET_SIZE(parent_of) ||
            slot >= PyByteArray_GET_SIZE(state)) {
            PyErr_SetString(PyExc_IndexError, "slot out of range");
            goto fail;
        }
        PyObject *slot_new = PyLong_FromSsize_t(slot);
        if (slot_new == NULL) goto fail;
        int rc = PyDict_SetItem(slots, key, slot_new);
        Py_DECREF(slot_new);
        if (rc < 0) goto fail;
        Py_INCREF(key);
        Py_SETREF(PyList_GET_ITEM(key_of, slot), key);
        Py_INCREF(parent);
        Py_SETREF(PyList_GET_ITEM(parent_of, slot), parent);
        PyByteArray_AS_STRING(state)[slot] = READY;
        depths[slot] = (uint32_t)i;
        /* push(key, parent) for an absent key: assignment appends it, so no move_to_end */
        int close = parent == Py_None || last == Py_None;
        if (!close) {
            int ne = PyObject_RichCompareBool(parent, last, Py_NE);
            if (ne < 0) goto fail;
            close = ne;
        }
        if (close && close_run(order, run) < 0) goto fail;
        if (PyObject_SetItem(order, key, parent) < 0 || PyDict_SetItem(run, key, Py_None) < 0) goto fail;
        last = key;
        inserted++;
        parent = key;
    }
    PyBuffer_Release(&depth);
    PyObject *out = Py_BuildValue("(nnnO)", inserted, evicted, rejected, last);
    Py_DECREF(keys);
    return out;
fail:
    PyBuffer_Release(&depth);
    Py_DECREF(keys);
    return NULL;
}

#define PENDING 1

/* commit_run(keys, slots, state, parent_of, order, run, last) -> (n, last): BlockIndex.commit_run with the LRU
 * policy and no priorities (each key PENDING -> READY, then LRUPolicy.insert(key, parent)), in order. A key
 * that is not a pending entry raises AssertionError, as the Python method's assert does, after the keys
 * before it were committed (the caller checked them all first: BlockStore._check_pending). */
static PyObject *commit_run(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "commit_run() takes 7 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *slots = args[1], *state = args[2], *parent_of = args[3], *order = args[4];
    PyObject *run = args[5], *last = args[6];
    if (!(PyList_CheckExact(keys) || PyTuple_CheckExact(keys)) || !PyList_CheckExact(parent_of) ||
        check_state(slots, state, order, run) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "unexpected index or policy structures");
        return NULL;
    }
    Py_INCREF(keys);
    Py_INCREF(last); /* owned here: a key the loop commits may be the only other reference */
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *slot_obj = PyDict_GetItemWithError(slots, key);
        if (slot_obj == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            goto fail;
        }
        Py_ssize_t slot = PyLong_AsSsize_t(slot_obj);
        if (slot < 0 || slot >= PyByteArray_GET_SIZE(state) || slot >= PyList_GET_SIZE(parent_of)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "slot out of range");
            goto fail;
        }
        if ((unsigned char)PyByteArray_AS_STRING(state)[slot] != PENDING) {
            PyErr_SetString(PyExc_AssertionError, "commit of a non-pending entry");
            goto fail;
        }
        PyByteArray_AS_STRING(state)[slot] = READY;
        n++;
        PyObject *parent = PyList_GET_ITEM(parent_of, slot);
        Py_INCREF(parent);
        /* LRUPolicy.insert(key, parent) */
        int close = parent == Py_None || last == Py_None;
        if (!close) {
            int ne = PyObject_RichCompareBool(parent, last, Py_NE);
            if (ne < 0) goto fail_parent;
            close = ne;
        }
        if (!close) {
            int in_run = PyDict_Contains(run, key);
            if (in_run < 0) goto fail_parent;
            close = in_run;
        }
        if (close && close_run(order, run) < 0) goto fail_parent;
        int was = PyDict_Contains(order, key);
        if (was < 0 || PyObject_SetItem(order, key, parent) < 0 || (was && move_to_end(order, key) < 0) ||
            PyDict_SetItem(run, key, Py_None) < 0)
            goto fail_parent;
        Py_DECREF(parent);
        Py_INCREF(key);
        Py_SETREF(last, key);
        continue;
    fail_parent:
        Py_DECREF(parent);
        goto fail;
    }
    PyObject *out = Py_BuildValue("(nO)", n, last);
    Py_DECREF(last);
    Py_DECREF(keys);
    return out;
fail:
    Py_DECREF(last);
    Py_DECREF(keys);
    return NULL;
}

/* first_not_pending(keys, slots, state) -> int: BlockStore._check_pending's scan. The position of the first of
 * keys that is not a PENDING entry (absent, or READY); when every key is pending, the position of the first
 * key that repeats an earlier one; -1 when neither. Repeats are found without a set: each pending key's state
 * byte is marked while the keys are scanned (a second visit finds the mark), then restored. */
#define SCAN_MARK 0xFF
static PyObject *first_not_pending(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "first_not_pending() takes 3 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *slots = args[1], *state = args[2];
    if (!(PyList_CheckExact(keys) || PyTuple_CheckExact(keys)) || !PyDict_CheckExact(slots) ||
        !PyByteArray_CheckExact(state)) {
        PyErr_SetString(PyExc_TypeError, "first_not_pending(): keys list/tuple, slots dict, state bytearray");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    /* Pass 1: the slot of each key (a small stack array, else the heap), the first not pending. */
    Py_ssize_t local[256], *at = n <= 256 ? local : PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    if (at == NULL) return PyErr_NoMemory();
    Py_ssize_t found = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* A key's hash or comparison may be Python code (keys are bytes in aiokv, but this is callable with
         * anything): the list and the state are re-read after every lookup, and the key held during it. */
        if (i >= PySequence_Fast_GET_SIZE(keys)) {
            PyErr_SetString(PyExc_RuntimeError, "first_not_pending(): keys changed size");
            goto fail;
        }
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        Py_INCREF(key);
        PyObject *slot_obj = PyDict_GetItemWithError(slots, key);
        Py_DECREF(key);
        if (slot_obj == NULL) {
            if (PyErr_Occurred()) goto fail;
            found = i;
            break;
        }
        Py_ssize_t slot = PyLong_AsSsize_t(slot_obj);
        if (slot == -1 && PyErr_Occurred()) goto fail;
        if (slot < 0 || slot >= PyByteArray_GET_SIZE(state) ||
            (unsigned char)PyByteArray_AS_STRING(state)[slot] != PENDING) {
            found = i;
            break;
        }
        at[i] = slot;
    }
    if (found < 0) {
        /* Pass 2: every key is pending; the first repeat. No Python code runs from here to the restore; a
         * slot a later lookup's Python code moved out of the state (or off PENDING) counts as not pending. */
        unsigned char *st = (unsigned char *)PyByteArray_AS_STRING(state);
        Py_ssize_t size = PyByteArray_GET_SIZE(state), marked = 0;
        for (; marked < n; marked++) {
            if (at[marked] >= size || (st[at[marked]] != PENDING && st[at[marked]] != SCAN_MARK)) {
                found = marked;
                break;
            }
            if (st[at[marked]] == SCAN_MARK) {
                found = marked;
                break;
            }
            st[at[marked]] = SCAN_MARK;
        }
        for (Py_ssize_t i = 0; i < marked; i++) st[at[i]] = PENDING;
    }
    if (at != local) PyMem_Free(at);
    return PyLong_FromSsize_t(found);
fail:
    if (at != local) PyMem_Free(at);
    return NULL;
}

static PyMethodDef methods[] = {
    {"touch_prefix", (PyCFunction)(void (*)(void))touch_prefix, METH_FASTCALL,
     "touch_prefix(keys, start, slots, state, order, run, last) -> (n, last)"},
    {"insert_chain", (PyCFunction)(void (*)(void))insert_chain, METH_FASTCALL,
     "insert_chain(keys, start, slots, state, free, key_of, parent_of, depth_of, on_evict, order, run, last)"
     " -> (inserted, evicted, rejected, last)"},
    {"first_not_pending", (PyCFunction)(void (*)(void))first_not_pending, METH_FASTCALL,
     "first_not_pending(keys, slots, state) -> int: the position of the first key not PENDING, else of the first "
     "repeated key, else -1"},
    {"commit_run", (PyCFunction)(void (*)(void))commit_run, METH_FASTCALL,
     "commit_run(keys, slots, state, parent_of, order, run, last) -> (n, last)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aiokv._native._lru",
    .m_doc = "BlockIndex's LRU replay loops (touch_prefix, insert_chain) in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__lru(void) {
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_popitem = PyUnicode_InternFromString("popitem");
    str_pop = PyUnicode_InternFromString("pop");
    if (str_move_to_end == NULL || str_popitem == NULL || str_pop == NULL) return NULL;
    return PyModule_Create(&moduledef);
}
