/* The engine's decode kernels: threaded, vectorised products on weights as stored.
 *
 * Scope: a matrix descriptor (czk_mat) over float32, float16, bfloat16 or the
 * packed group-wise q2/q3/q4/q8 layout of store/quant/formats.py (codes | fp16
 * scales | fp16 mins, w = d * q + m), and the calls one decode step needs:
 * a matvec, a whole MoE layer (every routed expert: gate and up, SwiGLU, down,
 * the routing weight, the sum), the attention block of one token (RMSNorm,
 * q/k/v, q/k norms, RoPE, KV write, grouped-query attention, o_proj, residual,
 * the post-attention RMSNorm) and softmax top-k routing; and, for a prompt's
 * tokens, a quantized matrix against several vectors (czk_matmul), each token
 * computed exactly as czk_matvec computes it; and the batched decode step's
 * entry points (czk_*_batch: many sequences' tokens per call, each token
 * computed by the one-token calls on one pool thread). Weights are read in place
 * (a slot's bytes, a trunk array): nothing is widened into a float32 copy.
 *
 * Threads: a pool of pthreads owned by the engine (czk_pool_new). Every
 * parallel loop is over output rows (or heads) with a fixed contiguous
 * partition; each output is computed by exactly one thread with the same
 * instructions whatever the partition, and no reduction crosses threads, so
 * results are bit-identical for every thread count. Loops too small to pay
 * for a wake-up (czk_set_min_work) run on the calling thread.
 *
 * Numerics, float formats: products in float32 with FMA (AVX2) or separate
 * multiply/add (portable), four (AVX2) or eight (portable) partial sums per
 * row, so results differ from numpy's BLAS by float32 rounding only.
 *
 * Numerics, quantized formats: as llama.cpp's Q4_1 x Q8_1, the input vector is
 * quantized once per call in blocks of 32: sx_b = max|x| / 127, xq =
 * rint(x / sx_b) in [-127, 127] (round half to even), plus the float32 sum of
 * each block (sequential). A row is then
 *     y = sum_b (d_g(b) * sx_b) * dot_b(q, xq)  +  sum_g m_g * sum_{b in g} xsum_b
 * taken over pairs of blocks (2p, 2p + 1): the pair's 64 codes, in the order
 * of its input (column order; for 4-bit codes the even codes of both blocks,
 * then the odd ones, the order the nibbles unpack in), give sixteen exact
 * integer lanes of four consecutive products (AVX-512 VNNI: one vpdpbusd per
 * row and pair; AVX2: vpmaddubsw/vpmaddwd; plain C: the same integers). Lane l
 * is converted to float and accumulated into float32 lane l with a fused
 * multiply-add by the scale s_b = d_g(b) * sx_b (a float32 product) of its
 * block, pairs in order; the sixteen lanes are summed in a fixed tree (lane k
 * with lane k + 8, then czk_tree8). The m-term likewise: group g into lane
 * g mod 16 with a fused multiply-add, the same tree; then the two sums added.
 * A missing second block (an odd block count) adds exact zeros. Every path
 * therefore gives the same bits, and a numpy reference performing the same
 * float32 operations reproduces them exactly (tests/inference/kernels/
 * test_czk.py). The only approximation against float weights is the 8-bit
 * input (relative error of an input at most 1/254 of its block's largest
 * magnitude).
 *
 * Speed: a row is read once per call, prefetched far ahead into L2 (see
 * CZK_PREFETCH), and each 64-code input pair is loaded once for two rows; the
 * block scales of eight blocks are expanded per row once (one F16C conversion
 * and one product) and picked per half pair with a permute, so the inner
 * loop per row and 32 codes is a load, an integer dot (one vpdpbusd with
 * AVX-512 VNNI+VL on 256-bit registers, which measured faster than 512-bit
 * ones on the double-pumped AMD Zen 4 these benchmarks ran on; with AVX2,
 * codes - 128 through vpmaddubsw plus a per-call input term, for 8-bit
 * codes), a conversion, a permute and one multiply-add. czk_matmul splits
 * its rows over the pool like czk_matvec (a prompt's products on the
 * engine's threads).
 *
 * Dispatch: AVX-512 VNNI+VL, AVX2+FMA+F16C or portable C, chosen once at run
 * time with __builtin_cpu_supports; hot functions carry target attributes and
 * the build passes no -march, so one build runs on every x86-64.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CZK_X86 1
#include <immintrin.h>
#else
#define CZK_X86 0
#endif

#define CZK_F32 0
#define CZK_F16 1
#define CZK_BF16 2
#define CZK_Q 3
/* Bytes ahead of its reads a row kernel prefetches each row, and into which
 * cache level: into L2 (T1), far ahead. The hardware prefetchers stop at 4 KiB
 * page boundaries and prefetches into L1 hold its few miss buffers, so neither
 * keeps enough lines in flight for one thread to stream a matrix from memory
 * at the rate the kernels compute (bench/KERNELS.md compares). */
#ifndef CZK_PREFETCH
#define CZK_PREFETCH 8192
#endif
#define CZK_PFHINT _MM_HINT_T1
#ifndef CZK_Q8NV512
#define CZK_Q8NV512 1
#endif
/* Most routed experts one czk_moe call takes. */
#define CZK_MAXK 256




#include "czk_api.h" /* czk_mat, czk_attn, czk_pool and the entry points */

/* ------------------------------------------------------------ CPU level */

static int czk_cap = 2;

static int czk_hw_level(void) {
#if CZK_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("f16c")) {
            cached = 1;
            if (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
                cached = 2;
        }
    }
    return cached;
#else
    return 0;
#endif
}

/* 0 portable, 1 AVX2, 2 AVX-512 VNNI. */
int czk_level(void) {
    int hw = czk_hw_level();
    return hw < czk_cap ? hw : czk_cap;
}

void czk_set_cap(int level) { czk_cap = level < 0 ? 0 : level; }

/* ------------------------------------------------------------ thread pool */

typedef void (*czk_fn)(void *ctx, int64_t t0, int64_t t1);

/* Work sharing: a loop's tasks are cut into chunks whose bounds depend only on
 * the loop and the pool size; participants (the caller and the woken workers)
 * claim chunks from one atomic word, (generation << 32) | chunks left, with a
 * compare-and-swap, so a worker the OS has descheduled simply claims nothing
 * and the others do its share (on a loaded machine a fixed split would wait
 * for it). Which thread runs a chunk does not change a result: every output
 * is computed by one thread with the same instructions. */
struct czk_pool {
    int n;
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t run; /* held by the one caller whose loop the pool is running */
    int64_t gen;   /* bumped per loop (wakes sleepers); guarded by mu */
    int64_t claim; /* atomic: (gen << 32) | chunks not yet claimed */
    int64_t done;  /* atomic: chunks finished */
    int64_t parked; /* atomic: gen when the caller last parked the pool (czk_pool_park) */
    int stop;
    czk_fn fn;
    void *ctx;
    int64_t ntasks, chunk;
};

typedef struct {
    czk_pool *p;
    int id;
} czk_worker_arg;

static int64_t czk_min_work = 1 << 16;

/* Multiply-adds below which a loop runs on the calling thread only. */
void czk_set_min_work(int64_t w) { czk_min_work = w < 1 ? 1 : w; }

/* Whether czk_attn_decode_batch shares weight rows between tokens (1, the
 * default) or runs each token's czk_attn_decode (0): the same results either
 * way; benchmarks compare the two. */
static int czk_attn_share = 1;

void czk_set_attn_share(int on) { czk_attn_share = on != 0; }

static inline void czk_relax(void) {
#if CZK_X86
    _mm_pause();
#endif
}

/* Claim and run chunks of the current loop until none is left. */
static void czk_claim_loop(czk_pool *p) {
    for (;;) {
        int64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
        const int64_t left = c & 0xffffffffLL;
        if (left == 0) return;
        if (!__atomic_compare_exchange_n(&p->claim, &c, c - 1, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        /* Chunk left-1 of this loop is ours: the caller waits for it, so the
         * loop's fields stay as published until we report it done. */
        const int64_t t0 = (left - 1) * p->chunk;
        const int64_t t1 = t0 + p->chunk < p->ntasks ? t0 + p->chunk : p->ntasks;
        p->fn(p->ctx, t0, t1);
        __atomic_add_fetch(&p->done, 1, __ATOMIC_ACQ_REL);
    }
}

static void *czk_worker(void *arg_) {
    czk_worker_arg *arg = (czk_worker_arg *)arg_;
    czk_pool *p = arg->p;
    free(arg);
    int64_t seen = 0;
    for (;;) {
        /* Spin briefly (a decode step runs many small loops), then sleep; at once
         * when the caller parked the pool after the last loop (it went off to
         * other work: spinning would only take a core from it). */
        int64_t g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
        for (int i = 0; g == seen && i < 20000; i++) {
            if (__atomic_load_n(&p->parked, __ATOMIC_ACQUIRE) == seen) break;
            czk_relax();
            if ((i & 1023) == 1023) sched_yield();
            g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            while (p->gen == seen && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
            g = p->gen;
            pthread_mutex_unlock(&p->mu);
        }
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
        seen = g;
        czk_claim_loop(p);
    }
}

czk_pool *czk_pool_new(int n) {
    if (n < 1) return NULL;
    czk_pool *p = (czk_pool *)calloc(1, sizeof(czk_pool));
    if (!p) return NULL;
    p->n = n;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_mutex_init(&p->run, NULL);
    p->th = (pthread_t *)calloc((size_t)n, sizeof(pthread_t));
    if (!p->th) {
        free(p);
        return NULL;
    }
    for (int i = 1; i < n; i++) {
        czk_worker_arg *a = (czk_worker_arg *)malloc(sizeof(czk_worker_arg));
        if (a) {
            a->p = p;
            a->id = i;
        }
        if (!a || pthread_create(&p->th[i], NULL, czk_worker, a) != 0) {
            free(a);
            p->n = i; /* the workers started so far are joined by free */
            break;
        }
    }
    return p;
}

int czk_pool_size(const czk_pool *p) { return p ? p->n : 1; }

/* The caller has no loop for the pool soon (a scheduler step ended): workers
 * still spinning after the last loop go to sleep now. The next loop wakes them
 * as usual; results never depend on it. */
void czk_pool_park(czk_pool *p) {
    if (!p) return;
    __atomic_store_n(&p->parked, __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
}

void czk_pool_free(czk_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&p->gen, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->run);
    free(p->th);
    free(p);
}

/* Run fn over tasks [0, ntasks); `work` is the loop's multiply-adds (it decides
 * whether waking workers is worth it, and how many chunks to cut). A pool runs
 * one caller's loop at a time: a second caller (another Python thread sharing
 * the engine's pool) runs its loop on its own thread, with the same results. */
static void czk_run(czk_pool *p, czk_fn fn, void *ctx, int64_t ntasks, int64_t work) {
    if (ntasks <= 0) return;
    int64_t used = p ? p->n : 1;
    const int64_t by_work = work / czk_min_work;
    if (by_work < used) used = by_work < 1 ? 1 : by_work;
    if (used > ntasks) used = ntasks;
    if (used <= 1 || pthread_mutex_trylock(&p->run) != 0) {
        fn(ctx, 0, ntasks);
        return;
    }
    int64_t nch = 4 * (int64_t)p->n;
    if (nch > ntasks) nch = ntasks;
    const int64_t chunk = (ntasks + nch - 1) / nch;
    nch = (ntasks + chunk - 1) / chunk;
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->ntasks = ntasks;
    p->chunk = chunk;
    __atomic_store_n(&p->done, 0, __ATOMIC_RELEASE);
    const int64_t g = __atomic_add_fetch(&p->gen, 1, __ATOMIC_ACQ_REL);
    __atomic_store_n(&p->claim, ((g & 0x7fffffffLL) << 32) | nch, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    czk_claim_loop(p);
    for (int i = 0; __atomic_load_n(&p->done, __ATOMIC_ACQUIRE) < nch; i++) {
        czk_relax();
        if ((i & 255) == 255) sched_yield();
    }
    pthread_mutex_unlock(&p->run);
}

/* ------------------------------------------------------------ helpers */

#include "half.h" /* czyx_h2f */

static inline float czk_bf2f(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* The quantized input of a product: blocks of 32 (see the header), zero
 * padded to a multiple of CZK_PADN values so the row kernels take blocks in
 * pairs and scales sixteen at a time without a tail (a padded block has
 * codes 0 and scale 0, so it adds exact zeros). q4p holds each pair of blocks
 * (2p, 2p + 1) in the order of 4-bit code bytes: the even codes of 2p, the
 * even codes of 2p + 1, the odd codes of 2p, the odd codes of 2p + 1. */
#define CZK_PADN 512
typedef struct {
    int64_t n, npad;
    int8_t *q;     /* npad codes in column order */
    int8_t *q4p;   /* npad codes in 4-bit pair order */
    float *sx;     /* npad / 32 block scales */
    float *bsum;   /* npad / 32 block sums */
    float *gsum;   /* per weight group of `ggroup` columns: sum of its block sums, in order */
    int32_t *xs4;  /* npad / 4: 128 times the sum of each four consecutive codes */
    int64_t ggroup;
} czk_xq;

static int64_t czk_padn(int64_t n) { return (n + CZK_PADN - 1) / CZK_PADN * CZK_PADN; }

static size_t czk_xq_bytes(int64_t n) {
    const int64_t np = czk_padn(n);
    return (size_t)(3 * np + 12 * (np / 32)) + 64;
}

static void czk_xq_bind(czk_xq *a, void *mem, int64_t n) {
    uint8_t *m = (uint8_t *)mem;
    const int64_t np = czk_padn(n), nbp = np / 32;
    a->n = n;
    a->npad = np;
    a->sx = (float *)m;
    a->bsum = a->sx + nbp;
    a->gsum = a->bsum + nbp;
    a->ggroup = 0;
    a->q = (int8_t *)(a->gsum + nbp);
    a->q4p = a->q + np;
    a->xs4 = (int32_t *)(a->q4p + np);
}

/* After the blocks' codes, scales and sums are in place: zero the padding and
 * lay out q4p. */
static void czk_xq_finish(czk_xq *a) {
    const int64_t nb = a->n / 32, nbp = a->npad / 32;
    /* The layouts up to the last pair of blocks the kernels read; past it, zeros
     * (what the zero codes give) without the loops: a small model's inputs are
     * a quarter of the padding unit. */
    const int64_t nq = (a->n + 63) / 64 * 64;
    memset(a->q + a->n, 0, (size_t)(a->npad - a->n));
    memset(a->q4p + nq, 0, (size_t)(a->npad - nq));
    memset(a->xs4 + nq / 4, 0, (size_t)(a->npad - nq) / 4 * sizeof(int32_t));
    for (int64_t b = nb; b < nbp; b++) a->sx[b] = a->bsum[b] = 0.0f;
    for (int64_t p = 0; p < nq / 64; p++) {
        const int8_t *q = a->q + 64 * p;
        int8_t *o = a->q4p + 64 * p;
        for (int i = 0; i < 16; i++) {
            o[i] = q[2 * i];
            o[16 + i] = q[32 + 2 * i];
            o[32 + i] = q[2 * i + 1];
            o[48 + i] = q[32 + 2 * i + 1];
        }
    }
    for (int64_t i = 0; i < nq / 4; i++)
        a->xs4[i] = 128 * ((int32_t)a->q[4 * i] + a->q[4 * i + 1] + a->q[4 * i + 2] + a->q[4 * i + 3]);
    a->ggroup = 0;
}

/* The group sums for weight groups of `group` columns (before a parallel
 * loop), zero past the last group. */
static void czk_xq_groups(czk_xq *a, int64_t group) {
    if (a->ggroup == group) return;
    const int64_t bpg = group / 32, G = a->n / group, nbp = a->npad / 32;
    for (int64_t g = 0; g < G; g++) {
        float gs = 0.0f;
        for (int64_t b = 0; b < bpg; b++) gs += a->bsum[g * bpg + b];
        a->gsum[g] = gs;
    }
    for (int64_t g = G; g < nbp; g++) a->gsum[g] = 0.0f;
    a->ggroup = group;
}

#if CZK_X86
/* The block quantization with eight-float vectors: the same values (the max is
 * exact in any order; vroundps rounds half to even as nearbyintf does in the
 * default rounding mode; the block sum stays sequential). */
__attribute__((target("avx2,fma,f16c"))) static void czk_quantize_avx2(const float *x,
                                                                       czk_xq *a) {
    const int64_t nb = a->n / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f),
                 lo = _mm256_set1_ps(-127.0f);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        float mm[8], s = 0.0f;
        _mm256_storeu_ps(mm, m);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++) amax = mm[i] > amax ? mm[i] : amax;
        for (int i = 0; i < 32; i++) s += xb[i];
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i qi[4];
        for (int k = 0; k < 4; k++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], vid),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            qi[k] = _mm256_cvtps_epi32(r);
        }
        /* int32 -> int8 in order: packs work per 128-bit lane, then fix the lane order */
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
        const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(a->q + 32 * b), p8);
        a->sx[b] = d;
        a->bsum[b] = s;
    }
    czk_xq_finish(a);
}
#endif

static void czk_quantize(const float *x, czk_xq *a) {
#if CZK_X86
    if (czk_level() >= 1) {
        czk_quantize_avx2(x, a);
        return;
    }
#endif
    const int64_t nb = a->n / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f, s = 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
            s += xb[i];
        }
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *q = a->q + 32 * b;
        for (int i = 0; i < 32; i++) {
            float v = nearbyintf(xb[i] * id);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[i] = (int8_t)v;
        }
        a->sx[b] = d;
        a->bsum[b] = s;
    }
    czk_xq_finish(a);
}

