/* Host backend: reservations from anonymous mappings, streams simulated by counters.
 *
 * A stream here is a queue of recorded events. Recording returns at once; the event completes when
 * the test calls ia_host_complete(stream), or immediately under auto-complete. A wait only counts
 * that it happened: on the host there is no queued work for it to hold back. Tests use the counts
 * to see that the arena ordered a cross-stream reuse.
 *
 * CUDA graph capture is simulated in the test build alone (csrc/testing/host_capture.c).
 *
 * Page mapping (ia_host_mapping_backend_create) is simulated with the kernel's own pages: an
 * address range is an inaccessible mapping (PROT_NONE), a mapped page is made read-write and
 * starts zero-filled, an unmapped page is replaced by a fresh inaccessible one, so its contents are
 * gone and any touch faults, as it would on a device. One byte per page says whether it is mapped;
 * every call the CUDA driver would refuse (a map of a mapped page, an unmap of an unmapped one, a
 * range freed with pages in it) is counted as an error instead; unmapping while a stream captures
 * is a capture violation, as giving a reservation back is. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"

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

/* Simulated CUDA graph capture, when the test build links it in (csrc/testing/host_capture.c);
 * without it no stream ever captures and nothing breaks capture rules. */
static const _ia_host_captures_t *captures;

void _ia_host_set_captures(const _ia_host_captures_t *sim) { captures = sim; }
static uint64_t capture_of(ia_stream_t stream) { return captures ? captures->capture_of(stream) : 0; }
static bool any_capturing(void) { return captures && captures->any(); }
static void violation(void) {
  if (captures) captures->violation();
}

static size_t host_capture_frontier(ia_backend_t *self, ia_stream_t stream, uint64_t *capture, const void **out,
                                    size_t cap) {
  (void)self;
  *capture = 0;
  return captures ? captures->frontier(stream, capture, out, cap) : 0;
}

static size_t host_node_parents(ia_backend_t *self, const void *node, const void **out, size_t cap) {
  (void)self;
  return captures ? captures->parents(node, out, cap) : 0;
}

static bool host_stream_capturing(ia_backend_t *self, ia_stream_t stream) {
  (void)self;
  return capture_of(stream) != 0;
}

typedef struct host_range {
  uintptr_t base;
  size_t size;
  uint8_t *mapped; /* one byte per page */
  struct host_range *next;
} host_range_t;

typedef struct {
  ia_backend_t base;
  /* Guards the fields below; taken under the arena's lock, and takes the simulated capture's (the
   * lock order of the whole core: Note [Device lifetime], csrc/torch/plugin.h). */
  pthread_mutex_t lock;
  size_t limit, reserved; /* reserved: ordinary reservations and mapped pages */
  bool auto_complete;
  stream_clock_t *clocks;
  size_t n_clocks, cap_clocks;
  wait_count_t *waits;
  size_t n_waits, cap_waits;
  host_range_t *ranges;
  ia_mapping_counters_t counters;
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
  if (any_capturing()) violation();
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
  if (e->capture) violation();
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
    captures->host_wait();
    return IA_OK;
  }
  if (waiter_capture != e->capture) violation();
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

/* A host thread that waits for a stream's work: on the host nothing is queued, so the wait is
 * what completes it. */
static ia_status_t host_event_wait(ia_backend_t *self, void *event) {
  host_backend_t *h = host(self);
  host_event_t *e = event;
  if (e->capture) violation();
  pthread_mutex_lock(&h->lock);
  stream_clock_t *c = clock_of(h, e->stream);
  if (c && c->completed < e->seq) {
    c->completed = e->seq;
    h->counters.waits++;
  }
  pthread_mutex_unlock(&h->lock);
  return c ? IA_OK : IA_ERR_NO_HOST_MEMORY;
}

/* ---- page mapping ------------------------------------------------------------------------------ */

