/* collectives.c: the public collectives: their argument checks and the three issue paths.
 *
 *  - CPU group (MPI): the record points at the tensors' memory, holds a reference to them, and
 *    is READY at once; the communication thread runs it in turn.
 *  - device group, MPI: on the communication stream, after a wait for the caller's current
 *    stream: the input copied into pinned memory, the gate (a host function that hands the
 *    record to the communication thread and holds the stream until MPI returns), the result
 *    copied back; then the caller's current stream waits for the communication stream.
 *  - device group, NCCL: the same two waits around the NCCL call itself on the communication
 *    stream; no thread.
 * A group's issue lock is held across each issue, so the order of the records on the queue is
 * the order of their work on the stream, and the ranks see the calls in the caller's order.
 * Every check comes before anything is enqueued; a failure after the first enqueue (a driver
 * error) fails the record and its group, since the ranks' sequences may no longer match.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "alloc_export.h"
#include "dist_impl.h"
#include "ebb/trace.h"
#include "ops_export.h"
#include "runtime_export.h"
#include "streams_export.h"

static const char *device_str(int device, char *buf, size_t cap) {
  if (device == EBB_DEVICE_CPU) snprintf(buf, cap, "the CPU");
  else snprintf(buf, cap, "device %d", device);
  return buf;
}

/* The checks every tensor argument gets: live, on the group's device, contiguous. */
static ebb_status check_tensor(const struct ebb_pg *pg, const ebb_tensor_t *t, const char *fn, const char *arg,
                               ebb_tensor_info *info) {
  ebb_status st = ebb__tensor_check(t, fn, arg);
  if (st) return st;
  if ((st = ebb_tensor_get_info(t, info))) return st;
  char desc[EBB__DESC_MAX], dev[32];
  if (info->device != pg->device)
    return ebb__fail(EBB_EDEVICE, "%s: %s is not on the group's device; expected a tensor on %s, where the %s group was "
                     "created", fn, ebb__tensor_desc(t, arg, -1, desc, sizeof desc), device_str(pg->device, dev, sizeof dev),
                     ebb_dist_backend_name(pg->backend));
  if (!info->contiguous)
    return ebb__fail(EBB_EINVAL, "%s: %s is not contiguous; expected a contiguous tensor (make one with "
                     "ebb_tensor_contiguous, and copy the result back)", fn, ebb__tensor_desc(t, arg, -1, desc, sizeof desc));
  if (info->numel > INT_MAX)
    return ebb__fail(EBB_ENOTSUP, "%s: %s has %lld elements; one collective moves at most %d elements per rank (split it)",
                     fn, ebb__tensor_desc(t, arg, -1, desc, sizeof desc), (long long)info->numel, INT_MAX);
  return EBB_OK;
}

static ebb_status group_usable(struct ebb_pg *pg, const char *fn) {
  ebb_status st = ebb__pg_check(pg, fn);
  if (st) return st;
  if (!ebb_is_initialized()) return ebb__fail(EBB_ENOTINIT, "%s: ebb is not initialised", fn);
  return EBB_OK;
}

/* Under dist_mu: the group's failure, as this call's refusal. */
static ebb_status refuse_failed_locked(struct ebb_pg *pg, const char *fn) {
  char msg[EBB__DIST_MSG_MAX];
  snprintf(msg, sizeof msg, "%s", pg->fail_msg);
  ebb__mutex_unlock(&ebb__dist_mu);
  return ebb__fail(EBB_ESTATE, "%s: the %s group failed earlier, and ranks may no longer agree on the order of its "
                   "collectives: %s; expected a healthy group (destroy it and create another on every rank)", fn,
                   ebb_dist_backend_name(pg->backend), msg);
}

static dist_elem elem_of(ebb_dtype dt) {
  switch (dt) {
  case EBB_F32: return DIST_ELEM_F32;
  case EBB_F64: return DIST_ELEM_F64;
  case EBB_I64: return DIST_ELEM_I64;
  case EBB_BF16: return DIST_ELEM_BF16;
  case EBB_F16: return DIST_ELEM_F16;
  case EBB_BOOL: break;
  }
  return DIST_ELEM_BYTE;
}

