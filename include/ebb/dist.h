/* ebb/dist.h: process groups and collectives on tensors, over Open MPI or NCCL.
 *
 * A process group is the set of processes (ranks) of one job that reduce, broadcast and gather
 * tensors together: every rank of an `mpirun -np N` job creates one, and gets its rank in
 * [0, N) and the size N. ebb never carries the bytes itself: the MPI backend calls Open MPI
 * (linked at build time; a build without MPI reports the backend unavailable), the NCCL backend
 * calls libnccl.so.2, loaded with dlopen when a group is created (never linked; a machine
 * without it reports the backend unavailable). The NCCL unique id travels from rank 0 to the
 * others over MPI, so both backends run under an MPI launcher.
 *
 * Who initialises MPI: the caller may call MPI_Init_thread itself before creating a group, and
 * must then grant MPI_THREAD_MULTIPLE (each group calls MPI from a communication thread of its
 * own, beside the caller's threads); ebb then never finalises MPI. Otherwise the first group
 * creation initialises MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE), and the last ebb_shutdown
 * finalises it (the one place ebb calls MPI_Finalize). MPI allows one initialisation per process:
 * once ebb finalised it, creating an MPI or NCCL group in that process is EBB_ESTATE. Under Open
 * MPI a process that exits without MPI_Finalize makes mpirun fail the job, so a program that let
 * ebb initialise MPI ends with ebb_shutdown. Loading libebb, ebb_init, and every call of this
 * header other than ebb_pg_create never initialise MPI.
 *
 * Devices: a group is bound to one device, given at creation: EBB_DEVICE_CPU (MPI only) or a
 * device ordinal (MPI on any driver, through pinned host staging; NCCL on CUDA devices only).
 * Every tensor of its collectives must be on that device (EBB_EDEVICE otherwise).
 *
 * Profiling: MPI's pinned staging blocks of a device group are owned by "dist <backend> staging"
 * (EBB_OWNER_STAGING), whatever scope the caller has open; each collective is a span of the
 * engine trace (ebb/trace.h), carrying the owner scope open on the thread that issued it.
 *
 * Order: collectives are matched between ranks by their order of issue, as in MPI. Every rank
 * must create its groups in the same order and issue the same collectives, with the same
 * shapes, dtypes, operations and roots, in the same order on each group. ebb checks what it can
 * see on one rank (arguments, devices, the output's shape); a divergence between ranks is not
 * detected (it hangs or fails inside the backend, or produces wrong values). A group issues its
 * collectives in the order of the calls on it: calls from several threads at once are
 * serialised, but their order is then the order of the calls' entry, which differs between ranks
 * unless the caller orders them.
 *
 * Execution. Each call checks its arguments, enqueues the collective and returns (a work handle
 * tells when it has finished):
 *  - CPU group (MPI): the collective runs on the group's communication thread, one blocking MPI
 *    call at a time in issue order (Open MPI as Debian builds it has no asynchronous progress
 *    thread: a blocking call on a thread of its own is what overlaps with the caller's work).
 *    The tensors are retained until it has run; the caller must not read or write them until
 *    ebb_work_wait (or ebb_work_test answering done) says it has.
 *  - device group: the collective is ordered on the device. Each group has a communication
 *    stream of its device; the call makes it wait (an event, on the device) for the work issued
 *    so far to the caller's current stream of the device, enqueues the collective there, records
 *    an event after it, and makes the caller's current stream wait for that event. So a kernel
 *    that wrote the input before the call is seen, and the caller's work issued after the call
 *    sees the result, with no host wait. MPI on a device: the input is copied into pinned host
 *    memory on the communication stream, a host function of that stream hands it to the
 *    communication thread and holds the stream until the MPI call has finished, and the result
 *    is copied back, all on the communication stream. NCCL: the NCCL call itself on the
 *    communication stream. The tensors' memory is declared used on the communication stream
 *    (ebb_tensor_record_stream), so releasing them right after the call is safe.
 *
 * Handles: a group from ebb_pg_create and a work handle from a collective are owned by the
 * caller, released with ebb_pg_destroy / ebb_work_release. A released handle passed to any call
 * is EBB_EFREED (records are type-stable and reused first-in-first-out only after 1024 more
 * releases, so a stale handle is reported until then). The last ebb_shutdown refuses with
 * EBB_EBUSY while a group or work handle is live.
 * Threading: every function is thread-safe (see Order for collectives issued from several
 * threads). A work handle may be waited for from any thread.
 * Failures: a status and a message naming the call, the argument (a tensor by its dtype, shape
 * and device), what was wrong and what was expected. A collective that fails once enqueued (the
 * backend returns an error, the timeout passes) fails its work handle with the backend's
 * message, and the group with it: every later collective on the group is EBB_ESTATE with that
 * message. So does a driver failure on a device group after the collective took its place in
 * the group's sequence (the call then returns that error and hands out no work handle). A rank that dies: under mpirun, Open MPI ends the whole job and names the rank; ebb
 * never waits for it longer than the group's timeout.
 */
