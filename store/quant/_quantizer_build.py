"""cffi (API mode) builder of ``czyx.store.quant._quantizer``, the C quantizer.

Built by ``setup.py`` (it discovers every ``_*_build.py``). One call quantizes
one matrix (``czyx_quantize``): it reads the source weights in their stored
dtype (f32, f16 or bf16, widened exactly), chooses every group's fp16 scale and
offset with the importance-weighted search of :mod:`czyx.store.quant.quantizer`
and writes the planar packed buffer of :mod:`czyx.store.quant.formats`.

Why C: the numpy search runs two dozen passes of a dozen array operations over
every group, each pass a full memory round trip and a Python call; in C a
group's 32-128 weights stay in L1 for the whole search.

Same bytes as the numpy reference. Every operation mirrors the reference's in
order and precision: float32 element products and sums evaluated exactly as
numpy evaluates them (``-ffp-contract=off``: no fused multiply-add), the
float64 group sums with numpy's pairwise summation (8 accumulators for up to
128 terms, halves above), ``rint`` ties-to-even, numpy's ``clip`` and fp16
conversions correctly rounded to nearest-even (float32 and float64 sources
alike, as numpy's casts do). ``tests/store/quant/test_native.py`` checks the
bytes against the numpy reference with hypothesis.

Threads: rows are cut into fixed blocks handed out by an atomic counter to
``nthreads`` pthreads. Each group's result depends only on its own weights, so
the output is identical for every thread count and every schedule. cffi
releases the GIL around the call.

Return: 0, or ``-1`` (a non-finite weight, its smallest flat index in
``*bad``), ``-2`` (a magnitude above ``FP16_SAFE``, index in ``*bad``), ``-3``
(out of memory), ``-4`` (bad arguments).
"""

from __future__ import annotations

from cffi import FFI

CDEF = """
int czyx_quantize(const void *src, int dtype, int64_t rows, int64_t cols, int bits,
                  int group, const float *imp, int search, uint8_t *out, int nthreads,
                  int64_t *bad);
uint16_t czyx_f64_to_f16(double v);
"""

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SAFE 60000.0
#define NSTEP 20
#define REFINE 2
#define INL static inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* ------------------------------------------------------------------ fp16 */
INL float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    float v;
    if (e == 0) {
        v = (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
        return s ? -v : v;
    }
    if (e == 31) b = s | 0x7f800000u | (m << 13);
    else b = s | ((e + 112u) << 23) | (m << 13);
    memcpy(&v, &b, 4);
    return v;
}

/* double -> fp16, correctly rounded to nearest even (as numpy's casts) */
INL uint16_t d2h(double v) {
    uint64_t b, mant, M, R, rem, half;
    int e, shift;
    uint16_t sign;
    memcpy(&b, &v, 8);
    sign = (uint16_t)((b >> 48) & 0x8000u);
    b &= 0x7fffffffffffffffull;
    if (b >= 0x7ff0000000000000ull)
        return (uint16_t)(sign | 0x7c00u | (b > 0x7ff0000000000000ull ? 0x200u : 0u));
    e = (int)(b >> 52) - 1023;
    mant = b & 0x000fffffffffffffull;
    if (e > 15) return (uint16_t)(sign | 0x7c00u);
    if (e < -25) return sign;
    M = mant | 0x0010000000000000ull;
    shift = e >= -14 ? 42 : 42 + (-14 - e);
    R = M >> shift;
    rem = M & ((1ull << shift) - 1);
    half = 1ull << (shift - 1);
    if (rem > half || (rem == half && (R & 1))) R++;
    if (e >= -14) {
        uint64_t h = ((uint64_t)(e + 15) << 10) + R - 1024;
        if (h >= 0x7c00u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | h);
    }
    return (uint16_t)(sign | R);
}

uint16_t czyx_f64_to_f16(double v) { return d2h(v); }

/* numpy's nextafter on fp16 bit patterns (finite x) */
INL uint16_t h_next(uint16_t x, int up) {
    if ((x & 0x7fffu) == 0) return up ? 0x0001u : 0x8001u;
    if (!(x & 0x8000u)) return up ? (uint16_t)(x + 1) : (uint16_t)(x - 1);
    return up ? (uint16_t)(x - 1) : (uint16_t)(x + 1);
}

