// t3d_store_t callbacks forwarding to a c10d::Store. Exceptions never cross into C: they become result codes.
#include "store_adapter.hpp"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace t3d_shim {

StoreAdapter::StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {
  cstore_.ctx = this;
  cstore_.set = &StoreAdapter::set;
  cstore_.get = &StoreAdapter::getKey;
}

t3d_result_t StoreAdapter::set(void* ctx, const char* key, const void* value, size_t len) {
  auto* self = static_cast<StoreAdapter*>(ctx);
  try {
    const auto* p = static_cast<const uint8_t*>(value);
    std::vector<uint8_t> v(p, p + len);
    self->store_->set(std::string(key), v);
    return T3D_OK;
  } catch (const std::exception& e) {
    LOG(WARNING) << "t3d: store set('" << key << "') failed: " << e.what();
    return T3D_ERR_SYSTEM;
  }
}

t3d_result_t StoreAdapter::getKey(void* ctx, const char* key, void** value, size_t* len, int64_t timeout_ms) {
  auto* self = static_cast<StoreAdapter*>(ctx);
  *value = nullptr;
  *len = 0;
  std::string k(key);
  try {
    // wait() honours our timeout; a bare get() would use the store's own (often 30 min).
    auto timeout = timeout_ms < 0 ? self->store_->getTimeout() : std::chrono::milliseconds(timeout_ms);
    self->store_->wait({k}, timeout);
  } catch (const c10::DistStoreError& e) {
    // c10d stores report a wait that ran out of time as DistStoreError ("Timeout waiting for key ...").
    return T3D_ERR_TIMEOUT;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (msg.find("imeout") != std::string::npos || msg.find("timed out") != std::string::npos) return T3D_ERR_TIMEOUT;
    LOG(WARNING) << "t3d: store wait('" << k << "') failed: " << msg;
    return T3D_ERR_SYSTEM;
  }
  try {
    std::vector<uint8_t> v = self->store_->get(k);
    // malloc(0) may return NULL; t3d frees what it gets, so always hand it a real block.
    void* out = std::malloc(v.empty() ? 1 : v.size());
    if (out == nullptr) return T3D_ERR_NO_MEMORY;
    if (!v.empty()) std::memcpy(out, v.data(), v.size());
    *value = out;
    *len = v.size();
    return T3D_OK;
  } catch (const std::exception& e) {
    LOG(WARNING) << "t3d: store get('" << k << "') failed: " << e.what();
    return T3D_ERR_SYSTEM;
  }
}

}  // namespace t3d_shim
