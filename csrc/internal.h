/* Declarations shared between the core's files; not part of the public interface. */
#ifndef INDEXER_ARENA_INTERNAL_H
#define INDEXER_ARENA_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"

#define IA_EXPORT __attribute__((visibility("default")))
#define IA_STREAM_NONE ((ia_stream_t)UINTPTR_MAX)

/* IA_DEBUG=1 at build time (INDEXER_ARENA_DEBUG_BUILD=1 for the extension) walks the whole arena
 * after every allocation and free and stops at the first broken invariant (slow).
 * ia_assert stays on in every build: the checks it guards are cheap and a broken arena must stop. */
#define ia_assert(cond)                                                                             \
  do {                                                                                              \
    if (__builtin_expect(!(cond), 0)) _ia_assert_fail(#cond, __FILE__, __LINE__);                   \
  } while (0)
__attribute__((noreturn)) void _ia_assert_fail(const char *cond, const char *file, int line);

/* A backend is a table of operations and its own state after it. The arena only ever calls these;
 * a new backend slots in by filling the table. Events order one stream's past work before another
 * stream's future work; `event_done` never blocks. */
struct ia_backend {
  const char *name;
  size_t natural_alignment; /* what reserve() guarantees for its base address */
  ia_status_t (*reserve)(ia_backend_t *self, size_t size, void **out);
  void (*release)(ia_backend_t *self, void *base, size_t size);
  ia_status_t (*event_create)(ia_backend_t *self, void **event);
  void (*event_destroy)(ia_backend_t *self, void *event);
  ia_status_t (*event_record)(ia_backend_t *self, void *event, ia_stream_t stream);
  bool (*event_done)(ia_backend_t *self, void *event);
  ia_status_t (*stream_wait)(ia_backend_t *self, ia_stream_t stream, void *event);
  void (*destroy)(ia_backend_t *self);
  /* Optional: back every page of a reservation now (unified memory), so use never faults in more. */
  ia_status_t (*commit)(ia_backend_t *self, void *base, size_t size);
  /* Whether `stream` is capturing a CUDA graph now. A wait whose waiter captures and whose event
   * was recorded outside the capture is made on the host instead (a capture may not depend on
   * outside work), so stream_wait must handle that case; events are never recorded on a
   * capturing stream by the arena's callers. */
  bool (*stream_capturing)(ia_backend_t *self, ia_stream_t stream);
  /* Optional: blocks the host until the event has completed. An arena over a mapping backend
   * waits this way before it unmaps pages whose last stream work may still run; without it those
   * pages stay mapped until a later release finds the work done. */
  ia_status_t (*event_wait)(ia_backend_t *self, void *event);
  /* Optional, both or none: the graph a capture has built so far, for reusing inside a capture a
   * block other streams used once the graph orders them before the reuse. capture_frontier gives
   * the capture `stream` belongs to (0: none) and copies up to cap of the nodes its next work will
   * depend on into out, returning how many there are; node_parents likewise gives the nodes
   * `node` depends on. Nodes are the backend's handles, valid while their capture lasts. */
  size_t (*capture_frontier)(ia_backend_t *self, ia_stream_t stream, uint64_t *capture, const void **out,
                             size_t cap);
  size_t (*node_parents)(ia_backend_t *self, const void *node, const void **out, size_t cap);
  /* Optional, all or none: address space alone, and physical pages mapped into it (CUDA's
   * virtual memory management, or the host backend's simulation of it). page_size is the
   * granularity of map and unmap, a power of two (0: the backend does not map). A range from
   * address_reserve starts at a multiple of page_size and holds no memory until pages are mapped
   * into it. map and unmap take page-aligned stretches of one reserved range; map is only asked
   * for pages not mapped and unmap only for mapped ones, so a backend may keep one physical
   * allocation per page. address_free gets a whole range with nothing mapped in it. */
  size_t page_size;
  ia_status_t (*address_reserve)(ia_backend_t *self, size_t size, void **out);
  void (*address_free)(ia_backend_t *self, void *base, size_t size);
  ia_status_t (*map)(ia_backend_t *self, void *at, size_t size);
  void (*unmap)(ia_backend_t *self, void *at, size_t size);
  /* Optional, mapping backends: every page mapped now or later is readable and writable by device
   * `peer` too (a driver's mapping is reachable only from the devices granted it). */
  ia_status_t (*grant_access)(ia_backend_t *self, int peer);
};

/* A backend that wraps another hands it every event, stream and capture operation: defines
 * prefix_event_create ... prefix_node_parents, each calling the same operation of inner(self), and
 * IA_FORWARDED_EVENTS(prefix, inner) fills them into a table (the optional ones only where the
 * inner backend has them). */
#define IA_FORWARD_EVENTS(prefix, inner)                                                               \
  static ia_status_t prefix##_event_create(ia_backend_t *self, void **ev) {                           \
    return inner(self)->event_create(inner(self), ev);                                                 \
  }                                                                                                    \
  static void prefix##_event_destroy(ia_backend_t *self, void *ev) { inner(self)->event_destroy(inner(self), ev); } \
  static ia_status_t prefix##_event_record(ia_backend_t *self, void *ev, ia_stream_t s) {             \
    return inner(self)->event_record(inner(self), ev, s);                                              \
  }                                                                                                    \
  static bool prefix##_event_done(ia_backend_t *self, void *ev) { return inner(self)->event_done(inner(self), ev); } \
  static ia_status_t prefix##_stream_wait(ia_backend_t *self, ia_stream_t s, void *ev) {              \
    return inner(self)->stream_wait(inner(self), s, ev);                                               \
  }                                                                                                    \
  static bool prefix##_stream_capturing(ia_backend_t *self, ia_stream_t s) {                          \
    return inner(self)->stream_capturing(inner(self), s);                                              \
  }                                                                                                    \
  static ia_status_t prefix##_event_wait(ia_backend_t *self, void *ev) {                              \
    return inner(self)->event_wait(inner(self), ev);                                                   \
  }                                                                                                    \
  static size_t prefix##_capture_frontier(ia_backend_t *self, ia_stream_t s, uint64_t *capture,       \
                                          const void **out, size_t cap) {                              \
    return inner(self)->capture_frontier(inner(self), s, capture, out, cap);                           \
  }                                                                                                    \
  static size_t prefix##_node_parents(ia_backend_t *self, const void *node, const void **out, size_t cap) { \
    return inner(self)->node_parents(inner(self), node, out, cap);                                     \
  }
