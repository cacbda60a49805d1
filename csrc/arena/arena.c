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
 * for small requests, and on a Llama-style decode held more memory than PyTorch's own best-fit
 * allocator (benchmarks/RESULTS.md). A request is refused only when no free block can hold it.
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
 * Threads: one mutex per arena guards everything in it, taken once per public call, as PyTorch's
 * caching allocator takes one mutex per device. A serving worker allocates from Python threads
 * that hold the GIL, so its allocations rarely meet on the lock. Backend calls made while growing
 * or ordering streams happen under it; they never call back into the arena (a graph's carve-out
 * backend calls into another, its parent). An arena of a device's group also takes the group's
 * lock, inside its own, for the moment it updates the device totals (arena_stats.c). The lock
 * order of the whole core: Note [Device lifetime], csrc/torch/plugin.h.
 *
 * Over a backend that maps pages, a growable arena's regions are the mapped stretches of one
 * address range instead of reservations (arena_mapped.c); nothing else changes.
 */
#define _GNU_SOURCE /* PTHREAD_MUTEX_ADAPTIVE_NP */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "private.h"

typedef _ia_region_t region_t;
typedef _ia_block_t block_t;

/* Blocks looked at per class list before settling; bounds the search whatever the list length. */
#define SCAN_LIMIT 16

void _ia_assert_fail(const char *cond, const char *file, int line) {
  fprintf(stderr, "indexer-arena: internal invariant broken: %s (%s:%d)\n", cond, file, line);
  abort();
}

/* ---- free classes (the size classes are in internal.h) ---------------------------------------- */

/* Every free block passes here once its size is set, whole or cut (a split's tail, the part before
 * an alloc_at, what unmapping pages leaves): it keeps the requested bytes of the allocation last
 * freed into it, as PyTorch's snapshot shows a free block, cut to what the block now holds. */
void _ia_bin_insert(ia_arena_t *a, block_t *b) {
  if (b->requested > b->size) b->requested = b->size;
  _ia_file_class(b);
  unsigned fl = b->fl, sl = b->sl;
  b->free_prev = NULL;
  b->free_next = a->bins[fl][sl];
  if (b->free_next) b->free_next->free_prev = b;
  a->bins[fl][sl] = b;
  a->fl_bitmap |= 1ull << fl;
  a->sl_bitmap[fl] |= 1u << sl;
  a->stats.free_bytes += b->size;
  a->stats.free_blocks++;
}

void _ia_bin_remove(ia_arena_t *a, block_t *b) {
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
  uint32_t sl_map = *sl + 1 < IA_SL_COUNT ? a->sl_bitmap[*fl] & (~0u << (*sl + 1)) : 0;
  if (!sl_map) {
    uint64_t fl_map = *fl + 1 < IA_FL_COUNT ? a->fl_bitmap & (~0ull << (*fl + 1)) : 0;
    if (!fl_map) return false;
    *fl = (unsigned)__builtin_ctzll(fl_map);
    sl_map = a->sl_bitmap[*fl];
  }
  *sl = (unsigned)__builtin_ctz(sl_map);
  return true;
}

block_t *_ia_find_free(ia_arena_t *a, size_t size) {
  unsigned fl, sl;
  _ia_class_of(size, &fl, &sl);
  block_t *own = a->bins[fl][sl];
  block_t *b = smallest_fitting(own, size, SCAN_LIMIT);
  if (b) return b;
  if (next_class(a, &fl, &sl)) return smallest_fitting(a->bins[fl][sl], size, SCAN_LIMIT);
  /* Nothing larger anywhere: a fitting block can only hide past the scan limit of its own class. */
  return smallest_fitting(own, size, UINT32_MAX);
}

/* ---- public operations ------------------------------------------------------------------------ */

void ia_arena_default_options(ia_arena_options_t *o) {
  *o = (ia_arena_options_t){.alignment = 256, .region_round = 2 * IA_MiB, .region_min = 2 * IA_MiB,
                            .region_exact_above = SIZE_MAX};
}

