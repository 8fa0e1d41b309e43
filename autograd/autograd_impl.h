/* autograd_impl.h: what graph.c and engine.c share: the node and the per-tensor meta. */
#ifndef EBB_AUTOGRAD_IMPL_H
#define EBB_AUTOGRAD_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "ebb/autograd.h"
#include "ebb_sync.h"
#include "ops_export.h"

#define EBB__NODE_MAGIC 0x65626e64u /* "ebnd" */
#define EBB__ACC_SEQ UINT64_MAX

struct ebb__edge {
  struct ebb_node *fn; /* strong; NULL: the input needs no gradient */
  int input_nr;
};

struct ebb_node {
  uint32_t magic;
  _Atomic long refs;
  uint64_t seq;
  int op;                    /* ebb__op_id; -1: AccumulateGrad */
  int nin, nout;
  ebb__op_args args;
  ebb__tensor_meta *in_meta; /* [nin] */
  ebb_tensor_t **saved;      /* [nin + nout]: what the table's entry saves (shared handles), else NULL */
  uint64_t *saved_version;   /* [nin + nout]: the storage's version when saved */
  struct ebb__edge *next;    /* [nin] */
  ebb_tensor_t *leaf;        /* AccumulateGrad: the leaf's handle (strong) */
  _Atomic bool freed_saved;  /* a backward without retain_graph released the saved tensors */
  struct ebb__hook *hooks;   /* tensor hooks of its outputs (non-leaf tensors), under ebb__hook_mu */
  uint64_t saved_owned;      /* bit k: saved[k]'s block is counted as saved by a node (owners.c) */
};

struct ebb__meta {
  bool requires_grad;
  struct ebb_node *grad_fn; /* strong; NULL for a leaf */
  int output_nr;
  struct ebb_node *grad_acc; /* a leaf's AccumulateGrad: weak, cleared when it goes */
  ebb_mutex grad_mu;         /* .grad's updates (rank EBB_RANK_AG_GRAD: held across ops) */
  ebb_tensor_t *grad;        /* .grad: owned, NULL until a backward reaches it */
  struct ebb__hook *hooks;   /* a leaf's tensor and post-accumulate hooks, under ebb__hook_mu */
  struct ebb__hook *retain;  /* a non-leaf's retain_grad hook (in its grad_fn's list), or NULL */
  const char *grad_owner;    /* a leaf's gradient's owner name, interned (owners.c), under grad_mu */
};

/* A registered hook (hooks.c). Lists are kept in registration order; a removed hook stays in its
 * list (marked) until its owner goes, so a backward walking the list never meets freed memory. */
enum { EBB__HOOK_TENSOR = 0, EBB__HOOK_POST_ACC = 1, EBB__HOOK_RETAIN = 2 };
struct ebb__hook {
  uint64_t id;
  int kind;
  int output_nr;            /* tensor hooks on a node: the output they watch */
  ebb_tensor_hook_fn fn;
  ebb_post_accumulate_hook_fn post;
  void *user;
  bool removed;
  struct ebb__hook *next;
};

/* hooks.c */
/* Runs the tensor hooks of list `h` that watch output `output_nr` on *grad, which a hook may
 * replace (a new reference, checked against the old one's shape, dtype and device); `who` names
 * the node for messages. Called by the engine with no lock held. */
EBB_HIDDEN ebb_status ebb__run_tensor_hooks(const char *fn, const char *who, struct ebb__hook *h, int output_nr, ebb_tensor_t **grad);
/* Runs the post-accumulate hooks of a leaf (meta m, handle t). */
EBB_HIDDEN ebb_status ebb__run_post_acc_hooks(const char *fn, struct ebb__hook *h, const ebb_tensor_t *t);
/* Ends a non-leaf's retain_grad hook as its meta goes (the hook stays in the node's list,
 * marked removed, never reading the meta again). */
EBB_HIDDEN void ebb__retain_end(struct ebb__meta *m);
/* Frees a hook list (its owner is going): the hooks leave the registry, so their handles read as
 * removed. */
EBB_HIDDEN void ebb__hooks_free(struct ebb__hook *h);


/* owners.c: what autograd's memory is tagged with in the allocator's owners. */
/* n saved t as saved[k] (just shared): an activation's block becomes saved by n. */
EBB_HIDDEN void ebb__owners_saved(struct ebb_node *n, int k, const ebb_tensor_t *t);
/* Releases n->saved[k] (non-NULL; set to NULL), giving its block its owner back when n was the
 * last node holding it. */
EBB_HIDDEN void ebb__owners_saved_drop(struct ebb_node *n, int k);
/* The engine runs n between these: its allocations are (EBB_OWNER_BACKWARD, n's name). Pass
 * enter's result to leave. */
EBB_HIDDEN bool ebb__owners_enter(const struct ebb_node *n);
EBB_HIDDEN void ebb__owners_leave(bool entered);
/* A backward just gave `leaf` (meta m, grad_mu held) its first .grad, `grad`: its block becomes
 * the leaf's gradient. */
EBB_HIDDEN void ebb__owners_grad_new(const ebb_tensor_t *leaf, struct ebb__meta *m, const ebb_tensor_t *grad);

/* graph.c */
EBB_HIDDEN struct ebb__meta *ebb__meta_of(const ebb_tensor_t *t);
/* A new meta in t's slot (none there yet); NULL without memory. */
EBB_HIDDEN struct ebb__meta *ebb__meta_new(ebb_tensor_t *t);
EBB_HIDDEN const char *ebb__node_name_of(const struct ebb_node *n);
EBB_HIDDEN void ebb__node_unref(struct ebb_node *n);
/* A leaf's AccumulateGrad if it has one (no reference: compared by address only). */
EBB_HIDDEN struct ebb_node *ebb__grad_acc_peek(const struct ebb__meta *m);
/* The AccumulateGrad of leaf t (meta m), made if needed; a new reference. */
EBB_HIDDEN ebb_status ebb__grad_acc(ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **out);

#endif /* EBB_AUTOGRAD_IMPL_H */
