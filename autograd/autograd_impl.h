/* autograd_impl.h: what the files of autograd share: the node and the per-tensor meta, and
 * each file's functions for the others. */
#ifndef EBB_AUTOGRAD_IMPL_H
#define EBB_AUTOGRAD_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ebb/autograd.h"
#include "ebb_sync.h"
#include "ops_export.h"

#define EBB__NODE_MAGIC 0x65626e64u /* "ebnd" */
#define EBB__ACC_SEQ UINT64_MAX
/* The op of a custom function's node (ebb/function.h): past the derivative table, whose entries
 * it has none of; n->fnrec says what it is. */
#define EBB__OP_FUNCTION ((int)EBB__OP_COUNT)

/* Edge i of a node (its owner, the consumer): where input i's gradient goes. Linked, while the
 * owner lives, into the consumer list of the node it points at, so a partial backward can walk
 * from its inputs up to the roots instead of over the whole graph. */
struct ebb__edge {
  struct ebb_node *fn;     /* strong; NULL: the input needs no gradient */
  int input_nr;
  struct ebb_node *owner;  /* the node this edge belongs to, set when linked; NULL: not linked */
  struct ebb__edge *cnext; /* fn's consumer list (under fn's consumer lock) */
  struct ebb__edge **cpprev; /* (under fn's consumer lock) */
};

struct ebb_node {
  uint32_t magic;
  _Atomic long refs;
  uint64_t seq;
  int op;                    /* ebb__op_id; -1: AccumulateGrad */
  int nin, nout;
  ebb__op_args args;
  ebb__tensor_meta *in_meta; /* [nin] */
  struct ebb__saved *saved;  /* [nin + nout]: what the table's entry saves (saved.c), else NULL */
  struct ebb__edge *next;    /* [nin] */
  ebb_tensor_t *leaf;        /* AccumulateGrad: the leaf's handle (strong) */
  _Atomic bool freed_saved;  /* a backward without retain_graph released the saved tensors */
  _Atomic(struct ebb__hook *) hooks; /* tensor hooks of its outputs (non-leaf tensors), and the node's own pre/post
                                hooks, appended under ebb__hook_mu (a release store: the engine walks it unlocked) */
  struct ebb__edge *consumers; /* edges of live nodes that point here, under its consumer lock */
  /* node_api.c. in_meta has nin + nout entries: [nin + k] is output k's (the node's input k). */
  uint64_t stream_id;        /* the outputs' device's current stream when recorded (0: CPU) */
  struct ebb__kv *kv;        /* user metadata, under node_api.c's lock */
  _Atomic bool has_node_hooks; /* a pre- or post-hook was registered (the engine's fast check) */
  ebb__view_geom *geom;      /* AS_STRIDED, COPY_SLICES: where the view lies (owned; args.geom) */
  _Atomic uint64_t saved_owned; /* bit k: saved[k]'s block is counted as saved by a node (owners.c; bits of
                                   different slots may change on different threads at once) */
  /* engine.c: the stream its backward runs on (stream_id's handle; NULL with id 0: none
   * recorded). An AccumulateGrad's may move to its producer's (follow-producer policy): read
   * and written through ebb__node_stream / ebb__node_stream_move. */
  ebb_stream_t *stream;
  _Atomic long edge_handles; /* ebb_gradient_edge handles on it (for the stream-mismatch warning) */
  int nsaved;                /* saved's entries: nin + nout for an op's node, what the ctx saved for a function's */
  struct ebb__fnrec *fnrec;  /* a custom function's node (op EBB__OP_FUNCTION): its definition and ctx (function.c) */
};

/* One tensor a node saved for its backward (saved.c). While the node holds it, exactly one of
 * `t` and `packed` is set; both NULL: nothing saved there, or released. Written by the thread
 * that records the node; read and released under the engine's saved lock of the node. */
struct ebb__saved {
  ebb_tensor_t *t;             /* the data: a slot-less handle on its storage (no hooks were on) */
  struct ebb__packed *packed;  /* what a pack hook made of it (reference counted: a backward
                                * unpacking it holds one while the unpack hook runs) */
  uint64_t version;            /* t's storage's version when saved (checked at unpack; t only) */
  struct ebb__mut *mut;        /* saved inside an allow-mutation scope: its record there (mutation.c), else NULL */
};

