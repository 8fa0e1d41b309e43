/* ebb-train: trains a model on synthetic data with ebb, as a user of the headers would.
 *
 * A classification task whose loss must fall: inputs drawn from a seeded generator, labels from a
 * fixed random linear "teacher" the model has to learn. Two models: an MLP (the default) and a
 * small causal transformer (`--model transformer`: pre-norm blocks of multi-head attention and a
 * GELU MLP over a sequence, classified from its last position). Layers (MLP) or blocks
 * (transformer) are placed round-robin over the devices, so activations go forward and gradients
 * come back across devices. Saved tensors are offloaded to pinned host memory by default
 * (`--offload off` keeps them on the device); the update is AdamW (include/ebb/optim.h).
 *
 * Each step prints a progress line (redrawn in place on a terminal, plain lines otherwise); the
 * last line is machine-readable:
 *   loss=<first>-><last> ms_per_step=<median> peak_device_bytes=<d0,d1,...> offloaded_bytes=<n> stalls=<n>
 * At the end it writes the memory snapshot (mem.json), its timeline page (mem.html, tools/memviz.c)
 * and the trace (trace.json). Each file is written beside its final name and renamed into place,
 * so a failed run leaves no partial file.
 *
 * Memory is owner-tagged as a training framework would tag it: parameters by layer, the forward's
 * activations by the layer that made them; autograd tags gradients, saved tensors and backward
 * temporaries, the optimizer its state.
 *
 * Exit codes: 0 trained, 1 ebb failed (its message on stderr), 2 bad command line or settings.
 */
#define _GNU_SOURCE /* fileno, strdup */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ebb/ebb.h"
#include "memviz.h"

#define MAX_LAYERS 256
#define MAX_DEVICES 64
#define CLASSES 10
#define MLP_IN 64      /* input features of the MLP */
#define SEQ 16         /* transformer: tokens per sequence */
#define TOKEN_IN 16    /* transformer: features per input token */
#define HEADS 4

typedef enum model_kind { MODEL_MLP, MODEL_TRANSFORMER } model_kind;
enum { DIST_NONE, DIST_MPI, DIST_NCCL };

typedef struct options {
  model_kind model;
  long steps, layers, hidden, batch, devices; /* devices 0: all */
  bool offload, quiet;
  int dist; /* DIST_NONE, DIST_MPI, DIST_NCCL */
  int64_t device_budget;
  uint64_t seed;
  const char *snapshot, *timeline, *trace;
} options;

/* The largest storage the model saves for backward, in bytes: the MLP's linear inputs and ReLU
 * outputs ([batch, width]); the transformer's qkv projection (its heads are views of it), MLP
 * hidden activation, attention probabilities and input ([batch, tokens, ...]). */
static int64_t largest_saved_bytes(const options *o) {
  int64_t w;
  if (o->model == MODEL_MLP) {
    w = o->hidden > MLP_IN ? o->hidden : MLP_IN;
    return o->batch * w * (int64_t)sizeof(float);
  }
  w = 4 * o->hidden;
  if ((int64_t)HEADS * SEQ > w) w = (int64_t)HEADS * SEQ;
  if (TOKEN_IN > w) w = TOKEN_IN;
  return o->batch * SEQ * w * (int64_t)sizeof(float);
}

#define OFFLOAD_MIN_BYTES (64 * 1024) /* smaller saved storages stay on the device */

/* ---- command line ---------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: ebb-train [options]\n"
          "Trains a classifier on synthetic data across every device, offloading saved tensors.\n"
          "  --model mlp|transformer  the model (default mlp)\n"
          "  --steps N                training steps (default 40)\n"
          "  --devices N              devices to use, round-robin (default: all)\n"
          "  --layers N               linear layers (mlp, default 8) or blocks (transformer, default 4)\n"
          "  --hidden N               hidden width (default 512 mlp, 128 transformer; transformer: a multiple of %d)\n"
          "  --batch N                examples per step (default 512 mlp, 32 transformer)\n"
          "  --offload on|off         offload saved tensors to pinned memory (default on)\n"
          "  --device-budget BYTES    offload: saved bytes kept per device (K/M/G suffix; default 0, no cap)\n"
          "  --seed N                 seed of the data and the initial weights (default 1)\n"
          "  --dist none|mpi|nccl     data-parallel over the ranks of an mpirun job: each rank trains\n"
          "                           on its own batches on one device (its local rank modulo the\n"
          "                           device count) and gradients are averaged over the ranks during\n"
          "                           backward (include/ebb/ddp.h); mpi: Open MPI on any device, nccl:\n"
          "                           NCCL on CUDA GPUs. Rank 0 prints and writes the files; every rank\n"
          "                           needs the same options but --offload, --device-budget, --quiet\n"
          "                           and the files (default none)\n"
          "  --snapshot FILE          memory snapshot JSON (default mem.json)\n"
          "  --timeline FILE          memory timeline page (default mem.html)\n"
          "  --trace FILE             Chrome/Perfetto trace (default trace.json)\n"
          "  --quiet                  print only the last line\n"
          "The last line: loss=<first>-><last> ms_per_step=<median> peak_device_bytes=<d0,...>\n"
          "offloaded_bytes=<n> stalls=<n>, with --dist also ranks=<n> params_in_sync=yes (the loss is\n"
          "the mean over the ranks, the rest rank 0's). Exit codes: 0 ok, 1 ebb failed, 2 bad options.\n",
          HEADS);
}

static int bad_option(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "ebb-train: ");
  fprintf(stderr, fmt, a, b);
  fprintf(stderr, "\n(ebb-train --help lists the options)\n");
  return 2;
}

/* A positive count up to `max`. */
static bool parse_count(const char *s, long max, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v <= 0 || v > max) return false;
  *out = v;
  return true;
}

/* Bytes with an optional K, M, G or T suffix (powers of 1024). */
static bool parse_bytes(const char *s, int64_t *out) {
  char *end;
  errno = 0;
  if (*s == '-') return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s) return false;
  unsigned shift = 0;
  if (*end) {
    const char *units = "KMGT";
    const char *u = strchr(units, *end);
    if (!u || end[1]) return false;
    shift = 10u * (unsigned)(u - units + 1);
  }
  if (v > ((unsigned long long)INT64_MAX >> shift)) return false;
  *out = (int64_t)(v << shift);
  return true;
}

