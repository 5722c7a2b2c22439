/* The replay loop of `aiokv replay` on interned block ids: aiokv.replay._sim._run with every tier's
 * BlockIndex and eviction policy (lru, arc, session, adaptive over lru/arc/session shadows) in C.
 *
 * The Python code stays the definition: _run (aiokv/replay/_sim.py), BlockIndex.touch_prefix and
 * BlockIndex.insert_chain (aiokv/tiers/_index.py) and the policies (aiokv/tiers/_policies.py). This module does
 * the same operations in the same order, on integers instead of bytes keys: a trace's keys are interned once
 * (`intern`: key -> dense id 0..n-1, in order of first appearance), and every structure is an array indexed by
 * id. Tests/replay/test_native_replay.py compares both on random traces and tier stacks.
 *
 * Structures.
 * - A recency list with chain runs (_RecencyList) is two doubly linked lists over one pair of prev/next arrays:
 *   `main`, the closed order (least recent first), and `run`, the open run stored most recent first, which is
 *   the order _RecencyList iterates it in. Closing the run appends `run` to `main` (the Python code moves the
 *   run's keys to the end in reversed order: the same result). A key's list is a tag byte, so membership is
 *   one load; each list of one policy has its own tag values.
 * - Ghost lists (ARC's and session's B1 and B2, adaptive's per-expert "resident but not in the shadow") are
 *   FIFO lists on their own link arrays, as the OrderedDicts they stand for (assignment of a new key appends).
 * - A policy stores each resident key's parent (what the Python lists keep as the OrderedDict value).
 * - ARC's p and session's bonus are doubles updated with the Python expressions' operations in the same order.
 * Everything is allocated per run and freed at its end; errors (memory, a progress callback's exception)
 * propagate as Python exceptions. run() checks its arrays are intern()'s (ids in [0, unique), offsets from 0
 * to the number of ids, one limit per request, read-only) before the loop, which then indexes by them
 * unchecked. The `bad` flag guards invariants of the policies themselves, not of the arguments.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int32_t kid; /* a key's id; NONE for Python's None */
#define NONE ((kid)-1)
#define MAX_UNIQUE INT32_MAX /* ids are 0 .. MAX_UNIQUE - 1 (the module's MAX_UNIQUE) */

/* ------------------------------------------------------------------------------------------ lists */

typedef struct {
    kid *prev, *next;
    uint8_t *tag; /* which list of this link set a key is on, 0: none */
} Links;

typedef struct {
    kid head, tail;
    int64_t len;
    uint8_t tag;
} DList;

static int links_init(Links *l, Py_ssize_t n) {
    size_t m = n > 0 ? (size_t)n : 1;
    l->prev = malloc(m * sizeof(kid));
    l->next = malloc(m * sizeof(kid));
    l->tag = calloc(m, 1);
    return (l->prev && l->next && l->tag) ? 0 : -1;
}

static void links_free(Links *l) {
    free(l->prev);
    free(l->next);
    free(l->tag);
    l->prev = l->next = NULL;
    l->tag = NULL;
}

static void dl_init(DList *d, uint8_t tag) {
    d->head = d->tail = NONE;
    d->len = 0;
    d->tag = tag;
}

static inline void dl_push_back(Links *l, DList *d, kid k) {
    l->prev[k] = d->tail;
    l->next[k] = NONE;
    if (d->tail != NONE)
        l->next[d->tail] = k;
    else
        d->head = k;
    d->tail = k;
    d->len++;
    l->tag[k] = d->tag;
}

static inline void dl_push_front(Links *l, DList *d, kid k) {
    l->next[k] = d->head;
    l->prev[k] = NONE;
    if (d->head != NONE)
        l->prev[d->head] = k;
    else
        d->tail = k;
    d->head = k;
    d->len++;
    l->tag[k] = d->tag;
}

static inline void dl_remove(Links *l, DList *d, kid k) {
    kid p = l->prev[k], n = l->next[k];
    if (p != NONE)
        l->next[p] = n;
    else
        d->head = n;
    if (n != NONE)
        l->prev[n] = p;
    else
        d->tail = p;
    d->len--;
    l->tag[k] = 0;
}

static inline kid dl_pop_front(Links *l, DList *d) {
    kid k = d->head;
    if (k != NONE) dl_remove(l, d, k);
    return k;
}

/* Append all of src to dst (src becomes empty). */
static void dl_splice_back(Links *l, DList *dst, DList *src) {
    if (!src->len) return;
    for (kid k = src->head; k != NONE; k = l->next[k]) l->tag[k] = dst->tag;
    if (dst->tail != NONE) {
        l->next[dst->tail] = src->head;
        l->prev[src->head] = dst->tail;
    } else {
        dst->head = src->head;
    }
    dst->tail = src->tail;
    dst->len += src->len;
    src->head = src->tail = NONE;
    src->len = 0;
}

/* _RecencyList */
typedef struct {
    DList main, run;
    kid last;
} RList;

static void rl_init(RList *r, uint8_t tag) {
    dl_init(&r->main, tag);
    dl_init(&r->run, (uint8_t)(tag + 1));
    r->last = NONE;
}