struct ebb__meta {
  bool requires_grad;
  struct ebb_node *grad_fn; /* strong; NULL for a leaf */
  int output_nr;
  struct ebb_node *grad_acc; /* a leaf's AccumulateGrad: weak, cleared when it goes */
  ebb_mutex grad_mu;         /* .grad's updates (rank EBB_RANK_AG_GRAD: held across ops) */
  ebb_tensor_t *grad;        /* .grad: owned, NULL until a backward reaches it */
  _Atomic(struct ebb__hook *) hooks; /* a leaf's tensor and post-accumulate hooks, as a node's */
  struct ebb__hook *retain;  /* a non-leaf's retain_grad hook (in its grad_fn's list), or NULL */
  /* A view (ebb__tensor_base non-NULL) whose grad_fn derives from its base's history: valid
   * while the storage's version is view_version; an in-place change through the base or any of
   * its views makes it stale, and the next read takes it again from the base (inplace.c).
   * Release store after grad_fn is replaced, acquire load before it is read without the lock. */
  bool is_view;
  /* A view a custom function returned (an input returned as-is, or a view of one): the
   * function's name. Its history must not be rebuilt from its base (that would drop the
   * function's backward): an in-place op on it, or a use after its base changed, is refused. */
  const char *fn_view;
  _Atomic uint64_t view_version;
  const char *grad_owner;    /* a leaf's gradient's owner name, interned (owners.c), under grad_mu */
  uint64_t uid;              /* never reused: names the leaf in the stream-mismatch warning's once-set */
  /* engine.c, under grad_mu: the stream a backward last wrote .grad on (id 0: none known, as
   * after ebb_tensor_set_grad). A backward writing it on another stream waits for that one first. */
  ebb_stream_t *grad_stream;
  uint64_t grad_stream_id;
  int grad_stream_dev;
};

/* A registered hook (hooks.c). Lists are kept in registration order; a removed hook stays in its
 * list (marked) until its owner goes, so a backward walking the list never meets freed memory. */
enum { EBB__HOOK_TENSOR = 0, EBB__HOOK_POST_ACC = 1, EBB__HOOK_RETAIN = 2, EBB__HOOK_NODE_PRE = 3, EBB__HOOK_NODE_POST = 4,
       EBB__HOOK_GROUP = 5 /* one handle over other hooks (multi-grad, logging): in no list */ };
struct ebb__hook {
  uint64_t id;
  int kind;
  int output_nr;            /* tensor hooks on a node: the output they watch */
  ebb_tensor_hook_fn fn;
  ebb_post_accumulate_hook_fn post;
  void *user;
  _Atomic bool removed;     /* read by a backward without the lock; removal may come from another thread */
  _Atomic(struct ebb__hook *) next; /* set once, by a release store (a backward walks the list unlocked) */
  ebb_node_pre_hook_fn pre;   /* EBB__HOOK_NODE_PRE */
  ebb_node_post_hook_fn npost; /* EBB__HOOK_NODE_POST */
  void (*user_free)(void *user); /* when the hook struct is freed (its owner goes, or a group is removed) */
  void (*on_remove)(void *user); /* EBB__HOOK_GROUP: removes its members (no lock held) */
  bool internal;                 /* a hook of autograd's own (a multi-grad member), not the user's code */
};

/* Around a user's callback the engine runs (tensor, node, post-accumulate, multi-grad hooks):
 * the calls it makes are the user's, failing as any call does (that thread's last error, the
 * error hook), not diverted into the backward's one failure (ebb__fail_divert); leave gives the
 * backward's message what the callback failed with: the message its calls left, else the status
 * it returned. */
struct ebb__user_call {
  char *div;
  uint64_t serial;
};
static inline void ebb__user_enter(struct ebb__user_call *u) {
  u->div = ebb__fail_divert(NULL);
  u->serial = ebb__fail_serial();
}
EBB_HIDDEN void ebb__user_leave(const struct ebb__user_call *u, ebb_status st);

