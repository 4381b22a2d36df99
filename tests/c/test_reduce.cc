// test_reduce.cc: unit tests of the reduction kernels (c_src/reduce.c): every dtype x op against a plain reference,
// integer wrap-around, scale and divide, half <-> float32 conversion, and the public dtype / op tables.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "t3d.h"

// t3d_internal.h uses C11 atomics that C++17 cannot parse: the kernels' prototypes are repeated here.
extern "C" {
void t3d__reduce(void *dst, const void *src, size_t n, t3d_dtype_t dt, t3d_redop_t op);
void t3d__scale(void *buf, size_t n, t3d_dtype_t dt, double s);
void t3d__divide(void *buf, size_t n, t3d_dtype_t dt, int64_t d);
void t3d__half_to_float(float *dst, const void *src, size_t n, t3d_dtype_t half_dt);
void t3d__float_to_half(void *dst, const float *src, size_t n, t3d_dtype_t half_dt);
// The portable scalar float16 path, exported so that it is tested where the F16C path is the one in use.
float t3d__f16_bits_to_float(uint16_t h);
uint16_t t3d__float_to_f16_bits(float f);
}

namespace {

const t3d_redop_t kKernelOps[] = {T3D_SUM, T3D_PROD, T3D_MIN, T3D_MAX, T3D_BAND, T3D_BOR, T3D_BXOR};
// Lengths around the kernels' 32-element blocks and the half conversion's 8-wide and 256-element tiles.
const size_t kLengths[] = {0, 1, 7, 31, 32, 33, 64, 255, 256, 257, 1000 + 7};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

bool IsInt(t3d_dtype_t dt) { return dt == T3D_INT8 || dt == T3D_UINT8 || dt == T3D_INT32 || dt == T3D_INT64; }
bool IsCplx(t3d_dtype_t dt) { return dt == T3D_COMPLEX64 || dt == T3D_COMPLEX128; }

// ---------- references ----------

template <typename T>
T IntRef(T a, T b, t3d_redop_t op) {
  // Through uint64: wraps modulo 2^64 and the narrowing keeps the low bits, which is the wrapped result.
  uint64_t ua = static_cast<uint64_t>(a), ub = static_cast<uint64_t>(b);
  switch (op) {
    case T3D_SUM: return static_cast<T>(ua + ub);
    case T3D_PROD: return static_cast<T>(ua * ub);
    case T3D_MIN: return b < a ? b : a;
    case T3D_MAX: return b > a ? b : a;
    case T3D_BAND: return static_cast<T>(ua & ub);
    case T3D_BOR: return static_cast<T>(ua | ub);
    case T3D_BXOR: return static_cast<T>(ua ^ ub);
    default: return a;
  }
}

template <typename T>
T FloatRef(T a, T b, t3d_redop_t op) {
  switch (op) {
    case T3D_SUM: return a + b;
    case T3D_PROD: return a * b;
    case T3D_MIN: return std::isnan(b) ? b : (std::isnan(a) ? a : (b < a ? b : a));
    case T3D_MAX: return std::isnan(b) ? b : (std::isnan(a) ? a : (b > a ? b : a));
    default: return a;
  }
}

uint8_t BoolRef(uint8_t a, uint8_t b, t3d_redop_t op) {
  bool x = a != 0, y = b != 0;
  switch (op) {
    case T3D_SUM: case T3D_MAX: case T3D_BOR: return x || y;
    case T3D_PROD: case T3D_MIN: case T3D_BAND: return x && y;
    case T3D_BXOR: return x != y;
    default: return a;
  }
}

template <typename T>
std::vector<T> RandomInts(size_t n, std::mt19937_64 &rng) {
  std::vector<T> v(n);
  for (auto &x : v) x = static_cast<T>(rng());
  return v;
}

template <typename T>
std::vector<T> RandomFloats(size_t n, std::mt19937_64 &rng, bool specials) {
  std::uniform_real_distribution<double> dist(-100.0, 100.0);
  std::vector<T> v(n);
  for (size_t i = 0; i < n; i++) {
    v[i] = static_cast<T>(dist(rng));
    if (specials && i % 13 == 5) v[i] = std::numeric_limits<T>::quiet_NaN();
    if (specials && i % 17 == 3) v[i] = std::numeric_limits<T>::infinity();
    if (specials && i % 19 == 7) v[i] = static_cast<T>(-0.0);
  }
  return v;
}

// Bitwise equality of floats, except that any NaN equals any NaN.
template <typename T>
bool SameFloat(T a, T b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, sizeof a) == 0;
}

