// The flight recorder: a bounded ring, per process, of the last operations of every t3d group (kind, sequence
// numbers, sizes, dtypes, state, timestamps, optionally the Python stack), dumped per rank as the pickle that torch's
// flight recorder analyser (torchfrtrace, torch.distributed.flight_recorder.fr_trace) reads. docs/architecture.md,
// "Flight recorder".
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace t3d_shim {
namespace fr {

constexpr uint64_t kNoRecord = UINT64_MAX;

// The format version the dump says it is: what torch 2.9 and 2.15's own recorder (FlightRecorder.hpp, version_val)
// write, and what their analyser reads.
constexpr const char* kFormatVersion = "2.10";

// What one operation is, at the moment it is issued.
struct OpInfo {
  size_t pg;               // from addGroup
  const char* op;          // the shim's name, a string literal ("allreduce", "_allgather_base", "send", ...)
  bool p2p;                // send / recv
  bool device;             // CUDA: completion is an event, not tracked; the entry ends "started" once enqueued
  int peer;                // send / recv: the peer's rank in the group; -2: any source
  at::TensorList inputs;
  at::TensorList outputs;
  int64_t timeoutMs;
};

class Recorder {
 public:
  // The process's recorder (made on first use and never destroyed: progress threads may still complete works at
  // exit). The ring holds TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) entries, 2000 when unset; 0
  // records nothing.
  static Recorder& get();

  bool enabled() const {
    return capacity_.load(std::memory_order_relaxed) > 0;
  }
  // A group (one per backend): its name, its members' global ranks (torch hands none for the default group: then
  // 0 .. size-1), this process's rank in it and its size. Returns its id.
  size_t addGroup(const std::string& name, const std::vector<int64_t>& globalRanks, int rank, int size);
  // torch sets a group's description after creating the backend; the group's first operation passes it here.
  void setGroupDesc(size_t pg, const std::string& desc);
  // A coalescing block opens: its operations share one sequence number with the "coalesced" entry that closes it.
  void beginBlock(size_t pg);
  void endBlock(size_t pg);

  // A new operation, state "scheduled" (or "started" when nothing of its group is ahead of it). Returns its id, or
  // kNoRecord when the recorder is off.
  uint64_t record(const OpInfo& info);
  // A CUDA operation is enqueued on the group's stream.
  void markStarted(uint64_t id);
  // The operation finished: state "completed" when ok, else it stays "started" with the error; retired either way.
  void retire(uint64_t id, bool ok, const std::string& error = std::string());

  // The dump as torch's recorder writes it (version, pg_config, pg_status, entries), pickled (protocol 2, plain
  // dicts, lists, tuples, strings and numbers: pickle.load reads it without torch).
  std::string pickled();
  // Writes pickled() to `path` (empty: the default path, <prefix><global rank>), through a temporary file and a
  // rename, so a reader never sees half a dump. Returns the path; throws on an I/O error.
  std::string writeDump(const std::string& path = std::string());
  // The default path: TORCH_FR_DUMP_TEMP_FILE (or TORCH_NCCL_DEBUG_INFO_TEMP_FILE, else /tmp/t3d_trace_rank_)
  // followed by this process's global rank.
  std::string defaultPath() const;
  // A group failed (timeout, lost peer, abort, desynchronised ranks): dumps once per process, unless the recorder
  // is off or TORCH_FR_DUMP_ON_TIMEOUT (TORCH_NCCL_DUMP_ON_TIMEOUT) is 0. Never throws; says on stderr where the
  // dump went.
  void dumpOnFailure(const std::string& why);

  void setStackCapture(bool on) {
    stacks_.store(on, std::memory_order_relaxed);
  }
  bool stackCapture() const {
    return stacks_.load(std::memory_order_relaxed);
  }
  size_t capacity() const {
    return capacity_.load(std::memory_order_relaxed);
  }
  // Empties the ring and sets its size (tests, and users who want another size than the environment's).
  void reset(size_t capacity);

 private:
  struct Frame {
    std::string name;
    std::string file;
    int line;
  };
  struct Entry {
    uint64_t id = kNoRecord;
    size_t pg = 0;
    const char* op = nullptr;
    int rank = 0;
    int peer = -1;
    uint64_t collSeq = 0;
    uint64_t p2pSeq = 0;
    uint64_t opId = 0;
    bool p2p = false;
    bool retired = false;
    int64_t timeoutMs = 0;
    int64_t created = 0;  // ns since the epoch; 0: not yet
    int64_t started = 0;
    int64_t completed = 0;
    // Per tensor: its number of dimensions; the sizes of all of them one after the other (inputs, then outputs).
    // Stored in the entry itself for the common case (a few tensors of a few dimensions): recording then touches
    // one contiguous slot, not five heap blocks.
    c10::SmallVector<int16_t, 4> inDims;
    c10::SmallVector<int16_t, 4> outDims;
    c10::SmallVector<int64_t, 8> sizes;
    c10::SmallVector<c10::ScalarType, 4> inTypes;
    c10::SmallVector<c10::ScalarType, 4> outTypes;
    std::thread::id thread;
    std::string error;
    std::vector<Frame> frames;
  };
  struct Group {
    std::string name;
    std::string desc = "undefined";
    std::string ranks;  // "[0, 1, 2]", global ranks, as torch writes them
    int rank = 0;
    uint64_t collSeq = 0;
    uint64_t p2pSeq = 0;
    uint64_t opId = 0;
    bool inBlock = false;
    bool blockBumped = false;
    bool blockP2P = false;
    int64_t lastEnqueued = -1;
    int64_t lastStarted = -1;
    int64_t lastCompleted = -1;
    std::deque<uint64_t> pending;  // host collectives not yet done, in issue order: the first one is running
  };

  Recorder();
  Entry* find(uint64_t id);  // under mu_; null when overwritten
  void start(Entry& e, int64_t now);
  static std::vector<Frame> pythonStack();

  std::mutex mu_;
  std::atomic<size_t> capacity_{0};
  std::atomic<bool> stacks_{false};
  std::atomic<bool> dumpedOnFailure_{false};
  bool dumpOnFailure_ = true;
  std::string prefix_;
  int globalRank_ = -1;
  uint64_t nextId_ = 0;
  std::vector<Entry> ring_;
  std::deque<Group> groups_;
};

}  // namespace fr
}  // namespace t3d_shim