#define IA_FORWARDED_EVENTS(prefix, inner_backend)                                                     \
  .event_create = prefix##_event_create, .event_destroy = prefix##_event_destroy,                     \
  .event_record = prefix##_event_record, .event_done = prefix##_event_done,                           \
  .stream_wait = prefix##_stream_wait,                                                                 \
  .stream_capturing = (inner_backend)->stream_capturing ? prefix##_stream_capturing : NULL,           \
  .event_wait = (inner_backend)->event_wait ? prefix##_event_wait : NULL,                             \
  .capture_frontier = (inner_backend)->capture_frontier ? prefix##_capture_frontier : NULL,           \
  .node_parents = (inner_backend)->capture_frontier ? prefix##_node_parents : NULL

/* backend_cuda.c for backend_vmm.c: driver calls for a device run between enter and exit, with
 * the device current and this thread in relaxed capture mode, as the runtime backend's own calls
 * do. bind_context makes the runtime bind the device's context to the thread (cudaFree(NULL)), for
 * a thread that has none yet. _ia_cuda_error sets what ia_cuda_last_error() says. */
typedef struct {
  int previous, mode;
  bool switched;
} _ia_cuda_scope_t;
ia_status_t _ia_cuda_enter(_ia_cuda_scope_t *s, int device);
void _ia_cuda_exit(_ia_cuda_scope_t *s);
ia_status_t _ia_cuda_bind_context(void);
void _ia_cuda_error(const char *format, ...) __attribute__((format(printf, 1, 2)));

static inline size_t _ia_align_up(size_t n, size_t a) { return (n + a - 1) & ~(a - 1); }
static inline bool _ia_is_pow2(size_t n) { return n && !(n & (n - 1)); }

/* The one update of a statistic: n added (n < 0: taken away), the peak and the sums kept. */
static inline void _ia_stat_add(ia_stat_t *s, int64_t n) {
  s->current += n;
  if (n > 0) {
    s->allocated += n;
    if (s->current > s->peak) s->peak = s->current;
  } else {
    s->freed -= n;
  }
}

