/* Microbenchmark of the arena core beside glibc: alloc+free pairs over a mixed size distribution.
 *
 * Each thread keeps a window of live blocks and, per pair, frees a random one and allocates a new
 * one of a random size (log-uniform, 16 B to 1 MiB), so the allocator always holds a realistic mix
 * of live blocks and holes. All threads share one allocator. ALLOCATOR is "arena", one arena on the
 * host backend, "plugin", the process-scope plugin's general pools on host memory
 * (ia_torch_alloc/ia_torch_free: pools by size, a free finds its arena in the region registry:
 * what PyTorch's calls reach, minus PyTorch), or "malloc", glibc malloc/free on the same sequence.
 * One allocator per process: glibc's heap adapts its thresholds to what ran before in the process
 * (the arena's own bookkeeping included), which would bias the reference;
 * benchmarks/alloc/bench_arena.py runs the processes in a rotated order and reports ratios.
 * usage: bench_arena arena|plugin|malloc THREADS PAIRS_PER_THREAD REPEATS
 *        prints one line "allocator threads ns_per_pair" per repeat. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "indexer_arena.h"

#define WINDOW 256

enum { MALLOC = 0, ARENA = 1, PLUGIN = 2, KINDS = 3 };
static const char *const names[KINDS] = {"malloc", "arena", "plugin"};

typedef struct {
  int use_arena; /* one of the above */
  long pairs;
  uint64_t seed;
  double ns;
} job_t;

static ia_arena_t *arenas[KINDS]; /* [ARENA], or the plugin's small pool */
static pthread_barrier_t start;

static uint64_t next_random(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static size_t random_size(uint64_t *rng) {
  uint64_t r = next_random(rng);
  unsigned bits = 4 + (unsigned)(r % 17); /* 16 B .. 1 MiB */
  return (size_t)((r >> 8) & ((1ull << bits) - 1)) + 16;
}

static void *get(int use_arena, size_t size, ia_stream_t stream) {
  if (!use_arena) return malloc(size);
  if (use_arena == PLUGIN) return ia_torch_alloc(size, 0, (void *)stream, NULL); /* aborts when refused */
  void *p;
  return ia_arena_alloc(arenas[use_arena], size, stream, &p) == IA_OK ? p : NULL;
}

static void put(int use_arena, void *p, ia_stream_t stream) {
  if (use_arena == PLUGIN) ia_torch_free(p);
  else if (use_arena) ia_arena_free(arenas[use_arena], p, stream);
  else free(p);
}

static void *run(void *arg) {
  job_t *job = arg;
  uint64_t rng = job->seed;
  ia_stream_t stream = (ia_stream_t)job->seed;
  void *live[WINDOW];
  size_t sizes[WINDOW];
  for (int i = 0; i < WINDOW; i++) live[i] = get(job->use_arena, sizes[i] = random_size(&rng), stream);
  /* Sizes drawn ahead, so the timed loop measures the allocator and not the generator. */
  size_t *draws = malloc(sizeof *draws * 4096);
  for (int i = 0; i < 4096; i++) draws[i] = random_size(&rng);
  /* A quarter of the pairs untimed first: a fresh process's allocator (tables, caches, glibc's
   * adaptive thresholds) settles before the clock starts. */
  long warm = job->pairs / 4;
  struct timespec t0, t1;
  for (long n = -warm; n < job->pairs; n++) {
    if (n == 0) {
      pthread_barrier_wait(&start);
      clock_gettime(CLOCK_MONOTONIC, &t0);
    }
    unsigned slot = (unsigned)((unsigned long)n * 2654435761u >> 7) % WINDOW;
    put(job->use_arena, live[slot], stream);
    live[slot] = get(job->use_arena, draws[(unsigned long)n & 4095], stream);
    if (!live[slot]) {
      fprintf(stderr, "allocation failed\n");
      exit(1);
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  job->ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)job->pairs;
  for (int i = 0; i < WINDOW; i++) put(job->use_arena, live[i], stream);
  free(draws);
  return NULL;
}

int main(int argc, char **argv) {
  int use_arena = -1;
  for (int k = 0; argc == 5 && k < KINDS; k++)
    if (!strcmp(argv[1], names[k])) use_arena = k;
  if (use_arena < 0) {
    fprintf(stderr, "usage: %s arena|plugin|malloc THREADS PAIRS_PER_THREAD REPEATS\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[2]);
  long pairs = atol(argv[3]);
  int repeats = atoi(argv[4]);
  if (threads < 1 || threads > 64) return 2;
  if (use_arena == PLUGIN) {
    ia_plugin_config_t c = {.scope = IA_SCOPE_PROCESS, .budget = (size_t)64 << 20, .alignment = 256, .host_memory = 1};
    if (ia_plugin_configure(&c) != IA_OK || ia_plugin_reserve(0) != IA_OK) return 3;
    arenas[PLUGIN] = ia_plugin_arena(0, IA_POOL_SMALL);
  } else if (use_arena) {
    ia_backend_t *backend;
    ia_arena_options_t opts;
    ia_arena_default_options(&opts);
    opts.capacity = (size_t)1 << 30;
    if (ia_host_backend_create(0, &backend) != IA_OK || ia_arena_create(&opts, backend, &arenas[use_arena]) != IA_OK)
      return 3;
  }
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (int rep = 0; rep < repeats; rep++) {
    job_t jobs[64];
    pthread_t tid[64];
    for (int t = 0; t < threads; t++) {
      jobs[t] = (job_t){.use_arena = use_arena, .pairs = pairs, .seed = 0x9E3779B97F4A7C15ull * (uint64_t)(t + 1)};
      pthread_create(&tid[t], NULL, run, &jobs[t]);
    }
    double worst = 0;
    for (int t = 0; t < threads; t++) {
      pthread_join(tid[t], NULL);
      if (jobs[t].ns > worst) worst = jobs[t].ns;
    }
    printf("%s %d %.2f\n", names[use_arena], threads, worst);
  }
  if (use_arena) {
    char msg[256];
    if (use_arena == PLUGIN) { /* the large pool too; the plugin's arenas live with the process */
      ia_arena_t *large = ia_plugin_arena(0, IA_POOL_LARGE);
      ia_stats_t s;
      ia_arena_stats(large, &s);
      if (!ia_arena_check(large, msg, sizeof msg) || s.in_use.current) {
        fprintf(stderr, "plugin's large pool: %s, %lu bytes in use\n", msg, (unsigned long)s.in_use.current);
        return 1;
      }
    }
    if (!ia_arena_check(arenas[use_arena], msg, sizeof msg)) {
      fprintf(stderr, "invariant broken: %s\n", msg);
      return 1;
    }
    ia_stats_t s;
    ia_arena_stats(arenas[use_arena], &s);
    if (s.in_use.current || s.free_blocks != s.regions.current) { /* every region one free block again */
      fprintf(stderr, "%s arena: %lu bytes still in use, %lu free blocks\n", names[use_arena],
              (unsigned long)s.in_use.current, (unsigned long)s.free_blocks);
      return 1;
    }
    if (use_arena != PLUGIN) ia_arena_destroy(arenas[use_arena]);
  }
  return 0;
}
