/* ebb/tensor.h: tensors. Storage on a device or in host memory, dtypes, creation, views, copies
 * between devices, version counters.
 *
 * A tensor is a refcounted, opaque view (offset, shape, strides in elements, dtype) of a
 * refcounted storage. Views share their base's storage and its version counter; in-place ops bump
 * that counter, so a reader that saved a tensor can tell whether it was overwritten.
 *
 * Devices: EBB_DEVICE_CPU (-1) is host memory (ebb_pageable_alloc); 0..n-1 are the driver's devices,
 * whose storage comes from the device arena (ebb_arena_alloc) on the calling thread's current
 * stream of that device, owner-tagged by the calling thread's owner scope
 * (ebb_alloc_owner_push; ebb_tensor_empty_named opens one for you).
 * Execution: work on CPU tensors runs on the calling thread and is finished when the call
 * returns. Work on device tensors is enqueued on the device's current stream (for the calling
 * thread) and the call returns at once; reading values back is an explicit copy
 * (ebb_tensor_to_host). Work is ordered within a stream only: a tensor written on one stream
 * and read on another needs the reader to wait first (ebb_stream_wait_stream or an event), as
 * in CUDA. A storage used on a stream other than its allocation stream is declared to the arena
 * (ebb_arena_record_stream), so releasing a tensor never races with queued work.
 *
 * Handles: every call returning a tensor hands the caller one reference, released with
 * ebb_tensor_release. Arguments are borrowed. A released tensor passed to any call is EBB_EFREED
 * (tensor records are type-stable and reused first-in-first-out only after 4096 more releases,
 * so a stale handle is reported until then); releasing twice is EBB_EFREED. Tensors must be
 * released before the last ebb_shutdown (they hold arena blocks).
 * Threading: every function is thread-safe. Two threads writing one storage at once (in-place
 * ops) is the caller's race, as with any memory.
 * Failures say which call, which argument and which shapes, dtypes or devices were wrong. The
 * message starts with the name of the call you made: a failure of work done on your behalf
 * (another module's call, or an op that a composite op is made of) reads "<your call>: <what
 * failed there>".
 */
#ifndef EBB_TENSOR_H
#define EBB_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ebb/alloc.h"
#include "ebb/status.h"
#include "ebb/stream.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EBB_DEVICE_CPU (-1)
#define EBB_TENSOR_MAX_DIMS 8
#define EBB_TENSOR_NAME_MAX 63 /* bytes of a tensor name, without the terminating NUL */

/* Element types. bf16 and f16 are storage types: values are converted to f32 (exactly) for
 * arithmetic and rounded back to nearest-even. i64 and bool are exact. */
typedef enum ebb_dtype {
  EBB_F32 = 0,
  EBB_F64 = 1,
  EBB_BF16 = 2,
  EBB_F16 = 3,
  EBB_I64 = 4,
  EBB_BOOL = 5
} ebb_dtype;
#define EBB_DTYPE_COUNT 6

typedef struct ebb_tensor ebb_tensor_t;

/* "f32", "f64", "bf16", "f16", "i64", "bool"; "unknown" outside the enum. Static strings. */
EBB_API const char *ebb_dtype_name(ebb_dtype dt);
/* Bytes per element (4, 8, 2, 2, 8, 1); 0 outside the enum. */
EBB_API size_t ebb_dtype_size(ebb_dtype dt);
EBB_API bool ebb_dtype_is_float(ebb_dtype dt);

/* Scalar conversions used by every kernel, exposed for tests and callers packing buffers.
 * float -> bf16/f16 rounds to nearest, ties to even; NaN stays NaN (quiet), overflow gives
 * infinity, f16 keeps subnormals. */
EBB_API uint16_t ebb_f32_to_bf16(float x);
EBB_API float ebb_bf16_to_f32(uint16_t h);
EBB_API uint16_t ebb_f32_to_f16(float x);
EBB_API float ebb_f16_to_f32(uint16_t h);

