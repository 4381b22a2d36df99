// registered_allocator.hpp: an opt-in CPU allocator for torch that puts large tensors in t3d memory
// (t3d_mem_alloc), so that collectives on them read and write the peers' tensors in place (README, "Registered
// memory"). Smaller allocations go to the allocator it replaced.
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

namespace t3d_shim {

class RegisteredAllocator final : public c10::Allocator {
 public:
  // The one instance (torch keeps a raw pointer to the CPU allocator: static lifetime).
  static RegisteredAllocator& get();

  // Makes torch's CPU allocations of at least min_bytes come from t3d memory, keeping up to cache_bytes of freed
  // blocks for reuse (their pages already touched, their mappings in the peers still valid). Again with other
  // values: they replace the old ones.
  void enable(size_t min_bytes, size_t cache_bytes);
  // Gives torch back the allocator enable() replaced; tensors allocated meanwhile stay valid and return their
  // blocks here when freed.
  void disable();
  bool enabled() const;
  // Bytes held now: in live tensors, and freed but cached.
  size_t live_bytes() const;
  size_t cached_bytes() const;
  // Frees every cached block.
  void empty_cache();

  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

 private:
  RegisteredAllocator() = default;
  static void release(void* ptr);
  void give_back(void* ptr);

  mutable std::mutex mu_;
  c10::Allocator* base_ = nullptr;  // the allocator torch had before enable()
  bool enabled_ = false;
  size_t min_bytes_ = 0, cache_limit_ = 0;
  std::unordered_map<void*, size_t> live_;  // block -> its bytes
  std::multimap<size_t, void*> cache_;      // freed blocks by size
  size_t live_bytes_ = 0, cached_bytes_ = 0;
};

}  // namespace t3d_shim