/* A quantity summed over one device's arenas, kept as they change so that the device-wide peak is
 * a true peak of the sum and not a sum of per-arena peaks (the sums of increases and decreases add
 * up exactly from the arenas' own). Under the group's lock. */
typedef struct {
  int64_t current, peak;
} _ia_total_t;

static inline void _ia_total_add(_ia_total_t *t, int64_t n) {
  t->current += n;
  if (t->current > t->peak) t->peak = t->current;
}

typedef struct ia_totals {
  /* Taken inside an arena's own lock, only for as long as the totals are read or updated. */
  pthread_mutex_t lock;
  _ia_total_t in_use, requested, blocks, capacity, regions;
  /* Growth of any arena of the group stops where capacity would pass this (0: no limit). Each
   * arena checks before it grows, under its own lock, so two arenas growing at once can pass it by
   * one region. Atomic: set by torch.cuda.set_per_process_memory_fraction outside every lock. */
  _Atomic uint64_t limit;
  /* Streams of the device capturing CUDA graphs now (begun and not ended allocate-to-pool scopes):
   * while any do, no arena watching it gives memory back. The frees it holds back pass under the
   * graph lock (graphs.c), so a free's relaxed look at it needs no stronger order on Arm. */
  _Atomic int captures;
} ia_totals_t;
/* Also watches the group's capture count (below). */
void _ia_arena_set_totals(ia_arena_t *arena, ia_totals_t *totals);
/* While *captures is above zero the arena gives nothing back to its backend (for an arena outside
 * any totals group: a graph's workspace carve-out, whose backend frees into the workspace arena
 * on the freeing stream, which a capture must not see either). */
void _ia_arena_watch_captures(ia_arena_t *arena, const _Atomic int *captures);
void _ia_totals_reset_peaks(ia_totals_t *totals);

/* Called under the arena's lock whenever it gains (added) or gives back a region. */
typedef void (*_ia_region_hook_t)(void *ctx, ia_arena_t *arena, uintptr_t base, size_t size, bool added);
/* Calls the hook at once for the regions already held. */
void _ia_arena_set_region_hook(ia_arena_t *arena, _ia_region_hook_t hook, void *ctx);
/* A live block's stream and the other streams recorded on it (*n_uses of them, the first cap copied
 * to uses); false when not live. */
bool _ia_arena_live_block(ia_arena_t *arena, const void *ptr, ia_stream_t *stream, ia_stream_t *uses, uint32_t cap,
                          uint32_t *n_uses);
/* Forgets the other streams recorded on a live block, so that its free orders nothing after them:
 * for a block whose capture's graph already orders their work before its next use. */
void _ia_arena_forget_uses(ia_arena_t *arena, const void *ptr);
/* The backend's capture_frontier and node_parents (capture 0 and no nodes without them). */
size_t _ia_arena_capture_frontier(ia_arena_t *arena, ia_stream_t stream, uint64_t *capture, const void **out,
                                  size_t cap);
size_t _ia_arena_node_parents(ia_arena_t *arena, const void *node, const void **out, size_t cap);

/* Who an arena serves: the device, and the CUDA graph pool when it is one of a pool's arenas. */
typedef struct graph_pool graph_pool_t;
typedef struct {
  int device;
  graph_pool_t *graph_pool;
} _ia_owner_t;

/* The region registry (registry.c). The hook is an _ia_region_hook_t whose ctx is the arena's
 * owner, which must outlive the arena's regions. */
void _ia_registry_hook(void *ctx, ia_arena_t *arena, uintptr_t base, size_t size, bool added);
ia_arena_t *_ia_registry_find(const void *ptr, const _ia_owner_t **owner);

/* Between plugin.c and graphs.c (IA_MAX_DEVICES: arena.h). */
enum { GRAPH_SMALL = 0, GRAPH_LARGE = 1, GRAPH_WORKSPACE = 2, GRAPH_KINDS = 3 };
ia_totals_t *_ia_plugin_totals(int device);
/* A new arena of a graph pool: small and large like the device's general pools; workspace carved
 * from the device's workspace arena on `stream`. */
ia_status_t _ia_plugin_graph_arena(int device, int kind, ia_stream_t stream, const _ia_owner_t *owner,
                                   ia_arena_t **out);
/* Records, on every stream with frees not yet behind an event, the event that orders them, in each
 * of the device's arenas: done when a capture is about to begin, so that no event need ever be
 * recorded on a stream while it captures. */
