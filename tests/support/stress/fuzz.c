/* Random operation sequences against the core, for a build with -fsanitize=address,undefined:
 * a fixed and a growable arena on the host backend and a growable arena over its page mapping
 * (allocations of any size on a few streams, frees of live, freed, interior and foreign pointers,
 * record_stream, release_cached, allocation at an address, stream completion), and the plugin's
 * graph pools on host memory (begin, a simulated capture, allocations in the pool and eagerly,
 * frees held back and run, release, checkpoint and restore, a side stream forked and joined in
 * the capture's graph with record_stream reuse on), its general pools mapped for even seeds. The mapping arenas write a canary byte at both ends of every block, so a block on an
 * unmapped page faults, and check it at the free; their backends must have refused no call and
 * hold exactly the arena's capacity, and with nothing live a release must unmap every page. The
 * invariant walk runs every 64 operations; any broken invariant, sanitizer report or wrong status
 * ends the run.
 *
 * usage: fuzz SEED OPERATIONS   (prints "ok" or fails) */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testing/testing.h"

#define LIVE 256
#define STREAM_NONE ((ia_stream_t)UINTPTR_MAX) /* free on the block's own stream */

/* The plugin raises out-of-memory through this hook and holds no lock then: jump back out. */
static jmp_buf refused;
static void raise_oom(const char *message) {
  (void)message;
  longjmp(refused, 1);
}

