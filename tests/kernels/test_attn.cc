// CPU attention kernels (kernels/include/t3d_attn.h) against a double-precision reference: forward, backward, GQA,
// causal offsets, fully masked rows, bfloat16, every ISA path this CPU has, the parallel-for hook, and the merge.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "t3d_attn.h"
#include "t3d_half.h"

namespace {

const double kInf = std::numeric_limits<double>::infinity();

uint16_t to_bf16(float f) { return t3d__f32_to_bf16(f); }
float from_bf16(uint16_t h) { return t3d__bf16_to_f32(h); }

// A tensor in the kernel's dtype plus the exact double values it holds (inputs are rounded before the reference
// sees them, so the reference and the kernel start from the same numbers).
struct Buf {
  t3d_attn_dtype_t dt;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Buf(t3d_attn_dtype_t d, size_t n) : dt(d) {
    if (d == T3D_ATTN_FLOAT32)
      f.assign(n, 0.0f);
    else
      h.assign(n, 0);
  }
  size_t size() const { return dt == T3D_ATTN_FLOAT32 ? f.size() : h.size(); }
  void *data() { return size() == 0 ? nullptr : dt == T3D_ATTN_FLOAT32 ? (void *)f.data() : (void *)h.data(); }
  double get(size_t i) const { return dt == T3D_ATTN_FLOAT32 ? (double)f[i] : (double)from_bf16(h[i]); }
  void set(size_t i, double x) {
    if (dt == T3D_ATTN_FLOAT32)
      f[i] = (float)x;
    else
      h[i] = to_bf16((float)x);
  }
  std::vector<double> values() const {
    std::vector<double> r(size());
    for (size_t i = 0; i < r.size(); i++) r[i] = get(i);
    return r;
  }
  void fill(std::mt19937 &rng, double amp) {
    std::uniform_real_distribution<double> u(-amp, amp);
    for (size_t i = 0; i < size(); i++) set(i, u(rng));
  }
};

struct Shape {
  int64_t B, Hq, Hkv, Sq, Sk, D;
  bool causal;
  int64_t qs, ks;
  double amp;  // input magnitude: large values make the softmax peaky and exercise the online rescaling
};

struct RefFwd {
  std::vector<double> out, lse, p;  // p: [B, Hq, Sq, Sk] probabilities
};

bool visible(const Shape &s, int64_t i, int64_t j) { return !s.causal || s.ks + j <= s.qs + i; }

RefFwd ref_forward(const Shape &s, double scale, const std::vector<double> &q, const std::vector<double> &k,
                   const std::vector<double> &v) {
  RefFwd r;
  r.out.assign(s.B * s.Hq * s.Sq * s.D, 0.0);
  r.lse.assign(s.B * s.Hq * s.Sq, -kInf);
  r.p.assign(s.B * s.Hq * s.Sq * s.Sk, 0.0);
  const int64_t g = s.Hq / s.Hkv;
  std::vector<double> sc(s.Sk);
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t h = 0; h < s.Hq; h++) {
      const int64_t kvh = h / g;
      for (int64_t i = 0; i < s.Sq; i++) {
        const double *qi = &q[((b * s.Hq + h) * s.Sq + i) * s.D];
        double m = -kInf;
        for (int64_t j = 0; j < s.Sk; j++) {
          if (!visible(s, i, j)) continue;
          const double *kj = &k[((b * s.Hkv + kvh) * s.Sk + j) * s.D];
          double d = 0;
          for (int64_t e = 0; e < s.D; e++) d += qi[e] * kj[e];
          sc[j] = d * scale;
          m = std::max(m, sc[j]);
        }
        const int64_t row = (b * s.Hq + h) * s.Sq + i;
        if (m == -kInf) continue;
        double sum = 0;
        for (int64_t j = 0; j < s.Sk; j++)
          if (visible(s, i, j)) sum += std::exp(sc[j] - m);
        const double lse = m + std::log(sum);
        r.lse[row] = lse;
        for (int64_t j = 0; j < s.Sk; j++) {
          if (!visible(s, i, j)) continue;
          const double pj = std::exp(sc[j] - lse);
          r.p[row * s.Sk + j] = pj;
          const double *vj = &v[((b * s.Hkv + kvh) * s.Sk + j) * s.D];
          for (int64_t e = 0; e < s.D; e++) r.out[row * s.D + e] += pj * vj[e];
        }
      }
    }
  return r;
}