/* hooks.c */
/* retain_grad's write: gradient g into non-leaf m's .grad (a copy the first time, then summed in
 * place), by the engine, which knows the stream it is written on (engine.c: ordered after .grad's
 * last write, and waited for by the caller's streams at the end of the backward). */
typedef ebb_status (*ebb__retain_write_fn)(void *ctx, struct ebb__meta *m, const ebb_tensor_t *g);
/* Runs the tensor hooks of list `h` that watch output `output_nr` on *grad, which a hook may
 * replace (a new reference, checked against the old one's shape, dtype and device), then its
 * retain_grad hooks through `retain` (with ctx); `who` names the node for messages. Called by the
 * engine with no lock held. */
EBB_HIDDEN ebb_status ebb__run_tensor_hooks(const char *fn, const char *who, struct ebb__hook *h, int output_nr, ebb_tensor_t **grad,
                                            ebb__retain_write_fn retain, void *ctx);
/* Runs the post-accumulate hooks of a leaf (meta m, handle t). */
EBB_HIDDEN ebb_status ebb__run_post_acc_hooks(const char *fn, struct ebb__hook *h, const ebb_tensor_t *t);
/* Ends a non-leaf's retain_grad hook as its meta goes (the hook stays in the node's list,
 * marked removed, never reading the meta again). */
EBB_HIDDEN void ebb__retain_end(struct ebb__meta *m);
/* Frees a hook list (its owner is going): the hooks leave the registry, so their handles read as
 * removed. */
EBB_HIDDEN void ebb__hooks_free(struct ebb__hook *h);


/* Adds hook h (kind, functions and user set; id and link filled here) to the registry and to the
 * end of *list (NULL: a group, in the registry only); its id in *id. EBB_ENOMEM (message naming
 * fn) without memory, h then not taken. */
EBB_HIDDEN ebb_status ebb__hook_attach(const char *fn, _Atomic(struct ebb__hook *) *list, struct ebb__hook *h, uint64_t *id);
/* The tensor-hook registration of ebb_tensor_register_hook with a destructor for user. */
EBB_HIDDEN ebb_status ebb__tensor_hook_add(const char *fn, ebb_tensor_t *t, ebb_tensor_hook_fn f, void *user,
                                           void (*user_free)(void *), uint64_t *id);
/* Removes the hook with id `id` if still registered (no message either way): true if it was. */
EBB_HIDDEN bool ebb__hook_remove_id(uint64_t id);

/* node_api.c */
/* What the engine tells node_api.c about a running graph task. The scope lives on the stack of
 * the call that runs the task; `task` is the engine's, for ebb__task_will_execute. */
struct ebb__task_scope {
  int64_t id;
  const struct ebb__task *task;
  struct ebb__task_scope *outer; /* the task this thread ran before (reentrant backward) */
  struct ebb_node *outer_node;
  struct ebb__mg_state *mg;      /* multi-grad states of this task, under node_api.c's lock */
};
EBB_HIDDEN void ebb__task_begin(struct ebb__task_scope *s, const struct ebb__task *task);
/* Ends the scope: fires the incomplete multi-grad "all" states when ok, drops them otherwise. */
EBB_HIDDEN ebb_status ebb__task_end(struct ebb__task_scope *s, bool ok);
/* Makes s the calling thread's current task (a worker about to run one of its nodes); returns
 * the previous one, to restore. */
EBB_HIDDEN struct ebb__task_scope *ebb__task_switch(struct ebb__task_scope *s);
/* Whether the graph task running on this thread keeps its saved tensors (retain_graph); false
 * outside a backward. For a node that keeps graphs of its own (map.c): it frees them as the
 * engine frees saved tensors. */
EBB_HIDDEN bool ebb__current_task_retains(void);
/* engine.c, for it: whether task t keeps the saved tensors of the nodes it runs. */
EBB_HIDDEN bool ebb__task_retains(const struct ebb__task *t);
/* The node being evaluated on this thread; returns the previous one, to restore. */
EBB_HIDDEN struct ebb_node *ebb__node_enter(struct ebb_node *n);
/* Node n's pre-hooks on its input gradients grads[0..ngrads) (replaced in place). */
EBB_HIDDEN ebb_status ebb__node_pre_hooks(const char *fn, struct ebb_node *n, ebb_tensor_t **grads, int ngrads);
/* Node n's post-hooks: gin[0..nin) may be replaced (checked against n->in_meta). */
EBB_HIDDEN ebb_status ebb__node_post_hooks(const char *fn, struct ebb_node *n, ebb_tensor_t **gin, int nin,
                                           ebb_tensor_t *const *gout, int nout);
