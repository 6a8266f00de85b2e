/* Quantized matrix-vector and small matrix-matrix products on packed formats.
 *
 * Scope: y[b, r] = sum_c W[r, c] * x[b, c] for a matrix W stored in the planar
 * group-wise format of store/quant/formats.py (codes | fp16 scales | fp16 mins,
 * w = d * q + m per group of `group` columns), directly on the packed codes:
 * each group is decoded eight codes at a time into registers (matvec) or into
 * a scratch of one group's floats in L1 (matmul, decoded once and reused for
 * every vector), never into a temporary copy of the matrix.
 *
 * Per group the sum factors as  d * sum(q_i x_i) + m * sum(x_i),  so the inner
 * loop is a dot product of codes with x, and sum(x_i) per group is computed
 * once per call. Accumulation is float32.
 *
 * Dispatch: two implementations of the same loops. A portable one (plain C,
 * written so that -O3 autovectorises it on any target, SSE2 or NEON), and on
 * x86-64 an AVX2+FMA+F16C one compiled with a function-level target attribute
 * and selected at run time with __builtin_cpu_supports. No -march flag is used,
 * so the extension runs on any x86-64 and the fast path is taken where the CPU
 * has it; an AVX-512 matvec likewise where AVX-512F/BW exist.
 * qk_set_simd_cap() lets the tests compare every path.
 *
 * Codes: a row is a little-endian bit stream, code i in bits [bits*i, bits*i+bits).
 * Eight codes therefore occupy exactly `bits` bytes and are decoded from one
 * little-endian word with per-lane shifts {0, bits, ..., 7*bits}.
 *
 * The Python binding (cffi, API mode) releases the GIL during these calls.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "qkernels assumes a little-endian host (the packed format is little-endian)"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QK_HAVE_X86 1
#include <immintrin.h>
#else
#define QK_HAVE_X86 0
#endif

#define QK_OK 0
#define QK_EARGS (-1)
#define QK_ENOMEM (-2)

/* The highest SIMD level used (tests lower it to compare every path). */
static int qk_simd_cap = 2;

#include "half.h" /* czyx_h2f: IEEE half -> float, exact for every input */

/* `bits` bytes (<= 8) at p as a little-endian word. Fixed-size copies only:
 * a 3-byte memcpy is not inlined by every compiler and a library call per
 * eight codes would dominate the loop. */
static inline __attribute__((always_inline)) uint64_t qk_word(const uint8_t *p, int bits) {
    uint64_t w = 0;
    uint32_t w32;
    uint16_t w16;
    switch (bits) {
    case 2: memcpy(&w16, p, 2); w = w16; break;
    case 3: w = (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16); break;
    case 4: memcpy(&w32, p, 4); w = w32; break;
    default: memcpy(&w, p, 8); break;
    }
    return w;
}

/* The matvec's x in "plane order" for 2- and 4-bit codes. Eight code bytes
 * zero-extended into eight 32-bit lanes (one vpmovzxbd) hold per = 8 / bits
 * codes each; plane j = (lane >> bits*j) & mask is then code per*k + j of the
 * chunk in lane k. Permuting x once per call to match (xp[base + 8j + k] =
 * x[base + per*k + j], chunks of 8*per codes) makes the inner loop one load,
 * one shift and one mask per plane: fewer instructions per weight than
 * decoding every eight codes from a broadcast word. */
static void qk_plane_order(const float *x, int64_t cols, int bits, int lanes, float *xp) {
    const int per = 8 / bits, chunk = lanes * per;
    for (int64_t base = 0; base < cols; base += chunk)
        for (int j = 0; j < per; j++)
            for (int k = 0; k < lanes; k++) xp[base + lanes * j + k] = x[base + per * k + j];
}

/* ------------------------------------------------------------ portable */

/* matvec, portable: the same plane order as the AVX2 path for 2 and 4 bits,
 * written as eight-lane loops the compiler vectorises at -O3 on any target
 * (byte -> float conversion and constant shifts exist in SSE2 and NEON). */
