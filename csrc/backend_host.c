/* Host backend: reservations from anonymous mappings, streams simulated by counters.
 *
 * A stream here is a queue of recorded events. Recording returns at once; the event completes when
 * the test calls ia_host_complete(stream), or immediately under auto-complete. A wait only counts
 * that it happened: on the host there is no queued work for it to hold back. Tests use the counts
 * to see that the arena ordered a cross-stream reuse.
 *
 * CUDA graph capture is simulated with CUDA's rules, and every break of them is counted instead of
 * invalidating anything: a stream put in capture (ia_host_capture_begin, shared by all host
 * backends) records captured events; querying a captured event, a wait between a captured event
 * and a stream outside that capture, and giving a reservation back while any stream captures are
 * violations. A capturing stream's wait on an outside event is made on the host, as the CUDA
 * backend does, and counted as a host wait. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

typedef struct {
  ia_stream_t stream;
  uint64_t recorded, completed;
} stream_clock_t;

typedef struct {
  ia_stream_t waiter, waited_on;
  uint64_t count;
} wait_count_t;

typedef struct {
  ia_stream_t stream;
  uint64_t seq;
  uint64_t capture; /* the capture it was recorded in; 0: none */
} host_event_t;

#define MAX_CAPTURING 64
static struct {
  pthread_mutex_t lock;
  ia_stream_t streams[MAX_CAPTURING];
  uint64_t ids[MAX_CAPTURING];
  size_t count;
  _Atomic uint64_t violations, host_waits;
} captures = {.lock = PTHREAD_MUTEX_INITIALIZER};

static uint64_t capture_of(ia_stream_t stream) {
  uint64_t id = 0;
  pthread_mutex_lock(&captures.lock);
  for (size_t i = 0; i < captures.count; i++)
    if (captures.streams[i] == stream) id = captures.ids[i];
  pthread_mutex_unlock(&captures.lock);
  return id;
}

bool ia_host_capture_begin(ia_stream_t stream, uint64_t capture) {
  pthread_mutex_lock(&captures.lock);
  bool ok = capture && captures.count < MAX_CAPTURING;
  for (size_t i = 0; ok && i < captures.count; i++) ok = captures.streams[i] != stream;
  if (ok) {
    captures.streams[captures.count] = stream;
    captures.ids[captures.count++] = capture;
  }
  pthread_mutex_unlock(&captures.lock);
  return ok;
}

void ia_host_capture_end(ia_stream_t stream) {
  pthread_mutex_lock(&captures.lock);
  for (size_t i = 0; i < captures.count; i++)
    if (captures.streams[i] == stream) {
      captures.streams[i] = captures.streams[--captures.count];
      captures.ids[i] = captures.ids[captures.count];
      break;
    }
  pthread_mutex_unlock(&captures.lock);
}

uint64_t ia_host_capture_violations(void) { return atomic_load(&captures.violations); }
uint64_t ia_host_capture_host_waits(void) { return atomic_load(&captures.host_waits); }

static bool host_stream_capturing(ia_backend_t *self, ia_stream_t stream) {
  (void)self;
  return capture_of(stream) != 0;
}

typedef struct {
  ia_backend_t base;
  pthread_mutex_t lock;
  size_t limit, reserved;
  bool auto_complete;
  stream_clock_t *clocks;
  size_t n_clocks, cap_clocks;
  wait_count_t *waits;
  size_t n_waits, cap_waits;
} host_backend_t;

static host_backend_t *host(ia_backend_t *b) { return (host_backend_t *)b; }

static bool grow_array(void **items, size_t *cap, size_t item_size) {
  size_t n = *cap ? *cap * 2 : 8;
  void *grown = realloc(*items, n * item_size);
  if (!grown) return false;
  *items = grown;
  *cap = n;
  return true;
}

static stream_clock_t *clock_of(host_backend_t *h, ia_stream_t s) {
  for (size_t i = 0; i < h->n_clocks; i++)
    if (h->clocks[i].stream == s) return &h->clocks[i];
  if (h->n_clocks == h->cap_clocks && !grow_array((void **)&h->clocks, &h->cap_clocks, sizeof *h->clocks))
    return NULL;
  h->clocks[h->n_clocks] = (stream_clock_t){.stream = s};
  return &h->clocks[h->n_clocks++];
}

static ia_status_t host_reserve(ia_backend_t *self, size_t size, void **out) {
  host_backend_t *h = host(self);
  pthread_mutex_lock(&h->lock);
  bool over = h->limit && (size > h->limit || h->reserved > h->limit - size);
  void *p = over ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED) h->reserved += size;
  pthread_mutex_unlock(&h->lock);
  if (p == MAP_FAILED) return IA_ERR_BACKEND_OUT_OF_MEMORY;
  *out = p;
  return IA_OK;
}

static void host_release(ia_backend_t *self, void *base, size_t size) {
  host_backend_t *h = host(self);
  pthread_mutex_lock(&captures.lock);
  if (captures.count) atomic_fetch_add(&captures.violations, 1);
  pthread_mutex_unlock(&captures.lock);
  munmap(base, size);
  pthread_mutex_lock(&h->lock);
  h->reserved -= size;
  pthread_mutex_unlock(&h->lock);
}

