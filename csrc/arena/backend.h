/* The backend interface: what an arena reserves from and orders streams with. Shared by the
 * arena's own backends (backend_*.c, guard.c), the PyTorch allocator's pool backends
 * (csrc/torch/backend_pool.c) and the test machinery; not part of the public interface. */
#ifndef INDEXER_ARENA_BACKEND_H
#define INDEXER_ARENA_BACKEND_H

#include "internal.h"

/* A backend is a table of operations and its own state after it. The arena only ever calls these;
 * a new backend slots in by filling the table. Events order one stream's past work before another
 * stream's future work; `event_done` never blocks. */
struct ia_backend {
  const char *name;
  size_t natural_alignment; /* what reserve() guarantees for its base address */
  ia_status_t (*reserve)(ia_backend_t *self, size_t size, void **out);
  void (*release)(ia_backend_t *self, void *base, size_t size);
  ia_status_t (*event_create)(ia_backend_t *self, void **event);
  void (*event_destroy)(ia_backend_t *self, void *event);
  ia_status_t (*event_record)(ia_backend_t *self, void *event, ia_stream_t stream);
  bool (*event_done)(ia_backend_t *self, void *event);
  ia_status_t (*stream_wait)(ia_backend_t *self, ia_stream_t stream, void *event);
  void (*destroy)(ia_backend_t *self);
  /* Optional: back every page of a reservation now (unified memory), so use never faults in more. */
  ia_status_t (*commit)(ia_backend_t *self, void *base, size_t size);
  /* Whether `stream` is capturing a CUDA graph now. A wait whose waiter captures and whose event
   * was recorded outside the capture is made on the host instead (a capture may not depend on
   * outside work), so stream_wait must handle that case; events are never recorded on a
   * capturing stream by the arena's callers. */
  bool (*stream_capturing)(ia_backend_t *self, ia_stream_t stream);
  /* Optional: blocks the host until the event has completed. An arena over a mapping backend
   * waits this way before it unmaps pages whose last stream work may still run; without it those
   * pages stay mapped until a later release finds the work done. */
  ia_status_t (*event_wait)(ia_backend_t *self, void *event);
  /* Optional, both or none: the graph a capture has built so far, for reusing inside a capture a
   * block other streams used once the graph orders them before the reuse. capture_frontier gives
   * the capture `stream` belongs to (0: none) and copies up to cap of the nodes its next work will
   * depend on into out, returning how many there are; node_parents likewise gives the nodes
   * `node` depends on. Nodes are the backend's handles, valid while their capture lasts. */
  size_t (*capture_frontier)(ia_backend_t *self, ia_stream_t stream, uint64_t *capture, const void **out,
                             size_t cap);
  size_t (*node_parents)(ia_backend_t *self, const void *node, const void **out, size_t cap);
  /* Optional, all or none: address space alone, and physical pages mapped into it (CUDA's
   * virtual memory management, or the host backend's simulation of it). page_size is the
   * granularity of map and unmap, a power of two (0: the backend does not map). A range from
   * address_reserve starts at a multiple of page_size and holds no memory until pages are mapped
   * into it. map and unmap take page-aligned stretches of one reserved range; map is only asked
   * for pages not mapped and unmap only for mapped ones, so a backend may keep one physical
   * allocation per page. address_free gets a whole range with nothing mapped in it. */
  size_t page_size;
  ia_status_t (*address_reserve)(ia_backend_t *self, size_t size, void **out);
  void (*address_free)(ia_backend_t *self, void *base, size_t size);
  ia_status_t (*map)(ia_backend_t *self, void *at, size_t size);
  void (*unmap)(ia_backend_t *self, void *at, size_t size);
  /* Optional, mapping backends: every page mapped now or later is readable and writable by device
   * `peer` too (a driver's mapping is reachable only from the devices granted it). */
  ia_status_t (*grant_access)(ia_backend_t *self, int peer);
};

/* A backend that wraps another hands it every event, stream and capture operation: defines
 * prefix_event_create ... prefix_node_parents, each calling the same operation of inner(self), and
 * IA_FORWARDED_EVENTS(prefix, inner) fills them into a table (the optional ones only where the
 * inner backend has them). */