static inline __attribute__((always_inline)) void qk_mv_portable(
    int bits, int64_t group, int64_t cols, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *mins, const float *xv, float *y, int64_t r0, int64_t r1,
    const float *xsum, float *dsc, float *mnv) {
    const int64_t G = cols / group, rb = cols * bits / 8, gb = group * bits / 8;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t gi = 0; gi < G; gi++) {
            dsc[gi] = czyx_h2f(scales[r * G + gi]);
            mnv[gi] = czyx_h2f(mins[r * G + gi]);
        }
        float total = 0.0f;
        for (int64_t gi = 0; gi < G; gi++) {
            const uint8_t *cg = codes + r * rb + gi * gb;
            const float *xg = xv + gi * group;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (bits == 4) {
                for (int64_t s = 0; s < group; s += 16)
                    for (int k = 0; k < 8; k++) {
                        const uint32_t v = cg[s / 2 + k];
                        acc[k] += (float)(v & 15u) * xg[s + k] + (float)(v >> 4) * xg[s + 8 + k];
                    }
            } else if (bits == 2) {
                for (int64_t s = 0; s < group; s += 32)
                    for (int k = 0; k < 8; k++) {
                        const uint32_t v = cg[s / 4 + k];
                        acc[k] += (float)(v & 3u) * xg[s + k] + (float)((v >> 2) & 3u) * xg[s + 8 + k] +
                                  (float)((v >> 4) & 3u) * xg[s + 16 + k] + (float)(v >> 6) * xg[s + 24 + k];
                    }
            } else if (bits == 8) {
                for (int64_t s = 0; s < group; s += 8)
                    for (int k = 0; k < 8; k++) acc[k] += (float)cg[s + k] * xg[s + k];
            } else {
                for (int64_t t = 0; t < group / 8; t++) {
                    const uint64_t w = qk_word(cg + t * bits, bits);
                    for (int k = 0; k < 8; k++)
                        acc[k] += (float)((w >> (bits * k)) & ((1u << bits) - 1u)) * xg[8 * t + k];
                }
            }
            const float sg = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                             ((acc[4] + acc[5]) + (acc[6] + acc[7]));
            total += dsc[gi] * sg + mnv[gi] * xsum[gi];
        }
        y[r] = total;
    }
}


static inline __attribute__((always_inline)) void qk_decode_group_portable(
    const uint8_t *c, int bits, int64_t group, float *tmp) {
    const uint64_t mask = (1u << bits) - 1u;
    for (int64_t t = 0; t < group / 8; t++) {
        uint64_t w = qk_word(c + t * bits, bits);
        for (int k = 0; k < 8; k++) tmp[8 * t + k] = (float)((w >> (bits * k)) & mask);
    }
}

static inline __attribute__((always_inline)) void qk_rows_portable(
    int bits, int64_t group, int64_t rows, int64_t cols, const uint8_t *codes,
    const uint16_t *scales, const uint16_t *mins, const float *x, int64_t nvec,
    float *y, int64_t r0, int64_t r1, float *xsum, float *tmp, float *dsc, float *mnv) {
    const int64_t G = cols / group, rb = cols * bits / 8;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * rb;
        for (int64_t gi = 0; gi < G; gi++) {
            dsc[gi] = czyx_h2f(scales[r * G + gi]);
            mnv[gi] = czyx_h2f(mins[r * G + gi]);
        }
        for (int64_t b = 0; b < nvec; b++) y[b * rows + r] = 0.0f;
        for (int64_t gi = 0; gi < G; gi++) {
            qk_decode_group_portable(c + gi * group * bits / 8, bits, group, tmp);
            for (int64_t b = 0; b < nvec; b++) {
                const float *xg = x + b * cols + gi * group;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t i = 0; i < group; i += 8)
                    for (int k = 0; k < 8; k++) acc[k] += tmp[i + k] * xg[i + k];
                float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                          ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                y[b * rows + r] += dsc[gi] * s + mnv[gi] * xsum[b * G + gi];
            }
        }
    }
}

