/* The entry points PyTorch's CUDAPluggableAllocator calls, and the routing behind them.
 *
 * Process scope (the process's allocator): each device gets two general arenas on first use, and
 * its workspace arena on first workspace use (or ia_plugin_reserve), so a process that never asks
 * for a workspace pays nothing for it:
 *   workspace  fixed, one reservation of the budget; serves allocations made while this thread is
 *              inside a workspace scope (ia_workspace_enter/exit), and never asks for more memory;
 *   small      growable, requests up to 1 MiB, 2 MiB regions;
 *   large      growable, 20 MiB regions for requests under 10 MiB, exact 2 MiB multiples above.
 * The general arenas are the caching layer for every other tensor: a freed block goes back to its
 * arena, stream-ordered, and no tensor costs a cudaMalloc once its size class has a region.
 * Region sizes follow PyTorch's own caching allocator so that peak memory stays comparable.
 * Where the driver maps pages (expandable, default auto), each general arena is instead one
 * address range of the device's size whose 2 MiB pages are mapped as blocks need them and unmapped
 * by torch.cuda.empty_cache(), as PyTorch's expandable segments: the region sizes above then do not
 * apply, and free space is never cut at a region's end. Graph pools and the workspace keep
 * reservations.
 *
 * Workspace scope (a torch.cuda.MemPool's backend, ia_pool_alloc/free): PyTorch's caching layer
 * sits on top and keeps every segment it is given while the pool lives, so the pool is handed one
 * budget-sized segment first (primed from Python) and splits every workspace from it; the arena
 * reserves that segment and one small-block segment once, and never grows.
 *
 * Failure: PyTorch turns a NULL from the alloc function into a tensor at address 0, so the entry
 * points never return NULL for a non-zero request. They format a message and call the raise_oom
 * hook, which throws c10::OutOfMemoryError from C++ (the core is built with -fexceptions so the
 * throw can unwind through it; no lock is held at that point). Without a hook it aborts.
 *
 * Lifetimes and lock order: Note [Device lifetime] (csrc/torch/plugin.h).
 *
 * This file: configuration, devices and their pools, device-wide statistics. plugin_entry.c: the
 * entry points and routing. plugin_oom.c: out-of-memory messages and the JSON report.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin.h"

/* PyTorch's caching allocator's segment sizes, the one place the core has them (Python's:
 * arena_tools/torch_model.py): a small-block segment (kSmallBuffer), the smallest large one
 * (kLargeBuffer), the request from which a large segment is the request's own size rounded
 * (kMinLargeAlloc) and that rounding (kRoundLarge). */
#define TORCH_SMALL_SEGMENT (2 * IA_MiB)
#define TORCH_MIN_LARGE_SEGMENT (20 * IA_MiB)
#define TORCH_MIN_LARGE_ALLOC (10 * IA_MiB)
#define TORCH_SEGMENT_ROUND (2 * IA_MiB)
_ia_plugin_t _ia_plugin = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    /* Every device's record, its locks ready before any thread runs (Note [Device lifetime]). */
    .devices = {[0 ... IA_MAX_DEVICES - 1] = {.totals = {.lock = PTHREAD_MUTEX_INITIALIZER},
                                              .graphs = {.lock = PTHREAD_MUTEX_INITIALIZER},
                                              .held = {.lock = PTHREAD_MUTEX_INITIALIZER}}},
};
__thread char _ia_failure[1024];

static const char *const pool_names[IA_POOL_COUNT] = {"workspace", "small", "large"};

static const char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

#define CONFIG_STRINGS(X) X(cudart_path) X(meminfo_path) X(cgroup_root) X(oom_report_path)

ia_status_t ia_plugin_configure(const ia_plugin_config_t *config) {
  if (!config || !config->budget || !_ia_is_pow2(config->alignment) || config->alignment < 16)
    return IA_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&_ia_plugin.lock);
  ia_status_t st = IA_OK;
  for (int d = 0; d < IA_MAX_DEVICES; d++)
    if (atomic_load(&_ia_plugin.devices[d].ready) == 1) st = IA_ERR_INVALID_ARGUMENT;
  if (st == IA_OK) {
#define REPLACE(field) free((char *)_ia_plugin.config.field);
    CONFIG_STRINGS(REPLACE)
#undef REPLACE
    _ia_plugin.config = *config;
#define COPY(field) _ia_plugin.config.field = dup_or_null(config->field);
    CONFIG_STRINGS(COPY)
#undef COPY
    _ia_plugin.configured = true;
  }
  pthread_mutex_unlock(&_ia_plugin.lock);
  return st;
}

