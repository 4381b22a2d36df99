// WorkT3D completion: t3d's progress thread calls onRequestDone, which runs the post step (copy-back), marks the
// work complete and, when someone holds the future, completes the future on an inter-op thread (user callbacks
// attached with then() may block on further collectives, which must not stall the progress thread).
#include "work_t3d.hpp"

#include <chrono>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/jit_type.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <thread>

namespace t3d_shim {

namespace {
// Slack on top of the operation's own timeout, so that the C library's timeout (whose message names the ranks that
// did not arrive) normally wins over the shim's.
constexpr int64_t kWaitGraceMs = 5000;
}  // namespace

CommHandle::~CommHandle() {
  destroy();
}

void CommHandle::freeRequest(t3d_request_t* req) {
  std::lock_guard<std::mutex> lk(mu);
  if (state == kAlive) t3d_request_free(req);
}

int CommHandle::poll(t3d_request_t* req, uint64_t* since) {
  pollers.fetch_add(1);
  int block = state.load() == kAlive && req != nullptr ? t3d_request_poll(req, since) : t3d_backoff_poll(since);
  pollers.fetch_sub(1);
  return block;
}

void CommHandle::abort() {
  std::lock_guard<std::mutex> lk(mu);
  if (state != kDead && comm != nullptr) t3d_comm_abort(comm);
}

void CommHandle::destroy() {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (state != kAlive || comm == nullptr) return;
    state = kDestroying;
  }
  // A waiter inside poll() leaves within a millisecond; none enters after the state changed.
  while (pollers.load() != 0) std::this_thread::yield();
  t3d_comm_destroy(comm);
  std::lock_guard<std::mutex> lk(mu);
  state = kDead;
}

WorkT3DBase::WorkT3DBase(std::shared_ptr<CommHandle> comm, int rank, c10d::OpType type, const char* opName,
                         std::string group, uint64_t seq, int64_t timeoutMs, std::vector<at::Tensor> outputs,
                         c10::optional<c10::Device> device)
    // The base class opens a profiler range when given a title; without a profiler attached it would still allocate
    // one per call, so the title is passed only when someone listens.
    : Work(rank, type, at::hasCallbacks() ? (std::string("t3d:") + opName).c_str() : nullptr),
      comm_(std::move(comm)),
      opName_(opName),
      group_(std::move(group)),
      seq_(seq),
      timeoutMs_(timeoutMs),
      outputs_(std::move(outputs)),
      device_(device) {
}

std::string WorkT3DBase::describe() const {
  std::string s = std::string(opName_) + " #" + std::to_string(seq_) + " on rank " + std::to_string(rank_) +
                  " of group '" + group_ + "'";
  if (device_) s += " (" + device_->str() + ")";
  return s;
}

void WorkT3DBase::abort() {
  if (comm_) comm_->abort();
}

WorkT3D::WorkT3D(std::shared_ptr<CommHandle> comm, int rank, c10d::OpType type, const char* opName,
                 std::string group, uint64_t seq, int64_t timeoutMs, std::vector<at::Tensor> outputs)
    : WorkT3DBase(std::move(comm), rank, type, opName, std::move(group), seq, timeoutMs, std::move(outputs)) {
}

WorkT3D::~WorkT3D() {
  if (req_ != nullptr && comm_) comm_->freeRequest(req_);
}

void WorkT3D::arm() {
  TORCH_INTERNAL_ASSERT(req_ != nullptr, "t3d: arm() without a request");
  // The callback owns one reference until it has run.
  WorkT3D* ref = c10::intrusive_ptr<WorkT3D>::unsafe_reclaim_from_nonowning(this).release();
  t3d_result_t r = t3d_request_set_callback(req_, &WorkT3D::onRequestDone, ref);
  if (r != T3D_OK) {
    c10::intrusive_ptr<WorkT3D>::reclaim(ref);
    C10_THROW_ERROR(DistBackendError,
                    c10::str("t3d: ", describe(), ": cannot register the completion callback: ", t3d_result_string(r)));
  }
}

void WorkT3D::dependOn(const c10::intrusive_ptr<WorkT3D>& member) {
  std::unique_lock<std::mutex> ml(member->mutex_);
  if (member->completed_) {
    std::exception_ptr e = member->exception_;
    ml.unlock();
    if (e) {
      std::lock_guard<std::mutex> lk(mutex_);
      if (!firstError_) firstError_ = e;
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mutex_);
    ++pending_;
  }
  member->parents_.push_back(c10::intrusive_ptr<WorkT3D>::unsafe_reclaim_from_nonowning(this));
}

