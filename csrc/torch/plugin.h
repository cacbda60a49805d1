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

/* Between plugin.c and graphs.c. A graph pool's arenas are of the kinds a device's own are
 * (IA_POOL_*, allocator.h): small and large like the device's general pools, workspace carved
 * from the device's workspace arena on `stream`. */
ia_status_t _ia_plugin_graph_arena(int device, int kind, ia_stream_t stream, const _ia_owner_t *owner,
                                   ia_arena_t **out);
/* The trace tag (allocator.h) of a graph pool's arena of `kind`: the values trace files hold. */
_Static_assert((int)IA_TRACE_POOL_GRAPH >= (int)IA_POOL_COUNT, "a graph pool's trace tag is no device pool's");
static inline uint8_t _ia_graph_trace_tag(int kind) {
  return kind == IA_POOL_SMALL ? IA_TRACE_POOL_GRAPH_SMALL
         : kind == IA_POOL_LARGE ? IA_TRACE_POOL_GRAPH_LARGE
                                 : IA_TRACE_POOL_GRAPH_WORKSPACE;
}
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
/* A MemPool's allocator (NULL: none) and no_split, under the graph lock; an eager request that
 * failed, served from a free block of a use_on_oom MemPool's arena of `kind` (NULL: none). */
const ia_pool_allocator_t *_ia_graph_pool_options(const graph_pool_t *pool, bool *no_split);
void *_ia_graph_alloc_on_oom(int device, size_t size, ia_stream_t stream, int kind);
void _ia_graph_pools_flush_events(int device);
/* Calls fn for every arena of the device's graph pools (kind: IA_POOL_*), under the graph lock,
 * which keeps them alive. */
void _ia_graph_each_arena(int device, void (*fn)(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *arena),
                          void *ctx);
/* Adds the graph pools' arenas as sum_device (plugin.c) does: stats[IA_STAT_ALL], and with count
 * IA_STAT_KINDS stats[IA_POOL_SMALL] or stats[IA_POOL_LARGE] by the arena's kind. */
