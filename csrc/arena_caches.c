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

/* Adds what the cache's fast path counted into the arena's statistics (the cache claimed). A peak
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

/* A cache's counters folded and its remote frees given back (the cache claimed, or the caller's). */
void _ia_collect(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_fold(a, c);
  for (block_t *b = _ia_tcache_take_remote_frees(c), *next; b; b = next) {
    next = b->free_next;
    b->free_next = NULL;
    b->freed_remotely = false;
    _ia_tcache_unlend(c, b);
    _ia_free_later(a, b);
  }
}

/* A block a cache gave back: it was counted as free already (fold), so it only rejoins the classes. */
static void give_back(ia_arena_t *a, block_t *b) {
  _ia_table_remove(&a->table, b);
  _ia_make_free(a, b, b->stream, true);
}

/* All of a cache's free blocks come back to the arena. */
static void take_all_back(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_collect(a, c);
  for (block_t *b; (b = _ia_tcache_evict(c, true));) give_back(a, b);
}

/* Every cache's free blocks come back to the arena. */
void _ia_drain(ia_arena_t *a) {
  _ia_tcache_claim(a->caches, a->n_caches);
  for (size_t i = 0; i < a->n_caches; i++) take_all_back(a, a->caches[i]);
  _ia_tcache_release(a->caches, a->n_caches);
}

/* Blocks of cache c come back one at a time, largest first, until a free block of rsize bytes is
 * found. */
static block_t *take_back_until(ia_arena_t *a, size_t rsize, _ia_tcache_t *c) {
  block_t *b = NULL;
  for (block_t *taken; !b && (taken = _ia_tcache_evict(c, true));) {
    give_back(a, taken);
    b = _ia_find_free(a, rsize);
  }
  return b;
}

/* A request the arena's free blocks cannot serve takes blocks back from the threads' caches, the
 * calling thread's own (`mine`) first, until it fits or no cache keeps any: only then may the arena
 * grow or refuse. Taking all of them back at once would empty caches whose threads fill them again
 * at once; in a pool grown to just what it needs, where the caches' blocks are all its slack, that
 * happened at nearly every miss. Other threads' caches are claimed together, and only when one
 * looks as if it had something to give. */
block_t *_ia_find_reclaiming(ia_arena_t *a, size_t rsize, _ia_tcache_t *mine) {
  block_t *b = _ia_find_free(a, rsize);
  if (!b && mine) b = take_back_until(a, rsize, mine);
  bool others = false;
  for (size_t i = 0; !b && i < a->n_caches; i++) others |= a->caches[i] != mine && _ia_tcache_may_hold(a->caches[i]);
  if (!others) return b;
  _ia_tcache_claim(a->caches, a->n_caches);
  for (size_t i = 0; i < a->n_caches; i++)
    if (a->caches[i] != mine) _ia_collect(a, a->caches[i]);
  b = _ia_find_free(a, rsize);
  for (size_t i = 0; !b && i < a->n_caches; i++)
    if (a->caches[i] != mine) b = take_back_until(a, rsize, a->caches[i]);
  _ia_tcache_release(a->caches, a->n_caches);
  return b;
}

void _ia_collect_all(ia_arena_t *a) {
  _ia_tcache_claim(a->caches, a->n_caches);
  for (size_t i = 0; i < a->n_caches; i++) _ia_collect(a, a->caches[i]);
  _ia_tcache_release(a->caches, a->n_caches);
}

/* A cache past its limit: its largest free blocks come back until it is within. */
void _ia_trim(ia_arena_t *a, _ia_tcache_t *c) {
  for (block_t *b; (b = _ia_tcache_evict(c, false));) give_back(a, b);
}

/* The exiting thread's own cache: no claim. */
void _ia_arena_cache_exit(ia_arena_t *a, _ia_tcache_t *c) {
  _ia_arena_lock(a);
  take_all_back(a, c);
  /* What the thread still has handed out is live; its frees now go through the arena's lock. */
  _ia_tcache_unlend_all(c);
  for (size_t i = 0; i < a->n_caches; i++)
    if (a->caches[i] == c) a->caches[i] = a->caches[--a->n_caches];
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
}
