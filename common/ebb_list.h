/* ebb_list.h: intrusive circular doubly linked list with a sentinel head.
 * Objects embed a struct ebb_list and are found back with ebb_container_of, so queueing never
 * allocates. Not thread-safe: the owner's lock protects a list.
 */
#ifndef EBB_LIST_H
#define EBB_LIST_H

#include <stdbool.h>
#include <stddef.h>

struct ebb_list {
  struct ebb_list *next, *prev;
};

#define ebb_container_of(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

static inline void ebb_list_init(struct ebb_list *h) { h->next = h->prev = h; }
static inline bool ebb_list_empty(const struct ebb_list *h) { return h->next == h; }
static inline void ebb_list_insert_tail(struct ebb_list *h, struct ebb_list *n) {
  n->prev = h->prev;
  n->next = h;
  h->prev->next = n;
  h->prev = n;
}
static inline void ebb_list_insert_head(struct ebb_list *h, struct ebb_list *n) {
  n->next = h->next;
  n->prev = h;
  h->next->prev = n;
  h->next = n;
}
static inline void ebb_list_remove(struct ebb_list *n) {
  n->prev->next = n->next;
  n->next->prev = n->prev;
  n->next = n->prev = n;
}
static inline struct ebb_list *ebb_list_pop_head(struct ebb_list *h) {
  if (ebb_list_empty(h)) return NULL;
  struct ebb_list *n = h->next;
  ebb_list_remove(n);
  return n;
}

#endif /* EBB_LIST_H */
