// harness.cc: the stores, RunRanks and the request helpers of the C test harness (values live in
// harness_values.cc).
#include "harness.h"

#include "base/params.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

namespace t3dtest {

int64_t TestTimeoutMs() {
  static const int64_t value = [] {
    const char *s = getenv("T3D_TEST_TIMEOUT_MS");
    if (s && *s) {
      char *end = nullptr;
      long long v = strtoll(s, &end, 10);
      if (end && *end == '\0' && v > 0) return static_cast<int64_t>(v);
    }
    return static_cast<int64_t>(60000);
  }();
  return value;
}

bool HasUcx() { return std::string(" ").append(t3d_build_features()).find(" ucx=no") == std::string::npos; }

namespace {
// ctest runs test_coll and test_p2p a second time with T3D_TRANSPORT=ucx (tests/c/CMakeLists.txt).
class SkipWithoutUcx : public ::testing::Environment {
 public:
  void SetUp() override {
    const char *want = getenv("T3D_TRANSPORT");
    if (want != nullptr && strcmp(want, "ucx") == 0 && !HasUcx())
      GTEST_SKIP() << "this build of t3d has no UCX (T3D_WITH_UCX=OFF), which T3D_TRANSPORT=ucx asks for";
  }
};
::testing::Environment *const kSkipWithoutUcx = ::testing::AddGlobalTestEnvironment(new SkipWithoutUcx);
}  // namespace

void SetEnv(const char *name, const char *value) {
  setenv(name, value, 1);
  t3d__param_reload();
}

void UnsetEnv(const char *name) {
  unsetenv(name);
  t3d__param_reload();
}

std::string UniqueName(const std::string &tag) {
  static std::atomic<uint64_t> counter{0};
  uint64_t now = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::ostringstream os;
  os << tag << "-" << getpid() << "-" << counter.fetch_add(1) << "-" << (now % 1000000007ull);
  return os.str();
}

// ---------- MemStore ----------

MemStore::MemStore() {
  store_.ctx = this;
  store_.set = &MemStore::Set;
  store_.get = &MemStore::Get;
}

size_t MemStore::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

t3d_result_t MemStore::Set(void *ctx, const char *key, const void *value, size_t len) {
  if (!ctx || !key || (!value && len > 0)) return T3D_ERR_INVALID_ARG;
  MemStore *self = static_cast<MemStore *>(ctx);
  const unsigned char *p = static_cast<const unsigned char *>(value);
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    self->map_[key] = std::vector<unsigned char>(p, p + len);
  }
  self->cv_.notify_all();
  return T3D_OK;
}

t3d_result_t MemStore::Get(void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms) {
  if (!ctx || !key || !value || !len) return T3D_ERR_INVALID_ARG;
  MemStore *self = static_cast<MemStore *>(ctx);
  std::unique_lock<std::mutex> lock(self->mu_);
  auto found = [&] { return self->map_.count(key) > 0; };
  if (timeout_ms < 0) {
    self->cv_.wait(lock, found);
  } else if (!self->cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), found)) {
    return T3D_ERR_TIMEOUT;
  }
  const std::vector<unsigned char> &v = self->map_[key];
  void *copy = malloc(v.empty() ? 1 : v.size());
  if (!copy) return T3D_ERR_NO_MEMORY;
  if (!v.empty()) memcpy(copy, v.data(), v.size());
  *value = copy;
  *len = v.size();
  return T3D_OK;
}

// ---------- FileStore ----------

FileStore::FileStore(const std::string &dir) : dir_(dir) {
  mkdir(dir_.c_str(), 0700);  // EEXIST is fine: several processes open the same directory
  store_.ctx = this;
  store_.set = &FileStore::Set;
  store_.get = &FileStore::Get;
}

