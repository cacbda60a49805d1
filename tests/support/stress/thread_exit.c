/* Threads that end while their thread caches hold blocks (csrc/thread_cache.c).
 *
 * Every block is claimed in an ownership map (one byte per 64 bytes of the arena) when it is handed
 * out and released before it is freed, so a block handed out twice is caught the moment the second
 * claim is made; each block also carries a canary of its address, size and allocation number,
 * checked before its free. Blocks are handed between threads through a mailbox, so frees of blocks
 * another thread allocated, including threads that have ended since, are common.
 *
 * churn: ROUNDS rounds of THREADS workers on one arena. Each worker ends one of three ways: it
 *   returns, it calls pthread_exit in the middle of its loop, or the main thread cancels it
 *   (pthread_cancel; the worker reaches pthread_testcancel once per operation). A worker that
 *   ends early posts the blocks it holds to the mailbox first (from a cleanup handler when
 *   cancelled); the blocks free in its cache must come back by themselves. While the workers run,
 *   the main thread walks the invariants (the caches' included) and reads the statistics and
 *   blocks over and over, and again after each round; at the end the mailbox is emptied and the
 *   arena must be one free block.
 * destroy: ROUNDS times, THREADS workers fill their caches from an arena, and while they wait with
 *   blocks cached and blocks live, the main thread walks the invariants, then destroys the arena and
 *   makes a new one (often
 *   at the same address); the workers forget the old blocks, work on the new arena, free all and
 *   end. A cache of the destroyed arena must be neither used nor followed into freed memory.
 *
 * usage: thread_exit churn|destroy THREADS ROUNDS OPS   (prints "ok ..." or fails) */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arena.h"
#include "xorshift.h"

#define CAPACITY ((size_t)16 << 20)
#define UNIT 64
#define HELD 48
#define MAILBOX 512

static ia_arena_t *_Atomic arena;
static uintptr_t arena_base;
static _Atomic unsigned char owner_map[CAPACITY / UNIT];
static _Atomic unsigned long canary_failures, double_handouts, bad_statuses, serials, ops_done;
static _Atomic unsigned long exits, cancels, returns;
static long ops_per_worker;

static struct {
  pthread_mutex_t lock;
  void *ptr[MAILBOX];
  size_t size[MAILBOX];
  uint64_t serial[MAILBOX];
  int count;
} mailbox = {.lock = PTHREAD_MUTEX_INITIALIZER};

typedef struct {
  void *ptr[HELD];
  size_t size[HELD];
  uint64_t serial[HELD];
} held_t;

