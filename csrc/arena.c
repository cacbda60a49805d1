/* The arena: sub-allocation of reservations that were made once.
 *
 * Layout. Every region (one backend reservation) is tiled by blocks kept in address order through
 * phys_prev/phys_next. A block is either live (in the live table, keyed by address) or free (in one
 * size-class bin). Block headers live here in host memory, never in the reservation, because the
 * reservation is usually device memory the CPU cannot touch.
 *
 * Policy: best fit over segregated size classes (TLSF's classes, Masmano et al. 2004): powers of
 * two split 32 ways, with bitmaps over the non-empty classes. A search scans the request's own
 * class for the smallest block that holds it, else takes the smallest block of the first non-empty
 * larger class (found with two find-first-set instructions); each scan looks at a bounded number
 * of blocks, so a search costs the same whatever the number of free blocks. Best fit rather than
 * TLSF's good fit, because the general pools serve every tensor of a serving process: taking a
 * block from a larger class when the request's own class has one that fits splits large blocks
 * for small requests, and measured on a Llama-style decode it held 18% more memory than PyTorch's
 * own best-fit allocator. A request is refused only when no free block can hold it.
 * Freed blocks merge with free neighbours at once, which keeps the arena one block when idle: the
 * growing-request pattern of a chunked prefill always finds the whole budget free.
 *
 * Streams. A live block belongs to the stream it was allocated on. A freed block remembers the
 * stream it was freed on and a sequence number. The same stream may reuse it at once (stream order
 * protects it). Another stream may reuse it only once ordered after the free: the arena records the
 * freeing stream's event (lazily, once per batch of frees) and, unless that event has already
 * completed, makes the allocating stream wait on it. Merging two free blocks freed on different
 * streams orders one stream after the other the same way, so a free block has a single stream.
 *
 * Threads. With thread_cache set, each thread has a cache of the blocks it allocated
 * (thread_cache.c): its own frees and same-stream reuse of them skip this file's lock. The arena
 * sees a block lent to a cache as not free. A request it cannot serve takes cached blocks back one
 * by one until it fits, so that it grows or refuses only once no cache keeps any; anything that
 * needs its merged free state (allocation at an address, releasing regions, recording events
 * before a capture) takes every cache's free blocks back (drain); destruction forgets them.
 * Statistics, the block list and the invariant walk change nothing: they add the caches' counters
 * (fold) and count the blocks free in caches as free blocks of their own.
 *
 * Locking: one mutex per arena (adaptive: it spins briefly before sleeping) guards everything in
 * it, taken once per public call that is not served by a thread cache. Backend calls made while
 * growing or ordering streams happen under it; they never call back into the arena.
 *
 * Over a backend that maps pages, a growable arena's regions are the mapped stretches of one
 * address range instead of reservations (see "mapped ranges" below); nothing else changes. Thread
 * caches keep blocks of those stretches as of any region: release takes them back before it unmaps,
 * and growth maps pages only after taking back every block they keep, so a cache never makes the
 * arena map more.
 */
#define _GNU_SOURCE /* PTHREAD_MUTEX_ADAPTIVE_NP */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SL_COUNT IA_SL_COUNT
#define FL_COUNT IA_FL_COUNT
#define ALIGN_SHIFT IA_ALIGN_SHIFT
#define SLAB_BLOCKS 256
/* Blocks looked at per class list before settling; bounds the search whatever the list length. */
#define SCAN_LIMIT 16
/* No reservation comes near this; above it the class arithmetic could overflow. */
#define MAX_REQUEST ((size_t)1 << 62)

typedef _ia_region_t region_t;
typedef _ia_block_t block_t; /* internal.h: thread caches hold blocks too */

struct _ia_region {
  void *raw;
  size_t raw_size;
  uintptr_t base;
  size_t size;
  block_t *first;
  region_t *next;
};

typedef struct slab {
  struct slab *next;
  block_t blocks[SLAB_BLOCKS];
} slab_t;

typedef struct stream_state {
  ia_stream_t stream;
  void *event;
  uint64_t recorded_seq; /* frees up to this sequence number are behind the recorded event */
} stream_state_t;

struct ia_arena {
  pthread_mutex_t lock;
  ia_arena_options_t opts;
  ia_backend_t *backend;

  region_t *regions; /* oldest first: a region's index in reports stays put as others come */
  uintptr_t fixed_lo, fixed_hi; /* fixed arenas: the one region, readable without the lock */

  uint64_t fl_bitmap;
  uint32_t sl_bitmap[FL_COUNT];
  block_t *bins[FL_COUNT][SL_COUNT];

  _ia_table_t table; /* every block not free here: live, or lent to a thread cache */

  slab_t *slabs;
  block_t *spare_blocks;

  stream_state_t *streams;
  size_t n_streams, cap_streams;
  uint64_t free_seq;

  _ia_tcache_t **caches; /* the threads' caches of this arena */
  size_t n_caches, cap_caches;

  ia_totals_t *totals;
  const _Atomic int *captures; /* the device's capture count, when it has one */
  _ia_region_hook_t on_region;
  void *on_region_ctx;
  /* Atomic: the thread-cache fast path records without the lock. The tag is device << 8 | pool. */
  ia_trace_t *_Atomic trace;
  _Atomic uint64_t trace_tag;

  /* Over a mapping backend: its page and the one address range (page 0: regions are reservations). */
  size_t page;
  uintptr_t range_base;
  size_t range_size;

  ia_stats_t stats;
};

static inline void trace(ia_arena_t *a, ia_trace_action_t action, uintptr_t address, uint64_t size,
                         ia_stream_t stream) {
  ia_trace_t *t = atomic_load_explicit(&a->trace, memory_order_acquire);
  if (!t) return;
  uint64_t tag = atomic_load_explicit(&a->trace_tag, memory_order_relaxed);
  _ia_trace_record(t, action, (int32_t)(tag >> 8), (uint8_t)tag, address, size, stream);
}

void _ia_assert_fail(const char *cond, const char *file, int line) {
  fprintf(stderr, "indexer-arena: internal invariant broken: %s (%s:%d)\n", cond, file, line);
  abort();
}

static void raise_peak(_Atomic uint64_t *peak, uint64_t value) {
  uint64_t seen = atomic_load_explicit(peak, memory_order_relaxed);
  while (value > seen && !atomic_compare_exchange_weak_explicit(peak, &seen, value, memory_order_relaxed,
                                                                memory_order_relaxed)) {
  }
}

static void totals_add(ia_arena_t *a, int64_t in_use, int64_t capacity) {
  ia_totals_t *t = a->totals;
  if (!t) return;
  if (in_use) raise_peak(&t->in_use_peak, atomic_fetch_add(&t->in_use, (uint64_t)in_use) + (uint64_t)in_use);
  if (capacity)
    raise_peak(&t->capacity_peak, atomic_fetch_add(&t->capacity, (uint64_t)capacity) + (uint64_t)capacity);
}

void _ia_totals_reset_peaks(ia_totals_t *t) {
  atomic_store(&t->in_use_peak, atomic_load(&t->in_use));
  atomic_store(&t->capacity_peak, atomic_load(&t->capacity));
}

void _ia_arena_watch_captures(ia_arena_t *a, const _Atomic int *captures) {
  pthread_mutex_lock(&a->lock);
  a->captures = captures;
  pthread_mutex_unlock(&a->lock);
}

void _ia_arena_set_totals(ia_arena_t *a, ia_totals_t *t) {
  pthread_mutex_lock(&a->lock);
  a->totals = t;
  a->captures = &t->captures;
  totals_add(a, (int64_t)a->stats.in_use, (int64_t)a->stats.capacity);
  pthread_mutex_unlock(&a->lock);
}

/* ---- free classes (the size classes are in internal.h) ---------------------------------------- */

static void bin_insert(ia_arena_t *a, block_t *b) {
  unsigned fl, sl;
  _ia_class_of(b->size, &fl, &sl);
  b->fl = (uint16_t)fl;
  b->sl = (uint16_t)sl;
  b->free_prev = NULL;
  b->free_next = a->bins[fl][sl];
  if (b->free_next) b->free_next->free_prev = b;
  a->bins[fl][sl] = b;
  a->fl_bitmap |= 1ull << fl;
  a->sl_bitmap[fl] |= 1u << sl;
  a->stats.free_bytes += b->size;
  a->stats.free_blocks++;
}

static void bin_remove(ia_arena_t *a, block_t *b) {
  unsigned fl = b->fl, sl = b->sl;
  if (b->free_prev) b->free_prev->free_next = b->free_next;
  else a->bins[fl][sl] = b->free_next;
  if (b->free_next) b->free_next->free_prev = b->free_prev;
  if (!a->bins[fl][sl]) {
    a->sl_bitmap[fl] &= ~(1u << sl);
    if (!a->sl_bitmap[fl]) a->fl_bitmap &= ~(1ull << fl);
  }
  b->free_prev = b->free_next = NULL;
  a->stats.free_bytes -= b->size;
  a->stats.free_blocks--;
}

