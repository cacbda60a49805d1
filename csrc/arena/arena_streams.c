/* Stream-ordered reuse: one event per stream that frees, recorded lazily, and the waits that
 * order an allocating stream after a free on another (arena.c says when). */
#include <pthread.h>
#include <stdlib.h>

#include "private.h"

typedef _ia_region_t region_t;
typedef _ia_block_t block_t;

/* ---- stream ordering -------------------------------------------------------------------------- */

_ia_stream_state_t *_ia_stream_state(ia_arena_t *a, ia_stream_t s, ia_status_t *st) {
  for (size_t i = 0; i < a->n_streams; i++)
    if (a->streams[i].stream == s) return &a->streams[i];
  if (a->n_streams == a->cap_streams) {
    size_t cap = a->cap_streams ? a->cap_streams * 2 : 8;
    _ia_stream_state_t *grown = realloc(a->streams, cap * sizeof *grown);
    if (!grown) {
      *st = IA_ERR_NO_HOST_MEMORY;
      return NULL;
    }
    a->streams = grown;
    a->cap_streams = cap;
  }
  _ia_stream_state_t *ss = &a->streams[a->n_streams];
  *ss = (_ia_stream_state_t){.stream = s};
  if ((*st = a->backend->event_create(a->backend, &ss->event)) != IA_OK) return NULL;
  a->n_streams++;
  return ss;
}

/* Makes `waiter` ordered after everything `freed_on` had queued when the free numbered free_seq
 * happened (UINT64_MAX: after everything it has queued now). */
ia_status_t _ia_order_after(ia_arena_t *a, ia_stream_t waiter, ia_stream_t freed_on,
                               uint64_t free_seq) {
  if (freed_on == IA_STREAM_NONE || freed_on == waiter) return IA_OK;
  ia_status_t st = IA_OK;
  _ia_stream_state_t *ss = _ia_stream_state(a, freed_on, &st);
  if (!ss) return st;
  if (ss->recorded_seq < free_seq) {
    if ((st = a->backend->event_record(a->backend, ss->event, freed_on)) != IA_OK) return st;
    ss->recorded_seq = a->free_seq;
    a->stats.event_records++;
  }
  if (a->backend->event_done(a->backend, ss->event)) return IA_OK;
  if ((st = a->backend->stream_wait(a->backend, waiter, ss->event)) != IA_OK) return st;
  a->stats.stream_waits++;
  return IA_OK;
}

ia_status_t ia_arena_record_stream(ia_arena_t *a, void *ptr, ia_stream_t stream) {
  if (stream == IA_STREAM_NONE) return IA_ERR_INVALID_ARGUMENT; /* see _ia_arena_alloc_reserving */
  _ia_arena_lock(a);
  ia_status_t st = IA_OK;
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr);
  if (!b) {
    st = _ia_region_of(a, (uintptr_t)ptr) ? IA_ERR_DOUBLE_FREE : IA_ERR_FOREIGN_POINTER;
  } else if (stream != b->stream) {
    bool known = false;
    for (uint32_t i = 0; i < b->n_uses; i++) known |= b->uses[i] == stream;
    if (!known) {
      if (b->n_uses == b->cap_uses) {
        uint32_t cap = b->cap_uses ? b->cap_uses * 2 : 4;
        ia_stream_t *grown = realloc(b->uses, cap * sizeof *grown);
        if (!grown) st = IA_ERR_NO_HOST_MEMORY;
        else {
          b->uses = grown;
          b->cap_uses = cap;
        }
      }
      if (st == IA_OK) b->uses[b->n_uses++] = stream;
    }
  }
  _ia_arena_unlock(a);
  return st;
}

void _ia_arena_flush_events(ia_arena_t *a) {
  _ia_arena_lock(a);
  for (region_t *r = a->regions; r; r = r->next)
    for (block_t *b = r->first; b; b = b->phys_next) {
      if (!b->is_free || b->stream == IA_STREAM_NONE) continue;
      ia_status_t st = IA_OK;
      _ia_stream_state_t *ss = _ia_stream_state(a, b->stream, &st);
      if (ss && ss->recorded_seq < b->free_seq &&
          a->backend->event_record(a->backend, ss->event, b->stream) == IA_OK) {
        ss->recorded_seq = a->free_seq;
        a->stats.event_records++;
      }
    }
  _ia_arena_unlock(a);
}

ia_status_t _ia_arena_grant_access(ia_arena_t *a, int peer) {
  _ia_arena_lock(a); /* maps happen under it too, so none misses the peer */
  ia_status_t st = a->page && a->backend->grant_access ? a->backend->grant_access(a->backend, peer) : IA_OK;
  _ia_arena_unlock(a);
  return st;
}

bool _ia_arena_stream_capturing(ia_arena_t *a, ia_stream_t stream) {
  return a->backend->stream_capturing && a->backend->stream_capturing(a->backend, stream);
}

bool _ia_arena_live_block(ia_arena_t *a, const void *ptr, ia_stream_t *stream, ia_stream_t *uses, uint32_t cap,
                          uint32_t *n_uses) {
  _ia_arena_lock(a);
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr);
  bool live = b != NULL;
  if (live) {
    *stream = b->stream;
    *n_uses = b->n_uses;
    for (uint32_t i = 0; i < b->n_uses && i < cap; i++) uses[i] = b->uses[i];
  }
  _ia_arena_unlock(a);
  return live;
}

void _ia_arena_forget_uses(ia_arena_t *a, const void *ptr) {
  _ia_arena_lock(a);
  block_t *b = _ia_table_find(&a->table, (uintptr_t)ptr);
  if (b) b->n_uses = 0;
  _ia_arena_unlock(a);
}

size_t _ia_arena_capture_frontier(ia_arena_t *a, ia_stream_t stream, uint64_t *capture, const void **out,
                                  size_t cap) {
  *capture = 0;
  return a->backend->capture_frontier ? a->backend->capture_frontier(a->backend, stream, capture, out, cap) : 0;
}

size_t _ia_arena_node_parents(ia_arena_t *a, const void *node, const void **out, size_t cap) {
  return a->backend->node_parents ? a->backend->node_parents(a->backend, node, out, cap) : 0;
}
