/* Microbenchmark of the arena core: alloc+free pairs over a mixed size distribution.
 *
 * Each thread keeps a window of live blocks and, per pair, frees a random one and allocates a new
 * one of a random size (log-uniform, 16 B to 1 MiB), so the arena always holds a realistic mix of
 * live blocks and holes. All threads share one arena. Three allocators run the same sequence:
 * "arena" with thread caches of THREAD_CACHE_MIB per thread (blocks up to 1 MiB, as the plugin's
 * small pool), "locked", the same arena without them (every operation takes the arena's lock),
 * and "malloc", glibc malloc/free. Each repeat runs all three, in an order rotated every repeat so
 * that running first or last favours none.
 * usage: bench_arena THREADS PAIRS_PER_THREAD REPEATS [THREAD_CACHE_MIB]
 *        prints one line "allocator threads ns_per_pair" per (allocator, repeat). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "arena.h"

#define WINDOW 256

enum { MALLOC = 0, ARENA = 1, LOCKED = 2 };
static const char *const names[] = {"malloc", "arena", "locked"};

typedef struct {
  int use_arena; /* MALLOC, ARENA or LOCKED */
  long pairs;
  uint64_t seed;
  double ns;
} job_t;

static ia_arena_t *arenas[3]; /* [ARENA], [LOCKED] */
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
  void *p;
  return ia_arena_alloc(arenas[use_arena], size, stream, &p) == IA_OK ? p : NULL;
}

static void put(int use_arena, void *p, ia_stream_t stream) {
  if (use_arena) ia_arena_free(arenas[use_arena], p, stream);
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
  pthread_barrier_wait(&start);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long n = 0; n < job->pairs; n++) {
    unsigned slot = (unsigned)(n * 2654435761u >> 7) % WINDOW;
    put(job->use_arena, live[slot], stream);
    live[slot] = get(job->use_arena, draws[n & 4095], stream);
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
  if (argc != 4 && argc != 5) {
    fprintf(stderr, "usage: %s THREADS PAIRS_PER_THREAD REPEATS [THREAD_CACHE_MIB]\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[1]);
  long pairs = atol(argv[2]);
  int repeats = atoi(argv[3]);
  size_t cache = argc == 5 ? (size_t)atol(argv[4]) << 20 : (size_t)16 << 20;
  if (threads < 1 || threads > 64) return 2;
  for (int kind = ARENA; kind <= LOCKED; kind++) {
    ia_backend_t *backend;
    ia_arena_options_t opts;
    ia_arena_default_options(&opts);
    opts.capacity = (size_t)1 << 30;
    opts.thread_cache = kind == ARENA ? cache : 0;
    if (ia_host_backend_create(0, &backend) != IA_OK || ia_arena_create(&opts, backend, &arenas[kind]) != IA_OK)
      return 3;
  }
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (int rep = 0; rep < repeats; rep++)
    for (int k = 0; k < 3; k++) {
      int use_arena = (rep + k) % 3;
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
      fflush(stdout);
    }
  for (int kind = ARENA; kind <= LOCKED; kind++) {
    char msg[256];
    if (!ia_arena_check(arenas[kind], msg, sizeof msg)) {
      fprintf(stderr, "invariant broken: %s\n", msg);
      return 1;
    }
    ia_stats_t s;
    ia_arena_stats(arenas[kind], &s);
    if (s.in_use || s.free_blocks != 1) { /* the threads ended: their caches gave everything back */
      fprintf(stderr, "%s arena: %lu bytes still in use, %lu free blocks\n", names[kind],
              (unsigned long)s.in_use, (unsigned long)s.free_blocks);
      return 1;
    }
    ia_arena_destroy(arenas[kind]);
  }
  return 0;
}
