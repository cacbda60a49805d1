/* One thread of bench_arena.c's arena case for several C cores in one process, alternated round by
 * round, so that every core sees the same moments of the machine. Hosts where a process runs at
 * one of two speeds for its whole life (benchmarks/RESULTS.md) make medians over alternated
 * processes move by more than a change is worth; ratios within one process do not.
 *
 * Each core is a shared library built from its own tree's csrc/ with this file compiled in as
 * BENCH_CORES_LIBRARY (so that the options struct is that tree's), loaded RTLD_LOCAL: its symbols,
 * thread-local storage and thread caches are its own. The libraries are built as the Python
 * extension is (position-independent, hidden symbols, thread-local storage reached through the
 * dynamic linker), so the figures compare cores as the extension runs them, not bench_arena.c's.
 * A LIBRARY given as "malloc" is glibc's malloc and free on the same sequence: beside the cores in
 * one process, it shows whether a slow stretch of the machine slows every allocator alike.
 * usage: bench_cores ROUNDS PAIRS THREAD_CACHE_MIB LIBRARY...
 *        prints "round R NS..." for every round, one ns per pair for each library in the order given */
#include <stdio.h>
#include <stdlib.h>

#include "arena.h"

#ifdef BENCH_CORES_LIBRARY
/* The part built into each core's library, against that core's arena.h; the core's own symbols are
 * hidden, as in the Python extension, so that its calls inside stay direct. */
#define EXPORT __attribute__((visibility("default")))

EXPORT ia_status_t bench_core_alloc(ia_arena_t *arena, size_t size, ia_stream_t stream, void **out) {
  return ia_arena_alloc(arena, size, stream, out);
}

EXPORT ia_status_t bench_core_free(ia_arena_t *arena, void *ptr, ia_stream_t stream) {
  return ia_arena_free(arena, ptr, stream);
}

EXPORT ia_arena_t *bench_core_create(size_t thread_cache) {
  ia_backend_t *backend;
  ia_arena_options_t opts;
  ia_arena_t *arena;
  ia_arena_default_options(&opts);
  opts.capacity = (size_t)1 << 30;
  opts.thread_cache = thread_cache;
  if (ia_host_backend_create(0, &backend) != IA_OK || ia_arena_create(&opts, backend, &arena) != IA_OK) return NULL;
  return arena;
}

EXPORT int bench_core_finish(ia_arena_t *arena) {
  char msg[256];
  if (!ia_arena_check(arena, msg, sizeof msg)) {
    fprintf(stderr, "invariant broken: %s\n", msg);
    return 0;
  }
  ia_arena_destroy(arena);
  return 1;
}
#else
#include <dlfcn.h>
#include <string.h>
#include <time.h>

#define WINDOW 256
#define MAX_CORES 8

typedef struct {
  ia_status_t (*alloc)(ia_arena_t *, size_t, ia_stream_t, void **);
  ia_status_t (*free)(ia_arena_t *, void *, ia_stream_t);
  int (*finish)(ia_arena_t *);
  ia_arena_t *arena;
  void *live[WINDOW];
  long next; /* the pair the core is at: every core walks the same sequence */
} core_t;

static size_t draws[4096];

/* The "malloc" pseudo-core. */
static ia_status_t malloc_alloc(ia_arena_t *arena, size_t size, ia_stream_t stream, void **out) {
  (void)arena, (void)stream;
  return (*out = malloc(size)) ? IA_OK : IA_ERR_OUT_OF_MEMORY;
}

static ia_status_t malloc_free(ia_arena_t *arena, void *ptr, ia_stream_t stream) {
  (void)arena, (void)stream;
  free(ptr);
  return IA_OK;
}

static int malloc_finish(ia_arena_t *arena) { return (void)arena, 1; }

