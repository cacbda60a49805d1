/* indexer-arena: the one public header of the C core.
 *
 * The cffi builder runs this file through the C preprocessor with IA_CDEF defined and hands the
 * result to cffi, so everything here must be plain declarations once preprocessed: no inline code,
 * no system headers in that mode.
 *
 * Naming: ia_* is public (this header), _ia_* is shared between the core's files (internal.h),
 * plain names are static to one file.
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
const char *ia_backend_name(const ia_backend_t *backend);

/* Host memory, for tests and for simulating a device on the CPU. limit_bytes caps the sum of live
 * reservations (0: no cap beyond what mmap grants). Streams are arbitrary integers; an event
 * recorded on a stream completes when ia_host_complete(stream) is called, or at once when
 * auto_complete is set (the default). */
ia_status_t ia_host_backend_create(size_t limit_bytes, ia_backend_t **out);
void ia_host_set_auto_complete(ia_backend_t *backend, bool on);
void ia_host_complete(ia_backend_t *backend, ia_stream_t stream);
uint64_t ia_host_waits(const ia_backend_t *backend, ia_stream_t waiter, ia_stream_t waited_on);

/* The CUDA runtime, loaded with dlopen at run time so that the core builds without CUDA.
 * cudart_path names the library to load (NULL: a libcudart already loaded in the process); the
 * first successful load stays for the life of the process. One backend per device: reservations
 * and events are made with that device current. ia_cuda_last_error() says what the last failing
 * runtime call of this thread was. */
ia_status_t ia_cuda_load(const char *cudart_path);
ia_status_t ia_cuda_backend_create(int device, const char *cudart_path, ia_backend_t **out);
ia_status_t ia_cuda_device_count(int *count);
ia_status_t ia_cuda_device_attribute(int device, int attribute, int *value);
ia_status_t ia_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes);
const char *ia_cuda_last_error(void);

/* ------------------------------------------------------------------------------------------------
 * Statistics: one declaration per field. X(type, name, description)
 * ---------------------------------------------------------------------------------------------- */
#define IA_STAT_FIELDS(X)                                                                          \
  X(uint64_t, capacity, "bytes reserved from the backend and held now")                          \
  X(uint64_t, capacity_peak, "most bytes reserved at once")                                      \
  X(uint64_t, regions, "reservations held now")                                                  \
  X(uint64_t, in_use, "bytes handed out in live blocks (rounded to the alignment)")              \
  X(uint64_t, in_use_peak, "most bytes handed out at once")                                      \
  X(uint64_t, requested, "bytes asked for by live blocks, before rounding")                      \
  X(uint64_t, blocks_in_use, "live blocks")                                                      \
  X(uint64_t, requests_served, "successful allocations")                                         \
  X(uint64_t, requests_failed, "allocations refused")                                            \
  X(uint64_t, frees, "successful frees")                                                         \
  X(uint64_t, bad_frees, "frees refused: double frees and foreign pointers")                     \
  X(uint64_t, allocated_total, "bytes handed out, summed over all allocations")                  \
  X(uint64_t, freed_total, "bytes returned, summed over all frees")                              \
  X(uint64_t, free_bytes, "bytes in free blocks")                                                \
  X(uint64_t, largest_free, "size of the largest free block")                                    \
  X(uint64_t, free_blocks, "number of free blocks")                                              \
  X(double, fragmentation, "1 - largest_free / free_bytes (0 when nothing is free)")            \
  X(uint64_t, backend_reserves, "reservations asked of the backend")                             \
  X(uint64_t, backend_releases, "reservations given back to the backend")                        \
  X(uint64_t, backend_failures, "reservations the backend or the host-memory guard refused")     \
  X(uint64_t, retries, "growths that released cached regions and asked again")                  \
  X(uint64_t, event_records, "stream events recorded to order cross-stream reuse")               \
  X(uint64_t, stream_waits, "streams made to wait on another stream's free")

#define IA_STAT_DECLARE(type, name, doc) type name;
typedef struct ia_stats {
  IA_STAT_FIELDS(IA_STAT_DECLARE)
} ia_stats_t;
#undef IA_STAT_DECLARE

size_t ia_stat_count(void);
const char *ia_stat_name(size_t index);
const char *ia_stat_doc(size_t index);
/* Writes "name = value" lines into buf (truncated to len); returns the length it needed. */
size_t ia_stats_format(const ia_stats_t *stats, char *buf, size_t len);

/* ------------------------------------------------------------------------------------------------
 * The arena.
 * ---------------------------------------------------------------------------------------------- */
typedef struct ia_arena ia_arena_t;

typedef struct ia_arena_options {
  /* Fixed arena: the one reservation made at creation. Growable arena: 0, or a first region. */
  size_t capacity;
  /* Every block starts at a multiple of this and spans a multiple of it; a power of two >= 16. */
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
} ia_arena_options_t;

typedef struct ia_block_info {
  uintptr_t address;
  uint64_t size;
  uint64_t requested; /* 0 for free blocks */
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

/* size 0 yields NULL and IA_OK. Never returns memory outside the arena's regions. */
ia_status_t ia_arena_alloc(ia_arena_t *arena, size_t size, ia_stream_t stream, void **out);
ia_status_t ia_arena_free(ia_arena_t *arena, void *ptr, ia_stream_t stream);
/* The block at ptr is also used on `stream`: its free will order that stream's work before reuse. */
ia_status_t ia_arena_record_stream(ia_arena_t *arena, void *ptr, ia_stream_t stream);
/* Growable mode: gives fully free regions back to the backend; returns the bytes released. */
uint64_t ia_arena_release_cached(ia_arena_t *arena);

bool ia_arena_owns(ia_arena_t *arena, const void *ptr);
void ia_arena_stats(ia_arena_t *arena, ia_stats_t *out);
void ia_arena_reset_peaks(ia_arena_t *arena);
size_t ia_arena_alignment(const ia_arena_t *arena);
/* Copies up to `cap` entries in address order within each region; returns how many exist. */
size_t ia_arena_blocks(ia_arena_t *arena, ia_block_info_t *out, size_t cap);
size_t ia_arena_regions(ia_arena_t *arena, ia_region_info_t *out, size_t cap);
/* Walks every region: blocks tile it exactly, no two neighbours are both free, the free bins and
 * the live-block table agree with the blocks, the counters agree with the walk.
 * Returns true when all hold; otherwise writes what broke into msg. */
bool ia_arena_check(ia_arena_t *arena, char *msg, size_t msg_len);

#endif /* INDEXER_ARENA_H */
