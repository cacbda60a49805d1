/* The arena's own state and the calls between its files (arena*.c); no other file includes it. */
#ifndef INDEXER_ARENA_PRIVATE_H
#define INDEXER_ARENA_PRIVATE_H

#include "backend.h"
#include "internal.h"

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

/* ---- The arena's state and the calls between its files (arena*.c; csrc/README.md says which
 * does what). Everything below runs under the arena's lock unless it says otherwise. ---------- */

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