/* The smallest block of a class list that holds `size`, looking at no more than `limit` blocks. */
static block_t *smallest_fitting(block_t *list, size_t size, unsigned limit) {
  block_t *best = NULL;
  for (block_t *b = list; b && limit--; b = b->free_next)
    if (b->size >= size && (!best || b->size < best->size)) {
      best = b;
      if (b->size == size) break;
    }
  return best;
}

/* The first non-empty class strictly above (fl, sl), or false. */
static bool next_class(const ia_arena_t *a, unsigned *fl, unsigned *sl) {
  uint32_t sl_map = *sl + 1 < SL_COUNT ? a->sl_bitmap[*fl] & (~0u << (*sl + 1)) : 0;
  if (!sl_map) {
    uint64_t fl_map = *fl + 1 < FL_COUNT ? a->fl_bitmap & (~0ull << (*fl + 1)) : 0;
    if (!fl_map) return false;
    *fl = (unsigned)__builtin_ctzll(fl_map);
    sl_map = a->sl_bitmap[*fl];
  }
  *sl = (unsigned)__builtin_ctz(sl_map);
  return true;
}

static block_t *find_free(ia_arena_t *a, size_t size) {
  unsigned fl, sl;
  _ia_class_of(size, &fl, &sl);
  block_t *own = a->bins[fl][sl];
  block_t *b = smallest_fitting(own, size, SCAN_LIMIT);
  if (b) return b;
  if (next_class(a, &fl, &sl)) return smallest_fitting(a->bins[fl][sl], size, SCAN_LIMIT);
  /* Nothing larger anywhere: a fitting block can only hide past the scan limit of its own class. */
  return smallest_fitting(own, size, UINT32_MAX);
}

/* ---- block headers ---------------------------------------------------------------------------- */

static block_t *block_new(ia_arena_t *a) {
  if (!a->spare_blocks) {
    slab_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->next = a->slabs;
    a->slabs = s;
    for (int i = SLAB_BLOCKS - 1; i >= 0; i--) {
      s->blocks[i].free_next = a->spare_blocks;
      a->spare_blocks = &s->blocks[i];
    }
  }
  block_t *b = a->spare_blocks;
  a->spare_blocks = b->free_next;
  memset(b, 0, sizeof *b);
  return b;
}

static void block_delete(ia_arena_t *a, block_t *b) {
  free(b->uses);
  b->uses = NULL;
  b->free_next = a->spare_blocks;
  a->spare_blocks = b;
}

/* ---- block tables (internal.h) ---------------------------------------------------------------- */

static inline size_t slot_of(const _ia_table_t *t, uintptr_t addr) {
  return (size_t)(((uint64_t)addr >> ALIGN_SHIFT) * 0x9E3779B97F4A7C15ull >> 20) & t->mask;
}

static bool table_grow(_ia_table_t *t) {
  size_t old_size = t->slots ? t->mask + 1 : 0;
  size_t new_size = old_size ? old_size * 2 : 1024;
  block_t **slots = calloc(new_size, sizeof *slots);
  if (!slots) return false;
  block_t **old = t->slots;
  t->slots = slots;
  t->mask = new_size - 1;
  for (size_t i = 0; i < old_size; i++) {
    if (!old[i]) continue;
    size_t j = slot_of(t, old[i]->addr);
    while (slots[j]) j = (j + 1) & t->mask;
    slots[j] = old[i];
  }
  free(old);
  return true;
}

bool _ia_table_insert(_ia_table_t *t, block_t *b) {
  if (!t->slots || (t->count + 1) * 2 > t->mask + 1)
    if (!table_grow(t)) return false;
  size_t i = slot_of(t, b->addr);
  while (t->slots[i]) i = (i + 1) & t->mask;
  t->slots[i] = b;
  t->count++;
  return true;
}

