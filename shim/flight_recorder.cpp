// The flight recorder's ring, its state machine (scheduled -> started -> completed, from what the engine's issue order
// and the works' completions tell) and its dump in torch's format.
#include <Python.h>

#include "flight_recorder.hpp"

#include <torch/csrc/jit/serialization/pickler.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <functional>
#include <stdexcept>

#include <sys/stat.h>
#include <unistd.h>

extern "C" {
#include "t3d.h"
}

namespace t3d_shim {
namespace fr {

namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The first of torch's names for a setting that is set and not empty (TORCH_FR_* first, then the older TORCH_NCCL_*).
const char* envFirst(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    const char* v = std::getenv(n);
    if (v != nullptr && v[0] != '\0') return v;
  }
  return nullptr;
}

long envInt(std::initializer_list<const char*> names, long dflt) {
  const char* v = envFirst(names);
  if (v == nullptr) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end != v && *end == '\0') ? x : dflt;
}

// The analyser's names for the shim's operations (torch's flight_recorder/components/types.py: COLLECTIVES, P2P,
// "coalesced"); the others are spelt the same in both.
const char* analyserName(const char* op) {
  static const char* const kRenamed[][2] = {
      {"allreduce", "all_reduce"},
      {"allgather", "all_gather"},
      {"_allgather_base", "_all_gather_base"},
      {"allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced"},
      {"alltoall", "all_to_all"},
      {"alltoall_base", "all_to_all_single"},
  };
  for (const auto& r : kRenamed) {
    if (std::strcmp(op, r[0]) == 0) return r[1];
  }
  return op;
}

using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

GenericDict newDict() {
  return GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

GenericList newList() {
  return GenericList(c10::AnyType::get());
}

std::string utf8(PyObject* s) {
  const char* c = s != nullptr ? PyUnicode_AsUTF8(s) : nullptr;
  if (c == nullptr) {
    PyErr_Clear();
    return "?";
  }
  return c;
}

// mkdir -p of the directory part of `path`.
void makeParents(const std::string& path) {
  for (size_t i = 1; i < path.size(); ++i) {
    if (path[i] != '/') continue;
    std::string dir = path.substr(0, i);
    if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) {
      throw std::runtime_error(c10::str("cannot create directory ", dir, ": ", std::strerror(errno)));
    }
  }
}

}  // namespace

Recorder& Recorder::get() {
  static Recorder* instance = new Recorder();  // never destroyed (see the header)
  return *instance;
}

Recorder::Recorder() {
  long n = envInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000);
  capacity_ = n > 0 ? static_cast<size_t>(n) : 0;
  dumpOnFailure_ = envInt({"TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"}, 1) != 0;
  // torch captures the Python stack of every operation unless told not to; here it costs the GIL on every call
  // (the shim runs without it), so it is on only when asked for.
  stacks_ = envInt({"TORCH_INCLUDE_STACK_TRACE"}, 0) != 0;
  const char* prefix = envFirst({"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"});
  prefix_ = prefix != nullptr ? prefix : "/tmp/t3d_trace_rank_";
}

size_t Recorder::addGroup(const std::string& name, const std::vector<int64_t>& globalRanks, int rank, int size) {
  std::vector<int64_t> members = globalRanks;
  if (members.empty()) {
    for (int r = 0; r < size; ++r) members.push_back(r);
  }
  std::lock_guard<std::mutex> lk(mu_);
  Group g;
  g.name = name;
  g.rank = rank;
  // std::to_string, not an ostringstream: on the GPU machine's build an ostringstream in this library crashed
  // inside libstdc++'s number formatting at every group creation (docs/benchmarks/gpu).
  g.ranks = "[";
  for (size_t i = 0; i < members.size(); ++i) g.ranks += (i ? ", " : "") + std::to_string(members[i]);
  g.ranks += "]";
  if (globalRank_ < 0 && rank >= 0 && static_cast<size_t>(rank) < members.size()) {
    globalRank_ = static_cast<int>(members[rank]);
  }
  groups_.push_back(std::move(g));
  return groups_.size() - 1;
}

void Recorder::setGroupDesc(size_t pg, const std::string& desc) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!desc.empty()) groups_.at(pg).desc = desc;
}