static int parse_args(int argc, char **argv, options *o) {
  *o = (options){.model = MODEL_MLP, .steps = 40, .offload = true, .seed = 1,
                 .snapshot = "mem.json", .timeline = "mem.html", .trace = "trace.json"};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      exit(0);
    }
    if (!strcmp(a, "--quiet")) {
      o->quiet = true;
      continue;
    }
    static const char *const with_value[] = {"--model", "--steps", "--devices", "--layers", "--hidden", "--batch",
                                             "--offload", "--device-budget", "--seed", "--snapshot", "--timeline",
                                             "--trace", "--dist"};
    bool known = false;
    for (size_t k = 0; k < sizeof with_value / sizeof *with_value; k++) known |= !strcmp(a, with_value[k]);
    if (!known) return bad_option("unknown option '%s'%s", a, "");
    if (i + 1 >= argc) return bad_option("%s needs a value%s", a, "");
    const char *v = argv[++i];
    if (!strcmp(a, "--model")) {
      if (!strcmp(v, "mlp")) o->model = MODEL_MLP;
      else if (!strcmp(v, "transformer")) o->model = MODEL_TRANSFORMER;
      else return bad_option("--model '%s': expected mlp or transformer%s", v, "");
    } else if (!strcmp(a, "--steps")) {
      if (!parse_count(v, 1000000, &o->steps)) return bad_option("--steps '%s': expected a count from 1 to 1000000%s", v, "");
    } else if (!strcmp(a, "--devices")) {
      if (!parse_count(v, MAX_DEVICES, &o->devices)) return bad_option("--devices '%s': expected a count from 1 to 64%s", v, "");
    } else if (!strcmp(a, "--layers")) {
      if (!parse_count(v, MAX_LAYERS, &o->layers)) return bad_option("--layers '%s': expected a count from 1 to 256%s", v, "");
    } else if (!strcmp(a, "--hidden")) {
      if (!parse_count(v, 65536, &o->hidden)) return bad_option("--hidden '%s': expected a width from 1 to 65536%s", v, "");
    } else if (!strcmp(a, "--batch")) {
      if (!parse_count(v, 1 << 20, &o->batch)) return bad_option("--batch '%s': expected a count from 1 to 1048576%s", v, "");
    } else if (!strcmp(a, "--offload")) {
      if (!strcmp(v, "on")) o->offload = true;
      else if (!strcmp(v, "off")) o->offload = false;
      else return bad_option("--offload '%s': expected on or off%s", v, "");
    } else if (!strcmp(a, "--dist")) {
      if (!strcmp(v, "none")) o->dist = DIST_NONE;
      else if (!strcmp(v, "mpi")) o->dist = DIST_MPI;
      else if (!strcmp(v, "nccl")) o->dist = DIST_NCCL;
      else return bad_option("--dist '%s': expected none, mpi or nccl%s", v, "");
    } else if (!strcmp(a, "--device-budget")) {
      if (!parse_bytes(v, &o->device_budget))
        return bad_option("--device-budget '%s': expected bytes, with an optional K, M, G or T suffix%s", v, "");
    } else if (!strcmp(a, "--seed")) {
      char *end;
      errno = 0;
      unsigned long long s = strtoull(v, &end, 10);
      if (errno || end == v || *end || *v == '-') return bad_option("--seed '%s': expected an integer from 0 to 2^64-1%s", v, "");
      o->seed = s;
    } else {
      if (!*v) return bad_option("%s: expected a file name, not an empty string%s", a, "");
      if (!strcmp(a, "--snapshot")) o->snapshot = v;
      else if (!strcmp(a, "--timeline")) o->timeline = v;
      else o->trace = v;
    }
  }
  if (o->dist && o->devices)
    return bad_option("--devices with --dist: each rank trains on one device, its local rank modulo the device "
                      "count%s%s", "", "");
  bool mlp = o->model == MODEL_MLP;
  if (!o->layers) o->layers = mlp ? 8 : 4;
  if (!o->hidden) o->hidden = mlp ? 512 : 128;
  if (!o->batch) o->batch = mlp ? 512 : 32;
  int64_t largest = largest_saved_bytes(o);
  if (o->offload && o->device_budget > 0 && largest >= OFFLOAD_MIN_BYTES && o->device_budget < largest) {
    fprintf(stderr, "ebb-train: --device-budget %" PRId64 " is below the largest tensor the model saves for backward "
                    "(%" PRId64 " bytes, from --batch %ld and --hidden %ld): give at least %" PRId64 ", or 0 for no cap\n",
            o->device_budget, largest, o->batch, o->hidden, largest);
    return 2;
  }
  if (!mlp && o->hidden % HEADS) {
    char h[32];
    snprintf(h, sizeof h, "%ld", o->hidden);
    return bad_option("--hidden %s: the transformer splits it over %s heads; give a multiple of 4", h, "4");
  }
  return 0;
}

/* ---- output files: written beside their final name, renamed into place -------------------- */

typedef struct out_file {
  const char *path;
  char tmp[PATH_MAX];
} out_file;

/* Proves now that `f->path` can be written (so a long run does not fail at its end), by creating
 * and removing its temporary sibling. */
static bool out_file_check(out_file *f) {
  int n = snprintf(f->tmp, sizeof f->tmp, "%s.tmp.%ld", f->path, (long)getpid());
  if (n < 0 || (size_t)n >= sizeof f->tmp) {
    fprintf(stderr, "ebb-train: output path '%s' is too long\n", f->path);
    return false;
  }
  struct stat st;
  if (stat(f->path, &st) == 0 && !S_ISREG(st.st_mode)) {
    fprintf(stderr, "ebb-train: cannot write '%s': it exists and is not a regular file\n", f->path);
    return false;
  }
  FILE *t = fopen(f->tmp, "w");
  if (!t) {
    fprintf(stderr, "ebb-train: cannot write '%s': %s\n", f->path, strerror(errno));
    return false;
  }
  fclose(t);
  remove(f->tmp);
  return true;
}

