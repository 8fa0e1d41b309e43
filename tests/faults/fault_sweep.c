/* fault_sweep.c: runs fault_workload once per injected driver fault and requires every run to end
 * well: in a clean failure (status and message, everything released, ebb_shutdown completed), or
 * with the fault absorbed (the same result bit for bit as the run without a fault, the last error
 * untouched). A crash, a hang, a sanitizer report, anything printed on stderr (the library never
 * prints), a changed last error, a wrong result or a failed shutdown fails the sweep.
 *
 * usage: fault_sweep <workload> [first [runs [timeout_s [CUresult]]]]
 *   The reference run (a fault past the end: nothing fails) counts the workload's driver calls T,
 *   shutdown included.
 *   Then call n fails (EBB_SIM_FAULT=*:n) for every n in 1..first, and for about `runs` - `first`
 *   more calls spread evenly over the rest of 1..T (defaults 300, 450, 60 s a run). The calls a run
 *   makes vary a little with its threads' timing (polls), so call n is not the same call in every
 *   run; each run still meets exactly one fault, unless it ends before call n. The fault is the
 *   emulated driver's default (CUDA_ERROR_OUT_OF_MEMORY for allocations, the sticky
 *   CUDA_ERROR_LAUNCH_FAILED otherwise) or the CUresult given (a non-sticky CUDA_ERROR_UNKNOWN
 *   reaches the paths that absorb a failure and go on).
 * A clean failure must come from the injected fault (the workload reports FIRED 1); the sweep
 * stops after three hung runs. Prints one line per unexpected run (with its output) and a summary
 * line:
 *   fault_sweep calls=T runs=R clean=C absorbed=A not_reached=N bad=B
 * and exits 0 when bad is 0.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdbool.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { OUT_MAX = 16384 };

struct run {
  int status;    /* waitpid's, when exited or signalled */
  bool timed_out;
  char out[OUT_MAX]; /* stdout */
  char err[OUT_MAX]; /* stderr */
};