void Recorder::beginBlock(size_t pg) {
  std::lock_guard<std::mutex> lk(mu_);
  Group& g = groups_.at(pg);
  g.inBlock = true;
  g.blockBumped = false;
  g.blockP2P = false;
}

void Recorder::endBlock(size_t pg) {
  std::lock_guard<std::mutex> lk(mu_);
  groups_.at(pg).inBlock = false;
}

Recorder::Entry* Recorder::find(uint64_t id) {
  if (id == kNoRecord || ring_.empty() || id >= nextId_) return nullptr;
  Entry& e = ring_[id % ring_.size()];
  return e.id == id ? &e : nullptr;
}

void Recorder::start(Entry& e, int64_t now) {
  if (e.started != 0) return;
  e.started = now;
  if (!e.p2p) {
    Group& g = groups_[e.pg];
    g.lastStarted = std::max<int64_t>(g.lastStarted, static_cast<int64_t>(e.collSeq));
  }
}

uint64_t Recorder::record(const OpInfo& info) {
  if (!enabled()) return kNoRecord;
  std::vector<Frame> frames;
  if (stackCapture()) frames = pythonStack();  // before the lock: it waits for the GIL
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lk(mu_);
  const size_t cap = capacity_.load(std::memory_order_relaxed);
  if (cap == 0) return kNoRecord;
  if (ring_.size() != cap) ring_.resize(cap);  // the first record after start-up or reset()
  Group& g = groups_.at(info.pg);
  bool p2p = info.p2p;
  const bool closesBlock = g.inBlock && std::strcmp(info.op, "coalesced") == 0;
  if (closesBlock && g.blockBumped) {
    p2p = g.blockP2P;  // the closing entry shares the block's number
  } else if (!g.inBlock || !g.blockBumped) {
    ++(p2p ? g.p2pSeq : g.collSeq);
    if (g.inBlock) {
      g.blockBumped = true;
      g.blockP2P = p2p;
    }
  }
  ++g.opId;
  const uint64_t id = nextId_++;
  Entry& e = ring_[id % cap];
  if (e.id != kNoRecord && e.retired == false) {
    // Overwritten while still in flight: its group must not wait for it to start the next one.
    auto& pend = groups_[e.pg].pending;
    pend.erase(std::remove(pend.begin(), pend.end(), e.id), pend.end());
  }
  e.id = id;
  e.pg = info.pg;
  e.op = info.op;
  e.rank = g.rank;
  e.peer = info.peer;
  e.collSeq = g.collSeq;
  e.p2pSeq = g.p2pSeq;
  e.opId = g.opId;
  e.p2p = p2p;
  e.retired = false;
  e.timeoutMs = info.timeoutMs;
  e.created = now;
  e.started = 0;
  e.completed = 0;
  // The vectors keep their capacity from the slot's earlier use: no allocation once the ring has gone round.
  e.inDims.clear();
  e.outDims.clear();
  e.sizes.clear();
  e.inTypes.clear();
  e.outTypes.clear();
  for (const at::Tensor& t : info.inputs) {
    e.inTypes.push_back(t.defined() ? t.scalar_type() : c10::ScalarType::Undefined);
    auto s = t.defined() ? t.sizes() : c10::IntArrayRef();
    e.inDims.push_back(static_cast<int16_t>(s.size()));
    e.sizes.insert(e.sizes.end(), s.begin(), s.end());
  }
  for (const at::Tensor& t : info.outputs) {
    e.outTypes.push_back(t.defined() ? t.scalar_type() : c10::ScalarType::Undefined);
    auto s = t.defined() ? t.sizes() : c10::IntArrayRef();
    e.outDims.push_back(static_cast<int16_t>(s.size()));
    e.sizes.insert(e.sizes.end(), s.begin(), s.end());
  }
  e.thread = std::this_thread::get_id();
  e.error.clear();
  if (!frames.empty() || !e.frames.empty()) e.frames = std::move(frames);
  if (!p2p) g.lastEnqueued = static_cast<int64_t>(g.collSeq);
  if (p2p) {
    start(e, now);  // posted at once; it does not wait behind the group's collectives
  } else if (!info.device) {
    // The engine runs a group's collectives one after the other in issue order: this one starts when the ones
    // ahead of it are done (retire() starts the next).
    g.pending.push_back(id);
    if (g.pending.size() == 1) start(e, now);
  }
  return id;
}