static inline int rl_has(const Links *l, const RList *r, kid k) {
    uint8_t t = l->tag[k];
    return t == r->main.tag || t == r->run.tag;
}

static inline int64_t rl_len(const RList *r) { return r->main.len + r->run.len; }

/* push(key, parent): make key the most recent (key is on this list or on none of this link set). */
static inline void rl_push(Links *l, RList *r, kid *par, kid k, kid parent) {
    if (parent == NONE || parent != r->last || l->tag[k] == r->run.tag) dl_splice_back(l, &r->main, &r->run);
    if (l->tag[k] == r->main.tag) dl_remove(l, &r->main, k);
    par[k] = parent;
    dl_push_front(l, &r->run, k);
    r->last = k;
}

static inline void rl_pop(Links *l, RList *r, kid k) {
    if (l->tag[k] == r->main.tag)
        dl_remove(l, &r->main, k);
    else
        dl_remove(l, &r->run, k);
}

static inline kid rl_first(const RList *r) { return r->main.len ? r->main.head : r->run.head; }

static inline kid rl_pop_first(Links *l, RList *r) {
    return r->main.len ? dl_pop_front(l, &r->main) : dl_pop_front(l, &r->run);
}

/* The key after k in iteration order (closed order, then the run most recent first). */
static inline kid rl_next(const Links *l, const RList *r, kid k) {
    kid n = l->next[k];
    if (n == NONE && l->tag[k] == r->main.tag) return r->run.head;
    return n;
}

/* ---------------------------------------------------------------------------------------- policies */

enum { P_LRU, P_ARC, P_SESSION, P_ADAPTIVE };
enum { T1 = 1, T2 = 3, COLD = 5 }; /* resident list tags (run = tag + 1) */
enum { B1 = 1, B2 = 2 };           /* ghost list tags */

#define MAX_EXPERTS 4

typedef struct Policy Policy;

struct Policy {
    int kind;
    Links r; /* resident lists */
    kid *par;
    RList t1, t2, cold; /* lru: t1 only; arc: t1 and t2; session: all three */
    Links g;            /* ghosts (arc, session) */
    DList b1, b2;
    int64_t cap;
    double p;          /* arc */
    double bonus, step; /* session */
    int64_t *stamp, clock, ghost_cap;
    kid next_cold;
    int *bad; /* set on a state the Python code could not be in (a bug): the run fails */
    /* adaptive */
    int n;
    Policy *sh[MAX_EXPERTS];
    Links out[MAX_EXPERTS];
    DList outl[MAX_EXPERTS];
    double score[MAX_EXPERTS];
    int64_t hits[MAX_EXPERTS];
    uint8_t ok[MAX_EXPERTS];
    kid last;
    int leader;
    int64_t epoch_refs, refs, starts, starts_needed, switches;
    double decay;
    const uint8_t *real; /* the tier's resident set */
};

static int64_t pol_len(const Policy *p) {
    switch (p->kind) {
        case P_LRU:
            return rl_len(&p->t1);
        case P_ARC:
            return rl_len(&p->t1) + rl_len(&p->t2);
        case P_SESSION:
            return rl_len(&p->t1) + rl_len(&p->t2) + rl_len(&p->cold);
        default:
            return -1; /* not used: adaptive's length is the tier's */
    }
}

static inline int pol_has(const Policy *p, kid k) { return p->r.tag[k] != 0; }

/* ARCPolicy._trim_ghosts */
static void arc_trim(Policy *p) {
    int64_t c = p->cap;
    int64_t n1 = rl_len(&p->t1);
    if (n1 + p->b1.len > c)
        while (p->b1.len && n1 + p->b1.len > c) dl_pop_front(&p->g, &p->b1);
    int64_t n12 = n1 + rl_len(&p->t2);
    while (n12 + p->b1.len + p->b2.len > 2 * c) {
        if (!p->b1.len && !p->b2.len) break; /* (Python would raise: popitem on an empty dict) */
        dl_pop_front(&p->g, p->b2.len ? &p->b2 : &p->b1);
    }
}

static inline double dmax(double a, double b) { return a >= b ? a : b; }
static inline double dmin(double a, double b) { return a <= b ? a : b; }

/* Python's max(x, 1.0) / min(c, x) return the first argument on ties; with these values ties are equal. */

static void arc_insert(Policy *p, kid k, kid parent) {
    uint8_t gt = p->g.tag[k];
    if (gt == B1) {
        p->p = dmin((double)p->cap, p->p + dmax((double)p->b2.len / (double)p->b1.len, 1.0));
        dl_remove(&p->g, &p->b1, k);
        rl_push(&p->r, &p->t2, p->par, k, parent);
        arc_trim(p);
    } else if (gt == B2) {
        p->p = dmax(0.0, p->p - dmax((double)p->b1.len / (double)p->b2.len, 1.0));
        dl_remove(&p->g, &p->b2, k);
        rl_push(&p->r, &p->t2, p->par, k, parent);
        arc_trim(p);
    } else {
        rl_push(&p->r, &p->t1, p->par, k, parent);
        int64_t c = p->cap, n1 = rl_len(&p->t1);
        while (p->b1.len && n1 + p->b1.len > c) dl_pop_front(&p->g, &p->b1);
        int64_t n12 = n1 + rl_len(&p->t2);
        while (n12 + p->b1.len + p->b2.len > 2 * c) {
            if (!p->b1.len && !p->b2.len) break;
            dl_pop_front(&p->g, p->b2.len ? &p->b2 : &p->b1);
        }
    }
}

