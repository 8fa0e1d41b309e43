/* engine_impl.h: what engine.c and inbuf.c share: the graph task and its nodes, and each file's
 * functions for the other. Grouped by provider. Not for the rest of autograd (autograd_impl.h). */
#ifndef EBB_ENGINE_IMPL_H
#define EBB_ENGINE_IMPL_H

#include "autograd_impl.h"
#include "ebb/stream.h"

/* A stream as the engine keeps it: handle, id (0: none, a CPU node or slot) and device. */
struct ebb__sref {
  ebb_stream_t *s;
  uint64_t id;
  int dev;
};

/* The stream state of one input slot holding a device gradient (spec: InputBuffer). */
struct ebb__slot {
  struct ebb__sref accum; /* where sums into the slot are made; id 0: no gradient yet */
  struct ebb__sref ready; /* the stream on which the slot's value is complete */
  ebb_event_t *ev;        /* recorded on `ready` when ev_ok, else to record before a wait */
  int ev_dev;
  bool ev_ok;
  /* The slot's tensor was handed to consumers on other streams too (a producer returning one
   * tensor for several inputs, as AddBackward does): their reads may still be pending there, so
   * it is never written in place (no sum into it, no backward computed in it) however alone it
   * looks by count once they let it go. */
  bool shared;
};

/* One node of the task. Task nodes live in one array and are named by their index: the array
 * grows while the graph is found, and indices survive that where pointers would not. */
struct ebb__tnode {
  struct ebb_node *n;
  int deps;             /* incoming edges from nodes of the task not yet run */
  int edge0;            /* its next edges' task indices start at task.edges[edge0] (-1: none) */
  bool needed;          /* runs (or, for a capture-only node, is reached) */
  bool run;             /* its backward runs (else only captured) */
  int capture;          /* index of the input whose gradient this is (+1), 0: none; for its input_nr */
  int capture_nr;
  ebb_tensor_t *buf_inline[2]; /* summed gradients of its outputs, for up to two (AccumulateGrad: [0]) */
  ebb_tensor_t **buf_heap;     /* the same for a node of more outputs, allocated on first use */
  int dev;                     /* its device (EBB_DEVICE_CPU: the owner's queue) */
  struct ebb__sref sr;         /* the stream it runs on (id 0: none) */
  struct ebb__slot *sync;      /* [nbufs]: stream state of its slots, made at the first device gradient */
  /* AccumulateGrad: the stream mismatch seen by its slot (the first producer on another stream);
   * the id of the stream recorded on the node when the task started (which `sr` is not when that
   * stream was released since), which a follow-producer move replaces; whether it follows. */
  struct ebb__sref mism;
  const struct ebb_node *mism_by;
  uint64_t recorded_id;
  bool follows;
};

struct ebb__task {
  const char *fn;
  struct ebb__tnode *nodes; /* [count] of cap */
  size_t cap, count;
  int *hash;                /* open addressing on the node's address: index + 1, 0 empty */
  size_t hcap;
  int *edges;               /* the next edges of every task node, as task indices (-1: not in the task) */
  size_t nedges, capedges;
  struct ebb_node **held;   /* references the task took (nodes found from its inputs), dropped at its end */
  size_t nheld, capheld;
  ebb_tensor_t **results;   /* ebb_grad: [ninputs]; NULL: ebb_backward, whose non-leaf inputs get .grad */
  const ebb_tensor_t *const *inputs;
  bool retain;
  /* Streams: the caller's current stream per device at the start ([ndev], made when the task
   * has a device node), and the streams that accumulated a .grad or captured a result. */
  struct ebb__sref *caller;
  int ndev;
  struct ebb__sref *leaves;
  size_t nleaves, capleaves;
  /* The streams the task holds (ebb__stream_hold) from its start to its end: its nodes' and the
   * caller's current ones, so a release asked meanwhile (a hook's, another thread's) is carried
   * out after it and never fails one of its steps; the last one taken, for the next node's
   * quick check. */
  struct ebb__sref *holds;
  size_t nholds, capholds;
  uint64_t last_held;
  /* The .grad fields written so far (a leaf's or an input's tensor; NULL with the node of a
   * retained non-leaf), for the message of a backward that fails after writing some. */
  struct ebb__wrote {
    const ebb_tensor_t *t;
    const struct ebb_node *of;
  } *wrote;
  size_t nwrote, capwrote;
  /* Shared tasks (device workers run some of its nodes). */
  bool shared;
  uint32_t depth;            /* reentrant depth of the call: queue order */
  ebb_mutex mu;              /* deliveries: buffers, dependency counts, pushes; the leaf list; the error */
  _Atomic long outstanding;  /* nodes queued or running */
  _Atomic bool failed;
  ebb_status err;            /* the first error, its message and where it ran */
  char errmsg[1024];
  struct ebb__queue *cpuq;   /* where its CPU nodes go: the owner's queue */
  struct ebb__task_scope *scope;
  const void *hooks;         /* the caller's saved-tensor hook stack, for the threads running its nodes (saved.c) */
  struct ebb__heap *ready;   /* a task on the calling thread: its ready nodes */
  struct ebb__offl_plan *offl; /* the reloads of its offloaded saved tensors (offload.c), NULL: none */
  /* The trace's flows not yet ended: a gradient that crossed devices to node `to` (a task index);
   * its consumer's span ends them. Under mu when shared; only while tracing. */
  struct ebb__tflow {
    uint64_t id;
    int to;
  } *flows;
  size_t nflows, capflows;
  _Atomic uint64_t n_nodes, n_nodes_w, n_xedges, n_events, n_waits, n_mism; /* counters, added to the totals at the end */
};