/* Frees n's user metadata (its destructors run): the node is going. */
EBB_HIDDEN void ebb__node_kv_free(struct ebb_node *n);
/* A gradient-edge root: checks edge i and gives its node and input; the edge's reference keeps it. */
EBB_HIDDEN ebb_status ebb__edge_resolve(const char *fn, const char *what, int i, const ebb_gradient_edge *e,
                                        struct ebb_node **node, int *nr);
/* The starting gradient of a root edge: g checked against the node's input metadata, or ones. */
EBB_HIDDEN ebb_status ebb__edge_root_grad(const char *fn, int i, const struct ebb_node *n, int nr, const ebb_tensor_t *g,
                                          ebb_tensor_t **out);
/* The public names of a backward call's roots and of their gradients, for messages (fn is the
 * call): ebb_grad, ebb_grad_edges and ebb_autograd_grad call them outputs and grad_outputs. */
static inline bool ebb__is_grad_call(const char *fn) { return strncmp(fn, "ebb_grad", 8) == 0 || strcmp(fn, "ebb_autograd_grad") == 0; }
static inline const char *ebb__roots_arg(const char *fn) { return ebb__is_grad_call(fn) ? "outputs" : "roots"; }
static inline const char *ebb__grad_roots_arg(const char *fn) {
  return ebb__is_grad_call(fn) ? "grad_outputs" : "grad_roots";
}
/* Node n's input k metadata (for an AccumulateGrad, its leaf's). */
EBB_HIDDEN void ebb__node_input_meta(const struct ebb_node *n, int k, ebb__tensor_meta *out);

/* workers.c: ready queues, device workers, the reentrant pool. */
struct ebb__task;
/* One ready node of a task: run deeper reentrant tasks first, then larger sequence numbers. */
struct ebb__qitem {
  uint32_t depth;
  uint64_t seq;
  struct ebb__task *t;
  int i;
};
struct ebb__queue {
  ebb_mutex mu;          /* a leaf lock */
  pthread_cond_t cv;
  struct ebb__qitem *a;  /* max-heap */
  size_t n, cap;
  _Atomic size_t count;  /* n, for waiters spinning without the lock */
  int sleepers;          /* threads parked on cv */
};
EBB_HIDDEN void ebb__queue_init(struct ebb__queue *q);
EBB_HIDDEN void ebb__queue_destroy(struct ebb__queue *q);
/* false without memory (nothing pushed). */
EBB_HIDDEN bool ebb__queue_push(struct ebb__queue *q, const struct ebb__qitem *it);
/* The next item (true), or false once *until_zero is 0 or *stop is true (either may be NULL)
 * with the queue empty. Spins briefly, then parks (counted in *parks, may be NULL). */
EBB_HIDDEN bool ebb__queue_pop_wait(struct ebb__queue *q, _Atomic long *until_zero, _Atomic bool *stop, struct ebb__qitem *out,
                                    uint64_t *parks);
/* Decrements *counter under q's lock, waking q's waiters when it reaches 0: after this call
 * the caller must not touch what the counter's owner may free once it sees 0. */
EBB_HIDDEN void ebb__queue_done(struct ebb__queue *q, _Atomic long *counter);
EBB_HIDDEN void ebb__queue_kick(struct ebb__queue *q);
/* The queue of device dev's worker, started if needed; NULL with a message on failure. */
EBB_HIDDEN struct ebb__queue *ebb__device_queue(int dev);
/* The queue the calling thread serves: its device's, on a worker (or a pool thread standing in
 * for one); NULL on any other thread. */
