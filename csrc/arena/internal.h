/* What the budget arena's files share with each other and with what is built on the arena (the
 * PyTorch allocator, csrc/torch/): helpers, device totals, and the calls into an arena beyond the
 * public interface. Not part of the public interface. The arena's own state is in private.h. */
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

#define IA_MiB ((size_t)1 << 20)

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
   * while any do, no arena watching it gives memory back; an arena looks under its own lock, so
   * whoever raises the count takes each arena's lock once afterwards to wait out a release that
   * looked before. Whoever counts captures passes the frees it holds back under its own lock, so a
   * free's relaxed look at the count needs no stronger order on Arm. */
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

void _ia_arena_flush_events(ia_arena_t *arena);
bool _ia_arena_stream_capturing(ia_arena_t *arena, ia_stream_t stream);
/* A mapping arena's pages become reachable from device `peer` (IA_OK and nothing else otherwise). */
ia_status_t _ia_arena_grant_access(ia_arena_t *arena, int peer);
/* ia_arena_alloc of a block of at least reserve bytes whose requested bytes stay size (PyTorch's
 * roundup_power2_divisions rounds the request up before the allocator sees it). */
ia_status_t _ia_arena_alloc_reserving(ia_arena_t *a, size_t size, size_t reserve, ia_stream_t stream, void **out);
/* The backend the arena took. */
const ia_backend_t *_ia_arena_backend(const ia_arena_t *arena);
/* Adds s to sum: quantities and counters summed (peaks too), the larger largest free block. */
void _ia_stats_add(ia_stats_t *sum, const ia_stats_t *s);
ia_status_t _ia_trace_resize(ia_trace_t *trace, size_t capacity);
void _ia_trace_record(ia_trace_t *trace, ia_trace_action_t action, int32_t device, uint8_t pool,
                      uintptr_t address, uint64_t size, ia_stream_t stream);
/* "1.50 MiB"-style rendering for messages; writes into buf and returns it. */
const char *_ia_format_bytes(uint64_t bytes, char *buf, size_t len);

#endif
