/* ebb-info: what ebb sees on this machine.
 *
 * Initialises ebb and prints the driver it loaded (and why), every device with its capabilities
 * and nearest NUMA node, the EBB_* configuration in force (the value set in the environment, or
 * the default ebb uses), and which malloc this process runs on. `--json` prints the same as one
 * JSON object; `--help` says how to call it.
 *
 * Single-threaded: it gathers everything into plain structs first, then prints them with one of
 * two printers, so the text and JSON views cannot drift apart.
 * Exit codes: 0 ok, 1 ebb_init or a query failed (the message from ebb_last_error() goes to
 * stderr), 2 bad command line.
 */
#define _GNU_SOURCE /* dladdr, RTLD_DEFAULT: GNU extensions of <dlfcn.h> */
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "ebb/runtime.h"
#include "ebb/status.h"

#ifndef EBB_INFO_VERSION
#define EBB_INFO_VERSION "unknown"
#endif

/* ---- what we gather ------------------------------------------------------------------------ */

typedef struct info_device {
  ebb_dev_caps caps;
  ebb_topo topo;
  bool have_topo;
  char topo_error[256]; /* why the topology is unknown, when !have_topo */
} info_device;

/* One configuration variable: the name, the value ebb uses when it is unset, what it does. */
typedef struct config_var {
  const char *name;
  const char *fallback;
  const char *meaning;
} config_var;

static const config_var k_config[] = {
    {"EBB_DRIVER", "auto", "driver: auto|cuda|sim|<path to a Driver API library>"},
    {"EBB_SIMDRV_PATH", "(beside libebb, then build tree, then install dir)",
     "path of libebb_simdrv.so"},
    {"EBB_SIM_DEVICES", "2", "emulated devices"},
    {"EBB_SIM_MEM", "8 GiB, at most 3/4 of host memory over the devices", "memory capacity of each emulated device"},
    {"EBB_SIM_COMMIT", "1", "emulated memory committed at allocation (0: at first touch)"},
    {"EBB_SIM_VMM", "1", "emulated devices have VMM (0: none, as a driver without it)"},
    {"EBB_SIM_COPY_GBPS", "(off: copies run at memcpy speed)", "emulated link bandwidth"},
    {"EBB_SIM_LAUNCH_US", "(off: no launch latency)", "emulated launch latency"},
    {"EBB_SIM_PERTURB", "(off: work runs as soon as it may)", "perturbation seed: independent streams' work shuffled"},
    {"EBB_STREAM_POOL_SIZE", "8", "pool streams per device and priority"},
    {"EBB_STAGING_CHUNK", "4194304", "bytes per pinned staging chunk"},
    {"EBB_STAGING_CHUNKS", "4", "pinned staging chunks per device"},
    {"EBB_TRACE", "(off)", "trace ring capacity in spans"},
    {"EBB_TRACE_FILE", "(none)", "trace JSON written at the last ebb_shutdown"},
    {"EBB_CHECK_LAUNCH", "0", "check the buffers declared at each kernel launch"},
    {"EBB_CPU_VEC", "(the widest the processor has)", "baseline|avx2|avx512: caps the CPU kernels' instruction set"},
    {"EBB_LOG", "warn", "warn|info: info also reports the driver choice at each first ebb_init, through the warning handler"},
    {"EBB_ALLOC_CONF", "(unset: expandable segments where the driver has VMM, slabs to 64K, history 65536)",
     "allocator settings, comma-separated key:value (README)"},
};

typedef struct info_alloc {
  const char *name;     /* "jemalloc", "glibc", "sanitizer" or "other" */
  char provider[512];   /* the shared object that defines malloc */
  char version[64];     /* jemalloc's version string, or glibc's */
  /* jemalloc: the settings in effect (its own report, not our malloc_conf string), the ones
   * ebb's programs set so that a steady state makes no system call. */
  bool have_opts;
  long long dirty_decay_ms, muzzy_decay_ms;
  bool retain, background_thread;
} info_alloc;

typedef struct info {
  ebb_driver_info drv;
  int ndev;
  info_device dev[EBB_MAX_DEVICES];
  info_alloc alloc;
} info;

/* jemalloc's control entry point; present in the process only when jemalloc is loaded. */
typedef int (*mallctl_fn)(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen);

/* Decides at run time which malloc this process calls: the object that defines the `malloc`
 * the dynamic linker resolves first, and whether jemalloc's mallctl is reachable. A build flag
 * would say what we linked, not what runs (LD_PRELOAD can change it). */