void _ia_plugin_flush_events(int device);
void _ia_arena_flush_events(ia_arena_t *arena);
bool _ia_arena_stream_capturing(ia_arena_t *arena, ia_stream_t stream);
/* A mapping arena's pages become reachable from device `peer` (IA_OK and nothing else otherwise). */
ia_status_t _ia_arena_grant_access(ia_arena_t *arena, int peer);
ia_arena_t *_ia_graph_arena(int device, ia_pool_id_t id, int kind, ia_stream_t stream, ia_status_t *st);
/* Every free while a pool allocates (graph_frees.c): keeps its graph pool; true when held for later. */
bool _ia_graph_defer_free(int device, ia_arena_t *arena, const _ia_owner_t *owner, void *ptr);
/* Before a graph pool's allocation on `stream` with record_stream_reuse on: frees the held blocks of
 * that stream whose last uses the capture's graph now orders before the stream's next work. */
void _ia_graph_reclaim(int device, ia_stream_t stream);
/* graph_frees.c, once the device's last capture ended: every held free runs. */
void _ia_graph_run_held(int device);
/* graphs.c: each pool allocating now keeps `owner` while it lives (a block of owner was freed). */
void _ia_graph_keep(int device, graph_pool_t *owner);
/* Frees a live block of `arena` on its own stream, saying on stderr when that is refused; a released
 * graph pool then gives back what came free. */
void _ia_free_owned(ia_arena_t *arena, const _ia_owner_t *owner, void *ptr);
void _ia_graph_flush_arenas(int device);
/* A MemPool's allocator (NULL: none) and no_split, under the graphs' lock; an eager request that
 * failed, served from a free block of a use_on_oom MemPool (NULL: none). */
const ia_pool_allocator_t *_ia_graph_pool_options(const graph_pool_t *pool, bool *no_split);
void *_ia_graph_alloc_on_oom(int device, size_t size, ia_stream_t stream, int kind);
/* ia_arena_alloc of a block of at least reserve bytes whose requested bytes stay size (PyTorch's
 * roundup_power2_divisions rounds the request up before the allocator sees it). */
ia_status_t _ia_arena_alloc_reserving(ia_arena_t *a, size_t size, size_t reserve, ia_stream_t stream, void **out);
void _ia_graph_pools_flush_events(int device);
void _ia_stats_add(ia_stats_t *sum, const ia_stats_t *s);
/* Calls fn for every arena of the device's graph pools, under the lock that keeps them alive. */
void _ia_graph_each_arena(int device, void (*fn)(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *arena),
                          void *ctx);
/* Adds the graph pools' arenas as sum_device (plugin.c) does: kinds[IA_KIND_ALL], and the small or
 * large one when count is IA_KIND_COUNT. */
void _ia_graph_add_stats(int device, ia_stats_t *kinds, int count);
/* reset_peak_memory_stats() for the graph pools: their arenas' and the retired record's peaks. */
void _ia_graph_reset_peaks(int device);
/* Backends whose reservations are blocks of `parent` taken on `stream`, or come from a MemPool's
 * allocator; events come from `events`, which each owns. */
ia_status_t _ia_pool_backend_create(const ia_pool_allocator_t *allocator, int device, ia_stream_t stream,
                                    ia_backend_t *events, ia_backend_t **out);
ia_status_t _ia_carve_backend_create(ia_arena_t *parent, ia_stream_t stream, ia_backend_t *events,
                                     ia_backend_t **out);

/* ---- Size classes, block headers and the table of live blocks -------------------------------- */

/* Size classes (TLSF's, Masmano et al. 2004): below 512 bytes one class per 16 bytes, above that
 * every power of two split 32 ways. */
#define IA_SL_BITS 5
#define IA_SL_COUNT (1u << IA_SL_BITS)
#define IA_ALIGN_SHIFT 4
#define IA_FL_SHIFT (IA_SL_BITS + IA_ALIGN_SHIFT)
#define IA_FL_COUNT (64 - IA_FL_SHIFT + 1)

static inline unsigned _ia_log2_floor(size_t n) { return 63u - (unsigned)__builtin_clzll(n); }

/* Below the first level's limit, f is taken as IA_FL_SHIFT, so that the second level is
 * size / IA_ALIGN and the first level comes out 0. */