block_t *_ia_table_find(const _ia_table_t *t, uintptr_t addr, size_t *slot) {
  if (!t->slots) return NULL;
  for (size_t i = slot_of(t, addr);; i = (i + 1) & t->mask) {
    block_t *b = t->slots[i];
    if (!b) return NULL;
    if (b->addr == addr) {
      if (slot) *slot = i;
      return b;
    }
  }
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
void _ia_table_remove_slot(_ia_table_t *t, size_t hole) {
  size_t i = hole;
  for (;;) {
    i = (i + 1) & t->mask;
    block_t *b = t->slots[i];
    if (!b) break;
    size_t home = slot_of(t, b->addr);
    bool movable = hole <= i ? (home <= hole || home > i) : (home <= hole && home > i);
    if (movable) {
      t->slots[hole] = b;
      hole = i;
    }
  }
  t->slots[hole] = NULL;
  t->count--;
}

void _ia_table_remove(_ia_table_t *t, block_t *b) {
  size_t slot;
  ia_assert(_ia_table_find(t, b->addr, &slot) == b);
  _ia_table_remove_slot(t, slot);
}

/* ---- regions ---------------------------------------------------------------------------------- */

static bool in_region(const region_t *r, uintptr_t p) { return p >= r->base && p - r->base < r->size; }

static region_t *region_of(const ia_arena_t *a, uintptr_t p) {
  for (region_t *r = a->regions; r; r = r->next)
    if (in_region(r, p)) return r;
  return NULL;
}

/* A reservation whose base is a multiple of `align`. A backend may promise less than an arena
 * asks (cudaMalloc promises 256 bytes; the general pools align to 512) and still return more, so
 * the exact size is asked first, and padded only when the base turns out unaligned: padding
 * every reservation would cost a whole 2 MiB page of device memory each, as the driver rounds
 * sizes up to its pages. */
static ia_status_t reserve_aligned(ia_arena_t *a, size_t size, size_t align, void **raw, size_t *raw_size) {
  a->stats.backend_reserves++;
  ia_status_t st = a->backend->reserve(a->backend, size, raw);
  if (st == IA_OK && ((uintptr_t)*raw & (align - 1)) == 0) {
    *raw_size = size;
    return IA_OK;
  }
  if (st == IA_OK) {
    a->backend->release(a->backend, *raw, size);
    a->stats.backend_releases++;
    a->stats.backend_reserves++;
    st = a->backend->reserve(a->backend, size + align, raw);
    *raw_size = size + align;
  }
  if (st != IA_OK) a->stats.backend_failures++;
  return st;
}

static ia_status_t region_add(ia_arena_t *a, size_t size) {
  size_t align = a->opts.alignment;
  if (size > SIZE_MAX - align) return IA_ERR_BACKEND_OUT_OF_MEMORY;
  region_t *r = calloc(1, sizeof *r);
  block_t *b = block_new(a);
  if (!r || !b) {
    free(r);
    if (b) block_delete(a, b);
    return IA_ERR_NO_HOST_MEMORY;
  }
  ia_status_t st = reserve_aligned(a, size, align, &r->raw, &r->raw_size);
  if (st != IA_OK) {
    free(r);
    block_delete(a, b);
    return st;
  }
  r->base = _ia_align_up((uintptr_t)r->raw, align);
  r->size = size;
  r->first = b;
  region_t **link = &a->regions; /* append: growth is rare and costs a backend call anyway */
  while (*link) link = &(*link)->next;
  *link = r;
  b->addr = r->base;
  b->size = size;
  b->region = r;
  b->stream = IA_STREAM_NONE;
  b->is_free = true;
  bin_insert(a, b);
  a->stats.capacity += size;
  totals_add(a, 0, (int64_t)size);
  a->stats.regions++;
  if (a->on_region) a->on_region(a->on_region_ctx, a, r->base, size, true);
  trace(a, IA_TRACE_RESERVE, r->base, size, IA_STREAM_NONE);
  if (a->stats.capacity > a->stats.capacity_peak) a->stats.capacity_peak = a->stats.capacity;
  return IA_OK;
}

static void region_drop(ia_arena_t *a, region_t *r) {
  region_t **link = &a->regions;
  while (*link != r) link = &(*link)->next;
  *link = r->next;
  if (a->on_region) a->on_region(a->on_region_ctx, a, r->base, r->size, false);
  trace(a, IA_TRACE_RELEASE, r->base, r->size, IA_STREAM_NONE);
  a->backend->release(a->backend, r->raw, r->raw_size);
  a->stats.backend_releases++;
  a->stats.capacity -= r->size;
  totals_add(a, 0, -(int64_t)r->size);
  a->stats.regions--;
  free(r);
}

/* While a stream of the device captures a CUDA graph, nothing goes back to the backend: a free
 * synchronizes the device, which a capture forbids. */
static bool capturing(const ia_arena_t *a) { return a->captures && atomic_load(a->captures) > 0; }

static uint64_t release_mapped(ia_arena_t *a);
static ia_status_t grow_mapped(ia_arena_t *a, size_t size);

static uint64_t release_free_regions(ia_arena_t *a) {
  uint64_t released = 0;
  if (capturing(a)) return 0;
  if (a->page) return release_mapped(a);
  region_t *next;
  for (region_t *r = a->regions; r; r = next) {
    next = r->next;
    block_t *b = r->first;
    if (!b->is_free || b->size != r->size) continue;
    bin_remove(a, b);
    block_delete(a, b);
    released += r->size;
    region_drop(a, r);
  }
  return released;
}

static size_t region_size_for(const ia_arena_options_t *o, size_t size) {
  size_t rounded = _ia_align_up(size, o->region_round);
  if (size >= o->region_exact_above) return rounded;
  return rounded > o->region_min ? rounded : o->region_min;
}

static bool over_limit(const ia_arena_t *a, size_t want) {
  if (a->opts.limit && a->stats.capacity + want > a->opts.limit) return true;
  uint64_t group = a->totals ? atomic_load(&a->totals->limit) : 0;
  return group && atomic_load(&a->totals->capacity) + want > group;
}

static ia_status_t grow(ia_arena_t *a, size_t size) {
  if (a->page) return grow_mapped(a, size);
  size_t want = region_size_for(&a->opts, size);
  if (over_limit(a, want)) {
    if (release_free_regions(a)) a->stats.retries++;
    if (over_limit(a, want)) return IA_ERR_LIMIT;
  }
  ia_status_t st = region_add(a, want);
  if ((st == IA_ERR_BACKEND_OUT_OF_MEMORY || st == IA_ERR_HOST_MEMORY_GUARD) &&
      release_free_regions(a)) {
    a->stats.retries++;
    st = region_add(a, want);
  }
  return st;
}

/* ---- stream ordering -------------------------------------------------------------------------- */

static stream_state_t *stream_state(ia_arena_t *a, ia_stream_t s, ia_status_t *st) {
  for (size_t i = 0; i < a->n_streams; i++)
    if (a->streams[i].stream == s) return &a->streams[i];
  if (a->n_streams == a->cap_streams) {
    size_t cap = a->cap_streams ? a->cap_streams * 2 : 8;
    stream_state_t *grown = realloc(a->streams, cap * sizeof *grown);
    if (!grown) {
      *st = IA_ERR_NO_HOST_MEMORY;
      return NULL;
    }
    a->streams = grown;
    a->cap_streams = cap;
  }
  stream_state_t *ss = &a->streams[a->n_streams];
  *ss = (stream_state_t){.stream = s};
  if ((*st = a->backend->event_create(a->backend, &ss->event)) != IA_OK) return NULL;
  a->n_streams++;
  return ss;
}

/* Makes `waiter` ordered after everything `freed_on` had queued when the free numbered free_seq
 * happened (UINT64_MAX: after everything it has queued now). */
static ia_status_t order_after(ia_arena_t *a, ia_stream_t waiter, ia_stream_t freed_on,
                               uint64_t free_seq) {
  if (freed_on == IA_STREAM_NONE || freed_on == waiter) return IA_OK;
  ia_status_t st = IA_OK;
  stream_state_t *ss = stream_state(a, freed_on, &st);
  if (!ss) return st;
  if (ss->recorded_seq < free_seq) {
    if ((st = a->backend->event_record(a->backend, ss->event, freed_on)) != IA_OK) return st;
    ss->recorded_seq = a->free_seq;
    a->stats.event_records++;
  }
  if (a->backend->event_done(a->backend, ss->event)) return IA_OK;
  if ((st = a->backend->stream_wait(a->backend, waiter, ss->event)) != IA_OK) return st;
  a->stats.stream_waits++;
  return IA_OK;
}

/* ---- mapped ranges ------------------------------------------------------------------------------
 * Over a mapping backend a growable arena reserves one address range when it is made and never
 * another. Its regions are the range's mapped stretches, kept in address order, each a whole
 * number of pages, so every byte of every block is mapped: allocation and free work as over
 * reservations and never see a page, and the capacity is the bytes mapped. Growth maps the fewest
 * pages that give the request a free block: after the free block that ends a stretch, as far as
 * the gap beyond allows, or filling a whole gap, whose two stretches then join and their free
 * blocks merge. So free space stays in one piece where regions would have cut it apart, and memory
 * grows by pages, not regions. Release unmaps the whole pages inside free blocks once no stream
 * work can still touch them, cutting stretches apart; a page that a live block touches stays. The
 * region hook (the registry) is told of the range once, so frees find the arena whatever is mapped.
 */

static void merge_into(ia_arena_t *a, block_t *left, block_t *right);

static size_t page_count(const ia_arena_t *a, size_t bytes) { return bytes / a->page + (bytes % a->page != 0); }

/* Growth is rare and costs a backend call, so the last block is found by walking. */
static block_t *last_block(const region_t *r) {
  block_t *b = r->first;
  while (b->phys_next) b = b->phys_next;
  return b;
}

/* `pages` pages to map at `at`, right after the stretch `after` (NULL: no stretch ends there). */
typedef struct {
  region_t *after;
  uintptr_t at;
  size_t pages;
} placement_t;

/* The placement that maps the fewest pages for a free block of `size`, the lowest on a tie; false
 * when no gap of the range can give one. */
static bool place(const ia_arena_t *a, size_t size, placement_t *out) {
  bool found = false;
  region_t *prev = NULL;
  for (region_t *r = a->regions;; prev = r, r = r->next) {
    uintptr_t lo = prev ? prev->base + prev->size : a->range_base;
    uintptr_t hi = r ? r->base : a->range_base + a->range_size;
    size_t gap = (hi - lo) / a->page;
    if (gap) {
      block_t *tail = prev ? last_block(prev) : NULL;
      size_t free_before = tail && tail->is_free ? tail->size : 0;
      size_t free_after = r && r->first->is_free ? r->first->size : 0;
      size_t pages = page_count(a, size > free_before ? size - free_before : 1);
      if (pages > gap) pages = free_before + (hi - lo) + free_after >= size ? gap : 0;
      if (pages && (!found || pages < out->pages)) {
        *out = (placement_t){prev, lo, pages};
        found = true;
      }
    }
    if (!r) return found;
  }
}

/* Joins `left` with the stretch that starts where it ends. Two free blocks meeting there merge,
 * which needs them on one stream: the first one's stream is ordered after the second one's, as a
 * free orders a free neighbour. When that fails the two stay apart, each whole. */
static ia_status_t join(ia_arena_t *a, region_t *left) {
  region_t *right = left->next;
  block_t *lb = last_block(left), *rb = right->first;
  bool merge = lb->is_free && rb->is_free;
  if (merge && lb->stream == IA_STREAM_NONE) {
    lb->stream = rb->stream;
    lb->free_seq = rb->free_seq;
  } else if (merge && rb->stream != IA_STREAM_NONE && rb->stream != lb->stream) {
    ia_status_t st = order_after(a, lb->stream, rb->stream, rb->free_seq);
    if (st != IA_OK) return st;
    lb->free_seq = ++a->free_seq; /* only an event recorded from now on follows the wait */
  } else if (merge && rb->free_seq > lb->free_seq) {
    lb->free_seq = rb->free_seq;
  }
  for (block_t *b = rb; b; b = b->phys_next) b->region = left;
  lb->phys_next = rb;
  rb->phys_prev = lb;
  left->size += right->size;
  left->next = right->next;
  free(right);
  a->stats.regions--;
  if (merge) {
    bin_remove(a, lb);
    bin_remove(a, rb);
    merge_into(a, lb, rb);
    bin_insert(a, lb);
  }
  return IA_OK;
}

/* Maps pages where `place` says; on IA_OK a free block of `size` exists. */
static ia_status_t map_for(ia_arena_t *a, size_t size) {
  placement_t p;
  if (!place(a, size, &p)) return IA_ERR_OUT_OF_MEMORY; /* no gap of the range is wide enough */
  size_t bytes = p.pages * a->page;
  if (over_limit(a, bytes)) return IA_ERR_LIMIT;
  /* The headers first: once the pages are mapped nothing may fail. */
  block_t *fresh = block_new(a);
  region_t *r = p.after ? p.after : calloc(1, sizeof *r);
  if (!fresh || !r) {
    if (fresh) block_delete(a, fresh);
    if (!p.after) free(r);
    return IA_ERR_NO_HOST_MEMORY;
  }
  a->stats.backend_reserves++;
  ia_status_t st = a->backend->map(a->backend, (void *)p.at, bytes);
  if (st != IA_OK) {
    a->stats.backend_failures++;
    block_delete(a, fresh);
    if (!p.after) free(r);
    return st;
  }
  a->stats.capacity += bytes;
  if (a->stats.capacity > a->stats.capacity_peak) a->stats.capacity_peak = a->stats.capacity;
  totals_add(a, 0, (int64_t)bytes);
  trace(a, IA_TRACE_RESERVE, p.at, bytes, IA_STREAM_NONE);
  *fresh = (block_t){.addr = p.at, .size = bytes, .region = r, .stream = IA_STREAM_NONE, .is_free = true};
  block_t *last = p.after ? last_block(r) : NULL;
  if (last && last->is_free) { /* new pages were never touched: the block keeps its stream */
    bin_remove(a, last);
    last->size += bytes;
    bin_insert(a, last);
    block_delete(a, fresh);
  } else if (last) {
    last->phys_next = fresh;
    fresh->phys_prev = last;
    bin_insert(a, fresh);
  } else {
    *r = (region_t){.base = p.at, .first = fresh};
    region_t **link = &a->regions;
    while (*link && (*link)->base < p.at) link = &(*link)->next;
    r->next = *link;
    *link = r;
    a->stats.regions++;
    bin_insert(a, fresh);
  }
  r->size += bytes;
  return r->next && r->base + r->size == r->next->base ? join(a, r) : IA_OK;
}

/* Like grow: a refusal of the limit or the backend gives the cached pages back and asks again. */
static ia_status_t grow_mapped(ia_arena_t *a, size_t size) {
  ia_status_t st = map_for(a, size);
  if ((st == IA_ERR_LIMIT || st == IA_ERR_BACKEND_OUT_OF_MEMORY || st == IA_ERR_HOST_MEMORY_GUARD) &&
      release_free_regions(a)) {
    a->stats.retries++;
    st = map_for(a, size);
  }
  return st;
}

/* Whether no stream work can still touch free block b: its stream's work up to its free has
 * completed, or the host waited for it where the backend can wait. Only called while no stream of
 * the device captures (so the event may be recorded now). */
static bool work_done(ia_arena_t *a, block_t *b) {
  if (b->stream == IA_STREAM_NONE) return true;
  ia_backend_t *be = a->backend;
  /* A capture the arena was not told of (standalone arenas have no capture count): no event on it. */
  if (be->stream_capturing && be->stream_capturing(be, b->stream)) return false;
  ia_status_t st = IA_OK;
  stream_state_t *ss = stream_state(a, b->stream, &st);
  if (!ss) return false;
  if (ss->recorded_seq < b->free_seq) {
    if (be->event_record(be, ss->event, b->stream) != IA_OK) return false;
    ss->recorded_seq = a->free_seq;
    a->stats.event_records++;
  }
  return be->event_done(be, ss->event) || (be->event_wait && be->event_wait(be, ss->event) == IA_OK);
}

/* Unmaps [lo, hi), whole pages inside free block b of stretch r, and cuts r there: what lies
 * before the hole stays r, what lies after becomes a stretch of its own (*rest: the stretch after
 * the hole, or NULL), and the parts of b on either side stay free blocks with b's stream. False,
 * changing nothing, when no header could be had. */
static bool cut(ia_arena_t *a, region_t *r, block_t *b, uintptr_t lo, uintptr_t hi, region_t **rest) {
  uintptr_t b_end = b->addr + b->size, r_end = r->base + r->size;
  bool head = lo > b->addr, tail = hi < b_end, before = lo > r->base, after = hi < r_end;
  block_t *spare = head && tail ? block_new(a) : NULL;
  region_t *split = before && after ? calloc(1, sizeof *split) : NULL;
  if ((head && tail && !spare) || (before && after && !split)) {
    if (spare) block_delete(a, spare);
    free(split);
    return false;
  }
  bin_remove(a, b);
  block_t *prev = b->phys_prev, *next = b->phys_next;
  block_t *tail_block = !tail ? NULL : head ? spare : b;
  if (tail_block == spare && spare)
    *spare = (block_t){.region = r, .stream = b->stream, .free_seq = b->free_seq, .is_free = true};
  if (tail_block) {
    tail_block->addr = hi;
    tail_block->size = b_end - hi;
    tail_block->phys_next = next;
    if (next) next->phys_prev = tail_block;
  }
  if (head) b->size = lo - b->addr;
  block_t *last_before = head ? b : prev, *first_after = tail_block ? tail_block : next;
  if (last_before) last_before->phys_next = NULL;
  if (first_after) first_after->phys_prev = NULL;
  if (!head && !tail) block_delete(a, b);
  *rest = NULL;
  if (before && after) {
    *split = (region_t){.base = hi, .size = r_end - hi, .first = first_after, .next = r->next};
    for (block_t *x = first_after; x; x = x->phys_next) x->region = split;
    r->next = split;
    r->size = lo - r->base;
    a->stats.regions++;
    *rest = split;
  } else if (before) {
    r->size = lo - r->base;
  } else if (after) {
    r->base = hi;
    r->size = r_end - hi;
    r->first = first_after;
    *rest = r;
  } else {
    region_t **link = &a->regions;
    while (*link != r) link = &(*link)->next;
    *link = r->next;
    free(r);
    a->stats.regions--;
  }
  if (head) bin_insert(a, b);
  if (tail_block) bin_insert(a, tail_block);
  a->backend->unmap(a->backend, (void *)lo, hi - lo);
  a->stats.backend_releases++;
  a->stats.capacity -= hi - lo;
  totals_add(a, 0, -(int64_t)(hi - lo));
  trace(a, IA_TRACE_RELEASE, lo, hi - lo, IA_STREAM_NONE);
  return true;
}

/* Called through release_free_regions, which has checked that nothing captures. */
static uint64_t release_mapped(ia_arena_t *a) {
  uint64_t released = 0;
  uintptr_t mask = ~(uintptr_t)(a->page - 1);
  for (region_t *r = a->regions, *next; r; r = next) {
    next = r->next;
    for (block_t *b = r->first; b; b = b->phys_next) {
      uintptr_t lo = _ia_align_up(b->addr, a->page), hi = (b->addr + b->size) & mask;
      region_t *rest;
      if (b->is_free && hi > lo && work_done(a, b) && cut(a, r, b, lo, hi, &rest)) {
        released += hi - lo;
        if (rest) next = rest; /* the walk goes on after the hole */
        break;
      }
    }
  }
  return released;
}

static ia_status_t reserve_range(ia_arena_t *a) {
  size_t page = a->backend->page_size, size = _ia_align_up(a->opts.address_range, page);
  void *base;
  ia_status_t st = a->backend->address_reserve(a->backend, size, &base);
  if (st != IA_OK) return st;
  ia_assert((uintptr_t)base % page == 0);
  a->page = page;
  a->range_base = (uintptr_t)base;
  a->range_size = size;
  return IA_OK;
}

static void unmap_all(ia_arena_t *a) {
  while (a->regions) {
    region_t *r = a->regions;
    a->regions = r->next;
    trace(a, IA_TRACE_RELEASE, r->base, r->size, IA_STREAM_NONE);
    a->backend->unmap(a->backend, (void *)r->base, r->size);
    a->stats.backend_releases++;
    a->stats.capacity -= r->size;
    totals_add(a, 0, -(int64_t)r->size);
    a->stats.regions--;
    free(r);
  }
  if (!a->range_size) return;
  if (a->on_region) a->on_region(a->on_region_ctx, a, a->range_base, a->range_size, false);
  a->backend->address_free(a->backend, (void *)a->range_base, a->range_size);
}

/* ---- thread caches: the arena's side (thread_cache.c holds the caches) ------------------------- */

#if IA_DEBUG
static void debug_check(ia_arena_t *a);
#define DEBUG_CHECK(a) debug_check(a)
#else
#define DEBUG_CHECK(a) ((void)0)
#endif

static bool caching(const ia_arena_t *a, size_t size) {
  return a->opts.thread_cache && size <= a->opts.thread_cache_block;
}

static _ia_tcache_t *my_cache(ia_arena_t *a, bool create) {
  return _ia_tcache_mine(a, a->opts.thread_cache, a->opts.thread_cache_block, create);
}

bool _ia_arena_attach_cache(ia_arena_t *a, _ia_tcache_t *c) {
  pthread_mutex_lock(&a->lock);
  bool room = a->n_caches < a->cap_caches;
  if (!room) {
    size_t cap = a->cap_caches ? a->cap_caches * 2 : 4;
    _ia_tcache_t **grown = realloc(a->caches, cap * sizeof *grown);
    if ((room = grown != NULL)) {
      a->caches = grown;
      a->cap_caches = cap;
    }
  }
  if (room) a->caches[a->n_caches++] = c;
  pthread_mutex_unlock(&a->lock);
  return room;
}

/* Adds what the cache's fast path counted into the arena's statistics (both locks held). The peak
 * is raised by the most the cache's thread held since the last fold: exact with one thread; with
 * several, it can miss or overstate by what the other threads' caches moved since their folds,
 * which is bounded by their thread_cache bytes. The device totals are exact: the fast path keeps
 * them itself. */
static void fold(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_tcache_counts_t k = _ia_tcache_fold(c);
  ia_stats_t *s = &a->stats;
  uint64_t high = s->in_use + (uint64_t)k.in_use_high;
  if (high > s->in_use_peak) s->in_use_peak = high;
  s->in_use += (uint64_t)k.in_use;
  s->requested += (uint64_t)k.requested;
  s->blocks_in_use += (uint64_t)k.blocks;
  s->requests_served += k.served;
  s->frees += k.frees;
  s->allocated_total += k.allocated_total;
  s->freed_total += k.freed_total;
  if (s->in_use > s->in_use_peak) s->in_use_peak = s->in_use;
}

static void make_free(ia_arena_t *a, block_t *b, ia_stream_t stream);

/* A block a cache gave back: it was counted as free already (fold), so it only rejoins the classes. */
static void give_back(ia_arena_t *a, block_t *b) {
  _ia_table_remove(&a->table, b);
  make_free(a, b, b->stream);
}

/* All of a cache's free blocks come back to the arena (both locks held). */
static void take_all_back(ia_arena_t *a, _ia_tcache_t *c) {
  fold(a, c);
  for (block_t *b; (b = _ia_tcache_evict(c, true));) give_back(a, b);
}

/* Every cache's free blocks come back to the arena. */
static void drain(ia_arena_t *a) {
  for (size_t i = 0; i < a->n_caches; i++) {
    _ia_tcache_lock(a->caches[i]);
    take_all_back(a, a->caches[i]);
    _ia_tcache_unlock(a->caches[i]);
  }
}

/* A request the arena's free blocks cannot serve takes blocks back from the threads' caches, one
 * at a time, largest first, the calling thread's own cache (`mine`, locked by the caller) first,
 * until it fits or no cache keeps any: only then may the arena grow or refuse. Taking all of them
 * back at once would empty caches whose threads fill them again at once; in a pool grown to just
 * what it needs, where the caches' blocks are all its slack, that happened at nearly every miss. */
static block_t *find_reclaiming(ia_arena_t *a, size_t rsize, _ia_tcache_t *mine) {
  block_t *b = find_free(a, rsize);
  for (size_t i = 0; !b && i <= a->n_caches;) {
    _ia_tcache_t *c = i == 0 ? mine : a->caches[i - 1];
    if (!c || (i > 0 && c == mine)) {
      i++;
      continue;
    }
    if (c != mine) _ia_tcache_lock(c);
    block_t *taken = _ia_tcache_evict(c, true);
    if (c != mine) _ia_tcache_unlock(c);
    if (!taken) {
      i++;
      continue;
    }
    give_back(a, taken);
    b = find_free(a, rsize);
  }
  return b;
}

static void fold_all(ia_arena_t *a) {
  for (size_t i = 0; i < a->n_caches; i++) {
    _ia_tcache_lock(a->caches[i]);
    fold(a, a->caches[i]);
    _ia_tcache_unlock(a->caches[i]);
  }
}

/* A cache past its limit: its largest free blocks come back until it is within. */
static void trim(ia_arena_t *a, _ia_tcache_t *c) {
  for (block_t *b; (b = _ia_tcache_evict(c, false));) give_back(a, b);
}

void _ia_arena_cache_exit(ia_arena_t *a, _ia_tcache_t *c) {
  pthread_mutex_lock(&a->lock);
  _ia_tcache_lock(c);
  take_all_back(a, c);
  /* What the thread still has handed out is live; its frees now go through the arena's lock. */
  _ia_tcache_unlend_all(c);
  _ia_tcache_unlock(c);
  for (size_t i = 0; i < a->n_caches; i++)
    if (a->caches[i] == c) a->caches[i] = a->caches[--a->n_caches];
  DEBUG_CHECK(a);
  pthread_mutex_unlock(&a->lock);
}

/* ---- public operations ------------------------------------------------------------------------ */

void ia_arena_default_options(ia_arena_options_t *o) {
  /* No thread caches by default: the arena's placement stays exactly best fit and every free
   * merges at once. Callers that share an arena between threads turn them on (the plugin's
   * general pools do: csrc/plugin.c says with what sizes and why). */
  *o = (ia_arena_options_t){.alignment = 256, .region_round = (size_t)2 << 20,
                            .region_min = (size_t)2 << 20, .region_exact_above = SIZE_MAX,
                            .thread_cache = 0, .thread_cache_block = (size_t)1 << 20};
}

ia_status_t ia_arena_create(const ia_arena_options_t *opts, ia_backend_t *backend, ia_arena_t **out) {
  *out = NULL;
  if (!backend) return IA_ERR_INVALID_ARGUMENT;
  /* Sizes past MAX_REQUEST would wrap when rounded; a region_min off the alignment would make
   * regions whose blocks cannot tile them. */
  if (!opts || !_ia_is_pow2(opts->alignment) || opts->alignment < 16 || opts->alignment > MAX_REQUEST ||
      (!opts->growable && opts->capacity == 0) || opts->capacity > MAX_REQUEST ||
      opts->thread_cache > MAX_REQUEST || opts->thread_cache_block > MAX_REQUEST ||
      (opts->growable && (!_ia_is_pow2(opts->region_round) || opts->region_round < opts->alignment ||
                          opts->region_round > MAX_REQUEST || opts->region_min > MAX_REQUEST ||
                          opts->region_min % opts->alignment)) ||
      (opts->address_range && (!opts->growable || !backend->map || !_ia_is_pow2(backend->page_size) ||
                               backend->page_size % opts->alignment || backend->page_size > MAX_REQUEST ||
                               opts->address_range > MAX_REQUEST))) {
    ia_backend_destroy(backend);
    return IA_ERR_INVALID_ARGUMENT;
  }
  ia_arena_t *a = calloc(1, sizeof *a);
  if (!a) {
    ia_backend_destroy(backend);
    return IA_ERR_NO_HOST_MEMORY;
  }
  /* Critical sections are a few dozen nanoseconds: spinning briefly before sleeping in the kernel
   * keeps contended threads off the futex path. */
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
  pthread_mutex_init(&a->lock, &attr);
  pthread_mutexattr_destroy(&attr);
  a->opts = *opts;
  if (!opts->thread_cache_block) a->opts.thread_cache = 0; /* nothing could be kept */
  a->backend = backend;
  if (opts->address_range) {
    ia_status_t st = reserve_range(a);
    if (st != IA_OK) {
      ia_arena_destroy(a);
      return st;
    }
  }
  if (opts->capacity) {
    size_t first = _ia_align_up(opts->capacity, opts->alignment);
    ia_status_t st = a->page ? grow_mapped(a, first) : region_add(a, first);
    if (st != IA_OK) {
      ia_arena_destroy(a);
      return st;
    }
    if (!opts->growable) {
      a->fixed_lo = a->regions->base;
      a->fixed_hi = a->regions->base + a->regions->size;
    }
  }
  *out = a;
  return IA_OK;
}

void ia_arena_destroy(ia_arena_t *a) {
  if (!a) return;
  /* Threads may still hold caches of this arena: each is orphaned (told its arena is gone, its
   * blocks forgotten) under the registry lock, which an exiting thread holds while it follows its
   * cache's arena pointer; the thread frees the cache later. */
  if (a->opts.thread_cache) {
    _ia_tcache_registry_lock();
    pthread_mutex_lock(&a->lock);
    for (size_t i = 0; i < a->n_caches; i++) {
      _ia_tcache_lock(a->caches[i]);
      _ia_tcache_orphan(a->caches[i]);
      _ia_tcache_unlock(a->caches[i]);
    }
    a->n_caches = 0;
    pthread_mutex_unlock(&a->lock);
    _ia_tcache_registry_unlock();
  }
  if (a->page) unmap_all(a);
  while (a->regions) region_drop(a, a->regions);
  for (size_t i = 0; i < a->n_streams; i++) a->backend->event_destroy(a->backend, a->streams[i].event);
  for (slab_t *s = a->slabs, *next; s; s = next) {
    next = s->next;
    for (int i = 0; i < SLAB_BLOCKS; i++) free(s->blocks[i].uses);
    free(s);
  }
  ia_backend_destroy(a->backend);
  free(a->caches);
  free(a->streams);
  free(a->table.slots);
  pthread_mutex_destroy(&a->lock);
  free(a);
}

/* A free block, out of its bin, becomes live with its first rsize bytes; the rest stays free when a
 * header for it can be had (without one the block is simply handed out whole). */
static void hand_out(ia_arena_t *a, block_t *b, size_t rsize, size_t size, ia_stream_t stream) {
  if (b->size - rsize >= a->opts.alignment) {
    block_t *tail = block_new(a);
    if (tail) {
      tail->addr = b->addr + rsize;
      tail->size = b->size - rsize;
      tail->region = b->region;
      tail->stream = b->stream;
      tail->free_seq = b->free_seq;
      tail->is_free = true;
      tail->phys_prev = b;
      tail->phys_next = b->phys_next;
      if (b->phys_next) b->phys_next->phys_prev = tail;
      b->phys_next = tail;
      b->size = rsize;
      bin_insert(a, tail);
    }
  }
  b->is_free = false;
  b->stream = stream;
  b->requested = size;
  ia_stats_t *s = &a->stats;
  s->in_use += b->size;
  totals_add(a, (int64_t)b->size, 0);
  if (s->in_use > s->in_use_peak) s->in_use_peak = s->in_use;
  s->requested += size;
  s->blocks_in_use++;
  s->requests_served++;
  s->allocated_total += b->size;
  trace(a, IA_TRACE_ALLOC, b->addr, size, stream);
}

/* The thread-cache fast path's share of what the arena would have done under its lock. */
static void after_cached_op(ia_arena_t *a, ia_trace_action_t action, uintptr_t addr, size_t size,
                            uint64_t bytes, ia_stream_t stream) {
  totals_add(a, action == IA_TRACE_ALLOC ? (int64_t)bytes : -(int64_t)bytes, 0);
  trace(a, action, addr, size, stream);
#if IA_DEBUG
  pthread_mutex_lock(&a->lock);
  DEBUG_CHECK(a);
  pthread_mutex_unlock(&a->lock);
#endif
}

ia_status_t ia_arena_alloc(ia_arena_t *a, size_t size, ia_stream_t stream, void **out) {
  *out = NULL;
  if (size == 0) return IA_OK;
  _ia_tcache_t *c = NULL;
  if (caching(a, size) && (c = my_cache(a, true))) {
    block_t *b = _ia_tcache_take(c, _ia_align_up(size, a->opts.alignment), size, stream);
    if (b) { /* handed out to this caller alone: addr and size are stable to read */
      after_cached_op(a, IA_TRACE_ALLOC, b->addr, size, b->size, stream);
      *out = (void *)b->addr;
      return IA_OK;
    }
  }
  pthread_mutex_lock(&a->lock);
  if (c) {
    _ia_tcache_lock(c);
    fold(a, c);
    trim(a, c);
  }
  ia_status_t st = IA_ERR_OUT_OF_MEMORY;
  block_t *b = NULL;
  if (size <= MAX_REQUEST) {
    size_t rsize = _ia_align_up(size, a->opts.alignment);
    b = find_reclaiming(a, rsize, c);
    if (!b && a->opts.growable) {
      st = grow(a, rsize);
      if (st == IA_OK) b = find_free(a, rsize);
    }
    if (b) {
      st = order_after(a, stream, b->stream, b->free_seq);
      if (st == IA_OK && !_ia_table_insert(&a->table, b)) st = IA_ERR_NO_HOST_MEMORY;
      if (st != IA_OK) b = NULL;
    }
    if (b) {
      bin_remove(a, b);
      hand_out(a, b, rsize, size, stream);
      if (c) _ia_tcache_lend(c, b); /* its free, on this thread, then skips the lock */
      *out = (void *)b->addr;
    }
  }
  if (c) _ia_tcache_unlock(c);
  if (!b) {
    a->stats.requests_failed++;
    trace(a, IA_TRACE_FAIL, 0, size, stream);
  }
  DEBUG_CHECK(a);
  pthread_mutex_unlock(&a->lock);
  return b ? IA_OK : st;
}

ia_status_t ia_arena_alloc_at(ia_arena_t *a, void *at, size_t size, ia_stream_t stream) {
  uintptr_t addr = (uintptr_t)at;
  if (size == 0 || size > MAX_REQUEST || addr % a->opts.alignment) return IA_ERR_INVALID_ARGUMENT;
  size_t rsize = _ia_align_up(size, a->opts.alignment);
  pthread_mutex_lock(&a->lock);
  drain(a); /* the range may lie in blocks that threads keep */
  region_t *r = region_of(a, addr);
  block_t *b = r ? r->first : NULL;
  while (b && b->addr + b->size <= addr) b = b->phys_next;
  ia_status_t st = IA_ERR_OUT_OF_MEMORY;
  if (b && b->is_free && addr + rsize <= b->addr + b->size) st = order_after(a, stream, b->stream, b->free_seq);
  block_t *rest = NULL;
  if (st == IA_OK && b->addr < addr && !(rest = block_new(a))) st = IA_ERR_NO_HOST_MEMORY;
  if (rest) rest->addr = addr; /* the table files a block by its address alone */
  if (st == IA_OK && !_ia_table_insert(&a->table, rest ? rest : b)) st = IA_ERR_NO_HOST_MEMORY;
  if (st == IA_OK) bin_remove(a, b);
  if (st == IA_OK && rest) { /* the part before `at` stays a free block of its own */
    *rest = (block_t){.addr = addr, .size = b->addr + b->size - addr, .region = b->region, .stream = b->stream,
                      .free_seq = b->free_seq, .is_free = true, .phys_prev = b, .phys_next = b->phys_next};
    if (b->phys_next) b->phys_next->phys_prev = rest;
    b->phys_next = rest;
    b->size = addr - b->addr;
    bin_insert(a, b);
    b = rest;
  } else if (rest) {
    block_delete(a, rest);
  }
  if (st == IA_OK) hand_out(a, b, rsize, size, stream);
  DEBUG_CHECK(a);
  pthread_mutex_unlock(&a->lock);
  return st;
}

static void merge_into(ia_arena_t *a, block_t *left, block_t *right) {
  left->size += right->size;
  left->phys_next = right->phys_next;
  if (right->phys_next) right->phys_next->phys_prev = left;
  block_delete(a, right);
}

/* A block out of the table, its counters settled, becomes free on `stream` and merges with its free
 * neighbours. Ordering failures cannot be handed back to the caller without leaking the block; the
 * streams involved are broken anyway, so they stop the process instead. */
static void make_free(ia_arena_t *a, block_t *b, ia_stream_t stream) {
  b->is_free = true;
  b->requested = 0;
  b->stream = stream;
  b->free_seq = ++a->free_seq;
  block_t *prev = b->phys_prev, *next = b->phys_next;
  if (prev && prev->is_free) {
    ia_assert(order_after(a, stream, prev->stream, prev->free_seq) == IA_OK);
    bin_remove(a, prev);
    merge_into(a, prev, b);
    prev->stream = stream;
    prev->free_seq = a->free_seq;
    b = prev;
  }
  if (next && next->is_free) {
    ia_assert(order_after(a, stream, next->stream, next->free_seq) == IA_OK);
    bin_remove(a, next);
    merge_into(a, b, next);
  }
  bin_insert(a, b);
}

ia_status_t ia_arena_free(ia_arena_t *a, void *ptr, ia_stream_t stream) {
  if (!ptr) return IA_OK;
  _ia_tcache_t *c = a->opts.thread_cache ? my_cache(a, false) : NULL;
  if (c) {
    size_t size;
    ia_stream_t freed_on;
    _ia_tcache_put_t kept = _ia_tcache_put(c, (uintptr_t)ptr, stream, &size, &freed_on);
    if (kept == IA_TC_KEPT || kept == IA_TC_KEPT_FULL) {
      after_cached_op(a, IA_TRACE_FREE, (uintptr_t)ptr, size, size, freed_on);
      if (kept == IA_TC_KEPT_FULL) {
        pthread_mutex_lock(&a->lock);
        _ia_tcache_lock(c);
        fold(a, c);
        trim(a, c);
        _ia_tcache_unlock(c);
        DEBUG_CHECK(a);
        pthread_mutex_unlock(&a->lock);
      }
      return IA_OK;
    }
    if (kept == IA_TC_DOUBLE_FREE) {
      pthread_mutex_lock(&a->lock);
      a->stats.bad_frees++;
      pthread_mutex_unlock(&a->lock);
      return IA_ERR_DOUBLE_FREE;
    }
  }
  pthread_mutex_lock(&a->lock);
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr, NULL);
  ia_status_t st = b ? IA_OK : region_of(a, (uintptr_t)ptr) ? IA_ERR_DOUBLE_FREE : IA_ERR_FOREIGN_POINTER;
  if (b && b->cache) { /* lent: freed by another thread, or with other streams recorded on it */
    _ia_tcache_t *owner = b->cache;
    _ia_tcache_lock(owner);
    fold(a, owner); /* so that the counters include the block the cache handed out */
    if (b->cached) st = IA_ERR_DOUBLE_FREE;
    else _ia_tcache_unlend(owner, b);
    _ia_tcache_unlock(owner);
  }
  if (st != IA_OK) {
    a->stats.bad_frees++;
    pthread_mutex_unlock(&a->lock);
    return st;
  }
  if (stream == IA_STREAM_NONE) stream = b->stream;
  for (uint32_t i = 0; i < b->n_uses; i++)
    ia_assert(order_after(a, stream, b->uses[i], UINT64_MAX) == IA_OK);
  b->n_uses = 0;
  _ia_table_remove(&a->table, b);
  ia_stats_t *s = &a->stats;
  s->in_use -= b->size;
  totals_add(a, -(int64_t)b->size, 0);
  s->requested -= b->requested;
  s->blocks_in_use--;
  s->frees++;
  s->freed_total += b->size;
  trace(a, IA_TRACE_FREE, b->addr, b->size, stream);
  make_free(a, b, stream);
  DEBUG_CHECK(a);
  pthread_mutex_unlock(&a->lock);
  return IA_OK;
}

