/* The lossy block encodings of the persistent tiers (aiokv/tiers/_codec.py) in C: one pass over each block,
 * the GIL released.
 *
 * encode(plan, src, dst, kind) and decode(plan, src, dst, kind) compute, byte for byte, what the torch
 * definitions in aiokv/tiers/_codec.py compute (tests/tiers/test_codec_native.py compares them):
 *
 *   plan: int64 records of PLAN_FIELDS fields, one per part of the slot (see _codec.py's Codec._plan):
 *         slot_offset, enc_offset, count, rows, groups, elems, dtype, nbytes
 *         dtype < 0: a part stored as it is (nbytes bytes copied); else DT_* below, a floating-point part of
 *         count x rows x groups x elems elements, encoded as count*groups float32 scales (count-major) then one
 *         byte per element in the slot's element order.
 *   kind: KIND_FP8 (float8 e4m3fn, scale = amax / 448) or KIND_INT8 (symmetric int8, scale = amax / 127,
 *         round half to even).
 *
 * A group is one index of a segment's second-to-last dimension: elements (c, r, g, 0..elems) for every r. Its
 * scale is amax / qmax (1 when amax is 0). Returns 0, or 1 when encode meets a value that is not finite (or a
 * float64 one beyond float32's range: torch's x.float() makes it inf), or when decode meets a scale that is not
 * finite and positive. Buffer bounds are checked against the plan before anything is read (ValueError).
 *
 * Decoding builds, per group, the 256 values a byte can decode to (table value x scale, converted to the
 * engine's dtype) and then maps every byte through that table: one load and one store per element.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PLAN_FIELDS 8
#define DT_F16 1
#define DT_BF16 2
#define DT_F32 3
#define DT_F64 4
#define KIND_FP8 0
#define KIND_INT8 1

static float fp8_values[256]; /* every e4m3fn byte as float32 (NaN for 0x7f and 0xff, never written) */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ------------------------------------------------------------------------------------ conversions */

static inline float bf16_to_f32(uint16_t h) { return f32_from((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return f32_from(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp != 0) return f32_from(sign | ((exp + 112u) << 23) | (man << 13));
    /* zero or subnormal: man x 2^-24, exact in float32 */
    float v = (float)man * 5.9604644775390625e-8f;
    return f32_from(sign | f32_bits(v));
}

static inline uint16_t f32_to_f16(float f) { /* IEEE binary16, round to nearest even */
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;        /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;       /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                             /* below 2^-14: a subnormal (or zero) result */
        if (a < 0x33000000u) return sign;              /* below 2^-25: rounds to zero (2^-25 itself: to even, 0) */
        uint32_t e = a >> 23;                          /* 102..112 */
        uint32_t m = (a & 0x7fffffu) | 0x800000u;      /* 24-bit significand */
        uint32_t shift = 126u - e;                     /* result = m >> shift, rounded */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
    /* normal: rebias the exponent, round the 13 dropped bits (a carry may bump the exponent, or reach inf) */
    uint32_t r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return sign | (uint16_t)(r >> 13);
}

static void init_fp8_values(void) {
    for (int b = 0; b < 256; b++) {
        uint32_t sign = (b & 0x80) ? 0x80000000u : 0u;
        uint32_t exp = (b >> 3) & 0xfu;
        uint32_t man = b & 0x7u;
        float v;
        if (exp == 0xf && man == 0x7)
            v = NAN;
        else if (exp == 0)
            v = (float)man * 0.001953125f; /* man x 2^-9 */
        else
            v = f32_from(((exp + 120u) << 23) | (man << 20));
        fp8_values[b] = f32_from(f32_bits(v) | sign);
    }
}

static inline int itemsize(int dt) { return dt == DT_F64 ? 8 : dt == DT_F32 ? 4 : 2; }

/* ------------------------------------------------------------------------------------ the plan */

typedef struct {
    int64_t slot_off, enc_off, count, rows, groups, elems, dtype, nbytes;
} Part;

/* Reads and checks the plan against the buffers' lengths; sets ValueError and returns -1 when a part does
 * not fit. */
static int check_plan(const Py_buffer *plan, Py_ssize_t slot_len, Py_ssize_t enc_len) {
    if (plan->len % (PLAN_FIELDS * 8) != 0) {
        PyErr_Format(PyExc_ValueError, "plan must hold int64 records of %d fields, got %zd bytes", PLAN_FIELDS,
                     plan->len);
        return -1;
    }
    Py_ssize_t n = plan->len / (PLAN_FIELDS * 8);
    for (Py_ssize_t i = 0; i < n; i++) {
        Part p;
        memcpy(&p, (const char *)plan->buf + i * PLAN_FIELDS * 8, sizeof p);
        int64_t dec, enc;
        if (p.dtype < 0) {
            if (p.nbytes < 0) goto bad;
            dec = enc = p.nbytes;
        } else {
            if (p.dtype < DT_F16 || p.dtype > DT_F64 || p.count < 0 || p.rows < 0 || p.groups < 0 || p.elems < 0)
                goto bad;
            int64_t elems, scales;
            if (__builtin_mul_overflow(p.count, p.rows, &elems) || __builtin_mul_overflow(elems, p.groups, &elems) ||
                __builtin_mul_overflow(elems, p.elems, &elems) || __builtin_mul_overflow(elems, 8, &dec) ||
                __builtin_mul_overflow(p.count, p.groups, &scales) || __builtin_mul_overflow(scales, 4, &scales) ||
                __builtin_add_overflow(scales, elems, &enc))
                goto bad;
            dec = elems * itemsize((int)p.dtype);
            if (dec != p.nbytes) goto bad;
        }
        if (p.slot_off < 0 || p.enc_off < 0 || p.slot_off > slot_len - dec || p.enc_off > enc_len - enc) {
            PyErr_Format(PyExc_ValueError,
                         "plan part %zd (slot bytes %lld+%lld, encoded bytes %lld+%lld) does not fit the buffers "
                         "(slot %zd bytes, encoded %zd bytes)",
                         i, (long long)p.slot_off, (long long)dec, (long long)p.enc_off, (long long)enc, slot_len,
                         enc_len);
            return -1;
        }
        continue;
    bad:
        PyErr_Format(PyExc_ValueError, "plan part %zd is malformed", i);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ encode */

/* The loops below are branch-free so that the compiler vectorizes them: SSE2 everywhere, and on x86-64 with
 * gcc or clang a second AVX2 build of each, chosen at load time (ifunc) on CPUs that have it. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(AIOKV_NO_CLONES)
#define VECTOR_LOOPS __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_LOOPS
#endif

VECTOR_LOOPS static void to_f32(const uint8_t *restrict x, int dt, Py_ssize_t n, float *restrict out) { /* torch's x.float() */
    switch (dt) {
    case DT_BF16:
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, x + 2 * i, 2);
            out[i] = bf16_to_f32(h);
        }
        break;
    case DT_F16:
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, x + 2 * i, 2);
            out[i] = f16_to_f32(h);
        }
        break;
    case DT_F32:
        memcpy(out, x, (size_t)n * 4);
        break;
    default:
        for (Py_ssize_t i = 0; i < n; i++) {
            double d;
            memcpy(&d, x + 8 * i, 8);
            out[i] = (float)d; /* beyond float32's range: inf, refused below */
        }
    }
}

