/* module.c: the alloc module as the runtime sees it. The registry of arenas (one per device,
 * then the pinned and host pools), EBB_ALLOC_CONF (checked by the first ebb_init, parsed into
 * the configuration every arena starts with), the module's start and teardown, the entry check
 * of every public call, the live-block counts the last ebb_shutdown asks for, and the ranges
 * given back (graves) that messages about stale pointers name.
 *
 * Owns: the module state (struct ebb__alloc_state: its phase, the device arenas, the parsed
 * configuration and its text) and the graves. The state starts lazily at the first call after
 * ebb_init that needs it (it starts the streams module first, so that our shutdown hook,
 * registered later, runs earlier: arenas release their events and segments while streams and
 * the driver are still up) and is torn down by that hook.
 *
 * Threading: start-up is elected by a compare-and-swap on `phase`; after it each arena
 * serialises itself (arena.c). The graves have a leaf lock of their own.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena_impl.h"

/* ---- the registry ---------------------------------------------------------------------------- */

struct ebb__alloc_state ebb__alloc_module;

/* Every arena of the module (devices, pinned pools, host pool), listed once at start for the
 * copy hook's range filter (ebb__arenas_all): no call per arena on every copy. Apart from
 * ebb__alloc_module, whose layout the allocation entry's code depends on (one more instruction a call
 * with them inside). Written at start and teardown only. */
static struct {
  struct ebb__arena *all[EBB__ARENAS_MAX];
  int n;
} ebb__al_all;

#define EBB__HISTORY_DEFAULT ((size_t)65536)
#define EBB__HISTORY_MAX ((size_t)1 << 26) /* 3 GiB of ring (48-byte slots) per device: surely a typo beyond */

struct ebb__arena *ebb__arena_nth(int i) {
  return i >= 0 && i < ebb__alloc_module.ndev ? &ebb__alloc_module.dev[i] : NULL;
}

struct ebb__arena *const *ebb__arenas_all(int *n) {
  *n = ebb__al_all.n;
  return ebb__al_all.all;
}

struct ebb__arena *ebb__arena_any(int i) {
  if (i < 0) return NULL;
  return i < ebb__alloc_module.ndev ? &ebb__alloc_module.dev[i] : ebb__hostpool_nth(i - ebb__alloc_module.ndev);
}

/* ---- EBB_ALLOC_CONF ---------------------------------------------------------------------------- */

/* "1073741824", "512M", "4G": bytes with an optional K/M/G/T suffix (powers of 1024). */
static bool parse_bytes(const char *val, size_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(val, &end, 10);
  if (errno || end == val || val[0] == '-') return false;
  unsigned shift = 0;
  switch (*end) {
  case '\0': break;
  case 'K': case 'k': shift = 10; end++; break;
  case 'M': case 'm': shift = 20; end++; break;
  case 'G': case 'g': shift = 30; end++; break;
  case 'T': case 't': shift = 40; end++; break;
  default: return false;
  }
  if (*end || v > (SIZE_MAX >> shift)) return false;
  *out = (size_t)v << shift;
  return true;
}

/* EBB_ALLOC_CONF: "key:value,key:value", checked by the first ebb_init (runtime_export.h): an
 * unknown key or a bad value fails ebb_init with EBB_EINVAL naming the item and what is
 * accepted, so a typo is never silently ignored. Parsed straight into ebb__alloc_module.conf: the check
 * runs while the module is stopped, and the start uses what it parsed. */
#define EBB__CONF_BAD(...)                   \
  do {                                       \
    snprintf(expected, len, __VA_ARGS__);    \
    return false;                            \
  } while (0)

