/* watch.c: the process's watch over the peers of its groups that are not on one host's segment (watch.h says what
 * it guarantees).
 *
 * Wiring. Each process that joins such a group starts one thread and one listening TCP socket (any address, a port
 * the kernel picks) and publishes, per group, "pid|host identity|port|addresses" in the store. For every peer
 * process it shares a group with, it opens one connection of its own (so a pair has two, one each way): it sends
 * on it, and reads nothing but the peer's greeting and, later, the end of the connection. The peer's connection to
 * it is where the peer's frames arrive: hello, heartbeats, failure reports, goodbye. Connections are shared by all
 * groups of the two processes; a goodbye goes out when the last group they share is destroyed, or at exit.
 *
 * Everything below is under one mutex except the store exchange and the blocking connects of a join (those are
 * serialised by their own mutex), the poll and the reads. Only the thread closes sockets, so the descriptors it polls stay valid while it polls. */
#include "watch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

enum { F_HELLO = 1, F_GREET, F_BEAT, F_ABORT, F_BYE };
#define MAGIC 0x74336477u /* "t3dw" */
#define MAX_PAYLOAD 1024
#define CONNECT_MS 3000

typedef struct {
  uint32_t magic;
  uint16_t type, len; /* len: payload bytes after the header */
  int32_t rank;       /* ABORT: the sender's rank in the group */
  int32_t origin;     /* ABORT: the rank whose failure it reports (the sender, or who told the sender) */
  int32_t code;       /* ABORT: that failure's error code */
  int32_t pad;
  uint64_t group;     /* ABORT: the group's id (group_id) */
  uint64_t key;       /* the sender process's key */
} frame_t;

typedef enum { ALIVE, LEFT, LOST } peer_state_t;

typedef struct peer {
  uint64_t key;
  int pid;
  char host[96]; /* its host name, for messages */
  int out_fd;    /* ours to it; -1: none */
  int close_out; /* the thread closes out_fd (goodbye sent) */
  int refs;      /* our groups that have it */
  peer_state_t state;
  uint64_t heard_ns; /* last frame from it, or when we started to expect one */
  int heard_any;
  struct peer *next;
} peer_t;

typedef struct conn { /* a connection that a peer opened to us */
  int fd;
  peer_t *peer; /* NULL until its hello */
  char buf[sizeof(frame_t) + MAX_PAYLOAD];
  size_t len;
  struct conn *next;
} conn_t;

struct t3d_watch_reg {
  t3d_comm_t *comm;
  uint64_t group;
  peer_t **peers; /* per rank; NULL for this rank and unwatched peers */
  int told;       /* t3d__watch_tell sent its report */
  int origin;     /* -1, or the rank whose failure a peer told of (origin_msg: its text) */
  char origin_msg[MAX_PAYLOAD + 1];
  struct t3d_watch_reg *next;
};

static struct {
  pthread_mutex_t mu, join_mu;
  int started, failed;
  int listen_fd, wake_fd;
  int port;
  uint64_t key;
  char ident[400];
  char addrs[512]; /* comma-separated IPv4 addresses, loopback last */
  peer_t *peers;
  conn_t *conns;
  struct t3d_watch_reg *regs;
  int64_t silence_ms;
  int grave[64]; /* descriptors for the thread to close */
  int ngrave;
} W = {.mu = PTHREAD_MUTEX_INITIALIZER, .join_mu = PTHREAD_MUTEX_INITIALIZER, .listen_fd = -1, .wake_fd = -1};

/* Under W.mu: fd is closed by the thread after its poll (it may be polling it now). */
static void bury(int fd) {
  if (W.ngrave < (int)(sizeof W.grave / sizeof W.grave[0])) W.grave[W.ngrave++] = fd;
  else shutdown(fd, SHUT_RDWR); /* the thread's next round sees it closed; leaked, which 64 pending never are */
}

static uint64_t fnv(const char *s, uint64_t h) {
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}
static uint64_t process_key(const char *ident, int pid) {
  return fnv(ident, 0xcbf29ce484222325ull) ^ ((uint64_t)(unsigned)pid * 0x9e3779b97f4a7c15ull);
}
static uint64_t group_id(const t3d_comm_t *c) {
  char s[400];
  snprintf(s, sizeof s, "%s|%s|%d", c->prefix, c->name, c->size);
  return fnv(s, 0xcbf29ce484222325ull);
}