EBB_HIDDEN struct ebb__queue *ebb__home_queue(void);
/* Runs fn(arg) on a pool thread that serves the caller's queue meanwhile, and waits for it. */
EBB_HIDDEN ebb_status ebb__pool_run(void (*fn)(void *), void *arg);
/* Joins the workers and pool threads (the module stops: no backward runs). */
EBB_HIDDEN void ebb__workers_stop(void);
/* engine.c, for workers.c: runs (or, after its task failed, skips) one queued node. */
EBB_HIDDEN void ebb__item_run(const struct ebb__qitem *it);
EBB_HIDDEN void ebb__engine_count_parks(uint64_t n);
/* engine.c, for graph.c: the module stops (workers joined, counters and the warn-once set reset). */
EBB_HIDDEN void ebb__engine_stop(void);

/* engine.c */
/* Whether task t will execute n (or reach it for a capture). */
EBB_HIDDEN bool ebb__task_will_execute(const struct ebb__task *t, const struct ebb_node *n);

/* function.c: custom functions (ebb/function.h). */
struct ebb__fnrec;
/* The node's name ("<name>Backward") and its allocator-interned owner name. */
EBB_HIDDEN const char *ebb__function_node_name(const struct ebb__fnrec *r);
/* Runs the custom backward of n (op EBB__OP_FUNCTION) on the gradients of its outputs go[0..nout)
 * (NULL: none reached), with its saved tensors unpacked in saved[0..nsaved) and need[i] whether
 * input i's gradient is wanted; gin[0..nin) get the checked gradients (new references, or NULL).
 * Failures name fn (the backward call) and the node. */
EBB_HIDDEN ebb_status ebb__function_backward(const char *fn, struct ebb_node *n, ebb_tensor_t *const *go,
                                             const ebb_tensor_t *const *saved, const bool *need, ebb_tensor_t **gin);
/* Whether n (a function's node) saved a tensor (not NULL) at slot k. */
EBB_HIDDEN bool ebb__function_saved_at(const struct ebb__fnrec *r, int k);
/* Frees a function node's record (its user data's destructor runs): the node is going. */
EBB_HIDDEN void ebb__function_free(struct ebb__fnrec *r);

/* owners.c: what autograd's memory is tagged with in the allocator's owners. */
/* n saved t as saved[k].t (just shared): an activation's block becomes saved by n. */
EBB_HIDDEN void ebb__owners_saved(struct ebb_node *n, int k, const ebb_tensor_t *t);
/* Releases n->saved[k].t (non-NULL; set to NULL), giving its block its owner back when n was the
 * last node holding it. */
EBB_HIDDEN void ebb__owners_saved_drop(struct ebb_node *n, int k);
/* The same for handle t, which n->saved[k] held and no longer does (the caller releases it
 * after, and has set the slot): for a slot whose tensor is replaced or dropped under the saved lock. */
EBB_HIDDEN void ebb__owners_saved_forget(struct ebb_node *n, int k, const ebb_tensor_t *t);
/* The engine runs n between these: its allocations are (EBB_OWNER_BACKWARD, n's name). Pass
 * enter's result to leave. */
EBB_HIDDEN bool ebb__owners_enter(const struct ebb_node *n);
EBB_HIDDEN void ebb__owners_leave(bool entered);
/* A backward just gave `leaf` (meta m, grad_mu held) its first .grad, `grad`: its block becomes
 * the leaf's gradient. */
EBB_HIDDEN void ebb__owners_grad_new(const ebb_tensor_t *leaf, struct ebb__meta *m, const ebb_tensor_t *grad);
/* Opens the owner scope of leaf's gradient when its name is known already (grad_mu held), so a
 * copy made now is the gradient's from its allocation, with no re-tag; false: none opened
 * (ebb__owners_leave then does nothing). */
EBB_HIDDEN bool ebb__owners_grad_enter(const ebb_tensor_t *leaf, struct ebb__meta *m);

/* graph.c */
EBB_HIDDEN struct ebb__meta *ebb__meta_of(const ebb_tensor_t *t);
/* A new meta in t's slot (none there yet); NULL without memory. */
EBB_HIDDEN struct ebb__meta *ebb__meta_new(ebb_tensor_t *t);
/* A meta in no slot yet (NULL without memory), and freeing one (in no slot any more). */
EBB_HIDDEN struct ebb__meta *ebb__meta_alloc(void);
EBB_HIDDEN void ebb__meta_free(struct ebb__meta *m);
/* A node of op (-1: AccumulateGrad) with nin zeroed edges and no reference counted yet (the
 * caller stores 1 or unrefs it through ebb__node_drop); NULL without memory. */