static void arc_touch(Policy *p, kid k) {
    if (rl_has(&p->r, &p->t1, k)) {
        kid parent = p->par[k];
        rl_pop(&p->r, &p->t1, k);
        rl_push(&p->r, &p->t2, p->par, k, parent);
    } else if (rl_has(&p->r, &p->t2, k)) {
        rl_push(&p->r, &p->t2, p->par, k, p->par[k]);
    }
}

static kid arc_pop_victim(Policy *p) {
    int64_t n1 = rl_len(&p->t1), n2 = rl_len(&p->t2);
    kid k;
    if (n1 && ((double)n1 > p->p || !n2)) {
        k = rl_pop_first(&p->r, &p->t1);
        dl_push_back(&p->g, &p->b1, k);
        n1--;
    } else if (n2) {
        k = rl_pop_first(&p->r, &p->t2);
        dl_push_back(&p->g, &p->b2, k);
        n2--;
    } else {
        return NONE;
    }
    int64_t nb1 = p->b1.len, c = p->cap;
    if ((nb1 && n1 + nb1 > c) || n1 + n2 + nb1 + p->b2.len > 2 * c) arc_trim(p);
    return k;
}

/* SessionPolicy */
static void ses_insert_(Policy *p, kid k, kid parent) {
    p->clock++;
    p->stamp[k] = p->clock;
    uint8_t gt = p->g.tag[k];
    if (gt == B1) {
        p->bonus = dmax(0.0, p->bonus - p->step * dmax((double)p->b2.len / (double)p->b1.len, 1.0));
        dl_remove(&p->g, &p->b1, k);
        rl_push(&p->r, &p->t2, p->par, k, parent);
    } else if (gt == B2) {
        p->bonus += p->step * dmax((double)p->b1.len / (double)p->b2.len, 1.0);
        dl_remove(&p->g, &p->b2, k);
        rl_push(&p->r, &p->t2, p->par, k, parent);
    } else {
        rl_push(&p->r, &p->t1, p->par, k, parent);
    }
}

static void ses_touch(Policy *p, kid k) {
    if (!pol_has(p, k)) return;
    if (rl_has(&p->r, &p->cold, k)) {
        kid parent = p->par[k];
        rl_pop(&p->r, &p->cold, k);
        ses_insert_(p, k, parent);
    }
    p->clock++;
    p->stamp[k] = p->clock;
    if (rl_has(&p->r, &p->t1, k)) {
        kid parent = p->par[k];
        rl_pop(&p->r, &p->t1, k);
        rl_push(&p->r, &p->t2, p->par, k, parent);
    } else {
        rl_push(&p->r, &p->t2, p->par, k, p->par[k]);
    }
}

static void ses_insert(Policy *p, kid k, kid parent) {
    if (pol_has(p, k)) {
        ses_touch(p, k);
        return;
    }
    if (k == p->next_cold) {
        p->next_cold = NONE;
        p->stamp[k] = p->clock;
        rl_push(&p->r, &p->cold, p->par, k, parent);
        return;
    }
    ses_insert_(p, k, parent);
}

static inline int ses_t1_first(const Policy *p, kid h1, kid h2) {
    if (h2 == NONE) return 1;
    if (h1 == NONE) return 0;
    return (double)p->stamp[h1] <= (double)p->stamp[h2] + p->bonus;
}

static void ses_ghost(Policy *p, DList *ghosts, kid k) {
    if (!p->ghost_cap) return;
    uint8_t gt = p->g.tag[k];
    if (gt == ghosts->tag) return; /* assignment to a present key keeps its place */
    if (gt) {
        *p->bad = 1; /* a resident T1/T2 key is never a ghost */
        return;
    }
    dl_push_back(&p->g, ghosts, k);
    if (ghosts->len > p->ghost_cap) dl_pop_front(&p->g, ghosts);
}

static kid ses_pop_victim(Policy *p) {
    if (rl_len(&p->cold)) return rl_pop_first(&p->r, &p->cold);
    kid h1 = rl_first(&p->t1), h2 = rl_first(&p->t2);
    if (h1 == NONE && h2 == NONE) return NONE;
    kid k;
    if (ses_t1_first(p, h1, h2)) {
        k = rl_pop_first(&p->r, &p->t1);
        ses_ghost(p, &p->b1, k);
    } else {
        k = rl_pop_first(&p->r, &p->t2);
        ses_ghost(p, &p->b2, k);
    }
    return k;
}

/* The first key of candidates() in `real` (NONE when none): AdaptivePolicy._pop_victim's fallback. */
static kid rl_first_in(const Links *l, const RList *r, const uint8_t *real) {
    for (kid k = rl_first(r); k != NONE; k = rl_next(l, r, k))
        if (real[k]) return k;
    return NONE;
}

