"""cffi (API mode) builder of ``curves._curves``: vectorised Morton and Hilbert in C.

Discovered by ``setup.py`` (``PKG/_*_build.py``); build in place with
``python setup.py build_ext --inplace``. Without the compiled module the curves
fall back to numpy (same results, slower) and warn once.

Layout contract (see :mod:`curves.words`): coordinates are ``(n, ndim)``
row-major ``uint64``; ordinals are ``(n, w)`` big-endian ``uint64`` words.
Only ``ndim`` 2 and 3 are compiled; functions return -1 for anything else.
cffi releases the GIL around each call.
"""

from __future__ import annotations

from cffi import FFI

CDEF = """
int czyx_morton_encode(int ndim, int bits, const uint64_t *coords, size_t n,
                       uint64_t *out, int w);
int czyx_morton_decode(int ndim, int bits, const uint64_t *ords, size_t n,
                       uint64_t *out, int w);
int czyx_hilbert_encode(int ndim, int bits, const uint64_t *coords, size_t n,
                        uint64_t *out, int w);
int czyx_hilbert_decode(int ndim, int bits, const uint64_t *ords, size_t n,
                        uint64_t *out, int w);
int czyx_key_pack(int hilbert, const uint8_t *cls, const uint64_t *coords, size_t n,
                  uint8_t *out);
int czyx_key_unpack(int hilbert, const uint8_t *keys, size_t n, uint8_t *cls,
                    uint64_t *coords);
"""

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <string.h>

/* On x86-64 Linux with GCC, also compile AVX2 clones of the hot loops and let
   the loader pick one at run time (ifunc); elsewhere, plain portable code. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define CZYX_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CZYX_CLONES
#endif

/* Spread the low 32 (2-D) or 21 (3-D) bits of x so that bit i lands at bit
   ndim*i; compact is the inverse. Classic magic-mask bit twiddling. */
static inline uint64_t spread2(uint64_t x) {
    x &= 0xFFFFFFFFULL;
    x = (x | (x << 16)) & 0x0000FFFF0000FFFFULL;
    x = (x | (x << 8)) & 0x00FF00FF00FF00FFULL;
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0FULL;
    x = (x | (x << 2)) & 0x3333333333333333ULL;
    x = (x | (x << 1)) & 0x5555555555555555ULL;
    return x;
}
static inline uint64_t compact2(uint64_t x) {
    x &= 0x5555555555555555ULL;
    x = (x | (x >> 1)) & 0x3333333333333333ULL;
    x = (x | (x >> 2)) & 0x0F0F0F0F0F0F0F0FULL;
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FFULL;
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFFULL;
    x = (x | (x >> 16)) & 0x00000000FFFFFFFFULL;
    return x;
}
static inline uint64_t spread3(uint64_t x) {
    x &= 0x1FFFFFULL;
    x = (x | (x << 32)) & 0x001F00000000FFFFULL;
    x = (x | (x << 16)) & 0x001F0000FF0000FFULL;
    x = (x | (x << 8)) & 0x100F00F00F00F00FULL;
    x = (x | (x << 4)) & 0x10C30C30C30C30C3ULL;
    x = (x | (x << 2)) & 0x1249249249249249ULL;
    return x;
}
static inline uint64_t compact3(uint64_t x) {
    x &= 0x1249249249249249ULL;
    x = (x ^ (x >> 2)) & 0x10C30C30C30C30C3ULL;
    x = (x ^ (x >> 4)) & 0x100F00F00F00F00FULL;
    x = (x ^ (x >> 8)) & 0x001F0000FF0000FFULL;
    x = (x ^ (x >> 16)) & 0x001F00000000FFFFULL;
    x = (x ^ (x >> 32)) & 0x00000000001FFFFFULL;
    return x;
}

/* acc is little-endian words (acc[0] least significant), at most 4 words. */
static inline void or_at(uint64_t *acc, uint64_t piece, int pos) {
    int k = pos >> 6, s = pos & 63;
    acc[k] |= piece << s;
    if (s) acc[k + 1] |= piece >> (64 - s);
}
static inline uint64_t get_at(const uint64_t *acc, int pos) {
    int k = pos >> 6, s = pos & 63;
    uint64_t v = acc[k] >> s;
    if (s) v |= acc[k + 1] << (64 - s);
    return v;
}

