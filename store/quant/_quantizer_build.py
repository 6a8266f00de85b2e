"""cffi (API mode) builder of ``czyx.store.quant._quantizer``, the C quantizer.

Built by ``setup.py`` (it discovers every ``_*_build.py``). One call quantizes
one matrix (``czyx_quantize``): it reads the source weights in their stored
dtype (f32, f16 or bf16, widened exactly), chooses every group's fp16 scale and
offset with the importance-weighted search of :mod:`czyx.store.quant.quantizer`
and writes the planar packed buffer of :mod:`czyx.store.quant.formats`.

Why C: the numpy search runs a dozen passes of a dozen array operations over
every group, each pass a full memory round trip and a Python call; in C a
group's 32-128 weights stay in L1 for the whole search, sixteen groups at a
time in vector lanes, and nothing per weight is stored until the end.

Same bytes as the numpy reference. Every operation mirrors the reference's in
order and precision: float32 element products and sums evaluated exactly as
numpy evaluates them (``-ffp-contract=off``: no fused multiply-add), the
float64 group sums with numpy's pairwise summation (8 accumulators for up to
128 terms, halves above), ``rint`` ties-to-even, numpy's ``clip`` and fp16
conversions correctly rounded to nearest-even (float32 and float64 sources
alike, as numpy's casts do). ``tests/store/quant/test_native.py`` checks the
bytes against the numpy reference with hypothesis. ``-fno-trapping-math``
changes no value (IEEE results do not depend on whether an exception traps);
it lets the compiler compute both sides of a lane's select, the guarded
``1 / d`` among them, in vector registers.

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
int czyx_f64_to_f16(const double *v, uint16_t *out, int64_t n, int path);
"""

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SAFE 60000.0
#define NSTEP 4
#define RMIN -1.0
#define RDELTA 0.5
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
            float isc = (float)(((double)qmax + RMIN) + RDELTA * (double)k) * inv;
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
   element i of lane l is x[i][l]. Every per-group scalar step of fit_impl (the
   pairwise sums' accumulators, the 2x2 solve, the fp16 rounding, the
   comparisons) becomes a loop over lanes that the compiler vectorises, and each
   lane performs exactly fit_impl's operations in fit_impl's order, so the
   bytes are the same. Used for groups of up to 128 (numpy's pairwise sum is
   then one level of 8 accumulators: accumulator j takes the terms j, j + 8,
   j + 16, ... in order, so each is summed in registers, j by j).

   Nothing per element is stored during the search: a lane's best codes are
   always assign(x, best d, best m) (the reference keeps exactly those codes),
   so candidates are tracked by their (d, m, error) and the codes are made once
   at the end; the refinement recomputes its candidate codes the same way.
   Without importance every error weight is one: the multiplications by one are
   skipped (exact), and the code sums (integers below 2^24 for groups of up to
   128 codes of up to 255) are exact in float32, hence equal to numpy's float64
   sums in any order. */
#define L 16
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint8_t vu16 __attribute__((vector_size(16)));
#define MAXG 128
typedef struct {
    float x[MAXG][L], w[MAXG][L], sh[MAXG][L], wx[MAXG][L];
    double a0[8][L], a1[8][L], a2[8][L];
    float df[L], mf[L], inv[L], bdf[L], bmf[L], binv[L], isc[L];
    double sw[L], sx[L], berr[L], err[L];
    union { double d[L]; uint64_t du[L]; };
    union { double m[L]; uint64_t mu[L]; };
    uint64_t dh64[L], mh64[L];
    int32_t ok[L];
    uint32_t bd[L], bm[L], dh[L], mh[L];
    uint8_t cq[MAXG][L];
} soa_t;

INL float h2f_l(uint32_t h) { /* branchless h2f for finite halves */
    uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t nb = s | ((e + 112u) << 23) | (m << 13);
    float nv, sv = (float)m * 5.9604644775390625e-08f;
    memcpy(&nv, &nb, 4);
    sv = s ? -sv : sv;
    return e == 0 ? sv : nv;
}