#ifndef EBB_DIST_H
#define EBB_DIST_H

#include <stdbool.h>
#include <stdint.h>

#include "ebb/status.h"
#include "ebb/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ebb_dist_backend {
  EBB_DIST_MPI = 0,  /* Open MPI: CPU tensors and any device (staged through pinned memory) */
  EBB_DIST_NCCL = 1  /* NCCL (libnccl.so.2, dlopen'ed): CUDA devices */
} ebb_dist_backend;

typedef enum ebb_reduce_op {
  EBB_REDUCE_SUM = 0,
  EBB_REDUCE_AVG = 1 /* the sum divided by the group's size, in the tensor's dtype (floating only) */
} ebb_reduce_op;

typedef struct ebb_pg ebb_pg_t;
typedef struct ebb_work ebb_work_t;

/* "mpi", "nccl"; "unknown" outside the enum. Static strings. */
EBB_API const char *ebb_dist_backend_name(ebb_dist_backend b);

/* Whether `backend` can be used in this process: EBB_OK, or EBB_ENOTSUP with a message saying
 * why (a build without MPI; libnccl.so.2 not found or missing a function, with dlerror's text;
 * NCCL with a driver that is not CUDA). Loads libnccl.so.2 for the question (kept loaded); never
 * initialises MPI. EBB_EINVAL for a backend outside the enum; EBB_ENOTINIT before ebb_init. */
EBB_API ebb_status ebb_dist_available(ebb_dist_backend backend);

/* Options of ebb_pg_create. A zero-initialised struct (`ebb_pg_options o = {0};`, or NULL)
 * gives the defaults. `version` is 0 or EBB_PG_OPTIONS_VERSION, both meaning the fields below;
 * a later header may add fields at the end and raise the version, and a library refuses a
 * version newer than it reads (EBB_ENOTSUP) rather than ignore a field. */
#define EBB_PG_OPTIONS_VERSION 1
#define EBB_PG_DEFAULT_TIMEOUT_MS 300000
typedef struct ebb_pg_options {
  uint32_t version;   /* 0 or EBB_PG_OPTIONS_VERSION */
  /* The number of ranks the caller expects: 0 takes the launcher's (MPI_COMM_WORLD's size);
   * any other value must equal it (EBB_EINVAL naming both: a job launched with another -np). */
  int world_size;
  /* How long a collective may take once it is its turn to run, in milliseconds: 0 gives
   * EBB_PG_DEFAULT_TIMEOUT_MS, -1 no limit. Past it ebb_work_wait, a stream held for an MPI
   * call, and ebb_pg_destroy stop waiting: the work and the group fail with EBB_EIO naming the
   * collective and its sequence number (NCCL: the communicator is aborted). MPI cannot cancel a
   * blocking call: its communication thread stays in it, and ebb_pg_destroy then answers
   * EBB_EBUSY (the process should end, or set abort_on_timeout). */
  int timeout_ms;
  /* On a timeout, end the whole job (MPI_Abort on MPI_COMM_WORLD with code 1: mpirun reports
   * the rank) instead of failing the work. Off by default: the library ends no process unasked. */
  bool abort_on_timeout;
} ebb_pg_options;

/* Creates a process group over `backend` spanning every rank of the job (a duplicate of
 * MPI_COMM_WORLD: its traffic never matches the caller's own MPI calls), bound to `device`
 * (EBB_DEVICE_CPU or a device ordinal). Collective over the job: every rank calls it, in the
 * same order among its group creations. Initialises MPI when no one did (see above). Starts the
 * group's communication thread, and for a device its communication stream. NCCL: rank 0 makes
 * the unique id and broadcasts it over MPI; ncclCommInitRank with the device current.
 * *out: a new group owned by the caller (ebb_pg_destroy).
 * Errors: EBB_EINVAL for a NULL out, a backend outside the enum, bad options (a negative
 * world_size, a timeout below -1, a world_size other than the job's); EBB_ENOTSUP for an
 * unavailable backend (ebb_dist_available's message), a newer options version, NCCL on the CPU,
 * or an MPI that grants less than MPI_THREAD_MULTIPLE; EBB_EDEVICE for no such device;
 * EBB_ESTATE after MPI was finalised; EBB_EIO when MPI or NCCL fail (their error text);
 * EBB_ENOTINIT before ebb_init. On failure nothing is left (MPI stays initialised). */
EBB_API ebb_status ebb_pg_create(ebb_dist_backend backend, int device, const ebb_pg_options *opts, ebb_pg_t **out);