/* The CPU path: the tensors' own memory, on the communication thread. */
static ebb_status issue_cpu(struct ebb_pg *pg, const char *fn, const dist_call *call, ebb_tensor_t *a, ebb_tensor_t *b,
                            ebb_work_t **work) {
  /* A group failing between this check and the enqueue refuses the record on its thread. */
  ebb__mutex_lock(&ebb__dist_mu);
  if (pg->failed) return refuse_failed_locked(pg, fn);
  ebb__mutex_unlock(&ebb__dist_mu);
  struct ebb_work *w;
  ebb_status st = ebb__work_new(pg, true, &w);
  if (st) return ebb__fail(st, "%s: %s", fn, ebb_last_error());
  w->call = *call;
  w->state = WORK_READY;
  if (a) ebb_tensor_retain(a);
  if (b) ebb_tensor_retain(b);
  w->hold[0] = a;
  w->hold[1] = b;
  ebb__mutex_lock(&pg->issue_mu);
  ebb__mutex_lock(&ebb__dist_mu);
  ebb__work_enqueue_locked(pg, w);
  ebb__mutex_unlock(&ebb__dist_mu);
  ebb__mutex_unlock(&pg->issue_mu);
  if (work) {
    *work = w;
    return EBB_OK;
  }
  /* The blocking form: wait, then drop the handle made for it. */
  st = ebb_work_wait(w);
  char msg[EBB__ERRMSG_MAX];
  if (st) snprintf(msg, sizeof msg, "%s", ebb_last_error());
  ebb_work_release(w);
  return st ? ebb__fail(st, "%s", msg) : EBB_OK;
}

/* Fails an enqueued device record whose enqueue could not be completed (the group with it). */
static ebb_status fail_enqueued(struct ebb_work *w, ebb_status st, const char *fn) {
  char msg[EBB__DIST_MSG_MAX];
  snprintf(msg, sizeof msg, "%s: %s #%llu could not be enqueued on the communication stream: %.380s", fn,
           ebb__dist_kind_name(w->call.kind), (unsigned long long)w->seq, ebb_last_error());
  ebb__mutex_lock(&ebb__dist_mu);
  ebb__work_finish_locked(w, st, msg);
  ebb__mutex_unlock(&ebb__dist_mu);
  return ebb__fail(st, "%s", msg);
}

/* The device paths. `inout` is all-reduce's and broadcast's tensor or all-gather's output,
 * `in` all-gather's input; both NULL for a barrier. */
