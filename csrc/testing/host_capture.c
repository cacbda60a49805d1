/* CUDA graph capture, simulated for every host backend at once (the test build only).
 *
 * It follows CUDA's rules and counts every break of them instead of invalidating anything: a stream
 * put in capture (ia_host_capture_begin) makes the host backends record captured events; querying
 * a captured event, a wait between a captured event and a stream outside that capture, and giving
 * a reservation back or unmapping a page while any stream captures are violations. A capturing
 * stream's wait on an outside event is made on the host, as the CUDA backend does, and counted as
 * a host wait. The capture's graph is simulated too: work launched on a capturing stream
 * (ia_host_capture_launch) is a node after the stream's frontier, and a stream's wait on another
 * (ia_host_capture_wait) joins the other's frontier to its own, pulling it into the capture as an
 * event wait does in CUDA; the nodes go once no stream captures. The host backend
 * (csrc/arena/backend_host.c) asks it through _ia_host_captures_t. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "../arena/backend.h"
#include "testing.h"

typedef struct host_node {
  struct host_node **parents;
  size_t n_parents;
  struct host_node *next; /* every node of every capture, freed once no stream captures */
} host_node_t;

#define MAX_CAPTURING 64
#define MAX_FRONTIER 64
static struct {
  pthread_mutex_t lock; /* innermost: takes no other (Note [Device lifetime], csrc/torch/plugin.h) */
  struct {
    ia_stream_t stream;
    uint64_t id;
    host_node_t *frontier[MAX_FRONTIER];
    size_t n_frontier;
  } streams[MAX_CAPTURING];
  size_t count;
  host_node_t *nodes;
  _Atomic uint64_t violations, host_waits;
} captures = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* The stream's index among the capturing ones, or -1; under captures.lock. */
static int capturing_index(ia_stream_t stream) {
  for (size_t i = 0; i < captures.count; i++)
    if (captures.streams[i].stream == stream) return (int)i;
  return -1;
}

static uint64_t capture_of(ia_stream_t stream) {
  pthread_mutex_lock(&captures.lock);
  int i = capturing_index(stream);
  uint64_t id = i < 0 ? 0 : captures.streams[i].id;
  pthread_mutex_unlock(&captures.lock);
  return id;
}

/* Under captures.lock: the stream starts capturing `capture` with an empty frontier. */
static bool start_capturing(ia_stream_t stream, uint64_t capture) {
  if (!capture || captures.count == MAX_CAPTURING || capturing_index(stream) >= 0) return false;
  captures.streams[captures.count].stream = stream;
  captures.streams[captures.count].id = capture;
  captures.streams[captures.count++].n_frontier = 0;
  return true;
}

bool ia_host_capture_begin(ia_stream_t stream, uint64_t capture) {
  pthread_mutex_lock(&captures.lock);
  bool ok = start_capturing(stream, capture);
  pthread_mutex_unlock(&captures.lock);
  return ok;
}

void ia_host_capture_end(ia_stream_t stream) {
  pthread_mutex_lock(&captures.lock);
  int i = capturing_index(stream);
  if (i >= 0) captures.streams[i] = captures.streams[--captures.count];
  while (!captures.count && captures.nodes) {
    host_node_t *n = captures.nodes;
    captures.nodes = n->next;
    free(n->parents);
    free(n);
  }
  pthread_mutex_unlock(&captures.lock);
}

const void *ia_host_capture_launch(ia_stream_t stream) {
  pthread_mutex_lock(&captures.lock);
  int i = capturing_index(stream);
  host_node_t *n = i < 0 ? NULL : calloc(1, sizeof *n);
  if (n && captures.streams[i].n_frontier) {
    n->n_parents = captures.streams[i].n_frontier;
    n->parents = malloc(n->n_parents * sizeof *n->parents);
    if (n->parents) {
      for (size_t k = 0; k < n->n_parents; k++) n->parents[k] = captures.streams[i].frontier[k];
    } else {
      free(n);
      n = NULL;
    }
  }
  if (n) {
    n->next = captures.nodes;
    captures.nodes = n;
    captures.streams[i].frontier[0] = n;
    captures.streams[i].n_frontier = 1;
  }
  pthread_mutex_unlock(&captures.lock);
  return n;
}

bool ia_host_capture_wait(ia_stream_t waiter, ia_stream_t waited) {
  pthread_mutex_lock(&captures.lock);
  int from = capturing_index(waited), to = capturing_index(waiter);
  bool ok = from >= 0 && (to < 0 || captures.streams[to].id == captures.streams[from].id);
  if (ok && to < 0) {
    ok = start_capturing(waiter, captures.streams[from].id);
    to = (int)captures.count - 1;
  }
  for (size_t k = 0; ok && k < captures.streams[from].n_frontier; k++) {
    host_node_t *node = captures.streams[from].frontier[k];
    bool known = false;
    for (size_t j = 0; j < captures.streams[to].n_frontier; j++) known |= captures.streams[to].frontier[j] == node;
    if (!known && (ok = captures.streams[to].n_frontier < MAX_FRONTIER))
      captures.streams[to].frontier[captures.streams[to].n_frontier++] = node;
  }
  pthread_mutex_unlock(&captures.lock);
  return ok;
}

static size_t frontier(ia_stream_t stream, uint64_t *capture, const void **out, size_t cap) {
  pthread_mutex_lock(&captures.lock);
  int i = capturing_index(stream);
  *capture = i < 0 ? 0 : captures.streams[i].id;
  size_t n = i < 0 ? 0 : captures.streams[i].n_frontier;
  for (size_t k = 0; k < n && k < cap; k++) out[k] = captures.streams[i].frontier[k];
  pthread_mutex_unlock(&captures.lock);
  return n;
}

static size_t parents(const void *node, const void **out, size_t cap) {
  const host_node_t *n = node;
  for (size_t k = 0; k < n->n_parents && k < cap; k++) out[k] = n->parents[k];
  return n->n_parents;
}

uint64_t ia_host_capture_violations(void) { return atomic_load(&captures.violations); }
uint64_t ia_host_capture_host_waits(void) { return atomic_load(&captures.host_waits); }

static bool any(void) {
  pthread_mutex_lock(&captures.lock);
  bool any = captures.count > 0;
  pthread_mutex_unlock(&captures.lock);
  return any;
}

static void violation(void) { atomic_fetch_add(&captures.violations, 1); }
static void host_wait(void) { atomic_fetch_add(&captures.host_waits, 1); }

/* Every host backend of the process sees the simulation from the start. */
__attribute__((constructor)) static void install(void) {
  static const _ia_host_captures_t sim = {.capture_of = capture_of, .any = any, .violation = violation,
                                          .host_wait = host_wait, .frontier = frontier, .parents = parents};
  _ia_host_set_captures(&sim);
}
