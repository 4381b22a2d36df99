// Dtype/op mapping, argument checks and contiguous staging for the shim (see tensor_args.hpp).
#include "tensor_args.hpp"

#include <sstream>

namespace t3d_shim {

namespace {

bool mapDtype(at::ScalarType st, t3d_dtype_t* out) {
  switch (st) {
    case at::kChar: *out = T3D_INT8; return true;
    case at::kByte: *out = T3D_UINT8; return true;
    case at::kInt: *out = T3D_INT32; return true;
    case at::kLong: *out = T3D_INT64; return true;
    case at::kHalf: *out = T3D_FLOAT16; return true;
    case at::kBFloat16: *out = T3D_BFLOAT16; return true;
    case at::kFloat: *out = T3D_FLOAT32; return true;
    case at::kDouble: *out = T3D_FLOAT64; return true;
    case at::kBool: *out = T3D_BOOL; return true;
    case at::kComplexFloat: *out = T3D_COMPLEX64; return true;
    case at::kComplexDouble: *out = T3D_COMPLEX128; return true;
    default: return false;
  }
}

const char* redopName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

}  // namespace

// Strings are built with std::to_string, not ostringstreams: see flight_recorder.cpp (addGroup).
std::string shapeStr(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

CType reduceType(const OpCtx& c, const char* arg, const at::Tensor& t) {
  t3d_dtype_t dt;
  TORCH_CHECK(mapDtype(t.scalar_type(), &dt), "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg,
              "' has dtype ", t.scalar_type(),
              ", which t3d cannot reduce (supported: int8, uint8, int32, int64, float16, bfloat16, float32, float64, "
              "bool, complex64, complex128)");
  return CType{dt, 1};
}

CType moveType(const OpCtx& c, const char* arg, const at::Tensor& t) {
  t3d_dtype_t dt;
  if (mapDtype(t.scalar_type(), &dt)) return CType{dt, 1};
  // Movement does not look at values: any other dtype (int16, uint16, float8, ...) travels as its bytes.
  return CType{T3D_UINT8, static_cast<size_t>(t.element_size())};
}

t3d_redop_t mapReduceOp(const OpCtx& c, const c10d::ReduceOp& op, double* premul) {
  *premul = 1.0;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return T3D_SUM;
    case c10d::ReduceOp::AVG: return T3D_AVG;
    case c10d::ReduceOp::PRODUCT: return T3D_PROD;
    case c10d::ReduceOp::MIN: return T3D_MIN;
    case c10d::ReduceOp::MAX: return T3D_MAX;
    case c10d::ReduceOp::BAND: return T3D_BAND;
    case c10d::ReduceOp::BOR: return T3D_BOR;
    case c10d::ReduceOp::BXOR: return T3D_BXOR;
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(sup != nullptr, "t3d: ", c.op, " on rank ", c.rank,
                  ": PREMUL_SUM without its scalar (build it with torch.distributed._make_nccl_premul_sum)");
      if (sup->tensor_factor.defined()) {
        TORCH_CHECK(sup->tensor_factor.numel() == 1, "t3d: ", c.op, " on rank ", c.rank,
                    ": the PREMUL_SUM factor must have one element, got shape ", shapeStr(sup->tensor_factor));
        // A real factor is all the C library takes; a complex one would need a complex scalar.
        TORCH_CHECK(!sup->tensor_factor.is_complex(), "t3d: ", c.op, " on rank ", c.rank,
                    ": a complex PREMUL_SUM factor is not supported");
        *premul = sup->tensor_factor.to(at::kCPU).to(at::kDouble).item<double>();
      } else {
        *premul = sup->double_factor;
      }
      return T3D_PREMUL_SUM;
    }
    default:
      TORCH_CHECK(false, "t3d: ", c.op, " on rank ", c.rank, ": unsupported reduce op ", redopName(op.op_));
  }
}

void checkReduceSupported(const OpCtx& c, const char* arg, t3d_redop_t op, const at::Tensor& t, t3d_dtype_t dt) {
  t3d_result_t r = t3d_redop_supported(op, dt);
  TORCH_CHECK(r == T3D_OK, "t3d: ", c.op, " on rank ", c.rank, ": reduce op ", t3d_redop_name(op),
              " is not supported for argument '", arg, "' of dtype ", t.scalar_type(), " (", t3d_result_string(r),
              ")");
}

void checkTensor(const OpCtx& c, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg, "' is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg,
              "' is on device ", t.device(), "; t3d serves cpu and cuda tensors");
  TORCH_CHECK(t.layout() == at::kStrided, "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg, "' has layout ",
              t.layout(), "; only dense (strided) tensors are supported");
  if (!c.device) {
    c.device = t.device();
    c.deviceArg = arg;
  }
  TORCH_CHECK(*c.device == t.device(), "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg, "' is on ",
              t.device(), " but '", c.deviceArg, "' is on ", *c.device, "; the tensors of one call share a device");
}

void checkSameDtype(const OpCtx& c, const char* arg, const at::Tensor& t, const at::Tensor& ref, const char* refArg) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg,
              "' has dtype ", t.scalar_type(), " but '", refArg, "' has dtype ", ref.scalar_type());
}

void checkListSize(const OpCtx& c, const char* arg, size_t got, size_t want) {
  TORCH_CHECK(got == want, "t3d: ", c.op, " on rank ", c.rank, ": argument '", arg, "' must hold ", want,
              " tensor(s), got ", got);
}

Staged stage(const at::Tensor& t, bool copyIn) {
  Staged s;
  s.user = t;
  if (t.is_contiguous()) {
    s.buf = t;
  } else {
    s.buf = copyIn ? t.contiguous() : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
    s.staged = true;
  }
  return s;
}

}  // namespace t3d_shim