static void gather_allocator(info_alloc *a) {
  a->name = "other";
  snprintf(a->provider, sizeof a->provider, "unknown");
  a->version[0] = '\0';

  void *m = dlsym(RTLD_DEFAULT, "malloc");
  Dl_info di;
  if (m != NULL && dladdr(m, &di) != 0 && di.dli_fname != NULL)
    snprintf(a->provider, sizeof a->provider, "%s", di.dli_fname);

  mallctl_fn mallctl = (mallctl_fn)dlsym(RTLD_DEFAULT, "mallctl");
  if (mallctl != NULL && strstr(a->provider, "jemalloc") != NULL) {
    const char *v = NULL;
    size_t len = sizeof v;
    a->name = "jemalloc";
    if (mallctl("version", &v, &len, NULL, 0) == 0 && v != NULL)
      snprintf(a->version, sizeof a->version, "%s", v);
    ssize_t dirty = 0, muzzy = 0;
    bool retain = false, bg = false;
    size_t zs = sizeof dirty, bs = sizeof retain;
    a->have_opts = mallctl("opt.dirty_decay_ms", &dirty, &zs, NULL, 0) == 0 &&
                   mallctl("opt.muzzy_decay_ms", &muzzy, &zs, NULL, 0) == 0 &&
                   mallctl("opt.retain", &retain, &bs, NULL, 0) == 0 &&
                   mallctl("opt.background_thread", &bg, &bs, NULL, 0) == 0;
    a->dirty_decay_ms = dirty;
    a->muzzy_decay_ms = muzzy;
    a->retain = retain;
    a->background_thread = bg;
    return;
  }
  if (strstr(a->provider, "libasan") != NULL || strstr(a->provider, "libtsan") != NULL) {
    a->name = "sanitizer"; /* ASan/TSan intercept malloc and bring their own allocator */
    return;
  }
  if (strstr(a->provider, "libc.so") != NULL) {
    /* gnu_get_libc_version lives in glibc itself; look it up rather than include gnu/libc-version.h
     * so the program still builds against another libc. */
    typedef const char *(*version_fn)(void);
    version_fn gv = (version_fn)dlsym(RTLD_DEFAULT, "gnu_get_libc_version");
    a->name = "glibc";
    if (gv != NULL) snprintf(a->version, sizeof a->version, "%s", gv());
  }
}

static int gather(info *in) {
  ebb_status st = ebb_driver_get_info(&in->drv);
  if (st != EBB_OK) goto fail;
  st = ebb_dev_count(&in->ndev);
  if (st != EBB_OK) goto fail;
  if (in->ndev > EBB_MAX_DEVICES) in->ndev = EBB_MAX_DEVICES;
  for (int d = 0; d < in->ndev; d++) {
    info_device *dv = &in->dev[d];
    st = ebb_dev_get_caps(d, &dv->caps);
    if (st != EBB_OK) goto fail;
    /* Topology is best effort: hwloc may be unable to place a device (containers, no PCI id). */
    dv->have_topo = ebb_dev_get_topo(d, &dv->topo) == EBB_OK;
    if (!dv->have_topo) snprintf(dv->topo_error, sizeof dv->topo_error, "%s", ebb_last_error());
  }
  gather_allocator(&in->alloc);
  return 0;

fail:
  fprintf(stderr, "ebb-info: %s: %s\n", ebb_status_name(st), ebb_last_error());
  return 1;
}

/* ---- helpers ------------------------------------------------------------------------------- */

static const char *driver_kind_str(ebb_driver_kind k) {
  switch (k) {
  case EBB_DRIVER_CUDA: return "cuda";
  case EBB_DRIVER_EMULATED: return "emulated";
  case EBB_DRIVER_CUSTOM: return "custom";
  }
  return "unknown";
}

/* Writes "vmm,host_alloc,..." into buf: the capabilities the device reports. */
static void caps_list(const ebb_dev_caps *c, char *buf, size_t n) {
  const struct { bool on; const char *name; } flags[] = {
      {c->unified_addressing, "unified_addressing"},
      {c->concurrent_kernels, "concurrent_kernels"},
      {c->vmm, "vmm"},
      {c->host_alloc, "host_alloc"},
      {c->host_register, "host_register"},
      {c->host_func, "host_func"},
      {c->peer, "peer"},
      {c->cpu_kernels, "cpu_kernels"},
  };
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
    if (!flags[i].on) continue;
    int w = snprintf(buf + used, n - used, "%s%s", used ? "," : "", flags[i].name);
    if (w < 0 || (size_t)w >= n - used) break;
    used += (size_t)w;
  }
}

static double gib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0 * 1024.0); }

/* ---- text ---------------------------------------------------------------------------------- */

