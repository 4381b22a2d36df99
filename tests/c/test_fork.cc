// test_fork.cc: ranks as real processes over the file store: a clean multi-process run (collectives, then
// point-to-point, whose large messages are read from the sender's process), and the death of a rank
// (SIGKILL), after which the survivors must fail with an error naming the collective instead of hanging.
// Children never touch gtest: they report through their exit code and one line each on a pipe.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

using Clock = std::chrono::steady_clock;

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// Exit codes of a child.
enum ChildExit {
  kExitOk = 0,
  kExitInit = 10,        // t3d_comm_init failed
  kExitWrongResult = 11, // a collective returned wrong data
  kExitNoError = 12,     // the peer died but no error came
  kExitTooSlow = 13,     // the error came later than twice the timeout
  kExitWrongCode = 14,   // an error other than TIMEOUT / PEER_LOST
  kExitBadText = 15,     // the error text does not name the collective
  kExitCallFailed = 16,  // a call failed where it should not
  kExitDestroy = 17,     // t3d_comm_destroy failed
};

const int kCommTimeoutMs = 2000;
const int kWorld = 3;

// One line on the report pipe; a single write below PIPE_BUF is atomic, so lines of different children never mix.
void Report(int fd, int rank, const char *fmt, ...) {
  char line[1024];
  int len = snprintf(line, sizeof line, "rank %d: ", rank);
  va_list ap;
  va_start(ap, fmt);
  len += vsnprintf(line + len, sizeof line - static_cast<size_t>(len), fmt, ap);
  va_end(ap);
  if (len > static_cast<int>(sizeof line) - 2) len = static_cast<int>(sizeof line) - 2;
  line[len++] = '\n';
  ssize_t ignored = write(fd, line, static_cast<size_t>(len));
  (void)ignored;
}

enum class Death { kNone, kSelfKill, kParentKill };
// What the children's loop runs: allreduces, or collectives that read large buffers straight from the other ranks'
// processes (single copy): allgathers of 400 kB blocks, or 400 kB broadcasts from rank 0 (the root writes part of
// each reader's buffer, the readers read the rest); or a ring shift of 4 MiB messages, which travel through the
// pairs' staging areas (c_src/shm/stage.c).
enum class Loop { kAllreduce, kAllgather, kBroadcast, kSendRecv };

struct ChildArgs {
  int rank;
  std::string dir;
  std::string prefix;
  int report_fd;
  int ready_fd;  // rank 2 writes one byte here once it has run a few iterations (kParentKill)
  Death death;
  std::string log;  // non-empty: T3D_DEBUG=INFO into files with this prefix
  Loop loop;
  bool default_ranges;  // leave T3D_SHM_DIRECT_BYTES unset: the library's own single-copy ranges
};