static ia_status_t make_backend(int device, bool unified, bool mapped, ia_backend_t **out) {
  size_t page = _ia_plugin.config.host_page_size ? _ia_plugin.config.host_page_size : 2 * IA_MiB;
  const char *cudart = _ia_plugin.config.cudart_path;
  ia_status_t st = _ia_plugin.config.host_memory ? (mapped ? ia_host_mapping_backend_create(0, page, out)
                                                       : ia_host_backend_create(0, out))
                                             : (mapped ? ia_vmm_backend_create(device, cudart, out)
                                                       : ia_cuda_backend_create(device, cudart, out));
  if (st != IA_OK || !unified) return st;
  ia_guard_options_t g = {.meminfo_path = _ia_plugin.config.meminfo_path, .cgroup_root = _ia_plugin.config.cgroup_root,
                          .headroom = _ia_plugin.config.host_headroom};
  return ia_guard_backend_create(*out, &g, out);
}

size_t ia_plugin_pool_segment(void) {
  size_t segment = _ia_align_up(_ia_plugin.config.budget, TORCH_SEGMENT_ROUND);
  return segment < TORCH_MIN_LARGE_SEGMENT ? TORCH_MIN_LARGE_SEGMENT : segment;
}

const char *ia_plugin_pool_name(int pool) {
  return pool >= 0 && pool < IA_POOL_COUNT ? pool_names[pool] : NULL;
}

ia_status_t ia_plugin_pool_options(int pool, ia_arena_options_t *o) {
  if (!o || pool < 0 || pool >= IA_POOL_COUNT) return IA_ERR_INVALID_ARGUMENT;
  ia_arena_default_options(o);
  if (pool == IA_POOL_WORKSPACE) {
    o->capacity = _ia_plugin.config.scope == IA_SCOPE_WORKSPACE ? ia_plugin_pool_segment() + TORCH_SMALL_SEGMENT
                                                            : _ia_plugin.config.budget;
    o->alignment = _ia_plugin.config.alignment;
  } else {
    o->growable = true;
    o->alignment = 512;
    o->region_round = TORCH_SEGMENT_ROUND;
    o->region_min = pool == IA_POOL_SMALL ? TORCH_SMALL_SEGMENT : TORCH_MIN_LARGE_SEGMENT;
    o->region_exact_above = pool == IA_POOL_SMALL ? SIZE_MAX : TORCH_MIN_LARGE_ALLOC;
  }
  return IA_OK;
}

static ia_trace_t *recording(ia_trace_t *t) { return t && ia_trace_recording(t) ? t : NULL; }

static ia_status_t make_arena(int device, bool unified, int pool, ia_arena_t **out) {
  _ia_device_t *dev = &_ia_plugin.devices[device];
  ia_totals_t *totals = &dev->totals;
  bool mapped = pool != IA_POOL_WORKSPACE && dev->expandable;
  ia_arena_options_t o;
  ia_plugin_pool_options(pool, &o);
  if (mapped) o.address_range = dev->address_range;
  ia_backend_t *backend;
  ia_status_t st = make_backend(device, unified, mapped, &backend);
  if (st == IA_OK) st = ia_arena_create(&o, backend, out);
  if (st == IA_OK) _ia_arena_set_totals(*out, totals);
  if (st == IA_OK) _ia_arena_set_region_hook(*out, _ia_registry_hook, &_ia_plugin.devices[device].owner);
  if (st == IA_OK) ia_arena_set_trace(*out, recording(_ia_plugin.trace), device, (uint8_t)pool);
  return st;
}

/* Why the last device creation or reservation of this thread failed. */

