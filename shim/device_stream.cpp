// nativeCudaStream: built with c10/cuda when the torch it is built against has CUDA (T3D_SHIM_CUDA); otherwise it
// raises an error that says this build has no CUDA support.
#include "device_stream.hpp"

#include <c10/util/Exception.h>

#ifdef T3D_SHIM_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace t3d_shim {

#ifdef T3D_SHIM_CUDA
bool cudaStreamsAvailable() {
  return true;
}

bool cudaDevicesPresent() {
  return c10::cuda::device_count() > 0;
}

void* nativeCudaStream(const c10::Stream& stream) {
  return static_cast<void*>(c10::cuda::CUDAStream(stream).stream());
}
#else
bool cudaStreamsAvailable() {
  return false;
}

bool cudaDevicesPresent() {
  return false;
}

void* nativeCudaStream(const c10::Stream& stream) {
  TORCH_CHECK(false, "t3d: this build of t3d's torch shim has no CUDA support (the torch it was built against has no "
              "CUDA, or its CUDA headers were not found); it cannot run collectives on ", stream.device());
}
#endif

}  // namespace t3d_shim
