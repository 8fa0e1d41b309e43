/* sim_exec.c: streams, engines, events and everything that enqueues work (copies, memset, host
 * functions, kernel launches) on the emulated driver.
 *
 * Model: a stream is a FIFO of commands; its head runs when the command before it has retired.
 * Each device has a bounded set of engine threads, started when first needed: one compute engine
 * (kernels, memset), two copy engines (COPY0: H2D, D2D, H2H; COPY1: D2H, peer) and one host-function
 * thread. An engine runs the head of any stream that is queued on it, higher priority first, so a
 * copy on one stream overlaps a kernel on another. Event records and stream waits never reach an
 * engine: they retire inline when they reach the head (a wait only once its event's work is done).
 * Stream positions are sequence numbers that only grow, across slot reuse too, so an event is just
 * {stream, seq} and "complete" means stream->done >= seq.
 *
 * Threading: one scheduler lock (`sched`) guards every queue, engine state and event record, for
 * all devices: cross-device waits and peer copies then need no lock ordering, and the lock is held
 * only to move list nodes, never while a command runs. `done` and `pending` are atomics so host
 * waits spin on them without the lock before parking on the device's condition variable. Commands
 * come from a free list (no malloc per launch once warm); engines are woken (a futex) only when
 * parked.
 *
 * Perturbation (EBB_SIM_PERTURB=<seed>): each engine command that reaches its stream's head
 * becomes eligible only after a random delay (none for a quarter of them, else up to about 2 ms,
 * log-uniform), and an engine picks at random among its eligible streams of the highest priority
 * that has any. Work of one stream still runs in issue order and waits still order, so everything
 * CUDA guarantees holds; what it leaves open (the order and timing of independent streams' work,
 * copies of one device on one copy engine included) varies from run to run, and a missing event
 * shows up as wrong data. The random state lives under sched and is seeded once at cuInit.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim_internal.h"

enum sim_cmd_kind { SIM_CMD_KERNEL, SIM_CMD_MEMSET, SIM_CMD_COPY, SIM_CMD_HOSTFN, SIM_CMD_RECORD, SIM_CMD_WAIT };

#define SIM_INLINE_ARGS 192u  /* kernel argument structs up to this size need no heap */
#define SIM_CMD_CHUNK 64u
#define SIM_STREAM_DEPTH 1024u /* commands a stream may hold before issuing blocks, as CUDA's
                                  pushbuffer does; it also bounds the command pool once warm */
#define SIM_SPIN_NS 5000      /* host waits and idle engines spin this long before parking */
#define SIM_LOCK_SPIN 200     /* trylock attempts on the scheduler lock before blocking */
#define SIM_COPY_PIECES 16    /* a modelled copy lands in this many pieces ... */
#define SIM_COPY_MIN_PIECE ((size_t)64 << 10) /* ... of at least 64 KiB */
#define SIM_PERTURB_LOG2_MAX_US 11 /* perturbation delays reach 2^11 us (about 2 ms) at most */

struct sim_event;

struct sim_cmd {
  struct ebb_list link;       /* in its stream's queue, or on the free list */
  uint64_t seq;               /* position in the stream */
  int kind;                   /* enum sim_cmd_kind */
  int engine;                 /* enum sim_engine_kind, for engine commands */
  union {
    struct { ebbsim_kernel_fn fn; } kernel;
    struct { void *dst; const void *src; size_t n; } copy;
    struct { void *dst; size_t n; unsigned char value; } memset;
    struct { CUhostFn fn; void *user; } host;
    struct { struct sim_event *ev; uint32_t ev_gen; uint64_t rec_id; } record;
    struct { struct sim_stream *target; uint64_t seq; } wait;
  } u;
  void *args;                 /* kernel arguments: inline_args or heap_args */
  void *heap_args;            /* kept across reuse, grown on demand */
  size_t heap_cap;
  _Alignas(16) unsigned char inline_args[SIM_INLINE_ARGS];
};

struct sim_stream {
  struct sim_slot slot;
  struct sim_device *dev;
  int prio;
  unsigned flags;
  struct ebb_list queue;       /* commands, oldest (the head) first */
  struct ebb_list ready_link;  /* in an engine's ready list */
  struct ebb_list waiters;     /* streams whose head waits for work of this stream */
  struct ebb_list wait_link;   /* in a target stream's waiters */
  bool running, in_ready, in_waiters;
  bool zombie;                 /* destroyed with work pending: freed when the queue drains */
  uint64_t ready_at;           /* perturbation: the head may run from this time on (0: at once) */
  uint64_t issued;             /* seq of the newest command; never reset, even on slot reuse */
  _Atomic uint64_t done;       /* seq of the newest retired command; never reset either */
};

struct sim_event {
  struct sim_slot slot;
  struct sim_device *dev;
  unsigned flags;
  struct sim_stream *stream;   /* NULL: never recorded */
  uint64_t seq;                /* the record's position in `stream` */
  uint64_t rec_id;             /* bumps per record, so a stale record command writes no time */
  uint64_t time_ns;            /* completion time of the latest record */
};

static pthread_mutex_t sched = PTHREAD_MUTEX_INITIALIZER;
static struct ebb_list cmd_free = {&cmd_free, &cmd_free}; /* sched */
static struct sim_table stream_table = SIM_TABLE_INIT(SIM_TAG_STREAM, struct sim_stream);
static struct sim_table event_table = SIM_TABLE_INIT(SIM_TAG_EVENT, struct sim_event);
static uint64_t perturb_rng; /* sched: xorshift64* state, seeded from EBB_SIM_PERTURB */

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Spin-then-park helper: call with i = 0, 1, 2, ... between polls; returns false once
 * SIM_SPIN_NS have passed (the clock is read every 64 polls, through the vDSO: no system call). */
static bool spin_more(unsigned i, uint64_t *deadline) {
  if (i % 64 == 0) {
    uint64_t now = sim_now_ns();
    if (i == 0)
      *deadline = now + SIM_SPIN_NS;
    else if (now >= *deadline)
      return false;
  }
  cpu_relax();
  return true;
}