static void describe_backend_failure(ia_status_t st) {
  const char *why = st == IA_ERR_HOST_MEMORY_GUARD ? ia_guard_last_message()
                    : (st == IA_ERR_BACKEND || st == IA_ERR_BACKEND_OUT_OF_MEMORY) ? ia_cuda_last_error()
                                                                                   : ia_status_str(st);
  snprintf(_ia_failure, sizeof _ia_failure, "%s", why && why[0] ? why : ia_status_str(st));
}

/* expandable: whether the device's general pools map pages, and how much address space each
 * reserves. auto takes regions where the driver cannot map (ia_plugin_device_expandable says
 * which); on refuses to, saying why. */
static ia_status_t choose_mapping(int device, bool *mapped, size_t *range) {
  *mapped = false;
  *range = _ia_plugin.config.address_range;
  if (_ia_plugin.config.scope != IA_SCOPE_PROCESS || _ia_plugin.config.expandable == 0) return IA_OK;
  if (_ia_plugin.config.host_memory) {
    *mapped = true;
    if (!*range) *range = (size_t)8 << 30;
    return IA_OK;
  }
  ia_status_t st = ia_vmm_supported(device, _ia_plugin.config.cudart_path);
  if (st != IA_OK && _ia_plugin.config.expandable < 0) return IA_OK;
  if (st != IA_OK) {
    char why[700];
    snprintf(why, sizeof why, "%.690s", ia_cuda_last_error());
    _ia_cuda_error("expandable:on in INDEXER_ARENA_CONF, but %s; set expandable:auto or expandable:off to "
                   "serve the general pools from regions (one cudaMalloc each)", why);
    return st;
  }
  size_t free_bytes, total;
  if (!*range && (st = ia_cuda_mem_info(device, &free_bytes, &total)) != IA_OK) return st;
  if (!*range) *range = total;
  *mapped = true;
  return IA_OK;
}

static ia_status_t create_device(int device) {
  _ia_device_t *dev = &_ia_plugin.devices[device];
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&_ia_plugin.lock);
  if (atomic_load(&dev->ready) != 1) {
    if (!_ia_plugin.configured) {
      snprintf(_ia_failure, sizeof _ia_failure, "the allocator was loaded but never configured: call alloc.install()");
      st = IA_ERR_INVALID_ARGUMENT;
    }
    if (st == IA_OK && !_ia_plugin.config.host_memory) st = ia_cuda_load(_ia_plugin.config.cudart_path);
    bool unified = _ia_plugin.config.unified == 1;
    if (st == IA_OK && _ia_plugin.config.unified < 0 && !_ia_plugin.config.host_memory) {
      ia_memory_attributes_t attributes;
      st = ia_cuda_memory_attributes(device, &attributes);
      unified = st == IA_OK && ia_memory_is_unified(&attributes);
    }
    dev->owner = (_ia_owner_t){.device = device};
    if (st == IA_OK) st = choose_mapping(device, &dev->expandable, &dev->address_range);
    for (int p = IA_POOL_SMALL; st == IA_OK && _ia_plugin.config.scope == IA_SCOPE_PROCESS && p < IA_POOL_COUNT; p++)
      st = make_arena(device, unified, p, &dev->arenas[p]);
    for (int peer = 0; st == IA_OK && peer < IA_MAX_DEVICES; peer++) /* asked before the pools existed */
      for (int p = IA_POOL_SMALL; st == IA_OK && p < IA_POOL_COUNT && (dev->peers >> peer & 1); p++)
        if (dev->arenas[p]) st = _ia_arena_grant_access(dev->arenas[p], peer);
    if (st != IA_OK) {
      if (_ia_plugin.configured) describe_backend_failure(st);
      for (int p = IA_POOL_SMALL; p < IA_POOL_COUNT; p++) {
        ia_arena_destroy(dev->arenas[p]);
        dev->arenas[p] = NULL;
      }
    }
    dev->unified = unified;
    atomic_store(&dev->pool_stream, IA_STREAM_NONE);
    atomic_store(&dev->ready, st == IA_OK ? 1 : -1);
  }
  pthread_mutex_unlock(&_ia_plugin.lock);
  return st;
}

