/* indexer-arena: the one public header of the C core.
 *
 * The cffi builder runs this file through the C preprocessor with IA_CDEF defined and hands the
 * result to cffi, so everything here must be plain declarations once preprocessed: no inline code,
 * no system headers in that mode.
 *
 * Naming: ia_* is public (this header; what only the tests reach is in arena_testing.h), _ia_* is
 * shared between the core's files (internal.h), plain names are static to one file.
 */
#ifndef INDEXER_ARENA_H
#define INDEXER_ARENA_H

#ifndef IA_CDEF
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#endif

/* ------------------------------------------------------------------------------------------------
 * Results. Every fallible call returns one of these; ia_status_str() names it.
 * ---------------------------------------------------------------------------------------------- */
typedef enum ia_status {
  IA_OK = 0,
  IA_ERR_OUT_OF_MEMORY = 1,     /* no free block is large enough and the arena may not grow */
  IA_ERR_BACKEND_OUT_OF_MEMORY, /* the backend refused a reservation */
  IA_ERR_HOST_MEMORY_GUARD,     /* unified memory: the reservation would cross available host memory */
  IA_ERR_LIMIT,                 /* growth would cross the arena's configured limit */
  IA_ERR_DOUBLE_FREE,           /* pointer lies inside the arena but is not a live block */
  IA_ERR_FOREIGN_POINTER,       /* pointer lies outside every region of the arena */
  IA_ERR_INVALID_ARGUMENT,
  IA_ERR_BACKEND,               /* the backend failed for a reason other than memory */
  IA_ERR_NO_HOST_MEMORY         /* malloc of the arena's own bookkeeping failed */
} ia_status_t;

const char *ia_status_str(ia_status_t status);

/* A stream is whatever the backend says it is: cudaStream_t for CUDA, a small integer for the
 * host backend. IA_STREAM_NONE (all bits set) marks memory that no stream has touched yet. */
typedef uintptr_t ia_stream_t;

/* ------------------------------------------------------------------------------------------------
 * Backends: where reservations and stream events come from.
 * ---------------------------------------------------------------------------------------------- */
typedef struct ia_backend ia_backend_t;

void ia_backend_destroy(ia_backend_t *backend);

/* Host memory, for tests and for simulating a device on the CPU. limit_bytes caps the sum of live
 * reservations (0: no cap beyond what mmap grants). Streams are arbitrary integers; an event
 * recorded on a stream completes when ia_host_complete(stream) is called, or at once when
 * auto_complete is set (the default). */
ia_status_t ia_host_backend_create(size_t limit_bytes, ia_backend_t **out);
void ia_host_set_auto_complete(ia_backend_t *backend, bool on);
void ia_host_complete(ia_backend_t *backend, ia_stream_t stream);
uint64_t ia_host_waits(const ia_backend_t *backend, ia_stream_t waiter, ia_stream_t waited_on);

/* Page mapping, simulated: a host backend that also reserves address ranges with no memory behind
 * them (mmap PROT_NONE) and maps pages of page_size bytes into them (a power of two, a multiple of
 * the system page, at most 1 GiB): a mapped page is read-write and zero-filled, an unmapped one is
 * discarded and inaccessible again. limit_bytes caps the bytes mapped (and reserved the ordinary
 * way) at once, as a device's memory would (0: no cap). Its event waits complete the event. */
ia_status_t ia_host_mapping_backend_create(size_t limit_bytes, size_t page_size, ia_backend_t **out);

