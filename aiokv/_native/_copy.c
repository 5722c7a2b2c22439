/* Batched scatter/gather memcpy for aiokv's CPU transfer path.
 *
 * copy_segments(dst, dst_index, dst_offsets, src, src_index, src_offsets, nbytes) copies nbytes[i] bytes from
 * byte src_offsets[i] of buffer src[src_index[i]] to byte dst_offsets[i] of buffer dst[dst_index[i]] for every
 * i, with the GIL released. dst and src are buffer objects (a tuple of them; dst's must be writable), taken
 * through the buffer protocol and held until the copy is done, so the memory stays alive; the index, offset
 * and length arguments are int64 buffers (numpy arrays). No raw address crosses the interface: every
 * (offset, length) is checked against its buffer's length before any byte moves, and a bad one is a
 * ValueError naming the argument and the segment. Adjacent segments (both source and destination contiguous)
 * are merged into one memcpy.
 *
 * CopyJob(dst, dst_index, dst_offsets, ...) is the same copy cut into parts of about part_bytes (at segment
 * boundaries) that any number of threads take one at a time from a shared counter (run()), so a thread that
 * starts late or runs slow simply copies fewer parts; wait() returns once every part is copied. The whole
 * plan is validated before any byte is copied.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define AIOKV_HAVE_SSE2 1
#endif

/* Large batches are copied with non-temporal (streaming) stores: the destination is not read again soon,
 * and streaming avoids the read-for-ownership of every destination cache line -- which is what makes glibc's
 * large contiguous memcpy (it streams above ~3/4 of the L3) beat a loop of medium-sized memcpys. Small
 * batches stay in cache and use plain memcpy. */
#define STREAM_MIN_BATCH ((size_t)4 << 20)
/* With group > 1, up to `group` merged runs are copied round-robin in `chunk`-byte slices (prefetching two
 * slices ahead), so several independent read streams are in flight at once: gathering scattered 16 KiB
 * segments is latency-bound, and one stream at a time leaves the memory system idle between them. Scattered
 * *writes* prefer group=1 (interleaved streaming stores thrash the write-combining buffers). Measured in
 * benchmarks/bench_copy.py; chosen by the executor per direction. */
#define MAX_GROUP 16

static void copy_stream(char *dst, const char *src, size_t n) {
#ifdef AIOKV_HAVE_SSE2
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    if (head) {
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
    }
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), e);
    }
    if (n > body) memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

static int get_i64(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 && strcmp(view->format, "<q") != 0 &&
         strcmp(view->format, "<l") != 0 && strcmp(view->format, "=q") != 0 && strcmp(view->format, "=l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One side of a copy: the buffers it may touch (held for the plan's lifetime, so the memory stays alive and
 * cannot be resized), which buffer each segment is in (NULL: all in buffer 0), and each segment's byte offset
 * in it. */
typedef struct {
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    Py_buffer index, offs;
    int have_index, have_offs;
} side_t;

static void side_release(side_t *sd) {
    for (Py_ssize_t k = 0; k < sd->nbufs; k++) PyBuffer_Release(&sd->bufs[k]);
    PyMem_Free(sd->bufs);
    sd->bufs = NULL;
    sd->nbufs = 0;
    if (sd->have_index) PyBuffer_Release(&sd->index);
    if (sd->have_offs) PyBuffer_Release(&sd->offs);
    sd->have_index = sd->have_offs = 0;
}

/* name: "dst" or "src". A destination's buffers must be writable. 0, or -1 with an exception set and nothing
 * held. */
static int side_init(side_t *sd, const char *name, PyObject *bufs_obj, PyObject *index_obj, PyObject *offs_obj,
                     int writable) {
    char what[32];
    memset(sd, 0, sizeof(*sd));
    PyObject *seq = PyTuple_Check(bufs_obj) || PyList_Check(bufs_obj) ? PySequence_Fast(bufs_obj, name)
                                                                      : PyTuple_Pack(1, bufs_obj);
    if (seq == NULL) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (m < 1) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s must be a buffer or a non-empty tuple of buffers", name);
        return -1;
    }
    sd->bufs = PyMem_Calloc((size_t)m, sizeof(Py_buffer));
    if (sd->bufs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        PyObject *b = PySequence_Fast_GET_ITEM(seq, k);
        /* PyBUF_SIMPLE: one contiguous run of bytes (a strided export is refused by its exporter). */
        if (PyObject_GetBuffer(b, &sd->bufs[k], PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be a contiguous buffer, got %.100s", name, k,
                         Py_TYPE(b)->tp_name);
            goto fail;
        }
        sd->nbufs = k + 1;
        if (writable && sd->bufs[k].readonly) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is a read-only buffer: a copy cannot write into it", name, k);
            goto fail;
        }
    }
    Py_CLEAR(seq);
    if (index_obj != Py_None) {
        snprintf(what, sizeof what, "%s_index", name);
        if (get_i64(index_obj, &sd->index, what) < 0) goto fail;
        sd->have_index = 1;
    } else if (m > 1) {
        PyErr_Format(PyExc_ValueError, "%s_index is required when %s has more than one buffer", name, name);
        goto fail;
    }
    snprintf(what, sizeof what, "%s_offsets", name);
    if (get_i64(offs_obj, &sd->offs, what) < 0) goto fail;
    sd->have_offs = 1;
    return 0;