// The body of a child process: init, then the loop's collective until the planned death shows as an error.
[[noreturn]] void ChildMain(const ChildArgs &a) {
  if (!a.log.empty()) {
    SetEnv("T3D_DEBUG", "INFO");
    SetEnv("T3D_DEBUG_FILE", a.log.c_str());
  }
  // Single copy of allgather blocks is off by default with more ranks than cores (3 here on 2 cores); setting the
  // size turns it on for both allgather and alltoall. The same for broadcasts, here from 256 to 512 KiB.
  if (!a.default_ranges) {
    SetEnv("T3D_SHM_P2P_STAGE_BYTES", "2097152");  // none by default: 3 ranks on 2 cores are more than the cores
    SetEnv("T3D_SHM_P2P_STAGE_MIN_BYTES", "4194304");  // the 4 MiB ring shifts below are staged (AMD: 8 MiB unset)
    SetEnv("T3D_SHM_DIRECT_BYTES", "65536");
    SetEnv("T3D_SHM_BCAST_DIRECT_BYTES", "262144");
    SetEnv("T3D_SHM_BCAST_DIRECT_MAX_BYTES", "524288");
  }
  FileStore store(a.dir);
  t3d_config_t cfg;
  t3d_config_init(&cfg);
  cfg.timeout_ms = kCommTimeoutMs;
  cfg.key_prefix = a.prefix.c_str();
  cfg.name = "forked";
  t3d_comm_t *comm = nullptr;
  t3d_result_t r = t3d_comm_init(&comm, a.rank, kWorld, store.store(), &cfg);
  if (r != T3D_OK) {
    Report(a.report_fd, a.rank, "t3d_comm_init -> %s", t3d_result_string(r));
    _exit(kExitInit);
  }
  const bool gather = a.loop == Loop::kAllgather, bcast = a.loop == Loop::kBroadcast;
  const bool p2p = a.loop == Loop::kSendRecv;
  const size_t count = a.loop == Loop::kAllreduce ? 4096 : p2p ? (size_t{1} << 20) + 3 : 100000;  // 400 kB blocks
  std::vector<float> in(count), out(gather ? count * kWorld : count);
  const char *opname = gather ? "allgather" : bcast ? "broadcast" : p2p ? " rank " : "allreduce";
  const int next = (a.rank + 1) % kWorld, prev = (a.rank + kWorld - 1) % kWorld;
  const int max_iters = a.death == Death::kNone ? 50 : 1000000;
  const auto loop_start = Clock::now();
  for (int it = 0; it < max_iters; ++it) {
    if (a.rank == 2 && a.death == Death::kSelfKill && it == 5) raise(SIGKILL);
    if (a.rank == 2 && a.death == Death::kParentKill && it == 3) {
      char byte = 'r';
      ssize_t ignored = write(a.ready_fd, &byte, 1);
      (void)ignored;
    }
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(a.rank + 1 + static_cast<int>(i % 5));
    t3d_request_t *req = nullptr;
    const auto t0 = Clock::now();
    if (bcast) out = a.rank == 0 ? in : std::vector<float>(count, -1.0f);
    if (p2p) {  // the send first, then the receive; req: the one whose wait failed
      t3d_request_t *rq = nullptr;
      r = t3d_recv(comm, out.data(), count, T3D_FLOAT32, prev, it, nullptr, &rq);
      if (r == T3D_OK) r = t3d_send(comm, in.data(), count, T3D_FLOAT32, next, it, nullptr, &req);
      if (r == T3D_OK) r = t3d_wait(req, 10 * kCommTimeoutMs);
      if (r == T3D_OK) {
        t3d_request_free(req);
        req = rq;
      }
    } else {
      r = gather ? t3d_allgather(comm, in.data(), out.data(), count, T3D_FLOAT32, nullptr, &req)
          : bcast ? t3d_broadcast(comm, out.data(), count, T3D_FLOAT32, 0, nullptr, &req)
                 : t3d_allreduce(comm, in.data(), out.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, &req);
    }
    if (r == T3D_OK) r = t3d_wait(req, 10 * kCommTimeoutMs);
    const int64_t took = MsSince(t0);
    if (r == T3D_OK) {
      t3d_request_free(req);
      for (size_t i = 0; i < out.size(); ++i) {
        const int five = static_cast<int>(i % count % 5);
        const float want = gather ? static_cast<float>(static_cast<int>(i / count) + 1 + five)
                           : bcast ? static_cast<float>(1 + five)
                           : p2p  ? static_cast<float>(prev + 1 + five)
                                  : static_cast<float>(kWorld * (kWorld + 1) / 2 + kWorld * five);
        if (out[i] != want) {
          Report(a.report_fd, a.rank, "iteration %d element %zu: got %g expected %g", it, i, out[i], want);
          _exit(kExitWrongResult);
        }
      }
      if (a.death != Death::kNone && MsSince(loop_start) > 20000) {
        Report(a.report_fd, a.rank, "no error %d iterations (%lld ms) after rank 2 was to die", it,
               static_cast<long long>(MsSince(loop_start)));
        _exit(kExitNoError);
      }
      continue;
    }
    // An error: a call that failed outright has no request; take the text from the communicator.
    const std::string text = req ? t3d_request_error(req) : t3d_comm_last_error(comm);
    if (req) t3d_request_free(req);
    if (a.death == Death::kNone) {
      Report(a.report_fd, a.rank, "iteration %d failed: %s: %s", it, t3d_result_string(r), text.c_str());
      _exit(kExitCallFailed);
    }
    Report(a.report_fd, a.rank, "iteration %d: %s after %lld ms: %s", it, t3d_result_string(r),
           static_cast<long long>(took), text.c_str());
    int code = kExitOk;
    if (r != T3D_ERR_TIMEOUT && r != T3D_ERR_PEER_LOST) code = kExitWrongCode;
    else if (took > 2 * kCommTimeoutMs) code = kExitTooSlow;
    else if (text.find(opname) == std::string::npos) code = kExitBadText;
    // The communicator is broken; destroy must still return.
    r = t3d_comm_destroy(comm);
    if (r != T3D_OK && code == kExitOk) {
      Report(a.report_fd, a.rank, "t3d_comm_destroy -> %s", t3d_result_string(r));
      code = kExitDestroy;
    }
    _exit(code);
  }
  // Point-to-point between processes: a ring shift of a small message (it travels inside a shared-memory slot), of
  // a 1 MiB one (the receiver reads it from the sender's process: process_vm_readv) and of a 16 MiB one (through
  // the pair's staging area, chunks the receiver reads itself when none is staged).
  for (size_t n : {size_t{3}, size_t{1} << 18, (size_t{1} << 22) + 5}) {
    std::vector<float> sbuf(n), rbuf(n);
    for (int it = 0; it < 5; ++it) {
      for (size_t i = 0; i < n; ++i) sbuf[i] = static_cast<float>(a.rank * 1000 + it * 10 + static_cast<int>(i % 7));
      t3d_request_t *rq = nullptr, *sq = nullptr;
      r = t3d_recv(comm, rbuf.data(), n, T3D_FLOAT32, prev, it, nullptr, &rq);
      if (r == T3D_OK) r = t3d_send(comm, sbuf.data(), n, T3D_FLOAT32, next, it, nullptr, &sq);
      if (r == T3D_OK) r = t3d_wait(sq, 10 * kCommTimeoutMs);
      if (r == T3D_OK) r = t3d_wait(rq, 10 * kCommTimeoutMs);
      if (r != T3D_OK) {
        Report(a.report_fd, a.rank, "send/recv of %zu floats, iteration %d: %s: %s", n, it, t3d_result_string(r),
               rq ? t3d_request_error(rq) : t3d_comm_last_error(comm));
        _exit(kExitCallFailed);
      }
      t3d_request_free(rq);
      t3d_request_free(sq);
      for (size_t i = 0; i < n; ++i) {
        const float want = static_cast<float>(prev * 1000 + it * 10 + static_cast<int>(i % 7));
        if (rbuf[i] != want) {
          Report(a.report_fd, a.rank, "recv of %zu floats, iteration %d, element %zu: got %g expected %g", n, it, i,
                 rbuf[i], want);
          _exit(kExitWrongResult);
        }
      }
    }
  }
  // Collectives whose blocks are large enough to be read straight from the owner's process (single copy): an
  // allgather, an alltoallv where only rank 0 sends large blocks, an alltoall; then broadcasts through the segment,
  // from rank 1 through the halves, one from rank 0 by single copy and a small one from rank 2 through the small
  // slots. New data every iteration,
  // so a reader that copied before the owner filled its buffer, or after it moved on, sees the wrong values.
  const size_t big = 100000;  // floats: 400 kB blocks
  for (int it = 0; it < 4; ++it) {
    auto value = [&](int from, int to, size_t i) {
      return static_cast<float>(from * 100000 + to * 1000 + it * 10 + static_cast<int>(i % 9));
    };
    auto check = [&](const char *what, const std::vector<float> &got, size_t at, int from, int to, size_t n) {
      for (size_t i = 0; i < n; ++i) {
        if (got[at + i] != value(from, to, i)) {
          Report(a.report_fd, a.rank, "%s, iteration %d, from rank %d, element %zu: got %g expected %g", what, it,
                 from, i, got[at + i], value(from, to, i));
          _exit(kExitWrongResult);
        }
      }
    };
    t3d_request_t *q = nullptr;
    auto run = [&](const char *what, t3d_result_t issued) {
      if (issued == T3D_OK) issued = t3d_wait(q, 10 * kCommTimeoutMs);
      if (issued != T3D_OK) {
        Report(a.report_fd, a.rank, "%s, iteration %d: %s: %s", what, it, t3d_result_string(issued),
               q ? t3d_request_error(q) : t3d_comm_last_error(comm));
        _exit(kExitCallFailed);
      }
      t3d_request_free(q);
      q = nullptr;
    };
    std::vector<float> mine(big), all(big * kWorld, -1.0f);
    for (size_t i = 0; i < big; ++i) mine[i] = value(a.rank, 0, i);
    run("allgather", t3d_allgather(comm, mine.data(), all.data(), big, T3D_FLOAT32, nullptr, &q));
    for (int p = 0; p < kWorld; ++p) check("allgather", all, big * p, p, 0, big);

    std::vector<size_t> sc(kWorld), sd(kWorld), rc(kWorld), rd(kWorld);
    size_t s_at = 0, r_at = 0;
    for (int p = 0; p < kWorld; ++p) {
      sc[p] = a.rank == 0 ? big : 10, sd[p] = s_at, s_at += sc[p];
      rc[p] = p == 0 ? big : 10, rd[p] = r_at, r_at += rc[p];
    }
    std::vector<float> sendv(s_at), recvv(r_at, -1.0f);
    for (int p = 0; p < kWorld; ++p)
      for (size_t i = 0; i < sc[p]; ++i) sendv[sd[p] + i] = value(a.rank, p, i);
    run("alltoallv", t3d_alltoallv(comm, sendv.data(), sc.data(), sd.data(), recvv.data(), rc.data(), rd.data(),
                                   T3D_FLOAT32, nullptr, &q));
    for (int p = 0; p < kWorld; ++p) check("alltoallv", recvv, rd[p], p, a.rank, rc[p]);

    std::vector<float> eq_in(big * kWorld), eq_out(big * kWorld, -1.0f);
    for (int p = 0; p < kWorld; ++p)
      for (size_t i = 0; i < big; ++i) eq_in[big * p + i] = value(a.rank, p, i);
    run("alltoall", t3d_alltoall(comm, eq_in.data(), eq_out.data(), big, T3D_FLOAT32, nullptr, &q));
    for (int p = 0; p < kWorld; ++p) check("alltoall", eq_out, big * p, p, a.rank, big);

    std::vector<float> bc(3 * big, -1.0f);
    if (a.rank == 1)
      for (size_t i = 0; i < bc.size(); ++i) bc[i] = value(1, 2, i);
    run("broadcast", t3d_broadcast(comm, bc.data(), bc.size(), T3D_FLOAT32, 1, nullptr, &q));
    check("broadcast", bc, 0, 1, 2, bc.size());

    std::vector<float> dc(big, -1.0f);  // 400 kB: single copy
    if (a.rank == 0)
      for (size_t i = 0; i < dc.size(); ++i) dc[i] = value(0, 1, i);
    run("single-copy broadcast", t3d_broadcast(comm, dc.data(), dc.size(), T3D_FLOAT32, 0, nullptr, &q));
    check("single-copy broadcast", dc, 0, 0, 1, dc.size());

    std::vector<float> sb(1000, -1.0f);
    if (a.rank == 2)
      for (size_t i = 0; i < sb.size(); ++i) sb[i] = value(2, 1, i);
    run("small broadcast", t3d_broadcast(comm, sb.data(), sb.size(), T3D_FLOAT32, 2, nullptr, &q));
    check("small broadcast", sb, 0, 2, 1, sb.size());
  }
  r = t3d_comm_destroy(comm);
  if (r != T3D_OK) {
    Report(a.report_fd, a.rank, "t3d_comm_destroy -> %s", t3d_result_string(r));
    _exit(kExitDestroy);
  }
  _exit(kExitOk);
}