/* Two outputs with one name: the second would replace the first. */
static bool out_files_distinct(const out_file *a, const out_file *b, const char *an, const char *bn) {
  struct stat sa, sb;
  bool same = !strcmp(a->path, b->path) ||
              (stat(a->path, &sa) == 0 && stat(b->path, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino);
  if (same) fprintf(stderr, "ebb-train: %s and %s are both '%s'; give them different files\n", an, bn, a->path);
  return !same;
}

static bool out_file_commit(out_file *f) {
  if (rename(f->tmp, f->path) == 0) return true;
  fprintf(stderr, "ebb-train: cannot move '%s' to '%s': %s\n", f->tmp, f->path, strerror(errno));
  remove(f->tmp);
  return false;
}

/* ---- synthetic data ------------------------------------------------------------------------- */

/* splitmix64: a seeded stream for the data and the teacher. */
static uint64_t next_u64(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static float next_normal(uint64_t *s) {
  double u1 = ((double)(next_u64(s) >> 11) + 1.0) / 9007199254740993.0; /* (0, 1] */
  double u2 = (double)(next_u64(s) >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Fills x (rows of `feat` features, `per_row` of them per example: the tokens of a sequence) and
 * labels: each label is the class whose teacher column scores the example's summed features
 * highest, a task an MLP and a causal transformer's last position can both learn. */
static void make_batch(uint64_t *rng, const float *teacher, long batch, long per_row, long feat, float *x,
                       int64_t *labels) {
  for (long b = 0; b < batch; b++) {
    double score[CLASSES] = {0};
    for (long r = 0; r < per_row; r++) {
      float *row = x + (b * per_row + r) * feat;
      for (long f = 0; f < feat; f++) {
        row[f] = next_normal(rng);
        for (int c = 0; c < CLASSES; c++) score[c] += (double)row[f] * teacher[f * CLASSES + c];
      }
    }
    int best = 0;
    for (int c = 1; c < CLASSES; c++)
      if (score[c] > score[best]) best = c;
    labels[b] = best;
  }
}

/* ---- the model ------------------------------------------------------------------------------ */

typedef struct linear {
  ebb_tensor_t *w, *b; /* w [out, in], b [out] */
} linear;

typedef struct norm {
  ebb_tensor_t *w, *b;
} norm;

typedef struct block { /* transformer block */
  int device;
  norm ln1, ln2;
  linear qkv, proj, up, down;
  ebb_tensor_t *mask; /* [SEQ, SEQ]: 0 on and below the diagonal, -inf above */
} block;

typedef struct model {
  options opt;
  int dev0, ndev;         /* the devices dev0 .. dev0 + ndev - 1 */
  ebb_tensor_t **plist;   /* every parameter, in creation order (the reducer's list) */
  int np, pcap;
  int rank, size;         /* --dist: this process's rank and the job's size; else 0 and 1 */
  ebb_pg_t *cpu_pg, *pg;  /* --dist: a CPU group (the loss, the final check) and the device's */
  ebb_reducer_t *red;     /* --dist: averages the gradients during backward */
  long nlin;               /* MLP: its linear layers */
  linear lin[MAX_LAYERS];  /* MLP layers; transformer: [0] the input projection, [1] the head */
  int lin_dev[MAX_LAYERS];
  block blk[MAX_LAYERS];
  norm ln_f;
  ebb_optim_t *opt_state;
  ebb_params_t *params;
  float teacher[TOKEN_IN > MLP_IN ? TOKEN_IN * CLASSES : MLP_IN * CLASSES];
} model;

/* The tensors one step makes, released together after the optimizer step. */
typedef struct temps {
  ebb_tensor_t **t;
  size_t n, cap;
} temps;

static ebb_status keep(temps *tp, ebb_tensor_t *t) {
  if (tp->n == tp->cap) {
    size_t cap = tp->cap ? tp->cap * 2 : 256;
    ebb_tensor_t **p = realloc(tp->t, cap * sizeof *p);
    if (!p) {
      ebb_tensor_release(t);
      fprintf(stderr, "ebb-train: out of host memory\n");
      return EBB_ENOMEM;
    }
    tp->t = p;
    tp->cap = cap;
  }
  tp->t[tp->n++] = t;
  return EBB_OK;
}

static void release_all(temps *tp) {
  for (size_t i = 0; i < tp->n; i++) ebb_tensor_release(tp->t[i]);
  tp->n = 0;
}

/* Runs `call`, which writes a new tensor into `out`, and keeps that tensor for release. */
#define OP(out, call)                                                                                 \
  do {                                                                                                \
    ebb_status op_st_ = (call);                                                                       \
    if (op_st_ != EBB_OK) return op_st_;                                                              \
    if ((op_st_ = keep(tp, (out))) != EBB_OK) return op_st_;                                          \
  } while (0)
#define CK(call)                                                                                      \
  do {                                                                                                \
    ebb_status ck_st_ = (call);                                                                       \
    if (ck_st_ != EBB_OK) return ck_st_;                                                              \
  } while (0)

/* A parameter on `device`: normal * scale (scale 0: zeros, 1 with ones: a norm's weight), owned
 * by "<name>", requiring a gradient, added to the optimizer's list. */
static ebb_status make_param(model *m, int device, int ndim, const int64_t *shape, double scale, bool ones,
                             const char *name, uint64_t *seed_offset, ebb_tensor_t **out) {
  CK(ebb_alloc_owner_push(EBB_OWNER_PARAMETER, name));
  ebb_status st;
  if (ones) st = ebb_tensor_ones(device, EBB_F32, ndim, shape, out);
  else if (scale == 0) st = ebb_tensor_zeros(device, EBB_F32, ndim, shape, out);
  else {
    st = ebb_tensor_randn(device, EBB_F32, ndim, shape, m->opt.seed, *seed_offset, out);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    *seed_offset += (uint64_t)n;
    if (st == EBB_OK && (st = ebb_op_mul_scalar_(*out, scale)) != EBB_OK) {
      ebb_tensor_release(*out);
      *out = NULL;
    }
  }
  ebb_alloc_owner_pop();
  if (st != EBB_OK) return st;
  if ((st = ebb_tensor_set_name(*out, name)) || (st = ebb_tensor_set_requires_grad(*out, true)) ||
      (st = ebb_params_add(m->params, *out))) {
    ebb_tensor_release(*out);
    *out = NULL;
    return st;
  }
  if (m->np == m->pcap) {
    int cap = m->pcap ? 2 * m->pcap : 64;
    ebb_tensor_t **p = realloc(m->plist, (size_t)cap * sizeof *p);
    if (!p) {
      fprintf(stderr, "ebb-train: out of host memory\n");
      return EBB_ENOMEM; /* *out stays the caller's: the model frees it */
    }
    m->plist = p;
    m->pcap = cap;
  }
  m->plist[m->np++] = *out;
  return EBB_OK;
}

static ebb_status make_linear(model *m, int device, int64_t in, int64_t out, const char *name, uint64_t *off,
                              linear *l) {
  char n[96];
  int64_t ws[2] = {out, in}, bs[1] = {out};
  snprintf(n, sizeof n, "%s.weight", name);
  CK(make_param(m, device, 2, ws, 1.0 / sqrt((double)in), false, n, off, &l->w));
  snprintf(n, sizeof n, "%s.bias", name);
  return make_param(m, device, 1, bs, 0, false, n, off, &l->b);
}

static ebb_status make_norm(model *m, int device, int64_t width, const char *name, uint64_t *off, norm *l) {
  char n[96];
  int64_t s[1] = {width};
  snprintf(n, sizeof n, "%s.weight", name);
  CK(make_param(m, device, 1, s, 0, true, n, off, &l->w));
  snprintf(n, sizeof n, "%s.bias", name);
  return make_param(m, device, 1, s, 0, false, n, off, &l->b);
}

static ebb_status build_model(model *m) {
  const options *o = &m->opt;
  uint64_t off = 0, rng = o->seed ^ 0x7465616368657273ull; /* the teacher's own stream */
  for (size_t i = 0; i < sizeof m->teacher / sizeof *m->teacher; i++) m->teacher[i] = next_normal(&rng);
  CK(ebb_params_create(&m->params));
  char name[64];
  if (o->model == MODEL_MLP) {
    m->nlin = o->layers;
    for (long i = 0; i < m->nlin; i++) {
      int64_t in = i == 0 ? MLP_IN : o->hidden, out = i == m->nlin - 1 ? CLASSES : o->hidden;
      m->lin_dev[i] = m->dev0 + (int)(i % m->ndev);
      snprintf(name, sizeof name, "layer%ld", i);
      CK(make_linear(m, m->lin_dev[i], in, out, name, &off, &m->lin[i]));
    }
  } else {
    int64_t d = o->hidden;
    CK(make_linear(m, m->dev0, TOKEN_IN, d, "embed", &off, &m->lin[0]));
    for (long k = 0; k < o->layers; k++) {
      block *b = &m->blk[k];
      b->device = m->dev0 + (int)(k % m->ndev);
      snprintf(name, sizeof name, "block%ld.ln1", k);
      CK(make_norm(m, b->device, d, name, &off, &b->ln1));
      snprintf(name, sizeof name, "block%ld.attn.qkv", k);
      CK(make_linear(m, b->device, d, 3 * d, name, &off, &b->qkv));
      snprintf(name, sizeof name, "block%ld.attn.proj", k);
      CK(make_linear(m, b->device, d, d, name, &off, &b->proj));
      snprintf(name, sizeof name, "block%ld.ln2", k);
      CK(make_norm(m, b->device, d, name, &off, &b->ln2));
      snprintf(name, sizeof name, "block%ld.mlp.up", k);
      CK(make_linear(m, b->device, d, 4 * d, name, &off, &b->up));
      snprintf(name, sizeof name, "block%ld.mlp.down", k);
      CK(make_linear(m, b->device, 4 * d, d, name, &off, &b->down));
      float mask[SEQ * SEQ];
      for (int i = 0; i < SEQ; i++)
        for (int j = 0; j < SEQ; j++) mask[i * SEQ + j] = j <= i ? 0.0f : -INFINITY;
      int64_t ms[2] = {SEQ, SEQ};
      CK(ebb_tensor_from_host(b->device, EBB_F32, 2, ms, mask, sizeof mask, &b->mask));
    }
    int last = m->blk[o->layers - 1].device;
    CK(make_norm(m, last, d, "ln_f", &off, &m->ln_f));
    CK(make_linear(m, last, d, CLASSES, "head", &off, &m->lin[1]));
  }
  ebb_adamw_options ao = ebb_adamw_defaults();
  ao.lr = o->model == MODEL_MLP ? 2e-3 : 1e-3;
  return ebb_optim_adamw(m->params, &ao, &m->opt_state);
}

static void free_model(model *m) {
  if (m->red) ebb_reducer_destroy(m->red); /* before the parameters: it holds them */
  free(m->plist);
  if (m->opt_state) ebb_optim_destroy(m->opt_state);
  if (m->params) ebb_params_destroy(m->params);
  ebb_tensor_t *all[] = {m->ln_f.w, m->ln_f.b};
  for (size_t i = 0; i < 2; i++)
    if (all[i]) ebb_tensor_release(all[i]);
  for (int i = 0; i < MAX_LAYERS; i++) {
    if (m->lin[i].w) ebb_tensor_release(m->lin[i].w);
    if (m->lin[i].b) ebb_tensor_release(m->lin[i].b);
    block *b = &m->blk[i];
    ebb_tensor_t *bt[] = {b->ln1.w, b->ln1.b, b->ln2.w, b->ln2.b, b->qkv.w, b->qkv.b, b->proj.w, b->proj.b,
                          b->up.w, b->up.b, b->down.w, b->down.b, b->mask};
    for (size_t k = 0; k < sizeof bt / sizeof *bt; k++)
      if (bt[k]) ebb_tensor_release(bt[k]);
  }
}

/* Intermediates are released as soon as nothing later in the forward reads them, as a Python
 * training loop drops them when its variables are rebound or go out of scope: what the backward
 * needs, the graph keeps (and offloads). `mark`/`release_since` scope a group of them. */
static void release_since(temps *tp, size_t mark, ebb_tensor_t *keep_t) {
  for (size_t i = mark; i < tp->n; i++)
    if (tp->t[i] != keep_t) ebb_tensor_release(tp->t[i]);
  tp->n = mark;
  if (keep_t) tp->t[tp->n++] = keep_t; /* the slot at mark is free: no allocation */
}

/* x moved to `device` when it is elsewhere (a differentiable copy: its gradient goes back). */
static ebb_status on_device(temps *tp, ebb_tensor_t *x, int device, ebb_tensor_t **out) {
  int d;
  CK(ebb_tensor_device(x, &d));
  if (d == device) {
    *out = x;
    return EBB_OK;
  }
  OP(*out, ebb_tensor_to_device(x, device, out));
  return EBB_OK;
}

/* One MLP layer: h (kept in tp) -> relu(linear(h)) on the layer's device, the only tensor left in
 * tp from `mark` on. */
static ebb_status mlp_layer(model *m, temps *tp, long i, ebb_tensor_t *h, ebb_tensor_t **out) {
  CK(on_device(tp, h, m->lin_dev[i], &h));
  OP(h, ebb_op_linear(h, m->lin[i].w, m->lin[i].b, &h));
  if (i + 1 < m->nlin) OP(h, ebb_op_relu(h, &h));
  *out = h;
  return EBB_OK;
}

static ebb_status mlp_forward(model *m, temps *tp, ebb_tensor_t *x, ebb_tensor_t **logits) {
  ebb_tensor_t *h = x;
  size_t mark = tp->n; /* x stays: the caller's */
  for (long i = 0; i < m->nlin; i++) {
    char name[32];
    snprintf(name, sizeof name, "layer%ld", i);
    CK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, name));
    ebb_status st = mlp_layer(m, tp, i, h, &h);
    ebb_alloc_owner_pop();
    if (st != EBB_OK) return st;
    release_since(tp, mark, h); /* the layer's input and its pre-activation go */
  }
  *logits = h;
  return EBB_OK;
}

/* [B, T, D] -> [B, H, T, D/H] */
static ebb_status split_heads(temps *tp, ebb_tensor_t *x, int64_t b, int64_t d, ebb_tensor_t **out) {
  int64_t s[4] = {b, SEQ, HEADS, d / HEADS};
  int perm[4] = {0, 2, 1, 3};
  ebb_tensor_t *r;
  OP(r, ebb_tensor_reshape(x, 4, s, &r));
  OP(*out, ebb_tensor_permute(r, perm, 4, out));
  return EBB_OK;
}

/* Causal multi-head self-attention of x [B, T, D]; its intermediates are released before it
 * returns, the output stays kept in tp. */
static ebb_status attention(const block *blk, temps *tp, ebb_tensor_t *x, int64_t b, int64_t d, ebb_tensor_t **out) {
  size_t mark = tp->n;
  ebb_tensor_t *qkv, *q, *k, *v, *kt, *s, *ss, *sm, *p, *o, *om, *oc;
  OP(qkv, ebb_op_linear(x, blk->qkv.w, blk->qkv.b, &qkv));
  ebb_tensor_t *part[3];
  for (int i = 0; i < 3; i++) OP(part[i], ebb_tensor_narrow(qkv, 2, i * d, d, &part[i]));
  CK(split_heads(tp, part[0], b, d, &q));
  CK(split_heads(tp, part[1], b, d, &k));
  CK(split_heads(tp, part[2], b, d, &v));
  OP(kt, ebb_tensor_transpose(k, 2, 3, &kt));
  OP(s, ebb_op_matmul(q, kt, &s));
  OP(ss, ebb_op_mul_scalar(s, 1.0 / sqrt((double)(d / HEADS)), &ss));
  OP(sm, ebb_op_add(ss, blk->mask, &sm));
  OP(p, ebb_op_softmax(sm, 3, &p));
  OP(o, ebb_op_matmul(p, v, &o));
  int perm[4] = {0, 2, 1, 3};
  int64_t merged[3] = {b, SEQ, d};
  OP(om, ebb_tensor_permute(o, perm, 4, &om));
  OP(oc, ebb_tensor_reshape(om, 3, merged, &oc));
  OP(*out, ebb_op_linear(oc, blk->proj.w, blk->proj.b, out));
  release_since(tp, mark, *out);
  return EBB_OK;
}

/* A pre-norm block: h + attn(ln1(h)), then + mlp(ln2(.)). Leaves only its output kept in tp
 * from `mark` on. */
static ebb_status block_forward(const block *blk, temps *tp, ebb_tensor_t *h, int64_t b, int64_t d, ebb_tensor_t **out) {
  ebb_tensor_t *n1, *a, *h1, *n2, *u, *g, *dn;
  OP(n1, ebb_op_layer_norm(h, 1, blk->ln1.w, blk->ln1.b, 1e-5, &n1));
  CK(attention(blk, tp, n1, b, d, &a));
  OP(h1, ebb_op_add(h, a, &h1));
  OP(n2, ebb_op_layer_norm(h1, 1, blk->ln2.w, blk->ln2.b, 1e-5, &n2));
  OP(u, ebb_op_linear(n2, blk->up.w, blk->up.b, &u));
  OP(g, ebb_op_gelu(u, &g));
  OP(dn, ebb_op_linear(g, blk->down.w, blk->down.b, &dn));
  OP(*out, ebb_op_add(h1, dn, out));
  return EBB_OK;
}

static ebb_status transformer_forward(model *m, temps *tp, ebb_tensor_t *x, ebb_tensor_t **logits) {
  int64_t b = m->opt.batch, d = m->opt.hidden;
  size_t mark = tp->n;
  ebb_tensor_t *h;
  CK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "embed"));
  ebb_status st = ebb_op_linear(x, m->lin[0].w, m->lin[0].b, &h);
  if (st == EBB_OK) st = keep(tp, h);
  ebb_alloc_owner_pop();
  if (st != EBB_OK) return st;
  for (long k = 0; k < m->opt.layers; k++) {
    char name[32];
    snprintf(name, sizeof name, "block%ld", k);
    CK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, name));
    st = on_device(tp, h, m->blk[k].device, &h);
    if (st == EBB_OK) st = block_forward(&m->blk[k], tp, h, b, d, &h);
    ebb_alloc_owner_pop();
    if (st != EBB_OK) return st;
    release_since(tp, mark, h);
  }
  ebb_tensor_t *n, *last;
  CK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "head"));
  st = ebb_op_layer_norm(h, 1, m->ln_f.w, m->ln_f.b, 1e-5, &n);
  if (st == EBB_OK && (st = keep(tp, n)) == EBB_OK && (st = ebb_tensor_select(n, 1, SEQ - 1, &last)) == EBB_OK &&
      (st = keep(tp, last)) == EBB_OK && (st = ebb_op_linear(last, m->lin[1].w, m->lin[1].b, logits)) == EBB_OK)
    st = keep(tp, *logits);
  ebb_alloc_owner_pop();
  if (st == EBB_OK) release_since(tp, mark, *logits);
  return st;
}