fail:
    Py_XDECREF(seq);
    side_release(sd);
    return -1;
}

/* Check segment i of this side (offset and length within its buffer) and return its address, or set a
 * ValueError naming the argument and return NULL. Overflow-safe: nothing is added before it is compared. */
static char *side_addr(const side_t *sd, const char *name, Py_ssize_t i, int64_t len) {
    int64_t k = sd->have_index ? ((const int64_t *)sd->index.buf)[i] : 0;
    if (k < 0 || k >= (int64_t)sd->nbufs) {
        PyErr_Format(PyExc_ValueError, "%s_index[%zd] = %lld is not a buffer of %s (it has %zd)", name, i,
                     (long long)k, name, sd->nbufs);
        return NULL;
    }
    int64_t off = ((const int64_t *)sd->offs.buf)[i];
    int64_t size = (int64_t)sd->bufs[k].len;
    if (off < 0 || off > size || len > size - off) {
        PyErr_Format(PyExc_ValueError,
                     "%s_offsets[%zd] = %lld with nbytes[%zd] = %lld is out of bounds of %s[%lld] (%lld bytes)", name,
                     i, (long long)off, i, (long long)len, name, (long long)k, (long long)size);
        return NULL;
    }
    return (char *)sd->bufs[k].buf + off;
}

/* A validated plan: both sides, the lengths, each segment's checked addresses, the interleaving and whether
 * to stream. */
typedef struct {
    side_t dside, sside;
    Py_buffer len;
    char **d;
    const char **s;
    const int64_t *l;
    Py_ssize_t n;
    size_t total;
    int group;
    size_t chunk;
    int stream;
} plan_t;

static void plan_release(plan_t *p) {
    side_release(&p->dside);
    side_release(&p->sside);
    PyBuffer_Release(&p->len);
    PyMem_Free(p->d);
    PyMem_Free((void *)p->s);
    p->d = NULL;
    p->s = NULL;
}

/* Fill *p from the Python arguments (0), or set an exception and hold nothing (-1). Every segment is checked
 * against its buffers' lengths here, before any byte is copied. */
