// ProcessGroupT3D: argument checks and the mapping of each c10d collective onto t3d's non-blocking C calls.
#include "process_group_t3d.hpp"

#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "device_stream.hpp"

#include <algorithm>
#include <numeric>

namespace t3d_shim {

namespace {

// Elements in one row along dim 0 (alltoall splits count rows).
int64_t rowElems(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

std::vector<size_t> prefixSums(const std::vector<size_t>& counts) {
  std::vector<size_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

// The timeout of a group's operations. torch always hands one over (init_process_group's or new_group's `timeout`,
// 30 minutes by default), so T3D_TIMEOUT_MS, when the user sets it, replaces it: the t3d-specific setting is the
// more specific one. A later pg._set_pg_timeout (setTimeout) and a timeout given to one call (the c10d options'
// `timeout`) still win over both. README.md, "Timeouts".
std::chrono::milliseconds groupTimeout(std::chrono::milliseconds fromTorch) {
  t3d_param_t p;
  if (t3d_param_find("T3D_TIMEOUT_MS", &p) == T3D_OK && p.is_set && p.is_valid && p.value > 0) {
    return std::chrono::milliseconds(p.value);
  }
  return fromTorch;
}

}  // namespace

c10::intrusive_ptr<ProcessGroupT3D> ProcessGroupT3D::create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                            int size, std::chrono::milliseconds timeout,
                                                            const std::string& groupName,
                                                            const std::vector<int64_t>& globalRanks) {
  TORCH_CHECK(store, "t3d: ProcessGroupT3D needs a store");
  TORCH_CHECK(size > 0 && rank >= 0 && rank < size, "t3d: invalid rank ", rank, " for group size ", size);
  auto adapter = std::make_shared<StoreAdapter>(store);
  timeout = groupTimeout(timeout);
  t3d_config_t cfg;
  t3d_config_init(&cfg);
  cfg.timeout_ms = timeout.count() > 0 ? timeout.count() : 0;
  cfg.name = groupName.c_str();
  t3d_comm_t* comm = nullptr;
  t3d_result_t r = t3d_comm_init(&comm, rank, size, adapter->get(), &cfg);
  if (r != T3D_OK) {
    std::string detail = t3d_thread_last_error();
    C10_THROW_ERROR(DistBackendError, c10::str("t3d: creating the communicator of group '", groupName, "' on rank ",
                                               rank, " of ", size, " failed: ", t3d_result_string(r),
                                               detail.empty() ? "" : ": ", detail));
  }
  return c10::make_intrusive<ProcessGroupT3D>(std::move(adapter), std::make_shared<CommHandle>(comm), rank, size,
                                              timeout, groupName, globalRanks);
}

ProcessGroupT3D::ProcessGroupT3D(std::shared_ptr<StoreAdapter> store, std::shared_ptr<CommHandle> comm, int rank,
                                 int size, std::chrono::milliseconds timeout, std::string groupName,
                                 std::vector<int64_t> globalRanks)
    : Backend(rank, size),
      store_(std::move(store)),
      comm_(std::move(comm)),
      timeout_(timeout),
      groupName_(std::move(groupName)),
      globalRanks_(std::move(globalRanks)) {
  init();
  frPg_ = fr::Recorder::get().addGroup(groupName_, globalRanks_, rank_, size_);
}

ProcessGroupT3D::~ProcessGroupT3D() {
  // A broken communicator may never drain: abort it so that destroy returns.
  if (comm_->state == CommHandle::kAlive && t3d_comm_status(comm_->comm) != T3D_OK) comm_->abort();
  comm_->destroy();
}

t3d_comm_t* ProcessGroupT3D::comm() const {
  TORCH_CHECK(comm_->state == CommHandle::kAlive, "t3d: group '", groupName_, "' on rank ", rank_,
              " was shut down");
  return comm_->comm;
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupT3D::getBackendOptions() {
  auto o = c10::make_intrusive<Options>("t3d", timeout_);
  o->group_name = groupName_;
  for (int64_t g : globalRanks_) o->global_ranks_in_group.push_back(static_cast<uint64_t>(g));
  return o;
}

void ProcessGroupT3D::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
}

int64_t ProcessGroupT3D::timeoutMs(std::chrono::milliseconds t) const {
  return t.count() > 0 ? t.count() : timeout_.count();
}

t3d_opts_t ProcessGroupT3D::cOpts(std::chrono::milliseconds t, double premul, unsigned flags) const {
  t3d_opts_t o{};
  o.timeout_ms = timeoutMs(t);
  o.premul_scalar = premul;
  o.flags = flags;
  return o;
}

void ProcessGroupT3D::fail(const OpCtx& c, t3d_result_t r, const char* what) const {
  const char* detail = comm_->state == CommHandle::kAlive ? t3d_comm_last_error(comm_->comm) : "";
  C10_THROW_ERROR(DistBackendError, c10::str("t3d: ", c.op, " on rank ", rank_, " of group '", groupName_, "': ",
                                             what, " failed: ", t3d_result_string(r),
                                             (detail && detail[0]) ? ": " : "", detail ? detail : ""));
}

void ProcessGroupT3D::checkRoot(const OpCtx& c, int64_t root) const {
  TORCH_CHECK(root >= 0 && root < size_, "t3d: ", c.op, " on rank ", rank_, ": root rank ", root,
              " is outside the group of size ", size_);
}

void ProcessGroupT3D::checkRootTensor(const OpCtx& c, int64_t rootTensor, size_t n) const {
  TORCH_CHECK(rootTensor >= 0 && static_cast<size_t>(rootTensor) < n, "t3d: ", c.op, " on rank ", rank_,
              ": argument 'rootTensor' is ", rootTensor, ", outside the ", n, " tensor(s) of 'tensors'");
}

void ProcessGroupT3D::checkPeer(const OpCtx& c, const char* arg, int peer) const {
  TORCH_CHECK(peer >= 0 && peer < size_, "t3d: ", c.op, " on rank ", rank_, ": ", arg, " ", peer,
              " is outside the group of size ", size_);
}

ProcessGroupT3D::Rop ProcessGroupT3D::rop(const OpCtx& c, const c10d::ReduceOp& op) const {
  Rop r;
  r.op = mapReduceOp(c, op, &r.premul);
  return r;
}

t3d_request_t* ProcessGroupT3D::issuePlan(const OpCtx& c, Plan& p, const t3d_opts_t& o) {
  t3d_comm_t* cm = comm();
  t3d_request_t* req = nullptr;
  if (p.issue.size() == 1) {
    check(c, p.issue[0](o, &req), c.op);
    return req;
  }
  // Several C operations: one t3d group, one request for all of them.
  check(c, t3d_group_start(cm), "t3d_group_start");
  for (auto& issue : p.issue) {
    t3d_request_t* one = nullptr;
    t3d_result_t r = issue(o, &one);
    if (r != T3D_OK && r != T3D_IN_PROGRESS) {
      std::string detail = t3d_comm_last_error(cm);
      t3d_request_t* g = nullptr;
      t3d_group_end(cm, &g);
      if (g != nullptr) t3d_request_free(g);
      C10_THROW_ERROR(DistBackendError, c10::str("t3d: ", c.op, " on rank ", rank_, " of group '", groupName_,
                                                 "' failed: ", t3d_result_string(r), ": ", detail));
    }
    t3d_request_free(one);
  }
  check(c, t3d_group_end(cm, &req), "t3d_group_end");
  return req;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::run(c10d::OpType type, const OpCtx& c, Plan&& p,
                                                    std::chrono::milliseconds timeout, bool asyncOp) {
  t3d_opts_t o = cOpts(timeout, p.premul, p.flags | (asyncOp ? 0u : T3D_FLAG_BLOCKING));
  if (c.device && c.device->is_cuda()) return runDevice(type, c, std::move(p), o);
  TORCH_CHECK(!coalescing_ || !coalescingDevice_ || coalescingDevice_->is_cpu(), "t3d: ", c.op, " on rank ", rank_,
              ": a coalescing block takes tensors of one device type; it began with ", *coalescingDevice_);
  if (coalescing_ && !coalescingDevice_) coalescingDevice_ = at::Device(at::kCPU);
  uint64_t seq = ++seq_;
  const uint64_t fid = frRecord(type, c, p, timeoutMs(timeout), false);
  auto work = c10::make_intrusive<WorkT3D>(comm_, rank_, type, c.op, groupName_, seq, timeoutMs(timeout),
                                           std::move(p.outputs));
  work->setRecord(fid);
  try {
    work->setRequest(issuePlan(c, p, o));
  } catch (const std::exception& e) {
    frNotIssued(fid, e);
    throw;
  }
  for (auto& t : p.keep) work->keepAlive(t);
  if (!p.post.empty()) {
    // The post steps (copy-back into the caller's tensors) run on the progress thread: they do so under the
    // caller's thread-local state (inference mode, autocast, dispatch keys), as if run where issued, and below
    // autograd: like the collective's own writes into contiguous tensors, a copy-back writes the tensor's memory
    // (a leaf that requires grad, or a view of one, takes the result as gloo gives it).
    work->setPost([post = std::move(p.post), tls = at::ThreadLocalState()](t3d_request_t* req) {
      at::ThreadLocalStateGuard guard(tls);
      at::AutoDispatchBelowADInplaceOrView belowAutograd;
      for (auto& f : post) f(req);
    });
  }
  work->arm();
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

ProcessGroupT3D::DeviceStreams& ProcessGroupT3D::deviceStreams(const OpCtx& c) {
  const at::Device d = *c.device;
  TORCH_CHECK(cudaStreamsAvailable(), "t3d: ", c.op, " on rank ", rank_, ": tensors on ", d,
              ", but this build of t3d's shim has no CUDA support (built against a torch without CUDA)");
  if (!streams_) {
    c10::impl::VirtualGuardImpl impl(d.type());
    c10::DeviceGuard guard(d);
    streams_ = std::make_unique<DeviceStreams>(
        DeviceStreams{d, impl.getStreamFromGlobalPool(d, false), c10::Event(d.type())});
  }
  TORCH_CHECK(streams_->device == d, "t3d: ", c.op, " on rank ", rank_, " of group '", groupName_, "': tensors on ",
              d, ", but this group already runs on ", streams_->device,
              " (one CUDA device per group and process, as with NCCL)");
  return *streams_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::runDevice(c10d::OpType type, const OpCtx& c, Plan&& p,
                                                          t3d_opts_t o) {
  TORCH_CHECK(!coalescing_ || !coalescingDevice_ || *coalescingDevice_ == *c.device, "t3d: ", c.op, " on rank ",
              rank_, ": a coalescing block takes tensors of one device; it began with ", *coalescingDevice_,
              ", this call has ", *c.device);
  DeviceStreams& ds = deviceStreams(c);
  if (coalescing_) coalescingDevice_ = ds.device;
  c10::DeviceGuard guard(ds.device);
  c10::impl::VirtualGuardImpl impl(ds.device.type());
  // The group's stream starts after everything the caller has queued so far: the inputs and the staging copies.
  ds.ready.record(impl.getStream(ds.device));
  ds.ready.block(ds.comm);
  o.memtype = T3D_MEM_CUDA;
  o.device = ds.device.index();
  o.stream = nativeCudaStream(ds.comm);
  uint64_t seq = ++seq_;
  std::vector<at::Tensor> tensors = p.keep;
  tensors.insert(tensors.end(), p.outputs.begin(), p.outputs.end());
  const uint64_t fid = frRecord(type, c, p, o.timeout_ms, true);
  auto work = c10::make_intrusive<WorkT3DDevice>(comm_, rank_, type, c.op, groupName_, seq,
                                                 timeoutMs(std::chrono::milliseconds(o.timeout_ms)), p.outputs,
                                                 ds.device);
  work->setRecord(fid);
  t3d_request_t* req = nullptr;
  try {
    req = issuePlan(c, p, o);
  } catch (const std::exception& e) {
    frNotIssued(fid, e);
    throw;
  }
  DevicePending pending{std::move(p.post), std::move(tensors), std::move(p.outputs), work, req};
  if (coalescing_) {
    coalescedDevice_.push_back(std::move(pending));
    return work;
  }
  finishDevice(c, pending);
  return work;
}

void ProcessGroupT3D::finishDevice(const OpCtx& c, DevicePending& pending) {
  DeviceStreams& ds = *streams_;
  t3d_request_t* req = pending.req;
  pending.req = nullptr;
  // NCCL calls finish their requests on this thread; a group request also waits for the progress thread.
  t3d_result_t r = req != nullptr ? t3d_wait(req, timeout_.count()) : T3D_OK;
  if (r != T3D_OK) {
    std::string detail = t3d_request_error(req);
    t3d_request_free(req);
    C10_THROW_ERROR(DistBackendError, c10::str("t3d: ", c.op, " on rank ", rank_, " of group '", groupName_, "' on ",
                                               ds.device, " failed: ", t3d_result_string(r), ": ", detail));
  }
  c10::impl::VirtualGuardImpl impl(ds.device.type());
  {
    c10::StreamGuard onComm(ds.comm);
    at::AutoDispatchBelowADInplaceOrView belowAutograd;  // as for host tensors (run())
    for (auto& f : pending.post) f(req);
  }
  // The caching allocator must not hand these blocks out again before the group's stream is done with them.
  for (auto& t : pending.tensors) {
    if (t.defined() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), ds.comm);
  }
  pending.work->markEnqueued(ds.comm);
  fr::Recorder::get().markStarted(pending.work->record());
  if (req != nullptr) t3d_request_free(req);
}

// ---- flight recorder --------------------------------------------------------------------------------------------

uint64_t ProcessGroupT3D::frRecord(c10d::OpType type, const OpCtx& c, const Plan& p, int64_t timeoutMs, bool device) {
  fr::Recorder& rec = fr::Recorder::get();
  if (!rec.enabled()) return fr::kNoRecord;
  if (!frDesc_) {
    rec.setGroupDesc(frPg_, getGroupDesc());
    frDesc_ = true;
  }
  const bool p2p = type == c10d::OpType::SEND || type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE;
  const at::TensorList out = p.frOut ? *p.frOut : at::TensorList(p.outputs);
  const at::TensorList in = p.frIn ? *p.frIn : out;
  return rec.record(fr::OpInfo{frPg_, c.op, p2p, device, p.frPeer, in, out, timeoutMs});
}

void ProcessGroupT3D::frNotIssued(uint64_t id, const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string what = ce != nullptr ? ce->what_without_backtrace() : e.what();
  fr::Recorder& rec = fr::Recorder::get();
  rec.retire(id, false, what);
  // A call refused because the group is already broken is part of the failure; a bad argument is not.
  bool broken;
  {
    std::lock_guard<std::mutex> lk(comm_->mu);
    broken = comm_->state == CommHandle::kAlive && t3d_comm_status(comm_->comm) != T3D_OK;
  }
  if (broken) rec.dumpOnFailure(what);
}

// ---- coalescing -------------------------------------------------------------------------------------------------

bool ProcessGroupT3D::supportsCoalescing() const {
  static const bool devices = cudaDevicesPresent();
  return devices;
}

void ProcessGroupT3D::startCoalescing() {
  OpCtx c = ctx("startCoalescing");
  TORCH_CHECK(!coalescing_, "t3d: startCoalescing on rank ", rank_, " while a coalescing block is already open");
  check(c, t3d_group_start(comm()), "t3d_group_start");
  fr::Recorder::get().beginBlock(frPg_);
  coalescing_ = true;
  coalescingDevice_.reset();
  coalesced_.clear();
  coalescedDevice_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::endCoalescing() {
  OpCtx c = ctx("endCoalescing");
  TORCH_CHECK(coalescing_, "t3d: endCoalescing on rank ", rank_, " without startCoalescing");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<WorkT3D>> members;
  members.swap(coalesced_);
  std::vector<DevicePending> deviceMembers;
  deviceMembers.swap(coalescedDevice_);
  t3d_request_t* req = nullptr;
  // The block's closing entry: no tensors of its own, the block's sequence number.
  Plan none;
  none.frIn = at::TensorList();
  none.frOut = at::TensorList();
  const uint64_t fid = frRecord(c10d::OpType::COALESCED, ctx("coalesced"), none, timeout_.count(),
                                !deviceMembers.empty());
  fr::Recorder::get().endBlock(frPg_);
  try {
    check(c, t3d_group_end(comm(), &req), "t3d_group_end");
  } catch (const std::exception& e) {
    frNotIssued(fid, e);
    throw;
  }
  if (!deviceMembers.empty()) {
    // NCCL has enqueued the block's operations: the members finish in order, then one event covers them all.
    std::vector<at::Tensor> outputs;
    DevicePending all{{}, {}, {}, nullptr, req};
    for (auto& m : deviceMembers) {
      finishDevice(c, m);
      outputs.insert(outputs.end(), m.outputs.begin(), m.outputs.end());
    }
    all.work = c10::make_intrusive<WorkT3DDevice>(comm_, rank_, c10d::OpType::COALESCED, "coalesced", groupName_,
                                                  ++seq_, timeout_.count(), std::move(outputs), streams_->device);
    all.work->setRecord(fid);
    finishDevice(c, all);
    return all.work;
  }
  std::vector<at::Tensor> outputs;
  for (auto& m : members) outputs.insert(outputs.end(), m->outputs().begin(), m->outputs().end());
  auto work = c10::make_intrusive<WorkT3D>(comm_, rank_, c10d::OpType::COALESCED, "coalesced", groupName_, ++seq_,
                                           timeout_.count(), std::move(outputs));
  work->setRecord(fid);
  work->setRequest(req);
  // The group request says the C operations are done; the members may still be copying results back.
  for (auto& m : members) work->dependOn(m);
  work->arm();
  return work;
}

// ---- reductions -------------------------------------------------------------------------------------------------

void ProcessGroupT3D::planAllreduce(const OpCtx& c, const char* arg, const at::Tensor& t, Rop r,
                                    Plan& p) {
  p.premul = r.premul;
  checkTensor(c, arg, t);
  CType ct = reduceType(c, arg, t);
  checkReduceSupported(c, arg, r.op, t, ct.dtype);
  Staged s = stage(t, true);
  t3d_comm_t* cm = comm();
  void* buf = dataPtr(s.buf);
  size_t n = static_cast<size_t>(t.numel());
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allreduce(cm, buf, buf, n, ct.dtype, r.op, &o, req);
  });
  p.keep.push_back(s.buf);
  if (s.staged) p.post.push_back([s](t3d_request_t*) { s.copyBack(); });
  p.outputs.push_back(t);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  OpCtx c = ctx("allreduce");
  TORCH_CHECK(!tensors.empty(), "t3d: allreduce on rank ", rank_, ": argument 'tensors' is empty");
  TORCH_CHECK(!opts.sparseIndices.has_value(), "t3d: allreduce on rank ", rank_,
              ": allreduce with sparseIndices is not supported (pass sparse COO tensors instead)");
  if (tensors[0].defined() && tensors[0].is_sparse()) return allreduceSparse(c, tensors, opts);
  Rop r = rop(c, opts.reduceOp);
  Plan p;
  if (tensors.size() == 1) {
    planAllreduce(c, "tensors[0]", tensors[0], r, p);
  } else {
    planAllreduceLocalFold(c, tensors, r, p);
  }
  return run(c10d::OpType::ALLREDUCE, c, std::move(p), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::allreduceSparse(const OpCtx& c, std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts) {
  // Ranks hold different index sets, so this is not one reduction over a buffer: every rank's indices and values
  // are all-gathered (their counts agreed first) and each rank sums them into one coalesced COO tensor, in rank
  // order, so every rank gets the same bits. The result replaces every tensor of the list.
  Rop r = rop(c, opts.reduceOp);
  const at::Tensor& first = tensors[0];
  TORCH_CHECK(first.device().is_cpu(), "t3d: allreduce on rank ", rank_, ": argument 'tensors[0]' is a sparse tensor on ",
              first.device(), "; t3d reduces sparse tensors on the CPU only");
  TORCH_CHECK(r.op == T3D_SUM || (r.op == T3D_AVG && at::isFloatingType(first.scalar_type())), "t3d: allreduce on rank ",
              rank_, ": sparse tensors are reduced with SUM (or AVG for floating types), not ", t3d_redop_name(r.op));
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string arg = c10::str("tensors[", i, "]");
    TORCH_CHECK(tensors[i].defined() && tensors[i].is_sparse(), "t3d: allreduce on rank ", rank_, ": argument '", arg,
                "' is not a sparse COO tensor, but 'tensors[0]' is");
    TORCH_CHECK(tensors[i].device() == first.device() && tensors[i].scalar_type() == first.scalar_type() &&
                    tensors[i].sizes() == first.sizes() && tensors[i].sparse_dim() == first.sparse_dim(),
                "t3d: allreduce on rank ", rank_, ": argument '", arg, "' (", tensors[i].scalar_type(), " ",
                shapeStr(tensors[i]), ") differs from 'tensors[0]' (", first.scalar_type(), " ", shapeStr(first),
                ") in dtype, shape or sparse dimensions");
  }
  at::Tensor local = first;
  for (size_t i = 1; i < tensors.size(); ++i) local = local + tensors[i];
  local = local.coalesce();
  const int64_t sparseDim = local.sparse_dim();
  constexpr int64_t kMaxDims = 8;
  TORCH_CHECK(local.dim() <= kMaxDims, "t3d: allreduce on rank ", rank_, ": sparse tensors of at most ", kMaxDims,
              " dimensions are supported, got ", local.dim());
  // What every rank must agree on (dims, sparse dims, sizes) and what differs (nnz), in one small exchange.
  std::vector<int64_t> meta(3 + kMaxDims, -1);
  meta[0] = local.dim();
  meta[1] = sparseDim;
  meta[2] = local._nnz();
  for (int64_t d = 0; d < local.dim(); ++d) meta[3 + d] = local.size(d);
  std::vector<int64_t> all = allgatherInts(c, meta, opts.timeout);
  const size_t w = meta.size();
  std::vector<int64_t> nnz(size_);
  for (int q = 0; q < size_; ++q) {
    const int64_t* m = all.data() + q * w;
    bool same = m[0] == meta[0] && m[1] == meta[1] && std::equal(m + 3, m + w, meta.begin() + 3);
    TORCH_CHECK(same, "t3d: allreduce on rank ", rank_, ": sparse tensor of shape ", shapeStr(local), " (",
                sparseDim, " sparse dims) but rank ", q, "'s has ", m[0], " dims (", m[1],
                " sparse); every rank must pass the same shape");
    nnz[q] = m[2];
  }
  at::Tensor idx = local.indices().contiguous();
  at::Tensor val = local.values().contiguous();
  int64_t rowNumel = 1;
  for (int64_t d = sparseDim; d < local.dim(); ++d) rowNumel *= local.size(d);
  int64_t totalNnz = 0;
  for (int64_t v : nnz) totalNnz += v;
  at::Tensor allIdx = at::empty({sparseDim, totalNnz}, idx.options());
  std::vector<int64_t> valShape{totalNnz};
  for (int64_t d = sparseDim; d < local.dim(); ++d) valShape.push_back(local.size(d));
  at::Tensor allVal = at::empty(valShape, val.options());
  // Indices are [sparseDim, nnz] per rank: gathered as [rank][dim][nnz] and reordered after.
  at::Tensor idxFlat = at::empty({sparseDim * totalNnz}, idx.options());
  CType vt = moveType(c, "tensors[0]", val);
  std::vector<size_t> ic(size_), vc(size_);
  for (int q = 0; q < size_; ++q) {
    ic[q] = static_cast<size_t>(nnz[q] * sparseDim);
    vc[q] = static_cast<size_t>(nnz[q] * rowNumel) * vt.scale;
  }
  std::vector<size_t> id = prefixSums(ic), vd = prefixSums(vc);
  t3d_comm_t* cm = comm();
  const void* isb = dataPtr(idx);
  void* irb = dataPtr(idxFlat);
  const void* vsb = dataPtr(val);
  void* vrb = dataPtr(allVal);
  size_t in = ic[rank_], vn = vc[rank_];
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allgatherv(cm, isb, in, irb, ic.data(), id.data(), T3D_INT64, &o, req);
  });
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allgatherv(cm, vsb, vn, vrb, vc.data(), vd.data(), vt.dtype, &o, req);
  });
  p.keep.insert(p.keep.end(), {idx, val, idxFlat, allVal});
  std::vector<at::Tensor> outs = tensors;
  std::vector<int64_t> sizes = local.sizes().vec();
  bool avg = r.op == T3D_AVG;
  int world = size_;
  p.post.push_back([=](t3d_request_t*) {
    int64_t off = 0;
    for (int q = 0; q < world; ++q) {
      if (nnz[q] > 0) {
        allIdx.narrow(1, off, nnz[q]).copy_(idxFlat.narrow(0, off * sparseDim, nnz[q] * sparseDim)
                                                  .view({sparseDim, nnz[q]}));
      }
      off += nnz[q];
    }
    at::Tensor sum = at::sparse_coo_tensor(allIdx, allVal, sizes, allVal.options().layout(at::kSparse)).coalesce();
    if (avg) sum = sum / world;
    for (const auto& t : outs) t.copy_(sum);
  });
  p.outputs = tensors;
  return run(c10d::OpType::ALLREDUCE, c, std::move(p), opts.timeout, opts.asyncOp);
}