void WorkT3D::onRequestDone(void* arg, t3d_result_t res) {
  auto self = c10::intrusive_ptr<WorkT3D>::reclaim(static_cast<WorkT3D*>(arg));
  try {
    self->requestDone(res);
  } catch (const std::exception& e) {
    // Nothing may unwind into C; requestDone only throws on allocation failure.
    LOG(ERROR) << "t3d: completion of " << self->describe() << " failed: " << e.what();
  }
}

void WorkT3D::requestDone(t3d_result_t res) {
  std::exception_ptr err;
  std::string text;
  if (res == T3D_OK) {
    if (opType_ == c10d::OpType::RECV || opType_ == c10d::OpType::RECVANYSOURCE) {
      std::lock_guard<std::mutex> lk(mutex_);
      sourceRank_ = t3d_request_source(req_);
    }
    if (post_) {
      try {
        post_(req_);
      } catch (const c10::Error& e) {
        err = std::current_exception();
        text = e.what_without_backtrace();
      } catch (const std::exception& e) {
        err = std::current_exception();
        text = e.what();
      } catch (...) {
        err = std::current_exception();
      }
    }
  } else {
    text = errorText(res, t3d_request_error(req_));
    err = makeError(text);
  }
  // Before the work completes: whoever sees the error finds the dump written.
  fr::Recorder& rec = fr::Recorder::get();
  rec.retire(frId_, err == nullptr, text);
  if (breaksGroup(res)) rec.dumpOnFailure(text);
  dependencyDone(err);
}

void WorkT3D::dependencyDone(std::exception_ptr err) {
  std::exception_ptr final;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (err && !firstError_) firstError_ = err;
    if (--pending_ > 0) return;
    final = firstError_;
  }
  complete(final);
}

void WorkT3D::complete(std::exception_ptr err) {
  std::function<void()> recordEnd;
  std::vector<c10::intrusive_ptr<WorkT3D>> parents;
  bool wantFuture;
  // Staging buffers and inputs are no longer needed; outputs stay for result() and the future.
  post_ = nullptr;
  keep_.clear();
  {
    std::lock_guard<std::mutex> lk(mutex_);
    completed_ = true;
    exception_ = err;
    wantFuture = futureWanted_;
    recordEnd = std::move(recordFunctionEndCallback_);
    recordFunctionEndCallback_ = nullptr;
    parents.swap(parents_);
  }
  done_.store(true, std::memory_order_release);
  if (recordEnd) recordEnd();
  cv_.notify_all();
  for (auto& p : parents) p->dependencyDone(err);
  if (wantFuture) {
    auto self = c10::intrusive_ptr<WorkT3D>::unsafe_reclaim_from_nonowning(this);
    at::launch([self]() { self->markFuture(); });
  }
}

void WorkT3D::markFuture() {
  if (futureMarked_.exchange(true)) return;
  std::exception_ptr e;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    e = exception_;
    future = future_;
  }
  if (e) {
    future->setError(e);
  } else {
    future->markCompleted(c10::IValue(outputs_));
  }
}

std::string WorkT3D::errorText(t3d_result_t res, const char* detail) const {
  std::string msg = c10::str("t3d: ", describe(), " failed: ", t3d_result_string(res));
  if (detail != nullptr && detail[0] != '\0') msg += c10::str(": ", detail);
  return msg;
}

std::exception_ptr WorkT3D::makeError(const std::string& msg) const {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

bool WorkT3D::isCompleted() {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_;
}

bool WorkT3D::isSuccess() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return !exception_;
}

std::exception_ptr WorkT3D::exception() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return exception_;
}

int WorkT3D::sourceRank() const {
  std::lock_guard<std::mutex> lk(mutex_);
  TORCH_CHECK(opType_ == c10d::OpType::RECV || opType_ == c10d::OpType::RECVANYSOURCE,
              "t3d: sourceRank() is only defined for receives, not for ", describe());
  TORCH_CHECK(completed_, "t3d: sourceRank() of ", describe(), " before it completed");
  return sourceRank_;
}