template <typename T>
void CheckIntOp(t3d_dtype_t dt, t3d_redop_t op, size_t n, std::mt19937_64 &rng) {
  std::vector<T> a = RandomInts<T>(n, rng), b = RandomInts<T>(n, rng), got = a;
  t3d__reduce(got.data(), b.data(), n, dt, op);
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(IntRef(a[i], b[i], op), got[i]) << t3d_dtype_name(dt) << " " << t3d_redop_name(op) << " n=" << n
                                              << " i=" << i;
}

template <typename T>
void CheckFloatOp(t3d_dtype_t dt, t3d_redop_t op, size_t n, std::mt19937_64 &rng) {
  bool specials = op == T3D_MIN || op == T3D_MAX;
  std::vector<T> a = RandomFloats<T>(n, rng, specials), b = RandomFloats<T>(n, rng, specials);
  // Specials on different indices for b so that NaN meets numbers on both sides.
  if (specials && n > 1) std::rotate(b.begin(), b.begin() + 1, b.end());
  std::vector<T> got = a;
  t3d__reduce(got.data(), b.data(), n, dt, op);
  for (size_t i = 0; i < n; i++)
    ASSERT_TRUE(SameFloat(FloatRef(a[i], b[i], op), got[i]))
        << t3d_dtype_name(dt) << " " << t3d_redop_name(op) << " n=" << n << " i=" << i << ": " << a[i] << " op "
        << b[i] << " gave " << got[i];
}

template <typename T>
void CheckComplexOp(t3d_dtype_t dt, t3d_redop_t op, size_t n, std::mt19937_64 &rng) {
  std::vector<T> a = RandomFloats<T>(2 * n, rng, false), b = RandomFloats<T>(2 * n, rng, false), got = a;
  t3d__reduce(got.data(), b.data(), n, dt, op);
  for (size_t i = 0; i < n; i++) {
    T ar = a[2 * i], ai = a[2 * i + 1], br = b[2 * i], bi = b[2 * i + 1];
    T er = op == T3D_SUM ? ar + br : ar * br - ai * bi;
    T ei = op == T3D_SUM ? ai + bi : ar * bi + ai * br;
    ASSERT_TRUE(SameFloat(er, got[2 * i]) && SameFloat(ei, got[2 * i + 1]))
        << t3d_dtype_name(dt) << " " << t3d_redop_name(op) << " n=" << n << " i=" << i;
  }
}

void CheckBoolOp(t3d_redop_t op, size_t n, std::mt19937_64 &rng) {
  std::vector<uint8_t> a(n), b(n);
  // Mostly 0/1, sometimes another nonzero byte: the kernels must still answer 0/1.
  for (size_t i = 0; i < n; i++) {
    a[i] = static_cast<uint8_t>(rng() % 2);
    b[i] = static_cast<uint8_t>(rng() % 2);
    if (i % 11 == 4) a[i] = 2;
    if (i % 7 == 2) b[i] = 0x80;
  }
  std::vector<uint8_t> got = a;
  t3d__reduce(got.data(), b.data(), n, T3D_BOOL, op);
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(BoolRef(a[i], b[i], op), got[i]) << "bool " << t3d_redop_name(op) << " n=" << n << " i=" << i;
}

void CheckHalfOp(t3d_dtype_t dt, t3d_redop_t op, size_t n, std::mt19937_64 &rng) {
  std::vector<float> fa = RandomFloats<float>(n, rng, false), fb = RandomFloats<float>(n, rng, false);
  std::vector<uint16_t> a(n), b(n), got(n);
  t3d__float_to_half(a.data(), fa.data(), n, dt);
  t3d__float_to_half(b.data(), fb.data(), n, dt);
  got = a;
  t3d__reduce(got.data(), b.data(), n, dt, op);
  for (size_t i = 0; i < n; i++) {
    // Reduced in float32, rounded once.
    float x, y, e;
    uint16_t eh;
    t3d__half_to_float(&x, &a[i], 1, dt);
    t3d__half_to_float(&y, &b[i], 1, dt);
    e = FloatRef(x, y, op);
    t3d__float_to_half(&eh, &e, 1, dt);
    ASSERT_EQ(eh, got[i]) << t3d_dtype_name(dt) << " " << t3d_redop_name(op) << " i=" << i;
  }
}