void ProcessGroupT3D::checkSameShapes(const OpCtx& c, const char* listArg, const std::vector<at::Tensor>& ts) const {
  for (size_t i = 0; i < ts.size(); ++i) {
    std::string arg = c10::str(listArg, "[", i, "]");
    checkTensor(c, arg.c_str(), ts[i]);
    if (i == 0) continue;
    std::string ref = c10::str(listArg, "[0]");
    checkSameDtype(c, arg.c_str(), ts[i], ts[0], ref.c_str());
    TORCH_CHECK(ts[i].sizes() == ts[0].sizes(), "t3d: ", c.op, " on rank ", rank_, ": argument '", arg,
                "' has shape ", shapeStr(ts[i]), " but '", ref, "' has ", shapeStr(ts[0]),
                "; the tensors of one rank must have the same shape");
  }
}

void ProcessGroupT3D::planAllreduceLocalFold(const OpCtx& c, const std::vector<at::Tensor>& tensors, Rop r,
                                            Plan& p) {
  // Several tensors per rank (as gloo serves them): the result is the reduction over every tensor of every rank,
  // written into each. This rank's tensors are folded first, then one allreduce runs over the fold.
  checkSameShapes(c, "tensors", tensors);
  CType ct = reduceType(c, "tensors[0]", tensors[0]);
  checkReduceSupported(c, "tensors[0]", r.op, tensors[0], ct.dtype);
  at::Tensor acc = tensors[0].contiguous().clone();
  for (size_t i = 1; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    switch (r.op) {
      case T3D_SUM: case T3D_AVG: case T3D_PREMUL_SUM: acc.add_(t); break;
      case T3D_PROD: acc.mul_(t); break;
      case T3D_MIN: acc = at::minimum(acc, t); break;
      case T3D_MAX: acc = at::maximum(acc, t); break;
      case T3D_BAND: acc.bitwise_and_(t); break;
      case T3D_BOR: acc.bitwise_or_(t); break;
      case T3D_BXOR: acc.bitwise_xor_(t); break;
      default: TORCH_CHECK(false, "t3d: ", c.op, " on rank ", rank_, ": reduce op ", t3d_redop_name(r.op),
                           " with several tensors per rank is not supported");
    }
  }
  p.premul = r.premul;
  t3d_comm_t* cm = comm();
  void* buf = dataPtr(acc);
  size_t n = static_cast<size_t>(acc.numel());
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allreduce(cm, buf, buf, n, ct.dtype, r.op, &o, req);
  });
  p.keep.push_back(acc);
  // AVG divided the sum by the group size; the mean is over every rank's tensors (integers truncate, as in C).
  int64_t local = static_cast<int64_t>(tensors.size());
  bool avg = r.op == T3D_AVG;
  std::vector<at::Tensor> outs = tensors;
  p.post.push_back([acc, outs, avg, local](t3d_request_t*) {
    at::Tensor v = acc;
    if (avg) v = at::isIntegralType(v.scalar_type(), true) ? v.div(local, "trunc") : v.div(local);
    for (const auto& t : outs) t.copy_(v);
  });
  p.outputs = tensors;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  OpCtx c = ctx("allreduce_coalesced");
  TORCH_CHECK(!tensors.empty(), "t3d: allreduce_coalesced on rank ", rank_, ": argument 'tensors' is empty");
  Rop r = rop(c, opts.reduceOp);
  Plan p;
  if (tensors.size() == 1) {
    planAllreduce(c, "tensors[0]", tensors[0], r, p);
    return run(c10d::OpType::ALLREDUCE_COALESCED, c, std::move(p), opts.timeout);
  }
  // As gloo does: every tensor is copied into one flat buffer per dtype before anything is reduced, and the results
  // are copied back after. A tensor listed twice, or tensors that overlap, are therefore reduced once, not in place
  // one after the other.
  std::vector<at::ScalarType> dtypes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string arg = c10::str("tensors[", i, "]");
    checkTensor(c, arg.c_str(), tensors[i]);
    CType ct = reduceType(c, arg.c_str(), tensors[i]);
    checkReduceSupported(c, arg.c_str(), r.op, tensors[i], ct.dtype);
    if (std::find(dtypes.begin(), dtypes.end(), tensors[i].scalar_type()) == dtypes.end()) {
      dtypes.push_back(tensors[i].scalar_type());
    }
  }
  p.premul = r.premul;
  t3d_comm_t* cm = comm();
  for (at::ScalarType st : dtypes) {
    std::vector<at::Tensor> members;
    for (const auto& t : tensors) {
      if (t.scalar_type() == st) members.push_back(t);
    }
    std::vector<at::Tensor> pieces;
    for (const auto& t : members) pieces.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(pieces);
    CType ct = reduceType(c, "tensors", flat);
    void* buf = dataPtr(flat);
    size_t n = static_cast<size_t>(flat.numel());
    p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
      return t3d_allreduce(cm, buf, buf, n, ct.dtype, r.op, &o, req);
    });
    p.keep.push_back(flat);
    p.post.push_back([flat, members](t3d_request_t*) {
      int64_t off = 0;
      for (const auto& t : members) {
        t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    });
  }
  p.outputs = tensors;
  return run(c10d::OpType::ALLREDUCE_COALESCED, c, std::move(p), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  OpCtx c = ctx("reduce");
  checkListSize(c, "tensors", tensors.size(), 1);
  checkRoot(c, opts.rootRank);
  checkRootTensor(c, opts.rootTensor, tensors.size());
  const at::Tensor& t = tensors[0];
  checkTensor(c, "tensors[0]", t);
  Rop r = rop(c, opts.reduceOp);
  CType ct = reduceType(c, "tensors[0]", t);
  checkReduceSupported(c, "tensors[0]", r.op, t, ct.dtype);
  Staged s = stage(t, true);
  t3d_comm_t* cm = comm();
  void* buf = dataPtr(s.buf);
  size_t n = static_cast<size_t>(t.numel());
  int root = static_cast<int>(opts.rootRank);
  Plan p;
  p.premul = r.premul;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_reduce(cm, buf, buf, n, ct.dtype, r.op, root, &o, req);
  });
  p.keep.push_back(s.buf);
  if (s.staged && rank_ == root) p.post.push_back([s](t3d_request_t*) { s.copyBack(); });
  p.outputs.push_back(t);
  return run(c10d::OpType::REDUCE, c, std::move(p), opts.timeout, opts.asyncOp);
}

