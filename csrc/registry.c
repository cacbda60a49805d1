/* Which arena owns an address: every region of the plugin's arenas, sorted by base.
 *
 * PyTorch frees by pointer alone, so the plugin finds the owner here instead of keeping a map of
 * every live pointer: a region lookup is a binary search over a few hundred regions, and a region
 * is added or removed only when an arena reserves or gives one back. A CUDA graph's workspace
 * arena carves its regions out of the device's workspace region, so regions may nest; a lookup
 * answers the innermost.
 *
 * Every free of the process looks here, from any thread, and changes are rare, so a lookup takes no
 * lock and writes nothing shared: the table is read under a sequence count (a seqlock), which a
 * change makes odd while it moves entries and even again after, and a lookup that saw it odd or
 * changed looks again. Every field is an atomic, read relaxed, so a lookup racing a change reads
 * stale values, never torn ones, and throws them away. A table outgrown is kept, not freed, since
 * a lookup may still be reading it: the tables kept hold fewer entries than the current one.
 */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

typedef struct {
  _Atomic uintptr_t base, end;
  ia_arena_t *_Atomic arena;
  const _ia_owner_t *_Atomic owner;
} entry_t;

typedef struct table {
  size_t cap;
  _Atomic size_t count;
  struct table *older; /* outgrown, kept for lookups that may still read it */
  entry_t items[];
} table_t;

static struct {
  pthread_mutex_t lock; /* changes */
  _Atomic unsigned seq; /* odd while a change moves entries */
  table_t *_Atomic table;
} reg = {.lock = PTHREAD_MUTEX_INITIALIZER};

#define LOAD(x) atomic_load_explicit(&(x), memory_order_relaxed)
#define STORE(x, v) atomic_store_explicit(&(x), (v), memory_order_relaxed)

/* Index of the first of t's n entries ordered after (base, end): by base, and the larger of two
 * nested regions with one base first. */
static size_t position(const table_t *t, size_t n, uintptr_t base, uintptr_t end) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    uintptr_t b = LOAD(t->items[mid].base);
    if (b < base || (b == base && LOAD(t->items[mid].end) >= end)) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static void copy_entry(entry_t *to, const entry_t *from) {
  STORE(to->base, LOAD(from->base));
  STORE(to->end, LOAD(from->end));
  STORE(to->arena, LOAD(from->arena));
  STORE(to->owner, LOAD(from->owner));
}

/* A table with room for one more entry: the current one, or a copy twice its size published in
 * its place (under the lock, outside any change: the copy is complete before a lookup can see it). */
static table_t *with_room(void) {
  table_t *t = LOAD(reg.table);
  size_t n = t ? LOAD(t->count) : 0;
  if (t && n < t->cap) return t;
  size_t cap = t ? t->cap * 2 : 64;
  table_t *grown = malloc(sizeof *grown + cap * sizeof *grown->items);
  /* Without room the region could never be freed into; the process cannot go on. */
  ia_assert(grown != NULL);
  grown->cap = cap;
  grown->older = t;
  for (size_t i = 0; i < n; i++) copy_entry(&grown->items[i], &t->items[i]);
  atomic_store_explicit(&grown->count, n, memory_order_relaxed);
  atomic_store_explicit(&reg.table, grown, memory_order_release);
  return grown;
}

void _ia_registry_hook(void *ctx, ia_arena_t *arena, uintptr_t base, size_t size, bool added) {
  uintptr_t end = base + size;
  pthread_mutex_lock(&reg.lock);
  table_t *t = added ? with_room() : LOAD(reg.table);
  size_t n = LOAD(t->count);
  unsigned seq = LOAD(reg.seq);
  STORE(reg.seq, seq + 1);
  atomic_thread_fence(memory_order_release); /* odd before any entry moves */
  size_t at = position(t, n, base, end);
  if (added) {
    for (size_t i = n; i > at; i--) copy_entry(&t->items[i], &t->items[i - 1]);
    entry_t *e = &t->items[at];
    STORE(e->base, base);
    STORE(e->end, end);
    STORE(e->arena, arena);
    STORE(e->owner, (const _ia_owner_t *)ctx);
    STORE(t->count, n + 1);
  } else {
    while (at > 0 && !(LOAD(t->items[at - 1].base) == base && LOAD(t->items[at - 1].arena) == arena)) at--;
    ia_assert(at > 0);
    for (size_t i = at; i < n; i++) copy_entry(&t->items[i - 1], &t->items[i]);
    STORE(t->count, n - 1);
  }
  atomic_store_explicit(&reg.seq, seq + 2, memory_order_release);
  pthread_mutex_unlock(&reg.lock);
}

/* The number of t's n entries whose base is at most p: position(t, n, p, 0), written for lookups
 * as a binary search without branches on the entries (the hardware cannot predict which half a
 * freed pointer falls in, and every free of the process looks here). position's two-part order
 * compiles to branches, so it stays for the rare changes. */
static size_t count_at_or_before(const table_t *t, size_t n, uintptr_t p) {
  if (n == 0) return 0;
  const entry_t *at = t->items;
  while (n > 1) {
    size_t half = n / 2;
    at = LOAD(at[half].base) <= p ? at + half : at;
    n -= half;
  }
  return (size_t)(at - t->items) + (LOAD(at->base) <= p);
}

ia_arena_t *_ia_registry_find(const void *ptr, const _ia_owner_t **owner) {
  uintptr_t p = (uintptr_t)ptr;
  for (;;) {
    unsigned seq = atomic_load_explicit(&reg.seq, memory_order_acquire);
    if (seq & 1) continue;
    const table_t *t = atomic_load_explicit(&reg.table, memory_order_acquire);
    ia_arena_t *found = NULL;
    const _ia_owner_t *found_owner = NULL;
    if (t) {
      size_t n = LOAD(t->count); /* never past t->cap: a table's count is written for that table */
      /* Entries at or before p, latest base first: the first that holds p is the innermost. */
      for (size_t i = count_at_or_before(t, n, p); i > 0 && !found; i--)
        if (p < LOAD(t->items[i - 1].end)) {
          found = LOAD(t->items[i - 1].arena);
          found_owner = LOAD(t->items[i - 1].owner);
        }
    }
    atomic_thread_fence(memory_order_acquire); /* the reads above before the second look */
    if (LOAD(reg.seq) == seq) {
      if (found) *owner = found_owner;
      return found;
    }
  }
}
