// ProcessGroupT3D: the c10d::Backend of t3d. One instance serves cpu and cuda tensors and routes by device; every
// collective validates its tensors, hands (pointer, count, dtype) to the C library and returns a WorkT3D.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "store_adapter.hpp"
#include "tensor_args.hpp"
#include "work_t3d.hpp"

namespace t3d_shim {

class ProcessGroupT3D : public c10d::Backend {
 public:
  // Collective over the `size` ranks sharing `store`: builds the t3d communicator.
  static c10::intrusive_ptr<ProcessGroupT3D> create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& groupName,
                                                    const std::vector<int64_t>& globalRanks);

  ProcessGroupT3D(std::shared_ptr<StoreAdapter> store, std::shared_ptr<CommHandle> comm, int rank, int size,
                  std::chrono::milliseconds timeout, std::string groupName, std::vector<int64_t> globalRanks);
  ~ProcessGroupT3D() override;

  const std::string getBackendName() const override {
    return "t3d";
  }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsSplitting() const override {
    return true;
  }
  // torch's batch_isend_irecv brackets its operations with startCoalescing/endCoalescing only when this is true.
  // NCCL needs that for device tensors (a send and a receive between two ranks, enqueued apart on one stream,
  // would wait for each other); a host send never blocks its caller, and torch's per-operation path costs some
  // 20 us less Python per batch. So it is true where this process sees a CUDA device.
  bool supportsCoalescing() const override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                           std::vector<at::Tensor>& inputTensors,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputTensorLists, std::vector<at::Tensor>& inputTensors,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                        std::vector<at::Tensor>& inputTensors,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputTensors,
                                         std::vector<std::vector<at::Tensor>>& inputTensors,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputTensors, std::vector<std::vector<at::Tensor>>& inputTensors,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& outputBuffer, at::Tensor& inputBuffer,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputTensors,
                                          std::vector<at::Tensor>& inputTensors,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  c10d::ErrorType getError() override;
  void abort() override;
  void shutdown() override;

  // For t3d._C introspection.
  std::string transport() const;
  const std::string& groupName() const {
    return groupName_;
  }

 private:
  // One C call, given the call's options (run() adds the device and stream of CUDA tensors to them).
  using Issuer = std::function<t3d_result_t(const t3d_opts_t&, t3d_request_t**)>;
  // What one c10d call turns into: C operations to issue (several run as one t3d group), tensors to keep alive,
  // steps to run after the C operations (copy-back: on completion for host tensors, on the group's stream right
  // after enqueueing for CUDA tensors), and the tensors the future carries.
  struct Plan {
    std::vector<Issuer> issue;
    std::vector<at::Tensor> keep;
    std::vector<std::function<void(t3d_request_t*)>> post;
    std::vector<at::Tensor> outputs;
    double premul = 1.0;  // PREMUL_SUM's factor
    unsigned flags = 0;   // T3D_FLAG_*
    // What the flight recorder notes: the call's input and output tensors (unset: `outputs` for both), and the
    // peer of a send or receive (-2: any source).
    c10::optional<at::TensorList> frIn;
    c10::optional<at::TensorList> frOut;
    int frPeer = -1;
  };
  struct Rop {
    t3d_redop_t op;
    double premul;
  };
  // The stream this group runs CUDA operations on (one per group, made at the first CUDA call, like NCCL's).
  struct DeviceStreams {
    c10::Device device;
    c10::Stream comm;
    c10::Event ready;  // re-recorded by every call: the caller's stream up to the call
  };
  // A CUDA operation enqueued by NCCL (or, inside a coalescing block, to be enqueued at its end), with what must
  // follow on the group's stream: copy-back steps, the allocator's stream bookkeeping, the completion event.
  struct DevicePending {
    std::vector<std::function<void(t3d_request_t*)>> post;
    std::vector<at::Tensor> tensors;
    std::vector<at::Tensor> outputs;
    c10::intrusive_ptr<WorkT3DDevice> work;
    t3d_request_t* req;  // owned; null for a request that is someone else's
  };

  OpCtx ctx(const char* op) const {
    return OpCtx{op, rank_};
  }
  t3d_comm_t* comm() const;
  int64_t timeoutMs(std::chrono::milliseconds t) const;
  t3d_opts_t cOpts(std::chrono::milliseconds t, double premul = 1.0, unsigned flags = 0) const;
  DeviceStreams& deviceStreams(const OpCtx& c);
  [[noreturn]] void fail(const OpCtx& c, t3d_result_t r, const char* what) const;
  void check(const OpCtx& c, t3d_result_t r, const char* what) const {
    if (r != T3D_OK && r != T3D_IN_PROGRESS) fail(c, r, what);
  }
  void checkRoot(const OpCtx& c, int64_t root) const;
  void checkRootTensor(const OpCtx& c, int64_t rootTensor, size_t n) const;
  void checkPeer(const OpCtx& c, const char* arg, int peer) const;
  Rop rop(const OpCtx& c, const c10d::ReduceOp& op) const;

