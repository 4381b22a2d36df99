// harness_values.cc: typed test values: half conversions, deterministic per-rank inputs that keep results exact, the
// serial reference reduction and dtype-aware comparison.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "t3d_half.h"

namespace t3dtest {

// Every dtype and op, and what kind of values each dtype holds: the rows of c_src/include/t3d_types.def, which
// libt3d's tables read too.
const t3d_dtype_t kAllDtypes[] = {
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND) ENUM,
#include "t3d_types.def"
#undef T3D_DTYPE
};
const size_t kNumDtypes = sizeof(kAllDtypes) / sizeof(kAllDtypes[0]);
const t3d_redop_t kAllOps[] = {
#define T3D_REDOP(ENUM, NAME) ENUM,
#include "t3d_types.def"
#undef T3D_REDOP
};
const size_t kNumOps = sizeof(kAllOps) / sizeof(kAllOps[0]);

enum class Kind { INT, BOOL, HALF, FLOAT, COMPLEX, INVALID };  // t3d_types.def's KIND column

static Kind KindOf(t3d_dtype_t dt) {
  switch (dt) {
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND) \
  case ENUM: return Kind::KIND;
#include "t3d_types.def"
#undef T3D_DTYPE
    default: return Kind::INVALID;
  }
}

bool IsHalf(t3d_dtype_t dt) { return KindOf(dt) == Kind::HALF; }
bool IsComplex(t3d_dtype_t dt) { return KindOf(dt) == Kind::COMPLEX; }
bool IsFloat(t3d_dtype_t dt) { return IsHalf(dt) || KindOf(dt) == Kind::FLOAT || IsComplex(dt); }
bool IsInteger(t3d_dtype_t dt) { return KindOf(dt) == Kind::INT; }

int Components(t3d_dtype_t dt) {
  switch (dt) {
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND) \
  case ENUM: return COMPS;
#include "t3d_types.def"
#undef T3D_DTYPE
    default: return 1;
  }
}

static size_t ElemSize(t3d_dtype_t dt) {
  switch (dt) {
#define T3D_DTYPE(ENUM, NAME, CTYPE, COMPS, SIZE, KIND) \
  case ENUM: return SIZE;
#include "t3d_types.def"
#undef T3D_DTYPE
    default: return 0;
  }
}

// The conversions of c_src/include/t3d_half.h, which libt3d, the kernels and the fake NCCL use too.
uint16_t FloatToHalf(float f) { return t3d__f32_to_f16(f); }
float HalfToFloat(uint16_t h) { return t3d__f16_to_f32(h); }
uint16_t FloatToBf16(float f) { return t3d__f32_to_bf16(f); }
float Bf16ToFloat(uint16_t h) { return t3d__bf16_to_f32(h); }

static void StoreBits(t3d_dtype_t dt, void *buf, size_t i, uint64_t bits) {
  unsigned char *p = static_cast<unsigned char *>(buf) + i * ElemSize(dt);
  if (dt == T3D_BOOL) bits &= 1u;
  for (size_t b = 0; b < ElemSize(dt); ++b) p[b] = static_cast<unsigned char>(bits >> (8 * b));
}

void StoreValue(t3d_dtype_t dt, void *buf, size_t i, int comp, double value) {
  unsigned char *p = static_cast<unsigned char *>(buf);
  switch (dt) {
    case T3D_INT8: case T3D_UINT8: case T3D_INT32: case T3D_INT64:
      StoreBits(dt, buf, i, static_cast<uint64_t>(static_cast<int64_t>(value)));
      break;
    case T3D_BOOL: p[i] = value != 0.0 ? 1 : 0; break;
    case T3D_FLOAT16: {
      uint16_t h = FloatToHalf(static_cast<float>(value));
      memcpy(p + 2 * i, &h, 2);
      break;
    }
    case T3D_BFLOAT16: {
      uint16_t h = FloatToBf16(static_cast<float>(value));
      memcpy(p + 2 * i, &h, 2);
      break;
    }
    case T3D_FLOAT32: {
      float f = static_cast<float>(value);
      memcpy(p + 4 * i, &f, 4);
      break;
    }
    case T3D_FLOAT64: memcpy(p + 8 * i, &value, 8); break;
    case T3D_COMPLEX64: {
      float f = static_cast<float>(value);
      memcpy(p + 8 * i + 4 * comp, &f, 4);
      break;
    }
    case T3D_COMPLEX128: memcpy(p + 16 * i + 8 * comp, &value, 8); break;
    default: break;
  }
}