static void sleep_until(uint64_t deadline_ns) {
  struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000u), .tv_nsec = (long)(deadline_ns % 1000000000u)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/* Waits on `cv` until signalled or CLOCK_MONOTONIC reaches deadline_ns (engine cvs use that clock). */
static void cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *m, uint64_t deadline_ns) {
  struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000u), .tv_nsec = (long)(deadline_ns % 1000000000u)};
  pthread_cond_timedwait(cv, m, &ts); /* a timeout, a signal and a spurious wake all mean: look again */
}

/* Takes the scheduler lock, spinning briefly first: critical sections are a few list moves, so
 * a launch that meets an engine inside one waits a few hundred nanoseconds in user space rather
 * than sleeping in the kernel (a plain pthread_mutex_lock would futex-wait on every collision). */
static void sched_lock(void) {
  for (int i = 0; i < SIM_LOCK_SPIN; i++) {
    if (pthread_mutex_trylock(&sched) == 0) return;
    cpu_relax();
  }
  pthread_mutex_lock(&sched);
}

/* ---------------------------------------------------------------- commands */

static struct sim_cmd *cmd_alloc(void) {
  struct ebb_list *n = ebb_list_pop_head(&cmd_free);
  if (!n) {
    /* Warm-up only: the pool grows by a chunk and never shrinks. */
    struct sim_cmd *chunk = calloc(SIM_CMD_CHUNK, sizeof *chunk);
    if (!chunk) return NULL;
    for (unsigned i = 1; i < SIM_CMD_CHUNK; i++) ebb_list_insert_tail(&cmd_free, &chunk[i].link);
    n = &chunk[0].link;
    ebb_list_init(n);
  }
  return ebb_container_of(n, struct sim_cmd, link);
}

static void cmd_free_one(struct sim_cmd *c) { ebb_list_insert_head(&cmd_free, &c->link); }

/* ---------------------------------------------------------------- perturbation */

/* splitmix64: spreads a small seed (1, 2, 3 ...) over the whole state, which xorshift needs
 * non-zero. */
static uint64_t perturb_seed_state(uint64_t seed) {
  uint64_t z = seed + 0x9E3779B97F4A7C15u;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
  z ^= z >> 31;
  return z ? z : 1;
}

/* The next random number (xorshift64*). Caller holds sched. */
static uint64_t perturb_next(void) {
  perturb_rng ^= perturb_rng >> 12;
  perturb_rng ^= perturb_rng << 25;
  perturb_rng ^= perturb_rng >> 27;
  return perturb_rng * 0x2545F4914F6CDD1Du;
}

/* How long a command that just reached its stream's head waits before an engine may take it.
 * Log-uniform: mostly microseconds, sometimes a few hundred, rarely 2 ms, so a race window of any
 * width gets hit without making a test suite of thousands of commands slow. Caller holds sched. */
static uint64_t perturb_delay_ns(void) {
  uint64_t r = perturb_next();
  if ((r & 3) == 0) return 0;
  unsigned k = (unsigned)((r >> 2) % (SIM_PERTURB_LOG2_MAX_US + 1));
  return (r >> 16) % ((uint64_t)1000 << k);
}

/* ---------------------------------------------------------------- engines and scheduling */

static void *engine_main(void *arg);

static bool engine_start(struct sim_engine *e) {
  pthread_t t;
  if (pthread_create(&t, NULL, engine_main, e) != 0) return false;
  pthread_detach(t);
  e->started = true;
  return true;
}

static void stream_schedule(struct sim_stream *s);

static void stream_free(struct sim_stream *s) {
  s->zombie = false;
  sim_table_free(&stream_table, &s->slot);
}

/* Retires the head command `c` of `s`. Caller holds sched. */
static void stream_retire(struct sim_stream *s, struct sim_cmd *c) {
  struct sim_device *d = s->dev;
  ebb_list_remove(&c->link);
  /* release: pairs with the acquire loads in host waits, so a host thread that sees `done`
   * reach its target also sees what the command wrote */
  atomic_store_explicit(&s->done, c->seq, memory_order_release);
  /* release: pairs with the acquire in sim_exec_sync_device's spin, as above */
  atomic_fetch_sub_explicit(&d->pending, 1, memory_order_release);
  cmd_free_one(c);
  /* Streams blocked on our progress re-check their wait. Move them out first: a stream still
   * not satisfied puts itself back on our list. */
  struct ebb_list woken;
  ebb_list_init(&woken);
  struct ebb_list *n;
  while ((n = ebb_list_pop_head(&s->waiters))) ebb_list_insert_tail(&woken, n);
  while ((n = ebb_list_pop_head(&woken))) {
    struct sim_stream *w = ebb_container_of(n, struct sim_stream, wait_link);
    w->in_waiters = false;
    stream_schedule(w);
  }
  if (d->host_waiters) pthread_cond_broadcast(&d->done_cv);
}

/* Moves `s` forward: retires event records and satisfied waits at its head, then queues it on
 * the engine its head needs, or parks it on the stream it waits for. Caller holds sched. */
