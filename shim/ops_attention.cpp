// torch.ops.t3d attention ops: schemas, argument checks, CPU kernels over kernels/t3d_attn.h and Meta (fake)
// kernels. The CUDA kernels are registered by the separate module t3d._C_cuda (ops_attention_cuda.cpp), so that a
// CUDA problem can never stop the CPU ops from loading.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "ops_attention.hpp"
#include "t3d_attn.h"

namespace t3d_ops {

namespace {

t3d_attn_dtype_t attnDtype(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? T3D_ATTN_BFLOAT16 : T3D_ATTN_FLOAT32;
}

// The kernels run on their own small pthread team, sized by torch's intra-op thread count so that
// torch.set_num_threads governs it. Not at::parallel_for: with ATen's OpenMP backend that template runs its body
// inline unless the calling file is itself compiled with OpenMP, which this one is not (it ran single-threaded).
t3d_attn_exec_t atenExec() {
  t3d_attn_exec_t e{};
  e.parallel_for = nullptr;
  e.parallel_ctx = nullptr;
  e.nthreads = at::in_parallel_region() ? 1 : at::get_num_threads();
  e.isa = T3D_ATTN_ISA_AUTO;
  return e;
}

void checkRc(const char* op, int rc) {
  if (rc == T3D_ATTN_OK) return;
  const char* what = rc == T3D_ATTN_ERR_INVALID_ARG   ? "invalid argument"
                     : rc == T3D_ATTN_ERR_NO_MEMORY   ? "out of memory"
                     : rc == T3D_ATTN_ERR_UNSUPPORTED ? "unsupported instruction set"
                     : rc == T3D_ATTN_ERR_SYSTEM      ? "thread creation failed"
                                                      : "unknown error";
  TORCH_CHECK(false, "t3d.", op, ": CPU kernel failed with code ", rc, " (", what, ")");
}

void checkCpu(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "t3d.", op, ": '", name, "' must be a CPU tensor for the CPU kernel, got ",
              t.device());
}

bool isHalf(const at::Tensor& t) { return t.scalar_type() == at::kHalf; }
at::Tensor toFloat(const at::Tensor& t) { return t.to(at::kFloat); }

std::tuple<at::Tensor, at::Tensor> attentionCpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool causal, std::optional<double> scale, int64_t qStart,
                                                int64_t kStart) {
  const char* op = "attention";
  checkQkv(op, q, k, v);
  checkCpu(op, q, "q");
  float s = checkScale(op, scale);
  if (isHalf(q)) {  // the CPU kernels have no float16: float32 copies in, the result rounded to float16
    auto [out, lse] = attentionCpu(toFloat(q), toFloat(k), toFloat(v), causal, scale, qStart, kStart);
    return {out.to(at::kHalf), lse};
  }
  ForwardArgs a = prepareForward(q, k, v);
  if (a.done) return {a.out, a.lse};
  t3d_attn_exec_t e = atenExec();
  int rc = t3d_attn_forward(attnDtype(q), a.qc.data_ptr(), a.kc.data_ptr(), a.vc.data_ptr(), a.out.data_ptr(),
                            a.lse.data_ptr<float>(), a.b, a.hq, a.hk, a.sq, a.sk, a.d, causal ? 1 : 0, s, qStart,
                            kStart, &e);
  checkRc(op, rc);
  return {a.out, a.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attentionBackwardCpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, std::optional<double> scale, int64_t qStart, int64_t kStart) {
  const char* op = "attention_backward";
  checkQkv(op, q, k, v);
  checkLike(op, "dout", dout, q, "q");
  checkLike(op, "out", out, q, "q");
  checkLse(op, "lse", lse, q);
  checkCpu(op, q, "q");
  float s = checkScale(op, scale);
  if (isHalf(q)) {  // as the forward: in float32, gradients rounded to float16
    auto [dq, dk, dv] = attentionBackwardCpu(toFloat(dout), toFloat(q), toFloat(k), toFloat(v), toFloat(out), lse,
                                             causal, scale, qStart, kStart);
    return {dq.to(at::kHalf), dk.to(at::kHalf), dv.to(at::kHalf)};
  }
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor dc = dout.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3), hk = k.size(1), sk = k.size(2);
  at::Tensor dq = at::empty_like(qc, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::empty_like(kc, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::empty_like(vc, at::MemoryFormat::Contiguous);
  if (dq.numel() == 0 || dk.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  t3d_attn_exec_t e = atenExec();
  int rc = t3d_attn_backward(attnDtype(q), dc.data_ptr(), qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), oc.data_ptr(),
                             lc.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), b, hq, hk, sq, sk, d,
                             causal ? 1 : 0, s, qStart, kStart, &e);
  checkRc(op, rc);
  return {dq, dk, dv};
}

void attentionMergeCpu(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& blockOut,
                       const at::Tensor& blockLse) {
  const char* op = "attention_merge_";
  checkMerge(out, lse, blockOut, blockLse);
  checkCpu(op, out, "out");
  if (out.numel() == 0) return;
  if (isHalf(out)) {  // merged into a float32 copy of out, then written back rounded
    at::Tensor out32 = toFloat(out);
    attentionMergeCpu(out32, lse, blockOut, blockLse);
    out.copy_(out32);
    return;
  }
  at::Tensor bo = isHalf(blockOut) ? toFloat(blockOut) : blockOut.contiguous(), bl = blockLse.contiguous();
  t3d_attn_exec_t e = atenExec();
  int rc = t3d_attn_merge(attnDtype(out), out.data_ptr(), lse.data_ptr<float>(), attnDtype(bo), bo.data_ptr(),
                          bl.data_ptr<float>(), out.size(0) * out.size(1) * out.size(2), out.size(3), &e);
  checkRc(op, rc);
}

// ---- Meta (fake) kernels: shapes and dtypes only, symbolic sizes kept for torch.compile's dynamic shapes ----------

std::tuple<at::Tensor, at::Tensor> attentionMeta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 bool causal, std::optional<double> scale, int64_t qStart,
                                                 int64_t kStart) {
  checkQkv("attention", q, k, v);
  checkScale("attention", scale);
  at::Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  at::Tensor lse =
      at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)}, q.options().dtype(at::kFloat));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attentionBackwardMeta(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, std::optional<double> scale, int64_t qStart, int64_t kStart) {
  const char* op = "attention_backward";
  checkQkv(op, q, k, v);
  checkLike(op, "dout", dout, q, "q");
  checkLike(op, "out", out, q, "q");
  checkLse(op, "lse", lse, q);
  checkScale(op, scale);
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(v.sym_sizes(), v.options())};
}

void attentionMergeMeta(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& blockOut,
                        const at::Tensor& blockLse) {
  checkMerge(out, lse, blockOut, blockLse);
}

}  // namespace

}  // namespace t3d_ops

TORCH_LIBRARY(t3d, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, int q_start=0, int k_start=0)"
      " -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal=False,"
      " float? scale=None, int q_start=0, int k_start=0) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("attention_merge_(Tensor(a!) out, Tensor(b!) lse, Tensor block_out, Tensor block_lse) -> ()");
}

TORCH_LIBRARY_IMPL(t3d, CPU, m) {
  m.impl("attention", &t3d_ops::attentionCpu);
  m.impl("attention_backward", &t3d_ops::attentionBackwardCpu);
  m.impl("attention_merge_", &t3d_ops::attentionMergeCpu);
}

TORCH_LIBRARY_IMPL(t3d, Meta, m) {
  m.impl("attention", &t3d_ops::attentionMeta);
  m.impl("attention_backward", &t3d_ops::attentionBackwardMeta);
  m.impl("attention_merge_", &t3d_ops::attentionMergeMeta);
}
