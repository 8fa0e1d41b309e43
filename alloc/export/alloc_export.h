/* alloc_export.h: what alloc offers the modules above it beyond ebb/alloc.h. Never installed,
 * not part of the API.
 *
 * Autograd opens an owner scope around every backward node it runs; the public push checks and
 * interns the name each time (~170 instructions). A caller that names scopes from a fixed set
 * of strings interns each once and pushes the interned pointer.
 */
#ifndef EBB_ALLOC_EXPORT_H
#define EBB_ALLOC_EXPORT_H

#include <stdbool.h>

#include "ebb/alloc.h"
#include "runtime_export.h" /* EBB_HIDDEN */

#ifdef __cplusplus
extern "C" {
#endif

/* name (NUL-terminated, at most EBB_OWNER_NAME_MAX bytes) interned into *out: a pointer that lives
 * for the process and can be passed to ebb__alloc_owner_push_interned. The errors of
 * ebb_alloc_owner_push's interning (EBB_EINVAL, EBB_ELIMIT, EBB_ENOMEM), named as `fn`'s. */
EBB_HIDDEN ebb_status ebb__alloc_intern(const char *fn, const char *name, const char **out);
/* ebb_alloc_owner_push with a name from ebb__alloc_intern and a valid cat, unchecked: false
 * (nothing pushed, no message) when the thread holds EBB_OWNER_MAX_DEPTH scopes already. Popped
 * with ebb_alloc_owner_pop. */
EBB_HIDDEN bool ebb__alloc_owner_push_interned(ebb_owner_cat cat, const char *interned);
/* The calling thread's innermost owner scope: its name (interned, for the process; "" when none
 * is open) and, when cat is not NULL, its category. For a module that carries an owner to work
 * another thread does (a collective the communication thread runs, traced under the owner its
 * issuer had open). */
EBB_HIDDEN const char *ebb__alloc_owner_current(ebb_owner_cat *cat);

/* The live block (or slot) starting at ptr, of any arena, no longer needs its free to wait for
 * stream `sid`: the caller has ordered the block's allocation stream after sid's use of it (an
 * event wait on the device), so the stream order of frees covers that use. For a module that
 * makes such waits itself where a free would otherwise stay pending until the host sees the
 * use's event complete (autograd's offloaded saved tensors: a host running ahead of the device
 * would grow the arena by every pending block). false when ptr is no live block's start or sid
 * was not among its uses (nothing changes). Thread-safe; takes the arena's lock. */
EBB_HIDDEN bool ebb__arena_use_forget(void *ptr, uint64_t sid);

#ifdef __cplusplus
}
#endif

#endif /* EBB_ALLOC_EXPORT_H */