static bool conf_check(const char *env, char *expected, size_t len) {
  struct ebb__conf *c = &ebb__alloc_module.conf;
  c->max_split = SIZE_MAX;
  c->expandable = false;
  c->expandable_set = false;
  c->history = EBB__HISTORY_DEFAULT;
  c->oom_snapshot = NULL;
  c->pinned_max = 0;
  c->slab_max = EBB__SLAB_MAX_DEFAULT;
  c->wait_pending_us = EBB__WAIT_PENDING_US_DEFAULT;
  ebb__alloc_module.env[0] = '\0';
  c->env = ebb__alloc_module.env;
  if (!env) return true;
  if (strlen(env) >= sizeof ebb__alloc_module.env) EBB__CONF_BAD("at most %zu characters", sizeof ebb__alloc_module.env - 1);
  snprintf(ebb__alloc_module.env, sizeof ebb__alloc_module.env, "%s", env);
  char buf[sizeof ebb__alloc_module.env];
  snprintf(buf, sizeof buf, "%s", env);
  char *save = NULL;
  for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    while (*tok == ' ') tok++;
    char *colon = strchr(tok, ':');
    if (!colon) EBB__CONF_BAD("key:value items; '%s' has no value", tok);
    *colon = '\0';
    const char *key = tok, *val = colon + 1;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(val, &end, 10);
    bool num_ok = !errno && end != val && *end == '\0' && val[0] != '-';
    if (!strcmp(key, "max_split_size_mb")) {
      /* PyTorch's minimum is 20 MiB, the oversize slack: below it nothing could be reused. */
      if (!num_ok || v < 20 || v >= ((size_t)1 << 40)) EBB__CONF_BAD("max_split_size_mb:N with N a whole number of MiB >= 20, not '%s'", val);
      c->max_split = (size_t)v << 20;
    } else if (!strcmp(key, "expandable_segments")) {
      if (!strcmp(val, "1") || !strcmp(val, "true") || !strcmp(val, "True")) c->expandable = true;
      else if (!strcmp(val, "0") || !strcmp(val, "false") || !strcmp(val, "False")) c->expandable = false;
      else EBB__CONF_BAD("expandable_segments:0 or expandable_segments:1, not '%s'", val);
      c->expandable_set = true;
    } else if (!strcmp(key, "history")) {
      if (!num_ok || v > EBB__HISTORY_MAX) EBB__CONF_BAD("history:N with N entries in [0, %zu], not '%s'", (size_t)EBB__HISTORY_MAX, val);
      c->history = (size_t)v;
    } else if (!strcmp(key, "oom_snapshot")) {
      if (!*val) EBB__CONF_BAD("oom_snapshot:PATH with a non-empty path");
      snprintf(ebb__alloc_module.oom_path, sizeof ebb__alloc_module.oom_path, "%s", val);
      c->oom_snapshot = ebb__alloc_module.oom_path;
    } else if (!strcmp(key, "pinned_max_bytes")) {
      if (!parse_bytes(val, &c->pinned_max))
        EBB__CONF_BAD("pinned_max_bytes:N with N bytes and an optional K/M/G/T suffix (0: no cap), not '%s'", val);
    } else if (!strcmp(key, "slab_max_bytes")) {
      /* Rounded down to 512 B (sizes are 512-byte multiples); 64 KiB at most: the slab address
       * map relies on every slab spanning more than one 64 KiB granule (addrmap.c). */
      size_t v2 = 0;
      if (!parse_bytes(val, &v2) || v2 > EBB__SLAB_MAX_LIMIT)
        EBB__CONF_BAD("slab_max_bytes:N with N bytes in [0, 64K] and an optional K suffix (0: no slabs), not '%s'", val);
      c->slab_max = v2 / EBB__MIN_BLOCK * EBB__MIN_BLOCK;
    } else if (!strcmp(key, "pending_wait_us")) {
      if (!num_ok || v > EBB__WAIT_PENDING_US_MAX)
        EBB__CONF_BAD("pending_wait_us:N with N microseconds in [0, %u] (0: never wait), not '%s'", (unsigned)EBB__WAIT_PENDING_US_MAX, val);
      c->wait_pending_us = (uint32_t)v;
    } else {
      EBB__CONF_BAD("keys max_split_size_mb, expandable_segments, pinned_max_bytes, slab_max_bytes, oom_snapshot, history "
                    "or pending_wait_us; '%s' is unknown", key);
    }
  }
  return true;
}

