/* Per-thread caches of free blocks: what lets threads share an arena without queueing on its lock.
 *
 * Why. Every allocation and free took the arena's one mutex; four threads sharing an arena spent
 * their time waiting for it, and even one thread paid a third of its time for the uncontended
 * lock. A cache lets the common case, a thread freeing what it allocated and allocating again on the
 * same stream, skip the arena.
 *
 * What a cache holds. Every block a thread allocates from the arena (of block_max bytes or less)
 * is lent to that thread's cache: the cache's table knows it, so the thread's own free of it finds
 * it without the arena. Freed, it stays lent and is free in the cache, on one class list (the
 * arena's size classes) and remembering the stream it was freed on; the thread's next allocation of
 * that class on that stream takes it back (stream order protects a block reused by its own stream,
 * so no event is needed); when the class has none, one of the next two classes up does, so a block
 * handed out is less than 3/32 larger than asked. A block with other streams recorded on it and
 * anything the cache cannot serve go to the arena under its lock as before (arena.c); a block freed
 * by another thread joins the cache's remote frees (thread_cache_claims.c).
 *
 * Giving back. The arena takes free blocks out of a cache (evict, largest first, since large
 * blocks are the least likely to be asked for again at their exact class and hold the most memory)
 * when the cache passes its limit, one by one when a request fits nowhere else, all of them when
 * the thread exits (a pthread key's destructor, which also runs on pthread_exit and cancellation)
 * and whenever the arena needs its merged free state (drain). Until then a cached block is free
 * but merges with no neighbour.
 *
 * Locks. The owner enters its cache on the fast path without an atomic read-modify-write; any
 * other thread claims the cache first, holding the arena's lock (thread_cache_claims.c). The
 * registry lock orders thread exit against arena destruction: an exiting thread may only follow its
 * cache's arena pointer while the arena cannot be destroyed, and a destroyed arena orphans its
 * caches (arena pointer NULL, blocks forgotten) for their threads to free. The fast path takes
 * neither.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "thread_cache.h"

/* Blocks looked at on one class list per allocation: the list mixes streams and sizes of a class. */
#define SCAN_LIMIT 8
/* Classes above a request's own that it may take a block from when its class has none on its
 * stream: a block is then less than 3/32 larger than asked (a class of 512 bytes or more is 1/32
 * wide), where going to the arena would leave that block idle in the cache and split a new one. */
#define CLASSES_UP 2
/* Free blocks a cache keeps at most, whatever their bytes: bounds a drain's work under the lock. A
 * cache is trimmed back to its limits once it passes them by a quarter (FULL_BLOCKS, full_bytes), so
 * that a thread hovering at a limit does not take the arena's lock on every free. */
#define MAX_BLOCKS 1024
#define FULL_BLOCKS (MAX_BLOCKS + MAX_BLOCKS / 4)

/* The calling thread's caches, one per arena it allocated from. */
static __thread struct {
  _ia_tcache_t *caches;
  bool exiting;
} mine;

static pthread_mutex_t registry = PTHREAD_MUTEX_INITIALIZER;
static pthread_key_t exit_key;
static bool exit_key_made;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;

void _ia_tcache_registry_lock(void) { pthread_mutex_lock(&registry); }
void _ia_tcache_registry_unlock(void) { pthread_mutex_unlock(&registry); }

bool _ia_tcache_mine(const _ia_tcache_t *c) { return c->owner == &mine; }

/* The owner's entry once enter failed: waits for the claim to end. */
static void enter_waiting(_ia_tcache_t *c) {
  unsigned spins = 0;
  while (!_ia_tcache_enter(c))
    while (atomic_load_explicit(c->asymmetric ? &c->claimed : &c->busy, memory_order_relaxed))
      _ia_tcache_back_off(&spins);
}

/* ---- class lists ---------------------------------------------------------------------------- */

/* Singly linked, newest first: taking and keeping touch only the block itself, never a neighbour's
 * header. A block's class (fl, sl) is set when it is lent and holds while it is: its size does not
 * change until the arena has it back. */

static inline size_t list_of(const _ia_block_t *b) { return (size_t)b->fl * IA_SL_COUNT + b->sl; }