static void stream_schedule(struct sim_stream *s) {
  while (!s->running && !s->in_ready && !s->in_waiters) {
    if (ebb_list_empty(&s->queue)) {
      if (s->zombie) stream_free(s);
      return;
    }
    struct sim_cmd *c = ebb_container_of(s->queue.next, struct sim_cmd, link);
    if (c->kind == SIM_CMD_RECORD) {
      struct sim_event *ev = c->u.record.ev;
      /* relaxed: the generation only changes under sched, which we hold */
      if (atomic_load_explicit(&ev->slot.gen, memory_order_relaxed) == c->u.record.ev_gen &&
          ev->rec_id == c->u.record.rec_id)
        ev->time_ns = sim_now_ns();
      stream_retire(s, c);
      continue;
    }
    if (c->kind == SIM_CMD_WAIT) {
      struct sim_stream *t = c->u.wait.target;
      /* relaxed: `done` is only written under sched, which we hold */
      if (atomic_load_explicit(&t->done, memory_order_relaxed) >= c->u.wait.seq) {
        stream_retire(s, c);
        continue;
      }
      ebb_list_insert_tail(&t->waiters, &s->wait_link);
      s->in_waiters = true;
      return;
    }
    struct sim_engine *e = &s->dev->engines[c->engine];
    s->ready_at = sim.perturb_seed ? sim_now_ns() + perturb_delay_ns() : 0;
    ebb_list_insert_tail(&e->ready[-s->prio], &s->ready_link);
    s->in_ready = true;
    /* relaxed: a hint for a spinning engine, which re-checks under sched */
    atomic_fetch_add_explicit(&e->kick, 1, memory_order_relaxed);
    if (e->parked) pthread_cond_signal(&e->cv);
    return;
  }
}

/* Perturbed pick: a random stream among those whose head is eligible now, of the highest
 * priority that has one. None eligible: NULL, and *wake_at = when the first becomes eligible
 * (0 when the engine has no ready stream at all). Caller holds sched. */
static struct sim_stream *engine_pick_perturbed(struct sim_engine *e, uint64_t *wake_at) {
  uint64_t now = sim_now_ns(), first = UINT64_MAX;
  for (int p = SIM_NPRIO - 1; p >= 0; p--) {
    unsigned eligible = 0;
    for (struct ebb_list *n = e->ready[p].next; n != &e->ready[p]; n = n->next) {
      struct sim_stream *s = ebb_container_of(n, struct sim_stream, ready_link);
      if (s->ready_at <= now)
        eligible++;
      else if (s->ready_at < first)
        first = s->ready_at;
    }
    if (!eligible) continue;
    unsigned k = (unsigned)(perturb_next() % eligible);
    for (struct ebb_list *n = e->ready[p].next;; n = n->next) {
      struct sim_stream *s = ebb_container_of(n, struct sim_stream, ready_link);
      if (s->ready_at > now) continue;
      if (k-- == 0) {
        ebb_list_remove(n);
        s->in_ready = false;
        return s;
      }
    }
  }
  *wake_at = first == UINT64_MAX ? 0 : first;
  return NULL;
}

/* The ready stream an engine should serve next: highest priority first, FIFO within one (or the
 * perturbed choice). NULL when none may run now; *wake_at as for engine_pick_perturbed. */
static struct sim_stream *engine_pick(struct sim_engine *e, uint64_t *wake_at) {
  *wake_at = 0;
  if (sim.perturb_seed) return engine_pick_perturbed(e, wake_at);
  for (int p = SIM_NPRIO - 1; p >= 0; p--) {
    struct ebb_list *n = ebb_list_pop_head(&e->ready[p]);
    if (n) {
      struct sim_stream *s = ebb_container_of(n, struct sim_stream, ready_link);
      s->in_ready = false;
      return s;
    }
  }
  return NULL;
}

/* A modelled copy moves its bytes like a DMA transfer: in SIM_COPY_PIECES pieces, each landing
 * when the link would have delivered it, so the copy ends no earlier than bytes / rate after it
 * started, its real memmove cost hides inside the modelled time (a copy beside a kernel takes
 * about the longer of the two, not their sum), and a reader that does not wait for the copy sees
 * old contents (the last piece lands last). */
static void copy_modelled(struct sim_cmd *c, uint64_t start) {
  unsigned char *dst = c->u.copy.dst;
  const unsigned char *src = c->u.copy.src;
  size_t n = c->u.copy.n, piece = (n + SIM_COPY_PIECES - 1) / SIM_COPY_PIECES;
  if (piece < SIM_COPY_MIN_PIECE) piece = SIM_COPY_MIN_PIECE;
  double ns_per_byte = 1.0 / sim.copy_gbps; /* GB/s = bytes per ns */
  for (size_t off = 0; off < n; off += piece) {
    size_t len = n - off < piece ? n - off : piece;
    sleep_until(start + (uint64_t)((double)(off + len) * ns_per_byte));
    memmove(dst + off, src + off, len);
  }
}

/* The threads running a host function: a slot each, holding the thread's id while it runs one
 * (0: free), claimed with one compare-and-swap (at most one host-function engine per device runs
 * one at a time; twice that many slots leave room). pthread_t is an integer on Linux, never 0 for
 * a live thread. */
#define SIM_HOSTFN_SLOTS (2 * SIM_MAX_DEVICES)
_Static_assert(sizeof(pthread_t) <= sizeof(uintptr_t), "a thread id fits a slot");
static _Atomic uintptr_t hostfn_slot[SIM_HOSTFN_SLOTS];

static uintptr_t thread_key(void) { return (uintptr_t)pthread_self(); }

bool sim_in_hostfn(void) {
  uintptr_t self = thread_key();
  for (int i = 0; i < SIM_HOSTFN_SLOTS; i++)
    if (atomic_load_explicit(&hostfn_slot[i], memory_order_acquire) == self) return true;
  return false;
}

/* A host function, its thread in a slot while it runs so that its driver calls are refused. */
static void hostfn_run(struct sim_cmd *c) {
  uintptr_t self = thread_key();
  int slot = -1;
  for (int i = 0; i < SIM_HOSTFN_SLOTS && slot < 0; i++) {
    uintptr_t expect = 0;
    if (atomic_compare_exchange_strong_explicit(&hostfn_slot[i], &expect, self, memory_order_acq_rel, memory_order_relaxed))
      slot = i;
  }
  atomic_fetch_add_explicit(&sim.slow, SIM_SLOW_HOSTFN_ONE, memory_order_relaxed);
  c->u.host.fn(c->u.host.user);
  atomic_fetch_sub_explicit(&sim.slow, SIM_SLOW_HOSTFN_ONE, memory_order_relaxed);
  if (slot >= 0) atomic_store_explicit(&hostfn_slot[slot], 0, memory_order_release);
}