void ref_backward(const Shape &s, double scale, const std::vector<double> &dout, const std::vector<double> &q,
                  const std::vector<double> &k, const std::vector<double> &v, const RefFwd &f,
                  std::vector<double> &dq, std::vector<double> &dk, std::vector<double> &dv) {
  dq.assign(q.size(), 0.0);
  dk.assign(k.size(), 0.0);
  dv.assign(v.size(), 0.0);
  const int64_t g = s.Hq / s.Hkv;
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t h = 0; h < s.Hq; h++) {
      const int64_t kvh = h / g;
      for (int64_t i = 0; i < s.Sq; i++) {
        const int64_t row = (b * s.Hq + h) * s.Sq + i;
        const double *doi = &dout[row * s.D];
        double Di = 0;
        for (int64_t e = 0; e < s.D; e++) Di += doi[e] * f.out[row * s.D + e];
        for (int64_t j = 0; j < s.Sk; j++) {
          const double p = f.p[row * s.Sk + j];
          if (p == 0.0) continue;
          const int64_t krow = (b * s.Hkv + kvh) * s.Sk + j;
          double dp = 0;
          for (int64_t e = 0; e < s.D; e++) dp += doi[e] * v[krow * s.D + e];
          const double ds = p * (dp - Di);
          for (int64_t e = 0; e < s.D; e++) {
            dv[krow * s.D + e] += p * doi[e];
            dq[row * s.D + e] += scale * ds * k[krow * s.D + e];
            dk[krow * s.D + e] += scale * ds * q[row * s.D + e];
          }
        }
      }
    }
}

// max |got - ref| <= rtol * max |ref|; a reference that is all zero must be matched exactly.
void expect_close(const char *what, const Buf &got, const std::vector<double> &ref, double rtol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double mx = 0, err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    mx = std::max(mx, std::fabs(ref[i]));
    const double e = std::fabs(got.get(i) - ref[i]);
    if (!(e <= err)) {
      err = e;
      worst = i;
    }
  }
  if (mx == 0) {
    // Zero in exact arithmetic (e.g. dq, dk with a single visible key, where ds = p (dp - D) cancels): rounding
    // may leave a residue. Masked rows are checked for exact zeros separately.
    EXPECT_LE(err, 1e-6) << what << " should be zero; element " << worst << " = " << got.get(worst);
  } else {
    EXPECT_LE(err, rtol * mx) << what << ": worst element " << worst << " got " << got.get(worst) << " want "
                              << ref[worst] << " (max |ref| " << mx << ")";
  }
}

void expect_lse(const std::vector<float> &got, const std::vector<double> &ref, double atol) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); i++) {
    if (ref[i] == -kInf) {
      ASSERT_EQ((double)got[i], -kInf) << "lse row " << i << " should be -inf";
    } else {
      ASSERT_NEAR((double)got[i], ref[i], atol) << "lse row " << i;
    }
  }
}

std::vector<t3d_attn_isa_t> isas_here() {
  std::vector<t3d_attn_isa_t> r;
  for (t3d_attn_isa_t i : {T3D_ATTN_ISA_SCALAR, T3D_ATTN_ISA_AVX2, T3D_ATTN_ISA_AVX512, T3D_ATTN_ISA_AMX})
    if (t3d_attn_isa_available(i)) r.push_back(i);
  return r;
}

struct Case {
  t3d_attn_isa_t isa;
  t3d_attn_dtype_t dt;
  Shape s;
};

void PrintTo(const Case &c, std::ostream *os) {
  *os << t3d_attn_isa_name(c.isa) << (c.dt == T3D_ATTN_FLOAT32 ? " f32" : " bf16") << " B" << c.s.B << " Hq" << c.s.Hq
      << " Hkv" << c.s.Hkv << " Sq" << c.s.Sq << " Sk" << c.s.Sk << " D" << c.s.D << (c.s.causal ? " causal" : "")
      << " qs" << c.s.qs << " ks" << c.s.ks;
}