void ProcessGroupT3D::planReduceScatterList(const OpCtx& c, const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                            Rop r, Plan& p) {
  p.premul = r.premul;
  checkTensor(c, "outputTensors[0]", out);
  checkListSize(c, "inputTensors[0]", ins.size(), static_cast<size_t>(size_));
  CType ct = reduceType(c, "outputTensors[0]", out);
  checkReduceSupported(c, "outputTensors[0]", r.op, out, ct.dtype);
  std::vector<size_t> counts(size_);
  bool even = true;
  for (int i = 0; i < size_; ++i) {
    std::string arg = c10::str("inputTensors[0][", i, "]");
    checkTensor(c, arg.c_str(), ins[i]);
    checkSameDtype(c, arg.c_str(), ins[i], out, "outputTensors[0]");
    counts[i] = static_cast<size_t>(ins[i].numel());
    even = even && counts[i] == counts[0];
  }
  TORCH_CHECK(counts[rank_] == static_cast<size_t>(out.numel()), "t3d: ", c.op, " on rank ", rank_,
              ": argument 'outputTensors[0]' has ", out.numel(), " elements but 'inputTensors[0][", rank_, "]' has ",
              counts[rank_]);
  std::vector<size_t> displs = prefixSums(counts);
  size_t total = displs.back() + counts.back();
  at::Tensor flat = at::empty({static_cast<int64_t>(total)}, out.options().memory_format(at::MemoryFormat::Contiguous));
  for (int i = 0; i < size_; ++i) {
    if (counts[i] > 0) flat.narrow(0, displs[i], counts[i]).copy_(ins[i].reshape({-1}));
  }
  Staged s = stage(out, false);
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(flat);
  void* rb = dataPtr(s.buf);
  if (even) {
    size_t n = counts[0];
    p.issue.push_back(
        [=](const t3d_opts_t& o, t3d_request_t** req) {
          return t3d_reduce_scatter(cm, sb, rb, n, ct.dtype, r.op, &o, req);
        });
  } else {
    p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
      return t3d_reduce_scatterv(cm, sb, rb, counts.data(), ct.dtype, r.op, &o, req);
    });
  }
  p.keep.push_back(flat);
  p.keep.push_back(s.buf);
  if (s.staged) p.post.push_back([s](t3d_request_t*) { s.copyBack(); });
  p.outputs.push_back(out);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::reduce_scatter(std::vector<at::Tensor>& outputTensors,
                                                               std::vector<std::vector<at::Tensor>>& inputTensors,
                                                               const c10d::ReduceScatterOptions& opts) {
  OpCtx c = ctx("reduce_scatter");
  checkListSize(c, "outputTensors", outputTensors.size(), 1);
  checkListSize(c, "inputTensors", inputTensors.size(), 1);
  Rop r = rop(c, opts.reduceOp);
  Plan p;
  planReduceScatterList(c, outputTensors[0], inputTensors[0], r, p);
  p.frIn = at::TensorList(inputTensors[0]);
  return run(c10d::OpType::REDUCE_SCATTER, c, std::move(p), opts.timeout, opts.asyncOp);
}

