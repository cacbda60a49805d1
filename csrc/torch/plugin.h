/* The PyTorch allocator's shared state and the calls between its files (csrc/torch/); not part of
 * the public interface. */
#ifndef INDEXER_ARENA_PLUGIN_H
#define INDEXER_ARENA_PLUGIN_H

#include "../arena/backend.h"
#include "../arena/internal.h"
#include "allocator.h"

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
void _ia_graph_pools_flush_events(int device);
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

/* Note [Device lifetime]
 * ~~~~~~~~~~~~~~~~~~~~~~
 * Readers of a device's memory (torch.cuda.memory_stats(), the memory snapshot, reset_peak_*,
 * the out-of-memory report, alloc.device_arena views) run on any thread, a serving engine's
 * metrics thread among them, at any moment, sleep mode included. So:
 *
 *  1. A device's own arenas (workspace, small, large), once made, live as long as the process.
 *     ia_plugin_release() puts the workspace arena to sleep (ia_arena_sleep: its reservation goes
 *     back, the arena and its counters stay); the next reservation wakes the same arena. Nothing
 *     ever frees or replaces them, so a pointer read from the slot stays valid without a lock,
 *     and a Python view of one never goes stale: after a release it shows an arena that holds
 *     nothing.
 *  2. A graph pool's arenas are made and destroyed only under the device's graph lock (graphs.c),
 *     and every reader walks them under that lock (_ia_graph_each_arena). Before a pool's arenas
 *     are destroyed their history (sums, peaks, counters) is folded into the device's retired
 *     record, which the device's statistics add: cumulative counters never run backwards.
 *  3. ready and workspace_made publish what is set before them (the arenas, unified, expandable,
 *     owner): stored under the plugin's lock with release (create_device's sequentially
 *     consistent store is one) and read with acquire where no lock is taken (_ia_device_slot,
 *     _ia_device_ready, ia_plugin_arena), so that on Arm a thread that sees 1 sees the arena too.
 *
 * Lock order, outermost first: the plugin's lock (configuration, device creation, sleep and
 * wake), a device's graph lock, an arena's lock, then its device's totals lock or the trace's.
 * The region registry's lock is taken under an arena's (its region hook) and takes none. */
typedef struct {
  _Atomic int ready;           /* 0: not yet, 1: general arenas exist, -1: creation failed */
  _Atomic int workspace_made;  /* 1: arenas[IA_POOL_WORKSPACE] exists (and always will) */
  _Atomic int workspace_ready; /* 1: it holds its reservation (0 after ia_plugin_release) */
  ia_arena_t *arenas[IA_POOL_COUNT];
  ia_totals_t totals;
  bool unified;
  bool expandable;      /* the general arenas map pages of one address range each, this big: */
  size_t address_range;
  uint64_t peers;       /* devices that asked to reach this one's memory (enablePeerAccess) */
  _ia_owner_t owner; /* what the region registry answers for this device's own arenas */
  _Atomic ia_stream_t pool_stream; /* workspace scope: the stream of the pool's first segment (a
                                    * value set once by compare-and-swap; it publishes nothing) */
  /* Under _ia_plugin.lock: torch.cuda.set_per_process_memory_fraction's last value (totals.limit
   * holds the bytes it allows) and whether one was set, and the accumulated counters as they
   * were at torch.cuda.reset_accumulated_memory_stats(), which PyTorch's figures start from. */
  double fraction;
  bool fraction_set;
  ia_torch_stats_t accumulated_base;
} _ia_device_slot_t;

typedef struct {
  pthread_mutex_t lock; /* guards configuration and device creation */
  bool configured;
  ia_plugin_config_t config; /* its strings are plugin.c's own copies */
  /* The traces are made and read under the lock; arenas get them through ia_arena_set_trace,
   * under their own lock. A graph pool's arena made under the graph pools' lock alone reads graph_trace
   * with acquire, which its release store pairs with: on Arm a thread could otherwise see the
   * pointer before the trace it points to is made. */
  ia_trace_t *trace;                /* the eager arenas': the ring (trace:N, alloc.trace) and the sink */
  ia_trace_t *_Atomic graph_trace; /* the graph pools' arenas': the sink alone, their events kept out of the ring */
  bool ring_sized;         /* trace's ring was made or resized with the capacity a start asked for */
  _ia_device_slot_t devices[IA_MAX_DEVICES];
  _Atomic uint64_t ooms, retries; /* counts, relaxed enough */
} _ia_plugin_t;
extern _ia_plugin_t _ia_plugin;
/* Why the last device creation, reservation or routing of this thread failed (ia_plugin_failure). */
extern __thread char _ia_failure[1024];

/* plugin.c. The device's slot, its arenas made on first use (NULL, and *st, when that fails). */
_ia_device_slot_t *_ia_device_slot(int device, ia_status_t *st);
ia_status_t _ia_ensure_workspace(_ia_device_slot_t *slot, int device);
bool _ia_device_ready(int device);
/* plugin_oom.c: each formats the message and raises it through the configuration's raise_oom. */
void _ia_raise_oom(const char *message);
void _ia_fail_alloc(int device, int pool, size_t size, ia_status_t st);
void _ia_fail_graph_alloc(int device, ia_pool_id_t id, int kind, size_t size, ia_status_t st);
void _ia_describe_pool_refusal(_ia_device_slot_t *slot, int device, size_t size, void *stream);

#endif
