/* owners.c: who holds autograd's memory, told to the allocator (ebb/alloc.h owners) so that
 * snapshots and OOM reports name it.
 *
 * - A backward's temporaries: the engine runs each node inside an owner scope
 *   (EBB_OWNER_BACKWARD, node name), so the gradients its backward computes, the sums made as they
 *   reach their producers' buffers and what its hooks allocate are the node's.
 * - A gradient: when a backward first gives a leaf its .grad (a buffer taken over, or a copy), the
 *   block is re-tagged (EBB_OWNER_GRADIENT, leaf name): the tensor's name (ebb_tensor_set_name),
 *   else its own block's owner name (a parameter made under a scope), else "leaf [shape] dtype",
 *   worked out at the leaf's first gradient and kept (a later rename is not followed).
 * - A saved tensor: a node that saves a tensor whose block belongs to an activation or to nobody
 *   (EBB_OWNER_ACTIVATION, EBB_OWNER_OTHER) re-tags it (EBB_OWNER_SAVED, node name): from then on
 *   the node is what keeps it alive. When the last node holding it lets go, the block gets its
 *   owner back. Parameters, gradients and optimizer state keep their category when saved (a weight
 *   a matmul saves is still the weight). A block saved by several nodes is named by the first.
 *
 * Cost: nothing on a path without autograd; per saved tensor one lock of the table here and two
 * allocator calls at save, one at release; per node run a scope push and pop (the name interned
 * from a thread-local cache, no lock).
 *
 * Threading: the table of re-tagged blocks is under ebb__saved_mu (rank EBB_RANK_AG_SAVED, held
 * across the allocator calls so a block's tag and its count change together); scopes are the
 * calling thread's. A node's `saved_owned` bit k is written by whoever changes its slot k: the
 * thread that saves (recording) or releases (the backward that frees the saved tensors, or the
 * last unref) its tensors, an allow-mutation scope's clone or exit (mutation.c), a per-tensor pair
 * of hooks (saved.c); different slots may change at once, so the word is changed atomically.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_export.h"
#include "ebb/alloc.h"
#include "ebb_internal.h"
#include "ebb_sync.h"
#include "autograd_impl.h"

/* A re-tagged block: how many saved references hold it, and the owner to give back. */
struct ebb__sv {
  void *block; /* NULL: empty slot */
  uint32_t count;
  ebb_owner_cat cat;
  const char *name; /* interned by alloc: never freed */
};

static ebb_mutex ebb__saved_mu = {PTHREAD_MUTEX_INITIALIZER, "autograd.saved", EBB_RANK_AG_SAVED};
static struct {
  struct ebb__sv *slot; /* open addressing, linear probing, power-of-two size */
  size_t cap, count;
} ebb__sv;

static size_t sv_hash(const void *p) { return (size_t)(((uintptr_t)p >> 9) * 0x9e3779b97f4a7c15ull); }

/* The entry of block p, or the empty slot where it would go. Lock held, cap > 0. */
static struct ebb__sv *sv_slot(void *p) {
  size_t j = sv_hash(p) & (ebb__sv.cap - 1);
  while (ebb__sv.slot[j].block && ebb__sv.slot[j].block != p) j = (j + 1) & (ebb__sv.cap - 1);
  return &ebb__sv.slot[j];
}

/* Room for one more entry (load <= 1/2). Lock held. */
static bool sv_reserve(void) {
  if ((ebb__sv.count + 1) * 2 <= ebb__sv.cap) return true;
  size_t nc = ebb__sv.cap ? ebb__sv.cap * 2 : 256;
  struct ebb__sv *ns = calloc(nc, sizeof *ns), *old = ebb__sv.slot;
  if (!ns) return false;
  size_t oc = ebb__sv.cap;
  ebb__sv.slot = ns;
  ebb__sv.cap = nc;
  for (size_t i = 0; i < oc; i++)
    if (old[i].block) *sv_slot(old[i].block) = old[i];
  free(old);
  return true;
}

/* Removes entry e, shifting back the entries of its probe run (no tombstones). Lock held. */
static void sv_remove(struct ebb__sv *e) {
  size_t m = ebb__sv.cap - 1, i = (size_t)(e - ebb__sv.slot), j = i;
  ebb__sv.slot[i].block = NULL;
  ebb__sv.count--;
  for (;;) {
    j = (j + 1) & m;
    if (!ebb__sv.slot[j].block) return;
    size_t home = sv_hash(ebb__sv.slot[j].block) & m;
    /* j's entry may fill the hole at i when its home is not in (i, j] (cyclically). */
    bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    ebb__sv.slot[i] = ebb__sv.slot[j];
    ebb__sv.slot[j].block = NULL;
    i = j;
  }
}

