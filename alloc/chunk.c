/* chunk.c: the host memory of the arena's record chunks (block records, slab records, free-index
 * nodes; arena_impl.h, "record chunks"), from aligned_alloc.
 *
 * Alone in its file (and so in its member of the static ebb_alloc) so that a white-box test can
 * link its own ebb__chunk_mem in its place, one that runs out of memory on demand
 * (tests/alloc/chunk_refusal.c), while the library's paths carry no test switch.
 *
 * Threading: called with the arena's lock held; aligned_alloc is thread-safe anyway.
 */
#include <stdlib.h>

#include "arena_impl.h"

void *ebb__chunk_mem(enum ebb__chunk_kind kind, size_t align, size_t bytes) {
  (void)kind; /* the library treats every kind alike */
  return aligned_alloc(align, bytes);
}
