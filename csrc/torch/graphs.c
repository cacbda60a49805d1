/* CUDA graph pools: what a captured graph allocates, kept apart from eager memory.
 *
 * PyTorch brackets a capture with begin/end of allocate-to-pool under a pool id, and releases the
 * pool when the graph goes; graphs may share one pool. Between begin and end, the allocations that
 * PyTorch's filter selects (the capture's streams) come from the pool's own arenas, one set per
 * stream, so that a block is only ever reused by the stream that freed it: a capture may not wait
 * on anything, and within one stream its order is the graph's order. A block freed into a pool
 * stays in it; while the pool lives nothing it holds is handed to eager code, so a graph's
 * addresses stay valid across replays. When the last holder releases the pool, its fully free
 * regions go back at once (or when the device's captures end), and the rest as their last blocks
 * are freed.
 *
 * While any stream of the device captures, some frees are held back (graph_frees.c).
 *
 * Workspaces inside a capture are carved from the device's workspace arena by a per-stream arena
 * of the pool whose regions are blocks of it: the graph keeps them for its lifetime and reuses them
 * for its later workspaces, and they go back to the workspace arena with the pool.
 *
 * Locking: the device's graph lock (its record's graphs.lock) guards its pools; arenas are called
 * outside it except when a pool is created or destroyed, or read for statistics. Which arena may
 * go when, and the lock order: Note [Device lifetime] (csrc/torch/plugin.h).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin.h"

typedef struct {
  ia_stream_t stream;
  ia_arena_t *arenas[IA_POOL_COUNT]; /* by kind, IA_POOL_* */
} pool_stream_t;

struct graph_pool {
  ia_pool_id_t id;
  int use_count;  /* graphs and MemPools holding it */
  int allocating; /* begun, not ended */
  int kept_by;    /* pools whose captures freed one of its blocks (below) */
  /* A MemPool's options: its own allocator (its regions come from it; allocator.drop when the
   * pool goes), no_split (a block takes its free block whole), use_on_oom (an eager request that
   * finds no memory may take one of its free blocks). */
  ia_pool_allocator_t allocator;
  bool no_split, use_on_oom;
  _ia_owner_t owner;
  pool_stream_t *streams;
  size_t n_streams, cap_streams;
  /* Other pools whose blocks were freed while this pool captured: the graph may still read and
   * write those addresses at replay, so their memory stays until this pool's graphs are gone. */
  graph_pool_t **keeps;
  size_t n_keeps, cap_keeps;
  graph_pool_t *next;
};

typedef _ia_device_graphs_t device_graphs_t;

/* The device's graph pools (plugin.h); NULL for a device outside 0 to IA_MAX_DEVICES - 1. */
static device_graphs_t *graphs_of(int device) {
  _ia_device_t *dev = _ia_device(device);
  return dev ? &dev->graphs : NULL;
}

static bool same_id(ia_pool_id_t a, ia_pool_id_t b) { return a.first == b.first && a.second == b.second; }

static graph_pool_t *find_pool(device_graphs_t *g, ia_pool_id_t id) {
  for (graph_pool_t *p = g->pools; p; p = p->next)
    if (same_id(p->id, id)) return p;
  return NULL;
}

static graph_pool_t *find_or_create(device_graphs_t *g, int device, ia_pool_id_t id) {
  graph_pool_t *p = find_pool(g, id);
  if (p) return p;
  if (!(p = calloc(1, sizeof *p))) return NULL;
  p->id = id;
  p->owner = (_ia_owner_t){.device = device, .graph_pool = p};
  p->next = g->pools;
  g->pools = p;
  return p;
}

/* The order a stream's arenas are walked in, which listings and reports keep: small, large, then
 * the workspace carve-outs. */
static const int walk_order[IA_POOL_COUNT] = {IA_POOL_SMALL, IA_POOL_LARGE, IA_POOL_WORKSPACE};

/* The body runs once for every arena `a` of pool `p`, of kind `k` (IA_POOL_*; one per stream and
 * kind). */