static ia_status_t host_commit(ia_backend_t *self, void *base, size_t size) {
  (void)self;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  for (size_t off = 0; off < size; off += page) ((volatile char *)base)[off] = 0;
  return IA_OK;
}

static ia_status_t host_event_create(ia_backend_t *self, void **event) {
  (void)self;
  *event = calloc(1, sizeof(host_event_t));
  return *event ? IA_OK : IA_ERR_NO_HOST_MEMORY;
}

static void host_event_destroy(ia_backend_t *self, void *event) {
  (void)self;
  free(event);
}

static ia_status_t host_event_record(ia_backend_t *self, void *event, ia_stream_t stream) {
  host_backend_t *h = host(self);
  host_event_t *e = event;
  pthread_mutex_lock(&h->lock);
  stream_clock_t *c = clock_of(h, stream);
  e->capture = capture_of(stream);
  if (c) {
    e->stream = stream;
    e->seq = ++c->recorded;
    if (h->auto_complete) c->completed = c->recorded;
  }
  pthread_mutex_unlock(&h->lock);
  return c ? IA_OK : IA_ERR_NO_HOST_MEMORY;
}

static bool host_event_done(ia_backend_t *self, void *event) {
  host_backend_t *h = host(self);
  host_event_t *e = event;
  if (e->capture) atomic_fetch_add(&captures.violations, 1);
  pthread_mutex_lock(&h->lock);
  stream_clock_t *c = clock_of(h, e->stream);
  bool done = !c || c->completed >= e->seq;
  pthread_mutex_unlock(&h->lock);
  return done;
}

static ia_status_t host_stream_wait(ia_backend_t *self, ia_stream_t stream, void *event) {
  host_backend_t *h = host(self);
  host_event_t *e = event;
  uint64_t waiter_capture = capture_of(stream);
  if (waiter_capture && !e->capture) { /* made on the host: nothing is queued behind it */
    atomic_fetch_add(&captures.host_waits, 1);
    return IA_OK;
  }
  if (waiter_capture != e->capture) atomic_fetch_add(&captures.violations, 1);
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&h->lock);
  wait_count_t *w = NULL;
  for (size_t i = 0; i < h->n_waits && !w; i++)
    if (h->waits[i].waiter == stream && h->waits[i].waited_on == e->stream) w = &h->waits[i];
  if (!w) {
    if (h->n_waits == h->cap_waits && !grow_array((void **)&h->waits, &h->cap_waits, sizeof *h->waits))
      st = IA_ERR_NO_HOST_MEMORY;
    else
      w = &h->waits[h->n_waits++], *w = (wait_count_t){.waiter = stream, .waited_on = e->stream};
  }
  if (w) w->count++;
  pthread_mutex_unlock(&h->lock);
  return st;
}

static void host_destroy(ia_backend_t *self) {
  host_backend_t *h = host(self);
  pthread_mutex_destroy(&h->lock);
  free(h->clocks);
  free(h->waits);
  free(h);
}

ia_status_t ia_host_backend_create(size_t limit_bytes, ia_backend_t **out) {
  host_backend_t *h = calloc(1, sizeof *h);
  if (!h) return IA_ERR_NO_HOST_MEMORY;
  h->base = (ia_backend_t){
      .name = "host",
      .natural_alignment = (size_t)sysconf(_SC_PAGESIZE),
      .reserve = host_reserve,
      .release = host_release,
      .event_create = host_event_create,
      .event_destroy = host_event_destroy,
      .event_record = host_event_record,
      .event_done = host_event_done,
      .stream_wait = host_stream_wait,
      .destroy = host_destroy,
      .commit = host_commit,
      .stream_capturing = host_stream_capturing,
  };
  pthread_mutex_init(&h->lock, NULL);
  h->limit = limit_bytes;
  h->auto_complete = true;
  *out = &h->base;
  return IA_OK;
}

void ia_host_set_auto_complete(ia_backend_t *b, bool on) {
  host_backend_t *h = host(b);
  pthread_mutex_lock(&h->lock);
  h->auto_complete = on;
  pthread_mutex_unlock(&h->lock);
}

void ia_host_complete(ia_backend_t *b, ia_stream_t stream) {
  host_backend_t *h = host(b);
  pthread_mutex_lock(&h->lock);
  stream_clock_t *c = clock_of(h, stream);
  if (c) c->completed = c->recorded;
  pthread_mutex_unlock(&h->lock);
}

uint64_t ia_host_waits(const ia_backend_t *b, ia_stream_t waiter, ia_stream_t waited_on) {
  host_backend_t *h = host((ia_backend_t *)b);
  uint64_t n = 0;
  pthread_mutex_lock(&h->lock);
  for (size_t i = 0; i < h->n_waits; i++)
    if (h->waits[i].waiter == waiter && h->waits[i].waited_on == waited_on) n = h->waits[i].count;
  pthread_mutex_unlock(&h->lock);
  return n;
}

void ia_backend_destroy(ia_backend_t *b) {
  if (b) b->destroy(b);
}
