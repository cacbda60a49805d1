/* The process scope's entry points (what torch_allocator.cpp calls through ia_torch_entry_points)
 * and the workspace scope's MemPool backend: which arena serves a request, and frees by address. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin.h"

static __thread int workspace_depth;
static __thread uint64_t pool_refusals;

uint64_t ia_plugin_pool_refusals(void) { return pool_refusals; }

void ia_workspace_enter(void) { workspace_depth++; }
bool ia_workspace_exit(void) {
  if (workspace_depth <= 0) return false;
  workspace_depth--;
  return true;
}
int ia_workspace_depth(void) { return workspace_depth; }

static void *graph_alloc(_ia_device_t *dev, int device, size_t size, size_t reserve, ia_stream_t stream,
                         ia_pool_id_t id) {
  int kind = workspace_depth ? IA_POOL_WORKSPACE : reserve <= IA_SMALL_REQUEST ? IA_POOL_SMALL : IA_POOL_LARGE;
  ia_status_t st = workspace_depth ? _ia_ensure_workspace(dev, device) : IA_OK;
  _ia_graph_reclaim(device, stream);
  ia_arena_t *arena = st == IA_OK ? _ia_graph_arena(device, id, kind, stream, &st) : NULL;
  void *p = NULL;
  if (arena) st = _ia_arena_alloc_reserving(arena, size, reserve, stream, &p);
  if (st != IA_OK) _ia_fail_graph_alloc(device, id, kind, size, st);
  return p;
}

void *ia_torch_alloc(size_t size, int device, void *stream, const ia_pool_id_t *graph_pool) {
  return ia_torch_alloc_rounded(size, size, device, stream, graph_pool);
}

void *ia_torch_alloc_rounded(size_t size, size_t reserve, int device, void *stream, const ia_pool_id_t *graph_pool) {
  if (size == 0) return NULL;
  if (reserve < size) reserve = size;
  ia_status_t st;
  _ia_device_t *dev = _ia_device_made(device, &st);
  if (dev && _ia_plugin.config.scope != IA_SCOPE_PROCESS) {
    snprintf(_ia_failure, sizeof _ia_failure, "the allocator is installed for workspace pools only, not as the "
             "process's allocator: its MemPools call ia_pool_alloc");
    st = IA_ERR_INVALID_ARGUMENT;
  }
  if (st == IA_OK && graph_pool) return graph_alloc(dev, device, size, reserve, (ia_stream_t)stream, *graph_pool);
  if (dev && workspace_depth) st = _ia_ensure_workspace(dev, device);
  if (st != IA_OK) _ia_fail_alloc(device, -1, size, st);
  int pool = workspace_depth ? IA_POOL_WORKSPACE : reserve <= IA_SMALL_REQUEST ? IA_POOL_SMALL : IA_POOL_LARGE;
  void *p;
  st = _ia_arena_alloc_reserving(dev->arenas[pool], size, reserve, (ia_stream_t)stream, &p);
  if (st != IA_OK && pool != IA_POOL_WORKSPACE) {
    /* The other general pool may be caching whole regions this request could use. */
    if (ia_arena_release_cached(dev->arenas[IA_POOL_SMALL + IA_POOL_LARGE - pool])) {
      atomic_fetch_add(&_ia_plugin.retries, 1);
      st = _ia_arena_alloc_reserving(dev->arenas[pool], size, reserve, (ia_stream_t)stream, &p);
    }
    /* Last, as PyTorch: the free blocks of MemPools made with use_on_oom. */
    if (st != IA_OK && (p = _ia_graph_alloc_on_oom(device, size, (ia_stream_t)stream, pool))) st = IA_OK;
  }
  if (st != IA_OK) _ia_fail_alloc(device, pool, size, st);
  return p;
}