#define FOR_EACH_ARENA(p, k, a)                                                                    \
  for (size_t stream_ = 0; stream_ < (p)->n_streams; stream_++)                                    \
    for (int kind_ = 0; kind_ < IA_POOL_COUNT; kind_++)                                            \
      for (int k = walk_order[kind_], once_ = 1; once_; once_ = 0)                                 \
        for (ia_arena_t *a = (p)->streams[stream_].arenas[k]; a; a = NULL)

static uint64_t pool_capacity(const graph_pool_t *p) {
  uint64_t total = 0;
  FOR_EACH_ARENA(p, k, a) {
    ia_stats_t s;
    ia_arena_stats(a, &s);
    total += (uint64_t)s.capacity.current;
  }
  return total;
}

/* Once a pool's graphs are gone, the pools it kept are no longer in use on its account. */
static void drop_keeps(graph_pool_t *p) {
  for (size_t i = 0; i < p->n_keeps; i++) p->keeps[i]->kept_by--;
  free(p->keeps);
  p->keeps = NULL;
  p->n_keeps = p->cap_keeps = 0;
}

/* An arena of a pool that goes keeps its history in the device's statistics. A carve-out's bytes
 * are the workspace arena's, which keeps them. Under the graph lock. */
static void retire(device_graphs_t *g, int kind, ia_arena_t *a) {
  if (kind == IA_POOL_WORKSPACE) return;
  ia_stats_t s;
  ia_arena_stats(a, &s);
  ia_assert(!s.capacity.current && !s.in_use.current); /* it holds nothing: its gauges are all 0 */
  _ia_stats_add(&g->retired[kind], &s);
}

/* A released pool gives back what it can; once it holds nothing, it goes. Under the graph lock.
 * Returns whether it dropped keeps, which may let other pools go too. */
static bool trim_one(device_graphs_t *g, graph_pool_t *p) {
  if (p->use_count > 0 || p->allocating > 0) return false;
  bool dropped = p->n_keeps > 0;
  drop_keeps(p);
  if (p->kept_by > 0 || atomic_load(&_ia_device(p->owner.device)->totals.captures) > 0) return dropped;
  FOR_EACH_ARENA(p, k, a) ia_arena_release_cached(a);
  if (pool_capacity(p)) return dropped;
  graph_pool_t **link = &g->pools;
  while (*link != p) link = &(*link)->next;
  *link = p->next;
  FOR_EACH_ARENA(p, k, a) {
    retire(g, k, a);
    ia_arena_destroy(a);
  }
  if (p->allocator.drop) p->allocator.drop(p->allocator.ctx);
  free(p->streams);
  free(p);
  return dropped;
}

/* Trims `p` (NULL: every pool), then every pool again for as long as a trim drops keeps. */
static void trim_released(device_graphs_t *g, graph_pool_t *p) {
  bool again = p ? trim_one(g, p) : true;
  while (again) {
    again = false;
    for (graph_pool_t *q = g->pools, *next; q; q = next) {
      next = q->next;
      again |= trim_one(g, q);
    }
  }
}

/* A block of pool `owner` freed while pools of its device allocate to them (a capture, a MemPool
 * in use): each of those pools keeps `owner` for as long as it lives, since what it captured may
 * use the freed block (a tensor rebound inside the capture). PyTorch's allocator keeps such memory
 * only until the next empty_cache(); after it, a replay would touch memory given back. */
static void keep_for_allocating_pools(device_graphs_t *g, graph_pool_t *owner) {
  for (graph_pool_t *p = g->pools; p; p = p->next) {
    if (p == owner || p->allocating == 0) continue;
    bool kept = false;
    for (size_t i = 0; i < p->n_keeps && !kept; i++) kept = p->keeps[i] == owner;
    if (kept) continue;
    if (p->n_keeps == p->cap_keeps) {
      size_t cap = p->cap_keeps ? p->cap_keeps * 2 : 4;
      graph_pool_t **grown = realloc(p->keeps, cap * sizeof *grown);
      if (!grown) continue; /* not kept: the pool is then no safer than under PyTorch's allocator */
      p->keeps = grown;
      p->cap_keeps = cap;
    }
    p->keeps[p->n_keeps++] = owner;
    owner->kept_by++;
  }
}