void Recorder::markStarted(uint64_t id) {
  if (id == kNoRecord) return;
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lk(mu_);
  if (Entry* e = find(id)) start(*e, now);
}

void Recorder::retire(uint64_t id, bool ok, const std::string& error) {
  if (id == kNoRecord) return;
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lk(mu_);
  Entry* e = find(id);
  if (e == nullptr) {
    // Overwritten (record() already took it off its group's queue), or the ring was reset.
    for (Group& g : groups_) g.pending.erase(std::remove(g.pending.begin(), g.pending.end(), id), g.pending.end());
    return;
  }
  Group& g = groups_[e->pg];
  start(*e, now);
  e->retired = true;
  if (ok) {
    e->completed = now;
    if (!e->p2p) g.lastCompleted = std::max<int64_t>(g.lastCompleted, static_cast<int64_t>(e->collSeq));
  } else {
    e->error = error;  // a failed operation never completed: it stays "started", as a hung one does under NCCL
  }
  auto it = std::find(g.pending.begin(), g.pending.end(), id);
  if (it != g.pending.end()) g.pending.erase(it);
  while (!g.pending.empty()) {
    if (Entry* next = find(g.pending.front())) {
      start(*next, now);
      break;
    }
    g.pending.pop_front();
  }
}

void Recorder::reset(size_t capacity) {
  std::lock_guard<std::mutex> lk(mu_);
  ring_.clear();
  ring_.shrink_to_fit();
  for (Group& g : groups_) g.pending.clear();
  capacity_ = capacity;
}

