/* cudart_abi.h: the part of the CUDA runtime's C ABI that the same-device provider uses, declared here so that
 * libt3d builds without CUDA headers and loads libcudart only when ranks that share a device first exchange CUDA
 * buffers. tests/c/test_cudart_abi.cc compares every value below with the real cuda_runtime_api.h when one is
 * installed. */
#ifndef T3D_CUDART_ABI_H
#define T3D_CUDART_ABI_H

#include <stddef.h>

typedef int t3d_cuda_error_t; /* cudaError_t */
enum {
  T3D_CUDA_SUCCESS = 0,       /* cudaSuccess */
  T3D_CUDA_NOT_READY = 600    /* cudaErrorNotReady: cudaStreamQuery while work is pending */
};

typedef int t3d_cuda_memcpy_kind_t; /* cudaMemcpyKind */
enum {
  T3D_CUDA_MEMCPY_HOST_TO_DEVICE = 1,
  T3D_CUDA_MEMCPY_DEVICE_TO_HOST = 2,
  T3D_CUDA_MEMCPY_DEVICE_TO_DEVICE = 3
};

enum {
  T3D_CUDA_EVENT_DISABLE_TIMING = 2, /* cudaEventDisableTiming */
  T3D_CUDA_EVENT_INTERPROCESS = 4,   /* cudaEventInterprocess */
  T3D_CUDA_IPC_LAZY_PEER_ACCESS = 1  /* cudaIpcMemLazyEnablePeerAccess */
};

/* cudaIpcMemHandle_t and cudaIpcEventHandle_t: 64 opaque bytes, passed by value. */
typedef struct {
  char reserved[64];
} t3d_cuda_ipc_handle_t;

/* The functions, under their runtime names without the "cuda" prefix. A stream is a cudaStream_t (void *; NULL is
 * the legacy default stream). */
typedef struct t3d_cudart_api {
  t3d_cuda_error_t (*RuntimeGetVersion)(int *version);
  t3d_cuda_error_t (*GetDevice)(int *device);
  t3d_cuda_error_t (*SetDevice)(int device);
  t3d_cuda_error_t (*DeviceGetPCIBusId)(char *bus_id, int len, int device);
  t3d_cuda_error_t (*MemcpyAsync)(void *dst, const void *src, size_t count, t3d_cuda_memcpy_kind_t kind,
                                  void *stream);
  t3d_cuda_error_t (*StreamQuery)(void *stream);
  t3d_cuda_error_t (*MallocHost)(void **ptr, size_t size);
  t3d_cuda_error_t (*FreeHost)(void *ptr);
  const char *(*GetErrorString)(t3d_cuda_error_t error);
  /* The device path (ipc.c): its own device buffers and interprocess events, shared through IPC handles. */
  t3d_cuda_error_t (*Malloc)(void **ptr, size_t size);
  t3d_cuda_error_t (*Free)(void *ptr);
  t3d_cuda_error_t (*IpcGetMemHandle)(t3d_cuda_ipc_handle_t *handle, void *ptr);
  t3d_cuda_error_t (*IpcOpenMemHandle)(void **ptr, t3d_cuda_ipc_handle_t handle, unsigned flags);
  t3d_cuda_error_t (*IpcCloseMemHandle)(void *ptr);
  t3d_cuda_error_t (*EventCreateWithFlags)(void **event, unsigned flags);
  t3d_cuda_error_t (*EventDestroy)(void *event);
  t3d_cuda_error_t (*EventRecord)(void *event, void *stream);
  t3d_cuda_error_t (*IpcGetEventHandle)(t3d_cuda_ipc_handle_t *handle, void *event);
  t3d_cuda_error_t (*IpcOpenEventHandle)(void **event, t3d_cuda_ipc_handle_t handle);
  t3d_cuda_error_t (*StreamWaitEvent)(void *stream, void *event, unsigned flags);
  t3d_cuda_error_t (*EventQuery)(void *event); /* T3D_CUDA_NOT_READY while its work is pending */
} t3d_cudart_api_t;

#endif /* T3D_CUDART_ABI_H */