EBB_HIDDEN struct ebb_node *ebb__node_new(int op, int nin, int nout);
/* Frees a node no one references yet (refs 0). */
EBB_HIDDEN void ebb__node_drop(struct ebb_node *n);
/* Grad mode as set on this thread (ebb_grad_set_enabled), inference mode aside. */
EBB_HIDDEN bool ebb__grad_mode_on(void);
EBB_HIDDEN const char *ebb__node_name_of(const struct ebb_node *n);
EBB_HIDDEN void ebb__node_unref(struct ebb_node *n);
/* The stream n's backward runs on, as recorded (handle and id; NULL and 0: none). */
EBB_HIDDEN void ebb__node_stream(const struct ebb_node *n, ebb_stream_t **s, uint64_t *id);
/* Makes AccumulateGrad a run on stream s (id) from now on; false when it was not on `from` any
 * more (another thread moved it first). */
EBB_HIDDEN bool ebb__node_stream_move(struct ebb_node *a, uint64_t from, ebb_stream_t *s, uint64_t id);
/* Links n's next edges into the consumer lists of the nodes they point at: once n is whole
 * (edges set), before anything else can reach it. Every node that records edges calls it once. */
EBB_HIDDEN void ebb__node_link(struct ebb_node *n);
/* The AccumulateGrad of leaf m if it has one that is not going: a new reference, or NULL. */
EBB_HIDDEN struct ebb_node *ebb__grad_acc_get(const struct ebb__meta *m);
/* Appends a new reference to each live node with an edge to p (a node with two edges to p comes
 * twice) to (*out)[*n..], growing it (*cap); EBB_ENOMEM leaves what was appended. Thread-safe
 * against nodes being recorded and freed. */
EBB_HIDDEN ebb_status ebb__consumers_get(struct ebb_node *p, struct ebb_node ***out, size_t *n, size_t *cap);
/* The AccumulateGrad of leaf t (meta m), made if needed; a new reference. */
EBB_HIDDEN ebb_status ebb__grad_acc(ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **out);

/* mutation.c: allow-mutation scopes (ebb_allow_mutation_on_saved_enter). */
struct ebb__mut;
/* n just saved an ordinary (unpacked) tensor as saved[k] (t, version set): registered in this
 * thread's scope when one is open, so an in-place write to its storage clones it first. Failures
 * (no memory) name n and k; nothing is registered then. */
EBB_HIDDEN ebb_status ebb__mutation_saved(struct ebb_node *n, int k);
/* n's saved tensors are going (n->saved[k].mut non-NULL for some k): every one of n's records
 * is freed and nothing of n is cloned or dropped by a scope any more. Before the tensors
 * themselves are released; by the thread that releases them. */
EBB_HIDDEN void ebb__mutation_release(struct ebb_node *n);
/* A backward reads n's saved tensor k (record m = n->saved[k].mut; saved lock held): EBB_ESTATE
 * when the scope it was saved in has exited (fn names the call), else EBB_OK. */
EBB_HIDDEN ebb_status ebb__mutation_unpack(const char *fn, const struct ebb_node *n, int k);
/* An in-place op is about to write dst's storage: the saved tensors registered on that storage
 * are cloned first (the slots then hold the clone). Called by the inplace hook, no lock held. */
EBB_HIDDEN ebb_status ebb__mutation_write(const ebb_tensor_t *dst);
/* Whether an allow-mutation scope is open on the calling thread (offload.c: its saves then
 * survive writes through their pinned copies). */
EBB_HIDDEN bool ebb__mutation_scope_here(void);

/* saved.c: saved tensors and the saved-tensor hooks stack. */
/* Saves t as n's saved tensor k (n->saved allocated): through the hooks on top of this thread's
 * stack when there are any (pack runs now), else a shared handle and its version now. t_owned:
 * t is a reference the caller hands over (kept as is when no hook packs it, released
 * otherwise), not a tensor to share. Failures name n and the saved input or output k. */
