/* device.c: the device arena: the driver upstream behind the arena engine (device memory through
 * cuMemAlloc, or VMM reservations mapped granule by granule for expandable segments), and the
 * public ebb_arena_* calls of ebb/alloc.h, which check their arguments and hand the device's
 * arena to the engine.
 *
 * Owns nothing of its own: the device arenas are the module state's (module.c).
 *
 * Threading: every public call is thread-safe; the upstream's entries are called by the engine
 * with the arena's lock dropped (VMM map and unmap excepted, see xseg.c) and take no ebb lock.
 */
#include <inttypes.h>
#include <stdio.h>

#include "arena_impl.h"

/* ---- the device upstream ------------------------------------------------------------------- */

static ebb_status dev_obtain(struct ebb__arena *a, size_t bytes, uint64_t *addr) {
  return ebb__drv_mem_alloc(a->device, bytes, addr);
}

static ebb_status dev_release(struct ebb__arena *a, uint64_t addr, size_t bytes) {
  (void)bytes;
  return ebb__drv_mem_free(a->device, addr);
}

static ebb_status dev_mem_info(struct ebb__arena *a, size_t *free_bytes, size_t *total_bytes) {
  return ebb_dev_mem_info(a->device, free_bytes, total_bytes);
}

static ebb_status dev_granularity(struct ebb__arena *a, size_t *gran) {
  return ebb__drv_vmm_granularity(a->device, gran);
}

static ebb_status dev_reserve(struct ebb__arena *a, size_t bytes, uint64_t *va) {
  return ebb__drv_vmm_reserve(a->device, bytes, va);
}

static ebb_status dev_unreserve(struct ebb__arena *a, uint64_t va, size_t bytes) {
  (void)a;
  return ebb__drv_vmm_free(va, bytes);
}

/* One physical chunk per granule, mapped at `va` for the owning device. */
static ebb_status dev_map(struct ebb__arena *a, uint64_t va, size_t bytes, uint64_t *handle) {
  uint64_t h = 0;
  ebb_status st = ebb__drv_vmm_create(a->device, bytes, &h);
  if (st) return st;
  st = ebb__drv_vmm_map(va, bytes, h, a->device);
  if (st) {
    /* Best effort, muted: the map's failure is the answer; a chunk that fails to go leaks. */
    ebb__fail_mute(true);
    (void)ebb__drv_vmm_release(h);
    ebb__fail_mute(false);
    return st;
  }
  *handle = h;
  return EBB_OK;
}

/* A range that fails to unmap is still mapped: its handle is kept (the failure returned, the
 * caller keeps the granule). Once unmapped the range is free whatever follows; a handle that
 * then fails to be released leaks its physical chunk, noted with the arena's failed unmaps for
 * ebb_arena_empty_cache to report (the arena's lock is held: no handler is called here). */
static ebb_status dev_unmap(struct ebb__arena *a, uint64_t va, size_t bytes, uint64_t handle) {
  ebb_status st = ebb__drv_vmm_unmap(va, bytes);
  if (st) return st;
  ebb__fail_mute(true);
  st = ebb__drv_vmm_release(handle);
  if (EBB_UNLIKELY(st) && !a->xunmap_fails++) {
    a->xunmap_st = st;
    snprintf(a->xunmap_why, sizeof a->xunmap_why, "a physical chunk of %zu bytes leaks: %s", bytes, ebb__muted_error());
  }
  ebb__fail_mute(false);
  return EBB_OK;
}

const struct ebb__upstream ebb__device_upstream = {
    .name = "device",
    .alloc_fn = "ebb_arena_alloc",
    .free_fn = "ebb_arena_free",
    .kind = EBB__MEM_DEVICE_ARENA,
    .obtain = dev_obtain,
    .release = dev_release,
    .mem_info = dev_mem_info,
    .granularity = dev_granularity,
    .reserve = dev_reserve,
    .unreserve = dev_unreserve,
    .map = dev_map,
    .unmap = dev_unmap,
};

/* ---- public API ---------------------------------------------------------------------------- */

/* The module's entry check inline (ebb__alloc_enter); and the device in range. */
static inline ebb_status device_enter(const char *fn) {
  if (EBB_LIKELY(ebb__alloc_up())) return EBB_OK;
  return ebb__alloc_enter_slow(fn);
}

static inline ebb_status enter_dev(const char *fn, int device) {
  ebb_status st = device_enter(fn);
  if (st) return st;
  if (EBB_UNLIKELY(device < 0 || device >= ebb__alloc_module.ndev))
    return ebb__fail(EBB_EDEVICE, "%s: device %d is out of range; expected 0 <= device < %d", fn, device, ebb__alloc_module.ndev);
  return EBB_OK;
}

/* ebb_arena_alloc's checks one by one, in their order, each with its message; also the path of
 * a NULL stream (the current one) and of zero bytes. */
