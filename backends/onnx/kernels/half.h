/* Half precision (IEEE binary16) to and from float32, for the kernels' float16 data: QLinear's
   scales and biases, Attention's KV caches. F16C where the build has it; otherwise the same
   conversions in plain C (rounding to nearest, ties to even, as F16C does). */

#ifndef EXO_HALF_H
#define EXO_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t float_to_half(float f)
{
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t abs = x & 0x7FFFFFFF;
    if (abs >= 0x7F800000) /* inf, nan (kept quiet) */
        return (uint16_t)(sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 | ((abs >> 13) & 0x3FF) : 0));
    if (abs >= 0x477FF000) /* rounds to 65520 or more: inf */
        return (uint16_t)(sign | 0x7C00);
    if (abs < 0x38800000) { /* below 2^-14: a subnormal half (or zero) */
        if (abs < 0x33000000) /* below half the smallest subnormal: zero */
            return sign;
        const uint32_t man = (abs & 0x7FFFFF) | 0x800000, shift = 126 - (abs >> 23); /* 14..24 */
        uint32_t h = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((abs >> 13) - (112u << 10)); /* rebias the exponent, keep 10 bits of mantissa */
    const uint32_t rest = abs & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
        h++; /* a carry into the exponent is right: it rounds up to the next power of two */
    return (uint16_t)(sign | h);
#endif
}

#endif