static kid pol_first_in(const Policy *p, const uint8_t *real) {
    kid k;
    switch (p->kind) {
        case P_LRU:
            return rl_first_in(&p->r, &p->t1, real);
        case P_ARC: {
            int64_t n1 = rl_len(&p->t1);
            int t1_first = n1 && ((double)n1 > p->p || !rl_len(&p->t2));
            const RList *a = t1_first ? &p->t1 : &p->t2, *b = t1_first ? &p->t2 : &p->t1;
            k = rl_first_in(&p->r, a, real);
            return k != NONE ? k : rl_first_in(&p->r, b, real);
        }
        case P_SESSION: {
            k = rl_first_in(&p->r, &p->cold, real);
            if (k != NONE) return k;
            kid h1 = rl_first(&p->t1), h2 = rl_first(&p->t2);
            while (h1 != NONE || h2 != NONE) {
                if (ses_t1_first(p, h1, h2)) {
                    if (real[h1]) return h1;
                    h1 = rl_next(&p->r, &p->t1, h1);
                } else {
                    if (real[h2]) return h2;
                    h2 = rl_next(&p->r, &p->t2, h2);
                }
            }
            return NONE;
        }
        default:
            return NONE;
    }
}

static void pol_touch(Policy *p, kid k);
static void pol_insert(Policy *p, kid k, kid parent);
static kid pol_pop_victim(Policy *p);

/* AdaptivePolicy._access */
static void ada_access(Policy *a, kid k, kid parent) {
    int walk = parent == NONE || parent == a->last;
    for (int i = 0; i < a->n; i++) {
        Policy *s = a->sh[i];
        if (pol_has(s, k)) {
            if (parent == NONE || (walk && a->ok[i])) {
                a->hits[i]++;
                a->ok[i] = 1;
            } else if (!walk) {
                a->ok[i] = 1;
            }
            pol_touch(s, k);
        } else {
            a->ok[i] = 0;
            if (pol_len(s) >= a->cap) {
                kid v = pol_pop_victim(s);
                if (v != NONE && a->real[v]) {
                    if (a->out[i].tag[v])
                        *a->bad = 1; /* a shadow's resident key is never in its "out" list */
                    else
                        dl_push_back(&a->out[i], &a->outl[i], v);
                }
            }
            pol_insert(s, k, parent);
            if (a->out[i].tag[k]) dl_remove(&a->out[i], &a->outl[i], k);
        }
    }
    a->last = k;
    a->refs++;
    if (parent == NONE) a->starts++;
    if (a->refs >= a->epoch_refs && a->starts >= a->starts_needed) {
        a->refs = 0;
        a->starts = 0;
        for (int i = 0; i < a->n; i++) {
            a->score[i] = a->score[i] * a->decay + (double)a->hits[i];
            a->hits[i] = 0;
        }
        /* max(range(n), key=lambda i: (score[i], i == lead)): the first maximum of that key */
        int lead = a->leader, best = 0;
        for (int i = 1; i < a->n; i++) {
            if (a->score[i] > a->score[best] || (a->score[i] == a->score[best] && i == lead && best != lead))
                best = i;
        }
        if (best != lead) {
            a->leader = best;
            a->switches++;
        }
    }
}

static kid ada_pop_victim(Policy *a) {
    DList *o = &a->outl[a->leader];
    kid k = o->len ? o->head : pol_first_in(a->sh[a->leader], a->real);
    if (k == NONE) return NONE;
    for (int i = 0; i < a->n; i++)
        if (a->out[i].tag[k]) dl_remove(&a->out[i], &a->outl[i], k);
    return k;
}

static void pol_touch(Policy *p, kid k) {
    switch (p->kind) {
        case P_LRU:
            if (pol_has(p, k)) rl_push(&p->r, &p->t1, p->par, k, p->par[k]);
            break;
        case P_ARC:
            arc_touch(p, k);
            break;
        case P_SESSION:
            ses_touch(p, k);
            break;
        case P_ADAPTIVE:
            if (p->real[k]) ada_access(p, k, p->par[k]);
            break;
    }
}

/* insert(key, parent) of an absent key (the index inserts only those; the shadows likewise). */
static void pol_insert(Policy *p, kid k, kid parent) {
    switch (p->kind) {
        case P_LRU:
            rl_push(&p->r, &p->t1, p->par, k, parent);
            break;
        case P_ARC:
            arc_insert(p, k, parent);
            break;
        case P_SESSION:
            ses_insert(p, k, parent);
            break;
        case P_ADAPTIVE:
            p->par[k] = parent;
            ada_access(p, k, parent);
            break;
    }
}

static kid pol_pop_victim(Policy *p) {
    switch (p->kind) {
        case P_LRU:
            return rl_pop_first(&p->r, &p->t1);
        case P_ARC:
            return arc_pop_victim(p);
        case P_SESSION:
            return ses_pop_victim(p);
        default:
            return ada_pop_victim(p);
    }
}

static void pol_hint_cold(Policy *p, kid k) {
    if (p->kind == P_SESSION) p->next_cold = k;
    if (p->kind == P_ADAPTIVE)
        for (int i = 0; i < p->n; i++) pol_hint_cold(p->sh[i], k);
}