static void wake(void) {
  uint64_t one = 1;
  if (W.wake_fd >= 0 && write(W.wake_fd, &one, sizeof one) < 0) { /* a wake-up already pending is enough */
  }
}

/* Non-blocking, never SIGPIPE; a frame that does not fit the socket's buffer is dropped (a heartbeat: the next one
 * follows; a report: the peer learns of the failure from its own wait). */
static void send_frame(int fd, int type, int rank, int origin, int code, uint64_t group, const char *payload) {
  char buf[sizeof(frame_t) + MAX_PAYLOAD];
  frame_t f = {MAGIC, (uint16_t)type, 0, rank, origin, code, 0, group, W.key};
  size_t n = payload ? strnlen(payload, MAX_PAYLOAD - 1) + 1 : 0;
  f.len = (uint16_t)n;
  memcpy(buf, &f, sizeof f);
  if (n) memcpy(buf + sizeof f, payload, n), buf[sizeof f + n - 1] = '\0';
  if (send(fd, buf, sizeof f + n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) T3D_TRACE("watch: send to fd %d: errno %d", fd, errno);
}

/* ---------- events: a peer lost, a failure reported ---------- */

static void comm_event(t3d_comm_t *c, t3d_result_t res, int told, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void comm_event(t3d_comm_t *c, t3d_result_t res, int told, const char *fmt, ...) {
  if (atomic_load(&c->watch_res) != 0) return; /* the first event wins; only this thread writes */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->watch_msg, sizeof c->watch_msg, fmt, ap);
  va_end(ap);
  c->watch_told = told;
  c->watch_since_ns = t3d__now_ns();
  atomic_store_explicit(&c->watch_res, (int)res, memory_order_release);
  /* Later operations fail at once, quoting it (core/run.c); this rank's report goes out when one of its own
   * collectives fails on it. */
  t3d__fail_comm(c, res, c->watch_msg);
  T3D_INFO("watch: group '%s' rank %d: %s", c->name, c->rank, c->watch_msg);
}

static void peer_lost(peer_t *p, const char *why) {
  if (p->state != ALIVE) return;
  p->state = LOST;
  for (struct t3d_watch_reg *g = W.regs; g != NULL; g = g->next) {
    for (int r = 0; r < g->comm->size; r++) {
      if (g->peers[r] == p) {
        comm_event(g->comm, T3D_ERR_PEER_LOST, 0, "lost rank %d (pid %d on host '%s'): %s", r, p->pid, p->host, why);
      }
    }
  }
}

/* The failure itself in a message that relays others: what follows its last "broke the group: ". A failure that
 * travels through several ranks (a host's part, then the other host, then a rank that had not run yet) would
 * otherwise nest one relay in the next until the failure itself is cut off the end of the message. */
static const char *innermost_failure(const char *msg) {
  static const char key[] = "broke the group: ";
  const char *at = msg, *q;
  while ((q = strstr(at, key)) != NULL) at = q + sizeof key - 1;
  return at;
}

static void on_abort(peer_t *p, const frame_t *f, const char *msg) {
  msg = innermost_failure(msg);
  for (struct t3d_watch_reg *g = W.regs; g != NULL; g = g->next) {
    if (g->group != f->group || f->rank < 0 || f->rank >= g->comm->size || g->peers[f->rank] != p) continue;
    if (f->origin < 0 || f->origin >= g->comm->size) continue;
    g->origin = f->origin;
    snprintf(g->origin_msg, sizeof g->origin_msg, "%s", msg);
    comm_event(g->comm, f->code < 0 ? (t3d_result_t)f->code : T3D_ERR_PEER_LOST, 1, "failed: rank %d broke the group: "
               "%s", f->origin, msg);
  }
}

/* ---------- the thread ---------- */

static peer_t *peer_find(uint64_t key) {
  for (peer_t *p = W.peers; p != NULL; p = p->next) {
    if (p->key == key) return p;
  }
  return NULL;
}

static peer_t *peer_get(uint64_t key, int pid, const char *host) {
  peer_t *p = peer_find(key);
  if (p == NULL && (p = calloc(1, sizeof *p)) != NULL) {
    p->key = key;
    p->pid = pid;
    p->out_fd = -1;
    p->state = ALIVE;
    p->heard_ns = t3d__now_ns();
    snprintf(p->host, sizeof p->host, "%.*s", (int)strcspn(host, "/"), host);
    p->next = W.peers;
    W.peers = p;
  }
  return p;
}

/* Frames in c->buf; 0 when the connection must close. */
static int parse(conn_t *c) {
  while (c->len >= sizeof(frame_t)) {
    frame_t f;
    memcpy(&f, c->buf, sizeof f);
    if (f.magic != MAGIC || f.len > MAX_PAYLOAD) return 0;
    if (c->len < sizeof f + f.len) break;
    char msg[MAX_PAYLOAD + 1];
    memcpy(msg, c->buf + sizeof f, f.len);
    msg[f.len] = '\0';
    if (f.type == F_HELLO) {
      int pid = 0;
      char host[400] = "";
      if (sscanf(msg, "%d %399s", &pid, host) < 1) return 0;
      c->peer = peer_get(f.key, pid, host);
      if (c->peer == NULL) return 0;
      c->peer->state = ALIVE; /* back after a goodbye: a new group */
      send_frame(c->fd, F_GREET, 0, 0, 0, 0, NULL);
    } else if (c->peer == NULL || c->peer->key != f.key) {
      return 0;
    }
    peer_t *p = c->peer;
    p->heard_ns = t3d__now_ns();
    p->heard_any = 1;
    if (f.type == F_ABORT) on_abort(p, &f, msg);
    if (f.type == F_BYE) p->state = LEFT;
    memmove(c->buf, c->buf + sizeof f + f.len, c->len - sizeof f - f.len);
    c->len -= sizeof f + f.len;
  }
  return 1;
}

static void read_conn(conn_t *c) {
  for (;;) {
    ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, MSG_DONTWAIT);
    if (n > 0) {
      c->len += (size_t)n;
      if (!parse(c)) n = 0;
      else continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    /* Closed (or garbage): without a goodbye first, its process is gone. */
    if (c->peer != NULL) peer_lost(c->peer, "its connection closed without a goodbye (the process died or was killed)");
    close(c->fd);
    c->fd = -1;
    return;
  }
}

static void check_silence(uint64_t now) {
  for (peer_t *p = W.peers; p != NULL; p = p->next) {
    if (p->state != ALIVE || p->refs == 0 || now < p->heard_ns + (uint64_t)W.silence_ms * 1000000ull) continue;
    char why[160];
    snprintf(why, sizeof why, "nothing heard from it for %lld ms (T3D_PEER_TIMEOUT_MS): its host is down or "
             "unreachable", (long long)W.silence_ms);
    peer_lost(p, p->heard_any ? why : "it never connected to this rank's watch");
  }
}

static void *watch_main(void *arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "t3d_watch");
  int64_t beat_ms = W.silence_ms / 5 > 0 ? W.silence_ms / 5 : 1;
  uint64_t next_beat = 0;
  struct pollfd *fds = NULL;
  void **what = NULL;
  size_t cap = 0;
  for (;;) {
    pthread_mutex_lock(&W.mu);
    uint64_t now = t3d__now_ns();
    if (now >= next_beat) {
      for (peer_t *p = W.peers; p != NULL; p = p->next) {
        if (p->out_fd >= 0 && !p->close_out) send_frame(p->out_fd, F_BEAT, 0, 0, 0, 0, NULL);
      }
      next_beat = now + (uint64_t)beat_ms * 1000000ull;
    }
    check_silence(now);
    size_t n = 2;
    for (peer_t *p = W.peers; p != NULL; p = p->next) n += p->out_fd >= 0;
    for (conn_t *c = W.conns; c != NULL; c = c->next) n += c->fd >= 0;
    if (n > cap) {
      cap = 2 * n;
      fds = realloc(fds, cap * sizeof *fds);
      what = realloc(what, cap * sizeof *what);
    }
    size_t k = 0;
    fds[k] = (struct pollfd){W.listen_fd, POLLIN, 0}, what[k++] = NULL;
    fds[k] = (struct pollfd){W.wake_fd, POLLIN, 0}, what[k++] = NULL;
    for (peer_t *p = W.peers; p != NULL; p = p->next) {
      if (p->out_fd >= 0) fds[k] = (struct pollfd){p->out_fd, POLLIN, 0}, what[k++] = p;
    }
    size_t first_conn = k;
    for (conn_t *c = W.conns; c != NULL; c = c->next) {
      if (c->fd >= 0) fds[k] = (struct pollfd){c->fd, POLLIN, 0}, what[k++] = c;
    }
    pthread_mutex_unlock(&W.mu);

    int timeout = (int)((next_beat - now) / 1000000ull) + 1;
    if (poll(fds, k, timeout) < 0 && errno != EINTR) usleep(1000);

    pthread_mutex_lock(&W.mu);
    if (fds[1].revents) {
      uint64_t v;
      if (read(W.wake_fd, &v, sizeof v) < 0) { /* nothing pending */
      }
    }
    if (fds[0].revents & POLLIN) {
      int fd = accept4(W.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
      conn_t *c = fd >= 0 ? calloc(1, sizeof *c) : NULL;
      if (c != NULL) {
        c->fd = fd;
        c->next = W.conns;
        W.conns = c;
      } else if (fd >= 0) {
        close(fd);
      }
    }
    for (size_t i = 2; i < first_conn; i++) { /* our own connections: readable means closed (or a late greeting) */
      peer_t *p = what[i];
      if (fds[i].revents == 0 || p->out_fd != fds[i].fd) continue;
      char junk[64];
      ssize_t got = recv(p->out_fd, junk, sizeof junk, MSG_DONTWAIT);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        if (!p->close_out) peer_lost(p, "its connection closed without a goodbye (the process died or was killed)");
        p->close_out = 1;
      }
    }
    for (size_t i = first_conn; i < k; i++) {
      conn_t *c = what[i];
      if (fds[i].revents != 0 && c->fd == fds[i].fd) read_conn(c);
    }
    for (peer_t *p = W.peers; p != NULL; p = p->next) {
      if (p->close_out && p->out_fd >= 0) close(p->out_fd), p->out_fd = -1;
      if (p->out_fd < 0) p->close_out = 0;
    }
    while (W.ngrave > 0) close(W.grave[--W.ngrave]);
    for (conn_t **l = &W.conns; *l != NULL;) {
      conn_t *c = *l;
      if (c->fd >= 0) {
        l = &c->next;
        continue;
      }
      *l = c->next;
      free(c);
    }
    pthread_mutex_unlock(&W.mu);
  }
  return NULL;
}