EBB_HIDDEN ebb_status ebb__save(struct ebb_node *n, int k, const ebb_tensor_t *t);
EBB_HIDDEN ebb_status ebb__save_owned(struct ebb_node *n, int k, ebb_tensor_t *t);
/* n's saved tensor k in messages: "saved input 0", "saved output 1" (an op's node, whose slots
 * are its forward's inputs then outputs), "saved tensor 2" (a custom function's, in the order its
 * ctx saved them). Returns buf. */
EBB_HIDDEN const char *ebb__saved_role(const struct ebb_node *n, int k, char *buf, size_t cap);
/* Releases what n->saved[k] holds (its tensor, or its packed value's reference), leaving it empty. */
EBB_HIDDEN void ebb__saved_drop(struct ebb_node *n, int k);
/* A new reference on a packed value, and dropping one (the last frees it through free_packed). */
EBB_HIDDEN void ebb__packed_get(struct ebb__packed *p);
EBB_HIDDEN void ebb__packed_put(struct ebb__packed *p);
/* Runs p's unpack hook for n's saved tensor k (p referenced by the caller, no lock held): *out a
 * slot-less handle of the engine's own on what it returned, checked against what was saved.
 * Failures name fn, n and k. */
EBB_HIDDEN ebb_status ebb__packed_unpack(const char *fn, const struct ebb_node *n, int k, struct ebb__packed *p,
                                         const ebb_tensor_t **out);
/* The unpack hooks of the packed tensors the engine took a reference on (pk[k], NULL where
 * none), run in order while st is OK, each reference dropped; pk freed. Returns st or the first
 * failure. */
EBB_HIDDEN ebb_status ebb__packed_unpack_all(const char *fn, const struct ebb_node *n, struct ebb__packed **pk,
                                             const ebb_tensor_t **saved, ebb_status st);
/* The failure of n's saved tensor k (handle sv) found at version v, changed in place since. */
EBB_HIDDEN EBB_COLD ebb_status ebb__saved_modified(const char *fn, const struct ebb_node *n, int k, const ebb_tensor_t *sv,
                                                   uint64_t v);
/* The calling thread's hook stack as a backward carries it (opaque; NULL: empty). */
EBB_HIDDEN const void *ebb__saved_hooks_now(void);
/* A thread runs a backward's work between these: its stack becomes `stack` (the caller's, as
 * ebb__saved_hooks_now gave it) and nothing of it can be popped; leave drops what was pushed
 * meanwhile and gives the thread its own stack back. */
struct ebb__saved_hooks_scope {
  const void *top, *base;
};
EBB_HIDDEN void ebb__saved_hooks_enter(struct ebb__saved_hooks_scope *s, const void *stack);
EBB_HIDDEN void ebb__saved_hooks_leave(const struct ebb__saved_hooks_scope *s);

/* The record of an offloaded tensor a packed value holds (offload.c), or NULL: hooks packed it. */
EBB_HIDDEN struct ebb__offl *ebb__packed_offl(const struct ebb__packed *p);

/* offload.c: saved tensors offloaded to pinned memory (ebb/autograd.h). */
struct ebb__offl;
struct ebb__offl_scope;
struct ebb__offl_plan;
/* A scope for policy p (checked; failures name fn), one reference; put drops one. */
EBB_HIDDEN ebb_status ebb__offl_scope_new(const char *fn, const ebb_offload_policy *p, struct ebb__offl_scope **out);
EBB_HIDDEN void ebb__offl_scope_put(struct ebb__offl_scope *sc);
/* The scope is popped: a look at the copies in flight (no wait). */
EBB_HIDDEN void ebb__offl_scope_exit(struct ebb__offl_scope *sc);
/* Offers t, n's saved tensor k, to the scope: *out a reference on the record of its storage, or
 * NULL when it stays an ordinary saved tensor (CPU, small, a parameter, the pinned budget).
 * Failures name n and k. */
EBB_HIDDEN ebb_status ebb__offl_save(struct ebb__offl_scope *sc, const struct ebb_node *n, int k, const ebb_tensor_t *t,
                                     struct ebb__offl **out);