/* ---- one step ------------------------------------------------------------------------------- */

typedef struct data {
  float *x;
  int64_t *labels;
  long rows_per_example, feat;
  uint64_t rng;
} data;

static ebb_status train_step(model *m, data *dt, temps *tp, float *loss_out) {
  const options *o = &m->opt;
  make_batch(&dt->rng, m->teacher, o->batch, dt->rows_per_example, dt->feat, dt->x, dt->labels);
  bool mlp = o->model == MODEL_MLP;
  int first = mlp ? m->lin_dev[0] : m->dev0;
  int last = mlp ? m->lin_dev[m->nlin - 1] : m->blk[o->layers - 1].device;
  int64_t xs[3] = {o->batch, mlp ? MLP_IN : SEQ, TOKEN_IN}, ys[1] = {o->batch};
  size_t xbytes = (size_t)o->batch * (size_t)dt->rows_per_example * (size_t)dt->feat * sizeof(float);
  ebb_tensor_t *x, *y, *logits, *loss;
  CK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "input"));
  ebb_status st = ebb_tensor_from_host(first, EBB_F32, mlp ? 2 : 3, xs, dt->x, xbytes, &x);
  if (st == EBB_OK && (st = keep(tp, x)) == EBB_OK &&
      (st = ebb_tensor_from_host(last, EBB_I64, 1, ys, dt->labels, (size_t)o->batch * sizeof(int64_t), &y)) == EBB_OK)
    st = keep(tp, y);
  ebb_alloc_owner_pop();
  if (st != EBB_OK) return st;

  if (o->offload) {
    /* Reloads run at most two of the largest saved tensors ahead of the node that reads them, so
     * the backward does not bring every activation back at once. */
    int64_t window = 2 * largest_saved_bytes(o);
    ebb_offload_policy pol = {.version = EBB_OFFLOAD_POLICY_VERSION,
                              .min_bytes = OFFLOAD_MIN_BYTES,
                              .device_budget_bytes = o->device_budget,
                              .prefetch_window_bytes = window > OFFLOAD_MIN_BYTES ? window : OFFLOAD_MIN_BYTES};
    CK(ebb_offload_scope_enter(&pol));
  }
  st = mlp ? mlp_forward(m, tp, x, &logits) : transformer_forward(m, tp, x, &logits);
  if (st == EBB_OK) {
    CK(ebb_alloc_owner_push(EBB_OWNER_ACTIVATION, "loss"));
    size_t mark = tp->n - 1; /* logits, the forward's last */
    st = ebb_op_cross_entropy(logits, y, &loss);
    if (st == EBB_OK) st = keep(tp, loss);
    ebb_alloc_owner_pop();
    if (st == EBB_OK) release_since(tp, mark, loss);
  }
  if (o->offload) {
    ebb_status ex = ebb_offload_scope_exit();
    if (st == EBB_OK) st = ex;
  }
  if (st != EBB_OK) return st;
  if (m->red) {
    /* Data-parallel: the buckets are the gradients; finish waits for the last all-reduce (on the
     * device, stream to stream), so the step reads averaged gradients. */
    CK(ebb_reducer_zero_grad(m->red));
    CK(ebb_backward_one(loss));
    CK(ebb_reducer_finish(m->red));
  } else {
    CK(ebb_optim_zero_grad(m->opt_state, true));
    CK(ebb_backward_one(loss));
  }
  CK(ebb_optim_step(m->opt_state));
  CK(ebb_tensor_to_host(loss, loss_out, sizeof *loss_out));
  if (m->cpu_pg) { /* the loss reported is the mean over the ranks */
    int64_t one = 1;
    ebb_tensor_t *l;
    CK(ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_F32, 1, &one, loss_out, sizeof *loss_out, &l));
    ebb_status st2 = ebb_all_reduce(m->cpu_pg, l, EBB_REDUCE_AVG, NULL);
    if (st2 == EBB_OK) st2 = ebb_tensor_to_host(l, loss_out, sizeof *loss_out);
    ebb_tensor_release(l);
    return st2;
  }
  return EBB_OK;
}