static int plan_init(plan_t *p, PyObject *dst_obj, PyObject *dst_index, PyObject *dst_offs, PyObject *src_obj,
                     PyObject *src_index, PyObject *src_offs, PyObject *len_obj, int group, Py_ssize_t chunk,
                     int stream) {
    memset(p, 0, sizeof(*p));
    if (group < 1 || group > MAX_GROUP) {
        PyErr_Format(PyExc_ValueError, "group must be in [1, %d], got %d", MAX_GROUP, group);
        return -1;
    }
    if (chunk < 64) {
        PyErr_Format(PyExc_ValueError, "chunk must be >= 64, got %zd", chunk);
        return -1;
    }
    if (side_init(&p->dside, "dst", dst_obj, dst_index, dst_offs, 1) < 0) return -1;
    if (side_init(&p->sside, "src", src_obj, src_index, src_offs, 0) < 0) {
        side_release(&p->dside);
        return -1;
    }
    if (get_i64(len_obj, &p->len, "nbytes") < 0) {
        side_release(&p->dside);
        side_release(&p->sside);
        return -1;
    }
    Py_ssize_t n = p->len.len / 8;
    if (p->dside.offs.len / 8 != n || p->sside.offs.len / 8 != n ||
        (p->dside.have_index && p->dside.index.len / 8 != n) ||
        (p->sside.have_index && p->sside.index.len / 8 != n)) {
        plan_release(p);
        PyErr_SetString(PyExc_ValueError,
                        "dst_offsets, src_offsets, nbytes (and dst_index, src_index) must have the same length");
        return -1;
    }
    p->l = (const int64_t *)p->len.buf;
    p->d = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(char *));
    p->s = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(char *));
    if (p->d == NULL || p->s == NULL) {
        plan_release(p);
        PyErr_NoMemory();
        return -1;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t len = p->l[i];
        if (len < 0) {
            plan_release(p);
            PyErr_Format(PyExc_ValueError, "nbytes[%zd] must be >= 0, got %lld", i, (long long)len);
            return -1;
        }
        char *d = side_addr(&p->dside, "dst", i, len);
        const char *s = d == NULL ? NULL : side_addr(&p->sside, "src", i, len);
        if (s == NULL) {
            plan_release(p);
            return -1;
        }
        p->d[i] = d;
        p->s[i] = s;
        total += (size_t)len;
    }
    p->n = n;
    p->total = total;
    p->group = group;
    p->chunk = (size_t)chunk;
    /* stream < 0: by size. A caller copying one large batch in pieces passes the whole batch's choice. */
    p->stream = stream < 0 ? total >= STREAM_MIN_BATCH : stream != 0;
    return 0;
}

/* Copy segments [i, end) of the plan. No GIL needed. Streaming stores are not fenced here. */
static void copy_range(const plan_t *p, Py_ssize_t i, Py_ssize_t end) {
    char *const *d = p->d;
    const char *const *s = p->s;
    const int64_t *l = p->l;
    const int group = p->group, stream = p->stream;
    const size_t chunk = p->chunk;
    while (i < end) {
        char *dps[MAX_GROUP];
        const char *sps[MAX_GROUP];
        size_t runs[MAX_GROUP];
        int g = 0;
        size_t maxrun = 0;
        while (g < group && i < end) {
            /* Merge segments that are adjacent on both sides into one run. */
            char *dp = d[i];
            const char *sp = s[i];
            size_t run = (size_t)l[i];
            Py_ssize_t j = i + 1;
            while (j < end && d[j] == dp + run && s[j] == sp + run) {
                run += (size_t)l[j];
                j++;
            }
            dps[g] = dp; sps[g] = sp; runs[g] = run; g++;
            if (run > maxrun) maxrun = run;
            i = j;
        }
        if (!stream) {
            for (int k = 0; k < g; k++) memcpy(dps[k], sps[k], runs[k]);
            continue;
        }
        if (g == 1) {
            copy_stream(dps[0], sps[0], runs[0]);
            continue;
        }
        for (size_t off = 0; off < maxrun; off += chunk) {
            for (int k = 0; k < g; k++) {
                if (off >= runs[k]) continue;
                size_t c = runs[k] - off < chunk ? runs[k] - off : chunk;
                if (off + 2 * chunk < runs[k]) {
                    const char *pf = sps[k] + off + 2 * chunk;
                    for (size_t q = 0; q < chunk; q += 64) __builtin_prefetch(pf + q, 0, 0);
                } else if (i + k < end) {
                    /* This run is ending: warm the head of a segment of the next group instead, so the next
                     * group does not start with every stream cold (measured: 16 KiB gathers 0.88 -> 0.98). */
                    size_t ahead = off + 2 * chunk - runs[k];
                    if ((size_t)l[i + k] > ahead) {
                        const char *pf = s[i + k] + ahead;
                        for (size_t q = 0; q < chunk; q += 64) __builtin_prefetch(pf + q, 0, 0);
                    }
                }
                copy_stream(dps[k] + off, sps[k] + off, c);
            }
        }
    }
}