static inline void list_push(_ia_tcache_t *c, _ia_block_t *b) {
  size_t i = list_of(b);
  b->free_next = c->heads[i];
  c->heads[i] = b;
  c->fl_map |= 1ull << b->fl;
  c->sl_map[b->fl] |= 1u << b->sl;
  c->free_bytes += b->size;
  __atomic_store_n(&c->free_blocks, c->free_blocks + 1, __ATOMIC_RELAXED); /* may_hold reads it unclaimed */
}

/* Takes b out of list i, where it follows prev (NULL: b is the head). */
static inline void list_unlink(_ia_tcache_t *c, size_t i, _ia_block_t *b, _ia_block_t *prev) {
  if (prev) {
    prev->free_next = b->free_next;
  } else if (!(c->heads[i] = b->free_next)) {
    c->sl_map[b->fl] &= ~(1u << b->sl);
    if (!c->sl_map[b->fl]) c->fl_map &= ~(1ull << b->fl);
  }
  b->free_next = NULL;
  c->free_bytes -= b->size;
  __atomic_store_n(&c->free_blocks, c->free_blocks - 1, __ATOMIC_RELAXED);
}

/* ---- the fast path -------------------------------------------------------------------------- */

/* A block's share of inactive_split, by the arena's rule (recorded at lending). */
static inline void count_split(_ia_tcache_counts_t *k, const _ia_block_t *b, bool freed) {
  if (!b->split) return;
  if (freed) {
    _ia_delta_inc(&k->inactive_split, 1);
    _ia_delta_inc(&k->inactive_split_bytes, b->size);
  } else {
    _ia_delta_dec(&k->inactive_split, 1);
    _ia_delta_dec(&k->inactive_split_bytes, b->size);
  }
}

/* A block on `stream` of at least rsize bytes from class list i, looking at SCAN_LIMIT blocks at
 * most; *prev is the block before it. */
static inline _ia_block_t *scan(const _ia_tcache_t *c, size_t i, size_t rsize, ia_stream_t stream,
                                _ia_block_t **prev) {
  _ia_block_t *b = c->heads[i];
  *prev = NULL;
  for (unsigned looked = 1; b && (b->stream != stream || b->size < rsize); looked++) {
    *prev = b;
    b = looked < SCAN_LIMIT ? b->free_next : NULL;
  }
  return b;
}

/* The same from the lists marked in `held` (bit 0: list *i), in order; *i ends at the block's. */
static inline _ia_block_t *scan_held(const _ia_tcache_t *c, size_t *i, uint64_t held, size_t rsize, ia_stream_t stream,
                                     _ia_block_t **prev) {
  for (; held; held >>= 1, ++*i) {
    _ia_block_t *b = held & 1 ? scan(c, *i, rsize, stream, prev) : NULL;
    if (b) return b;
  }
  return NULL;
}

/* The fast paths below are written so that every call they make on a rare path is a tail call
 * (the slow cases are functions of their own that start over or finish the operation): with no
 * value live across a call, the compiler keeps the common path's values in registers a call may
 * clobber, and saves 3 registers on entry where it saved 6. */

/* The trace's record, out of line: only a traced arena pays for it. */
static __attribute__((noinline)) ia_status_t traced(ia_arena_t *a, ia_trace_action_t action, uintptr_t addr,
                                                   size_t size, ia_stream_t stream) {
  _ia_arena_trace(a, action, addr, size, stream);
  return IA_OK;
}

/* What the arena would have done under its lock besides the cache's own counters: the device
 * totals, the trace, and in a debug build the invariant walk. Returns IA_OK. */
static inline ia_status_t after_op(ia_arena_t *a, ia_trace_action_t action, uintptr_t addr, size_t size,
                                   uint64_t bytes, uint64_t requested, ia_stream_t stream) {
  _ia_totals_live(a->totals, action == IA_TRACE_ALLOC ? 1 : -1, (int64_t)bytes, (int64_t)requested);
#if IA_DEBUG
  _ia_arena_lock(a);
  IA_DEBUG_CHECK(a);
  _ia_arena_unlock(a);
#endif
  if (__builtin_expect(atomic_load_explicit(&a->trace, memory_order_relaxed) != NULL, 0))
    return traced(a, action, addr, size, stream);
  return IA_OK;
}