/* ---- reporting ------------------------------------------------------------------------------ */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void human(char *buf, size_t cap, uint64_t bytes) {
  if (bytes >= (1ull << 30)) snprintf(buf, cap, "%.2f GiB", (double)bytes / (1ull << 30));
  else if (bytes >= (1ull << 20)) snprintf(buf, cap, "%.1f MiB", (double)bytes / (1ull << 20));
  else snprintf(buf, cap, "%.1f KiB", (double)bytes / 1024.0);
}

static void progress(const model *m, long step, float loss, double ms, bool tty) {
  char line[512], b[32];
  int n = snprintf(line, sizeof line, "step %ld/%ld  loss %.4f  %.1f ms/step  peak", step + 1, m->opt.steps,
                   (double)loss, ms);
  for (int d = m->dev0; d < m->dev0 + m->ndev && n < (int)sizeof line; d++) {
    ebb_arena_stats s;
    if (ebb_arena_get_stats(d, &s) != EBB_OK) continue;
    human(b, sizeof b, s.allocated_bytes.peak);
    n += snprintf(line + n, sizeof line - (size_t)n, " dev%d %s", d, b);
  }
  ebb_offload_stats os = {0};
  ebb_offload_get_stats(&os);
  if (n < (int)sizeof line) {
    char p[32], off[32];
    human(p, sizeof p, os.pinned_peak_bytes);
    human(off, sizeof off, os.bytes_offloaded);
    snprintf(line + n, sizeof line - (size_t)n, "  pinned peak %s  offloaded %s  stalls %" PRIu64, p, off, os.stalls);
  }
  /* A line longer than the terminal wraps, and \r would redraw only its last row: cut it. */
  struct winsize ws;
  if (tty && ioctl(fileno(stdout), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 && strlen(line) >= ws.ws_col)
    line[ws.ws_col - 1] = 0;
  if (tty) printf("\r\033[2K%s", line);
  else printf("%s\n", line);
  fflush(stdout);
}

/* ---- main ----------------------------------------------------------------------------------- */

/* EBB_TRAIN_SYSCALL_MARKERS=N (N >= 1) brackets the steady-state steps for perf/train_syscalls.sh,
 * which counts their system calls under strace: an access() of a path that cannot exist fails
 * harmlessly and shows the path in strace's log, "steady-begin" after the first N steps (the
 * warm-up) and "steady-end" after the last. Unset, empty or 0: no markers. -1: a bad value. */
static long syscall_markers_warmup(void) {
  const char *v = getenv("EBB_TRAIN_SYSCALL_MARKERS");
  if (!v || !*v) return 0;
  char *end;
  errno = 0;
  long n = strtol(v, &end, 10);
  return errno || *end || n < 0 ? -1 : n;
}

static void syscall_marker(const char *what) {
  char path[64];
  snprintf(path, sizeof path, "/nonexistent/ebb-train:%s", what);
  (void)access(path, F_OK);
}

static int fail(const char *what) {
  fprintf(stderr, "ebb-train: %s: %s\n", what, ebb_last_error());
  return 1;
}

/* This process's rank among those of its machine, from the launcher (Open MPI, MPICH, Slurm), so
 * that ranks on one machine take different devices; the global rank where none says. */
static int local_rank(int rank) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
    const char *v = getenv(vars[i]);
    char *end;
    long r = v && *v ? strtol(v, &end, 10) : -1;
    if (r >= 0 && r < INT_MAX && v && *end == '\0') return (int)r;
  }
  return rank;
}

