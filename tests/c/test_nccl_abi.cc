// test_nccl_abi.cc: nccl_abi.h against the real nccl.h, at compile time: every result code, data type, reduction
// operator and constant, and the layout of the ncclConfig_t head that t3d fills; and cudart_abi.h (the staged
// same-device path) against cuda_runtime_api.h: its values and the signatures of the functions it resolves. Built
// only where nccl.h exists; links nothing from NCCL or CUDA.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <cstddef>
#include <type_traits>

#include "cudev/cudart_abi.h"
#include "nccl/nccl_abi.h"

namespace {

// The two sides are different enum types; compare their values.
#define SAME_VALUE(ours, nccls) \
  static_assert(static_cast<long long>(ours) == static_cast<long long>(nccls), #ours " != " #nccls)

// Results.
SAME_VALUE(T3D_NCCL_SUCCESS, ncclSuccess);
SAME_VALUE(T3D_NCCL_UNHANDLED_CUDA_ERROR, ncclUnhandledCudaError);
SAME_VALUE(T3D_NCCL_SYSTEM_ERROR, ncclSystemError);
SAME_VALUE(T3D_NCCL_INTERNAL_ERROR, ncclInternalError);
SAME_VALUE(T3D_NCCL_INVALID_ARGUMENT, ncclInvalidArgument);
SAME_VALUE(T3D_NCCL_INVALID_USAGE, ncclInvalidUsage);
SAME_VALUE(T3D_NCCL_REMOTE_ERROR, ncclRemoteError);
SAME_VALUE(T3D_NCCL_IN_PROGRESS, ncclInProgress);
static_assert(sizeof(t3d_nccl_result_t) == sizeof(ncclResult_t), "ncclResult_t is passed by value and pointer");

// Data types.
SAME_VALUE(T3D_NCCL_INT8, ncclInt8);
SAME_VALUE(T3D_NCCL_UINT8, ncclUint8);
SAME_VALUE(T3D_NCCL_INT32, ncclInt32);
SAME_VALUE(T3D_NCCL_UINT32, ncclUint32);
SAME_VALUE(T3D_NCCL_INT64, ncclInt64);
SAME_VALUE(T3D_NCCL_UINT64, ncclUint64);
SAME_VALUE(T3D_NCCL_FLOAT16, ncclFloat16);
SAME_VALUE(T3D_NCCL_FLOAT32, ncclFloat32);
SAME_VALUE(T3D_NCCL_FLOAT64, ncclFloat64);
SAME_VALUE(T3D_NCCL_BFLOAT16, ncclBfloat16);
static_assert(sizeof(t3d_nccl_dtype_t) == sizeof(ncclDataType_t), "ncclDataType_t");

// Reduction operators; PreMulSum operators are numbered from ncclNumOps.
SAME_VALUE(T3D_NCCL_SUM, ncclSum);
SAME_VALUE(T3D_NCCL_PROD, ncclProd);
SAME_VALUE(T3D_NCCL_MAX, ncclMax);
SAME_VALUE(T3D_NCCL_MIN, ncclMin);
SAME_VALUE(T3D_NCCL_AVG, ncclAvg);
SAME_VALUE(T3D_NCCL_NUM_OPS, ncclNumOps);
static_assert(sizeof(t3d_nccl_redop_t) == sizeof(ncclRedOp_t), "ncclRedOp_t is written through a pointer");

SAME_VALUE(T3D_NCCL_SCALAR_HOST_IMMEDIATE, ncclScalarHostImmediate);
static_assert(sizeof(int) == sizeof(ncclScalarResidence_t), "ncclScalarResidence_t is passed as an int");

// The unique id travels by value through the store and into ncclCommInitRankConfig.
static_assert(T3D_NCCL_UNIQUE_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "NCCL_UNIQUE_ID_BYTES");
static_assert(sizeof(t3d_nccl_unique_id_t) == sizeof(ncclUniqueId), "sizeof ncclUniqueId");
static_assert(alignof(t3d_nccl_unique_id_t) == alignof(ncclUniqueId), "alignof ncclUniqueId");

// ncclConfig_t: t3d fills the head that NCCL 2.14 defined; the fields must sit where NCCL reads them.
static_assert(offsetof(t3d_nccl_config_t, size) == offsetof(ncclConfig_t, size), "config.size");
static_assert(offsetof(t3d_nccl_config_t, magic) == offsetof(ncclConfig_t, magic), "config.magic");
static_assert(offsetof(t3d_nccl_config_t, version) == offsetof(ncclConfig_t, version), "config.version");
static_assert(offsetof(t3d_nccl_config_t, blocking) == offsetof(ncclConfig_t, blocking), "config.blocking");
static_assert(offsetof(t3d_nccl_config_t, cga_cluster_size) == offsetof(ncclConfig_t, cgaClusterSize),
              "config.cgaClusterSize");
static_assert(offsetof(t3d_nccl_config_t, min_ctas) == offsetof(ncclConfig_t, minCTAs), "config.minCTAs");
static_assert(offsetof(t3d_nccl_config_t, max_ctas) == offsetof(ncclConfig_t, maxCTAs), "config.maxCTAs");
static_assert(offsetof(t3d_nccl_config_t, net_name) == offsetof(ncclConfig_t, netName), "config.netName");
static_assert(sizeof(t3d_nccl_config_t) <= sizeof(ncclConfig_t), "the t3d config is a head of NCCL's");
static_assert(std::is_same<decltype(ncclConfig_t{}.size), decltype(t3d_nccl_config_t{}.size)>::value, "size type");
static_assert(std::is_same<decltype(ncclConfig_t{}.magic), decltype(t3d_nccl_config_t{}.magic)>::value, "magic type");
static_assert(std::is_same<decltype(ncclConfig_t{}.version), decltype(t3d_nccl_config_t{}.version)>::value,
              "version type");
static_assert(NCCL_CONFIG_UNDEF_INT == T3D_NCCL_CONFIG_UNDEF_INT, "NCCL_CONFIG_UNDEF_INT");

// The magic is only spelled inside NCCL_CONFIG_INITIALIZER.
constexpr ncclConfig_t kInitializer = NCCL_CONFIG_INITIALIZER;
static_assert(kInitializer.magic == T3D_NCCL_CONFIG_MAGIC, "ncclConfig_t magic");
static_assert(kInitializer.blocking == T3D_NCCL_CONFIG_UNDEF_INT, "the initializer leaves blocking undefined");
// The version t3d writes must be one that every NCCL from 2.14.3 on accepts, i.e. not newer than this header's.
static_assert(T3D_NCCL_CONFIG_VERSION <= NCCL_VERSION_CODE, "config version");
static_assert(T3D_NCCL_CONFIG_VERSION == NCCL_VERSION(2, 14, 3), "config version is 2.14.3");

// The function table against NCCL's declarations. t3d spells ncclComm_t, cudaStream_t and the enums with its own
// types, so each parameter is compared by shape: size, pointer or not (and const pointee), integer/enum or not.
template <class A, class B>
struct SameShape
    : std::integral_constant<
          bool, sizeof(A) == sizeof(B) && std::is_pointer<A>::value == std::is_pointer<B>::value &&
                    std::is_const<typename std::remove_pointer<A>::type>::value ==
                        std::is_const<typename std::remove_pointer<B>::type>::value &&
                    (std::is_integral<A>::value || std::is_enum<A>::value) ==
                        (std::is_integral<B>::value || std::is_enum<B>::value)> {};
template <class F, class G>
struct SameSignature : std::false_type {};
template <class R1, class... A1, class R2, class... A2>
struct SameSignature<R1 (*)(A1...), R2 (*)(A2...)>
    : std::integral_constant<bool, SameShape<R1, R2>::value && (SameShape<A1, A2>::value && ...)> {};

#define SAME_SIGNATURE(field, fn)                                                             \
  static_assert(SameSignature<decltype(t3d_nccl_api_t::field), decltype(&fn)>::value, #fn \
                " differs from t3d_nccl_api_t::" #field)
SAME_SIGNATURE(GetVersion, ncclGetVersion);
SAME_SIGNATURE(GetUniqueId, ncclGetUniqueId);
SAME_SIGNATURE(CommInitRankConfig, ncclCommInitRankConfig);
SAME_SIGNATURE(CommFinalize, ncclCommFinalize);
SAME_SIGNATURE(CommDestroy, ncclCommDestroy);
SAME_SIGNATURE(CommAbort, ncclCommAbort);
SAME_SIGNATURE(CommGetAsyncError, ncclCommGetAsyncError);
SAME_SIGNATURE(GetErrorString, ncclGetErrorString);
SAME_SIGNATURE(GetLastError, ncclGetLastError);
SAME_SIGNATURE(RedOpCreatePreMulSum, ncclRedOpCreatePreMulSum);
SAME_SIGNATURE(RedOpDestroy, ncclRedOpDestroy);
SAME_SIGNATURE(AllReduce, ncclAllReduce);
SAME_SIGNATURE(Broadcast, ncclBroadcast);
SAME_SIGNATURE(Reduce, ncclReduce);
SAME_SIGNATURE(AllGather, ncclAllGather);
SAME_SIGNATURE(ReduceScatter, ncclReduceScatter);
SAME_SIGNATURE(Send, ncclSend);
SAME_SIGNATURE(Recv, ncclRecv);
SAME_SIGNATURE(GroupStart, ncclGroupStart);
SAME_SIGNATURE(GroupEnd, ncclGroupEnd);
static_assert(sizeof(t3d_nccl_comm_t) == sizeof(ncclComm_t), "ncclComm_t is a pointer");
static_assert(sizeof(t3d_cuda_stream_t) == sizeof(cudaStream_t), "cudaStream_t is a pointer");

// The CUDA runtime (c_src/cudev/cudart_abi.h).
SAME_VALUE(T3D_CUDA_SUCCESS, cudaSuccess);
SAME_VALUE(T3D_CUDA_NOT_READY, cudaErrorNotReady);
SAME_VALUE(T3D_CUDA_MEMCPY_HOST_TO_DEVICE, cudaMemcpyHostToDevice);
SAME_VALUE(T3D_CUDA_MEMCPY_DEVICE_TO_HOST, cudaMemcpyDeviceToHost);
static_assert(sizeof(t3d_cuda_error_t) == sizeof(cudaError_t), "cudaError_t is returned by value");
static_assert(sizeof(t3d_cuda_memcpy_kind_t) == sizeof(cudaMemcpyKind), "cudaMemcpyKind is passed by value");
static_assert(sizeof(void *) == sizeof(cudaStream_t), "a stream travels as void *");
// Each function's parameters, one by one, as t3d calls them (the real ones take the runtime's enums and handles).
static_assert(std::is_same<decltype(&cudaDeviceGetPCIBusId), cudaError_t (*)(char *, int, int)>::value, "");
static_assert(std::is_same<decltype(&cudaSetDevice), cudaError_t (*)(int)>::value, "");
static_assert(std::is_same<decltype(&cudaGetDevice), cudaError_t (*)(int *)>::value, "");
static_assert(std::is_same<decltype(&cudaRuntimeGetVersion), cudaError_t (*)(int *)>::value, "");
static_assert(std::is_same<decltype(&cudaFreeHost), cudaError_t (*)(void *)>::value, "");
static_assert(std::is_same<decltype(&cudaStreamQuery), cudaError_t (*)(cudaStream_t)>::value, "");
static_assert(std::is_same<decltype(&cudaGetErrorString), const char *(*)(cudaError_t)>::value, "");
static_assert(std::is_same<decltype(static_cast<cudaError_t (*)(void **, size_t)>(&cudaMallocHost)),
                           cudaError_t (*)(void **, size_t)>::value, "");
static_assert(std::is_same<decltype(&cudaMemcpyAsync),
                           cudaError_t (*)(void *, const void *, size_t, cudaMemcpyKind, cudaStream_t)>::value, "");
// The device path (c_src/cudev/ipc.c).
SAME_VALUE(T3D_CUDA_MEMCPY_DEVICE_TO_DEVICE, cudaMemcpyDeviceToDevice);
SAME_VALUE(T3D_CUDA_EVENT_DISABLE_TIMING, cudaEventDisableTiming);
SAME_VALUE(T3D_CUDA_EVENT_INTERPROCESS, cudaEventInterprocess);
SAME_VALUE(T3D_CUDA_IPC_LAZY_PEER_ACCESS, cudaIpcMemLazyEnablePeerAccess);
static_assert(sizeof(t3d_cuda_ipc_handle_t) == sizeof(cudaIpcMemHandle_t), "cudaIpcMemHandle_t is passed by value");
static_assert(sizeof(t3d_cuda_ipc_handle_t) == sizeof(cudaIpcEventHandle_t), "so is cudaIpcEventHandle_t");
static_assert(alignof(t3d_cuda_ipc_handle_t) == alignof(cudaIpcMemHandle_t), "");
static_assert(sizeof(void *) == sizeof(cudaEvent_t), "an event travels as void *");
static_assert(std::is_same<decltype(static_cast<cudaError_t (*)(void **, size_t)>(&cudaMalloc)),
                           cudaError_t (*)(void **, size_t)>::value, "");
static_assert(std::is_same<decltype(&cudaFree), cudaError_t (*)(void *)>::value, "");
static_assert(std::is_same<decltype(&cudaIpcGetMemHandle), cudaError_t (*)(cudaIpcMemHandle_t *, void *)>::value, "");
static_assert(std::is_same<decltype(&cudaIpcOpenMemHandle),
                           cudaError_t (*)(void **, cudaIpcMemHandle_t, unsigned int)>::value, "");
static_assert(std::is_same<decltype(&cudaIpcCloseMemHandle), cudaError_t (*)(void *)>::value, "");
static_assert(std::is_same<decltype(&cudaEventCreateWithFlags), cudaError_t (*)(cudaEvent_t *, unsigned int)>::value,
              "");
static_assert(std::is_same<decltype(&cudaEventDestroy), cudaError_t (*)(cudaEvent_t)>::value, "");
static_assert(std::is_same<decltype(static_cast<cudaError_t (*)(cudaEvent_t, cudaStream_t)>(&cudaEventRecord)),
                           cudaError_t (*)(cudaEvent_t, cudaStream_t)>::value, "");
static_assert(std::is_same<decltype(&cudaIpcGetEventHandle), cudaError_t (*)(cudaIpcEventHandle_t *, cudaEvent_t)>::value,
              "");
static_assert(std::is_same<decltype(&cudaIpcOpenEventHandle), cudaError_t (*)(cudaEvent_t *, cudaIpcEventHandle_t)>::value,
              "");
static_assert(std::is_same<decltype(&cudaEventQuery), cudaError_t (*)(cudaEvent_t)>::value, "");
static_assert(std::is_same<decltype(static_cast<cudaError_t (*)(cudaStream_t, cudaEvent_t, unsigned int)>(
                               &cudaStreamWaitEvent)),
                           cudaError_t (*)(cudaStream_t, cudaEvent_t, unsigned int)>::value, "");

TEST(NcclAbi, CheckedAtCompileTime) {
  // The static_asserts above are the test; this records the header the build compared against.
  EXPECT_GE(NCCL_VERSION_CODE, NCCL_VERSION(2, 14, 3)) << "nccl.h is older than the 2.14.3 that t3d needs";
  RecordProperty("nccl_h_version", NCCL_VERSION_CODE);
}

}  // namespace