std::string case_name(const testing::TestParamInfo<Case> &info) {
  const Case &c = info.param;
  const Shape &s = c.s;
  std::string n = std::string(t3d_attn_isa_name(c.isa)) + (c.dt == T3D_ATTN_FLOAT32 ? "_f32" : "_bf16") + "_B" +
                   std::to_string(s.B) + "H" + std::to_string(s.Hq) + "kv" + std::to_string(s.Hkv) + "_q" +
                   std::to_string(s.Sq) + "k" + std::to_string(s.Sk) + "d" + std::to_string(s.D) +
                   (s.causal ? "_causal" : "_full") + "_qs" + std::to_string(s.qs) + "ks" + std::to_string(s.ks);
  if (s.amp != 1.0) n += "_amp" + std::to_string((int)s.amp);
  return n;
}

std::vector<Shape> shapes() {
  std::vector<Shape> r;
  for (bool causal : {false, true}) {
    r.push_back({1, 1, 1, 1, 1, 16, causal, 0, 0, 1.0});
    r.push_back({2, 4, 2, 7, 129, 64, causal, 122, 0, 1.0});   // GQA 4/2; causal: queries at the end of the keys
    r.push_back({1, 4, 1, 129, 7, 80, causal, 0, 0, 1.0});     // GQA 4/1, few keys: later rows see them all
    r.push_back({1, 2, 2, 129, 129, 128, causal, 0, 0, 1.0});
    r.push_back({2, 4, 4, 129, 129, 16, causal, 0, 0, 3.0});   // peaky softmax
    r.push_back({1, 2, 1, 200, 300, 64, causal, 100, 0, 1.0}); // several blocks both ways, q_start > k_start
    r.push_back({1, 2, 2, 129, 129, 64, causal, 0, 50, 1.0});  // q_start < k_start: 50 fully masked rows
    r.push_back({1, 1, 1, 7, 129, 80, causal, 3, 1000, 1.0});  // causal: every row masked
    r.push_back({1, 2, 1, 65, 0, 16, causal, 0, 0, 1.0});      // no keys at all
    r.push_back({1, 2, 1, 600, 130, 33, causal, 80, 0, 1.0});  // odd D; more queries than one AMX backward chunk
  }
  return r;
}

std::vector<Case> all_cases() {
  std::vector<Case> r;
  for (t3d_attn_isa_t isa : isas_here())
    for (t3d_attn_dtype_t dt : {T3D_ATTN_FLOAT32, T3D_ATTN_BFLOAT16}) {
      if (isa == T3D_ATTN_ISA_AMX && dt == T3D_ATTN_FLOAT32) continue;  // float32 under AMX is the AVX-512 path
      for (const Shape &s : shapes()) r.push_back({isa, dt, s});
    }
  return r;
}

class AttnTest : public testing::TestWithParam<Case> {};