#define IA_FORWARD_EVENTS(prefix, inner)                                                               \
  static ia_status_t prefix##_event_create(ia_backend_t *self, void **ev) {                           \
    return inner(self)->event_create(inner(self), ev);                                                 \
  }                                                                                                    \
  static void prefix##_event_destroy(ia_backend_t *self, void *ev) { inner(self)->event_destroy(inner(self), ev); } \
  static ia_status_t prefix##_event_record(ia_backend_t *self, void *ev, ia_stream_t s) {             \
    return inner(self)->event_record(inner(self), ev, s);                                              \
  }                                                                                                    \
  static bool prefix##_event_done(ia_backend_t *self, void *ev) { return inner(self)->event_done(inner(self), ev); } \
  static ia_status_t prefix##_stream_wait(ia_backend_t *self, ia_stream_t s, void *ev) {              \
    return inner(self)->stream_wait(inner(self), s, ev);                                               \
  }                                                                                                    \
  static bool prefix##_stream_capturing(ia_backend_t *self, ia_stream_t s) {                          \
    return inner(self)->stream_capturing(inner(self), s);                                              \
  }                                                                                                    \
  static ia_status_t prefix##_event_wait(ia_backend_t *self, void *ev) {                              \
    return inner(self)->event_wait(inner(self), ev);                                                   \
  }                                                                                                    \
  static size_t prefix##_capture_frontier(ia_backend_t *self, ia_stream_t s, uint64_t *capture,       \
                                          const void **out, size_t cap) {                              \
    return inner(self)->capture_frontier(inner(self), s, capture, out, cap);                           \
  }                                                                                                    \
  static size_t prefix##_node_parents(ia_backend_t *self, const void *node, const void **out, size_t cap) { \
    return inner(self)->node_parents(inner(self), node, out, cap);                                     \
  }
#define IA_FORWARDED_EVENTS(prefix, inner_backend)                                                     \
  .event_create = prefix##_event_create, .event_destroy = prefix##_event_destroy,                     \
  .event_record = prefix##_event_record, .event_done = prefix##_event_done,                           \
  .stream_wait = prefix##_stream_wait,                                                                 \
  .stream_capturing = (inner_backend)->stream_capturing ? prefix##_stream_capturing : NULL,           \
  .event_wait = (inner_backend)->event_wait ? prefix##_event_wait : NULL,                             \
  .capture_frontier = (inner_backend)->capture_frontier ? prefix##_capture_frontier : NULL,           \
  .node_parents = (inner_backend)->capture_frontier ? prefix##_node_parents : NULL

/* backend_cuda.c for backend_vmm.c: driver calls for a device run between enter and exit, with
 * the device current and this thread in relaxed capture mode, as the runtime backend's own calls
 * do. bind_context makes the runtime bind the device's context to the thread (cudaFree(NULL)), for
 * a thread that has none yet. _ia_cuda_error sets what ia_cuda_last_error() says. */
typedef struct {
  int previous, mode;
  bool switched;
} _ia_cuda_scope_t;
ia_status_t _ia_cuda_enter(_ia_cuda_scope_t *s, int device);
void _ia_cuda_exit(_ia_cuda_scope_t *s);
ia_status_t _ia_cuda_bind_context(void);
void _ia_cuda_error(const char *format, ...) __attribute__((format(printf, 1, 2)));

/* The host backend's view of simulated CUDA graph capture, which the test build provides
 * (csrc/testing/host_capture.c registers it before main); without it no stream ever captures.
 * capture_of: the capture a stream is in (0: none); any: whether any stream captures; violation
 * and host_wait count a break of CUDA's capture rules and a wait made on the host; frontier and
 * parents are the backend's capture_frontier and node_parents. */
typedef struct {
  uint64_t (*capture_of)(ia_stream_t stream);
  bool (*any)(void);
  void (*violation)(void);
  void (*host_wait)(void);
  size_t (*frontier)(ia_stream_t stream, uint64_t *capture, const void **out, size_t cap);
  size_t (*parents)(const void *node, const void **out, size_t cap);
} _ia_host_captures_t;
void _ia_host_set_captures(const _ia_host_captures_t *sim);

#endif