static inline void _ia_class_of(size_t size, unsigned *fl, unsigned *sl) {
  unsigned f = _ia_log2_floor(size | ((size_t)1 << IA_FL_SHIFT));
  *sl = (unsigned)(size >> (f - IA_SL_BITS)) & (IA_SL_COUNT - 1);
  *fl = f - (IA_FL_SHIFT - 1) - (size < ((size_t)1 << IA_FL_SHIFT));
}

typedef struct _ia_region _ia_region_t;

/* One block of a region, kept in host memory (the region is usually device memory). */
typedef struct _ia_block {
  uintptr_t addr;
  size_t size;
  size_t requested;
  /* Free: its class list. Unused header: the slab's spare list. */
  struct _ia_block *free_prev, *free_next;
  ia_stream_t stream;
  uint32_t n_uses;
  uint8_t fl, sl;
  bool is_free; /* in one of the arena's classes */
  _ia_region_t *region;
  struct _ia_block *phys_prev, *phys_next;
  uint64_t free_seq;
  ia_stream_t *uses; /* other streams recorded with ia_arena_record_stream */
  uint32_t cap_uses;
} _ia_block_t;
_Static_assert(IA_FL_COUNT <= 256 && IA_SL_COUNT <= 256, "a block's classes fit in bytes");

/* Records b's size class in b (fl, sl), where the arena files it as free. */
static inline void _ia_file_class(_ia_block_t *b) {
  unsigned fl, sl;
  _ia_class_of(b->size, &fl, &sl);
  b->fl = (uint8_t)fl;
  b->sl = (uint8_t)sl;
}

/* Live blocks by address: open addressing, linear probing, backward-shift deletion. */
typedef struct {
  _ia_block_t **slots;
  size_t mask, count;
} _ia_table_t;

bool _ia_table_insert(_ia_table_t *t, _ia_block_t *b); /* false: no memory to grow it */
_ia_block_t *_ia_table_find(const _ia_table_t *t, uintptr_t addr);
void _ia_table_remove(_ia_table_t *t, _ia_block_t *b); /* b must be in it */

ia_status_t _ia_trace_resize(ia_trace_t *trace, size_t capacity);
void _ia_trace_record(ia_trace_t *trace, ia_trace_action_t action, int32_t device, uint8_t pool,
                      uintptr_t address, uint64_t size, ia_stream_t stream);

/* "1.50 MiB"-style rendering for messages; writes into buf and returns it. */
const char *_ia_format_bytes(uint64_t bytes, char *buf, size_t len);

/* ---- The arena's state and the calls between its files (arena*.c) -------------------------------
 * arena.c: size classes, allocation and free; arena_regions.c: reservations; arena_blocks.c: block
 * headers and the address table; arena_streams.c: stream-ordered reuse; arena_mapped.c: mapped
 * stretches; arena_stats.c: statistics and listings; arena_check.c: the invariant walk. Everything below runs under the arena's lock unless it says otherwise. */

#define IA_SLAB_BLOCKS 256
/* No reservation comes near this; above it the class arithmetic could overflow. */
#define IA_MAX_REQUEST ((size_t)1 << 62)

struct _ia_region {
  void *raw;
  size_t raw_size;
  uintptr_t base;
  size_t size;
  _ia_block_t *first;
  _ia_region_t *next;
};

typedef struct _ia_slab {
  struct _ia_slab *next;
  _ia_block_t blocks[IA_SLAB_BLOCKS];
} _ia_slab_t;

typedef struct {
  ia_stream_t stream;
  void *event;
  uint64_t recorded_seq; /* frees up to this sequence number are behind the recorded event */
} _ia_stream_state_t;

struct ia_arena {
  /* Set at creation, or when the arena joins a device's group, before other threads see it. */
  ia_arena_options_t opts;
  ia_backend_t *backend;
  ia_totals_t *totals;
  const _Atomic int *captures; /* the device's capture count, when it has one */
  _ia_region_hook_t on_region;
  void *on_region_ctx;
  /* Over a mapping backend: its page and the one address range (page 0: regions are reservations). */
  size_t page;
  uintptr_t range_base;
  size_t range_size;

  /* Guards everything below, and what the arena's backend does for it. */
  pthread_mutex_t lock;

  ia_trace_t *trace;
  uint64_t trace_tag; /* device << 8 | pool */

  _ia_region_t *regions; /* oldest first: a region's index in reports stays put as others come */