static _ia_tcache_t *make(ia_arena_t *a);

static inline _ia_tcache_t *find_mine(const ia_arena_t *a) {
  /* Relaxed: a destroyed arena's caches were orphaned before its memory could hold a new arena
   * that this thread learned of, so a match is this arena's cache. */
  for (_ia_tcache_t *c = mine.caches; c; c = c->next)
    if (atomic_load_explicit(&c->arena, memory_order_relaxed) == a) return c;
  return NULL;
}

/* Which of the lists a request of class (fl, sl) may take from hold a block, from the bitmaps:
 * bit 0 is the request's own list, then up to CLASSES_UP above it (the span may run into the next
 * row), so that empty lists cost no branch. The first level's classes are exact sizes, where a
 * class up is a fixed 16 bytes however small the request: none there. */
static inline uint64_t lists_held(const _ia_tcache_t *c, unsigned fl, unsigned sl) {
  uint64_t rows = c->sl_map[fl] | (uint64_t)c->sl_map[fl + 1] << IA_SL_COUNT;
  return (rows >> sl) & (fl ? (1u << (CLASSES_UP + 1)) - 1 : 1);
}

/* Hands out b, taken from list i where it follows prev, and leaves the cache. Always inlined, as
 * put below: gcc kept each out of line for its two callers, and take's eight arguments then went
 * through the stack on the fast path. */
static inline __attribute__((always_inline)) ia_status_t take(ia_arena_t *a, _ia_tcache_t *c, size_t i,
                                                              _ia_block_t *b, _ia_block_t *prev, size_t size,
                                                              ia_stream_t stream, void **out) {
  list_unlink(c, i, b, prev);
  b->cached = false;
  b->requested = size;
  _ia_tcache_counts_t *k = &c->counts;
  _ia_delta_inc(&k->in_use, b->size);
  _ia_delta_inc(&k->requested, size);
  _ia_delta_inc(&k->blocks, 1);
  count_split(k, b, false);
  _ia_tcache_leave(c);
  /* Handed out to this caller alone: its fields are stable to read. */
  *out = (void *)b->addr;
  return after_op(a, IA_TRACE_ALLOC, b->addr, size, b->size, size, stream);
}

/* An allocation inside the cache, looking at every list it may take from: what the fast path hands
 * over when the first list's head does not serve the request, or the cache was claimed. */
static __attribute__((noinline)) ia_status_t alloc_scanning(ia_arena_t *a, _ia_tcache_t *c, size_t size,
                                                            ia_stream_t stream, void **out) {
  size_t rsize = _ia_align_up(size, a->opts.alignment);
  unsigned fl, sl;
  _ia_class_of(rsize, &fl, &sl);
  size_t i = (size_t)fl * IA_SL_COUNT + sl;
  _ia_block_t *prev = NULL, *b = scan_held(c, &i, lists_held(c, fl, sl), rsize, stream, &prev);
  if (b) return take(a, c, i, b, prev, size, stream, out);
  _ia_tcache_leave(c);
  return _ia_alloc_locked(a, size, stream, c, out);
}

static __attribute__((noinline)) ia_status_t alloc_contended(ia_arena_t *a, _ia_tcache_t *c, size_t size,
                                                             ia_stream_t stream, void **out) {
  enter_waiting(c);
  return alloc_scanning(a, c, size, stream, out);
}

/* The thread's first allocation from the arena: its cache is made, then the allocation starts over. */
static __attribute__((noinline)) ia_status_t alloc_first(ia_arena_t *a, size_t size, ia_stream_t stream,
                                                         void **out) {
  if (!make(a)) return _ia_alloc_locked(a, size, stream, NULL, out);
  return _ia_tcache_alloc(a, size, stream, out);
}

