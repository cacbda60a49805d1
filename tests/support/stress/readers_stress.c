/* Statistics readers racing sleep: what a serving engine's metrics thread does while its sleep mode
 * gives the workspace arena back. On host memory, through the plugin:
 *   - a sleeper thread takes workspaces (canary in each), releases the workspace arena, reserves it
 *     again, and captures and releases a graph pool, over and over;
 *   - eager threads allocate and free general blocks (canaries), so the mapped pools grow and give
 *     pages back (empty cache) while they are listed;
 *   - reader threads read the device's PyTorch statistics and totals, reset the peaks, and walk the
 *     memory snapshot's segments, checking that every segment is tiled by its blocks and that no
 *     cumulative counter (allocated, freed, device allocs and frees) ever goes down.
 * Under AddressSanitizer a reader of a released arena is a use after free; under ThreadSanitizer an
 * unordered read is a race.
 *
 * usage: readers_stress ROUNDS   (prints "ok" or what broke) */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testing/testing.h"
#include "canary.h"

#define MiB ((size_t)1 << 20)

static long rounds;
static _Atomic int sleeping_done;
static _Atomic unsigned long canary_failures, torn_segments, backwards, refused_releases;
static char first_problem[512];
static pthread_mutex_t problem_lock = PTHREAD_MUTEX_INITIALIZER;

static void problem(_Atomic unsigned long *counter, const char *what) {
  if (atomic_fetch_add(counter, 1) == 0) {
    pthread_mutex_lock(&problem_lock);
    if (!first_problem[0]) snprintf(first_problem, sizeof first_problem, "%s", what);
    pthread_mutex_unlock(&problem_lock);
  }
}

static void check_and_free(void *p, size_t size) {
  if (!canary_intact(p, size)) problem(&canary_failures, "a canary was overwritten");
  ia_torch_free(p);
}

static void *sleeper(void *arg) {
  (void)arg;
  void *stream = (void *)(uintptr_t)7;
  for (long r = 0; r < rounds; r++) {
    ia_workspace_enter();
    size_t size = (size_t)(r % 5 + 1) * MiB;
    void *ws = ia_torch_alloc(size, 0, stream, NULL);
    ia_workspace_exit();
    canary_fill(ws, size);
    check_and_free(ws, size);
    if (ia_plugin_release(0) != IA_OK) problem(&refused_releases, ia_plugin_failure());
    if (r % 3 == 0 && ia_plugin_reserve(0) != IA_OK) abort();
    if (r % 4 == 0) { /* a graph pool that comes and goes, with its own history */
      ia_pool_id_t id = {.first = (uint64_t)r + 1, .second = 0};
      if (ia_graph_begin(0, id) != IA_OK || !ia_host_capture_begin(999, (uint64_t)r + 1)) abort();
      void *g = ia_torch_alloc(3 * MiB, 0, (void *)(uintptr_t)999, &id);
      canary_fill(g, 3 * MiB);
      ia_host_capture_end(999);
      if (ia_graph_end(0, id) != IA_OK) abort();
      check_and_free(g, 3 * MiB);
      if (ia_graph_release(0, id) != IA_OK) abort();
    }
  }
  atomic_store(&sleeping_done, 1);
  return NULL;
}

static void *eager(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg;
  void *stream = (void *)(uintptr_t)(100 + (uintptr_t)arg);
  static const size_t sizes[] = {512, 4096, 65536, 1 << 20, 3 << 20, 12 << 20, 40 << 20};
  struct { void *p; size_t size; } held[16];
  int n = 0;
  for (long op = 0; !atomic_load(&sleeping_done); op++) {
    if (n == 16 || (n && rand_r(&seed) % 2)) {
      int i = rand_r(&seed) % n;
      check_and_free(held[i].p, held[i].size);
      held[i] = held[--n];
    } else {
      size_t size = sizes[rand_r(&seed) % (sizeof sizes / sizeof sizes[0])];
      held[n].p = ia_torch_alloc(size, 0, stream, NULL);
      canary_fill(held[n].p, size);
      held[n++].size = size;
    }
    if (op % 64 == 0) ia_torch_empty_cache(); /* mapped pools unmap their free pages */
  }
  while (n--) check_and_free(held[n].p, held[n].size);
  return NULL;
}

