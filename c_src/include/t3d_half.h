/* t3d_half.h: float16 and bfloat16 <-> float32, one element at a time, round to nearest even. Internal, not part of
 * the public API of t3d.h: header-only (static inline) so that libt3d (c_src/base/reduce.c: its bulk conversions are
 * these in a loop, after the F16C loop where the CPU has one), the attention kernels library (which does not link
 * libt3d), the C tests (C and C++) and the benchmarks all convert with the same code, bit for bit.
 *
 * NaNs come out quiet, with the payload kept as far as the narrower format holds it (its top bits), as IEEE 754
 * recommends and as F16C's VCVTPH2PS / VCVTPS2PH do: reduce.c's F16C path and these agree on every input.
 * Infinities stay infinities; a finite float32 too large for float16 rounds to infinity (65520 and up); float16
 * subnormals are exact both ways, and float32 values up to half of float16's least subnormal (2^-25, a tie with an
 * even zero) round to a signed zero. bfloat16 keeps float32's subnormals (no flush to zero). */
#ifndef T3D_HALF_H
#define T3D_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t t3d__f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float t3d__f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* ---------- float16 (IEEE binary16) ---------- */

static inline float t3d__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
  uint32_t man = (uint32_t)h & 0x3ffu;
  if (exp == 0) {
    /* Zero or subnormal: man * 2^-24 is exact in float32. */
    return t3d__f32_from_bits(sign | t3d__f32_bits((float)man * 0x1p-24f));
  }
  if (exp == 31) {
    /* Infinity, or a NaN that comes out quiet with its payload (VCVTPH2PS). */
    return t3d__f32_from_bits(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
  }
  return t3d__f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t t3d__f32_to_f16(float f) {
  uint32_t u = t3d__f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    /* Quiet NaN with the top of the payload, matching VCVTPS2PH. */
    return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  /* 65520 is halfway between 65504 (odd mantissa) and 65536: ties to even go to infinity. */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    /* Normal: rebias the exponent and round the 13 dropped bits to nearest even; a carry into the exponent
     * field is the correct next binade. */
    uint32_t r = a - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
  }
  /* 2^-25 and below round to zero (2^-25 itself is a tie with an even zero). */
  if (a <= 0x33000000u) return sign;
  /* Subnormal: the value in units of 2^-24 is the full mantissa shifted right by 126 - exponent (14..24). */
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;
  uint32_t r = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

/* ---------- bfloat16 (the top half of a float32) ---------- */

static inline float t3d__bf16_to_f32(uint16_t h) { return t3d__f32_from_bits((uint32_t)h << 16); }

static inline uint16_t t3d__f32_to_bf16(float f) {
  uint32_t u = t3d__f32_bits(f);
  /* Rounding could carry a NaN's payload into infinity: keep its top bits and force the quiet bit instead. */
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#endif /* T3D_HALF_H */
