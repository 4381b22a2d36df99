/* reduce.c: the element-wise kernels collectives reduce with (reduce, scale, divide, half <-> float32 conversion)
 * and the public dtype / reduction-op tables. */
#include "t3d_internal.h"
#include "t3d_half.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define T3D_HAVE_F16C_PATH 1
#endif

/* ---------- public tables ---------- */

/* The rows are t3d_types.def's, which the C tests read too. */
enum dtype_kind { KIND_INT, KIND_BOOL, KIND_HALF, KIND_FLOAT, KIND_COMPLEX };

static const struct {
  const char *name;
  size_t size;
  enum dtype_kind kind;
} dtypes[T3D_DTYPE_COUNT] = {
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND) [ENUM] = {NAME, SIZE, KIND_##KIND},
#include "t3d_types.def"
#undef T3D_DTYPE
};

static const char *const redop_names[T3D_REDOP_COUNT] = {
#define T3D_REDOP(ENUM, NAME) [ENUM] = NAME,
#include "t3d_types.def"
#undef T3D_REDOP
};

/* Each list has one row per enum value, in enum order, and each dtype's size is that of its components. */
enum {
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND) DTYPE_ROW_##ENUM,
#include "t3d_types.def"
#undef T3D_DTYPE
  DTYPE_ROWS
};
enum {
#define T3D_REDOP(ENUM, NAME) REDOP_ROW_##ENUM,
#include "t3d_types.def"
#undef T3D_REDOP
  REDOP_ROWS
};
_Static_assert((int)DTYPE_ROWS == (int)T3D_DTYPE_COUNT, "t3d_types.def: one T3D_DTYPE row per t3d_dtype_t");
_Static_assert((int)REDOP_ROWS == (int)T3D_REDOP_COUNT, "t3d_types.def: one T3D_REDOP row per t3d_redop_t");
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND)                                                       \
  _Static_assert((int)DTYPE_ROW_##ENUM == (int)ENUM, "t3d_types.def: " NAME " out of enum order");            \
  _Static_assert((COMPS) * sizeof(CTYPE) == (SIZE), "t3d_types.def: " NAME "'s size is not its components'");
#define T3D_REDOP(ENUM, NAME)                                                                                 \
  _Static_assert((int)REDOP_ROW_##ENUM == (int)ENUM, "t3d_types.def: " NAME " out of enum order");
#include "t3d_types.def"
#undef T3D_DTYPE
#undef T3D_REDOP

/* Compared as unsigned so that a negative value cast into the enum is caught too. */
static bool valid_dtype(t3d_dtype_t dt) { return (unsigned)dt < (unsigned)T3D_DTYPE_COUNT; }

size_t t3d_dtype_size(t3d_dtype_t dtype) { return valid_dtype(dtype) ? dtypes[dtype].size : 0; }

const char *t3d_dtype_name(t3d_dtype_t dtype) { return valid_dtype(dtype) ? dtypes[dtype].name : "invalid"; }

const char *t3d_redop_name(t3d_redop_t op) {
  return (unsigned)op < (unsigned)T3D_REDOP_COUNT ? redop_names[op] : "invalid";
}

static bool is_integer(t3d_dtype_t dt) { return dtypes[dt].kind == KIND_INT; }

static bool is_complex(t3d_dtype_t dt) { return dtypes[dt].kind == KIND_COMPLEX; }

t3d_result_t t3d_redop_supported(t3d_redop_t op, t3d_dtype_t dtype) {
  if ((unsigned)op >= (unsigned)T3D_REDOP_COUNT || !valid_dtype(dtype)) return T3D_ERR_INVALID_ARG;
  switch (op) {
    case T3D_BAND: case T3D_BOR: case T3D_BXOR:
      return (is_integer(dtype) || dtype == T3D_BOOL) ? T3D_OK : T3D_ERR_UNSUPPORTED;
    case T3D_PROD: case T3D_MIN: case T3D_MAX:
      return is_complex(dtype) ? T3D_ERR_UNSUPPORTED : T3D_OK;
    case T3D_AVG: case T3D_PREMUL_SUM:
      return dtype == T3D_BOOL ? T3D_ERR_UNSUPPORTED : T3D_OK;
    default:
      return T3D_OK;
  }
}

/* ---------- half <-> float32 ---------- */

/* The scalar conversions are t3d_half.h's, shared with the kernels library, the tests and the benchmarks; the
 * float16 pair is also exported (non-static) so that the unit tests can check the portable path even where F16C is
 * used. */
float t3d__f16_bits_to_float(uint16_t h);
uint16_t t3d__float_to_f16_bits(float f);

float t3d__f16_bits_to_float(uint16_t h) { return t3d__f16_to_f32(h); }

uint16_t t3d__float_to_f16_bits(float f) { return t3d__f32_to_f16(f); }

#ifdef T3D_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) static size_t f16_to_float_f16c(float *dst, const uint16_t *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  return i;
}

__attribute__((target("avx,f16c"))) static size_t float_to_f16_f16c(uint16_t *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(void *)(dst + i), h);
  }
  return i;
}