/* Exported for the tests: the quantized input exactly as the kernels use it. */
void czk_quantize_input(const float *x, int64_t n, int8_t *q, float *sx, float *bsum) {
    czk_xq a;
    void *mem = malloc(czk_xq_bytes(n));
    if (!mem) return;
    czk_xq_bind(&a, mem, n);
    czk_quantize(x, &a);
    memcpy(q, a.q, (size_t)n);
    memcpy(sx, a.sx, sizeof(float) * (size_t)(n / 32));
    memcpy(bsum, a.bsum, sizeof(float) * (size_t)(n / 32));
    free(mem);
}

static inline float czk_tree8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* 32 codes of a 2/3-bit row block (little-endian bit stream) as bytes. */
static inline void czk_unpack32(const uint8_t *c, int bits, uint8_t *out) {
    const uint32_t mask = (1u << bits) - 1u;
    for (int t = 0; t < 4; t++) {
        uint64_t w = 0;
        for (int k = 0; k < bits; k++) w |= (uint64_t)c[t * bits + k] << (8 * k);
        for (int k = 0; k < 8; k++) out[8 * t + k] = (uint8_t)((w >> (bits * k)) & mask);
    }
}

/* Sixteen lanes summed in a fixed tree: lane k with lane k + 8, then czk_tree8. */
static inline float czk_tree16(const float *a) {
    float t[8];
    for (int k = 0; k < 8; k++) t[k] = a[k] + a[k + 8];
    return czk_tree8(t);
}

/* The 64 code bytes of the block pair (2p, 2p + 1) of a row in the order of
 * its input (8, 3 and 2 bits: column order; 4 bits: czk_xq's pair order);
 * zeros for block 2p + 1 when the row has no such block (full == 0). */
static inline void czk_pair_codes(const uint8_t *c, int bits, int64_t p, int full,
                                  uint8_t *u) {
    if (bits == 8) {
        memcpy(u, c + 64 * p, full ? 64 : 32);
        if (!full) memset(u + 32, 0, 32);
    } else if (bits == 4) {
        const uint8_t *v = c + 32 * p;
        const int nbytes = full ? 32 : 16;
        for (int i = 0; i < 32; i++) {
            const uint8_t t = i < nbytes ? v[i] : 0;
            u[i] = t & 15u;
            u[32 + i] = t >> 4;
        }
    } else {
        czk_unpack32(c + 4 * bits * (2 * p), bits, u);
        if (full)
            czk_unpack32(c + 4 * bits * (2 * p + 1), bits, u + 32);
        else
            memset(u + 32, 0, 32);
    }
}

/* The quantized row kernel in plain C: the definition every SIMD path
 * reproduces bit for bit (see the header). */
static void czk_rows_q_portable(const czk_mat *m, const czk_xq *a, float *y, int64_t r0,
                                int64_t r1) {
    const int64_t nb = m->cols / 32, bpg = m->group / 32, G = m->cols / m->group;
    const int64_t rb = m->cols * m->bits / 8;
    const int bits = m->bits;
    const uint8_t *codes = (const uint8_t *)m->data;
    const int8_t *xqb = bits == 4 ? a->q4p : a->q;
    uint8_t u[64];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * rb;
        const uint16_t *sc = m->scales + r * G, *mn = m->mins + r * G;
        float acc[16], mt[16];
        for (int l = 0; l < 16; l++) acc[l] = mt[l] = 0.0f;
        for (int64_t p = 0; 2 * p < nb; p++) {
            const int full = 2 * p + 1 < nb;
            czk_pair_codes(c, bits, p, full, u);
            const int8_t *xq = xqb + 64 * p;
            float s[2];
            s[0] = czyx_h2f(sc[(2 * p) / bpg]) * a->sx[2 * p];
            s[1] = full ? czyx_h2f(sc[(2 * p + 1) / bpg]) * a->sx[2 * p + 1] : 0.0f;
            for (int l = 0; l < 16; l++) {
                int32_t d = 0;
                for (int i = 0; i < 4; i++) d += (int32_t)u[4 * l + i] * (int32_t)xq[4 * l + i];
                const int blk = bits == 4 ? (l >> 2) & 1 : l >> 3;
                acc[l] = fmaf((float)d, s[blk], acc[l]);
            }
        }
        for (int64_t g = 0; g < G; g++) mt[g & 15] = fmaf(czyx_h2f(mn[g]), a->gsum[g], mt[g & 15]);
        y[r] = czk_tree16(acc) + czk_tree16(mt);
    }
}

static inline float czk_wf(const czk_mat *m, int64_t i) {
    if (m->kind == CZK_F16) return czyx_h2f(((const uint16_t *)m->data)[i]);
    if (m->kind == CZK_BF16) return czk_bf2f(((const uint16_t *)m->data)[i]);
    return ((const float *)m->data)[i];
}

static void czk_rows_f_portable(const czk_mat *m, const float *x, float *y, int64_t r0,
                                int64_t r1) {
    const int64_t C = m->cols;
    for (int64_t r = r0; r < r1; r++) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t c = 0;
        for (; c + 8 <= C; c += 8)
            for (int k = 0; k < 8; k++) acc[k] += czk_wf(m, r * C + c + k) * x[c + k];
        float t = czk_tree8(acc);
        for (; c < C; c++) t += czk_wf(m, r * C + c) * x[c];
        y[r] = t;
    }
}

/* ------------------------------------------------------------ AVX2 rows */
#if CZK_X86
#define CZK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CZK_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* czk_tree8 of the eight lanes, in registers: lanes k and k + 4 added, then
 * (0, 2) and (1, 3), then those two: the same additions in the same order. */
CZK_AVX2 static inline float czk_hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

CZK_AVX2 static inline __m256 czk_load8(const czk_mat *m, int64_t i) {
    if (m->kind == CZK_F32) return _mm256_loadu_ps((const float *)m->data + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)m->data + i));
    if (m->kind == CZK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One row's sum as czk_rows_f_avx2 defines it (four eight-lane accumulators over
 * 32-column steps, then eight-column steps into the first, (a0 + a1) + (a2 + a3),
 * czk_tree8, the scalar tail), for RB rows at once: the rows' chains are
 * independent, so interleaving them hides the multiply-add latency of short
 * rows without changing any row's operations. */
CZK_AVX2 static inline __attribute__((always_inline)) void czk_rows_f_rb(
    const czk_mat *m, const float *x, float *y, int64_t r, const int RB, const int kind) {
    const int64_t C = m->cols;
    __m256 a0[2], a1[2], a2[2], a3[2];
    for (int i = 0; i < RB; i++) a0[i] = a1[i] = a2[i] = a3[i] = _mm256_setzero_ps();
    czk_mat mk = *m;
    mk.kind = kind;
    int64_t c = 0;
    for (; c + 32 <= C; c += 32) {
        const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
        const __m256 x2 = _mm256_loadu_ps(x + c + 16), x3 = _mm256_loadu_ps(x + c + 24);
        for (int i = 0; i < RB; i++) {
            const int64_t base = (r + i) * C + c;
            a0[i] = _mm256_fmadd_ps(czk_load8(&mk, base), x0, a0[i]);
            a1[i] = _mm256_fmadd_ps(czk_load8(&mk, base + 8), x1, a1[i]);
            a2[i] = _mm256_fmadd_ps(czk_load8(&mk, base + 16), x2, a2[i]);
            a3[i] = _mm256_fmadd_ps(czk_load8(&mk, base + 24), x3, a3[i]);
        }
    }
    for (; c + 8 <= C; c += 8)
        for (int i = 0; i < RB; i++)
            a0[i] = _mm256_fmadd_ps(czk_load8(&mk, (r + i) * C + c), _mm256_loadu_ps(x + c),
                                    a0[i]);
    for (int i = 0; i < RB; i++) {
        float t = czk_hsum8(_mm256_add_ps(_mm256_add_ps(a0[i], a1[i]), _mm256_add_ps(a2[i], a3[i])));
        for (int64_t cc = c; cc < C; cc++) t += czk_wf(&mk, (r + i) * C + cc) * x[cc];
        y[r + i] = t;
    }
}

CZK_AVX2 static inline __attribute__((always_inline)) void czk_rows_f_kind(
    const czk_mat *m, const float *x, float *y, int64_t r0, int64_t r1, const int kind) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) czk_rows_f_rb(m, x, y, r, 2, kind);
    for (; r < r1; r++) czk_rows_f_rb(m, x, y, r, 1, kind);
}

CZK_AVX2 static void czk_rows_f_avx2(const czk_mat *m, const float *x, float *y, int64_t r0,
                                     int64_t r1) {
    if (m->kind == CZK_F32)
        czk_rows_f_kind(m, x, y, r0, r1, CZK_F32);
    else if (m->kind == CZK_F16)
        czk_rows_f_kind(m, x, y, r0, r1, CZK_F16);
    else
        czk_rows_f_kind(m, x, y, r0, r1, CZK_BF16);
}

/* n halves to floats with F16C (bit-exact, as czyx_h2f). */
CZK_AVX2 static inline void czk_h2f_row(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(h[i]);
}

/* Eight lanes, lane k = sum of products 4k..4k+3 (codes unsigned, xq signed). */
CZK_AVX2 static inline __m256i czk_dot_avx2(__m256i c, __m256i xq, int bits) {
    if (bits == 8) { /* 255 * 127 * 2 overflows vpmaddubsw's int16: widen instead */
        const __m256i c0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c));
        const __m256i c1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1));
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xq));
        const __m256i x1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xq, 1));
        const __m256i h = _mm256_hadd_epi32(_mm256_madd_epi16(c0, x0), _mm256_madd_epi16(c1, x1));
        return _mm256_permute4x64_epi64(h, 0xD8);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, xq), _mm256_set1_epi16(1));
}

/* The same eight lanes for 8-bit codes from codes - 128 (signed, so vpmaddubsw
 * cannot saturate: |c - 128| <= 128, |xq| <= 127), plus xs = 128 * the lane's
 * input sum: the same integers, fewer instructions than widening to 16 bits. */
CZK_AVX2 static inline __m256i czk_dot8_avx2(__m256i c, __m256i xq, __m256i xs) {
    const __m256i cs = _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80));
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(cs), _mm256_sign_epi8(xq, cs));
    return _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), xs);
}

/* Whether the SIMD row kernels take m: weight groups of a power-of-two number
 * of blocks (their scale expansion); others take the portable kernel. */
static inline int czk_simd_fits(const czk_mat *m) {
    const int64_t bpg = m->group / 32;
    return (bpg & (bpg - 1)) == 0;
}

/* Whether every step of a row's scale and min loads is whole (one scale per block,
 * blocks in eights, groups in sixteens): the row kernels then take an
 * instantiation without the partial loads (czk_h8), whose branches would cost a
 * long row's loop registers. */
static inline int czk_whole_rows(const czk_mat *m) {
    const int64_t nb = m->cols / 32, G = m->cols / m->group;
    return m->group == 32 && nb % 8 == 0 && G % 16 == 0;
}

/* --- AVX2: a row's sixteen lanes as two eight-float registers (lo, hi). */

/* n in [1, 8] fp16 values from p, zero past them, reading only those n: a short
 * row's scales or mins. The common short counts load directly; a copy through the
 * stack would stall on store-to-load forwarding, once per row of a small model.
 * Only in the kernels' instantiations for rows that are not whole (czk_whole_rows):
 * in a long row's loop its branches cost registers. */
CZK_AVX2 static inline __attribute__((always_inline)) __m128i czk_h8(const uint16_t *p, int64_t n) {
    switch (n) {
    case 8: return _mm_loadu_si128((const __m128i *)p);
    case 4: return _mm_loadl_epi64((const __m128i *)p);
    case 2: {
        int32_t v;
        memcpy(&v, p, sizeof v);
        return _mm_cvtsi32_si128(v);
    }
    case 1: return _mm_cvtsi32_si128(p[0]);
    default: {
        uint16_t t[8] = {0};
        for (int64_t l = 0; l < n; l++) t[l] = p[l];
        return _mm_loadu_si128((const __m128i *)t);
    }
    }
}

/* The scales of blocks b0 .. b0 + 7 (0 past nb) of a row's scales sc, groups of bpg
 * blocks (a power of two: czk_simd_fits), where they are not eight consecutive
 * halves: a short row's last blocks, or groups of several blocks. */
CZK_AVX2 static inline __attribute__((always_inline)) __m128i czk_wscales_part(
    const uint16_t *sc, int64_t b0, int64_t nb, int64_t bpg) {
    if (bpg == 1) return czk_h8(sc + b0, nb - b0);
    if (bpg == 2 && b0 + 8 <= nb) { /* (q2, q3: groups of 64) each of 4 halves twice */
        const __m128i h = _mm_loadl_epi64((const __m128i *)(sc + b0 / 2));
        return _mm_unpacklo_epi16(h, h);
    }
    const int sh = __builtin_ctzll((unsigned long long)bpg);
    uint16_t t[8];
    for (int l = 0; l < 8; l++) t[l] = b0 + l < nb ? sc[(b0 + l) >> sh] : 0;
    return _mm_loadu_si128((const __m128i *)t);
}

/* The weight scales d_g(b) of blocks b0 .. b0 + 7 of row r as floats (0 past the row). */
CZK_AVX2 static inline __attribute__((always_inline)) __m256 czk_wscales8(
    const czk_mat *m, int64_t r, int64_t b0, int64_t nb, int64_t bpg, int64_t G, const int whole) {
    const uint16_t *sc = m->scales + r * G;
    __m128i h;
    if (whole || (bpg == 1 && b0 + 8 <= nb)) {
        h = _mm_loadu_si128((const __m128i *)(sc + b0));
    } else {
        h = czk_wscales_part(sc, b0, nb, bpg);
    }
    return _mm256_cvtph_ps(h);
}

/* The block scales d_g(b) * sx_b of blocks b0 .. b0 + 7 of row r (0 past the row). */
CZK_AVX2 static inline __attribute__((always_inline)) __m256 czk_scales8(
    const czk_mat *m, int64_t r, int64_t b0, int64_t nb, int64_t bpg, int64_t G, const float *sx,
    const int whole) {
    return _mm256_mul_ps(czk_wscales8(m, r, b0, nb, bpg, G, whole), _mm256_loadu_ps(sx + b0));
}

/* czk_mins16 past the last full sixteen groups. */
CZK_AVX2 static inline __attribute__((always_inline)) void czk_mins_part(
    const uint16_t *mn, int64_t g, int64_t G, __m128i *h0, __m128i *h1) {
    const int64_t n = G - g;
    *h0 = czk_h8(mn + g, n < 8 ? n : 8);
    *h1 = n > 8 ? czk_h8(mn + g + 8, n - 8) : _mm_setzero_si128();
}

/* The fp16 mins of groups g .. g + 15 of a row (0 past its G groups), as two halves. */
CZK_AVX2 static inline __attribute__((always_inline)) void czk_mins16(
    const uint16_t *mn, int64_t g, int64_t G, __m128i *h0, __m128i *h1, const int whole) {
    if (whole || g + 16 <= G) {
        *h0 = _mm_loadu_si128((const __m128i *)(mn + g));
        *h1 = _mm_loadu_si128((const __m128i *)(mn + g + 8));
    } else {
        czk_mins_part(mn, g, G, h0, h1);
    }
}

/* The m-term's sixteen lanes over the groups of row r, summed (czk_tree16). */
CZK_AVX2 static inline __attribute__((always_inline)) float czk_mterm_avx2(
    const czk_mat *m, int64_t r, int64_t G, const float *gsum, const int whole) {
    const uint16_t *mn = m->mins + r * G;
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    for (int64_t g = 0; g < G; g += 16) {
        __m128i h0, h1;
        czk_mins16(mn, g, G, &h0, &h1, whole);
        lo = _mm256_fmadd_ps(_mm256_cvtph_ps(h0), _mm256_loadu_ps(gsum + g), lo);
        hi = _mm256_fmadd_ps(_mm256_cvtph_ps(h1), _mm256_loadu_ps(gsum + g + 8), hi);
    }
    return czk_hsum8(_mm256_add_ps(lo, hi));
}

/* czk_mterm_avx2 for NV <= 4 inputs of one row (each group's mins converted once). */
CZK_AVX2 static inline __attribute__((always_inline)) void czk_mterm_nv(
    const czk_mat *m, int64_t r, int64_t G, const czk_xq *av, const int NV, float *out,
    const int whole) {
    const uint16_t *mn = m->mins + r * G;
    __m256 lo[4], hi[4];
    for (int v = 0; v < NV; v++) lo[v] = hi[v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
        __m128i h0, h1;
        czk_mins16(mn, g, G, &h0, &h1, whole);
        const __m256 f0 = _mm256_cvtph_ps(h0), f1 = _mm256_cvtph_ps(h1);
        for (int v = 0; v < NV; v++) {
            lo[v] = _mm256_fmadd_ps(f0, _mm256_loadu_ps(av[v].gsum + g), lo[v]);
            hi[v] = _mm256_fmadd_ps(f1, _mm256_loadu_ps(av[v].gsum + g + 8), hi[v]);
        }
    }
    for (int v = 0; v < NV; v++) out[v] = czk_hsum8(_mm256_add_ps(lo[v], hi[v]));
}

/* The 32 two-bit codes of 8 bytes, one byte each, in column order (czk_pair_avx2). */
CZK_AVX2 static inline __m256i czk_q2_lanes(const uint8_t *b) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    v = _mm256_or_si256(v, _mm256_slli_epi32(v, 6));
    v = _mm256_or_si256(v, _mm256_slli_epi32(v, 12));
    return _mm256_and_si256(v, _mm256_set1_epi8(3));
}

