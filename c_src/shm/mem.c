/* mem.c: host memory that every rank of a host can map (t3d_mem_alloc), the host analogue of NCCL's user-buffer
 * registration. Each allocation is its own memfd, mapped shared; a page of header in front of the caller's bytes
 * says what it is. Another process maps it by opening /proc/<owner pid>/fd/<fd> (the same permission as reading
 * the owner's memory, which the segment's probe checked), and keeps the mapping in a cache until the owner frees
 * the allocation (the header says so) or the cache is full. A collective whose buffers are all in such memory on
 * every rank reads and writes the peers' buffers in place (mapped.c): one copy, with non-temporal stores, instead
 * of two through the segment or the kernel's slower copy (process_vm_readv).
 *
 * fork(): a child would share these pages with its parent (they are a shared file's), so that a write in the child
 * (a DataLoader worker filling a tensor it inherited) changed the parent's tensor, and its free marked the parent's
 * allocation freed for the peers. So the child maps every allocation it inherited privately instead, copy on write
 * from the file (its writes stay its own; a page it has not written still shows what the parent writes there
 * later), no longer offers them to peers (their file holds the parent's bytes), and drops its views of the
 * parent's peers. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MEM_MAGIC 0x314d454d44443354ull /* "T3DDMEM1" */
#define MEM_HEADER 4096

typedef struct mem_header {
  uint64_t magic;
  uint64_t key;           /* id << 20 | fd, as published */
  uint64_t bytes;         /* the caller's bytes, after this page */
  _Atomic uint32_t freed; /* set by the owner before it unmaps: peers drop their mappings */
} mem_header_t;

typedef struct mem_region {
  char *base; /* the header; the caller's bytes start MEM_HEADER after it */
  size_t map_bytes;
  uint64_t key;
  int fd;
  int inherited; /* mapped privately in a child of the process that allocated it: never offered to peers */
  struct mem_region *next;
} mem_region_t;

/* A peer's allocation mapped here. */
typedef struct mem_view {
  int pid;
  uint64_t key;
  char *base;
  size_t map_bytes;
  uint64_t used; /* for eviction: the clock of its last lookup */
} mem_view_t;

#define MEM_VIEWS 1024 /* a view is evicted only when all are taken: then the least recently looked up one */

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static mem_region_t *regions;
static uint64_t next_id;
static mem_view_t views[MEM_VIEWS];
static int views_hi; /* slots at or past it were never used: lookups stop there */
static uint64_t view_clock;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void drop_view(mem_view_t *v) {
  munmap(v->base, v->map_bytes);
  memset(v, 0, sizeof *v);
}

/* Around fork(): the lock is held across it, so that the child finds the lists whole. */
static void fork_prepare(void) { pthread_mutex_lock(&mem_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&mem_lock); }

/* In the child: every inherited allocation mapped privately from its file (contents kept: they are the file's),
 * then moved over the shared mapping at the same address (mremap replaces it in one step; a failed mmap leaves it
 * as it was), and the views of the parent's peers dropped. A region that cannot be remapped (no memory for the
 * mapping) stays shared; it is still not offered, and its free does not mark the parent's allocation freed. */
static void fork_child(void) {
  for (mem_region_t *r = regions; r != NULL; r = r->next) {
    void *priv = mmap(NULL, r->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, r->fd, 0);
    /* The system call itself: the memory hooks of older UCX (Debian 12's 1.13 among them) replace mremap() with a
     * function of four arguments, which drops the new address: the mapping would move to address 0. */
    if (priv != MAP_FAILED && syscall(SYS_mremap, priv, r->map_bytes, r->map_bytes, MREMAP_MAYMOVE | MREMAP_FIXED,
                                      r->base) != (long)(uintptr_t)r->base)
      munmap(priv, r->map_bytes);
    r->inherited = 1;
  }
  for (int i = 0; i < views_hi; i++) {
    if (views[i].base != NULL) drop_view(&views[i]);
  }
  views_hi = 0;
  pthread_mutex_unlock(&mem_lock);
}