/* ---- creation -----------------------------------------------------------------------------
 * `shape` has `ndim` entries (0 <= ndim <= EBB_TENSOR_MAX_DIMS; ndim 0 is a scalar of one
 * element); every extent >= 0. The result is contiguous (row-major). On a device, values are
 * written by a kernel on the current stream.
 * Failures: EBB_EINVAL (NULL out, NULL shape with ndim > 0, ndim or an extent out of range,
 * a dtype outside the enum, a byte size that overflows), EBB_EDEVICE (no such device),
 * EBB_ENOMEM (the arena or host pool is exhausted; the message names the tensor, then gives
 * the allocator's report: "ebb_tensor_empty: out of memory for a [4096,4096] f32 tensor
 * (64 MiB) on device 0: ..."; so do the ops, for the tensors they create), EBB_ENOTINIT. */
EBB_API ebb_status ebb_tensor_empty(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out);
/* ebb_tensor_empty inside an owner scope (cat, name): the arena records the storage as owned by
 * `name`, and the tensor carries the name (ebb_tensor_name). */
EBB_API ebb_status ebb_tensor_empty_named(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_owner_cat cat,
                                          const char *name, ebb_tensor_t **out);
EBB_API ebb_status ebb_tensor_zeros(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out);
EBB_API ebb_status ebb_tensor_ones(int device, ebb_dtype dt, int ndim, const int64_t *shape, ebb_tensor_t **out);
/* Every element = value converted to dt as ebb_tensor_to_dtype converts (i64: truncated toward
 * zero; bool: value != 0). */
EBB_API ebb_status ebb_tensor_full(int device, ebb_dtype dt, int ndim, const int64_t *shape, double value,
                                   ebb_tensor_t **out);
/* 1-D: element i = start + i * step, for i < n. */
EBB_API ebb_status ebb_tensor_arange(int device, ebb_dtype dt, double start, double step, int64_t n, ebb_tensor_t **out);
/* Random numbers from a counter-based generator (Philox 4x32, 10 rounds) keyed by `seed`:
 * element i (row-major) is a function of (seed, offset + i) only, so the same call gives the
 * same values on the CPU and on every device, and a stream of draws is (seed, offset += numel).
 * rand: uniform in [0, 1); randn: standard normal (Box-Muller). dt must be floating. */
EBB_API ebb_status ebb_tensor_rand(int device, ebb_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                                   uint64_t offset, ebb_tensor_t **out);
EBB_API ebb_status ebb_tensor_randn(int device, ebb_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                                    uint64_t offset, ebb_tensor_t **out);
/* A tensor holding a copy of `src`: numel elements of dt, row-major, `bytes` must equal
 * numel * ebb_dtype_size(dt). Pageable src may be reused when the call returns (device copies
 * of pageable memory are staged at call time); pinned src must stay unchanged until the
 * device's current stream has run the copy (as with ebb_copy_async). */
EBB_API ebb_status ebb_tensor_from_host(int device, ebb_dtype dt, int ndim, const int64_t *shape, const void *src,
                                        size_t bytes, ebb_tensor_t **out);

/* ---- reading values back --------------------------------------------------------------------
 * Synchronous: copies the elements of `t` (row-major, its own dtype) into dst, which has `bytes`
 * = numel * element size, and returns when dst holds them (waits for the current stream of t's
 * device). EBB_EINVAL for a wrong byte count or NULL dst. */
EBB_API ebb_status ebb_tensor_to_host(const ebb_tensor_t *t, void *dst, size_t bytes);
/* Asynchronous: enqueues the copy on the current stream of t's device into `dst`, pinned memory
 * (ebb_pinned_alloc or driver-allocated); records `done` on that stream after the copy, so dst
 * is valid once `done` completes. EBB_EINVAL when dst is not pinned host memory or `done` is
 * NULL; EBB_EFREED when `done` is released; EBB_EDEVICE when `done` belongs to another device.
 * For a CPU tensor the copy is made before the call returns and `done` is left as it was
 * (EBB_EDEVICE never applies; a released `done` is still EBB_EFREED, with nothing copied).
 * On failure nothing is enqueued, nothing is written to dst, and `done` is not recorded: every
 * check is made before the copy is enqueued. */
EBB_API ebb_status ebb_tensor_to_host_async(const ebb_tensor_t *t, void *dst, size_t bytes, ebb_event_t *done);

/* ---- handles and getters ------------------------------------------------------------------ */

EBB_API ebb_status ebb_tensor_retain(ebb_tensor_t *t);
/* Drops one reference; the last one (of the last view) returns the storage to its arena or
 * pool, stream-ordered: queued work that uses it finishes first. */