static void qk_portable(int bits, int64_t group, int64_t rows, int64_t cols,
                        const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                        const float *x, int64_t nvec, float *y, int64_t r0, int64_t r1,
                        float *xsum, float *tmp, float *xp, float *dsc, float *mnv) {
    /* Constant bit widths let the compiler specialise each loop. */
    if (nvec == 1) {
        const float *xv = x;
        if (bits == 2 || bits == 4) {
            qk_plane_order(x, cols, bits, 8, xp);
            xv = xp;
        }
        switch (bits) {
        case 2: qk_mv_portable(2, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); return;
        case 3: qk_mv_portable(3, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); return;
        case 4: qk_mv_portable(4, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); return;
        default: qk_mv_portable(8, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); return;
        }
    }
    switch (bits) {
    case 2: qk_rows_portable(2, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); break;
    case 3: qk_rows_portable(3, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); break;
    case 4: qk_rows_portable(4, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); break;
    default: qk_rows_portable(8, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); break;
    }
}

/* ---------------------------------------------------------------- AVX2 */
#if QK_HAVE_X86
#define QK_AVX2 __attribute__((target("avx2,fma,f16c")))

QK_AVX2 static inline __attribute__((always_inline)) __m256 qk_dec8(const uint8_t *p, int bits) {
    __m256i v;
    if (bits == 8) {
        v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    } else {
        const __m256i sh = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits,
                                             6 * bits, 7 * bits);
        uint32_t w = (uint32_t)qk_word(p, bits);
        v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh),
                             _mm256_set1_epi32((1 << bits) - 1));
    }
    return _mm256_cvtepi32_ps(v);
}

QK_AVX2 static inline float qk_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* fp16 -> float for n values (n any), F16C eight at a time. */
QK_AVX2 static inline void qk_h2f_n(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = czyx_h2f(h[i]);
}

/* matvec on RB rows at once (RB = 2, or 1 for a tail): codes decoded into
 * registers, each x chunk loaded once for the RB rows, two FMA chains per row,
 * each group's scale applied once per group. For 2 and 4 bits xv is the
 * plane-ordered x (qk_plane_order), otherwise x itself. */
QK_AVX2 static inline __attribute__((always_inline)) void qk_mv_rows_avx2(
    int bits, int RB, int64_t group, int64_t cols, const uint8_t *codes,
    const uint16_t *scales, const uint16_t *mins, const float *xv, float *y, int64_t r,
    const float *xsum, float *dsc, float *mnv) {
    const int64_t G = cols / group, rb = cols * bits / 8, gb = group * bits / 8;
    const __m256i m2 = _mm256_set1_epi32(3), m4 = _mm256_set1_epi32(15);
    __m256 racc[2];
    float mt[2];
    for (int i = 0; i < RB; i++) {
        qk_h2f_n(scales + (r + i) * G, G, dsc + i * G);
        qk_h2f_n(mins + (r + i) * G, G, mnv + i * G);
        racc[i] = _mm256_setzero_ps();
        mt[i] = 0.0f;
    }
    for (int64_t gi = 0; gi < G; gi++) {
        const float *xg = xv + gi * group;
        __m256 a[2][2];
        for (int i = 0; i < RB; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        if (bits == 2) {
            for (int64_t s = 0; s < group; s += 32) {
                const __m256 x0 = _mm256_loadu_ps(xg + s), x1 = _mm256_loadu_ps(xg + s + 8);
                const __m256 x2 = _mm256_loadu_ps(xg + s + 16), x3 = _mm256_loadu_ps(xg + s + 24);
                for (int i = 0; i < RB; i++) {
                    const uint8_t *cs = codes + (r + i) * rb + gi * gb + s / 4;
                    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)cs));
                    const __m256 p0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, m2));
                    const __m256 p1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 2), m2));
                    const __m256 p2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), m2));
                    const __m256 p3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 6));
                    a[i][0] = _mm256_fmadd_ps(p0, x0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(p1, x1, a[i][1]);
                    a[i][0] = _mm256_fmadd_ps(p2, x2, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(p3, x3, a[i][1]);
                }
            }
        } else if (bits == 4) {
            for (int64_t s = 0; s < group; s += 16) {
                const __m256 x0 = _mm256_loadu_ps(xg + s), x1 = _mm256_loadu_ps(xg + s + 8);
                for (int i = 0; i < RB; i++) {
                    const uint8_t *cs = codes + (r + i) * rb + gi * gb + s / 2;
                    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)cs));
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m4));
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                    a[i][0] = _mm256_fmadd_ps(lo, x0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(hi, x1, a[i][1]);
                }
            }
        } else {
            for (int64_t s = 0; s < group; s += 16) {
                const __m256 x0 = _mm256_loadu_ps(xg + s), x1 = _mm256_loadu_ps(xg + s + 8);
                for (int i = 0; i < RB; i++) {
                    const uint8_t *cs = codes + (r + i) * rb + gi * gb + s * bits / 8;
                    a[i][0] = _mm256_fmadd_ps(qk_dec8(cs, bits), x0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(qk_dec8(cs + bits, bits), x1, a[i][1]);
                }
            }
        }
        for (int i = 0; i < RB; i++) {
            racc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dsc[i * G + gi]),
                                      _mm256_add_ps(a[i][0], a[i][1]), racc[i]);
            mt[i] += mnv[i * G + gi] * xsum[gi];
        }
    }
    for (int i = 0; i < RB; i++) y[r + i] = qk_hsum(racc[i]) + mt[i];
}