/* ---------- starting, joining, leaving ---------- */

static void at_exit(void) { /* a process that ends normally leaves; only a death counts as a loss */
  pthread_mutex_lock(&W.mu);
  for (peer_t *p = W.peers; p != NULL; p = p->next) {
    if (p->out_fd >= 0 && !p->close_out) send_frame(p->out_fd, F_BYE, 0, 0, 0, 0, NULL), p->close_out = 1;
  }
  pthread_mutex_unlock(&W.mu);
}

/* A forked child has no watch thread and must not hold its parent's connections open (they are how the parent's
 * peers see it die): it drops them, and starts its own watch if it makes groups. */
static void at_fork_child(void) {
  pthread_mutex_init(&W.mu, NULL);
  pthread_mutex_init(&W.join_mu, NULL);
  for (peer_t *p = W.peers; p != NULL; p = p->next) {
    if (p->out_fd >= 0) close(p->out_fd);
  }
  for (conn_t *c = W.conns; c != NULL; c = c->next) {
    if (c->fd >= 0) close(c->fd);
  }
  if (W.listen_fd >= 0) close(W.listen_fd);
  if (W.wake_fd >= 0) close(W.wake_fd);
  W.peers = NULL, W.conns = NULL, W.regs = NULL;
  W.started = 0, W.failed = 0, W.listen_fd = -1, W.wake_fd = -1;
}