static void read_file(const char *path, char *buf) {
  buf[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f) return;
  size_t n = fread(buf, 1, OUT_MAX - 1, f);
  buf[n] = 0;
  fclose(f);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The workload being run, killed with its process group if the sweep itself is stopped. */
static volatile sig_atomic_t current_child;

static void on_stop(int sig) {
  if (current_child > 0) kill(-(pid_t)current_child, SIGKILL);
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Runs `workload` with EBB_SIM_FAULT=`fault`, killing its process group after timeout_s. */
static int run_one(const char *workload, const char *fault, double timeout_s, const char *dir, struct run *r) {
  char out_path[512], err_path[512];
  snprintf(out_path, sizeof out_path, "%s/out", dir);
  snprintf(err_path, sizeof err_path, "%s/err", dir);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    setpgid(0, 0);
    int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (o < 0 || e < 0) _exit(126);
    dup2(o, 1);
    dup2(e, 2);
    setenv("EBB_SIM_FAULT", fault, 1);
    execl(workload, workload, (char *)NULL);
    _exit(127);
  }
  setpgid(pid, pid);
  current_child = pid;
  r->timed_out = false;
  double deadline = now_s() + timeout_s;
  for (;;) {
    pid_t w = waitpid(pid, &r->status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) return -1;
    if (now_s() > deadline) {
      r->timed_out = true;
      kill(-pid, SIGKILL);
      waitpid(pid, &r->status, 0);
      break;
    }
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  current_child = 0;
  read_file(out_path, r->out);
  read_file(err_path, r->err);
  return 0;
}

static int exit_code(const struct run *r) { return !r->timed_out && WIFEXITED(r->status) ? WEXITSTATUS(r->status) : -1; }

/* The value after `key ` on a line of the run's stdout, or NULL. */
static const char *field(const struct run *r, const char *key) {
  const char *p = strstr(r->out, key);
  return p ? p + strlen(key) : NULL;
}

static void describe(const struct run *r, char *buf, size_t n) {
  if (r->timed_out)
    snprintf(buf, n, "hung (killed after the timeout)");
  else if (WIFSIGNALED(r->status))
    snprintf(buf, n, "killed by signal %d", WTERMSIG(r->status));
  else
    snprintf(buf, n, "exit %d", WEXITSTATUS(r->status));
}

/* Whether a FAIL line names a driver call (cuMemAlloc, say) or the CUDA error: a clean failure says what
 * failed where. */
static bool names_driver(const char *line) {
  if (strstr(line, "CUDA_ERROR_")) return true;
  for (const char *p = strstr(line, "cu"); p; p = strstr(p + 1, "cu"))
    if (p[2] >= 'A' && p[2] <= 'Z' && (p == line || !((p[-1] >= 'a' && p[-1] <= 'z') || (p[-1] >= 'A' && p[-1] <= 'Z'))))
      return true;
  return false;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <workload> [first [runs [timeout_s [CUresult]]]]\n", argv[0]);
    return 2;
  }
  /* Line-buffered: what was found so far is out even if ctest stops the sweep at its timeout. */
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGTERM, on_stop);
  signal(SIGINT, on_stop);
  const char *workload = argv[1];
  long first = argc > 2 ? atol(argv[2]) : 300, runs = argc > 3 ? atol(argv[3]) : 450;
  double timeout_s = argc > 4 ? atof(argv[4]) : 60;
  const char *result = argc > 5 ? argv[5] : NULL;
  char dir[] = "/tmp/ebb-fault-sweep-XXXXXX";
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 2;
  }
  static struct run r;
  if (run_one(workload, "*:999999999", timeout_s, dir, &r) != 0 || exit_code(&r) != 0 || r.err[0] || !field(&r, "RESULT ")) {
    char how[64];
    describe(&r, how, sizeof how);
    printf("fault_sweep: the run without a fault did not pass (%s)\nstdout:\n%s\nstderr:\n%s\n", how, r.out, r.err);
    return 1;
  }
  char ref[32] = {0};
  sscanf(field(&r, "RESULT "), "%31s", ref);
  unsigned long long calls = 0;
  const char *c = field(&r, "CALLS ");
  if (c) calls = strtoull(c, NULL, 10);
  if (calls == 0) {
    printf("fault_sweep: the reference run reported no driver calls (not the emulated driver?)\n%s\n", r.out);
    return 1;
  }
  if ((unsigned long long)first > calls) first = (long)calls;
  long rest = runs > first ? runs - first : 0;
  unsigned long long span = calls - (unsigned long long)first, stride = rest && span > (unsigned long long)rest ? span / (unsigned long long)rest : 1;
  long n_runs = 0, clean = 0, absorbed = 0, not_reached = 0, bad = 0, hung = 0;
  bool stop = false;
  double t0 = now_s();
  for (unsigned long long n = 1; n <= calls && !stop; n = n < (unsigned long long)first ? n + 1 : n + stride) {
    char fault[128];
    snprintf(fault, sizeof fault, "*:%llu%s%s", n, result ? ":" : "", result ? result : "");
    if (run_one(workload, fault, timeout_s, dir, &r) != 0) {
      perror("fault_sweep: fork or wait");
      return 2;
    }
    n_runs++;
    int code = exit_code(&r);
    const char *why = NULL;
    if (r.err[0])
      why = "printed on stderr";
    else if (strstr(r.out, "LASTERR "))
      why = "a successful call changed the last error";
    else if (code == 3) {
      const char *line = field(&r, "FAIL "), *fired = field(&r, "FIRED ");
      if (!fired || atoi(fired) != 1) why = "a failure without the injected fault (a failure of its own)";
      else if (!line || !names_driver(line)) why = "a failure whose message names no driver call or CUDA error";
      else clean++;
    } else if (code == 0) {
      char got[32] = {0};
      const char *res = field(&r, "RESULT "), *fired = field(&r, "FIRED ");
      if (res) sscanf(res, "%31s", got);
      if (!res || strcmp(got, ref) != 0) why = "a wrong result";
      else if (fired && atoi(fired) == 1) absorbed++;
      else not_reached++;
    } else
      why = code == 4 ? "a successful call changed the last error" : code == 5 ? "ebb_shutdown failed after every handle was released" : "crashed, hung or exited abnormally";
    if (why) {
      bad++;
      if (r.timed_out && ++hung == 3) stop = true; /* each costs a whole timeout: three say enough */
      char how[64];
      describe(&r, how, sizeof how);
      printf("fault_sweep: EBB_SIM_FAULT=%s: %s (%s)\nstdout:\n%s\nstderr:\n%.4000s\n", fault, why, how, r.out, r.err);
    }
  }
  printf("fault_sweep fault=%s calls=%llu runs=%ld clean=%ld absorbed=%ld not_reached=%ld bad=%ld seconds=%.1f\n", result ? result : "default", calls, n_runs, clean, absorbed,
         not_reached, bad, now_s() - t0);
  char p[600];
  snprintf(p, sizeof p, "%s/out", dir);
  unlink(p);
  snprintf(p, sizeof p, "%s/err", dir);
  unlink(p);
  rmdir(dir);
  return bad ? 1 : 0;
}
