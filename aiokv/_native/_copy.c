/* Batched scatter/gather memcpy for aiokv's CPU transfer path.
 *
 * copy_segments(dst_addrs, src_addrs, nbytes) copies nbytes[i] bytes from src_addrs[i] to dst_addrs[i] for
 * every i, with the GIL released. The three arguments are buffers of int64 (numpy arrays); the caller owns
 * the memory the addresses point into and keeps it alive for the duration of the call. Adjacent segments
 * (both source and destination contiguous) are merged into one memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define AIOKV_HAVE_SSE2 1
#endif

/* Segments at least this long are copied with non-temporal (streaming) stores: the destination is not read
 * again soon, and streaming avoids the read-for-ownership of every destination cache line, which is what
 * makes glibc's large contiguous memcpy faster than a loop of medium-sized memcpys. */
#define NT_THRESHOLD 4096

static void copy_run(char *dst, const char *src, size_t n) {
#ifdef AIOKV_HAVE_SSE2
    if (n >= NT_THRESHOLD) {
        /* Align the destination to 16 bytes with a short memcpy head. */
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        if (head) {
            memcpy(dst, src, head);
            dst += head; src += head; n -= head;
        }
        size_t blocks = n / 64;
        for (size_t i = 0; i < blocks; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)(dst + 0), a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            src += 64; dst += 64;
        }
        n -= blocks * 64;
        if (n) memcpy(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
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

static PyObject *copy_segments(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *len_obj;
    Py_buffer dst, src, len;
    if (!PyArg_ParseTuple(args, "OOO", &dst_obj, &src_obj, &len_obj)) return NULL;
    if (get_i64(dst_obj, &dst, "dst_addrs") < 0) return NULL;
    if (get_i64(src_obj, &src, "src_addrs") < 0) { PyBuffer_Release(&dst); return NULL; }
    if (get_i64(len_obj, &len, "nbytes") < 0) { PyBuffer_Release(&dst); PyBuffer_Release(&src); return NULL; }
    Py_ssize_t n = dst.len / 8;
    if (src.len / 8 != n || len.len / 8 != n) {
        PyBuffer_Release(&dst); PyBuffer_Release(&src); PyBuffer_Release(&len);
        PyErr_SetString(PyExc_ValueError, "dst_addrs, src_addrs and nbytes must have the same length");
        return NULL;
    }
    const int64_t *d = (const int64_t *)dst.buf, *s = (const int64_t *)src.buf, *l = (const int64_t *)len.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (l[i] < 0) {
            PyBuffer_Release(&dst); PyBuffer_Release(&src); PyBuffer_Release(&len);
            PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    while (i < n) {
        char *dp = (char *)(intptr_t)d[i];
        const char *sp = (const char *)(intptr_t)s[i];
        size_t run = (size_t)l[i];
        Py_ssize_t j = i + 1;
        while (j < n && (char *)(intptr_t)d[j] == dp + run && (const char *)(intptr_t)s[j] == sp + run) {
            run += (size_t)l[j];
            j++;
        }
        if (j < n) {
            /* Warm the start of the next source segment while this one copies: scattered small reads are
             * latency-bound, and the hardware prefetcher only ramps up within a page. */
            const char *np_ = (const char *)(intptr_t)s[j];
            size_t pf = (size_t)l[j] < 4096 ? (size_t)l[j] : 4096;
            for (size_t k = 0; k < pf; k += 64) __builtin_prefetch(np_ + k, 0, 0);
        }
        copy_run(dp, sp, run);
        i = j;
    }
#ifdef AIOKV_HAVE_SSE2
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before completion is reported */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst); PyBuffer_Release(&src); PyBuffer_Release(&len);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_segments", copy_segments, METH_VARARGS,
     "copy_segments(dst_addrs, src_addrs, nbytes): memcpy each segment, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&module); }