EBB_API ebb_status ebb_tensor_release(ebb_tensor_t *t);
/* Declares that work issued to `stream` so far and later uses t's storage (any view of it, and
 * so every view of that storage), as work enqueued by ebb's own ops on a stream declares itself:
 * when the storage's last reference goes, its memory is reused only after that stream's work
 * (an event, never a host wait). For work the caller enqueues itself on another stream (its own
 * kernels through ebb_tensor_data, a copy). Once per stream is enough; again is a no-op. A
 * stream released afterwards is still waited for. Thread-safe. Errors: EBB_EINVAL for NULL t or
 * stream, or a CPU tensor (its memory is not stream-ordered); EBB_EFREED for a released t or
 * stream; EBB_EDEVICE when the stream belongs to another device than t. */
EBB_API ebb_status ebb_tensor_record_stream(const ebb_tensor_t *t, ebb_stream_t *stream);

typedef struct ebb_tensor_info {
  int device;                          /* EBB_DEVICE_CPU or a device ordinal */
  ebb_dtype dtype;
  int ndim;
  int64_t shape[EBB_TENSOR_MAX_DIMS];
  int64_t strides[EBB_TENSOR_MAX_DIMS];/* in elements; 0 along expanded dims */
  int64_t offset;                      /* elements from the start of the storage */
  int64_t numel;
  bool contiguous;                     /* row-major with no gaps (extents of 1 ignored) */
  uint64_t version;                    /* the storage's version counter */
} ebb_tensor_info;

EBB_API ebb_status ebb_tensor_get_info(const ebb_tensor_t *t, ebb_tensor_info *out);
EBB_API ebb_status ebb_tensor_shape(const ebb_tensor_t *t, int *ndim, int64_t shape[EBB_TENSOR_MAX_DIMS]);
EBB_API ebb_status ebb_tensor_strides(const ebb_tensor_t *t, int64_t strides[EBB_TENSOR_MAX_DIMS]);
EBB_API ebb_status ebb_tensor_dtype(const ebb_tensor_t *t, ebb_dtype *out);
EBB_API ebb_status ebb_tensor_device(const ebb_tensor_t *t, int *out);
EBB_API ebb_status ebb_tensor_numel(const ebb_tensor_t *t, int64_t *out);
EBB_API ebb_status ebb_tensor_is_contiguous(const ebb_tensor_t *t, bool *out);
/* The storage's version counter: starts at 0, +1 per in-place write through any view. */
EBB_API ebb_status ebb_tensor_version(const ebb_tensor_t *t, uint64_t *out);
/* Whether a and b are views of one storage. */
EBB_API ebb_status ebb_tensor_same_storage(const ebb_tensor_t *a, const ebb_tensor_t *b, bool *out);
/* Address of element 0 of the view (device or host memory), for interop and kernels of your
 * own. Borrowed: valid while the tensor (or another view of its storage) is alive. */
EBB_API ebb_status ebb_tensor_data(const ebb_tensor_t *t, void **out);
/* The tensor's name ("" until set), copied into buf (truncated to cap - 1 bytes). */
EBB_API ebb_status ebb_tensor_name(const ebb_tensor_t *t, char *buf, size_t cap);
/* Names this handle (not its views); used in ebb's messages. At most EBB_TENSOR_NAME_MAX bytes. */
EBB_API ebb_status ebb_tensor_set_name(ebb_tensor_t *t, const char *name);


/* Adds 1 to the storage's version counter (ops' in-place variants call it; autograd and
 * callers writing through ebb_tensor_data do too). */
EBB_API ebb_status ebb_tensor_bump_version(ebb_tensor_t *t);

/* ---- views: share storage and version counter with `t` ---------------------------------------
 * Dims may be negative (counted from the end: -1 is the last). Failures: EBB_EINVAL naming the
 * dim or shape that is out of range or incompatible; EBB_EFREED for a released t.
 * A view holds a reference to its base (the tensor its chain of views started from; t itself
 * unless t is a view), so the base's handle (and its autograd history) lives as long as its
 * views: autograd gives an in-place change through a view to the base (ebb/autograd.h). A
 * reshape that copies is not a view. */