static void fence(const plan_t *p) {
#ifdef AIOKV_HAVE_SSE2
    if (p->stream) _mm_sfence(); /* streaming stores are weakly ordered: drain them before reporting completion */
#else
    (void)p;
#endif
}

static PyObject *copy_segments(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"dst", "dst_index", "dst_offsets", "src", "src_index", "src_offsets", "nbytes",
                             "group", "chunk", "stream", NULL};
    PyObject *dst_obj, *dst_index, *dst_offs, *src_obj, *src_index, *src_offs, *len_obj;
    int group = 1, stream = -1;
    Py_ssize_t chunk = 512;
    plan_t p;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO|ini", kwlist, &dst_obj, &dst_index, &dst_offs, &src_obj,
                                     &src_index, &src_offs, &len_obj, &group, &chunk, &stream))
        return NULL;
    if (plan_init(&p, dst_obj, dst_index, dst_offs, src_obj, src_index, src_offs, len_obj, group, chunk, stream) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_range(&p, 0, p.n);
    fence(&p);
    Py_END_ALLOW_THREADS
    plan_release(&p);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ CopyJob */

typedef struct {
    PyObject_HEAD
    plan_t plan;
    int have_plan;
    Py_ssize_t nparts;
    Py_ssize_t *bounds;       /* nparts + 1 segment indices: part k is [bounds[k], bounds[k + 1]) */
    Py_ssize_t next;          /* the next part to take (atomic; grows past nparts once all are taken) */
    Py_ssize_t done;          /* parts copied (atomic) */
    PyThread_type_lock lock;  /* held from creation until the last part is copied */
} CopyJobObject;

static void job_dealloc(CopyJobObject *self) {
    if (self->lock != NULL) {
        if (__atomic_load_n(&self->done, __ATOMIC_ACQUIRE) < self->nparts) PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    PyMem_Free(self->bounds);
    if (self->have_plan) plan_release(&self->plan);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *job_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"dst", "dst_index", "dst_offsets", "src", "src_index", "src_offsets", "nbytes",
                             "group", "chunk", "part_bytes", NULL};
    PyObject *dst_obj, *dst_index, *dst_offs, *src_obj, *src_index, *src_offs, *len_obj;
    int group = 1;
    Py_ssize_t chunk = 512, part_bytes = (Py_ssize_t)1 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO|inn", kwlist, &dst_obj, &dst_index, &dst_offs, &src_obj,
                                     &src_index, &src_offs, &len_obj, &group, &chunk, &part_bytes))
        return NULL;
    if (part_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "part_bytes must be >= 1, got %zd", part_bytes);
        return NULL;
    }
    CopyJobObject *self = (CopyJobObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (plan_init(&self->plan, dst_obj, dst_index, dst_offs, src_obj, src_index, src_offs, len_obj, group, chunk,
                  -1) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->have_plan = 1;
    const plan_t *p = &self->plan;
    /* Parts of about part_bytes, cut at segment boundaries (a longer segment is a part of its own). */
    size_t want = (size_t)part_bytes, nparts = 0, acc = 0;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        acc += (size_t)p->l[i];
        if (acc >= want || i == p->n - 1) { nparts++; acc = 0; }
    }
    self->bounds = PyMem_Malloc((nparts + 1) * sizeof(Py_ssize_t));
    self->lock = PyThread_allocate_lock();
    if (self->bounds == NULL || self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_ssize_t k = 0;
    self->bounds[0] = 0;
    acc = 0;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        acc += (size_t)p->l[i];
        if (acc >= want || i == p->n - 1) { self->bounds[++k] = i + 1; acc = 0; }
    }
    self->nparts = (Py_ssize_t)nparts;
    if (nparts > 0) PyThread_acquire_lock(self->lock, WAIT_LOCK); /* uncontended: the lock is new */
    return (PyObject *)self;
}