void _ia_graph_keep(int device, graph_pool_t *owner) {
  device_graphs_t *g = graphs_of(device);
  pthread_mutex_lock(&g->lock);
  keep_for_allocating_pools(g, owner);
  pthread_mutex_unlock(&g->lock);
}

static ia_status_t pool_call(int device, ia_pool_id_t id, int begin_delta, int use_delta, bool create) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return IA_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = create ? find_or_create(g, device, id) : find_pool(g, id);
  ia_status_t st = IA_OK;
  if (!p) st = create ? IA_ERR_NO_HOST_MEMORY : IA_ERR_INVALID_ARGUMENT;
  else if (p->allocating + begin_delta < 0 || p->use_count + use_delta < 0) st = IA_ERR_INVALID_ARGUMENT;
  if (st == IA_OK) {
    p->allocating += begin_delta;
    p->use_count += use_delta;
    trim_released(g, p);
  }
  pthread_mutex_unlock(&g->lock);
  return st;
}

ia_status_t ia_graph_begin(int device, ia_pool_id_t id) {
  _ia_device_t *dev = _ia_device(device);
  if (!dev) return IA_ERR_INVALID_ARGUMENT;
  ia_status_t st = pool_call(device, id, 1, 1, true);
  if (st != IA_OK) return st;
  atomic_fetch_add(&dev->totals.captures, 1);
  /* PyTorch begins allocating to the pool before the capture starts. From the count on, no arena of
   * the device gives memory back; a release that looked before it may still be unmapping under its
   * arena's lock, and recording the pending frees' events takes every arena's lock once, which waits
   * it out: when this returns nothing goes back to the driver while the capture runs, as PyTorch's
   * allocator mutex guarantees (its release and beginAllocateToPool take it alike). The events are
   * recorded while no stream of the device captures yet. */
  _ia_plugin_flush_events(device);
  return IA_OK;
}

ia_status_t ia_graph_end(int device, ia_pool_id_t id) {
  ia_status_t st = pool_call(device, id, -1, 0, false);
  if (st != IA_OK) return st;
  if (atomic_fetch_sub(&_ia_device(device)->totals.captures, 1) != 1) return IA_OK;
  /* The last capture of the device ended: the held frees run, released pools give back. */
  _ia_graph_run_held(device);
  _ia_graph_flush_arenas(device);
  return IA_OK;
}

ia_status_t ia_graph_incref(int device, ia_pool_id_t id) { return pool_call(device, id, 0, 1, true); }
ia_status_t ia_graph_release(int device, ia_pool_id_t id) { return pool_call(device, id, 0, -1, false); }

int ia_graph_use_count(int device, ia_pool_id_t id) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return 0;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = find_pool(g, id);
  int n = p ? p->use_count : 0;
  pthread_mutex_unlock(&g->lock);
  return n;
}

/* Sets what `set` does to the pool (made if new); with before_use, only before it has allocated. */
static ia_status_t configure(int device, ia_pool_id_t id, void (*set)(graph_pool_t *p, const void *arg),
                             const void *arg, bool before_use) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return IA_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = find_or_create(g, device, id);
  ia_status_t st = !p ? IA_ERR_NO_HOST_MEMORY : before_use && p->n_streams ? IA_ERR_INVALID_ARGUMENT : IA_OK;
  if (st == IA_OK) set(p, arg);
  pthread_mutex_unlock(&g->lock);
  return st;
}

static void set_allocator(graph_pool_t *p, const void *allocator) {
  if (p->allocator.drop) p->allocator.drop(p->allocator.ctx);
  p->allocator = *(const ia_pool_allocator_t *)allocator;
}
static void set_no_split(graph_pool_t *p, const void *on) { p->no_split = *(const bool *)on; }
static void set_use_on_oom(graph_pool_t *p, const void *on) { p->use_on_oom = *(const bool *)on; }

