// Tensor-to-C-buffer conversion for the shim: dtype and reduce-op mapping, device/layout checks, and contiguous
// staging with a copy-back. Every check names the collective, the argument and the rank.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

extern "C" {
#include "t3d.h"
}

namespace t3d_shim {

// Who is asking: used in every message. checkTensor records the device of the call's first tensor, which every
// other tensor of the call must share.
struct OpCtx {
  const char* op;  // the c10d name, e.g. "allreduce"
  int rank;
  mutable c10::optional<at::Device> device = c10::nullopt;
  mutable std::string deviceArg = std::string();
};

// How a tensor travels through the C library. `scale` converts torch elements to C elements: 1 for a mapped dtype,
// the element size when a dtype without a C equivalent moves as bytes (data-movement collectives only).
struct CType {
  t3d_dtype_t dtype;
  size_t scale;
};

// The tensor's dtype for a reduction; throws naming the argument when t3d cannot reduce it.
CType reduceType(const OpCtx& c, const char* arg, const at::Tensor& t);
// The tensor's dtype for a data-movement collective: a mapped dtype, or bytes.
CType moveType(const OpCtx& c, const char* arg, const at::Tensor& t);

// The reduce op and, for PREMUL_SUM, its scalar (from a double or a one-element tensor supplement).
t3d_redop_t mapReduceOp(const OpCtx& c, const c10d::ReduceOp& op, double* premul);
// Rejects op/dtype pairs the C library cannot reduce (e.g. BAND on float, MIN on complex).
void checkReduceSupported(const OpCtx& c, const char* arg, t3d_redop_t op, const at::Tensor& t, t3d_dtype_t dt);

// Device (cpu or cuda, the same for every tensor of a call), layout and definedness.
void checkTensor(const OpCtx& c, const char* arg, const at::Tensor& t);
void checkSameDtype(const OpCtx& c, const char* arg, const at::Tensor& t, const at::Tensor& ref, const char* refArg);
void checkListSize(const OpCtx& c, const char* arg, size_t got, size_t want);

// A contiguous buffer for a user tensor. `buf` aliases `user` when it is contiguous; otherwise it is a staging copy
// (filled from `user` when `copyIn`) that copyBack() writes into `user` after completion.
struct Staged {
  at::Tensor user;
  at::Tensor buf;
  bool staged = false;
  void copyBack() const {
    if (staged) user.copy_(buf);
  }
};
Staged stage(const at::Tensor& t, bool copyIn);

inline void* dataPtr(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : t.data_ptr();
}

std::string shapeStr(const at::Tensor& t);

}  // namespace t3d_shim