static const ebb__config_var ebb__alloc_vars[] = {{"EBB_ALLOC_CONF", conf_check}};

/* ---- pointers from before a completed ebb_shutdown ---------------------------------------- */

/* The address ranges of the segments given back lately (the newest EBB__GRAVES): by the
 * teardown of a completed ebb_shutdown, and during a session by empty_cache, an OOM retry or a
 * trim. A pointer into one is memory ebb gave back rather than memory it never had, which the
 * free's message says. The range may since hold memory from elsewhere (a driver allocation, a
 * host mapping), which the message admits. Written when segments go back, read on failure
 * paths only. */
#define EBB__GRAVES 256
static ebb_mutex ebb__graves_mu = {PTHREAD_MUTEX_INITIALIZER, "alloc.graves", EBB_RANK_LEAF};
static struct ebb__grave {
  uint64_t base;
  size_t size;
  unsigned session;   /* ebb__sessions when it was given back */
  bool at_shutdown;   /* by the teardown, else during its session */
  uint8_t kind;       /* enum ebb__memkind of its pool */
  char label[48];
} ebb__graves[EBB__GRAVES];
static unsigned ebb__ngraves, ebb__sessions; /* (graves_mu) sessions: alloc module starts */

static void grave_put(const struct ebb__arena *a, uint64_t base, size_t size, bool at_shutdown) {
  ebb__mutex_lock(&ebb__graves_mu);
  struct ebb__grave *g = &ebb__graves[ebb__ngraves++ % EBB__GRAVES];
  *g = (struct ebb__grave){.base = base, .size = size, .session = ebb__sessions, .at_shutdown = at_shutdown,
                           .kind = (uint8_t)a->up->kind};
  snprintf(g->label, sizeof g->label, "%s", a->label);
  ebb__mutex_unlock(&ebb__graves_mu);
}

void ebb__grave_add(const struct ebb__arena *a, uint64_t base, size_t size) { grave_put(a, base, size, false); }

static void graves_add(struct ebb__arena *a) {
  for (struct ebb_list *n = a->segments.next; n != &a->segments; n = n->next) {
    const struct ebb__segment *sg = ebb_container_of(n, struct ebb__segment, node);
    grave_put(a, sg->base, sg->size, true);
  }
}

const char *ebb__grave_find(uint64_t addr, enum ebb__memkind kind, char *label, size_t len) {
  const char *when = NULL;
  ebb__mutex_lock(&ebb__graves_mu);
  unsigned n = ebb__ngraves < EBB__GRAVES ? ebb__ngraves : EBB__GRAVES;
  for (unsigned i = 0; i < n && !when; i++) {
    const struct ebb__grave *g = &ebb__graves[(ebb__ngraves - 1 - i) % EBB__GRAVES]; /* newest first */
    if (g->kind != kind || addr < g->base || addr >= g->base + g->size) continue;
    snprintf(label, len, "%s", g->label);
    when = g->session != ebb__sessions || g->at_shutdown ? "before the last completed ebb_shutdown"
                                                          : "since ebb_init (empty_cache, an OOM retry or a trim)";
  }
  ebb__mutex_unlock(&ebb__graves_mu);
  return when;
}

/* ---- start, teardown and the entry check ------------------------------------------------------ */

/* The module's stop, run by the last ebb_shutdown once no block is live. */
static void alloc_teardown(void *user) {
  (void)user;
  /* acquire: pairs with the release store of UP (the arenas are visible). */
  if (atomic_load_explicit(&ebb__alloc_module.phase, memory_order_acquire) != EBB__AL_UP) return;
  ebb__copy_hook_set(NULL); /* before the maps it reads are cleared */
  ebb__al_all.n = 0;
  for (int i = 0; i < ebb__alloc_module.ndev; i++) graves_add(&ebb__alloc_module.dev[i]);
  struct ebb__arena *hp;
  for (int i = 0; (hp = ebb__hostpool_nth(i)) != NULL; i++) graves_add(hp);
  for (int i = 0; i < ebb__alloc_module.ndev; i++) ebb__arena_fini(&ebb__alloc_module.dev[i]);
  ebb__hostpools_fini();
  ebb__addrmap_clear();
  ebb__alloc_module.ndev = 0;
  /* release: pairs with the acquire CAS of the next start in ebb__alloc_enter. */
  atomic_store_explicit(&ebb__alloc_module.phase, EBB__AL_DOWN, memory_order_release);
}