static PyObject *job_run(CopyJobObject *self, PyObject *Py_UNUSED(unused)) {
    const plan_t *p = &self->plan;
    const Py_ssize_t nparts = self->nparts;
    size_t copied = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        Py_ssize_t k = __atomic_fetch_add(&self->next, 1, __ATOMIC_RELAXED);
        if (k >= nparts) break;
        Py_ssize_t a = self->bounds[k], b = self->bounds[k + 1];
        copy_range(p, a, b);
        fence(p);
        for (Py_ssize_t i = a; i < b; i++) copied += (size_t)p->l[i];
        if (__atomic_add_fetch(&self->done, 1, __ATOMIC_RELEASE) == nparts) PyThread_release_lock(self->lock);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(copied);
}

static PyObject *job_wait(CopyJobObject *self, PyObject *Py_UNUSED(unused)) {
    if (__atomic_load_n(&self->done, __ATOMIC_ACQUIRE) < self->nparts) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *job_get_parts(CopyJobObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->nparts);
}

static PyObject *job_get_nbytes(CopyJobObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->plan.total);
}

static PyObject *job_get_done(CopyJobObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(__atomic_load_n(&self->done, __ATOMIC_ACQUIRE) >= self->nparts);
}

static PyMethodDef job_methods[] = {
    {"run", (PyCFunction)job_run, METH_NOARGS,
     "run() -> int: copy parts until none is left to take (GIL released); the bytes this call copied."},
    {"wait", (PyCFunction)job_wait, METH_NOARGS,
     "wait(): block (GIL released) until every part is copied. Call run() first: no thread may be left to."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"parts", (getter)job_get_parts, NULL, "number of parts", NULL},
    {"nbytes", (getter)job_get_nbytes, NULL, "bytes of the whole copy", NULL},
    {"done", (getter)job_get_done, NULL, "whether every part is copied", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv._native._copy.CopyJob",
    .tp_basicsize = sizeof(CopyJobObject),
    .tp_dealloc = (destructor)job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CopyJob(dst, dst_index, dst_offsets, src, src_index, src_offsets, nbytes, group=1, chunk=512, "
              "part_bytes=1 MiB): one segment copy (checked as copy_segments checks it) in parts that any number "
              "of threads take from a shared counter.",
    .tp_methods = job_methods,
    .tp_getset = job_getset,
    .tp_new = job_new,
};

/* ------------------------------------------------------------------------------------------ plan_blocks */

typedef struct {
    long long slot, block;
} pair_t;

static int pair_cmp(const void *a, const void *b) {
    const pair_t *x = a, *y = b;
    if (x->slot != y->slot) return x->slot < y->slot ? -1 : 1;
    if (x->block != y->block) return x->block < y->block ? -1 : 1;
    return 0;
}

/* An int64 buffer's items (C-contiguous, format "q" or "l" of 8 bytes), as plan_blocks reads its layout. */
static int int64_view(PyObject *obj, Py_buffer *v, const char *name, Py_ssize_t want) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (v->itemsize != 8 || v->format == NULL || !(strcmp(v->format, "q") == 0 || strcmp(v->format, "l") == 0 ||
                                                    strcmp(v->format, "<q") == 0 || strcmp(v->format, "<l") == 0 ||
                                                    strcmp(v->format, "=q") == 0 || strcmp(v->format, "=l") == 0)) {
        PyErr_Format(PyExc_ValueError, "plan_blocks: %s must be an int64 array", name);
        PyBuffer_Release(v);
        return -1;
    }
    if (want >= 0 && v->len / 8 != want) {
        PyErr_Format(PyExc_ValueError, "plan_blocks: %s has %zd items, expected %zd", name, v->len / 8, want);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

/* plan_blocks(block_ids, slot_ids, bases, strides, lens, offs, slot_bytes, host_base, seg_buf)
 *   -> (engine_offsets, host_offsets, nbytes, engine_index, n)
 * KVLayout.copy_plan of the pairs (slot_ids[i], block_ids[i]) sorted by (slot, block) -- the executor's merged
 * batch, slot order -- in one pass: for pair i and segment j, engine bases[j] + block * strides[j], host
 * host_base + slot * slot_bytes + offs[j], length lens[j]. bases[j] is relative to the engine buffer segment j
 * lies in, seg_buf[j] (an int64 array, or None: all in buffer 0), which engine_index repeats per pair (None
 * without seg_buf). The results are bytearrays of int64 (np.frombuffer views them); n is the number of pairs.
 * The copy kernel checks every segment against its buffer, as it does for the Python plan: this only computes
 * it (an overflow is an OverflowError). */
static PyObject *plan_blocks(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "plan_blocks() takes 9 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *slots = args[1];
    if (!(PyList_CheckExact(blocks) || PyTuple_CheckExact(blocks)) ||
        !(PyList_CheckExact(slots) || PyTuple_CheckExact(slots))) {
        PyErr_SetString(PyExc_TypeError, "plan_blocks: block_ids and slot_ids must be lists or tuples");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (PySequence_Fast_GET_SIZE(slots) != n) {
        PyErr_SetString(PyExc_ValueError, "plan_blocks: block_ids and slot_ids must have the same length");
        return NULL;
    }
    long long slot_bytes = PyLong_AsLongLong(args[6]), host_base = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    PyObject *out_e = NULL, *out_h = NULL, *out_n = NULL, *out_i = NULL, *result = NULL;
    pair_t *pairs = NULL;
    Py_buffer vb, vs, vl, vo, vi;
    int have_index = args[8] != Py_None;
    if (int64_view(args[2], &vb, "bases", -1) < 0) return NULL;
    Py_ssize_t nseg = vb.len / 8;
    if (int64_view(args[3], &vs, "strides", nseg) < 0) goto fail_b;
    if (int64_view(args[4], &vl, "lens", nseg) < 0) goto fail_s;
    if (int64_view(args[5], &vo, "offs", nseg) < 0) goto fail_l;
    if (have_index && int64_view(args[8], &vi, "seg_buf", nseg) < 0) goto fail_o;
    pairs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(pair_t));
    if (pairs == NULL) {
        PyErr_NoMemory();
        goto fail_i;
    }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* An int-like's __index__ is Python code: the lists are re-measured and their items held. */
        if (i >= PySequence_Fast_GET_SIZE(blocks) || i >= PySequence_Fast_GET_SIZE(slots)) {
            PyErr_SetString(PyExc_RuntimeError, "plan_blocks: block_ids or slot_ids changed size");
            goto fail_pairs;
        }
        PyObject *bo = PySequence_Fast_GET_ITEM(blocks, i), *so = PySequence_Fast_GET_ITEM(slots, i);
        Py_INCREF(bo);
        Py_INCREF(so);
        long long b = PyLong_AsLongLong(bo);
        long long sl = b == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(so);
        Py_DECREF(bo);
        Py_DECREF(so);
        if ((b == -1 || sl == -1) && PyErr_Occurred()) goto fail_pairs;
        pairs[i].slot = sl;
        pairs[i].block = b;
        if (i && sorted && pair_cmp(&pairs[i - 1], &pairs[i]) > 0) sorted = 0;
    }
    if (!sorted) qsort(pairs, (size_t)n, sizeof(pair_t), pair_cmp);
    if (nseg && n > PY_SSIZE_T_MAX / 8 / nseg) {
        PyErr_NoMemory();
        goto fail_pairs;
    }
    Py_ssize_t total = n * nseg;
    out_e = PyByteArray_FromStringAndSize(NULL, total * 8);
    out_h = PyByteArray_FromStringAndSize(NULL, total * 8);
    out_n = PyByteArray_FromStringAndSize(NULL, total * 8);
    if (have_index) out_i = PyByteArray_FromStringAndSize(NULL, total * 8);
    if (out_e == NULL || out_h == NULL || out_n == NULL || (have_index && out_i == NULL)) goto fail_pairs;
    {
        int64_t *e = (int64_t *)PyByteArray_AS_STRING(out_e), *h = (int64_t *)PyByteArray_AS_STRING(out_h),
                *nb = (int64_t *)PyByteArray_AS_STRING(out_n);
        int64_t *ix = have_index ? (int64_t *)PyByteArray_AS_STRING(out_i) : NULL;
        const int64_t *seg_buf = have_index ? vi.buf : NULL;
        const int64_t *bases = vb.buf, *strides = vs.buf, *lens = vl.buf, *offs = vo.buf;
        int overflow = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            long long slot_addr;
            overflow |= __builtin_mul_overflow(pairs[i].slot, slot_bytes, &slot_addr);
            overflow |= __builtin_add_overflow(slot_addr, host_base, &slot_addr);
            for (Py_ssize_t j = 0; j < nseg; j++) {
                long long a;
                overflow |= __builtin_mul_overflow(pairs[i].block, (long long)strides[j], &a);
                overflow |= __builtin_add_overflow(a, (long long)bases[j], &a);
                long long ho;
                overflow |= __builtin_add_overflow(slot_addr, (long long)offs[j], &ho);
                e[i * nseg + j] = a;
                h[i * nseg + j] = ho;
                nb[i * nseg + j] = lens[j];
                if (ix != NULL) ix[i * nseg + j] = seg_buf[j];
            }
        }
        if (overflow) {
            PyErr_SetString(PyExc_OverflowError, "plan_blocks: an address overflows int64");
            goto fail_pairs;
        }
    }
    result = Py_BuildValue("(OOOOn)", out_e, out_h, out_n, have_index ? out_i : Py_None, n);
fail_pairs:
    PyMem_Free(pairs);
    Py_XDECREF(out_e);
    Py_XDECREF(out_h);
    Py_XDECREF(out_n);
    Py_XDECREF(out_i);
fail_i:
    if (have_index) PyBuffer_Release(&vi);
fail_o:
    PyBuffer_Release(&vo);
fail_l:
    PyBuffer_Release(&vl);
fail_s:
    PyBuffer_Release(&vs);
fail_b:
    PyBuffer_Release(&vb);
    return result;
}

static PyMethodDef methods[] = {
    {"plan_blocks", (PyCFunction)(void (*)(void))plan_blocks, METH_FASTCALL,
     "plan_blocks(block_ids, slot_ids, bases, strides, lens, offs, slot_bytes, host_base, seg_buf) -> "
     "(engine_offsets, host_offsets, nbytes, engine_index, n): KVLayout.copy_plan of the pairs sorted by (slot, "
     "block), as int64 bytearrays; bases relative to each segment's engine buffer seg_buf[j] (None: buffer 0)."},
    {"copy_segments", (PyCFunction)(void (*)(void))copy_segments, METH_VARARGS | METH_KEYWORDS,
     "copy_segments(dst, dst_index, dst_offsets, src, src_index, src_offsets, nbytes, group=1, chunk=512, "
     "stream=-1): memcpy each segment src[src_index[i]][src_offsets[i]:][:nbytes[i]] -> the same in dst, GIL "
     "released. dst and src: a buffer or a tuple of buffers (dst writable); *_index: int64 arrays naming the "
     "buffer of each segment, or None (all in buffer 0); *_offsets, nbytes: int64 arrays. Every segment is "
     "checked against its buffer's length before any byte is copied (ValueError naming the argument). stream: "
     "1 streaming stores, 0 plain memcpy, -1 streaming for batches of 4 MiB or more."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
    if (PyType_Ready(&CopyJobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CopyJobType);
    if (PyModule_AddObject(m, "CopyJob", (PyObject *)&CopyJobType) < 0) {
        Py_DECREF(&CopyJobType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