TEST(Reduce, EveryDtypeAndOp) {
  std::mt19937_64 rng(12345);
  for (int d = 0; d < T3D_DTYPE_COUNT; d++) {
    t3d_dtype_t dt = static_cast<t3d_dtype_t>(d);
    for (t3d_redop_t op : kKernelOps) {
      if (t3d_redop_supported(op, dt) != T3D_OK) continue;
      for (size_t n : kLengths) {
        SCOPED_TRACE(std::string(t3d_dtype_name(dt)) + " " + t3d_redop_name(op) + " n=" + std::to_string(n));
        switch (dt) {
          case T3D_INT8: CheckIntOp<int8_t>(dt, op, n, rng); break;
          case T3D_UINT8: CheckIntOp<uint8_t>(dt, op, n, rng); break;
          case T3D_INT32: CheckIntOp<int32_t>(dt, op, n, rng); break;
          case T3D_INT64: CheckIntOp<int64_t>(dt, op, n, rng); break;
          case T3D_FLOAT32: CheckFloatOp<float>(dt, op, n, rng); break;
          case T3D_FLOAT64: CheckFloatOp<double>(dt, op, n, rng); break;
          case T3D_COMPLEX64: CheckComplexOp<float>(dt, op, n, rng); break;
          case T3D_COMPLEX128: CheckComplexOp<double>(dt, op, n, rng); break;
          case T3D_BOOL: CheckBoolOp(op, n, rng); break;
          case T3D_FLOAT16: case T3D_BFLOAT16: CheckHalfOp(dt, op, n, rng); break;
          default: FAIL() << "dtype " << d;
        }
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(Reduce, ComplexProdIsComplexMultiplication) {
  std::complex<double> a(1, 2), b(3, -4);
  std::complex<double> got = a;
  t3d__reduce(&got, &b, 1, T3D_COMPLEX128, T3D_PROD);
  EXPECT_EQ(got, std::complex<double>(11, 2));
  std::complex<float> fa(0.5f, -1.0f), fb(2.0f, 2.0f);
  t3d__reduce(&fa, &fb, 1, T3D_COMPLEX64, T3D_PROD);
  EXPECT_EQ(fa, std::complex<float>(3.0f, -1.0f));
}

TEST(Reduce, IntegerWrapAround) {
  int8_t i8[] = {127, -128, 100, -1};
  int8_t i8b[] = {1, -1, 3, -128};
  t3d__reduce(i8, i8b, 4, T3D_INT8, T3D_SUM);
  EXPECT_EQ(i8[0], -128);
  EXPECT_EQ(i8[1], 127);
  EXPECT_EQ(i8[2], 103);
  EXPECT_EQ(i8[3], 127);
  int8_t p8[] = {64, -128}, p8b[] = {4, -1};
  t3d__reduce(p8, p8b, 2, T3D_INT8, T3D_PROD);
  EXPECT_EQ(p8[0], 0);
  EXPECT_EQ(p8[1], -128);
  uint8_t u8[] = {255, 16}, u8b[] = {1, 16};
  t3d__reduce(u8, u8b, 2, T3D_UINT8, T3D_SUM);
  EXPECT_EQ(u8[0], 0);
  t3d__reduce(u8 + 1, u8b + 1, 1, T3D_UINT8, T3D_PROD);
  EXPECT_EQ(u8[1], 0);
  int32_t i32[] = {INT32_MAX, INT32_MIN, 65536}, i32b[] = {1, -1, 65536};
  t3d__reduce(i32, i32b, 2, T3D_INT32, T3D_SUM);
  EXPECT_EQ(i32[0], INT32_MIN);
  EXPECT_EQ(i32[1], INT32_MAX);
  t3d__reduce(i32 + 2, i32b + 2, 1, T3D_INT32, T3D_PROD);
  EXPECT_EQ(i32[2], 0);
  int64_t i64[] = {INT64_MAX, INT64_MIN, INT64_MAX}, i64b[] = {1, -1, 2};
  t3d__reduce(i64, i64b, 2, T3D_INT64, T3D_SUM);
  EXPECT_EQ(i64[0], INT64_MIN);
  EXPECT_EQ(i64[1], INT64_MAX);
  t3d__reduce(i64 + 2, i64b + 2, 1, T3D_INT64, T3D_PROD);
  EXPECT_EQ(i64[2], -2);
  // Long enough to go through the vector blocks too.
  std::vector<int32_t> v(100, INT32_MAX), w(100, 2);
  t3d__reduce(v.data(), w.data(), v.size(), T3D_INT32, T3D_SUM);
  for (int32_t x : v) ASSERT_EQ(x, INT32_MIN + 1);
}

TEST(Reduce, SignedMinMaxUseSignedOrder) {
  int8_t a[] = {-1, 5}, b[] = {1, -128};
  t3d__reduce(a, b, 2, T3D_INT8, T3D_MIN);
  EXPECT_EQ(a[0], -1);
  EXPECT_EQ(a[1], -128);
  uint8_t ua[] = {255, 0}, ub[] = {1, 200};
  t3d__reduce(ua, ub, 2, T3D_UINT8, T3D_MAX);
  EXPECT_EQ(ua[0], 255);
  EXPECT_EQ(ua[1], 200);
  int64_t la[] = {INT64_MIN, -5}, lb[] = {INT64_MAX, -6};
  t3d__reduce(la, lb, 2, T3D_INT64, T3D_MAX);
  EXPECT_EQ(la[0], INT64_MAX);
  EXPECT_EQ(la[1], -5);
}

TEST(Reduce, FloatMinMaxPropagateNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float a[] = {nan, 1.0f, 2.0f}, b[] = {1.0f, nan, 3.0f};
  t3d__reduce(a, b, 3, T3D_FLOAT32, T3D_MIN);
  EXPECT_TRUE(std::isnan(a[0]));
  EXPECT_TRUE(std::isnan(a[1]));
  EXPECT_EQ(a[2], 2.0f);
  double c[] = {std::nan(""), -1.0}, d[] = {0.0, std::nan("")};
  t3d__reduce(c, d, 2, T3D_FLOAT64, T3D_MAX);
  EXPECT_TRUE(std::isnan(c[0]));
  EXPECT_TRUE(std::isnan(c[1]));
}

// ---------- scale and divide ----------

TEST(Scale, FloatsAndComplex) {
  std::vector<float> f = {1.0f, -3.0f, 0.1f};
  t3d__scale(f.data(), f.size(), T3D_FLOAT32, 0.5);
  EXPECT_EQ(f[0], 0.5f);
  EXPECT_EQ(f[1], -1.5f);
  EXPECT_EQ(f[2], 0.1f * 0.5f);
  double dd[] = {3.0, 1.0, -2.0, 4.0};
  t3d__scale(dd, 2, T3D_COMPLEX128, 2.0);
  EXPECT_EQ(dd[0], 6.0);
  EXPECT_EQ(dd[1], 2.0);
  EXPECT_EQ(dd[2], -4.0);
  EXPECT_EQ(dd[3], 8.0);
  float c[] = {1.0f, -1.0f};
  t3d__scale(c, 1, T3D_COMPLEX64, 0.25);
  EXPECT_EQ(c[0], 0.25f);
  EXPECT_EQ(c[1], -0.25f);
  for (t3d_dtype_t dt : {T3D_FLOAT16, T3D_BFLOAT16}) {
    float in[] = {3.0f, -0.5f, 100.0f}, out[3];
    uint16_t h[3];
    t3d__float_to_half(h, in, 3, dt);
    t3d__scale(h, 3, dt, 0.5);
    t3d__half_to_float(out, h, 3, dt);
    EXPECT_EQ(out[0], 1.5f) << t3d_dtype_name(dt);
    EXPECT_EQ(out[1], -0.25f) << t3d_dtype_name(dt);
    EXPECT_EQ(out[2], 50.0f) << t3d_dtype_name(dt);
  }
}

TEST(Scale, IntegersWrapOrTruncate) {
  int32_t a[] = {INT32_MAX, -3, 7};
  t3d__scale(a, 3, T3D_INT32, 2.0);
  EXPECT_EQ(a[0], -2);  // whole scalar: integer product, wrapped
  EXPECT_EQ(a[1], -6);
  EXPECT_EQ(a[2], 14);
  int64_t b[] = {7, -7, INT64_MAX};
  t3d__scale(b, 3, T3D_INT64, 1.5);
  EXPECT_EQ(b[0], 10);  // 10.5 truncated toward zero
  EXPECT_EQ(b[1], -10);
  EXPECT_EQ(b[2], INT64_MAX);  // saturates instead of an undefined cast
  int8_t c[] = {100, -100, 3};
  t3d__scale(c, 3, T3D_INT8, 2.5);
  EXPECT_EQ(c[0], 127);
  EXPECT_EQ(c[1], -128);
  EXPECT_EQ(c[2], 7);
  uint8_t u[] = {200, 3};
  t3d__scale(u, 2, T3D_UINT8, -1.5);
  EXPECT_EQ(u[0], 0);
  EXPECT_EQ(u[1], 0);
  int32_t nanscale[] = {5};
  t3d__scale(nanscale, 1, T3D_INT32, std::nan(""));
  EXPECT_EQ(nanscale[0], 0);
}

TEST(Divide, IntegersTruncateTowardZero) {
  int32_t a[] = {7, -7, 8, INT32_MIN, -1, 0};
  t3d__divide(a, 6, T3D_INT32, 2);
  EXPECT_EQ(a[0], 3);
  EXPECT_EQ(a[1], -3);
  EXPECT_EQ(a[2], 4);
  EXPECT_EQ(a[3], INT32_MIN / 2);
  EXPECT_EQ(a[4], 0);
  EXPECT_EQ(a[5], 0);
  int8_t b[] = {-128, 127, -5};
  t3d__divide(b, 3, T3D_INT8, 3);
  EXPECT_EQ(b[0], -42);
  EXPECT_EQ(b[1], 42);
  EXPECT_EQ(b[2], -1);
  uint8_t c[] = {255, 3};
  t3d__divide(c, 2, T3D_UINT8, 4);
  EXPECT_EQ(c[0], 63);
  EXPECT_EQ(c[1], 0);
  int64_t d[] = {INT64_MIN, -9, 9};
  t3d__divide(d, 3, T3D_INT64, 8);
  EXPECT_EQ(d[0], INT64_MIN / 8);
  EXPECT_EQ(d[1], -1);
  EXPECT_EQ(d[2], 1);
  int64_t e[] = {INT64_MIN, 5};
  t3d__divide(e, 2, T3D_INT64, -1);
  EXPECT_EQ(e[0], INT64_MIN);  // wraps instead of trapping
  EXPECT_EQ(e[1], -5);
  int32_t f[] = {9};
  t3d__divide(f, 1, T3D_INT32, 1);
  EXPECT_EQ(f[0], 9);
  t3d__divide(f, 1, T3D_INT32, 0);  // ignored rather than undefined
  EXPECT_EQ(f[0], 9);
  // Long enough for the vector loops.
  std::vector<int32_t> v(77, -15);
  t3d__divide(v.data(), v.size(), T3D_INT32, 4);
  for (int32_t x : v) ASSERT_EQ(x, -3);
}

TEST(Divide, Floats) {
  float a[] = {1.0f, -6.0f};
  t3d__divide(a, 2, T3D_FLOAT32, 3);
  EXPECT_EQ(a[0], 1.0f / 3.0f);
  EXPECT_EQ(a[1], -2.0f);
  double b[] = {1.0, 3.0, -5.0, 7.0};
  t3d__divide(b, 2, T3D_COMPLEX128, 2);
  EXPECT_EQ(b[0], 0.5);
  EXPECT_EQ(b[1], 1.5);
  EXPECT_EQ(b[2], -2.5);
  EXPECT_EQ(b[3], 3.5);
  float c[] = {8.0f, 2.0f};
  t3d__divide(c, 1, T3D_COMPLEX64, 4);
  EXPECT_EQ(c[0], 2.0f);
  EXPECT_EQ(c[1], 0.5f);
  for (t3d_dtype_t dt : {T3D_FLOAT16, T3D_BFLOAT16}) {
    float in[] = {3.0f, -8.0f}, out[2];
    uint16_t h[2];
    t3d__float_to_half(h, in, 2, dt);
    t3d__divide(h, 2, dt, 4);
    t3d__half_to_float(out, h, 2, dt);
    EXPECT_EQ(out[0], 0.75f) << t3d_dtype_name(dt);
    EXPECT_EQ(out[1], -2.0f) << t3d_dtype_name(dt);
  }
}

// ---------- float16 / bfloat16 ----------

// Value of a binary16 pattern from its definition.
double F16Value(uint16_t h) {
  int sign = (h >> 15) ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  if (e == 31) return m ? std::nan("") : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(static_cast<double>(1024 + m), e - 25);
}

// Nearest binary16 by search over the ordered finite magnitudes; ties go to the even pattern.
uint16_t F16Nearest(float f) {
  if (std::isnan(f)) return 0x7e00;
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  uint16_t lo = 0, hi = 0x7bff;
  while (lo < hi) {  // last pattern whose value is <= a
    uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (F16Value(mid) <= a) lo = mid;
    else hi = static_cast<uint16_t>(mid - 1);
  }
  if (lo == 0x7bff) return sign | lo;
  double below = a - F16Value(lo), above = F16Value(static_cast<uint16_t>(lo + 1)) - a;
  uint16_t r = lo;
  if (above < below || (above == below && (lo & 1))) r = static_cast<uint16_t>(lo + 1);
  return sign | r;
}

uint16_t ToF16(float f) {
  uint16_t h;
  t3d__float_to_half(&h, &f, 1, T3D_FLOAT16);
  return h;
}

TEST(Half, Float16DecodesEveryPattern) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); i++) all[i] = static_cast<uint16_t>(i);
  std::vector<float> bulk(all.size());
  t3d__half_to_float(bulk.data(), all.data(), all.size(), T3D_FLOAT16);
  for (size_t i = 0; i < all.size(); i++) {
    uint16_t h = all[i];
    double expect = F16Value(h);
    float scalar = t3d__f16_bits_to_float(h);
    if (std::isnan(expect)) {
      ASSERT_TRUE(std::isnan(scalar)) << std::hex << h;
      ASSERT_TRUE(std::isnan(bulk[i])) << std::hex << h;
      // Both paths agree bit for bit, NaN payload included.
      ASSERT_EQ(Bits(scalar), Bits(bulk[i])) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(scalar), expect) << std::hex << h;
      ASSERT_EQ(Bits(scalar), Bits(bulk[i])) << std::hex << h;  // signed zeros too
    }
  }
}