std::string DescribeStatus(int status) {
  char buf[64];
  if (WIFEXITED(status)) snprintf(buf, sizeof buf, "exit code %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status)) snprintf(buf, sizeof buf, "killed by signal %d", WTERMSIG(status));
  else snprintf(buf, sizeof buf, "status 0x%x", status);
  return buf;
}

std::string ReadAll(int fd) {
  std::string s;
  char chunk[4096];
  for (;;) {
    ssize_t r = read(fd, chunk, sizeof chunk);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    s.append(chunk, static_cast<size_t>(r));
  }
  return s;
}

// Forks kWorld children, plays the parent's part of `death`, and waits for all of them under a hard deadline
// (killing every child when it passes). Returns each child's wait status; -1 for one that had to be killed.
std::vector<int> RunChildren(Death death, std::string *reports, const std::string &log = "",
                             Loop loop = Loop::kAllreduce, bool default_ranges = false) {
  const std::string dir = "/tmp/" + UniqueName("t3d-fork");
  FileStore store(dir);
  int report_pipe[2], ready_pipe[2];
  if (pipe(report_pipe) != 0 || pipe(ready_pipe) != 0) {
    ADD_FAILURE() << "pipe: " << strerror(errno);
    return {};
  }
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids(kWorld, -1);
  for (int rank = 0; rank < kWorld; ++rank) {
    pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << strerror(errno);
      break;
    }
    if (pid == 0) {
      close(report_pipe[0]);
      close(ready_pipe[0]);
      ChildArgs a{rank, dir, "fork", report_pipe[1], ready_pipe[1], death, log, loop, default_ranges};
      ChildMain(a);
    }
    pids[rank] = pid;
  }
  close(report_pipe[1]);
  close(ready_pipe[1]);

  const int64_t deadline_ms = 30000;
  const auto start = Clock::now();
  std::vector<int> status(kWorld, -1);
  std::vector<bool> done(kWorld, false);
  int remaining = 0;
  for (pid_t p : pids) remaining += p > 0;
  for (int r = 0; r < kWorld; ++r) done[r] = pids[r] <= 0;
  bool killed_rank2 = false;
  while (remaining > 0 && MsSince(start) < deadline_ms) {
    if (death == Death::kParentKill && !killed_rank2) {
      struct pollfd pfd = {ready_pipe[0], POLLIN, 0};
      if (poll(&pfd, 1, 0) == 1) {
        char byte;
        if (read(ready_pipe[0], &byte, 1) == 1 && pids[2] > 0) {
          kill(pids[2], SIGKILL);
          killed_rank2 = true;
        }
      }
    }
    for (int r = 0; r < kWorld; ++r) {
      if (done[r]) continue;
      int st = 0;
      pid_t w = waitpid(pids[r], &st, WNOHANG);
      if (w == pids[r]) {
        status[r] = st;
        done[r] = true;
        remaining--;
      }
    }
    usleep(5000);
  }
  if (remaining > 0) {
    std::string hung;
    for (int r = 0; r < kWorld; ++r) {
      if (done[r]) continue;
      hung += " " + std::to_string(r);
      kill(pids[r], SIGKILL);
      int st = 0;
      waitpid(pids[r], &st, 0);
    }
    ADD_FAILURE() << "children still running after the " << deadline_ms << " ms deadline (killed):" << hung;
  }
  if (death == Death::kParentKill) {
    EXPECT_TRUE(killed_rank2) << "rank 2 never said it was ready to be killed";
  }
  *reports = ReadAll(report_pipe[0]);
  close(report_pipe[0]);
  close(ready_pipe[0]);
  store.Remove();
  return status;
}

