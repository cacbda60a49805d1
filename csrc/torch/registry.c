/* Which arena owns an address: every region of the plugin's arenas, sorted by base, under a
 * readers-writer lock: every free of the process looks here, from any thread, and lookups do not
 * wait for each other.
 *
 * PyTorch frees by pointer alone, so the plugin finds the owner here instead of keeping a map of
 * every live pointer: a lookup is a binary search over the regions (a handful once the general
 * pools map pages of one address range each, a few hundred at most with regions), and a region is
 * added or removed only when an arena reserves or gives one back. A CUDA graph's workspace arena
 * carves its regions out of the device's workspace region, so regions may nest; a lookup answers
 * the innermost. The hook runs under the arena's lock; the lock order: Note [Device lifetime]
 * (csrc/torch/plugin.h).
 */
#include <pthread.h>
#include <stdlib.h>

#include "plugin.h"

typedef struct {
  uintptr_t base, end;
  ia_arena_t *arena;
  const _ia_owner_t *owner;
} entry_t;

static struct {
  pthread_rwlock_t lock;
  entry_t *items;
  size_t count, cap;
} reg = {.lock = PTHREAD_RWLOCK_INITIALIZER};

/* Index of the first entry ordered after (base, end): by base, and the larger of two nested
 * regions with one base first. */
static size_t position(uintptr_t base, uintptr_t end) {
  size_t lo = 0, hi = reg.count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const entry_t *e = &reg.items[mid];
    if (e->base < base || (e->base == base && e->end >= end)) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static void add(ia_arena_t *arena, const _ia_owner_t *owner, uintptr_t base, uintptr_t end) {
  if (reg.count == reg.cap) {
    size_t cap = reg.cap ? reg.cap * 2 : 64;
    entry_t *grown = realloc(reg.items, cap * sizeof *grown);
    /* Without room the region could never be freed into; the process cannot go on. */
    ia_assert(grown != NULL);
    reg.items = grown;
    reg.cap = cap;
  }
  size_t at = position(base, end);
  memmove(&reg.items[at + 1], &reg.items[at], (reg.count - at) * sizeof *reg.items);
  reg.items[at] = (entry_t){base, end, arena, owner};
  reg.count++;
}

static void drop(ia_arena_t *arena, uintptr_t base, uintptr_t end) {
  size_t at = position(base, end);
  while (at > 0 && !(reg.items[at - 1].base == base && reg.items[at - 1].arena == arena)) at--;
  ia_assert(at > 0);
  memmove(&reg.items[at - 1], &reg.items[at], (reg.count - at) * sizeof *reg.items);
  reg.count--;
}

void _ia_registry_hook(void *ctx, ia_arena_t *arena, uintptr_t base, size_t size, bool added) {
  pthread_rwlock_wrlock(&reg.lock);
  if (added) add(arena, (const _ia_owner_t *)ctx, base, base + size);
  else drop(arena, base, base + size);
  pthread_rwlock_unlock(&reg.lock);
}

ia_arena_t *_ia_registry_find(const void *ptr, const _ia_owner_t **owner) {
  uintptr_t p = (uintptr_t)ptr;
  ia_arena_t *found = NULL;
  pthread_rwlock_rdlock(&reg.lock);
  /* Entries at or before p, latest base first: the first that holds p is the innermost. */
  for (size_t i = position(p, 0); i > 0 && !found; i--)
    if (p < reg.items[i - 1].end) {
      found = reg.items[i - 1].arena;
      *owner = reg.items[i - 1].owner;
    }
  pthread_rwlock_unlock(&reg.lock);
  return found;
}
