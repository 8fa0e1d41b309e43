/* fault_workload.c: a small training-like program written from ebb's public headers alone, run by
 * fault_sweep.c with one injected driver fault (EBB_SIM_FAULT). It trains a two-layer MLP
 * data-parallel on devices 0 and 1 (forward and backward on each, device 1's gradients copied to
 * device 0 and averaged there), copies through pinned memory and between the devices on created
 * streams, and reads results back asynchronously into pinned memory.
 *
 * Each call is checked. The first failing call ends the run: the program prints
 * "FAIL <call> <status>: <message>", releases everything it holds, calls ebb_shutdown and exits 3.
 * A call that succeeds must leave ebb_last_error() as it was (a sentinel error is set before
 * ebb_init): otherwise it prints "LASTERR <call>: <message>", goes on, and exits 4 (3 if a later
 * call fails). A run to the end prints
 * "RESULT <hex>" (the losses and final weights, bit for bit), releases everything and exits 0.
 * A failed shutdown after everything was released exits 5. Every run ends with "CALLS <n> FIRED
 * <k>": the emulated driver's fault counters after shutdown (the calls counted, the faults that
 * fired), so the sweep knows a failure came from its fault.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ebb/ebb.h"

enum { IN = 8, HID = 16, OUT = 4, BATCH = 32, STEPS = 3, MAXH = 256 };

static char sentinel[512];
static bool lasterr_seen;
static ebb_tensor_t *tensors[MAXH];
static int ntensors;
static void *pinned[8];
static int npinned;
static void *blocks[8];
static int nblocks;
static ebb_stream_t *streams[4];
static int nstreams;
static ebb_event_t *events[4];
static int nevents;

static void release_all(void) {
  for (int i = 0; i < ntensors; i++)
    if (tensors[i]) ebb_tensor_release(tensors[i]);
  for (int i = 0; i < nblocks; i++) ebb_arena_free(blocks[i]);
  for (int i = 0; i < npinned; i++) ebb_pinned_free(pinned[i]);
  for (int i = 0; i < nevents; i++) ebb_event_release(events[i]);
  for (int i = 0; i < nstreams; i++) ebb_stream_release(streams[i]);
  ntensors = nblocks = npinned = nevents = nstreams = 0;
}

/* Prints the emulated driver's fault counters, read after everything ran, shutdown included
 * (absent on another driver: FIRED -1). */
static void print_counts(void) {
  unsigned long long calls = 0;
  int fired = -1;
  const char *path = getenv("EBB_SIMDRV_PATH");
  void *sim = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
  if (sim) {
    void (*counts)(unsigned long long *, int *); /* the emulated driver's ebbsim_fault_counts */
    *(void **)&counts = dlsym(sim, "ebbsim_fault_counts");
    if (counts) counts(&calls, &fired);
    dlclose(sim);
  }
  printf("CALLS %llu FIRED %d\n", calls, fired);
}

static void finish(int code) {
  release_all();
  ebb_status st = ebb_shutdown();
  if (st != EBB_OK && ebb_is_initialized()) {
    printf("SHUTDOWN %s: %s\n", ebb_status_name(st), ebb_last_error());
    code = 5;
  }
  print_counts();
  fflush(stdout);
  exit(code == 0 && lasterr_seen ? 4 : code);
}

/* Sets the thread's last error to the sentinel's text (a call that fails the same way). */
static void set_sentinel(void) {
  ebb_dev_caps caps;
  if (ebb_dev_get_caps(-7, &caps) == EBB_OK) exit(2);
  snprintf(sentinel, sizeof sentinel, "%s", ebb_last_error());
}

/* A successful call that changed the last error is reported at once and the run goes on (its
 * handles still to be released); the exit code says it. */
static void check(ebb_status st, const char *call) {
  if (st != EBB_OK) {
    printf("FAIL %s %s: %s\n", call, ebb_status_name(st), ebb_last_error());
    finish(3);
  }
  if (strcmp(ebb_last_error(), sentinel) != 0) {
    printf("LASTERR %s: %s\n", call, ebb_last_error());
    lasterr_seen = true;
    set_sentinel();
  }
}

#define CALL(expr) check((expr), #expr)

/* Keeps a tensor for release_all; returns it. */
static ebb_tensor_t *keep(ebb_tensor_t *t) {
  if (ntensors == MAXH) {
    printf("FAIL keep: more than %d tensors\n", MAXH);
    finish(6);
  }
  tensors[ntensors++] = t;
  return t;
}

/* Releases the tensors kept since mark. */
static void drop_since(int mark) {
  for (int i = mark; i < ntensors; i++) CALL(ebb_tensor_release(tensors[i]));
  ntensors = mark;
}