_ia_device_t *_ia_device_made(int device, ia_status_t *st) {
  _ia_device_t *dev = _ia_device(device);
  if (!dev) {
    snprintf(_ia_failure, sizeof _ia_failure, "device index %d is outside 0..%d", device, IA_MAX_DEVICES - 1);
    *st = IA_ERR_INVALID_ARGUMENT;
    return NULL;
  }
  *st = atomic_load_explicit(&dev->ready, memory_order_acquire) == 1 ? IA_OK : create_device(device);
  return *st == IA_OK ? dev : NULL;
}

ia_status_t _ia_ensure_workspace(_ia_device_t *dev, int device) {
  if (atomic_load_explicit(&dev->workspace_ready, memory_order_acquire)) return IA_OK;
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&_ia_plugin.lock);
  if (!atomic_load(&dev->workspace_ready)) {
    /* Made once; after a release the same arena reserves its budget again (Note [Device lifetime]). */
    if (atomic_load(&dev->workspace_made)) {
      st = ia_arena_wake(dev->arenas[IA_POOL_WORKSPACE]);
    } else if ((st = make_arena(device, dev->unified, IA_POOL_WORKSPACE, &dev->arenas[IA_POOL_WORKSPACE])) ==
               IA_OK) {
      atomic_store_explicit(&dev->workspace_made, 1, memory_order_release);
    }
    if (st == IA_OK) {
      atomic_store_explicit(&dev->workspace_ready, 1, memory_order_release);
    } else {
      char budget[32], why[768];
      describe_backend_failure(st);
      snprintf(why, sizeof why, "%.700s", _ia_failure);
      snprintf(_ia_failure, sizeof _ia_failure,
               "reserving its %s workspace arena failed (%s); lower budget_mb in INDEXER_ARENA_CONF",
               _ia_format_bytes(_ia_plugin.config.budget, budget, sizeof budget), why);
    }
  }
  pthread_mutex_unlock(&_ia_plugin.lock);
  return st;
}

ia_status_t ia_plugin_reserve(int device) {
  ia_status_t st;
  _ia_device_t *dev = _ia_device_made(device, &st);
  return dev ? _ia_ensure_workspace(dev, device) : st;
}

const char *ia_plugin_failure(void) { return _ia_failure; }

/* Sleep: the workspace arena's reservation goes back to the driver when none of its blocks is live
 * (a workspace tensor, a CUDA graph's carve-out, the workspace pool's segment) and no stream of the
 * device captures, and comes back at the next reservation or workspace. The arena itself stays
 * (Note [Device lifetime], csrc/torch/plugin.h): readers on other threads keep reading it, and its counters
 * keep their history. */
ia_status_t ia_plugin_release(int device) {
  if (!_ia_device_ready(device)) return IA_OK;
  _ia_device_t *dev = &_ia_plugin.devices[device];
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&_ia_plugin.lock);
  ia_arena_t *arena = ia_plugin_arena(device, IA_POOL_WORKSPACE);
  if (arena && (st = ia_arena_sleep(arena)) != IA_OK) {
    ia_stats_t s;
    char live[32];
    ia_arena_stats(arena, &s);
    if (s.in_use.current)
      snprintf(_ia_failure, sizeof _ia_failure, "%s of its workspace arena are live (%llu blocks); free those "
               "tensors (or the CUDA graphs that hold them) first",
               _ia_format_bytes(s.in_use.current, live, sizeof live), (unsigned long long)s.blocks.current);
    else
      snprintf(_ia_failure, sizeof _ia_failure, "a CUDA graph is being captured on it; release once the capture "
               "has ended");
  } else if (arena) {
    atomic_store_explicit(&dev->workspace_ready, 0, memory_order_release);
    atomic_store(&dev->pool_stream, IA_STREAM_NONE);
  }
  pthread_mutex_unlock(&_ia_plugin.lock);
  return st;
}

bool _ia_device_ready(int device) {
  return device >= 0 && device < IA_MAX_DEVICES &&
         atomic_load_explicit(&_ia_plugin.devices[device].ready, memory_order_acquire) == 1;
}

ia_arena_t *ia_plugin_arena(int device, int pool) {
  if (!_ia_device_ready(device) || pool < 0 || pool >= IA_POOL_COUNT) return NULL;
  _ia_device_t *dev = &_ia_plugin.devices[device];
  if (pool == IA_POOL_WORKSPACE && !atomic_load_explicit(&dev->workspace_made, memory_order_acquire)) return NULL;
  return dev->arenas[pool];
}