std::vector<Recorder::Frame> Recorder::pythonStack() {
  std::vector<Frame> out;
  if (!Py_IsInitialized()) return out;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyFrameObject* f = PyThreadState_GetFrame(PyThreadState_Get());  // new reference, or null
  // Innermost first, as torch's recorder lists them.
  while (f != nullptr && out.size() < 64) {
    PyCodeObject* code = PyFrame_GetCode(f);
    out.push_back(Frame{utf8(code->co_name), utf8(code->co_filename), PyFrame_GetLineNumber(f)});
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  PyGILState_Release(gil);
  return out;
}

std::string Recorder::pickled() {
  GenericDict dump = newDict();
  {
    std::lock_guard<std::mutex> lk(mu_);
    dump.insert("version", kFormatVersion);
    dump.insert("comm_lib_version", c10::str("t3d ", t3d_version_string()));
    GenericDict config = newDict();
    GenericDict status = newDict();
    for (size_t i = 0; i < groups_.size(); ++i) {
      const Group& g = groups_[i];
      GenericDict c = newDict();
      c.insert("name", g.name);
      c.insert("desc", g.desc);
      c.insert("ranks", g.ranks);
      config.insert_or_assign(g.name, c);
      GenericDict s = newDict();
      s.insert("last_enqueued_collective", g.lastEnqueued);
      s.insert("last_started_collective", g.lastStarted);
      s.insert("last_completed_collective", g.lastCompleted);
      status.insert(std::to_string(i), s);
    }
    dump.insert("pg_config", config);
    dump.insert("pg_status", status);
    GenericList entries = newList();
    const size_t cap = ring_.size();
    const uint64_t first = nextId_ > cap ? nextId_ - cap : 0;
    for (uint64_t id = first; id < nextId_; ++id) {
      const Entry* e = find(id);
      if (e == nullptr) continue;
      const Group& g = groups_[e->pg];
      std::string name = c10::str("t3d:", analyserName(e->op));
      if (std::strcmp(e->op, "send") == 0) {
        name += c10::str(" ", e->rank, "->", e->peer);
      } else if (std::strcmp(e->op, "recv") == 0) {
        name += e->peer < 0 ? c10::str(" ", e->rank, "<-?") : c10::str(" ", e->rank, "<-", e->peer);
      }
      size_t at = 0;
      auto sizes = [&](const c10::SmallVector<int16_t, 4>& dims) {
        GenericList l = newList();
        for (int16_t d : dims) {
          GenericList one = newList();
          for (int16_t k = 0; k < d; ++k) one.push_back(e->sizes[at++]);
          l.push_back(one);
        }
        return l;
      };
      auto dtypes = [](const c10::SmallVector<c10::ScalarType, 4>& types) {
        GenericList l = newList();
        for (c10::ScalarType t : types) l.push_back(std::string(c10::toString(t)));
        return l;
      };
      GenericDict d = newDict();
      d.insert("record_id", static_cast<int64_t>(e->id));
      d.insert("pg_id", static_cast<int64_t>(e->pg));
      d.insert("process_group", c10::ivalue::Tuple::create(g.name, g.desc));
      d.insert("collective_seq_id", static_cast<int64_t>(e->collSeq));
      d.insert("p2p_seq_id", static_cast<int64_t>(e->p2pSeq));
      d.insert("op_id", static_cast<int64_t>(e->opId));
      d.insert("profiling_name", name);
      d.insert("time_created_ns", e->created);
      if (e->completed != 0) d.insert("duration_ms", static_cast<double>(e->completed - e->started) / 1e6);
      d.insert("input_sizes", sizes(e->inDims));
      d.insert("input_dtypes", dtypes(e->inTypes));
      d.insert("output_sizes", sizes(e->outDims));
      d.insert("output_dtypes", dtypes(e->outTypes));
      d.insert("state", e->completed != 0 ? "completed" : e->started != 0 ? "started" : "scheduled");
      d.insert("time_discovered_started_ns", e->started != 0 ? c10::IValue(e->started) : c10::IValue());
      d.insert("time_discovered_completed_ns", e->completed != 0 ? c10::IValue(e->completed) : c10::IValue());
      d.insert("retired", e->retired);
      d.insert("timeout_ms", e->timeoutMs);
      d.insert("is_p2p", e->p2p);
      d.insert("thread_id", std::to_string(std::hash<std::thread::id>{}(e->thread)));
      GenericList frames = newList();
      for (const Frame& f : e->frames) {
        GenericDict fd = newDict();
        fd.insert("name", f.name);
        fd.insert("filename", f.file);
        fd.insert("line", static_cast<int64_t>(f.line));
        frames.push_back(fd);
      }
      d.insert("frames", frames);
      if (!e->error.empty()) d.insert("error", e->error);  // t3d's own key: the operation's error text
      entries.push_back(d);
    }
    dump.insert("entries", entries);
  }
  std::string out;
  {
    // Untagged, as torch's recorder pickles its dump: pickle.load needs no torch to read it.
    torch::jit::Pickler p([&out](const char* data, size_t n) { out.append(data, n); }, nullptr, nullptr, nullptr,
                          nullptr, /*tag_aggregates=*/false);
    p.protocol();
    p.pushIValue(dump);
    p.stop();
  }
  return out;
}

std::string Recorder::defaultPath() const {
  return prefix_ + std::to_string(globalRank_ < 0 ? 0 : globalRank_);
}

std::string Recorder::writeDump(const std::string& path) {
  const std::string target = path.empty() ? defaultPath() : path;
  const std::string data = pickled();
  makeParents(target);
  // The temporary file's name does not contain the dump's prefix, so the analyser never mistakes it for a dump.
  const size_t slash = target.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : target.substr(0, slash == 0 ? 1 : slash);
  const std::string tmp = c10::str(dir, "/.t3d-fr-", ::getpid(), ".partial");
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error(c10::str("cannot open ", tmp, ": ", std::strerror(errno)));
  const bool written = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed || std::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw std::runtime_error(c10::str("cannot write ", target, ": ", std::strerror(err)));
  }
  return target;
}

void Recorder::dumpOnFailure(const std::string& why) {
  if (!enabled() || !dumpOnFailure_ || dumpedOnFailure_.exchange(true)) return;
  try {
    std::string path = writeDump();
    std::fprintf(stderr,
                 "t3d: flight recorder: %s\nt3d: flight recorder: the last operations of this rank are in %s "
                 "(python -m torch.distributed.flight_recorder.fr_trace <dir of all ranks' dumps> -p <prefix>)\n",
                 why.c_str(), path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "t3d: flight recorder: could not write the dump after a failure: %s\n", e.what());
  }
}

}  // namespace fr
}  // namespace t3d_shim