/* What a mapping backend did, for tests. */
typedef struct ia_mapping_counters {
  uint64_t page_size;
  uint64_t ranges;         /* address ranges reserved now */
  uint64_t range_reserves; /* address ranges reserved, ever */
  uint64_t maps, unmaps;   /* calls */
  uint64_t pages_mapped, pages_unmapped; /* pages, summed over those calls */
  uint64_t mapped, mapped_peak;          /* bytes mapped now; most at once */
  uint64_t refusals;       /* maps refused: the host backend's limit, the guard */
  uint64_t peers;          /* devices granted access to the pages, one bit each */
  uint64_t waits;          /* host backend: event waits that found the event not yet complete */
  uint64_t errors;         /* host backend: a map of a mapped page, an unmap of an unmapped one, a
                            * range freed with pages mapped, a stretch outside every range (an
                            * unmap while a stream captures counts as a capture violation) */
} ia_mapping_counters_t;

void ia_host_mapping_counters(const ia_backend_t *backend, ia_mapping_counters_t *out);
/* Whether every page that [at, at + size) touches is mapped now (false outside every range). */
bool ia_host_range_mapped(const ia_backend_t *backend, uintptr_t at, size_t size);

/* The CUDA runtime, loaded with dlopen at run time so that the core builds without CUDA.
 * cudart_path names the library to load (NULL: a libcudart already loaded in the process); the
 * first successful load stays for the life of the process. One backend per device: reservations
 * and events are made with that device current. ia_cuda_last_error() says what the last failing
 * runtime call of this thread was. */
ia_status_t ia_cuda_load(const char *cudart_path);
ia_status_t ia_cuda_backend_create(int device, const char *cudart_path, ia_backend_t **out);
ia_status_t ia_cuda_device_attribute(int device, int attribute, int *value);
ia_status_t ia_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes);
const char *ia_cuda_last_error(void);

/* The CUDA driver's virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap and
 * their inverses) from libcuda.so.1, loaded at run time as the runtime is: a mapping backend whose
 * pages are the driver's allocation granularity (2 MiB on current GPUs), one physical allocation
 * each, mapped read-write for the device. Events and ordinary reservations are the runtime
 * backend's of the same device. ia_vmm_supported: IA_OK when the driver loads and the device
 * reports virtual memory management, else why not in ia_cuda_last_error(). */
ia_status_t ia_vmm_supported(int device, const char *cudart_path);
ia_status_t ia_vmm_backend_create(int device, const char *cudart_path, ia_backend_t **out);

/* Unified memory: a backend wrapper that checks host memory before every reservation and commits
 * the pages of what it reserves. Available host memory is MemAvailable from a meminfo-format file,
 * bounded by the cgroup (v2 or v1) limit minus usage when one is set; `available_fn`, when given,
 * replaces all of that (tests). A reservation that would leave less than `headroom` available is
 * refused with IA_ERR_HOST_MEMORY_GUARD before the inner backend is asked. */
typedef struct ia_host_memory {
  uint64_t mem_available; /* MemAvailable, bytes */
  bool cgroup_limited;     /* a cgroup limit was found (memory.max other than "max"; 0 is a limit) */
  uint64_t cgroup_limit;  /* its bytes, when cgroup_limited */
  uint64_t cgroup_usage;
  uint64_t available;     /* what the guard counts on */
} ia_host_memory_t;

typedef struct ia_guard_options {
  const char *meminfo_path; /* NULL: /proc/meminfo */
  const char *cgroup_root;  /* NULL: /sys/fs/cgroup; "" : ignore cgroups */
  uint64_t headroom;
  uint64_t (*available_fn)(void *ctx);
  void *available_ctx;
} ia_guard_options_t;

/* The CUDA device attributes that describe how a device reaches memory, and the decision drawn
 * from them. */
typedef struct ia_memory_attributes {
  int integrated;                  /* cudaDevAttrIntegrated */
  int pageable_memory_access;      /* cudaDevAttrPageableMemoryAccess */
  int concurrent_managed_access;   /* cudaDevAttrConcurrentManagedAccess */
  int uses_host_page_tables;       /* cudaDevAttrPageableMemoryAccessUsesHostPageTables */
} ia_memory_attributes_t;

ia_status_t ia_cuda_memory_attributes(int device, ia_memory_attributes_t *out);
bool ia_memory_is_unified(const ia_memory_attributes_t *attributes);

