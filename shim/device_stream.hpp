// The native handle of a torch stream (a cudaStream_t) for the C library; the rest of the shim's CUDA handling uses
// torch's device-generic streams, events and guards and needs no CUDA headers.
#pragma once

#include <c10/core/Stream.h>

namespace t3d_shim {

// Whether this build can hand CUDA streams to the C library (torch was built with CUDA and its headers were found).
bool cudaStreamsAvailable();
// Whether this process sees a CUDA device (false without CUDA support or without a GPU).
bool cudaDevicesPresent();
// The cudaStream_t behind a CUDA stream; throws when cudaStreamsAvailable() is false.
void* nativeCudaStream(const c10::Stream& stream);

}  // namespace t3d_shim