double LoadValue(t3d_dtype_t dt, const void *buf, size_t i, int comp) {
  const unsigned char *p = static_cast<const unsigned char *>(buf);
  switch (dt) {
    case T3D_INT8: return static_cast<int8_t>(p[i]);
    case T3D_UINT8: return p[i];
    case T3D_BOOL: return p[i];
    case T3D_INT32: {
      int32_t v;
      memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case T3D_INT64: {
      int64_t v;
      memcpy(&v, p + 8 * i, 8);
      return static_cast<double>(v);
    }
    case T3D_FLOAT16: {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      return HalfToFloat(h);
    }
    case T3D_BFLOAT16: {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      return Bf16ToFloat(h);
    }
    case T3D_FLOAT32: {
      float f;
      memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case T3D_FLOAT64: {
      double d;
      memcpy(&d, p + 8 * i, 8);
      return d;
    }
    case T3D_COMPLEX64: {
      float f;
      memcpy(&f, p + 8 * i + 4 * comp, 4);
      return f;
    }
    case T3D_COMPLEX128: {
      double d;
      memcpy(&d, p + 16 * i + 8 * comp, 8);
      return d;
    }
    default: return 0.0;
  }
}

double PremulScalar(t3d_dtype_t dt) { return (IsInteger(dt) || dt == T3D_BOOL) ? 2.0 : 0.5; }

static uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static bool IsBitwise(t3d_redop_t op) { return op == T3D_BAND || op == T3D_BOR || op == T3D_BXOR; }

uint64_t InputBits(t3d_dtype_t dt, int rank, size_t i) {
  return Mix((static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(i) * 0x100000001b3ull) ^
             static_cast<uint64_t>(dt));
}

double InputValue(t3d_dtype_t dt, t3d_redop_t op, int rank, size_t i, int comp) {
  const uint64_t r = static_cast<uint64_t>(rank);
  const uint64_t c = static_cast<uint64_t>(comp);
  if (dt == T3D_BOOL) {
    switch (op) {
      case T3D_PROD: case T3D_MIN: case T3D_BAND: return ((i + 3 * r) % 7 == 0) ? 0.0 : 1.0;  // mostly 1
      case T3D_BXOR: return ((i + r) % 3 == 0) ? 1.0 : 0.0;
      default: return ((3 * i + r) % 5 == 0) ? 1.0 : 0.0;  // mostly 0
    }
  }
  if (op == T3D_PROD) {
    // |product| <= 2^ceil(nranks/4): at most every fourth rank holds a 2; signed types also see -1.
    const double mag = ((i + r + c) % 4 == 0) ? 2.0 : 1.0;
    const bool neg = dt != T3D_UINT8 && (7 * i + r + c) % 3 == 0;
    return neg ? -mag : mag;
  }
  // SUM, AVG, PREMUL_SUM, MIN, MAX: |x| <= 6 keeps 8 ranks times the premul factor 2 inside int8 / uint8.
  const uint64_t h = (7 * i + 5 * r + 3 * c + (i >> 5)) % 13;
  if (dt == T3D_UINT8) return static_cast<double>(h);
  return static_cast<double>(h) - 6.0;
}

void FillInput(t3d_dtype_t dt, t3d_redop_t op, int rank, void *buf, size_t n, size_t first) {
  if (IsBitwise(op) && IsInteger(dt)) {
    for (size_t i = 0; i < n; ++i) StoreBits(dt, buf, i, InputBits(dt, rank, first + i));
    return;
  }
  const int comps = Components(dt);
  for (size_t i = 0; i < n; ++i)
    for (int c = 0; c < comps; ++c) StoreValue(dt, buf, i, c, InputValue(dt, op, rank, first + i, c));
}

void ReferenceReduce(t3d_dtype_t dt, t3d_redop_t op, int nranks, void *out, size_t n, size_t first) {
  if (IsBitwise(op) && IsInteger(dt)) {
    for (size_t i = 0; i < n; ++i) {
      uint64_t acc = InputBits(dt, 0, first + i);
      for (int r = 1; r < nranks; ++r) {
        const uint64_t b = InputBits(dt, r, first + i);
        acc = op == T3D_BAND ? (acc & b) : op == T3D_BOR ? (acc | b) : (acc ^ b);
      }
      StoreBits(dt, out, i, acc);
    }
    return;
  }
  const int comps = Components(dt);
  const bool integral = IsInteger(dt) || dt == T3D_BOOL;
  const double s = PremulScalar(dt);
  for (size_t i = 0; i < n; ++i) {
    for (int c = 0; c < comps; ++c) {
      double acc = 0.0;
      for (int r = 0; r < nranks; ++r) {
        double x = InputValue(dt, op, r, first + i, c);
        switch (op) {
          case T3D_SUM: case T3D_AVG: acc = r ? acc + x : x; break;
          case T3D_PREMUL_SUM: {
            double y = integral ? std::trunc(x * s) : x * s;
            acc = r ? acc + y : y;
            break;
          }
          case T3D_PROD: acc = r ? acc * x : x; break;
          case T3D_MIN: case T3D_BAND: acc = r ? std::min(acc, x) : x; break;  // bool only reaches BAND here
          case T3D_MAX: case T3D_BOR: acc = r ? std::max(acc, x) : x; break;
          case T3D_BXOR: acc = r ? static_cast<double>(static_cast<int>(acc) ^ static_cast<int>(x)) : x; break;
          default: break;
        }
      }
      if (op == T3D_AVG) acc = integral ? std::trunc(acc / nranks) : acc / nranks;
      StoreValue(dt, out, i, c, acc);
    }
  }
}

double Tolerance(t3d_dtype_t dt, t3d_redop_t op) {
  if (op != T3D_AVG || !IsFloat(dt)) return 0.0;
  switch (dt) {
    case T3D_FLOAT16: return 1e-3;
    case T3D_BFLOAT16: return 8e-3;
    case T3D_FLOAT32: case T3D_COMPLEX64: return 1e-6;
    default: return 1e-14;
  }
}

std::string CompareBuffers(t3d_dtype_t dt, const void *got, const void *expect, size_t n, double tol) {
  const size_t es = ElemSize(dt);
  const unsigned char *g = static_cast<const unsigned char *>(got);
  const unsigned char *e = static_cast<const unsigned char *>(expect);
  if (!IsFloat(dt)) {
    for (size_t i = 0; i < n; ++i) {
      if (memcmp(g + i * es, e + i * es, es) != 0) {
        std::ostringstream os;
        os << t3d_dtype_name(dt) << " element " << i << " of " << n << ": got " << LoadValue(dt, got, i, 0)
           << ", expected " << LoadValue(dt, expect, i, 0);
        return os.str();
      }
    }
    return "";
  }
  const int comps = Components(dt);
  for (size_t i = 0; i < n; ++i) {
    for (int c = 0; c < comps; ++c) {
      const double a = LoadValue(dt, got, i, c);
      const double b = LoadValue(dt, expect, i, c);
      const bool ok = tol == 0.0 ? (a == b) : (std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b)));
      if (!ok) {
        std::ostringstream os;
        os.precision(17);
        os << t3d_dtype_name(dt) << " element " << i << (comps > 1 ? (c ? " (imag)" : " (real)") : "") << " of "
           << n << ": got " << a << ", expected " << b << " (tolerance " << tol << ")";
        return os.str();
      }
    }
  }
  return "";
}