/* Interleave x[0..ndim) (axis 0 most significant in each group) into the
   big-endian words out[0..w). The common cases (3-D up to 63 bits, 2-D) are
   straight-line code; 3-D at 64 bits takes the generic piece loop. */
static inline void interleave(int ndim, int bits, const uint64_t *x, uint64_t *out, int w) {
    uint64_t acc[5] = {0, 0, 0, 0, 0};
    if (ndim == 3 && bits <= 21) {
        out[0] = (spread3(x[0]) << 2) | (spread3(x[1]) << 1) | spread3(x[2]);
        return;
    } else if (ndim == 2 && bits <= 32) {
        out[0] = (spread2(x[0]) << 1) | spread2(x[1]);
        return;
    } else if (ndim == 3 && bits <= 63) {
        uint64_t p0 = (spread3(x[0]) << 2) | (spread3(x[1]) << 1) | spread3(x[2]);
        uint64_t p1 = (spread3(x[0] >> 21) << 2) | (spread3(x[1] >> 21) << 1)
                    | spread3(x[2] >> 21);
        uint64_t p2 = (spread3(x[0] >> 42) << 2) | (spread3(x[1] >> 42) << 1)
                    | spread3(x[2] >> 42);
        acc[0] = p0 | (p1 << 63);
        acc[1] = (p1 >> 1) | (p2 << 62);
        acc[2] = p2 >> 2;
    } else if (ndim == 2) {
        acc[0] = (spread2(x[0]) << 1) | spread2(x[1]);
        acc[1] = (spread2(x[0] >> 32) << 1) | spread2(x[1] >> 32);
    } else {
        for (int j = 0; j * 21 < bits; j++) {
            uint64_t piece = (spread3(x[0] >> (21 * j)) << 2)
                           | (spread3(x[1] >> (21 * j)) << 1)
                           | spread3(x[2] >> (21 * j));
            or_at(acc, piece, 63 * j);
        }
    }
    for (int k = 0; k < w; k++) out[k] = acc[w - 1 - k];
}

static inline void deinterleave(int ndim, int bits, const uint64_t *in, uint64_t *x, int w) {
    uint64_t acc[5] = {0, 0, 0, 0, 0};
    if (ndim == 3 && bits <= 21) {
        x[0] = compact3(in[0] >> 2);
        x[1] = compact3(in[0] >> 1);
        x[2] = compact3(in[0]);
        return;
    } else if (ndim == 2 && bits <= 32) {
        x[0] = compact2(in[0] >> 1);
        x[1] = compact2(in[0]);
        return;
    }
    for (int k = 0; k < w; k++) acc[k] = in[w - 1 - k];
    if (ndim == 3 && bits <= 63) {
        uint64_t p0 = acc[0];
        uint64_t p1 = (acc[0] >> 63) | (acc[1] << 1);
        uint64_t p2 = (acc[1] >> 62) | (acc[2] << 2);
        x[0] = compact3(p0 >> 2) | (compact3(p1 >> 2) << 21) | (compact3(p2 >> 2) << 42);
        x[1] = compact3(p0 >> 1) | (compact3(p1 >> 1) << 21) | (compact3(p2 >> 1) << 42);
        x[2] = compact3(p0) | (compact3(p1) << 21) | (compact3(p2) << 42);
    } else if (ndim == 2) {
        x[0] = compact2(acc[0] >> 1) | (compact2(acc[1] >> 1) << 32);
        x[1] = compact2(acc[0]) | (compact2(acc[1]) << 32);
    } else {
        x[0] = x[1] = x[2] = 0;
        for (int j = 0; j * 21 < bits; j++) {
            uint64_t piece = get_at(acc, 63 * j);
            x[0] |= compact3(piece >> 2) << (21 * j);
            x[1] |= compact3(piece >> 1) << (21 * j);
            x[2] |= compact3(piece) << (21 * j);
        }
    }
}

/* The key's case (3-D, 43..63 bits, three words) as one flat loop with
   interleaved-access groups of 3, which GCC vectorises. */