/* Codes of the pair p as two 32-byte halves in input order (see czk_pair_codes). */
CZK_AVX2 static inline void czk_pair_avx2(const uint8_t *c, int bits, int64_t p, int full,
                                          __m256i *lo, __m256i *hi) {
    if (bits == 8) {
        *lo = _mm256_loadu_si256((const __m256i *)(c + 64 * p));
        *hi = full ? _mm256_loadu_si256((const __m256i *)(c + 64 * p + 32))
                   : _mm256_setzero_si256();
    } else if (bits == 4) {
        const __m256i v =
            full ? _mm256_loadu_si256((const __m256i *)(c + 32 * p))
                 : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                           _mm_loadu_si128((const __m128i *)(c + 32 * p)), 0);
        const __m256i m4 = _mm256_set1_epi8(15);
        *lo = _mm256_and_si256(v, m4);
        *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    } else if (bits == 2) {
        /* Byte j holds codes 4j .. 4j + 3 at bits 0, 2, 4, 6. Widened to 32-bit lane j
         * and ORed with its copies shifted by 6 and 12 (so by 6, 12 and 18), code 4j + i
         * lands at bits 8i, 8i + 1: masked, the lanes' bytes are the codes in column
         * order (czk_pair_codes' bytes) without a shuffle. */
        *lo = czk_q2_lanes(c + 16 * p);
        *hi = full ? czk_q2_lanes(c + 16 * p + 8) : _mm256_setzero_si256();
    } else {
        uint8_t u[64];
        czk_pair_codes(c, bits, p, full, u);
        *lo = _mm256_loadu_si256((const __m256i *)u);
        *hi = _mm256_loadu_si256((const __m256i *)(u + 32));
    }
}

/* RB rows from r: per pair of blocks, the input loaded once for the RB rows;
 * per row two integer dots, converted, one fused multiply-add per half. */
/* The eight-lane row kernel, written once for AVX2 (DOT8: czk_dot8_avx2, DOTQ:
 * czk_dot_avx2) and for 256-bit VNNI (both one vpdpbusd). */
#define CZK_ROWS_Q8LANE(ATTR, NAME, DOT8, DOTQ) \
ATTR static inline __attribute__((always_inline)) void NAME##_rb(                                  \
    const czk_mat *m, const czk_xq *a, float *y, int64_t r, const int RB, const int bits,          \
    const int whole) {                                                                              \
    const int64_t nb = m->cols / 32, bpg = m->group / 32, G = m->cols / m->group;                  \
    const int64_t rb = m->cols * bits / 8, pfull = nb / 2;                                         \
    const int8_t *xqb = bits == 4 ? a->q4p : a->q;                                                 \
    const uint8_t *c[4];                                                                           \
    __m256 lo[4], hi[4];                                                                           \
    for (int i = 0; i < RB; i++) {                                                                 \
        c[i] = (const uint8_t *)m->data + (r + i) * rb;                                            \
        lo[i] = hi[i] = _mm256_setzero_ps();                                                       \
    }                                                                                              \
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {                                                       \
        __m256 S[4];                                                                               \
        for (int i = 0; i < RB; i++) S[i] = czk_scales8(m, r + i, b0, nb, bpg, G, a->sx, whole);    \
        const int64_t p1 = b0 / 2 + 4;                                                             \
        for (int64_t p = b0 / 2; p < p1 && 2 * p < nb; p++) {                                      \
            const int full = p < pfull;                                                            \
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xqb + 64 * p));                \
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xqb + 64 * p + 32));           \
            const int k = (int)(2 * p - b0);                                                       \
            const __m256i i0 = bits == 4 ? _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1) \
                                         : _mm256_set1_epi32(k);                                   \
            const __m256i i1 = bits == 4 ? i0 : _mm256_set1_epi32(k + 1);                          \
            const __m256i s0 = _mm256_loadu_si256((const __m256i *)(a->xs4 + 16 * p));             \
            const __m256i s1 = _mm256_loadu_si256((const __m256i *)(a->xs4 + 16 * p + 8));         \
            for (int i = 0; i < RB; i++) {                                                         \
                __m256i cl, ch;                                                                    \
                _mm_prefetch((const char *)(c[i] + (bits * 8) * p + CZK_PREFETCH), CZK_PFHINT);   \
                czk_pair_avx2(c[i], bits, p, full, &cl, &ch);                                      \
                __m256 d0, d1;                                                                     \
                if (bits == 8) {                                                                   \
                    d0 = _mm256_cvtepi32_ps(DOT8(cl, x0, s0));                                     \
                    d1 = _mm256_cvtepi32_ps(DOT8(ch, x1, s1));                                     \
                } else {                                                                           \
                    d0 = _mm256_cvtepi32_ps(DOTQ(cl, x0, bits));                                   \
                    d1 = _mm256_cvtepi32_ps(DOTQ(ch, x1, bits));                                   \
                }                                                                                  \
                lo[i] = _mm256_fmadd_ps(d0, _mm256_permutevar8x32_ps(S[i], i0), lo[i]);            \
                hi[i] = _mm256_fmadd_ps(d1, _mm256_permutevar8x32_ps(S[i], i1), hi[i]);            \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < RB; i++)                                                                   \
        y[r + i] =                                                                                 \
            czk_hsum8(_mm256_add_ps(lo[i], hi[i])) + czk_mterm_avx2(m, r + i, G, a->gsum, whole);   \
}                                                                                                  \
                                                                                                   \
/* Inlined into each case of NAME's switch, so every bit width gets its own loop  \
 * with `bits` a constant: left to the compiler, whether it clones the function  \
 * per width depends on the rest of the file, and the generic loop is far slower. */\
ATTR static inline __attribute__((always_inline)) void NAME##_bits(                               \
    const czk_mat *m, const czk_xq *a, float *y, int64_t r0, int64_t r1, const int bits) {        \
    int64_t r = r0;                                                                                \
    if (czk_whole_rows(m)) {                                                                        \
        for (; r + 2 <= r1; r += 2) NAME##_rb(m, a, y, r, 2, bits, 1);                             \
        for (; r < r1; r++) NAME##_rb(m, a, y, r, 1, bits, 1);                                     \
        return;                                                                                    \
    }                                                                                              \
    for (; r + 2 <= r1; r += 2) NAME##_rb(m, a, y, r, 2, bits, 0);                                 \
    for (; r < r1; r++) NAME##_rb(m, a, y, r, 1, bits, 0);                                         \
}                                                                                                  \
                                                                                                   \
ATTR static void NAME(const czk_mat *m, const czk_xq *a, float *y, int64_t r0,                     \
                                     int64_t r1) {                                                 \
    switch (m->bits) {                                                                             \
    case 8: NAME##_bits(m, a, y, r0, r1, 8); break;                                                \
    case 4: NAME##_bits(m, a, y, r0, r1, 4); break;                                                \
    case 3: NAME##_bits(m, a, y, r0, r1, 3); break;                                                \
    default: NAME##_bits(m, a, y, r0, r1, 2); break;                                               \
    }                                                                                              \
}                                                                                                  \

CZK_ROWS_Q8LANE(CZK_AVX2, czk_rows_q_avx2, czk_dot8_avx2, czk_dot_avx2)

/* 256-bit VNNI: vpdpbusd takes unsigned codes times signed inputs directly. */
CZK_VNNI static inline __m256i czk_dot8_vnni256(__m256i c, __m256i xq, __m256i xs) {
    (void)xs;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xq);
}

CZK_VNNI static inline __m256i czk_dotq_vnni256(__m256i c, __m256i xq, int bits) {
    (void)bits;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xq);
}

CZK_ROWS_Q8LANE(CZK_VNNI, czk_rows_q_vnni256, czk_dot8_vnni256, czk_dotq_vnni256)

/* Several input vectors against one row (a prefill's tokens): the row's codes
 * are loaded once per pair for NV <= 4 vectors; each (row, vector) output gets
 * exactly the operations of the one-vector kernel, so a token's result does not
 * depend on the batch it came in. */
#define CZK_ROWS_QNV(ATTR, NAME, DOT8, DOTQ)                                                      \
    ATTR static inline __attribute__((always_inline)) void NAME##_nv(                             \
        const czk_mat *m, const czk_xq *av, float *y, int64_t ystride, int64_t r, const int NV,   \
        const int bits, const int whole) {                                                         \
        const int64_t nb = m->cols / 32, bpg = m->group / 32, G = m->cols / m->group;            \
        const int64_t rb = m->cols * bits / 8, pfull = nb / 2;                                    \
        const uint8_t *c = (const uint8_t *)m->data + r * rb;                                     \
        __m256 lo[4], hi[4];                                                                      \
        for (int v = 0; v < NV; v++) lo[v] = hi[v] = _mm256_setzero_ps();                         \
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {                                                  \
            __m256 S[4];                                                                          \
            const __m256 dw = czk_wscales8(m, r, b0, nb, bpg, G, whole);                           \
            for (int v = 0; v < NV; v++) S[v] = _mm256_mul_ps(dw, _mm256_loadu_ps(av[v].sx + b0)); \
            const int64_t p1 = b0 / 2 + 4;                                                        \
            for (int64_t p = b0 / 2; p < p1 && 2 * p < nb; p++) {                                 \
                const int full = p < pfull;                                                       \
                const int k = (int)(2 * p - b0);                                                  \
                const __m256i i0 = bits == 4 ? _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, \
                                                                 k + 1)                           \
                                             : _mm256_set1_epi32(k);                              \
                const __m256i i1 = bits == 4 ? i0 : _mm256_set1_epi32(k + 1);                     \
                __m256i cl, ch;                                                                   \
                _mm_prefetch((const char *)(c + (bits * 8) * p + CZK_PREFETCH), CZK_PFHINT);     \
                czk_pair_avx2(c, bits, p, full, &cl, &ch);                                        \
                for (int v = 0; v < NV; v++) {                                                    \
                    const int8_t *xqb = bits == 4 ? av[v].q4p : av[v].q;                          \
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xqb + 64 * p));       \
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xqb + 64 * p + 32));  \
                    __m256 d0, d1;                                                                \
                    if (bits == 8) {                                                              \
                        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(av[v].xs4 + 16 * p)); \
                        const __m256i s1 =                                                        \
                            _mm256_loadu_si256((const __m256i *)(av[v].xs4 + 16 * p + 8));        \
                        d0 = _mm256_cvtepi32_ps(DOT8(cl, x0, s0));                                \
                        d1 = _mm256_cvtepi32_ps(DOT8(ch, x1, s1));                                \
                    } else {                                                                      \
                        d0 = _mm256_cvtepi32_ps(DOTQ(cl, x0, bits));                              \
                        d1 = _mm256_cvtepi32_ps(DOTQ(ch, x1, bits));                              \
                    }                                                                             \
                    lo[v] = _mm256_fmadd_ps(d0, _mm256_permutevar8x32_ps(S[v], i0), lo[v]);       \
                    hi[v] = _mm256_fmadd_ps(d1, _mm256_permutevar8x32_ps(S[v], i1), hi[v]);       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        float mt[4];                                                                              \
        czk_mterm_nv(m, r, G, av, NV, mt, whole);                                                  \
        for (int v = 0; v < NV; v++)                                                              \
            y[v * ystride + r] = czk_hsum8(_mm256_add_ps(lo[v], hi[v])) + mt[v];                  \
    }                                                                                             \
                                                                                                  \
    ATTR static inline __attribute__((always_inline)) void NAME##_nvbits(                        \
        const czk_mat *m, const czk_xq *av, int nv, float *y,                                     \
                                   int64_t ystride, int64_t r0, int64_t r1, const int bits) {     \
        const int whole = czk_whole_rows(m);                                                        \
        for (int64_t r = r0; r < r1; r++) switch (nv * 2 + whole) {                                \
            case 9: NAME##_nv(m, av, y, ystride, r, 4, bits, 1); break;                           \
            case 8: NAME##_nv(m, av, y, ystride, r, 4, bits, 0); break;                           \
            case 7: NAME##_nv(m, av, y, ystride, r, 3, bits, 1); break;                           \
            case 6: NAME##_nv(m, av, y, ystride, r, 3, bits, 0); break;                           \
            case 5: NAME##_nv(m, av, y, ystride, r, 2, bits, 1); break;                           \
            case 4: NAME##_nv(m, av, y, ystride, r, 2, bits, 0); break;                           \
            case 3: NAME##_nv(m, av, y, ystride, r, 1, bits, 1); break;                           \
            default: NAME##_nv(m, av, y, ystride, r, 1, bits, 0); break;                          \
            }                                                                                     \
    }                                                                                             \
                                                                                                  \
    ATTR static void NAME##_multi(const czk_mat *m, const czk_xq *av, int nv, float *y,           \
                                  int64_t ystride, int64_t r0, int64_t r1) {                      \
        switch (m->bits) {                                                                        \
        case 8: NAME##_nvbits(m, av, nv, y, ystride, r0, r1, 8); break;                           \
        case 4: NAME##_nvbits(m, av, nv, y, ystride, r0, r1, 4); break;                           \
        case 3: NAME##_nvbits(m, av, nv, y, ystride, r0, r1, 3); break;                           \
        default: NAME##_nvbits(m, av, nv, y, ystride, r0, r1, 2); break;                          \
        }                                                                                         \
    }

CZK_ROWS_QNV(CZK_AVX2, czk_rows_q_avx2, czk_dot8_avx2, czk_dot_avx2)
CZK_ROWS_QNV(CZK_VNNI, czk_rows_q_vnni256, czk_dot8_vnni256, czk_dotq_vnni256)

/* 8-bit codes against NV <= 4 inputs with AVX2: czk_rows_q_avx2_nv's operations
 * for bits == 8 (each (row, input) gets the same integer dot, conversion, scale
 * and fused multiply-add per pair, in order, and the same sum), arranged so the
 * eight accumulators stay in the sixteen registers: the block scales are
 * broadcast from memory instead of permuted in registers (the same floats), and
 * each half's codes are prepared once for the inputs. Written the macro's way,
 * the compiler keeps the accumulators on the stack and every pair waits on
 * store-to-load forwarding. */
CZK_AVX2 static inline __attribute__((always_inline)) void czk_q8nv_avx2_row(
    const czk_mat *m, const czk_xq *av, float *y, int64_t ystride, int64_t r, const int NV,
    const int whole) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    float sc[4][8] __attribute__((aligned(32))); /* each input's block scales, to broadcast */
    __m256 lo[4], hi[4];
    const int64_t nb = m->cols / 32, bpg = m->group / 32, G = m->cols / m->group;
    const int64_t pfull = nb / 2;
    const uint8_t *c = (const uint8_t *)m->data + r * m->cols;
    for (int v = 0; v < NV; v++) lo[v] = hi[v] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const __m256 dw = czk_wscales8(m, r, b0, nb, bpg, G, whole);
        for (int v = 0; v < NV; v++)
            _mm256_store_ps(sc[v], _mm256_mul_ps(dw, _mm256_loadu_ps(av[v].sx + b0)));
        const int64_t p1 = b0 / 2 + 4;
        for (int64_t p = b0 / 2; p < p1 && 2 * p < nb; p++) {
            const int k = (int)(2 * p - b0);
            _mm_prefetch((const char *)(c + 64 * p + CZK_PREFETCH), CZK_PFHINT);
            const __m256i c0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + 64 * p)), flip);
            const __m256i a0 = _mm256_abs_epi8(c0);
            for (int v = 0; v < NV; v++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(av[v].q + 64 * p));
                const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, c0)), ones);
                const __m256i d = _mm256_add_epi32(t, _mm256_loadu_si256((const __m256i *)(av[v].xs4 + 16 * p)));
                lo[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(&sc[v][k]), lo[v]);
            }
            const __m256i c1 = _mm256_xor_si256(
                p < pfull ? _mm256_loadu_si256((const __m256i *)(c + 64 * p + 32)) : _mm256_setzero_si256(),
                flip);
            const __m256i a1 = _mm256_abs_epi8(c1);
            for (int v = 0; v < NV; v++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(av[v].q + 64 * p + 32));
                const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, c1)), ones);
                const __m256i d =
                    _mm256_add_epi32(t, _mm256_loadu_si256((const __m256i *)(av[v].xs4 + 16 * p + 8)));
                hi[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(&sc[v][k + 1]), hi[v]);
            }
        }
    }
    float mt[4];
    czk_mterm_nv(m, r, G, av, NV, mt, whole);
    for (int v = 0; v < NV; v++) y[v * ystride + r] = czk_hsum8(_mm256_add_ps(lo[v], hi[v])) + mt[v];
}

/* Rows r0 .. r1 of an 8-bit multi-input row kernel ROW for nv <= 4 inputs: every
 * (input count, whole rows) case a call with constants, so each loop is specialised. */
#define CZK_Q8NV_ROWS(ATTR, NAME, ROW)                                                            \
    ATTR static void NAME(const czk_mat *m, const czk_xq *av, int nv, float *y, int64_t ystride, \
                          int64_t r0, int64_t r1) {                                               \
        const int whole = czk_whole_rows(m);                                                        \
        for (int64_t r = r0; r < r1; r++) switch (nv * 2 + whole) {                                \
            case 9: ROW(m, av, y, ystride, r, 4, 1); break;                                       \
            case 8: ROW(m, av, y, ystride, r, 4, 0); break;                                       \
            case 7: ROW(m, av, y, ystride, r, 3, 1); break;                                       \
            case 6: ROW(m, av, y, ystride, r, 3, 0); break;                                       \
            case 5: ROW(m, av, y, ystride, r, 2, 1); break;                                       \
            case 4: ROW(m, av, y, ystride, r, 2, 0); break;                                       \
            case 3: ROW(m, av, y, ystride, r, 1, 1); break;                                       \
            default: ROW(m, av, y, ystride, r, 1, 0); break;                                      \
            }                                                                                     \
    }