/* Runs one command with no lock held. The timing model makes a copy last bytes / rate on its
 * engine and a kernel at least EBB_SIM_LAUNCH_US on the compute engine (launch latency plus a
 * short kernel: the floor of a kernel's execution time). */
static void cmd_run(struct sim_cmd *c) {
  uint64_t start = (sim.copy_gbps > 0 || sim.launch_ns > 0) ? sim_now_ns() : 0;
  switch (c->kind) {
    case SIM_CMD_KERNEL:
      c->u.kernel.fn(c->args);
      if (sim.launch_ns > 0) sleep_until(start + (uint64_t)sim.launch_ns);
      break;
    case SIM_CMD_MEMSET:
      memset(c->u.memset.dst, c->u.memset.value, c->u.memset.n);
      break;
    case SIM_CMD_COPY:
      if (sim.copy_gbps > 0)
        copy_modelled(c, start);
      else
        memmove(c->u.copy.dst, c->u.copy.src, c->u.copy.n);
      break;
    case SIM_CMD_HOSTFN:
      hostfn_run(c);
      break;
    default:
      break;
  }
}

static void *engine_main(void *arg) {
  struct sim_engine *e = arg;
  sched_lock();
  for (;;) {
    uint64_t wake_at;
    struct sim_stream *s = engine_pick(e, &wake_at);
    if (!s && !wake_at) {
      /* Spin a little outside the lock before parking, so back-to-back launches need no futex. */
      uint32_t k = atomic_load_explicit(&e->kick, memory_order_relaxed);
      uint64_t deadline;
      pthread_mutex_unlock(&sched);
      for (unsigned i = 0; atomic_load_explicit(&e->kick, memory_order_relaxed) == k && spin_more(i, &deadline); i++) {
      }
      sched_lock();
      s = engine_pick(e, &wake_at);
    }
    if (!s) {
      /* Parked until a stream becomes ready (stream_schedule signals) or, perturbed, until the
       * first delayed head becomes eligible. */
      e->parked = true;
      if (wake_at)
        cond_wait_until(&e->cv, &sched, wake_at);
      else
        pthread_cond_wait(&e->cv, &sched);
      e->parked = false;
      continue;
    }
    struct sim_cmd *c = ebb_container_of(s->queue.next, struct sim_cmd, link);
    s->running = true;
    pthread_mutex_unlock(&sched);
    cmd_run(c);
    sched_lock();
    s->running = false;
    stream_retire(s, c);
    stream_schedule(s);
  }
  return NULL;
}

void sim_exec_init_device(struct sim_device *d) {
  /* Every device sets the same state: cuInit runs once, before any stream exists. */
  perturb_rng = perturb_seed_state(sim.perturb_seed);
  pthread_condattr_t mono;
  pthread_condattr_init(&mono);
  pthread_condattr_setclock(&mono, CLOCK_MONOTONIC); /* cond_wait_until's deadlines are monotonic */
  pthread_cond_init(&d->done_cv, NULL);
  d->host_waiters = 0;
  atomic_init(&d->pending, 0);
  for (int k = 0; k < SIM_NENGINES; k++) {
    struct sim_engine *e = &d->engines[k];
    e->dev = d;
    e->kind = k;
    e->started = e->parked = false;
    pthread_cond_init(&e->cv, &mono);
    atomic_init(&e->kick, 0);
    for (int p = 0; p < SIM_NPRIO; p++) ebb_list_init(&e->ready[p]);
  }
  pthread_condattr_destroy(&mono);
}

/* ---------------------------------------------------------------- host waits */

/* Waits until s->done >= seq: spin, then park on the device's condition variable. */
/* `d` is the stream's device, read under sched by the caller: once the stream drains, its slot
 * may be reused on another device, but `done` only grows, so the wait still ends. */
static void wait_stream_seq(struct sim_device *d, struct sim_stream *s, uint64_t seq) {
  uint64_t deadline;
  /* acquire: pairs with the release in stream_retire; the waited-for work's writes are visible */
  for (unsigned i = 0; spin_more(i, &deadline); i++)
    if (atomic_load_explicit(&s->done, memory_order_acquire) >= seq) return;
  sched_lock();
  d->host_waiters++;
  while (atomic_load_explicit(&s->done, memory_order_relaxed) < seq) pthread_cond_wait(&d->done_cv, &sched);
  d->host_waiters--;
  pthread_mutex_unlock(&sched);
}

void sim_exec_sync_device(struct sim_device *d) {
  uint64_t deadline;
  /* acquire: pairs with the release decrement in stream_retire */
  for (unsigned i = 0; spin_more(i, &deadline); i++)
    if (atomic_load_explicit(&d->pending, memory_order_acquire) == 0) return;
  sched_lock();
  d->host_waiters++;
  while (atomic_load_explicit(&d->pending, memory_order_relaxed) != 0) pthread_cond_wait(&d->done_cv, &sched);
  d->host_waiters--;
  pthread_mutex_unlock(&sched);
}

void sim_exec_drain_all(void) {
  for (int i = 0; i < sim.ndev; i++) sim_exec_sync_device(&sim.dev[i]);
}

/* ---------------------------------------------------------------- streams */

static void stream_init(struct sim_stream *s, struct sim_device *d, int prio, unsigned flags) {
  s->dev = d;
  s->prio = prio;
  s->flags = flags;
  ebb_list_init(&s->queue);
  ebb_list_init(&s->ready_link);
  ebb_list_init(&s->waiters);
  ebb_list_init(&s->wait_link);
  s->running = s->in_ready = s->in_waiters = s->zombie = false;
  /* `issued` and `done` keep counting from the slot's previous life: events and waits that
   * captured {stream, seq} from it stay correct. */
}

bool sim_exec_create_null_stream(struct sim_device *d) {
  uint64_t h;
  struct sim_stream *s = sim_table_alloc(&stream_table, &h);
  if (!s) return false;
  sched_lock();
  stream_init(s, d, 0, CU_STREAM_DEFAULT);
  d->null_stream = s;
  pthread_mutex_unlock(&sched);
  return true;
}

