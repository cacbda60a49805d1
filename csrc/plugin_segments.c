/* The device's segments and their blocks, as PyTorch's memory snapshot lists them: a segment is a
 * region of an arena (a reservation, or a mapped stretch of a page-mapping pool), its blocks tile
 * it in address order. A graph pool's workspace carve-outs are not listed apart: each is a live
 * block of the workspace arena's segment. */
#include <stdlib.h>

#include "plugin.h"

typedef struct {
  ia_segment_fn fn;
  void *ctx;
} walk_t;

/* Fills *out with a fresh array of the arena's entries (count in *n); false when out of memory. */
#define LISTING(name, type, list)                                                                  \
  static bool name(ia_arena_t *a, type **out, size_t *n) {                                         \
    size_t cap = list(a, NULL, 0) + 8;                                                             \
    for (;;) { /* the arena may gain entries between the two calls */                              \
      *out = calloc(cap, sizeof **out);                                                            \
      if (!*out) return false;                                                                     \
      *n = list(a, *out, cap);                                                                     \
      if (*n <= cap) return true;                                                                  \
      free(*out);                                                                                  \
      cap = *n + 8;                                                                                \
    }                                                                                              \
  }
LISTING(list_blocks, ia_block_info_t, ia_arena_blocks)
LISTING(list_regions, ia_region_info_t, ia_arena_regions)
#undef LISTING

static void walk_arena(const walk_t *w, ia_arena_t *a, int32_t pool, ia_pool_id_t graph_pool) {
  ia_block_info_t *blocks = NULL;
  ia_region_info_t *regions = NULL;
  size_t n_blocks = 0, n_regions = 0;
  if (list_regions(a, &regions, &n_regions) && list_blocks(a, &blocks, &n_blocks)) {
    /* ia_arena_blocks lists each region's blocks together, in address order */
    for (size_t i = 0; i < n_blocks;) {
      size_t j = i;
      while (j < n_blocks && blocks[j].region_base == blocks[i].region_base) j++;
      ia_segment_info_t seg = {.address = blocks[i].region_base, .stream = blocks[i].stream, .pool = pool,
                               .expandable = ia_arena_page_size(a) != 0, .graph_pool = graph_pool};
      for (size_t r = 0; r < n_regions; r++)
        if (regions[r].base == seg.address) seg.size = regions[r].size;
      if (seg.size) w->fn(w->ctx, &seg, blocks + i, j - i);
      i = j;
    }
  }
  free(blocks);
  free(regions);
}

static void walk_graph_arena(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *a) {
  if (kind != GRAPH_WORKSPACE) walk_arena(ctx, a, IA_TRACE_POOL_GRAPH + kind, id);
}

void ia_plugin_segments(int device, ia_segment_fn fn, void *ctx) {
  if (!_ia_device_ready(device)) return;
  walk_t w = {fn, ctx};
  for (int p = 0; p < IA_POOL_COUNT; p++)
    if (ia_plugin_arena(device, p)) walk_arena(&w, ia_plugin_arena(device, p), p, (ia_pool_id_t){0, 0});
  _ia_graph_each_arena(device, walk_graph_arena, &w);
}