CZK_Q8NV_ROWS(CZK_AVX2, czk_q8nv_avx2, czk_q8nv_avx2_row)

/* 8-bit codes against NV <= 4 inputs with 512-bit VNNI: a pair of blocks is one
 * register, lanes 0-7 block 2p and lanes 8-15 block 2p + 1, so each lane gets
 * exactly the operations of the 256-bit kernel's lo and hi lanes (the same
 * integer dot, conversion, scale and fused multiply-add, pairs in order) in
 * half the instructions; the sum is the same lo + hi and tree. A prompt's
 * products are compute-bound, unlike decode's, so the wider registers pay. */
CZK_VNNI static inline __attribute__((always_inline)) void czk_q8nv512_row(
    const czk_mat *m, const czk_xq *av, float *y, int64_t ystride, int64_t r, const int NV,
    const int whole) {
    const int64_t nb = m->cols / 32, bpg = m->group / 32, G = m->cols / m->group;
    const int64_t pfull = nb / 2;
    const uint8_t *c = (const uint8_t *)m->data + r * m->cols;
    __m512 acc[4];
    for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const __m256 dw = czk_wscales8(m, r, b0, nb, bpg, G, whole);
        __m512 S[4];
        for (int v = 0; v < NV; v++)
            S[v] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(av[v].sx + b0)));
        const int64_t p1 = b0 / 2 + 4;
        for (int64_t p = b0 / 2; p < p1 && 2 * p < nb; p++) {
            const int k = (int)(2 * p - b0);
            const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(k), _mm256_set1_epi32(k + 1), 1);
            _mm_prefetch((const char *)(c + 64 * p + CZK_PREFETCH), CZK_PFHINT);
            const __m512i cc =
                p < pfull ? _mm512_loadu_si512((const void *)(c + 64 * p))
                          : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(c + 64 * p)));
            for (int v = 0; v < NV; v++) {
                const __m512i xx = _mm512_loadu_si512((const void *)(av[v].q + 64 * p));
                const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cc, xx);
                acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, S[v]),
                                         acc[v]);
            }
        }
    }
    float mt[4];
    czk_mterm_nv(m, r, G, av, NV, mt, whole);
    for (int v = 0; v < NV; v++) {
        const __m256 lo = _mm512_castps512_ps256(acc[v]);
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[v]), 1));
        y[v * ystride + r] = czk_hsum8(_mm256_add_ps(lo, hi)) + mt[v];
    }
}

CZK_Q8NV_ROWS(CZK_VNNI, czk_q8nv512, czk_q8nv512_row)

#endif

/* Rows [r0, r1) of m @ x (x float for float kinds, `a` for quantized ones). */
static void czk_rows(const czk_mat *m, const float *x, const czk_xq *a, float *y, int64_t r0,
                     int64_t r1) {
    const int lvl = czk_level();
    if (m->kind == CZK_Q) {
#if CZK_X86
        if (!czk_simd_fits(m)) return czk_rows_q_portable(m, a, y, r0, r1);
        if (lvl == 2) return czk_rows_q_vnni256(m, a, y, r0, r1);
        /* 8-bit codes: the register-resident kernel (the same operations as the
         * macro's, whose version for one input keeps fewer of them in registers) */
        if (lvl == 1 && m->bits == 8) return czk_q8nv_avx2(m, a, 1, y, 0, r0, r1);
        if (lvl == 1) return czk_rows_q_avx2(m, a, y, r0, r1);
#endif
        return czk_rows_q_portable(m, a, y, r0, r1);
    }
#if CZK_X86
    if (lvl >= 1) return czk_rows_f_avx2(m, x, y, r0, r1);
#endif
    czk_rows_f_portable(m, x, y, r0, r1);
}

static int czk_check(const czk_mat *m) {
    if (m->rows < 0 || m->cols <= 0 || !m->data) return 0;
    if (m->kind == CZK_Q) {
        if (!(m->bits == 2 || m->bits == 3 || m->bits == 4 || m->bits == 8)) return 0;
        if (m->group <= 0 || m->group % 32 || m->cols % m->group || !m->scales || !m->mins)
            return 0;
        return 1;
    }
    return m->kind == CZK_F32 || m->kind == CZK_F16 || m->kind == CZK_BF16;
}

/* ------------------------------------------------------------ matvec */

typedef struct {
    const czk_mat *m;
    const float *x;
    const czk_xq *a;
    float *y;
} czk_mv_ctx;

static void czk_mv_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_mv_ctx *c = (czk_mv_ctx *)ctx_;
    czk_rows(c->m, c->x, c->a, c->y, t0, t1);
}

/* Scratch bytes a call needs for inputs of n floats (quantization buffers). */
int64_t czk_work_bytes(int64_t n) { return (int64_t)czk_xq_bytes(n) + 64; }

static void *czk_align(void *p) { return (void *)(((uintptr_t)p + 63u) & ~(uintptr_t)63u); }

/* y = m @ x. work: czk_work_bytes(m->cols) bytes. Returns 0, or -1 on bad arguments. */
int czk_matvec(czk_pool *p, const czk_mat *m, const float *x, float *y, void *work) {
    if (!czk_check(m)) return -1;
    czk_xq a;
    if (m->kind == CZK_Q) {
        czk_xq_bind(&a, czk_align(work), m->cols);
        czk_quantize(x, &a);
        czk_xq_groups(&a, m->group);
    }
    czk_mv_ctx c = {m, x, &a, y};
    czk_run(p, czk_mv_task, &c, m->rows, m->rows * m->cols);
    return 0;
}

/* ------------------------------------------------------------ several vectors */

/* Rows [r0, r1) of a quantized m against nv <= 4 quantized inputs, output v row r
 * at y[v * ystride + r], each (row, input) exactly as czk_rows computes it: the
 * multi-input kernels of the CPU's SIMD path (the codes loaded once for the nv
 * inputs), else the portable one per input. */
static void czk_rows_qnv(const czk_mat *m, const czk_xq *av, int nv, float *y, int64_t ystride,
                         int64_t r0, int64_t r1) {
#if CZK_X86
    const int lvl = czk_level();
    if (czk_simd_fits(m) && lvl == 2 && m->bits == 8 && CZK_Q8NV512) {
        czk_q8nv512(m, av, nv, y, ystride, r0, r1);
        return;
    }
    if (czk_simd_fits(m) && lvl == 2) {
        czk_rows_q_vnni256_multi(m, av, nv, y, ystride, r0, r1);
        return;
    }
    if (czk_simd_fits(m) && lvl == 1 && m->bits == 8) { /* (czk_rows' own 8-bit kernel) */
        czk_q8nv_avx2(m, av, nv, y, ystride, r0, r1);
        return;
    }
    if (czk_simd_fits(m) && lvl == 1) {
        czk_rows_q_avx2_multi(m, av, nv, y, ystride, r0, r1);
        return;
    }
#endif
    for (int v = 0; v < nv; v++) czk_rows_q_portable(m, &av[v], y + v * ystride, r0, r1);
}

typedef struct {
    const czk_mat *m;
    const czk_xq *av; /* nvec quantized inputs */
    int64_t nvec;
    float *y; /* [nvec, rows] */
} czk_mm_ctx;

static void czk_mm_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_mm_ctx *c = (czk_mm_ctx *)ctx_;
    const czk_mat *m = c->m;
    for (int64_t v0 = 0; v0 < c->nvec; v0 += 4) {
        const int nv = c->nvec - v0 < 4 ? (int)(c->nvec - v0) : 4;
        czk_rows_qnv(m, c->av + v0, nv, c->y + v0 * m->rows, m->rows, t0, t1);
    }
}

/* Scratch bytes of czk_matmul for nvec inputs of n floats. */
int64_t czk_matmul_work_bytes(int64_t nvec, int64_t n) {
    return nvec * ((int64_t)czk_xq_bytes(n) + 64) + (int64_t)sizeof(czk_xq) * nvec + 64;
}

/* y[v] = m @ x[v] for nvec inputs (x [nvec, cols], y [nvec, rows]) of a quantized
 * m, each output exactly as czk_matvec computes it. Returns 0, or -1. */
int czk_matmul(czk_pool *p, const czk_mat *m, const float *x, int64_t nvec, float *y,
               void *work) {
    if (!czk_check(m) || m->kind != CZK_Q || nvec <= 0) return -1;
    uint8_t *w = (uint8_t *)czk_align(work);
    czk_xq *av = (czk_xq *)w;
    w = (uint8_t *)czk_align(w + sizeof(czk_xq) * (size_t)nvec);
    for (int64_t v = 0; v < nvec; v++) {
        czk_xq_bind(&av[v], w, m->cols);
        w = (uint8_t *)czk_align(w + czk_xq_bytes(m->cols));
        czk_quantize(x + v * m->cols, &av[v]);
        czk_xq_groups(&av[v], m->group);
    }
    czk_mm_ctx c = {m, av, nvec, y};
    czk_run(p, czk_mm_task, &c, m->rows, nvec * m->rows * m->cols);
    return 0;
}

/* ------------------------------------------------------------ MoE layer */

typedef struct {
    int n;
    int64_t H, I;
    const czk_mat *mats; /* gate, up, down per table entry */
    const int64_t *slots;
    const float *w;
    const float *x;
    const czk_xq *const *axe; /* [n] the input quantized for expert j's gate/up groups */
    float *act;               /* [n, I] */
    const czk_xq *aact;
    float *y;
} czk_moe_ctx;

static void czk_moe_gu_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_moe_ctx *c = (czk_moe_ctx *)ctx_;
    float g[64], u[64];
    for (int64_t t = t0; t < t1;) {
        const int64_t j = t / c->I, r = t % c->I;
        int64_t e = (j + 1) * c->I;
        if (e > t1) e = t1;
        if (e - t > 64) e = t + 64;
        const czk_mat *gm = &c->mats[3 * c->slots[j]], *um = &c->mats[3 * c->slots[j] + 1];
        const czk_xq *ax = c->axe ? c->axe[j] : NULL;
        czk_rows(gm, c->x, ax, g - r, r, r + (e - t));
        czk_rows(um, c->x, ax, u - r, r, r + (e - t));
        float *act = c->act + j * c->I;
        for (int64_t i = 0; i < e - t; i++) {
            const float gv = g[i];
            act[r + i] = gv / (1.0f + expf(-gv)) * u[i];
        }
        t = e;
    }
}

static void czk_moe_down_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_moe_ctx *c = (czk_moe_ctx *)ctx_;
    float d[64];
    for (int64_t r = t0; r < t1; r += 64) {
        const int64_t e = r + 64 < t1 ? r + 64 : t1;
        for (int j = 0; j < c->n; j++) {
            const czk_xq *aj = c->aact ? &c->aact[j] : NULL;
            czk_rows(&c->mats[3 * c->slots[j] + 2], c->act + j * c->I, aj, d - r, r, e);
            const float wj = c->w[j];
            if (j == 0)
                for (int64_t i = r; i < e; i++) c->y[i] = wj * d[i - r];
            else
                for (int64_t i = r; i < e; i++) c->y[i] += wj * d[i - r];
        }
    }
}

/* Distinct gate/up group sizes one MoE call's packed experts may mix (experts held
 * at different precisions: q4's groups of 32 beside q2's of 64). The input is
 * quantized once; only its per-group sums differ, one array per group size. */
#define CZK_MAXG 4

/* Bytes of the extra per-group sums of an input of n values (CZK_MAXG - 1 arrays). */
static int64_t czk_gsum_bytes(int64_t n) {
    return (CZK_MAXG - 1) * (int64_t)(sizeof(float) * (size_t)(czk_padn(n) / 32) + 64);
}

/* Scratch bytes of czk_moe for n experts of hidden H and intermediate I. */
int64_t czk_moe_work_bytes(int n, int64_t H, int64_t I) {
    return (int64_t)(sizeof(float) * (size_t)(n * I)) + 64 + czk_work_bytes(H) +
           czk_gsum_bytes(H) + (int64_t)n * czk_work_bytes(I) + 64;
}

/* Index of `group` in groups[0 .. *ng), appended when new; -1 past CZK_MAXG. */
static int czk_group_index(int64_t *groups, int *ng, int64_t group) {
    for (int i = 0; i < *ng; i++)
        if (groups[i] == group) return i;
    if (*ng == CZK_MAXG) return -1;
    groups[*ng] = group;
    return (*ng)++;
}

/* The input x quantized once into xq[0] (bound at *mem), and its group sums for the
 * gate/up group of each of the n experts at slots: xq[i] shares xq[0]'s codes with
 * the sums of the i-th distinct group (bound after it); axe[j] is expert j's. */
static void czk_quantize_groups(const float *x, int64_t H, const czk_mat *table,
                                const int64_t *slots, int n, czk_xq *xq, const czk_xq **axe,
                                uint8_t **mem) {
    uint8_t *m = *mem;
    czk_xq_bind(&xq[0], m, H);
    m = (uint8_t *)czk_align(m + czk_xq_bytes(H));
    czk_quantize(x, &xq[0]);
    int64_t groups[CZK_MAXG];
    int ng = 0;
    for (int j = 0; j < n; j++) {
        const int64_t g = table[3 * slots[j]].group;
        const int before = ng, i = czk_group_index(groups, &ng, g);
        if (ng > before && i > 0) { /* a new group size: its own sums over the same codes */
            xq[i] = xq[0];
            xq[i].gsum = (float *)m;
            xq[i].ggroup = 0;
            m = (uint8_t *)czk_align(m + sizeof(float) * (size_t)(xq[0].npad / 32));
        }
        czk_xq_groups(&xq[i], g);
        axe[j] = &xq[i];
    }
    *mem = m;
}

/* Whether the n experts at slots of a descriptor table are one MoE layer's:
 * each a valid gate [I, H], up [I, H] and down [H, I] of one kind (float or
 * packed; packed experts may differ in bits and group sizes, gate and up of one
 * expert share theirs, at most CZK_MAXG gate groups in all), I a multiple of 32
 * when packed. */
static int czk_experts_ok(const czk_mat *table, const int64_t *slots, int n, int64_t H) {
    const czk_mat *f = &table[3 * slots[0]];
    const int64_t I = f->rows;
    const int quant = f->kind == CZK_Q;
    int64_t groups[CZK_MAXG];
    int ng = 0;
    for (int j = 0; j < n; j++) {
        const czk_mat *g = &table[3 * slots[j]], *u = g + 1, *d = g + 2;
        if (!czk_check(g) || !czk_check(u) || !czk_check(d)) return 0;
        if (g->rows != I || g->cols != H || u->rows != I || u->cols != H || d->rows != H ||
            d->cols != I)
            return 0;
        if ((g->kind == CZK_Q) != quant || u->kind != g->kind || d->kind != g->kind) return 0;
        if (quant && (u->group != g->group || czk_group_index(groups, &ng, g->group) < 0))
            return 0;
    }
    return !(quant && I % 32);
}

/* One token through n routed experts: y = sum_j w[j] * down_j(silu(gate_j x) * up_j x),
 * summed in j order. Expert j is table entry slots[j]: (gate [I, H], up [I, H],
 * down [H, I]) at table[3 * slots[j]] (a slot cache's descriptors, made once).
 * Returns 0, or -1 on inconsistent shapes or formats. */
int czk_moe(czk_pool *p, int n, const czk_mat *table, const int64_t *slots, const float *w,
            const float *x, float *y, void *work) {
    if (n <= 0 || n > CZK_MAXK) return -1;
    const czk_mat *mats = table;
    const int64_t I = table[3 * slots[0]].rows, H = table[3 * slots[0]].cols;
    const int kind0 = table[3 * slots[0]].kind;
    if (!czk_experts_ok(table, slots, n, H)) return -1;
    const int quant = kind0 == CZK_Q;
    uint8_t *m = (uint8_t *)czk_align(work);
    float *act = (float *)m;
    m = (uint8_t *)czk_align(m + sizeof(float) * (size_t)(n * I));
    czk_xq ax[CZK_MAXG], aact[CZK_MAXK];
    const czk_xq *axe[CZK_MAXK];
    if (quant) {
        for (int j = 0; j < n; j++) {
            czk_xq_bind(&aact[j], m, I);
            m = (uint8_t *)czk_align(m + czk_xq_bytes(I));
        }
        czk_quantize_groups(x, H, table, slots, n, ax, axe, &m);
    }
    czk_moe_ctx c = {n, H, I, mats, slots, w, x, quant ? axe : NULL, act, NULL, y};
    czk_run(p, czk_moe_gu_task, &c, (int64_t)n * I, 2 * (int64_t)n * I * H);
    if (quant) {
        for (int j = 0; j < n; j++) {
            czk_quantize(act + (int64_t)j * I, &aact[j]);
            czk_xq_groups(&aact[j], table[3 * slots[j] + 2].group);
        }
        c.aact = aact;
    }
    czk_run(p, czk_moe_down_task, &c, H, (int64_t)n * I * H);
    return 0;
}

/* The same layer one expert at a time, for decode under a slot budget: a read
 * that is still in flight need not hold back the experts already resident.
 * czk_moe_one computes expert j's unweighted output into row j of the work
 * buffer (in whatever order the experts' bytes arrive); czk_moe_sum then adds
 * the rows weighted, in j order, with the arithmetic czk_moe uses (its down
 * task writes w0 * d0 and adds w[j] * d[j]; 1.0f * d is d exactly), so the
 * result is bit-identical to czk_moe's on the same experts. Each call
 * quantizes x for its own expert, so experts of different formats may share
 * one sum. Work: czk_moe_one_work_bytes(n, H, I) bytes. */