/* The largest |v| as its bits: a finite float's bits without the sign order like its magnitude, and inf and
 * NaN lie above every finite one (>= 0x7f800000). */
VECTOR_LOOPS static uint32_t amax_bits(const float *restrict v, Py_ssize_t n, uint32_t m) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = f32_bits(v[i]) & 0x7fffffffu;
        m = u > m ? u : m;
    }
    return m;
}

/* float32 -> e4m3fn, round to nearest even, for |f| <= 448 (callers clamp first). Below 2^-6 the result is
 * subnormal: adding 2^-6 x 8 lines its bits up with the float's low mantissa bits and the float addition
 * rounds them. Above, the exponent is rebiased and the 20 dropped bits rounded. Both are computed and one
 * selected, so that loops over it vectorize. */
static inline uint8_t fp8_of(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7fffffffu;
    const uint32_t denorm = 141u << 23;
    uint32_t sub = f32_bits(f32_from(a) + f32_from(denorm)) - denorm;
    uint32_t nrm = (a + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    return (uint8_t)((a < (121u << 23) ? sub : nrm) | sign);
}

VECTOR_LOOPS static void quantize_fp8(const float *restrict v, Py_ssize_t n, float s, uint8_t *restrict out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float q = v[i] / s;
        q = q < -448.0f ? -448.0f : q;
        q = q > 448.0f ? 448.0f : q;
        out[i] = fp8_of(q);
    }
}

VECTOR_LOOPS static void quantize_int8(const float *restrict v, Py_ssize_t n, float s, uint8_t *restrict out) {
    const float magic = 12582912.0f; /* 1.5 x 2^23: adding and subtracting it rounds to nearest even */
    for (Py_ssize_t i = 0; i < n; i++) {
        float q = v[i] / s;
        q = q == q ? q : 0.0f; /* NaN (0/0 when a scale underflowed to 0: that entry never decodes) */
        q = q < -127.0f ? -127.0f : q;
        q = q > 127.0f ? 127.0f : q; /* clamping first, then rounding: the same as torch's round then clamp */
        q = (q + magic) - magic;
        out[i] = (uint8_t)(int8_t)(int32_t)q;
    }
}