bool ia_plugin_workspace_reserved(int device) {
  ia_arena_t *a = ia_plugin_arena(device, IA_POOL_WORKSPACE);
  return a && !ia_arena_asleep(a);
}

bool ia_plugin_device_unified(int device) { return _ia_device_ready(device) && _ia_plugin.devices[device].unified; }
bool ia_plugin_device_expandable(int device) { return _ia_device_ready(device) && _ia_plugin.devices[device].expandable; }

/* The device's exact current and peak of a quantity its totals keep; the sums came from the arenas. */
static void exact(ia_stat_t *s, const _ia_total_t *t) {
  s->current = t->current;
  s->peak = t->peak;
}

/* ia_torch_stats_t is indexed as PyTorch's StatType (aggregate, small pool, large pool), its small
 * and large entries by the pool kind itself (allocator.h). */
_Static_assert(IA_STAT_ALL == 0 && IA_POOL_SMALL == 1 && IA_POOL_LARGE == 2 && IA_STAT_KINDS == 3,
               "ia_torch_stats_t's index is PyTorch's StatType: AGGREGATE 0, SMALL_POOL 1, LARGE_POOL 2");

/* The device's arenas summed in one pass, each read once: every arena into stats[IA_STAT_ALL],
 * and with count IA_STAT_KINDS the general small and large pools into stats[IA_POOL_SMALL] and
 * stats[IA_POOL_LARGE] too, each with the graph pools' arenas of its kind (as PyTorch counts a
 * private pool's blocks). The device-wide current and peak are its totals' exact ones. */
static void sum_device(int device, ia_stats_t *stats, int count) {
  memset(stats, 0, (size_t)count * sizeof *stats);
  if (!_ia_device_ready(device)) return;
  for (int p = 0; p < IA_POOL_COUNT; p++) {
    ia_arena_t *a = ia_plugin_arena(device, p);
    if (!a) continue;
    ia_stats_t s;
    ia_arena_stats(a, &s);
    _ia_stats_add(&stats[IA_STAT_ALL], &s);
    if (count == IA_STAT_KINDS && p != IA_POOL_WORKSPACE) _ia_stats_add(&stats[p], &s);
  }
  _ia_graph_add_stats(device, stats, count);
  ia_stats_t *all = &stats[IA_STAT_ALL];
  ia_totals_t *t = &_ia_plugin.devices[device].totals;
  pthread_mutex_lock(&t->lock);
  exact(&all->in_use, &t->in_use);
  exact(&all->requested, &t->requested);
  exact(&all->blocks, &t->blocks);
  exact(&all->capacity, &t->capacity);
  exact(&all->regions, &t->regions);
  pthread_mutex_unlock(&t->lock);
  all->active = all->blocks; /* no arena holds a freed block back (arena.h) */
  all->active_bytes = all->in_use;
  all->fragmentation = all->free_bytes ? 1.0 - (double)all->largest_free / (double)all->free_bytes : 0.0;
}

void ia_plugin_device_stats(int device, ia_stats_t *out) { sum_device(device, out, 1); }

ia_device_totals_t ia_plugin_device_totals(int device) {
  ia_stats_t s;
  ia_plugin_device_stats(device, &s);
  return (ia_device_totals_t){s.in_use, s.requested, s.blocks, s.capacity, s.regions};
}