ia_status_t ia_graph_set_allocator(int device, ia_pool_id_t id, const ia_pool_allocator_t *allocator) {
  return allocator && allocator->alloc && allocator->free ? configure(device, id, set_allocator, allocator, true)
                                                          : IA_ERR_INVALID_ARGUMENT;
}
ia_status_t ia_graph_set_no_split(int device, ia_pool_id_t id) {
  bool on = true;
  return configure(device, id, set_no_split, &on, true);
}
ia_status_t ia_graph_set_use_on_oom(int device, ia_pool_id_t id, bool use_on_oom) {
  return configure(device, id, set_use_on_oom, &use_on_oom, false);
}

const ia_pool_allocator_t *_ia_graph_pool_options(const graph_pool_t *p, bool *no_split) {
  *no_split = p->no_split;
  return p->allocator.alloc ? &p->allocator : NULL;
}

void *_ia_graph_alloc_on_oom(int device, size_t size, ia_stream_t stream, int kind) {
  device_graphs_t *g = graphs_of(device);
  void *out = NULL;
  if (!g) return NULL;
  pthread_mutex_lock(&g->lock);
  for (graph_pool_t *p = g->pools; p && !out; p = p->next) {
    if (!p->use_on_oom || p->use_count <= 0) continue;
    for (size_t i = 0; i < p->n_streams && !out; i++)
      if (p->streams[i].stream == stream && p->streams[i].arenas[kind])
        ia_arena_alloc_cached(p->streams[i].arenas[kind], size, stream, &out);
  }
  pthread_mutex_unlock(&g->lock);
  return out;
}

/* Streams of the device capturing now, over all pools. */
static int captures(int device) {
  _ia_device_t *dev = _ia_device(device);
  return dev ? atomic_load(&dev->totals.captures) : 0;
}

void ia_graph_empty_cache(int device, ia_pool_id_t id) {
  device_graphs_t *g = graphs_of(device);
  if (!g || captures(device) > 0) return;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = find_pool(g, id);
  if (p) FOR_EACH_ARENA(p, k, a) ia_arena_release_cached(a);
  if (p) trim_released(g, p);
  pthread_mutex_unlock(&g->lock);
}

ia_arena_t *_ia_graph_arena(int device, ia_pool_id_t id, int kind, ia_stream_t stream, ia_status_t *st) {
  device_graphs_t *g = graphs_of(device);
  ia_arena_t *arena = NULL;
  *st = IA_ERR_INVALID_ARGUMENT;
  if (!g) return NULL;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = find_pool(g, id);
  pool_stream_t *ps = NULL;
  for (size_t i = 0; p && i < p->n_streams && !ps; i++)
    if (p->streams[i].stream == stream) ps = &p->streams[i];
  if (p && !ps) {
    if (p->n_streams == p->cap_streams) {
      size_t cap = p->cap_streams ? p->cap_streams * 2 : 2;
      pool_stream_t *grown = realloc(p->streams, cap * sizeof *grown);
      if (grown) {
        p->streams = grown;
        p->cap_streams = cap;
      }
    }
    if (p->n_streams < p->cap_streams) {
      ps = &p->streams[p->n_streams++];
      *ps = (pool_stream_t){.stream = stream};
    } else {
      *st = IA_ERR_NO_HOST_MEMORY;
    }
  }
  if (ps) {
    *st = IA_OK;
    if (!ps->arenas[kind]) *st = _ia_plugin_graph_arena(device, kind, stream, &p->owner, &ps->arenas[kind]);
    arena = ps->arenas[kind];
  }
  pthread_mutex_unlock(&g->lock);
  return *st == IA_OK ? arena : NULL;
}

void _ia_free_owned(ia_arena_t *arena, const _ia_owner_t *owner, void *ptr) {
  /* The owner lives in the graph pool, which may go once this block is free: read it first. */
  int device = owner->device;
  graph_pool_t *pool = owner->graph_pool;
  ia_status_t st = ia_arena_free(arena, ptr, IA_STREAM_NONE);
  /* A destructor cannot throw; a bad free here is PyTorch's bookkeeping gone wrong, so say so. */
  if (st != IA_OK) fprintf(stderr, "indexer-arena: free(%p) refused: %s\n", ptr, ia_status_str(st));
  if (st != IA_OK || !pool) return;
  device_graphs_t *g = graphs_of(device);
  pthread_mutex_lock(&g->lock);
  /* Another thread's free may have emptied the pool and removed it since this block's free, so
   * the pool is compared, not followed, until found among the device's pools. */
  graph_pool_t *p = g->pools;
  while (p && p != pool) p = p->next;
  if (p) trim_released(g, p);
  pthread_mutex_unlock(&g->lock);
}

