/* The arena over a backend that maps pages: its regions are the mapped stretches of one range. */
#include <stdlib.h>

#include "private.h"

typedef _ia_region_t region_t;
typedef _ia_block_t block_t;

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
    ia_status_t st = _ia_order_after(a, lb->stream, rb->stream, rb->free_seq);
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
  _ia_count_regions(a, -1);
  if (merge) {
    _ia_bin_remove(a, lb);
    _ia_bin_remove(a, rb);
    _ia_merge_into(a, lb, rb);
    _ia_bin_insert(a, lb);
  }
  return IA_OK;
}

/* Maps pages where `place` says; on IA_OK a free block of `size` exists. */
static ia_status_t map_for(ia_arena_t *a, size_t size) {
  placement_t p = {0};
  if (!place(a, size, &p)) return IA_ERR_OUT_OF_MEMORY; /* no gap of the range is wide enough */
  size_t bytes = p.pages * a->page;
  if (_ia_over_limit(a, bytes)) return IA_ERR_LIMIT;
  /* The headers first: once the pages are mapped nothing may fail. */
  block_t *fresh = _ia_block_new(a);
  region_t *r = p.after ? p.after : calloc(1, sizeof *r);
  if (!fresh || !r) {
    if (fresh) _ia_block_delete(a, fresh);
    if (!p.after) free(r);
    return IA_ERR_NO_HOST_MEMORY;
  }
  a->stats.backend_reserves++;
  ia_status_t st = a->backend->map(a->backend, (void *)p.at, bytes);
  if (st != IA_OK) {
    a->stats.backend_failures++;
    _ia_block_delete(a, fresh);
    if (!p.after) free(r);
    return st;
  }
  _ia_count_capacity(a, (int64_t)bytes);
  _ia_arena_trace(a, IA_TRACE_RESERVE, p.at, bytes, IA_STREAM_NONE);
  *fresh = (block_t){.addr = p.at, .size = bytes, .region = r, .stream = IA_STREAM_NONE, .is_free = true};
  block_t *last = p.after ? last_block(r) : NULL;
  if (last && last->is_free) { /* new pages were never touched: the block keeps its stream */
    _ia_bin_remove(a, last);
    last->size += bytes;
    _ia_bin_insert(a, last);
    _ia_block_delete(a, fresh);
  } else if (last) {
    last->phys_next = fresh;
    fresh->phys_prev = last;
    _ia_bin_insert(a, fresh);
  } else {
    *r = (region_t){.base = p.at, .first = fresh};
    region_t **link = &a->regions;
    while (*link && (*link)->base < p.at) link = &(*link)->next;
    r->next = *link;
    *link = r;
    _ia_count_regions(a, 1);
    _ia_bin_insert(a, fresh);
  }
  r->size += bytes;
  return r->next && r->base + r->size == r->next->base ? join(a, r) : IA_OK;
}

/* Like grow: a refusal of the limit or the backend gives the cached pages back and asks again. */
ia_status_t _ia_grow_mapped(ia_arena_t *a, size_t size) {
  ia_status_t st = map_for(a, size);
  if ((st == IA_ERR_LIMIT || st == IA_ERR_BACKEND_OUT_OF_MEMORY || st == IA_ERR_HOST_MEMORY_GUARD) &&
      _ia_release_free_regions(a)) {
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
  _ia_stream_state_t *ss = _ia_stream_state(a, b->stream, &st);
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
  block_t *spare = head && tail ? _ia_block_new(a) : NULL;
  region_t *split = before && after ? calloc(1, sizeof *split) : NULL;
  if ((head && tail && !spare) || (before && after && !split)) {
    if (spare) _ia_block_delete(a, spare);
    free(split);
    return false;
  }
  _ia_bin_remove(a, b);
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
  if (!head && !tail) _ia_block_delete(a, b);
  *rest = NULL;
  if (before && after) {
    *split = (region_t){.base = hi, .size = r_end - hi, .first = first_after, .next = r->next};
    for (block_t *x = first_after; x; x = x->phys_next) x->region = split;
    r->next = split;
    r->size = lo - r->base;
    _ia_count_regions(a, 1);
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
    _ia_count_regions(a, -1);
  }
  if (head) _ia_bin_insert(a, b);
  if (tail_block) _ia_bin_insert(a, tail_block);
  a->backend->unmap(a->backend, (void *)lo, hi - lo);
  a->stats.backend_releases++;
  _ia_count_capacity(a, -(int64_t)(hi - lo));
  _ia_arena_trace(a, IA_TRACE_RELEASE, lo, hi - lo, IA_STREAM_NONE);
  return true;
}

/* Called through release_free_regions, which has checked that nothing captures. */
uint64_t _ia_release_mapped(ia_arena_t *a) {
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

ia_status_t _ia_reserve_range(ia_arena_t *a) {
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

void _ia_unmap_all(ia_arena_t *a) {
  while (a->regions) {
    region_t *r = a->regions;
    a->regions = r->next;
    _ia_arena_trace(a, IA_TRACE_RELEASE, r->base, r->size, IA_STREAM_NONE);
    a->backend->unmap(a->backend, (void *)r->base, r->size);
    a->stats.backend_releases++;
    _ia_count_capacity(a, -(int64_t)r->size);
    _ia_count_regions(a, -1);
    free(r);
  }
  if (!a->range_size) return;
  if (a->on_region) a->on_region(a->on_region_ctx, a, a->range_base, a->range_size, false);
  a->backend->address_free(a->backend, (void *)a->range_base, a->range_size);
}
