/* Multi-threaded stress of the plugin with CUDA graph pools, on host memory: eager threads
 * allocate and free through ia_torch_alloc/ia_torch_free on their own streams, with a canary in
 * every block checked before its free, while one thread captures graphs over and over (begin, a
 * simulated capture on its stream, allocations and frees in the pool, workspaces inside the
 * capture, end, release) and checks the pool's blocks the same way. Half of the graphs are
 * released while their outputs live, and the outputs are handed to the eager threads, which free
 * them concurrently: the last frees into a released pool race to give it back. One output of each
 * released graph is instead rebound inside the next capture (written, then freed there), and that
 * graph writes it again at every simulated replay until it is released: the block must stay
 * mapped and never be handed out meanwhile (PyTorch's test_graph_capture_reset_recapture). Every
 * third capture forks a side stream that is recorded on a block freed inside the capture and
 * joins it back before the next allocation, which takes the block back (record_stream reuse). At
 * the end nothing is live, no pool is left and no capture rule was broken.
 *
 * usage: graphs_stress EAGER_THREADS OPS_PER_THREAD GRAPHS   (prints "ok" or fails) */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testing/testing.h"
#include "canary.h"

static long ops_per_thread, graphs;
static _Atomic unsigned long canary_failures;

#define MAILBOX 256
static struct {
  pthread_mutex_t lock;
  void *ptr[MAILBOX];
  size_t size[MAILBOX];
  int count;
} mailbox = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void check_and_free(void *p, size_t size) {
  if (!canary_intact(p, size)) canary_failures++;
  ia_torch_free(p);
}

static size_t pick(unsigned *seed) {
  static const size_t sizes[] = {512, 4096, 65536, 1 << 20, 3 << 20, 12 << 20};
  return sizes[rand_r(seed) % (sizeof sizes / sizeof sizes[0])];
}

/* Puts a block in the mailbox for another thread to free; false when it is full. */
static bool post(void *p, size_t size) {
  pthread_mutex_lock(&mailbox.lock);
  bool room = mailbox.count < MAILBOX;
  if (room) {
    mailbox.ptr[mailbox.count] = p;
    mailbox.size[mailbox.count++] = size;
  }
  pthread_mutex_unlock(&mailbox.lock);
  return room;
}

static bool take(void **p, size_t *size) {
  pthread_mutex_lock(&mailbox.lock);
  bool any = mailbox.count > 0;
  if (any) {
    mailbox.count--;
    *p = mailbox.ptr[mailbox.count];
    *size = mailbox.size[mailbox.count];
  }
  pthread_mutex_unlock(&mailbox.lock);
  return any;
}

static void *eager(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg;
  void *stream = (void *)(uintptr_t)(100 + (uintptr_t)arg);
  struct { void *p; size_t size; } held[32];
  int n = 0;
  for (long op = 0; op < ops_per_thread; op++) {
    void *posted;
    size_t posted_size;
    if (op % 4 == 0 && take(&posted, &posted_size)) check_and_free(posted, posted_size);
    if (n == 32 || (n && rand_r(&seed) % 2)) {
      int i = rand_r(&seed) % n;
      check_and_free(held[i].p, held[i].size);
      held[i] = held[--n];
    } else {
      size_t size = pick(&seed);
      void *p = ia_torch_alloc(size, 0, stream, NULL);
      canary_fill(p, size);
      held[n].p = p;
      held[n++].size = size;
    }
  }
  while (n--) check_and_free(held[n].p, held[n].size);
  return NULL;
}

