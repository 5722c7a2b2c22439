/* Chained SHA-256 block hashes for aiokv's hashing hot path.
 *
 * chain_hashes(prev, token_ids, start, block_size, n_blocks) returns, for i < n_blocks,
 *     h_i = sha256(h_{i-1} || int64_le(token_ids[start + i*bs : start + (i+1)*bs])),  h_{-1} = prev,
 * byte for byte what aiokv/_hashing.py computes with struct and hashlib. The messages are short (160 bytes
 * for a 16-token block), so hashlib's cost is mostly per-call set-up (object allocation, EVP context); here
 * the padding is laid out once per call and each block costs one message fill plus the compression rounds.
 *
 * SHA-256 is written from FIPS 180-4: a portable C compression function, and on x86 one using the SHA
 * extensions (SHA-NI), compiled through a function target attribute so the file needs no global flags and
 * chosen at run time from cpuid. The GIL stays held: one call hashes a few kilobytes at most.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 5)) && \
    !defined(AIOKV_NO_SHANI)
#define AIOKV_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t IV256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

/* Compresses n consecutive 64-byte blocks of data into state. */
typedef void (*compress_fn)(uint32_t state[8], const uint8_t *data, size_t n);

/* ------------------------------------------------------------------------------------------ portable */
#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define CH(x, y, z) (((x) & (y)) ^ (~(x) & (z)))
#define MAJ(x, y, z) (((x) & (y)) ^ ((x) & (z)) ^ ((y) & (z)))
#define BSIG0(x) (ROTR(x, 2) ^ ROTR(x, 13) ^ ROTR(x, 22))
#define BSIG1(x) (ROTR(x, 6) ^ ROTR(x, 11) ^ ROTR(x, 25))
#define SSIG0(x) (ROTR(x, 7) ^ ROTR(x, 18) ^ ((x) >> 3))
#define SSIG1(x) (ROTR(x, 17) ^ ROTR(x, 19) ^ ((x) >> 10))

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Eight rounds per step with the working variables renamed instead of shifted, and the message schedule kept
 * in a 16-word window computed as it is consumed: compilers keep all of it in registers. */
#define ROUND(a, b, c, d, e, f, g, h, t, wt)                                                                  \
    do {                                                                                                     \
        uint32_t t1_ = (h) + BSIG1(e) + CH(e, f, g) + K256[t] + (wt);                                       \
        (d) += t1_;                                                                                          \
        (h) = t1_ + BSIG0(a) + MAJ(a, b, c);                                                                 \
    } while (0)
#define W(t) w[(t) & 15]
#define NEXT_W(t) (W(t) += SSIG1(W((t) + 14)) + W((t) + 9) + SSIG0(W((t) + 1)))

static void compress_portable(uint32_t state[8], const uint8_t *data, size_t n) {
    uint32_t w[16];
    for (; n; n--, data += 64) {
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 16; t++) w[t] = load_be32(data + 4 * t);
        for (int t = 0; t < 16; t += 8) {
            ROUND(a, b, c, d, e, f, g, h, t + 0, W(t + 0));
            ROUND(h, a, b, c, d, e, f, g, t + 1, W(t + 1));
            ROUND(g, h, a, b, c, d, e, f, t + 2, W(t + 2));
            ROUND(f, g, h, a, b, c, d, e, t + 3, W(t + 3));
            ROUND(e, f, g, h, a, b, c, d, t + 4, W(t + 4));
            ROUND(d, e, f, g, h, a, b, c, t + 5, W(t + 5));
            ROUND(c, d, e, f, g, h, a, b, t + 6, W(t + 6));
            ROUND(b, c, d, e, f, g, h, a, t + 7, W(t + 7));
        }
        for (int t = 16; t < 64; t += 8) {
            ROUND(a, b, c, d, e, f, g, h, t + 0, NEXT_W(t + 0));
            ROUND(h, a, b, c, d, e, f, g, t + 1, NEXT_W(t + 1));
            ROUND(g, h, a, b, c, d, e, f, t + 2, NEXT_W(t + 2));
            ROUND(f, g, h, a, b, c, d, e, t + 3, NEXT_W(t + 3));
            ROUND(e, f, g, h, a, b, c, d, t + 4, NEXT_W(t + 4));
            ROUND(d, e, f, g, h, a, b, c, t + 5, NEXT_W(t + 5));
            ROUND(c, d, e, f, g, h, a, b, t + 6, NEXT_W(t + 6));
            ROUND(b, c, d, e, f, g, h, a, t + 7, NEXT_W(t + 7));
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}
#undef ROUND
#undef W
#undef NEXT_W

/* ------------------------------------------------------------------------------------------- SHA-NI */
#ifdef AIOKV_SHANI
/* sha256rnds2 keeps the working variables as two vectors, {A,B,E,F} and {C,D,G,H} (A in the top lane), and
 * does two rounds per instruction with W+K taken from the low two lanes of its third operand. Each RNDS4
 * below does four rounds: two, then the upper pair of W+K moved down for the next two. Afterwards the old
 * ABEF is the new CDGH, so passing (cdgh, abef) then (abef, cdgh) leaves each name holding its own value. */
#define RNDS4(msg, k)                                                                                        \
    do {                                                                                                     \
        __m128i wk_ = _mm_add_epi32((msg), _mm_loadu_si128((const __m128i *)(k)));                          \
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk_);                                                       \
        abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk_, 0x0E));                               \
    } while (0)