ia_status_t ia_host_memory_read(const char *meminfo_path, const char *cgroup_root, ia_host_memory_t *out);
/* The guard takes the inner backend and destroys it with itself. */
ia_status_t ia_guard_backend_create(ia_backend_t *inner, const ia_guard_options_t *opts, ia_backend_t **out);
/* Over a mapping backend the guard checks host memory before every map instead (an address range
 * costs none) and commits what it maps; these count what went through it. */
void ia_guard_mapping_counters(const ia_backend_t *guard, ia_mapping_counters_t *out);
/* Why the last refusal or read failure of this thread happened. */
const char *ia_guard_last_message(void);

/* ------------------------------------------------------------------------------------------------
 * Statistics. A quantity that goes up and down is one ia_stat_t, as PyTorch's caching allocator and
 * mimalloc keep theirs: its value now, the most it has been since peaks were last reset, and the
 * sums of every increase and of every decrease (so current = allocated - freed).
 * ---------------------------------------------------------------------------------------------- */
typedef struct ia_stat {
  int64_t current, peak, allocated, freed;
} ia_stat_t;

/* The quantities: X(name, torch, description), `torch` being the family of keys PyTorch's
 * torch.cuda.memory_stats() gives the same meaning ("<torch>.<all|small_pool|large_pool>.<field>").
 * The arena never holds a freed block back (reuse by another stream waits on an event on the GPU,
 * not on the host), so its active blocks are its live ones; they differ where the plugin holds a
 * free back during a CUDA graph capture (csrc/graphs.c), where the block stays live here. */
#define IA_STAT_QUADS(X)                                                                            \
  X(in_use, allocated_bytes, "bytes in live blocks (each rounded up to the alignment)")            \
  X(requested, requested_bytes, "bytes asked for by live blocks, before rounding")                  \
  X(blocks, allocation, "live blocks")                                                              \
  X(active, active, "active blocks: live, or freed but not yet reusable (here: the live ones)")    \
  X(active_bytes, active_bytes, "bytes of active blocks")                                           \
  X(capacity, reserved_bytes, "bytes reserved from the backend (mapped, over a mapping backend)")  \
  X(regions, segment, "regions held: reservations, or the mapped stretches of the address range")  \
  X(inactive_split, inactive_split, "free blocks of regions that are split (not one whole free "   \
    "block); never counted over a mapping backend, as PyTorch counts none in expandable segments") \
  X(inactive_split_bytes, inactive_split_bytes, "bytes of those blocks")

/* The counters that only count or describe: X(type, name, description). */
#define IA_STAT_COUNTERS(X)                                                                        \
  X(uint64_t, requests_failed, "allocations refused")                                            \
  X(uint64_t, bad_frees, "frees refused: double frees and foreign pointers")                     \
  X(uint64_t, free_bytes, "bytes in free blocks")                                                \
  X(uint64_t, largest_free, "size of the largest free block")                                    \
  X(uint64_t, free_blocks, "number of free blocks")                                              \
  X(double, fragmentation, "1 - largest_free / free_bytes (0 when nothing is free)")            \
  X(uint64_t, backend_reserves, "reservations (or page mappings) asked of the backend")          \
  X(uint64_t, backend_releases, "reservations given back (or pages unmapped) to the backend")    \
  X(uint64_t, backend_failures, "reservations or mappings the backend or the guard refused")     \
  X(uint64_t, retries, "growths that released cached regions and asked again")                  \
  X(uint64_t, event_records, "stream events recorded to order cross-stream reuse")               \
  X(uint64_t, stream_waits, "streams made to wait on another stream's free")

#define IA_STAT_DECLARE_QUAD(name, torch, doc) ia_stat_t name;
#define IA_STAT_DECLARE(type, name, doc) type name;
/* Written flat (the JSON report, alloc.Arena.stats()): a quantity as `name` (its current value),
 * `name_peak`, `name_allocated` and `name_freed`. */