ia_status_t ia_arena_record_stream(ia_arena_t *a, void *ptr, ia_stream_t stream) {
  pthread_mutex_lock(&a->lock);
  ia_status_t st = IA_OK;
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr, NULL);
  _ia_tcache_t *owner = b ? b->cache : NULL;
  if (owner) _ia_tcache_lock(owner); /* a lent block's streams are its cache's to read */
  if (!b || (owner && b->cached)) {
    st = region_of(a, (uintptr_t)ptr) ? IA_ERR_DOUBLE_FREE : IA_ERR_FOREIGN_POINTER;
  } else if (stream != b->stream) {
    bool known = false;
    for (uint32_t i = 0; i < b->n_uses; i++) known |= b->uses[i] == stream;
    if (!known) {
      if (b->n_uses == b->cap_uses) {
        uint32_t cap = b->cap_uses ? b->cap_uses * 2 : 4;
        ia_stream_t *grown = realloc(b->uses, cap * sizeof *grown);
        if (!grown) st = IA_ERR_NO_HOST_MEMORY;
        else {
          b->uses = grown;
          b->cap_uses = cap;
        }
      }
      if (st == IA_OK) b->uses[b->n_uses++] = stream;
    }
  }
  if (owner) _ia_tcache_unlock(owner);
  pthread_mutex_unlock(&a->lock);
  return st;
}