/* W[t..t+3] from the four previous message vectors (oldest first): msg1 adds sigma0 of the next word to each
 * W[t-16], the alignr supplies W[t-7..t-4], msg2 adds sigma1 of W[t-2] (computing W[t], W[t+1] first). */
#define SCHED(m0, m1, m2, m3) \
    _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32((m0), (m1)), _mm_alignr_epi8((m3), (m2), 4)), (m3))

__attribute__((target("sha,sse4.1,ssse3"))) static void compress_shani(uint32_t state[8], const uint8_t *data,
                                                                       size_t n) {
    /* Message words are big-endian: reverse the bytes of every 32-bit lane. */
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i lo = _mm_loadu_si128((const __m128i *)state);      /* lanes a b c d (a lowest) */
    __m128i hi = _mm_loadu_si128((const __m128i *)(state + 4)); /* lanes e f g h */
    lo = _mm_shuffle_epi32(lo, 0xB1);                           /* b a d c */
    hi = _mm_shuffle_epi32(hi, 0x1B);                           /* h g f e */
    __m128i abef = _mm_alignr_epi8(lo, hi, 8);                  /* f e b a */
    __m128i cdgh = _mm_blend_epi16(hi, lo, 0xF0);               /* h g d c */

    for (; n; n--, data += 64) {
        const __m128i abef0 = abef, cdgh0 = cdgh;
        __m128i m0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 0)), bswap);
        __m128i m1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16)), bswap);
        __m128i m2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 32)), bswap);
        __m128i m3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 48)), bswap);
        RNDS4(m0, K256 + 0);
        RNDS4(m1, K256 + 4);
        RNDS4(m2, K256 + 8);
        RNDS4(m3, K256 + 12);
        for (int t = 16; t < 64; t += 16) {
            m0 = SCHED(m0, m1, m2, m3);
            RNDS4(m0, K256 + t);
            m1 = SCHED(m1, m2, m3, m0);
            RNDS4(m1, K256 + t + 4);
            m2 = SCHED(m2, m3, m0, m1);
            RNDS4(m2, K256 + t + 8);
            m3 = SCHED(m3, m0, m1, m2);
            RNDS4(m3, K256 + t + 12);
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }

    __m128i t0 = _mm_shuffle_epi32(abef, 0x1B); /* a b e f */
    __m128i t1 = _mm_shuffle_epi32(cdgh, 0xB1); /* g h c d */
    _mm_storeu_si128((__m128i *)state, _mm_blend_epi16(t0, t1, 0xF0));           /* a b c d */
    _mm_storeu_si128((__m128i *)(state + 4), _mm_alignr_epi8(t1, t0, 8));        /* e f g h */
}
#undef RNDS4
#undef SCHED

static int cpu_has_shani(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & bit_SSSE3) || !(c & bit_SSE4_1)) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1; /* CPUID.(EAX=7,ECX=0):EBX.SHA[bit 29] */
}
#else
static int cpu_has_shani(void) { return 0; }
#endif

/* ------------------------------------------------------------------------------------- implementation */
enum { CHOICE_AUTO, CHOICE_PORTABLE, CHOICE_SHANI };
static const char *const CHOICE_NAMES[] = {"auto", "portable", "shani"};
static int have_shani;
static int choice = CHOICE_AUTO;
static compress_fn compress = compress_portable;

