/* indexer-arena: PyTorch's CUDA allocator over the budget arena (csrc/arena/arena.h): the plugin's
 * per-device arenas, CUDA graph pools, PyTorch's statistics and the entry points that
 * torch_allocator.cpp and torch.cuda.MemPool call. The same rules as arena.h: plain declarations
 * once preprocessed with IA_CDEF. */
#ifndef INDEXER_ARENA_ALLOCATOR_H
#define INDEXER_ARENA_ALLOCATOR_H

#ifndef IA_CDEF
#include "../arena/arena.h"
#endif

/* The kinds of arena: a device's pools, and a CUDA graph pool's arenas of each kind (the workspace
 * kind of a graph pool: its carve-outs of the device's workspace arena). */
enum { IA_POOL_WORKSPACE = 0, IA_POOL_SMALL = 1, IA_POOL_LARGE = 2, IA_POOL_COUNT = 3 };

/* A device's statistics in PyTorch's shape, what torch.cuda.memory_stats() reports in process
 * scope: one ia_stat_t per family and kind, the field named for PyTorch's family (IA_STAT_QUADS
 * says which arena quantity it is). The index is PyTorch's StatType: IA_STAT_ALL (its AGGREGATE,
 * 0) counts every arena of the device, graph pools included; IA_POOL_SMALL and IA_POOL_LARGE (its
 * SMALL_POOL, 1, and LARGE_POOL, 2) the general small or large pool with the graph pools' arenas
 * of that kind. The workspace pool has no entry of its own (PyTorch has no such StatType): it
 * counts in the aggregate alone, whose index 0 IA_POOL_WORKSPACE shares. */
enum { IA_STAT_ALL = 0, IA_STAT_KINDS = 3 };
#define IA_TORCH_DECLARE(name, torch, doc) ia_stat_t torch[IA_STAT_KINDS];
typedef struct ia_torch_stats {
  IA_STAT_QUADS(IA_TORCH_DECLARE)
  int64_t num_alloc_retries; /* growths that released cached memory and asked again */
  int64_t num_ooms;          /* out-of-memory errors raised */
  int64_t num_device_alloc;  /* reservations and page mappings asked of the driver */
  int64_t num_device_free;   /* reservations and page mappings given back */
} ia_torch_stats_t;
#undef IA_TORCH_DECLARE

/* ------------------------------------------------------------------------------------------------
 * The PyTorch plugin: per-device arenas behind CUDAPluggableAllocator's entry points.
 * ---------------------------------------------------------------------------------------------- */
/* The pool an arena's trace events carry (ia_trace_event_t.pool; ia_segment_info_t.pool too): a
 * device's own arena its IA_POOL_*, a graph pool's arena IA_TRACE_POOL_GRAPH or above by its kind.
 * Trace files and reports keep these numbers, so they stay as they are whatever the kinds' order. */
enum {
  IA_TRACE_POOL_GRAPH = 3, /* the first graph pool's tag: every tag from here on is a graph pool's */
  IA_TRACE_POOL_GRAPH_SMALL = 3,
  IA_TRACE_POOL_GRAPH_LARGE = 4,
  IA_TRACE_POOL_GRAPH_WORKSPACE = 5, /* its workspace carve-outs */
};
/* Devices the plugin serves: indices 0 to IA_MAX_DEVICES - 1 (arena.h). General requests of up to
 * IA_SMALL_REQUEST bytes go to the small pool, larger ones to the large pool. */
enum { IA_SMALL_REQUEST = 1 << 20 };
/* The pool's name as traces and reports write it ("workspace", "small", "large"); NULL for a
 * pool outside 0 to IA_POOL_COUNT - 1. */
const char *ia_plugin_pool_name(int pool);
/* The options a device's arena of `pool` is created with under the current configuration (the
 * workspace arena's capacity and alignment come from it; 0 before ia_plugin_configure).
 * IA_ERR_INVALID_ARGUMENT for an unknown pool. */
ia_status_t ia_plugin_pool_options(int pool, ia_arena_options_t *out);

/* How the plugin serves PyTorch. Process scope: ia_torch_alloc/free are the process's CUDA
 * allocator (change_current_allocator) and every pool exists. Workspace scope: PyTorch's own
 * allocator stays, and ia_pool_alloc/free back one torch.cuda.MemPool per device with the
 * workspace arena alone; the general pools are never made. */
enum { IA_SCOPE_PROCESS = 0, IA_SCOPE_WORKSPACE = 1 };

