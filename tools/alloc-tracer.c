/* alloc-tracer: an LD_PRELOAD library (libebb-alloc-tracer.so) that records a process's heap
 * blocks of at least a given size as an ebb-alloc-replay trace. It is how the real training
 * traces in perf/traces were recorded (tools/record-traces.py); it is no part of libebb.
 *
 *   LD_PRELOAD=build/default/lib/libebb-alloc-tracer.so EBB_ALLOC_TRACE=out.trace program ...
 *
 * Environment (read once, at the first allocation):
 *   EBB_ALLOC_TRACE      the trace file (created or truncated). Unset or empty: nothing is traced
 *                        and every call goes straight to the next allocator. The tracer removes
 *                        the variable from the environment once read, so a child the program
 *                        starts (torch and Python run `uname`, `ldconfig`, ...) does not truncate
 *                        the file: it inherits LD_PRELOAD but traces nothing.
 *   EBB_ALLOC_TRACE_MIN  smallest block traced, in bytes (default 4096). Smaller blocks, and their
 *                        frees, are not in the trace.
 *   EBB_ALLOC_TRACE_CALLS  comma-separated calls whose blocks are recorded (default: all of
 *                        malloc,calloc,realloc,posix_memalign,aligned_alloc,memalign). Frees of
 *                        recorded blocks are always recorded. PyTorch's CPU allocator takes every
 *                        tensor from posix_memalign, while OpenBLAS mallocs a 512 KiB job array
 *                        per threaded GEMM: `posix_memalign` keeps the tensors and leaves out what
 *                        no device allocator would see (tools/record-traces.py sets it). A name
 *                        not in the list: nothing is traced, with a message on stderr.
 *   EBB_ALLOC_TRACE_PAUSED  1: start paused (see ebb_alloc_tracer_resume).
 *   EBB_ALLOC_TRACE_WHO  1: end each `a` line with a comment naming the call (`# posix_memalign`),
 *                        to see where blocks come from; the replay ignores it.
 *
 * Output: ebb-alloc-replay's format (tools/ebb-alloc-replay.c): `a <id> <bytes>` for malloc,
 * calloc, posix_memalign, aligned_alloc, memalign and the new block of a realloc; `f <id>` for
 * free and the old block of a realloc; `#` comment lines. Ids count up from 0 and are never
 * reused. Bytes are the size asked for. Blocks still live at exit stay unfreed in the trace
 * (ebb-alloc-replay frees what a trace leaves live). A block allocated before tracing started or
 * while paused is unknown to the tracer, and so is its free. A process that forks stops tracing
 * in the child. Not intercepted: valloc, pvalloc, reallocarray and glibc-internal allocations
 * that do not go through the exported symbols.
 *
 * Steps: the traced program marks them by calling functions exported here, found with dlsym or,
 * from Python, ctypes.CDLL(path_of_this_library) (the preloaded copy is the one returned):
 *   void ebb_alloc_tracer_mark(const char *text)  writes `# <text>` (newlines become spaces),
 *                                                  e.g. "step 3", and flushes the file;
 *   void ebb_alloc_tracer_pause(void) / _resume(void)  stop / start recording new blocks (frees
 *                                                  of recorded blocks are still recorded, so the
 *                                                  trace stays consistent);
 *   void ebb_alloc_tracer_stop(void)               flush and close: nothing more is recorded;
 *   int  ebb_alloc_tracer_active(void)             1 while a trace file is open.
 * The library's destructor calls ebb_alloc_tracer_stop.
 *
 * Threading: every hook may run on any thread. One mutex guards the table of traced blocks and
 * the output buffer, so each event's line is written in the order its table change happened: a
 * free's line is written before the block goes back to the allocator, an allocation's after it
 * came from it, so an address never appears live twice. The table lives in mmap'ed memory and
 * the output is written with write(2): nothing under the lock calls malloc. dlsym may call
 * calloc/malloc while the real functions are being looked up; those calls (made on the thread
 * running the one-time initialisation) are served from a static buffer and never freed.
 */
#define _GNU_SOURCE /* RTLD_NEXT; memalign's declaration in <malloc.h> */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define TRACER_API __attribute__((visibility("default")))
/* initial-exec: the library is preloaded, so its thread-locals sit in the static TLS block and
 * reading one never calls __tls_get_addr (which may allocate). */