void ProcessGroupT3D::planReduceScatterBase(const OpCtx& c, const char* outArg, const at::Tensor& out,
                                            const char* inArg, const at::Tensor& in, Rop r, Plan& p) {
  p.premul = r.premul;
  checkTensor(c, outArg, out);
  checkTensor(c, inArg, in);
  checkSameDtype(c, inArg, in, out, outArg);
  CType ct = reduceType(c, outArg, out);
  checkReduceSupported(c, outArg, r.op, out, ct.dtype);
  TORCH_CHECK(in.numel() == out.numel() * size_, "t3d: ", c.op, " on rank ", rank_, ": argument '", inArg, "' has ",
              in.numel(), " elements, expected group size ", size_, " x ", out.numel(), " ('", outArg, "' has ",
              out.numel(), ")");
  Staged si = stage(in, true);
  Staged so = stage(out, false);
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(si.buf);
  void* rb = dataPtr(so.buf);
  size_t n = static_cast<size_t>(out.numel());
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_reduce_scatter(cm, sb, rb, n, ct.dtype, r.op, &o, req);
  });
  p.keep.push_back(si.buf);
  p.keep.push_back(so.buf);
  if (so.staged) p.post.push_back([so](t3d_request_t*) { so.copyBack(); });
  p.outputs.push_back(out);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::_reduce_scatter_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                                     const c10d::ReduceScatterOptions& opts) {
  OpCtx c = ctx("_reduce_scatter_base");
  Rop r = rop(c, opts.reduceOp);
  Plan p;
  planReduceScatterBase(c, "outputBuffer", outputBuffer, "inputBuffer", inputBuffer, r, p);
  p.frIn = at::TensorList(inputBuffer);
  return run(c10d::OpType::_REDUCE_SCATTER_BASE, c, std::move(p), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  OpCtx c = ctx("reduce_scatter_tensor_coalesced");
  checkListSize(c, "inputs", inputs.size(), outputs.size());
  Rop r = rop(c, opts.reduceOp);
  Plan p;
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::string oa = c10::str("outputs[", i, "]"), ia = c10::str("inputs[", i, "]");
    planReduceScatterBase(c, oa.c_str(), outputs[i], ia.c_str(), inputs[i], r, p);
  }
  p.frIn = at::TensorList(inputs);
  return run(c10d::OpType::COALESCED, c, std::move(p), opts.timeout);
}