ia_status_t ia_arena_create(const ia_arena_options_t *opts, ia_backend_t *backend, ia_arena_t **out) {
  *out = NULL;
  if (!backend) return IA_ERR_INVALID_ARGUMENT;
  /* Sizes past IA_MAX_REQUEST would wrap when rounded; a region_min off the alignment would make
   * regions whose blocks cannot tile them. */
  if (!opts || !_ia_is_pow2(opts->alignment) || opts->alignment < 16 || opts->alignment > IA_MAX_REQUEST ||
      (!opts->growable && opts->capacity == 0) || opts->capacity > IA_MAX_REQUEST ||
      (opts->growable && (!_ia_is_pow2(opts->region_round) || opts->region_round < opts->alignment ||
                          opts->region_round > IA_MAX_REQUEST || opts->region_min > IA_MAX_REQUEST ||
                          opts->region_min % opts->alignment)) ||
      (opts->address_range && (!opts->growable || !backend->map || !_ia_is_pow2(backend->page_size) ||
                               backend->page_size % opts->alignment || backend->page_size > IA_MAX_REQUEST ||
                               opts->address_range > IA_MAX_REQUEST))) {
    ia_backend_destroy(backend);
    return IA_ERR_INVALID_ARGUMENT;
  }
  ia_arena_t *a = calloc(1, sizeof *a);
  if (!a) {
    ia_backend_destroy(backend);
    return IA_ERR_NO_HOST_MEMORY;
  }
  /* Adaptive: a thread that finds the lock taken spins a little before it sleeps, since the lock
   * is held for far less than a sleep and a wake-up cost. */
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
  pthread_mutex_init(&a->lock, &attr);
  pthread_mutexattr_destroy(&attr);
  a->opts = *opts;
  a->backend = backend;
  if (opts->address_range) {
    ia_status_t st = _ia_reserve_range(a);
    if (st != IA_OK) {
      ia_arena_destroy(a);
      return st;
    }
  }
  if (opts->capacity) {
    size_t first = _ia_align_up(opts->capacity, opts->alignment);
    ia_status_t st = a->page ? _ia_grow_mapped(a, first) : _ia_region_add(a, first);
    if (st != IA_OK) {
      ia_arena_destroy(a);
      return st;
    }
  }
  *out = a;
  return IA_OK;
}

void ia_arena_destroy(ia_arena_t *a) {
  if (!a) return;
  if (a->page) _ia_unmap_all(a);
  while (a->regions) _ia_region_drop(a, a->regions);
  for (size_t i = 0; i < a->n_streams; i++) a->backend->event_destroy(a->backend, a->streams[i].event);
  for (_ia_slab_t *s = a->slabs, *next; s; s = next) {
    next = s->next;
    for (int i = 0; i < IA_SLAB_BLOCKS; i++) free(s->blocks[i].uses);
    free(s);
  }
  ia_backend_destroy(a->backend);
  free(a->streams);
  free(a->table.slots);
  pthread_mutex_destroy(&a->lock);
  free(a);
}

/* inactive_split's change: the free blocks that an operation takes away (sign -1) and makes (1). */
static void split_change(const ia_arena_t *a, const block_t *b, int64_t sign, int64_t *n, int64_t *bytes) {
  if (!b || !_ia_split_free(a, b)) return;
  *n += sign;
  *bytes += sign * (int64_t)b->size;
}

/* A free block, out of its bin, becomes live with its first rsize bytes; the rest stays free when a
 * header for it can be had (without one the block is simply handed out whole). */
static void hand_out(ia_arena_t *a, block_t *b, size_t rsize, size_t size, ia_stream_t stream) {
  int64_t n = 0, bytes = 0;
  split_change(a, b, -1, &n, &bytes);
  block_t *tail = !a->opts.no_split && b->size - rsize >= a->opts.alignment ? _ia_block_new(a) : NULL;
  if (tail) {
    tail->addr = b->addr + rsize;
    tail->size = b->size - rsize;
    tail->region = b->region;
    tail->stream = b->stream;
    tail->free_seq = b->free_seq;
    tail->requested = b->requested;
    tail->is_free = true;
    tail->phys_prev = b;
    tail->phys_next = b->phys_next;
    if (b->phys_next) b->phys_next->phys_prev = tail;
    b->phys_next = tail;
    b->size = rsize;
    _ia_bin_insert(a, tail);
  }
  split_change(a, tail, 1, &n, &bytes);
  _ia_count_split(a, n, bytes);
  b->is_free = false;
  b->stream = stream;
  b->requested = size;
  _ia_count_live(a, 1, (int64_t)b->size, (int64_t)size);
  _ia_arena_trace(a, IA_TRACE_ALLOC, b->addr, size, stream);
}