static void local_addresses(char *out, size_t len) {
  struct ifaddrs *ifs = NULL;
  size_t n = 0;
  out[0] = '\0';
  if (getifaddrs(&ifs) != 0) return;
  for (int loop = 0; loop < 2; loop++) { /* loopback last: it reaches only this host */
    for (struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
      if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
      if (((i->ifa_flags & IFF_LOOPBACK) != 0) != loop) continue;
      char a[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, a, sizeof a);
      if (n + strlen(a) + 2 < len) n += (size_t)snprintf(out + n, len - n, "%s%s", n ? "," : "", a);
    }
  }
  freeifaddrs(ifs);
}

static t3d_result_t start(t3d_comm_t *comm) {
  if (W.started) return T3D_OK;
  if (W.failed) return T3D_ERR_SYSTEM;
  W.silence_ms = t3d__param_int(T3D_PARAM_PEER_TIMEOUT_MS);
  t3d__host_identity(W.ident, sizeof W.ident);
  W.key = process_key(W.ident, (int)getpid());
  local_addresses(W.addrs, sizeof W.addrs);
  W.listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  W.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = 0};
  socklen_t sl = sizeof sa;
  pthread_t th;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (W.listen_fd < 0 || W.wake_fd < 0 || bind(W.listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      listen(W.listen_fd, 256) != 0 || getsockname(W.listen_fd, (struct sockaddr *)&sa, &sl) != 0 ||
      pthread_create(&th, &attr, watch_main, NULL) != 0) {
    int e = errno;
    pthread_attr_destroy(&attr);
    W.failed = 1;
    return t3d__set_error(comm, T3D_ERR_SYSTEM, "t3d_comm_init: rank %d of group '%s' cannot start its watch over "
                          "its peers (a listening TCP socket and a thread): %s", comm->rank, comm->name, strerror(e));
  }
  pthread_attr_destroy(&attr);
  W.port = ntohs(sa.sin_port);
  static int once;
  if (!once) {
    once = 1;
    atexit(at_exit);
    pthread_atfork(NULL, NULL, at_fork_child);
  }
  W.started = 1;
  return T3D_OK;
}