static unsigned long long rng_state;
static unsigned long long next(void) { /* splitmix64 */
  unsigned long long z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static size_t below(size_t n) { return n ? (size_t)(next() % n) : 0; }

static void fail(const char *what, long op) {
  fprintf(stderr, "fuzz: %s at operation %ld\n", what, op);
  exit(1);
}

static size_t any_size(void) {
  switch (below(6)) {
    case 0: return below(64);
    case 1: return below(4096);
    case 2: return below(1 << 20);
    case 3: return below(8 << 20);
    case 4: return (size_t)1 << below(63);
    default: return (size_t)next();
  }
}

typedef struct {
  ia_arena_t *arena;
  ia_backend_t *host;
  void *live[LIVE];
  size_t size[LIVE];
  int n;
  bool mapped; /* over the host backend's page mapping: canaries, and the mapping checked */
} subject_t;

static void check(ia_arena_t *a, long op) {
  char msg[512];
  if (!ia_arena_check(a, msg, sizeof msg)) fail(msg, op);
}

static unsigned char canary(const void *p) { return (unsigned char)((uintptr_t)p >> 9 ^ 0x5A); }

static void keep(subject_t *s, void *p, size_t size) {
  if (s->mapped) ((unsigned char *)p)[0] = ((unsigned char *)p)[size - 1] = canary(p);
  s->live[s->n] = p;
  s->size[s->n++] = size;
}

static void check_mapping(subject_t *s, long op) {
  ia_mapping_counters_t c;
  ia_stats_t st;
  ia_host_mapping_counters(s->host, &c);
  ia_arena_stats(s->arena, &st);
  if (c.errors) fail("the arena made a mapping call the driver refuses", op);
  if (c.mapped != (uint64_t)st.capacity.current) fail("the backend maps other than the arena's capacity", op);
  for (int i = 0; i < s->n; i++)
    if (!ia_host_range_mapped(s->host, (uintptr_t)s->live[i], s->size[i])) fail("a live block is not mapped", op);
}

static void forget(subject_t *s, int i, long op) {
  const unsigned char *p = s->live[i];
  if (s->mapped && (p[0] != canary(p) || p[s->size[i] - 1] != canary(p))) fail("a canary changed", op);
  s->live[i] = s->live[--s->n];
  s->size[i] = s->size[s->n];
}

static void arena_step(subject_t *s, long op) {
  ia_stream_t stream = below(4);
  void *p;
  switch (below(9)) {
    case 0: case 1: case 2: {
      size_t size = any_size();
      ia_status_t st = ia_arena_alloc(s->arena, size, stream, &p);
      if (st == IA_OK && p && s->n < LIVE) keep(s, p, size);
      else if (st == IA_OK && p && ia_arena_free(s->arena, p, stream) != IA_OK) fail("free of a new block", op);
      else if (st != IA_OK && st != IA_ERR_OUT_OF_MEMORY && st != IA_ERR_BACKEND_OUT_OF_MEMORY && st != IA_ERR_LIMIT)
        fail(ia_status_str(st), op);
      break;
    }
    case 3: case 4:
      if (s->n) {
        int i = (int)below((size_t)s->n);
        void *q = s->live[i];
        forget(s, i, op);
        if (ia_arena_free(s->arena, q, below(5) ? stream : STREAM_NONE) != IA_OK) fail("free of a live block", op);
        if (!below(8) && ia_arena_free(s->arena, q, stream) != IA_ERR_DOUBLE_FREE)
          fail("a second free was not refused", op);
      }
      break;
    case 5: { /* bad frees: inside a live block (every block spans the alignment at least), foreign */
      size_t inside = ia_arena_alignment(s->arena) - 1;
      uintptr_t q = s->n ? (uintptr_t)s->live[below((size_t)s->n)] + 1 + below(inside) : (uintptr_t)next();
      ia_status_t st = ia_arena_free(s->arena, (void *)q, stream);
      if (st == IA_OK) fail("a bad pointer was freed", op);
      break;
    }
    case 6:
      if (s->n) ia_arena_record_stream(s->arena, s->live[below((size_t)s->n)], below(6));
      break;
    case 7:
      ia_arena_release_cached(s->arena);
      ia_host_complete(s->host, below(6));
      break;
    default: { /* allocation at an address: anywhere in or near a region */
      ia_region_info_t r[8];
      size_t n = ia_arena_regions(s->arena, r, 8);
      if (!n) break;
      ia_region_info_t pick = r[below(n < 8 ? n : 8)];
      uintptr_t at = (pick.base + below(pick.size + 4096)) & ~(uintptr_t)(ia_arena_alignment(s->arena) - 1);
      size_t size = any_size() % (1 << 22) + 1;
      ia_status_t st = ia_arena_alloc_at(s->arena, (void *)at, size, stream);
      if (st == IA_OK && s->n < LIVE) keep(s, (void *)at, size);
      else if (st == IA_OK) ia_arena_free(s->arena, (void *)at, stream);
    }
  }
  if (op % 64 == 0) check(s->arena, op);
  if (op % 64 == 0 && s->mapped) check_mapping(s, op);
}

static void drain(subject_t *s, long op) {
  while (s->n) {
    void *p = s->live[s->n - 1];
    forget(s, s->n - 1, op);
    if (ia_arena_free(s->arena, p, STREAM_NONE) != IA_OK) fail("drain", op);
  }
  check(s->arena, op);
  if (s->mapped) {
    ia_arena_release_cached(s->arena); /* nothing live: everything goes */
    ia_stats_t st;
    ia_arena_stats(s->arena, &st);
    if (st.capacity.current || st.regions.current) fail("pages stayed mapped with nothing live", op);
    check_mapping(s, op);
  }
}

/* ---- the plugin's graph pools on host memory ---------------------------------------------------- */

static void *plugin_live[LIVE];
static bool plugin_in_graph[LIVE]; /* allocated in a graph pool */
static int plugin_n;

/* Blocks of graph pools freed while pool `id` captured: its graph may use them at every replay,
 * so they must stay mapped for as long as the pool is in use (after that they are forgotten). */
static struct {
  ia_pool_id_t id;
  unsigned char *p;
} touched[LIVE];
static int touched_n;

static void replay_touched(void) {
  for (int i = 0; i < touched_n;) {
    if (ia_graph_use_count(0, touched[i].id) == 0) {
      touched[i] = touched[--touched_n];
      continue;
    }
    touched[i++].p[0] ^= 1; /* a replay writes it: a fault if it was given back */
  }
}

static void plugin_step(long op) {
  static int capturing;
  uint64_t violations = ia_host_capture_violations(); /* the standalone arenas may add their own */
  static ia_pool_id_t id;
  static ia_stream_t stream = 77, side = 78; /* side: forked from stream inside captures */
  static uint64_t capture_id;
  switch (below(8)) {
    case 0:
      if (!capturing) {
        id = (ia_pool_id_t){.first = 1 + below(3), .second = 0};
        if (ia_graph_begin(0, id) != IA_OK) fail("begin", op);
        ia_host_capture_begin(stream, ++capture_id);
        capturing = 1;
      }
      break;
    case 1:
      if (capturing) {
        ia_host_capture_end(side);
        ia_host_capture_end(stream);
        if (ia_graph_end(0, id) != IA_OK) fail("end", op);
        if (below(2) && ia_graph_release(0, id) != IA_OK) fail("release", op);
        capturing = 0;
      }
      break;
    case 2: case 3: {
      size_t size = below(4) ? below(1 << 20) + 1 : below(24 << 20) + 1;
      bool workspace = below(4) == 0;
      if (workspace) ia_workspace_enter();
      void *p = NULL;
      if (!setjmp(refused))
        p = ia_torch_alloc(size, 0, (void *)(capturing ? stream : below(3)), capturing ? &id : NULL);
      if (workspace) ia_workspace_exit();
      if (p && plugin_n < LIVE) {
        plugin_in_graph[plugin_n] = capturing;
        plugin_live[plugin_n++] = p;
      } else if (p) {
        ia_torch_free(p);
      }
      break;
    }
    case 4: case 5:
      if (plugin_n) {
        int i = (int)below((size_t)plugin_n);
        if (below(4) == 0) ia_torch_record_stream(plugin_live[i], (void *)(capturing && below(2) ? side : below(3)));
        if (capturing && plugin_in_graph[i] && touched_n < LIVE)
          touched[touched_n++] = (typeof(touched[0])){id, plugin_live[i]};
        ia_torch_free(plugin_live[i]);
        plugin_n--;
        plugin_live[i] = plugin_live[plugin_n];
        plugin_in_graph[i] = plugin_in_graph[plugin_n];
      }
      break;
    case 6:
      ia_torch_empty_cache();
      break;
    default:
      if (capturing) { /* the capture's graph: work on either stream, a fork, a join */
        switch (below(4)) {
          case 0: ia_host_capture_launch(stream); break;
          case 1: ia_host_capture_launch(side); break;
          case 2: ia_host_capture_wait(side, stream); break;
          default: ia_host_capture_wait(stream, side);
        }
      } else { /* a checkpoint of a pool, its live blocks freed, then restored */
        ia_pool_id_t pid = {.first = 1 + below(3), .second = 0};
        size_t n = ia_graph_blocks(0, pid, NULL, 0);
        ia_block_info_t *saved = calloc(n + 1, sizeof *saved);
        if (n && ia_graph_blocks(0, pid, saved, n) == n) {
          ia_status_t st = ia_graph_restore(0, pid, saved, n);
          if (st != IA_OK) fail("restore", op);
        }
        free(saved);
        char msg[512];
        if (!ia_graph_check(0, pid, msg, sizeof msg)) fail(msg, op);
      }
  }
  if (!capturing) replay_touched();
  if (ia_host_capture_violations() != violations) fail("the plugin broke a capture rule", op);
}

/* A refused ia_arena_create still owns its backend and must leave nothing behind: bad options,
 * and a first reservation the backend refuses. LeakSanitizer (on with ASan) checks at exit. */
static void refused_creations(void) {
  for (int i = 0; i < 64; i++) {
    ia_arena_options_t o;
    ia_arena_default_options(&o);
    o.capacity = (size_t)(1 + below(64)) << 20;
    o.alignment = (size_t)16 << below(8);
    switch (below(4)) {
      case 0: o.alignment += 16; break;                            /* not a power of two */
      case 1: o.capacity = (size_t)1 << 63; break;                 /* past the core's bound */
      case 2: o.growable = true, o.region_min = o.alignment * 3 / 2; break; /* off the alignment */
      default: break;                                              /* the backend refuses */
    }
    ia_backend_t *host;
    if (ia_host_backend_create(512 << 10, &host) != IA_OK) fail("host backend", i);
    ia_arena_t *arena = (ia_arena_t *)1;
    if (ia_arena_create(&o, host, &arena) == IA_OK || arena) fail("a refused creation made an arena", i);
  }
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s SEED OPERATIONS\n", argv[0]);
    return 2;
  }
  rng_state = strtoull(argv[1], NULL, 10);
  long ops = atol(argv[2]);
  refused_creations();
  /* fixed, growable, mapping */
  subject_t subjects[3] = {{0}};
  for (int i = 0; i < 3; i++) {
    int kind = i;
    ia_arena_options_t o;
    ia_arena_default_options(&o);
    o.alignment = (size_t)256 << (kind == 1);
    if (kind == 0) o.capacity = 16 << 20;
    else o.growable = true, o.region_min = 2 << 20, o.region_exact_above = 4 << 20, o.limit = 64 << 20;
    /* The mapping arena: 64 KiB pages, a range wider than its limit, a backend that fits less. */
    if (kind == 2) o.address_range = 256 << 20, o.limit = 96 << 20, subjects[i].mapped = true;
    ia_status_t st = kind == 2 ? ia_host_mapping_backend_create(48 << 20, 64 << 10, &subjects[i].host)
                               : ia_host_backend_create(128 << 20, &subjects[i].host);
    if (st != IA_OK) return 1;
    ia_host_set_auto_complete(subjects[i].host, kind == 0);
    if (ia_arena_create(&o, subjects[i].host, &subjects[i].arena) != IA_OK) return 1;
  }
  ia_plugin_config_t c = {.budget = 32 << 20, .alignment = 256, .host_memory = 1, .raise_oom = raise_oom,
                          .expandable = rng_state % 2 == 0, .address_range = (size_t)1 << 30,
                          .host_page_size = 64 << 10};
  if (ia_plugin_configure(&c) != IA_OK) return 1;
  ia_graph_set_record_stream_reuse(true);
  for (long op = 0; op < ops; op++) {
    int which = (int)below(6);
    if (which < 3) arena_step(&subjects[which], op);
    else plugin_step(op);
  }
  for (int i = 0; i < 3; i++) {
    drain(&subjects[i], ops);
    ia_arena_destroy(subjects[i].arena);
  }
  printf("ok\n");
  return 0;
}