std::string FileStore::PathOf(const char *key) const {
  // Keys may hold '/' and other characters a file name cannot: keep [A-Za-z0-9._-], escape the rest as %XX.
  static const char hex[] = "0123456789abcdef";
  std::string name;
  for (const char *c = key; *c; ++c) {
    unsigned char u = static_cast<unsigned char>(*c);
    if (isalnum(u) || u == '-' || u == '_' || (u == '.' && c != key)) {
      name.push_back(static_cast<char>(u));
    } else {
      name.push_back('%');
      name.push_back(hex[u >> 4]);
      name.push_back(hex[u & 15]);
    }
  }
  return dir_ + "/" + name;
}

static bool WriteAll(int fd, const void *data, size_t len) {
  const char *p = static_cast<const char *>(data);
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    len -= static_cast<size_t>(w);
  }
  return true;
}

t3d_result_t FileStore::Set(void *ctx, const char *key, const void *value, size_t len) {
  if (!ctx || !key || (!value && len > 0)) return T3D_ERR_INVALID_ARG;
  FileStore *self = static_cast<FileStore *>(ctx);
  static std::atomic<uint64_t> counter{0};
  std::ostringstream tmp;
  tmp << self->dir_ << "/.tmp-" << getpid() << "-" << counter.fetch_add(1);
  std::string tmp_path = tmp.str();
  int fd = open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return T3D_ERR_SYSTEM;
  bool ok = WriteAll(fd, value, len);
  ok = (close(fd) == 0) && ok;
  if (!ok || rename(tmp_path.c_str(), self->PathOf(key).c_str()) != 0) {
    unlink(tmp_path.c_str());
    return T3D_ERR_SYSTEM;
  }
  return T3D_OK;
}

t3d_result_t FileStore::Get(void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms) {
  if (!ctx || !key || !value || !len) return T3D_ERR_INVALID_ARG;
  FileStore *self = static_cast<FileStore *>(ctx);
  std::string path = self->PathOf(key);
  auto start = std::chrono::steady_clock::now();
  for (;;) {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      std::vector<char> data;
      char chunk[4096];
      for (;;) {
        ssize_t r = read(fd, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
          close(fd);
          return T3D_ERR_SYSTEM;
        }
        if (r == 0) break;
        data.insert(data.end(), chunk, chunk + r);
      }
      close(fd);
      void *copy = malloc(data.empty() ? 1 : data.size());
      if (!copy) return T3D_ERR_NO_MEMORY;
      if (!data.empty()) memcpy(copy, data.data(), data.size());
      *value = copy;
      *len = data.size();
      return T3D_OK;
    }
    if (errno != ENOENT) return T3D_ERR_SYSTEM;
    auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (timeout_ms >= 0 && waited >= timeout_ms) return T3D_ERR_TIMEOUT;
    std::this_thread::sleep_for(std::chrono::milliseconds(waited < 100 ? 1 : 5));
  }
}

void FileStore::Remove() {
  DIR *d = opendir(dir_.c_str());
  if (d) {
    while (struct dirent *e = readdir(d)) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      unlink((dir_ + "/" + e->d_name).c_str());
    }
    closedir(d);
  }
  rmdir(dir_.c_str());
}

// ---------- RunRanks ----------

namespace {

enum Phase { kInit = 0, kRunning, kWaitingPeers, kDestroying, kDone };
const char *const kPhaseNames[] = {"in t3d_comm_init", "in the test body", "waiting for peers",
                                   "in t3d_comm_destroy", "done"};

struct RunState {
  int n = 0;
  bool abort_on_failure = true;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<t3d_comm_t *> comms;
  std::vector<int> phase;
  int finished_body = 0;  // ranks past the body (returned or failed init)
  int finished = 0;
  bool aborted = false;
  // host barrier
  int bar_arrived = 0;
  uint64_t bar_generation = 0;
  std::vector<std::vector<unsigned char>> slots;

