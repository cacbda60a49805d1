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

/* The arena's blocks, listed in one hold of its lock, tile each of its regions at that moment, so
 * each segment is the run of blocks of one region and its size their sum: a consistent picture of
 * the segment whatever other threads do to the arena meanwhile. */
static void walk_arena(const walk_t *w, ia_arena_t *a, int32_t pool, ia_pool_id_t graph_pool) {
  size_t cap = ia_arena_blocks(a, NULL, 0) + 8, n = 0;
  ia_block_info_t *blocks = NULL;
  for (;;) { /* the arena may gain blocks between the two calls */
    if (!(blocks = calloc(cap, sizeof *blocks))) return;
    if ((n = ia_arena_blocks(a, blocks, cap)) <= cap) break;
    free(blocks);
    cap = n + 8;
  }
  for (size_t i = 0; i < n;) { /* ia_arena_blocks lists each region's blocks together, in address order */
    ia_segment_info_t seg = {.address = blocks[i].region_base, .stream = blocks[i].stream, .pool = pool,
                             .expandable = ia_arena_page_size(a) != 0, .graph_pool = graph_pool};
    size_t j = i;
    for (; j < n && blocks[j].region_base == blocks[i].region_base; j++) seg.size += blocks[j].size;
    w->fn(w->ctx, &seg, blocks + i, j - i);
    i = j;
  }
  free(blocks);
}

static void walk_graph_arena(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *a) {
  if (kind != IA_POOL_WORKSPACE) walk_arena(ctx, a, _ia_graph_trace_tag(kind), id);
}

void ia_plugin_segments(int device, ia_segment_fn fn, void *ctx) {
  if (!_ia_device_ready(device)) return;
  walk_t w = {fn, ctx};
  for (int p = 0; p < IA_POOL_COUNT; p++) {
    ia_arena_t *a = ia_plugin_arena(device, p); /* Note [Device lifetime]: it stays once made */
    if (a) walk_arena(&w, a, p, (ia_pool_id_t){0, 0});
  }
  _ia_graph_each_arena(device, walk_graph_arena, &w);
}