static void register_fork_handlers(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

/* Every allocation holds a descriptor for as long as it lives; raise the soft limit once so that many do fit. */
static void raise_fd_limit(void) {
  static int done;
  if (done) return;
  done = 1;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

t3d_result_t t3d_mem_alloc(size_t bytes, void **ptr) {
  if (ptr == NULL) return T3D_ERR_INVALID_ARG;
  *ptr = NULL;
  if (bytes == 0 || bytes > ((size_t)1 << 46)) return T3D_ERR_INVALID_ARG;
  pthread_once(&fork_once, register_fork_handlers);
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t map_bytes = MEM_HEADER + (bytes + page - 1) / page * page;
  pthread_mutex_lock(&mem_lock);
  raise_fd_limit();
  if (next_id == 0) { /* ids differ between processes that reuse a pid: start from the clock */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    next_id = ((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20)) & ((1ull << 43) - 1);
  }
  uint64_t id = (++next_id) & ((1ull << 44) - 1);
  pthread_mutex_unlock(&mem_lock);
  int fd = memfd_create("t3d-mem", MFD_CLOEXEC);
  if (fd < 0) return errno == EMFILE || errno == ENFILE ? T3D_ERR_NO_MEMORY : T3D_ERR_SYSTEM;
  if (fd >= (1 << 20) || ftruncate(fd, (off_t)map_bytes) != 0) {
    close(fd);
    return T3D_ERR_NO_MEMORY;
  }
  char *base = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  mem_region_t *r = malloc(sizeof *r);
  if (base == MAP_FAILED || r == NULL) {
    if (base != MAP_FAILED) munmap(base, map_bytes);
    free(r);
    close(fd);
    return T3D_ERR_NO_MEMORY;
  }
  mem_header_t *h = (mem_header_t *)(void *)base;
  h->magic = MEM_MAGIC;
  h->key = id << 20 | (uint64_t)fd;
  h->bytes = bytes;
  atomic_store_explicit(&h->freed, 0u, memory_order_relaxed);
  r->base = base;
  r->map_bytes = map_bytes;
  r->key = h->key;
  r->fd = fd;
  r->inherited = 0;
  pthread_mutex_lock(&mem_lock);
  r->next = regions;
  regions = r;
  pthread_mutex_unlock(&mem_lock);
  *ptr = base + MEM_HEADER;
  return T3D_OK;
}

t3d_result_t t3d_mem_free(void *ptr) {
  if (ptr == NULL) return T3D_OK;
  pthread_mutex_lock(&mem_lock);
  mem_region_t **pp = &regions;
  while (*pp != NULL && (*pp)->base + MEM_HEADER != (char *)ptr) pp = &(*pp)->next;
  mem_region_t *r = *pp;
  if (r != NULL) *pp = r->next;
  for (int i = 0; i < views_hi && r != NULL; i++) { /* ranks that are threads of this process mapped it too */
    if (views[i].base != NULL && views[i].pid == (int)getpid() && views[i].key == r->key) drop_view(&views[i]);
  }
  pthread_mutex_unlock(&mem_lock);
  if (r == NULL) return T3D_ERR_INVALID_ARG;
  if (!r->inherited) atomic_store_explicit(&((mem_header_t *)(void *)r->base)->freed, 1u, memory_order_release);
  munmap(r->base, r->map_bytes);
  close(r->fd);
  free(r);
  return T3D_OK;
}

int t3d_mem_owns(const void *ptr, size_t bytes) {
  uint64_t key, off;
  return t3d__mem_find(ptr, bytes, &key, &off);
}

int t3d__mem_find(const void *ptr, size_t bytes, uint64_t *key, uint64_t *off) {
  const char *p = ptr;
  int found = 0;
  pthread_mutex_lock(&mem_lock);
  for (mem_region_t *r = regions; r != NULL && !found; r = r->next) {
    const char *lo = r->base + MEM_HEADER, *hi = r->base + r->map_bytes;
    if (!r->inherited && p >= lo && p <= hi && bytes <= (size_t)(hi - p)) {
      *key = r->key;
      *off = (uint64_t)(p - r->base);
      found = 1;
    }
  }
  pthread_mutex_unlock(&mem_lock);
  return found;
}

/* Maps peer pid's allocation `key` into a view slot (its bytes in *map_bytes); NULL with err set on failure.
 * Called with mem_lock held. */
static char *map_view(int pid, uint64_t key, size_t *map_bytes, char *err, size_t errlen) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, (int)(key & ((1u << 20) - 1)));
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    snprintf(err, errlen, "opening %s: %s", path, strerror(errno));
    return NULL;
  }
  struct stat st;
  char *base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && (size_t)st.st_size > MEM_HEADER)
    base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  const mem_header_t *h = (const mem_header_t *)(const void *)base;
  if (base == MAP_FAILED || h->magic != MEM_MAGIC || h->key != key ||
      atomic_load_explicit(&h->freed, memory_order_acquire) != 0) {
    if (base != MAP_FAILED) munmap(base, (size_t)st.st_size);
    snprintf(err, errlen, "%s is not the t3d memory the rank published (freed, or not t3d_mem_alloc's)", path);
    return NULL;
  }
  mem_view_t *slot = NULL;
  /* Drops the views of allocations their owners freed, and takes a free slot (the slots in use, then the next one),
   * else the least recently used. */
  for (int i = 0; i < views_hi + (views_hi < MEM_VIEWS); i++) {
    mem_view_t *v = &views[i];
    if (v->base != NULL && atomic_load_explicit(&((mem_header_t *)(void *)v->base)->freed, memory_order_acquire))
      drop_view(v);
    if (v->base == NULL) {
      if (slot == NULL || slot->base != NULL) slot = v;
    } else if (slot == NULL || (slot->base != NULL && v->used < slot->used)) {
      slot = v;
    }
  }
  if (slot->base != NULL) drop_view(slot);
  if (slot - views >= views_hi) views_hi = (int)(slot - views) + 1;
  slot->pid = pid;
  slot->key = key;
  slot->base = base;
  slot->map_bytes = (size_t)st.st_size;
  slot->used = ++view_clock;
  *map_bytes = slot->map_bytes;
  return base;
}

char *t3d__mem_peer(int pid, uint64_t key, uint64_t off, size_t bytes, char *err, size_t errlen) {
  char *base = NULL;
  size_t map_bytes = 0;
  pthread_mutex_lock(&mem_lock);
  for (int i = 0; i < views_hi && base == NULL; i++) {
    mem_view_t *v = &views[i];
    if (v->base == NULL || v->pid != pid || v->key != key) continue;
    if (atomic_load_explicit(&((mem_header_t *)(void *)v->base)->freed, memory_order_acquire)) {
      drop_view(v); /* a process that reused the pid and the id: cannot be the live one */
      continue;
    }
    v->used = ++view_clock;
    base = v->base;
    map_bytes = v->map_bytes;
  }
  if (base == NULL) base = map_view(pid, key, &map_bytes, err, errlen);
  pthread_mutex_unlock(&mem_lock);
  if (base == NULL) return NULL;
  if (off < MEM_HEADER || off > map_bytes || bytes > map_bytes - off) {
    snprintf(err, errlen, "bytes %llu..%llu lie outside the %zu-byte allocation", (unsigned long long)off,
             (unsigned long long)(off + bytes), map_bytes);
    return NULL;
  }
  return base + off;
}