TEST(Half, Float16RoundTripsEveryPattern) {
  for (uint32_t i = 0; i < 65536; i++) {
    uint16_t h = static_cast<uint16_t>(i);
    float f = t3d__f16_bits_to_float(h);
    uint16_t back = t3d__float_to_f16_bits(f);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
      // NaN stays NaN (made quiet).
      ASSERT_EQ(back & 0x7c00, 0x7c00) << std::hex << h;
      ASSERT_NE(back & 0x3ff, 0) << std::hex << h;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
      ASSERT_EQ(ToF16(f), h) << std::hex << h;
    }
  }
}

TEST(Half, Float16RoundsToNearestEven) {
  struct Case {
    float f;
    uint16_t h;
  } cases[] = {
      {1.0f + 0x1p-11f, 0x3c00},           // tie, even below
      {1.0f + 3 * 0x1p-11f, 0x3c02},       // tie, even above
      {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01},  // just past the tie
      {65504.0f, 0x7bff},
      {65519.0f, 0x7bff},
      {65520.0f, 0x7c00},                  // tie between 65504 and 65536 (odd max): infinity
      {1e10f, 0x7c00},
      {-1e10f, 0xfc00},
      {0x1p-24f, 0x0001},                  // smallest subnormal
      {0x1p-25f, 0x0000},                  // tie with zero
      {-0x1p-25f, 0x8000},
      {0x1p-25f * 1.0000001f, 0x0001},
      {3 * 0x1p-25f, 0x0002},              // tie between 1 and 2 units: even
      {5 * 0x1p-25f, 0x0002},              // tie between 2 and 3 units: even
      {0x1p-14f - 0x1p-25f, 0x0400},       // tie between largest subnormal and smallest normal
      {0x1p-14f, 0x0400},
      {1e-10f, 0x0000},
      {-0.0f, 0x8000},
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      {std::numeric_limits<float>::denorm_min(), 0x0000},
  };
  for (const Case &c : cases) {
    EXPECT_EQ(t3d__float_to_f16_bits(c.f), c.h) << c.f;
    EXPECT_EQ(ToF16(c.f), c.h) << c.f;
  }
  uint16_t n = ToF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(n & 0x7c00, 0x7c00);
  EXPECT_NE(n & 0x3ff, 0);
  // A signalling NaN whose payload sits only in the low bits must not become infinity.
  float snan = FromBits(0x7f800001u);
  uint16_t s = t3d__float_to_f16_bits(snan);
  EXPECT_EQ(s & 0x7c00, 0x7c00);
  EXPECT_NE(s & 0x3ff, 0);
  EXPECT_EQ(ToF16(snan), s);
}

