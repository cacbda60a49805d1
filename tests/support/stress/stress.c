/* Multi-threaded stress of the arena: threads allocate blocks of mixed sizes on their own stream,
 * fill each with a canary derived from its address and size, and hand about a third of them to
 * other threads through a shared mailbox; whoever frees a block first checks its canary. At the
 * end every block is freed and the arena must be one free block again.
 *
 * With "mapped", the arena maps 64 KiB pages of one address range (the host backend's simulation,
 * holding at most CAPACITY_MIB) and the first thread also gives cached pages back every 1,024
 * operations while the others allocate; at the end everything must unmap, with no call the driver
 * would refuse.
 *
 * usage: stress THREADS OPS_PER_THREAD CAPACITY_MIB [mapped]
 *        (prints "ok <ops> <ms>" or fails) */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arena/arena.h"
#include "xorshift.h"

#define MAILBOX 4096
#define HELD 64

static ia_arena_t *arena;
static size_t capacity;
static long ops_per_thread;
static bool mapped;

static struct {
  pthread_mutex_t lock;
  void *ptr[MAILBOX];
  size_t size[MAILBOX];
  size_t head, count;
} mailbox = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Atomic unsigned long total_ops, canary_failures, oom_count;

static uint64_t canary(uintptr_t p, size_t size, size_t i) {
  uint64_t x = (uint64_t)p * 0x9E3779B97F4A7C15ull ^ size ^ (i * 0xD6E8FEB86659FD93ull);
  return x ^ (x >> 29);
}

static void fill(void *p, size_t size) {
  uint64_t *w = p;
  for (size_t i = 0; i < size / 8; i++) w[i] = canary((uintptr_t)p, size, i);
  for (size_t i = size & ~(size_t)7; i < size; i++) ((unsigned char *)p)[i] = (unsigned char)(i ^ size);
}

static void verify_and_free(void *p, size_t size, ia_stream_t stream) {
  const uint64_t *w = p;
  for (size_t i = 0; i < size / 8; i++)
    if (w[i] != canary((uintptr_t)p, size, i)) {
      canary_failures++;
      break;
    }
  for (size_t i = size & ~(size_t)7; i < size; i++)
    if (((unsigned char *)p)[i] != (unsigned char)(i ^ size)) canary_failures++;
  if (ia_arena_free(arena, p, stream) != IA_OK) {
    fprintf(stderr, "free of %p failed\n", p);
    exit(3);
  }
}

/* Log-uniform sizes from 1 byte to 64 KiB, with an occasional large block. */
static size_t random_size(uint64_t *rng) {
  uint64_t r = next_random(rng);
  if (r % 512 == 0) return (size_t)(r >> 20) % (capacity / 16) + 1;
  unsigned bits = (unsigned)(r % 17);
  return (size_t)((r >> 8) & ((1ull << bits) - 1)) + 1;
}

static void *worker(void *arg) {
  uint64_t rng = 0x1234567ull + (uintptr_t)arg * 0x9E3779B97F4A7C15ull;
  ia_stream_t stream = (ia_stream_t)arg + 1;
  void *held[HELD] = {0};
  size_t held_size[HELD] = {0};
  for (long n = 0; n < ops_per_thread; n++) {
    unsigned slot = (unsigned)(next_random(&rng) % HELD);
    if (held[slot]) {
      uint64_t r = next_random(&rng) % 3;
      if (r == 0) { /* hand it to whoever takes from the mailbox next */
        pthread_mutex_lock(&mailbox.lock);
        if (mailbox.count < MAILBOX) {
          size_t i = (mailbox.head + mailbox.count++) % MAILBOX;
          mailbox.ptr[i] = held[slot];
          mailbox.size[i] = held_size[slot];
          held[slot] = NULL;
        }
        pthread_mutex_unlock(&mailbox.lock);
      }
      if (held[slot]) {
        verify_and_free(held[slot], held_size[slot], stream);
        held[slot] = NULL;
      }
    } else if (next_random(&rng) % 4 == 0) { /* take a block another thread handed over */
      void *p = NULL;
      size_t size = 0;
      pthread_mutex_lock(&mailbox.lock);
      if (mailbox.count) {
        p = mailbox.ptr[mailbox.head];
        size = mailbox.size[mailbox.head];
        mailbox.head = (mailbox.head + 1) % MAILBOX;
        mailbox.count--;
      }
      pthread_mutex_unlock(&mailbox.lock);
      if (p) verify_and_free(p, size, stream);
    } else {
      size_t size = random_size(&rng);
      void *p;
      ia_status_t st = ia_arena_alloc(arena, size, stream, &p);
      if (st == IA_OK) {
        fill(p, size);
        held[slot] = p;
        held_size[slot] = size;
      } else if (st == IA_ERR_OUT_OF_MEMORY || (mapped && st == IA_ERR_BACKEND_OUT_OF_MEMORY)) {
        oom_count++;
      } else {
        fprintf(stderr, "alloc failed: %s\n", ia_status_str(st));
        exit(3);
      }
    }
    total_ops++;
    if (mapped && arg == NULL && n % 1024 == 1023) ia_arena_release_cached(arena);
  }
  for (unsigned i = 0; i < HELD; i++)
    if (held[i]) verify_and_free(held[i], held_size[i], stream);
  return NULL;
}