/* The stream a handle names: NULL and the legacy/per-thread handles (0x1, 0x2) are the current
 * context's default stream. Its generation in *gen, to be re-checked under sched. */
static CUresult stream_resolve(CUstream h, struct sim_stream **out, uint32_t *gen) {
  uintptr_t v = (uintptr_t)h;
  if (v <= 2) {
    struct sim_device *d = sim_current_device();
    if (!d) return CUDA_ERROR_INVALID_CONTEXT;
    *out = d->null_stream;
    *gen = atomic_load_explicit(&d->null_stream->slot.gen, memory_order_relaxed); /* never changes */
    return CUDA_SUCCESS;
  }
  struct sim_stream *s = sim_table_get(&stream_table, v, gen);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  *out = s;
  return CUDA_SUCCESS;
}

/* Takes sched and checks the stream is still alive. */
static CUresult stream_lock(struct sim_stream *s, uint32_t gen) {
  sched_lock();
  /* relaxed: destroy changes the generation under sched, which we hold now */
  if (atomic_load_explicit(&s->slot.gen, memory_order_relaxed) != gen) {
    pthread_mutex_unlock(&sched);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  /* A stream of a context holding a sticky error takes no work and answers with the error,
   * whichever context the calling thread has current. */
  CUresult r = sim_device_sticky(s->dev);
  if (r != CUDA_SUCCESS) pthread_mutex_unlock(&sched);
  return r;
}

/* stream_lock for calls that add a command: while `s` already holds SIM_STREAM_DEPTH commands,
 * waits (spin, then park) until half of them retired, as a real driver blocks on a full
 * pushbuffer. Without the bound a host issuing faster than the engines drain would grow the
 * command pool (and the process's memory) without limit. */
static CUresult stream_lock_push(struct sim_stream *s, uint32_t gen) {
  for (;;) {
    CUresult r = stream_lock(s, gen);
    if (r != CUDA_SUCCESS) return r;
    /* relaxed: sched is held, and stream_retire stores done under sched */
    uint64_t done = atomic_load_explicit(&s->done, memory_order_relaxed);
    if (s->issued - done < SIM_STREAM_DEPTH) return CUDA_SUCCESS;
    uint64_t target = s->issued - SIM_STREAM_DEPTH / 2;
    pthread_mutex_unlock(&sched);
    wait_stream_seq(s->dev, s, target); /* the slot is type-stable: `s` stays readable */
  }
}

/* Appends a filled command to `s` and moves the stream. Caller holds sched. */
static CUresult stream_push(struct sim_stream *s, struct sim_cmd *c) {
  if (c->kind != SIM_CMD_RECORD && c->kind != SIM_CMD_WAIT) {
    struct sim_engine *e = &s->dev->engines[c->engine];
    if (!e->started && !engine_start(e)) {
      cmd_free_one(c);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  c->seq = ++s->issued;
  atomic_fetch_add_explicit(&s->dev->pending, 1, memory_order_relaxed); /* sched orders it */
  bool was_idle = ebb_list_empty(&s->queue);
  ebb_list_insert_tail(&s->queue, &c->link);
  if (was_idle) stream_schedule(s);
  return CUDA_SUCCESS;
}

static int clamp_prio(int p) {
  if (p > SIM_PRIO_LEAST) return SIM_PRIO_LEAST;
  if (p < SIM_PRIO_GREATEST) return SIM_PRIO_GREATEST;
  return p;
}

SIM_API CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
  SIM_ENTER(cuStreamCreateWithPriority);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  uint64_t h;
  struct sim_stream *s = sim_table_alloc(&stream_table, &h);
  if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
  sched_lock();
  stream_init(s, d, clamp_prio(priority), flags);
  pthread_mutex_unlock(&sched);
  *phStream = (CUstream)(uintptr_t)h;
  return CUDA_SUCCESS;
}

/* Returns at once; work already queued still runs, and the slot is reused only after it has. */
SIM_API CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
  SIM_ENTER(cuStreamDestroy);
  if ((uintptr_t)hStream <= 2) return CUDA_ERROR_INVALID_HANDLE; /* the default stream is not ours to end */
  struct sim_stream *s;
  uint32_t gen;
  CUresult r = stream_resolve(hStream, &s, &gen);
  if (r != CUDA_SUCCESS) return r;
  sched_lock();
  if (!sim_table_kill(&s->slot, gen)) {
    pthread_mutex_unlock(&sched);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (ebb_list_empty(&s->queue))
    stream_free(s);
  else
    s->zombie = true;
  pthread_mutex_unlock(&sched);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  SIM_ENTER(cuStreamSynchronize);
  struct sim_stream *s;
  uint32_t gen;
  CUresult r = stream_resolve(hStream, &s, &gen);
  if (r != CUDA_SUCCESS || (r = stream_lock(s, gen)) != CUDA_SUCCESS) return r;
  uint64_t target = s->issued;
  struct sim_device *d = s->dev;
  pthread_mutex_unlock(&sched);
  wait_stream_seq(d, s, target);
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuStreamQuery(CUstream hStream) {
  SIM_ENTER(cuStreamQuery);
  struct sim_stream *s;
  uint32_t gen;
  CUresult r = stream_resolve(hStream, &s, &gen);
  if (r != CUDA_SUCCESS || (r = stream_lock(s, gen)) != CUDA_SUCCESS) return r;
  bool idle = atomic_load_explicit(&s->done, memory_order_relaxed) >= s->issued; /* under sched */
  pthread_mutex_unlock(&sched);
  return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_API CUresult CUDAAPI cuStreamGetPriority(CUstream hStream, int *priority) {
  SIM_ENTER(cuStreamGetPriority);
  if (!priority) return CUDA_ERROR_INVALID_VALUE;
  struct sim_stream *s;
  uint32_t gen;
  CUresult r = stream_resolve(hStream, &s, &gen);
  if (r != CUDA_SUCCESS || (r = stream_lock(s, gen)) != CUDA_SUCCESS) return r;
  *priority = s->prio;
  pthread_mutex_unlock(&sched);
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- events */

SIM_API CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  SIM_ENTER(cuEventCreate);
  struct sim_device *d = sim_current_device();
  if (!d) return CUDA_ERROR_INVALID_CONTEXT;
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (!phEvent || (Flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
  uint64_t h;
  struct sim_event *ev = sim_table_alloc(&event_table, &h);
  if (!ev) return CUDA_ERROR_OUT_OF_MEMORY;
  sched_lock(); /* record commands of the slot's previous life read these fields */
  ev->dev = d;
  ev->flags = Flags;
  ev->stream = NULL;
  ev->seq = 0;
  ev->time_ns = 0;
  pthread_mutex_unlock(&sched);
  *phEvent = (CUevent)(uintptr_t)h;
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
  SIM_ENTER(cuEventDestroy);
  uint32_t gen;
  struct sim_event *ev = sim_table_get(&event_table, (uintptr_t)hEvent, &gen);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  /* Under sched so a pending record command sees either the old generation or the new one. */
  sched_lock();
  bool killed = sim_table_kill(&ev->slot, gen);
  pthread_mutex_unlock(&sched);
  if (!killed) return CUDA_ERROR_INVALID_HANDLE;
  sim_table_free(&event_table, &ev->slot);
  return CUDA_SUCCESS;
}

/* Takes sched with the event alive, or fails. */
static CUresult event_lock(CUevent h, struct sim_event **out) {
  uint32_t gen;
  struct sim_event *ev = sim_table_get(&event_table, (uintptr_t)h, &gen);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  sched_lock();
  if (atomic_load_explicit(&ev->slot.gen, memory_order_relaxed) != gen) { /* stable under sched */
    pthread_mutex_unlock(&sched);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  CUresult r = sim_device_sticky(ev->dev); /* as for streams (stream_lock) */
  if (r != CUDA_SUCCESS) {
    pthread_mutex_unlock(&sched);
    return r;
  }
  *out = ev;
  return CUDA_SUCCESS;
}

static bool event_done(const struct sim_event *ev) {
  return !ev->stream || atomic_load_explicit(&ev->stream->done, memory_order_relaxed) >= ev->seq; /* under sched */
}

SIM_API CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
  SIM_ENTER(cuEventRecord);
  uint32_t egen, sgen;
  struct sim_event *ev = sim_table_get(&event_table, (uintptr_t)hEvent, &egen);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  struct sim_stream *s;
  CUresult r = stream_resolve(hStream, &s, &sgen);
  if (r != CUDA_SUCCESS || (r = stream_lock_push(s, sgen)) != CUDA_SUCCESS) return r;
  if (atomic_load_explicit(&ev->slot.gen, memory_order_relaxed) != egen) {
    r = CUDA_ERROR_INVALID_HANDLE;
    goto out_unlock;
  }
  if (ev->dev != s->dev) { /* event and stream of different contexts */
    r = CUDA_ERROR_INVALID_HANDLE;
    goto out_unlock;
  }
  struct sim_cmd *c = cmd_alloc();
  if (!c) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out_unlock;
  }
  c->kind = SIM_CMD_RECORD;
  c->u.record.ev = ev;
  c->u.record.ev_gen = egen;
  c->u.record.rec_id = ++ev->rec_id;
  ev->stream = s;
  ev->seq = s->issued + 1; /* the record's own position, assigned by stream_push */
  r = stream_push(s, c);
out_unlock:
  pthread_mutex_unlock(&sched);
  return r;
}

SIM_API CUresult CUDAAPI cuEventQuery(CUevent hEvent) {
  SIM_ENTER(cuEventQuery);
  struct sim_event *ev;
  CUresult r = event_lock(hEvent, &ev);
  if (r != CUDA_SUCCESS) return r;
  bool done = event_done(ev);
  pthread_mutex_unlock(&sched);
  return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_API CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  SIM_ENTER(cuEventSynchronize);
  struct sim_event *ev;
  CUresult r = event_lock(hEvent, &ev);
  if (r != CUDA_SUCCESS) return r;
  struct sim_stream *s = ev->stream;
  struct sim_device *d = s ? s->dev : NULL;
  uint64_t seq = ev->seq;
  pthread_mutex_unlock(&sched);
  if (s) wait_stream_seq(d, s, seq); /* a never-recorded event is complete */
  return CUDA_SUCCESS;
}

SIM_API CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
  SIM_ENTER(cuEventElapsedTime);
  if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
  uint32_t g0, g1;
  struct sim_event *a = sim_table_get(&event_table, (uintptr_t)hStart, &g0);
  struct sim_event *b = sim_table_get(&event_table, (uintptr_t)hEnd, &g1);
  if (!a || !b) return CUDA_ERROR_INVALID_HANDLE;
  CUresult r = CUDA_SUCCESS;
  sched_lock();
  if (atomic_load_explicit(&a->slot.gen, memory_order_relaxed) != g0 ||
      atomic_load_explicit(&b->slot.gen, memory_order_relaxed) != g1 ||
      (a->flags & CU_EVENT_DISABLE_TIMING) || (b->flags & CU_EVENT_DISABLE_TIMING) || !a->stream || !b->stream)
    r = CUDA_ERROR_INVALID_HANDLE;
  else if (!event_done(a) || !event_done(b))
    r = CUDA_ERROR_NOT_READY;
  else
    *pMilliseconds = (float)(((double)b->time_ns - (double)a->time_ns) / 1e6);
  pthread_mutex_unlock(&sched);
  return r;
}

/* The pair of streams whose waits ebbsim_skip_waits (ebb_cuda.h) turns into nothing, each with the
 * slot generation it had then, so a newer stream in a reused slot does not match. Under sched. */
static struct {
  struct sim_stream *waiter, *producer; /* NULL: none */
  uint32_t waiter_gen, producer_gen;
  unsigned long long skipped;
} skip;

SIM_API CUresult ebbsim_skip_waits(CUstream waiter, CUstream producer, int on, unsigned long long *skipped) {
  if (!sim_initialized()) return CUDA_ERROR_NOT_INITIALIZED; /* (a test entry: not counted by EBB_SIM_FAULT) */
  struct sim_stream *w = NULL, *p = NULL;
  uint32_t wg = 0, pg = 0;
  CUresult r;
  if (on && ((r = stream_resolve(waiter, &w, &wg)) != CUDA_SUCCESS || (r = stream_resolve(producer, &p, &pg)) != CUDA_SUCCESS))
    return r;
  sched_lock();
  /* relaxed: destroy changes a generation under sched, which we hold */
  if (on && (atomic_load_explicit(&w->slot.gen, memory_order_relaxed) != wg ||
             atomic_load_explicit(&p->slot.gen, memory_order_relaxed) != pg)) {
    pthread_mutex_unlock(&sched);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (skipped) *skipped = skip.skipped;
  skip.waiter = w;
  skip.producer = p;
  skip.waiter_gen = wg;
  skip.producer_gen = pg;
  skip.skipped = 0;
  pthread_mutex_unlock(&sched);
  return CUDA_SUCCESS;
}

/* Whether ebbsim_skip_waits asks that s skip its wait for ev (recorded, not complete). Under sched. */
static bool wait_skipped(const struct sim_stream *s, const struct sim_event *ev) {
  if (!skip.waiter || s != skip.waiter || ev->stream != skip.producer) return false;
  return atomic_load_explicit(&s->slot.gen, memory_order_relaxed) == skip.waiter_gen &&
         atomic_load_explicit(&ev->stream->slot.gen, memory_order_relaxed) == skip.producer_gen;
}

/* Later work on hStream waits for the event's record as it stands now; a never-recorded or
 * already complete event adds nothing. The event may belong to another device. */
SIM_API CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  SIM_ENTER(cuStreamWaitEvent);
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  uint32_t egen, sgen;
  struct sim_event *ev = sim_table_get(&event_table, (uintptr_t)hEvent, &egen);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  struct sim_stream *s;
  CUresult r = stream_resolve(hStream, &s, &sgen);
  if (r != CUDA_SUCCESS || (r = stream_lock_push(s, sgen)) != CUDA_SUCCESS) return r;
  if (atomic_load_explicit(&ev->slot.gen, memory_order_relaxed) != egen) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else if (!event_done(ev) && wait_skipped(s, ev)) {
    skip.skipped++;
  } else if (!event_done(ev)) {
    struct sim_cmd *c = cmd_alloc();
    if (!c) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      c->kind = SIM_CMD_WAIT;
      c->u.wait.target = ev->stream;
      c->u.wait.seq = ev->seq;
      r = stream_push(s, c);
    }
  }
  pthread_mutex_unlock(&sched);
  return r;
}

/* ---------------------------------------------------------------- copies and memset */

/* Issues the command `tmpl` (kind, engine and payload filled in) on hStream: resolves the stream,
 * waits for room, takes a pooled command, fills in the template's payload and pushes it. `n == 0` work is
 * accepted and skipped after the stream check, as the driver does. */
static CUresult enqueue_cmd(CUstream hStream, size_t n, const struct sim_cmd *tmpl) {
  struct sim_stream *s;
  uint32_t gen;
  CUresult r = stream_resolve(hStream, &s, &gen);
  if (r != CUDA_SUCCESS) return r;
  if (n == 0) return CUDA_SUCCESS;
  if ((r = stream_lock_push(s, gen)) != CUDA_SUCCESS) return r;
  struct sim_cmd *c = cmd_alloc();
  if (!c) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    /* Only the payload: a pooled command keeps its list link and its grown argument buffer. */
    c->kind = tmpl->kind;
    c->engine = tmpl->engine;
    c->u = tmpl->u;
    r = stream_push(s, c);
  }
  pthread_mutex_unlock(&sched);
  return r;
}

static CUresult enqueue_copy(CUstream hStream, void *dst, const void *src, size_t n, int engine) {
  struct sim_cmd t = {.kind = SIM_CMD_COPY, .engine = engine};
  t.u.copy.dst = dst;
  t.u.copy.src = src;
  t.u.copy.n = n;
  return enqueue_cmd(hStream, n, &t);
}

/* Which copy engine serves a copy between memory of these kinds. */
static int copy_engine(const struct sim_ptr *dst, const struct sim_ptr *src) {
  bool dd = sim_is_device_mem(dst->kind), sd = sim_is_device_mem(src->kind);
  if (sd && dd) return dst->ordinal == src->ordinal ? SIM_ENG_COPY0 : SIM_ENG_COPY1; /* peer on COPY1 */
  if (sd) return SIM_ENG_COPY1;                                                      /* D2H */
  return SIM_ENG_COPY0;                                                              /* H2D, H2H */
}

SIM_API CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
  SIM_ENTER(cuMemcpyAsync);
  if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
  struct sim_ptr pd, ps;
  if (sim_mem_span((uintptr_t)dst, ByteCount, &pd) != CUDA_SUCCESS ||
      sim_mem_span((uintptr_t)src, ByteCount, &ps) != CUDA_SUCCESS)
    return CUDA_ERROR_INVALID_VALUE;
  return enqueue_copy(hStream, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, ByteCount, copy_engine(&pd, &ps));
}

SIM_API CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                          CUstream hStream) {
  SIM_ENTER(cuMemcpyHtoDAsync);
  struct sim_ptr pd;
  if (!dstDevice || !srcHost || sim_mem_span((uintptr_t)dstDevice, ByteCount, &pd) != CUDA_SUCCESS ||
      !sim_is_device_mem(pd.kind))
    return CUDA_ERROR_INVALID_VALUE;
  return enqueue_copy(hStream, (void *)(uintptr_t)dstDevice, srcHost, ByteCount, SIM_ENG_COPY0);
}