  // Validation and staging for one operation; they append to a Plan and issue nothing.
  void planAllreduce(const OpCtx& c, const char* arg, const at::Tensor& t, Rop r, Plan& p);
  // An uneven list (outputs of different sizes) first agrees on every rank's input size (allgatherInts).
  void planAllgatherList(const OpCtx& c, const char* outArg, const std::vector<at::Tensor>& outs, const char* inArg,
                         const at::Tensor& in, std::chrono::milliseconds timeout, Plan& p);
  // Several tensors of one rank (gloo's multi-tensor calls): each must match the first in dtype and shape.
  void checkSameShapes(const OpCtx& c, const char* listArg, const std::vector<at::Tensor>& ts) const;
  void planAllreduceLocalFold(const OpCtx& c, const std::vector<at::Tensor>& tensors, Rop r, Plan& p);
  // A small allgather of int64 values that the caller waits for at once: sizes agreed before a collective whose
  // shape depends on them. Not inside a coalescing block (it would be held there).
  std::vector<int64_t> allgatherInts(const OpCtx& c, const std::vector<int64_t>& mine,
                                     std::chrono::milliseconds timeout);
  // COO tensors, SUM (and AVG): indices and values are all-gathered and summed on every rank, as gloo does.
  c10::intrusive_ptr<c10d::Work> allreduceSparse(const OpCtx& c, std::vector<at::Tensor>& tensors,
                                                 const c10d::AllreduceOptions& opts);
  void planAllgatherBase(const OpCtx& c, const char* outArg, const at::Tensor& out, const char* inArg,
                         const at::Tensor& in, Plan& p);
  void planReduceScatterList(const OpCtx& c, const at::Tensor& out, const std::vector<at::Tensor>& ins, Rop r,
                             Plan& p);
  void planReduceScatterBase(const OpCtx& c, const char* outArg, const at::Tensor& out, const char* inArg,
                             const at::Tensor& in, Rop r, Plan& p);
  // Issues the plan and wraps it in a work: on host tensors an armed WorkT3D, on CUDA tensors a WorkT3DDevice.
  // asyncOp false: torch waits for the work right away (dist.all_reduce(t) without async_op), so the C call may run
  // the whole collective on this thread (T3D_FLAG_BLOCKING).
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, const OpCtx& c, Plan&& p, std::chrono::milliseconds timeout,
                                     bool asyncOp = true);
  // Issues a plan's C operations (several as one t3d group) and returns the request of them all.
  t3d_request_t* issuePlan(const OpCtx& c, Plan& p, const t3d_opts_t& o);
  c10::intrusive_ptr<c10d::Work> runDevice(c10d::OpType type, const OpCtx& c, Plan&& p, t3d_opts_t o);
  // Waits for the request of NCCL's enqueueing (throwing its error), then runs what follows on the group's stream.
  void finishDevice(const OpCtx& c, DevicePending& pending);
  // The call's entry in the flight recorder (before the plan's outputs move into the work), and what becomes of it
  // when issuing throws: failed, and a dump when the group is broken.
  uint64_t frRecord(c10d::OpType type, const OpCtx& c, const Plan& p, int64_t timeoutMs, bool device);
  void frNotIssued(uint64_t id, const std::exception& e);

  std::shared_ptr<StoreAdapter> store_;
  std::shared_ptr<CommHandle> comm_;
  std::chrono::milliseconds timeout_;
  std::string groupName_;
  std::vector<int64_t> globalRanks_;
  uint64_t seq_ = 0;
  uint64_t splitCount_ = 0;
  // The last split, handed out again when torch repeats the call for its next device type.
  struct SplitMemo {
    std::string name;
    std::vector<int> ranks;
    c10::intrusive_ptr<c10d::Backend> backend;
  };
  std::unique_ptr<SplitMemo> lastSplit_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<WorkT3D>> coalesced_;
  // CUDA operations of the open coalescing block: NCCL enqueues them at endCoalescing.
  std::vector<DevicePending> coalescedDevice_;
  c10::optional<c10::Device> coalescingDevice_;  // the device type of the first operation in the block
  std::unique_ptr<DeviceStreams> streams_;
  size_t frPg_ = 0;        // this group in the flight recorder
  bool frDesc_ = false;    // its description (set by torch after creation) passed on
};

}  // namespace t3d_shim