static void *grapher(void *arg) {
  (void)arg;
  unsigned seed = 7;
  ia_stream_t stream = 999, side = 998;
  void *carried = NULL; /* an output of the last graph, released with it */
  size_t carried_size = 0;
  for (long g = 0; g < graphs; g++) {
    ia_pool_id_t id = {.first = (uint64_t)g + 1, .second = 0};
    if (ia_graph_begin(0, id) != IA_OK || !ia_host_capture_begin(stream, (uint64_t)g + 1)) abort();
    bool fork = g % 3 == 0;
    if (fork && (!ia_host_capture_wait(side, stream) || !ia_host_capture_launch(side))) abort();
    void *rebound = carried;
    size_t rebound_size = carried_size;
    if (rebound) check_and_free(rebound, rebound_size); /* used by this capture, then rebound */
    carried = NULL;
    void *out[8];
    size_t sizes[8];
    for (int i = 0; i < 8; i++) {
      sizes[i] = pick(&seed);
      if (i == 7) ia_workspace_enter();
      out[i] = ia_torch_alloc(sizes[i], 0, (void *)stream, &id);
      if (i == 7) ia_workspace_exit();
      canary_fill(out[i], sizes[i]);
      if (fork && i == 4) { /* read on the side stream, freed before it joins back */
        ia_torch_record_stream(out[i], (void *)side);
        check_and_free(out[i], sizes[i]), out[i] = NULL;
      }
      if (fork && i == 5) { /* joined: the next allocation takes that block back */
        if (!ia_host_capture_wait(stream, side) || !ia_host_capture_launch(stream)) abort();
        void *again = ia_torch_alloc(sizes[4], 0, (void *)stream, &id);
        canary_fill(again, sizes[4]);
        check_and_free(again, sizes[4]);
      }
      if (i % 3 == 0 && out[i]) check_and_free(out[i], sizes[i]), out[i] = NULL; /* freed inside the capture */
    }
    if (fork) ia_host_capture_end(side);
    ia_host_capture_end(stream);
    if (ia_graph_end(0, id) != IA_OK) abort();
    if (rebound) canary_fill(rebound, rebound_size); /* a replay writes what the graph rebound */
    bool hand_out = g % 2;
    if (hand_out && ia_graph_release(0, id) != IA_OK) abort(); /* the outputs outlive the graph */
    if (hand_out && out[1]) carried = out[1], carried_size = sizes[1], out[1] = NULL;
    for (int i = 0; i < 8; i++)
      if (out[i] && !(hand_out && i < 7 && post(out[i], sizes[i]))) /* not the workspace: its budget is small */
        check_and_free(out[i], sizes[i]);
    if (!hand_out && ia_graph_release(0, id) != IA_OK) abort();
  }
  if (carried) check_and_free(carried, carried_size);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s EAGER_THREADS OPS_PER_THREAD GRAPHS\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[1]);
  ops_per_thread = atol(argv[2]);
  graphs = atol(argv[3]);
  ia_plugin_config_t c = {.budget = 64 << 20, .alignment = 256, .unified = 0, .host_memory = 1};
  if (ia_plugin_configure(&c) != IA_OK) return 1;
  ia_graph_set_record_stream_reuse(true);
  pthread_t t[64];
  for (int i = 0; i < threads && i < 63; i++) pthread_create(&t[i], NULL, eager, (void *)(uintptr_t)(i + 1));
  pthread_create(&t[63], NULL, grapher, NULL);
  for (int i = 0; i < threads && i < 63; i++) pthread_join(t[i], NULL);
  pthread_join(t[63], NULL);
  void *left;
  size_t left_size;
  while (take(&left, &left_size)) check_and_free(left, left_size);
  ia_graph_pool_info_t info[4];
  ia_device_totals_t totals = ia_plugin_device_totals(0);
  size_t pools = ia_graph_pools(0, info, 4);
  if (canary_failures || pools || totals.in_use.current || ia_host_capture_violations()) {
    fprintf(stderr, "canary failures %lu, pools left %zu, bytes live %lu, capture violations %lu\n",
            (unsigned long)canary_failures, pools, (unsigned long)totals.in_use.current,
            (unsigned long)ia_host_capture_violations());
    return 1;
  }
  printf("ok\n");
  return 0;
}