TEST_P(AttnTest, ForwardBackwardMatchReference) {
  const Case &c = GetParam();
  const Shape &s = c.s;
  std::mt19937 rng(1234 + (unsigned)(s.Sq * 7 + s.Sk * 13 + s.D));
  const size_t nq = s.B * s.Hq * s.Sq * s.D, nk = s.B * s.Hkv * s.Sk * s.D, rows = s.B * s.Hq * s.Sq;
  Buf q(c.dt, nq), k(c.dt, nk), v(c.dt, nk), dout(c.dt, nq);
  q.fill(rng, s.amp);
  k.fill(rng, s.amp);
  v.fill(rng, 1.0);
  dout.fill(rng, 1.0);
  const float scale = s.D == 80 ? 0.2f : NAN;  // NAN: the 1/sqrt(D) default
  const double dscale = std::isnan(scale) ? 1.0 / std::sqrt((double)s.D) : (double)scale;

  t3d_attn_exec_t ex = {};
  ex.isa = c.isa;
  ex.nthreads = 4;  // more than the box's cores: exercises the key-block slabs of the backward

  Buf out(c.dt, nq);
  std::vector<float> lse(rows, 123.0f);
  ASSERT_EQ(t3d_attn_forward(c.dt, q.data(), k.data(), v.data(), out.data(), lse.data(), s.B, s.Hq, s.Hkv, s.Sq,
                             s.Sk, s.D, s.causal, scale, s.qs, s.ks, &ex),
            T3D_ATTN_OK);
  const std::vector<double> qd = q.values(), kd = k.values(), vd = v.values(), dod = dout.values();
  RefFwd ref = ref_forward(s, dscale, qd, kd, vd);
  const bool bf = c.dt == T3D_ATTN_BFLOAT16;
  expect_close("out", out, ref.out, bf ? 2e-2 : 2e-5);
  expect_lse(lse, ref.lse, bf ? 1e-3 : 1e-4);
  for (size_t r = 0; r < rows; r++)
    if (ref.lse[r] == -kInf) {
      for (int64_t e = 0; e < s.D; e++) ASSERT_EQ(out.get(r * s.D + e), 0.0) << "masked row " << r;
    }

  Buf dq(c.dt, nq), dk(c.dt, nk), dv(c.dt, nk);
  // Poison the outputs: the kernel must write every element.
  for (Buf *g : {&dq, &dk, &dv})
    for (size_t i = 0; i < g->size(); i++) g->set(i, 777.0);
  ASSERT_EQ(t3d_attn_backward(c.dt, dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), dq.data(),
                              dk.data(), dv.data(), s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, s.causal, scale, s.qs, s.ks,
                              &ex),
            T3D_ATTN_OK);
  std::vector<double> rdq, rdk, rdv;
  ref_backward(s, dscale, dod, qd, kd, vd, ref, rdq, rdk, rdv);
  const double gt = bf ? 2e-2 : 5e-5;
  expect_close("dq", dq, rdq, gt);
  expect_close("dk", dk, rdk, gt);
  expect_close("dv", dv, rdv, gt);
  // Rows that see no key have exactly zero gradient.
  for (size_t r = 0; r < rows; r++)
    if (ref.lse[r] == -kInf) {
      for (int64_t e = 0; e < s.D; e++) ASSERT_EQ(dq.get(r * s.D + e), 0.0) << "masked row " << r;
    }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, AttnTest, testing::ValuesIn(all_cases()), case_name);

// ------------------------------------------------------------------ paths agree with each other, hooks, env var

struct Problem {
  Shape s;
  t3d_attn_dtype_t dt;
  Buf q, k, v, dout;
  Problem(const Shape &sh, t3d_attn_dtype_t d, unsigned seed)
      : s(sh), dt(d), q(d, sh.B * sh.Hq * sh.Sq * sh.D), k(d, sh.B * sh.Hkv * sh.Sk * sh.D),
        v(d, sh.B * sh.Hkv * sh.Sk * sh.D), dout(d, sh.B * sh.Hq * sh.Sq * sh.D) {
    std::mt19937 rng(seed);
    q.fill(rng, sh.amp);
    k.fill(rng, sh.amp);
    v.fill(rng, 1.0);
    dout.fill(rng, 1.0);
  }
  void forward(const t3d_attn_exec_t *ex, Buf &out, std::vector<float> &lse) {
    lse.assign(s.B * s.Hq * s.Sq, 0.0f);
    ASSERT_EQ(t3d_attn_forward(dt, q.data(), k.data(), v.data(), out.data(), lse.data(), s.B, s.Hq, s.Hkv, s.Sq,
                               s.Sk, s.D, s.causal, NAN, s.qs, s.ks, ex),
              T3D_ATTN_OK);
  }
};

// A parallel-for like at::parallel_for: contiguous chunks on a few std::threads.
std::atomic<int> g_pf_calls{0};
void test_parallel_for(void *ctx, int64_t n, t3d_attn_body_fn body, void *arg) {
  const int nt = *(int *)ctx;
  g_pf_calls++;
  std::vector<std::thread> th;
  const int64_t chunk = (n + nt - 1) / nt;
  for (int64_t b = 0; b < n; b += chunk) th.emplace_back(body, arg, b, std::min(n, b + chunk));
  for (auto &t : th) t.join();
}

