/* The size classes (_ia_class_of, csrc/arena/internal.h) against their definition: the first level's
 * classes are IA_ALIGN bytes wide below 2^IA_FL_SHIFT; above, level fl holds [2^(fl+IA_FL_SHIFT-1),
 * 2^(fl+IA_FL_SHIFT)) cut into IA_SL_COUNT classes of equal width. Every size up to 2^24 and random
 * sizes of every magnitude up to 2^64 - 1 must land in the class whose range holds them.
 * usage: class_check SEED STEPS        prints "ok" or the first size filed wrongly. */
#include <stdio.h>
#include <stdlib.h>

#include "arena/private.h"
#include "xorshift.h"

static uint64_t rng;

/* The first size of class (fl, sl), as a 128-bit number: the last level's top is 2^64. */
static unsigned __int128 class_start(unsigned fl, unsigned sl) {
  if (fl == 0) return (unsigned __int128)sl << IA_ALIGN_SHIFT;
  unsigned shift = fl + IA_FL_SHIFT - 1;
  return ((unsigned __int128)1 << shift) + ((unsigned __int128)sl << (shift - IA_SL_BITS));
}

static int check(size_t size) {
  unsigned fl, sl;
  _ia_class_of(size, &fl, &sl);
  unsigned next_fl = sl + 1 < IA_SL_COUNT ? fl : fl + 1, next_sl = sl + 1 < IA_SL_COUNT ? sl + 1 : 0;
  if (fl < IA_FL_COUNT && sl < IA_SL_COUNT && class_start(fl, sl) <= size && size < class_start(next_fl, next_sl))
    return 1;
  printf("size %zu filed in class %u/%u\n", size, fl, sl);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  rng = strtoull(argv[1], NULL, 10) * 0x9E3779B97F4A7C15ull | 1;
  long steps = atol(argv[2]);
  for (size_t size = 0; size < ((size_t)1 << 24); size++)
    if (!check(size)) return 1;
  for (unsigned bit = 0; bit < 64; bit++) /* each power of two and its neighbours */
    for (int d = -1; d <= 1; d++)
      if (!check(((size_t)1 << bit) + (size_t)d)) return 1;
  for (long i = 0; i < steps; i++) {
    uint64_t r = next_random(&rng);
    if (!check((size_t)(next_random(&rng) >> (r & 63)))) return 1;
  }
  printf("ok\n");
  return 0;
}