TEST(Half, Float16MatchesSearchReference) {
  // Every tie point between neighbouring halves and the floats either side of it, then random bit patterns.
  std::vector<float> in;
  for (uint32_t h = 0; h < 0x7bff; h++) {
    float mid = static_cast<float>((F16Value(static_cast<uint16_t>(h)) + F16Value(static_cast<uint16_t>(h + 1))) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      in.push_back(f);
      in.push_back(-f);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 300000; i++) in.push_back(FromBits(static_cast<uint32_t>(rng())));
  std::vector<uint16_t> bulk(in.size());
  t3d__float_to_half(bulk.data(), in.data(), in.size(), T3D_FLOAT16);
  for (size_t i = 0; i < in.size(); i++) {
    float f = in[i];
    uint16_t scalar = t3d__float_to_f16_bits(f);
    ASSERT_EQ(scalar, bulk[i]) << "bulk and scalar paths differ at " << std::hexfloat << f;
    if (std::isnan(f)) {
      ASSERT_EQ(scalar & 0x7c00, 0x7c00);
      ASSERT_NE(scalar & 0x3ff, 0);
    } else {
      ASSERT_EQ(scalar, F16Nearest(f)) << std::hexfloat << f;
    }
  }
}

float Bf16ToFloatForTest(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t Bf16Nearest(float f) {
  uint32_t u = Bits(f);
  uint32_t lo = u >> 16, rem = u & 0xffff;
  if (rem > 0x8000 || (rem == 0x8000 && (lo & 1))) lo++;
  return static_cast<uint16_t>(lo);
}

TEST(Half, Bfloat16) {
  // Every pattern decodes to the float with the same top bits and encodes back unchanged (NaN stays NaN).
  for (uint32_t i = 0; i < 65536; i++) {
    uint16_t h = static_cast<uint16_t>(i), back;
    float f;
    t3d__half_to_float(&f, &h, 1, T3D_BFLOAT16);
    ASSERT_EQ(Bits(f), i << 16);
    t3d__float_to_half(&back, &f, 1, T3D_BFLOAT16);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Bf16ToFloatForTest(back)));
    } else {
      ASSERT_EQ(back, h);
    }
  }
  std::mt19937 rng(11);
  std::vector<float> in;
  for (int i = 0; i < 200000; i++) in.push_back(FromBits(static_cast<uint32_t>(rng())));
  in.push_back(1.0f + 0x1p-8f);             // tie, even below: 1.0
  in.push_back(1.0f + 3 * 0x1p-8f);         // tie, even above
  in.push_back(std::numeric_limits<float>::max());  // rounds to infinity
  in.push_back(FromBits(0x7f800001u));      // NaN whose payload would be rounded away
  in.push_back(FromBits(0xff80ffffu));
  std::vector<uint16_t> out(in.size());
  t3d__float_to_half(out.data(), in.data(), in.size(), T3D_BFLOAT16);
  for (size_t i = 0; i < in.size(); i++) {
    if (std::isnan(in[i])) {
      ASSERT_TRUE(std::isnan(Bf16ToFloatForTest(out[i]))) << std::hex << Bits(in[i]);
      ASSERT_EQ(out[i] & 0x8000, (Bits(in[i]) >> 16) & 0x8000);
    } else {
      ASSERT_EQ(out[i], Bf16Nearest(in[i])) << std::hexfloat << in[i];
    }
  }
  EXPECT_EQ(out[out.size() - 5], 0x3f80);
  EXPECT_EQ(out[out.size() - 4], 0x3f82);
  EXPECT_EQ(out[out.size() - 3], 0x7f80);
}

