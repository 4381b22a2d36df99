// t3d_store_t over a c10d::Store: the bootstrap key-value exchange of t3d_comm_init / t3d_comm_split.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

extern "C" {
#include "t3d.h"
}

namespace t3d_shim {

// Owns the t3d_store_t that a communicator points at; it must outlive every communicator made from it, so backends
// (and the backends split from them) share it through a shared_ptr.
class StoreAdapter {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store);
  StoreAdapter(const StoreAdapter&) = delete;
  StoreAdapter& operator=(const StoreAdapter&) = delete;

  const t3d_store_t* get() const {
    return &cstore_;
  }

 private:
  static t3d_result_t set(void* ctx, const char* key, const void* value, size_t len);
  static t3d_result_t getKey(void* ctx, const char* key, void** value, size_t* len, int64_t timeout_ms);

  c10::intrusive_ptr<c10d::Store> store_;
  t3d_store_t cstore_;
};

}  // namespace t3d_shim
