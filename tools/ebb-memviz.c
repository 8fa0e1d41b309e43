/* ebb-memviz: an ebb memory snapshot (ebb_memory_snapshot_json, EBB_ALLOC_CONF=oom_snapshot:,
 * ebb-train --snapshot) as one self-contained HTML page, and optionally an SVG.
 *
 *   ebb-memviz SNAPSHOT.json [-o PAGE.html] [--svg FIGURE.svg]
 *
 * The page's contents: tools/memviz.h. Exit codes: 0 written, 2 bad command line or a snapshot
 * that cannot be read (the message says where it stopped), 1 an output that cannot be written.
 * Nothing partial is left behind.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "memviz.h"

static int usage(FILE *f, int rc) {
  fprintf(f, "usage: ebb-memviz SNAPSHOT.json [-o PAGE.html] [--svg FIGURE.svg]\n"
             "Writes the memory timeline of an ebb snapshot as one HTML page (default: SNAPSHOT with .html\n"
             "for .json) and, with --svg, as an SVG figure.\n");
  return rc;
}

int main(int argc, char **argv) {
  const char *in = NULL, *html = NULL, *svg = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return usage(stdout, 0);
    if (!strcmp(argv[i], "-o") || !strcmp(argv[i], "--svg")) {
      if (i + 1 >= argc || !argv[i + 1][0]) {
        fprintf(stderr, "ebb-memviz: %s needs a file name\n", argv[i]);
        return usage(stderr, 2);
      }
      if (argv[i][1] == 'o') html = argv[++i];
      else svg = argv[++i];
    } else if (argv[i][0] == '-' && argv[i][1]) {
      fprintf(stderr, "ebb-memviz: unknown option '%s'\n", argv[i]);
      return usage(stderr, 2);
    } else if (in) {
      fprintf(stderr, "ebb-memviz: one snapshot at a time ('%s' and '%s' given)\n", in, argv[i]);
      return usage(stderr, 2);
    } else
      in = argv[i];
  }
  if (!in) return usage(stderr, 2);
  char *def = NULL;
  if (!html) {
    size_t n = strlen(in);
    def = malloc(n + 6);
    if (!def) return 1;
    memcpy(def, in, n + 1);
    if (n > 5 && !strcmp(def + n - 5, ".json")) def[n - 5] = 0;
    strcat(def, ".html");
    html = def;
  }
  /* Reading problems (a missing or malformed snapshot) are the caller's: 2; the only other way
   * to fail is an output that cannot be written. */
  /* The page (or the SVG) written over the snapshot would lose the snapshot. */
  const char *outs[2] = {html, svg};
  struct stat si, so;
  bool have_in = stat(in, &si) == 0;
  for (int k = 0; k < 2; k++) {
    if (!outs[k]) continue;
    if (!strcmp(outs[k], in) || (have_in && stat(outs[k], &so) == 0 && so.st_dev == si.st_dev && so.st_ino == si.st_ino)) {
      fprintf(stderr, "ebb-memviz: '%s' is the snapshot itself; give the %s another name\n", outs[k], k ? "SVG" : "page");
      free(def);
      return 2;
    }
  }
  if (svg && !strcmp(svg, html)) {
    fprintf(stderr, "ebb-memviz: the page and the SVG would both be '%s'; give them different names\n", svg);
    free(def);
    return 2;
  }
  FILE *probe = fopen(in, "rb");
  if (!probe) {
    fprintf(stderr, "ebb-memviz: cannot read '%s'\n", in);
    free(def);
    return 2;
  }
  fclose(probe);
  int rc = ebb_memviz_write_html(in, html, svg) ? 0 : ebb_memviz_last_error_is_input() ? 2 : 1;
  free(def);
  return rc;
}