// ---------- public tables ----------

TEST(Tables, DtypeSizesAndNames) {
  const size_t sizes[] = {1, 1, 4, 8, 2, 2, 4, 8, 1, 8, 16};
  const char *names[] = {"int8",    "uint8",   "int32", "int64",     "float16",   "bfloat16",
                         "float32", "float64", "bool",  "complex64", "complex128"};
  static_assert(sizeof(sizes) / sizeof(sizes[0]) == T3D_DTYPE_COUNT, "one size per dtype");
  for (int d = 0; d < T3D_DTYPE_COUNT; d++) {
    EXPECT_EQ(t3d_dtype_size(static_cast<t3d_dtype_t>(d)), sizes[d]) << d;
    EXPECT_STREQ(t3d_dtype_name(static_cast<t3d_dtype_t>(d)), names[d]) << d;
  }
  EXPECT_EQ(t3d_dtype_size(T3D_DTYPE_COUNT), 0u);
  EXPECT_EQ(t3d_dtype_size(static_cast<t3d_dtype_t>(-1)), 0u);
  EXPECT_NE(t3d_dtype_name(static_cast<t3d_dtype_t>(99)), nullptr);
  const char *ops[] = {"sum", "prod", "min", "max", "avg", "premul_sum", "band", "bor", "bxor"};
  for (int o = 0; o < T3D_REDOP_COUNT; o++) EXPECT_STREQ(t3d_redop_name(static_cast<t3d_redop_t>(o)), ops[o]);
  EXPECT_NE(t3d_redop_name(static_cast<t3d_redop_t>(-3)), nullptr);
}

