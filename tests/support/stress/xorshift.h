/* The harnesses' random numbers: xorshift64, one state word per user (threads keep their own). */
#pragma once
#include <stdint.h>

static inline uint64_t next_random(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}