void ebb__owners_saved(struct ebb_node *n, int k, const ebb_tensor_t *t) {
  if (k >= 64) return; /* (no node saves that many: cat and stack save nothing) */
  void *p = ebb__tensor_block(t);
  if (!p) return;
  ebb__mutex_lock(&ebb__saved_mu);
  struct ebb__sv *e = ebb__sv.cap ? sv_slot(p) : NULL;
  if (e && e->block) {
    e->count++;
    atomic_fetch_or_explicit(&n->saved_owned, 1ull << k, memory_order_relaxed);
    ebb__mutex_unlock(&ebb__saved_mu);
    return;
  }
  /* Every storage ops makes is a block of a pool, so these calls do not fail on a live tensor
   * (a failure would leave the block as it was). */
  ebb_owner_cat cat = EBB_OWNER_OTHER;
  const char *name = "";
  ebb__fail_mute(true); /* (a tag that cannot be set, its name not interned, fails no op) */
  if (sv_reserve() && ebb_alloc_block_owner(p, &cat, &name) == EBB_OK &&
      (cat == EBB_OWNER_ACTIVATION || cat == EBB_OWNER_OTHER) &&
      ebb_alloc_block_set_owner(p, EBB_OWNER_SAVED, ebb__node_name_of(n), NULL, NULL) == EBB_OK) {
    *sv_slot(p) = (struct ebb__sv){p, 1, cat, name};
    ebb__sv.count++;
    atomic_fetch_or_explicit(&n->saved_owned, 1ull << k, memory_order_relaxed);
  }
  ebb__fail_mute(false);
  ebb__mutex_unlock(&ebb__saved_mu);
}

void ebb__owners_saved_drop(struct ebb_node *n, int k) {
  ebb_tensor_t *t = n->saved[k].t;
  n->saved[k].t = NULL;
  ebb__owners_saved_forget(n, k, t);
  ebb_tensor_release(t);
}

void ebb__owners_saved_forget(struct ebb_node *n, int k, const ebb_tensor_t *t) {
  if (k < 64 && (atomic_fetch_and_explicit(&n->saved_owned, ~(1ull << k), memory_order_relaxed) >> k & 1)) {
    void *p = ebb__tensor_block(t);
    ebb__mutex_lock(&ebb__saved_mu);
    struct ebb__sv *e = ebb__sv.cap ? sv_slot(p) : NULL;
    if (e && e->block && --e->count == 0) {
      /* Given back before the reference goes (after it the block may be freed and reused), unless
       * this handle is the storage's last: then the block is freed now, and its free is recorded
       * as the node's, which held it last. */
      if (!ebb__tensor_exclusive(t)) {
        ebb__fail_mute(true);
        ebb_alloc_block_set_owner(p, e->cat, e->name, NULL, NULL);
        ebb__fail_mute(false);
      }
      sv_remove(e);
    }
    ebb__mutex_unlock(&ebb__saved_mu);
  }
}

/* The owner of block p as its allocator sees it, except that a block a node saved has the owner
 * it had before (the one the node gives back), not the node's. */
static ebb_status owner_proper(void *p, ebb_owner_cat *cat, const char **name) {
  ebb__mutex_lock(&ebb__saved_mu); /* (the tag and the table change together under it) */
  struct ebb__sv *e = ebb__sv.cap ? sv_slot(p) : NULL;
  ebb_status st = EBB_OK;
  if (e && e->block) {
    *cat = e->cat;
    *name = e->name;
  } else {
    st = ebb_alloc_block_owner(p, cat, name);
  }
  ebb__mutex_unlock(&ebb__saved_mu);
  return st;
}

/* Node names interned once per operation (index op + 1; 0: AccumulateGrad): the push per node
 * run is then a few stores. Racing first uses intern the same name twice, harmlessly. */
static _Atomic(const char *) ebb__node_owner[EBB__OP_COUNT + 1];

bool ebb__owners_enter(const struct ebb_node *n) {
  if (EBB_UNLIKELY(n->fnrec != NULL)) /* a custom function's: its name, interned when the function was first applied */
    return ebb__alloc_owner_push_interned(EBB_OWNER_BACKWARD, ebb__function_node_name(n->fnrec));
  size_t k = n->op < 0 ? 0 : (size_t)n->op + 1;
  const char *in = atomic_load_explicit(&ebb__node_owner[k], memory_order_acquire);
  if (!in) {
    ebb__fail_mute(true); /* (a name that cannot be interned fails no backward: the node's memory is then the caller's scope's) */
    ebb_status st = ebb__alloc_intern("ebb_backward", ebb__node_name_of(n), &in);
    ebb__fail_mute(false);
    if (st) return false;
    atomic_store_explicit(&ebb__node_owner[k], in, memory_order_release);
  }
  /* Fails only with EBB_OWNER_MAX_DEPTH scopes already open on this thread: the node's memory is
   * then the caller's innermost scope's. */
  return ebb__alloc_owner_push_interned(EBB_OWNER_BACKWARD, in);
}

void ebb__owners_leave(bool entered) {
  if (entered) ebb_alloc_owner_pop();
}