bool WorkT3D::wait(std::chrono::milliseconds timeout) {
  int64_t ms = timeout == kNoTimeout ? timeoutMs_ + kWaitGraceMs : timeout.count();
  // Poll as t3d's own waits do (spin, yield, then block): a small collective completes in microseconds, and waking
  // from a condition variable costs tens of them; with more ranks than cores the library cuts polling short.
  const auto start = std::chrono::steady_clock::now();
  uint64_t since = 0;
  while (!done_.load(std::memory_order_acquire) && !(comm_ ? comm_->poll(req_, &since) : t3d_backoff_poll(&since))) {
  }
  std::unique_lock<std::mutex> lk(mutex_);
  bool done = cv_.wait_until(lk, start + std::chrono::milliseconds(ms), [this] { return completed_; });
  if (!done) {
    lk.unlock();
    std::string msg = c10::str("t3d: wait timed out after ", ms, " ms: ", describe(),
                               " has not completed (it keeps running; abort the group to stop it)");
    fr::Recorder::get().dumpOnFailure(msg);
    C10_THROW_ERROR(DistBackendError, msg);
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkT3D::getFuture() {
  // Made on first request (most works are only waited on): one type object for all of them.
  static const c10::TypePtr kTensorList = c10::ListType::create(c10::TensorType::get());
  bool done;
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (!future_) future_ = c10::make_intrusive<c10::ivalue::Future>(kTensorList);
    futureWanted_ = true;
    done = completed_;
    f = future_;
  }
  if (done) markFuture();
  return f;
}

// ---- WorkT3DDevice ---------------------------------------------------------------------------------------------

namespace {
const c10::TypePtr& tensorListType() {
  static const c10::TypePtr kTensorList = c10::ListType::create(c10::TensorType::get());
  return kTensorList;
}

// T3D_CUDA_BLOCKING_WAIT, through libt3d's registry of parameters (declared in c_src/base/params.def): a BOOL, on
// when set to a nonzero integer. Looked up once.
bool blockingWait() {
  static const bool on = [] {
    t3d_param_t p;
    return t3d_param_find("T3D_CUDA_BLOCKING_WAIT", &p) == T3D_OK && p.value != 0;
  }();
  return on;
}
}  // namespace

WorkT3DDevice::WorkT3DDevice(std::shared_ptr<CommHandle> comm, int rank, c10d::OpType type, const char* opName,
                             std::string group, uint64_t seq, int64_t timeoutMs, std::vector<at::Tensor> outputs,
                             c10::Device device)
    : WorkT3DBase(std::move(comm), rank, type, opName, std::move(group), seq, timeoutMs, std::move(outputs), device),
      done_(device.type()) {
}

void WorkT3DDevice::markEnqueued(const c10::Stream& stream) {
  done_.record(stream);
  // The future's value is ready in the order of this stream: consumers wait for it there (what NCCL's works do).
  auto future = c10::make_intrusive<c10::ivalue::Future>(tensorListType(), std::vector<c10::Device>{device()});
  {
    c10::StreamGuard guard(stream);
    future->markCompleted(c10::IValue(outputs_));
  }
  {
    std::lock_guard<std::mutex> lk(mutex_);
    future_ = std::move(future);
  }
  enqueued_.store(true, std::memory_order_release);
}

void WorkT3DDevice::checkEnqueued(const char* what) const {
  TORCH_CHECK(enqueued_.load(std::memory_order_acquire), "t3d: ", what, " of ", describe(),
              " before its coalescing block ended: wait on the work that endCoalescing returns");
}

std::exception_ptr WorkT3DDevice::commError() const {
  std::lock_guard<std::mutex> lk(comm_->mu);
  if (comm_->state != CommHandle::kAlive) return nullptr;
  t3d_result_t r = t3d_comm_status(comm_->comm);
  if (r == T3D_OK) return nullptr;
  try {
    C10_THROW_ERROR(DistBackendError, c10::str("t3d: ", describe(), ": ", t3d_result_string(r), ": ",
                                               t3d_comm_last_error(comm_->comm)));
  } catch (...) {
    return std::current_exception();
  }
}

bool WorkT3DDevice::isCompleted() {
  return enqueued_.load(std::memory_order_acquire) && done_.query();
}

bool WorkT3DDevice::isSuccess() const {
  return commError() == nullptr;
}

std::exception_ptr WorkT3DDevice::exception() const {
  return commError();
}

void WorkT3DDevice::synchronize() {
  checkEnqueued("synchronize()");
  c10::impl::VirtualGuardImpl impl(device().type());
  done_.block(impl.getStream(device()));
}

bool WorkT3DDevice::wait(std::chrono::milliseconds timeout) {
  checkEnqueued("wait()");
  if (blockingWait()) {
    int64_t ms = timeout == kNoTimeout ? timeoutMs_ : timeout.count();
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    uint64_t since = 0;
    while (!done_.query()) {
      if (std::chrono::steady_clock::now() > until) {
        // A device that never finishes is a lost peer or a desynchronised group: end the group as NCCL's watchdog
        // does, so that nothing queued after this waits for it too.
        comm_->abort();
        std::string msg =
            c10::str("t3d: ", describe(), " did not complete on the device within ", ms, " ms; the group was aborted");
        fr::Recorder::get().dumpOnFailure(msg);
        C10_THROW_ERROR(DistBackendError, msg);
      }
      if (t3d_backoff_poll(&since)) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  } else {
    synchronize();
  }
  if (std::exception_ptr e = commError()) std::rethrow_exception(e);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkT3DDevice::getFuture() {
  checkEnqueued("getFuture()");
  std::lock_guard<std::mutex> lk(mutex_);
  return future_;
}

}  // namespace t3d_shim