TEST(Tables, RedopSupported) {
  for (int o = 0; o < T3D_REDOP_COUNT; o++) {
    for (int d = 0; d < T3D_DTYPE_COUNT; d++) {
      t3d_redop_t op = static_cast<t3d_redop_t>(o);
      t3d_dtype_t dt = static_cast<t3d_dtype_t>(d);
      bool ok;
      switch (op) {
        case T3D_BAND: case T3D_BOR: case T3D_BXOR: ok = IsInt(dt) || dt == T3D_BOOL; break;
        case T3D_PROD: case T3D_MIN: case T3D_MAX: ok = !IsCplx(dt); break;
        case T3D_AVG: case T3D_PREMUL_SUM: ok = dt != T3D_BOOL; break;
        default: ok = true; break;
      }
      EXPECT_EQ(t3d_redop_supported(op, dt), ok ? T3D_OK : T3D_ERR_UNSUPPORTED)
          << t3d_redop_name(op) << " " << t3d_dtype_name(dt);
    }
  }
  EXPECT_EQ(t3d_redop_supported(T3D_REDOP_COUNT, T3D_FLOAT32), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_redop_supported(static_cast<t3d_redop_t>(-1), T3D_FLOAT32), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_redop_supported(T3D_SUM, T3D_DTYPE_COUNT), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_redop_supported(T3D_SUM, static_cast<t3d_dtype_t>(-2)), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_redop_supported(T3D_BAND, T3D_FLOAT16), T3D_ERR_UNSUPPORTED);
  EXPECT_EQ(t3d_redop_supported(T3D_SUM, T3D_BFLOAT16), T3D_OK);
}

}  // namespace