void _ia_graph_flush_arenas(int device) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return;
  pthread_mutex_lock(&g->lock);
  trim_released(g, NULL);
  pthread_mutex_unlock(&g->lock);
}

/* ---- what the pool holds ---------------------------------------------------------------------- */

size_t ia_graph_blocks(int device, ia_pool_id_t id, ia_block_info_t *out, size_t cap) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return 0;
  size_t n = 0;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = find_pool(g, id);
  if (p) FOR_EACH_ARENA(p, k, a) {
    size_t count = ia_arena_blocks(a, NULL, 0);
    if (n + count <= cap) ia_arena_blocks(a, out + n, count);
    n += count;
  }
  pthread_mutex_unlock(&g->lock);
  return n;
}

ia_status_t ia_graph_restore(int device, ia_pool_id_t id, const ia_block_info_t *blocks, size_t n) {
  device_graphs_t *g = graphs_of(device);
  if (!g || captures(device) > 0) return IA_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&g->lock);
  graph_pool_t *p = find_pool(g, id);
  ia_status_t st = p ? IA_OK : IA_ERR_INVALID_ARGUMENT;
  /* Everything live in the pool is freed, then the checkpoint's live blocks are made again at
   * their addresses; the checkpoint's regions are all still held, since a pool in use gives
   * nothing back. */
  if (p) FOR_EACH_ARENA(p, k, a) {
    size_t count = ia_arena_blocks(a, NULL, 0);
    ia_block_info_t *live = calloc(count + 1, sizeof *live);
    if (!live) {
      st = IA_ERR_NO_HOST_MEMORY;
      continue;
    }
    count = ia_arena_blocks(a, live, count);
    for (size_t j = 0; j < count; j++)
      if (!live[j].is_free) ia_arena_free(a, (void *)live[j].address, IA_STREAM_NONE);
    free(live);
  }
  for (size_t j = 0; st == IA_OK && j < n; j++) {
    if (blocks[j].is_free) continue;
    const _ia_owner_t *owner = NULL;
    ia_arena_t *a = _ia_registry_find((void *)blocks[j].address, &owner);
    if (!a || owner->graph_pool != p) st = IA_ERR_FOREIGN_POINTER;
    else st = ia_arena_alloc_at(a, (void *)blocks[j].address,
                                blocks[j].requested ? blocks[j].requested : blocks[j].size, blocks[j].stream);
  }
  pthread_mutex_unlock(&g->lock);
  return st;
}

size_t ia_graph_pools(int device, ia_graph_pool_info_t *out, size_t cap) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return 0;
  size_t n = 0;
  pthread_mutex_lock(&g->lock);
  for (graph_pool_t *p = g->pools; p; p = p->next, n++) {
    if (n >= cap) continue;
    ia_graph_pool_info_t info = {.first = p->id.first, .second = p->id.second, .use_count = p->use_count,
                                 .allocating = p->allocating, .streams = (uint32_t)p->n_streams};
    FOR_EACH_ARENA(p, k, a) {
      ia_stats_t s;
      ia_arena_stats(a, &s);
      info.capacity += (uint64_t)s.capacity.current;
      info.in_use += (uint64_t)s.in_use.current;
      if (k == IA_POOL_WORKSPACE) info.workspace += (uint64_t)s.capacity.current;
    }
    out[n] = info;
  }
  pthread_mutex_unlock(&g->lock);
  return n;
}

/* ---- the workspace carve-out backend ---------------------------------------------------------- */

typedef struct {
  ia_backend_t base;
  ia_arena_t *parent;
  ia_stream_t stream;
  ia_backend_t *events;
} carve_backend_t;

static carve_backend_t *carve(ia_backend_t *b) { return (carve_backend_t *)b; }

