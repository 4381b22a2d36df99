/* nccl_abi.h: the part of NCCL's C ABI that t3d uses, declared here so that libt3d builds without CUDA or NCCL
 * headers and loads libnccl.so.2 only when a CUDA buffer first arrives. tests/c/test_nccl_abi.cc compares every
 * value and layout below with the real nccl.h when one is installed. */
#ifndef T3D_NCCL_ABI_H
#define T3D_NCCL_ABI_H

#include <stddef.h>

typedef int t3d_nccl_result_t; /* ncclResult_t */
enum {
  T3D_NCCL_SUCCESS = 0,
  T3D_NCCL_UNHANDLED_CUDA_ERROR = 1,
  T3D_NCCL_SYSTEM_ERROR = 2,
  T3D_NCCL_INTERNAL_ERROR = 3,
  T3D_NCCL_INVALID_ARGUMENT = 4,
  T3D_NCCL_INVALID_USAGE = 5,
  T3D_NCCL_REMOTE_ERROR = 6,
  T3D_NCCL_IN_PROGRESS = 7
};

typedef int t3d_nccl_dtype_t; /* ncclDataType_t */
enum {
  T3D_NCCL_INT8 = 0,
  T3D_NCCL_UINT8 = 1,
  T3D_NCCL_INT32 = 2,
  T3D_NCCL_UINT32 = 3,
  T3D_NCCL_INT64 = 4,
  T3D_NCCL_UINT64 = 5,
  T3D_NCCL_FLOAT16 = 6,
  T3D_NCCL_FLOAT32 = 7,
  T3D_NCCL_FLOAT64 = 8,
  T3D_NCCL_BFLOAT16 = 9
};

typedef int t3d_nccl_redop_t; /* ncclRedOp_t; values from NUM_OPS up are made by ncclRedOpCreatePreMulSum */
enum {
  T3D_NCCL_SUM = 0,
  T3D_NCCL_PROD = 1,
  T3D_NCCL_MAX = 2,
  T3D_NCCL_MIN = 3,
  T3D_NCCL_AVG = 4,
  T3D_NCCL_NUM_OPS = 5
};

enum { T3D_NCCL_SCALAR_HOST_IMMEDIATE = 1 }; /* ncclScalarResidence_t */

#define T3D_NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[T3D_NCCL_UNIQUE_ID_BYTES];
} t3d_nccl_unique_id_t;

typedef struct t3d_nccl_comm_opaque *t3d_nccl_comm_t; /* ncclComm_t */
typedef void *t3d_cuda_stream_t;                     /* cudaStream_t */

/* The head of ncclConfig_t as NCCL 2.14 defined it. NCCL reads a config by its `size` and `version`, so later
 * libraries accept this shorter one; every field a version adds after netName stays at its default. */
#define T3D_NCCL_CONFIG_MAGIC 0xcafebeefu
#define T3D_NCCL_CONFIG_VERSION 21403 /* 2.14.3 */
#define T3D_NCCL_CONFIG_UNDEF_INT (-2147483647 - 1)
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cga_cluster_size;
  int min_ctas;
  int max_ctas;
  const char *net_name;
} t3d_nccl_config_t;

/* The functions, resolved by name from the library. */
typedef struct t3d_nccl_api {
  t3d_nccl_result_t (*GetVersion)(int *version);
  t3d_nccl_result_t (*GetUniqueId)(t3d_nccl_unique_id_t *id);
  t3d_nccl_result_t (*CommInitRankConfig)(t3d_nccl_comm_t *comm, int nranks, t3d_nccl_unique_id_t id, int rank,
                                          t3d_nccl_config_t *config);
  t3d_nccl_result_t (*CommFinalize)(t3d_nccl_comm_t comm);
  t3d_nccl_result_t (*CommDestroy)(t3d_nccl_comm_t comm);
  t3d_nccl_result_t (*CommAbort)(t3d_nccl_comm_t comm);
  t3d_nccl_result_t (*CommGetAsyncError)(t3d_nccl_comm_t comm, t3d_nccl_result_t *err);
  const char *(*GetErrorString)(t3d_nccl_result_t res);
  const char *(*GetLastError)(t3d_nccl_comm_t comm);
  t3d_nccl_result_t (*RedOpCreatePreMulSum)(t3d_nccl_redop_t *op, void *scalar, t3d_nccl_dtype_t dt, int residence,
                                            t3d_nccl_comm_t comm);
  t3d_nccl_result_t (*RedOpDestroy)(t3d_nccl_redop_t op, t3d_nccl_comm_t comm);
  t3d_nccl_result_t (*AllReduce)(const void *sendbuf, void *recvbuf, size_t count, t3d_nccl_dtype_t dt,
                                 t3d_nccl_redop_t op, t3d_nccl_comm_t comm, t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*Broadcast)(const void *sendbuf, void *recvbuf, size_t count, t3d_nccl_dtype_t dt, int root,
                                 t3d_nccl_comm_t comm, t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*Reduce)(const void *sendbuf, void *recvbuf, size_t count, t3d_nccl_dtype_t dt,
                              t3d_nccl_redop_t op, int root, t3d_nccl_comm_t comm, t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*AllGather)(const void *sendbuf, void *recvbuf, size_t sendcount, t3d_nccl_dtype_t dt,
                                 t3d_nccl_comm_t comm, t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*ReduceScatter)(const void *sendbuf, void *recvbuf, size_t recvcount, t3d_nccl_dtype_t dt,
                                     t3d_nccl_redop_t op, t3d_nccl_comm_t comm, t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*Send)(const void *buf, size_t count, t3d_nccl_dtype_t dt, int peer, t3d_nccl_comm_t comm,
                            t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*Recv)(void *buf, size_t count, t3d_nccl_dtype_t dt, int peer, t3d_nccl_comm_t comm,
                            t3d_cuda_stream_t stream);
  t3d_nccl_result_t (*GroupStart)(void);
  t3d_nccl_result_t (*GroupEnd)(void);
} t3d_nccl_api_t;

#endif /* T3D_NCCL_ABI_H */