#define TRACER_TLS _Thread_local __attribute__((tls_model("initial-exec")))

TRACER_API void ebb_alloc_tracer_mark(const char *text);
TRACER_API void ebb_alloc_tracer_pause(void);
TRACER_API void ebb_alloc_tracer_resume(void);
TRACER_API void ebb_alloc_tracer_stop(void);
TRACER_API int ebb_alloc_tracer_active(void);

/* ---- the real functions -------------------------------------------------------------------- */

typedef void *(*malloc_fn)(size_t);
typedef void *(*calloc_fn)(size_t, size_t);
typedef void *(*realloc_fn)(void *, size_t);
typedef void (*free_fn)(void *);
typedef int (*posix_memalign_fn)(void **, size_t, size_t);
typedef void *(*aligned_alloc_fn)(size_t, size_t);

static malloc_fn real_malloc;
static calloc_fn real_calloc;
static realloc_fn real_realloc;
static free_fn real_free;
static posix_memalign_fn real_posix_memalign;
static aligned_alloc_fn real_aligned_alloc;
static aligned_alloc_fn real_memalign;

/* The calls, as bits of `calls` (EBB_ALLOC_TRACE_CALLS), in the order of call_names. */
enum { C_MALLOC = 1, C_CALLOC = 2, C_REALLOC = 4, C_POSIX_MEMALIGN = 8, C_ALIGNED_ALLOC = 16, C_MEMALIGN = 32 };
static const char *const call_names[] = {"malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign"};
#define NCALLS (sizeof call_names / sizeof call_names[0])

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static TRACER_TLS bool in_init; /* this thread runs init(): allocations go to the boot buffer */

/* ---- the boot buffer: what dlsym allocates while init() runs -------------------------------- */

#define BOOT_BYTES (64 * 1024)
static _Alignas(64) unsigned char boot_buf[BOOT_BYTES];
static size_t boot_used; /* only the init thread touches it, inside pthread_once */

static bool is_boot(const void *p) {
  return (const unsigned char *)p >= boot_buf && (const unsigned char *)p < boot_buf + BOOT_BYTES;
}

/* Returns a zeroed block (the buffer is static, never reused), or NULL when it is exhausted. */
static void *boot_alloc(size_t bytes, size_t align) {
  if (align < 16) align = 16;
  size_t at = (boot_used + align - 1) & ~(align - 1);
  if (at > BOOT_BYTES || bytes > BOOT_BYTES - at) return NULL;
  boot_used = at + bytes;
  return boot_buf + at;
}

/* ---- the table of traced blocks -------------------------------------------------------------
 * Open addressing keyed by address, linear probing, backward-shift deletion; in mmap'ed memory
 * so growing it never calls malloc. Guarded by `lock`. */

typedef struct slot {
  uintptr_t addr; /* 0: empty */
  uint64_t id;
  size_t bytes;
} slot;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static slot *table;
static size_t table_cap; /* a power of two, or 0 */
static size_t table_n;

static size_t hash_addr(uintptr_t a) {
  uint64_t x = (uint64_t)a >> 4; /* blocks are at least 16-byte aligned */
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return (size_t)x;
}

