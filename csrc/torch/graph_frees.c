/* Frees held back while a stream of the device captures a CUDA graph.
 *
 * Frees that would make an eager arena record an event on a capturing stream (a block of a
 * capturing stream) or that must order other streams (record_stream) wait until the device's last
 * capture ends. With PyTorch's graph_capture_record_stream_reuse, a graph pool's block freed while
 * every stream that used it captures one capture comes back sooner, inside the capture: the nodes
 * those streams had captured when it was freed (its markers) are its last uses, and once all of
 * them are ancestors of what its own stream captures next (the capture's graph joined the
 * streams), an allocation on that stream may reuse it with no event, the graph's edges ordering
 * the reuse after the uses. Only a pool's block: its arena serves that one stream, where an eager
 * arena would hand the block to any stream, which the graph does not order.
 *
 * Locking: the device's held-frees lock (its record's held.lock) guards its held frees and what
 * the walks of its captures' graphs found; the capture graph is read under it, arenas are called
 * outside it, and the graph lock is never taken under it nor it under the graph lock. The lock
 * order: Note [Device lifetime] (csrc/torch/plugin.h).
 */
#include <pthread.h>
#include <stdlib.h>

#include "plugin.h"

typedef struct _ia_held_free {
  ia_arena_t *arena;
  const _ia_owner_t *owner;
  void *ptr;
  ia_stream_t stream;   /* the block's own: only an allocation on it may reuse the block early */
  uint64_t capture;     /* whose graph the markers are in; 0: the free waits for the captures' end */
  const void **markers; /* malloc'd */
  size_t n_markers;
} held_free_t;

/* A set of graph nodes: open addressing, a power-of-two table at most half full. */
typedef struct {
  const void **slots;
  size_t cap, n;
} node_set_t;

/* The nodes found to precede a capturing stream's next work so far. They only grow while the
 * capture lasts (a stream's new work follows its earlier work), so each walk stops at nodes seen. */
typedef struct _ia_reach {
  uint64_t capture;
  ia_stream_t stream;
  node_set_t ancestors;
} reach_t;

static _Atomic bool record_stream_reuse;

typedef _ia_device_held_t held_frees_t;

/* The device's held frees (plugin.h); NULL for a device outside 0 to IA_MAX_DEVICES - 1. */
static held_frees_t *held_of(int device) {
  _ia_device_t *dev = _ia_device(device);
  return dev ? &dev->held : NULL;
}

static void forget_reach(held_frees_t *f) {
  for (size_t i = 0; i < f->n_reach; i++) free(f->reach[i].ancestors.slots);
  free(f->reach);
  f->reach = NULL;
  f->n_reach = f->cap_reach = 0;
}

void _ia_graph_run_held(int device) {
  held_frees_t *f = held_of(device);
  ia_totals_t *t = &_ia_device(device)->totals;
  for (;;) {
    pthread_mutex_lock(&f->lock);
    held_free_t h = {0};
    bool any = f->n_held > 0 && atomic_load(&t->captures) == 0;
    if (any) h = f->held[--f->n_held];
    if (!any && atomic_load(&t->captures) == 0) forget_reach(f);
    pthread_mutex_unlock(&f->lock);
    if (!any) break;
    free(h.markers);
    _ia_free_owned(h.arena, h.owner, h.ptr);
  }
}

void ia_graph_set_record_stream_reuse(bool on) { atomic_store(&record_stream_reuse, on); }

