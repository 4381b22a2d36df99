/* A crash reporter for the GPU check (LD_PRELOAD): on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT it writes the
 * native backtrace (module(+offset) per frame) and the process's mappings of the C++ runtime, torch and t3d to
 * stderr, then lets the signal kill the process as it would have. gpu-check.sh turns the offsets into function names
 * with addr2line. Only async-signal-safe calls after the first backtrace() (made at load time, so that libgcc is
 * loaded before any crash). */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void say(const char* s) {
  ssize_t r = write(2, s, strlen(s));
  (void)r;
}

static void dump_maps(void) {
  int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) return;
  static char buf[1 << 16];
  char line[512];
  size_t n = 0;
  ssize_t got;
  while ((got = read(fd, buf, sizeof buf)) > 0) {
    for (ssize_t i = 0; i < got; i++) {
      if (n < sizeof line - 2) line[n++] = buf[i];
      if (buf[i] != '\n') continue;
      line[n] = 0;
      /* only executable mappings of the libraries that matter here */
      if (strstr(line, " r-xp ") && (strstr(line, "libstdc++") || strstr(line, "libc10") || strstr(line, "libtorch") ||
                                      strstr(line, "/t3d/") || strstr(line, "libt3d") || strstr(line, "libgcc_s")))
        say(line);
      n = 0;
    }
  }
  close(fd);
}

static void on_crash(int sig) {
  void* frames[64];
  say("\n==== t3d crash_backtrace: signal ");
  say(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGILL ? "SIGILL" : sig == SIGFPE ? "SIGFPE"
                                                                                                       : "SIGABRT");
  say(" ====\n");
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  say("==== executable mappings ====\n");
  dump_maps();
  say("==== end of crash_backtrace ====\n");
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  void* warm[2];
  backtrace(warm, 2);
  static char altstack[1 << 16];
  stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_crash;
  sa.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaction(sigs[i], &sa, NULL);
}
