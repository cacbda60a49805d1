/* The growth limits at their edge, with limits that are not a whole number of regions: an arena's
 * own (ia_arena_options_t.limit) and its device's totals (ia_totals_t.limit, which
 * torch.cuda.set_per_process_memory_fraction sets). Growth that lands exactly on a limit is served;
 * growth one byte past it is refused with IA_ERR_LIMIT, whichever arena of the group grows.
 * usage: limit_check       prints "ok" or the first case that went wrong. */
#include <stdio.h>
#include <string.h>

#include "arena/internal.h"

#define MiB ((size_t)1 << 20)

static ia_arena_t *growable(size_t limit) {
  ia_arena_options_t o;
  ia_arena_default_options(&o);
  o.capacity = 0, o.growable = true, o.region_min = MiB, o.region_round = MiB, o.region_exact_above = MiB;
  o.limit = limit;
  ia_backend_t *b;
  ia_arena_t *a;
  if (ia_host_backend_create(0, &b) != IA_OK || ia_arena_create(&o, b, &a) != IA_OK) return NULL;
  return a;
}

/* Two arenas of one group (or one arena with its own limit) take 2 MiB, then one of them asks 1 MiB
 * more: capacity would reach 3 MiB, which `limit` allows or not. */
static int edge(size_t limit, bool grouped, ia_status_t want) {
  ia_totals_t totals;
  memset(&totals, 0, sizeof totals);
  pthread_mutex_init(&totals.lock, NULL);
  atomic_store(&totals.limit, grouped ? limit : 0);
  ia_arena_t *a = growable(grouped ? 0 : limit), *b = growable(0);
  if (!a || !b) return printf("no arena\n"), 0;
  if (grouped) _ia_arena_set_totals(a, &totals), _ia_arena_set_totals(b, &totals);
  void *p, *q, *r;
  ia_arena_t *second = grouped ? b : a;
  if (ia_arena_alloc(a, MiB, 0, &p) != IA_OK || ia_arena_alloc(second, MiB, 0, &q) != IA_OK)
    return printf("limit %zu%s: the first 2 MiB refused\n", limit, grouped ? " (totals)" : ""), 0;
  ia_status_t got = ia_arena_alloc(second, MiB, 0, &r);
  if (got != want)
    return printf("limit %zu%s: growth to 3 MiB gave %s, expected %s\n", limit, grouped ? " (totals)" : "",
                  ia_status_str(got), ia_status_str(want)), 0;
  ia_stats_t s;
  ia_arena_stats(second, &s);
  if (want == IA_ERR_LIMIT && s.requests_failed != 1) return printf("refusal not counted\n"), 0;
  ia_arena_destroy(a), ia_arena_destroy(b);
  return 1;
}

int main(void) {
  for (int grouped = 0; grouped <= 1; grouped++) {
    if (!edge(3 * MiB, grouped, IA_OK) || !edge(3 * MiB - 1, grouped, IA_ERR_LIMIT) ||
        !edge(3 * MiB + 1, grouped, IA_OK) || !edge(2 * MiB + 1, grouped, IA_ERR_LIMIT))
      return 1;
  }
  printf("ok\n");
  return 0;
}