typedef struct ia_plugin_config {
  int scope;                  /* IA_SCOPE_PROCESS or IA_SCOPE_WORKSPACE */
  size_t budget;              /* bytes of each device's workspace arena */
  size_t alignment;           /* of workspace blocks */
  const char *cudart_path;    /* the CUDA runtime PyTorch loaded */
  int unified;                /* -1: from the device's attributes, 0: off, 1: on */
  uint64_t host_headroom;     /* unified memory: host bytes kept free */
  const char *meminfo_path;   /* NULL: /proc/meminfo */
  const char *cgroup_root;    /* NULL: /sys/fs/cgroup */
  const char *oom_report_path;/* NULL: none; else written on every out-of-memory */
  void (*raise_oom)(const char *message); /* throws c10::OutOfMemoryError; never returns */
  int host_memory;            /* tests: arenas reserve host memory (the host backend), no CUDA */
  /* The general pools: -1 (auto): each over one address range whose pages are mapped as blocks
   * need them (CUDA's virtual memory management) where the driver supports it, else regions;
   * 0: regions (one cudaMalloc each); 1: mapped, or the device's creation fails saying why.
   * With host_memory, mapped means the host backend's simulation (-1 and 1 alike). */
  int expandable;
  size_t address_range;       /* mapped pools: bytes of each range (0: the device's memory; host: 8 GiB) */
  size_t host_page_size;      /* host_memory: the simulated page (0: 2 MiB) */
} ia_plugin_config_t;

/* Refused (IA_ERR_INVALID_ARGUMENT) once any device has its arenas. */
ia_status_t ia_plugin_configure(const ia_plugin_config_t *config);
/* Creates the device's arenas now (they are otherwise created at its first allocation). */
ia_status_t ia_plugin_reserve(int device);
const char *ia_plugin_failure(void);
/* Gives the device's workspace arena's memory back (the arena sleeps, and takes its budget again at
 * the next reservation or workspace); refused (IA_ERR_INVALID_ARGUMENT, ia_plugin_failure says why)
 * while any of its blocks is live or a stream of the device captures. */
ia_status_t ia_plugin_release(int device);
/* NULL until the device has the pool's arena; once made it stays (a released workspace arena holds
 * nothing until it is reserved again). */
ia_arena_t *ia_plugin_arena(int device, int pool);
bool ia_plugin_workspace_reserved(int device); /* the workspace arena holds its budget now */
bool ia_plugin_device_unified(int device);
/* Whether the device's general pools map pages of one address range (false before its first use). */
bool ia_plugin_device_expandable(int device);
/* Device-wide quantities over its pools, graph pools included, workspace carve-outs counted
 * once (in the workspace arena); every field, peaks included, is exact for the sum. */
typedef struct ia_device_totals {
  ia_stat_t in_use, requested, blocks, capacity, regions;
} ia_device_totals_t;
ia_device_totals_t ia_plugin_device_totals(int device);
/* Every arena's statistics summed over the device (the quantities' peaks are those of
 * ia_plugin_device_totals where it keeps them, else the sum of the arenas' peaks, an upper bound). */
void ia_plugin_device_stats(int device, ia_stats_t *out);
void ia_plugin_torch_stats(int device, ia_torch_stats_t *out);
void ia_plugin_reset_peaks(int device);
/* torch.cuda.reset_accumulated_memory_stats(): ia_plugin_torch_stats's allocated and freed sums and
 * its counters count from now (currents and peaks are untouched), as PyTorch's do. */
void ia_plugin_reset_accumulated(int device);
uint64_t ia_plugin_ooms(void);
uint64_t ia_plugin_retries(void);
ia_status_t ia_plugin_trace_start(size_t capacity);
/* Every event of every arena of the plugin, graph pools' included, also goes to `sink` (NULL:
 * stop); the ring, if ia_plugin_trace_start made one, records as before. */
ia_status_t ia_plugin_trace_sink(ia_trace_sink_t sink, void *ctx);
ia_trace_t *ia_plugin_trace(void);
bool ia_plugin_write_report(const char *path);


/* Workspace scope: the MemPool's one large segment, the budget rounded up the way PyTorch rounds
 * a segment (2 MiB steps, 20 MiB at least). The arena holds it and one small-block segment
 * (2 MiB) for requests of 1 MiB or less, in one reservation. */
size_t ia_plugin_pool_segment(void);
/* Segment requests of the calling thread that the workspace pool refused. */
uint64_t ia_plugin_pool_refusals(void);

/* The workspace scope of the calling thread: allocations inside go to the workspace arena. */
void ia_workspace_enter(void);
bool ia_workspace_exit(void); /* false when the thread is in no scope */
int ia_workspace_depth(void);

