// WorkT3D: a c10d::Work over one t3d request (or a coalesced group of them), with a real ivalue::Future.
// WorkT3DDevice: the same for CUDA tensors, where completion is an event on the group's stream.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

extern "C" {
#include "t3d.h"
}

#include "flight_recorder.hpp"

namespace t3d_shim {

// The communicator shared by a backend and its works. destroy() runs on the user's thread and does not hold the lock
// while t3d_comm_destroy drains the queue (whose callbacks free requests), so it cannot deadlock with them; a work
// freed or aborted once destruction has begun leaves the communicator alone (t3d releases its requests itself).
struct CommHandle {
  enum State { kAlive, kDestroying, kDead };
  t3d_comm_t* comm = nullptr;
  std::mutex mu;
  std::atomic<State> state{kAlive};
  std::atomic<int> pollers{0};  // threads inside poll(): destroy() waits for them to leave the library

  explicit CommHandle(t3d_comm_t* c) : comm(c) {}
  ~CommHandle();
  // One poll of a waiter on req (t3d_request_poll: it also progresses same-host point-to-point); 1: block now.
  int poll(t3d_request_t* req, uint64_t* since);
  // Frees a request unless the communicator is gone (then t3d released it) or being torn down right now.
  void freeRequest(t3d_request_t* req);
  void abort();
  void destroy();
};

// What every t3d work has: its communicator, its name in messages, its outputs and its sequence number.
class WorkT3DBase : public c10d::Work {
 public:
  const std::vector<at::Tensor>& outputs() const {
    return outputs_;
  }
  // "allreduce #12 on rank 3 of group '0'" (and the device, for CUDA), built when a message needs it.
  std::string describe() const;
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  void abort() override;
  uint64_t getSequencenumber() const override {
    return seq_;
  }
  // The work's entry in the flight recorder (fr::kNoRecord: none).
  void setRecord(uint64_t id) {
    frId_ = id;
  }
  uint64_t record() const {
    return frId_;
  }

 protected:
  WorkT3DBase(std::shared_ptr<CommHandle> comm, int rank, c10d::OpType type, const char* opName, std::string group,
              uint64_t seq, int64_t timeoutMs, std::vector<at::Tensor> outputs,
              c10::optional<c10::Device> device = c10::nullopt);

  std::shared_ptr<CommHandle> comm_;
  const char* opName_;  // a string literal
  std::string group_;
  uint64_t seq_;
  int64_t timeoutMs_;
  std::vector<at::Tensor> outputs_;
  c10::optional<c10::Device> device_;
  uint64_t frId_ = fr::kNoRecord;
};

// Whether an operation's error is one that breaks its group (a timeout, a lost peer, an abort, ranks that disagree):
// the flight recorder dumps on those, not on a bad argument.
inline bool breaksGroup(t3d_result_t r) {
  return r < 0 && r != T3D_ERR_INVALID_ARG && r != T3D_ERR_UNSUPPORTED && r != T3D_ERR_NO_MEMORY;
}

class WorkT3D : public WorkT3DBase {
 public:
  WorkT3D(std::shared_ptr<CommHandle> comm, int rank, c10d::OpType type, const char* opName, std::string group,
          uint64_t seq, int64_t timeoutMs, std::vector<at::Tensor> outputs);
  ~WorkT3D() override;

  // Setup, before arm(): the request this work completes with (owned), tensors to keep alive until completion,
  // and work to do on success before the work counts as complete (copy-back, unflattening). `post` may throw.
  void setRequest(t3d_request_t* req) {
    req_ = req;
  }
  void keepAlive(const at::Tensor& t) {
    keep_.push_back(t);
  }
  void setPost(std::function<void(t3d_request_t*)> post) {
    post_ = std::move(post);
  }
  // Registers the completion callback. The callback holds a reference, so the work lives until it has run.
  void arm();
  // A group work (endCoalescing) completes only after its own request and every member work still pending. Call
  // before arm().
  void dependOn(const c10::intrusive_ptr<WorkT3D>& member);

  t3d_request_t* request() const {
    return req_;
  }

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  static void onRequestDone(void* arg, t3d_result_t res);
  void requestDone(t3d_result_t res);
  // One dependency (own request or member work) finished; the last one completes the work.
  void dependencyDone(std::exception_ptr err);
  void complete(std::exception_ptr err);
  void markFuture();
  std::string errorText(t3d_result_t res, const char* detail) const;
  std::exception_ptr makeError(const std::string& msg) const;

  t3d_request_t* req_ = nullptr;
  std::vector<at::Tensor> keep_;
  std::function<void(t3d_request_t*)> post_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made by the first getFuture(); guarded by Work::mutex_

  // Guarded by Work::mutex_ (as are completed_ and exception_).
  bool futureWanted_ = false;
  int sourceRank_ = -1;
  int pending_ = 1;
  std::exception_ptr firstError_;
  std::vector<c10::intrusive_ptr<WorkT3D>> parents_;
  std::atomic<bool> futureMarked_{false};
  // Set (release) after completed_/exception_ are published under the mutex: lets wait() poll before it sleeps.
  std::atomic<bool> done_{false};
};

// A CUDA operation: NCCL runs it on the group's stream, and the work completes with an event recorded there after
// the operation and its copy-back steps. As with NCCL's works, wait() makes the caller's current stream wait for
// that event and returns at once; with T3D_CUDA_BLOCKING_WAIT=1 it blocks the calling thread until the event has
// passed, up to the operation's timeout, and aborts the group when that runs out.
class WorkT3DDevice : public WorkT3DBase {
 public:
  WorkT3DDevice(std::shared_ptr<CommHandle> comm, int rank, c10d::OpType type, const char* opName, std::string group,
                uint64_t seq, int64_t timeoutMs, std::vector<at::Tensor> outputs, c10::Device device);

  // Once everything the work covers is enqueued on `stream`: records the completion event there, and completes the
  // future in stream order. Until then (inside a coalescing block) the work cannot be waited on.
  void markEnqueued(const c10::Stream& stream);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void checkEnqueued(const char* what) const;
  std::exception_ptr commError() const;

  c10::Device device() const {
    return *device_;
  }

  c10::Event done_;
  std::atomic<bool> enqueued_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // set by markEnqueued
};

}  // namespace t3d_shim
