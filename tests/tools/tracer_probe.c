/* tracer_probe: a known sequence of allocations, run under libebb-alloc-tracer by
 * check_tracer.cmake, which compares the trace the tracer wrote with what this program did.
 *
 * Sequence (blocks below 4 KiB are not traced):
 *   1. one call of each intercepted function, a realloc that moves, `# step 1`, their frees;
 *      a block allocated while paused and its free (neither traced);
 *   2. `# threads`: THREADS threads allocate and free ITERS blocks of 4..32 KiB each; the last
 *      HANDOFF blocks each one keeps are freed by another thread;
 *   3. a fork whose child allocates and frees (not traced), and an exec of this program with
 *      `--child`, which fails (exit 3) if EBB_ALLOC_TRACE reached it (the tracer removes it);
 *   4. `# end`, the realloc'ed block left live, ebb_alloc_tracer_stop, then an allocation that
 *      must not be traced.
 * Single-threaded except for part 2. Exit 0, or 1 with a message when a call fails.
 */
#define _GNU_SOURCE /* RTLD_DEFAULT; memalign's declaration in <malloc.h> */
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define THREADS 4
#define ITERS 2000
#define HANDOFF 64 /* blocks a thread hands to the next one to free */

typedef void (*mark_fn)(const char *);
typedef void (*void_fn)(void);

static void *handoff[THREADS][HANDOFF];
static pthread_barrier_t barrier;

static void *worker(void *arg) {
  int t = (int)(size_t)arg;
  for (int i = 0; i < ITERS; i++) {
    void *p = malloc(4096 * (size_t)(1 + (i * 7 + t) % 8));
    if (p == NULL) return (void *)1;
    memset(p, 0, 16);
    if (i % 2 == 0) {
      free(p);
    } else {
      /* Hand it over: the next thread frees it after the barrier. */
      size_t k = (size_t)(i / 2) % HANDOFF;
      free(handoff[t][k]);
      handoff[t][k] = p;
    }
  }
  pthread_barrier_wait(&barrier);
  for (int k = 0; k < HANDOFF; k++) free(handoff[(t + 1) % THREADS][k]);
  return NULL;
}

static void *sym(const char *name) {
  void *f = dlsym(RTLD_DEFAULT, name);
  if (f == NULL) {
    fprintf(stderr, "tracer_probe: %s not found: is libebb-alloc-tracer preloaded?\n", name);
    exit(1);
  }
  return f;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--child") == 0) {
    free(malloc(65536));
    return getenv("EBB_ALLOC_TRACE") != NULL ? 3 : 0;
  }
  mark_fn mark;
  void_fn pause, resume, stop;
  *(void **)&mark = sym("ebb_alloc_tracer_mark");
  *(void **)&pause = sym("ebb_alloc_tracer_pause");
  *(void **)&resume = sym("ebb_alloc_tracer_resume");
  *(void **)&stop = sym("ebb_alloc_tracer_stop");

  /* 1. Each call once. */
  mark("part 1");
  void *small = malloc(100);
  void *m = malloc(8192);
  void *c = calloc(2, 4096);
  void *r = realloc(m, 1 << 20); /* large enough that glibc moves it */
  void *pm = NULL;
  int rc = posix_memalign(&pm, 64, 5000);
  void *aa = aligned_alloc(4096, 8192);
  void *ma = memalign(64, 4096);
  if (small == NULL || m == NULL || c == NULL || r == NULL || rc != 0 || aa == NULL || ma == NULL) {
    fprintf(stderr, "tracer_probe: an allocation failed\n");
    return 1;
  }
  mark("step 1\nwith a newline");
  free(c);
  free(pm);
  free(aa);
  free(ma);
  free(small);
  pause();
  void *hidden = malloc(8192);
  resume();
  free(hidden);

  /* 2. Threads. */
  mark("threads");
  pthread_t th[THREADS];
  pthread_barrier_init(&barrier, NULL, THREADS);
  for (int t = 0; t < THREADS; t++) {
    if (pthread_create(&th[t], NULL, worker, (void *)(size_t)t) != 0) {
      fprintf(stderr, "tracer_probe: pthread_create failed\n");
      return 1;
    }
  }
  for (int t = 0; t < THREADS; t++) {
    void *res = NULL;
    pthread_join(th[t], &res);
    if (res != NULL) {
      fprintf(stderr, "tracer_probe: a worker's allocation failed\n");
      return 1;
    }
  }
  pthread_barrier_destroy(&barrier);

  /* 3. A fork child and an exec'ed child. */
  mark("children");
  pid_t pid = fork();
  if (pid == 0) {
    free(malloc(65536));
    _exit(0);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "tracer_probe: the fork child failed\n");
    return 1;
  }
  pid = fork();
  if (pid == 0) {
    execl("/proc/self/exe", argv[0], "--child", (char *)NULL);
    _exit(2);
  }
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "tracer_probe: the exec'ed child failed (exit %d; 3: EBB_ALLOC_TRACE reached it)\n",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return 1;
  }

  /* 4. The end: r stays live; nothing after stop is traced. */
  mark("end");
  stop();
  void *after = malloc(8192);
  free(after);
  free(r);
  return 0;
}