static ebb_status arena_alloc_entry(int device, size_t bytes, ebb_stream_t *stream, void **ptr) {
  static const char fn[] = "ebb_arena_alloc";
  ebb_status st = enter_dev(fn, device);
  if (EBB_UNLIKELY(st)) return st;
  if (EBB_UNLIKELY(!ptr)) return ebb__fail(EBB_EINVAL, "%s: ptr is NULL; expected a void * to fill", fn);
  struct ebb__stream_ref s;
  if (!stream && (st = ebb_stream_current(device, &stream))) return st;
  if ((st = ebb__stream_ref(fn, stream, &s))) return st;
  if (EBB_UNLIKELY(s.device != device))
    return ebb__fail(EBB_EDEVICE, "%s: stream %" PRIu64 " belongs to device %d; expected a stream of device %d", fn, s.id,
                     s.device, device);
  if (bytes == 0) {
    *ptr = NULL;
    return EBB_OK;
  }
  return ebb__arena_alloc(&ebb__alloc_module.dev[device], bytes, &s, ptr);
}

ebb_status ebb_arena_alloc(int device, size_t bytes, ebb_stream_t *stream, void **ptr) {
  /* Every check passing, tested together: the module up, the device in range, an out pointer,
   * a live stream of that device, a size. Anything else takes the checks one by one for the
   * message of the first that fails (or the NULL-stream and zero-byte paths). */
  struct ebb__stream_ref s;
  if (EBB_LIKELY(ebb__alloc_up() && (unsigned)device < (unsigned)ebb__alloc_module.ndev && ptr && bytes &&
                 ebb__stream_peek(stream, &s.id, &s.device) && s.device == device)) {
    s.s = stream;
    return ebb__arena_alloc(&ebb__alloc_module.dev[device], bytes, &s, ptr);
  }
  return arena_alloc_entry(device, bytes, stream, ptr);
}

ebb_status ebb_arena_free(void *ptr) {
  static const char fn[] = "ebb_arena_free";
  ebb_status st = device_enter(fn);
  if (EBB_UNLIKELY(st)) return st;
  if (!ptr) return EBB_OK;
  return ebb__arena_free(fn, ptr, EBB__MEM_DEVICE_ARENA);
}

ebb_status ebb_arena_record_stream(void *ptr, ebb_stream_t *stream) {
  static const char fn[] = "ebb_arena_record_stream";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!ptr) return ebb__fail(EBB_EINVAL, "%s: pointer is NULL; expected a block from ebb_arena_alloc", fn);
  struct ebb__stream_ref s;
  if ((st = ebb__stream_ref(fn, stream, &s))) return st;
  return ebb__arena_record(fn, ptr, &s, EBB__MEM_DEVICE_ARENA);
}

ebb_status ebb_arena_empty_cache(int device) {
  ebb_status st = enter_dev("ebb_arena_empty_cache", device);
  if (st) return st;
  return ebb__arena_empty_cache(&ebb__alloc_module.dev[device]);
}

ebb_status ebb_arena_set_limit(int device, size_t bytes) {
  ebb_status st = enter_dev("ebb_arena_set_limit", device);
  if (st) return st;
  ebb__arena_set_limit(&ebb__alloc_module.dev[device], bytes);
  return EBB_OK;
}

ebb_status ebb_arena_set_limit_fraction(int device, double fraction) {
  static const char fn[] = "ebb_arena_set_limit_fraction";
  ebb_status st = enter_dev(fn, device);
  if (st) return st;
  if (!(fraction > 0.0 && fraction <= 1.0))
    return ebb__fail(EBB_EINVAL, "%s: fraction %g is not valid; expected 0 < fraction <= 1", fn, fraction);
  struct ebb__arena *a = &ebb__alloc_module.dev[device];
  size_t bytes = (size_t)((double)a->total_mem * fraction);
  ebb__arena_set_limit(a, bytes ? bytes : 1);
  return EBB_OK;
}

ebb_status ebb_arena_get_stats(int device, ebb_arena_stats *out) {
  static const char fn[] = "ebb_arena_get_stats";
  ebb_status st = enter_dev(fn, device);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "%s: out is NULL; expected an ebb_arena_stats to fill", fn);
  ebb__arena_get_stats(&ebb__alloc_module.dev[device], out);
  return EBB_OK;
}

ebb_status ebb_arena_reset_peak(int device) {
  ebb_status st = enter_dev("ebb_arena_reset_peak", device);
  if (st) return st;
  ebb__arena_reset_peak(&ebb__alloc_module.dev[device]);
  return EBB_OK;
}

ebb_status ebb_arena_debug_check(int device) {
  static const char fn[] = "ebb_arena_debug_check";
  ebb_status st = enter_dev(fn, device);
  if (st) return st;
  return ebb__arena_check(&ebb__alloc_module.dev[device], fn);
}


ebb_status ebb_alloc_history_get(int device, ebb_alloc_trace_entry *out, size_t cap, size_t *count, uint64_t *total) {
  static const char fn[] = "ebb_alloc_history_get";
  ebb_status st = enter_dev(fn, device);
  if (st) return st;
  if (!count) return ebb__fail(EBB_EINVAL, "%s: count is NULL; expected a size_t to fill", fn);
  if (!out && cap) return ebb__fail(EBB_EINVAL, "%s: out is NULL with cap %zu; expected an array of cap entries", fn, cap);
  return ebb__hist_get(&ebb__alloc_module.dev[device], out, cap, count, total);
}

ebb_status ebb_memory_snapshot_json(const char *path) {
  static const char fn[] = "ebb_memory_snapshot_json";
  ebb_status st = ebb__alloc_enter(fn);
  if (st) return st;
  if (!path) return ebb__fail(EBB_EINVAL, "%s: path is NULL; expected a file name to write", fn);
  return ebb__snapshot_write(fn, path);
}