/* Runs with phase == STARTING owned by this thread, after streams started (the runtime starts
 * modules in layer order), with the configuration ebb_init checked in ebb__alloc_module.conf. */
static ebb_status alloc_start(const char *fn) {
  int ndev = 0;
  ebb_status st = ebb_dev_count(&ndev);
  if (st) return st;
  size_t total[EBB_MAX_DEVICES];
  bool vmm[EBB_MAX_DEVICES];
  for (int i = 0; i < ndev; i++) {
    size_t fr = 0;
    ebb_dev_caps caps;
    st = ebb_dev_mem_info(i, &fr, &total[i]);
    if (!st) st = ebb_dev_get_caps(i, &caps);
    if (st) {
      char why[512];
      snprintf(why, sizeof why, "%s", ebb_last_error());
      return ebb__fail(st, "%s: cannot read the memory size or capabilities of device %d: %s", fn, i, why);
    }
    vmm[i] = caps.vmm;
  }
  ebb__mutex_lock(&ebb__graves_mu);
  ebb__sessions++;
  ebb__mutex_unlock(&ebb__graves_mu);
  for (int i = 0; i < ndev; i++) {
    /* Expandable segments unless EBB_ALLOC_CONF says otherwise, where the driver does VMM (every
     * current GPU, and the emulated driver): on the real training traces they reserve 1.02-1.12
     * times the peak live bytes, classic segments 1.02-1.26 (perf/RESULTS.md). */
    struct ebb__conf c = ebb__alloc_module.conf;
    if (!c.expandable_set) c.expandable = vmm[i];
    /* Asked for where the driver cannot grow a reservation: every allocation would fail with an
     * OOM that hides why. Classic segments serve, and the user hears it once per device. */
    if (c.expandable && !vmm[i]) {
      ebb__warn("EBB_ALLOC_CONF: expandable_segments:1, but device %d's driver has no VMM (virtual memory "
                "management); device %d uses classic segments",
                i, i);
      c.expandable = false;
    }
    ebb__arena_init(&ebb__alloc_module.dev[i], &ebb__device_upstream, i, &c, total[i]);
  }
  ebb__alloc_module.ndev = ndev;
  st = ebb__hostpools_start(&ebb__alloc_module.conf, ndev);
  if (!st) {
    ebb__al_all.n = 0;
    for (struct ebb__arena *a; ebb__al_all.n < EBB__ARENAS_MAX && (a = ebb__arena_any(ebb__al_all.n));)
      ebb__al_all.all[ebb__al_all.n++] = a;
    /* Copies record their streams on the blocks they touch (ebb__arena_copy_use). */
    ebb__copy_hook_set(ebb__arena_copy_use);
  }
  if (st) {
    for (int i = 0; i < ndev; i++) ebb__arena_fini(&ebb__alloc_module.dev[i]);
    ebb__hostpools_fini();
    ebb__alloc_module.ndev = 0;
  }
  return st;
}

ebb_status ebb__alloc_enter_slow(const char *fn) {
  if (EBB_UNLIKELY(!ebb_is_initialized()))
    return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised; call ebb_init first", fn);
  if (ebb__alloc_up()) return EBB_OK;
  for (;;) {
    int ph = EBB__AL_DOWN;
    /* acquire on success: pairs with the teardown's release store of DOWN; on failure with the
     * release store of UP. */
    if (atomic_compare_exchange_strong_explicit(&ebb__alloc_module.phase, &ph, EBB__AL_STARTING, memory_order_acquire,
                                                memory_order_acquire))
      break;
    if (ph == EBB__AL_UP) return EBB_OK;
    ebb__cpu_relax(); /* another thread is starting the module */
  }
  ebb_status st = alloc_start(fn);
  /* release: publishes the started (or undone) state to the acquires above. */
  atomic_store_explicit(&ebb__alloc_module.phase, st ? EBB__AL_DOWN : EBB__AL_UP, memory_order_release);
  return st;
}