const char *ExitMeaning(int code) {
  switch (code) {
    case kExitOk: return "ok";
    case kExitInit: return "init failed";
    case kExitWrongResult: return "wrong allreduce result";
    case kExitNoError: return "no error after the peer died";
    case kExitTooSlow: return "error came later than 2x the timeout";
    case kExitWrongCode: return "error was neither TIMEOUT nor PEER_LOST";
    case kExitBadText: return "error text does not name the collective";
    case kExitCallFailed: return "a collective failed";
    case kExitDestroy: return "t3d_comm_destroy failed";
    default: return "?";
  }
}

void ExpectExitedOk(const std::vector<int> &status, int rank, const std::string &reports) {
  ASSERT_LT(static_cast<size_t>(rank), status.size());
  const int st = status[rank];
  ASSERT_NE(st, -1) << "rank " << rank << " had to be killed\n" << reports;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == kExitOk)
      << "rank " << rank << ": " << DescribeStatus(st) << " ("
      << (WIFEXITED(st) ? ExitMeaning(WEXITSTATUS(st)) : "signal") << ")\nchild reports:\n" << reports;
}

// A clean run whose ranks log at INFO level; returns their logs (and removes the files).
std::string CleanRunLogs(bool default_ranges) {
  std::string reports;
  const std::string log = "/tmp/" + UniqueName("t3d-fork-log");
  std::vector<int> status = RunChildren(Death::kNone, &reports, log, Loop::kAllreduce, default_ranges);
  EXPECT_EQ(status.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < static_cast<int>(status.size()); ++r) ExpectExitedOk(status, r, reports);
  std::string logs;
  const std::string dir = "/tmp", base = log.substr(5) + ".";
  if (DIR *d = opendir(dir.c_str())) {
    while (struct dirent *e = readdir(d)) {
      if (strncmp(e->d_name, base.c_str(), base.size()) != 0) continue;
      const std::string path = dir + "/" + e->d_name;
      int fd = open(path.c_str(), O_RDONLY);
      if (fd >= 0) {
        logs += ReadAll(fd);
        close(fd);
      }
      unlink(path.c_str());
    }
    closedir(d);
  }
  return logs;
}

