/* ebb_malloc_conf.c: jemalloc's configuration for ebb's own programs (never for libebb).
 * Linked only into executables that link jemalloc as their process allocator. The settings keep
 * a steady state free of OS calls: dirty and muzzy pages are never purged on a timer (no
 * madvise), the retained virtual memory is reused rather than unmapped (no munmap), and the
 * background thread stays off so the process does not gain a thread behind the user's back.
 */
/* Default visibility, against the build's hidden default: libjemalloc defines a weak
 * malloc_conf of its own, and only a definition the program exports takes its place (the linker
 * exports it because that library defines it too); a hidden one would leave jemalloc on its
 * defaults (dirty pages purged after 10 s: stray madvise calls in a warm process). ebb-info shows
 * the settings in effect; tools.ebb_info_json checks them. */
__attribute__((visibility("default"))) const char *malloc_conf =
    "dirty_decay_ms:-1,muzzy_decay_ms:-1,retain:true,background_thread:false";
