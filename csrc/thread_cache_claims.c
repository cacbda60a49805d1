/* How threads other than a cache's owner get into the cache, and how the owner keeps them out.
 *
 * Why not a lock. The owner's fast path enters its cache on every allocation and free, and an
 * atomic exchange there is a full barrier on every one (benchmarks/RESULTS.md times the
 * difference). Other threads touch a cache rarely: statistics, drains, a capture's start, taking
 * blocks back from other threads' caches when a request fits nowhere else. So the cost goes to
 * them.
 *
 * The protocol. The owner marks itself busy with a plain store, then reads whether the cache is
 * claimed (_ia_tcache_enter); it leaves with a release store. A claimer always holds the arena's
 * lock: it marks its claim, makes every running thread of the process pass a full barrier
 * (membarrier's private expedited command; a thread not running passed one when it was switched
 * out), and waits for the owner to be not busy. The barrier stands in for the fence the owner left
 * out between its store and its load, so of the two one sees the other (Dekker): either the owner
 * sees the claim and waits for its end, or the claimer sees the owner busy and waits for it to
 * leave. The owner itself never claims: everyone else holds the arena's lock to touch its cache, so
 * while the owner holds that lock the cache is its own, and claim and release pass over it.
 *
 * A free by another thread of a block lent to a cache claims nothing: the block joins the cache's
 * remote frees, guarded by the arena's lock alone, which the owner's fast path never reads; the
 * arena completes those frees when it next settles the cache (arena_caches.c: collect).
 *
 * Where the barrier is not available (not Linux, a kernel without it, ThreadSanitizer, which
 * cannot see it, or a build with IA_NO_MEMBARRIER=1), busy is a spinlock that both sides take
 * with an exchange. */
#define _GNU_SOURCE
#include <pthread.h>

#include "thread_cache.h"

#if defined(__SANITIZE_THREAD__) /* gcc */
#define IA_TSAN 1
#elif defined(__has_feature) /* clang */
#if __has_feature(thread_sanitizer)
#define IA_TSAN 1
#endif
#endif
#if defined(__linux__) && !IA_TSAN && !IA_NO_MEMBARRIER && __has_include(<linux/membarrier.h>)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

static long membarrier(int cmd) { return syscall(__NR_membarrier, cmd, 0, 0); }
static bool asymmetric;
static pthread_once_t asymmetric_once = PTHREAD_ONCE_INIT;
static void register_barrier(void) { asymmetric = membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0; }

bool _ia_tcache_asymmetric(void) {
  pthread_once(&asymmetric_once, register_barrier);
  return asymmetric;
}

/* Every running thread of the process passes a full barrier. A fork's child may not have inherited
 * the registration: it registers again, or takes the global command, slower but always there. */
static void process_barrier(void) {
  if (membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return;
  if (membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 && membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
    return;
  ia_assert(membarrier(MEMBARRIER_CMD_GLOBAL) == 0);
}
#else
bool _ia_tcache_asymmetric(void) { return false; }
static void process_barrier(void) {}
#endif

const char *ia_thread_cache_protocol(void) { return _ia_tcache_asymmetric() ? "membarrier" : "exchange"; }

void _ia_tcache_claim(_ia_tcache_t *const *caches, size_t n) {
  bool barrier = false;
  for (size_t i = 0; i < n; i++) {
    _ia_tcache_t *c = caches[i];
    unsigned spins = 0;
    if (_ia_tcache_mine(c)) continue;
    if (c->asymmetric) atomic_store(&c->claimed, 1);
    else
      while (atomic_exchange_explicit(&c->busy, 1, memory_order_acquire)) _ia_tcache_back_off(&spins);
    barrier |= c->asymmetric;
  }
  if (barrier) process_barrier(); /* one for all the caches */
  for (size_t i = 0; i < n; i++) {
    unsigned spins = 0;
    if (caches[i]->asymmetric && !_ia_tcache_mine(caches[i]))
      while (atomic_load_explicit(&caches[i]->busy, memory_order_acquire)) _ia_tcache_back_off(&spins);
  }
}

void _ia_tcache_release(_ia_tcache_t *const *caches, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!_ia_tcache_mine(caches[i]))
      atomic_store_explicit(caches[i]->asymmetric ? &caches[i]->claimed : &caches[i]->busy, 0, memory_order_release);
}

bool _ia_tcache_may_hold(const _ia_tcache_t *c) {
  return c->remote_frees || __atomic_load_n(&c->free_blocks, __ATOMIC_RELAXED);
}

void _ia_tcache_free_remotely(_ia_tcache_t *c, _ia_block_t *b) {
  b->freed_remotely = true;
  b->free_next = c->remote_frees;
  c->remote_frees = b;
}

_ia_block_t *_ia_tcache_take_remote_frees(_ia_tcache_t *c) {
  _ia_block_t *list = c->remote_frees;
  c->remote_frees = NULL;
  return list;
}