void ia_torch_free(void *ptr) {
  if (!ptr) return;
  const _ia_owner_t *owner = NULL;
  ia_arena_t *arena = _ia_registry_find(ptr, &owner);
  if (!arena) {
    fprintf(stderr, "indexer-arena: free(%p) refused: %s\n", ptr, ia_status_str(IA_ERR_FOREIGN_POINTER));
    return;
  }
  if (atomic_load_explicit(&_ia_plugin.devices[owner->device].totals.captures, memory_order_relaxed) &&
      _ia_graph_defer_free(owner->device, arena, owner, ptr))
    return;
  _ia_free_owned(arena, owner, ptr);
}

void ia_torch_record_stream(void *ptr, void *stream) {
  const _ia_owner_t *owner;
  ia_arena_t *arena = _ia_registry_find(ptr, &owner);
  if (arena) ia_arena_record_stream(arena, ptr, (ia_stream_t)stream);
}

/* torch.cuda.set_per_process_memory_fraction: everything the device's pools hold, the workspace
 * arena included, stays under fraction x the device's memory; the general pools stop growing there
 * (and raise out-of-memory, after giving back their cached regions). */
void ia_torch_memory_fraction(double fraction, int device) {
  ia_status_t st;
  _ia_device_t *dev = _ia_device_made(device, &st);
  size_t free_bytes, total;
  if (!dev || ia_cuda_mem_info(device, &free_bytes, &total) != IA_OK) return;
  pthread_mutex_lock(&_ia_plugin.lock);
  dev->fraction = fraction;
  dev->fraction_set = true;
  /* As PyTorch: 1.0 lifts the limit; 0.0 allows nothing (a limit of 0 would mean none). */
  uint64_t allowed = (uint64_t)(fraction * (double)total);
  atomic_store(&dev->totals.limit, fraction >= 1.0 ? 0 : allowed ? allowed : 1);
  pthread_mutex_unlock(&_ia_plugin.lock);
}

double ia_torch_get_memory_fraction(int device) {
  if (device < 0 || device >= IA_MAX_DEVICES) return 1.0;
  _ia_device_t *dev = &_ia_plugin.devices[device];
  pthread_mutex_lock(&_ia_plugin.lock);
  double fraction = dev->fraction_set ? dev->fraction : 1.0;
  pthread_mutex_unlock(&_ia_plugin.lock);
  size_t free_bytes, total;
  /* As PyTorch answers: the bytes allowed over the device's memory. */
  if (fraction < 1.0 && ia_cuda_mem_info(device, &free_bytes, &total) == IA_OK && total)
    fraction = (double)(uint64_t)(fraction * (double)total) / (double)total;
  return fraction;
}

ia_status_t ia_torch_enable_peer_access(int dev, int dev_to_access) {
  if (dev < 0 || dev >= IA_MAX_DEVICES || dev_to_access < 0 || dev_to_access >= IA_MAX_DEVICES) return IA_ERR_INVALID_ARGUMENT;
  _ia_device_t *target = &_ia_plugin.devices[dev_to_access];
  pthread_mutex_lock(&_ia_plugin.lock); /* a device made now sees the bit, or is ready once it is set */
  target->peers |= 1ull << dev;
  bool ready = atomic_load(&target->ready) == 1;
  pthread_mutex_unlock(&_ia_plugin.lock);
  ia_status_t st = IA_OK;
  for (int p = IA_POOL_SMALL; ready && st == IA_OK && p < IA_POOL_COUNT; p++)
    if (target->arenas[p]) st = _ia_arena_grant_access(target->arenas[p], dev);
  return st;
}

void ia_torch_empty_cache(void) {
  for (int d = 0; d < IA_MAX_DEVICES; d++)
    for (int p = IA_POOL_SMALL; p < IA_POOL_COUNT; p++)
      if (ia_plugin_arena(d, p)) ia_arena_release_cached(ia_plugin_arena(d, p));
}