  // Called with mu held.
  void AbortAllLocked() {
    if (aborted) return;
    aborted = true;
    for (t3d_comm_t *c : comms)
      if (c) t3d_comm_abort(c);
    cv.notify_all();
  }
};

thread_local RunState *tls_run = nullptr;

void RankThread(RunState *st, int rank, const RankFn *fn, const t3d_store_t *store, const std::string *prefix,
                const RunOptions *opts) {
  tls_run = st;
  t3d_config_t cfg;
  t3d_config_init(&cfg);
  cfg.timeout_ms = opts->comm_timeout_ms > 0 ? opts->comm_timeout_ms : TestTimeoutMs();
  cfg.key_prefix = prefix->c_str();
  if (opts->name) cfg.name = opts->name;
  t3d_comm_t *comm = nullptr;
  t3d_result_t r = t3d_comm_init(&comm, rank, st->n, store, &cfg);
  bool run_body = false;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    if (r != T3D_OK || !comm) {
      ADD_FAILURE() << "rank " << rank << " of " << st->n << ": t3d_comm_init -> " << t3d_result_string(r) << ": "
                    << t3d_thread_last_error();
      comm = nullptr;
      if (st->abort_on_failure) st->AbortAllLocked();
    } else {
      st->comms[rank] = comm;
      if (st->aborted) t3d_comm_abort(comm);
      run_body = true;
      st->phase[rank] = kRunning;
    }
  }
  if (run_body) {
    (*fn)(rank, comm);
  }
  {
    std::unique_lock<std::mutex> lock(st->mu);
    st->phase[rank] = kWaitingPeers;
    st->finished_body++;
    if (st->abort_on_failure && ::testing::Test::HasFailure()) st->AbortAllLocked();
    st->cv.notify_all();
    // Destroy only once every rank is past its body: a peer may still be receiving what this rank sent.
    st->cv.wait(lock, [&] { return st->finished_body == st->n; });
    st->phase[rank] = kDestroying;
  }
  if (comm) {
    t3d_result_t dr = t3d_comm_destroy(comm);
    EXPECT_EQ(dr, T3D_OK) << "rank " << rank << ": t3d_comm_destroy -> " << t3d_result_string(dr);
  }
  std::lock_guard<std::mutex> lock(st->mu);
  st->comms[rank] = nullptr;
  st->phase[rank] = kDone;
  st->finished++;
  st->cv.notify_all();
}

}  // namespace

void RunRanks(int n, const RankFn &fn, int64_t deadline_ms) {
  RunOptions o;
  o.deadline_ms = deadline_ms;
  RunRanks(n, fn, o);
}

void RunRanks(int n, const RankFn &fn, const RunOptions &opts) {
  ASSERT_GT(n, 0);
  std::unique_ptr<MemStore> own_store;
  const t3d_store_t *store = opts.store;
  if (!store) {
    own_store.reset(new MemStore());
    store = own_store->store();
  }
  const std::string prefix = UniqueName("run");
  RunState st;
  st.n = n;
  // A failure already recorded by an earlier run of the same test must not abort this one.
  st.abort_on_failure = opts.abort_on_failure && !::testing::Test::HasFailure();
  st.comms.assign(static_cast<size_t>(n), nullptr);
  st.phase.assign(static_cast<size_t>(n), kInit);
  st.slots.resize(static_cast<size_t>(n));

  const int64_t deadline_ms = opts.deadline_ms >= 0 ? opts.deadline_ms : TestTimeoutMs();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(deadline_ms);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) threads.emplace_back(RankThread, &st, r, &fn, store, &prefix, &opts);

  std::unique_lock<std::mutex> lock(st.mu);
  if (!st.cv.wait_until(lock, deadline, [&] { return st.finished == n; })) {
    std::ostringstream msg;
    msg << "RunRanks(" << n << "): hard deadline of " << deadline_ms << " ms passed; ranks still running:";
    for (int r = 0; r < n; ++r)
      if (st.phase[r] != kDone) msg << " " << r << " (" << kPhaseNames[st.phase[r]] << ")";
    msg << ". Exiting the process instead of hanging (T3D_TEST_TIMEOUT_MS sets the deadline).";
    ADD_FAILURE() << msg.str();
    const ::testing::TestInfo *info = ::testing::UnitTest::GetInstance()->current_test_info();
    fprintf(stderr, "\n[  FAILED  ] %s.%s: %s\n", info ? info->test_suite_name() : "?", info ? info->name() : "?",
            msg.str().c_str());
    fflush(stderr);
    fflush(stdout);
    std::_Exit(3);
  }
  lock.unlock();
  for (std::thread &t : threads) t.join();
}

