/* A torch.cuda.MemPool's own allocator as a backend: the pool's regions are reserved from it and
 * given back to it (vLLM's sleep mode, NCCL's symmetric memory), as PyTorch's allocator asks such
 * a pool's allocator for its segments. Events still come from the device's CUDA backend. */
#include <stdlib.h>

#include "plugin.h"

typedef struct {
  ia_backend_t base;
  ia_pool_allocator_t allocator;
  int device;
  ia_stream_t stream;
  ia_backend_t *events;
} pool_backend_t;

static pool_backend_t *pool(ia_backend_t *b) { return (pool_backend_t *)b; }

static ia_status_t pool_reserve(ia_backend_t *self, size_t size, void **out) {
  pool_backend_t *p = pool(self);
  *out = p->allocator.alloc(p->allocator.ctx, size, p->device, (void *)p->stream);
  return *out ? IA_OK : IA_ERR_BACKEND_OUT_OF_MEMORY;
}

static void pool_release(ia_backend_t *self, void *base, size_t size) {
  pool_backend_t *p = pool(self);
  p->allocator.free(p->allocator.ctx, base, size, p->device, (void *)p->stream);
}

static ia_backend_t *pool_events(ia_backend_t *self) { return pool(self)->events; }
IA_FORWARD_EVENTS(pool, pool_events)

static void pool_destroy(ia_backend_t *self) {
  ia_backend_destroy(pool(self)->events);
  free(self);
}

ia_status_t _ia_pool_backend_create(const ia_pool_allocator_t *allocator, int device, ia_stream_t stream,
                                    ia_backend_t *events, ia_backend_t **out) {
  pool_backend_t *p = calloc(1, sizeof *p);
  if (!p) {
    ia_backend_destroy(events);
    return IA_ERR_NO_HOST_MEMORY;
  }
  p->base = (ia_backend_t){
      .name = "a MemPool's allocator",
      .natural_alignment = 256, /* what cudaMalloc promises; reserve_aligned pads when short */
      .reserve = pool_reserve,
      .release = pool_release,
      IA_FORWARDED_EVENTS(pool, events),
      .destroy = pool_destroy,
  };
  p->allocator = *allocator;
  p->device = device;
  p->stream = stream;
  p->events = events;
  *out = &p->base;
  return IA_OK;
}