ia_status_t _ia_tcache_alloc(ia_arena_t *a, size_t size, ia_stream_t stream, void **out) {
  _ia_tcache_t *c = find_mine(a);
  if (__builtin_expect(!c, 0)) return alloc_first(a, size, stream, out);
  size_t rsize = _ia_align_up(size, a->opts.alignment);
  unsigned fl, sl;
  _ia_class_of(rsize, &fl, &sl);
  if (fl >= c->fl_count) return _ia_alloc_locked(a, size, stream, c, out);
  if (__builtin_expect(!_ia_tcache_enter(c), 0))
    return alloc_contended(a, c, size, stream, out);
  uint64_t held = lists_held(c, fl, sl);
  if (!held) {
    _ia_tcache_leave(c);
    return _ia_alloc_locked(a, size, stream, c, out);
  }
  /* The common case: the first list that holds a block, its newest block. */
  size_t i = (size_t)fl * IA_SL_COUNT + sl + (size_t)__builtin_ctzll(held);
  _ia_block_t *b = c->heads[i];
  if (__builtin_expect(b->stream != stream || b->size < rsize, 0)) return alloc_scanning(a, c, size, stream, out);
  return take(a, c, i, b, NULL, size, stream, out);
}

/* A free past the cache's limits: recorded, then the cache gives back down to them. */
static __attribute__((noinline)) ia_status_t free_trimming(ia_arena_t *a, _ia_tcache_t *c, uintptr_t addr,
                                                           uint64_t size, uint64_t requested, ia_stream_t stream) {
  after_op(a, IA_TRACE_FREE, addr, size, size, requested, stream);
  _ia_trim_cache(a, c);
  return IA_OK;
}

/* A free inside the cache. */
static inline __attribute__((always_inline)) ia_status_t put(ia_arena_t *a, _ia_tcache_t *c, void *ptr,
                                                             ia_stream_t stream) {
  _ia_block_t *b = _ia_table_find(&c->lent, (uintptr_t)ptr, NULL);
  if (!b || b->n_uses || b->freed_remotely) { /* not lent here, other streams recorded on it, or freed */
    _ia_tcache_leave(c);
    return _ia_free_locked(a, ptr, stream);
  }
  if (b->cached) {
    _ia_tcache_leave(c);
    return _ia_bad_free(a, IA_ERR_DOUBLE_FREE);
  }
  if (stream != IA_STREAM_NONE) b->stream = stream; /* else: the stream it was allocated on */
  uint64_t size = b->size, requested = b->requested;
  _ia_tcache_counts_t *k = &c->counts;
  _ia_delta_dec(&k->in_use, size);
  _ia_delta_dec(&k->requested, requested);
  _ia_delta_dec(&k->blocks, 1);
  count_split(k, b, true);
  b->requested = 0;
  b->cached = true;
  ia_stream_t freed_on = b->stream;
  list_push(c, b);
  bool full = c->free_bytes > c->full_bytes || c->free_blocks > FULL_BLOCKS;
  _ia_tcache_leave(c);
  if (__builtin_expect(full, 0)) return free_trimming(a, c, (uintptr_t)ptr, size, requested, freed_on);
  return after_op(a, IA_TRACE_FREE, (uintptr_t)ptr, size, size, requested, freed_on);
}

static __attribute__((noinline)) ia_status_t free_contended(ia_arena_t *a, _ia_tcache_t *c, void *ptr,
                                                            ia_stream_t stream) {
  enter_waiting(c);
  return put(a, c, ptr, stream);
}

ia_status_t _ia_tcache_free(ia_arena_t *a, void *ptr, ia_stream_t stream) {
  _ia_tcache_t *c = find_mine(a);
  if (!c) return _ia_free_locked(a, ptr, stream);
  if (__builtin_expect(!_ia_tcache_enter(c), 0))
    return free_contended(a, c, ptr, stream);
  return put(a, c, ptr, stream);
}

/* ---- the arena's side (its lock held, the cache claimed or the caller's) -------------------- */

_ia_tcache_counts_t _ia_tcache_fold(_ia_tcache_t *c) {
  _ia_tcache_counts_t k = c->counts;
  c->counts = (_ia_tcache_counts_t){0};
  return k;
}

bool _ia_tcache_lend(const ia_arena_t *a, _ia_tcache_t *c, _ia_block_t *b) {
  if (b->size > c->block_max || !_ia_table_insert(&c->lent, b)) return false;
  _ia_file_class(b);
  b->split = _ia_split_free(a, b);
  b->free_prev = b->free_next = NULL;
  b->cache = c;
  b->cached = false;
  return true;
}