typedef struct ia_stats {
  IA_STAT_QUADS(IA_STAT_DECLARE_QUAD)
  IA_STAT_COUNTERS(IA_STAT_DECLARE)
} ia_stats_t;
#undef IA_STAT_DECLARE

/* A device's statistics in PyTorch's shape, what torch.cuda.memory_stats() reports in process
 * scope: one ia_stat_t per family and kind (IA_KIND_ALL: every arena of the device, graph pools
 * included; SMALL and LARGE: the general small or large pool with the graph pools' arenas of that
 * kind), the field named for PyTorch's family (IA_STAT_QUADS says which arena quantity it is). */
enum { IA_KIND_ALL = 0, IA_KIND_SMALL = 1, IA_KIND_LARGE = 2, IA_KIND_COUNT = 3 };
#define IA_TORCH_DECLARE(name, torch, doc) ia_stat_t torch[IA_KIND_COUNT];
typedef struct ia_torch_stats {
  IA_STAT_QUADS(IA_TORCH_DECLARE)
  int64_t num_alloc_retries; /* growths that released cached memory and asked again */
  int64_t num_ooms;          /* out-of-memory errors raised */
  int64_t num_device_alloc;  /* reservations and page mappings asked of the driver */
  int64_t num_device_free;   /* reservations and page mappings given back */
} ia_torch_stats_t;
#undef IA_TORCH_DECLARE
#undef IA_STAT_DECLARE_QUAD

/* ------------------------------------------------------------------------------------------------
 * The arena.
 * ---------------------------------------------------------------------------------------------- */
typedef struct ia_arena ia_arena_t;

typedef struct ia_arena_options {
  /* Fixed arena: the one reservation made at creation. Growable arena: 0, or a first region. */
  size_t capacity;
  /* Every block starts at a multiple of this and spans a multiple of it; a power of two >= 16.
   * Sizes (capacity, region_min, region_round) above 2**62 are refused, and region_min must be a
   * multiple of the alignment. */
  size_t alignment;
  /* Growable mode when true: a request no free block can serve reserves a new region of
   * max(region_min, round_up(size, region_round)), or round_up(size, region_round) for requests of
   * region_exact_above bytes and more. Fully free regions go back with ia_arena_release_cached. */
  bool growable;
  size_t region_min;
  size_t region_round;
  size_t region_exact_above;
  /* Growable mode: most bytes the regions may hold together (0: no limit). */
  size_t limit;
  /* Growable mode over a backend that maps pages: bytes of the one address range reserved at
   * creation, rounded up to the page (0: the arena reserves regions, as over any backend). Its
   * regions are then the range's mapped stretches, in address order: growth maps the pages a
   * request lacks, after free space where it can (region_min, region_round and
   * region_exact_above do not apply), and ia_arena_release_cached unmaps the whole pages of free
   * blocks. Capacity and limit count mapped bytes. The page must be a multiple of the alignment. */
  size_t address_range;
  /* Every block takes the free block it is served from whole, however much larger (PyTorch's
   * MemPool(no_split=True)); the default splits off the rest. */
  bool no_split;
} ia_arena_options_t;

typedef struct ia_block_info {
  uintptr_t address;
  uint64_t size;
  uint64_t requested; /* a free block: of the last allocation freed into it, as PyTorch's snapshot */
  uintptr_t region_base;
  uint32_t region;    /* index of the region in ia_arena_regions order (oldest first) */
  bool is_free;
  ia_stream_t stream; /* free: the stream it was freed on; live: the stream it was allocated on */
} ia_block_info_t;

typedef struct ia_region_info {
  uintptr_t base;
  uint64_t size;
} ia_region_info_t;

void ia_arena_default_options(ia_arena_options_t *opts);
/* The arena takes the backend and destroys it with itself. */
ia_status_t ia_arena_create(const ia_arena_options_t *opts, ia_backend_t *backend, ia_arena_t **out);
void ia_arena_destroy(ia_arena_t *arena);