/* ------------------------------------------------------- numpy's sums */
static double pw_big(const double *a, int64_t n);
typedef double v8d __attribute__((vector_size(64)));

/* numpy's pairwise sum (pairwise_sum_DOUBLE): 8 accumulators up to 128 terms */
INL double pw(const double *a, int64_t n) {
    if (n >= 8 && n <= 128 && n % 8 == 0) { /* the 8 accumulators are one vector's lanes */
        v8d r, t;
        memcpy(&r, a, sizeof r);
        for (int64_t i = 8; i < n; i += 8) {
            memcpy(&t, a + i, sizeof t);
            r += t;
        }
        return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    }
    return pw_big(a, n);
}

static double pw_big(const double *a, int64_t n) {
    if (n < 8) {
        double r = 0.;
        for (int64_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        double r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pw_big(a, n2) + pw_big(a + n2, n - n2);
}

/* --------------------------------------------------------- one group */
typedef struct {
    float *x, *sh, *wx, *cand, *q, *bq, *tmp;
    double *t0, *t1, *t2;
} scratch;

INL float clipq(float t, float qm) {
    t = t > 0.0f ? t : 0.0f; /* numpy clip: min(max(t, 0), qmax) */
    return t < qm ? t : qm;
}

INL void assign(const float *x, int g, uint16_t dh, uint16_t mh, float qm, float *q) {
    float df = h2f(dh), mf = h2f(mh);
    float inv = df > 0.0f ? 1.0f / df : 0.0f;
    for (int i = 0; i < g; i++) q[i] = clipq(rintf((x[i] - mf) * inv), qm);
}

INL double werr(const float *x, const float *w, const float *q, int g, uint16_t dh,
                   uint16_t mh, double *t) {
    float df = h2f(dh), mf = h2f(mh);
    if (w) {
        for (int i = 0; i < g; i++) {
            float r = q[i] * df + mf - x[i];
            t[i] = (double)((r * r) * w[i]);
        }
    } else {
        for (int i = 0; i < g; i++) {
            float r = q[i] * df + mf - x[i];
            t[i] = (double)(r * r);
        }
    }
    return pw(t, g);
}

typedef struct {
    double sw, sx, err;
    uint16_t d, m;
} best_t;

/* least-squares (d, m) for codes c, fp16 snap, reassign, keep if strictly better */
INL void try_codes(scratch *s, const float *w, int g, float qm, const float *c, best_t *b) {
    for (int i = 0; i < g; i++) {
        float wq = w ? w[i] * c[i] : c[i];
        s->t0[i] = (double)wq;
        s->t1[i] = (double)(wq * c[i]);
        s->t2[i] = (double)(s->wx[i] * c[i]);
    }
    double sl = pw(s->t0, g), sll = pw(s->t1, g), slx = pw(s->t2, g);
    double sw = b->sw, sx = b->sx;
    double det = sw * sll - sl * sl;
    double p = sw * sll;
    if (!(det > 1e-12 * (p > 1e-300 ? p : 1e-300))) return;
    double d = (sw * slx - sl * sx) / det;
    double m = (sll * sx - sl * slx) / det;
    if (!(d > 0 && isfinite(d) && isfinite(m))) return;
    if (!(fabs(m) < SAFE && d * 255 < SAFE)) return;
    uint16_t dh = d2h(d), mh = d2h(m);
    if (!(h2f(dh) > 0.0f)) return;
    assign(s->x, g, dh, mh, qm, s->q);
    double err = werr(s->x, w, s->q, g, dh, mh, s->t0);
    if (err < b->err) {
        memcpy(s->bq, s->q, (size_t)g * sizeof(float));
        b->d = dh;
        b->m = mh;
        b->err = err;
    }
}

/* s->x holds the group; w its error weights or NULL; result in s->bq, *d, *m */
INL void fit_impl(scratch *s, const float *w, int g, int qmax, int search, uint16_t *dout,
                  uint16_t *mout) {
    const float *x = s->x;
    float qm = (float)qmax;
    float xmin = x[0], xmax = x[0];
    for (int i = 1; i < g; i++) {
        xmin = x[i] < xmin ? x[i] : xmin;
        xmax = x[i] > xmax ? x[i] : xmax;
    }
    /* min-max start: m <= xmin, d * qmax + m >= xmax, both fp16 */
    uint16_t m = d2h((double)xmin);
    if (h2f(m) > xmin) m = h_next(m, 0);
    float mf = h2f(m);
    uint16_t d = d2h((double)((xmax - mf) / qm));
    for (int r = 0; r < 4; r++) {
        if (!(h2f(d) * qm + mf < xmax)) break;
        d = h_next(d, 1);
    }
    best_t b;
    assign(x, g, d, m, qm, s->bq);
    b.d = d;
    b.m = m;
    b.err = werr(x, w, s->bq, g, d, m, s->t0);
    if (search) {
        float rng = xmax - xmin;
        float inv = rng > 0.0f ? 1.0f / rng : 0.0f;
        for (int i = 0; i < g; i++) s->sh[i] = x[i] - xmin;
        if (w) {
            for (int i = 0; i < g; i++) {
                s->wx[i] = w[i] * x[i];
                s->t0[i] = (double)w[i];
            }
            b.sw = pw(s->t0, g);
        } else {
            memcpy(s->wx, x, (size_t)g * sizeof(float));
            b.sw = (double)g;
        }
        for (int i = 0; i < g; i++) s->t1[i] = (double)s->wx[i];
        b.sx = pw(s->t1, g);
        for (int k = 0; k <= NSTEP; k++) {
            float isc = (float)(((double)qmax + -1.0) + 0.1 * (double)k) * inv;
            for (int i = 0; i < g; i++) s->cand[i] = clipq(rintf(isc * s->sh[i]), qm);
            try_codes(s, w, g, qm, s->cand, &b);
        }
        for (int r = 0; r < REFINE; r++) {
            memcpy(s->tmp, s->bq, (size_t)g * sizeof(float));
            try_codes(s, w, g, qm, s->tmp, &b);
        }
    }
    *dout = b.d;
    *mout = b.m;
}

/* ------------------------------------------------ sixteen groups at once
   The same search with the groups in vector lanes ("structure of arrays"):
   element i of lane l is a[i][l]. Every per-group scalar step of fit_impl (the
   pairwise sums' accumulators, the 2x2 solve, the fp16 rounding, the
   comparisons) becomes a loop over lanes that the compiler vectorises, and each
   lane performs exactly fit_impl's operations in fit_impl's order, so the
   bytes are the same. Used for groups of up to 128 (numpy's pairwise sum is
   then one level of 8 accumulators, accumulated here as the terms are made). */
#define L 16
#define MAXG 128
typedef struct {
    float x[MAXG][L], w[MAXG][L], sh[MAXG][L], wx[MAXG][L], c[MAXG][L], q[MAXG][L],
        bq[MAXG][L];
    double a0[8][L], a1[8][L], a2[8][L];
    float inv[L], df[L], mf[L];
    double sw[L], sx[L], berr[L], err[L], d[L], m[L];
    int32_t ok[L], better[L];
    uint32_t bd[L], bm[L], dh[L], mh[L];
} soa_t;

INL float h2f_l(uint32_t h) { /* branchless h2f for finite halves */
    uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t nb = s | ((e + 112u) << 23) | (m << 13);
    float nv, sv = (float)m * 5.9604644775390625e-08f;
    memcpy(&nv, &nb, 4);
    sv = s ? -sv : sv;
    return e == 0 ? sv : nv;
}

INL uint32_t d2h_l(double v) { /* branchless d2h for finite doubles */
    uint64_t b;
    memcpy(&b, &v, 8);
    uint64_t sign = (b >> 48) & 0x8000u;
    b &= 0x7fffffffffffffffull;
    int64_t e = (int64_t)(b >> 52) - 1023;
    uint64_t M = (b & 0x000fffffffffffffull) | 0x0010000000000000ull;
    int64_t shift = e >= -14 ? 42 : 28 - e;
    shift = shift > 63 ? 63 : shift;
    uint64_t R = M >> shift;
    uint64_t rem = M & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    R += (uint64_t)((rem > half) | ((rem == half) & (R & 1)));
    uint64_t hn = ((uint64_t)(e + 15) << 10) + R - 1024;
    uint64_t h = e >= -14 ? hn : R;
    h = (e > 15 || h >= 0x7c00u) ? 0x7c00u : h;
    h = e < -25 ? 0 : h;
    return (uint32_t)(sign | h);
}

/* codes q[][] of every lane for (dh, mh); then the weighted error into err[] */
INL void soa_assign_err(soa_t *S, int g, float qm, const uint32_t *dh, const uint32_t *mh,
                        float (*q)[L]) {
    for (int l = 0; l < L; l++) {
        S->df[l] = h2f_l(dh[l]);
        S->mf[l] = h2f_l(mh[l]);
        S->inv[l] = S->df[l] > 0.0f ? 1.0f / S->df[l] : 0.0f;
    }
    for (int i = 0; i < g; i++) {
        for (int l = 0; l < L; l++) {
            float t = rintf((S->x[i][l] - S->mf[l]) * S->inv[l]);
            t = t > 0.0f ? t : 0.0f;
            t = t < qm ? t : qm;
            q[i][l] = t;
            float r = t * S->df[l] + S->mf[l] - S->x[i][l];
            double e = (double)((r * r) * S->w[i][l]);
            if (i < 8) S->a0[i][l] = e;
            else S->a0[i & 7][l] += e;
        }
    }
    for (int l = 0; l < L; l++)
        S->err[l] = ((S->a0[0][l] + S->a0[1][l]) + (S->a0[2][l] + S->a0[3][l])) +
                    ((S->a0[4][l] + S->a0[5][l]) + (S->a0[6][l] + S->a0[7][l]));
}

#define COMB(A, l) \
    (((A[0][l] + A[1][l]) + (A[2][l] + A[3][l])) + ((A[4][l] + A[5][l]) + (A[6][l] + A[7][l])))

INL void soa_try(soa_t *S, int g, float qm, float (*c)[L]) {
    for (int i = 0; i < g; i++) {
        for (int l = 0; l < L; l++) {
            float wq = S->w[i][l] * c[i][l];
            double t0 = (double)wq, t1 = (double)(wq * c[i][l]);
            double t2 = (double)(S->wx[i][l] * c[i][l]);
            if (i < 8) {
                S->a0[i][l] = t0;
                S->a1[i][l] = t1;
                S->a2[i][l] = t2;
            } else {
                S->a0[i & 7][l] += t0;
                S->a1[i & 7][l] += t1;
                S->a2[i & 7][l] += t2;
            }
        }
    }
    for (int l = 0; l < L; l++) { /* simple lane loops: each one vectorises */
        double sl = COMB(S->a0, l), sll = COMB(S->a1, l), slx = COMB(S->a2, l);
        double sw = S->sw[l], sx = S->sx[l];
        double det = sw * sll - sl * sl;
        double p = sw * sll;
        int ok = det > 1e-12 * (p > 1e-300 ? p : 1e-300);
        double d = (sw * slx - sl * sx) / det;
        double m = (sll * sx - sl * slx) / det;
        ok = ok & (d > 0) & (fabs(d) < INFINITY) & (fabs(m) < INFINITY);
        ok = ok & (fabs(m) < SAFE) & (d * 255 < SAFE);
        S->d[l] = ok ? d : 0.0;
        S->m[l] = ok ? m : 0.0;
        S->ok[l] = ok;
    }
    for (int l = 0; l < L; l++) S->dh[l] = d2h_l(S->d[l]);
    for (int l = 0; l < L; l++) S->mh[l] = d2h_l(S->m[l]);
    int any = 0;
    for (int l = 0; l < L; l++) {
        S->ok[l] = S->ok[l] & (h2f_l(S->dh[l]) > 0.0f);
        any |= S->ok[l];
    }
    if (!any) return;
    soa_assign_err(S, g, qm, S->dh, S->mh, S->q);
    any = 0;
    for (int l = 0; l < L; l++) {
        S->better[l] = S->ok[l] & (S->err[l] < S->berr[l]);
        any |= S->better[l];
    }
    if (!any) return;
    for (int l = 0; l < L; l++) {
        S->bd[l] = S->better[l] ? S->dh[l] : S->bd[l];
        S->bm[l] = S->better[l] ? S->mh[l] : S->bm[l];
        S->berr[l] = S->better[l] ? S->err[l] : S->berr[l];
    }
    for (int i = 0; i < g; i++)
        for (int l = 0; l < L; l++) S->bq[i][l] = S->better[l] ? S->q[i][l] : S->bq[i][l];
}

/* S->x and S->w (ones without importance) hold 16 groups; results in bq, bd, bm */
INL void soa_fit_impl(soa_t *S, int g, int qmax, int search) {
    float qm = (float)qmax;
    float xmin[L], xmax[L];
    uint32_t d0[L], m0[L];
    for (int l = 0; l < L; l++) {
        xmin[l] = S->x[0][l];
        xmax[l] = S->x[0][l];
    }
    for (int i = 1; i < g; i++)
        for (int l = 0; l < L; l++) {
            xmin[l] = S->x[i][l] < xmin[l] ? S->x[i][l] : xmin[l];
            xmax[l] = S->x[i][l] > xmax[l] ? S->x[i][l] : xmax[l];
        }
    for (int l = 0; l < L; l++) { /* the min-max start, as fit_impl */
        uint16_t m = d2h((double)xmin[l]);
        if (h2f(m) > xmin[l]) m = h_next(m, 0);
        float mf = h2f(m);
        uint16_t d = d2h((double)((xmax[l] - mf) / qm));
        for (int r = 0; r < 4; r++) {
            if (!(h2f(d) * qm + mf < xmax[l])) break;
            d = h_next(d, 1);
        }
        d0[l] = d;
        m0[l] = m;
    }
    soa_assign_err(S, g, qm, d0, m0, S->bq);
    for (int l = 0; l < L; l++) {
        S->bd[l] = d0[l];
        S->bm[l] = m0[l];
        S->berr[l] = S->err[l];
    }
    if (!search) return;
    float inv[L];
    for (int l = 0; l < L; l++) {
        float rng = xmax[l] - xmin[l];
        inv[l] = rng > 0.0f ? 1.0f / rng : 0.0f;
    }
    for (int i = 0; i < g; i++)
        for (int l = 0; l < L; l++) {
            S->sh[i][l] = S->x[i][l] - xmin[l];
            S->wx[i][l] = S->w[i][l] * S->x[i][l];
            double a = (double)S->w[i][l], b = (double)S->wx[i][l];
            if (i < 8) {
                S->a0[i][l] = a;
                S->a1[i][l] = b;
            } else {
                S->a0[i & 7][l] += a;
                S->a1[i & 7][l] += b;
            }
        }
    for (int l = 0; l < L; l++) {
        S->sw[l] = COMB(S->a0, l);
        S->sx[l] = COMB(S->a1, l);
    }
    for (int k = 0; k <= NSTEP; k++) {
        float f = (float)(((double)qmax + -1.0) + 0.1 * (double)k);
        float isc[L];
        for (int l = 0; l < L; l++) isc[l] = f * inv[l];
        for (int i = 0; i < g; i++)
            for (int l = 0; l < L; l++) {
                float t = rintf(isc[l] * S->sh[i][l]);
                t = t > 0.0f ? t : 0.0f;
                S->c[i][l] = t < qm ? t : qm;
            }
        soa_try(S, g, qm, S->c);
    }
    for (int r = 0; r < REFINE; r++) {
        memcpy(S->c, S->bq, sizeof(float) * L * (size_t)g);
        soa_try(S, g, qm, S->c);
    }
}

CLONES static void soa_fit32(soa_t *S, int qmax, int search) { soa_fit_impl(S, 32, qmax, search); }
CLONES static void soa_fit64(soa_t *S, int qmax, int search) { soa_fit_impl(S, 64, qmax, search); }
CLONES static void soa_fit_any(soa_t *S, int g, int qmax, int search) {
    soa_fit_impl(S, g, qmax, search);
}
CLONES static void fit_any(scratch *s, const float *w, int g, int qmax, int search,
                           uint16_t *d, uint16_t *m) {
    fit_impl(s, w, g, qmax, search, d, m);
}

/* ---------------------------------------------------------- matrices */
typedef struct {
    const void *src;
    int dtype, bits, group, search, qmax;
    int64_t rows, cols, block, nblocks;
    const float *imp;
    uint8_t *out;
    int64_t next; /* atomic */
    int64_t bad_nf, bad_mag; /* smallest bad flat index, per kind (under lock) */
    int oom;
    pthread_mutex_t lock;
} job_t;

static inline float load(const void *src, int dtype, int64_t i) {
    if (dtype == 0) return ((const float *)src)[i];
    if (dtype == 1) return h2f(((const uint16_t *)src)[i]);
    uint32_t b = (uint32_t)((const uint16_t *)src)[i] << 16;
    float v;
    memcpy(&v, &b, 4);
    return v;
}

static void pack_row(const uint8_t *c, int64_t cols, int bits, uint8_t *dst) {
    if (bits == 8) {
        memcpy(dst, c, (size_t)cols);
        return;
    }
    for (int64_t o = 0; o < cols; o += 8) {
        uint64_t word = 0;
        for (int j = 0; j < 8; j++) word |= (uint64_t)c[o + j] << (bits * j);
        for (int j = 0; j < bits; j++) dst[o / 8 * bits + j] = (uint8_t)(word >> (8 * j));
    }
}

static void note_bad(int64_t *slot, int64_t idx) {
    if (*slot < 0 || idx < *slot) *slot = idx;
}

static void *worker(void *arg) {
    job_t *J = (job_t *)arg;
    int g = J->group, soa = g <= MAXG;
    int64_t cols = J->cols, ngr = cols / g, rb = cols * J->bits / 8;
    uint16_t *scales = (uint16_t *)(J->out + J->rows * rb);
    uint16_t *mins = scales + J->rows * ngr;
    size_t fb = (size_t)g * sizeof(float), db = (size_t)g * sizeof(double);
    size_t codes_n = (size_t)(J->block * cols);
    /* scratch: the one-group path's arrays, the block's unpacked codes, the lanes */
    char *mem = malloc(7 * fb + 3 * db + codes_n + 64 + sizeof(soa_t) + 64);
    if (!mem) {
        pthread_mutex_lock(&J->lock);
        J->oom = 1;
        pthread_mutex_unlock(&J->lock);
        return NULL;
    }
    scratch s;
    s.t0 = (double *)mem;
    s.t1 = (double *)(mem + db);
    s.t2 = (double *)(mem + 2 * db);
    s.x = (float *)(mem + 3 * db);
    s.sh = s.x + g;
    s.wx = s.sh + g;
    s.cand = s.wx + g;
    s.q = s.cand + g;
    s.bq = s.q + g;
    s.tmp = s.bq + g;
    uint8_t *codes = (uint8_t *)(s.tmp + g);
    soa_t *S = (soa_t *)(((uintptr_t)(codes + codes_n) + 63) & ~(uintptr_t)63);
    int64_t my_nf = -1, my_mag = -1;
    for (;;) {
        int64_t blk = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (blk >= J->nblocks) break;
        int64_t r0 = blk * J->block, r1 = r0 + J->block;
        if (r1 > J->rows) r1 = J->rows;
        /* validate the block (the smallest bad index wins, as numpy reports) */
        for (int64_t i = r0 * cols; i < r1 * cols; i++) {
            float v = load(J->src, J->dtype, i);
            if (!isfinite(v)) {
                note_bad(&my_nf, i);
                break;
            }
            if (fabsf(v) > (float)SAFE) note_bad(&my_mag, i);
        }
        if (my_nf >= 0 || my_mag >= 0) continue; /* failing: only look for bad values */
        int64_t n_groups = (r1 - r0) * ngr, g0 = r0 * ngr;
        if (soa) {
            for (int64_t b0 = 0; b0 < n_groups; b0 += L) {
                for (int l = 0; l < L; l++) { /* lanes past the end repeat the last group */
                    int64_t G = g0 + (b0 + l < n_groups ? b0 + l : n_groups - 1);
                    int64_t gi = G % ngr;
                    const float *w = J->imp ? J->imp + gi * g : NULL;
                    for (int i = 0; i < g; i++) {
                        S->x[i][l] = load(J->src, J->dtype, G * g + i);
                        S->w[i][l] = w ? w[i] : 1.0f;
                    }
                }
                if (g == 32) soa_fit32(S, J->qmax, J->search);
                else if (g == 64) soa_fit64(S, J->qmax, J->search);
                else soa_fit_any(S, g, J->qmax, J->search);
                for (int l = 0; l < L && b0 + l < n_groups; l++) {
                    int64_t G = g0 + b0 + l, r = G / ngr, gi = G % ngr;
                    uint8_t *dst = codes + (r - r0) * cols + gi * g;
                    for (int i = 0; i < g; i++) dst[i] = (uint8_t)S->bq[i][l];
                    scales[G] = (uint16_t)S->bd[l];
                    mins[G] = (uint16_t)S->bm[l];
                }
            }
        } else {
            for (int64_t G = g0; G < g0 + n_groups; G++) {
                int64_t r = G / ngr, gi = G % ngr;
                for (int i = 0; i < g; i++) s.x[i] = load(J->src, J->dtype, G * g + i);
                uint16_t d, m;
                fit_any(&s, J->imp ? J->imp + gi * g : NULL, g, J->qmax, J->search, &d, &m);
                uint8_t *dst = codes + (r - r0) * cols + gi * g;
                for (int i = 0; i < g; i++) dst[i] = (uint8_t)s.bq[i];
                scales[G] = d;
                mins[G] = m;
            }
        }
        for (int64_t r = r0; r < r1; r++) pack_row(codes + (r - r0) * cols, cols, J->bits,
                                                   J->out + r * rb);
    }
    free(mem);
    if (my_nf >= 0 || my_mag >= 0) {
        pthread_mutex_lock(&J->lock);
        if (my_nf >= 0) note_bad(&J->bad_nf, my_nf);
        if (my_mag >= 0) note_bad(&J->bad_mag, my_mag);
        pthread_mutex_unlock(&J->lock);
    }
    return NULL;
}

int czyx_quantize(const void *src, int dtype, int64_t rows, int64_t cols, int bits,
                  int group, const float *imp, int search, uint8_t *out, int nthreads,
                  int64_t *bad) {
    job_t J;
    *bad = -1;
    if (rows < 0 || cols <= 0 || group <= 0 || group % 32 || cols % group) return -4;
    if (!(bits == 2 || bits == 3 || bits == 4 || bits == 8) || dtype < 0 || dtype > 2) return -4;
    if (rows == 0) return 0;
    memset(&J, 0, sizeof J);
    J.src = src;
    J.dtype = dtype;
    J.bits = bits;
    J.group = group;
    J.search = search;
    J.qmax = (1 << bits) - 1;
    J.rows = rows;
    J.cols = cols;
    J.imp = imp;
    J.out = out;
    J.block = 16384 / cols > 0 ? 16384 / cols : 1;
    J.nblocks = (rows + J.block - 1) / J.block;
    J.bad_nf = J.bad_mag = -1;
    pthread_mutex_init(&J.lock, NULL);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 256) nthreads = 256;
    if (nthreads > J.nblocks) nthreads = (int)J.nblocks;
    pthread_t tids[256];
    int started = 0;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&tids[started], NULL, worker, &J) != 0) break;
        started++;
    }
    worker(&J); /* the calling thread works too */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    pthread_mutex_destroy(&J.lock);
    if (J.oom) return -3;
    if (J.bad_nf >= 0) {
        *bad = J.bad_nf;
        return -1;
    }
    if (J.bad_mag >= 0) {
        *bad = J.bad_mag;
        return -2;
    }
    return 0;
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "czyx.store.quant._quantizer",
    SOURCE,
    extra_compile_args=["-O3", "-std=gnu99", "-ffp-contract=off", "-fno-math-errno"],
    libraries=["pthread", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