ebb_status ebb__alloc_enter(const char *fn) {
  if (EBB_LIKELY(ebb__alloc_up())) return EBB_OK;
  return ebb__alloc_enter_slow(fn);
}

static ebb_status alloc_module_start(void) { return ebb__alloc_enter("ebb_init"); }
static void alloc_module_stop(void) { alloc_teardown(NULL); }

/* Blocks handed out and not freed, per pool. Kinds name the pool ("blocks of the device 0
 * arena"); their strings are static. */
static int module_alloc_count(ebb__live_count *out, int max) {
  static const char *const dev_kinds[EBB_MAX_DEVICES] = {
    "blocks of the device 0 arena", "blocks of the device 1 arena", "blocks of the device 2 arena",
    "blocks of the device 3 arena", "blocks of the device 4 arena", "blocks of the device 5 arena",
    "blocks of the device 6 arena", "blocks of the device 7 arena", "blocks of the device 8 arena",
    "blocks of the device 9 arena", "blocks of the device 10 arena", "blocks of the device 11 arena",
    "blocks of the device 12 arena", "blocks of the device 13 arena", "blocks of the device 14 arena",
    "blocks of the device 15 arena"};
  if (!ebb__alloc_up()) return 0;
  int n = 0;
  for (int i = 0; i < ebb__alloc_module.ndev && n < max; i++) {
    ebb_arena_stats s;
    ebb__arena_get_stats(&ebb__alloc_module.dev[i], &s);
    out[n++] = (ebb__live_count){dev_kinds[i], (long)(s.alloc_count - s.free_count)};
  }
  long pinned = 0, host = 0;
  struct ebb__arena *a;
  for (int i = 0; (a = ebb__hostpool_nth(i)) != NULL; i++) {
    ebb_arena_stats s;
    ebb__arena_get_stats(a, &s);
    if (a->up->kind == EBB__MEM_PINNED_POOL) pinned += (long)(s.alloc_count - s.free_count);
    else host += (long)(s.alloc_count - s.free_count);
  }
  if (n < max) out[n++] = (ebb__live_count){"blocks of the pinned host pool", pinned};
  if (n < max) out[n++] = (ebb__live_count){"blocks of the host pool", host};
  return n;
}

const ebb__module_desc ebb__module_alloc = {
  .name = "alloc",
  .layer = EBB__LAYER_ALLOC,
  .vars = ebb__alloc_vars,
  .nvars = (int)EBB_ARRAY_LEN(ebb__alloc_vars),
  .start = alloc_module_start,
  .stop = alloc_module_stop,
  .count = module_alloc_count,
};

/* ---- stream references --------------------------------------------------------------------- */

/* The stream an allocation or a use is for, validated, with its id and device: the message of
 * a bad one is that of ebb_stream_get_info, prefixed with `fn`. */
static ebb_status stream_ref_slow(const char *fn, ebb_stream_t *s, struct ebb__stream_ref *out) {
  ebb_stream_info info;
  ebb_status st = ebb_stream_get_info(s, &info);
  if (st) {
    char why[512]; /* the message is rewritten below: copy it out of the buffer first */
    snprintf(why, sizeof why, "%s", ebb_last_error());
    return ebb__fail(st, "%s: %s", fn, why);
  }
  out->s = s;
  out->id = info.id;
  out->device = info.device;
  return EBB_OK;
}

ebb_status ebb__stream_ref(const char *fn, ebb_stream_t *s, struct ebb__stream_ref *out) {
  /* A live stream is one lock-free check (streams_export.h); anything else takes the public
   * call for its message. */
  if (EBB_LIKELY(ebb__stream_peek(s, &out->id, &out->device))) {
    out->s = s;
    return EBB_OK;
  }
  return stream_ref_slow(fn, s, out);
}
