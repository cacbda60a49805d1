/* Thread caches, the arena's side (thread_cache.c holds the caches themselves). */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

typedef _ia_block_t block_t;

bool _ia_arena_attach_cache(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_arena_lock(a);
  bool room = a->n_caches < a->cap_caches;
  if (!room) {
    size_t cap = a->cap_caches ? a->cap_caches * 2 : 4;
    _ia_tcache_t **grown = realloc(a->caches, cap * sizeof *grown);
    if ((room = grown != NULL)) {
      a->caches = grown;
      a->cap_caches = cap;
    }
  }
  if (room) a->caches[a->n_caches++] = c;
  _ia_arena_unlock(a);
  return room;
}

/* Adds what the cache's fast path counted into the arena's statistics (both locks held). A peak
 * is raised by the most the cache's thread moved it since the last fold: exact with one thread;
 * with several, it can miss or overstate by what the other threads' caches moved since their
 * folds, which is bounded by their thread_cache bytes. The device totals are exact: the fast path
 * keeps them itself. */
void _ia_fold(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_tcache_counts_t k = _ia_tcache_fold(c);
  ia_stats_t *s = &a->stats;
  _ia_stat_fold(&s->in_use, &k.in_use);
  _ia_stat_fold(&s->active_bytes, &k.in_use);
  _ia_stat_fold(&s->requested, &k.requested);
  _ia_stat_fold(&s->blocks, &k.blocks);
  _ia_stat_fold(&s->active, &k.blocks);
  _ia_stat_fold(&s->inactive_split, &k.inactive_split);
  _ia_stat_fold(&s->inactive_split_bytes, &k.inactive_split_bytes);
}



/* A block a cache gave back: it was counted as free already (fold), so it only rejoins the classes. */
static void give_back(ia_arena_t *a, block_t *b) {
  _ia_table_remove(&a->table, b);
  _ia_make_free(a, b, b->stream, true);
}

/* All of a cache's free blocks come back to the arena (both locks held). */
static void take_all_back(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_fold(a, c);
  for (block_t *b; (b = _ia_tcache_evict(c, true));) give_back(a, b);
}

/* Every cache's free blocks come back to the arena. */
void _ia_drain(ia_arena_t *a) {
  for (size_t i = 0; i < a->n_caches; i++) {
    _ia_tcache_lock(a->caches[i]);
    take_all_back(a, a->caches[i]);
    _ia_tcache_unlock(a->caches[i]);
  }
}

/* A request the arena's free blocks cannot serve takes blocks back from the threads' caches, one
 * at a time, largest first, the calling thread's own cache (`mine`, locked by the caller) first,
 * until it fits or no cache keeps any: only then may the arena grow or refuse. Taking all of them
 * back at once would empty caches whose threads fill them again at once; in a pool grown to just
 * what it needs, where the caches' blocks are all its slack, that happened at nearly every miss. */
block_t *_ia_find_reclaiming(ia_arena_t *a, size_t rsize, _ia_tcache_t *mine) {
  block_t *b = _ia_find_free(a, rsize);
  for (size_t i = 0; !b && i <= a->n_caches;) {
    _ia_tcache_t *c = i == 0 ? mine : a->caches[i - 1];
    if (!c || (i > 0 && c == mine)) {
      i++;
      continue;
    }
    if (c != mine) _ia_tcache_lock(c);
    block_t *taken = _ia_tcache_evict(c, true);
    if (c != mine) _ia_tcache_unlock(c);
    if (!taken) {
      i++;
      continue;
    }
    give_back(a, taken);
    b = _ia_find_free(a, rsize);
  }
  return b;
}

void _ia_fold_all(ia_arena_t *a) {
  for (size_t i = 0; i < a->n_caches; i++) {
    _ia_tcache_lock(a->caches[i]);
    _ia_fold(a, a->caches[i]);
    _ia_tcache_unlock(a->caches[i]);
  }
}

/* A cache past its limit: its largest free blocks come back until it is within. */
void _ia_trim(ia_arena_t *a, _ia_tcache_t *c) {
  for (block_t *b; (b = _ia_tcache_evict(c, false));) give_back(a, b);
}

void _ia_arena_cache_exit(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_arena_lock(a);
  _ia_tcache_lock(c);
  take_all_back(a, c);
  /* What the thread still has handed out is live; its frees now go through the arena's lock. */
  _ia_tcache_unlend_all(c);
  _ia_tcache_unlock(c);
  for (size_t i = 0; i < a->n_caches; i++)
    if (a->caches[i] == c) a->caches[i] = a->caches[--a->n_caches];
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
}