void _ia_arena_flush_events(ia_arena_t *a) {
  pthread_mutex_lock(&a->lock);
  drain(a); /* frees kept by threads need their events now too */
  for (region_t *r = a->regions; r; r = r->next)
    for (block_t *b = r->first; b; b = b->phys_next) {
      if (!b->is_free || b->stream == IA_STREAM_NONE) continue;
      ia_status_t st = IA_OK;
      stream_state_t *ss = stream_state(a, b->stream, &st);
      if (ss && ss->recorded_seq < b->free_seq &&
          a->backend->event_record(a->backend, ss->event, b->stream) == IA_OK) {
        ss->recorded_seq = a->free_seq;
        a->stats.event_records++;
      }
    }
  pthread_mutex_unlock(&a->lock);
}

ia_status_t _ia_arena_grant_access(ia_arena_t *a, int peer) {
  pthread_mutex_lock(&a->lock); /* maps happen under it too, so none misses the peer */
  ia_status_t st = a->page && a->backend->grant_access ? a->backend->grant_access(a->backend, peer) : IA_OK;
  pthread_mutex_unlock(&a->lock);
  return st;
}

bool _ia_arena_stream_capturing(ia_arena_t *a, ia_stream_t stream) {
  return a->backend->stream_capturing && a->backend->stream_capturing(a->backend, stream);
}