static void pol_free(Policy *p) {
    if (p == NULL) return;
    links_free(&p->r);
    links_free(&p->g);
    free(p->par);
    free(p->stamp);
    for (int i = 0; i < p->n; i++) {
        pol_free(p->sh[i]);
        links_free(&p->out[i]);
    }
    free(p);
}

static double get_float(PyObject *spec, Py_ssize_t i, int *err) {
    double v = PyFloat_AsDouble(PyTuple_GET_ITEM(spec, i));
    if (v == -1.0 && PyErr_Occurred()) *err = 1;
    return v;
}

static int64_t get_int(PyObject *spec, Py_ssize_t i, int *err) {
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, i));
    if (v == -1 && PyErr_Occurred()) *err = 1;
    return (int64_t)v;
}

/* A policy from its spec (see the .pyi), or NULL with an exception set. */
static Policy *pol_new(PyObject *spec, Py_ssize_t n, const uint8_t *real, int *bad) {
    static const char *names[] = {"lru", "arc", "session", "adaptive"};
    static const Py_ssize_t sizes[] = {1, 2, 5, 6};
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(spec, 0))) {
        PyErr_SetString(PyExc_TypeError, "a policy spec must be a tuple (name, ...)");
        return NULL;
    }
    int kind = -1;
    for (int i = 0; i < 4; i++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(spec, 0), names[i]) == 0) kind = i;
    if (kind < 0 || PyTuple_GET_SIZE(spec) != sizes[kind]) {
        PyErr_Format(PyExc_ValueError, "bad policy spec %R", spec);
        return NULL;
    }
    Policy *p = calloc(1, sizeof(Policy));
    if (p == NULL) return (Policy *)PyErr_NoMemory();
    p->kind = kind;
    p->bad = bad;
    p->real = real;
    p->next_cold = NONE;
    p->last = NONE;
    rl_init(&p->t1, T1);
    rl_init(&p->t2, T2);
    rl_init(&p->cold, COLD);
    dl_init(&p->b1, B1);
    dl_init(&p->b2, B2);
    int err = 0;
    if (kind != P_ADAPTIVE) {
        if (links_init(&p->r, n) < 0) goto nomem;
    } else {
        p->r.tag = calloc(n > 0 ? (size_t)n : 1, 1); /* unused lists: tags only, all 0 */
        if (p->r.tag == NULL) goto nomem;
    }
    p->par = malloc((n > 0 ? (size_t)n : 1) * sizeof(kid));
    if (p->par == NULL) goto nomem;
    if (kind == P_ARC || kind == P_SESSION) {
        if (links_init(&p->g, n) < 0) goto nomem;
        p->cap = get_int(spec, 1, &err);
    }
    if (kind == P_ARC) p->p = 0.0;
    if (kind == P_SESSION) {
        p->ghost_cap = get_int(spec, 2, &err);
        p->step = get_float(spec, 3, &err);
        p->bonus = get_float(spec, 4, &err);
        p->stamp = malloc((n > 0 ? (size_t)n : 1) * sizeof(int64_t));
        if (p->stamp == NULL) goto nomem;
    }
    if (kind == P_ADAPTIVE) {
        /* ("adaptive", capacity, (expert specs...), decay, starts, epoch_refs) */
        p->cap = get_int(spec, 1, &err);
        PyObject *experts = PyTuple_GET_ITEM(spec, 2);
        p->decay = get_float(spec, 3, &err);
        p->starts_needed = get_int(spec, 4, &err);
        p->epoch_refs = get_int(spec, 5, &err);
        if (err) goto fail;
        if (!PyTuple_Check(experts) || PyTuple_GET_SIZE(experts) < 1 ||
            PyTuple_GET_SIZE(experts) > MAX_EXPERTS) {
            PyErr_SetString(PyExc_ValueError, "adaptive needs 1 to 4 expert specs");
            goto fail;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(experts); i++) {
            PyObject *es = PyTuple_GET_ITEM(experts, i);
            if (PyTuple_Check(es) && PyTuple_GET_SIZE(es) &&
                PyUnicode_Check(PyTuple_GET_ITEM(es, 0)) &&
                PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(es, 0), "adaptive") == 0) {
                PyErr_SetString(PyExc_ValueError, "an adaptive expert cannot be adaptive");
                goto fail;
            }
            if (links_init(&p->out[i], n) < 0) goto nomem;
            dl_init(&p->outl[i], 1);
            p->n = (int)i + 1;
            p->sh[i] = pol_new(es, n, real, bad);
            if (p->sh[i] == NULL) goto fail;
        }
    }
    if (err) goto fail;
    return p;
nomem:
    PyErr_NoMemory();
fail:
    pol_free(p);
    return NULL;
}

/* ------------------------------------------------------------------------------------------- tiers */

typedef struct {
    int64_t slots, used;
    uint8_t *present;
    Policy *pol;
    int64_t hit_blocks, hit_tokens, stored, staged, evicted, rejected;
} Tier;

/* BlockIndex.touch_prefix(keys, start) */
static inline int64_t tier_touch_prefix(Tier *t, const kid *keys, int64_t start, int64_t n) {
    int64_t i = start;
    for (; i < n; i++) {
        kid k = keys[i];
        if (!t->present[k]) break;
        pol_touch(t->pol, k);
    }
    return i - start;
}