static const ia_torch_entry_points_t entry_points = {
    .alloc = ia_torch_alloc_rounded,
    .free = ia_torch_free,
    .record_stream = ia_torch_record_stream,
    .empty_cache = ia_torch_empty_cache,
    .memory_fraction = ia_torch_memory_fraction,
    .get_memory_fraction = ia_torch_get_memory_fraction,
    .reset_accumulated = ia_plugin_reset_accumulated,
    .segments = ia_plugin_segments,
    .trace_sink = ia_plugin_trace_sink,
    .device_expandable = ia_plugin_device_expandable,
    .graph_set_allocator = ia_graph_set_allocator,
    .graph_set_no_split = ia_graph_set_no_split,
    .graph_set_use_on_oom = ia_graph_set_use_on_oom,
    .graph_set_record_stream_reuse = ia_graph_set_record_stream_reuse,
    .graph_empty_cache = ia_graph_empty_cache,
    .graph_begin = ia_graph_begin,
    .graph_end = ia_graph_end,
    .graph_incref = ia_graph_incref,
    .graph_release = ia_graph_release,
    .graph_use_count = ia_graph_use_count,
    .graph_blocks = ia_graph_blocks,
    .graph_restore = ia_graph_restore,
    .device_stats = ia_plugin_device_stats,
    .torch_stats = ia_plugin_torch_stats,
    .reset_peaks = ia_plugin_reset_peaks,
    .ooms = ia_plugin_ooms,
    .retries = ia_plugin_retries,
    .status_str = ia_status_str,
    .enable_peer_access = ia_torch_enable_peer_access,
};

const ia_torch_entry_points_t *ia_torch_entry_points(void) { return &entry_points; }

/* ---- workspace scope: the MemPool's backend ------------------------------------------------- */

IA_EXPORT void *ia_pool_alloc(ssize_t size, int device, void *stream) {
  if (size <= 0) return NULL;
  ia_status_t st;
  _ia_device_t *dev = _ia_device_made(device, &st);
  if (dev && _ia_plugin.config.scope != IA_SCOPE_WORKSPACE) {
    snprintf(_ia_failure, sizeof _ia_failure, "the allocator is installed for the whole process, not for workspace pools");
    st = IA_ERR_INVALID_ARGUMENT;
  }
  if (st == IA_OK) st = _ia_ensure_workspace(dev, device);
  void *p = NULL;
  if (st == IA_OK) {
    ia_stream_t none = IA_STREAM_NONE;
    atomic_compare_exchange_strong(&dev->pool_stream, &none, (ia_stream_t)stream);
    st = ia_arena_alloc(dev->arenas[IA_POOL_WORKSPACE], (size_t)size, (ia_stream_t)stream, &p);
    if (st != IA_OK) _ia_describe_pool_refusal(dev, device, (size_t)size, stream);
  }
  if (st != IA_OK) {
    pool_refusals++;
    if (_ia_plugin.config.raise_oom) {
      /* The core's own figures only: PyTorch's view of the pool's blocks would need Python, and
       * taking the GIL here, under PyTorch's allocator lock, can deadlock against a thread that
       * holds the GIL and waits for that lock (freeing a tensor does). workspace() adds it. */
      char budget[32], message[sizeof _ia_failure + 256];
      snprintf(message, sizeof message, "CUDA out of memory on device %d: a workspace request does not fit "
               "the workspace pool (budget %s): %s", device,
               _ia_format_bytes(_ia_plugin.config.budget, budget, sizeof budget), _ia_failure);
      _ia_raise_oom(message);
    }
    return NULL;
  }
  return p;
}

IA_EXPORT void ia_pool_free(void *ptr, ssize_t size, int device, void *stream) {
  if (!ptr) return;
  ia_arena_t *workspace = ia_plugin_arena(device, IA_POOL_WORKSPACE);
  ia_status_t st = workspace ? ia_arena_free(workspace, ptr, (ia_stream_t)stream) : IA_ERR_FOREIGN_POINTER;
  if (st != IA_OK)
    fprintf(stderr, "indexer-arena: pool free(%p, %zd bytes, device %d) refused: %s\n", ptr, size, device,
            ia_status_str(st));
}

