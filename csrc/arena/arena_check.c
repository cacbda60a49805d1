/* The invariant walk (ia_arena_check, and after every operation in IA_DEBUG builds). */
#include <pthread.h>
#include <stdio.h>

#include "private.h"

typedef _ia_region_t region_t;
typedef _ia_block_t block_t;

#define CHECK(cond, ...)                                                                            \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      snprintf(msg, msg_len, __VA_ARGS__);                                                          \
      goto broken;                                                                                  \
    }                                                                                               \
  } while (0)

/* What the walk counted, to hold against the arena's counters. */
typedef struct {
  uint64_t in_use, free_bytes, capacity, requested, split_bytes;
  size_t live, free_count, n_regions, split;
} walk_t;

static void count_split(const ia_arena_t *a, const block_t *b, walk_t *w) {
  if (!_ia_split_free(a, b)) return;
  w->split++;
  w->split_bytes += b->size;
}

/* A free block: not beside another free one, filed in its class. */
static bool check_free_block(ia_arena_t *a, block_t *b, walk_t *w, char *msg, size_t msg_len) {
  CHECK(!b->phys_next || !b->phys_next->is_free, "free blocks %#lx and %#lx are neighbours",
        (unsigned long)b->addr, (unsigned long)b->phys_next->addr);
  unsigned fl, sl;
  _ia_class_of(b->size, &fl, &sl);
  CHECK(b->fl == fl && b->sl == sl, "free block %#lx filed in the wrong class", (unsigned long)b->addr);
  bool found = false;
  for (block_t *x = a->bins[fl][sl]; x && !found; x = x->free_next) found = x == b;
  CHECK(found, "free block %#lx missing from its class", (unsigned long)b->addr);
  CHECK(b->requested <= b->size, "free block %#lx says %llu bytes were requested of its %llu",
        (unsigned long)b->addr, (unsigned long long)b->requested, (unsigned long long)b->size);
  w->free_bytes += b->size;
  w->free_count++;
  count_split(a, b, w);
  return true;
broken:
  return false;
}

/* A live block: in the table. */
static bool check_live_block(ia_arena_t *a, block_t *b, walk_t *w, char *msg, size_t msg_len) {
  CHECK(_ia_table_find(&a->table, b->addr) == b, "live block %#lx missing from the live table",
        (unsigned long)b->addr);
  CHECK(b->requested <= b->size, "live block %#lx says %llu bytes were requested of its %llu",
        (unsigned long)b->addr, (unsigned long long)b->requested, (unsigned long long)b->size);
  w->in_use += b->size;
  w->requested += b->requested;
  w->live++;
  return true;
broken:
  return false;
}

/* One region (a mapped stretch: whole pages, in address order, after *mapped_to) tiled by blocks. */
static bool check_region(ia_arena_t *a, region_t *r, uintptr_t *mapped_to, walk_t *w, char *msg, size_t msg_len) {
  CHECK(r->base % a->opts.alignment == 0, "region %#lx is not aligned", (unsigned long)r->base);
  if (a->page) {
    CHECK(r->size && r->base % a->page == 0 && r->size % a->page == 0, "stretch %#lx is not whole pages",
          (unsigned long)r->base);
    CHECK(r->base >= *mapped_to && r->base + r->size <= a->range_base + a->range_size,
          "stretch %#lx overlaps another, is out of address order or outside the range", (unsigned long)r->base);
    *mapped_to = r->base + r->size;
  }
  CHECK(r->first && r->first->addr == r->base && !r->first->phys_prev,
        "region %#lx does not start with its first block", (unsigned long)r->base);
  uintptr_t expect = r->base;
  for (block_t *b = r->first; b; b = b->phys_next) {
    CHECK(b->addr == expect, "gap or overlap at %#lx (block starts at %#lx)", (unsigned long)expect,
          (unsigned long)b->addr);
    CHECK(b->region == r, "block %#lx names the wrong region", (unsigned long)b->addr);
    CHECK(b->size && b->size % a->opts.alignment == 0, "block %#lx has size %zu", (unsigned long)b->addr,
          b->size);
    CHECK(!b->phys_next || b->phys_next->phys_prev == b, "broken links after %#lx", (unsigned long)b->addr);
    expect += b->size;
    if (!(b->is_free ? check_free_block : check_live_block)(a, b, w, msg, msg_len)) return false;
  }
  CHECK(expect == r->base + r->size, "blocks of region %#lx cover %zu of %zu bytes", (unsigned long)r->base,
        (size_t)(expect - r->base), r->size);
  w->capacity += r->size;
  w->n_regions++;
  return true;
broken:
  return false;
}