/* The one place the arena's quantities become PyTorch's families (IA_STAT_QUADS names each pair). */
void ia_plugin_torch_stats(int device, ia_torch_stats_t *out) {
  ia_stats_t stats[IA_STAT_KINDS];
  sum_device(device, stats, IA_STAT_KINDS);
#define FILL(name, torch, doc)                                                                      \
  for (int k = 0; k < IA_STAT_KINDS; k++) out->torch[k] = stats[k].name;
  IA_STAT_QUADS(FILL)
#undef FILL
  const ia_stats_t *all = &stats[IA_STAT_ALL];
  out->num_alloc_retries = (int64_t)(all->retries + ia_plugin_retries());
  out->num_ooms = (int64_t)ia_plugin_ooms();
  out->num_device_alloc = (int64_t)all->backend_reserves;
  out->num_device_free = (int64_t)all->backend_releases;
  if (!_ia_device_ready(device)) return;
  pthread_mutex_lock(&_ia_plugin.lock);
  const ia_torch_stats_t *base = &_ia_plugin.devices[device].accumulated_base;
#define SINCE_RESET(name, torch, doc)                                                               \
  for (int k = 0; k < IA_STAT_KINDS; k++) {                                                         \
    out->torch[k].allocated -= base->torch[k].allocated;                                           \
    out->torch[k].freed -= base->torch[k].freed;                                                   \
  }
  IA_STAT_QUADS(SINCE_RESET)
#undef SINCE_RESET
  out->num_alloc_retries -= base->num_alloc_retries;
  out->num_ooms -= base->num_ooms;
  out->num_device_alloc -= base->num_device_alloc;
  out->num_device_free -= base->num_device_free;
  pthread_mutex_unlock(&_ia_plugin.lock);
}

void ia_plugin_reset_accumulated(int device) {
  if (!_ia_device_ready(device)) return;
  ia_torch_stats_t now;
  pthread_mutex_lock(&_ia_plugin.lock);
  memset(&_ia_plugin.devices[device].accumulated_base, 0, sizeof now);
  pthread_mutex_unlock(&_ia_plugin.lock);
  ia_plugin_torch_stats(device, &now); /* the counters since the beginning */
  pthread_mutex_lock(&_ia_plugin.lock);
  _ia_plugin.devices[device].accumulated_base = now;
  pthread_mutex_unlock(&_ia_plugin.lock);
}

void ia_plugin_reset_peaks(int device) {
  if (!_ia_device_ready(device)) return;
  for (int p = 0; p < IA_POOL_COUNT; p++) {
    ia_arena_t *a = ia_plugin_arena(device, p);
    if (a) ia_arena_reset_peaks(a);
  }
  _ia_graph_reset_peaks(device);
  _ia_totals_reset_peaks(&_ia_plugin.devices[device].totals);
}

uint64_t ia_plugin_ooms(void) { return atomic_load(&_ia_plugin.ooms); }
uint64_t ia_plugin_retries(void) { return atomic_load(&_ia_plugin.retries); }

/* ---- tracing ---------------------------------------------------------------------------------- */

typedef struct {
  ia_trace_t *trace;
  int device;
} trace_target_t;

static void trace_graph_arena(void *target, ia_pool_id_t id, int kind, ia_arena_t *arena) {
  (void)id;
  trace_target_t *t = target;
  ia_arena_set_trace(arena, t->trace, t->device, _ia_graph_trace_tag(kind));
}

/* Every arena of every device records into the plugin's traces while they record (else none, so
 * that an arena nobody listens to pays nothing). Under the plugin's lock. */
static void trace_every_arena(void) {
  for (int d = 0; d < IA_MAX_DEVICES; d++) {
    if (atomic_load(&_ia_plugin.devices[d].ready) != 1) continue;
    for (int p = 0; p < IA_POOL_COUNT; p++)
      if (ia_plugin_arena(d, p)) ia_arena_set_trace(ia_plugin_arena(d, p), recording(_ia_plugin.trace), d, (uint8_t)p);
    trace_target_t target = {recording(_ia_plugin.graph_trace), d};
    _ia_graph_each_arena(d, trace_graph_arena, &target);
  }
}

/* The plugin's traces, made on first use (the eager arenas' with a ring of `capacity` events, at
 * least one), their ring off and no sink until the callers set them. Under the plugin's lock. */
static ia_status_t plugin_traces(size_t capacity) {
  ia_status_t st = IA_OK;
  /* A ring made for the sink alone (capacity 0) takes the first capacity a ring is started with. */
  if (_ia_plugin.trace && capacity && !_ia_plugin.ring_sized) st = _ia_trace_resize(_ia_plugin.trace, capacity);
  if (!_ia_plugin.trace && (st = ia_trace_create(capacity ? capacity : 1, &_ia_plugin.trace)) == IA_OK)
    ia_trace_set_enabled(_ia_plugin.trace, false);
  if (st == IA_OK && capacity) _ia_plugin.ring_sized = true;
  ia_trace_t *graph_trace = NULL;
  if (st == IA_OK && !_ia_plugin.graph_trace && (st = ia_trace_create(1, &graph_trace)) == IA_OK) {
    ia_trace_set_enabled(graph_trace, false);
    atomic_store_explicit(&_ia_plugin.graph_trace, graph_trace, memory_order_release);
  }
  return st;
}