bool _ia_arena_live_block(ia_arena_t *a, const void *ptr, ia_stream_t *stream, uint32_t *other_streams) {
  pthread_mutex_lock(&a->lock);
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr, NULL);
  if (b && b->cache) _ia_tcache_lock(b->cache);
  bool live = b && !(b->cache && b->cached);
  if (live) {
    *stream = b->stream;
    *other_streams = b->n_uses;
  }
  if (b && b->cache) _ia_tcache_unlock(b->cache);
  pthread_mutex_unlock(&a->lock);
  return live;
}

void _ia_arena_set_region_hook(ia_arena_t *a, _ia_region_hook_t hook, void *ctx) {
  pthread_mutex_lock(&a->lock);
  a->on_region = hook;
  a->on_region_ctx = ctx;
  if (a->range_size && hook) hook(ctx, a, a->range_base, a->range_size, true); /* mapping: the range */
  for (region_t *r = a->page ? NULL : a->regions; r && hook; r = r->next) hook(ctx, a, r->base, r->size, true);
  pthread_mutex_unlock(&a->lock);
}

uint64_t ia_arena_release_cached(ia_arena_t *a) {
  if (!a->opts.growable) return 0;
  pthread_mutex_lock(&a->lock);
  if (!capturing(a)) drain(a); /* a region may be free but for blocks that threads keep */
  uint64_t released = release_free_regions(a);
  pthread_mutex_unlock(&a->lock);
  return released;
}