SIM_API CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  SIM_ENTER(cuMemcpyDtoHAsync);
  struct sim_ptr ps;
  if (!dstHost || !srcDevice || sim_mem_span((uintptr_t)srcDevice, ByteCount, &ps) != CUDA_SUCCESS ||
      !sim_is_device_mem(ps.kind))
    return CUDA_ERROR_INVALID_VALUE;
  return enqueue_copy(hStream, dstHost, (const void *)(uintptr_t)srcDevice, ByteCount, SIM_ENG_COPY1);
}

SIM_API CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                          CUstream hStream) {
  SIM_ENTER(cuMemcpyDtoDAsync);
  struct sim_ptr pd, ps;
  if (!dstDevice || !srcDevice || sim_mem_span((uintptr_t)dstDevice, ByteCount, &pd) != CUDA_SUCCESS ||
      sim_mem_span((uintptr_t)srcDevice, ByteCount, &ps) != CUDA_SUCCESS || !sim_is_device_mem(pd.kind) ||
      !sim_is_device_mem(ps.kind))
    return CUDA_ERROR_INVALID_VALUE;
  return enqueue_copy(hStream, (void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount,
                      copy_engine(&pd, &ps));
}

/* Works with or without cuCtxEnablePeerAccess: the emulated link stages like PCIe without P2P. */
SIM_API CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                          CUcontext srcContext, size_t ByteCount, CUstream hStream) {
  SIM_ENTER(cuMemcpyPeerAsync);
  struct sim_device *dd = sim_device_of_ctx(dstContext), *sd = sim_device_of_ctx(srcContext);
  if (!dd || !sd) return CUDA_ERROR_INVALID_CONTEXT;
  struct sim_ptr pd, ps;
  if (!dstDevice || !srcDevice || sim_mem_span((uintptr_t)dstDevice, ByteCount, &pd) != CUDA_SUCCESS ||
      sim_mem_span((uintptr_t)srcDevice, ByteCount, &ps) != CUDA_SUCCESS || !sim_is_device_mem(pd.kind) ||
      !sim_is_device_mem(ps.kind))
    return CUDA_ERROR_INVALID_VALUE;
  return enqueue_copy(hStream, (void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount,
                      dd == sd ? SIM_ENG_COPY0 : SIM_ENG_COPY1);
}

SIM_API CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
  SIM_ENTER(cuMemsetD8Async);
  struct sim_ptr pd;
  if (!dstDevice || sim_mem_span((uintptr_t)dstDevice, N, &pd) != CUDA_SUCCESS || pd.kind == SIM_MEM_NONE)
    return CUDA_ERROR_INVALID_VALUE;
  struct sim_cmd t = {.kind = SIM_CMD_MEMSET, .engine = SIM_ENG_COMPUTE};
  t.u.memset.dst = (void *)(uintptr_t)dstDevice;
  t.u.memset.n = N;
  t.u.memset.value = uc;
  return enqueue_cmd(hStream, N, &t);
}