static uint64_t word(const void *p, size_t size, uint64_t serial, size_t i) {
  uint64_t x = ((uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull) ^ size ^ (serial << 20) ^ (i * 0xD6E8FEB86659FD93ull);
  return x ^ (x >> 29);
}

/* Claims the block's units; a unit already claimed means the arena handed it out twice. */
static void claim(void *p, size_t size, uint64_t serial) {
  size_t first = ((uintptr_t)p - arena_base) / UNIT, last = ((uintptr_t)p - arena_base + size - 1) / UNIT;
  for (size_t u = first; u <= last; u++)
    if (atomic_exchange(&owner_map[u], 1)) double_handouts++;
  uint64_t *w = p;
  for (size_t i = 0; i < size / 8; i++) w[i] = word(p, size, serial, i);
}

static void check_and_release(void *p, size_t size, uint64_t serial) {
  const uint64_t *w = p;
  for (size_t i = 0; i < size / 8; i++)
    if (w[i] != word(p, size, serial, i)) {
      canary_failures++;
      break;
    }
  size_t first = ((uintptr_t)p - arena_base) / UNIT, last = ((uintptr_t)p - arena_base + size - 1) / UNIT;
  for (size_t u = first; u <= last; u++) atomic_store(&owner_map[u], 0);
}

static void release_and_free(void *p, size_t size, uint64_t serial, ia_stream_t stream) {
  check_and_release(p, size, serial);
  if (ia_arena_free(atomic_load(&arena), p, stream) != IA_OK) bad_statuses++;
}

static bool post(void *p, size_t size, uint64_t serial) {
  pthread_mutex_lock(&mailbox.lock);
  bool room = mailbox.count < MAILBOX;
  if (room) {
    mailbox.ptr[mailbox.count] = p;
    mailbox.size[mailbox.count] = size;
    mailbox.serial[mailbox.count++] = serial;
  }
  pthread_mutex_unlock(&mailbox.lock);
  return room;
}

static bool take(void **p, size_t *size, uint64_t *serial) {
  pthread_mutex_lock(&mailbox.lock);
  bool any = mailbox.count > 0;
  if (any) {
    int i = --mailbox.count;
    *p = mailbox.ptr[i];
    *size = mailbox.size[i];
    *serial = mailbox.serial[i];
  }
  pthread_mutex_unlock(&mailbox.lock);
  return any;
}

/* What a worker holds goes to the mailbox (freed there if it is full). */
static void post_all(held_t *h, ia_stream_t stream) {
  for (int i = 0; i < HELD; i++)
    if (h->ptr[i]) {
      if (!post(h->ptr[i], h->size[i], h->serial[i])) release_and_free(h->ptr[i], h->size[i], h->serial[i], stream);
      h->ptr[i] = NULL;
    }
}

static void free_all(held_t *h, ia_stream_t stream) {
  for (int i = 0; i < HELD; i++)
    if (h->ptr[i]) {
      release_and_free(h->ptr[i], h->size[i], h->serial[i], stream);
      h->ptr[i] = NULL;
    }
}

/* Sizes from 1 byte to 64 KiB, log-uniform, sometimes past what a cache keeps (32 KiB). */
static size_t random_size(uint64_t *rng) {
  uint64_t r = next_random(rng);
  unsigned bits = (unsigned)(r % 17);
  return (size_t)((r >> 8) & ((1ull << bits) - 1)) + 1;
}

/* One operation: allocate into an empty slot, or free, post or take. */
static void step(held_t *h, uint64_t *rng, ia_stream_t stream) {
  ops_done++;
  unsigned slot = (unsigned)(next_random(rng) % HELD);
  uint64_t r = next_random(rng) % 8;
  if (!h->ptr[slot]) {
    void *p;
    size_t size;
    uint64_t serial;
    if (r == 0 && take(&p, &size, &serial)) { /* a block another thread allocated, maybe a dead one */
      release_and_free(p, size, serial, stream);
      return;
    }
    size = random_size(rng);
    ia_status_t st = ia_arena_alloc(atomic_load(&arena), size, stream, &p);
    if (st == IA_ERR_OUT_OF_MEMORY) return;
    if (st != IA_OK) {
      bad_statuses++;
      return;
    }
    serial = ++serials;
    claim(p, size, serial);
    h->ptr[slot] = p;
    h->size[slot] = size;
    h->serial[slot] = serial;
  } else if (r < 2 && post(h->ptr[slot], h->size[slot], h->serial[slot])) {
    h->ptr[slot] = NULL;
  } else {
    release_and_free(h->ptr[slot], h->size[slot], h->serial[slot], stream);
    h->ptr[slot] = NULL;
  }
}

/* ---- churn -------------------------------------------------------------------------------------- */

enum { END_RETURN, END_EXIT, END_CANCEL };

typedef struct {
  int id, end;
  long exit_at; /* END_EXIT: the operation it leaves at (kept here: pthread_cleanup_push may setjmp) */
  _Atomic long done;
  held_t held;
} worker_t;

static void on_cancel(void *arg) {
  worker_t *w = arg;
  post_all(&w->held, (ia_stream_t)(w->id % 3) + 1);
  if (w->end == END_CANCEL) cancels++; /* pthread_exit runs the handler too */
}

static void *churn_worker(void *arg) {
  worker_t *w = arg;
  uint64_t rng = 0x2545F4914F6CDD1Dull * (uint64_t)(w->id + 1);
  ia_stream_t stream = (ia_stream_t)(w->id % 3) + 1; /* threads share streams too */
  w->exit_at = w->end == END_EXIT ? (long)(next_random(&rng) % (uint64_t)ops_per_worker) : -1;
  pthread_cleanup_push(on_cancel, w);
  for (long n = 0; w->end == END_CANCEL || n < ops_per_worker; n++) {
    pthread_testcancel();
    if (n == w->exit_at) {
      post_all(&w->held, stream);
      exits++;
      pthread_exit(NULL); /* with blocks free in its cache */
    }
    step(&w->held, &rng, stream);
    atomic_store(&w->done, n + 1);
  }
  pthread_cleanup_pop(0);
  free_all(&w->held, stream);
  returns++;
  return NULL;
}

/* The invariant walk, statistics and block list from a thread that is not a worker. */
static bool inspect(const char *when, int round) {
  ia_arena_t *a = atomic_load(&arena);
  char msg[512];
  if (!ia_arena_check(a, msg, sizeof msg)) {
    fprintf(stderr, "%s of round %d: invariant broken: %s\n", when, round, msg);
    return false;
  }
  ia_stats_t s;
  ia_arena_stats(a, &s);
  if (s.free_bytes + s.in_use.current != s.capacity.current) {
    fprintf(stderr, "%s of round %d: %lu free and %lu used bytes of %lu\n", when, round,
            (unsigned long)s.free_bytes, (unsigned long)s.in_use.current, (unsigned long)s.capacity.current);
    return false;
  }
  /* One listing is one moment: its blocks tile the arena, cached ones listed as free. */
  static ia_block_info_t listed[8192];
  size_t n = ia_arena_blocks(a, listed, 8192);
  uintptr_t expect = arena_base;
  for (size_t i = 0; i < n && n <= 8192; i++) {
    if (listed[i].address != expect) {
      fprintf(stderr, "%s of round %d: block list has a gap or overlap at %#lx\n", when, round,
              (unsigned long)expect);
      return false;
    }
    expect += listed[i].size;
  }
  if (n <= 8192 && expect != arena_base + CAPACITY) {
    fprintf(stderr, "%s of round %d: listed blocks cover %lu bytes\n", when, round,
            (unsigned long)(expect - arena_base));
    return false;
  }
  return true;
}

static int churn(int threads, int rounds) {
  worker_t *w = calloc((size_t)threads, sizeof *w);
  pthread_t *tid = calloc((size_t)threads, sizeof *tid);
  for (int round = 0; round < rounds; round++) {
    for (int i = 0; i < threads; i++) {
      memset(&w[i], 0, sizeof w[i]);
      w[i].id = round * threads + i;
      w[i].end = (round + i) % 3;
      pthread_create(&tid[i], NULL, churn_worker, &w[i]);
    }
    for (int i = 0; i < threads; i++) {
      if (w[i].end == END_CANCEL) {
        long want = ops_per_worker / 2;
        while (atomic_load(&w[i].done) < want) {
          if (!inspect("middle", round)) return 1;
          struct timespec pause = {0, 100000};
          nanosleep(&pause, NULL);
        }
        pthread_cancel(tid[i]);
      }
    }
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    if (!inspect("end", round)) return 1;
  }
  void *p;
  size_t size;
  uint64_t serial;
  while (take(&p, &size, &serial)) release_and_free(p, size, serial, 0);
  free(w);
  free(tid);
  return 0;
}

/* ---- destroy ------------------------------------------------------------------------------------ */

static pthread_barrier_t filled, replaced;

static void *destroy_worker(void *arg) {
  int id = (int)(uintptr_t)arg;
  uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(id + 1);
  ia_stream_t stream = (ia_stream_t)id + 1;
  held_t h = {0};
  for (long n = 0; n < ops_per_worker; n++) step(&h, &rng, stream);
  pthread_barrier_wait(&filled); /* caches hold free blocks, `h` live ones: the arena goes now */
  pthread_barrier_wait(&replaced);
  memset(&h, 0, sizeof h); /* blocks of the destroyed arena: gone with it */
  for (long n = 0; n < ops_per_worker; n++) step(&h, &rng, stream);
  free_all(&h, stream);
  return NULL;
}

static ia_arena_t *make_arena(void) {
  ia_backend_t *backend;
  ia_arena_options_t opts;
  ia_arena_default_options(&opts);
  opts.capacity = CAPACITY;
  opts.alignment = UNIT;
  opts.thread_cache = (size_t)1 << 20;
  opts.thread_cache_block = (size_t)32 << 10;
  ia_arena_t *a = NULL;
  if (ia_host_backend_create(0, &backend) != IA_OK || ia_arena_create(&opts, backend, &a) != IA_OK) {
    fprintf(stderr, "cannot create the arena\n");
    exit(3);
  }
  ia_region_info_t r;
  ia_arena_regions(a, &r, 1);
  arena_base = r.base;
  return a;
}

static int destroy(int threads, int rounds, unsigned *same_address) {
  pthread_t *tid = calloc((size_t)threads, sizeof *tid);
  for (int round = 0; round < rounds; round++) {
    pthread_barrier_init(&filled, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&replaced, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, destroy_worker, (void *)(uintptr_t)i);
    pthread_barrier_wait(&filled);
    if (!inspect("middle", round)) return 1;
    ia_arena_t *old = atomic_load(&arena);
    ia_arena_destroy(old);
    pthread_mutex_lock(&mailbox.lock);
    mailbox.count = 0; /* its blocks went with it */
    pthread_mutex_unlock(&mailbox.lock);
    memset(owner_map, 0, sizeof owner_map);
    ia_arena_t *fresh = make_arena();
    *same_address += fresh == old;
    atomic_store(&arena, fresh);
    pthread_barrier_wait(&replaced);
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    void *p;
    size_t size;
    uint64_t serial;
    while (take(&p, &size, &serial)) release_and_free(p, size, serial, 0);
    pthread_barrier_destroy(&filled);
    pthread_barrier_destroy(&replaced);
  }
  free(tid);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[1], "churn") && strcmp(argv[1], "destroy"))) {
    fprintf(stderr, "usage: %s churn|destroy THREADS ROUNDS OPS\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[2]), rounds = atoi(argv[3]);
  ops_per_worker = atol(argv[4]);
  atomic_store(&arena, make_arena());
  unsigned same_address = 0;
  int rc = !strcmp(argv[1], "churn") ? churn(threads, rounds) : destroy(threads, rounds, &same_address);
  if (rc) return rc;
  ia_arena_t *a = atomic_load(&arena);
  char msg[512];
  if (!ia_arena_check(a, msg, sizeof msg)) {
    fprintf(stderr, "invariant broken: %s\n", msg);
    return 1;
  }
  ia_stats_t s;
  ia_arena_stats(a, &s);
  if (canary_failures || double_handouts || bad_statuses) {
    fprintf(stderr, "%lu canary failures, %lu blocks handed out twice, %lu refused frees or allocations\n",
            (unsigned long)canary_failures, (unsigned long)double_handouts, (unsigned long)bad_statuses);
    return 1;
  }
  /* Every thread has ended: whatever their caches kept must be back and merged. */
  if (s.free_blocks != 1 || s.largest_free != CAPACITY || s.in_use.current != 0 || s.blocks.current != 0) {
    fprintf(stderr, "arena not back to one free block: %lu free blocks, %lu bytes in %lu blocks in use\n",
            (unsigned long)s.free_blocks, (unsigned long)s.in_use.current, (unsigned long)s.blocks.current);
    return 1;
  }
  printf("ok %lu ops %lu served %lu returned %lu exited %lu cancelled %u same-address\n",
         (unsigned long)ops_done, (unsigned long)s.blocks.allocated, (unsigned long)returns,
         (unsigned long)exits, (unsigned long)cancels, same_address);
  ia_arena_destroy(a);
  return 0;
}