/* The largest |h| of 16-bit floats as bits (sign cleared: orders like the magnitude; >= inf's bits: not finite). */
VECTOR_LOOPS static uint16_t amax_bits16(const uint8_t *restrict x, Py_ssize_t n, uint16_t m) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, x + 2 * i, 2);
        h &= 0x7fffu;
        m = h > m ? h : m;
    }
    return m;
}

/* scratch: groups floats (the scales), then one row of elems floats */
static int encode_part(const Part *p, const uint8_t *slot, uint8_t *enc, int kind, float *scratch) {
    const int dt = (int)p->dtype;
    const Py_ssize_t G = (Py_ssize_t)p->groups, E = (Py_ssize_t)p->elems, R = (Py_ssize_t)p->rows;
    const Py_ssize_t seg_elems = R * G * E;
    const float qmax = kind == KIND_FP8 ? 448.0f : 127.0f;
    const int isz = itemsize(dt);
    float *scale = scratch, *v = scratch + G;
    for (int64_t c = 0; c < p->count; c++) {
        const uint8_t *x = slot + p->slot_off + (Py_ssize_t)c * seg_elems * isz;
        uint8_t *scales = enc + p->enc_off + (Py_ssize_t)c * G * 4;
        uint8_t *q = enc + p->enc_off + (Py_ssize_t)p->count * G * 4 + (Py_ssize_t)c * seg_elems;
        for (Py_ssize_t g = 0; g < G; g++) {
            float amax;
            if (isz == 2) {
                uint16_t m = 0;
                for (Py_ssize_t r = 0; r < R; r++) m = amax_bits16(x + (r * G + g) * E * 2, E, m);
                if (m >= (dt == DT_BF16 ? 0x7f80u : 0x7c00u)) return 1;
                amax = dt == DT_BF16 ? bf16_to_f32(m) : f16_to_f32(m);
            } else {
                uint32_t m = 0;
                for (Py_ssize_t r = 0; r < R; r++) {
                    to_f32(x + (r * G + g) * E * isz, dt, E, v);
                    m = amax_bits(v, E, m);
                }
                if (m >= 0x7f800000u) return 1;
                amax = f32_from(m);
            }
            scale[g] = amax > 0.0f ? amax / qmax : 1.0f;
            memcpy(scales + 4 * g, &scale[g], 4);
        }
        for (Py_ssize_t r = 0; r < R; r++)
            for (Py_ssize_t g = 0; g < G; g++) {
                Py_ssize_t base = (r * G + g) * E;
                to_f32(x + base * isz, dt, E, v);
                if (kind == KIND_FP8)
                    quantize_fp8(v, E, scale[g], q + base);
                else
                    quantize_int8(v, E, scale[g], q + base);
            }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ decode */

/* A table lookup per element: gcc's vectorizer emulates the gathers through the stack, three times slower than
 * the scalar loop; keep it scalar. */
#if defined(__GNUC__) && !defined(__clang__)
#define SCALAR_LOOPS __attribute__((optimize("no-tree-vectorize")))
#else
#define SCALAR_LOOPS
#endif

SCALAR_LOOPS static void map16(const uint8_t *restrict in, Py_ssize_t n, const uint16_t *restrict t, uint8_t *restrict out) {
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) { /* four lookups per 8-byte store */
        uint64_t w = (uint64_t)t[in[i]] | (uint64_t)t[in[i + 1]] << 16 | (uint64_t)t[in[i + 2]] << 32 |
                     (uint64_t)t[in[i + 3]] << 48;
        memcpy(out + 2 * i, &w, 8); /* little-endian byte order, as the slot's */
    }
    for (; i < n; i++) memcpy(out + 2 * i, &t[in[i]], 2);
}

/* tables: 256 decoded values per group, of the engine's dtype */
static int decode_part(const Part *p, const uint8_t *enc, uint8_t *slot, int kind, void *tables) {
    const int dt = (int)p->dtype;
    const Py_ssize_t G = (Py_ssize_t)p->groups, E = (Py_ssize_t)p->elems, R = (Py_ssize_t)p->rows;
    const Py_ssize_t seg_elems = R * G * E;
    const int isz = itemsize(dt);
    for (int64_t c = 0; c < p->count; c++) {
        const uint8_t *scales = enc + p->enc_off + (Py_ssize_t)c * G * 4;
        const uint8_t *q = enc + p->enc_off + (Py_ssize_t)p->count * G * 4 + (Py_ssize_t)c * seg_elems;
        uint8_t *x = slot + p->slot_off + (Py_ssize_t)c * seg_elems * isz;
        for (Py_ssize_t g = 0; g < G; g++) {
            float s;
            memcpy(&s, scales + 4 * g, 4);
            if (!(s > 0.0f && s <= 3.4028234663852886e38f)) return 1;
            for (int b = 0; b < 256; b++) {
                float v = (kind == KIND_FP8 ? fp8_values[b] : (float)(int8_t)b) * s;
                switch (dt) {
                case DT_BF16: ((uint16_t *)tables)[g * 256 + b] = f32_to_bf16(v); break;
                case DT_F16: ((uint16_t *)tables)[g * 256 + b] = f32_to_f16(v); break;
                case DT_F32: ((float *)tables)[g * 256 + b] = v; break;
                default: ((double *)tables)[g * 256 + b] = (double)v; break;
                }
            }
        }
        for (Py_ssize_t r = 0; r < R; r++)
            for (Py_ssize_t g = 0; g < G; g++) {
                Py_ssize_t base = (r * G + g) * E;
                const uint8_t *in = q + base;
                if (isz == 2) {
                    map16(in, E, (const uint16_t *)tables + g * 256, x + base * 2);
                } else if (isz == 4) {
                    const float *t = (const float *)tables + g * 256;
                    uint8_t *out = x + base * 4;
                    for (Py_ssize_t e = 0; e < E; e++) memcpy(out + 4 * e, &t[in[e]], 4);
                } else {
                    const double *t = (const double *)tables + g * 256;
                    uint8_t *out = x + base * 8;
                    for (Py_ssize_t e = 0; e < E; e++) memcpy(out + 8 * e, &t[in[e]], 8);
                }
            }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ entry points */

static PyObject *run(PyObject *const *args, Py_ssize_t nargs, int encoding) {
    const char *name = encoding ? "encode" : "decode";
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s() takes 4 arguments (plan, src, dst, kind), got %zd", name, nargs);
        return NULL;
    }
    long kind = PyLong_AsLong(args[3]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (kind != KIND_FP8 && kind != KIND_INT8) {
        PyErr_Format(PyExc_ValueError, "kind must be 0 (fp8) or 1 (int8), got %ld", kind);
        return NULL;
    }
    Py_buffer plan, src, dst;
    if (PyObject_GetBuffer(args[0], &plan, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&plan);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&plan);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t slot_len = encoding ? src.len : dst.len, enc_len = encoding ? dst.len : src.len;
    Py_ssize_t n = plan.len / (PLAN_FIELDS * 8);
    Part *parts = NULL;
    void *scratch = NULL;
    if (check_plan(&plan, slot_len, enc_len) < 0) goto done;
    parts = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(Part));
    int64_t max_groups = 1, max_elems = 1;
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(parts, plan.buf, (size_t)n * sizeof(Part));
    for (Py_ssize_t i = 0; i < n; i++)
        if (parts[i].dtype >= 0) {
            if (parts[i].groups > max_groups) max_groups = parts[i].groups;
            if (parts[i].elems > max_elems) max_elems = parts[i].elems;
        }
    /* encode: one scale per group, then a row as float32; decode: 256 values of up to 8 bytes per group */
    scratch = PyMem_RawMalloc(encoding ? (size_t)(max_groups + max_elems) * sizeof(float)
                                       : (size_t)max_groups * 256 * sizeof(double));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int status = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n && status == 0; i++) {
        const Part *p = &parts[i];
        if (p->dtype < 0) {
            if (encoding)
                memcpy((uint8_t *)dst.buf + p->enc_off, (const uint8_t *)src.buf + p->slot_off, (size_t)p->nbytes);
            else
                memcpy((uint8_t *)dst.buf + p->slot_off, (const uint8_t *)src.buf + p->enc_off, (size_t)p->nbytes);
        } else if (encoding) {
            status = encode_part(p, src.buf, dst.buf, (int)kind, scratch);
        } else {
            status = decode_part(p, src.buf, dst.buf, (int)kind, scratch);
        }
    }
    Py_END_ALLOW_THREADS;
    result = PyLong_FromLong(status);
done:
    PyMem_RawFree(scratch);
    PyMem_RawFree(parts);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&plan);
    return result;
}

static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return run(args, nargs, 1);
}

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return run(args, nargs, 0);
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL,
     "encode(plan, slot, dst, kind, /) -> 0, or 1 when a value is not finite."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(plan, src, slot, kind, /) -> 0, or 1 when a scale is not finite and positive."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__codec(void) {
    init_fp8_values();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "PLAN_FIELDS", PLAN_FIELDS) < 0 || PyModule_AddIntConstant(m, "KIND_FP8", KIND_FP8) < 0 ||
        PyModule_AddIntConstant(m, "KIND_INT8", KIND_INT8) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