static void print_text(const info *in) {
  const ebb_driver_info *d = &in->drv;
  printf("ebb %s\n\n", EBB_INFO_VERSION);
  printf("driver\n");
  printf("  name:     %s (%s)\n", d->name, driver_kind_str(d->kind));
  printf("  path:     %s\n", d->path);
  printf("  version:  %d.%d (%d)\n", d->version / 1000, (d->version % 1000) / 10, d->version);
  printf("  chosen:   %s\n", d->reason);
  printf("  devices:  %d\n", in->ndev);

  for (int i = 0; i < in->ndev; i++) {
    const info_device *dv = &in->dev[i];
    const ebb_dev_caps *c = &dv->caps;
    char caps[512];
    caps_list(c, caps, sizeof caps);
    printf("\ndevice %d: %s\n", c->ordinal, c->name);
    printf("  kind:              %s\n", c->emulated ? "emulated (CPU threads)" : "GPU");
    printf("  memory:            %zu bytes (%.2f GiB)\n", c->total_mem, gib(c->total_mem));
    if (c->emulated)
      printf("  compute:           emulated\n");
    else
      printf("  compute:           %d.%d\n", c->cc_major, c->cc_minor);
    printf("  multiprocessors:   %d\n", c->multiprocessors);
    printf("  copy engines:      %d\n", c->async_engines);
    if (c->peak_mem_gbps > 0)
      printf("  memory bandwidth:  %.0f GB/s peak (%d-bit bus, %d MHz)\n", c->peak_mem_gbps, c->mem_bus_bits,
             c->mem_clock_khz / 1000);
    printf("  stream priorities: %d (least) .. %d (greatest)\n", c->prio_least, c->prio_greatest);
    printf("  capabilities:      %s\n", caps[0] ? caps : "(none)");
    printf("  pci bus id:        %s\n", c->pci_bus_id[0] ? c->pci_bus_id : "(unknown)");
    if (dv->have_topo)
      printf("  nearest numa node: %d of %d, %d cores: %s (%s)\n", dv->topo.numa_node,
             dv->topo.numa_nodes, dv->topo.ncores, dv->topo.cpus,
             dv->topo.from_pci ? "from PCI location" : "spread over the machine");
    else
      printf("  nearest numa node: unknown (%s)\n", dv->topo_error);
  }

  printf("\nconfiguration (environment, or default)\n");
  for (size_t i = 0; i < sizeof k_config / sizeof k_config[0]; i++) {
    const char *v = getenv(k_config[i].name);
    printf("  %-21s %s%s\n", k_config[i].name, v ? v : k_config[i].fallback, v ? "" : "  [default]");
  }

  printf("\nprocess allocator\n");
  printf("  malloc:   %s%s%s\n", in->alloc.name, in->alloc.version[0] ? " " : "", in->alloc.version);
  printf("  from:     %s\n", in->alloc.provider);
  if (in->alloc.have_opts)
    printf("  settings: dirty_decay_ms:%lld muzzy_decay_ms:%lld retain:%s background_thread:%s\n",
           in->alloc.dirty_decay_ms, in->alloc.muzzy_decay_ms, in->alloc.retain ? "true" : "false",
           in->alloc.background_thread ? "true" : "false");
}

/* ---- JSON ----------------------------------------------------------------------------------
 * A tiny writer: each open object/array remembers whether it has a member yet, so callers never
 * place commas by hand. key is NULL inside arrays. */

static bool j_first[8]; /* per nesting level: no member written yet */
static int j_depth;

/* Prints s as a JSON string: quotes, backslashes and control characters escaped (RFC 8259). */
static void json_str(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    switch (*p) {
    case '"': fputs("\\\"", stdout); break;
    case '\\': fputs("\\\\", stdout); break;
    case '\b': fputs("\\b", stdout); break;
    case '\f': fputs("\\f", stdout); break;
    case '\n': fputs("\\n", stdout); break;
    case '\r': fputs("\\r", stdout); break;
    case '\t': fputs("\\t", stdout); break;
    default:
      if (*p < 0x20)
        printf("\\u%04x", *p);
      else
        putchar(*p);
    }
  }
  putchar('"');
}

/* Starts a member: the separating comma, then "key": when a key is given. */
static void j_member(const char *key) {
  if (j_depth > 0) {
    if (!j_first[j_depth]) putchar(',');
    j_first[j_depth] = false;
  }
  if (key != NULL) {
    json_str(key);
    putchar(':');
  }
}

static void j_open(const char *key, char bracket) {
  j_member(key);
  putchar(bracket);
  j_first[++j_depth] = true;
}

static void j_close(char bracket) {
  putchar(bracket);
  j_depth--;
}

static void j_string(const char *key, const char *v) {
  j_member(key);
  json_str(v);
}

static void j_int(const char *key, long long v) {
  j_member(key);
  printf("%lld", v);
}

static void j_uint(const char *key, unsigned long long v) {
  j_member(key);
  printf("%llu", v);
}