static ia_status_t alloc(ia_arena_t *a, size_t size, size_t reserve, ia_stream_t stream, bool grow, void **out);

ia_status_t ia_arena_alloc(ia_arena_t *a, size_t size, ia_stream_t stream, void **out) {
  return _ia_arena_alloc_reserving(a, size, size, stream, out);
}

/* A block's stream IA_STREAM_NONE means "ordered after nothing" (a fresh region's), so no caller's
 * block may carry it: the value is refused where a stream enters the arena. */
ia_status_t _ia_arena_alloc_reserving(ia_arena_t *a, size_t size, size_t reserve, ia_stream_t stream, void **out) {
  *out = NULL;
  if (stream == IA_STREAM_NONE) return IA_ERR_INVALID_ARGUMENT;
  return size == 0 ? IA_OK : alloc(a, size, reserve > size ? reserve : size, stream, true, out);
}

ia_status_t ia_arena_alloc_cached(ia_arena_t *a, size_t size, ia_stream_t stream, void **out) {
  *out = NULL;
  if (stream == IA_STREAM_NONE) return IA_ERR_INVALID_ARGUMENT;
  return size == 0 ? IA_OK : alloc(a, size, size, stream, false, out);
}

/* reserve (>= size): the bytes the block takes at least; its requested bytes stay size. */
static ia_status_t alloc(ia_arena_t *a, size_t size, size_t reserve, ia_stream_t stream, bool grow, void **out) {
  _ia_arena_lock(a);
  ia_status_t st = IA_ERR_OUT_OF_MEMORY;
  block_t *b = NULL;
  /* A fixed arena asleep reserves its capacity again before it serves (ia_arena_sleep). */
  if (reserve <= IA_MAX_REQUEST && (!grow || (st = _ia_wake(a)) == IA_OK)) {
    st = IA_ERR_OUT_OF_MEMORY;
    size_t rsize = _ia_align_up(reserve, a->opts.alignment);
    b = _ia_find_free(a, rsize);
    if (!b && grow && a->opts.growable) {
      st = _ia_grow(a, rsize);
      if (st == IA_OK) b = _ia_find_free(a, rsize);
    }
    if (b) {
      st = _ia_order_after(a, stream, b->stream, b->free_seq);
      if (st == IA_OK && !_ia_table_insert(&a->table, b)) st = IA_ERR_NO_HOST_MEMORY;
      if (st != IA_OK) b = NULL;
    }
    if (b) {
      _ia_bin_remove(a, b);
      hand_out(a, b, rsize, size, stream);
      *out = (void *)b->addr;
    }
  }
  if (!b) {
    a->stats.requests_failed++;
    _ia_arena_trace(a, IA_TRACE_FAIL, 0, size, stream);
  }
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
  return b ? IA_OK : st;
}

ia_status_t ia_arena_alloc_at(ia_arena_t *a, void *at, size_t size, ia_stream_t stream) {
  uintptr_t addr = (uintptr_t)at;
  if (size == 0 || size > IA_MAX_REQUEST || addr % a->opts.alignment || stream == IA_STREAM_NONE)
    return IA_ERR_INVALID_ARGUMENT;
  size_t rsize = _ia_align_up(size, a->opts.alignment);
  _ia_arena_lock(a);
  region_t *r = _ia_region_of(a, addr);
  block_t *b = r ? r->first : NULL;
  while (b && b->addr + b->size <= addr) b = b->phys_next;
  ia_status_t st = IA_ERR_OUT_OF_MEMORY;
  if (b && b->is_free && addr + rsize <= b->addr + b->size) st = _ia_order_after(a, stream, b->stream, b->free_seq);
  block_t *rest = NULL;
  if (st == IA_OK && b->addr < addr && !(rest = _ia_block_new(a))) st = IA_ERR_NO_HOST_MEMORY;
  if (rest) rest->addr = addr; /* the table files a block by its address alone */
  if (st == IA_OK && !_ia_table_insert(&a->table, rest ? rest : b)) st = IA_ERR_NO_HOST_MEMORY;
  if (st == IA_OK) _ia_bin_remove(a, b);
  if (st == IA_OK && rest) { /* the part before `at` stays a free block of its own */
    int64_t n = 0, bytes = 0;
    split_change(a, b, -1, &n, &bytes);
    *rest = (block_t){.addr = addr, .size = b->addr + b->size - addr, .region = b->region, .stream = b->stream,
                      .free_seq = b->free_seq, .is_free = true, .phys_prev = b, .phys_next = b->phys_next};
    if (b->phys_next) b->phys_next->phys_prev = rest;
    b->phys_next = rest;
    b->size = addr - b->addr;
    _ia_bin_insert(a, b);
    split_change(a, b, 1, &n, &bytes);
    split_change(a, rest, 1, &n, &bytes);
    _ia_count_split(a, n, bytes);
    b = rest;
  } else if (rest) {
    _ia_block_delete(a, rest);
  }
  if (st == IA_OK) hand_out(a, b, rsize, size, stream);
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
  return st;
}