/* ---- CUDA graph pools ----------------------------------------------------------------------
 * PyTorch's MempoolId_t. Between ia_graph_begin and ia_graph_end the allocations PyTorch routes
 * to the pool (ia_torch_alloc with graph_pool set) come from the pool's own arenas; a pool lives
 * while its use count is above zero (begin and incref count up, release down) and then gives its
 * memory back as its blocks come free. While any begin of the device is not yet ended, nothing
 * of the device goes back to the driver, and frees that would need an event on a capturing
 * stream wait for the end (graphs.c). Each call returns IA_ERR_INVALID_ARGUMENT for an unknown
 * pool, an end without a begin or a release below zero. */
typedef struct ia_pool_id {
  uint64_t first, second;
} ia_pool_id_t;

typedef struct ia_graph_pool_info {
  uint64_t first, second;
  int32_t use_count;
  int32_t allocating;  /* begun and not ended */
  uint32_t streams;    /* streams that allocated in it */
  uint64_t capacity;   /* bytes its arenas hold, workspace carve-outs included */
  uint64_t in_use;
  uint64_t workspace;  /* bytes of the device's workspace arena it holds */
} ia_graph_pool_info_t;

ia_status_t ia_graph_begin(int device, ia_pool_id_t id);
ia_status_t ia_graph_end(int device, ia_pool_id_t id);
ia_status_t ia_graph_incref(int device, ia_pool_id_t id);
ia_status_t ia_graph_release(int device, ia_pool_id_t id);
int ia_graph_use_count(int device, ia_pool_id_t id); /* 0 for an unknown pool */
/* Every block of the pool's arenas, live and free (how many exist is returned; none is copied
 * when they do not all fit). */
size_t ia_graph_blocks(int device, ia_pool_id_t id, ia_block_info_t *out, size_t cap);
/* Frees every live block of the pool and makes the live blocks of `blocks` (an earlier
 * ia_graph_blocks) live again at their addresses: CUDA graph trees' checkpoints. */
ia_status_t ia_graph_restore(int device, ia_pool_id_t id, const ia_block_info_t *blocks, size_t n);
size_t ia_graph_pools(int device, ia_graph_pool_info_t *out, size_t cap);

/* A torch.cuda.MemPool's own allocator (vLLM's sleep mode, NCCL's symmetric memory): the pool's
 * regions are reserved with alloc (NULL: out of memory) and given back with free, as PyTorch's
 * allocator asks such a pool's allocator for its segments. drop(ctx), if set, once the pool is
 * gone and holds nothing. Set before the pool first allocates. */
typedef struct ia_pool_allocator {
  void *(*alloc)(void *ctx, size_t size, int device, void *stream);
  void (*free)(void *ctx, void *ptr, size_t size, int device, void *stream);
  void (*drop)(void *ctx);
  void *ctx;
} ia_pool_allocator_t;
ia_status_t ia_graph_set_allocator(int device, ia_pool_id_t id, const ia_pool_allocator_t *allocator);
/* MemPool.empty_cache(), and a MemPool's end: the pool's fully free regions go back (its own
 * allocator's, to it); nothing while a stream of the device captures. */
void ia_graph_empty_cache(int device, ia_pool_id_t id);
/* PyTorch's graph_capture_record_stream_reuse (off by default): a graph pool's block freed inside a
 * capture while other streams were recorded on it is reused on its own stream as soon as the
 * capture's graph orders their work before that stream's next work, not at the capture's end. */
void ia_graph_set_record_stream_reuse(bool on);
/* MemPool(no_split=True), set before the pool first allocates: its arenas split no block. */
ia_status_t ia_graph_set_no_split(int device, ia_pool_id_t id);
/* MemPool(use_on_oom=True): an eager request the general pools cannot serve takes a free block of
 * the pool's arena of the same stream, if one fits, instead of failing (while the pool is held). */
ia_status_t ia_graph_set_use_on_oom(int device, ia_pool_id_t id, bool use_on_oom);

/* A segment of a device's memory as PyTorch's memory snapshot lists one: a region of one of its
 * arenas (the workspace arena, a general pool, or a graph pool's small or large arena). */
typedef struct ia_segment_info {
  uintptr_t address;
  uint64_t size;
  ia_stream_t stream;  /* its first block's */
  int32_t pool;        /* IA_POOL_*, or IA_TRACE_POOL_GRAPH_SMALL or _LARGE (trace tags, above) */
  bool expandable;     /* a mapped stretch of a page-mapping pool */
  ia_pool_id_t graph_pool; /* a graph pool's id, else 0, 0 */
} ia_segment_info_t;
/* Calls fn once per segment of the device with its blocks in address order, while their arena
 * lists them (fn must not call into the allocator). */
