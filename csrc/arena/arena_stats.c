/* What an arena says of itself: statistics, device totals, its blocks and regions.
 *
 * The device totals (internal.h: ia_totals_t) are plain integers under the group's lock, which an
 * arena takes inside its own for each update; nothing is called under it, so it is never held
 * for more than a few additions. (The lock order of the whole core: Note [Device lifetime],
 * csrc/torch/plugin.h.) */
#include <pthread.h>

#include "private.h"

typedef _ia_region_t region_t;
typedef _ia_block_t block_t;

void _ia_totals_reset_peaks(ia_totals_t *t) {
  pthread_mutex_lock(&t->lock);
  _ia_total_t *all[] = {&t->in_use, &t->requested, &t->blocks, &t->capacity, &t->regions};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) all[i]->peak = all[i]->current;
  pthread_mutex_unlock(&t->lock);
}

void _ia_count_live(ia_arena_t *a, int64_t sign, int64_t bytes, int64_t requested) {
  ia_stats_t *s = &a->stats;
  _ia_stat_add(&s->in_use, sign * bytes);
  _ia_stat_add(&s->active_bytes, sign * bytes);
  _ia_stat_add(&s->requested, sign * requested);
  _ia_stat_add(&s->blocks, sign);
  _ia_stat_add(&s->active, sign);
  ia_totals_t *t = a->totals;
  if (!t) return;
  pthread_mutex_lock(&t->lock);
  _ia_total_add(&t->in_use, sign * bytes);
  _ia_total_add(&t->requested, sign * requested);
  _ia_total_add(&t->blocks, sign);
  pthread_mutex_unlock(&t->lock);
}

void _ia_count_capacity(ia_arena_t *a, int64_t bytes) {
  _ia_stat_add(&a->stats.capacity, bytes);
  if (!a->totals) return;
  pthread_mutex_lock(&a->totals->lock);
  _ia_total_add(&a->totals->capacity, bytes);
  pthread_mutex_unlock(&a->totals->lock);
}

void _ia_count_regions(ia_arena_t *a, int64_t n) {
  _ia_stat_add(&a->stats.regions, n);
  if (!a->totals) return;
  pthread_mutex_lock(&a->totals->lock);
  _ia_total_add(&a->totals->regions, n);
  pthread_mutex_unlock(&a->totals->lock);
}

void _ia_count_split(ia_arena_t *a, int64_t blocks, int64_t bytes) {
  _ia_stat_add(&a->stats.inactive_split, blocks);
  _ia_stat_add(&a->stats.inactive_split_bytes, bytes);
}

void _ia_arena_watch_captures(ia_arena_t *a, const _Atomic int *captures) {
  _ia_arena_lock(a);
  a->captures = captures;
  _ia_arena_unlock(a);
}

void _ia_arena_set_totals(ia_arena_t *a, ia_totals_t *t) {
  _ia_arena_lock(a);
  a->totals = t;
  a->captures = &t->captures;
  const ia_stats_t *s = &a->stats;
  pthread_mutex_lock(&t->lock);
  _ia_total_add(&t->in_use, s->in_use.current);
  _ia_total_add(&t->requested, s->requested.current);
  _ia_total_add(&t->blocks, s->blocks.current);
  _ia_total_add(&t->capacity, s->capacity.current);
  _ia_total_add(&t->regions, s->regions.current);
  pthread_mutex_unlock(&t->lock);
  _ia_arena_unlock(a);
}

void _ia_arena_set_region_hook(ia_arena_t *a, _ia_region_hook_t hook, void *ctx) {
  _ia_arena_lock(a);
  a->on_region = hook;
  a->on_region_ctx = ctx;
  if (a->range_size && hook) hook(ctx, a, a->range_base, a->range_size, true); /* mapping: the range */
  for (region_t *r = a->page ? NULL : a->regions; r && hook; r = r->next) hook(ctx, a, r->base, r->size, true);
  _ia_arena_unlock(a);
}

bool ia_arena_owns(ia_arena_t *a, const void *ptr) {
  uintptr_t p = (uintptr_t)ptr;
  _ia_arena_lock(a);
  bool owned = _ia_region_of(a, p) != NULL;
  _ia_arena_unlock(a);
  return owned;
}

size_t ia_arena_alignment(const ia_arena_t *a) { return a->opts.alignment; }

size_t ia_arena_page_size(const ia_arena_t *a) { return a->page; }

const ia_backend_t *_ia_arena_backend(const ia_arena_t *a) { return a->backend; }

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

void ia_arena_stats(ia_arena_t *a, ia_stats_t *out) {
  _ia_arena_lock(a);
  *out = a->stats;
  out->largest_free = largest_free_locked(a);
  _ia_arena_unlock(a);
  out->fragmentation = out->free_bytes ? 1.0 - (double)out->largest_free / (double)out->free_bytes : 0.0;
}

void ia_arena_reset_peaks(ia_arena_t *a) {
  _ia_arena_lock(a);
#define RESET(name, torch, doc) a->stats.name.peak = a->stats.name.current;
  IA_STAT_QUADS(RESET)
#undef RESET
  _ia_arena_unlock(a);
}

size_t ia_arena_regions(ia_arena_t *a, ia_region_info_t *out, size_t cap) {
  _ia_arena_lock(a);
  size_t n = 0;
  for (region_t *r = a->regions; r; r = r->next, n++)
    if (n < cap) out[n] = (ia_region_info_t){r->base, r->size};
  _ia_arena_unlock(a);
  return n;
}

size_t ia_arena_blocks(ia_arena_t *a, ia_block_info_t *out, size_t cap) {
  _ia_arena_lock(a);
  size_t n = 0;
  uint32_t index = 0;
  for (region_t *r = a->regions; r; r = r->next, index++)
    for (block_t *b = r->first; b; b = b->phys_next, n++)
      if (n < cap)
        out[n] = (ia_block_info_t){.address = b->addr, .size = b->size, .requested = b->requested,
                                   .region_base = r->base, .region = index,
                                   .is_free = b->is_free, .stream = b->stream};
  _ia_arena_unlock(a);
  return n;
}

void ia_arena_set_trace(ia_arena_t *a, ia_trace_t *t, int32_t device, uint8_t pool) {
  _ia_arena_lock(a);
  bool attaching = t && t != a->trace;
  a->trace_tag = (uint64_t)(uint32_t)device << 8 | pool;
  a->trace = t;
  /* A trace starts with the regions already held, so a consumer knows the arena's layout. */
  for (region_t *r = attaching ? a->regions : NULL; r; r = r->next)
    _ia_arena_trace(a, IA_TRACE_RESERVE, r->base, r->size, IA_STREAM_NONE);
  _ia_arena_unlock(a);
}

/* Arenas summed: every quantity and counter added, the largest free block the larger one. */
void _ia_stats_add(ia_stats_t *sum, const ia_stats_t *s) {
  uint64_t largest = sum->largest_free > s->largest_free ? sum->largest_free : s->largest_free;
#define ADD_QUAD(name, torch, doc)                                                                  \
  sum->name = (ia_stat_t){sum->name.current + s->name.current, sum->name.peak + s->name.peak,        \
                          sum->name.allocated + s->name.allocated, sum->name.freed + s->name.freed};
#define ADD(type, name, doc) sum->name = _Generic(sum->name, double: sum->name, default: sum->name + s->name);
  IA_STAT_QUADS(ADD_QUAD)
  IA_STAT_COUNTERS(ADD)
#undef ADD
#undef ADD_QUAD
  sum->largest_free = largest;
}