/* A view with `shape` (one entry may be -1: inferred). Needs strides that allow it (any
 * contiguous tensor does); EBB_EINVAL otherwise: use ebb_tensor_reshape. */
EBB_API ebb_status ebb_tensor_view(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out);
/* ebb_tensor_view when the strides allow it, else a contiguous copy with that shape. */
EBB_API ebb_status ebb_tensor_reshape(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out);
EBB_API ebb_status ebb_tensor_transpose(const ebb_tensor_t *t, int dim0, int dim1, ebb_tensor_t **out);
/* dims is a permutation of 0..ndim-1 (negative allowed): out.shape[i] = t.shape[dims[i]]. */
EBB_API ebb_status ebb_tensor_permute(const ebb_tensor_t *t, const int *dims, int ndim, ebb_tensor_t **out);
/* Elements start, start+step, ... below end along dim. start/end are clamped to [0, size]
 * (negative ones count from the end first); step >= 1. */
EBB_API ebb_status ebb_tensor_slice(const ebb_tensor_t *t, int dim, int64_t start, int64_t end, int64_t step,
                                    ebb_tensor_t **out);
/* length elements from start along dim; start + length must lie within the dim (no clamping). */
EBB_API ebb_status ebb_tensor_narrow(const ebb_tensor_t *t, int dim, int64_t start, int64_t length, ebb_tensor_t **out);
/* Index `index` along dim, which is removed. */
EBB_API ebb_status ebb_tensor_select(const ebb_tensor_t *t, int dim, int64_t index, ebb_tensor_t **out);
/* Broadcast to `shape` (ndim >= t's; size-1 dims become any size with stride 0; -1 keeps a
 * size). The result must not be written in place (its elements alias). */
EBB_API ebb_status ebb_tensor_expand(const ebb_tensor_t *t, int ndim, const int64_t *shape, ebb_tensor_t **out);
/* Removes dim (which must have size 1). */
EBB_API ebb_status ebb_tensor_squeeze(const ebb_tensor_t *t, int dim, ebb_tensor_t **out);
/* Inserts a dim of size 1 at position dim (-1: at the end; range [-ndim-1, ndim]). */
EBB_API ebb_status ebb_tensor_unsqueeze(const ebb_tensor_t *t, int dim, ebb_tensor_t **out);

/* ---- copies ---------------------------------------------------------------------------------
 * New storage, a version counter of its own. */

/* `t` itself (one more reference) when contiguous, else a contiguous copy on its device. */
EBB_API ebb_status ebb_tensor_contiguous(const ebb_tensor_t *t, ebb_tensor_t **out);
/* A contiguous copy on t's device. */
EBB_API ebb_status ebb_tensor_clone(const ebb_tensor_t *t, ebb_tensor_t **out);
/* A contiguous copy on `device`. Device to device goes through ebb_copy_async on the current
 * stream of the destination device (ordered after the source device's current stream); CPU to
 * device is staged at call time; device to CPU waits for the copy (a CPU tensor is always
 * ready). */
EBB_API ebb_status ebb_tensor_to_device(const ebb_tensor_t *t, int device, ebb_tensor_t **out);
/* A contiguous copy converted to dt. Float to i64 truncates toward zero (NaN gives 0, values
 * out of range saturate); anything to bool is (x != 0). */
EBB_API ebb_status ebb_tensor_to_dtype(const ebb_tensor_t *t, ebb_dtype dt, ebb_tensor_t **out);

/* ---- in place: each bumps the version counter of dst's storage once ----------------------- */

/* Every element of dst = value. */
EBB_API ebb_status ebb_tensor_fill_(ebb_tensor_t *dst, double value);
EBB_API ebb_status ebb_tensor_zero_(ebb_tensor_t *dst);
/* dst = src, converting dtype and broadcasting src to dst's shape; src may be on another
 * device (copied through dst's device). EBB_EINVAL when src does not broadcast to dst's shape
 * or dst has expanded (stride 0) dims. */
EBB_API ebb_status ebb_tensor_copy_(ebb_tensor_t *dst, const ebb_tensor_t *src);

/* Tensor handles alive in the process (all devices), for leak checks in tests. */
EBB_API long ebb_tensor_live_count(void);

#ifdef __cplusplus
}
#endif
#endif /* EBB_TENSOR_H */