// ---- data movement ----------------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  OpCtx c = ctx("broadcast");
  TORCH_CHECK(!tensors.empty(), "t3d: broadcast on rank ", rank_, ": argument 'tensors' is empty");
  checkRoot(c, opts.rootRank);
  checkRootTensor(c, opts.rootTensor, tensors.size());
  // Several tensors per rank (as gloo serves them): the root's tensors[rootTensor] reaches every tensor of every
  // rank.
  checkSameShapes(c, "tensors", tensors);
  const size_t rt = static_cast<size_t>(opts.rootTensor);
  const at::Tensor& t = tensors[rt];
  std::string arg = c10::str("tensors[", rt, "]");
  CType ct = moveType(c, arg.c_str(), t);
  Staged s = stage(t, true);
  t3d_comm_t* cm = comm();
  void* buf = dataPtr(s.buf);
  size_t n = static_cast<size_t>(t.numel()) * ct.scale;
  int root = static_cast<int>(opts.rootRank);
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_broadcast(cm, buf, n, ct.dtype, root, &o, req);
  });
  p.keep.push_back(s.buf);
  if (s.staged && rank_ != root) p.post.push_back([s](t3d_request_t*) { s.copyBack(); });
  if (tensors.size() > 1) {
    std::vector<at::Tensor> others;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (i != rt) others.push_back(tensors[i]);
    }
    at::Tensor src = s.buf;
    p.post.push_back([src, others](t3d_request_t*) {
      for (const auto& o : others) o.copy_(src);
    });
  }
  p.outputs = tensors;
  return run(c10d::OpType::BROADCAST, c, std::move(p), opts.timeout, opts.asyncOp);
}

std::vector<int64_t> ProcessGroupT3D::allgatherInts(const OpCtx& c, const std::vector<int64_t>& mine,
                                                   std::chrono::milliseconds timeout) {
  TORCH_CHECK(!coalescing_, "t3d: ", c.op, " on rank ", rank_,
              ": this call needs to agree on sizes first, which it cannot do inside a coalescing block");
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(size_));
  t3d_opts_t o = cOpts(timeout, 1.0, T3D_FLAG_BLOCKING);
  t3d_request_t* req = nullptr;
  check(c, t3d_allgather(comm(), mine.data(), all.data(), mine.size(), T3D_INT64, &o, &req), "exchanging sizes");
  t3d_result_t r = t3d_wait(req, -1);
  if (r != T3D_OK) {
    std::string detail = t3d_request_error(req);
    t3d_request_free(req);
    C10_THROW_ERROR(DistBackendError, c10::str("t3d: ", c.op, " on rank ", rank_, " of group '", groupName_,
                                               "': exchanging sizes failed: ", t3d_result_string(r), ": ", detail));
  }
  t3d_request_free(req);
  return all;
}