static inline void morton3_encode_w3(const uint64_t *restrict c, size_t n,
                                     uint64_t *restrict out) {
    for (size_t i = 0; i < n; i++) {
        uint64_t a = c[3 * i], b = c[3 * i + 1], d = c[3 * i + 2];
        uint64_t p0 = (spread3(a) << 2) | (spread3(b) << 1) | spread3(d);
        uint64_t p1 = (spread3(a >> 21) << 2) | (spread3(b >> 21) << 1) | spread3(d >> 21);
        uint64_t p2 = (spread3(a >> 42) << 2) | (spread3(b >> 42) << 1) | spread3(d >> 42);
        out[3 * i] = p2 >> 2;
        out[3 * i + 1] = (p1 >> 1) | (p2 << 62);
        out[3 * i + 2] = p0 | (p1 << 63);
    }
}

static inline void morton3_decode_w3(const uint64_t *restrict in, size_t n,
                                     uint64_t *restrict x) {
    for (size_t i = 0; i < n; i++) {
        uint64_t hi = in[3 * i], mid = in[3 * i + 1], lo = in[3 * i + 2];
        uint64_t p0 = lo, p1 = (lo >> 63) | (mid << 1), p2 = (mid >> 62) | (hi << 2);
        x[3 * i] = compact3(p0 >> 2) | (compact3(p1 >> 2) << 21) | (compact3(p2 >> 2) << 42);
        x[3 * i + 1] = compact3(p0 >> 1) | (compact3(p1 >> 1) << 21) | (compact3(p2 >> 1) << 42);
        x[3 * i + 2] = compact3(p0) | (compact3(p1) << 21) | (compact3(p2) << 42);
    }
}

CZYX_CLONES
int czyx_morton_encode(int ndim, int bits, const uint64_t *coords, size_t n,
                       uint64_t *out, int w) {
    if (ndim != 2 && ndim != 3) return -1;
    if (ndim == 3 && w == 3 && bits <= 63) {
        morton3_encode_w3(coords, n, out);
        return 0;
    }
    for (size_t i = 0; i < n; i++) interleave(ndim, bits, coords + i * ndim, out + i * w, w);
    return 0;
}

CZYX_CLONES
int czyx_morton_decode(int ndim, int bits, const uint64_t *ords, size_t n,
                       uint64_t *out, int w) {
    if (ndim != 2 && ndim != 3) return -1;
    if (ndim == 3 && w == 3 && bits <= 63) {
        morton3_decode_w3(ords, n, out);
        return 0;
    }
    for (size_t i = 0; i < n; i++) deinterleave(ndim, bits, ords + i * w, out + i * ndim, w);
    return 0;
}

/* Skilling, "Programming the Hilbert curve" (AIP Conf. Proc. 707, 2004):
   AxestoTranspose / TransposetoAxes, written branch-free. The transpose is then
   Morton-interleaved with axis 0 most significant, which is the convention of
   the hilbertcurve package.

   Each point's transform is one long serial dependency chain through X[0], so
   points are processed in blocks of HB in lockstep (X[axis][lane]): the lane
   loops are independent, which the compiler vectorises and the CPU overlaps. */
#define HB 64

/* t with bit j = XOR of the bits of x above j: the inverse Gray code of x >> 1.
   Replaces Skilling's loop "for Q: if (X[n-1] & Q) t ^= Q - 1". */
static inline uint64_t xor_above(uint64_t x) {
    uint64_t y = x >> 1;
    y ^= y >> 1; y ^= y >> 2; y ^= y >> 4; y ^= y >> 8; y ^= y >> 16; y ^= y >> 32;
    return y;
}

/* One exchange step of bit q for axis i (i >= 1) across the block. */
static inline void exchange(uint64_t *restrict x0, uint64_t *restrict xi, int q, size_t cnt) {
    uint64_t P = (1ULL << q) - 1;
    for (size_t k = 0; k < cnt; k++) {
        uint64_t m = 0 - ((xi[k] >> q) & 1);       /* all ones if bit q set */
        uint64_t s = (x0[k] ^ xi[k]) & P & ~m;     /* swap low bits if clear */
        x0[k] ^= (P & m) | s;
        xi[k] ^= s;
    }
}
static inline void invert0(uint64_t *restrict x0, int q, size_t cnt) {
    uint64_t P = (1ULL << q) - 1;
    for (size_t k = 0; k < cnt; k++) x0[k] ^= P & (0 - ((x0[k] >> q) & 1));
}