static ebb_status issue_device(struct ebb_pg *pg, const char *fn, const dist_call *call, ebb_tensor_t *inout,
                               const ebb_tensor_t *in, ebb_work_t **work) {
  ebb_status st;
  void *out_ptr = NULL, *in_ptr = NULL;
  if (inout && (st = ebb_tensor_data(inout, &out_ptr))) return st;
  if (in && (st = ebb_tensor_data(in, &in_ptr))) return st;
  size_t bytes = call->count * call->elem_bytes;                       /* one rank's part */
  size_t out_bytes = call->kind == DIST_ALL_GATHER ? bytes * (size_t)pg->size : bytes;
  bool nccl = pg->backend == EBB_DIST_NCCL;
  ebb__pg_free_spent(pg);
  ebb_dev_guard guard;
  if ((st = ebb_dev_guard_enter(&guard, pg->device))) return st;
  ebb__mutex_lock(&pg->issue_mu);
  ebb__mutex_lock(&ebb__dist_mu);
  if (pg->failed) {
    ebb__mutex_unlock(&pg->issue_mu);
    ebb_dev_guard_exit(&guard);
    return refuse_failed_locked(pg, fn);
  }
  ebb__mutex_unlock(&ebb__dist_mu);

  ebb_stream_t *cur = NULL;
  void *pinned = NULL;
  ebb_event_t *end = NULL;
  struct ebb_work *w = NULL;
  if ((st = ebb_stream_current(pg->device, &cur))) goto fail;
  if (work) {
    if ((st = ebb_event_create(pg->device, EBB_EVENT_DEFAULT, &end))) goto fail;
    ebb__events_live_add(-1); /* the work handle's own: counted as the handle */
  }
  /* MPI's host copy: the input part first (all-gather: apart from the output, which MPI fills). */
  size_t pinned_bytes = nccl ? 0 : (call->kind == DIST_ALL_GATHER ? bytes + out_bytes : out_bytes);
  if (pinned_bytes) {
    /* Tagged as the group's staging, whatever scope the caller has open (a backward node's). */
    bool pushed = ebb__alloc_owner_push_interned(EBB_OWNER_STAGING, pg->staging_owner);
    st = ebb_pinned_alloc(pinned_bytes, pg->device, &pinned);
    if (pushed) ebb_alloc_owner_pop();
    if (st) goto fail;
  }
  /* References: the caller's handle (when asked for), the queue's (MPI: dropped by the
   * communication thread; NCCL, which queues nothing: dropped below), the gate's (MPI). */
  if ((st = ebb__work_new(pg, work != NULL, &w))) goto fail;
  bool gate_enqueued = false;
  w->call = *call;
  w->device = true;
  w->end = end;
  if (!nccl) {
    w->call.buf = call->kind == DIST_ALL_GATHER ? (char *)pinned + bytes : pinned;
    w->call.src = call->kind == DIST_ALL_GATHER ? pinned : NULL;
    w->pinned = pinned; /* handed back by the communication thread once MPI is done with it */
    w->refs++;          /* the gate's */
  } else {
    w->state = WORK_DONE; /* NCCL: the stream is the whole story; the end event says when */
  }
  ebb__mutex_lock(&ebb__dist_mu);
  if (!nccl) ebb__work_enqueue_locked(pg, w);
  else w->seq = ++pg->next_seq;
  ebb__mutex_unlock(&ebb__dist_mu);

  /* From here the record has its place in the sequence: failures fail it and the group. */
  if ((st = ebb_stream_wait_stream(pg->stream, cur))) goto fail_enqueued;
  if (nccl) {
    struct CUstream_st *cu;
    char msg[EBB__DIST_MSG_MAX];
    if ((st = ebb_stream_cu(pg->stream, &cu))) goto fail_enqueued;
    dist_call c = *call;
    c.buf = out_ptr;
    uint64_t t0 = ebb_trace_now_ns();
    if ((st = ebb__nccl_enqueue(pg->nccl_comm, &c, call->kind == DIST_ALL_GATHER ? in_ptr : out_ptr, cu, pg->size, msg,
                                sizeof msg))) {
      ebb__fail(st, "%s", msg);
      goto fail_enqueued;
    }
    if (ebb_trace_enabled()) { /* like a kernel's: the host's enqueue time, on the stream's track */
      ebb_trace_span r = {.name = ebb__dist_kind_name(call->kind), .start_ns = t0, .end_ns = ebb_trace_now_ns(),
                          .device = pg->device, .stream = pg->trace_stream, .kind = EBB_TRACE_SPAN,
                          .args = EBB_TRACE_ARG_SEQ | EBB_TRACE_ARG_BYTES, .seq = w->seq, .bytes = (uint64_t)bytes,
                          .owner = w->owner && *w->owner ? w->owner : NULL};
      (void)ebb_trace_record(&r);
    }
  } else {
    const void *src = call->kind == DIST_ALL_GATHER ? in_ptr : out_ptr;
    bool send = call->kind != DIST_BROADCAST || call->root == pg->rank;
    if (bytes && send && (st = ebb_copy_async(pinned, src, bytes, pg->stream))) goto fail_enqueued;
    if ((st = ebb_stream_host_func(pg->stream, ebb__work_gate, w))) goto fail_enqueued;
    gate_enqueued = true;
    if (out_bytes && (st = ebb_copy_async(out_ptr, w->call.buf, out_bytes, pg->stream))) goto fail_enqueued;
  }
  if (end && (st = ebb_event_record(end, pg->stream))) goto fail_enqueued;
  if ((st = ebb_stream_wait_stream(cur, pg->stream))) goto fail_enqueued;
  ebb__mutex_unlock(&pg->issue_mu);
  ebb_dev_guard_exit(&guard);
  if (nccl) {
    ebb__mutex_lock(&ebb__dist_mu);
    ebb__work_unref_locked(w); /* the queue's, unused */
    ebb__mutex_unlock(&ebb__dist_mu);
  }
  if (work) *work = w;
  return EBB_OK;

fail_enqueued:
  st = fail_enqueued(w, st, fn);
  /* The stream may still run what was enqueued: the block, handed back by the communication
   * thread, is reused after it. */
  if (pinned) ebb_pinned_record_stream(pinned, pg->stream);
  ebb__mutex_unlock(&pg->issue_mu);
  ebb_dev_guard_exit(&guard);
  ebb__mutex_lock(&ebb__dist_mu);
  if (!nccl && !gate_enqueued) ebb__work_unref_locked(w); /* the gate will not run */
  if (nccl) ebb__work_unref_locked(w);                    /* the queue's, unused */
  ebb__mutex_unlock(&ebb__dist_mu);
  if (work) {
    /* Nothing is handed out on failure: the handle made for the caller goes, the record stays
     * on the queue (failed) until the communication thread drops it. */
    char msg[EBB__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", ebb_last_error());
    ebb_work_release(w);
    st = ebb__fail(st, "%s", msg);
  }
  return st;

fail:
  if (pinned) ebb_pinned_free(pinned);
  if (end) {
    ebb__events_live_add(1);
    ebb_event_release(end);
  }
  ebb__mutex_unlock(&pg->issue_mu);
  ebb_dev_guard_exit(&guard);
  return ebb__fail(st, "%s: %s", fn, ebb_last_error());
}

static ebb_status issue(struct ebb_pg *pg, const char *fn, const dist_call *call, ebb_tensor_t *inout,
                        const ebb_tensor_t *in, ebb_work_t **work) {
  if (pg->device == EBB_DEVICE_CPU)
    return issue_cpu(pg, fn, call, inout, (ebb_tensor_t *)(uintptr_t)in, work);
  return issue_device(pg, fn, call, inout, in, work);
}

ebb_status ebb_all_reduce(ebb_pg_t *pg, ebb_tensor_t *t, ebb_reduce_op op, ebb_work_t **work) {
  static const char fn[] = "ebb_all_reduce";
  ebb_status st = group_usable(pg, fn);
  if (st) return st;
  ebb_tensor_info info;
  if ((st = check_tensor(pg, t, fn, "t", &info))) return st;
  char desc[EBB__DESC_MAX];
  if (op != EBB_REDUCE_SUM && op != EBB_REDUCE_AVG)
    return ebb__fail(EBB_EINVAL, "%s: op %d is not one of EBB_REDUCE_SUM (0), EBB_REDUCE_AVG (1)", fn, (int)op);
  if (info.dtype == EBB_BOOL)
    return ebb__fail(EBB_EINVAL, "%s: %s is bool, which has no sum; expected f32, f64, i64 (or bf16, f16 on NCCL)", fn,
                     ebb__tensor_desc(t, "t", -1, desc, sizeof desc));
  if (op == EBB_REDUCE_AVG && info.dtype == EBB_I64)
    return ebb__fail(EBB_EINVAL, "%s: EBB_REDUCE_AVG of %s: an integer average would be rounded; expected a floating "
                     "dtype (or EBB_REDUCE_SUM)", fn, ebb__tensor_desc(t, "t", -1, desc, sizeof desc));
  if ((info.dtype == EBB_BF16 || info.dtype == EBB_F16) && pg->backend == EBB_DIST_MPI)
    return ebb__fail(EBB_ENOTSUP, "%s: %s: MPI has no %s sum; expected f32, f64 or i64 on the MPI backend (convert with "
                     "ebb_tensor_to_dtype)", fn, ebb__tensor_desc(t, "t", -1, desc, sizeof desc), ebb_dtype_name(info.dtype));
  dist_call c = {.kind = DIST_ALL_REDUCE, .elem = elem_of(info.dtype), .avg = op == EBB_REDUCE_AVG,
                 .count = (size_t)info.numel, .elem_bytes = ebb_dtype_size(info.dtype)};
  if (pg->device == EBB_DEVICE_CPU && (st = ebb_tensor_data(t, &c.buf))) return st;
  return issue(pg, fn, &c, t, NULL, work);
}

ebb_status ebb_broadcast(ebb_pg_t *pg, ebb_tensor_t *t, int root, ebb_work_t **work) {
  static const char fn[] = "ebb_broadcast";
  ebb_status st = group_usable(pg, fn);
  if (st) return st;
  ebb_tensor_info info;
  if ((st = check_tensor(pg, t, fn, "t", &info))) return st;
  if (root < 0 || root >= pg->size)
    return ebb__fail(EBB_EINVAL, "%s: root %d is not a rank of the group; expected a rank in [0, %d)", fn, root, pg->size);
  dist_call c = {.kind = DIST_BROADCAST, .elem = DIST_ELEM_BYTE, .root = root, .count = (size_t)info.numel,
                 .elem_bytes = ebb_dtype_size(info.dtype)};
  if (pg->device == EBB_DEVICE_CPU && (st = ebb_tensor_data(t, &c.buf))) return st;
  return issue(pg, fn, &c, t, NULL, work);
}

static const char *shape_str(const int64_t *shape, int ndim, char *buf, size_t cap) {
  size_t n = (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < ndim && n < cap; i++) n += (size_t)snprintf(buf + n, cap - n, i ? ", %lld" : "%lld", (long long)shape[i]);
  if (n < cap) snprintf(buf + n, cap - n, "]");
  return buf;
}

ebb_status ebb_all_gather(ebb_pg_t *pg, ebb_tensor_t *out, const ebb_tensor_t *in, ebb_work_t **work) {
  static const char fn[] = "ebb_all_gather";
  ebb_status st = group_usable(pg, fn);
  if (st) return st;
  ebb_tensor_info oi, ii;
  if ((st = check_tensor(pg, in, fn, "in", &ii)) || (st = check_tensor(pg, out, fn, "out", &oi))) return st;
  char desc[EBB__DESC_MAX], want[160];
  int64_t shape[EBB_TENSOR_MAX_DIMS + 1] = {pg->size};
  memcpy(shape + 1, ii.shape, (size_t)ii.ndim * sizeof *shape);
  bool ok = ii.ndim < EBB_TENSOR_MAX_DIMS && oi.ndim == ii.ndim + 1 && oi.dtype == ii.dtype;
  for (int i = 0; ok && i < oi.ndim; i++) ok = oi.shape[i] == shape[i];
  if (ii.ndim >= EBB_TENSOR_MAX_DIMS)
    return ebb__fail(EBB_EINVAL, "%s: %s has %d dims; the output needs one more and tensors have at most %d", fn,
                     ebb__tensor_desc(in, "in", -1, desc, sizeof desc), ii.ndim, EBB_TENSOR_MAX_DIMS);
  if (!ok)
    return ebb__fail(EBB_EINVAL, "%s: %s; expected %s %s (the group's size, %d, then in's shape, in in's dtype)", fn,
                     ebb__tensor_desc(out, "out", -1, desc, sizeof desc), ebb_dtype_name(ii.dtype),
                     shape_str(shape, ii.ndim + 1, want, sizeof want), pg->size);
  bool same = false;
  if ((st = ebb_tensor_same_storage(out, in, &same))) return st;
  if (same && ii.numel > 0)
    return ebb__fail(EBB_EINVAL, "%s: out and in share a storage; expected an output apart from the input", fn);
  dist_call c = {.kind = DIST_ALL_GATHER, .elem = DIST_ELEM_BYTE, .count = (size_t)ii.numel,
                 .elem_bytes = ebb_dtype_size(ii.dtype)};
  if (pg->device == EBB_DEVICE_CPU) {
    void *src;
    if ((st = ebb_tensor_data(out, &c.buf)) || (st = ebb_tensor_data(in, &src))) return st;
    c.src = src;
  }
  return issue(pg, fn, &c, out, in, work);
}

ebb_status ebb_barrier(ebb_pg_t *pg, ebb_work_t **work) {
  static const char fn[] = "ebb_barrier";
  ebb_status st = group_usable(pg, fn);
  if (st) return st;
  dist_call c = {.kind = DIST_BARRIER, .elem = DIST_ELEM_F32, .elem_bytes = 4};
  return issue(pg, fn, &c, NULL, NULL, work);
}