void ProcessGroupT3D::planAllgatherList(const OpCtx& c, const char* outArg, const std::vector<at::Tensor>& outs,
                                        const char* inArg, const at::Tensor& in, std::chrono::milliseconds timeout,
                                        Plan& p) {
  checkTensor(c, inArg, in);
  checkListSize(c, outArg, outs.size(), static_cast<size_t>(size_));
  CType ct = moveType(c, inArg, in);
  std::vector<size_t> counts(size_);
  bool even = true;
  for (int i = 0; i < size_; ++i) {
    std::string arg = c10::str(outArg, "[", i, "]");
    checkTensor(c, arg.c_str(), outs[i]);
    checkSameDtype(c, arg.c_str(), outs[i], in, inArg);
    counts[i] = static_cast<size_t>(outs[i].numel());
    even = even && counts[i] == counts[0];
  }
  if (!even) {
    // Uneven outputs: every rank learns every input's size first, so that a call whose outputs do not match the
    // inputs fails on all ranks with the same message instead of failing on some and waiting on the others.
    std::vector<int64_t> sizes = allgatherInts(c, {in.numel()}, timeout);
    for (int i = 0; i < size_; ++i) {
      TORCH_CHECK(counts[i] == static_cast<size_t>(sizes[i]), "t3d: ", c.op, " on rank ", rank_, ": argument '",
                  outArg, "[", i, "]' has ", counts[i], " elements but rank ", i, "'s input has ", sizes[i]);
    }
  }
  TORCH_CHECK(counts[rank_] == static_cast<size_t>(in.numel()), "t3d: ", c.op, " on rank ", rank_, ": argument '",
              outArg, "[", rank_, "]' has ", counts[rank_], " elements but '", inArg, "' has ", in.numel());
  std::vector<size_t> displs = prefixSums(counts);
  size_t total = displs.back() + counts.back();
  at::Tensor flat = at::empty({static_cast<int64_t>(total)}, in.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor src = in.contiguous();
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(src);
  void* rb = dataPtr(flat);
  size_t sc = ct.scale;
  if (even) {
    size_t n = counts[0] * sc;
    p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
      return t3d_allgather(cm, sb, rb, n, ct.dtype, &o, req);
    });
  } else {
    std::vector<size_t> rc(size_), rd(size_);
    for (int i = 0; i < size_; ++i) {
      rc[i] = counts[i] * sc;
      rd[i] = displs[i] * sc;
    }
    size_t n = counts[rank_] * sc;
    p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
      return t3d_allgatherv(cm, sb, n, rb, rc.data(), rd.data(), ct.dtype, &o, req);
    });
  }
  p.keep.push_back(src);
  p.keep.push_back(flat);
  p.post.push_back([flat, outs, counts, displs](t3d_request_t*) {
    for (size_t i = 0; i < outs.size(); ++i) {
      if (counts[i] > 0) outs[i].copy_(flat.narrow(0, displs[i], counts[i]).view(outs[i].sizes()));
    }
  });
  p.outputs.insert(p.outputs.end(), outs.begin(), outs.end());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::allgather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                                          std::vector<at::Tensor>& inputTensors,
                                                          const c10d::AllgatherOptions& opts) {
  OpCtx c = ctx("allgather");
  TORCH_CHECK(!inputTensors.empty(), "t3d: allgather on rank ", rank_, ": argument 'inputTensors' is empty");
  checkListSize(c, "outputTensors", outputTensors.size(), inputTensors.size());
  Plan p;
  if (inputTensors.size() == 1) {
    planAllgatherList(c, "outputTensors[0]", outputTensors[0], "inputTensors[0]", inputTensors[0], opts.timeout, p);
    p.frIn = at::TensorList(inputTensors);
    return run(c10d::OpType::ALLGATHER, c, std::move(p), opts.timeout, opts.asyncOp);
  }
  // Several tensors per rank (as gloo serves them): every output list receives all ranks' inputs, rank-major:
  // outputTensors[i][r * k + j] is rank r's inputTensors[j], for k inputs per rank.
  checkSameShapes(c, "inputTensors", inputTensors);
  const size_t k = inputTensors.size();
  for (size_t i = 0; i < k; ++i) {
    std::string la = c10::str("outputTensors[", i, "]");
    checkListSize(c, la.c_str(), outputTensors[i].size(), k * static_cast<size_t>(size_));
    for (size_t j = 0; j < outputTensors[i].size(); ++j) {
      std::string arg = c10::str("outputTensors[", i, "][", j, "]");
      const at::Tensor& o = outputTensors[i][j];
      checkTensor(c, arg.c_str(), o);
      checkSameDtype(c, arg.c_str(), o, inputTensors[0], "inputTensors[0]");
      TORCH_CHECK(o.numel() == inputTensors[0].numel(), "t3d: allgather on rank ", rank_, ": argument '", arg,
                  "' has ", o.numel(), " elements but 'inputTensors[0]' has ", inputTensors[0].numel());
    }
  }
  CType ct = moveType(c, "inputTensors[0]", inputTensors[0]);
  const int64_t m = inputTensors[0].numel();
  at::Tensor src = at::stack(inputTensors).reshape({-1});
  at::Tensor flat = at::empty({m * static_cast<int64_t>(k) * size_}, src.options());
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(src);
  void* rb = dataPtr(flat);
  size_t n = static_cast<size_t>(m) * k * ct.scale;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allgather(cm, sb, rb, n, ct.dtype, &o, req);
  });
  p.keep.push_back(src);
  p.keep.push_back(flat);
  std::vector<std::vector<at::Tensor>> outs = outputTensors;
  p.post.push_back([flat, outs, m](t3d_request_t*) {
    for (const auto& list : outs) {
      for (size_t j = 0; j < list.size(); ++j) {
        if (m > 0) list[j].copy_(flat.narrow(0, static_cast<int64_t>(j) * m, m).view(list[j].sizes()));
      }
    }
  });
  for (const auto& list : outputTensors) p.outputs.insert(p.outputs.end(), list.begin(), list.end());
  p.frIn = at::TensorList(inputTensors);
  return run(c10d::OpType::ALLGATHER, c, std::move(p), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists, std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  // torch's layout (and gloo's): outputTensorLists[r][i] receives rank r's inputTensors[i]. The inputs travel as
  // one packed byte buffer per rank (any mix of dtypes), each piece aligned for its dtype.
  OpCtx c = ctx("allgather_coalesced");
  TORCH_CHECK(outputTensorLists.size() == static_cast<size_t>(size_), "t3d: allgather_coalesced on rank ", rank_,
              ": argument 'outputTensorLists' must hold one list per rank (", size_, "), got ",
              outputTensorLists.size());
  const size_t k = inputTensors.size();
  std::vector<int64_t> offs(k);
  int64_t bytes = 0;
  for (size_t i = 0; i < k; ++i) {
    std::string ia = c10::str("inputTensors[", i, "]");
    checkTensor(c, ia.c_str(), inputTensors[i]);
    const int64_t align = 16;
    bytes = (bytes + align - 1) / align * align;
    offs[i] = bytes;
    bytes += inputTensors[i].numel() * static_cast<int64_t>(inputTensors[i].element_size());
  }
  for (int r = 0; r < size_; ++r) {
    std::string la = c10::str("outputTensorLists[", r, "]");
    checkListSize(c, la.c_str(), outputTensorLists[r].size(), k);
    for (size_t i = 0; i < k; ++i) {
      std::string oa = c10::str("outputTensorLists[", r, "][", i, "]"), ia = c10::str("inputTensors[", i, "]");
      const at::Tensor& o = outputTensorLists[r][i];
      checkTensor(c, oa.c_str(), o);
      checkSameDtype(c, oa.c_str(), o, inputTensors[i], ia.c_str());
      TORCH_CHECK(o.numel() == inputTensors[i].numel(), "t3d: allgather_coalesced on rank ", rank_, ": argument '",
                  oa, "' has ", o.numel(), " elements but '", ia, "' has ", inputTensors[i].numel());
    }
  }
  at::Tensor anyT = k > 0 ? inputTensors[0] : at::empty({0}, at::kByte);
  auto byteOpts = anyT.options().dtype(at::kByte).memory_format(at::MemoryFormat::Contiguous);
  at::Tensor src = at::empty({bytes}, byteOpts);
  auto piece = [](const at::Tensor& flatBytes, int64_t off, const at::Tensor& like) {
    int64_t nb = like.numel() * static_cast<int64_t>(like.element_size());
    return flatBytes.narrow(0, off, nb).view(like.scalar_type()).view(like.sizes());
  };
  for (size_t i = 0; i < k; ++i) {
    if (inputTensors[i].numel() > 0) piece(src, offs[i], inputTensors[i]).copy_(inputTensors[i]);
  }
  at::Tensor flat = at::empty({bytes * size_}, byteOpts);
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(src);
  void* rb = dataPtr(flat);
  size_t n = static_cast<size_t>(bytes);
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allgather(cm, sb, rb, n, T3D_UINT8, &o, req);
  });
  p.keep.push_back(src);
  p.keep.push_back(flat);
  std::vector<std::vector<at::Tensor>> outs = outputTensorLists;
  p.post.push_back([flat, outs, offs, bytes, piece](t3d_request_t*) {
    for (size_t r = 0; r < outs.size(); ++r) {
      at::Tensor block = flat.narrow(0, static_cast<int64_t>(r) * bytes, bytes);
      for (size_t i = 0; i < outs[r].size(); ++i) {
        if (outs[r][i].numel() > 0) outs[r][i].copy_(piece(block, offs[i], outs[r][i]));
      }
    }
  });
  for (const auto& list : outputTensorLists) p.outputs.insert(p.outputs.end(), list.begin(), list.end());
  p.frIn = at::TensorList(inputTensors);
  return run(c10d::OpType::ALLGATHER_COALESCED, c, std::move(p), opts.timeout);
}