/* ---------------------------------------------------------------- host functions and kernels */

SIM_API CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
  SIM_ENTER(cuLaunchHostFunc);
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  struct sim_stream *s;
  uint32_t gen;
  CUresult r = stream_resolve(hStream, &s, &gen);
  if (r != CUDA_SUCCESS || (r = stream_lock_push(s, gen)) != CUDA_SUCCESS) return r;
  struct sim_cmd *c = cmd_alloc();
  if (!c) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    c->kind = SIM_CMD_HOSTFN;
    c->engine = SIM_ENG_HOST;
    c->u.host.fn = fn;
    c->u.host.user = userData;
    r = stream_push(s, c);
  }
  pthread_mutex_unlock(&sched);
  return r;
}

/* Copies the argument struct into the command, as CUDA copies kernel parameters at launch, so
 * the caller may reuse its own at once. `extra` (packed argument buffers) is not supported. */
SIM_API CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                       unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                       unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                       void **kernelParams, void **extra) {
  SIM_ENTER(cuLaunchKernel);
  (void)sharedMemBytes;
  ebbsim_kernel_fn fn;
  size_t arg_bytes;
  struct sim_device *fdev;
  CUresult r = sim_kernel_resolve(f, &fn, &arg_bytes, &fdev);
  if (r != CUDA_SUCCESS) return r;
  if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ || extra)
    return CUDA_ERROR_INVALID_VALUE;
  if ((unsigned long long)blockDimX * blockDimY * blockDimZ > 1024) return CUDA_ERROR_INVALID_VALUE;
  if (arg_bytes > 0 && (!kernelParams || !kernelParams[0])) return CUDA_ERROR_INVALID_VALUE;
  struct sim_stream *s;
  uint32_t gen;
  if ((r = stream_resolve(hStream, &s, &gen)) != CUDA_SUCCESS) return r;
  if ((r = stream_lock_push(s, gen)) != CUDA_SUCCESS) return r;
  if (s->dev != fdev) { /* the function's module was loaded in another context */
    r = CUDA_ERROR_INVALID_CONTEXT;
    goto out_unlock;
  }
  struct sim_cmd *c = cmd_alloc();
  if (!c) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out_unlock;
  }
  c->args = c->inline_args;
  if (arg_bytes > SIM_INLINE_ARGS) {
    if (c->heap_cap < arg_bytes) {
      void *p = realloc(c->heap_args, arg_bytes); /* grows once per command slot, then reused */
      if (!p) {
        cmd_free_one(c);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto out_unlock;
      }
      c->heap_args = p;
      c->heap_cap = arg_bytes;
    }
    c->args = c->heap_args;
  }
  if (arg_bytes) memcpy(c->args, kernelParams[0], arg_bytes);
  c->kind = SIM_CMD_KERNEL;
  c->engine = SIM_ENG_COMPUTE;
  c->u.kernel.fn = fn;
  r = stream_push(s, c);
out_unlock:
  pthread_mutex_unlock(&sched);
  return r;
}