typedef void (*ia_segment_fn)(void *ctx, const ia_segment_info_t *segment, const ia_block_info_t *blocks,
                              size_t n_blocks);
void ia_plugin_segments(int device, ia_segment_fn fn, void *ctx);

/* What the process-scope allocator (csrc/torch/torch_allocator.cpp, built against the installed torch)
 * calls. A failed allocation never returns: it raises through raise_oom. Streams are
 * cudaStream_t. graph_pool NULL: an eager allocation. A free finds its arena by address. */
void *ia_torch_alloc(size_t size, int device, void *stream, const ia_pool_id_t *graph_pool);
/* ia_torch_alloc of a block of at least reserve bytes (PyTorch's roundup_power2_divisions) whose
 * requested bytes stay size. */
void *ia_torch_alloc_rounded(size_t size, size_t reserve, int device, void *stream, const ia_pool_id_t *graph_pool);
void ia_torch_free(void *ptr);
void ia_torch_record_stream(void *ptr, void *stream);
void ia_torch_empty_cache(void);
void ia_torch_memory_fraction(double fraction, int device);
double ia_torch_get_memory_fraction(int device); /* the last fraction set, 1.0 before any */
/* torch's enablePeerAccess(dev, dev_to_access): the pages of dev_to_access's mapped general pools,
 * mapped now or later, become reachable from dev (regions need nothing: cudaDeviceEnablePeerAccess
 * covers them). Remembered for a device whose pools do not exist yet. */
ia_status_t ia_torch_enable_peer_access(int dev, int dev_to_access);
/* All of the above that the process-scope allocator calls, in one table: it is a separate library
 * built against the installed torch, and the core exports nothing it does not have to. */
typedef struct ia_torch_entry_points {
  void *(*alloc)(size_t size, size_t reserve, int device, void *stream, const ia_pool_id_t *graph_pool);
  void (*free)(void *ptr);
  void (*record_stream)(void *ptr, void *stream);
  void (*empty_cache)(void);
  void (*memory_fraction)(double fraction, int device);
  double (*get_memory_fraction)(int device);
  void (*reset_accumulated)(int device);
  void (*segments)(int device, ia_segment_fn fn, void *ctx);
  ia_status_t (*trace_sink)(ia_trace_sink_t sink, void *ctx);
  bool (*device_expandable)(int device);
  ia_status_t (*graph_set_allocator)(int device, ia_pool_id_t id, const ia_pool_allocator_t *allocator);
  ia_status_t (*graph_set_no_split)(int device, ia_pool_id_t id);
  ia_status_t (*graph_set_use_on_oom)(int device, ia_pool_id_t id, bool use_on_oom);
  void (*graph_set_record_stream_reuse)(bool on);
  void (*graph_empty_cache)(int device, ia_pool_id_t id);
  ia_status_t (*graph_begin)(int device, ia_pool_id_t id);
  ia_status_t (*graph_end)(int device, ia_pool_id_t id);
  ia_status_t (*graph_incref)(int device, ia_pool_id_t id);
  ia_status_t (*graph_release)(int device, ia_pool_id_t id);
  int (*graph_use_count)(int device, ia_pool_id_t id);
  size_t (*graph_blocks)(int device, ia_pool_id_t id, ia_block_info_t *out, size_t cap);
  ia_status_t (*graph_restore)(int device, ia_pool_id_t id, const ia_block_info_t *blocks, size_t n);
  void (*device_stats)(int device, ia_stats_t *out); /* summed over the device's arenas */
  void (*torch_stats)(int device, ia_torch_stats_t *out);
  void (*reset_peaks)(int device);
  uint64_t (*ooms)(void);
  uint64_t (*retries)(void);
  const char *(*status_str)(ia_status_t status);
  ia_status_t (*enable_peer_access)(int dev, int dev_to_access);
} ia_torch_entry_points_t;
const ia_torch_entry_points_t *ia_torch_entry_points(void);

/* What a torch.cuda.MemPool calls in workspace scope (exported): PyTorch's caching layer asks for
 * segments, which come from the device's workspace arena. A refusal raises through raise_oom
 * (PyTorch's retry could not help: it never releases a live pool's segments), or returns NULL
 * without a hook, which PyTorch turns into its own out-of-memory error. */
void *ia_pool_alloc(ssize_t size, int device, void *stream);
void ia_pool_free(void *ptr, ssize_t size, int device, void *stream);

#endif /* INDEXER_ARENA_ALLOCATOR_H */