void _ia_tcache_unlend(_ia_tcache_t *c, _ia_block_t *b) {
  _ia_table_remove(&c->lent, b);
  b->cache = NULL;
}

_ia_block_t *_ia_tcache_evict(_ia_tcache_t *c, bool all) {
  if (!c->fl_map || (!all && c->free_bytes <= c->limit && c->free_blocks <= MAX_BLOCKS)) return NULL;
  unsigned fl = _ia_log2_floor(c->fl_map);
  unsigned sl = _ia_log2_floor(c->sl_map[fl]);
  size_t i = (size_t)fl * IA_SL_COUNT + sl;
  _ia_block_t *b = c->heads[i]; /* the newest of the largest class */
  list_unlink(c, i, b, NULL);
  _ia_table_remove(&c->lent, b);
  b->cache = NULL;
  b->cached = false;
  return b;
}

void _ia_tcache_free_info(const _ia_tcache_t *c, uint64_t *bytes, uint64_t *blocks, uint64_t *largest) {
  *bytes = c->free_bytes;
  *blocks = c->free_blocks;
  *largest = 0;
  if (!c->fl_map) return;
  unsigned fl = _ia_log2_floor(c->fl_map);
  for (const _ia_block_t *b = c->heads[(size_t)fl * IA_SL_COUNT + _ia_log2_floor(c->sl_map[fl])]; b;
       b = b->free_next)
    if (b->size > *largest) *largest = b->size;
}

bool _ia_tcache_holds(const _ia_tcache_t *c, const _ia_block_t *b) {
  return _ia_table_find(&c->lent, b->addr, NULL) == b;
}

size_t _ia_tcache_lent(const _ia_tcache_t *c) { return c->lent.count; }

void _ia_tcache_unlend_all(_ia_tcache_t *c) {
  for (size_t i = 0; c->lent.slots && i <= c->lent.mask; i++)
    if (c->lent.slots[i]) {
      c->lent.slots[i]->cache = NULL;
      c->lent.slots[i] = NULL;
    }
  c->lent.count = 0;
}

void _ia_tcache_orphan(_ia_tcache_t *c) {
  free(c->lent.slots);
  c->lent = (_ia_table_t){0};
  memset(c->heads, 0, (size_t)c->fl_count * IA_SL_COUNT * sizeof *c->heads);
  memset(c->sl_map, 0, (c->fl_count + 1) * sizeof *c->sl_map);
  c->fl_map = c->free_bytes = 0;
  __atomic_store_n(&c->free_blocks, 0, __ATOMIC_RELAXED);
  c->remote_frees = NULL;
  atomic_store(&c->arena, NULL);
}

#define CHECK(cond, ...)                                                                            \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      snprintf(msg, msg_len, __VA_ARGS__);                                                          \
      return false;                                                                                 \
    }                                                                                               \
  } while (0)

bool _ia_tcache_check(const _ia_tcache_t *c, char *msg, size_t msg_len) {
  uint64_t bytes = 0, blocks = 0;
  CHECK(!c->sl_map[c->fl_count], "a thread cache's bitmap marks lists past its last class");
  for (unsigned fl = 0; fl < c->fl_count; fl++)
    for (unsigned sl = 0; sl < IA_SL_COUNT; sl++) {
      size_t i = (size_t)fl * IA_SL_COUNT + sl;
      bool bit = (c->sl_map[fl] >> sl) & 1;
      CHECK(bit == (c->heads[i] != NULL) && ((c->fl_map >> fl) & 1) == (c->sl_map[fl] != 0),
            "a thread cache's bitmap disagrees with its class %u/%u", fl, sl);
      for (const _ia_block_t *b = c->heads[i]; b; b = b->free_next) {
        unsigned bfl, bsl;
        _ia_class_of(b->size, &bfl, &bsl);
        CHECK(b->cache == c && b->cached && !b->is_free && !b->n_uses && !b->requested,
              "block %#lx on a thread cache's list is not free in that cache", (unsigned long)b->addr);
        CHECK(bfl == fl && bsl == sl && b->fl == fl && b->sl == sl && b->size <= c->block_max,
              "block %#lx filed in the wrong class of a thread cache", (unsigned long)b->addr);
        CHECK(!b->free_prev && !b->freed_remotely, "block %#lx on a thread cache's list has a back link or was "
              "freed by another thread", (unsigned long)b->addr);
        CHECK(_ia_tcache_holds(c, b), "free block %#lx of a thread cache is missing from its table",
              (unsigned long)b->addr);
        bytes += b->size;
        blocks++;
      }
    }
  CHECK(bytes == c->free_bytes && blocks == c->free_blocks, "a thread cache's free counters are off");
  for (const _ia_block_t *b = c->remote_frees; b; b = b->free_next)
    CHECK(b->cache == c && b->freed_remotely && !b->cached && _ia_tcache_holds(c, b),
          "block %#lx on a thread cache's remote frees is not a handed-out block of it", (unsigned long)b->addr);
  size_t lent = 0;
  for (size_t i = 0; c->lent.slots && i <= c->lent.mask; i++)
    if (c->lent.slots[i]) {
      CHECK(c->lent.slots[i]->cache == c, "block %#lx is in a thread cache's table but lent elsewhere",
            (unsigned long)c->lent.slots[i]->addr);
      lent++;
    }
  CHECK(lent == c->lent.count, "a thread cache's table holds %zu blocks and counts %zu", lent, c->lent.count);
  return true;
}