/* The input buffer of task node x: one slot per output (AccumulateGrad: one); NULL when x has
 * more than two outputs and none has a gradient yet. */
static inline ebb_tensor_t **ebb__bufs(struct ebb__tnode *x) { return x->n->nout > 2 ? x->buf_heap : x->buf_inline; }
static inline int ebb__nbufs(const struct ebb__tnode *x) { return x->n->nout > 0 ? x->n->nout : 1; }

/* ---- engine.c ---------------------------------------------------------------------------------- */
enum { EBB__S_CALLS, EBB__S_NODES, EBB__S_NODES_W, EBB__S_XEDGES, EBB__S_EVENTS, EBB__S_WAITS, EBB__S_MISM, EBB__S_WARNS,
       EBB__S_FOLLOWED, EBB__S_REENTRANT, EBB__S_HANDOFFS, EBB__S_PARKS, EBB__S_COUNT };
/* Adds n to engine counter k (ebb_autograd_get_engine_stats). */
EBB_HIDDEN void ebb__count(int k, uint64_t n);
/* The task index of node n, or -1. */
EBB_HIDDEN int ebb__tfind(const struct ebb__task *t, const struct ebb_node *n);

/* ---- inbuf.c ------------------------------------------------------------------------------------ */
/* Each needed node's device and stream, the caller's current streams, the devices touched. */
EBB_HIDDEN ebb_status ebb__task_streams(struct ebb__task *t, int *ndevs);
/* The device of x's slot k (where its gradient lives). */
EBB_HIDDEN int ebb__slot_dev(const struct ebb__tnode *x, int k);
/* Adds g (consumed) into slot k of x, produced on stream prod by pn (NULL: a root); shared: g was
 * handed to consumers on other streams too (never written in place). */
EBB_HIDDEN ebb_status ebb__buf_add(struct ebb__task *t, struct ebb__tnode *x, int k, ebb_tensor_t *g, const struct ebb__sref *prod,
                                   const struct ebb_node *pn, bool shared);
/* x's stream waits for its slots' values, before it runs. */
EBB_HIDDEN ebb_status ebb__consume_waits(struct ebb__task *t, struct ebb__tnode *x);
/* x's stream wrote something the caller reads: the caller's stream waits for it at the end. */
EBB_HIDDEN ebb_status ebb__leaf_stream(struct ebb__task *t, const struct ebb__tnode *x);
/* AccumulateGrad x runs: its follow-producer move made permanent, or the mismatch warning. */
EBB_HIDDEN void ebb__acc_stream(struct ebb__task *t, const struct ebb__tnode *x);
/* The leaf's .grad updated (AccumulateGrad), and a non-leaf's (ebb_backward's inputs, retain_grad). */
EBB_HIDDEN ebb_status ebb__accumulate(struct ebb__task *t, const struct ebb__tnode *x, ebb_tensor_t **g);
EBB_HIDDEN ebb_status ebb__accumulate_into(struct ebb__task *t, const struct ebb__tnode *x, struct ebb__meta *m, const ebb_tensor_t *g);
/* The caller's current streams wait for the leaf streams. */
EBB_HIDDEN ebb_status ebb__end_sync(struct ebb__task *t);
/* The streams the task held, let go (a release asked meanwhile is carried out here). */
EBB_HIDDEN void ebb__task_unhold(struct ebb__task *t);
/* A .grad written by the task (t: the leaf or input tensor; NULL with `of`, a retained output
 * of that node); under the task's lock when shared. */
EBB_HIDDEN ebb_status ebb__task_wrote(struct ebb__task *t, const ebb_tensor_t *tensor, const struct ebb_node *of);
/* Appends to msg (of size n) which .grad fields the task wrote: for the message of a failure. */
EBB_HIDDEN void ebb__task_wrote_describe(const struct ebb__task *t, char *msg, size_t n);
/* Makes r current (a guard) when it is a live stream; leave with the answer. */
EBB_HIDDEN bool ebb__enter(ebb_stream_guard *g, const struct ebb__sref *r);
EBB_HIDDEN void ebb__leave(ebb_stream_guard *g, bool entered);
/* Gives back an event of the engine's own (NULL: nothing). */
EBB_HIDDEN void ebb__ev_free(ebb_event_t *e);
/* The module stops: the warn-once set goes. */
EBB_HIDDEN void ebb__inbuf_stop(void);

#endif /* EBB_ENGINE_IMPL_H */