void ProcessGroupT3D::planAllgatherBase(const OpCtx& c, const char* outArg, const at::Tensor& out, const char* inArg,
                                        const at::Tensor& in, Plan& p) {
  checkTensor(c, outArg, out);
  checkTensor(c, inArg, in);
  checkSameDtype(c, outArg, out, in, inArg);
  TORCH_CHECK(out.numel() == in.numel() * size_, "t3d: ", c.op, " on rank ", rank_, ": argument '", outArg, "' has ",
              out.numel(), " elements, expected group size ", size_, " x ", in.numel(), " ('", inArg, "' has ",
              in.numel(), ")");
  CType ct = moveType(c, inArg, in);
  Staged si = stage(in, true);
  Staged so = stage(out, false);
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(si.buf);
  void* rb = dataPtr(so.buf);
  size_t n = static_cast<size_t>(in.numel()) * ct.scale;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_allgather(cm, sb, rb, n, ct.dtype, &o, req);
  });
  p.keep.push_back(si.buf);
  p.keep.push_back(so.buf);
  if (so.staged) p.post.push_back([so](t3d_request_t*) { so.copyBack(); });
  p.outputs.push_back(out);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::_allgather_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                                const c10d::AllgatherOptions& opts) {
  OpCtx c = ctx("_allgather_base");
  Plan p;
  planAllgatherBase(c, "outputBuffer", outputBuffer, "inputBuffer", inputBuffer, p);
  p.frIn = at::TensorList(inputBuffer);
  return run(c10d::OpType::_ALLGATHER_BASE, c, std::move(p), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  OpCtx c = ctx("allgather_into_tensor_coalesced");
  checkListSize(c, "inputs", inputs.size(), outputs.size());
  Plan p;
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::string oa = c10::str("outputs[", i, "]"), ia = c10::str("inputs[", i, "]");
    planAllgatherBase(c, oa.c_str(), outputs[i], ia.c_str(), inputs[i], p);
  }
  p.frIn = at::TensorList(inputs);
  return run(c10d::OpType::COALESCED, c, std::move(p), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::gather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                                       std::vector<at::Tensor>& inputTensors,
                                                       const c10d::GatherOptions& opts) {
  OpCtx c = ctx("gather");
  checkRoot(c, opts.rootRank);
  checkListSize(c, "inputTensors", inputTensors.size(), 1);
  const at::Tensor& in = inputTensors[0];
  checkTensor(c, "inputTensors[0]", in);
  CType ct = moveType(c, "inputTensors[0]", in);
  int root = static_cast<int>(opts.rootRank);
  Plan p;
  at::Tensor flat;
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    checkListSize(c, "outputTensors", outputTensors.size(), 1);
    outs = outputTensors[0];
    checkListSize(c, "outputTensors[0]", outs.size(), static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) {
      std::string arg = c10::str("outputTensors[0][", i, "]");
      checkTensor(c, arg.c_str(), outs[i]);
      checkSameDtype(c, arg.c_str(), outs[i], in, "inputTensors[0]");
      TORCH_CHECK(outs[i].numel() == in.numel(), "t3d: gather on rank ", rank_, ": argument '", arg, "' has ",
                  outs[i].numel(), " elements but 'inputTensors[0]' has ", in.numel());
    }
    flat = at::empty({in.numel() * size_}, in.options().memory_format(at::MemoryFormat::Contiguous));
  } else {
    TORCH_CHECK(outputTensors.empty() || (outputTensors.size() == 1 && outputTensors[0].empty()),
                "t3d: gather on rank ", rank_, ": argument 'outputTensors' must be empty on non-root ranks (root is ",
                root, ")");
  }
  at::Tensor src = in.contiguous();
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(src);
  void* rb = flat.defined() ? dataPtr(flat) : nullptr;
  size_t n = static_cast<size_t>(in.numel()) * ct.scale;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_gather(cm, sb, rb, n, ct.dtype, root, &o, req);
  });
  p.keep.push_back(src);
  if (flat.defined()) {
    p.keep.push_back(flat);
    int64_t m = in.numel();
    p.post.push_back([flat, outs, m](t3d_request_t*) {
      for (size_t i = 0; i < outs.size(); ++i) {
        if (m > 0) outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * m, m).view(outs[i].sizes()));
      }
    });
  }
  p.outputs = outs;
  p.frIn = at::TensorList(inputTensors);
  return run(c10d::OpType::GATHER, c, std::move(p), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::scatter(std::vector<at::Tensor>& outputTensors,
                                                        std::vector<std::vector<at::Tensor>>& inputTensors,
                                                        const c10d::ScatterOptions& opts) {
  OpCtx c = ctx("scatter");
  checkRoot(c, opts.rootRank);
  checkListSize(c, "outputTensors", outputTensors.size(), 1);
  const at::Tensor& out = outputTensors[0];
  checkTensor(c, "outputTensors[0]", out);
  CType ct = moveType(c, "outputTensors[0]", out);
  int root = static_cast<int>(opts.rootRank);
  at::Tensor flat;
  if (rank_ == root) {
    checkListSize(c, "inputTensors", inputTensors.size(), 1);
    const auto& ins = inputTensors[0];
    checkListSize(c, "inputTensors[0]", ins.size(), static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) {
      std::string arg = c10::str("inputTensors[0][", i, "]");
      checkTensor(c, arg.c_str(), ins[i]);
      checkSameDtype(c, arg.c_str(), ins[i], out, "outputTensors[0]");
      TORCH_CHECK(ins[i].numel() == out.numel(), "t3d: scatter on rank ", rank_, ": argument '", arg, "' has ",
                  ins[i].numel(), " elements but 'outputTensors[0]' has ", out.numel());
    }
    flat = at::empty({out.numel() * size_}, out.options().memory_format(at::MemoryFormat::Contiguous));
    for (int i = 0; i < size_; ++i) {
      if (out.numel() > 0) flat.narrow(0, i * out.numel(), out.numel()).copy_(ins[i].reshape({-1}));
    }
  } else {
    TORCH_CHECK(inputTensors.empty() || (inputTensors.size() == 1 && inputTensors[0].empty()),
                "t3d: scatter on rank ", rank_, ": argument 'inputTensors' must be empty on non-root ranks (root is ",
                root, ")");
  }
  Staged so = stage(out, false);
  t3d_comm_t* cm = comm();
  const void* sb = flat.defined() ? dataPtr(flat) : nullptr;
  void* rb = dataPtr(so.buf);
  size_t n = static_cast<size_t>(out.numel()) * ct.scale;
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_scatter(cm, sb, rb, n, ct.dtype, root, &o, req);
  });
  if (flat.defined()) p.keep.push_back(flat);
  p.keep.push_back(so.buf);
  if (so.staged) p.post.push_back([so](t3d_request_t*) { so.copyBack(); });
  p.outputs.push_back(out);
  p.frIn = inputTensors.empty() ? at::TensorList() : at::TensorList(inputTensors[0]);
  return run(c10d::OpType::SCATTER, c, std::move(p), opts.timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::alltoall_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                              std::vector<int64_t>& outputSplitSizes,
                                                              std::vector<int64_t>& inputSplitSizes,
                                                              const c10d::AllToAllOptions& opts) {
  OpCtx c = ctx("alltoall_base");
  const at::Tensor& out = outputBuffer;
  const at::Tensor& in = inputBuffer;
  checkTensor(c, "outputBuffer", out);
  checkTensor(c, "inputBuffer", in);
  checkSameDtype(c, "outputBuffer", out, in, "inputBuffer");
  CType ct = moveType(c, "inputBuffer", in);
  Staged si = stage(in, true);
  Staged so = stage(out, false);
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(si.buf);
  void* rb = dataPtr(so.buf);
  Plan p;
  if (outputSplitSizes.empty() && inputSplitSizes.empty()) {
    TORCH_CHECK(in.numel() % size_ == 0, "t3d: alltoall_base on rank ", rank_, ": argument 'inputBuffer' has ",
                in.numel(), " elements, not divisible by the group size ", size_, " (no split sizes given)");
    TORCH_CHECK(out.numel() == in.numel(), "t3d: alltoall_base on rank ", rank_, ": argument 'outputBuffer' has ",
                out.numel(), " elements but 'inputBuffer' has ", in.numel(), " (no split sizes given)");
    size_t n = static_cast<size_t>(in.numel() / size_) * ct.scale;
    p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
      return t3d_alltoall(cm, sb, rb, n, ct.dtype, &o, req);
    });
  } else {
    TORCH_CHECK(in.dim() > 0 && out.dim() > 0, "t3d: alltoall_base on rank ", rank_,
                ": split sizes need tensors with at least one dimension");
    TORCH_CHECK(rowElems(in) == rowElems(out), "t3d: alltoall_base on rank ", rank_, ": rows of 'inputBuffer' ",
                shapeStr(in), " and 'outputBuffer' ", shapeStr(out), " differ in size");
    size_t row = static_cast<size_t>(rowElems(in)) * ct.scale;
    auto splits = [&](const char* arg, const std::vector<int64_t>& sp, const at::Tensor& t) {
      std::vector<size_t> counts(size_);
      if (sp.empty()) {
        TORCH_CHECK(t.size(0) % size_ == 0, "t3d: alltoall_base on rank ", rank_, ": '", arg,
                    "' is empty (equal split) but dim 0 of the tensor (", t.size(0),
                    ") is not divisible by the group size ", size_);
        std::fill(counts.begin(), counts.end(), static_cast<size_t>(t.size(0) / size_) * row);
        return counts;
      }
      TORCH_CHECK(sp.size() == static_cast<size_t>(size_), "t3d: alltoall_base on rank ", rank_, ": argument '",
                  arg, "' has ", sp.size(), " entries, expected the group size ", size_);
      int64_t sum = 0;
      for (int i = 0; i < size_; ++i) {
        TORCH_CHECK(sp[i] >= 0, "t3d: alltoall_base on rank ", rank_, ": argument '", arg, "' has a negative entry ",
                    sp[i], " at ", i);
        sum += sp[i];
        counts[i] = static_cast<size_t>(sp[i]) * row;
      }
      TORCH_CHECK(sum == t.size(0), "t3d: alltoall_base on rank ", rank_, ": argument '", arg, "' sums to ", sum,
                  " but dim 0 of the tensor is ", t.size(0));
      return counts;
    };
    std::vector<size_t> sc = splits("inputSplitSizes", inputSplitSizes, in);
    std::vector<size_t> rc = splits("outputSplitSizes", outputSplitSizes, out);
    std::vector<size_t> sd = prefixSums(sc), rd = prefixSums(rc);
    p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
      return t3d_alltoallv(cm, sb, sc.data(), sd.data(), rb, rc.data(), rd.data(), ct.dtype, &o, req);
    });
  }
  p.keep.push_back(si.buf);
  p.keep.push_back(so.buf);
  if (so.staged) p.post.push_back([so](t3d_request_t*) { so.copyBack(); });
  p.outputs.push_back(out);
  p.frIn = at::TensorList(inputBuffer);
  return run(c10d::OpType::ALLTOALL_BASE, c, std::move(p), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::alltoall(std::vector<at::Tensor>& outputTensors,
                                                         std::vector<at::Tensor>& inputTensors,
                                                         const c10d::AllToAllOptions& opts) {
  OpCtx c = ctx("alltoall");
  checkListSize(c, "outputTensors", outputTensors.size(), static_cast<size_t>(size_));
  checkListSize(c, "inputTensors", inputTensors.size(), static_cast<size_t>(size_));
  checkTensor(c, "inputTensors[0]", inputTensors[0]);
  const at::Tensor& ref = inputTensors[0];
  CType ct = moveType(c, "inputTensors[0]", ref);
  std::vector<size_t> sn(size_), rn(size_);
  for (int i = 0; i < size_; ++i) {
    std::string ia = c10::str("inputTensors[", i, "]"), oa = c10::str("outputTensors[", i, "]");
    checkTensor(c, ia.c_str(), inputTensors[i]);
    checkTensor(c, oa.c_str(), outputTensors[i]);
    checkSameDtype(c, ia.c_str(), inputTensors[i], ref, "inputTensors[0]");
    checkSameDtype(c, oa.c_str(), outputTensors[i], ref, "inputTensors[0]");
    sn[i] = static_cast<size_t>(inputTensors[i].numel());
    rn[i] = static_cast<size_t>(outputTensors[i].numel());
  }
  std::vector<size_t> sd = prefixSums(sn), rd = prefixSums(rn);
  auto opt = ref.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor sflat = at::empty({static_cast<int64_t>(sd.back() + sn.back())}, opt);
  at::Tensor rflat = at::empty({static_cast<int64_t>(rd.back() + rn.back())}, opt);
  for (int i = 0; i < size_; ++i) {
    if (sn[i] > 0) sflat.narrow(0, sd[i], sn[i]).copy_(inputTensors[i].reshape({-1}));
  }
  std::vector<size_t> sc(size_), scd(size_), rc(size_), rcd(size_);
  for (int i = 0; i < size_; ++i) {
    sc[i] = sn[i] * ct.scale;
    scd[i] = sd[i] * ct.scale;
    rc[i] = rn[i] * ct.scale;
    rcd[i] = rd[i] * ct.scale;
  }
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(sflat);
  void* rb = dataPtr(rflat);
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_alltoallv(cm, sb, sc.data(), scd.data(), rb, rc.data(), rcd.data(), ct.dtype, &o, req);
  });
  p.keep.push_back(sflat);
  p.keep.push_back(rflat);
  std::vector<at::Tensor> outs = outputTensors;
  p.post.push_back([rflat, outs, rn, rd](t3d_request_t*) {
    for (size_t i = 0; i < outs.size(); ++i) {
      if (rn[i] > 0) outs[i].copy_(rflat.narrow(0, rd[i], rn[i]).view(outs[i].sizes()));
    }
  });
  p.outputs = outs;
  p.frIn = at::TensorList(inputTensors);
  return run(c10d::OpType::ALLTOALL, c, std::move(p), opts.timeout, opts.asyncOp);
}