CZYX_CLONES
int czyx_hilbert_encode(int ndim, int bits, const uint64_t *coords, size_t n,
                        uint64_t *out, int w) {
    if (ndim != 2 && ndim != 3) return -1;
    uint64_t X[3][HB];
    uint64_t pt[3];
    for (size_t base = 0; base < n; base += HB) {
        size_t cnt = n - base < HB ? n - base : HB;
        for (size_t k = 0; k < cnt; k++)
            for (int i = 0; i < ndim; i++) X[i][k] = coords[(base + k) * ndim + i];
        for (int q = bits - 1; q >= 1; q--) {
            invert0(X[0], q, cnt);
            for (int i = 1; i < ndim; i++) exchange(X[0], X[i], q, cnt);
        }
        for (size_t k = 0; k < cnt; k++) {
            for (int i = 1; i < ndim; i++) X[i][k] ^= X[i - 1][k];
            uint64_t t = xor_above(X[ndim - 1][k]);
            for (int i = 0; i < ndim; i++) pt[i] = X[i][k] ^ t;
            interleave(ndim, bits, pt, out + (base + k) * w, w);
        }
    }
    return 0;
}

CZYX_CLONES
int czyx_hilbert_decode(int ndim, int bits, const uint64_t *ords, size_t n,
                        uint64_t *out, int w) {
    if (ndim != 2 && ndim != 3) return -1;
    uint64_t X[3][HB];
    uint64_t pt[3];
    for (size_t base = 0; base < n; base += HB) {
        size_t cnt = n - base < HB ? n - base : HB;
        for (size_t k = 0; k < cnt; k++) {
            deinterleave(ndim, bits, ords + (base + k) * w, pt, w);
            uint64_t t = pt[ndim - 1] >> 1;
            for (int i = ndim - 1; i > 0; i--) pt[i] ^= pt[i - 1];
            pt[0] ^= t;
            for (int i = 0; i < ndim; i++) X[i][k] = pt[i];
        }
        for (int q = 1; q < bits; q++) {
            for (int i = ndim - 1; i >= 1; i--) exchange(X[0], X[i], q, cnt);
            invert0(X[0], q, cnt);
        }
        for (size_t k = 0; k < cnt; k++)
            for (int i = 0; i < ndim; i++) out[(base + k) * ndim + i] = X[i][k];
    }
    return 0;
}

/* 24-byte keys: class byte, then the 3 x 61-bit ordinal as 23 big-endian bytes
   (the 192-bit big-endian word triple with its always-zero top byte replaced
   by the class). Encoded a block at a time into a stack buffer. */
#define KB 256
static inline uint64_t to_be64(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return v;
#else
    return __builtin_bswap64(v);
#endif
}

int czyx_key_pack(int hilbert, const uint8_t *cls, const uint64_t *coords, size_t n,
                  uint8_t *out) {
    uint64_t words[KB * 3];
    for (size_t base = 0; base < n; base += KB) {
        size_t cnt = n - base < KB ? n - base : KB;
        if (hilbert) czyx_hilbert_encode(3, 61, coords + base * 3, cnt, words, 3);
        else czyx_morton_encode(3, 61, coords + base * 3, cnt, words, 3);
        for (size_t k = 0; k < cnt; k++) {
            uint64_t be[3] = {to_be64(words[3 * k]), to_be64(words[3 * k + 1]),
                              to_be64(words[3 * k + 2])};
            uint8_t *dst = out + (base + k) * 24;
            memcpy(dst, be, 24);
            dst[0] = cls[base + k];
        }
    }
    return 0;
}

int czyx_key_unpack(int hilbert, const uint8_t *keys, size_t n, uint8_t *cls,
                    uint64_t *coords) {
    uint64_t words[KB * 3];
    for (size_t base = 0; base < n; base += KB) {
        size_t cnt = n - base < KB ? n - base : KB;
        for (size_t k = 0; k < cnt; k++) {
            const uint8_t *src = keys + (base + k) * 24;
            uint64_t be[3];
            memcpy(be, src, 24);
            cls[base + k] = src[0];
            words[3 * k] = to_be64(be[0]) & 0x00FFFFFFFFFFFFFFULL;
            words[3 * k + 1] = to_be64(be[1]);
            words[3 * k + 2] = to_be64(be[2]);
        }
        if (hilbert) czyx_hilbert_decode(3, 61, words, cnt, coords + base * 3, 3);
        else czyx_morton_decode(3, 61, words, cnt, coords + base * 3, 3);
    }
    return 0;
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("czyx.curves._curves", SOURCE, extra_compile_args=["-O3", "-std=c99"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