int64_t czk_moe_one_work_bytes(int n, int64_t H, int64_t I) {
    return (int64_t)sizeof(float) * ((int64_t)n * H + I) + 3 * 64 + czk_work_bytes(H) +
           czk_work_bytes(I);
}

int czk_moe_one(czk_pool *p, int n, int j, const czk_mat *table, int64_t slot, int64_t I,
                const float *x, void *work) {
    if (n <= 0 || n > CZK_MAXK || j < 0 || j >= n) return -1;
    const czk_mat *g = &table[3 * slot];
    const int64_t H = g->cols;
    if (g->rows != I || !czk_experts_ok(table, &slot, 1, H)) return -1;
    const int quant = g->kind == CZK_Q;
    float *rows = (float *)czk_align(work);
    float *act = rows + (int64_t)n * H;
    uint8_t *m = (uint8_t *)czk_align(act + I);
    czk_xq ax, aact;
    if (quant) {
        czk_xq_bind(&ax, m, H);
        m = (uint8_t *)czk_align(m + czk_xq_bytes(H));
        czk_xq_bind(&aact, m, I);
        czk_quantize(x, &ax);
        czk_xq_groups(&ax, g->group);
    }
    static const float one = 1.0f;
    const czk_xq *axe[1] = {&ax};
    czk_moe_ctx c = {1, H, I, table, &slot, &one, x, quant ? axe : NULL, act, NULL,
                     rows + (int64_t)j * H};
    czk_run(p, czk_moe_gu_task, &c, I, 2 * I * H);
    if (quant) {
        czk_quantize(act, &aact);
        czk_xq_groups(&aact, g[2].group);
        c.aact = &aact;
    }
    czk_run(p, czk_moe_down_task, &c, H, I * H);
    return 0;
}

void czk_moe_sum(int n, int64_t H, const float *w, const void *work, float *y) {
    const float *rows = (const float *)czk_align((void *)work);
    for (int64_t i = 0; i < H; i++) y[i] = w[0] * rows[i];
    for (int j = 1; j < n; j++) {
        const float wj = w[j], *d = rows + (int64_t)j * H;
        for (int64_t i = 0; i < H; i++) y[i] += wj * d[i];
    }
}

/* ------------------------------------------------------------ attention block */

static void czk_rms(const float *x, const float *w, int64_t n, float eps, float *out) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    const float inv = 1.0f / sqrtf(s / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

void czk_rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    czk_rms(x, w, n, eps, out);
}

typedef struct {
    const czk_attn *a;
    const czk_mat *m[3];
    int64_t off[4];
    const float *x;
    const czk_xq *ax;
    float *y;
} czk_qkv_ctx;

static void czk_qkv_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_qkv_ctx *c = (czk_qkv_ctx *)ctx_;
    for (int i = 0; i < 3; i++) {
        int64_t lo = t0 > c->off[i] ? t0 : c->off[i];
        int64_t hi = t1 < c->off[i + 1] ? t1 : c->off[i + 1];
        if (lo < hi)
            czk_rows(c->m[i], c->x, c->ax, c->y + c->off[i], lo - c->off[i], hi - c->off[i]);
    }
}

typedef struct {
    const czk_attn *a;
    const float *q;
    const float *kc, *vc;
    int64_t cap, start, end;
    float *out;
    float *scores; /* [n_heads, end] */
} czk_heads_ctx;

/* s[start, end) <- exp(s - mx) in place, summed in index order; returns 1 / sum.
 * The portable path's softmax (the SIMD paths' is czk_softmax8_avx2). */
static inline float czk_softmax_span(float *s, int64_t start, int64_t end, float mx) {
    float sum = 0.0f;
    for (int64_t j = start; j < end; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    return 1.0f / sum;
}

#if CZK_X86
/* exp of eight lanes: Cephes' expf (2^n times a degree-5 polynomial of the remainder
 * on [-ln2/2, ln2/2], n = round(x log2 e), ln 2 in two parts): within 1 ulp of glibc's
 * expf on every 256th float of [-87.3, 88.3] and every float within 1e-3 of 0.
 * Inputs are clamped to [-87.33, 88.37]: below, 2^-126 rather than expf's denormals
 * (a softmax term next to the maximum's 1, so no sum changes), above, no overflow. */
CZK_AVX2 static inline __m256 czk_exp8(__m256 x) {
    /* (the constant first: max_ps and min_ps return their second operand for a NaN,
     * so a NaN score stays NaN, as expf leaves it) */
    x = _mm256_min_ps(_mm256_set1_ps(88.37626f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* s[start, end) <- exp(s - mx) in place, eight at a time (the tail in a padded block);
 * returns 1 / their sum (eight lane sums, then czk_hsum8). */
CZK_AVX2 static float czk_softmax8_avx2(float *s, int64_t start, int64_t end, float mx) {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = start;
    for (; j + 8 <= end; j += 8) {
        const __m256 e = czk_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (j < end) { /* the last n < 8: a block padded past them, its pad lanes zeroed */
        float t[8];
        const int n = (int)(end - j);
        for (int i = 0; i < 8; i++) t[i] = i < n ? s[j + i] - mx : 0.0f;
        const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_ps((float)n), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(czk_exp8(_mm256_loadu_ps(t)), live);
        _mm256_storeu_ps(t, e);
        for (int i = 0; i < n; i++) s[j + i] = t[i];
        acc = _mm256_add_ps(acc, e);
    }
    return 1.0f / czk_hsum8(acc);
}

/* Eight dot products at once, lane j = czk_hsum8 of row j's eight lane sums: the
 * rows' accumulators transposed so lane j holds ((a0 + a4) + (a2 + a6)) + ((a1 + a5)
 * + (a3 + a7)) of row j, czk_hsum8's tree, in one vector (no horizontal sum a row). */
CZK_AVX2 static inline __m256 czk_hsum8x8(const __m256 *a) {
    __m256 h[4];
    for (int j = 0; j < 4; j++) /* [lo + hi of row j | of row j + 4] */
        h[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20),
                             _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    /* per 128-bit lane (s0 + s2, s1 + s3) of two rows side by side */
    const __m256 pq = _mm256_add_ps(_mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 rs = _mm256_add_ps(_mm256_shuffle_ps(h[2], h[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(h[2], h[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(pq, rs, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(pq, rs, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Query heads sharing one key-value head go through its rows together, a few at a
 * time (at most this many): a block of keys or values is read from memory once for
 * all of them and from the L1 cache for the rest. */
#define CZK_HEADS_SHARE 16
/* Positions a block of values holds (p.v): 32 rows of up to 128 floats stay in L1. */
#define CZK_PV_BLOCK 32

/* The same loops with eight-float vectors (head_dim a multiple of 8): each score is
 * the dot product's eight lanes summed in czk_tree8's order, as the portable path,
 * eight positions at a time; the softmax is czk_softmax8_avx2's; each output lane
 * sums p_j * v_j over the positions in order. The heads of [t0, t1) that share a
 * key-value head run together (up to CZK_HEADS_SHARE), block by block of positions:
 * each head's operations, and so its output, are those it computes alone. */
CZK_AVX2 static void czk_heads_avx2(czk_heads_ctx *c, int64_t t0, int64_t t1) {
    const int hd = c->a->head_dim, groups = c->a->n_heads / c->a->n_kv;
    const float scale = c->a->scale;
    const int64_t j0 = c->start, j1 = c->end;
    for (int64_t h0 = t0; h0 < t1;) {
        const int64_t g = h0 / groups;
        int64_t h1 = (g + 1) * groups;
        h1 = h1 < t1 ? h1 : t1;
        h1 = h1 - h0 > CZK_HEADS_SHARE ? h0 + CZK_HEADS_SHARE : h1;
        const int nh = (int)(h1 - h0);
        const float *k = c->kc + g * c->cap * hd, *v = c->vc + g * c->cap * hd;
        __m256 mx8[CZK_HEADS_SHARE];
        float inv[CZK_HEADS_SHARE];
        for (int e = 0; e < nh; e++) mx8[e] = _mm256_set1_ps(-INFINITY);
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) { /* eight keys, every head's eight scores */
            for (int e = 0; e < nh; e++) {
                const float *q = c->q + (h0 + e) * hd;
                __m256 acc[8];
                for (int r = 0; r < 8; r++) {
                    const float *kj = k + (j + r) * hd;
                    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kj));
                    for (int i = 8; i < hd; i += 8)
                        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + i),
                                                           _mm256_loadu_ps(kj + i)));
                    acc[r] = a;
                }
                const __m256 t = _mm256_mul_ps(czk_hsum8x8(acc), _mm256_set1_ps(scale));
                _mm256_storeu_ps(c->scores + (h0 + e) * j1 + j, t);
                mx8[e] = _mm256_max_ps(mx8[e], t);
            }
        }
        for (int e = 0; e < nh; e++) {
            const float *q = c->q + (h0 + e) * hd;
            float *s = c->scores + (h0 + e) * j1;
            float mt[8];
            _mm256_storeu_ps(mt, mx8[e]);
            float mx = mt[0];
            for (int i = 1; i < 8; i++) mx = mt[i] > mx ? mt[i] : mx;
            for (int64_t jj = j; jj < j1; jj++) {
                const float *kj = k + jj * hd;
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kj));
                for (int i = 8; i < hd; i += 8)
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + i),
                                                           _mm256_loadu_ps(kj + i)));
                const float t = czk_hsum8(acc) * scale;
                s[jj] = t;
                mx = t > mx ? t : mx;
            }
            inv[e] = czk_softmax8_avx2(s, j0, j1, mx);
        }
        /* p.v a block of values at a time, every head's partial sums kept in its output
         * between blocks: four lanes-of-eight at a time (independent chains), the rest
         * eight by eight. */
        for (int64_t b0 = j0; b0 < j1; b0 += CZK_PV_BLOCK) {
            const int64_t b1 = b0 + CZK_PV_BLOCK < j1 ? b0 + CZK_PV_BLOCK : j1;
            for (int e = 0; e < nh; e++) {
                const float *s = c->scores + (h0 + e) * j1;
                float *o = c->out + (h0 + e) * hd;
                const float iv = inv[e];
                int i = 0;
                for (; i + 32 <= hd; i += 32) {
                    __m256 a0, a1, a2, a3;
                    if (b0 == j0) {
                        a0 = a1 = a2 = a3 = _mm256_setzero_ps();
                    } else {
                        a0 = _mm256_loadu_ps(o + i), a1 = _mm256_loadu_ps(o + i + 8);
                        a2 = _mm256_loadu_ps(o + i + 16), a3 = _mm256_loadu_ps(o + i + 24);
                    }
                    for (int64_t jj = b0; jj < b1; jj++) {
                        const __m256 pj = _mm256_set1_ps(s[jj] * iv);
                        const float *vj = v + jj * hd + i;
                        a0 = _mm256_add_ps(a0, _mm256_mul_ps(pj, _mm256_loadu_ps(vj)));
                        a1 = _mm256_add_ps(a1, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 8)));
                        a2 = _mm256_add_ps(a2, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 16)));
                        a3 = _mm256_add_ps(a3, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 24)));
                    }
                    _mm256_storeu_ps(o + i, a0);
                    _mm256_storeu_ps(o + i + 8, a1);
                    _mm256_storeu_ps(o + i + 16, a2);
                    _mm256_storeu_ps(o + i + 24, a3);
                }
                for (; i < hd; i += 8) {
                    __m256 acc = b0 == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + i);
                    for (int64_t jj = b0; jj < b1; jj++)
                        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(s[jj] * iv),
                                                               _mm256_loadu_ps(v + jj * hd + i)));
                    _mm256_storeu_ps(o + i, acc);
                }
            }
        }
        h0 = h1;
    }
}
#endif

static void czk_heads_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_heads_ctx *c = (czk_heads_ctx *)ctx_;
#if CZK_X86
    if (czk_level() >= 1 && c->a->head_dim % 8 == 0) {
        czk_heads_avx2(c, t0, t1);
        return;
    }
#endif
    const int hd = c->a->head_dim, groups = c->a->n_heads / c->a->n_kv;
    for (int64_t h = t0; h < t1; h++) {
        const int64_t g = h / groups;
        const float *q = c->q + h * hd;
        const float *k = c->kc + g * c->cap * hd, *v = c->vc + g * c->cap * hd;
        float *s = c->scores + h * c->end;
        float mx = -INFINITY;
        for (int64_t j = c->start; j < c->end; j++) {
            /* eight independent partial sums: the compiler vectorises them */
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float *kj = k + j * hd;
            int i = 0;
            for (; i + 8 <= hd; i += 8)
                for (int l = 0; l < 8; l++) acc[l] = acc[l] + q[i + l] * kj[i + l];
            float t = czk_tree8(acc);
            for (; i < hd; i++) t += q[i] * kj[i];
            t *= c->a->scale;
            s[j] = t;
            mx = t > mx ? t : mx;
        }
        const float inv = czk_softmax_span(s, c->start, c->end, mx);
        float *o = c->out + h * hd;
        for (int i = 0; i < hd; i++) o[i] = 0.0f;
        for (int64_t j = c->start; j < c->end; j++) {
            const float pj = s[j] * inv;
            for (int i = 0; i < hd; i++) o[i] += pj * v[j * hd + i];
        }
    }
}

typedef struct {
    const czk_mat *m;
    const float *x;
    const czk_xq *ax;
    float *tmp;
    float *h;
    const float *bias;
} czk_res_ctx;

static void czk_res_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_res_ctx *c = (czk_res_ctx *)ctx_;
    czk_rows(c->m, c->x, c->ax, c->tmp, t0, t1);
    if (c->bias) /* (o_proj(out) + bias), then the residual add: numpy's order */
        for (int64_t r = t0; r < t1; r++) c->h[r] += c->tmp[r] + c->bias[r];
    else
        for (int64_t r = t0; r < t1; r++) c->h[r] += c->tmp[r];
}

static void czk_rope(float *v, int heads, int hd, int rot, const float *cs, const float *sn) {
    const int half = rot / 2;
    for (int h = 0; h < heads; h++) {
        float *x = v + (int64_t)h * hd;
        for (int i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[half + i];
            x[i] = x1 * cs[i] - x2 * sn[i];
            x[half + i] = x2 * cs[i] + x1 * sn[i];
        }
    }
}

/* Scratch bytes of czk_attn_decode for hidden H up to `length` positions. */
int64_t czk_attn_work_bytes(const czk_attn *a, int64_t H, int64_t length) {
    const int64_t nq = (int64_t)a->n_heads * a->head_dim, nkv = (int64_t)a->n_kv * a->head_dim;
    int64_t n = H + nq + 2 * nkv + nq + H + (int64_t)a->n_heads * length;
    int64_t big = H > nq ? H : nq;
    return (int64_t)sizeof(float) * n + 6 * 64 + czk_work_bytes(big);
}

/* One token's scratch in czk_attn_decode's layout (positions up to end). */
typedef struct {
    float *xn, *qkv, *att, *tmp, *scores;
    void *xqmem;
} czk_attn_buf;

static void czk_attn_bufs(const czk_attn *a, int64_t H, int64_t end, void *work,
                          czk_attn_buf *b) {
    const int64_t nq = (int64_t)a->n_heads * a->head_dim, nkv = (int64_t)a->n_kv * a->head_dim;
    b->xn = (float *)czk_align(work);
    b->qkv = (float *)czk_align(b->xn + H);
    b->att = (float *)czk_align(b->qkv + nq + 2 * nkv);
    b->tmp = (float *)czk_align(b->att + nq);
    b->scores = (float *)czk_align(b->tmp + H);
    b->xqmem = czk_align(b->scores + (int64_t)a->n_heads * end);
}

/* The shape and format checks of czk_attn_decode (the position's aside). */
static int czk_attn_ok(const czk_attn *a, int64_t H) {
    const int hd = a->head_dim;
    const int64_t nq = (int64_t)a->n_heads * hd, nkv = (int64_t)a->n_kv * hd;
    if (a->n_kv <= 0 || a->n_heads % a->n_kv) return 0;
    if (a->rot <= 0 || a->rot > hd || a->rot % 2) return 0;
    if (a->qk_norm < 0 || a->qk_norm > 2 || (a->qk_norm && (!a->q_norm || !a->k_norm))) return 0;
    const czk_mat *ms[4] = {&a->q, &a->k, &a->v, &a->o};
    for (int i = 0; i < 4; i++)
        if (!czk_check(ms[i])) return 0;
    if (a->q.rows != nq || a->k.rows != nkv || a->v.rows != nkv || a->q.cols != H ||
        a->k.cols != H || a->v.cols != H || a->o.rows != H || a->o.cols != nq)
        return 0;
    if ((a->q.kind == CZK_Q) != (a->k.kind == CZK_Q) || (a->q.kind == CZK_Q) != (a->v.kind == CZK_Q))
        return 0;
    if (a->q.kind == CZK_Q && (a->k.group != a->q.group || a->v.group != a->q.group)) return 0;
    return 1;
}

/* x = rmsnorm(h) * in_norm into b->xn, quantized into *ax (bound at b->xqmem)
 * for quantized q/k/v. */
static void czk_attn_in(const czk_attn *a, int64_t H, const float *h, const czk_attn_buf *b,
                        czk_xq *ax) {
    czk_rms(h, a->in_norm, H, a->eps, b->xn);
    if (a->q.kind == CZK_Q) {
        czk_xq_bind(ax, b->xqmem, H);
        czk_quantize(b->xn, ax);
        czk_xq_groups(ax, a->q.group);
    }
}

/* From the q/k/v products in b->qkv: biases, q/k norms, clip, RoPE, the cache
 * write at pos, the heads' attention into b->att (over p's threads by head),
 * then (quantized o) att quantized into *ax (bound at b->xqmem). */