/* The class bitmaps and lists and the live table against what the regions hold. */
static bool check_classes(ia_arena_t *a, const walk_t *w, char *msg, size_t msg_len) {
  size_t binned = 0;
  for (unsigned fl = 0; fl < IA_FL_COUNT; fl++)
    for (unsigned sl = 0; sl < IA_SL_COUNT; sl++) {
      bool bit = (a->sl_bitmap[fl] >> sl) & 1;
      CHECK(bit == (a->bins[fl][sl] != NULL), "bitmap disagrees with class %u/%u", fl, sl);
      for (block_t *x = a->bins[fl][sl]; x; x = x->free_next, binned++)
        CHECK(x->is_free, "live block %#lx sits in a free class", (unsigned long)x->addr);
    }
  CHECK(binned == w->free_count, "%zu blocks in classes, %zu free blocks in regions", binned, w->free_count);
  CHECK(w->live == a->table.count, "%zu live blocks, %zu in the live table", w->live, a->table.count);
  return true;
broken:
  return false;
}

/* Every quantity: current = allocated - freed, within 0 and its peak. */
static bool check_quads(const ia_stats_t *s, char *msg, size_t msg_len) {
#define QUAD(name, torch, doc)                                                                      \
  CHECK(s->name.current == s->name.allocated - s->name.freed && s->name.current >= 0 &&              \
            s->name.current <= s->name.peak,                                                          \
        "%s is off: current %ld, peak %ld, allocated %ld, freed %ld", #name, (long)s->name.current,  \
        (long)s->name.peak, (long)s->name.allocated, (long)s->name.freed);
  IA_STAT_QUADS(QUAD)
#undef QUAD
  return true;
broken:
  return false;
}

/* Under the arena's lock. */
static bool check_locked(ia_arena_t *a, char *msg, size_t msg_len) {
  walk_t w = {0};
  uintptr_t mapped_to = a->range_base; /* mapping: where the previous stretch ended */
  for (region_t *r = a->regions; r; r = r->next)
    if (!check_region(a, r, &mapped_to, &w, msg, msg_len)) return false;
  if (!check_classes(a, &w, msg, msg_len)) return false;
  const ia_stats_t *s = &a->stats;
  if (!check_quads(s, msg, msg_len)) return false;
  CHECK((int64_t)w.n_regions == s->regions.current && (int64_t)w.capacity == s->capacity.current,
        "region counters are off");
  CHECK((int64_t)w.in_use == s->in_use.current && (int64_t)w.live == s->blocks.current &&
            (int64_t)w.requested == s->requested.current,
        "in-use counters are off: walked %lu bytes in %zu blocks, counted %ld in %ld", (unsigned long)w.in_use,
        w.live, (long)s->in_use.current, (long)s->blocks.current);
  CHECK(s->active.current == s->blocks.current && s->active_bytes.current == s->in_use.current,
        "active counters are off");
  CHECK((int64_t)w.split == s->inactive_split.current && (int64_t)w.split_bytes == s->inactive_split_bytes.current,
        "inactive_split is off: walked %zu blocks of %lu bytes, counted %ld of %ld", w.split,
        (unsigned long)w.split_bytes, (long)s->inactive_split.current, (long)s->inactive_split_bytes.current);
  CHECK(w.free_bytes == a->stats.free_bytes && w.free_count == a->stats.free_blocks, "free counters are off");
  if (msg_len) msg[0] = '\0';
  return true;
broken:
  return false;
}

bool ia_arena_check(ia_arena_t *a, char *msg, size_t msg_len) {
  _ia_arena_lock(a);
  bool ok = check_locked(a, msg, msg_len);
  _ia_arena_unlock(a);
  return ok;
}

void _ia_arena_debug_check(ia_arena_t *a) {
  char msg[512];
  if (!check_locked(a, msg, sizeof msg)) _ia_assert_fail(msg, __FILE__, __LINE__);
}