/* The range holding [at, at + size), when the stretch is page-aligned and inside one; under h->lock. */
static host_range_t *stretch_range(host_backend_t *h, uintptr_t at, size_t size) {
  size_t page = h->base.page_size;
  if (!size || at % page || size % page) return NULL;
  for (host_range_t *r = h->ranges; r; r = r->next)
    if (at >= r->base && at - r->base < r->size && size <= r->size - (at - r->base)) return r;
  return NULL;
}

/* Replaces [at, at + size) with fresh inaccessible pages: what was there is gone. */
static void discard(uintptr_t at, size_t size) {
  mmap((void *)at, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

static ia_status_t host_address_reserve(ia_backend_t *self, size_t size, void **out) {
  host_backend_t *h = host(self);
  size_t page = self->page_size;
  if (!size || size % page || size > SIZE_MAX - page) return IA_ERR_INVALID_ARGUMENT;
  host_range_t *r = calloc(1, sizeof *r);
  uint8_t *mapped = calloc(size / page, 1);
  /* A page more than asked, so that a start on a page boundary lies inside; the rest is trimmed. */
  void *raw = r && mapped ? mmap(NULL, size + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                          : MAP_FAILED;
  if (raw == MAP_FAILED) {
    free(r);
    free(mapped);
    return IA_ERR_BACKEND_OUT_OF_MEMORY;
  }
  uintptr_t lo = (uintptr_t)raw, base = _ia_align_up(lo, page);
  if (base > lo) munmap(raw, base - lo);
  if (lo + page > base) munmap((void *)(base + size), lo + page - base);
  *r = (host_range_t){.base = base, .size = size, .mapped = mapped};
  pthread_mutex_lock(&h->lock);
  r->next = h->ranges;
  h->ranges = r;
  h->counters.ranges++;
  h->counters.range_reserves++;
  pthread_mutex_unlock(&h->lock);
  *out = (void *)base;
  return IA_OK;
}

static void host_address_free(ia_backend_t *self, void *base, size_t size) {
  host_backend_t *h = host(self);
  pthread_mutex_lock(&h->lock);
  host_range_t **link = &h->ranges;
  while (*link && !((*link)->base == (uintptr_t)base && (*link)->size == size)) link = &(*link)->next;
  host_range_t *r = *link;
  if (r) {
    *link = r->next;
    size_t page = self->page_size, still = 0;
    for (size_t i = 0; i < size / page; i++) still += r->mapped[i];
    if (still) { /* the driver refuses this; count it, and give the pages back anyway */
      h->counters.errors++;
      h->reserved -= still * page;
      h->counters.mapped -= still * page;
    }
    h->counters.ranges--;
  } else {
    h->counters.errors++;
  }
  pthread_mutex_unlock(&h->lock);
  if (r) {
    munmap(base, size);
    free(r->mapped);
    free(r);
  }
}

static ia_status_t host_map(ia_backend_t *self, void *at, size_t size) {
  host_backend_t *h = host(self);
  uintptr_t p = (uintptr_t)at;
  size_t page = self->page_size;
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&h->lock);
  host_range_t *r = stretch_range(h, p, size);
  size_t first = r ? (p - r->base) / page : 0, n = size / page;
  for (size_t i = 0; r && i < n && st == IA_OK; i++)
    if (r->mapped[first + i]) st = IA_ERR_INVALID_ARGUMENT;
  if (!r || st != IA_OK) {
    h->counters.errors++;
    st = IA_ERR_INVALID_ARGUMENT;
  } else if (h->limit && (size > h->limit || h->reserved > h->limit - size)) {
    st = IA_ERR_BACKEND_OUT_OF_MEMORY;
  } else if (mprotect(at, size, PROT_READ | PROT_WRITE) != 0) {
    st = IA_ERR_BACKEND_OUT_OF_MEMORY;
  }
  if (st == IA_OK) {
    memset(r->mapped + first, 1, n);
    h->reserved += size;
    ia_mapping_counters_t *c = &h->counters;
    c->maps++;
    c->pages_mapped += n;
    c->mapped += size;
    if (c->mapped > c->mapped_peak) c->mapped_peak = c->mapped;
  } else if (st == IA_ERR_BACKEND_OUT_OF_MEMORY) {
    h->counters.refusals++;
  }
  pthread_mutex_unlock(&h->lock);
  return st;
}

static void host_unmap(ia_backend_t *self, void *at, size_t size) {
  host_backend_t *h = host(self);
  uintptr_t p = (uintptr_t)at;
  size_t page = self->page_size;
  if (any_capturing()) violation();
  pthread_mutex_lock(&h->lock);
  host_range_t *r = stretch_range(h, p, size);
  size_t first = r ? (p - r->base) / page : 0, n = size / page;
  bool all_mapped = r != NULL;
  for (size_t i = 0; r && i < n; i++) all_mapped &= r->mapped[first + i] == 1;
  if (!all_mapped) h->counters.errors++;
  if (all_mapped) {
    discard(p, size);
    memset(r->mapped + first, 0, n);
    h->reserved -= size;
    h->counters.unmaps++;
    h->counters.pages_unmapped += n;
    h->counters.mapped -= size;
  }
  pthread_mutex_unlock(&h->lock);
}

static ia_status_t host_grant_access(ia_backend_t *self, int peer) {
  if (peer < 0 || peer >= 64) return IA_ERR_INVALID_ARGUMENT;
  host_backend_t *h = host(self);
  pthread_mutex_lock(&h->lock);
  h->counters.peers |= 1ull << peer;
  pthread_mutex_unlock(&h->lock);
  return IA_OK;
}

void ia_host_mapping_counters(const ia_backend_t *b, ia_mapping_counters_t *out) {
  host_backend_t *h = host((ia_backend_t *)b);
  pthread_mutex_lock(&h->lock);
  *out = h->counters;
  pthread_mutex_unlock(&h->lock);
}

bool ia_host_range_mapped(const ia_backend_t *b, uintptr_t at, size_t size) {
  host_backend_t *h = host((ia_backend_t *)b);
  size_t page = b->page_size;
  if (!page || !size || at > UINTPTR_MAX - size) return false;
  uintptr_t lo = at & ~(uintptr_t)(page - 1), hi = _ia_align_up(at + size, page);
  pthread_mutex_lock(&h->lock);
  host_range_t *r = stretch_range(h, lo, hi - lo);
  bool mapped = r != NULL;
  for (uintptr_t q = lo; r && q < hi; q += page) mapped &= r->mapped[(q - r->base) / page] == 1;
  pthread_mutex_unlock(&h->lock);
  return mapped;
}

static void host_destroy(ia_backend_t *self) {
  host_backend_t *h = host(self);
  while (h->ranges) host_address_free(self, (void *)h->ranges->base, h->ranges->size);
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
      .event_wait = host_event_wait,
      .capture_frontier = host_capture_frontier,
      .node_parents = host_node_parents,
  };
  pthread_mutex_init(&h->lock, NULL);
  h->limit = limit_bytes;
  h->auto_complete = true;
  *out = &h->base;
  return IA_OK;
}

ia_status_t ia_host_mapping_backend_create(size_t limit_bytes, size_t page_size, ia_backend_t **out) {
  *out = NULL;
  if (!_ia_is_pow2(page_size) || page_size % (size_t)sysconf(_SC_PAGESIZE) || page_size > ((size_t)1 << 30))
    return IA_ERR_INVALID_ARGUMENT;
  ia_status_t st = ia_host_backend_create(limit_bytes, out);
  if (st != IA_OK) return st;
  ia_backend_t *b = *out;
  b->name = "host (mapping)";
  b->page_size = page_size;
  b->address_reserve = host_address_reserve;
  b->address_free = host_address_free;
  b->map = host_map;
  b->unmap = host_unmap;
  b->grant_access = host_grant_access;
  host(b)->counters.page_size = page_size;
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