/* BlockIndex.insert_chain(keys[:n], start) */
static int64_t tier_insert_chain(Tier *t, const kid *keys, int64_t start, int64_t n) {
    kid parent = start > 0 ? keys[start - 1] : NONE;
    int64_t inserted = 0;
    for (int64_t i = start; i < n; i++) {
        kid k = keys[i];
        if (t->present[k]) {
            pol_touch(t->pol, k);
            parent = k;
            continue;
        }
        if (t->used < t->slots) {
            t->used++;
        } else {
            kid v = pol_pop_victim(t->pol);
            if (v == NONE) {
                t->rejected++;
                parent = k;
                continue;
            }
            t->present[v] = 0;
            t->evicted++;
        }
        t->present[k] = 1;
        pol_insert(t->pol, k, parent);
        inserted++;
        parent = k;
    }
    return inserted;
}

/* --------------------------------------------------------------------------------------- functions */

PyDoc_STRVAR(intern_doc,
             "intern(requests, max_unique=MAX_UNIQUE, /) -> (ids, offsets, limits, unique) | None\n\n"
             "Each request's keys as dense int32 ids (first appearance order), concatenated; offsets (int64,\n"
             "len(requests) + 1) bound each request's ids; limits (int64, len(requests)) are the input_tokens.\n"
             "None when the requests hold more than max_unique (0 to MAX_UNIQUE) unique keys.");

static PyObject *intern_(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "intern takes 1 or 2 arguments");
        return NULL;
    }
    long long max_unique = MAX_UNIQUE;
    if (nargs == 2) {
        max_unique = PyLong_AsLongLong(args[1]);
        if (max_unique == -1 && PyErr_Occurred()) return NULL;
        if (max_unique < 0 || max_unique > MAX_UNIQUE) {
            PyErr_Format(PyExc_ValueError, "max_unique must be in [0, %d], got %lld", MAX_UNIQUE, max_unique);
            return NULL;
        }
    }
    PyObject *seq = PySequence_Fast(args[0], "requests must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t nreq = PySequence_Fast_GET_SIZE(seq);
    int over = 0; /* more than max_unique unique keys: the result is None */
    PyObject *table = PyDict_New(), *ids = NULL, *offs = NULL, *limits = NULL, *result = NULL;
    PyObject *s_keys = PyUnicode_InternFromString("keys");
    PyObject *s_input = PyUnicode_InternFromString("input_tokens");
    kid *idv = NULL;
    size_t idcap = 0, idlen = 0;
    if (table == NULL || s_keys == NULL || s_input == NULL) goto done;
    offs = PyBytes_FromStringAndSize(NULL, (nreq + 1) * (Py_ssize_t)sizeof(int64_t));
    limits = PyBytes_FromStringAndSize(NULL, nreq * (Py_ssize_t)sizeof(int64_t));
    if (offs == NULL || limits == NULL) goto done;
    int64_t *ov = (int64_t *)PyBytes_AS_STRING(offs), *lv = (int64_t *)PyBytes_AS_STRING(limits);
    ov[0] = 0;
    for (Py_ssize_t r = 0; r < nreq; r++) {
        PyObject *req = PySequence_Fast_GET_ITEM(seq, r);
        PyObject *keys = PyObject_GetAttr(req, s_keys);
        if (keys == NULL) goto done;
        PyObject *inp = PyObject_GetAttr(req, s_input);
        if (inp == NULL) {
            Py_DECREF(keys);
            goto done;
        }
        long long limit = PyLong_AsLongLong(inp);
        Py_DECREF(inp);
        if (limit == -1 && PyErr_Occurred()) {
            Py_DECREF(keys);
            goto done;
        }
        lv[r] = limit;
        PyObject *kseq = PySequence_Fast(keys, "keys must be a sequence");
        Py_DECREF(keys);
        if (kseq == NULL) goto done;
        Py_ssize_t nk = PySequence_Fast_GET_SIZE(kseq);
        if (idlen + (size_t)nk > idcap) {
            size_t cap = idcap ? idcap : 4096;
            while (cap < idlen + (size_t)nk) cap *= 2;
            kid *grown = realloc(idv, cap * sizeof(kid));
            if (grown == NULL) {
                Py_DECREF(kseq);
                PyErr_NoMemory();
                goto done;
            }
            idv = grown;
            idcap = cap;
        }
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *key = PySequence_Fast_GET_ITEM(kseq, i);
            PyObject *id = PyDict_GetItemWithError(table, key);
            long v;
            if (id != NULL) {
                v = PyLong_AsLong(id);
            } else {
                if (PyErr_Occurred()) {
                    Py_DECREF(kseq);
                    goto done;
                }
                v = (long)PyDict_GET_SIZE(table);
                if (v >= max_unique) {
                    Py_DECREF(kseq);
                    over = 1;
                    goto done;
                }
                PyObject *nid = PyLong_FromLong(v);
                if (nid == NULL || PyDict_SetItem(table, key, nid) < 0) {
                    Py_XDECREF(nid);
                    Py_DECREF(kseq);
                    goto done;
                }
                Py_DECREF(nid);
            }
            idv[idlen++] = (kid)v;
        }
        Py_DECREF(kseq);
        ov[r + 1] = (int64_t)idlen;
    }
    ids = PyBytes_FromStringAndSize((const char *)idv, (Py_ssize_t)(idlen * sizeof(kid)));
    if (ids == NULL) goto done;
    result = Py_BuildValue("(OOOn)", ids, offs, limits, PyDict_GET_SIZE(table));