bool HostBarrier() {
  RunState *st = tls_run;
  if (!st) {
    ADD_FAILURE() << "HostBarrier called outside RunRanks";
    return false;
  }
  std::unique_lock<std::mutex> lock(st->mu);
  if (st->aborted) return false;
  uint64_t gen = st->bar_generation;
  if (++st->bar_arrived == st->n) {
    st->bar_arrived = 0;
    st->bar_generation++;
    st->cv.notify_all();
    return true;
  }
  st->cv.wait(lock, [&] { return st->bar_generation != gen || st->aborted; });
  return st->bar_generation != gen;
}

std::vector<std::vector<unsigned char>> &HostSlots() {
  static std::vector<std::vector<unsigned char>> none;
  if (!tls_run) {
    ADD_FAILURE() << "HostSlots called outside RunRanks";
    return none;
  }
  return tls_run->slots;
}

// ---------- requests ----------

t3d_result_t Finish(t3d_request_t *req, std::string *err) {
  if (!req) {
    if (err) *err = "no request was returned";
    return T3D_ERR_INTERNAL;
  }
  t3d_result_t r = t3d_wait(req, TestTimeoutMs());
  if (err) {
    const char *text = t3d_request_error(req);
    *err = text ? text : "(null request error)";
    if (r == T3D_ERR_TIMEOUT && err->empty()) *err = "t3d_wait gave up after T3D_TEST_TIMEOUT_MS";
  }
  t3d_request_free(req);
  return r;
}

t3d_result_t Complete(t3d_result_t call_res, t3d_request_t *req, std::string *err) {
  if (call_res != T3D_OK) {
    if (err) *err = "the call itself failed";
    if (req) t3d_request_free(req);
    return call_res;
  }
  return Finish(req, err);
}

t3d_result_t RunResult(const IssueFn &issue, std::string *err) {
  t3d_request_t *req = nullptr;
  t3d_result_t r = issue(&req);
  return Complete(r, req, err);
}

bool RunOk(t3d_comm_t *comm, const std::string &what, const IssueFn &issue) {
  std::string err;
  t3d_result_t r = RunResult(issue, &err);
  if (r == T3D_OK) return true;
  ADD_FAILURE() << "rank " << (comm ? t3d_comm_rank(comm) : -1) << ": " << what << " -> " << t3d_result_string(r)
                << "; request error: \"" << err << "\"; last error: \"" << (comm ? t3d_comm_last_error(comm) : "")
                << "\"";
  return false;
}

// ---------- uneven layouts ----------

size_t VCount(size_t base, int from, int to) {
  const size_t k = static_cast<size_t>(from + 2 * to) % 4;
  return k == 3 ? 0 : base + k;
}

size_t AllgathervLayout(int n, size_t base, std::vector<size_t> *counts, std::vector<size_t> *displs) {
  counts->assign(static_cast<size_t>(n), 0);
  displs->assign(static_cast<size_t>(n), 0);
  for (int r = 0; r < n; ++r) (*counts)[r] = (r % 3 == 1) ? 0 : base + 2 * static_cast<size_t>(r);
  size_t at = 0;
  for (int r = n - 1; r >= 0; --r) {
    (*displs)[r] = at;
    at += (*counts)[r] + 1;
  }
  return at;
}

A2aLayout AlltoallvLayout(int n, int rank, size_t base) {
  A2aLayout l;
  l.sc.resize(n);
  l.sd.resize(n);
  l.rc.resize(n);
  l.rd.resize(n);
  for (int p = 0; p < n; ++p) {
    l.sc[p] = VCount(base, rank, p);
    l.sd[p] = l.s_total;
    l.s_total += l.sc[p] + 1;
  }
  for (int p = n - 1; p >= 0; --p) {
    l.rc[p] = VCount(base, p, rank);
    l.rd[p] = l.r_total;
    l.r_total += l.rc[p] + 1;
  }
  return l;
}

}  // namespace t3dtest