bool ia_arena_owns(ia_arena_t *a, const void *ptr) {
  uintptr_t p = (uintptr_t)ptr;
  if (a->fixed_hi) return p >= a->fixed_lo && p < a->fixed_hi;
  pthread_mutex_lock(&a->lock);
  bool owned = region_of(a, p) != NULL;
  pthread_mutex_unlock(&a->lock);
  return owned;
}

size_t ia_arena_alignment(const ia_arena_t *a) { return a->opts.alignment; }

size_t ia_arena_page_size(const ia_arena_t *a) { return a->page; }

const ia_backend_t *ia_arena_backend(const ia_arena_t *a) { return a->backend; }

bool ia_arena_address_range(const ia_arena_t *a, ia_region_info_t *out) {
  if (a->range_size) *out = (ia_region_info_t){a->range_base, a->range_size};
  return a->range_size != 0;
}


static uint64_t largest_free_locked(const ia_arena_t *a) {
  if (!a->fl_bitmap) return 0;
  unsigned fl = _ia_log2_floor(a->fl_bitmap);
  unsigned sl = _ia_log2_floor(a->sl_bitmap[fl]);
  uint64_t largest = 0;
  for (block_t *b = a->bins[fl][sl]; b; b = b->free_next)
    if (b->size > largest) largest = b->size;
  return largest;
}

/* Blocks kept by thread caches count as free (they are, to PyTorch's allocated-versus-reserved
 * view), each as the block it is: they have not merged with their neighbours. */
void ia_arena_stats(ia_arena_t *a, ia_stats_t *out) {
  pthread_mutex_lock(&a->lock);
  uint64_t cached_bytes = 0, cached_blocks = 0, cached_largest = 0;
  for (size_t i = 0; i < a->n_caches; i++) {
    uint64_t bytes, blocks, largest;
    _ia_tcache_lock(a->caches[i]);
    fold(a, a->caches[i]);
    _ia_tcache_free_info(a->caches[i], &bytes, &blocks, &largest);
    _ia_tcache_unlock(a->caches[i]);
    cached_bytes += bytes;
    cached_blocks += blocks;
    if (largest > cached_largest) cached_largest = largest;
  }
  *out = a->stats;
  out->largest_free = largest_free_locked(a);
  pthread_mutex_unlock(&a->lock);
  out->free_bytes += cached_bytes;
  out->free_blocks += cached_blocks;
  if (cached_largest > out->largest_free) out->largest_free = cached_largest;
  out->fragmentation = out->free_bytes ? 1.0 - (double)out->largest_free / (double)out->free_bytes : 0.0;
}

void ia_arena_reset_peaks(ia_arena_t *a) {
  pthread_mutex_lock(&a->lock);
  fold_all(a);
  a->stats.in_use_peak = a->stats.in_use;
  a->stats.capacity_peak = a->stats.capacity;
  pthread_mutex_unlock(&a->lock);
}

size_t ia_arena_regions(ia_arena_t *a, ia_region_info_t *out, size_t cap) {
  pthread_mutex_lock(&a->lock);
  size_t n = 0;
  for (region_t *r = a->regions; r; r = r->next, n++)
    if (n < cap) out[n] = (ia_region_info_t){r->base, r->size};
  pthread_mutex_unlock(&a->lock);
  return n;
}

/* A block a thread cache keeps is listed as the free block it is (it may neighbour another), as
 * ia_arena_stats counts it: looking does not change the arena. */