size_t Count(const std::string &text, const std::string &what) {
  size_t n = 0;
  for (size_t at = 0; (at = text.find(what, at)) != std::string::npos; ++at) n++;
  return n;
}

// The clean run also checks, in the ranks' INFO logs, that the paths it means to cover were the ones taken:
// point-to-point over shared memory and single-copy collectives (both need cross-memory attach between processes).
TEST(Fork, CleanRunOverFileStore) {
  const std::string logs = CleanRunLogs(false);
  const char *want = "point-to-point over shared memory, single copy for allgather blocks of 65536 to 4194304 bytes, "
                     "alltoall blocks of 65536 to 4194304";
  EXPECT_EQ(Count(logs, want), static_cast<size_t>(kWorld))
      << "every rank should log that it runs point-to-point over shared memory and single-copy collectives; logs:\n"
      << logs;
}

// Without T3D_SHM_DIRECT_BYTES the ranges follow the cores: with a core per rank, blocks of 16 KiB to 4 MiB for
// both (on CPUs other than Intel's: allgather 1.5-2 MiB, alltoall 1-2 MiB); with more ranks than cores, none for
// allgather and, for alltoall, 32 KiB up to where all n * n blocks together reach 32 MiB (docs/architecture.md,
// "Single copy"). The run's alltoall blocks (400 kB) are in range either way. Broadcasts skip the segment only with
// a core per rank: 32 KiB to 16 MiB on an Intel CPU, 64 KiB to 2 MiB elsewhere.
TEST(Fork, DefaultSingleCopyRangesFollowTheCores) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cpus) cpus = CPU_COUNT(&set);
  const std::string bcast = kWorld > cpus ? "0 to 0"
                            : __builtin_cpu_is("intel") ? "32768 to 16777216" : "65536 to 2097152";
  const std::string one = __builtin_cpu_is("intel")
      ? "single copy for allgather blocks of 16384 to 4194304 bytes, alltoall blocks of 16384 to 4194304"
      : "single copy for allgather blocks of 1572864 to 2097152 bytes, alltoall blocks of 1048576 to 2097152";
  const std::string want = (kWorld > cpus
      ? "single copy for allgather blocks of 0 to 0 bytes, alltoall blocks of 32768 to " +
            std::to_string((32u << 20) / (kWorld * kWorld))
      : one) + " and broadcasts of " + bcast + " ";
  const std::string logs = CleanRunLogs(true);
  EXPECT_EQ(Count(logs, want), static_cast<size_t>(kWorld))
      << kWorld << " ranks on " << cpus << " cores: every rank should log '" << want << "'; logs:\n" << logs;
}