TEST(AttnExec, ParallelForHookAndThreadCountsGiveSameResult) {
  Shape s{2, 4, 2, 150, 170, 64, true, 20, 0, 1.0};
  Problem pr(s, T3D_ATTN_FLOAT32, 7);
  const size_t nq = pr.q.size(), nk = pr.k.size();
  Buf out1(pr.dt, nq), out2(pr.dt, nq), out3(pr.dt, nq);
  std::vector<float> l1, l2, l3;
  t3d_attn_exec_t one = {};
  one.nthreads = 1;
  pr.forward(&one, out1, l1);
  t3d_attn_exec_t three = {};
  three.nthreads = 3;
  pr.forward(&three, out2, l2);
  int nt = 3;
  t3d_attn_exec_t hook = {};
  hook.parallel_for = test_parallel_for;
  hook.parallel_ctx = &nt;
  g_pf_calls = 0;
  pr.forward(&hook, out3, l3);
  EXPECT_GT(g_pf_calls.load(), 0);
  // Tasks are independent: the split cannot change a bit of the forward.
  EXPECT_EQ(out1.f, out2.f);
  EXPECT_EQ(out1.f, out3.f);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(l1, l3);

  Buf dq1(pr.dt, nq), dk1(pr.dt, nk), dv1(pr.dt, nk), dq3(pr.dt, nq), dk3(pr.dt, nk), dv3(pr.dt, nk);
  ASSERT_EQ(t3d_attn_backward(pr.dt, pr.dout.data(), pr.q.data(), pr.k.data(), pr.v.data(), out1.data(), l1.data(),
                              dq1.data(), dk1.data(), dv1.data(), s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, s.causal, NAN,
                              s.qs, s.ks, &one),
            T3D_ATTN_OK);
  g_pf_calls = 0;
  ASSERT_EQ(t3d_attn_backward(pr.dt, pr.dout.data(), pr.q.data(), pr.k.data(), pr.v.data(), out1.data(), l1.data(),
                              dq3.data(), dk3.data(), dv3.data(), s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, s.causal, NAN,
                              s.qs, s.ks, &hook),
            T3D_ATTN_OK);
  EXPECT_GT(g_pf_calls.load(), 0);
  // dk/dv: one task owns each key block. dq may be summed over slabs in another order: compare closely.
  EXPECT_EQ(dk1.f, dk3.f);
  EXPECT_EQ(dv1.f, dv3.f);
  expect_close("dq hook vs 1 thread", dq3, dq1.values(), 1e-5);
}

TEST(AttnExec, IsaPathsAgree) {
  // The second shape has the largest head_dim (the AMX path pads it to no more tiles than its buffers hold) and
  // also compares the backward.
  for (const Shape &s :
       {Shape{1, 4, 2, 130, 260, 128, true, 130, 0, 2.0}, Shape{1, 2, 1, 70, 150, 256, true, 80, 0, 1.0}})
    for (t3d_attn_dtype_t dt : {T3D_ATTN_FLOAT32, T3D_ATTN_BFLOAT16}) {
      Problem pr(s, dt, 11);
      Buf ref(dt, pr.q.size());
      std::vector<float> lref;
      t3d_attn_exec_t ex = {};
      ex.isa = T3D_ATTN_ISA_SCALAR;
      pr.forward(&ex, ref, lref);
      const bool bwd = s.D == 256;
      Buf rdq(dt, pr.q.size()), rdk(dt, pr.k.size()), rdv(dt, pr.k.size());
      if (bwd) {
        ASSERT_EQ(t3d_attn_backward(dt, pr.dout.data(), pr.q.data(), pr.k.data(), pr.v.data(), ref.data(), lref.data(),
                                    rdq.data(), rdk.data(), rdv.data(), s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, s.causal,
                                    NAN, s.qs, s.ks, &ex),
                  T3D_ATTN_OK);
      }
      for (t3d_attn_isa_t isa : isas_here()) {
        SCOPED_TRACE(t3d_attn_isa_describe(isa, dt));
        ex.isa = isa;
        Buf out(dt, pr.q.size());
        std::vector<float> l;
        pr.forward(&ex, out, l);
        const double tol = dt == T3D_ATTN_FLOAT32 ? 1e-5 : 2e-2;
        expect_close("out vs scalar", out, ref.values(), tol);
        for (size_t i = 0; i < l.size(); i++) ASSERT_NEAR(l[i], lref[i], 1e-3);
        if (!bwd) continue;
        Buf dq(dt, pr.q.size()), dk(dt, pr.k.size()), dv(dt, pr.k.size());
        ASSERT_EQ(t3d_attn_backward(dt, pr.dout.data(), pr.q.data(), pr.k.data(), pr.v.data(), ref.data(),
                                    lref.data(), dq.data(), dk.data(), dv.data(), s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D,
                                    s.causal, NAN, s.qs, s.ks, &ex),
                  T3D_ATTN_OK);
        const double gtol = dt == T3D_ATTN_FLOAT32 ? 5e-5 : 2e-2;
        expect_close("dq vs scalar", dq, rdq.values(), gtol);
        expect_close("dk vs scalar", dk, rdk.values(), gtol);
        expect_close("dv vs scalar", dv, rdv.values(), gtol);
      }
    }
}