static ebb_tensor_t *from_host(int dev, int rows, int cols, const float *v) {
  int64_t shape[2] = {rows, cols};
  ebb_tensor_t *t = NULL;
  CALL(ebb_tensor_from_host(dev, EBB_F32, 2, shape, v, sizeof(float) * (size_t)rows * (size_t)cols, &t));
  return keep(t);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

int main(void) {
  /* The sentinel: an error set before ebb_init, which every later successful call leaves alone. */
  set_sentinel();
  CALL(ebb_init());
  int ndev = 0;
  CALL(ebb_dev_count(&ndev));
  if (ndev < 2) {
    printf("FAIL setup: %d device(s); expected 2 (EBB_SIM_DEVICES=2)\n", ndev);
    finish(6);
  }

  /* Deterministic data: weights shared by both devices, each device its half of the batch. */
  static float w1[IN * HID], w2[HID * OUT], x[2][BATCH * IN], y[2][BATCH * OUT];
  uint32_t seed = 12345;
#define RNDF() ((float)((seed = seed * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f)
  for (int i = 0; i < IN * HID; i++) w1[i] = RNDF();
  for (int i = 0; i < HID * OUT; i++) w2[i] = RNDF();
  for (int d = 0; d < 2; d++) {
    for (int i = 0; i < BATCH * IN; i++) x[d][i] = RNDF();
    for (int i = 0; i < BATCH * OUT; i++) y[d][i] = RNDF();
  }

  /* Streams, events and pinned memory. */
  for (int d = 0; d < 2; d++) CALL(ebb_stream_create(d, EBB_PRIO_LOW, &streams[nstreams++]));
  for (int d = 0; d < 2; d++) CALL(ebb_event_create(d, EBB_EVENT_DEFAULT, &events[nevents++]));
  const size_t nbytes = 64 * 1024;
  CALL(ebb_pinned_alloc(nbytes, 0, &pinned[npinned++]));
  CALL(ebb_pinned_alloc(nbytes, 1, &pinned[npinned++]));
  CALL(ebb_pinned_alloc(1000, 0, &pinned[npinned++]));
  CALL(ebb_pinned_free(pinned[--npinned])); /* cached, then reused below */
  CALL(ebb_pinned_alloc(900, 0, &pinned[npinned++]));

  /* Copies: pinned -> device 0 -> device 1 -> pinned, on created streams, ordered by an event. */
  unsigned char *src = pinned[0], *back = pinned[1];
  for (size_t i = 0; i < nbytes; i++) src[i] = (unsigned char)(i * 7 + 3);
  memset(back, 0, nbytes);
  CALL(ebb_arena_alloc(0, nbytes, streams[0], &blocks[nblocks++]));
  CALL(ebb_arena_alloc(1, nbytes, streams[1], &blocks[nblocks++]));
  CALL(ebb_copy_async(blocks[0], src, nbytes, streams[0]));
  CALL(ebb_pinned_record_stream(src, streams[0]));
  CALL(ebb_event_record(events[0], streams[0]));
  CALL(ebb_event_wait(events[0], streams[1]));
  CALL(ebb_copy_async(blocks[1], blocks[0], nbytes, streams[1]));
  CALL(ebb_copy_async(back, blocks[1], nbytes, streams[1]));
  CALL(ebb_event_record(events[1], streams[1]));
  CALL(ebb_event_synchronize(events[1]));
  uint64_t h = 1469598103934665603ull;
  h = fnv(h, back, nbytes);
  CALL(ebb_arena_free(blocks[--nblocks]));
  CALL(ebb_arena_free(blocks[--nblocks]));

  /* Training: data parallel over the two devices, averaged on device 0. */
  const float lr = 0.1f;
  float losses[STEPS][2];
  for (int step = 0; step < STEPS; step++) {
    int mark = ntensors;
    ebb_tensor_t *g[2][2] = {{NULL, NULL}, {NULL, NULL}};
    for (int d = 0; d < 2; d++) {
      ebb_tensor_t *a = from_host(d, IN, HID, w1), *b = from_host(d, HID, OUT, w2);
      CALL(ebb_tensor_set_requires_grad(a, true));
      CALL(ebb_tensor_set_requires_grad(b, true));
      ebb_tensor_t *xd = from_host(d, BATCH, IN, x[d]), *yd = from_host(d, BATCH, OUT, y[d]);
      ebb_tensor_t *t = NULL;
      CALL(ebb_op_matmul(xd, a, &t));
      ebb_tensor_t *hdn = keep(t);
      CALL(ebb_op_relu(hdn, &t));
      ebb_tensor_t *act = keep(t);
      CALL(ebb_op_matmul(act, b, &t));
      ebb_tensor_t *out = keep(t);
      CALL(ebb_op_mse_loss(out, yd, &t));
      ebb_tensor_t *loss = keep(t);
      const ebb_tensor_t *root = loss;
      CALL(ebb_backward(&root, NULL, 1, false, NULL, 0));
      float lv = 0;
      CALL(ebb_tensor_to_host(loss, &lv, sizeof lv));
      losses[step][d] = lv;
      CALL(ebb_tensor_grad(a, &t));
      g[d][0] = keep(t);
      CALL(ebb_tensor_grad(b, &t));
      g[d][1] = keep(t);
    }
    /* Device 1's gradients to device 0, averaged there, read back through pinned memory. */
    for (int k = 0; k < 2; k++) {
      ebb_tensor_t *moved = NULL, *sum = NULL, *avg = NULL;
      CALL(ebb_tensor_to_device(g[1][k], 0, &moved));
      keep(moved);
      CALL(ebb_op_add(g[0][k], moved, &sum));
      keep(sum);
      CALL(ebb_op_mul_scalar(sum, 0.5, &avg));
      keep(avg);
      float *w = k == 0 ? w1 : w2;
      size_t n = k == 0 ? (size_t)IN * HID : (size_t)HID * OUT;
      float *gh = pinned[2];
      CALL(ebb_tensor_to_host_async(avg, gh, n * sizeof(float), events[0]));
      CALL(ebb_event_synchronize(events[0]));
      for (size_t i = 0; i < n; i++) w[i] -= lr * gh[i];
    }
    drop_since(mark);
  }
  h = fnv(h, losses, sizeof losses);
  h = fnv(h, w1, sizeof w1);
  h = fnv(h, w2, sizeof w2);
  printf("RESULT %016llx\n", (unsigned long long)h);

  finish(0);
  return 0;
}