static size_t slot_of(const void *node, size_t cap) {
  return (size_t)(((uintptr_t)node * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

static bool set_has(const node_set_t *s, const void *node) {
  if (!s->cap) return false;
  for (size_t i = slot_of(node, s->cap);; i = (i + 1) & (s->cap - 1)) {
    if (s->slots[i] == node) return true;
    if (!s->slots[i]) return false;
  }
}

/* 1: added, 0: already there, -1: out of host memory. */
static int set_add(node_set_t *s, const void *node) {
  if (set_has(s, node)) return 0;
  if (2 * (s->n + 1) > s->cap) {
    node_set_t grown = {calloc(s->cap ? 2 * s->cap : 64, sizeof(void *)), s->cap ? 2 * s->cap : 64, 0};
    if (!grown.slots) return -1;
    for (size_t i = 0; i < s->cap; i++)
      if (s->slots[i]) set_add(&grown, s->slots[i]);
    free(s->slots);
    *s = grown;
  }
  size_t i = slot_of(node, s->cap);
  while (s->slots[i]) i = (i + 1) & (s->cap - 1);
  s->slots[i] = node;
  s->n++;
  return 1;
}

/* Nodes a backend query answered. */
typedef struct {
  const void **items;
  size_t n, cap;
} nodes_t;

/* Appends the nodes of `stream`'s frontier (node NULL; *capture gets its capture) or of `node`'s
 * parents; false when host memory ran out (or the answer grew between two asks). */
static bool append_nodes(nodes_t *list, ia_arena_t *arena, ia_stream_t stream, const void *node, uint64_t *capture) {
  size_t want = 16;
  for (int ask = 0; ask < 2; ask++) {
    if (list->cap - list->n < want) {
      size_t cap = list->n + (want > list->cap ? want : list->cap);
      const void **grown = realloc(list->items, cap * sizeof *grown);
      if (!grown) return false;
      list->items = grown;
      list->cap = cap;
    }
    size_t room = list->cap - list->n;
    const void **out = list->items + list->n;
    size_t got = node ? _ia_arena_node_parents(arena, node, out, room)
                      : _ia_arena_capture_frontier(arena, stream, capture, out, room);
    if (got <= room) {
      list->n += got;
      return true;
    }
    want = got;
  }
  return false;
}

/* A held block's markers: the frontiers of its own stream and of every stream recorded on it, all
 * capturing one capture. Otherwise (or out of host memory) it keeps capture 0. */
static void mark(held_free_t *h, const ia_stream_t *uses, uint32_t n_uses) {
  nodes_t markers = {0};
  uint64_t capture = 0;
  bool ok = true;
  for (uint32_t i = 0; i <= n_uses && ok; i++) {
    uint64_t c = 0;
    ok = append_nodes(&markers, h->arena, i ? uses[i - 1] : h->stream, NULL, &c) && c && (!capture || c == capture);
    capture = c;
  }
  if (!ok || !markers.n) {
    free(markers.items);
    return;
  }
  h->capture = capture;
  h->markers = markers.items;
  h->n_markers = markers.n;
}

bool _ia_graph_defer_free(int device, ia_arena_t *arena, const _ia_owner_t *owner, void *ptr) {
  enum { MAX_USES = 16 }; /* a block recorded on more streams waits for the captures' end */
  ia_stream_t stream, uses[MAX_USES];
  uint32_t others;
  if (!_ia_arena_live_block(arena, ptr, &stream, uses, MAX_USES, &others)) return false; /* the free reports it */
  held_frees_t *f = held_of(device);
  if (owner->graph_pool) _ia_graph_keep(device, owner->graph_pool);
  /* A pool's arena serves its own stream only, so a block freed on it needs no event; an eager
   * arena's block of a capturing stream would. Other streams recorded on a block always do. */
  if (!others && (owner->graph_pool || !_ia_arena_stream_capturing(arena, stream))) return false;
  held_free_t h = {arena, owner, ptr, stream};
  if (owner->graph_pool && others <= MAX_USES && atomic_load(&record_stream_reuse)) mark(&h, uses, others);
  pthread_mutex_lock(&f->lock);
  bool held = atomic_load(&_ia_device(device)->totals.captures) > 0;
  if (held && f->n_held == f->cap_held) {
    size_t cap = f->cap_held ? f->cap_held * 2 : 64;
    held_free_t *grown = realloc(f->held, cap * sizeof *grown);
    if (grown) {
      f->held = grown;
      f->cap_held = cap;
    }
  }
  held = held && f->n_held < f->cap_held; /* without room, freeing now is the lesser harm */
  if (held) f->held[f->n_held++] = h;
  pthread_mutex_unlock(&f->lock);
  if (!held) free(h.markers);
  return held;
}

/* The ancestors of `stream`'s frontier in its capture (*capture), grown from what earlier walks
 * found; NULL when the stream captures nothing or host memory ran out. Under the held-frees lock. */
static const node_set_t *ancestors(held_frees_t *f, ia_arena_t *arena, ia_stream_t stream, uint64_t *capture) {
  nodes_t todo = {0};
  *capture = 0;
  bool ok = append_nodes(&todo, arena, stream, NULL, capture) && *capture;
  reach_t *r = NULL;
  for (size_t i = 0; ok && i < f->n_reach && !r; i++)
    if (f->reach[i].capture == *capture && f->reach[i].stream == stream) r = &f->reach[i];
  if (ok && !r && f->n_reach == f->cap_reach) {
    size_t cap = f->cap_reach ? 2 * f->cap_reach : 4;
    reach_t *grown = realloc(f->reach, cap * sizeof *grown);
    if (grown) {
      f->reach = grown;
      f->cap_reach = cap;
    }
  }
  if (ok && !r && f->n_reach < f->cap_reach) {
    r = &f->reach[f->n_reach++];
    *r = (reach_t){.capture = *capture, .stream = stream};
  }
  ok = ok && r;
  while (ok && todo.n > 0) {
    const void *node = todo.items[--todo.n];
    int added = set_add(&r->ancestors, node);
    ok = added >= 0 && (added == 0 || append_nodes(&todo, arena, stream, node, NULL));
  }
  free(todo.items);
  if (r && !ok) { /* a walk cut short leaves ancestors unseen behind nodes marked seen: start over */
    free(r->ancestors.slots);
    r->ancestors = (node_set_t){0};
  }
  return ok ? &r->ancestors : NULL;
}

void _ia_graph_reclaim(int device, ia_stream_t stream) {
  held_frees_t *f = held_of(device);
  if (!f || !atomic_load(&record_stream_reuse)) return;
  held_free_t *ready = NULL;
  size_t n_ready = 0;
  pthread_mutex_lock(&f->lock);
  ia_arena_t *arena = NULL;
  for (size_t i = 0; i < f->n_held && !arena; i++)
    if (f->held[i].capture && f->held[i].stream == stream) arena = f->held[i].arena;
  uint64_t capture = 0;
  const node_set_t *seen = arena ? ancestors(f, arena, stream, &capture) : NULL;
  if (seen) ready = malloc(f->n_held * sizeof *ready);
  for (size_t i = 0; ready && i < f->n_held;) {
    held_free_t *h = &f->held[i];
    bool reusable = h->capture == capture && h->stream == stream;
    for (size_t m = 0; reusable && m < h->n_markers; m++) reusable = set_has(seen, h->markers[m]);
    if (reusable) {
      ready[n_ready++] = *h;
      *h = f->held[--f->n_held];
    } else {
      i++;
    }
  }
  pthread_mutex_unlock(&f->lock);
  for (size_t i = 0; i < n_ready; i++) {
    _ia_arena_forget_uses(ready[i].arena, ready[i].ptr);
    free(ready[i].markers);
    _ia_free_owned(ready[i].arena, ready[i].owner, ready[i].ptr);
  }
  free(ready);
}