/* size 0 yields NULL and IA_OK. Never returns memory outside the arena's regions. A stream with all
 * bits set (IA_STREAM_NONE, "no stream") is refused with IA_ERR_INVALID_ARGUMENT here, by
 * ia_arena_alloc_cached, ia_arena_alloc_at and ia_arena_record_stream; ia_arena_free takes it to
 * mean the block's own stream. */
ia_status_t ia_arena_alloc(ia_arena_t *arena, size_t size, ia_stream_t stream, void **out);
/* ia_arena_alloc from the free blocks the arena holds: it never grows. */
ia_status_t ia_arena_alloc_cached(ia_arena_t *arena, size_t size, ia_stream_t stream, void **out);
/* Makes [at, at + size) a live block when that range lies in one free block (checkpoints of CUDA
 * graph pools are restored this way); IA_ERR_OUT_OF_MEMORY when it does not. */
ia_status_t ia_arena_alloc_at(ia_arena_t *arena, void *at, size_t size, ia_stream_t stream);
/* stream all bits set (IA_STREAM_NONE): the stream the block was allocated on. */
ia_status_t ia_arena_free(ia_arena_t *arena, void *ptr, ia_stream_t stream);
/* The block at ptr is also used on `stream`: its free will order that stream's work before reuse. */
ia_status_t ia_arena_record_stream(ia_arena_t *arena, void *ptr, ia_stream_t stream);
/* Growable mode: gives fully free regions back to the backend, or, over a mapping backend, unmaps
 * the whole pages inside free blocks once no stream work can still touch them (waiting for it where
 * the backend can wait); nothing while a stream of the device captures. Returns the bytes. */
uint64_t ia_arena_release_cached(ia_arena_t *arena);
/* Fixed mode, an engine's sleep: gives the arena's reservation back while none of its blocks is
 * live and no stream of its device captures (IA_ERR_INVALID_ARGUMENT otherwise, and for a growable
 * arena). The arena stays valid, its statistics and history with it; ia_arena_wake, or the next
 * allocation that may grow, reserves the capacity again. */
ia_status_t ia_arena_sleep(ia_arena_t *arena);
ia_status_t ia_arena_wake(ia_arena_t *arena);
bool ia_arena_asleep(ia_arena_t *arena);

bool ia_arena_owns(ia_arena_t *arena, const void *ptr);
void ia_arena_stats(ia_arena_t *arena, ia_stats_t *out);
void ia_arena_reset_peaks(ia_arena_t *arena);
size_t ia_arena_alignment(const ia_arena_t *arena);
/* Copies up to `cap` entries in address order within each region; returns how many exist. */
size_t ia_arena_blocks(ia_arena_t *arena, ia_block_info_t *out, size_t cap);
size_t ia_arena_regions(ia_arena_t *arena, ia_region_info_t *out, size_t cap);
/* A mapping arena's page (0: an arena of reservations) and its one address range (false: none). */
size_t ia_arena_page_size(const ia_arena_t *arena);
bool ia_arena_address_range(const ia_arena_t *arena, ia_region_info_t *out);
/* Walks every region: blocks tile it exactly, no two neighbours are both free, the free bins and
 * the live-block table agree with the blocks, the counters agree with the walk.
 * Returns true when all hold; otherwise writes what broke into msg. */
bool ia_arena_check(ia_arena_t *arena, char *msg, size_t msg_len);

/* ------------------------------------------------------------------------------------------------
 * Tracing: a bounded ring of allocation events, shared by any number of arenas. When the ring is
 * full the oldest events are overwritten and counted as dropped. Recording takes the trace's own
 * lock (after the arena's); nothing on this path calls back into Python.
 * ---------------------------------------------------------------------------------------------- */
