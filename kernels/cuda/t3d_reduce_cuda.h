/* t3d_reduce_cuda.h: the device reduction of reduce_cuda.cu, in the form libt3d registers (t3d_cuda_set_kernels):
 * t3d._C_cuda hands it to libt3d when it loads, so that ranks sharing a GPU reduce on it (T3D_CUDA_PATH=ipc). */
#ifndef T3D_REDUCE_CUDA_H
#define T3D_REDUCE_CUDA_H

#include "t3d.h"

#ifdef __cplusplus
extern "C" {
#endif

const t3d_cuda_kernels_t *t3d_cuda_reduce_kernels(void);

#ifdef __cplusplus
}
#endif
#endif /* T3D_REDUCE_CUDA_H */