static bool have_f16c(void) {
  static int cached = -1; /* a benign race: every thread computes the same answer */
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v < 0) {
    __builtin_cpu_init();
    v = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  }
  return v != 0;
}
#endif

void t3d__half_to_float(float *dst, const void *src, size_t n, t3d_dtype_t half_dt) {
  const uint16_t *s = (const uint16_t *)src;
  size_t i = 0;
  if (half_dt == T3D_BFLOAT16) {
    for (; i < n; i++) dst[i] = t3d__bf16_to_f32(s[i]);
    return;
  }
#ifdef T3D_HAVE_F16C_PATH
  if (have_f16c()) i = f16_to_float_f16c(dst, s, n);
#endif
  for (; i < n; i++) dst[i] = t3d__f16_to_f32(s[i]);
}

void t3d__float_to_half(void *dst, const float *src, size_t n, t3d_dtype_t half_dt) {
  uint16_t *d = (uint16_t *)dst;
  size_t i = 0;
  if (half_dt == T3D_BFLOAT16) {
    for (; i < n; i++) d[i] = t3d__f32_to_bf16(src[i]);
    return;
  }
#ifdef T3D_HAVE_F16C_PATH
  if (have_f16c()) i = float_to_f16_f16c(d, src, n);
#endif
  for (; i < n; i++) d[i] = t3d__f32_to_f16(src[i]);
}

/* ---------- reduce ---------- */

/* The main loop works on fixed blocks: GCC's default -O2 cost model only vectorises loops whose trip count is a
 * known multiple of the vector width, which the inner loop is. */
#define BLOCK 32

#define DEFINE_BINARY(name, T, EXPR)                                                       \
  static void name(T *restrict d, const T *restrict s, size_t n) {                         \
    size_t i = 0;                                                                          \
    for (; i + BLOCK <= n; i += BLOCK) {                                                   \
      for (size_t j = 0; j < BLOCK; j++) {                                                 \
        T a = d[i + j], b = s[i + j];                                                      \
        d[i + j] = (T)(EXPR);                                                              \
      }                                                                                    \
    }                                                                                      \
    for (; i < n; i++) {                                                                   \
      T a = d[i], b = s[i];                                                                \
      d[i] = (T)(EXPR);                                                                    \
    }                                                                                      \
  }

/* Wider vectors where the CPU has them; the float kernels are compute-light enough that this matters only when
 * the data is in cache, but it costs nothing. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLOAT_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define FLOAT_KERNEL
#endif

#define DEFINE_FLOAT_BINARY(name, T, EXPR)                                                 \
  FLOAT_KERNEL static void name(T *restrict d, const T *restrict s, size_t n) {            \
    size_t i = 0;                                                                          \
    for (; i + BLOCK <= n; i += BLOCK) {                                                   \
      for (size_t j = 0; j < BLOCK; j++) {                                                 \
        T a = d[i + j], b = s[i + j];                                                      \
        d[i + j] = (EXPR);                                                                 \
      }                                                                                    \
    }                                                                                      \
    for (; i < n; i++) {                                                                   \
      T a = d[i], b = s[i];                                                                \
      d[i] = (EXPR);                                                                       \
    }                                                                                      \
  }

/* Integer SUM, PROD and bit operations run on the unsigned type of the same width: wrap-around is then defined,
 * and two's complement makes the bits identical to the signed result. MIN / MAX need the signed order. */
