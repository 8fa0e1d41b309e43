/* module.c: the modules above the runtime, and the runtime's own configuration.
 *
 * Owns: the runtime's configuration (EBB_DRIVER, EBB_LOG, EBB_TRACE, EBB_TRACE_FILE,
 * EBB_CHECK_LAUNCH), checked with every module's registered variables at the first ebb_init
 * under one policy: a value that is not accepted fails ebb_init with EBB_EINVAL naming the
 * variable, the value and what is accepted; the modules' start in layer order, their live-object
 * counts, and their stop in reverse layer order. Modules are found through ebb__module_table
 * (runtime_export.h), which the link provides, so the runtime includes no module's header.
 *
 * Threading: everything here runs inside ebb_init / ebb_shutdown (driver.c), which serialise on
 * the runtime lock; ebb__rt_conf is written by the first ebb_init before `ready` is published
 * and read-only until the last ebb_shutdown.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime_export.h"
#include "runtime_impl.h"

ebb_rt_conf ebb__rt_conf;

/* ---- the runtime's own variables ------------------------------------------------------------ */

static bool check_driver(const char *v, char *expected, size_t len) {
  if (!v || !strcmp(v, "auto") || !strcmp(v, "cuda") || !strcmp(v, "sim") || strchr(v, '/') || strstr(v, ".so")) return true;
  snprintf(expected, len, "auto, cuda, sim or a path to a driver library");
  return false;
}

static bool check_log(const char *v, char *expected, size_t len) {
  ebb__rt_conf.log_info = v && !strcmp(v, "info");
  if (!v || !strcmp(v, "info") || !strcmp(v, "warn")) return true;
  snprintf(expected, len, "warn (the default) or info (also say which driver was chosen)");
  return false;
}

#define EBB__TRACE_CAP_MAX ((unsigned long long)1 << 30)

static bool check_trace(const char *v, char *expected, size_t len) {
  ebb__rt_conf.trace_cap = 0;
  if (!v) return true;
  char *end = NULL;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (!errno && end != v && !*end && v[0] != '-' && x <= EBB__TRACE_CAP_MAX) {
    ebb__rt_conf.trace_cap = (size_t)x;
    return true;
  }
  snprintf(expected, len, "0 (off) or the number of spans to keep, at most %llu", EBB__TRACE_CAP_MAX);
  return false;
}

/* The file is written at the last ebb_shutdown; a path that cannot be written then would lose
 * the whole trace, so the directory is checked now. */
static bool check_trace_file(const char *v, char *expected, size_t len) {
  ebb__rt_conf.trace_file[0] = '\0';
  if (!v) return true;
  char dir[sizeof ebb__rt_conf.trace_file];
  size_t n = strlen(v);
  const char *slash = strrchr(v, '/');
  if (n < sizeof dir && v[n - 1] != '/') {
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == v) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - v), v);
    if (access(dir, W_OK | X_OK) == 0) {
      snprintf(ebb__rt_conf.trace_file, sizeof ebb__rt_conf.trace_file, "%s", v);
      return true;
    }
  }
  snprintf(expected, len, "the path of a file (shorter than %zu bytes) in an existing writable directory", sizeof dir);
  return false;
}

static bool check_launch_var(const char *v, char *expected, size_t len) {
  ebb__rt_conf.check_launch = v && !strcmp(v, "1");
  if (!v || !strcmp(v, "0") || !strcmp(v, "1")) return true;
  snprintf(expected, len, "0 or 1");
  return false;
}

static const ebb__config_var ebb__rt_vars[] = {
  {"EBB_DRIVER", check_driver},
  {"EBB_LOG", check_log},
  {"EBB_TRACE", check_trace},
  {"EBB_TRACE_FILE", check_trace_file},
  {"EBB_CHECK_LAUNCH", check_launch_var},
};

static ebb_status check_vars(const ebb__config_var *vars, int n) {
  for (int i = 0; i < n; i++) {
    const char *v = getenv(vars[i].name);
    if (v && !*v) v = NULL;
    char expected[384] = "";
    if (!vars[i].check(v, expected, sizeof expected))
      return ebb__fail(EBB_EINVAL, "ebb_init: %s='%s' is not valid; expected %s", vars[i].name, v ? v : "",
                       expected[0] ? expected : "another value");
  }
  return EBB_OK;
}

/* ---- modules -------------------------------------------------------------------------------- */

#define EBB__MODULES_MAX 16

/* The linked modules ordered by layer (lowest first); stable for equal layers. */
static int modules_sorted(const ebb__module_desc **out) {
  int n = 0;
  for (const ebb__module_desc *const *m = ebb__module_table; *m && n < EBB__MODULES_MAX; m++) {
    int i = n++;
    while (i > 0 && out[i - 1]->layer > (*m)->layer) {
      out[i] = out[i - 1];
      i--;
    }
    out[i] = *m;
  }
  return n;
}

ebb_status ebb__modules_configure(void) {
  memset(&ebb__rt_conf, 0, sizeof ebb__rt_conf);
  ebb_status st = check_vars(ebb__rt_vars, (int)EBB_ARRAY_LEN(ebb__rt_vars));
  const ebb__module_desc *mods[EBB__MODULES_MAX];
  int n = modules_sorted(mods);
  for (int i = 0; i < n && !st; i++) st = check_vars(mods[i]->vars, mods[i]->nvars);
  return st;
}

void ebb__modules_stop(void) {
  const ebb__module_desc *mods[EBB__MODULES_MAX];
  for (int i = modules_sorted(mods) - 1; i >= 0; i--)
    if (mods[i]->stop) mods[i]->stop();
}

ebb_status ebb__modules_start(void) {
  const ebb__module_desc *mods[EBB__MODULES_MAX];
  int n = modules_sorted(mods);
  for (int i = 0; i < n; i++) {
    ebb_status st = mods[i]->start ? mods[i]->start() : EBB_OK;
    if (st) {
      char why[512];
      snprintf(why, sizeof why, "%s", ebb_last_error());
      for (int j = i; j >= 0; j--) /* the failed one too: it may have started half-way */
        if (mods[j]->stop) mods[j]->stop();
      return ebb__fail(st, "ebb_init: the %s module did not start: %s", mods[i]->name, why);
    }
  }
  return EBB_OK;
}

long ebb__modules_live(char *msg, size_t len) {
  const ebb__module_desc *mods[EBB__MODULES_MAX];
  int n = modules_sorted(mods);
  long total = 0;
  size_t used = 0;
  msg[0] = '\0';
  for (int i = n - 1; i >= 0; i--) {
    if (!mods[i]->count) continue;
    ebb__live_count c[EBB__LIVE_KINDS_MAX];
    int k = mods[i]->count(c, EBB__LIVE_KINDS_MAX);
    for (int j = 0; j < k; j++) {
      if (c[j].count <= 0) continue;
      total += c[j].count;
      if (used < len)
        used += (size_t)snprintf(msg + used, len - used, "%s%s: %ld", used ? ", " : "", c[j].kind, c[j].count);
    }
  }
  return total;
}