static bool table_grow(void) {
  size_t ncap = table_cap ? table_cap * 2 : 4096;
  slot *n = mmap(NULL, ncap * sizeof *n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (n == MAP_FAILED) return false;
  for (size_t i = 0; i < table_cap; i++) {
    if (table[i].addr == 0) continue;
    size_t j = hash_addr(table[i].addr) & (ncap - 1);
    while (n[j].addr != 0) j = (j + 1) & (ncap - 1);
    n[j] = table[i];
  }
  if (table != NULL) munmap(table, table_cap * sizeof *table);
  table = n;
  table_cap = ncap;
  return true;
}

/* false when the table cannot grow (the block is then left out of the trace). */
static bool table_put(uintptr_t addr, uint64_t id, size_t bytes) {
  if ((table_n + 1) * 4 > table_cap * 3 && !table_grow()) return false;
  size_t mask = table_cap - 1;
  size_t i = hash_addr(addr) & mask;
  while (table[i].addr != 0) i = (i + 1) & mask;
  table[i] = (slot){.addr = addr, .id = id, .bytes = bytes};
  table_n++;
  return true;
}

/* Removes addr; true with its entry in *out when it was traced. */
static bool table_take(uintptr_t addr, slot *out) {
  if (table_cap == 0) return false;
  size_t mask = table_cap - 1;
  size_t i = hash_addr(addr) & mask;
  while (table[i].addr != addr) {
    if (table[i].addr == 0) return false;
    i = (i + 1) & mask;
  }
  *out = table[i];
  size_t hole = i;
  for (size_t j = (hole + 1) & mask; table[j].addr != 0; j = (j + 1) & mask) {
    size_t home = hash_addr(table[j].addr) & mask;
    /* j may move to the hole only if its home is not in (hole, j] (cyclically). */
    bool home_in_range = hole < j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (!home_in_range) {
      table[hole] = table[j];
      hole = j;
    }
  }
  table[hole].addr = 0;
  table_n--;
  return true;
}

/* ---- output -------------------------------------------------------------------------------- */

static int out_fd = -1;   /* under lock; -1: not tracing (never opened, stopped, or a fork child) */
static bool paused;       /* under lock */
static bool who;          /* EBB_ALLOC_TRACE_WHO */
static unsigned calls = (1u << NCALLS) - 1; /* EBB_ALLOC_TRACE_CALLS */
static size_t min_bytes = 4096;
static uint64_t next_id;  /* under lock */
static char out_buf[64 * 1024];
static size_t out_len;    /* under lock */

static void out_flush(void) {
  size_t done = 0;
  while (done < out_len) {
    ssize_t w = write(out_fd, out_buf + done, out_len - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break; /* a full disk loses the rest: the replay then reports the broken trace */
    done += (size_t)w;
  }
  out_len = 0;
}

static void out_str(const char *s, size_t n) {
  while (n > 0) {
    if (out_len == sizeof out_buf) out_flush();
    size_t k = sizeof out_buf - out_len;
    if (k > n) k = n;
    memcpy(out_buf + out_len, s, k);
    out_len += k;
    s += k;
    n -= k;
  }
}

static void out_cstr(const char *s) { out_str(s, strlen(s)); }

static void out_u64(uint64_t v) {
  char d[20];
  size_t n = 0;
  do {
    d[sizeof d - 1 - n++] = (char)('0' + v % 10);
    v /= 10;
  } while (v != 0);
  out_str(d + sizeof d - n, n);
}

/* Under lock, tracing. `what` names the call (EBB_ALLOC_TRACE_WHO). */
static void record_alloc(void *p, size_t bytes, const char *what) {
  uint64_t id = next_id;
  if (!table_put((uintptr_t)p, id, bytes)) return;
  next_id++;
  out_cstr("a ");
  out_u64(id);
  out_cstr(" ");
  out_u64(bytes);
  if (who) {
    out_cstr(" # ");
    out_cstr(what);
  }
  out_cstr("\n");
}

/* Under lock. true when p was traced (its `f` line is written). */
static bool record_free(void *p, slot *e) {
  if (!table_take((uintptr_t)p, e)) return false;
  out_cstr("f ");
  out_u64(e->id);
  out_cstr("\n");
  return true;
}

/* ---- initialisation ------------------------------------------------------------------------ */

static void fork_child(void) { /* the child holds a copy of lock, taken by the fork handler */
  out_fd = -1;
  out_len = 0;
  pthread_mutex_unlock(&lock);
}
static void fork_prepare(void) { pthread_mutex_lock(&lock); }
static void fork_parent(void) { pthread_mutex_unlock(&lock); }

static void *must_sym(const char *name) {
  void *f = dlsym(RTLD_NEXT, name);
  if (f == NULL) {
    static const char msg[] = "libebb-alloc-tracer: a symbol of the allocator cannot be found; aborting\n";
    (void)!write(2, msg, sizeof msg - 1);
    abort(); /* nothing can allocate without it */
  }
  return f;
}

static void init(void) {
  in_init = true;
  /* A function pointer is read from dlsym's void *: POSIX guarantees the conversion. */
  *(void **)&real_malloc = must_sym("malloc");
  *(void **)&real_calloc = must_sym("calloc");
  *(void **)&real_realloc = must_sym("realloc");
  *(void **)&real_free = must_sym("free");
  *(void **)&real_posix_memalign = must_sym("posix_memalign");
  *(void **)&real_aligned_alloc = must_sym("aligned_alloc");
  *(void **)&real_memalign = must_sym("memalign");

  const char *path = getenv("EBB_ALLOC_TRACE");
  if (path != NULL && path[0] != '\0') {
    const char *m = getenv("EBB_ALLOC_TRACE_MIN");
    if (m != NULL && m[0] != '\0') {
      size_t v = 0;
      for (; *m >= '0' && *m <= '9'; m++) v = v * 10 + (size_t)(*m - '0');
      min_bytes = v;
    }
    bool calls_ok = true;
    const char *c = getenv("EBB_ALLOC_TRACE_CALLS");
    if (c != NULL && c[0] != '\0') {
      calls = 0;
      while (*c != '\0' && calls_ok) {
        size_t n = strcspn(c, ",");
        calls_ok = false;
        for (size_t i = 0; i < NCALLS; i++) {
          if (strlen(call_names[i]) == n && strncmp(c, call_names[i], n) == 0) {
            calls |= 1u << i;
            calls_ok = true;
          }
        }
        c += n;
        if (*c == ',') c++;
      }
    }
    const char *p = getenv("EBB_ALLOC_TRACE_PAUSED");
    paused = p != NULL && strcmp(p, "1") == 0;
    const char *w = getenv("EBB_ALLOC_TRACE_WHO");
    who = w != NULL && strcmp(w, "1") == 0;
    int fd = calls_ok ? open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    if (!calls_ok) {
      static const char msg[] =
          "libebb-alloc-tracer: EBB_ALLOC_TRACE_CALLS names a call it does not know; expected a comma-separated "
          "list of malloc, calloc, realloc, posix_memalign, aligned_alloc, memalign; not tracing\n";
      (void)!write(2, msg, sizeof msg - 1);
    } else if (fd >= 0) {
      pthread_atfork(fork_prepare, fork_parent, fork_child);
      out_fd = fd;
      out_cstr("# ebb-alloc-tracer: blocks of ");
      out_u64(min_bytes);
      out_cstr(" bytes or more from");
      for (size_t i = 0; i < NCALLS; i++) {
        if ((calls & (1u << i)) == 0) continue;
        out_cstr(" ");
        out_cstr(call_names[i]);
      }
      out_cstr("\n");
    } else {
      static const char msg[] = "libebb-alloc-tracer: cannot open EBB_ALLOC_TRACE; not tracing\n";
      (void)!write(2, msg, sizeof msg - 1);
    }
    /* The children of this process inherit LD_PRELOAD but must not truncate the file. */
    unsetenv("EBB_ALLOC_TRACE");
  }
  in_init = false;
}

static void ensure_init(void) { pthread_once(&init_once, init); }

__attribute__((destructor)) static void tracer_fini(void) { ebb_alloc_tracer_stop(); }

/* ---- the hooks ----------------------------------------------------------------------------- */

/* A block of `bytes` came from the allocator through `call` (a C_* bit): record it if it is
 * traced. `what` is the comment of EBB_ALLOC_TRACE_WHO. */
static void after_alloc(void *p, size_t bytes, unsigned call, const char *what) {
  if (p == NULL || bytes < min_bytes || (calls & call) == 0) return;
  pthread_mutex_lock(&lock);
  if (out_fd >= 0 && !paused) record_alloc(p, bytes, what);
  pthread_mutex_unlock(&lock);
}

/* p goes back to the allocator: its `f` line first, so its address is not live twice. */
static void before_free(void *p) {
  slot e;
  pthread_mutex_lock(&lock);
  if (out_fd >= 0) record_free(p, &e);
  pthread_mutex_unlock(&lock);
}

TRACER_API void *malloc(size_t bytes) {
  if (in_init) return boot_alloc(bytes, 16);
  ensure_init();
  void *p = real_malloc(bytes);
  after_alloc(p, bytes, C_MALLOC, "malloc");
  return p;
}

TRACER_API void *calloc(size_t n, size_t size) {
  if (in_init) return n != 0 && size > SIZE_MAX / n ? NULL : boot_alloc(n * size, 16);
  ensure_init();
  void *p = real_calloc(n, size);
  if (p != NULL) after_alloc(p, n * size, C_CALLOC, "calloc"); /* non-NULL: n * size did not overflow */
  return p;
}

TRACER_API void free(void *p) {
  if (p == NULL || is_boot(p)) return;
  ensure_init();
  before_free(p);
  real_free(p);
}

TRACER_API void *realloc(void *p, size_t bytes) {
  if (in_init || is_boot(p)) {
    /* A boot block's size is unknown: copy what the buffer holds after it (it is zeroed). */
    void *n = in_init ? boot_alloc(bytes, 16) : malloc(bytes);
    if (n != NULL && p != NULL) {
      size_t avail = (size_t)(boot_buf + BOOT_BYTES - (unsigned char *)p);
      memcpy(n, p, avail < bytes ? avail : bytes);
    }
    return n;
  }
  ensure_init();
  if (p == NULL) {
    void *n = real_realloc(NULL, bytes);
    after_alloc(n, bytes, C_REALLOC, "realloc");
    return n;
  }
  /* The old block's free is recorded before the call: once realloc returns, another thread may
   * be given its address. If realloc fails the block is still live: it is recorded again. */
  slot old;
  bool traced;
  pthread_mutex_lock(&lock);
  traced = out_fd >= 0 && record_free(p, &old);
  pthread_mutex_unlock(&lock);
  void *n = real_realloc(p, bytes);
  if (n == NULL && bytes != 0) {
    if (traced) after_alloc(p, old.bytes, ~0u, "realloc (failed, the old block again)");
    return NULL;
  }
  after_alloc(n, bytes, C_REALLOC, "realloc");
  return n;
}

TRACER_API int posix_memalign(void **out, size_t align, size_t bytes) {
  if (in_init) {
    void *p = boot_alloc(bytes, align);
    if (p == NULL) return ENOMEM;
    *out = p;
    return 0;
  }
  ensure_init();
  int rc = real_posix_memalign(out, align, bytes);
  if (rc == 0) after_alloc(*out, bytes, C_POSIX_MEMALIGN, "posix_memalign");
  return rc;
}

TRACER_API void *aligned_alloc(size_t align, size_t bytes) {
  if (in_init) return boot_alloc(bytes, align);
  ensure_init();
  void *p = real_aligned_alloc(align, bytes);
  after_alloc(p, bytes, C_ALIGNED_ALLOC, "aligned_alloc");
  return p;
}

TRACER_API void *memalign(size_t align, size_t bytes) {
  if (in_init) return boot_alloc(bytes, align);
  ensure_init();
  void *p = real_memalign(align, bytes);
  after_alloc(p, bytes, C_MEMALIGN, "memalign");
  return p;
}

/* ---- the control functions ----------------------------------------------------------------- */

TRACER_API void ebb_alloc_tracer_mark(const char *text) {
  ensure_init();
  pthread_mutex_lock(&lock);
  if (out_fd >= 0 && text != NULL) {
    out_cstr("# ");
    for (const char *c = text; *c; c++) out_str(*c == '\n' || *c == '\r' ? " " : c, 1);
    out_cstr("\n");
    out_flush();
  }
  pthread_mutex_unlock(&lock);
}

TRACER_API void ebb_alloc_tracer_pause(void) {
  ensure_init();
  pthread_mutex_lock(&lock);
  paused = true;
  pthread_mutex_unlock(&lock);
}

TRACER_API void ebb_alloc_tracer_resume(void) {
  ensure_init();
  pthread_mutex_lock(&lock);
  paused = false;
  pthread_mutex_unlock(&lock);
}

TRACER_API void ebb_alloc_tracer_stop(void) {
  ensure_init();
  pthread_mutex_lock(&lock);
  if (out_fd >= 0) {
    out_flush();
    close(out_fd);
    out_fd = -1;
  }
  pthread_mutex_unlock(&lock);
}

TRACER_API int ebb_alloc_tracer_active(void) {
  ensure_init();
  pthread_mutex_lock(&lock);
  int on = out_fd >= 0;
  pthread_mutex_unlock(&lock);
  return on;
}