static void check_tiling(void *ctx, const ia_segment_info_t *seg, const ia_block_info_t *blocks, size_t n) {
  (void)ctx;
  uintptr_t at = seg->address;
  for (size_t i = 0; i < n; i++) {
    if (blocks[i].address != at) break;
    at += blocks[i].size;
  }
  if (at != seg->address + seg->size) {
    char what[160];
    snprintf(what, sizeof what, "a segment of %llu bytes at %#lx is not tiled by its %zu blocks",
             (unsigned long long)seg->size, (unsigned long)seg->address, n);
    problem(&torn_segments, what);
  }
}

/* Every cumulative figure of the device: each kind's allocated and freed sums, then the counters. */
#define CUMULATIVE (IA_STAT_KINDS * 2 * 9 + 2)
static void cumulative(const ia_torch_stats_t *s, int64_t *out) {
  int i = 0;
#define TAKE(name, torch, doc)                                                                      \
  for (int k = 0; k < IA_STAT_KINDS; k++) out[i++] = s->torch[k].allocated, out[i++] = s->torch[k].freed;
  IA_STAT_QUADS(TAKE)
#undef TAKE
  out[i++] = s->num_device_alloc;
  out[i++] = s->num_device_free;
}

static void *reader(void *arg) {
  long id = (long)(uintptr_t)arg;
  int64_t last[CUMULATIVE] = {0}, now[CUMULATIVE];
  for (long n = 0; !atomic_load(&sleeping_done); n++) {
    ia_torch_stats_t s;
    ia_plugin_torch_stats(0, &s);
    cumulative(&s, now);
    for (int i = 0; i < CUMULATIVE; i++)
      if (now[i] < last[i]) {
        char what[160];
        snprintf(what, sizeof what, "cumulative figure %d went down from %lld to %lld", i, (long long)last[i],
                 (long long)now[i]);
        problem(&backwards, what);
      }
    memcpy(last, now, sizeof last);
    (void)ia_plugin_device_totals(0);
    if (id == 0 && n % 8 == 0) ia_plugin_reset_peaks(0);
    ia_plugin_segments(0, check_tiling, NULL);
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s ROUNDS\n", argv[0]);
    return 2;
  }
  rounds = atol(argv[1]);
  ia_plugin_config_t c = {.budget = 16 << 20, .alignment = 256, .unified = 0, .host_memory = 1,
                          .expandable = -1, .host_page_size = 64 << 10};
  if (ia_plugin_configure(&c) != IA_OK || ia_plugin_reserve(0) != IA_OK) return 1;
  pthread_t t[5];
  pthread_create(&t[0], NULL, sleeper, NULL);
  for (int i = 1; i < 3; i++) pthread_create(&t[i], NULL, eager, (void *)(uintptr_t)i);
  for (int i = 3; i < 5; i++) pthread_create(&t[i], NULL, reader, (void *)(uintptr_t)(i - 3));
  for (int i = 0; i < 5; i++) pthread_join(t[i], NULL);
  ia_device_totals_t totals = ia_plugin_device_totals(0);
  if (canary_failures || torn_segments || backwards || refused_releases || totals.in_use.current ||
      ia_host_capture_violations()) {
    fprintf(stderr, "%s\ncanary failures %lu, torn segments %lu, counters backwards %lu, releases refused %lu, "
            "bytes live %lld, capture violations %lu\n", first_problem, (unsigned long)canary_failures,
            (unsigned long)torn_segments, (unsigned long)backwards, (unsigned long)refused_releases,
            (long long)totals.in_use.current, (unsigned long)ia_host_capture_violations());
    return 1;
  }
  printf("ok\n");
  return 0;
}