size_t ia_arena_blocks(ia_arena_t *a, ia_block_info_t *out, size_t cap) {
  pthread_mutex_lock(&a->lock);
  for (size_t i = 0; i < a->n_caches; i++) _ia_tcache_lock(a->caches[i]);
  size_t n = 0;
  uint32_t index = 0;
  for (region_t *r = a->regions; r; r = r->next, index++)
    for (block_t *b = r->first; b; b = b->phys_next, n++)
      if (n < cap)
        out[n] = (ia_block_info_t){.address = b->addr, .size = b->size, .requested = b->requested,
                                   .region_base = r->base, .region = index,
                                   .is_free = b->is_free || (b->cache && b->cached), .stream = b->stream};
  for (size_t i = 0; i < a->n_caches; i++) _ia_tcache_unlock(a->caches[i]);
  pthread_mutex_unlock(&a->lock);
  return n;
}

void ia_arena_set_trace(ia_arena_t *a, ia_trace_t *t, int32_t device, uint8_t pool) {
  pthread_mutex_lock(&a->lock);
  bool attaching = t && t != atomic_load(&a->trace);
  atomic_store(&a->trace_tag, (uint64_t)(uint32_t)device << 8 | pool);
  atomic_store_explicit(&a->trace, t, memory_order_release);
  /* A trace starts with the regions already held, so a consumer knows the arena's layout. */
  for (region_t *r = attaching ? a->regions : NULL; r; r = r->next)
    trace(a, IA_TRACE_RESERVE, r->base, r->size, IA_STREAM_NONE);
  pthread_mutex_unlock(&a->lock);
}

#define CHECK(cond, ...)                                                                            \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      snprintf(msg, msg_len, __VA_ARGS__);                                                          \
      goto broken;                                                                                  \
    }                                                                                               \
  } while (0)

static bool is_my_cache(const ia_arena_t *a, const _ia_tcache_t *c) {
  for (size_t i = 0; i < a->n_caches; i++)
    if (a->caches[i] == c) return true;
  return false;
}

/* Under the arena's lock and every cache's. A block lent to a cache and free in it counts as free
 * but sits in no class of the arena and may neighbour a free block. */
static bool check_locked(ia_arena_t *a, char *msg, size_t msg_len) {
  uint64_t in_use = 0, free_bytes = 0, capacity = 0, requested = 0, cached_bytes = 0;
  size_t live = 0, free_count = 0, binned = 0, n_regions = 0, lent = 0, cached = 0;
  uintptr_t mapped_to = a->range_base; /* mapping: where the previous stretch ended */
  for (region_t *r = a->regions; r; r = r->next, n_regions++) {
    CHECK(r->base % a->opts.alignment == 0, "region %#lx is not aligned", (unsigned long)r->base);
    if (a->page) {
      CHECK(r->size && r->base % a->page == 0 && r->size % a->page == 0, "stretch %#lx is not whole pages",
            (unsigned long)r->base);
      CHECK(r->base >= mapped_to && r->base + r->size <= a->range_base + a->range_size,
            "stretch %#lx overlaps another, is out of address order or outside the range", (unsigned long)r->base);
      mapped_to = r->base + r->size;
    }
    CHECK(r->first && r->first->addr == r->base && !r->first->phys_prev,
          "region %#lx does not start with its first block", (unsigned long)r->base);
    uintptr_t expect = r->base;
    for (block_t *b = r->first; b; b = b->phys_next) {
      CHECK(b->addr == expect, "gap or overlap at %#lx (block starts at %#lx)", (unsigned long)expect,
            (unsigned long)b->addr);
      CHECK(b->region == r, "block %#lx names the wrong region", (unsigned long)b->addr);
      CHECK(b->size && b->size % a->opts.alignment == 0, "block %#lx has size %zu",
            (unsigned long)b->addr, b->size);
      CHECK(!b->phys_next || b->phys_next->phys_prev == b, "broken links after %#lx",
            (unsigned long)b->addr);
      expect += b->size;
      if (b->is_free) {
        CHECK(!b->phys_next || !b->phys_next->is_free, "free blocks %#lx and %#lx are neighbours",
              (unsigned long)b->addr, (unsigned long)b->phys_next->addr);
        CHECK(!b->cache, "free block %#lx is lent to a thread cache", (unsigned long)b->addr);
        unsigned fl, sl;
        _ia_class_of(b->size, &fl, &sl);
        CHECK(b->fl == fl && b->sl == sl, "free block %#lx filed in the wrong class",
              (unsigned long)b->addr);
        bool found = false;
        for (block_t *x = a->bins[fl][sl]; x && !found; x = x->free_next) found = x == b;
        CHECK(found, "free block %#lx missing from its class", (unsigned long)b->addr);
        free_bytes += b->size;
        free_count++;
      } else {
        CHECK(_ia_table_find(&a->table, b->addr, NULL) == b, "live block %#lx missing from the live table",
              (unsigned long)b->addr);
        if (b->cache) {
          CHECK(is_my_cache(a, b->cache) && _ia_tcache_holds(b->cache, b),
                "block %#lx is lent to a cache that does not hold it", (unsigned long)b->addr);
          lent++;
        } else {
          CHECK(!b->cached, "block %#lx is free in a cache it is not lent to", (unsigned long)b->addr);
        }
        if (b->cache && b->cached) {
          cached_bytes += b->size;
          cached++;
        } else {
          in_use += b->size;
          requested += b->requested;
          live++;
        }
      }
    }
    CHECK(expect == r->base + r->size, "blocks of region %#lx cover %zu of %zu bytes",
          (unsigned long)r->base, (size_t)(expect - r->base), r->size);
    capacity += r->size;
  }
  for (unsigned fl = 0; fl < FL_COUNT; fl++)
    for (unsigned sl = 0; sl < SL_COUNT; sl++) {
      bool bit = (a->sl_bitmap[fl] >> sl) & 1;
      CHECK(bit == (a->bins[fl][sl] != NULL), "bitmap disagrees with class %u/%u", fl, sl);
      for (block_t *x = a->bins[fl][sl]; x; x = x->free_next, binned++)
        CHECK(x->is_free, "live block %#lx sits in a free class", (unsigned long)x->addr);
    }
  uint64_t listed_bytes = 0, listed = 0;
  size_t held = 0;
  for (size_t i = 0; i < a->n_caches; i++) {
    uint64_t bytes, blocks, largest;
    if (!_ia_tcache_check(a->caches[i], msg, msg_len)) goto broken;
    _ia_tcache_free_info(a->caches[i], &bytes, &blocks, &largest);
    listed_bytes += bytes;
    listed += blocks;
    held += _ia_tcache_lent(a->caches[i]);
  }
  CHECK(held == lent, "thread caches hold %zu blocks, %zu blocks are lent", held, lent);
  CHECK(listed == cached && listed_bytes == cached_bytes, "thread caches list %lu free blocks, the "
        "regions have %zu", (unsigned long)listed, cached);
  CHECK(binned == free_count, "%zu blocks in classes, %zu free blocks in regions", binned, free_count);
  CHECK(live + cached == a->table.count, "%zu live blocks, %zu in the live table", live + cached,
        a->table.count);
  CHECK(n_regions == a->stats.regions && capacity == a->stats.capacity, "region counters are off");
  CHECK(in_use == a->stats.in_use && live == a->stats.blocks_in_use && requested == a->stats.requested,
        "in-use counters are off: walked %lu bytes in %zu blocks, counted %lu in %lu",
        (unsigned long)in_use, live, (unsigned long)a->stats.in_use,
        (unsigned long)a->stats.blocks_in_use);
  CHECK(free_bytes == a->stats.free_bytes && free_count == a->stats.free_blocks,
        "free counters are off");
  if (msg_len) msg[0] = '\0';
  return true;
broken:
  return false;
}

/* Caches are locked (and folded, so that the counters compare) for the whole walk. */
static bool check_with_caches(ia_arena_t *a, char *msg, size_t msg_len) {
  for (size_t i = 0; i < a->n_caches; i++) {
    _ia_tcache_lock(a->caches[i]);
    fold(a, a->caches[i]);
  }
  bool ok = check_locked(a, msg, msg_len);
  for (size_t i = 0; i < a->n_caches; i++) _ia_tcache_unlock(a->caches[i]);
  return ok;
}

bool ia_arena_check(ia_arena_t *a, char *msg, size_t msg_len) {
  pthread_mutex_lock(&a->lock);
  bool ok = check_with_caches(a, msg, msg_len);
  pthread_mutex_unlock(&a->lock);
  return ok;
}

#if IA_DEBUG
static void debug_check(ia_arena_t *a) {
  char msg[512];
  if (!check_with_caches(a, msg, sizeof msg)) _ia_assert_fail(msg, __FILE__, __LINE__);
}
#endif