done:
    free(idv);
    Py_XDECREF(ids);
    Py_XDECREF(offs);
    Py_XDECREF(limits);
    Py_XDECREF(table);
    Py_XDECREF(s_keys);
    Py_XDECREF(s_input);
    Py_DECREF(seq);
    if (over) Py_RETURN_NONE;
    return result;
}

/* A buffer argument of run() as read-only, C-contiguous bytes whose length is a multiple of `item`: read-only
 * so that the progress callback cannot change what was checked. */
static int get_array(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t item, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (!view->readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be a read-only buffer such as bytes, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (view->len % item) {
        PyErr_Format(PyExc_ValueError, "%s must hold %s (a multiple of %zd bytes), got %zd bytes", name, what, item,
                     view->len);
        return -1;
    }
    return 0;
}

/* run()'s arrays are intern()'s: refuse anything else before the loop, which indexes by them unchecked. */
static int check_run_arrays(const Py_buffer *bids, const Py_buffer *boffs, const Py_buffer *blims,
                            Py_ssize_t nuniq) {
    const kid *ids = bids->buf;
    const int64_t *offs = boffs->buf;
    Py_ssize_t nids = bids->len / (Py_ssize_t)sizeof(kid), noffs = boffs->len / (Py_ssize_t)sizeof(int64_t);
    if (noffs < 1) {
        PyErr_SetString(PyExc_ValueError, "offsets must hold one int64 more than there are requests, got none");
        return -1;
    }
    Py_ssize_t nreq = noffs - 1;
    if (blims->len != nreq * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "limits must hold one int64 per request (%zd), got %zd bytes", nreq,
                     blims->len);
        return -1;
    }
    if (offs[0] != 0) {
        PyErr_Format(PyExc_ValueError, "offsets must start at 0, got %lld", (long long)offs[0]);
        return -1;
    }
    for (Py_ssize_t r = 0; r < nreq; r++) {
        if (offs[r + 1] < offs[r]) {
            PyErr_Format(PyExc_ValueError, "offsets must not decrease, got %lld after %lld at %zd",
                         (long long)offs[r + 1], (long long)offs[r], r + 1);
            return -1;
        }
    }
    if (offs[nreq] != nids) {
        PyErr_Format(PyExc_ValueError, "offsets must end at the number of ids (%zd), got %lld", nids,
                     (long long)offs[nreq]);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nids; i++) {
        if (ids[i] < 0 || ids[i] >= nuniq) {
            PyErr_Format(PyExc_ValueError, "ids must be in [0, unique) = [0, %zd), got %ld at %zd", nuniq,
                         (long)ids[i], i);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(run_doc,
             "run(ids, offsets, limits, unique, block_tokens, tiers, inflight, progress, /) -> (counts, hit_tokens)\n\n"
             "_run on interned ids: tiers is a sequence of (slots, policy spec); counts per tier are\n"
             "(hit_blocks, hit_tokens, stored, staged, evicted, rejected).");

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "run takes 8 arguments");
        return NULL;
    }
    Py_buffer bids = {0}, boffs = {0}, blims = {0};
    Tier *tiers = NULL;
    Py_ssize_t m = 0;
    int64_t *pend = NULL;
    PyObject *result = NULL, *tseq = NULL;
    int bad = 0;
    if (get_array(args[0], &bids, "ids", (Py_ssize_t)sizeof(kid), "int32 ids") < 0) goto done;
    if (get_array(args[1], &boffs, "offsets", (Py_ssize_t)sizeof(int64_t), "int64 offsets") < 0) goto done;
    if (get_array(args[2], &blims, "limits", (Py_ssize_t)sizeof(int64_t), "int64 limits") < 0) goto done;
    Py_ssize_t nuniq = PyLong_AsSsize_t(args[3]);
    long long bt = PyLong_AsLongLong(args[4]);
    long long inflight = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) goto done;
    PyObject *progress = args[7];
    if (nuniq < 0 || nuniq > MAX_UNIQUE) {
        PyErr_Format(PyExc_ValueError, "unique must be in [0, %d], got %zd", MAX_UNIQUE, nuniq);
        goto done;
    }
    if (bt <= 0) {
        PyErr_Format(PyExc_ValueError, "block_tokens must be > 0, got %lld", bt);
        goto done;
    }
    if (inflight < 0) {
        PyErr_Format(PyExc_ValueError, "inflight must be >= 0, got %lld", inflight);
        goto done;
    }
    if (check_run_arrays(&bids, &boffs, &blims, nuniq) < 0) goto done;
    const kid *ids = bids.buf;
    const int64_t *offs = boffs.buf, *lims = blims.buf;
    Py_ssize_t nreq = boffs.len / (Py_ssize_t)sizeof(int64_t) - 1;
    tseq = PySequence_Fast(args[5], "tiers must be a sequence");
    if (tseq == NULL) goto done;
    m = PySequence_Fast_GET_SIZE(tseq);
    tiers = calloc(m ? (size_t)m : 1, sizeof(Tier));
    if (tiers == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t t = 0; t < m; t++) {
        PyObject *item = PySequence_Fast_GET_ITEM(tseq, t);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "a tier must be a tuple (slots, spec)");
            goto done;
        }
        tiers[t].slots = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0));
        if (PyErr_Occurred()) goto done;
        tiers[t].present = calloc(nuniq ? (size_t)nuniq : 1, 1);
        if (tiers[t].present == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        tiers[t].pol = pol_new(PyTuple_GET_ITEM(item, 1), nuniq, tiers[t].present, &bad);
        if (tiers[t].pol == NULL) goto done;
    }
    /* pending stores: a ring of (request, pos) pairs, at most inflight + 1 at once */
    int64_t ring = (inflight < nreq ? inflight : nreq) + 1;
    pend = malloc((size_t)ring * 2 * sizeof(int64_t));
    if (pend == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t phead = 0, plen = 0, total_hit_tokens = 0, step_refs = 0;
    int64_t bounds[65];
    int64_t *bnd = m + 1 <= 65 ? bounds : malloc((size_t)(m + 1) * sizeof(int64_t));
    if (bnd == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r <= nreq; r++) {
        int draining = r == nreq;
        if (!draining) {
            const kid *keys = ids + offs[r];
            int64_t n = offs[r + 1] - offs[r], limit = lims[r], pos = 0;
            bnd[0] = 0;
            for (Py_ssize_t t = 0; t < m; t++) {
                if (pos < n) {
                    int64_t h = tier_touch_prefix(&tiers[t], keys, pos, n);
                    if (h) {
                        int64_t a = (pos + h) * bt, b = pos * bt;
                        tiers[t].hit_blocks += h;
                        tiers[t].hit_tokens += (a < limit ? a : limit) - (b < limit ? b : limit);
                        pos += h;
                    }
                }
                bnd[t + 1] = pos;
            }
            total_hit_tokens += pos * bt < limit ? pos * bt : limit;
            if (pos && m > 1)
                for (Py_ssize_t t = 0; t + 1 < m; t++)
                    if (bnd[t + 1] < pos) tiers[t].staged += tier_insert_chain(&tiers[t], keys, bnd[t + 1], pos);
            if (pos < n) {
                int64_t slot = (phead + plen) % ring;
                pend[2 * slot] = r;
                pend[2 * slot + 1] = pos;
                plen++;
            }
        }
        while (plen > (draining ? 0 : inflight)) {
            int64_t q = pend[2 * phead], qpos = pend[2 * phead + 1];
            phead = (phead + 1) % ring;
            plen--;
            const kid *qkeys = ids + offs[q];
            int64_t qn = offs[q + 1] - offs[q];
            if (lims[q] < qn * bt)
                for (Py_ssize_t t = 0; t < m; t++) pol_hint_cold(tiers[t].pol, qkeys[qn - 1]);
            for (Py_ssize_t t = 0; t < m; t++) tiers[t].stored += tier_insert_chain(&tiers[t], qkeys, qpos, qn);
        }
        if (bad) break;
        if (progress != Py_None) {
            if (!draining) step_refs += offs[r + 1] - offs[r];
            if (step_refs >= 65536 || (draining && step_refs)) {
                PyObject *rv = PyObject_CallFunction(progress, "L", (long long)step_refs);
                step_refs = 0;
                if (rv == NULL) {
                    if (bnd != bounds) free(bnd);
                    goto done;
                }
                Py_DECREF(rv);
            }
        }
    }
    if (bnd != bounds) free(bnd);
    if (bad) {
        PyErr_SetString(PyExc_RuntimeError, "aiokv._native._replay reached a state the Python policies cannot be in");
        goto done;
    }
    PyObject *counts = PyList_New(m);
    if (counts == NULL) goto done;
    for (Py_ssize_t t = 0; t < m; t++) {
        Tier *x = &tiers[t];
        PyObject *c = Py_BuildValue("(LLLLLL)", (long long)x->hit_blocks, (long long)x->hit_tokens,
                                    (long long)x->stored, (long long)x->staged, (long long)x->evicted,
                                    (long long)x->rejected);
        if (c == NULL) {
            Py_DECREF(counts);
            goto done;
        }
        PyList_SET_ITEM(counts, t, c);
    }
    result = Py_BuildValue("(NL)", counts, (long long)total_hit_tokens);
done:
    if (tiers != NULL) {
        for (Py_ssize_t t = 0; t < m; t++) {
            pol_free(tiers[t].pol);
            free(tiers[t].present);
        }
        free(tiers);
    }
    free(pend);
    Py_XDECREF(tseq);
    if (bids.obj) PyBuffer_Release(&bids);
    if (boffs.obj) PyBuffer_Release(&boffs);
    if (blims.obj) PyBuffer_Release(&blims);
    return result;
}

static PyMethodDef methods[] = {
    {"intern", (PyCFunction)(void (*)(void))intern_, METH_FASTCALL, intern_doc},
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL, run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit__replay(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_UNIQUE", MAX_UNIQUE) < 0) Py_CLEAR(m);
    return m;
}