/* bench_arena.c's generator and sizes: log-uniform, 16 B to 1 MiB. */
static uint64_t next_random(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static size_t random_size(uint64_t *rng) {
  uint64_t r = next_random(rng);
  unsigned bits = 4 + (unsigned)(r % 17);
  return (size_t)((r >> 8) & ((1ull << bits) - 1)) + 16;
}

static void fail(const char *what, const char *library) {
  fprintf(stderr, "bench_cores: %s: %s\n", library, what);
  exit(1);
}

/* ns per pair over the core's next `pairs` pairs. */
static double run(core_t *c, long pairs, ia_stream_t stream) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long end = c->next + pairs; c->next < end; c->next++) {
    unsigned slot = (unsigned)((unsigned long)c->next * 2654435761u >> 7) % WINDOW;
    c->free(c->arena, c->live[slot], stream);
    if (c->alloc(c->arena, draws[(unsigned long)c->next & 4095], stream, &c->live[slot]) != IA_OK) {
      fprintf(stderr, "bench_cores: allocation failed\n");
      exit(1);
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)pairs;
}

int main(int argc, char **argv) {
  int n = argc - 4, rounds = argc > 4 ? atoi(argv[1]) : 0;
  long pairs = argc > 4 ? atol(argv[2]) : 0;
  size_t cache = argc > 4 ? (size_t)atol(argv[3]) << 20 : 0;
  if (n < 1 || n > MAX_CORES || rounds < 1 || pairs < 1) {
    fprintf(stderr, "usage: %s ROUNDS PAIRS THREAD_CACHE_MIB LIBRARY... (1 to %d libraries)\n", argv[0], MAX_CORES);
    return 2;
  }
  const ia_stream_t stream = (ia_stream_t)0x9E3779B97F4A7C15ull; /* bench_arena.c's first thread's */
  uint64_t rng = stream;
  core_t cores[MAX_CORES];
  for (int k = 0; k < n; k++) {
    const char *library = argv[4 + k];
    core_t *c = &cores[k];
    if (!strcmp(library, "malloc")) {
      *c = (core_t){.alloc = malloc_alloc, .free = malloc_free, .finish = malloc_finish};
    } else {
      void *h = dlopen(library, RTLD_NOW | RTLD_LOCAL);
      if (!h) fail(dlerror(), library);
      ia_arena_t *(*create)(size_t) = (ia_arena_t * (*)(size_t)) dlsym(h, "bench_core_create");
      *(void **)&c->alloc = dlsym(h, "bench_core_alloc");
      *(void **)&c->free = dlsym(h, "bench_core_free");
      *(void **)&c->finish = dlsym(h, "bench_core_finish");
      if (!create || !c->alloc || !c->free || !c->finish) fail("not a core built with bench_cores.c", library);
      if (!(c->arena = create(cache))) fail("its arena could not be made", library);
    }
    uint64_t window_rng = rng;
    for (int i = 0; i < WINDOW; i++)
      if (c->alloc(c->arena, random_size(&window_rng), stream, &c->live[i]) != IA_OK) fail("allocation failed", library);
    c->next = -pairs / 4;
  }
  for (int i = 0; i < WINDOW; i++) random_size(&rng);
  for (int i = 0; i < 4096; i++) draws[i] = random_size(&rng);
  for (int k = 0; k < n; k++) run(&cores[k], pairs / 4 + 1, stream); /* settle, untimed */
  for (int r = 0; r < rounds; r++) {
    double ns[MAX_CORES];
    for (int j = 0; j < n; j++) {
      int k = (r + j) % n;
      ns[k] = run(&cores[k], pairs, stream);
    }
    printf("round %d", r);
    for (int k = 0; k < n; k++) printf(" %.2f", ns[k]);
    printf("\n");
  }
  for (int k = 0; k < n; k++) {
    for (int i = 0; i < WINDOW; i++) cores[k].free(cores[k].arena, cores[k].live[i], stream);
    if (!cores[k].finish(cores[k].arena)) fail("its arena's invariants broke", argv[4 + k]);
  }
  return 0;
}
#endif