EBB_HIDDEN void ebb__offl_put(struct ebb__offl *o);
/* The whole storage of record o on its device (a new slot-less 1-D handle), with the current
 * stream of its device made to wait for a reload; for n's saved tensor k (name: its name or "").
 * Checks the version; failures name fn, n and k. No lock held. */
EBB_HIDDEN ebb_status ebb__offl_unpack(const char *fn, const struct ebb_node *n, int k, struct ebb__offl *o, const char *name,
                                       ebb_tensor_t **whole);
/* Whether in-place ops must be shown to ebb__offl_inplace (records alive, and the write is not
 * offload.c's own), and dst about to be changed in place: the records of its storage at its
 * version are marked changed (their backward fails the version check), and the write waits on
 * the device for a copy out still reading it; records saved inside an allow-mutation scope keep
 * their pinned copy as the saved value instead (a failure, EBB_ENOMEM when it cannot be made,
 * refuses the write before anything changes). From the inplace hook, before the write. */
EBB_HIDDEN bool ebb__offl_watching(void);
EBB_HIDDEN ebb_status ebb__offl_inplace(const ebb_tensor_t *dst);
/* Records alive (the engine makes a plan only when there are some). */
EBB_HIDDEN long ebb__offl_live(void);
/* A backward's plan: the engine adds each offloaded record of each task node it will run (ti its
 * task index of nnodes, seq its sequence number, s the stream it runs on, held by the backward,
 * or NULL; the plan takes a reference), starts the plan
 * (the first reloads go out), brackets each node's run with enter (its reloads issued if not
 * yet: a failure fails the node) and leave, and ends it (everything let go, NULL allowed). */
EBB_HIDDEN ebb_status ebb__offl_plan_add(struct ebb__offl_plan **p, size_t nnodes, int ti, uint64_t seq, ebb_stream_t *s,
                                         struct ebb__offl *o);
EBB_HIDDEN ebb_status ebb__offl_plan_start(const char *fn, struct ebb__offl_plan *p);
EBB_HIDDEN ebb_status ebb__offl_plan_enter(const char *fn, struct ebb__offl_plan *p, int ti);
EBB_HIDDEN void ebb__offl_plan_leave(const char *fn, struct ebb__offl_plan *p, int ti);
EBB_HIDDEN void ebb__offl_plan_end(struct ebb__offl_plan *p);
/* The module stops: the offload streams are released, the statistics reset. */
EBB_HIDDEN void ebb__offl_stop(void);
/* The engine's saved lock of n (engine.c). */
EBB_HIDDEN ebb_mutex *ebb__saved_lock(const struct ebb_node *n);

/* inplace.c */
/* t's grad_fn and output_nr as they are now (*fn NULL for a leaf): a stale view's history is
 * taken again from its base first (thread-safe: a read may do it). Borrowed: valid while t
 * lives and is not changed in place (through itself, its base or another view of the base).
 * Failures: EBB_ENOMEM; EBB_EINVAL for a view a custom function returned whose base changed since (meta
 * fn_view). Message set. m is t's meta (non-NULL). */
EBB_HIDDEN ebb_status ebb__grad_fn_now(const ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **fn, int *output_nr);
/* The ops hooks for in-place ops (ops_export.h). */
EBB_HIDDEN ebb_status ebb__ag_inplace(int op, ebb_tensor_t *dst, const ebb_tensor_t *const *src, int nsrc, const ebb__op_args *args,
                                      void **token);
EBB_HIDDEN void ebb__ag_inplace_done(void *token, bool ok);

/* hooks.c (for inplace.c): moving a non-leaf's retain_grad hook to a new grad_fn. prepare
 * registers a hook on `node` (output nr) for m (*out; NULL when m retains nothing); it is freed
 * with the node if never committed. commit ends m's current retain hook and makes `h` it. */
EBB_HIDDEN ebb_status ebb__retain_prepare(struct ebb__meta *m, struct ebb_node *node, int nr, struct ebb__hook **out);
EBB_HIDDEN void ebb__retain_commit(struct ebb__meta *m, struct ebb__hook *h);

/* custom_op.c, for graph.c: the module stops (this session's custom ops forgotten). */
EBB_HIDDEN void ebb__custom_ops_stop(void);

#endif /* EBB_AUTOGRAD_IMPL_H */
