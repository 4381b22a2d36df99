// harness.h: what the C tests share: in-memory and file-system stores, RunRanks (N ranks as threads with a hard
// deadline), typed buffer fill / reference / compare helpers, and request helpers.
#ifndef T3D_TESTS_HARNESS_H
#define T3D_TESTS_HARNESS_H

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "t3d.h"

namespace t3dtest {

// T3D_TEST_TIMEOUT_MS (default 60000): the hard deadline of one RunRanks call and of every wait in the tests.
int64_t TestTimeoutMs();

// Whether this libt3d has the UCX transport (t3d_build_features has "ucx=no" when built with T3D_WITH_UCX=OFF).
// Without it, a test binary run with T3D_TRANSPORT=ucx (test_coll_ucx, test_p2p_ucx) skips all its tests.
bool HasUcx();

// setenv / unsetenv of a variable t3d reads, then t3d__param_reload(): libt3d reads its environment once per process
// (c_src/base/params.c), so a test that changes it in between must say so.
void SetEnv(const char *name, const char *value);
void UnsetEnv(const char *name);

// A name no other run in this process (or, through the pid, in another process) uses.
std::string UniqueName(const std::string &tag);

// ---------- stores ----------

// Thread-safe map; get blocks on a condition variable until the key exists or the timeout passes.
class MemStore {
 public:
  MemStore();
  MemStore(const MemStore &) = delete;
  MemStore &operator=(const MemStore &) = delete;
  const t3d_store_t *store() const { return &store_; }
  size_t size();

 private:
  static t3d_result_t Set(void *ctx, const char *key, const void *value, size_t len);
  static t3d_result_t Get(void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms);
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<unsigned char>> map_;
  t3d_store_t store_;
};

// A directory shared by processes: set writes a temporary file and renames it into place (readers never see a
// partial value); get polls with short sleeps. Safe to construct again in a forked child from the same path.
class FileStore {
 public:
  explicit FileStore(const std::string &dir);
  FileStore(const FileStore &) = delete;
  FileStore &operator=(const FileStore &) = delete;
  const t3d_store_t *store() const { return &store_; }
  const std::string &dir() const { return dir_; }
  // Deletes the directory and what it holds.
  void Remove();