static void czk_attn_mid(czk_pool *p, const czk_attn *a, const czk_attn_buf *b, float *kc,
                         float *vc, int64_t cap, int64_t pos, int64_t window, const float *cs,
                         const float *sn, czk_xq *ax) {
    const int hd = a->head_dim;
    const int64_t nq = (int64_t)a->n_heads * hd, nkv = (int64_t)a->n_kv * hd;
    const int64_t end = pos + 1;
    float *qkv = b->qkv;
    float *q = qkv, *k = qkv + nq, *v = qkv + nq + nkv;
    if (a->qb)
        for (int64_t i = 0; i < nq; i++) q[i] += a->qb[i];
    if (a->kb)
        for (int64_t i = 0; i < nkv; i++) k[i] += a->kb[i];
    if (a->vb)
        for (int64_t i = 0; i < nkv; i++) v[i] += a->vb[i];
    if (a->qk_norm == 1) { /* one RMS norm over all query heads, one over all key heads */
        czk_rms(q, a->q_norm, nq, a->eps, q);
        czk_rms(k, a->k_norm, nkv, a->eps, k);
    } else if (a->qk_norm == 2) { /* each head its own RMS norm, one head_dim weight */
        for (int j = 0; j < a->n_heads; j++) {
            float *qj = q + (int64_t)j * hd;
            czk_rms(qj, a->q_norm, hd, a->eps, qj);
        }
        for (int g = 0; g < a->n_kv; g++) {
            float *kg = k + (int64_t)g * hd;
            czk_rms(kg, a->k_norm, hd, a->eps, kg);
        }
    }
    if (a->clip > 0.0f) {
        const float c = a->clip;
        for (int64_t i = 0; i < nq + 2 * nkv; i++)
            qkv[i] = qkv[i] > c ? c : (qkv[i] < -c ? -c : qkv[i]);
    }
    czk_rope(q, a->n_heads, hd, a->rot, cs, sn);
    czk_rope(k, a->n_kv, hd, a->rot, cs, sn);
    for (int g = 0; g < a->n_kv; g++) {
        memcpy(kc + ((int64_t)g * cap + pos) * hd, k + (int64_t)g * hd, sizeof(float) * hd);
        memcpy(vc + ((int64_t)g * cap + pos) * hd, v + (int64_t)g * hd, sizeof(float) * hd);
    }
    int64_t start = 0;
    if (window > 0 && end - window > 0) start = end - window;
    czk_heads_ctx hc = {a, q, kc, vc, cap, start, end, b->att, b->scores};
    czk_run(p, czk_heads_task, &hc, a->n_heads, (int64_t)a->n_heads * (end - start) * hd * 2);
    if (a->o.kind == CZK_Q) {
        czk_xq_bind(ax, b->xqmem, nq);
        czk_quantize(b->att, ax);
        czk_xq_groups(ax, a->o.group);
    }
}

/* The attention half of a decoder layer for one token at position pos:
 *   x = rmsnorm(h) * in_norm; q, k, v = x @ W.T (+ biases); q/k RMS norms
 *   (qk_norm 1: over all heads at once, as OLMoE, weights nq / nkv wide;
 *   2: each head on its own, as Qwen3-MoE, weights head_dim wide; 0: none);
 *   q, k, v clamped to [-clip, clip] (clip > 0); RoPE on q and k
 *   (cos/sin: the position's half-width tables); k, v written at pos of the
 *   layer's cache [n_kv, cap, head_dim]; grouped-query attention over the
 *   positions max(0, pos - window + 1) .. pos (window 0: all);
 *   h += o_proj(out) (+ ob, the o_proj bias, when not NULL);
 *   x_out = rmsnorm(h) * post_norm.
 * Returns 0, or -1 on inconsistent shapes. */
int czk_attn_decode(czk_pool *p, const czk_attn *a, int64_t H, float *h, float *x_out,
                    float *kc, float *vc, int64_t cap, int64_t pos, int64_t window,
                    const float *cs, const float *sn, void *work) {
    if (pos < 0 || pos >= cap || !czk_attn_ok(a, H)) return -1;
    const int64_t nq = (int64_t)a->n_heads * a->head_dim, nkv = (int64_t)a->n_kv * a->head_dim;
    czk_attn_buf b;
    czk_attn_bufs(a, H, pos + 1, work, &b);
    czk_xq ax;
    czk_attn_in(a, H, h, &b, &ax);
    czk_qkv_ctx qc = {a, {&a->q, &a->k, &a->v}, {0, nq, nq + nkv, nq + 2 * nkv}, b.xn, &ax, b.qkv};
    czk_run(p, czk_qkv_task, &qc, nq + 2 * nkv, (nq + 2 * nkv) * H);
    czk_attn_mid(p, a, &b, kc, vc, cap, pos, window, cs, sn, &ax);
    czk_res_ctx rc = {&a->o, b.att, &ax, b.tmp, h, a->ob};
    czk_run(p, czk_res_task, &rc, H, H * nq);
    czk_rms(h, a->post_norm, H, a->eps, x_out);
    return 0;
}

/* ------------------------------------------------------------ embedding row */

/* Row r of m as float32 (an embedding lookup): float kinds widened exactly,
 * quantized ones as d * q + m in float32 (the product rounded, then the sum:
 * store.quant.formats.dequantize's operations). Returns 0, or -1. */
int czk_row(const czk_mat *m, int64_t r, float *out) {
    if (!czk_check(m) || r < 0 || r >= m->rows) return -1;
    const int64_t C = m->cols;
    if (m->kind != CZK_Q) {
        for (int64_t c = 0; c < C; c++) out[c] = czk_wf(m, r * C + c);
        return 0;
    }
    const int64_t G = C / m->group, rb = C * m->bits / 8;
    const uint8_t *codes = (const uint8_t *)m->data + r * rb;
    uint8_t u[32];
    for (int64_t b = 0; b < C / 32; b++) {
        if (m->bits == 8) {
            memcpy(u, codes + 32 * b, 32);
        } else if (m->bits == 4) {
            for (int i = 0; i < 16; i++) {
                u[2 * i] = codes[16 * b + i] & 15u;
                u[2 * i + 1] = codes[16 * b + i] >> 4;
            }
        } else {
            czk_unpack32(codes + 4 * m->bits * b, m->bits, u);
        }
        const int64_t g = (32 * b) / m->group;
        const float d = czyx_h2f(m->scales[r * G + g]), mn = czyx_h2f(m->mins[r * G + g]);
        for (int i = 0; i < 32; i++) {
            const float t = d * (float)u[i];
            out[32 * b + i] = t + mn;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ routing */

/* Softmax over E router logits, the k largest (descending, ties to the lower
 * index), optionally renormalised: the operations of route_topk in base.py. */
int czk_topk(const float *logits, int E, int k, int renorm, int64_t *idx, float *w) {
    if (k <= 0 || k > E || E > 4096) return -1;
    float pr[4096];
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
        pr[e] = expf(logits[e] - mx);
        sum += pr[e];
    }
    for (int e = 0; e < E; e++) pr[e] = pr[e] / sum;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= idx[i] == e;
            if (!taken && (best < 0 || pr[e] > pr[best])) best = e;
        }
        idx[j] = best;
        w[j] = pr[best];
    }
    if (renorm) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w[j];
        for (int j = 0; j < k; j++) w[j] = w[j] / s;
    }
    return 0;
}

/* ------------------------------------------------------------ batched decode
 *
 * One call per layer for B sequences' decode tokens (a continuous-batching
 * step). Attention (and routing): groups of up to four consecutive
 * sequences, each group one task of the pool, every weight row of its
 * products read once for the group (czk_attn_shared), the rest of each
 * sequence's block computed by the one-token code on that task's thread (no
 * nested pool use), with its own KV cache, position and scratch (`work + b *
 * wstride`). The head: each sequence one task running the one-token entry
 * points. With B == 1 the sequence's own loops use the pool instead (the
 * one-token calls as the engine makes them). The MoE layer:
 * expert by expert, each held expert's rows read once for the tokens that
 * chose it, split over the pool by output rows, every (token, expert)
 * product with czk_moe's operations. A sequence's results are therefore
 * exactly the one-token calls' with any pool and any batch: every product's
 * rows and every head are computed with the same instructions whatever the
 * thread split and the other inputs of a multi-input kernel (see the
 * header), so a token's logits are bit-identical whether it decodes alone or
 * in any batch. Each returns 0, or -1 when any sequence's call refused its
 * arguments. */

static void czk_rows_nv(const czk_mat *m, const float *const *xs, const czk_xq *av, int nv,
                        float *const *ys, int64_t r0, int64_t r1);

typedef struct {
    const czk_attn *a;
    const czk_mat *m;
    int64_t H, E, k, V;
    int renorm;
    float *h, *x, *y, *logits;
    const float *norm;
    float eps;
    const uintptr_t *kp, *vp;
    int64_t pstride;
    const int64_t *cap, *pos;
    int64_t window;
    const float *cs, *sn;
    int64_t rope_w, rope_rows;
    const czk_mat *table;
    const int64_t *slot_of, *idx;
    const float *w;
    int64_t *idx_out;
    float *w_out;
    float *resid;
    uint8_t *work;
    int64_t wstride;
    czk_pool *inner;
    int fail;
} czk_batch_ctx;

static inline void czk_batch_failed(czk_batch_ctx *c) {
    __atomic_store_n(&c->fail, 1, __ATOMIC_RELAXED);
}

static void czk_attn_b_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_batch_ctx *c = (czk_batch_ctx *)ctx_;
    for (int64_t b = t0; b < t1; b++) {
        const int64_t pos = c->pos[b];
        if (pos < 0 || pos >= c->rope_rows) {
            czk_batch_failed(c);
            continue;
        }
        const int64_t off = pos * c->rope_w;
        float *kc = (float *)c->kp[b * c->pstride], *vc = (float *)c->vp[b * c->pstride];
        float *x = c->x + b * c->H;
        void *wk = c->work + b * c->wstride;
        if (!kc || !vc || czk_attn_decode(c->inner, c->a, c->H, c->h + b * c->H, x, kc, vc,
                                          c->cap[b], pos, c->window, c->cs + off, c->sn + off,
                                          wk)) {
            czk_batch_failed(c);
            continue;
        }
        if (!c->m) continue;
        float *lg = c->logits + b * c->E;
        if (czk_matvec(c->inner, c->m, x, lg, wk) ||
            czk_topk(lg, (int)c->E, (int)c->k, c->renorm, c->idx_out + b * c->k,
                     c->w_out + b * c->k))
            czk_batch_failed(c);
    }
}

/* The shared-weight path of czk_attn_decode_batch: the tokens in groups of up
 * to four consecutive ones, each group one pool task; within a group every
 * product (q/k/v, o, router) reads each weight row once for the group's tokens
 * (czk_rows_nv: float kinds two inputs per load, quantized ones czk_matmul's
 * multi-input kernels; each (row, input) exactly as czk_rows computes it), and
 * each token's norms, RoPE, cache write, heads, residual and routing are
 * czk_attn_decode's, czk_matvec's and czk_topk's. One pool dispatch per layer,
 * as the per-token path: the products of this call are small, a dispatch per
 * product would cost more than the weight reads it saves. Token b's scratch is
 * czk_attn_decode's layout at work + b * wstride (wstride a multiple of 64, so
 * every token's buffers sit at the same offsets and a product's outputs are a
 * fixed stride apart, as the multi-input kernels write them). */
typedef struct {
    czk_batch_ctx *c;
    int B, G;
} czk_shared_ctx;

/* czk_rows_nv over all of m's rows, split over pool p (NULL: this thread); a
 * row's result does not depend on the split. */
typedef struct {
    const czk_mat *m;
    const float *const *xs;
    const czk_xq *av;
    int nv;
    float *const *ys;
} czk_rows_nv_ctx;

static void czk_rows_nv_task(void *ctx_, int64_t r0, int64_t r1) {
    const czk_rows_nv_ctx *s = (const czk_rows_nv_ctx *)ctx_;
    czk_rows_nv(s->m, s->xs, s->av, s->nv, s->ys, r0, r1);
}

static void czk_rows_nv_on(czk_pool *p, const czk_mat *m, const float *const *xs,
                           const czk_xq *av, int nv, float *const *ys) {
    if (!p) {
        czk_rows_nv(m, xs, av, nv, ys, 0, m->rows);
        return;
    }
    czk_rows_nv_ctx s = {m, xs, av, nv, ys};
    czk_run(p, czk_rows_nv_task, &s, m->rows, m->rows * m->cols * nv);
}

static void czk_attn_group(czk_batch_ctx *c, int b0, int nv, czk_pool *p) {
    const czk_attn *a = c->a;
    const int64_t H = c->H;
    const int64_t nq = (int64_t)a->n_heads * a->head_dim, nkv = (int64_t)a->n_kv * a->head_dim;
    czk_attn_buf buf[4];
    czk_xq ax[4];
    const float *xs[4];
    float *ys[4];
    for (int v = 0; v < nv; v++) {
        const int64_t b = b0 + v;
        czk_attn_bufs(a, H, c->pos[b] + 1, c->work + b * c->wstride, &buf[v]);
        czk_attn_in(a, H, c->h + b * H, &buf[v], &ax[v]);
    }
    const czk_mat *qkv[3] = {&a->q, &a->k, &a->v};
    const int64_t off[3] = {0, nq, nq + nkv};
    for (int i = 0; i < 3; i++) {
        for (int v = 0; v < nv; v++) {
            xs[v] = buf[v].xn;
            ys[v] = buf[v].qkv + off[i];
        }
        czk_rows_nv_on(p, qkv[i], xs, ax, nv, ys);
    }
    for (int v = 0; v < nv; v++) {
        const int64_t b = b0 + v, pos = c->pos[b], roff = pos * c->rope_w;
        czk_attn_mid(NULL, a, &buf[v], (float *)c->kp[b * c->pstride],
                     (float *)c->vp[b * c->pstride], c->cap[b], pos, c->window, c->cs + roff,
                     c->sn + roff, &ax[v]);
        xs[v] = buf[v].att;
        ys[v] = buf[v].tmp;
    }
    czk_rows_nv_on(p, &a->o, xs, ax, nv, ys);
    for (int v = 0; v < nv; v++) { /* czk_res_task's residual add, then the post norm */
        float *h = c->h + (int64_t)(b0 + v) * H;
        const float *tmp = buf[v].tmp;
        if (a->ob)
            for (int64_t r = 0; r < H; r++) h[r] += tmp[r] + a->ob[r];
        else
            for (int64_t r = 0; r < H; r++) h[r] += tmp[r];
        czk_rms(h, a->post_norm, H, a->eps, c->x + (int64_t)(b0 + v) * H);
    }
    if (!c->m) return;
    const czk_mat *r = c->m; /* the routing: czk_matvec's products, then czk_topk */
    for (int v = 0; v < nv; v++) {
        const int64_t b = b0 + v;
        xs[v] = c->x + b * H;
        ys[v] = c->logits + b * c->E;
        if (r->kind == CZK_Q) {
            czk_xq_bind(&ax[v], buf[v].xqmem, H);
            czk_quantize(xs[v], &ax[v]);
            czk_xq_groups(&ax[v], r->group);
        }
    }
    czk_rows_nv_on(p, r, xs, ax, nv, ys);
    for (int v = 0; v < nv; v++) {
        const int64_t b = b0 + v;
        if (czk_topk(ys[v], (int)c->E, (int)c->k, c->renorm, c->idx_out + b * c->k,
                     c->w_out + b * c->k))
            czk_batch_failed(c);
    }
}

static void czk_attn_g_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_shared_ctx *s = (czk_shared_ctx *)ctx_;
    for (int64_t g = t0; g < t1; g++) {
        const int b0 = (int)g * s->G;
        czk_attn_group(s->c, b0, s->B - b0 < s->G ? s->B - b0 : s->G, NULL);
    }
}

static int czk_attn_shared(czk_pool *p, czk_batch_ctx *c, int B, int64_t macs) {
    if (!czk_attn_ok(c->a, c->H)) return -1;
    for (int b = 0; b < B; b++) {
        const int64_t pos = c->pos[b];
        if (pos < 0 || pos >= c->rope_rows || pos >= c->cap[b] || !c->kp[b * c->pstride] ||
            !c->vp[b * c->pstride])
            return -1;
    }
    /* groups of G tokens, G as large as four allows while every thread has one */
    const int n = czk_pool_size(p);
    int G = (B + n - 1) / n;
    G = G < 1 ? 1 : (G > 4 ? 4 : G);
    czk_shared_ctx s = {c, B, G};
    czk_run(p, czk_attn_g_task, &s, (B + G - 1) / G, macs);
    return c->fail ? -1 : 0;
}

/* The context of the batched attention entry points from their common arguments
 * (see czk_attn_decode_batch); -1 for a router they cannot use. */
static int czk_attn_ctx(czk_batch_ctx *c, const czk_attn *a, int64_t H, float *h, float *x_out,
                        const uintptr_t *kp, const uintptr_t *vp, int64_t pstride,
                        const int64_t *cap, const int64_t *pos, int64_t window, const float *cs,
                        const float *sn, int64_t rope_w, int64_t rope_rows,
                        const czk_mat *router, int k, int renorm, float *logits, int64_t *idx,
                        float *w, void *work, int64_t wstride) {
    if (router && (!czk_check(router) || router->cols != H || router->rows > 4096 || k <= 0 ||
                   k > router->rows))
        return -1;
    memset(c, 0, sizeof *c);
    c->a = a;
    c->H = H;
    c->h = h;
    c->x = x_out;
    c->kp = kp;
    c->vp = vp;
    c->pstride = pstride;
    c->cap = cap;
    c->pos = pos;
    c->window = window;
    c->cs = cs;
    c->sn = sn;
    c->rope_w = rope_w;
    c->rope_rows = rope_rows;
    c->m = router;
    c->E = router ? router->rows : 0;
    c->k = k;
    c->renorm = renorm;
    c->logits = logits;
    c->idx_out = idx;
    c->w_out = w;
    c->work = (uint8_t *)work;
    c->wstride = wstride;
    return 0;
}