/* ---- lifetime ------------------------------------------------------------------------------- */

static void free_cache(_ia_tcache_t *c) {
  free(c->lent.slots);
  free(c);
}

/* The key's destructor: pthread runs it when the thread ends, by returning, pthread_exit or
 * cancellation (not for the thread that calls exit(), whose memory goes with the process). */
static void thread_exit(void *unused) {
  (void)unused;
  mine.exiting = true; /* a later destructor of another library that allocates gets no new cache */
  pthread_mutex_lock(&registry);
  for (_ia_tcache_t *c = mine.caches, *next; c; c = next) {
    next = c->next;
    ia_arena_t *a = atomic_load(&c->arena);
    if (a) _ia_arena_cache_exit(a, c);
    free_cache(c); /* an orphan was orphaned under the registry lock, which we hold: nobody has it */
  }
  mine.caches = NULL;
  pthread_mutex_unlock(&registry);
}

static void make_exit_key(void) { exit_key_made = pthread_key_create(&exit_key, thread_exit) == 0; }

/* Frees this thread's caches whose arenas were destroyed. Their destruction set the arena pointer
 * with the cache claimed; entering and leaving waits for it to be done with the cache. */
static void forget_orphans(void) {
  for (_ia_tcache_t **link = &mine.caches; *link;) {
    _ia_tcache_t *c = *link;
    if (atomic_load(&c->arena)) {
      link = &c->next;
      continue;
    }
    enter_waiting(c);
    _ia_tcache_leave(c);
    *link = c->next;
    free_cache(c);
  }
}

/* Out of line: inlined, it would make the fast paths save registers they do not need. */
static __attribute__((noinline)) _ia_tcache_t *make(ia_arena_t *a) {
  size_t limit = a->opts.thread_cache, block_max = a->opts.thread_cache_block;
  if (mine.exiting) return NULL;
  pthread_once(&exit_key_once, make_exit_key);
  /* Without the destructor an exiting thread would strand its blocks: no cache then. */
  if (!exit_key_made || pthread_setspecific(exit_key, &mine) != 0) return NULL;
  forget_orphans();
  unsigned fl, sl;
  _ia_class_of(block_max, &fl, &sl);
  size_t lists = (size_t)(fl + 1) * IA_SL_COUNT;
  _ia_tcache_t *c = _ia_zalloc_lines(sizeof *c + lists * sizeof(_ia_block_t *) + (fl + 2) * sizeof(uint32_t));
  if (!c) return NULL;
  c->heads = (_ia_block_t **)(c + 1);
  c->sl_map = (uint32_t *)(c->heads + lists);
  c->fl_count = fl + 1;
  c->owner = &mine;
  c->asymmetric = _ia_tcache_asymmetric();
  c->limit = limit;
  c->full_bytes = limit + limit / 4;
  c->block_max = block_max;
  atomic_store(&c->arena, a);
  if (!_ia_arena_attach_cache(a, c)) {
    free(c);
    return NULL;
  }
  c->next = mine.caches;
  mine.caches = c;
  return c;
}
