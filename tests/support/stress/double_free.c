/* Racing double frees: in every round the main thread allocates BLOCKS blocks, then THREADS
 * threads are released at once and each frees every one of them, all in the same order, so that
 * the frees of one block meet. Exactly one free of each block must succeed and every other be
 * refused as a double free; after every round the invariant walk must hold and nothing may be live.
 *
 *   arena   one growable arena on the host backend (1 MiB regions, so a freed pointer may merge
 *           into a neighbour or lie in another region); every eighth round gives free regions back.
 *   plugin  the process scope's general pools on host memory (mapped pages), freed through
 *           ia_torch_free, which finds each block's arena by address (the region registry); the
 *           refusals are counted from the device's bad_frees (each also says so on stderr).
 *
 * usage: double_free arena|plugin THREADS ROUNDS BLOCKS   (prints "ok <frees> <refused>" or fails) */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "indexer_arena.h"
#include "xorshift.h"

#define MAX_THREADS 32
#define MAX_BLOCKS 4096

static bool through_plugin;
static ia_arena_t *arena;
static int threads;
static long blocks;
static void *ptrs[MAX_BLOCKS];
static _Atomic int succeeded[MAX_BLOCKS], refused[MAX_BLOCKS];
static _Atomic unsigned long other_status;
static pthread_barrier_t start, done;
static volatile bool finished;

static void fail(const char *what, long round) {
  fprintf(stderr, "round %ld: %s\n", round, what);
  exit(1);
}

static void *worker(void *arg) {
  (void)arg;
  for (;;) {
    pthread_barrier_wait(&start);
    if (finished) return NULL;
    for (long i = 0; i < blocks; i++) {
      if (through_plugin) {
        ia_torch_free(ptrs[i]); /* counted from the device's statistics */
        continue;
      }
      ia_status_t st = ia_arena_free(arena, ptrs[i], 0);
      if (st == IA_OK) succeeded[i]++;
      else if (st == IA_ERR_DOUBLE_FREE) refused[i]++;
      else other_status++;
    }
    pthread_barrier_wait(&done);
  }
}

static size_t random_size(uint64_t *rng) {
  uint64_t r = next_random(rng);
  return (size_t)(r >> 8) % (r % 4 ? 64 << 10 : 2 << 20) + 1;
}

static void check(ia_arena_t *a, long round) {
  char msg[512];
  if (a && !ia_arena_check(a, msg, sizeof msg)) fail(msg, round);
}

static uint64_t bad_frees(void) {
  ia_stats_t s;
  if (!through_plugin) {
    ia_arena_stats(arena, &s);
    return s.bad_frees;
  }
  ia_plugin_device_stats(0, &s);
  return s.bad_frees;
}

static int64_t live_bytes(void) {
  ia_stats_t s;
  if (through_plugin) ia_plugin_device_stats(0, &s);
  else ia_arena_stats(arena, &s);
  return s.in_use.current;
}

static void setup(void) {
  if (through_plugin) {
    ia_plugin_config_t c = {.budget = 8 << 20, .alignment = 256, .host_memory = 1, .expandable = 1,
                            .address_range = (size_t)1 << 30, .host_page_size = 64 << 10};
    if (ia_plugin_configure(&c) != IA_OK || ia_plugin_reserve(0) != IA_OK) fail("cannot set up the plugin", 0);
    return;
  }
  ia_arena_options_t o;
  ia_arena_default_options(&o);
  o.growable = true;
  o.region_min = 1 << 20;
  o.region_round = 64 << 10;
  ia_backend_t *backend;
  if (ia_host_backend_create(0, &backend) != IA_OK || ia_arena_create(&o, backend, &arena) != IA_OK)
    fail("cannot create the arena", 0);
}

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[1], "arena") && strcmp(argv[1], "plugin"))) {
    fprintf(stderr, "usage: %s arena|plugin THREADS ROUNDS BLOCKS\n", argv[0]);
    return 2;
  }
  through_plugin = strcmp(argv[1], "plugin") == 0;
  threads = atoi(argv[2]);
  long rounds = atol(argv[3]);
  blocks = atol(argv[4]);
  if (threads < 2 || threads > MAX_THREADS || blocks < 1 || blocks > MAX_BLOCKS) {
    fprintf(stderr, "THREADS: 2 to %d, BLOCKS: 1 to %d\n", MAX_THREADS, MAX_BLOCKS);
    return 2;
  }
  setup();
  pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
  pthread_barrier_init(&done, NULL, (unsigned)threads + 1);
  pthread_t tid[MAX_THREADS];
  for (int t = 0; t < threads; t++) pthread_create(&tid[t], NULL, worker, NULL);
  uint64_t rng = 0x5DEECE66Dull;
  unsigned long frees = 0, refusals = 0;
  for (long round = 0; round < rounds; round++) {
    for (long i = 0; i < blocks; i++) {
      size_t size = random_size(&rng);
      ptrs[i] = through_plugin ? ia_torch_alloc(size, 0, NULL, NULL) : NULL;
      if (!through_plugin && ia_arena_alloc(arena, size, 0, &ptrs[i]) != IA_OK) fail("an allocation failed", round);
      succeeded[i] = refused[i] = 0;
    }
    uint64_t bad_before = bad_frees();
    pthread_barrier_wait(&start);
    pthread_barrier_wait(&done);
    uint64_t bad = bad_frees() - bad_before;
    for (long i = 0; !through_plugin && i < blocks; i++)
      if (succeeded[i] != 1 || refused[i] != threads - 1) {
        fprintf(stderr, "round %ld: block %p freed %d times, refused %d times\n", round, ptrs[i], succeeded[i],
                refused[i]);
        return 1;
      }
    if (other_status) fail("a free was refused for another reason than a double free", round);
    if (bad != (uint64_t)blocks * (uint64_t)(threads - 1)) fail("not every second free was refused", round);
    if (live_bytes()) fail("blocks are still live after every one was freed", round);
    check(arena, round);
    for (int pool = IA_POOL_SMALL; through_plugin && pool < IA_POOL_COUNT; pool++)
      check(ia_plugin_arena(0, pool), round);
    if (round % 8 == 7) {
      if (through_plugin) ia_torch_empty_cache();
      else ia_arena_release_cached(arena);
    }
    frees += (unsigned long)blocks;
    refusals += (unsigned long)bad;
  }
  finished = true;
  pthread_barrier_wait(&start);
  for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
  printf("ok %lu %lu\n", frees, refusals);
  if (arena) ia_arena_destroy(arena);
  return 0;
}
