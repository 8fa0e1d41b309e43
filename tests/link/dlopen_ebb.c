/* dlopen_ebb.c: libebb.so can be loaded with dlopen by a C program that does not link it.
 *
 * This is how language bindings and plugin hosts load ebb. It fails when libebb (or anything it
 * depends on) uses initial-exec TLS beyond glibc's surplus ("cannot allocate memory in static TLS
 * block"), which is why libebb never links jemalloc. Two full rounds of dlopen, ebb_init,
 * ebb_shutdown and dlclose also check that shutdown leaves nothing running inside the library's
 * code once it is unmapped.
 * usage: dlopen_ebb /path/to/libebb.so; prints "ok" and exits 0 on success.
 */
#include <dlfcn.h>
#include <stdio.h>

typedef int (*status_fn)(void);
typedef const char *(*error_fn)(void);

static int round_trip(const char *path, int round) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    fprintf(stderr, "round %d: dlopen(%s) failed: %s\n", round, path, dlerror());
    return 1;
  }
  /* POSIX guarantees object and function pointers convert through dlsym's void *. */
  status_fn init = (status_fn)dlsym(h, "ebb_init");
  status_fn shutdown = (status_fn)dlsym(h, "ebb_shutdown");
  error_fn last_error = (error_fn)dlsym(h, "ebb_last_error");
  if (init == NULL || shutdown == NULL || last_error == NULL) {
    fprintf(stderr, "round %d: libebb lacks ebb_init/ebb_shutdown/ebb_last_error: %s\n", round,
            dlerror());
    dlclose(h);
    return 1;
  }
  int st = init();
  if (st != 0) {
    fprintf(stderr, "round %d: ebb_init returned %d: %s\n", round, st, last_error());
    dlclose(h);
    return 1;
  }
  st = shutdown();
  if (st != 0) {
    fprintf(stderr, "round %d: ebb_shutdown returned %d: %s\n", round, st, last_error());
    dlclose(h);
    return 1;
  }
  if (dlclose(h) != 0) {
    fprintf(stderr, "round %d: dlclose failed: %s\n", round, dlerror());
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s /path/to/libebb.so\n", argv[0]);
    return 2;
  }
  for (int round = 1; round <= 2; round++)
    if (round_trip(argv[1], round) != 0) return 1;
  puts("ok");
  return 0;
}