/* Waits for the group's enqueued collectives (each at most the timeout), stops its
 * communication thread, frees its communicator (MPI_Comm_free; NCCL: ncclCommDestroy, or
 * ncclCommAbort when failed) and its stream, and releases the handle. Work handles of the group
 * stay valid (done, or failed) until released. Collective over the job like creation when the
 * group is healthy (MPI_Comm_free). EBB_EINVAL for NULL, EBB_EFREED for a released group,
 * EBB_EBUSY when an MPI call of the group is still blocked past the timeout (nothing released:
 * see ebb_pg_options.timeout_ms); a collective that failed does not fail the destroy. */
EBB_API ebb_status ebb_pg_destroy(ebb_pg_t *pg);

/* This process's rank in [0, size), the number of ranks, the group's device and backend.
 * EBB_EINVAL for NULL, EBB_EFREED for a released group. */
EBB_API ebb_status ebb_pg_rank(const ebb_pg_t *pg, int *rank);
EBB_API ebb_status ebb_pg_size(const ebb_pg_t *pg, int *size);
EBB_API ebb_status ebb_pg_device(const ebb_pg_t *pg, int *device);
EBB_API ebb_status ebb_pg_backend(const ebb_pg_t *pg, ebb_dist_backend *backend);

/* ---- collectives -----------------------------------------------------------------------------
 * Common to all: `pg` is live and healthy (a failed group is EBB_ESTATE with its first error);
 * every tensor is live (EBB_EFREED), on the group's device (EBB_EDEVICE naming both) and
 * contiguous (EBB_EINVAL: make a contiguous copy with ebb_tensor_contiguous and copy back).
 * `work`, when not NULL, receives a new work handle (ebb_work_wait / ebb_work_test /
 * ebb_work_release). With work NULL the call on a CPU group is blocking: it returns once the
 * collective has run, with its status; on a device group it returns once enqueued (the
 * caller's current stream is ordered after it anyway), and a failure once enqueued shows only
 * as the group's failure. On any failure nothing is enqueued and *work is not written.
 * Sizes: dtypes as MPI carries them (all-reduce: f32, f64, i64, and bf16/f16 on NCCL only; the
 * others move any dtype as bytes); a tensor of 0 elements is a valid, empty collective. */

/* Replaces `t` on every rank with the element-wise sum (or average) of `t` over the ranks.
 * EBB_EINVAL for AVG on i64 and for bool; EBB_ENOTSUP for bf16/f16 on MPI. */
EBB_API ebb_status ebb_all_reduce(ebb_pg_t *pg, ebb_tensor_t *t, ebb_reduce_op op, ebb_work_t **work);
/* Replaces `t` on every rank with rank `root`'s `t`. EBB_EINVAL for a root outside [0, size). */
EBB_API ebb_status ebb_broadcast(ebb_pg_t *pg, ebb_tensor_t *t, int root, ebb_work_t **work);
/* Writes every rank's `in` into `out`, which has shape [size, in's shape...] and in's dtype:
 * out[r] is rank r's `in`. `in` is only read. EBB_EINVAL for another shape or dtype (naming the
 * shape expected) and for `out` sharing in's storage. */
EBB_API ebb_status ebb_all_gather(ebb_pg_t *pg, ebb_tensor_t *out, const ebb_tensor_t *in, ebb_work_t **work);
/* Completes on every rank once every rank has issued it (and, on a device group, once each
 * rank's current stream has reached it). */
EBB_API ebb_status ebb_barrier(ebb_pg_t *pg, ebb_work_t **work);

/* ---- work handles ----------------------------------------------------------------------------
 * A work handle says when one collective has finished: for a CPU group when its MPI call has
 * returned; for a device group when its communication stream has passed it (the result is in
 * device memory). Waiting is never needed for ordering on a device (the caller's current stream
 * waits already); it is for the host. */

/* Blocks until the collective has finished, at most the group's timeout past the moment it
 * began to run. Returns its status: EBB_OK, or the error it failed with (EBB_EIO and the
 * backend's message, or the timeout's). May be called several times and from several threads.
 * EBB_EINVAL for NULL, EBB_EFREED for a released handle. Must not be called from a host
 * function of a stream (ebb_stream_host_func): EBB_ESTATE. */
EBB_API ebb_status ebb_work_wait(ebb_work_t *w);
/* Non-blocking: *done true once the collective has finished (successfully or not: then
 * ebb_work_wait returns its status at once). EBB_EINVAL for NULL, EBB_EFREED for released. */
EBB_API ebb_status ebb_work_test(ebb_work_t *w, bool *done);
/* Releases the handle; the collective goes on and finishes whether or not a handle watches it.
 * EBB_EINVAL for NULL, EBB_EFREED for a released handle. */
EBB_API ebb_status ebb_work_release(ebb_work_t *w);

#ifdef __cplusplus
}
#endif
#endif /* EBB_DIST_H */