static void select_impl(void) {
#ifdef AIOKV_SHANI
    if (choice != CHOICE_PORTABLE && have_shani) {
        compress = compress_shani;
        return;
    }
#endif
    compress = compress_portable;
}

/* Lays out the padding of a message of len bytes in a buffer of padded_len(len) bytes: everything after the
 * first len bytes, which are filled per block. */
static inline size_t padded_len(size_t len) { return (len + 9 + 63) & ~(size_t)63; }

static void write_padding(uint8_t *buf, size_t len) {
    size_t total = padded_len(len);
    memset(buf + len, 0, total - len);
    buf[len] = 0x80;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) buf[total - 1 - i] = (uint8_t)(bits >> (8 * i));
}

static void digest(const uint8_t *padded, size_t nblocks, uint8_t out[32]) {
    uint32_t state[8];
    memcpy(state, IV256, sizeof state);
    compress(state, padded, nblocks);
    for (int i = 0; i < 8; i++) store_be32(out + 4 * i, state[i]);
}

static inline void store_le64(uint8_t *p, int64_t v) {
#if PY_LITTLE_ENDIAN
    memcpy(p, &v, 8);
#else
    uint64_t u = (uint64_t)v;
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(u >> (8 * i));
#endif
}

/* Token ids are small ints, stored in a single digit: reading it directly skips a call per token, about a
 * tenth of the per-block cost at block size 16 and a fifth at 256 (benchmarks/bench_hash.py). Returns 0 for
 * anything else, which the general path handles. */
static inline int compact_value(PyObject *item, uint8_t *p) {
    if (!PyLong_CheckExact(item)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) return 0;
    store_le64(p, (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)item));
    return 1;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size < -1 || size > 1) return 0;
    int64_t v = size == 0 ? 0 : (int64_t)((PyLongObject *)item)->ob_digit[0];
    store_le64(p, size < 0 ? -v : v);
    return 1;
#endif
}

/* ----------------------------------------------------------------------------------------- functions */
#define STACK_BUF 4096
/* Keeps 32 + 8 * block_size + padding far from overflowing size_t and Py_ssize_t. */
#define MAX_BLOCK_SIZE (PY_SSIZE_T_MAX / 16)

static int as_ssize(PyObject *obj, const char *name, Py_ssize_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %zd", name, v);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "chain_hashes expected 5 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *prev = args[0], *seq = args[1];
    Py_ssize_t start, bs, n_blocks;
    if (!PyBytes_Check(prev)) {
        PyErr_Format(PyExc_TypeError, "prev must be bytes, got %.100s", Py_TYPE(prev)->tp_name);
        return NULL;
    }
    if (PyBytes_GET_SIZE(prev) != 32) {
        PyErr_Format(PyExc_ValueError, "prev must be 32 bytes, got %zd", PyBytes_GET_SIZE(prev));
        return NULL;
    }
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_Format(PyExc_TypeError, "token_ids must be a list or tuple, got %.100s", Py_TYPE(seq)->tp_name);
        return NULL;
    }
    if (as_ssize(args[2], "start", &start) < 0 || as_ssize(args[3], "block_size", &bs) < 0 ||
        as_ssize(args[4], "n_blocks", &n_blocks) < 0)
        return NULL;
    if (bs == 0 || bs > MAX_BLOCK_SIZE) {
        PyErr_Format(PyExc_ValueError, "block_size must be in [1, %zd], got %zd", (Py_ssize_t)MAX_BLOCK_SIZE, bs);
        return NULL;
    }
    /* Checked again before each block: the sizes are read after the arguments' conversions ran. */
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (start > len || n_blocks > (len - start) / bs) {
        PyErr_Format(PyExc_ValueError,
                     "start + n_blocks * block_size must be <= len(token_ids), got start=%zd, n_blocks=%zd, "
                     "block_size=%zd, len=%zd",
                     start, n_blocks, bs, len);
        return NULL;
    }

    /* Allocated before any token is read: from here on nothing can run Python code (bytes objects are not
     * tracked by the garbage collector, so creating them never triggers a collection). */
    PyObject *out = PyList_New(n_blocks);
    if (out == NULL) return NULL;
    size_t msg_len = 32 + 8 * (size_t)bs;
    size_t total = padded_len(msg_len);
    uint8_t stack_buf[STACK_BUF];
    uint8_t *buf = stack_buf;
    if (total > STACK_BUF) {
        buf = PyMem_Malloc(total);
        if (buf == NULL) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
    }
    write_padding(buf, msg_len);
    memcpy(buf, PyBytes_AS_STRING(prev), 32);

    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        Py_ssize_t first = start + i * bs;
        if (first + bs > PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "token_ids changed size during hashing");
            goto fail;
        }
        PyObject **items = PySequence_Fast_ITEMS(seq) + first;
        uint8_t *p = buf + 32;
        for (Py_ssize_t j = 0; j < bs; j++, p += 8) {
            PyObject *item = items[j];
            if (compact_value(item, p)) continue;
            if (!PyLong_Check(item)) {
                PyErr_Format(PyExc_TypeError, "token_ids must contain ints, got %.100s at index %zd",
                             Py_TYPE(item)->tp_name, first + j);
                goto fail;
            }
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow) {
                PyErr_Format(PyExc_OverflowError, "token_ids[%zd] is outside the int64 range", first + j);
                goto fail;
            }
            if (v == -1 && PyErr_Occurred()) goto fail;
            store_le64(p, (int64_t)v);
        }
        PyObject *h = PyBytes_FromStringAndSize(NULL, 32);
        if (h == NULL) goto fail;
        uint8_t *hp = (uint8_t *)PyBytes_AS_STRING(h);
        digest(buf, total / 64, hp);
        memcpy(buf, hp, 32);
        PyList_SET_ITEM(out, i, h);
    }
    if (buf != stack_buf) PyMem_Free(buf);
    return out;