void ExpectSurvivorsReported(Death death, Loop loop = Loop::kAllreduce) {
  std::string reports;
  std::vector<int> status = RunChildren(death, &reports, "", loop);
  ASSERT_EQ(status.size(), static_cast<size_t>(kWorld));
  const int st2 = status[2];
  EXPECT_TRUE(st2 != -1 && WIFSIGNALED(st2) && WTERMSIG(st2) == SIGKILL)
      << "rank 2: " << (st2 == -1 ? "hung" : DescribeStatus(st2)) << "\n" << reports;
  ExpectExitedOk(status, 0, reports);
  ExpectExitedOk(status, 1, reports);
  // Visible in the log: what the survivors said.
  printf("%s", reports.c_str());
}

TEST(Fork, RankKillsItselfSurvivorsFail) { ExpectSurvivorsReported(Death::kSelfKill); }

TEST(Fork, ParentKillsRankSurvivorsFail) { ExpectSurvivorsReported(Death::kParentKill); }

// The same deaths in a loop of single-copy allgathers: a survivor waiting for the dead rank's block, reading it
// from a process that is gone, or waiting for it to finish reading its own block, fails with a timeout or a lost
// peer that names the allgather, in time.
// And in a loop of 4 MiB ring shifts through the staging areas: rank 2 dies while it stages for rank 0, reads
// rank 1's message or waits; the survivors' sends and receives fail with the lost peer (or a timeout) in time.
TEST(Fork, RankKillsItselfDuringStagedSendRecvSurvivorsFail) { ExpectSurvivorsReported(Death::kSelfKill, Loop::kSendRecv); }

TEST(Fork, ParentKillsRankDuringStagedSendRecvSurvivorsFail) {
  ExpectSurvivorsReported(Death::kParentKill, Loop::kSendRecv);
}

TEST(Fork, RankKillsItselfDuringSingleCopySurvivorsFail) { ExpectSurvivorsReported(Death::kSelfKill, Loop::kAllgather); }

TEST(Fork, ParentKillsRankDuringSingleCopySurvivorsFail) {
  ExpectSurvivorsReported(Death::kParentKill, Loop::kAllgather);
}

// And in a loop of single-copy broadcasts from rank 0, where rank 2 is a reader: the root, writing into a process
// that is gone or waiting for its reader, and the other reader fail in time, naming the broadcast.
TEST(Fork, RankKillsItselfDuringSingleCopyBroadcastSurvivorsFail) {
  ExpectSurvivorsReported(Death::kSelfKill, Loop::kBroadcast);
}

TEST(Fork, ParentKillsRankDuringSingleCopyBroadcastSurvivorsFail) {
  ExpectSurvivorsReported(Death::kParentKill, Loop::kBroadcast);
}

}  // namespace