/* Reads exactly len bytes within the deadline; 0 on success. */
static int read_full(int fd, void *buf, size_t len, uint64_t deadline) {
  size_t got = 0;
  while (got < len) {
    uint64_t now = t3d__now_ns();
    if (now >= deadline) return -1;
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, (int)((deadline - now) / 1000000ull) + 1) <= 0) continue;
    ssize_t n = recv(fd, (char *)buf + got, len - got, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return -1;
    if (n > 0) got += (size_t)n;
  }
  return 0;
}

/* Opens our connection to the peer: its first address that answers with the expected key. */
static int dial(const char *addrs, int port, uint64_t key, int same_host) {
  char list[512];
  snprintf(list, sizeof list, "%s", addrs);
  char *save = NULL;
  for (char *a = strtok_r(list, ",", &save); a != NULL; a = strtok_r(NULL, ",", &save)) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, a, &sa.sin_addr) != 1) continue;
    if (!same_host && (ntohl(sa.sin_addr.s_addr) >> 24) == 127) continue;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    uint64_t deadline = t3d__now_ns() + CONNECT_MS * 1000000ull;
    int ok = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 || errno == EINPROGRESS;
    if (ok) {
      struct pollfd pf = {fd, POLLOUT, 0};
      int err = 0;
      socklen_t el = sizeof err;
      ok = poll(&pf, 1, CONNECT_MS) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0;
    }
    if (ok) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      char hello[480];
      snprintf(hello, sizeof hello, "%d %s", (int)getpid(), W.ident);
      send_frame(fd, F_HELLO, 0, 0, 0, 0, hello);
      frame_t f;
      ok = read_full(fd, &f, sizeof f, deadline) == 0 && f.magic == MAGIC && f.type == F_GREET && f.key == key;
    }
    if (ok) return fd;
    close(fd);
  }
  return -1;
}

