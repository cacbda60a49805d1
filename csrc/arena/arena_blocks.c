/* Block headers (slabs of them, in host memory) and the table of blocks by address. */
#include <stdlib.h>
#include <string.h>

#include "private.h"

typedef _ia_block_t block_t;

/* ---- block headers ---------------------------------------------------------------------------- */

block_t *_ia_block_new(ia_arena_t *a) {
  if (!a->spare_blocks) {
    _ia_slab_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->next = a->slabs;
    a->slabs = s;
    for (int i = IA_SLAB_BLOCKS - 1; i >= 0; i--) {
      s->blocks[i].free_next = a->spare_blocks;
      a->spare_blocks = &s->blocks[i];
    }
  }
  block_t *b = a->spare_blocks;
  a->spare_blocks = b->free_next;
  memset(b, 0, sizeof *b);
  return b;
}

void _ia_block_delete(ia_arena_t *a, block_t *b) {
  free(b->uses);
  b->uses = NULL;
  b->free_next = a->spare_blocks;
  a->spare_blocks = b;
}

/* ---- the table of live blocks (internal.h) ---------------------------------------------------- */

static size_t slot_of(const _ia_table_t *t, uintptr_t addr) {
  return (size_t)(((uint64_t)addr >> IA_ALIGN_SHIFT) * 0x9E3779B97F4A7C15ull >> 20) & t->mask;
}

static block_t *find(const _ia_table_t *t, uintptr_t addr, size_t *slot) {
  if (!t->slots) return NULL;
  for (size_t i = slot_of(t, addr);; i = (i + 1) & t->mask) {
    block_t *b = t->slots[i];
    if (!b || b->addr == addr) {
      *slot = i;
      return b;
    }
  }
}

block_t *_ia_table_find(const _ia_table_t *t, uintptr_t addr) {
  size_t slot;
  return find(t, addr, &slot);
}

static bool table_grow(_ia_table_t *t) {
  size_t old_size = t->slots ? t->mask + 1 : 0;
  size_t new_size = old_size ? old_size * 2 : 1024;
  block_t **slots = calloc(new_size, sizeof *slots);
  if (!slots) return false;
  block_t **old = t->slots;
  t->slots = slots;
  t->mask = new_size - 1;
  for (size_t i = 0; i < old_size; i++) {
    if (!old[i]) continue;
    size_t j = slot_of(t, old[i]->addr);
    while (slots[j]) j = (j + 1) & t->mask;
    slots[j] = old[i];
  }
  free(old);
  return true;
}

bool _ia_table_insert(_ia_table_t *t, block_t *b) {
  if (!t->slots || (t->count + 1) * 2 > t->mask + 1)
    if (!table_grow(t)) return false;
  size_t i = slot_of(t, b->addr);
  while (t->slots[i]) i = (i + 1) & t->mask;
  t->slots[i] = b;
  t->count++;
  return true;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void remove_slot(_ia_table_t *t, size_t hole) {
  size_t i = hole;
  for (;;) {
    i = (i + 1) & t->mask;
    block_t *b = t->slots[i];
    if (!b) break;
    size_t home = slot_of(t, b->addr);
    bool movable = hole <= i ? (home <= hole || home > i) : (home <= hole && home > i);
    if (movable) {
      t->slots[hole] = b;
      hole = i;
    }
  }
  t->slots[hole] = NULL;
  t->count--;
}

void _ia_table_remove(_ia_table_t *t, block_t *b) {
  size_t slot;
  ia_assert(find(t, b->addr, &slot) == b);
  remove_slot(t, slot);
}