int main(int argc, char **argv) {
  mapped = argc == 5 && strcmp(argv[4], "mapped") == 0;
  if (argc != 4 && !mapped) {
    fprintf(stderr, "usage: %s THREADS OPS_PER_THREAD CAPACITY_MIB [mapped]\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[1]);
  ops_per_thread = atol(argv[2]);
  capacity = (size_t)atol(argv[3]) << 20;
  ia_backend_t *backend;
  ia_arena_options_t opts;
  ia_arena_default_options(&opts);
  opts.capacity = capacity;
  opts.alignment = 64;
  if (mapped) opts.capacity = 0, opts.growable = true, opts.address_range = 4 * capacity;
  ia_status_t st = mapped ? ia_host_mapping_backend_create(capacity, 64 << 10, &backend)
                          : ia_host_backend_create(0, &backend);
  if (st != IA_OK || ia_arena_create(&opts, backend, &arena) != IA_OK) {
    fprintf(stderr, "cannot create the arena\n");
    return 3;
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pthread_t tid[64];
  for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, worker, (void *)(uintptr_t)i);
  for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
  while (mailbox.count) {
    verify_and_free(mailbox.ptr[mailbox.head], mailbox.size[mailbox.head], 0);
    mailbox.head = (mailbox.head + 1) % MAILBOX;
    mailbox.count--;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  char msg[512];
  if (!ia_arena_check(arena, msg, sizeof msg)) {
    fprintf(stderr, "invariant broken: %s\n", msg);
    return 1;
  }
  ia_stats_t s;
  ia_arena_stats(arena, &s);
  if (canary_failures) {
    fprintf(stderr, "%lu canary failures\n", (unsigned long)canary_failures);
    return 1;
  }
  if (mapped) { /* nothing live: every page goes, and the backend saw nothing it would refuse */
    ia_mapping_counters_t c;
    ia_arena_release_cached(arena);
    ia_arena_stats(arena, &s);
    ia_host_mapping_counters(backend, &c);
    if (s.capacity.current || s.regions.current || c.mapped || c.errors || s.in_use.current) {
      fprintf(stderr, "mapping not back to nothing: capacity %lu, %lu stretches, %lu mapped, %lu errors\n",
              (unsigned long)s.capacity.current, (unsigned long)s.regions.current, (unsigned long)c.mapped, (unsigned long)c.errors);
      return 1;
    }
  } else if (s.free_blocks != 1 || s.largest_free != capacity || s.in_use.current != 0) {
    fprintf(stderr, "arena not back to one free block: %lu free blocks, %lu in use\n",
            (unsigned long)s.free_blocks, (unsigned long)s.in_use.current);
    return 1;
  }
  double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
  printf("ok %lu ops %.1f ms %lu oom %lu served %lu waits\n", (unsigned long)total_ops, ms,
         (unsigned long)oom_count, (unsigned long)s.blocks.allocated, (unsigned long)s.stream_waits);
  ia_arena_destroy(arena);
  return 0;
}