t3d_result_t t3d__watch_join(t3d_comm_t *comm) {
  if (comm->size < 2 || t3d__param_int(T3D_PARAM_PEER_TIMEOUT_MS) <= 0) return T3D_OK;
  pthread_mutex_lock(&W.mu);
  t3d_result_t res = start(comm);
  pthread_mutex_unlock(&W.mu);
  struct t3d_watch_reg *g = res == T3D_OK ? calloc(1, sizeof *g) : NULL;
  if (res == T3D_OK && (g == NULL || (g->peers = calloc((size_t)comm->size, sizeof *g->peers)) == NULL)) {
    res = T3D_ERR_NO_MEMORY;
  }
  char mine[1000], key[32];
  snprintf(mine, sizeof mine, "%d|%s|%d|%s", (int)getpid(), W.ident, W.port, W.addrs);
  snprintf(key, sizeof key, "watch/%d", comm->rank);
  if (res == T3D_OK) res = t3d__store_set(comm, key, mine, strlen(mine) + 1);
  for (int r = 0; r < comm->size && res == T3D_OK; r++) {
    if (r == comm->rank) continue;
    void *v = NULL;
    size_t len = 0;
    snprintf(key, sizeof key, "watch/%d", r);
    res = t3d__store_get(comm, key, &v, &len);
    if (res != T3D_OK) break;
    char ident[400] = "", addrs[512] = "";
    int pid = 0, port = 0;
    int ok = len > 0 && ((char *)v)[len - 1] == '\0' &&
             sscanf(v, "%d|%399[^|]|%d|%511s", &pid, ident, &port, addrs) == 4;
    free(v);
    if (!ok) {
      T3D_WARN("watch: rank %d of group '%s' published no usable address; it is not watched", r, comm->name);
      continue;
    }
    uint64_t k = process_key(ident, pid);
    if (k == W.key) continue; /* another rank of this process (tests): nothing to watch */
    pthread_mutex_lock(&W.join_mu); /* one dial per peer, when groups are made on several threads at once */
    pthread_mutex_lock(&W.mu);
    peer_t *p = peer_get(k, pid, ident);
    int need = p != NULL && (p->out_fd < 0 || p->close_out);
    pthread_mutex_unlock(&W.mu);
    if (p == NULL) {
      pthread_mutex_unlock(&W.join_mu);
      res = T3D_ERR_NO_MEMORY;
      break;
    }
    int fd = need ? dial(addrs, port, k, strcmp(ident, W.ident) == 0) : -1;
    pthread_mutex_lock(&W.mu);
    if (need && fd < 0) {
      T3D_WARN("watch: rank %d of group '%s' cannot reach rank %d's watch at %s port %d; a loss of that rank is "
               "found only by the operation timeout", comm->rank, comm->name, r, addrs, port);
    } else {
      if (fd >= 0) {
        if (p->out_fd >= 0) bury(p->out_fd); /* said goodbye on it, not closed yet */
        p->out_fd = fd;
        p->close_out = 0;
        if (p->refs == 0) p->heard_ns = t3d__now_ns();
      }
      p->refs++;
      g->peers[r] = p;
    }
    pthread_mutex_unlock(&W.mu);
    pthread_mutex_unlock(&W.join_mu);
  }
  if (res == T3D_OK) {
    pthread_mutex_lock(&W.mu);
    g->comm = comm;
    g->origin = -1;
    g->group = group_id(comm);
    g->next = W.regs;
    W.regs = g;
    comm->watch = g;
    pthread_mutex_unlock(&W.mu);
    wake();
  } else if (g != NULL) {
    pthread_mutex_lock(&W.mu);
    for (int r = 0; g->peers != NULL && r < comm->size; r++) {
      if (g->peers[r] != NULL) g->peers[r]->refs--;
    }
    pthread_mutex_unlock(&W.mu);
    free(g->peers);
    free(g);
  }
  return res;
}

void t3d__watch_leave(t3d_comm_t *comm) {
  struct t3d_watch_reg *g = comm->watch;
  if (g == NULL) return;
  pthread_mutex_lock(&W.mu);
  for (struct t3d_watch_reg **l = &W.regs; *l != NULL; l = &(*l)->next) {
    if (*l == g) {
      *l = g->next;
      break;
    }
  }
  for (int r = 0; r < comm->size; r++) {
    peer_t *p = g->peers[r];
    if (p == NULL || --p->refs > 0) continue;
    if (p->out_fd >= 0 && !p->close_out) send_frame(p->out_fd, F_BYE, 0, 0, 0, 0, NULL), p->close_out = 1;
  }
  pthread_mutex_unlock(&W.mu);
  wake();
  comm->watch = NULL;
  free(g->peers);
  free(g);
}

void t3d__watch_tell(t3d_comm_t *comm, t3d_result_t res, const char *msg) {
  struct t3d_watch_reg *g = comm->watch;
  if (g == NULL) return;
  pthread_mutex_lock(&W.mu);
  if (!g->told) { /* a failure that a peer told of goes on as it came, not wrapped in this rank's words */
    g->told = 1;
    int origin = g->origin >= 0 ? g->origin : comm->rank;
    const char *text = g->origin >= 0 ? g->origin_msg : msg;
    if (g->origin >= 0) res = (t3d_result_t)atomic_load(&comm->watch_res);
    for (int r = 0; r < comm->size; r++) {
      peer_t *p = g->peers[r];
      if (p != NULL && p->out_fd >= 0 && !p->close_out) {
        send_frame(p->out_fd, F_ABORT, comm->rank, origin, res, g->group, text);
      }
    }
  }
  pthread_mutex_unlock(&W.mu);
}