typedef enum ia_trace_action {
  IA_TRACE_ALLOC = 0,
  IA_TRACE_FREE = 1,
  IA_TRACE_FAIL = 2,     /* an allocation refused; size is the request */
  IA_TRACE_RESERVE = 3,  /* a region reserved from the backend; address is its base */
  IA_TRACE_RELEASE = 4   /* a region given back to the backend */
} ia_trace_action_t;

typedef struct ia_trace_event {
  uint64_t time_ns; /* CLOCK_REALTIME */
  uint64_t thread;  /* kernel thread id */
  uintptr_t address;
  uint64_t size;    /* bytes asked for (alloc, fail; free: those of the allocation, as PyTorch), region size */
  ia_stream_t stream;
  int32_t device;
  uint8_t action;   /* ia_trace_action_t */
  uint8_t pool;     /* the tag given to ia_arena_set_trace: which arena of the device */
} ia_trace_event_t;

typedef struct ia_trace ia_trace_t;

ia_status_t ia_trace_create(size_t capacity, ia_trace_t **out);
void ia_trace_destroy(ia_trace_t *trace);
void ia_trace_set_enabled(ia_trace_t *trace, bool on);
/* Every event recorded is also handed to `sink` (NULL: none), ring enabled or not, in the order
 * recorded, under the trace's lock and the arena's: a sink must not call into any arena. */
typedef void (*ia_trace_sink_t)(void *ctx, const ia_trace_event_t *event);
void ia_trace_set_sink(ia_trace_t *trace, ia_trace_sink_t sink, void *ctx);
/* Whether the ring is enabled or a sink is set. */
bool ia_trace_recording(ia_trace_t *trace);
size_t ia_trace_capacity(const ia_trace_t *trace);
/* Copies the held events oldest first (up to cap); returns how many are held. */
size_t ia_trace_read(ia_trace_t *trace, ia_trace_event_t *out, size_t cap, uint64_t *dropped);
void ia_trace_clear(ia_trace_t *trace);
/* Events of this arena go to `trace` (NULL: none), tagged with device and pool. */
void ia_arena_set_trace(ia_arena_t *arena, ia_trace_t *trace, int32_t device, uint8_t pool);

/* ------------------------------------------------------------------------------------------------
 * The PyTorch plugin: per-device arenas behind CUDAPluggableAllocator's entry points.
 * ---------------------------------------------------------------------------------------------- */
enum { IA_POOL_WORKSPACE = 0, IA_POOL_SMALL = 1, IA_POOL_LARGE = 2, IA_POOL_COUNT = 3 };
/* The plugin's trace tags a graph pool's arena IA_TRACE_POOL_GRAPH + 0 (small), + 1 (large) or
 * + 2 (its workspace carve-outs). */
enum { IA_TRACE_POOL_GRAPH = IA_POOL_COUNT };
/* Devices the plugin serves: indices 0 to IA_MAX_DEVICES - 1. General requests of up to
 * IA_SMALL_REQUEST bytes go to the small pool, larger ones to the large pool. */
enum { IA_MAX_DEVICES = 64, IA_SMALL_REQUEST = 1 << 20 };
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
  int32_t pool;        /* IA_POOL_*, or IA_TRACE_POOL_GRAPH + 0 (small) or + 1 (large) */
  bool expandable;     /* a mapped stretch of a page-mapping pool */
  ia_pool_id_t graph_pool; /* a graph pool's id, else 0, 0 */
} ia_segment_info_t;
/* Calls fn once per segment of the device with its blocks in address order, while their arena
 * lists them (fn must not call into the allocator). */
typedef void (*ia_segment_fn)(void *ctx, const ia_segment_info_t *segment, const ia_block_info_t *blocks,
                              size_t n_blocks);
void ia_plugin_segments(int device, ia_segment_fn fn, void *ctx);

/* What the process-scope allocator (csrc/torch_allocator.cpp, built against the installed torch)
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

#endif /* INDEXER_ARENA_H */