QK_AVX2 static inline __attribute__((always_inline)) void qk_mv_avx2(
    int bits, int64_t group, int64_t cols, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *mins, const float *x, float *y, int64_t r0, int64_t r1,
    const float *xsum, float *xp, float *dsc, float *mnv) {
    const float *xv = x;
    if (bits == 2 || bits == 4) {
        qk_plane_order(x, cols, bits, 8, xp);
        xv = xp;
    }
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        qk_mv_rows_avx2(bits, 2, group, cols, codes, scales, mins, xv, y, r, xsum, dsc, mnv);
    for (; r < r1; r++)
        qk_mv_rows_avx2(bits, 1, group, cols, codes, scales, mins, xv, y, r, xsum, dsc, mnv);
}

/* matmul on a tile of RB rows and the groups [g0, g1): each group of the RB rows
 * is decoded once into tmp (RB * group floats, in L1) and reused for every
 * vector; each vector's x chunk is loaded once per tile. Adds into y. */
QK_AVX2 static inline __attribute__((always_inline)) void qk_tile_avx2(
    int bits, int RB, int64_t group, int64_t rows, int64_t cols, const uint8_t *codes,
    const uint16_t *scales, const uint16_t *mins, const float *x, int64_t nvec,
    float *y, int64_t r, int64_t g0, int64_t g1, const float *xsum, float *tmp,
    float *dsc, float *mnv) {
    const int64_t G = cols / group, rb = cols * bits / 8, gb = group * bits / 8;
    for (int i = 0; i < RB; i++) {
        qk_h2f_n(scales + (r + i) * G + g0, g1 - g0, dsc + i * G + g0);
        qk_h2f_n(mins + (r + i) * G + g0, g1 - g0, mnv + i * G + g0);
    }
    for (int64_t b0 = 0; b0 < nvec; b0 += 16) {
        const int64_t nb = nvec - b0 < 16 ? nvec - b0 : 16;
        __m256 racc[16 * 4];
        for (int64_t j = 0; j < nb * RB; j++) racc[j] = _mm256_setzero_ps();
        for (int64_t gi = g0; gi < g1; gi++) {
            for (int i = 0; i < RB; i++) {
                const uint8_t *cg = codes + (r + i) * rb + gi * gb;
                for (int64_t t = 0; t < group / 8; t++)
                    _mm256_store_ps(tmp + i * group + 8 * t, qk_dec8(cg + t * bits, bits));
            }
            for (int64_t b = 0; b < nb; b++) {
                const float *xg = x + (b0 + b) * cols + gi * group;
                __m256 a[4];
                for (int i = 0; i < RB; i++) a[i] = _mm256_setzero_ps();
                for (int64_t s = 0; s < group; s += 8) {
                    const __m256 xv = _mm256_loadu_ps(xg + s);
                    for (int i = 0; i < RB; i++)
                        a[i] = _mm256_fmadd_ps(_mm256_load_ps(tmp + i * group + s), xv, a[i]);
                }
                for (int i = 0; i < RB; i++)
                    racc[b * RB + i] =
                        _mm256_fmadd_ps(_mm256_set1_ps(dsc[i * G + gi]), a[i], racc[b * RB + i]);
            }
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *xs = xsum + (b0 + b) * G;
            for (int i = 0; i < RB; i++) {
                float mt = 0.0f;
                for (int64_t gi = g0; gi < g1; gi++) mt += mnv[i * G + gi] * xs[gi];
                y[(b0 + b) * rows + r + i] += qk_hsum(racc[b * RB + i]) + mt;
            }
        }
    }
}

