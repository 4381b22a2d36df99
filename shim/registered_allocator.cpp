// registered_allocator.cpp: see registered_allocator.hpp.
#include "registered_allocator.hpp"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "t3d.h"

namespace t3d_shim {

namespace {
// Above the default CPU allocator's registration (0), so that SetCPUAllocator takes ours, and the same again to
// give the old one back.
constexpr uint8_t kPriority = 1;
constexpr size_t kPage = 4096;
}  // namespace

RegisteredAllocator& RegisteredAllocator::get() {
  static RegisteredAllocator* instance = new RegisteredAllocator();  // never destroyed: tensors may outlive exit
  return *instance;
}

void RegisteredAllocator::enable(size_t min_bytes, size_t cache_bytes) {
  std::lock_guard<std::mutex> g(mu_);
  min_bytes_ = min_bytes;
  cache_limit_ = cache_bytes;
  if (enabled_) return;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != this) base_ = current;
  c10::SetCPUAllocator(this, kPriority);
  enabled_ = true;
}

void RegisteredAllocator::disable() {
  std::lock_guard<std::mutex> g(mu_);
  if (!enabled_) return;
  c10::SetCPUAllocator(base_, kPriority);
  enabled_ = false;
}

bool RegisteredAllocator::enabled() const {
  std::lock_guard<std::mutex> g(mu_);
  return enabled_;
}

size_t RegisteredAllocator::live_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return live_bytes_;
}

size_t RegisteredAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return cached_bytes_;
}

void RegisteredAllocator::empty_cache() {
  std::multimap<size_t, void*> drop;
  {
    std::lock_guard<std::mutex> g(mu_);
    drop.swap(cache_);
    cached_bytes_ = 0;
  }
  for (auto& kv : drop) t3d_mem_free(kv.second);
}

c10::DataPtr RegisteredAllocator::allocate(size_t n) {
  c10::Allocator* base;
  size_t bytes = (n + kPage - 1) / kPage * kPage;
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    base = base_;
    if (n < min_bytes_ || !enabled_) return base->allocate(n);
    // A cached block of the size, or at most a quarter larger (training steps ask for the same sizes again).
    auto it = cache_.lower_bound(bytes);
    if (it != cache_.end() && it->first <= bytes + bytes / 4) {
      bytes = it->first;
      ptr = it->second;
      cache_.erase(it);
      cached_bytes_ -= bytes;
    }
  }
  if (ptr == nullptr) {
    t3d_result_t r = t3d_mem_alloc(bytes, &ptr);
    if (r != T3D_OK) {
      empty_cache();  // the cache may hold what the system lacks now (memory, file descriptors)
      r = t3d_mem_alloc(bytes, &ptr);
    }
    TORCH_CHECK(r == T3D_OK, "t3d: allocating ", n, " bytes of t3d memory for a CPU tensor (T3D_CPU_ALLOCATOR) "
                "failed: ", t3d_result_string(r));
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    live_[ptr] = bytes;
    live_bytes_ += bytes;
  }
  return {ptr, ptr, &RegisteredAllocator::release, c10::Device(c10::DeviceType::CPU)};
}

void RegisteredAllocator::release(void* ptr) { get().give_back(ptr); }

void RegisteredAllocator::give_back(void* ptr) {
  bool keep = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;  // not ours: cannot happen, as only our DataPtrs name this deleter
    const size_t bytes = it->second;
    live_.erase(it);
    live_bytes_ -= bytes;
    keep = enabled_ && cached_bytes_ + bytes <= cache_limit_;
    if (keep) {
      cache_.emplace(bytes, ptr);
      cached_bytes_ += bytes;
    }
  }
  if (!keep) t3d_mem_free(ptr);
}

void RegisteredAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

}  // namespace t3d_shim
