/* indexer-arena: the one public header of the C core. The budget arena (arena/arena.h) and
 * PyTorch's allocator built on it (torch/allocator.h); what only the tests reach is in
 * testing/testing.h. csrc/README.md says which file does what. */
#ifndef INDEXER_ARENA_PUBLIC_H
#define INDEXER_ARENA_PUBLIC_H

#include "arena/arena.h"
#include "torch/allocator.h"

#endif /* INDEXER_ARENA_PUBLIC_H */