/* matmul: columns in blocks whose slice of x (all vectors) fits in L1, so x is
 * read from L1 by every row tile instead of streaming from L2 per tile. */
#define QK_L1_X_FLOATS 4096
QK_AVX2 static inline __attribute__((always_inline)) void qk_mm_avx2(
    int bits, int64_t group, int64_t rows, int64_t cols, const uint8_t *codes,
    const uint16_t *scales, const uint16_t *mins, const float *x, int64_t nvec,
    float *y, int64_t r0, int64_t r1, const float *xsum, float *tmp, float *dsc, float *mnv) {
    const int64_t G = cols / group;
    int64_t gblk = QK_L1_X_FLOATS / ((nvec < 16 ? nvec : 16) * group);
    if (gblk < 1) gblk = 1;
    for (int64_t b = 0; b < nvec; b++)
        for (int64_t r = r0; r < r1; r++) y[b * rows + r] = 0.0f;
    for (int64_t g0 = 0; g0 < G; g0 += gblk) {
        const int64_t g1 = g0 + gblk < G ? g0 + gblk : G;
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4)
            qk_tile_avx2(bits, 4, group, rows, cols, codes, scales, mins, x, nvec, y, r, g0, g1,
                         xsum, tmp, dsc, mnv);
        for (; r < r1; r++)
            qk_tile_avx2(bits, 1, group, rows, cols, codes, scales, mins, x, nvec, y, r, g0, g1,
                         xsum, tmp, dsc, mnv);
    }
}

QK_AVX2 static void qk_avx2(int bits, int64_t group, int64_t rows, int64_t cols,
                            const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                            const float *x, int64_t nvec, float *y, int64_t r0, int64_t r1,
                            float *xsum, float *tmp, float *xp, float *dsc, float *mnv) {
    if (nvec > 1) {
        switch (bits) {
        case 2: qk_mm_avx2(2, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); return;
        case 3: qk_mm_avx2(3, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); return;
        case 4: qk_mm_avx2(4, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); return;
        default: qk_mm_avx2(8, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, dsc, mnv); return;
        }
    }
    switch (bits) {
    case 2: qk_mv_avx2(2, group, cols, codes, scales, mins, x, y, r0, r1, xsum, xp, dsc, mnv); break;
    case 3: qk_mv_avx2(3, group, cols, codes, scales, mins, x, y, r0, r1, xsum, xp, dsc, mnv); break;
    case 4: qk_mv_avx2(4, group, cols, codes, scales, mins, x, y, r0, r1, xsum, xp, dsc, mnv); break;
    default: qk_mv_avx2(8, group, cols, codes, scales, mins, x, y, r0, r1, xsum, xp, dsc, mnv); break;
    }
}