#define DEFINE_INT_FAMILY(U, S, UT, ST)                                                    \
  DEFINE_BINARY(sum_##U, UT, a + b)                                                        \
  DEFINE_BINARY(prod_##U, UT, a * b)                                                       \
  DEFINE_BINARY(band_##U, UT, a & b)                                                       \
  DEFINE_BINARY(bor_##U, UT, a | b)                                                        \
  DEFINE_BINARY(bxor_##U, UT, a ^ b)                                                       \
  DEFINE_BINARY(min_##S, ST, b < a ? b : a)                                                \
  DEFINE_BINARY(max_##S, ST, b > a ? b : a)

DEFINE_INT_FAMILY(u8, i8, uint8_t, int8_t)
DEFINE_INT_FAMILY(u32, i32, uint32_t, int32_t)
DEFINE_INT_FAMILY(u64, i64, uint64_t, int64_t)
DEFINE_BINARY(min_u8, uint8_t, b < a ? b : a)
DEFINE_BINARY(max_u8, uint8_t, b > a ? b : a)

/* Bool is 0/1 but a caller's byte may hold any nonzero value: normalise on the way. */
DEFINE_BINARY(lor_b, uint8_t, (a | b) != 0)
DEFINE_BINARY(land_b, uint8_t, (a != 0) & (b != 0))
DEFINE_BINARY(lxor_b, uint8_t, (a != 0) ^ (b != 0))

/* MIN / MAX propagate NaN (like torch.minimum): b wins when it is NaN, a stays when it is. */
#define DEFINE_FLOAT_FAMILY(F, T)                                                          \
  DEFINE_FLOAT_BINARY(sum_##F, T, a + b)                                                   \
  DEFINE_FLOAT_BINARY(prod_##F, T, a * b)                                                  \
  DEFINE_FLOAT_BINARY(min_##F, T, (b < a || b != b) ? b : a)                               \
  DEFINE_FLOAT_BINARY(max_##F, T, (b > a || b != b) ? b : a)

DEFINE_FLOAT_FAMILY(f32, float)
DEFINE_FLOAT_FAMILY(f64, double)

#define DEFINE_COMPLEX_PROD(name, T)                                                       \
  static void name(T *restrict d, const T *restrict s, size_t n) {                         \
    for (size_t i = 0; i < n; i++) {                                                       \
      T ar = d[2 * i], ai = d[2 * i + 1], br = s[2 * i], bi = s[2 * i + 1];                \
      d[2 * i] = ar * br - ai * bi;                                                        \
      d[2 * i + 1] = ar * bi + ai * br;                                                    \
    }                                                                                      \
  }
DEFINE_COMPLEX_PROD(cprod_f32, float)
DEFINE_COMPLEX_PROD(cprod_f64, double)

/* Converts a block at a time through float32 on the stack: halves are reduced in float32 and rounded once. */
#define HALF_TILE 256

static void reduce_half(void *dst, const void *src, size_t n, t3d_dtype_t dt, t3d_redop_t op) {
  float a[HALF_TILE], b[HALF_TILE];
  uint16_t *d = (uint16_t *)dst;
  const uint16_t *s = (const uint16_t *)src;
  for (size_t i = 0; i < n; i += HALF_TILE) {
    size_t m = n - i < HALF_TILE ? n - i : HALF_TILE;
    t3d__half_to_float(a, d + i, m, dt);
    t3d__half_to_float(b, s + i, m, dt);
    t3d__reduce(a, b, m, T3D_FLOAT32, op);
    t3d__float_to_half(d + i, a, m, dt);
  }
}

void t3d__reduce(void *dst, const void *src, size_t n, t3d_dtype_t dt, t3d_redop_t op) {
  if (n == 0) return;
  switch (dt) {
    case T3D_INT8:
    case T3D_UINT8:
      switch (op) {
        case T3D_SUM: sum_u8(dst, src, n); return;
        case T3D_PROD: prod_u8(dst, src, n); return;
        case T3D_MIN: if (dt == T3D_INT8) min_i8(dst, src, n); else min_u8(dst, src, n); return;
        case T3D_MAX: if (dt == T3D_INT8) max_i8(dst, src, n); else max_u8(dst, src, n); return;
        case T3D_BAND: band_u8(dst, src, n); return;
        case T3D_BOR: bor_u8(dst, src, n); return;
        case T3D_BXOR: bxor_u8(dst, src, n); return;
        default: break;
      }
      break;
    case T3D_INT32:
      switch (op) {
        case T3D_SUM: sum_u32(dst, src, n); return;
        case T3D_PROD: prod_u32(dst, src, n); return;
        case T3D_MIN: min_i32(dst, src, n); return;
        case T3D_MAX: max_i32(dst, src, n); return;
        case T3D_BAND: band_u32(dst, src, n); return;
        case T3D_BOR: bor_u32(dst, src, n); return;
        case T3D_BXOR: bxor_u32(dst, src, n); return;
        default: break;
      }
      break;
    case T3D_INT64:
      switch (op) {
        case T3D_SUM: sum_u64(dst, src, n); return;
        case T3D_PROD: prod_u64(dst, src, n); return;
        case T3D_MIN: min_i64(dst, src, n); return;
        case T3D_MAX: max_i64(dst, src, n); return;
        case T3D_BAND: band_u64(dst, src, n); return;
        case T3D_BOR: bor_u64(dst, src, n); return;
        case T3D_BXOR: bxor_u64(dst, src, n); return;
        default: break;
      }
      break;
    case T3D_BOOL:
      switch (op) {
        case T3D_SUM: case T3D_MAX: case T3D_BOR: lor_b(dst, src, n); return;
        case T3D_PROD: case T3D_MIN: case T3D_BAND: land_b(dst, src, n); return;
        case T3D_BXOR: lxor_b(dst, src, n); return;
        default: break;
      }
      break;
    case T3D_FLOAT32:
      switch (op) {
        case T3D_SUM: sum_f32(dst, src, n); return;
        case T3D_PROD: prod_f32(dst, src, n); return;
        case T3D_MIN: min_f32(dst, src, n); return;
        case T3D_MAX: max_f32(dst, src, n); return;
        default: break;
      }
      break;
    case T3D_FLOAT64:
      switch (op) {
        case T3D_SUM: sum_f64(dst, src, n); return;
        case T3D_PROD: prod_f64(dst, src, n); return;
        case T3D_MIN: min_f64(dst, src, n); return;
        case T3D_MAX: max_f64(dst, src, n); return;
        default: break;
      }
      break;
    case T3D_COMPLEX64:
      if (op == T3D_SUM) { sum_f32(dst, src, 2 * n); return; }
      if (op == T3D_PROD) { cprod_f32(dst, src, n); return; }
      break;
    case T3D_COMPLEX128:
      if (op == T3D_SUM) { sum_f64(dst, src, 2 * n); return; }
      if (op == T3D_PROD) { cprod_f64(dst, src, n); return; }
      break;
    case T3D_FLOAT16:
    case T3D_BFLOAT16:
      reduce_half(dst, src, n, dt, op);
      return;
    default:
      break;
  }
  /* The front end rejects these pairs (t3d_redop_supported); reaching here is a bug in a caller. */
  T3D_WARN("t3d__reduce: unsupported op %s on %s ignored", t3d_redop_name(op), t3d_dtype_name(dt));
}

/* ---------- scale and divide ---------- */

/* Double -> integer in [lo, hi] without the undefined behaviour of an out-of-range cast:
 * truncate toward zero, saturate, NaN -> 0. */
static int64_t sat_trunc_signed(double v, int64_t lo, int64_t hi) {
  if (v != v) return 0;
  if (v <= (double)lo) return lo;
  if (v >= (double)hi) return hi;
  return (int64_t)v;
}

/* Scales with exact integer arithmetic when s is a whole number (the common PREMUL_SUM case): wrap like any
 * integer product. Otherwise through double, truncated and saturated. */
#define SCALE_INT(T, UT, LO, HI)                                                           \
  do {                                                                                     \
    T *b = (T *)buf;                                                                       \
    if (whole) {                                                                           \
      UT k = (UT)si;                                                                       \
      for (size_t i = 0; i < n; i++) b[i] = (T)(UT)((UT)b[i] * k);                         \
    } else {                                                                               \
      for (size_t i = 0; i < n; i++) b[i] = (T)sat_trunc_signed((double)b[i] * s, LO, HI); \
    }                                                                                      \
  } while (0)

void t3d__scale(void *buf, size_t n, t3d_dtype_t dt, double s) {
  if (n == 0) return;
  /* 2^63 is the first double that does not fit: whole numbers inside (-2^63, 2^63) convert exactly. */
  bool whole = s == trunc(s) && fabs(s) < 0x1p63;
  int64_t si = whole ? (int64_t)s : 0;
  switch (dt) {
    case T3D_INT8: SCALE_INT(int8_t, uint32_t, INT8_MIN, INT8_MAX); return;
    case T3D_UINT8: SCALE_INT(uint8_t, uint32_t, 0, UINT8_MAX); return;
    case T3D_INT32: SCALE_INT(int32_t, uint32_t, INT32_MIN, INT32_MAX); return;
    case T3D_INT64: SCALE_INT(int64_t, uint64_t, INT64_MIN, INT64_MAX); return;
    case T3D_BOOL: {
      uint8_t *b = (uint8_t *)buf;
      for (size_t i = 0; i < n; i++) b[i] = (b[i] != 0) & (s != 0);
      return;
    }
    case T3D_FLOAT32: case T3D_COMPLEX64: {
      /* float32 times the scalar rounded to float32, as torch computes tensor * python_float. */
      float *b = (float *)buf, k = (float)s;
      size_t m = dt == T3D_COMPLEX64 ? 2 * n : n;
      for (size_t i = 0; i < m; i++) b[i] *= k;
      return;
    }
    case T3D_FLOAT64: case T3D_COMPLEX128: {
      double *b = (double *)buf;
      size_t m = dt == T3D_COMPLEX128 ? 2 * n : n;
      for (size_t i = 0; i < m; i++) b[i] *= s;
      return;
    }
    case T3D_FLOAT16: case T3D_BFLOAT16: {
      float t[HALF_TILE];
      uint16_t *b = (uint16_t *)buf;
      for (size_t i = 0; i < n; i += HALF_TILE) {
        size_t m = n - i < HALF_TILE ? n - i : HALF_TILE;
        t3d__half_to_float(t, b + i, m, dt);
        t3d__scale(t, m, T3D_FLOAT32, s);
        t3d__float_to_half(b + i, t, m, dt);
      }
      return;
    }
    default:
      return;
  }
}

void t3d__divide(void *buf, size_t n, t3d_dtype_t dt, int64_t d) {
  /* d is the group size; 0 would be undefined and 1 changes nothing. */
  if (n == 0 || d == 0 || d == 1) return;
  switch (dt) {
    case T3D_INT8: {
      int8_t *b = (int8_t *)buf;
      for (size_t i = 0; i < n; i++) b[i] = (int8_t)(uint8_t)(uint64_t)((int64_t)b[i] / d);
      return;
    }
    case T3D_UINT8: {
      uint8_t *b = (uint8_t *)buf;
      for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(uint64_t)((int64_t)b[i] / d);
      return;
    }
    case T3D_INT32: {
      int32_t *b = (int32_t *)buf;
      for (size_t i = 0; i < n; i++) b[i] = (int32_t)(uint32_t)(uint64_t)((int64_t)b[i] / d);
      return;
    }
    case T3D_INT64: {
      int64_t *b = (int64_t *)buf;
      if (d == -1) {
        /* INT64_MIN / -1 overflows: negate with wrap-around instead. */
        for (size_t i = 0; i < n; i++) b[i] = (int64_t)(0u - (uint64_t)b[i]);
        return;
      }
      for (size_t i = 0; i < n; i++) b[i] /= d;
      return;
    }
    case T3D_BOOL: {
      uint8_t *b = (uint8_t *)buf;
      for (size_t i = 0; i < n; i++) b[i] = (int64_t)(b[i] != 0) / d != 0;
      return;
    }
    case T3D_FLOAT32: case T3D_COMPLEX64: {
      float *b = (float *)buf, k = (float)d;
      size_t m = dt == T3D_COMPLEX64 ? 2 * n : n;
      for (size_t i = 0; i < m; i++) b[i] /= k;
      return;
    }
    case T3D_FLOAT64: case T3D_COMPLEX128: {
      double *b = (double *)buf, k = (double)d;
      size_t m = dt == T3D_COMPLEX128 ? 2 * n : n;
      for (size_t i = 0; i < m; i++) b[i] /= k;
      return;
    }
    case T3D_FLOAT16: case T3D_BFLOAT16: {
      float t[HALF_TILE];
      uint16_t *b = (uint16_t *)buf;
      for (size_t i = 0; i < n; i += HALF_TILE) {
        size_t m = n - i < HALF_TILE ? n - i : HALF_TILE;
        t3d__half_to_float(t, b + i, m, dt);
        t3d__divide(t, m, T3D_FLOAT32, d);
        t3d__float_to_half(b + i, t, m, dt);
      }
      return;
    }
    default:
      return;
  }
}

/* ---------- fingerprints (t3d_internal.h) ---------- */

void t3d__fingerprint_text(uint32_t fp, char *buf, size_t len) {
  size_t n = 0;
  buf[0] = '\0';
  if ((fp & 0x1fu) != 0) n += (size_t)snprintf(buf, len, "%s", t3d_dtype_name((t3d_dtype_t)((fp & 0x1fu) - 1)));
  if (((fp >> 5) & 0xfu) != 0 && n < len) {
    const char *op = t3d_redop_name((t3d_redop_t)(((fp >> 5) & 0xfu) - 1));
    n += (size_t)snprintf(buf + n, len - n, "%s%s", n ? ", " : "", op);
  }
  if (((fp >> 9) & 0x1ffffu) != 0 && n < len) {
    snprintf(buf + n, len - n, "%sroot %u", n ? ", " : "", ((fp >> 9) & 0x1ffffu) - 1);
  }
}