// ---- point-to-point ---------------------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  OpCtx c = ctx("send");
  checkListSize(c, "tensors", tensors.size(), 1);
  checkPeer(c, "dstRank", dstRank);
  TORCH_CHECK(tag >= 0 && tag <= T3D_MAX_TAG, "t3d: send on rank ", rank_, ": tag ", tag, " is outside [0, ",
              T3D_MAX_TAG, "]");
  const at::Tensor& t = tensors[0];
  checkTensor(c, "tensors[0]", t);
  CType ct = moveType(c, "tensors[0]", t);
  at::Tensor src = t.contiguous();
  t3d_comm_t* cm = comm();
  const void* sb = dataPtr(src);
  size_t n = static_cast<size_t>(t.numel()) * ct.scale;
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_send(cm, sb, n, ct.dtype, dstRank, tag, &o, req);
  });
  p.keep.push_back(src);
  p.frIn = at::TensorList(tensors);
  p.frOut = at::TensorList(tensors);
  p.frPeer = dstRank;
  return run(c10d::OpType::SEND, c, std::move(p), c10d::kUnsetTimeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  OpCtx c = ctx("recv");
  checkListSize(c, "tensors", tensors.size(), 1);
  TORCH_CHECK(srcRank == T3D_ANY_SOURCE || (srcRank >= 0 && srcRank < size_), "t3d: recv on rank ", rank_,
              ": srcRank ", srcRank, " is outside the group of size ", size_);
  TORCH_CHECK(tag >= 0 && tag <= T3D_MAX_TAG, "t3d: recv on rank ", rank_, ": tag ", tag, " is outside [0, ",
              T3D_MAX_TAG, "]");
  const at::Tensor& t = tensors[0];
  checkTensor(c, "tensors[0]", t);
  CType ct = moveType(c, "tensors[0]", t);
  Staged s = stage(t, false);
  t3d_comm_t* cm = comm();
  void* rb = dataPtr(s.buf);
  size_t n = static_cast<size_t>(t.numel()) * ct.scale;
  // torch.distributed.pipelining's stage set-up sends an int64 scalar into a one-element float32 tensor (torch
  // 2.9.1, stage.py _get_init_p2p_neighbors_ops); gloo aborts on it. A longer message therefore fills the tensor and
  // warns once, where MPI would fail; a shorter one is still an error.
  int rank = rank_;
  Plan p;
  p.flags |= T3D_FLAG_RECV_TRUNCATE;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) {
    return t3d_recv(cm, rb, n, ct.dtype, srcRank, tag, &o, req);
  });
  p.keep.push_back(s.buf);
  p.post.push_back([s, n, rank](t3d_request_t* req) {
    size_t got = t3d_request_count(req);
    TORCH_CHECK(got >= n, "t3d: recv on rank ", rank, ": got ", got, " elements from rank ",
                t3d_request_source(req), " but 'tensors[0]' ", shapeStr(s.user), " expects ", n);
    if (got > n) {
      TORCH_WARN_ONCE("t3d: recv on rank ", rank, ": rank ", t3d_request_source(req), " sent ", got,
                      " elements of this dtype's size into 'tensors[0]' ", shapeStr(s.user),
                      "; the first ", n, " were kept (warned once per process)");
    }
    s.copyBack();
  });
  p.outputs.push_back(t);
  p.frPeer = srcRank == T3D_ANY_SOURCE ? -2 : srcRank;
  return run(srcRank == T3D_ANY_SOURCE ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, c, std::move(p),
             c10d::kUnsetTimeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recv(tensors, T3D_ANY_SOURCE, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupT3D::barrier(const c10d::BarrierOptions& opts) {
  OpCtx c = ctx("barrier");
  t3d_comm_t* cm = comm();
  Plan p;
  p.issue.push_back([=](const t3d_opts_t& o, t3d_request_t** req) { return t3d_barrier(cm, &o, req); });
  return run(c10d::OpType::BARRIER, c, std::move(p), opts.timeout, opts.asyncOp);
}

void ProcessGroupT3D::monitoredBarrier(const c10d::BarrierOptions& opts, bool /*waitAllRanks*/) {
  // t3d's own timeout error already names the ranks that did not arrive.
  barrier(opts)->wait(opts.timeout.count() > 0 ? opts.timeout : timeout_);
}

// ---- group management -------------------------------------------------------------------------------------------

void ProcessGroupT3D::setSequenceNumberForGroup() {
  seq_ = 0;
}

uint64_t ProcessGroupT3D::getSequenceNumberForGroup() {
  return seq_;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupT3D::split(const c10::intrusive_ptr<c10d::Store>& /*store*/,
                                                         const std::vector<int>& ranks,
                                                         const c10::intrusive_ptr<Options>& opts) {
  OpCtx c = ctx("split");
  // torch's ProcessGroup::splitGroup calls split once per device type, and this one backend serves them all: the
  // repeated call (same name and ranks) gets the same child, or a second communicator would be made and at once
  // dropped by ProcessGroup::setBackend while peers still connect to it. Every rank repeats the same way.
  std::string want_name = opts ? opts->group_name : std::string();
  if (lastSplit_ && lastSplit_->name == want_name && lastSplit_->ranks == ranks) {
    auto again = lastSplit_->backend;
    lastSplit_.reset();
    return again;
  }
  lastSplit_.reset();
  // Collective over this whole group: ranks outside `ranks` take part with no color and get no backend.
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  int color = T3D_SPLIT_NOCOLOR;
  int key = 0;
  if (it != ranks.end()) {
    color = *std::min_element(ranks.begin(), ranks.end());
    key = static_cast<int>(it - ranks.begin());
  }
  std::chrono::milliseconds timeout = opts ? opts->timeout : timeout_;
  std::string name = (opts && !opts->group_name.empty()) ? opts->group_name : c10::str(groupName_, ":split");
  // Each split of this group gets its own key namespace (the counter is in step on every rank).
  std::string prefix = c10::str("t3d/", groupName_, "/split", splitCount_++, "/", color);
  t3d_config_t cfg;
  t3d_config_init(&cfg);
  cfg.timeout_ms = timeout.count() > 0 ? timeout.count() : 0;
  cfg.name = name.c_str();
  cfg.key_prefix = prefix.c_str();
  t3d_comm_t* child = nullptr;
  check(c, t3d_comm_split(comm(), color, key, &cfg, &child), "t3d_comm_split");
  c10::intrusive_ptr<c10d::Backend> result;
  if (child != nullptr) {
    std::vector<int64_t> global;
    for (int r : ranks) global.push_back(globalRanks_.empty() ? r : globalRanks_.at(r));
    result = c10::make_intrusive<ProcessGroupT3D>(store_, std::make_shared<CommHandle>(child), t3d_comm_rank(child),
                                                  t3d_comm_size(child), timeout, name, std::move(global));
  }
  lastSplit_ = std::make_unique<SplitMemo>(SplitMemo{want_name, ranks, result});
  return result;
}

c10d::ErrorType ProcessGroupT3D::getError() {
  if (comm_->state != CommHandle::kAlive) return c10d::ErrorType::COMM_ERROR;
  switch (t3d_comm_status(comm_->comm)) {
    case T3D_OK: return c10d::ErrorType::SUCCESS;
    case T3D_ERR_TIMEOUT: return c10d::ErrorType::TIMEOUT;
    case T3D_ERR_PEER_LOST: return c10d::ErrorType::REMOTE_ERROR;
    default: return c10d::ErrorType::COMM_ERROR;
  }
}

void ProcessGroupT3D::abort() {
  comm_->abort();
}

void ProcessGroupT3D::shutdown() {
  comm_->destroy();
}

std::string ProcessGroupT3D::transport() const {
  if (comm_->state != CommHandle::kAlive) return "";
  const char* t = t3d_comm_transport(comm_->comm);
  return t ? t : "";
}

}  // namespace t3d_shim