void _ia_merge_into(ia_arena_t *a, block_t *left, block_t *right) {
  left->size += right->size;
  left->phys_next = right->phys_next;
  if (right->phys_next) right->phys_next->phys_prev = left;
  _ia_block_delete(a, right);
}

/* A block out of the table, its counters settled, becomes free on `stream` and merges with its free
 * neighbours. Ordering failures cannot be handed back to the caller without leaking the block; the
 * streams involved are broken anyway, so they stop the process instead. */
void _ia_make_free(ia_arena_t *a, block_t *b, ia_stream_t stream) {
  block_t *prev = b->phys_prev, *next = b->phys_next;
  int64_t n = 0, bytes = 0;
  if (prev && prev->is_free) split_change(a, prev, -1, &n, &bytes);
  if (next && next->is_free) split_change(a, next, -1, &n, &bytes);
  b->is_free = true;
  b->stream = stream;
  b->free_seq = ++a->free_seq;
  if (prev && prev->is_free) {
    ia_assert(_ia_order_after(a, stream, prev->stream, prev->free_seq) == IA_OK);
    _ia_bin_remove(a, prev);
    prev->requested = b->requested; /* the freed block's, as PyTorch's merge keeps the freed block */
    _ia_merge_into(a, prev, b);
    prev->stream = stream;
    prev->free_seq = a->free_seq;
    b = prev;
  }
  if (next && next->is_free) {
    ia_assert(_ia_order_after(a, stream, next->stream, next->free_seq) == IA_OK);
    _ia_bin_remove(a, next);
    _ia_merge_into(a, b, next);
  }
  _ia_bin_insert(a, b);
  split_change(a, b, 1, &n, &bytes);
  _ia_count_split(a, n, bytes);
}

/* A live block is in the table; a pointer inside one of the arena's regions that is not is a
 * double free (or a pointer into a block's middle), anything else is foreign. The other streams
 * recorded on the block are ordered before `stream`'s reuse of it. */
ia_status_t ia_arena_free(ia_arena_t *a, void *ptr, ia_stream_t stream) {
  if (!ptr) return IA_OK;
  _ia_arena_lock(a);
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr);
  if (!b) {
    ia_status_t st = _ia_region_of(a, (uintptr_t)ptr) ? IA_ERR_DOUBLE_FREE : IA_ERR_FOREIGN_POINTER;
    a->stats.bad_frees++;
    _ia_arena_unlock(a);
    return st;
  }
  if (stream == IA_STREAM_NONE) stream = b->stream;
  for (uint32_t i = 0; i < b->n_uses; i++)
    ia_assert(_ia_order_after(a, stream, b->uses[i], UINT64_MAX) == IA_OK);
  b->n_uses = 0;
  _ia_arena_trace(a, IA_TRACE_FREE, b->addr, b->requested, stream);
  _ia_table_remove(&a->table, b);
  _ia_count_live(a, -1, (int64_t)b->size, (int64_t)b->requested);
  _ia_make_free(a, b, stream);
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
  return IA_OK;
}

uint64_t ia_arena_release_cached(ia_arena_t *a) {
  if (!a->opts.growable) return 0;
  _ia_arena_lock(a);
  uint64_t released = _ia_release_free_regions(a);
  _ia_arena_unlock(a);
  return released;
}