/* d2h on a double's bits, in operations a compiler vectorises (no variable shift of a
   constant, no comparison feeding arithmetic): finite inputs, same results as d2h */
INL uint64_t d2h_l(uint64_t b) {
    uint64_t sign = (b >> 48) & 0x8000u;
    b &= 0x7fffffffffffffffull;
    uint64_t ex = b >> 52; /* biased exponent */
    uint64_t M = (b & 0x000fffffffffffffull) | 0x0010000000000000ull;
    uint64_t nrm = ex >= 1009; /* an fp16 normal (e >= -14), else subnormal or zero */
    uint64_t shift = nrm ? 42 : 1051 - ex;
    shift = shift > 63 ? 63 : shift;
    uint64_t R2 = M >> (shift - 1), R = R2 >> 1; /* R2 keeps the round bit */
    uint64_t s = M << (65 - shift);              /* the bits below the round bit */
    uint64_t sticky = (s | (0 - s)) >> 63;
    R += R2 & 1 & (sticky | (R & 1)); /* nearest, ties to even */
    uint64_t h = R + (nrm ? ((ex - 1008) << 10) - 1024 : 0);
    h = h < 0x7c00u ? h : 0x7c00u; /* overflow: infinity */
    return sign | h;
}

/* d2h_l of L lanes with F16C where the CPU has it (asked once, when the module loads):
   the double is first rounded to float "to odd" (towards zero, then the last bit set if
   anything was cut off), so the hardware's float -> fp16 rounding to nearest even that
   follows gives the double's own correctly rounded fp16 (float keeps 13 more bits than
   fp16, more than the 2 that rounding to odd needs). Same results as d2h_l. */