/* "leaf [2,3] f32" into buf (cap > 40), by hand: a backward gives thousands of fresh leaves their
 * first gradient in a step (each name once), and printf's machinery cost ~5,000 instructions a
 * name there. */
static void leaf_name(const ebb_tensor_info *info, char *buf, size_t cap) {
  size_t at = 0;
  const char *head = "leaf [";
  while (*head) buf[at++] = *head++;
  for (int d = 0; d < info->ndim && at + 24 < cap; d++) {
    if (d) buf[at++] = ',';
    char digits[24];
    int nd = 0;
    unsigned long long v = (unsigned long long)info->shape[d];
    do digits[nd++] = (char)('0' + v % 10); while ((v /= 10) && nd < 24);
    while (nd) buf[at++] = digits[--nd];
  }
  const char *dt = ebb_dtype_name(info->dtype);
  if (at + 2 + strlen(dt) < cap) {
    buf[at++] = ']';
    buf[at++] = ' ';
    while (*dt) buf[at++] = *dt++;
  }
  buf[at] = '\0';
}

/* Interned names of unnamed leaves' gradients by shape and dtype, per thread: a step that gives
 * thousands of fresh leaves their first gradient formats and interns each shape once. */
#define EBB__LEAF_NAMES 16
static _Thread_local struct {
  uint64_t key;     /* 0: empty */
  const char *name; /* interned */
} ebb__leaf_names[EBB__LEAF_NAMES];

static uint64_t shape_key(const ebb_tensor_info *info) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)info->dtype ^ ((uint64_t)info->ndim << 8);
  for (int d = 0; d < info->ndim; d++) h = (h ^ (uint64_t)info->shape[d]) * 0x100000001b3ull;
  return h | 1;
}

/* The interned name a leaf's gradient is tagged with: the tensor's name, else its own block's
 * owner name (a parameter made under a scope), else "leaf [shape] dtype". Kept in m->grad_owner
 * (grad_mu held): worked out once per leaf. NULL if the allocator cannot intern it. */
static const char *grad_name(const ebb_tensor_t *leaf, struct ebb__meta *m, void *grad_block) {
  if (m->grad_owner) return m->grad_owner;
  char name[EBB_OWNER_NAME_MAX + 1] = "";
  const char *in = NULL;
  ebb_owner_cat cat;
  if (ebb_tensor_name(leaf, name, sizeof name) != EBB_OK) name[0] = '\0';
  if (!name[0]) {
    void *lp = ebb__tensor_block(leaf);
    /* (a leaf a node saves is tagged saved by it meanwhile: its own owner is the one before) */
    if (lp && owner_proper(lp, &cat, &in) == EBB_OK && in[0]) return m->grad_owner = in; /* interned already */
    ebb_tensor_info info;
    if (ebb_tensor_get_info(leaf, &info) != EBB_OK) return NULL;
    uint64_t key = shape_key(&info);
    size_t slot = (size_t)(key >> 7) & (EBB__LEAF_NAMES - 1);
    if (ebb__leaf_names[slot].key == key) return m->grad_owner = ebb__leaf_names[slot].name;
    leaf_name(&info, name, sizeof name);
    /* interned by tagging the gradient's block, read back */
    if (!grad_block || ebb_alloc_block_set_owner(grad_block, EBB_OWNER_GRADIENT, name, NULL, NULL) != EBB_OK ||
        ebb_alloc_block_owner(grad_block, &cat, &in) != EBB_OK)
      return NULL;
    ebb__leaf_names[slot].key = key;
    ebb__leaf_names[slot].name = in;
    return m->grad_owner = in;
  }
  if (!grad_block || ebb_alloc_block_set_owner(grad_block, EBB_OWNER_GRADIENT, name, NULL, NULL) != EBB_OK ||
      ebb_alloc_block_owner(grad_block, &cat, &in) != EBB_OK)
    return NULL;
  return m->grad_owner = in;
}

/* The tag is bookkeeping: an allocator call that fails (a name that cannot be interned) leaves
 * the block as it was and fails no backward, so these run muted. */
void ebb__owners_grad_new(const ebb_tensor_t *leaf, struct ebb__meta *m, const ebb_tensor_t *grad) {
  void *p = ebb__tensor_block(grad);
  if (!p) return;
  ebb__fail_mute(true);
  const char *name = grad_name(leaf, m, p);
  if (name) ebb_alloc_block_set_owner(p, EBB_OWNER_GRADIENT, name, NULL, NULL);
  ebb__fail_mute(false);
}

bool ebb__owners_grad_enter(const ebb_tensor_t *leaf, struct ebb__meta *m) {
  ebb__fail_mute(true);
  const char *name = grad_name(leaf, m, NULL);
  bool in = name && ebb_alloc_owner_push(EBB_OWNER_GRADIENT, name) == EBB_OK;
  ebb__fail_mute(false);
  return in;
}
