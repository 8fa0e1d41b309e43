/* memviz: an ebb memory snapshot (ebb_memory_snapshot_json, include/ebb/alloc.h) as one
 * self-contained HTML page, and as an SVG for documents. Shared by ebb-memviz and ebb-train.
 *
 * The page draws, for each device and each host pool with history, live bytes over time stacked
 * by owner category (each block counted under the owner it had when it was freed, or has now:
 * autograd re-tags a forward's output as saved when a node keeps it) with the reserved bytes as a
 * line; zoom (wheel), pan (drag), hover details (the owner, size, stream and lifetime of the
 * block whose event is nearest), the segment map at the time of the snapshot and the top owners at
 * each pool's peak. No network, no external script: the data travels in the page as base64 typed
 * arrays, decoded once at load.
 *
 * A block counts from its alloc until its free completes (the streams that used it have passed
 * the free): the arena's active bytes, which include frees still waiting for a stream, where
 * ebb_arena_get_stats' allocated_bytes (and ebb-train's peak_device_bytes) drop a block at the
 * free call. So a page's peak can be above the program's reported peak.
 *
 * Blocks allocated before the history's first entry (the ring keeps the newest actions) are
 * shown as live from its start: those freed in the history, and those the snapshot's segments
 * still hold that the history never saw allocated.
 */
#ifndef EBB_TOOLS_MEMVIZ_H
#define EBB_TOOLS_MEMVIZ_H

#include <stdbool.h>

/* Reads the snapshot at `snapshot_path` and writes the page to `html_path` and, when `svg_path`
 * is not NULL, the SVG. Returns false after printing to stderr what was wrong: a file that
 * cannot be read or written, or a snapshot that is not one (malformed or truncated JSON, a field
 * of the wrong type), named with the byte offset where reading stopped. Partially written outputs
 * are removed. */
bool ebb_memviz_write_html(const char *snapshot_path, const char *html_path, const char *svg_path);
/* After ebb_memviz_write_html returned false: whether the snapshot was at fault (unreadable,
 * malformed or truncated) rather than an output or host memory. */
bool ebb_memviz_last_error_is_input(void);

#endif