/* The attention block (czk_attn_decode) for B tokens, then (router not NULL)
 * each token's softmax top-k routing on its x_out row (czk_matvec, czk_topk):
 * token b's residual stream h[b] (in place) and x_out[b] rows of H floats, its
 * layer caches kp[b * pstride] / vp[b * pstride] (float32 [n_kv, cap[b],
 * head_dim]) and position pos[b]; the rope tables are [rope_rows, rope_w] (row
 * pos[b]); router logits into logits [B, E] (E = router rows), the routes
 * into idx / w [B, k]. work: wstride >= czk_attn_work_bytes(a, H, max pos + 1)
 * bytes per token (which covers the routing's czk_work_bytes(H)). With B > 1
 * and wstride a multiple of 64, the q/k/v, o and router products read each
 * weight row once for a group of up to four tokens (czk_attn_shared); otherwise each token
 * is one pool task running czk_attn_decode. Either way each token's results
 * are czk_attn_decode's (then czk_matvec's and czk_topk's) bit for bit. */
int czk_attn_decode_batch(czk_pool *p, const czk_attn *a, int64_t H, int B, float *h,
                          float *x_out, const uintptr_t *kp, const uintptr_t *vp,
                          int64_t pstride, const int64_t *cap, const int64_t *pos,
                          int64_t window, const float *cs, const float *sn, int64_t rope_w,
                          int64_t rope_rows, const czk_mat *router, int k, int renorm,
                          float *logits, int64_t *idx, float *w, void *work, int64_t wstride) {
    if (B <= 0 || rope_w <= 0 || wstride <= 0) return -1;
    czk_batch_ctx c;
    if (czk_attn_ctx(&c, a, H, h, x_out, kp, vp, pstride, cap, pos, window, cs, sn, rope_w,
                     rope_rows, router, k, renorm, logits, idx, w, work, wstride))
        return -1;
    c.inner = B == 1 ? p : NULL;
    const int64_t nq = (int64_t)a->n_heads * a->head_dim, nkv = (int64_t)a->n_kv * a->head_dim;
    int64_t macs = (int64_t)B * ((nq + 2 * nkv) * H + H * nq + c.E * H);
    for (int b = 0; b < B; b++) macs += 2 * nq * (pos[b] + 1);
    if (B > 1 && wstride % 64 == 0 && czk_attn_share) return czk_attn_shared(p, &c, B, macs);
    if (B == 1)
        czk_attn_b_task(&c, 0, 1);
    else
        czk_run(p, czk_attn_b_task, &c, B, macs);
    return c.fail ? -1 : 0;
}

/* czk_attn_decode_batch's work for rows in waves of groups: group g is rows
 * [groups[g], groups[g + 1]) (at most four), wave j is groups [waves[j],
 * waves[j + 1]), and the waves run one after another (each row's h, x_out,
 * KV pointers, cap, pos, logits, routes and scratch at its row, as there). A
 * group's rows share each weight row of their products (czk_attn_group) and
 * take their cache writes and attention in row order, so a group may hold
 * consecutive tokens of one sequence (a prompt's, each attending to the ones
 * before it); the groups of a wave run as pool tasks and must name different
 * caches. A wave of one group runs on this thread, its products split over
 * the pool (one row: czk_attn_decode's own threading). Every token's results
 * are czk_attn_decode's (then czk_matvec's and czk_topk's) bit for bit. */
typedef struct {
    czk_batch_ctx *c;
    const int64_t *groups;
} czk_groups_ctx;

static void czk_attn_groups_task(void *ctx_, int64_t g0, int64_t g1) {
    czk_groups_ctx *s = (czk_groups_ctx *)ctx_;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = s->groups[g], r1 = s->groups[g + 1];
        if (czk_attn_share)
            czk_attn_group(s->c, (int)r0, (int)(r1 - r0), NULL);
        else /* (the benchmarks' switch: each row alone, in order) */
            czk_attn_b_task(s->c, r0, r1);
    }
}

int czk_attn_decode_waves(czk_pool *p, const czk_attn *a, int64_t H, int nwaves,
                          const int64_t *waves, const int64_t *groups, float *h, float *x_out,
                          const uintptr_t *kp, const uintptr_t *vp, int64_t pstride,
                          const int64_t *cap, const int64_t *pos, int64_t window,
                          const float *cs, const float *sn, int64_t rope_w, int64_t rope_rows,
                          const czk_mat *router, int k, int renorm, float *logits, int64_t *idx,
                          float *w, void *work, int64_t wstride) {
    if (nwaves <= 0 || waves[0] != 0 || rope_w <= 0 || wstride <= 0 || wstride % 64 ||
        groups[0] != 0 || !czk_attn_ok(a, H))
        return -1;
    for (int j = 0; j < nwaves; j++)
        if (waves[j + 1] <= waves[j]) return -1;
    const int64_t ng = waves[nwaves];
    for (int64_t g = 0; g < ng; g++) {
        const int64_t n = groups[g + 1] - groups[g];
        if (n < 1 || n > 4) return -1;
    }
    const int64_t B = groups[ng];
    if (B > INT32_MAX) return -1;
    for (int64_t b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= rope_rows || pos[b] >= cap[b] || !kp[b * pstride] ||
            !vp[b * pstride])
            return -1;
    czk_batch_ctx c;
    if (czk_attn_ctx(&c, a, H, h, x_out, kp, vp, pstride, cap, pos, window, cs, sn, rope_w,
                     rope_rows, router, k, renorm, logits, idx, w, work, wstride))
        return -1;
    const int64_t nq = (int64_t)a->n_heads * a->head_dim, nkv = (int64_t)a->n_kv * a->head_dim;
    czk_groups_ctx s = {&c, groups};
    for (int j = 0; j < nwaves && !c.fail; j++) {
        const int64_t g0 = waves[j], g1 = waves[j + 1];
        if (g1 - g0 == 1) {
            const int64_t r0 = groups[g0], n = groups[g1] - r0;
            if (n == 1 || !czk_attn_share) { /* czk_attn_decode_batch's B == 1 path */
                c.inner = p;
                czk_attn_b_task(&c, r0, r0 + n);
                c.inner = NULL;
            } else {
                czk_attn_group(&c, (int)r0, (int)n, p);
            }
            continue;
        }
        int64_t macs = (groups[g1] - groups[g0]) * ((nq + 2 * nkv) * H + H * nq + c.E * H);
        for (int64_t b = groups[g0]; b < groups[g1]; b++) macs += 2 * nq * (pos[b] + 1);
        s.groups = groups + g0;
        czk_run(p, czk_attn_groups_task, &s, g1 - g0, macs);
    }
    return c.fail ? -1 : 0;
}

/* The distinct values of idx[0 .. n) (expert ids in [0, E)), those with
 * resident[e] >= 0 first, each part in ascending order, into out; returns their
 * count, or -1 for an id outside [0, E) or E > 4096. (A step's union of routed experts in
 * the order the cache acquires them: its hits before its misses.) */
int czk_union(const int64_t *idx, int64_t n, const int32_t *resident, int E, int64_t *out) {
    if (E <= 0 || E > 4096) return -1;
    uint8_t seen[4096 / 8];
    memset(seen, 0, (size_t)(E + 7) / 8);
    for (int64_t i = 0; i < n; i++) {
        const int64_t e = idx[i];
        if (e < 0 || e >= E) return -1;
        seen[e >> 3] |= (uint8_t)(1u << (e & 7));
    }
    int m = 0;
    for (int part = 0; part < 2; part++)
        for (int e = 0; e < E; e++)
            if ((seen[e >> 3] >> (e & 7) & 1) && ((resident[e] >= 0) == (part == 0)))
                out[m++] = e;
    return m;
}

/* Rows [r0, r1) of a float-kind m against nv <= 2 inputs xs[v] into ys[v]: each
 * (row, input) exactly as czk_rows computes it (czk_rows_f_rb's operations at
 * the AVX2 level, czk_rows_f_portable's below it), the row's weights loaded
 * (and widened) once for both inputs. */
#if CZK_X86
CZK_AVX2 static inline __attribute__((always_inline)) void czk_rows_f2_kind(
    const czk_mat *m, const float *const *xs, int nv, float *const *ys, int64_t r0, int64_t r1,
    const int kind) {
    const int64_t C = m->cols;
    czk_mat mk = *m;
    mk.kind = kind;
    for (int64_t r = r0; r < r1; r++) {
        __m256 a0[2], a1[2], a2[2], a3[2];
        for (int v = 0; v < 2; v++) a0[v] = a1[v] = a2[v] = a3[v] = _mm256_setzero_ps();
        const int64_t base = r * C;
        int64_t c = 0;
        for (; c + 32 <= C; c += 32) {
            const __m256 w0 = czk_load8(&mk, base + c), w1 = czk_load8(&mk, base + c + 8);
            const __m256 w2 = czk_load8(&mk, base + c + 16), w3 = czk_load8(&mk, base + c + 24);
            for (int v = 0; v < nv; v++) {
                const float *x = xs[v];
                a0[v] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + c), a0[v]);
                a1[v] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + c + 8), a1[v]);
                a2[v] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + c + 16), a2[v]);
                a3[v] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + c + 24), a3[v]);
            }
        }
        for (; c + 8 <= C; c += 8) {
            const __m256 w0 = czk_load8(&mk, base + c);
            for (int v = 0; v < nv; v++)
                a0[v] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[v] + c), a0[v]);
        }
        for (int v = 0; v < nv; v++) {
            float t = czk_hsum8(_mm256_add_ps(_mm256_add_ps(a0[v], a1[v]), _mm256_add_ps(a2[v], a3[v])));
            for (int64_t cc = c; cc < C; cc++) t += czk_wf(&mk, base + cc) * xs[v][cc];
            ys[v][r] = t;
        }
    }
}

CZK_AVX2 static void czk_rows_f2_avx2(const czk_mat *m, const float *const *xs, int nv,
                                      float *const *ys, int64_t r0, int64_t r1) {
    if (m->kind == CZK_F32)
        czk_rows_f2_kind(m, xs, nv, ys, r0, r1, CZK_F32);
    else if (m->kind == CZK_F16)
        czk_rows_f2_kind(m, xs, nv, ys, r0, r1, CZK_F16);
    else
        czk_rows_f2_kind(m, xs, nv, ys, r0, r1, CZK_BF16);
}
#endif

/* Rows [r0, r1) of m against nv <= 4 inputs, each (row, input) exactly as czk_rows
 * computes it: float kinds from xs[v] (pairs of inputs share the weight loads),
 * quantized ones from av[v] (czk_matmul's kernels: the codes loaded once for the
 * nv inputs). Output v row r at ys[v][r]. */
static void czk_rows_nv(const czk_mat *m, const float *const *xs, const czk_xq *av, int nv,
                        float *const *ys, int64_t r0, int64_t r1) {
    if (m->kind != CZK_Q) {
#if CZK_X86
        if (czk_level() >= 1) {
            int v = 0;
            for (; v + 2 <= nv; v += 2) czk_rows_f2_avx2(m, xs + v, 2, ys + v, r0, r1);
            if (v < nv) czk_rows_f_avx2(m, xs[v], ys[v], r0, r1); /* two rows at a time */
            return;
        }
#endif
        for (int v = 0; v < nv; v++) czk_rows_f_portable(m, xs[v], ys[v], r0, r1);
        return;
    }
    /* czk_rows_qnv writes output v row r at y[v * ystride + r]: the outputs of one
     * call are at a fixed stride apart (the callers' buffers are). */
    czk_rows_qnv(m, av, nv, ys[0], nv > 1 ? ys[1] - ys[0] : 0, r0, r1);
}

/* The batched MoE layer, expert by expert: the (token, k) pairs grouped by the
 * expert they chose (pairs of one expert consecutive), each expert's gate, up
 * and down rows read once for all its pairs; every pair's products, SiLU,
 * input quantizations and the per-token weighted sum in top-k order are
 * czk_moe's operations for that token. */
typedef struct {
    const czk_mat *table;
    const int64_t *eslot;  /* [n_held] slot of each held expert */
    const int32_t *estart; /* [n_held + 1] first pair of each expert */
    const int32_t *ptok;   /* [P] token of each pair */
    int64_t H, I;
    const float *x;        /* [B, H] */
    const czk_xq *ax;      /* [G, B] quantized inputs per gate group (quantized experts) */
    const uint8_t *egrp;   /* [n_held] the gate group (row of ax) of each held expert */
    int B;
    float *act;            /* [P, I] */
    const czk_xq *aact;    /* [P] quantized activations (quantized experts) */
    float *d;              /* [P, H] */
} czk_moex_ctx;

static void czk_moex_gu_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_moex_ctx *c = (czk_moex_ctx *)ctx_;
    float gb[4 * 64], ub[4 * 64];
    for (int64_t t = t0; t < t1;) {
        const int64_t e = t / c->I, r = t % c->I;
        int64_t end = (e + 1) * c->I;
        if (end > t1) end = t1;
        if (end - t > 64) end = t + 64;
        const int64_t n = end - t;
        const czk_mat *gm = &c->table[3 * c->eslot[e]], *um = gm + 1;
        const czk_xq *axg = c->ax ? c->ax + (int64_t)c->egrp[e] * c->B : NULL;
        for (int32_t p0 = c->estart[e]; p0 < c->estart[e + 1]; p0 += 4) {
            const int nv = c->estart[e + 1] - p0 < 4 ? c->estart[e + 1] - p0 : 4;
            const float *xs[4];
            float *gs[4], *us[4];
            czk_xq av[4];
            for (int v = 0; v < nv; v++) {
                const int32_t b = c->ptok[p0 + v];
                xs[v] = c->x + b * c->H;
                if (axg) av[v] = axg[b];
                gs[v] = gb + 64 * v - r;
                us[v] = ub + 64 * v - r;
            }
            czk_rows_nv(gm, xs, av, nv, gs, r, r + n);
            czk_rows_nv(um, xs, av, nv, us, r, r + n);
            for (int v = 0; v < nv; v++) {
                float *act = c->act + (int64_t)(p0 + v) * c->I;
                const float *g = gb + 64 * v, *u = ub + 64 * v;
                for (int64_t i = 0; i < n; i++) {
                    const float gv = g[i];
                    act[r + i] = gv / (1.0f + expf(-gv)) * u[i];
                }
            }
        }
        t = end;
    }
}

static void czk_moex_down_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_moex_ctx *c = (czk_moex_ctx *)ctx_;
    for (int64_t t = t0; t < t1;) {
        const int64_t e = t / c->H, r = t % c->H;
        int64_t end = (e + 1) * c->H;
        if (end > t1) end = t1;
        const czk_mat *dm = &c->table[3 * c->eslot[e] + 2];
        for (int32_t p0 = c->estart[e]; p0 < c->estart[e + 1]; p0 += 4) {
            const int nv = c->estart[e + 1] - p0 < 4 ? c->estart[e + 1] - p0 : 4;
            const float *xs[4];
            float *ds[4];
            for (int v = 0; v < nv; v++) {
                xs[v] = c->act + (int64_t)(p0 + v) * c->I;
                ds[v] = c->d + (int64_t)(p0 + v) * c->H;
            }
            czk_rows_nv(dm, xs, c->aact ? c->aact + p0 : NULL, nv, ds, r, r + (end - t));
        }
        t = end;
    }
}

/* Scratch bytes of czk_moe_batch for B rows of top-k over experts of hidden H and
 * intermediate I (held experts at most B * k). */
int64_t czk_moe_batch_work_bytes(int B, int k, int64_t H, int64_t I) {
    const int64_t P = (int64_t)B * k;
    return 4 * (4 * P + 2) + 8 * P + 4 * P * (I + H) + P + 64 +
           (int64_t)sizeof(czk_xq) * (CZK_MAXG * B + P) +
           B * ((int64_t)czk_xq_bytes(H) + czk_gsum_bytes(H) + 64) +
           P * ((int64_t)czk_xq_bytes(I) + 64) + 8 * 64;
}

/* The MoE layer (czk_moe) for B rows, its experts held at slots: row b's
 * experts are idx[b * k .. + k] (ids in [0, E)) in that order, expert
 * experts[j] (j < n_held, distinct) at slot slots[j] of the cache's descriptor
 * table of n_slots slots; weights w[b * k ..]; x, y [B, H]; then (resid not
 * NULL) resid[b] += y[b]. Each row's y is czk_moe's for that row alone; the
 * products run expert by expert (each expert's rows read once for the rows
 * that chose it), split over the pool by output rows. A row naming an expert
 * not held, a slot outside [0, n_slots) or inconsistent shapes or formats
 * refuse the call (nothing is computed). work: nwork >=
 * czk_moe_batch_work_bytes(B, k, H, I) bytes.
 *
 * dpairs not NULL ([B * k, H], the caller's): the layer in parts, when the
 * rows' experts do not fit the cache at once. Each call computes the pairs of
 * the experts it holds (a row's other experts are skipped, not refused) into
 * dpairs at the pair's index (b * k + j) and sets pdone[b * k + j] ([B * k],
 * the caller's, zero before the first part); the call with finish set then
 * forms every row's weighted sum from dpairs, in top-k order, and refuses
 * (-1, y and resid untouched) unless every pair was computed by one of the
 * calls. The same operations as one call. */
