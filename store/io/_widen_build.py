"""cffi (API mode) builder of ``store._widen``: fp16/bf16 to float32 widening.

Built by ``setup.py`` (it discovers every ``_*_build.py``) or in place with
``python setup.py build_ext --inplace``. The lazy trunk widens every layer's
fp16 matrices on each use; numpy's cast does that one value at a time (~1.7
ns per value here, 94% of a warm lazy load of an fp16 matrix), while this
branch-free loop vectorises. Both are exact, and the result is the same bits
as numpy's for every one of the 65536 half values (tested exhaustively), NaN
payloads included. cffi releases the GIL around the call, so a loader thread
widens while the decoder computes.
"""

from __future__ import annotations

from cffi import FFI

CDEF = """
void czyx_f16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n);
void czyx_bf16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n);
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* One half (bits) to float bits, exactly as numpy's npy_halfbits_to_floatbits:
   normal: rebias the exponent (+112) and shift; inf/NaN: all-ones exponent and
   the significand copied (payload kept, not quieted); zero and subnormals:
   sig * 2^-24, exact in float32. Masks, not branches or ?:, so the loop
   vectorises (plain SSE2: em is signed so it can compare and convert it). */
static inline uint32_t h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    int32_t em = (int32_t)(h & 0x7fffu);
    uint32_t normal = (uint32_t)(em + 0x1c000) << 13;
    uint32_t special = 0x7f800000u | ((uint32_t)(em & 0x03ff) << 13);
    float sub = (float)em * 5.9604644775390625e-8f; /* 2^-24 */
    uint32_t subb;
    memcpy(&subb, &sub, 4);
    uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00);
    uint32_t is_normal = (0u - (uint32_t)(em >= 0x0400)) & ~is_special;
    uint32_t is_sub = ~(is_special | is_normal);
    return sign | (special & is_special) | (normal & is_normal) | (subb & is_sub);
}

void czyx_f16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = h2f(src[i]);
}

void czyx_bf16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = (uint32_t)src[i] << 16;
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("czyx.store.io._widen", SOURCE, extra_compile_args=["-O3"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=False)