TEST(AttnExec, EnvVarForcesPath) {
  const char *old = std::getenv("T3D_ATTN_ISA");
  std::string saved = old ? old : "";
  setenv("T3D_ATTN_ISA", "scalar", 1);
  EXPECT_EQ(t3d_attn_isa_selected(), T3D_ATTN_ISA_SCALAR);
  setenv("T3D_ATTN_ISA", "avx2", 1);
  EXPECT_EQ(t3d_attn_isa_selected(), t3d_attn_isa_available(T3D_ATTN_ISA_AVX2) ? T3D_ATTN_ISA_AVX2
                                                                               : T3D_ATTN_ISA_SCALAR);
  if (t3d_attn_isa_available(T3D_ATTN_ISA_AVX512)) {
    setenv("T3D_ATTN_ISA", "avx512", 1);
    EXPECT_EQ(t3d_attn_isa_selected(), T3D_ATTN_ISA_AVX512);
  }
  setenv("T3D_ATTN_ISA", "amx", 1);
  EXPECT_EQ(t3d_attn_isa_selected() == T3D_ATTN_ISA_AMX, t3d_attn_isa_available(T3D_ATTN_ISA_AMX) != 0);
  EXPECT_STREQ(t3d_attn_isa_describe(T3D_ATTN_ISA_AMX, T3D_ATTN_FLOAT32), "avx512");
  // A forced path also runs: the scalar path through AUTO matches the explicit scalar path bit for bit.
  Shape s{1, 2, 1, 70, 90, 64, true, 20, 0, 1.0};
  Problem pr(s, T3D_ATTN_FLOAT32, 3);
  Buf a(pr.dt, pr.q.size()), b(pr.dt, pr.q.size());
  std::vector<float> la, lb;
  setenv("T3D_ATTN_ISA", "scalar", 1);
  pr.forward(nullptr, a, la);
  t3d_attn_exec_t ex = {};
  ex.isa = T3D_ATTN_ISA_SCALAR;
  unsetenv("T3D_ATTN_ISA");
  pr.forward(&ex, b, lb);
  EXPECT_EQ(a.f, b.f);
  if (old)
    setenv("T3D_ATTN_ISA", saved.c_str(), 1);
  else
    unsetenv("T3D_ATTN_ISA");
  std::printf("auto path here: float32 %s, bfloat16 %s\n", t3d_attn_isa_describe(T3D_ATTN_ISA_AUTO, T3D_ATTN_FLOAT32),
              t3d_attn_isa_describe(T3D_ATTN_ISA_AUTO, T3D_ATTN_BFLOAT16));
}