  uint64_t fl_bitmap;
  uint32_t sl_bitmap[IA_FL_COUNT];
  _ia_block_t *bins[IA_FL_COUNT][IA_SL_COUNT];

  _ia_table_t table; /* the live blocks */

  _ia_slab_t *slabs;
  _ia_block_t *spare_blocks;

  _ia_stream_state_t *streams;
  size_t n_streams, cap_streams;
  uint64_t free_seq;

  ia_stats_t stats;
};

static inline void _ia_arena_lock(ia_arena_t *a) { pthread_mutex_lock(&a->lock); }
static inline void _ia_arena_unlock(ia_arena_t *a) { pthread_mutex_unlock(&a->lock); }

static inline void _ia_arena_trace(ia_arena_t *a, ia_trace_action_t action, uintptr_t address, uint64_t size,
                                   ia_stream_t stream) {
  if (a->trace)
    _ia_trace_record(a->trace, action, (int32_t)(a->trace_tag >> 8), (uint8_t)a->trace_tag, address, size, stream);
}

/* Where the arena's quantities change, and its device's totals with them (arena_stats.c): a block
 * becoming live (sign 1) or no longer live (-1), capacity and regions gained or given back, and
 * free blocks of split regions. */
void _ia_count_live(ia_arena_t *a, int64_t sign, int64_t bytes, int64_t requested);
void _ia_count_capacity(ia_arena_t *a, int64_t bytes);
void _ia_count_regions(ia_arena_t *a, int64_t n);
/* What free block b adds to inactive_split: 1 and its bytes when its region is split (it is not the
 * whole region), else nothing; nothing in a mapping arena. */
static inline bool _ia_split_free(const ia_arena_t *a, const _ia_block_t *b) {
  return !a->page && b->size < b->region->size;
}
void _ia_count_split(ia_arena_t *a, int64_t blocks, int64_t bytes);

/* While a stream of the device captures a CUDA graph, nothing goes back to the backend: a free
 * synchronizes the device, which a capture forbids. */
static inline bool _ia_capturing(const ia_arena_t *a) { return a->captures && atomic_load(a->captures) > 0; }

/* arena.c */
void _ia_bin_insert(ia_arena_t *a, _ia_block_t *b);
void _ia_bin_remove(ia_arena_t *a, _ia_block_t *b);
_ia_block_t *_ia_find_free(ia_arena_t *a, size_t size);
void _ia_merge_into(ia_arena_t *a, _ia_block_t *left, _ia_block_t *right);
void _ia_make_free(ia_arena_t *a, _ia_block_t *b, ia_stream_t stream);
/* arena_regions.c */
_ia_region_t *_ia_region_of(const ia_arena_t *a, uintptr_t p);
ia_status_t _ia_region_add(ia_arena_t *a, size_t size);
void _ia_region_drop(ia_arena_t *a, _ia_region_t *r);
bool _ia_over_limit(const ia_arena_t *a, size_t want);
ia_status_t _ia_grow(ia_arena_t *a, size_t size);
uint64_t _ia_release_free_regions(ia_arena_t *a);
/* A fixed arena asleep (ia_arena_sleep) reserves its capacity again; IA_OK for any other arena. */
ia_status_t _ia_wake(ia_arena_t *a);
/* arena_blocks.c */
_ia_block_t *_ia_block_new(ia_arena_t *a);
void _ia_block_delete(ia_arena_t *a, _ia_block_t *b);
/* arena_streams.c */
_ia_stream_state_t *_ia_stream_state(ia_arena_t *a, ia_stream_t s, ia_status_t *st);
ia_status_t _ia_order_after(ia_arena_t *a, ia_stream_t waiter, ia_stream_t freed_on, uint64_t free_seq);
/* arena_mapped.c */
ia_status_t _ia_reserve_range(ia_arena_t *a);
ia_status_t _ia_grow_mapped(ia_arena_t *a, size_t size);
uint64_t _ia_release_mapped(ia_arena_t *a);
void _ia_unmap_all(ia_arena_t *a);
/* arena_check.c */
void _ia_arena_debug_check(ia_arena_t *a);
#if IA_DEBUG
#define IA_DEBUG_CHECK(a) _ia_arena_debug_check(a)
#else
#define IA_DEBUG_CHECK(a) ((void)0)
#endif

#endif