/* Under the carve-out arena's lock (the graph lock when it is destroyed), these take the workspace
 * arena's: the one arena lock taken under another (Note [Device lifetime], csrc/torch/plugin.h). */
static ia_status_t carve_reserve(ia_backend_t *self, size_t size, void **out) {
  ia_status_t st = ia_arena_alloc(carve(self)->parent, size, carve(self)->stream, out);
  return st == IA_ERR_OUT_OF_MEMORY ? IA_ERR_BACKEND_OUT_OF_MEMORY : st;
}

static void carve_release(ia_backend_t *self, void *base, size_t size) {
  (void)size;
  ia_arena_free(carve(self)->parent, base, IA_STREAM_NONE);
}

static ia_backend_t *carve_events(ia_backend_t *self) { return carve(self)->events; }
IA_FORWARD_EVENTS(carve, carve_events)

static void carve_destroy(ia_backend_t *self) {
  ia_backend_destroy(carve(self)->events);
  free(self);
}

ia_status_t _ia_carve_backend_create(ia_arena_t *parent, ia_stream_t stream, ia_backend_t *events,
                                     ia_backend_t **out) {
  carve_backend_t *c = calloc(1, sizeof *c);
  if (!c) {
    ia_backend_destroy(events);
    return IA_ERR_NO_HOST_MEMORY;
  }
  c->base = (ia_backend_t){
      .name = "workspace carve-out",
      .natural_alignment = ia_arena_alignment(parent),
      .reserve = carve_reserve,
      .release = carve_release,
      IA_FORWARDED_EVENTS(carve, events),
      .destroy = carve_destroy,
  };
  c->parent = parent;
  c->stream = stream;
  c->events = events;
  *out = &c->base;
  return IA_OK;
}

void _ia_graph_each_arena(int device, void (*fn)(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *arena),
                          void *ctx) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return;
  pthread_mutex_lock(&g->lock);
  for (graph_pool_t *p = g->pools; p; p = p->next) FOR_EACH_ARENA(p, k, a) fn(ctx, p->id, k, a);
  pthread_mutex_unlock(&g->lock);
}

static void flush_one(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *arena) {
  (void)ctx, (void)id, (void)kind;
  _ia_arena_flush_events(arena);
}

void _ia_graph_pools_flush_events(int device) { _ia_graph_each_arena(device, flush_one, NULL); }

/* Adds what an arena of a graph pool of `kind` (small or large) counts to the device's
 * statistics, as sum_device (plugin.c) does for the general pools. */
static void add_kind(ia_stats_t *stats, int count, int kind, const ia_stats_t *s) {
  _ia_stats_add(&stats[IA_STAT_ALL], s);
  if (count == IA_STAT_KINDS) _ia_stats_add(&stats[kind], s);
}

void _ia_graph_add_stats(int device, ia_stats_t *stats, int count) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return;
  pthread_mutex_lock(&g->lock);
  for (int k = IA_POOL_SMALL; k <= IA_POOL_LARGE; k++) add_kind(stats, count, k, &g->retired[k]);
  for (graph_pool_t *p = g->pools; p; p = p->next) FOR_EACH_ARENA(p, k, a) {
    if (k == IA_POOL_WORKSPACE) continue; /* its bytes are the workspace arena's */
    ia_stats_t s;
    ia_arena_stats(a, &s);
    add_kind(stats, count, k, &s);
  }
  pthread_mutex_unlock(&g->lock);
}

void _ia_graph_reset_peaks(int device) {
  device_graphs_t *g = graphs_of(device);
  if (!g) return;
  pthread_mutex_lock(&g->lock);
  for (int k = 0; k < IA_POOL_COUNT; k++) {
#define RESET(name, torch, doc) g->retired[k].name.peak = 0; /* nothing of them is current */
    IA_STAT_QUADS(RESET)
#undef RESET
  }
  for (graph_pool_t *p = g->pools; p; p = p->next) FOR_EACH_ARENA(p, k, a) ia_arena_reset_peaks(a);
  pthread_mutex_unlock(&g->lock);
}
