// Argument checks shared by the CPU/Meta (ops_attention.cpp) and CUDA (ops_attention_cuda.cpp) attention ops.
// Sizes are read as SymInts so the same checks run on fake tensors with dynamic shapes.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>

#include "t3d_attn.h"

namespace t3d_ops {

// float32, bfloat16 and float16 (the CPU kernels take float16 through float32 copies).
inline bool attnDtypeOk(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

inline void checkQkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const char* names[3] = {"q", "k", "v"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& t = *ts[i];
    TORCH_CHECK(t.defined(), "t3d.", op, ": '", names[i], "' is undefined");
    TORCH_CHECK(t.dim() == 4, "t3d.", op, ": '", names[i], "' must be 4-D [batch, heads, seq, head_dim], got ",
                t.dim(), "-D ", t.sym_sizes());
    TORCH_CHECK(attnDtypeOk(t), "t3d.", op, ": '", names[i], "' must be float32, bfloat16 or float16, got ",
                t.scalar_type());
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "t3d.", op, ": '", names[i], "' has dtype ", t.scalar_type(),
                " but 'q' has ", q.scalar_type());
    TORCH_CHECK(t.device() == q.device(), "t3d.", op, ": '", names[i], "' is on ", t.device(), " but 'q' is on ",
                q.device());
  }
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes(), "t3d.", op, ": 'k' ", k.sym_sizes(), " and 'v' ", v.sym_sizes(),
              " must have the same shape");
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0), "t3d.", op, ": 'k' batch ", k.sym_size(0), " != 'q' batch ",
              q.sym_size(0));
  TORCH_CHECK(k.sym_size(3) == q.sym_size(3), "t3d.", op, ": 'k' head_dim ", k.sym_size(3), " != 'q' head_dim ",
              q.sym_size(3));
  TORCH_CHECK(k.sym_size(1) > 0, "t3d.", op, ": 'k' must have at least one head");
  TORCH_CHECK(q.sym_size(1) % k.sym_size(1) == 0, "t3d.", op, ": 'q' heads (", q.sym_size(1),
              ") must be a multiple of 'k'/'v' heads (", k.sym_size(1), ") for grouped-query attention");
  TORCH_CHECK(q.sym_size(3) > 0 && q.sym_size(3) <= T3D_ATTN_MAX_HEAD_DIM, "t3d.", op, ": head_dim ",
              q.sym_size(3), " must be in [1, ", T3D_ATTN_MAX_HEAD_DIM, "]");
}

inline void checkLike(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like, const char* likeName) {
  TORCH_CHECK(t.defined(), "t3d.", op, ": '", name, "' is undefined");
  TORCH_CHECK(t.sym_sizes() == like.sym_sizes(), "t3d.", op, ": '", name, "' has shape ", t.sym_sizes(),
              " but must match '", likeName, "' ", like.sym_sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "t3d.", op, ": '", name, "' has dtype ", t.scalar_type(),
              " but must match '", likeName, "' (", like.scalar_type(), ")");
  TORCH_CHECK(t.device() == like.device(), "t3d.", op, ": '", name, "' is on ", t.device(), " but '", likeName,
              "' is on ", like.device());
}

inline void checkLse(const char* op, const char* name, const at::Tensor& lse, const at::Tensor& q) {
  TORCH_CHECK(lse.defined(), "t3d.", op, ": '", name, "' is undefined");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "t3d.", op, ": '", name, "' must be float32, got ",
              lse.scalar_type());
  TORCH_CHECK(lse.dim() == 3 && lse.sym_size(0) == q.sym_size(0) && lse.sym_size(1) == q.sym_size(1) &&
                  lse.sym_size(2) == q.sym_size(2),
              "t3d.", op, ": '", name, "' has shape ", lse.sym_sizes(), " but must be [batch, heads, seq_q] = [",
              q.sym_size(0), ", ", q.sym_size(1), ", ", q.sym_size(2), "]");
  TORCH_CHECK(lse.device() == q.device(), "t3d.", op, ": '", name, "' is on ", lse.device(), " but 'q' is on ",
              q.device());
}

inline float checkScale(const char* op, const std::optional<double>& scale) {
  if (!scale.has_value()) return std::numeric_limits<float>::quiet_NaN();
  double s = *scale;
  TORCH_CHECK(std::isfinite(s) && s > 0.0, "t3d.", op, ": 'scale' must be a positive finite number, got ", s);
  return static_cast<float>(s);
}

inline void checkMerge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& blockOut,
                const at::Tensor& blockLse) {
  const char* op = "attention_merge_";
  TORCH_CHECK(out.defined() && blockOut.defined(), "t3d.", op, ": 'out' and 'block_out' must be defined");
  TORCH_CHECK(attnDtypeOk(out), "t3d.", op, ": 'out' must be float32, bfloat16 or float16, got ",
              out.scalar_type());
  TORCH_CHECK(attnDtypeOk(blockOut), "t3d.", op, ": 'block_out' must be float32, bfloat16 or float16, got ",
              blockOut.scalar_type());
  TORCH_CHECK(out.dim() == 4, "t3d.", op, ": 'out' must be 4-D [batch, heads, seq, head_dim], got ", out.sym_sizes());
  TORCH_CHECK(blockOut.sym_sizes() == out.sym_sizes(), "t3d.", op, ": 'block_out' has shape ", blockOut.sym_sizes(),
              " but must match 'out' ", out.sym_sizes());
  checkLse(op, "lse", lse, out);
  checkLse(op, "block_lse", blockLse, out);
  TORCH_CHECK(blockOut.device() == out.device(), "t3d.", op, ": 'block_out' is on ", blockOut.device(),
              " but 'out' is on ", out.device());
  // Results are written in place: a copy would lose them.
  TORCH_CHECK(out.is_contiguous(), "t3d.", op, ": 'out' must be contiguous (it is updated in place)");
  TORCH_CHECK(lse.is_contiguous(), "t3d.", op, ": 'lse' must be contiguous (it is updated in place)");
}

// What both forward kernels (CPU, CUDA) start from: contiguous inputs, the outputs allocated, and the cases that need
// no kernel (empty output; no keys: out 0, lse -inf) already answered (`done`).
struct ForwardArgs {
  at::Tensor qc, kc, vc, out, lse;
  int64_t b, hq, hk, sq, sk, d;
  bool done;
};

inline ForwardArgs prepareForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  ForwardArgs a;
  a.qc = q.contiguous();
  a.kc = k.contiguous();
  a.vc = v.contiguous();
  a.b = q.size(0), a.hq = q.size(1), a.sq = q.size(2), a.d = q.size(3), a.hk = k.size(1), a.sk = k.size(2);
  a.out = at::empty_like(a.qc, at::MemoryFormat::Contiguous);
  a.lse = at::empty({a.b, a.hq, a.sq}, q.options().dtype(at::kFloat));
  a.done = a.out.numel() == 0 || a.sk == 0;
  if (a.out.numel() != 0 && a.sk == 0) {
    a.out.zero_();
    a.lse.fill_(-std::numeric_limits<float>::infinity());
  }
  return a;
}

}  // namespace t3d_ops