 private:
  static t3d_result_t Set(void *ctx, const char *key, const void *value, size_t len);
  static t3d_result_t Get(void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms);
  std::string PathOf(const char *key) const;
  std::string dir_;
  t3d_store_t store_;
};

// ---------- uneven layouts ----------

// Elements rank `from` sends to rank `to` in the alltoallv tests: uneven, and zero for a quarter of the pairs.
size_t VCount(size_t base, int from, int to);
// An allgatherv's blocks: rank r contributes 0 elements when r % 3 == 1, else base + 2r; the blocks lie in reverse
// rank order with a one-element gap after each. Returns the elements the receive buffer spans.
size_t AllgathervLayout(int n, size_t base, std::vector<size_t> *counts, std::vector<size_t> *displs);
// An alltoallv seen from `rank`: it sends VCount(base, rank, p) elements to p (send blocks in rank order) and
// receives VCount(base, p, rank) from p (receive blocks in reverse rank order), a one-element gap after each block.
struct A2aLayout {
  std::vector<size_t> sc, sd, rc, rd;
  size_t s_total = 0, r_total = 0;  // elements the send and receive buffers span
};
A2aLayout AlltoallvLayout(int n, int rank, size_t base);

// ---------- ranks as threads ----------

struct RunOptions {
  int64_t deadline_ms = -1;      // hard deadline of the whole run; < 0: TestTimeoutMs()
  int64_t comm_timeout_ms = 0;   // cfg.timeout_ms; 0: TestTimeoutMs()
  const char *name = nullptr;    // cfg.name
  const t3d_store_t *store = nullptr;  // nullptr: a fresh MemStore per run
  bool abort_on_failure = true;  // a rank that records a gtest failure aborts every communicator of the run
};

using RankFn = std::function<void(int rank, t3d_comm_t *comm)>;

// Starts n threads; each inits a communicator (unique key prefix per run), runs fn, and the communicators are
// destroyed once every rank has returned. If a rank is still running at the deadline the test fails naming the
// ranks, and the process exits at once (a hang must not wedge ctest).
void RunRanks(int n, const RankFn &fn, const RunOptions &opts = RunOptions());
void RunRanks(int n, const RankFn &fn, int64_t deadline_ms);

// Inside a RunRanks rank: a host-side barrier over the run's threads (independent of t3d). Returns false when the
// run was aborted because another rank failed; the caller should then return.
bool HostBarrier();
// Inside a RunRanks rank: the run's shared scratch slots, one per rank (for cross-rank comparisons).
std::vector<std::vector<unsigned char>> &HostSlots();

// ---------- requests ----------

// Waits (within TestTimeoutMs) and frees. On error, *err (if given) gets the request's error text.
t3d_result_t Finish(t3d_request_t *req, std::string *err = nullptr);
// Issued-call result and completion folded into one: if call_res is an error it is returned (req ignored);
// otherwise the request is finished.
t3d_result_t Complete(t3d_result_t call_res, t3d_request_t *req, std::string *err = nullptr);

using IssueFn = std::function<t3d_result_t(t3d_request_t **req)>;
// Issues one operation and finishes it; returns the call's error or, when the call succeeded, the request's result.
t3d_result_t RunResult(const IssueFn &issue, std::string *err = nullptr);
// The same, recording a gtest failure that names `what` (and the rank), the result and the error text unless the
// operation succeeds. Returns whether it did.
bool RunOk(t3d_comm_t *comm, const std::string &what, const IssueFn &issue);

// ---------- dtypes and values ----------

extern const t3d_dtype_t kAllDtypes[];
extern const size_t kNumDtypes;
extern const t3d_redop_t kAllOps[];
extern const size_t kNumOps;

bool IsHalf(t3d_dtype_t dt);
bool IsFloat(t3d_dtype_t dt);    // real or complex floating types, halves included
bool IsComplex(t3d_dtype_t dt);
bool IsInteger(t3d_dtype_t dt);  // int8/uint8/int32/int64 (not bool)
int Components(t3d_dtype_t dt);  // 2 for complex

uint16_t FloatToHalf(float f);  // IEEE binary16, round to nearest even
float HalfToFloat(uint16_t h);
uint16_t FloatToBf16(float f);  // round to nearest even
float Bf16ToFloat(uint16_t h);

// Writes value (one component of element i) into buf of dtype dt, converting like a C cast (bool: != 0).
void StoreValue(t3d_dtype_t dt, void *buf, size_t i, int comp, double value);
double LoadValue(t3d_dtype_t dt, const void *buf, size_t i, int comp);

// The scalar PREMUL_SUM tests use: 2 for integer types (exact under truncation), 0.5 otherwise.
double PremulScalar(t3d_dtype_t dt);

// Deterministic input of `rank` at element i, component comp, chosen for op so that the exact result is
// representable in dt: small integers for SUM-like ops, mostly 1 with few 2 (and -1 for signed) for PROD,
// arbitrary bit patterns for bitwise ops on integers, 0/1 for bool.
double InputValue(t3d_dtype_t dt, t3d_redop_t op, int rank, size_t i, int comp);
// Bitwise ops: raw bits of the input (truncated to the dtype's width when stored).
uint64_t InputBits(t3d_dtype_t dt, int rank, size_t i);

// Fills n elements of buf (element offset `first` into the rank's logical input) with InputValue / InputBits.
void FillInput(t3d_dtype_t dt, t3d_redop_t op, int rank, void *buf, size_t n, size_t first = 0);
// The reduction over ranks [0, nranks) of the inputs at logical elements [first, first + n), written to out in dt.
// Serial reference: double accumulation (bit operations on uint64 for bitwise ops), then cast.
void ReferenceReduce(t3d_dtype_t dt, t3d_redop_t op, int nranks, void *out, size_t n, size_t first = 0);

// Tolerance of a comparison: 0 (exact) except AVG on floating types (one rounding's worth).
double Tolerance(t3d_dtype_t dt, t3d_redop_t op);
// Compares n elements; returns "" when equal within tol, else a message naming the first bad element.
std::string CompareBuffers(t3d_dtype_t dt, const void *got, const void *expect, size_t n, double tol);
// "" when the two byte buffers are equal; else the first byte that differs ("byte 12: got 3, want 4").
std::string ByteDiff(const std::vector<unsigned char> &got, const std::vector<unsigned char> &want);

// Data-movement collectives: a deterministic byte pattern per (rank, element) that is a valid dt value.
void FillPattern(t3d_dtype_t dt, int rank, void *buf, size_t n, size_t first = 0, int salt = 0);

std::string CaseName(t3d_dtype_t dt, t3d_redop_t op, size_t count);

}  // namespace t3dtest

// EXPECT that a t3d call returns T3D_OK, printing the communicator's last error otherwise.
#define T3D_EXPECT_OK(comm, call)                                                                         \
  do {                                                                                                    \
    t3d_result_t t3d_r_ = (call);                                                                         \
    EXPECT_EQ(t3d_r_, T3D_OK) << #call << " -> " << t3d_result_string(t3d_r_) << ": "                     \
                              << ((comm) ? t3d_comm_last_error(comm) : "");                               \
  } while (0)
#define T3D_ASSERT_OK(comm, call)                                                                         \
  do {                                                                                                    \
    t3d_result_t t3d_r_ = (call);                                                                         \
    ASSERT_EQ(t3d_r_, T3D_OK) << #call << " -> " << t3d_result_string(t3d_r_) << ": "                     \
                              << ((comm) ? t3d_comm_last_error(comm) : "");                               \
  } while (0)

#endif  // T3D_TESTS_HARNESS_H