/* -------------------------------------------------------------- AVX-512 */
/* The matvec with 16 lanes (AVX-512F/BW): the AVX2 loop's plane order with 16
 * code bytes per load, half the instructions per weight. 2-bit needs groups
 * of 64 (a 16-byte load holds 64 codes); 3-bit keeps the AVX2 path. */
#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

QK_AVX512 static inline __attribute__((always_inline)) void qk_mv_rows_avx512(
    int bits, int RB, int64_t group, int64_t cols, const uint8_t *codes,
    const uint16_t *scales, const uint16_t *mins, const float *xv, float *y, int64_t r,
    const float *xsum, float *dsc, float *mnv) {
    const int64_t G = cols / group, rb = cols * bits / 8, gb = group * bits / 8;
    const __m512i m2 = _mm512_set1_epi32(3), m4 = _mm512_set1_epi32(15);
    __m512 racc[2];
    float mt[2];
    for (int i = 0; i < RB; i++) {
        qk_h2f_n(scales + (r + i) * G, G, dsc + i * G);
        qk_h2f_n(mins + (r + i) * G, G, mnv + i * G);
        racc[i] = _mm512_setzero_ps();
        mt[i] = 0.0f;
    }
    for (int64_t gi = 0; gi < G; gi++) {
        const float *xg = xv + gi * group;
        __m512 a[2][2];
        for (int i = 0; i < RB; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
        if (bits == 2) {
            for (int64_t s = 0; s < group; s += 64) {
                const __m512 x0 = _mm512_loadu_ps(xg + s), x1 = _mm512_loadu_ps(xg + s + 16);
                const __m512 x2 = _mm512_loadu_ps(xg + s + 32), x3 = _mm512_loadu_ps(xg + s + 48);
                for (int i = 0; i < RB; i++) {
                    const uint8_t *cs = codes + (r + i) * rb + gi * gb + s / 4;
                    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)cs));
                    const __m512 p0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, m2));
                    const __m512 p1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 2), m2));
                    const __m512 p2 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), m2));
                    const __m512 p3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 6));
                    a[i][0] = _mm512_fmadd_ps(p0, x0, a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(p1, x1, a[i][1]);
                    a[i][0] = _mm512_fmadd_ps(p2, x2, a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(p3, x3, a[i][1]);
                }
            }
        } else if (bits == 4) {
            for (int64_t s = 0; s < group; s += 32) {
                const __m512 x0 = _mm512_loadu_ps(xg + s), x1 = _mm512_loadu_ps(xg + s + 16);
                for (int i = 0; i < RB; i++) {
                    const uint8_t *cs = codes + (r + i) * rb + gi * gb + s / 2;
                    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)cs));
                    a[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, m4)), x0, a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), x1, a[i][1]);
                }
            }
        } else {
            for (int64_t s = 0; s < group; s += 32) {
                const __m512 x0 = _mm512_loadu_ps(xg + s), x1 = _mm512_loadu_ps(xg + s + 16);
                for (int i = 0; i < RB; i++) {
                    const uint8_t *cs = codes + (r + i) * rb + gi * gb + s;
                    const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)cs));
                    const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cs + 16)));
                    a[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), x0, a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), x1, a[i][1]);
                }
            }
        }
        for (int i = 0; i < RB; i++) {
            racc[i] = _mm512_fmadd_ps(_mm512_set1_ps(dsc[i * G + gi]),
                                      _mm512_add_ps(a[i][0], a[i][1]), racc[i]);
            mt[i] += mnv[i * G + gi] * xsum[gi];
        }
    }
    for (int i = 0; i < RB; i++) y[r + i] = _mm512_reduce_add_ps(racc[i]) + mt[i];
}

QK_AVX512 static inline __attribute__((always_inline)) void qk_mv_avx512_bits(
    int bits, int64_t group, int64_t cols, const uint8_t *codes, const uint16_t *scales,
    const uint16_t *mins, const float *xv, float *y, int64_t r0, int64_t r1,
    const float *xsum, float *dsc, float *mnv) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        qk_mv_rows_avx512(bits, 2, group, cols, codes, scales, mins, xv, y, r, xsum, dsc, mnv);
    for (; r < r1; r++)
        qk_mv_rows_avx512(bits, 1, group, cols, codes, scales, mins, xv, y, r, xsum, dsc, mnv);
}