void FillPattern(t3d_dtype_t dt, int rank, void *buf, size_t n, size_t first, int salt) {
  const int comps = Components(dt);
  for (size_t i = 0; i < n; ++i) {
    for (int c = 0; c < comps; ++c) {
      const uint64_t h = (static_cast<uint64_t>(rank) * 7919u + (first + i) * 31u + static_cast<uint64_t>(c) * 17u +
                          static_cast<uint64_t>(salt) * 101u) % 251u;
      double v;
      if (dt == T3D_BOOL) v = static_cast<double>(h & 1u);
      else if (dt == T3D_UINT8) v = static_cast<double>(h);
      else v = static_cast<double>(h) - 125.0;
      StoreValue(dt, buf, i, c, v);
    }
  }
}

std::string CaseName(t3d_dtype_t dt, t3d_redop_t op, size_t count) {
  std::ostringstream os;
  const char *dn = t3d_dtype_name(dt);
  const char *on = t3d_redop_name(op);
  os << (dn ? dn : "?") << "/" << (on ? on : "?") << "/count=" << count;
  return os.str();
}

std::string ByteDiff(const std::vector<unsigned char> &got, const std::vector<unsigned char> &want) {
  if (got.size() != want.size()) return "sizes differ";
  for (size_t b = 0; b < got.size(); ++b)
    if (got[b] != want[b])
      return "byte " + std::to_string(b) + ": got " + std::to_string(got[b]) + ", want " + std::to_string(want[b]);
  return "";
}

}  // namespace t3dtest
