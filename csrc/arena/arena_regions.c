/* Regions that are reservations: made, given back, grown into (arena_mapped.c: mapped stretches). */
#include <stdlib.h>

#include "private.h"

typedef _ia_region_t region_t;
typedef _ia_block_t block_t;

static bool in_region(const region_t *r, uintptr_t p) { return p >= r->base && p - r->base < r->size; }

region_t *_ia_region_of(const ia_arena_t *a, uintptr_t p) {
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

ia_status_t _ia_region_add(ia_arena_t *a, size_t size) {
  size_t align = a->opts.alignment;
  if (size > SIZE_MAX - align) return IA_ERR_BACKEND_OUT_OF_MEMORY;
  region_t *r = calloc(1, sizeof *r);
  block_t *b = _ia_block_new(a);
  if (!r || !b) {
    free(r);
    if (b) _ia_block_delete(a, b);
    return IA_ERR_NO_HOST_MEMORY;
  }
  ia_status_t st = reserve_aligned(a, size, align, &r->raw, &r->raw_size);
  if (st != IA_OK) {
    free(r);
    _ia_block_delete(a, b);
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
  _ia_bin_insert(a, b);
  _ia_count_capacity(a, (int64_t)size);
  _ia_count_regions(a, 1);
  if (a->on_region) a->on_region(a->on_region_ctx, a, r->base, size, true);
  _ia_arena_trace(a, IA_TRACE_RESERVE, r->base, size, IA_STREAM_NONE);
  return IA_OK;
}

void _ia_region_drop(ia_arena_t *a, region_t *r) {
  region_t **link = &a->regions;
  while (*link != r) link = &(*link)->next;
  *link = r->next;
  if (a->on_region) a->on_region(a->on_region_ctx, a, r->base, r->size, false);
  _ia_arena_trace(a, IA_TRACE_RELEASE, r->base, r->size, IA_STREAM_NONE);
  a->backend->release(a->backend, r->raw, r->raw_size);
  a->stats.backend_releases++;
  _ia_count_capacity(a, -(int64_t)r->size);
  _ia_count_regions(a, -1);
  free(r);
}


uint64_t _ia_release_free_regions(ia_arena_t *a) {
  uint64_t released = 0;
  if (_ia_capturing(a)) return 0;
  if (a->page) return _ia_release_mapped(a);
  region_t *next;
  for (region_t *r = a->regions; r; r = next) {
    next = r->next;
    block_t *b = r->first;
    if (!b->is_free || b->size != r->size) continue;
    _ia_bin_remove(a, b);
    _ia_block_delete(a, b);
    released += r->size;
    _ia_region_drop(a, r);
  }
  return released;
}

static size_t region_size_for(const ia_arena_options_t *o, size_t size) {
  size_t rounded = _ia_align_up(size, o->region_round);
  if (size >= o->region_exact_above) return rounded;
  return rounded > o->region_min ? rounded : o->region_min;
}

bool _ia_over_limit(const ia_arena_t *a, size_t want) {
  if (a->opts.limit && (uint64_t)a->stats.capacity.current + want > a->opts.limit) return true;
  uint64_t group = a->totals ? atomic_load(&a->totals->limit) : 0;
  if (!group) return false;
  pthread_mutex_lock(&a->totals->lock);
  bool over = (uint64_t)a->totals->capacity.current + want > group;
  pthread_mutex_unlock(&a->totals->lock);
  return over;
}

ia_status_t _ia_grow(ia_arena_t *a, size_t size) {
  if (a->page) return _ia_grow_mapped(a, size);
  size_t want = region_size_for(&a->opts, size);
  if (_ia_over_limit(a, want)) {
    if (_ia_release_free_regions(a)) a->stats.retries++;
    if (_ia_over_limit(a, want)) return IA_ERR_LIMIT;
  }
  ia_status_t st = _ia_region_add(a, want);
  if ((st == IA_ERR_BACKEND_OUT_OF_MEMORY || st == IA_ERR_HOST_MEMORY_GUARD) &&
      _ia_release_free_regions(a)) {
    a->stats.retries++;
    st = _ia_region_add(a, want);
  }
  return st;
}

/* Sleep: the one reservation of a fixed arena goes back while nothing in it is live, and the arena
 * stays, with its statistics and history (why: Note [Device lifetime], csrc/torch/plugin.h). In use or while a
 * stream of the device captures, nothing changes and the answer is IA_ERR_INVALID_ARGUMENT. */
ia_status_t ia_arena_sleep(ia_arena_t *a) {
  if (a->opts.growable) return IA_ERR_INVALID_ARGUMENT;
  _ia_arena_lock(a);
  ia_status_t st = a->stats.in_use.current || _ia_capturing(a) ? IA_ERR_INVALID_ARGUMENT : IA_OK;
  region_t *r = a->regions;
  if (st == IA_OK && r) {
    block_t *b = r->first; /* nothing live: frees merge at once, so one free block is the region */
    ia_assert(b->is_free && b->size == r->size && !r->next);
    _ia_bin_remove(a, b);
    _ia_block_delete(a, b);
    _ia_region_drop(a, r);
  }
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
  return st;
}

ia_status_t _ia_wake(ia_arena_t *a) {
  if (a->opts.growable || a->regions) return IA_OK;
  return _ia_region_add(a, _ia_align_up(a->opts.capacity, a->opts.alignment));
}

ia_status_t ia_arena_wake(ia_arena_t *a) {
  _ia_arena_lock(a);
  ia_status_t st = _ia_wake(a);
  _ia_arena_unlock(a);
  return st;
}

bool ia_arena_asleep(ia_arena_t *a) {
  _ia_arena_lock(a);
  bool asleep = !a->opts.growable && !a->regions;
  _ia_arena_unlock(a);
  return asleep;
}