static int use_f16c;
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define F16C_PATH 1
__attribute__((constructor)) static void find_f16c(void) {
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
__attribute__((target("avx2,f16c"))) static void d2h_f16c(const double *d, uint32_t *h) {
    const __m256d absm = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); /* a mask's low words */
    const __m128i one = _mm_set1_epi32(1);
    for (int l = 0; l < L; l += 8) {
        __m128 f[2];
        for (int k = 0; k < 2; k++) {
            __m256d x = _mm256_loadu_pd(d + l + 4 * k);
            __m128 y = _mm256_cvtpd_ps(x); /* nearest */
            __m256d up = _mm256_cmp_pd(_mm256_and_pd(_mm256_cvtps_pd(y), absm),
                                       _mm256_and_pd(x, absm), _CMP_GT_OQ);
            __m128i down = _mm256_castsi256_si128(
                _mm256_permutevar8x32_epi32(_mm256_castpd_si256(up), even));
            __m128i yi = _mm_add_epi32(_mm_castps_si128(y), down); /* now towards zero */
            __m256d cut = _mm256_cmp_pd(_mm256_cvtps_pd(_mm_castsi128_ps(yi)), x, _CMP_NEQ_UQ);
            __m128i odd = _mm256_castsi256_si128(
                _mm256_permutevar8x32_epi32(_mm256_castpd_si256(cut), even));
            f[k] = _mm_castsi128_ps(_mm_or_si128(yi, _mm_and_si128(odd, one)));
        }
        __m128i h8 = _mm256_cvtps_ph(_mm256_set_m128(f[1], f[0]), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_si256((__m256i *)(h + l), _mm256_cvtepu16_epi32(h8));
    }
}
#endif

#define COMB(A, l) \
    (((A[0][l] + A[1][l]) + (A[2][l] + A[3][l])) + ((A[4][l] + A[5][l]) + (A[6][l] + A[7][l])))

/* float32 (d, m) and 1/d of fp16 pairs, as assign() makes them */
INL void soa_grid(const uint32_t *dh, const uint32_t *mh, float *df, float *mf, float *inv) {
    for (int l = 0; l < L; l++) {
        df[l] = h2f_l(dh[l]);
        mf[l] = h2f_l(mh[l]);
        inv[l] = df[l] > 0.0f ? 1.0f / df[l] : 0.0f;
    }
}

/* the nearest code of x[i][l] on the grid (mf, inv): assign() */
INL float soa_code(const soa_t *S, int i, int l, float qm, const float *mf, const float *inv) {
    float t = rintf((S->x[i][l] - mf[l]) * inv[l]);
    t = t > 0.0f ? t : 0.0f;
    return t < qm ? t : qm;
}

/* one weighted squared residual of the grid (df, mf, inv), widened: werr()'s term */
INL double soa_eterm(const soa_t *S, int i, int l, float qm, const float *df, const float *mf,
                     const float *inv, int wt) {
    float t = soa_code(S, i, l, qm, mf, inv);
    float r = t * df[l] + mf[l] - S->x[i][l];
    float rr = r * r;
    if (wt) rr = rr * S->w[i][l];
    return (double)rr;
}

/* err[] of every lane for the grid in (df, mf, inv) */
INL void soa_err(soa_t *S, int g, float qm, const float *df, const float *mf, const float *inv,
                 int wt) {
    for (int j = 0; j < 8; j++) {
        double acc[L];
        for (int l = 0; l < L; l++) acc[l] = soa_eterm(S, j, l, qm, df, mf, inv, wt);
        for (int i = j + 8; i < g; i += 8)
            for (int l = 0; l < L; l++) acc[l] += soa_eterm(S, i, l, qm, df, mf, inv, wt);
        for (int l = 0; l < L; l++) S->a0[j][l] = acc[l];
    }
    for (int l = 0; l < L; l++) S->err[l] = COMB(S->a0, l);
}

/* candidate code i of lane l: the grid step's (mode 0) or the best grid's (mode 1) */
INL float soa_cand(const soa_t *S, int i, int l, float qm, int mode) {
    if (mode == 1) return soa_code(S, i, l, qm, S->bmf, S->binv);
    float t = rintf(S->isc[l] * S->sh[i][l]);
    t = t > 0.0f ? t : 0.0f;
    return t < qm ? t : qm;
}

/* the three code sums of try_codes into a0, a1, a2 (accumulator j, lane l) */
INL void soa_sums(soa_t *S, int g, float qm, int mode, int wt) {
    for (int j = 0; j < 8; j++) {
        if (wt) {
            double s0[L], s1[L], s2[L];
            for (int l = 0; l < L; l++) {
                float c = soa_cand(S, j, l, qm, mode), wq = S->w[j][l] * c;
                s0[l] = (double)wq;
                s1[l] = (double)(wq * c);
                s2[l] = (double)(S->wx[j][l] * c);
            }
            for (int i = j + 8; i < g; i += 8)
                for (int l = 0; l < L; l++) {
                    float c = soa_cand(S, i, l, qm, mode), wq = S->w[i][l] * c;
                    s0[l] += (double)wq;
                    s1[l] += (double)(wq * c);
                    s2[l] += (double)(S->wx[i][l] * c);
                }
            for (int l = 0; l < L; l++) {
                S->a0[j][l] = s0[l];
                S->a1[j][l] = s1[l];
                S->a2[j][l] = s2[l];
            }
        } else { /* exact integer sums in float32; x * c as the weighted path's wx * c */
            float s0[L], s1[L];
            double s2[L];
            for (int l = 0; l < L; l++) {
                float c = soa_cand(S, j, l, qm, mode);
                s0[l] = c;
                s1[l] = c * c;
                s2[l] = (double)(S->x[j][l] * c);
            }
            for (int i = j + 8; i < g; i += 8)
                for (int l = 0; l < L; l++) {
                    float c = soa_cand(S, i, l, qm, mode);
                    s0[l] += c;
                    s1[l] += c * c;
                    s2[l] += (double)(S->x[i][l] * c);
                }
            for (int l = 0; l < L; l++) {
                S->a0[j][l] = (double)s0[l];
                S->a1[j][l] = (double)s1[l];
                S->a2[j][l] = s2[l];
            }
        }
    }
}

/* try_codes on all lanes: least squares for the candidate codes, fp16 snap, reassign,
   keep (d, m, error) where strictly better; returns whether any lane's best changed */
INL int soa_try(soa_t *S, int g, float qm, int mode, int wt) {
    soa_sums(S, g, qm, mode, wt);
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
#ifdef F16C_PATH
    if (use_f16c) {
        d2h_f16c(S->d, S->dh);
        d2h_f16c(S->m, S->mh);
    } else
#endif
    {
        for (int l = 0; l < L; l++) S->dh64[l] = d2h_l(S->du[l]);
        for (int l = 0; l < L; l++) S->mh64[l] = d2h_l(S->mu[l]);
        for (int l = 0; l < L; l++) {
            S->dh[l] = (uint32_t)S->dh64[l];
            S->mh[l] = (uint32_t)S->mh64[l];
        }
    }
    int any = 0;
    for (int l = 0; l < L; l++) {
        S->ok[l] = S->ok[l] & (h2f_l(S->dh[l]) > 0.0f);
        any |= S->ok[l];
    }
    if (!any) return 0;
    soa_grid(S->dh, S->mh, S->df, S->mf, S->inv);
    soa_err(S, g, qm, S->df, S->mf, S->inv, wt);
    int changed = 0;
    for (int l = 0; l < L; l++) {
        int better = S->ok[l] & (S->err[l] < S->berr[l]);
        S->bd[l] = better ? S->dh[l] : S->bd[l];
        S->bm[l] = better ? S->mh[l] : S->bm[l];
        S->berr[l] = better ? S->err[l] : S->berr[l];
        changed |= better;
    }
    soa_grid(S->bd, S->bm, S->bdf, S->bmf, S->binv);
    return changed;
}

/* h_next on all lanes (finite halves): one fp16 step down (up = 0) or up */
INL uint32_t h_next_l(uint32_t x, int up) {
    uint32_t zero = (x & 0x7fffu) == 0, neg = (x & 0x8000u) != 0;
    uint32_t away = up ? !neg : neg; /* away from zero: the magnitude grows */
    uint32_t stepped = away ? x + 1 : x - 1;
    return zero ? (up ? 0x0001u : 0x8001u) : stepped;
}

/* the min-max start of fit_impl on all lanes: m <= xmin, d * qmax + m >= xmax, fp16 */
INL void soa_minmax_start(soa_t *S, float qm, const float *xmin, const float *xmax) {
    union { double d[L]; uint64_t u[L]; } U;
    uint64_t h[L];
    float mf[L];
    for (int l = 0; l < L; l++) U.d[l] = (double)xmin[l];
    for (int l = 0; l < L; l++) h[l] = d2h_l(U.u[l]);
    for (int l = 0; l < L; l++) {
        uint32_t m = (uint32_t)h[l];
        m = h2f_l(m) > xmin[l] ? h_next_l(m, 0) : m;
        S->bm[l] = m;
        mf[l] = h2f_l(m);
        U.d[l] = (double)((xmax[l] - mf[l]) / qm);
    }
    for (int l = 0; l < L; l++) h[l] = d2h_l(U.u[l]);
    for (int l = 0; l < L; l++) S->bd[l] = (uint32_t)h[l];
    for (int r = 0; r < 4; r++) /* a lane once long enough stays so: no early exit needed */
        for (int l = 0; l < L; l++) {
            uint32_t d = S->bd[l];
            S->bd[l] = h2f_l(d) * qm + mf[l] < xmax[l] ? h_next_l(d, 1) : d;
        }
}

/* the grid search and refinement from the min-max start in bd, bm */
INL void soa_search(soa_t *S, int g, int qmax, int wt, const float *xmin, const float *xmax) {
    float qm = (float)qmax;
    soa_err(S, g, qm, S->bdf, S->bmf, S->binv, wt);
    for (int l = 0; l < L; l++) S->berr[l] = S->err[l];
    float inv[L];
    for (int l = 0; l < L; l++) {
        float rng = xmax[l] - xmin[l];
        inv[l] = rng > 0.0f ? 1.0f / rng : 0.0f;
    }
    for (int i = 0; i < g; i++)
        for (int l = 0; l < L; l++) {
            S->sh[i][l] = S->x[i][l] - xmin[l];
            S->wx[i][l] = wt ? S->w[i][l] * S->x[i][l] : S->x[i][l];
        }
    for (int j = 0; j < 8; j++) { /* sx: numpy's pairwise order, as the other sums */
        double b[L];
        for (int l = 0; l < L; l++) b[l] = (double)S->wx[j][l];
        for (int i = j + 8; i < g; i += 8)
            for (int l = 0; l < L; l++) b[l] += (double)S->wx[i][l];
        for (int l = 0; l < L; l++) S->a1[j][l] = b[l];
    }
    for (int l = 0; l < L; l++) S->sx[l] = COMB(S->a1, l);
    for (int k = 0; k <= NSTEP; k++) {
        float f = (float)(((double)qmax + RMIN) + RDELTA * (double)k);
        for (int l = 0; l < L; l++) S->isc[l] = f * inv[l];
        soa_try(S, g, qm, 0, wt);
    }
    /* A refinement round's candidates are the codes of the best grid so far: after a
       round that changed no lane's best, the next would try exactly the same candidates
       and keep nothing (not strictly better), so it is skipped (same bytes). */
    for (int r = 0, changed = 1; r < REFINE && changed; r++) changed = soa_try(S, g, qm, 1, wt);
}

/* S->x (and S->w with importance) hold 16 groups; results in bd, bm and the codes cq */
INL void soa_fit_impl(soa_t *S, int g, int qmax, int search, int wt) {
    float qm = (float)qmax;
    float xmin[L], xmax[L];
    for (int h = 0; h < L; h += 8) { /* 8 lanes a vector: kept in registers, in order per lane */
        vf8 mn, mx, v;
        memcpy(&mn, &S->x[0][h], sizeof mn);
        mx = mn;
        for (int i = 1; i < g; i++) {
            memcpy(&v, &S->x[i][h], sizeof v);
            vi8 lt = v < mn, gt = v > mx;
            mn = (vf8)((lt & (vi8)v) | (~lt & (vi8)mn));
            mx = (vf8)((gt & (vi8)v) | (~gt & (vi8)mx));
        }
        memcpy(&xmin[h], &mn, sizeof mn);
        memcpy(&xmax[h], &mx, sizeof mx);
    }
    soa_minmax_start(S, qm, xmin, xmax);
    soa_grid(S->bd, S->bm, S->bdf, S->bmf, S->binv);
    if (search) soa_search(S, g, qmax, wt, xmin, xmax);
    for (int i = 0; i < g; i++) /* the codes of the best grid, vectorised here */
        for (int l = 0; l < L; l++) S->cq[i][l] = (uint8_t)soa_code(S, i, l, qm, S->bmf, S->binv);
}

/* group elements [e0, e0 + g) of the source into lane l, widened exactly */
INL void load_lane(soa_t *S, const void *src, int dtype, int64_t e0, int g, int l) {
    if (dtype == 0) {
        const float *f = (const float *)src + e0;
        for (int i = 0; i < g; i++) S->x[i][l] = f[i];
    } else if (dtype == 1) {
        const uint16_t *h = (const uint16_t *)src + e0;
        for (int i = 0; i < g; i++) S->x[i][l] = h2f(h[i]);
    } else {
        const uint16_t *h = (const uint16_t *)src + e0;
        for (int i = 0; i < g; i++) {
            uint32_t b = (uint32_t)h[i] << 16;
            float v;
            memcpy(&v, &b, 4);
            S->x[i][l] = v;
        }
    }
}

/* a 16 x 16 byte matrix (one vector a row) transposed in place: four rounds of
   interleaving row i with row i + 8 (a perfect shuffle of the rows' bytes) */
INL void transpose16(vu16 *r) {
#if !defined(__clang__)
    const vu16 lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const vu16 hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#endif
    for (int round = 0; round < 4; round++) {
        vu16 t[16];
        for (int i = 0; i < 8; i++) {
#if defined(__clang__)
            t[2 * i] = __builtin_shufflevector(r[i], r[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4,
                                               20, 5, 21, 6, 22, 7, 23);
            t[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 8], 8, 24, 9, 25, 10, 26, 11,
                                                   27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
            t[2 * i] = __builtin_shuffle(r[i], r[i + 8], lo);
            t[2 * i + 1] = __builtin_shuffle(r[i], r[i + 8], hi);
#endif
        }
        memcpy(r, t, sizeof t);
    }
}

/* the error weights' sums of every lane (sw), in numpy's pairwise order as the other sums */
INL void soa_wsum(const float (*w)[L], int g, double *sw) {
    double a[8][L];
    for (int j = 0; j < 8; j++) {
        for (int l = 0; l < L; l++) a[j][l] = (double)w[j][l];
        for (int i = j + 8; i < g; i += 8)
            for (int l = 0; l < L; l++) a[j][l] += (double)w[i][l];
    }
    for (int l = 0; l < L; l++) sw[l] = COMB(a, l);
}

/* The error weights of a lane depend only on its group's place in the row, so where a
   row's groups fill whole sets of lanes (ngr % L == 0), every set of lanes at the same
   place in any row has the same weights: they are laid out in lanes, and summed, once
   per matrix (npat sets of g x L weights and L sums). */
typedef struct {
    int64_t npat;
    float *w;
    double *sw;
} wplan_t;

/* groups [g0, g0 + n) of the matrix, 16 at a time: codes (contiguous by group), scales, mins */
INL void soa_groups_impl(soa_t *S, const void *src, int dtype, const float *imp, int64_t ngr,
                         int g, int64_t g0, int64_t n, int qmax, int search, int wt,
                         const wplan_t *P, uint8_t *codes, uint16_t *scales, uint16_t *mins) {
    for (int64_t b0 = 0; b0 < n; b0 += L) {
        for (int l = 0; l < L; l++) { /* lanes past the end repeat the last group */
            int64_t G = g0 + (b0 + l < n ? b0 + l : n - 1);
            load_lane(S, src, dtype, G * g, g, l);
            if (wt && !P) {
                const float *w = imp + (G % ngr) * g;
                for (int i = 0; i < g; i++) S->w[i][l] = w[i];
            }
        }
        if (wt && P) { /* g0 and b0 are multiples of L, so are the row's lane sets */
            int64_t p = (b0 % ngr) / L;
            memcpy(S->w, P->w + p * g * L, (size_t)g * L * sizeof(float));
            memcpy(S->sw, P->sw + p * L, L * sizeof(double));
        } else if (wt) {
            soa_wsum((const float (*)[L])S->w, g, S->sw);
        } else {
            for (int l = 0; l < L; l++) S->sw[l] = (double)g;
        }
        soa_fit_impl(S, g, qmax, search, wt);
        for (int i0 = 0; i0 < g; i0 += 16) { /* codes: 16 x 16 byte transposes */
            vu16 r[16];
            memcpy(r, S->cq[i0], sizeof r);
            transpose16(r);
            for (int l = 0; l < L && b0 + l < n; l++)
                memcpy(codes + (b0 + l) * g + i0, &r[l], 16);
        }
        for (int l = 0; l < L && b0 + l < n; l++) {
            scales[g0 + b0 + l] = (uint16_t)S->bd[l];
            mins[g0 + b0 + l] = (uint16_t)S->bm[l];
        }
    }
}

/* soa_groups_impl with the common group sizes and the weighting as constants */
CLONES static void soa_groups(soa_t *S, const void *src, int dtype, const float *imp,
                              int64_t ngr, int g, int64_t g0, int64_t n, int qmax, int search,
                              const wplan_t *P, uint8_t *codes, uint16_t *scales,
                              uint16_t *mins) {
#define SOA_CALL(G, W) \
    soa_groups_impl(S, src, dtype, imp, ngr, G, g0, n, qmax, search, W, P, codes, scales, mins)
    if (g == 32 && !imp) SOA_CALL(32, 0);
    else if (g == 32) SOA_CALL(32, 1);
    else if (g == 64 && !imp) SOA_CALL(64, 0);
    else if (g == 64) SOA_CALL(64, 1);
    else if (!imp) SOA_CALL(g, 0);
    else SOA_CALL(g, 1);
#undef SOA_CALL
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
    const wplan_t *plan; /* NULL: each set of lanes copies and sums its own weights */
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

/* whether every element of [i0, i1) is finite and within SAFE (one branch-free pass;
   the exact first bad index is looked for only when this fails) */
CLONES static int block_ok(const void *src, int dtype, int64_t i0, int64_t i1) {
    int bad = 0;
    if (dtype == 0) {
        const float *f = (const float *)src;
        for (int64_t i = i0; i < i1; i++) bad |= !(fabsf(f[i]) <= (float)SAFE);
    } else if (dtype == 1) { /* fp16: |v| > SAFE or inf/nan <=> magnitude bits above SAFE's */
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = i0; i < i1; i++) bad |= (h[i] & 0x7fffu) > 0x7b53u;
    } else { /* bf16: the magnitude bits order as the values */
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = i0; i < i1; i++) bad |= (h[i] & 0x7fffu) > 0x476au;
    }
    return !bad;
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
        if (!block_ok(J->src, J->dtype, r0 * cols, r1 * cols)) {
            for (int64_t i = r0 * cols; i < r1 * cols; i++) {
                float v = load(J->src, J->dtype, i);
                if (!isfinite(v)) {
                    note_bad(&my_nf, i);
                    break;
                }
                if (fabsf(v) > (float)SAFE) note_bad(&my_mag, i);
            }
        }
        if (my_nf >= 0 || my_mag >= 0) continue; /* failing: only look for bad values */
        int64_t n_groups = (r1 - r0) * ngr, g0 = r0 * ngr;
        if (soa) {
            soa_groups(S, J->src, J->dtype, J->imp, ngr, g, g0, n_groups, J->qmax, J->search,
                       J->plan, codes, scales, mins);
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
    /* the error weights laid out in lanes once for every thread (see wplan_t) */
    wplan_t plan = {0, NULL, NULL};
    int64_t ngr = cols / group;
    if (group <= MAXG && imp && ngr % L == 0) {
        plan.npat = ngr / L;
        plan.sw = malloc((size_t)ngr * (group * sizeof(float) + sizeof(double)));
        if (!plan.sw) return -3;
        plan.w = (float *)(plan.sw + ngr);
        for (int64_t p = 0; p < plan.npat; p++) {
            float(*w)[L] = (float(*)[L])(plan.w + p * group * L);
            for (int l = 0; l < L; l++)
                for (int i = 0; i < group; i++) w[i][l] = imp[(p * L + l) * group + i];
            soa_wsum((const float(*)[L])w, group, plan.sw + p * L);
        }
        J.plan = &plan;
    }
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
    free(plan.sw);
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

/* The fp16 roundings of doubles the searches use, for tests: path 0 d2h_l (the lanes'
   portable one), 1 d2h_f16c where the CPU has F16C (else d2h_l), 2 d2h (the one-group
   search's). Returns the path that ran. */
int czyx_f64_to_f16(const double *v, uint16_t *out, int64_t n, int path) {
    union { double d[L]; uint64_t u[L]; } in;
    uint32_t h[L];
    if (path == 1 && !use_f16c) path = 0;
    if (path == 2) {
        for (int64_t i = 0; i < n; i++) out[i] = d2h(v[i]);
        return 2;
    }
    for (int64_t i0 = 0; i0 < n; i0 += L) {
        for (int l = 0; l < L; l++) in.d[l] = i0 + l < n ? v[i0 + l] : 0.0;
#ifdef F16C_PATH
        if (path == 1) d2h_f16c(in.d, h);
        else
#endif
            for (int l = 0; l < L; l++) h[l] = (uint32_t)d2h_l(in.u[l]);
        for (int l = 0; l < L && i0 + l < n; l++) out[i0 + l] = (uint16_t)h[l];
    }
    return path;
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "czyx.store.quant._quantizer",
    SOURCE,
    extra_compile_args=[
        "-O3",
        "-std=gnu99",
        "-ffp-contract=off",
        "-fno-math-errno",
        "-fno-trapping-math",
    ],
    libraries=["pthread", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