/* --dist, a rank that failed: the others may wait in a collective for it, and a shutdown would
 * wait for them (MPI's finalisation is collective), so the process ends here and mpirun ends the
 * job, naming this rank. _exit, not exit: MPI's threads still run, and exit-time work (a leak
 * checker's walk of the threads, MPI's own handlers) could hang or fail in them. */
static _Noreturn void dist_abandon(int rc) {
  fflush(stdout);
  fflush(stderr);
  _exit(rc);
}

/* --dist: the options every rank must share, checked against rank 0's over the CPU group before
 * anything else is collective. Ranks that differ would build different models (the reducer would
 * refuse them, naming a parameter rather than the option), draw from another task (--seed), or
 * run another number of steps: one rank waiting in a collective the others never issue until the
 * groups' timeout. Memory settings (--offload, --device-budget) may differ. 0, or the exit code. */
static int options_agree(const model *m) {
  enum { NOPT = 7 };
  static const char *const names[NOPT] = {"--dist", "--model", "--steps", "--layers", "--hidden", "--batch", "--seed"};
  const options *o = &m->opt;
  int64_t mine[NOPT] = {o->dist, o->model, o->steps, o->layers, o->hidden, o->batch, (int64_t)o->seed};
  int64_t n = NOPT, shape[2] = {m->size, NOPT};
  int64_t *all = calloc((size_t)m->size * NOPT, sizeof *all);
  ebb_tensor_t *in = NULL, *out = NULL;
  ebb_status st = all ? EBB_OK : EBB_ENOMEM;
  if (st == EBB_OK) st = ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_I64, 1, &n, mine, sizeof mine, &in);
  if (st == EBB_OK) st = ebb_tensor_empty(EBB_DEVICE_CPU, EBB_I64, 2, shape, &out);
  if (st == EBB_OK) st = ebb_all_gather(m->cpu_pg, out, in, NULL);
  if (st == EBB_OK) st = ebb_tensor_to_host(out, all, (size_t)m->size * NOPT * sizeof *all);
  if (in) ebb_tensor_release(in);
  if (out) ebb_tensor_release(out);
  if (st != EBB_OK) {
    fprintf(stderr, "ebb-train: --dist: rank %d, comparing the ranks' options: %s\n", m->rank,
            all ? ebb_last_error() : "out of host memory");
    free(all);
    return 1;
  }
  /* The first difference from rank 0's, reported by rank 0 and by each rank that differs (a rank
   * that exits first may end the job before another has printed). */
  int rc = 0;
  for (int r = 1; r < m->size && !rc; r++)
    for (int k = 0; k < NOPT && !rc; k++) {
      int64_t a = all[k], b = all[(size_t)r * NOPT + k];
      if (a == b) continue;
      rc = 2;
      if (m->rank != 0 && m->rank != r) break;
      char va[32], vb[32];
      if (k == 0) {
        static const char *const dn[] = {"none", "mpi", "nccl"};
        snprintf(va, sizeof va, "%s", a >= 0 && a < 3 ? dn[a] : "?");
        snprintf(vb, sizeof vb, "%s", b >= 0 && b < 3 ? dn[b] : "?");
      } else if (k == 1) {
        snprintf(va, sizeof va, "%s", a == MODEL_MLP ? "mlp" : "transformer");
        snprintf(vb, sizeof vb, "%s", b == MODEL_MLP ? "mlp" : "transformer");
      } else if (k == 6) {
        snprintf(va, sizeof va, "%" PRIu64, (uint64_t)a);
        snprintf(vb, sizeof vb, "%" PRIu64, (uint64_t)b);
      } else {
        snprintf(va, sizeof va, "%" PRId64, a);
        snprintf(vb, sizeof vb, "%" PRId64, b);
      }
      fprintf(stderr, "ebb-train: --dist: rank %d has %s %s, rank 0 has %s %s; expected the same %s on every rank "
                      "(every option but --offload, --device-budget, --quiet and the output files)\n", r, names[k], vb, names[k], va,
              names[k]);
    }
  free(all);
  return rc;
}

