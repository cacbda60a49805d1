/* A thread cache's layout and the owner's way in, shared by thread_cache.c (the owner's side: the
 * fast path, the class lists, lifetime) and thread_cache_claims.c (every other thread's). */
#ifndef IA_THREAD_CACHE_H
#define IA_THREAD_CACHE_H

#include <sched.h>

#include "internal.h"

struct _ia_tcache {
  _Atomic int busy;          /* the owner is in its fast path (or, with the exchange, anyone) */
  bool asymmetric;           /* the owner only stores busy; claimers pass the process-wide barrier */
  const void *owner;         /* the owning thread's mark (thread_cache.c: &mine) */
  ia_arena_t *_Atomic arena; /* NULL once the arena is destroyed */
  _ia_table_t lent;          /* every block lent to the cache, free in it or handed out */
  size_t limit, full_bytes, block_max;
  unsigned fl_count;         /* classes 0 .. fl_count - 1 of the first level exist */
  uint64_t free_bytes;
  uint64_t free_blocks;      /* stored with relaxed atomics: _ia_tcache_may_hold reads it unclaimed */
  _ia_tcache_counts_t counts;
  _ia_tcache_t *next;        /* the thread's caches */
  uint64_t fl_map;
  uint32_t *sl_map;          /* [fl], and a last one always 0: a row's next one can be read */
  _ia_block_t **heads;       /* [fl * IA_SL_COUNT + sl]: newest first */
  /* On a line of their own, away from what the owner's fast path writes. */
  _Atomic int claimed __attribute__((aligned(IA_CACHE_LINE)));
  _ia_block_t *remote_frees; /* lent blocks other threads freed, linked by free_next (arena's lock) */
};

/* The owner's entry to its cache: false while another thread claims it (thread_cache_claims.c
 * says why a store and a load are enough). */
static inline bool _ia_tcache_enter(_ia_tcache_t *c) {
  if (!c->asymmetric) return !atomic_exchange_explicit(&c->busy, 1, memory_order_acquire);
  atomic_store_explicit(&c->busy, 1, memory_order_relaxed);
  atomic_signal_fence(memory_order_seq_cst); /* a claimer's barrier makes it a full fence */
  if (__builtin_expect(!atomic_load_explicit(&c->claimed, memory_order_acquire), 1)) return true;
  atomic_store_explicit(&c->busy, 0, memory_order_relaxed);
  return false;
}

static inline void _ia_tcache_leave(_ia_tcache_t *c) { atomic_store_explicit(&c->busy, 0, memory_order_release); }

/* Spins a while, then yields, so that an oversubscribed machine lets the other side run. */
static inline void _ia_tcache_back_off(unsigned *spins) {
  if (++*spins < 64) _ia_cpu_relax();
  else sched_yield();
}

/* Whether claimers pass the process-wide barrier (made ready on the first call). */
bool _ia_tcache_asymmetric(void);

#endif