static void j_double(const char *key, double v) {
  j_member(key);
  printf("%.1f", v);
}

static void j_bool(const char *key, bool v) {
  j_member(key);
  fputs(v ? "true" : "false", stdout);
}

static void print_json(const info *in) {
  const ebb_driver_info *d = &in->drv;
  j_open(NULL, '{');
  j_string("ebb_version", EBB_INFO_VERSION);

  j_open("driver", '{');
  j_string("name", d->name);
  j_string("kind", driver_kind_str(d->kind));
  j_string("path", d->path);
  j_int("version", d->version);
  j_string("reason", d->reason);
  j_int("device_count", in->ndev);
  j_close('}');

  j_open("devices", '[');
  for (int i = 0; i < in->ndev; i++) {
    const info_device *dv = &in->dev[i];
    const ebb_dev_caps *c = &dv->caps;
    char buf[512];
    j_open(NULL, '{');
    j_int("ordinal", c->ordinal);
    j_string("name", c->name);
    j_bool("emulated", c->emulated);
    j_uint("total_mem", c->total_mem);
    snprintf(buf, sizeof buf, "%d.%d", c->cc_major, c->cc_minor);
    j_string("compute_capability", c->emulated ? "emulated" : buf);
    j_int("multiprocessors", c->multiprocessors);
    j_int("copy_engines", c->async_engines);
    j_int("mem_clock_khz", c->mem_clock_khz);
    j_int("mem_bus_bits", c->mem_bus_bits);
    j_double("peak_mem_gbps", c->peak_mem_gbps);
    j_int("priority_least", c->prio_least);
    j_int("priority_greatest", c->prio_greatest);
    /* The capability list as an array: split the comma list built for the text view. */
    caps_list(c, buf, sizeof buf);
    j_open("capabilities", '[');
    for (char *tok = strtok(buf, ","); tok != NULL; tok = strtok(NULL, ",")) j_string(NULL, tok);
    j_close(']');
    j_string("pci_bus_id", c->pci_bus_id);
    j_open("topology", '{');
    if (dv->have_topo) {
      j_int("numa_node", dv->topo.numa_node);
      j_int("numa_nodes", dv->topo.numa_nodes);
      j_int("cores", dv->topo.ncores);
      j_string("cpus", dv->topo.cpus);
      j_bool("from_pci", dv->topo.from_pci);
    } else {
      j_string("error", dv->topo_error);
    }
    j_close('}');
    j_close('}');
  }
  j_close(']');

  /* Each variable: its value, and whether it came from the environment or is ebb's default. */
  j_open("config", '{');
  for (size_t i = 0; i < sizeof k_config / sizeof k_config[0]; i++) {
    const char *v = getenv(k_config[i].name);
    j_open(k_config[i].name, '{');
    j_string("value", v ? v : k_config[i].fallback);
    j_bool("set", v != NULL);
    j_string("meaning", k_config[i].meaning);
    j_close('}');
  }
  j_close('}');

  j_open("allocator", '{');
  j_string("name", in->alloc.name);
  j_string("version", in->alloc.version);
  j_string("provider", in->alloc.provider);
  if (in->alloc.have_opts) {
    j_open("settings", '{');
    j_int("dirty_decay_ms", in->alloc.dirty_decay_ms);
    j_int("muzzy_decay_ms", in->alloc.muzzy_decay_ms);
    j_bool("retain", in->alloc.retain);
    j_bool("background_thread", in->alloc.background_thread);
    j_close('}');
  }
  j_close('}');
  j_close('}');
  putchar('\n');
}

/* ---- main ---------------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: ebb-info [--json] [--help]\n"
          "Prints the driver ebb loads, its devices, their topology, the EBB_* configuration in\n"
          "force and the process allocator.\n"
          "  --json   one JSON object instead of text\n"
          "  --help   this message\n"
          "Choose the driver with EBB_DRIVER=auto|cuda|sim|<path>; see README.md.\n");
}

int main(int argc, char **argv) {
  bool json = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "ebb-info: unknown argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }

  ebb_status st = ebb_init();
  if (st != EBB_OK) {
    fprintf(stderr, "ebb-info: ebb_init failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
    return 1;
  }

  /* ~9 KiB per device: keep it off the stack. */
  static info in;
  int rc = gather(&in);
  if (rc == 0) {
    if (json)
      print_json(&in);
    else
      print_text(&in);
  }

  st = ebb_shutdown();
  if (st != EBB_OK) {
    fprintf(stderr, "ebb-info: ebb_shutdown failed: %s: %s\n", ebb_status_name(st), ebb_last_error());
    rc = 1;
  }
  if (fflush(stdout) != 0) rc = 1;
  return rc;
}
