/* IEEE half -> float, exact for every input (subnormals, inf, nan), in plain C.
 *
 * Shared by czk.c and qkernels.c (each includes it once; the build puts this
 * folder on the include path), so every kernel decodes fp16 scales the same way.
 */
#ifndef CZYX_HALF_H
#define CZYX_HALF_H

#include <stdint.h>
#include <string.h>

static inline float czyx_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t b;
    float f;
    if (exp == 0) {
        f = (float)mant * 5.9604644775390625e-08f; /* 2^-24 */
        memcpy(&b, &f, 4);
        b |= sign;
    } else if (exp == 31) {
        b = sign | 0x7f800000u | (mant << 13);
    } else {
        b = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &b, 4);
    return f;
}

#endif