ia_status_t ia_plugin_trace_start(size_t capacity) {
  pthread_mutex_lock(&_ia_plugin.lock);
  ia_status_t st = plugin_traces(capacity);
  if (st == IA_OK) {
    ia_trace_set_enabled(_ia_plugin.trace, true);
    trace_every_arena();
  }
  pthread_mutex_unlock(&_ia_plugin.lock);
  return st;
}

ia_status_t ia_plugin_trace_sink(ia_trace_sink_t sink, void *ctx) {
  pthread_mutex_lock(&_ia_plugin.lock);
  ia_status_t st = sink ? plugin_traces(0) : IA_OK;
  if (st == IA_OK && _ia_plugin.trace) {
    ia_trace_set_sink(_ia_plugin.trace, sink, ctx);
    ia_trace_set_sink(_ia_plugin.graph_trace, sink, ctx);
    trace_every_arena();
  }
  pthread_mutex_unlock(&_ia_plugin.lock);
  return st;
}

/* Under the lock: the trace may be made by another thread at this moment (ia_plugin_trace_start). */
ia_trace_t *ia_plugin_trace(void) {
  pthread_mutex_lock(&_ia_plugin.lock);
  ia_trace_t *t = _ia_plugin.trace;
  pthread_mutex_unlock(&_ia_plugin.lock);
  return t;
}

ia_status_t _ia_plugin_graph_arena(int device, int kind, ia_stream_t stream, const _ia_owner_t *owner,
                                   ia_arena_t **out) {
  _ia_device_t *dev = &_ia_plugin.devices[device];
  ia_arena_options_t o;
  ia_backend_t *backend;
  ia_status_t st = make_backend(device, dev->unified, false, &backend); /* graph pools keep regions */
  if (st != IA_OK) return st;
  if (kind == IA_POOL_WORKSPACE) {
    ia_arena_default_options(&o);
    o.growable = true;
    /* Regions of exactly what is asked, so that the graph holds no more of the budget than it uses. */
    o.alignment = o.region_round = o.region_min = _ia_plugin.config.alignment;
    st = _ia_carve_backend_create(dev->arenas[IA_POOL_WORKSPACE], stream, backend, &backend);
  } else {
    ia_plugin_pool_options(kind, &o); /* the general pool's of that kind: growable, its regions */
    const ia_pool_allocator_t *own = _ia_graph_pool_options(owner->graph_pool, &o.no_split);
    if (own) st = _ia_pool_backend_create(own, device, stream, backend, &backend);
  }
  if (st == IA_OK) st = ia_arena_create(&o, backend, out);
  /* A carve-out's bytes are already counted by the workspace arena it comes from. */
  if (st == IA_OK && kind != IA_POOL_WORKSPACE) _ia_arena_set_totals(*out, &dev->totals);
  if (st == IA_OK && kind == IA_POOL_WORKSPACE) _ia_arena_watch_captures(*out, &dev->totals.captures);
  if (st == IA_OK) _ia_arena_set_region_hook(*out, _ia_registry_hook, (void *)owner);
  /* Under the graph lock, which trace_every_arena also takes after setting the sink. */
  ia_trace_t *graph_trace = atomic_load_explicit(&_ia_plugin.graph_trace, memory_order_acquire);
  if (st == IA_OK && recording(graph_trace))
    ia_arena_set_trace(*out, graph_trace, device, _ia_graph_trace_tag(kind));
  return st;
}

void _ia_plugin_flush_events(int device) {
  if (!_ia_device_ready(device)) return;
  for (int p = 0; p < IA_POOL_COUNT; p++)
    if (ia_plugin_arena(device, p)) _ia_arena_flush_events(ia_plugin_arena(device, p));
  _ia_graph_pools_flush_events(device);
}
