/* autograd_impl.h: what the files of autograd share: the node and the per-tensor meta, and
 * each file's functions for the others. */
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
  ebb__view_geom *geom;      /* AS_STRIDED, COPY_SLICES: where the view lies (owned; args.geom) */
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
  /* A view (ebb__tensor_base non-NULL) whose grad_fn derives from its base's history: valid
   * while the storage's version is view_version; an in-place change through the base or any of
   * its views makes it stale, and the next read takes it again from the base (inplace.c).
   * Release store after grad_fn is replaced, acquire load before it is read without the lock. */
  bool is_view;
  _Atomic uint64_t view_version;
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
/* Saves t as n's saved tensor k (a shared handle and its version now). */
EBB_HIDDEN ebb_status ebb__save(struct ebb_node *n, int k, const ebb_tensor_t *t);
/* Grad mode as set on this thread (ebb_grad_set_enabled), inference mode aside. */
EBB_HIDDEN bool ebb__grad_mode_on(void);
EBB_HIDDEN const char *ebb__node_name_of(const struct ebb_node *n);
EBB_HIDDEN void ebb__node_unref(struct ebb_node *n);
/* A leaf's AccumulateGrad if it has one (no reference: compared by address only). */
EBB_HIDDEN struct ebb_node *ebb__grad_acc_peek(const struct ebb__meta *m);
/* The AccumulateGrad of leaf t (meta m), made if needed; a new reference. */
EBB_HIDDEN ebb_status ebb__grad_acc(ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **out);

/* inplace.c */
/* t's grad_fn and output_nr as they are now (*fn NULL for a leaf): a stale view's history is
 * taken again from its base first (thread-safe: a read may do it). Borrowed: valid while t
 * lives and is not changed in place (through itself, its base or another view of the base).
 * Only failure: EBB_ENOMEM (message set). m is t's meta (non-NULL). */
EBB_HIDDEN ebb_status ebb__grad_fn_now(const ebb_tensor_t *t, struct ebb__meta *m, struct ebb_node **fn, int *output_nr);
/* The ops hooks for in-place ops (ops_export.h). */
EBB_HIDDEN ebb_status ebb__ag_inplace(int op, ebb_tensor_t *dst, const ebb_tensor_t *src, void **token);
EBB_HIDDEN void ebb__ag_inplace_done(void *token, bool ok);

/* hooks.c (for inplace.c): moving a non-leaf's retain_grad hook to a new grad_fn. prepare
 * registers a hook on `node` (output nr) for m (*out; NULL when m retains nothing); it is freed
 * with the node if never committed. commit ends m's current retain hook and makes `h` it. */
EBB_HIDDEN ebb_status ebb__retain_prepare(struct ebb__meta *m, struct ebb_node *node, int nr, struct ebb__hook **out);
EBB_HIDDEN void ebb__retain_commit(struct ebb__meta *m, struct ebb__hook *h);

#endif /* EBB_AUTOGRAD_IMPL_H */
