/* chunk_refusal.c: host memory running out for the arena's records, for white-box tests. Linked
 * into a test program before the static ebb_alloc, its ebb__chunk_mem takes the place of the
 * library's (alloc/chunk.c, alone in its archive member so the linker then leaves it out): it
 * refuses the next n chunks of one kind as if aligned_alloc had failed, else allocates as the
 * library does. So the library's allocation paths carry no test switch, and the tests still run
 * the code that finds no memory for a block record or a free-index node.
 *
 * Threading: the counters are atomics (arenas call in under their own locks, from any thread);
 * ebb_test_hold_block_records takes the arena's lock.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "arena_impl.h"

static atomic_int ebb_test_refuse[EBB__CHUNK_FXNODES + 1];

void *ebb__chunk_mem(enum ebb__chunk_kind kind, size_t align, size_t bytes) {
  atomic_int *left = &ebb_test_refuse[kind];
  for (int n = atomic_load_explicit(left, memory_order_relaxed); n > 0;)
    if (atomic_compare_exchange_weak_explicit(left, &n, n - 1, memory_order_relaxed, memory_order_relaxed)) return NULL;
  return aligned_alloc(align, bytes);
}

/* The next n chunks of free-index nodes are refused (0: none); the index then keeps free blocks
 * in its list. */
void ebb_test_refuse_fidx_chunks(int n) { atomic_store_explicit(&ebb_test_refuse[EBB__CHUNK_FXNODES], n, memory_order_relaxed); }

/* The next n slabs of block records are refused (0: none). */
void ebb_test_refuse_block_slabs(int n) { atomic_store_explicit(&ebb_test_refuse[EBB__CHUNK_BLOCKS], n, memory_order_relaxed); }

/* Moves device arena `device`'s spare block records aside (hold), so the next record asked for
 * needs a new slab, and back (!hold). */
static struct ebb_list ebb_test_held = {&ebb_test_held, &ebb_test_held};
void ebb_test_hold_block_records(int device, bool hold) {
  struct ebb__arena *a = ebb__arena_nth(device);
  if (!a) return;
  ebb__lock(&a->mu);
  struct ebb_list *from = hold ? &a->block_spare : &ebb_test_held, *to = hold ? &ebb_test_held : &a->block_spare;
  for (struct ebb_list *n; (n = ebb_list_pop_head(from));) ebb_list_insert_tail(to, n);
  ebb__unlock(&a->mu);
}