fail:
    if (buf != stack_buf) PyMem_Free(buf);
    Py_DECREF(out); /* unset slots are NULL, which list deallocation skips */
    return NULL;
}

static PyObject *sha256(PyObject *self, PyObject *data) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *p = view.buf;
    size_t n = (size_t)view.len;
    uint32_t state[8];
    memcpy(state, IV256, sizeof state);
    compress(state, p, n / 64);
    size_t rest = n % 64;
    uint8_t tail[128];
    memcpy(tail, p + (n - rest), rest);
    size_t tail_len = padded_len(rest);
    write_padding(tail, rest);
    /* The length field counts the whole message, not just the tail. */
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[tail_len - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(state, tail, tail_len / 64);
    PyBuffer_Release(&view);
    uint8_t out[32];
    for (int i = 0; i < 8; i++) store_be32(out + 4 * i, state[i]);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static PyObject *set_impl(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "impl must be a str, got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    int wanted = -1;
    for (int i = 0; i < 3; i++)
        if (PyUnicode_CompareWithASCIIString(arg, CHOICE_NAMES[i]) == 0) wanted = i;
    if (wanted < 0) {
        PyErr_Format(PyExc_ValueError, "impl must be 'auto', 'portable' or 'shani', got %R", arg);
        return NULL;
    }
    if (wanted == CHOICE_SHANI && !have_shani) {
        PyErr_SetString(PyExc_ValueError, "impl 'shani' is not available (CPU or compiler lacks SHA extensions)");
        return NULL;
    }
    int previous = choice;
    choice = wanted;
    select_impl();
    return PyUnicode_FromString(CHOICE_NAMES[previous]);
}

static PyObject *impl(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef AIOKV_SHANI
    if (compress == compress_shani) return PyUnicode_FromString("shani");
#endif
    return PyUnicode_FromString("portable");
}

static PyMethodDef methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL,
     "chain_hashes(prev, token_ids, start, block_size, n_blocks, /): chained sha256 of int64 token blocks."},
    {"sha256", sha256, METH_O, "sha256(data, /): the SHA-256 digest of a bytes-like object."},
    {"_set_impl", set_impl, METH_O,
     "_set_impl(name, /): select 'auto', 'portable' or 'shani'; returns the previous choice."},
    {"impl", impl, METH_NOARGS, "impl(): the compression function in use, 'shani' or 'portable'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sha", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sha(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    have_shani = cpu_has_shani();
    select_impl();
    if (PyModule_AddObject(m, "HAVE_SHANI", PyBool_FromLong(have_shani)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
