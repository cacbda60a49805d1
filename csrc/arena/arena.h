/* indexer-arena: the budget arena's interface (backends, arenas, statistics, traces).
 *
 * It stands alone: nothing here knows PyTorch. csrc/torch/allocator.h builds PyTorch's allocator
 * on it, and csrc/indexer_arena.h, the one header a user includes, holds both. The cffi builder
 * runs that header through the C preprocessor with IA_CDEF defined and hands the result to cffi,
 * so everything here must be plain declarations once preprocessed: no inline code, no system
 * headers in that mode.
 *
 * Naming: ia_* is public, _ia_* is shared between the core's files (internal.h and the private
 * headers of each folder), plain names are static to one file.
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
/* Device indices run from 0 to IA_MAX_DEVICES - 1 (a mapping backend grants at most this many). */
enum { IA_MAX_DEVICES = 64 };

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
 * free back during a CUDA graph capture (csrc/torch/graphs.c), where the block stays live here. */
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

#endif /* INDEXER_ARENA_H */
