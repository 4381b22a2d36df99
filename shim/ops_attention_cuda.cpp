// t3d._C_cuda: CUDA kernels of the torch.ops.t3d attention ops (schemas live in t3d._C), calling the plain-C
// interface of kernels/cuda/attn_cuda.cu on the current stream, and the device reduction it registers with libt3d
// (kernels/cuda/reduce_cuda.cu) for ranks that share a GPU. Built only when nvcc and torch's CUDA are found.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <Python.h>

#include <limits>

#include "ops_attention.hpp"
#include "t3d_attn_cuda.h"
#include "t3d_reduce_cuda.h"

namespace t3d_ops {
namespace {

int cudaDtype(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? 1 : t.scalar_type() == at::kHalf ? 2 : 0;
}

void checkCuda(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cuda(), "t3d.", op, ": '", name, "' must be a CUDA tensor for the CUDA kernel, got ",
              t.device());
}

void checkRc(const char* op, int rc) {
  TORCH_CHECK(rc == 0, "t3d.", op, ": CUDA kernel failed: ", t3d_attn_cuda_error_string(rc));
}

std::tuple<at::Tensor, at::Tensor> attentionCuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 bool causal, std::optional<double> scale, int64_t qStart,
                                                 int64_t kStart) {
  const char* op = "attention";
  checkQkv(op, q, k, v);
  checkCuda(op, q, "q");
  float s = checkScale(op, scale);
  c10::cuda::CUDAGuard guard(q.device());
  ForwardArgs a = prepareForward(q, k, v);
  if (a.done) return {a.out, a.lse};
  void* st = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  checkRc(op, t3d_attn_cuda_forward(cudaDtype(q), a.qc.data_ptr(), a.kc.data_ptr(), a.vc.data_ptr(),
                                    a.out.data_ptr(), a.lse.data_ptr<float>(), a.b, a.hq, a.hk, a.sq, a.sk, a.d,
                                    causal ? 1 : 0, s, qStart, kStart, st));
  return {a.out, a.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attentionBackwardCuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, std::optional<double> scale, int64_t qStart, int64_t kStart) {
  const char* op = "attention_backward";
  checkQkv(op, q, k, v);
  checkLike(op, "dout", dout, q, "q");
  checkLike(op, "out", out, q, "q");
  checkLse(op, "lse", lse, q);
  checkCuda(op, q, "q");
  float s = checkScale(op, scale);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor dc = dout.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3), hk = k.size(1), sk = k.size(2);
  at::Tensor dq = at::zeros_like(qc, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::zeros_like(kc, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::zeros_like(vc, at::MemoryFormat::Contiguous);
  if (dq.numel() == 0 || dk.numel() == 0) return {dq, dk, dv};
  at::Tensor delta = at::empty({b * hq * sq}, q.options().dtype(at::kFloat));
  void* st = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  checkRc(op, t3d_attn_cuda_backward(cudaDtype(q), dc.data_ptr(), qc.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                     oc.data_ptr(), lc.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(),
                                     dv.data_ptr(), delta.data_ptr<float>(), b, hq, hk, sq, sk, d, causal ? 1 : 0, s,
                                     qStart, kStart, st));
  return {dq, dk, dv};
}

void attentionMergeCuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& blockOut,
                        const at::Tensor& blockLse) {
  const char* op = "attention_merge_";
  checkMerge(out, lse, blockOut, blockLse);
  checkCuda(op, out, "out");
  checkCuda(op, lse, "lse");
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  at::Tensor bo = blockOut.contiguous(), bl = blockLse.contiguous();
  void* st = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  checkRc(op, t3d_attn_cuda_merge(cudaDtype(out), out.data_ptr(), lse.data_ptr<float>(), cudaDtype(bo),
                                  bo.data_ptr(), bl.data_ptr<float>(), out.size(0) * out.size(1) * out.size(2),
                                  out.size(3), st));
}

}  // namespace
}  // namespace t3d_ops

// The schemas come from t3d._C, which t3d.ops imports first.
TORCH_LIBRARY_IMPL(t3d, CUDA, m) {
  m.impl("attention", &t3d_ops::attentionCuda);
  m.impl("attention_backward", &t3d_ops::attentionBackwardCuda);
  m.impl("attention_merge_", &t3d_ops::attentionMergeCuda);
}

// A bare extension module: importing it runs the registration above.
static struct PyModuleDef t3dCudaModule = {PyModuleDef_HEAD_INIT, "_C_cuda",
                                           "t3d CUDA attention kernels (registered with torch.ops.t3d on import)",
                                           -1, nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C_cuda(void) {
  // The device reduction of ranks that share a GPU (libt3d's T3D_CUDA_PATH=ipc) comes from here too.
  t3d_cuda_set_kernels(t3d_cuda_reduce_kernels());
  return PyModule_Create(&t3dCudaModule);
}