TEST(AttnExec, InvalidArguments) {
  float x[64] = {0}, l[4] = {0};
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, l, 1, 3, 2, 1, 1, 16, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);  // 3 % 2
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, l, 1, 1, 1, 1, 1, 0, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);  // head_dim 0
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, l, 1, 1, 1, 1, 1, 257, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);  // head_dim > 256
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, nullptr, x, x, x, l, 1, 1, 1, 1, 1, 16, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, nullptr, 1, 1, 1, 1, 1, 16, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_attn_forward((t3d_attn_dtype_t)9, x, x, x, x, l, 1, 1, 1, 1, 1, 16, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, l, -1, 1, 1, 1, 1, 16, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_attn_backward(T3D_ATTN_FLOAT32, x, x, x, x, x, l, x, nullptr, x, 1, 1, 1, 1, 1, 16, 0, NAN, 0, 0,
                              nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_attn_backward(T3D_ATTN_FLOAT32, x, x, x, x, x, l, x, x, x, 1, 4, 3, 1, 1, 16, 0, NAN, 0, 0, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_attn_merge(T3D_ATTN_FLOAT32, x, nullptr, T3D_ATTN_FLOAT32, x, l, 1, 16, nullptr),
            T3D_ATTN_ERR_INVALID_ARG);
  t3d_attn_exec_t ex = {};
  ex.isa = (t3d_attn_isa_t)42;
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, l, 1, 1, 1, 1, 1, 16, 0, NAN, 0, 0, &ex),
            T3D_ATTN_ERR_INVALID_ARG);
  for (t3d_attn_isa_t isa : {T3D_ATTN_ISA_AVX2, T3D_ATTN_ISA_AVX512})
    if (!t3d_attn_isa_available(isa)) {
      ex.isa = isa;
      EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, x, x, x, x, l, 1, 1, 1, 1, 1, 16, 0, NAN, 0, 0, &ex),
                T3D_ATTN_ERR_UNSUPPORTED);
    }
  // Empty problems are fine, with NULL data.
  EXPECT_EQ(t3d_attn_forward(T3D_ATTN_FLOAT32, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1, 1, 5, 5, 16, 0, NAN,
                             0, 0, nullptr),
            T3D_ATTN_OK);
  EXPECT_EQ(t3d_attn_merge(T3D_ATTN_FLOAT32, nullptr, nullptr, T3D_ATTN_FLOAT32, nullptr, nullptr, 0, 16, nullptr),
            T3D_ATTN_OK);
}

// ------------------------------------------------------------------ merge

struct MergeCase {
  t3d_attn_dtype_t dt;   // input and block output dtype
  t3d_attn_dtype_t acc;  // running output dtype
  bool causal;
};

class MergeTest : public testing::TestWithParam<MergeCase> {};