int czk_moe_batch(czk_pool *p, int B, int k, const czk_mat *table, int64_t n_slots,
                  int E, const int64_t *experts, const int64_t *slots, int n_held,
                  const int64_t *idx, const float *w, const float *x, float *y, float *resid,
                  int64_t H, void *work, int64_t nwork, float *dpairs, uint8_t *pdone,
                  int finish) {
    if (B <= 0 || k <= 0 || k > CZK_MAXK || n_slots <= 0 || E <= 0 || E > 4096 ||
        n_held <= 0 || n_held > B * k || (dpairs != NULL) != (pdone != NULL))
        return -1;
    int32_t pos_of[4096]; /* held position of each expert, -1 if not held */
    for (int e = 0; e < E; e++) pos_of[e] = -1;
    for (int j = 0; j < n_held; j++) {
        if (experts[j] < 0 || experts[j] >= E || slots[j] < 0 || slots[j] >= n_slots ||
            pos_of[experts[j]] >= 0)
            return -1;
        pos_of[experts[j]] = j;
    }
    for (int64_t i = 0; i < (int64_t)B * k; i++)
        if (idx[i] < 0 || idx[i] >= E || (pos_of[idx[i]] < 0 && !dpairs)) return -1;
    /* The checks czk_moe makes, over every held expert. */
    const czk_mat *f = &table[3 * slots[0]];
    const int64_t I = f->rows;
    const int kind0 = f->kind;
    if (!czk_experts_ok(table, slots, n_held, H)) return -1;
    if (nwork < czk_moe_batch_work_bytes(B, k, H, I)) return -1;
    const int quant = kind0 == CZK_Q;
    const int64_t P = (int64_t)B * k;
    /* Pairs grouped by held expert (in held order), tokens in order within each. */
    uint8_t *m = (uint8_t *)czk_align(work);
    int32_t *estart = (int32_t *)m, *ptok = estart + n_held + 1, *pidx = ptok + P;
    int32_t *pout = pidx + P;
    int64_t *eslot = (int64_t *)czk_align(pout + P);
    float *act = (float *)czk_align(eslot + n_held);
    float *d = (float *)czk_align(act + P * I);
    uint8_t *egrp = (uint8_t *)(d + P * H);
    czk_xq *ax = (czk_xq *)czk_align(egrp + n_held);
    czk_xq *aact = ax + CZK_MAXG * B;
    m = (uint8_t *)czk_align(aact + P);
    for (int j = 0; j <= n_held; j++) estart[j] = 0;
    for (int64_t i = 0; i < P; i++)
        if (pos_of[idx[i]] >= 0) estart[pos_of[idx[i]] + 1]++;
    for (int j = 0; j < n_held; j++) {
        estart[j + 1] += estart[j];
        eslot[j] = slots[j];
    }
    int32_t fill[4096];
    for (int j = 0; j < n_held; j++) fill[j] = estart[j];
    for (int64_t i = 0; i < P; i++) {
        if (pos_of[idx[i]] < 0) continue; /* (dpairs: another call holds its expert) */
        const int32_t q = fill[pos_of[idx[i]]]++;
        ptok[q] = (int32_t)(i / k);
        pidx[i] = q;
        pout[q] = (int32_t)i;
    }
    if (quant) {
        /* Row b's input quantized once; ax[g * B + b] its sums for held gate group g. */
        int64_t groups[CZK_MAXG];
        int ng = 0;
        for (int j = 0; j < n_held; j++)
            egrp[j] = (uint8_t)czk_group_index(groups, &ng, table[3 * slots[j]].group);
        for (int b = 0; b < B; b++) {
            czk_xq_bind(&ax[b], m, H);
            m = (uint8_t *)czk_align(m + czk_xq_bytes(H));
            czk_quantize(x + (int64_t)b * H, &ax[b]);
            czk_xq_groups(&ax[b], groups[0]);
            for (int g = 1; g < ng; g++) {
                czk_xq *a = &ax[(int64_t)g * B + b];
                *a = ax[b];
                a->gsum = (float *)m;
                a->ggroup = 0;
                m = (uint8_t *)czk_align(m + sizeof(float) * (size_t)(ax[b].npad / 32));
                czk_xq_groups(a, groups[g]);
            }
        }
    }
    czk_moex_ctx c = {table, eslot, estart, ptok, H,    I, x, quant ? ax : NULL,
                      egrp,  B,     act,    NULL, d};
    czk_run(p, czk_moex_gu_task, &c, (int64_t)n_held * I, 2 * P * I * H);
    if (quant) {
        for (int j = 0; j < n_held; j++) { /* the pairs of each held expert */
            for (int64_t q = estart[j]; q < estart[j + 1]; q++) {
                czk_xq_bind(&aact[q], m, I);
                m = (uint8_t *)czk_align(m + czk_xq_bytes(I));
                czk_quantize(act + q * I, &aact[q]);
                czk_xq_groups(&aact[q], table[3 * slots[j] + 2].group);
            }
        }
        c.aact = aact;
    }
    czk_run(p, czk_moex_down_task, &c, (int64_t)n_held * H, P * I * H);
    if (dpairs) { /* (the multi-input kernels write d at a fixed stride: copied after) */
        for (int64_t q = 0; q < estart[n_held]; q++) {
            memcpy(dpairs + (int64_t)pout[q] * H, d + q * H, (size_t)H * sizeof(float));
            pdone[pout[q]] = 1;
        }
        if (!finish) return 0;
        for (int64_t i = 0; i < P; i++)
            if (!pdone[i]) return -1; /* a pair no part computed: refuse, not a stale sum */
    }
    /* Each row's weighted sum in its top-k order (czk_moe_down_task's operations). */
    for (int b = 0; b < B; b++) {
        float *yb = y + (int64_t)b * H;
        for (int j = 0; j < k; j++) {
            const int64_t pj = (int64_t)b * k + j; /* the pair */
            const float wj = w[pj];
            const float *dj = dpairs ? dpairs + pj * H : d + (int64_t)pidx[pj] * H;
            if (j == 0)
                for (int64_t i = 0; i < H; i++) yb[i] = wj * dj[i];
            else
                for (int64_t i = 0; i < H; i++) yb[i] += wj * dj[i];
        }
        if (resid) {
            float *h = resid + (int64_t)b * H;
            for (int64_t i = 0; i < H; i++) h[i] += yb[i];
        }
    }
    return 0;
}

static void czk_head_b_task(void *ctx_, int64_t t0, int64_t t1) {
    czk_batch_ctx *c = (czk_batch_ctx *)ctx_;
    for (int64_t b = t0; b < t1; b++) {
        uint8_t *wk = c->work + b * c->wstride;
        float *xn = (float *)czk_align(wk);
        czk_rms(c->h + b * c->H, c->norm, c->H, c->eps, xn);
        if (czk_matvec(c->inner, c->m, xn, c->logits + b * c->V, czk_align(xn + c->H)))
            czk_batch_failed(c);
    }
}

/* The head for B rows: logits[b] = lm_head @ (rmsnorm(h[b]) * norm), as czk_rmsnorm
 * then czk_matvec. work: wstride >= 4 * H + 128 + czk_work_bytes(H) bytes per row. */
int czk_head_batch(czk_pool *p, int B, const float *h, int64_t H, const float *norm, float eps,
                   const czk_mat *lm_head, float *logits, void *work, int64_t wstride) {
    if (B <= 0 || !czk_check(lm_head) || lm_head->cols != H) return -1;
    czk_batch_ctx c;
    memset(&c, 0, sizeof c);
    c.h = (float *)h;
    c.H = H;
    c.norm = norm;
    c.eps = eps;
    c.m = lm_head;
    c.V = lm_head->rows;
    c.logits = logits;
    c.work = (uint8_t *)work;
    c.wstride = wstride;
    c.inner = B == 1 ? p : NULL;
    if (B == 1)
        czk_head_b_task(&c, 0, 1);
    else
        czk_run(p, czk_head_b_task, &c, B, (int64_t)B * lm_head->rows * H);
    return c.fail ? -1 : 0;
}

/* Rows tokens[0 .. B) of m into out [B, cols] (czk_row each: an embedding lookup). */
int czk_rows_take(const czk_mat *m, int B, const int64_t *tokens, float *out) {
    if (!czk_check(m)) return -1;
    for (int b = 0; b < B; b++)
        if (czk_row(m, tokens[b], out + (int64_t)b * m->cols)) return -1;
    return 0;
}

/* Gated DeltaNet (Qwen3-Next linear attention): T tokens of one layer, token by token, in
 * place on the layer's recurrent state (decode is T = 1: O(1) work per token, whatever the
 * length reached).
 *
 * mixed [T, C]: the q | k | v projections before the convolution (C = 2 * nk * dk + nv * dv);
 * b, a [T, nv]: the beta and decay inputs; conv_w [C, K]: the depthwise causal convolution;
 * conv_state [K - 1, C]: the K - 1 previous inputs, oldest first; a_log, dt_bias [nv];
 * state [nv, dk, dv]; out [T, nv, dv]. Value head h reads key head h / (nv / nk).
 *
 * Per token, as transformers' torch_recurrent_gated_delta_rule after causal_conv1d_update:
 *   y = silu(sum_j w[:, j] * window[j])   (window: the K - 1 previous inputs, then this one)
 *   q, k = l2norm(q), l2norm(k) (eps 1e-6 inside the root); q *= dk ** -0.5
 *   beta = sigmoid(b); g = -exp(a_log) * softplus(a + dt_bias) (softplus = x above 20)
 *   S *= exp(g); delta = (v - k S) * beta; S += k (x) delta; o = q S
 * Every sum runs in index order (the numpy reference's order). The value heads of a token
 * are spread over the pool (p may be NULL): each head is one thread's, so the result does
 * not depend on the thread count. Returns -1 on bad sizes or when its scratch cannot be
 * allocated. */
typedef struct {
    int64_t key, t;
    int nv, dk, dv, rep;
    const float *y, *b, *a, *a_log, *dt_bias;
    float *state, *out, *scratch; /* scratch: 2 * dv floats per head */
} czk_gdn_ctx;

static void czk_gdn_heads(void *vc, int64_t h0, int64_t h1) {
    const czk_gdn_ctx *c = (const czk_gdn_ctx *)vc;
    const int dk = c->dk, dv = c->dv, nv = c->nv;
    const int64_t t = c->t;
    for (int64_t h = h0; h < h1; h++) {
        const float *q = c->y + (h / c->rep) * dk, *k = c->y + c->key + (h / c->rep) * dk;
        const float *v = c->y + 2 * c->key + h * dv;
        float *mem = c->scratch + h * 2 * dv, *delta = mem + dv;
        const float beta = 1.0f / (1.0f + expf(-c->b[t * nv + h]));
        const float sp = c->a[t * nv + h] + c->dt_bias[h];
        const float soft = sp > 20.0f ? sp : log1pf(expf(sp));
        const float decay = expf(-expf(c->a_log[h]) * soft);
        float *S = c->state + h * dk * dv, *o = c->out + (t * nv + h) * (int64_t)dv;
        /* Two passes over the state (it is the memory traffic): decay and k S, then the
         * update and q S; each row is used while it is in cache. */
        for (int j = 0; j < dv; j++) mem[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (int64_t)i * dv;
            const float ki = k[i];
            for (int j = 0; j < dv; j++) {
                row[j] = row[j] * decay;
                mem[j] += row[j] * ki;
            }
        }
        for (int j = 0; j < dv; j++) delta[j] = (v[j] - mem[j]) * beta;
        for (int j = 0; j < dv; j++) o[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (int64_t)i * dv;
            const float ki = k[i], qi = q[i];
            for (int j = 0; j < dv; j++) {
                row[j] += ki * delta[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

int czk_gdn(czk_pool *p, int64_t T, int nk, int nv, int dk, int dv, int K, const float *mixed,
            const float *b, const float *a, const float *conv_w, const float *a_log,
            const float *dt_bias, float *conv_state, float *state, float *out) {
    if (T < 0 || nk <= 0 || nv <= 0 || dk <= 0 || dv <= 0 || K <= 0 || nv % nk) return -1;
    const int64_t key = (int64_t)nk * dk, C = 2 * key + (int64_t)nv * dv;
    float *y = (float *)malloc(sizeof(float) * (size_t)(C + 2 * (int64_t)nv * dv));
    if (!y) return -1;
    czk_gdn_ctx ctx = {key, 0, nv, dk, dv, nv / nk, y, b, a, a_log, dt_bias, state, out, y + C};
    const float scale = 1.0f / sqrtf((float)dk);
    for (int64_t t = 0; t < T; t++) {
        const float *x = mixed + t * C;
        for (int64_t c = 0; c < C; c++) {
            const float *w = conv_w + c * K;
            float acc = 0.0f;
            for (int j = 0; j < K - 1; j++) acc += w[j] * conv_state[(int64_t)j * C + c];
            acc += w[K - 1] * x[c];
            y[c] = acc / (1.0f + expf(-acc));
        }
        if (K > 1) {
            memmove(conv_state, conv_state + C, sizeof(float) * (size_t)((K - 2) * C));
            memcpy(conv_state + (int64_t)(K - 2) * C, x, sizeof(float) * (size_t)C);
        }
        for (int hk = 0; hk < 2 * nk; hk++) { /* l2norm each query head, then each key head */
            float *v = y + (int64_t)hk * dk, ss = 0.0f;
            for (int i = 0; i < dk; i++) ss += v[i] * v[i];
            const float inv = 1.0f / sqrtf(ss + 1e-6f);
            for (int i = 0; i < dk; i++) v[i] = v[i] * inv;
        }
        for (int64_t i = 0; i < key; i++) y[i] = y[i] * scale;
        ctx.t = t;
        czk_run(p, czk_gdn_heads, &ctx, nv, 4 * (int64_t)nv * dk * dv);
    }
    free(y);
    return 0;
}

/* A depthwise causal convolution with bias, then silu, over T tokens, in place on its state
 * (Jamba's Mamba layers). x [T, C] with row stride xstride, w [C, K], bias [C] or NULL,
 * conv_state [K - 1, C] (the previous inputs, oldest first), out [T, C]:
 *   out[t, c] = silu(sum_j w[c, j] * window[j][c] + bias[c]), sums in j order. */
int czk_conv_silu(int64_t T, int64_t C, int K, const float *x, int64_t xstride,
                  const float *w, const float *bias, float *conv_state, float *out) {
    if (T < 0 || C <= 0 || K <= 0 || xstride < C) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * xstride;
        float *o = out + t * C;
        for (int64_t c = 0; c < C; c++) {
            const float *wc = w + c * K;
            float acc = 0.0f;
            for (int j = 0; j < K - 1; j++) acc += wc[j] * conv_state[(int64_t)j * C + c];
            acc += wc[K - 1] * xt[c];
            if (bias) acc += bias[c];
            o[c] = acc / (1.0f + expf(-acc));
        }
        if (K > 1) {
            memmove(conv_state, conv_state + C, sizeof(float) * (size_t)((K - 2) * C));
            memcpy(conv_state + (int64_t)(K - 2) * C, xt, sizeof(float) * (size_t)C);
        }
    }
    return 0;
}

/* Mamba's selective scan over T tokens, in place on state [I, N] (transformers'
 * mamba_selective_state_update per token). x, dt [T, I] (dt before its bias and softplus),
 * dt_bias, D [I], neg_a [I, N] (-exp(A_log), a layer constant), B, Cm [T, N], z [T, I] with
 * row stride zstride, out [T, I]:
 *   d = softplus(dt + dt_bias); s[c, n] = s[c, n] * exp(d * neg_a[c, n]) + d * B[n] * x[c]
 *   out[c] = (sum_n s[c, n] * Cm[n] + x[c] * D[c]) * silu(z[c])            (sums in n order)
 * The channels are spread over the pool (p may be NULL), each one thread's. */
typedef struct {
    int64_t t, I, zstride;
    int N;
    const float *x, *dt, *dt_bias, *neg_a, *B, *Cm, *D, *z;
    float *state, *out;
} czk_scan_ctx;

static void czk_scan_channels(void *vc, int64_t c0, int64_t c1) {
    const czk_scan_ctx *c = (const czk_scan_ctx *)vc;
    const int64_t t = c->t, I = c->I;
    const int N = c->N;
    const float *xt = c->x + t * I, *dtt = c->dt + t * I, *Bt = c->B + t * N;
    const float *Ct = c->Cm + t * N, *zt = c->z + t * c->zstride;
    float *o = c->out + t * I;
    for (int64_t ch = c0; ch < c1; ch++) {
        const float sp = dtt[ch] + c->dt_bias[ch];
        const float d = sp > 20.0f ? sp : log1pf(expf(sp));
        float *s = c->state + ch * N;
        const float *na = c->neg_a + ch * N;
        float acc = 0.0f;
        for (int n = 0; n < N; n++) {
            const float dA = expf(d * na[n]);
            s[n] = s[n] * dA + (d * Bt[n]) * xt[ch];
            acc += s[n] * Ct[n];
        }
        const float zc = zt[ch];
        o[ch] = (acc + xt[ch] * c->D[ch]) * (zc / (1.0f + expf(-zc)));
    }
}

int czk_mamba_scan(czk_pool *p, int64_t T, int64_t I, int N, const float *x, const float *dt,
                   const float *dt_bias, const float *neg_a, const float *B, const float *Cm,
                   const float *D, const float *z, int64_t zstride, float *state, float *out) {
    if (T < 0 || I <= 0 || N <= 0 || zstride < I) return -1;
    czk_scan_ctx c = {0, I, zstride, N, x, dt, dt_bias, neg_a, B, Cm, D, z, state, out};
    for (int64_t t = 0; t < T; t++) {
        c.t = t;
        czk_run(p, czk_scan_channels, &c, I, 8 * I * N);
    }
    return 0;
}