/* --dist: the groups and this rank's device (m->dev0). An unavailable backend is a setting the
 * machine cannot honour (exit 2); other failures are ebb's (exit 1). */
static int dist_start(model *m, int have) {
  /* A rank that fails ends its process and mpirun ends the job; a rank that waits on one that
   * hangs ends the job at the group's timeout instead of waiting for ever. */
  ebb_pg_options po = {0};
  po.abort_on_timeout = true;
  ebb_status st = ebb_pg_create(EBB_DIST_MPI, EBB_DEVICE_CPU, &po, &m->cpu_pg);
  if (st == EBB_OK) st = ebb_pg_rank(m->cpu_pg, &m->rank);
  if (st == EBB_OK) st = ebb_pg_size(m->cpu_pg, &m->size);
  if (st != EBB_OK) {
    fprintf(stderr, "ebb-train: --dist: the CPU process group: %s\n", ebb_last_error());
    return st == EBB_ENOTSUP ? 2 : 1;
  }
  int rc = options_agree(m);
  if (rc) return rc;
  m->dev0 = local_rank(m->rank) % have;
  m->ndev = 1;
  st = ebb_pg_create(m->opt.dist == DIST_NCCL ? EBB_DIST_NCCL : EBB_DIST_MPI, m->dev0, &po, &m->pg);
  if (st != EBB_OK) {
    fprintf(stderr, "ebb-train: --dist: rank %d, the group of device %d: %s\n", m->rank, m->dev0, ebb_last_error());
    return st == EBB_ENOTSUP ? 2 : 1;
  }
  return 0;
}

/* --dist, after training: every rank must hold the same parameters, bit for bit (the same start,
 * broadcast from rank 0, and the same averaged gradients). A hash of their bytes is gathered. */
static ebb_status params_in_sync(model *m, bool *same) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a over every parameter's bytes, in order */
  for (int i = 0; i < m->np; i++) {
    int64_t n;
    CK(ebb_tensor_numel(m->plist[i], &n));
    float *v = malloc((size_t)n * sizeof *v + 1);
    if (!v) return EBB_ENOMEM;
    ebb_status st = ebb_tensor_to_host(m->plist[i], v, (size_t)n * sizeof *v);
    for (int64_t k = 0; st == EBB_OK && k < n * (int64_t)sizeof *v; k++) h = (h ^ ((const unsigned char *)v)[k]) * 1099511628211ull;
    free(v);
    CK(st);
  }
  int64_t mine = (int64_t)h, one = 1, shape[2] = {m->size, 1};
  int64_t *all = calloc((size_t)m->size, sizeof *all);
  if (!all) return EBB_ENOMEM;
  ebb_tensor_t *in = NULL, *out = NULL;
  ebb_status st = ebb_tensor_from_host(EBB_DEVICE_CPU, EBB_I64, 1, &one, &mine, sizeof mine, &in);
  if (st == EBB_OK) st = ebb_tensor_empty(EBB_DEVICE_CPU, EBB_I64, 2, shape, &out);
  if (st == EBB_OK) st = ebb_all_gather(m->cpu_pg, out, in, NULL);
  if (st == EBB_OK) st = ebb_tensor_to_host(out, all, (size_t)m->size * sizeof *all);
  *same = true;
  for (int r = 0; st == EBB_OK && r < m->size; r++)
    if (all[r] != mine) {
      *same = false;
      if (m->rank == 0)
        fprintf(stderr, "ebb-train: rank %d's parameters differ from rank 0's after training (hash %016" PRIx64
                        " against %016" PRIx64 ")\n", r, (uint64_t)all[r], (uint64_t)mine);
    }
  if (in) ebb_tensor_release(in);
  if (out) ebb_tensor_release(out);
  free(all);
  return st;
}