void _ia_graph_add_stats(int device, ia_stats_t *stats, int count);
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
 * Everything the plugin keeps per device is one record, _ia_device_t, in _ia_plugin.devices[d]
 * for every d from 0 to IA_MAX_DEVICES - 1: initialised statically (each of its locks with
 * PTHREAD_MUTEX_INITIALIZER), never freed, moved or cleared, so that the pointer _ia_device(d)
 * gives may be kept and followed by any thread, without a lock, for as long as the process runs.
 * Its parts have lifetimes of their own, and locks (below). Readers of a
 * device's memory (torch.cuda.memory_stats(), the memory snapshot, reset_peak_*, the
 * out-of-memory report, alloc.device_arena views) run on any thread, a serving engine's metrics
 * thread among them, at any moment, sleep mode included. What the record holds lives so:
 *
 *  1. A device's own arenas (workspace, small, large), once made, live as long as the process.
 *     ia_plugin_release() puts the workspace arena to sleep (ia_arena_sleep: its reservation goes
 *     back, the arena and its counters stay); the next reservation wakes the same arena. Nothing
 *     ever frees or replaces them, so a pointer read from the record stays valid without a lock,
 *     and a Python view of one never goes stale: after a release it shows an arena that holds
 *     nothing. The totals (device-wide sums over those arenas and the graph pools' small and
 *     large ones) and owner (what the region registry answers for those arenas) live as long;
 *     the totals' figures change under the totals lock, their limit and captures atomically.
 *  2. The graph pools (graphs.c, the record's `graphs`): a pool and its arenas are made and
 *     destroyed only under the graph lock, and every reader walks them under it
 *     (_ia_graph_each_arena). Before a pool's arenas are destroyed their history (sums, peaks,
 *     counters) is folded into graphs.retired, which the device's statistics add: cumulative
 *     counters never run backwards.
 *  3. The held frees (graph_frees.c, the record's `held`): frees held back while a stream of the
 *     device captures, and what the walks of the captures' graphs found, under the held-frees
 *     lock. A held free's arena is one of 1 or 2: its graph pool cannot go while the free is held,
 *     since a pool whose block is live gives nothing back. All run, and the walks are forgotten,
 *     once the device's last capture ends.
 *  4. ready and workspace_made publish what is set before them (the arenas, unified, expandable,
 *     owner): stored under the plugin's lock with release (create_device's sequentially
 *     consistent store is one) and read with acquire where no lock is taken (_ia_device_made,
 *     _ia_device_ready, ia_plugin_arena), so that on Arm a thread that sees 1 sees the arena too.
 *     The rest (fraction, accumulated_base, peers) is read and written under the plugin's lock.
 *
 * Lock order, for every lock of the core (csrc/) and the C++ allocator over it: a thread that
 * holds one of these takes only locks further down the list, never one above it.
 *
 *  1. ArenaAllocator::routes_mutex_ (torch_allocator.cpp): held around core->graph_begin, so
 *     above everything ia_graph_begin takes; the C core never takes it.
 *  2. The plugin's lock (_ia_plugin.lock, plugin.c): configuration, device creation, the workspace
 *     arena's reservation, sleep and wake, the memory fraction, accumulated_base and the traces.
 *     Under it: a device's graph lock (trace_every_arena walks the graph pools' arenas), arenas'
 *     locks (creation, wake, sleep, ia_arena_set_trace, peer access), traces' locks and the CUDA
 *     loaders' locks.
 *  3. A device's graph lock (devices[d].graphs.lock, graphs.c). Under it: arenas' locks (its
 *     pools' arenas; the device's workspace arena's when a carve-out arena is destroyed, which
 *     takes no lock of its own), the graph trace's lock (an arena is made), the registry's lock
 *     (ia_graph_restore's lookups, a destroyed arena's region hook), the CUDA loaders' locks (a new
 *     arena's backend), history.mu (the snapshot's add_segment, called through
 *     _ia_graph_each_arena) and a MemPool allocator's drop.
 *     A device's held-frees lock (devices[d].held.lock, graph_frees.c) stands beside the graph
 *     lock, never held with it either way: _ia_graph_defer_free takes the graph lock
 *     (_ia_graph_keep) before it, and every free it held runs (_ia_free_owned, which takes the
 *     graph lock and an arena's) after it is let go. Under it only the backends' capture queries
 *     run (cudaStreamGetCaptureInfo, cudaGraphNodeGetDependencies; in the test build the simulated
 *     capture's lock), no arena's lock.
 *  4. An arena's lock (arena.c). One arena's lock is taken under another's in one case alone: a
 *     graph pool's workspace carve-out arena, whose backend reserves and frees blocks of the
 *     device's workspace arena (graphs.c), takes the workspace arena's lock under its own; the
 *     workspace arena's backend calls into no arena, so the nesting is one deep and one way.
 *     Under an arena's lock: everything in 5, and a MemPool's own allocator (its alloc and free,
 *     PyTorch's code, for the pool's regions).
 *  5. Taken under an arena's lock (or higher), never two of them together except as said:
 *     - its device's totals lock (devices[d].totals.lock, internal.h): a few additions; takes nothing.
 *     - the registry's readers-writer lock (registry.c): written by the region hook, read by every
 *       free's lookup with no other lock held; takes nothing.
 *     - a trace's lock (trace.c): held while its sink runs, which takes history.mu
 *       (torch_allocator.cpp's on_event), and nothing of the core's.
 *     - a host backend's lock (backend_host.c; tests and host_memory): takes the simulated
 *       capture's lock (csrc/testing/host_capture.c, the test build alone), which takes nothing.
 *       The other backends (CUDA, mapping, guard, pool, carve-out) have no lock of their own: they
 *       are called under their arena's.
 *  6. Leaves, taking nothing: history.mu, the simulated capture's lock, the CUDA runtime's and
 *     driver's loader locks (backend_cuda.c, backend_vmm.c: both under the plugin's lock as a
 *     device is made, the runtime's under the graph lock too as a graph pool's arena gets its
 *     backend), and torch_allocator.cpp's profiled_mu (taken with no other lock held).
 *
 * Files that take these locks point here rather than repeat the order. */

/* A device's CUDA graph pools (graphs.c), under `lock`. */
typedef struct {
  pthread_mutex_t lock;
  graph_pool_t *pools;
  /* What the small and large arenas of pools that went left behind: their sums, peaks and
   * counters, nothing current (Note [Device lifetime], 2). [IA_POOL_WORKSPACE] stays empty: a
   * carve-out's bytes are the workspace arena's, which keeps them. */
  ia_stats_t retired[IA_POOL_COUNT];
} _ia_device_graphs_t;

/* Frees held back while a stream of the device captures (graph_frees.c, which defines the
 * entries), under `lock`. */
typedef struct _ia_held_free _ia_held_free_t;
typedef struct _ia_reach _ia_reach_t;
typedef struct {
  pthread_mutex_t lock;
  _ia_held_free_t *held;
  size_t n_held, cap_held;
  _ia_reach_t *reach; /* until the device's captures end */
  size_t n_reach, cap_reach;
} _ia_device_held_t;

/* Everything per device (Note [Device lifetime]). */
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
  _ia_device_graphs_t graphs;
  _ia_device_held_t held;
} _ia_device_t;

typedef struct {
  pthread_mutex_t lock; /* guards configuration and device creation */
  bool configured;
  ia_plugin_config_t config; /* its strings are plugin.c's own copies */
  /* The traces are made and read under the lock; arenas get them through ia_arena_set_trace,
   * under their own lock. A graph pool's arena made under the graph lock alone reads graph_trace
   * with acquire, which its release store pairs with: on Arm a thread could otherwise see the
   * pointer before the trace it points to is made. */
  ia_trace_t *trace;                /* the eager arenas': the ring (trace:N, alloc.trace) and the sink */
  ia_trace_t *_Atomic graph_trace; /* the graph pools' arenas': the sink alone, their events kept out of the ring */
  bool ring_sized;         /* trace's ring was made or resized with the capacity a start asked for */
  _ia_device_t devices[IA_MAX_DEVICES];
  _Atomic uint64_t ooms, retries; /* counts, relaxed enough */
} _ia_plugin_t;
extern _ia_plugin_t _ia_plugin;
/* Why the last device creation, reservation or routing of this thread failed (ia_plugin_failure). */
extern __thread char _ia_failure[1024];

/* The device's record, whether or not its arenas exist yet; NULL outside 0 to IA_MAX_DEVICES - 1. */
static inline _ia_device_t *_ia_device(int device) {
  return device >= 0 && device < IA_MAX_DEVICES ? &_ia_plugin.devices[device] : NULL;
}
/* plugin.c. The device's record with its arenas, made on first use (NULL, and *st, when that fails). */
_ia_device_t *_ia_device_made(int device, ia_status_t *st);
ia_status_t _ia_ensure_workspace(_ia_device_t *dev, int device);
bool _ia_device_ready(int device);
/* plugin_oom.c: each formats the message and raises it through the configuration's raise_oom. */
void _ia_raise_oom(const char *message);
void _ia_fail_alloc(int device, int pool, size_t size, ia_status_t st);
void _ia_fail_graph_alloc(int device, ia_pool_id_t id, int kind, size_t size, ia_status_t st);
void _ia_describe_pool_refusal(_ia_device_t *dev, int device, size_t size, void *stream);

#endif