/* Whether the AVX-512 matvec handles this call. */
static int qk_avx512_fits(int bits, int64_t group, int64_t nvec) {
    return nvec == 1 && bits != 3 && (bits != 2 || group % 64 == 0);
}

QK_AVX512 static void qk_mv_avx512(int bits, int64_t group, int64_t cols, const uint8_t *codes,
                                   const uint16_t *scales, const uint16_t *mins, const float *x,
                                   float *y, int64_t r0, int64_t r1, const float *xsum, float *xp,
                                   float *dsc, float *mnv) {
    const float *xv = x;
    if (bits != 8) {
        qk_plane_order(x, cols, bits, 16, xp);
        xv = xp;
    }
    switch (bits) {
    case 2: qk_mv_avx512_bits(2, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); break;
    case 4: qk_mv_avx512_bits(4, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); break;
    default: qk_mv_avx512_bits(8, group, cols, codes, scales, mins, xv, y, r0, r1, xsum, dsc, mnv); break;
    }
}

/* 0: portable, 1: AVX2+FMA+F16C, 2: also AVX-512F/BW. */
static int qk_cpu_level(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("f16c")) {
            cached = 1;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) cached = 2;
        }
    }
    return cached;
}
#else
static int qk_cpu_level(void) { return 0; }
#endif

/* --------------------------------------------------------------- public */

int qk_simd_level(void) {
    const int hw = qk_cpu_level();
    return hw < qk_simd_cap ? hw : qk_simd_cap;
}

void qk_set_simd_cap(int level) { qk_simd_cap = level < 0 ? 0 : level; }

int qk_matmul(int bits, int64_t group, int64_t rows, int64_t cols, const uint8_t *codes,
              const uint16_t *scales, const uint16_t *mins, const float *x, int64_t nvec,
              float *y, int64_t r0, int64_t r1) {
    if (!(bits == 2 || bits == 3 || bits == 4 || bits == 8)) return QK_EARGS;
    if (group <= 0 || group % 32 || cols <= 0 || cols % group || rows < 0 || nvec <= 0)
        return QK_EARGS;
    if (r0 < 0 || r1 > rows || r0 > r1) return QK_EARGS;
    if (r0 == r1) return QK_OK;
    const int64_t G = cols / group;
    /* One allocation per call: per-vector group sums of x, a tile's decoded
     * group (32-byte aligned), a tile's scales and mins as floats, and the
     * matvec's plane-ordered x. */
    const int64_t nfloats = nvec * G + 4 * group + 8 * G + cols + 8;
    float *work = (float *)malloc((size_t)nfloats * sizeof(float));
    if (!work) return QK_ENOMEM;
    float *xsum = work;
    float *tmp = (float *)(((uintptr_t)(work + nvec * G) + 31u) & ~(uintptr_t)31u);
    float *dsc = tmp + 4 * group;
    float *mnv = dsc + 4 * G;
    float *xp = mnv + 4 * G;
    for (int64_t b = 0; b < nvec; b++)
        for (int64_t gi = 0; gi < G; gi++) {
            const float *xg = x + b * cols + gi * group;
            float s = 0.0f;
            for (int64_t i = 0; i < group; i++) s += xg[i];
            xsum[b * G + gi] = s;
        }
#if QK_HAVE_X86
    const int level = qk_simd_level();
    if (level == 2 && qk_avx512_fits(bits, group, nvec))
        qk_mv_avx512(bits, group, cols, codes, scales, mins, x, y, r0, r1, xsum, xp, dsc, mnv);
    else if (level >= 1)
        qk_avx2(bits, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, xp, dsc, mnv);
    else
#endif
        qk_portable(bits, group, rows, cols, codes, scales, mins, x, nvec, y, r0, r1, xsum, tmp, xp, dsc, mnv);
    free(work);
    return QK_OK;
}