int main(int argc, char **argv) {
  options o;
  int rc = parse_args(argc, argv, &o);
  if (rc) return rc;
  long marker_warmup = syscall_markers_warmup();
  if (marker_warmup < 0) {
    fprintf(stderr, "ebb-train: EBB_TRAIN_SYSCALL_MARKERS='%s': expected a count of warm-up steps (0: off)\n",
            getenv("EBB_TRAIN_SYSCALL_MARKERS"));
    return 2;
  }
  out_file files[3] = {{.path = o.snapshot}, {.path = o.timeline}, {.path = o.trace}};
  static const char *const opt_names[3] = {"--snapshot", "--timeline", "--trace"};
  for (int i = 0; i < 3; i++)
    if (!out_file_check(&files[i])) return 2;
  for (int i = 0; i < 3; i++)
    for (int k = i + 1; k < 3; k++)
      if (!out_files_distinct(&files[i], &files[k], opt_names[i], opt_names[k])) return 2;

  if (ebb_init() != EBB_OK) return fail("ebb_init");
  int have;
  if (ebb_dev_count(&have) != EBB_OK) return fail("ebb_dev_count");
  if (have == 0) {
    fprintf(stderr, "ebb-train: no device: the driver reports none (ebb-info shows why)\n");
    ebb_shutdown();
    return 2;
  }
  if (o.devices > have) {
    fprintf(stderr, "ebb-train: --devices %ld, but this machine has %d (ebb-info lists them; EBB_SIM_DEVICES sets the "
                    "emulated driver's count)\n", o.devices, have);
    ebb_shutdown();
    return 2;
  }
  model *m = calloc(1, sizeof *m);
  data dt = {0};
  temps tp = {0};
  double *ms = calloc((size_t)o.steps, sizeof *ms);
  if (!m || !ms) {
    fprintf(stderr, "ebb-train: out of host memory\n");
    return 1;
  }
  m->opt = o;
  m->ndev = o.devices ? (int)o.devices : have;
  m->size = 1;
  if (o.dist && (rc = dist_start(m, have)) != 0) dist_abandon(rc);
  bool lead = m->rank == 0; /* the rank that prints and writes the files */
  bool mlp = o.model == MODEL_MLP;
  dt.rows_per_example = mlp ? 1 : SEQ;
  dt.feat = mlp ? MLP_IN : TOKEN_IN;
  dt.rng = o.seed ^ ((uint64_t)m->rank * 0xD1B54A32D192ED03ull); /* each rank its own batches */
  dt.x = malloc((size_t)o.batch * (size_t)dt.rows_per_example * (size_t)dt.feat * sizeof(float));
  dt.labels = malloc((size_t)o.batch * sizeof(int64_t));
  if (!dt.x || !dt.labels) {
    fprintf(stderr, "ebb-train: out of host memory for a batch of %ld\n", o.batch);
    return 1;
  }
  if (ebb_trace_enable(1u << 20) != EBB_OK) return fail("ebb_trace_enable");

  rc = 0;
  const char *failed = NULL;
  float first_loss = NAN, loss = NAN;
  if (build_model(m) != EBB_OK) failed = "building the model";
  else if (m->pg) {
    /* Collective: every rank passes the same list; rank 0's values are broadcast to the others. */
    ebb_reducer_options ro = {.version = EBB_REDUCER_OPTIONS_VERSION};
    if (ebb_reducer_create(m->pg, m->plist, m->np, &ro, &m->red) != EBB_OK) failed = "attaching the reducer";
  }
  bool tty = isatty(fileno(stdout)) && !o.quiet && lead;
  bool in_steady = false;
  for (long s = 0; !failed && s < o.steps; s++) {
    if (marker_warmup && s == marker_warmup) {
      syscall_marker("steady-begin");
      in_steady = true;
    }
    double t0 = now_ms();
    if (train_step(m, &dt, &tp, &loss) != EBB_OK) {
      failed = "training step";
      break;
    }
    release_all(&tp);
    ms[s] = now_ms() - t0;
    if (s == 0) first_loss = loss;
    if (!isfinite(loss)) {
      fprintf(stderr, "%sebb-train: the loss is %f at step %ld\n", tty ? "\n" : "", (double)loss, s + 1);
      rc = 1;
      break;
    }
    if (!o.quiet && lead) progress(m, s, loss, ms[s], tty);
  }
  if (in_steady) syscall_marker("steady-end");
  if (tty) printf("\n");
  if (failed) {
    if (o.dist) fprintf(stderr, "ebb-train: rank %d: %s failed: %s\n", m->rank, failed, ebb_last_error());
    else fprintf(stderr, "ebb-train: %s failed: %s\n", failed, ebb_last_error());
    rc = 1;
  }
  release_all(&tp);
  free(tp.t);
  /* A failed step (an out-of-memory above all) still leaves the snapshot, its page and the
   * trace: they show what filled the device (with --dist, rank 0's, when rank 0 failed). */
  if (failed && lead) {
    bool wrote = ebb_memory_snapshot_json(files[0].tmp) == EBB_OK &&
                 ebb_memviz_write_html(files[0].tmp, files[1].tmp, NULL) &&
                 ebb_trace_export_json(files[2].tmp) == EBB_OK;
    for (int i = 0; i < 3 && wrote; i++) wrote = out_file_commit(&files[i]);
    if (wrote)
      fprintf(stderr, "ebb-train: the memory at the failure: %s (its timeline: %s), the trace: %s\n", o.snapshot,
              o.timeline, o.trace);
  }
  if (o.dist && rc) dist_abandon(rc);
  bool in_sync = true;
  if (o.dist && params_in_sync(m, &in_sync) != EBB_OK) return fail("comparing the ranks' parameters");
  if (!in_sync) rc = 1;
  if (rc == 0 && lead) {
    /* The step times after the first (which pays for the first allocations). */
    long skip = o.steps > 1 ? 1 : 0;
    qsort(ms + skip, (size_t)(o.steps - skip), sizeof *ms, cmp_double);
    double median = ms[skip + (o.steps - skip) / 2];
    ebb_offload_stats os = {0};
    ebb_offload_get_stats(&os);
    char peaks[MAX_DEVICES * 24] = "";
    size_t n = 0;
    for (int d = m->dev0; d < m->dev0 + m->ndev; d++) {
      ebb_arena_stats st;
      if (ebb_arena_get_stats(d, &st) != EBB_OK) return fail("ebb_arena_get_stats");
      n += (size_t)snprintf(peaks + n, sizeof peaks - n, "%s%" PRIu64, d > m->dev0 ? "," : "", st.allocated_bytes.peak);
    }
    if (ebb_memory_snapshot_json(files[0].tmp) != EBB_OK) {
      fprintf(stderr, "ebb-train: writing the snapshot '%s': %s\n", o.snapshot, ebb_last_error());
      rc = 1;
    } else if (!ebb_memviz_write_html(files[0].tmp, files[1].tmp, NULL)) {
      rc = 1;
    } else if (ebb_trace_export_json(files[2].tmp) != EBB_OK) {
      fprintf(stderr, "ebb-train: writing the trace '%s': %s\n", o.trace, ebb_last_error());
      rc = 1;
    }
    for (int i = 0; i < 3 && rc == 0; i++)
      if (!out_file_commit(&files[i])) rc = 1;
    if (rc == 0) {
      printf("loss=%.4f->%.4f ms_per_step=%.2f peak_device_bytes=%s offloaded_bytes=%" PRIu64 " stalls=%" PRIu64,
             (double)first_loss, (double)loss, median, peaks, os.bytes_offloaded, os.stalls);
      if (o.dist) printf(" ranks=%d params_in_sync=yes", m->size);
      printf("\n");
    }
  }
  for (int i = 0; i < 3; i++) remove(files[i].tmp);
  free_model(m);
  if (m->pg) ebb_pg_destroy(m->pg);
  if (m->cpu_pg) ebb_pg_destroy(m->cpu_pg);
  free(m);
  free(ms);
  free(dt.x);
  free(dt.labels);
  if (ebb_shutdown() != EBB_OK && rc == 0) return fail("ebb_shutdown");
  return rc;
}
