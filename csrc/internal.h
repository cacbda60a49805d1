/* Declarations shared between the core's files; not part of the public interface. */
#ifndef INDEXER_ARENA_INTERNAL_H
#define INDEXER_ARENA_INTERNAL_H

#include <stdatomic.h>

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
};

static inline size_t _ia_align_up(size_t n, size_t a) { return (n + a - 1) & ~(a - 1); }
static inline bool _ia_is_pow2(size_t n) { return n && !(n & (n - 1)); }

/* Byte counts summed over several arenas (one device's pools), kept exact with atomics so that a
 * device-wide peak is a true peak and not a sum of per-arena peaks. */
typedef struct ia_totals {
  _Atomic uint64_t in_use, in_use_peak, capacity, capacity_peak;
  /* Growth of any arena of the group stops where capacity would pass this (0: no limit). Checked
   * under each arena's own lock, so two arenas growing at once can pass it by one region. */
  _Atomic uint64_t limit;
} ia_totals_t;
void _ia_arena_set_totals(ia_arena_t *arena, ia_totals_t *totals);
void _ia_totals_reset_peaks(ia_totals_t *totals);

void _ia_trace_record(ia_trace_t *trace, ia_trace_action_t action, int32_t device, uint8_t pool,
                      uintptr_t address, uint64_t size, ia_stream_t stream);

/* "1.50 MiB"-style rendering for messages; writes into buf and returns it. */
const char *_ia_format_bytes(uint64_t bytes, char *buf, size_t len);

#endif
