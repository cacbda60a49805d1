/* Canaries for the harnesses: a block's bytes carry a tag of its address and size, so a block
 * handed out twice, or written by another block's owner, is caught when it is checked. */
#ifndef INDEXER_ARENA_CANARY_H
#define INDEXER_ARENA_CANARY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

static inline unsigned char canary_tag(const void *p, size_t size) {
  return (unsigned char)(((uintptr_t)p >> 8) ^ size);
}

/* Every 61st byte: enough to catch a block handed out twice, cheap enough for millions of bytes. */
static inline void canary_fill(void *p, size_t size) {
  unsigned char *b = p, t = canary_tag(p, size);
  for (size_t i = 0; i < size; i += 61) b[i] = t;
}

static inline bool canary_intact(const void *p, size_t size) {
  const unsigned char *b = p, want = canary_tag(p, size);
  for (size_t i = 0; i < size; i += 61)
    if (b[i] != want) return false;
  return true;
}

#endif
