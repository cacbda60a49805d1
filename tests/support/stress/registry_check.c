/* The region registry (csrc/torch/registry.c) against a brute-force model: random sets of regions, some
 * nested inside others as a graph's workspace arena carves them out of the device's workspace
 * region, added and removed in random order; after every change, lookups at every region's
 * edges and at random addresses must answer the innermost region holding the address (the one
 * with the latest base, and of two with one base the smaller), or nothing.
 * usage: registry_check SEED STEPS        prints "ok" or the first wrong answer. */
#include <stdio.h>
#include <stdlib.h>

#include "torch/plugin.h"
#include "xorshift.h"

#define MAX_REGIONS 300

typedef struct {
  uintptr_t base, end;
  ia_arena_t *arena; /* a distinct fake pointer per region: the registry never follows it */
  _ia_owner_t owner;
  int live;
} region_t;

static region_t regions[MAX_REGIONS];
static uint64_t rng;

/* Innermost live region holding p, by the registry's rule. */
static const region_t *model_find(uintptr_t p) {
  const region_t *best = NULL;
  for (int i = 0; i < MAX_REGIONS; i++) {
    const region_t *r = &regions[i];
    if (!r->live || p < r->base || p >= r->end) continue;
    if (!best || r->base > best->base || (r->base == best->base && r->end < best->end)) best = r;
  }
  return best;
}

static int check(uintptr_t p, int step) {
  const region_t *want = model_find(p);
  const _ia_owner_t *owner = NULL;
  ia_arena_t *got = _ia_registry_find((const void *)p, &owner);
  if (got != (want ? want->arena : NULL) || (want && owner != &want->owner)) {
    printf("step %d: address %#lx found %p, want %p\n", step, (unsigned long)p, (void *)got,
           want ? (void *)want->arena : NULL);
    return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s SEED STEPS\n", argv[0]);
    return 2;
  }
  rng = 0x9E3779B97F4A7C15ull * (uint64_t)(atoi(argv[1]) + 1);
  int steps = atoi(argv[2]);
  const uintptr_t space = (uintptr_t)1 << 40, unit = 4096;
  for (int step = 0; step < steps; step++) {
    region_t *r = &regions[next_random(&rng) % MAX_REGIONS];
    if (r->live) {
      _ia_registry_hook(&r->owner, r->arena, r->base, r->end - r->base, false);
      r->live = 0;
    } else {
      /* A third nest inside a live region (a carve-out at its base or further in), the rest stand
       * alone somewhere in the space (they may overlap others without nesting, which the
       * registry never sees from the plugin; they are kept apart here by their own range). */
      const region_t *outer = &regions[next_random(&rng) % MAX_REGIONS];
      if (outer->live && next_random(&rng) % 3 == 0 && outer->end - outer->base >= 2 * unit) {
        uintptr_t units = (outer->end - outer->base) / unit;
        uintptr_t at = next_random(&rng) % 2 ? 0 : next_random(&rng) % (units - 1);
        uintptr_t len = 1 + next_random(&rng) % (units - at - 1);
        r->base = outer->base + at * unit;
        r->end = r->base + len * unit;
        if (model_find(r->base) != outer || model_find(r->end - 1) != outer) continue; /* keep nesting proper */
      } else {
        uintptr_t slot = (uintptr_t)(r - regions);
        r->base = slot * (space / MAX_REGIONS) + (next_random(&rng) % 64) * unit;
        r->end = r->base + (1 + next_random(&rng) % 4096) * unit;
      }
      r->arena = (ia_arena_t *)(uintptr_t)(0x1000 + 16 * (uintptr_t)step);
      _ia_registry_hook(&r->owner, r->arena, r->base, r->end - r->base, true);
      r->live = 1;
    }
    for (int i = 0; i < MAX_REGIONS; i++) {
      const region_t *q = &regions[i];
      if (!q->live) continue;
      if (!check(q->base, step) || !check(q->end - 1, step) || !check(q->end, step) || !check(q->base - 1, step))
        return 1;
    }
    for (int k = 0; k < 64; k++)
      if (!check((uintptr_t)(next_random(&rng) % space), step)) return 1;
  }
  printf("ok\n");
  return 0;
}