// Split the keys into random blocks, run the forward on each with its k_start, merge: equals the whole.
TEST_P(MergeTest, SplitKeysMergeEqualsWhole) {
  const MergeCase mc = GetParam();
  Shape s{2, 4, 2, 97, 301, 64, mc.causal, 150, 10, 2.0};
  Problem pr(s, mc.dt, 99);
  const size_t nq = pr.q.size(), rows = s.B * s.Hq * s.Sq;
  Buf whole(mc.dt, nq);
  std::vector<float> lwhole;
  pr.forward(nullptr, whole, lwhole);

  std::mt19937 rng(5);
  for (int nblocks : {1, 2, 5}) {
    std::vector<int64_t> cuts = {0, s.Sk};
    std::uniform_int_distribution<int64_t> u(1, s.Sk - 1);
    while ((int)cuts.size() < nblocks + 1) {
      int64_t c = u(rng);
      if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    Buf run(mc.acc, nq);  // zeros
    std::vector<float> lrun(rows, -INFINITY);
    for (int bi = 0; bi < nblocks; bi++) {
      const int64_t k0 = cuts[bi], nk = cuts[bi + 1] - cuts[bi];
      Buf kb(mc.dt, s.B * s.Hkv * nk * s.D), vb(mc.dt, s.B * s.Hkv * nk * s.D);
      for (int64_t bh = 0; bh < s.B * s.Hkv; bh++)
        for (int64_t j = 0; j < nk; j++)
          for (int64_t e = 0; e < s.D; e++) {
            kb.set((bh * nk + j) * s.D + e, pr.k.get((bh * s.Sk + k0 + j) * s.D + e));
            vb.set((bh * nk + j) * s.D + e, pr.v.get((bh * s.Sk + k0 + j) * s.D + e));
          }
      Buf bo(mc.dt, nq);
      std::vector<float> bl(rows);
      ASSERT_EQ(t3d_attn_forward(mc.dt, pr.q.data(), kb.data(), vb.data(), bo.data(), bl.data(), s.B, s.Hq, s.Hkv,
                                 s.Sq, nk, s.D, s.causal, NAN, s.qs, s.ks + k0, nullptr),
                T3D_ATTN_OK);
      ASSERT_EQ(t3d_attn_merge(mc.acc, run.data(), lrun.data(), mc.dt, bo.data(), bl.data(), (int64_t)rows, s.D,
                               nullptr),
                T3D_ATTN_OK);
    }
    SCOPED_TRACE("blocks " + std::to_string(nblocks));
    const bool bf = mc.dt == T3D_ATTN_BFLOAT16 || mc.acc == T3D_ATTN_BFLOAT16;
    expect_close("merged out", run, whole.values(), bf ? 2e-2 : 1e-5);
    for (size_t r = 0; r < rows; r++) {
      if (lwhole[r] == -INFINITY) {
        ASSERT_EQ(lrun[r], -INFINITY);
      } else {
        ASSERT_NEAR(lrun[r], lwhole[r], 1e-4) << "row " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MergeTest,
                         testing::Values(MergeCase{T3D_ATTN_FLOAT32, T3D_ATTN_FLOAT32, false},
                                         MergeCase{T3D_ATTN_FLOAT32, T3D_ATTN_FLOAT32, true},
                                         MergeCase{T3D_ATTN_BFLOAT16, T3D_ATTN_FLOAT32, true},
                                         MergeCase{T3D_ATTN_BFLOAT16, T3D_ATTN_BFLOAT16, true}),
                         [](const testing::TestParamInfo<MergeCase> &i) {
                           return std::string(i.param.dt == T3D_ATTN_FLOAT32 ? "f32" : "bf16") + "_into_" +
                                  (i.param.acc == T3D_ATTN_FLOAT32 ? "f32" : "bf16") +
                                  (i.param.causal ? "_causal" : "_full");
                         });

TEST(Merge, InfinityRules) {
  const int64_t D = 4;
  float out[3 * D] = {1, 2, 3, 4, 0, 0, 0, 0, 5, 5, 5, 5};
  float lse[3] = {0.5f, -INFINITY, -INFINITY};
  const float blk[3 * D] = {9, 9, 9, 9, 7, 6, 5, 4, 8, 8, 8, 8};
  const float blse[3] = {-INFINITY, 1.25f, -INFINITY};
  ASSERT_EQ(t3d_attn_merge(T3D_ATTN_FLOAT32, out, lse, T3D_ATTN_FLOAT32, blk, blse, 3, D, nullptr), T3D_ATTN_OK);
  // Row 0: an empty block leaves it untouched.
  EXPECT_EQ(lse[0], 0.5f);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[3], 4.0f);
  // Row 1: an empty running row takes the block.
  EXPECT_EQ(lse[1], 1.25f);
  EXPECT_EQ(out[4], 7.0f);
  EXPECT_EQ(out[7], 4.0f);
  // Row 2: both empty stays -inf, out unchanged.
  EXPECT_EQ(lse[2], -INFINITY);
  EXPECT_EQ(out[8], 5.0f);
  // Equal weights average.
  float o2[D] = {1, 1, 1, 1}, l2[1] = {0.0f};
  const float b2[D] = {3, 3, 3, 3}, bl2[1] = {0.0f};
  ASSERT_EQ(t3d_attn_merge(T3D_ATTN_FLOAT32, o2, l2, T3D_ATTN_FLOAT32, b2, bl2, 1, D, nullptr), T3D_ATTN_OK);
  EXPECT_NEAR(o2[0], 2.0f, 1e-6);
  EXPECT_NEAR(l2[0], std::log(2.0f), 1e-6);
}

}  // namespace
