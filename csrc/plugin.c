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
 * arena, stream-ordered, and no tensor costs a cudaMalloc once its size class has a region. Each
 * thread keeps a cache of its own freed blocks in them (thread_cache.c), so that threads allocating
 * at once do not queue on an arena's lock.
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
 * Failure: PyTorch turns a NULL from the alloc function into a tensor at address 0, so this file
 * never returns NULL for a non-zero request. It formats a message and calls the raise_oom hook,
 * which throws c10::OutOfMemoryError from C++ (this file is built with -fexceptions so the throw
 * can unwind through it; no lock is held at that point). Without a hook it aborts.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MAX_DEVICES IA_MAX_DEVICES
#define SMALL_REQUEST ((size_t)IA_SMALL_REQUEST)
#define MiB ((size_t)1 << 20)
/* PyTorch's caching allocator: a small-block segment (kSmallBuffer) and the smallest large one
 * (kLargeBuffer); large segments grow in 2 MiB steps (kRoundLarge). */
#define TORCH_SMALL_SEGMENT (2 * MiB)
#define TORCH_MIN_LARGE_SEGMENT (20 * MiB)
#define TORCH_SEGMENT_ROUND (2 * MiB)
/* Thread caches of the general pools (ia_arena_options_t.thread_cache): PyTorch allocates from
 * several threads (the main thread, autograd's device threads, data-loading threads pinning
 * memory), and a thread mostly frees and reallocates the same tensor sizes on its own stream. A
 * cache never makes a pool grow (the arena takes the caches' blocks back first), so what it costs is
 * unmerged free blocks, bounded per thread by these sizes (and by 1,024 blocks, which bounds the
 * work of taking them back). A pool grows only while the caches are empty, so their blocks are its
 * slack: a larger cache keeps more of it unmerged and sends more requests to take blocks back one by
 * one (benchmarks/RESULTS.md compares the sizes). The small pool's blocks are 1 MiB at most; in the large pool only
 * blocks up to 8 MiB are kept, where the lock's cost is not yet negligible beside the work on the
 * tensor. */
#define SMALL_THREAD_CACHE (16 * MiB)
#define LARGE_THREAD_CACHE (32 * MiB)
#define LARGE_THREAD_CACHE_BLOCK (8 * MiB)

typedef struct {
  _Atomic int ready;           /* 0: not yet, 1: general arenas exist, -1: creation failed */
  _Atomic int workspace_ready; /* 1: arenas[IA_POOL_WORKSPACE] exists */
  ia_arena_t *arenas[IA_POOL_COUNT];
  ia_totals_t totals;
  bool unified;
  bool expandable;      /* the general arenas map pages of one address range each, this big: */
  size_t address_range;
  uint64_t peers;       /* devices that asked to reach this one's memory (enablePeerAccess) */
  _ia_owner_t owner; /* what the region registry answers for this device's own arenas */
  _Atomic ia_stream_t pool_stream; /* workspace scope: the stream of the pool's first segment */
} device_slot_t;

static struct {
  pthread_mutex_t lock; /* guards configuration and device creation */
  bool configured;
  ia_plugin_config_t config; /* its strings are this file's own copies */
  ia_trace_t *trace;
  device_slot_t devices[MAX_DEVICES];
  _Atomic uint64_t ooms, retries;
} plugin = {.lock = PTHREAD_MUTEX_INITIALIZER};

static __thread int workspace_depth;
static __thread uint64_t pool_refusals;

static const char *const pool_names[IA_POOL_COUNT] = {"workspace", "small", "large"};

static const char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

#define CONFIG_STRINGS(X) X(cudart_path) X(meminfo_path) X(cgroup_root) X(oom_report_path)

ia_status_t ia_plugin_configure(const ia_plugin_config_t *config) {
  if (!config || !config->budget || !_ia_is_pow2(config->alignment) || config->alignment < 16)
    return IA_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&plugin.lock);
  ia_status_t st = IA_OK;
  for (int d = 0; d < MAX_DEVICES; d++)
    if (atomic_load(&plugin.devices[d].ready) == 1) st = IA_ERR_INVALID_ARGUMENT;
  if (st == IA_OK) {
#define REPLACE(field) free((char *)plugin.config.field);
    CONFIG_STRINGS(REPLACE)
#undef REPLACE
    plugin.config = *config;
#define COPY(field) plugin.config.field = dup_or_null(config->field);
    CONFIG_STRINGS(COPY)
#undef COPY
    plugin.configured = true;
  }
  pthread_mutex_unlock(&plugin.lock);
  return st;
}

static ia_status_t make_backend(int device, bool unified, bool mapped, ia_backend_t **out) {
  size_t page = plugin.config.host_page_size ? plugin.config.host_page_size : 2 * MiB;
  const char *cudart = plugin.config.cudart_path;
  ia_status_t st = plugin.config.host_memory ? (mapped ? ia_host_mapping_backend_create(0, page, out)
                                                       : ia_host_backend_create(0, out))
                                             : (mapped ? ia_vmm_backend_create(device, cudart, out)
                                                       : ia_cuda_backend_create(device, cudart, out));
  if (st != IA_OK || !unified) return st;
  ia_guard_options_t g = {.meminfo_path = plugin.config.meminfo_path, .cgroup_root = plugin.config.cgroup_root,
                          .headroom = plugin.config.host_headroom};
  return ia_guard_backend_create(*out, &g, out);
}

size_t ia_plugin_pool_segment(void) {
  size_t segment = _ia_align_up(plugin.config.budget, TORCH_SEGMENT_ROUND);
  return segment < TORCH_MIN_LARGE_SEGMENT ? TORCH_MIN_LARGE_SEGMENT : segment;
}

const char *ia_plugin_pool_name(int pool) {
  return pool >= 0 && pool < IA_POOL_COUNT ? pool_names[pool] : NULL;
}

ia_status_t ia_plugin_pool_options(int pool, ia_arena_options_t *o) {
  if (!o || pool < 0 || pool >= IA_POOL_COUNT) return IA_ERR_INVALID_ARGUMENT;
  ia_arena_default_options(o);
  if (pool == IA_POOL_WORKSPACE) {
    o->capacity = plugin.config.scope == IA_SCOPE_WORKSPACE ? ia_plugin_pool_segment() + TORCH_SMALL_SEGMENT
                                                            : plugin.config.budget;
    o->alignment = plugin.config.alignment;
  } else {
    o->growable = true;
    o->alignment = 512;
    o->region_round = 2 * MiB;
    o->region_min = pool == IA_POOL_SMALL ? 2 * MiB : 20 * MiB;
    o->region_exact_above = pool == IA_POOL_SMALL ? SIZE_MAX : 10 * MiB;
    o->thread_cache = pool == IA_POOL_SMALL ? SMALL_THREAD_CACHE : LARGE_THREAD_CACHE;
    o->thread_cache_block = pool == IA_POOL_SMALL ? SMALL_REQUEST : LARGE_THREAD_CACHE_BLOCK;
  }
  return IA_OK;
}

static ia_status_t make_arena(int device, bool unified, int pool, ia_arena_t **out) {
  device_slot_t *slot = &plugin.devices[device];
  ia_totals_t *totals = &slot->totals;
  bool mapped = pool != IA_POOL_WORKSPACE && slot->expandable;
  ia_arena_options_t o;
  ia_plugin_pool_options(pool, &o);
  if (mapped) o.address_range = slot->address_range;
  ia_backend_t *backend;
  ia_status_t st = make_backend(device, unified, mapped, &backend);
  if (st == IA_OK) st = ia_arena_create(&o, backend, out);
  if (st == IA_OK) _ia_arena_set_totals(*out, totals);
  if (st == IA_OK) _ia_arena_set_region_hook(*out, _ia_registry_hook, &plugin.devices[device].owner);
  if (st == IA_OK && plugin.trace) ia_arena_set_trace(*out, plugin.trace, device, (uint8_t)pool);
  return st;
}

/* Why the last device creation or reservation of this thread failed. */
static __thread char failure[1024];

static void describe_backend_failure(ia_status_t st) {
  const char *why = st == IA_ERR_HOST_MEMORY_GUARD ? ia_guard_last_message()
                    : (st == IA_ERR_BACKEND || st == IA_ERR_BACKEND_OUT_OF_MEMORY) ? ia_cuda_last_error()
                                                                                   : ia_status_str(st);
  snprintf(failure, sizeof failure, "%s", why && why[0] ? why : ia_status_str(st));
}

/* expandable: whether the device's general pools map pages, and how much address space each
 * reserves. auto takes regions where the driver cannot map (ia_plugin_device_expandable says
 * which); on refuses to, saying why. */
static ia_status_t choose_mapping(int device, bool *mapped, size_t *range) {
  *mapped = false;
  *range = plugin.config.address_range;
  if (plugin.config.scope != IA_SCOPE_PROCESS || plugin.config.expandable == 0) return IA_OK;
  if (plugin.config.host_memory) {
    *mapped = true;
    if (!*range) *range = (size_t)8 << 30;
    return IA_OK;
  }
  ia_status_t st = ia_vmm_supported(device, plugin.config.cudart_path);
  if (st != IA_OK && plugin.config.expandable < 0) return IA_OK;
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
  device_slot_t *slot = &plugin.devices[device];
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&plugin.lock);
  if (atomic_load(&slot->ready) != 1) {
    if (!plugin.configured) {
      snprintf(failure, sizeof failure, "the allocator was loaded but never configured: call alloc.install()");
      st = IA_ERR_INVALID_ARGUMENT;
    }
    if (st == IA_OK && !plugin.config.host_memory) st = ia_cuda_load(plugin.config.cudart_path);
    bool unified = plugin.config.unified == 1;
    if (st == IA_OK && plugin.config.unified < 0 && !plugin.config.host_memory) {
      ia_memory_attributes_t attributes;
      st = ia_cuda_memory_attributes(device, &attributes);
      unified = st == IA_OK && ia_memory_is_unified(&attributes);
    }
    slot->owner = (_ia_owner_t){.device = device};
    if (st == IA_OK) st = choose_mapping(device, &slot->expandable, &slot->address_range);
    for (int p = IA_POOL_SMALL; st == IA_OK && plugin.config.scope == IA_SCOPE_PROCESS && p < IA_POOL_COUNT; p++)
      st = make_arena(device, unified, p, &slot->arenas[p]);
    for (int peer = 0; st == IA_OK && peer < MAX_DEVICES; peer++) /* asked before the pools existed */
      for (int p = IA_POOL_SMALL; st == IA_OK && p < IA_POOL_COUNT && (slot->peers >> peer & 1); p++)
        if (slot->arenas[p]) st = _ia_arena_grant_access(slot->arenas[p], peer);
    if (st != IA_OK) {
      if (plugin.configured) describe_backend_failure(st);
      for (int p = IA_POOL_SMALL; p < IA_POOL_COUNT; p++) {
        ia_arena_destroy(slot->arenas[p]);
        slot->arenas[p] = NULL;
      }
    }
    slot->unified = unified;
    atomic_store(&slot->pool_stream, IA_STREAM_NONE);
    atomic_store(&slot->ready, st == IA_OK ? 1 : -1);
  }
  pthread_mutex_unlock(&plugin.lock);
  return st;
}

static device_slot_t *device_slot(int device, ia_status_t *st) {
  if (device < 0 || device >= MAX_DEVICES) {
    snprintf(failure, sizeof failure, "device index %d is outside 0..%d", device, MAX_DEVICES - 1);
    *st = IA_ERR_INVALID_ARGUMENT;
    return NULL;
  }
  device_slot_t *slot = &plugin.devices[device];
  *st = atomic_load_explicit(&slot->ready, memory_order_acquire) == 1 ? IA_OK : create_device(device);
  return *st == IA_OK ? slot : NULL;
}

static ia_status_t ensure_workspace(device_slot_t *slot, int device) {
  if (atomic_load_explicit(&slot->workspace_ready, memory_order_acquire)) return IA_OK;
  ia_status_t st = IA_OK;
  pthread_mutex_lock(&plugin.lock);
  if (!atomic_load(&slot->workspace_ready)) {
    st = make_arena(device, slot->unified, IA_POOL_WORKSPACE, &slot->arenas[IA_POOL_WORKSPACE]);
    if (st == IA_OK) {
      atomic_store_explicit(&slot->workspace_ready, 1, memory_order_release);
    } else {
      char budget[32], why[768];
      describe_backend_failure(st);
      snprintf(why, sizeof why, "%.700s", failure);
      snprintf(failure, sizeof failure,
               "reserving its %s workspace arena failed (%s); lower budget_mb in INDEXER_ARENA_CONF",
               _ia_format_bytes(plugin.config.budget, budget, sizeof budget), why);
    }
  }
  pthread_mutex_unlock(&plugin.lock);
  return st;
}

ia_status_t ia_plugin_reserve(int device) {
  ia_status_t st;
  device_slot_t *slot = device_slot(device, &st);
  return slot ? ensure_workspace(slot, device) : st;
}

const char *ia_plugin_failure(void) { return failure; }

static bool device_ready(int device) {
  return device >= 0 && device < MAX_DEVICES &&
         atomic_load_explicit(&plugin.devices[device].ready, memory_order_acquire) == 1;
}

ia_arena_t *ia_plugin_arena(int device, int pool) {
  if (!device_ready(device) || pool < 0 || pool >= IA_POOL_COUNT) return NULL;
  device_slot_t *slot = &plugin.devices[device];
  if (pool == IA_POOL_WORKSPACE && !atomic_load_explicit(&slot->workspace_ready, memory_order_acquire)) return NULL;
  return slot->arenas[pool];
}

bool ia_plugin_device_unified(int device) { return device_ready(device) && plugin.devices[device].unified; }
bool ia_plugin_device_expandable(int device) { return device_ready(device) && plugin.devices[device].expandable; }

ia_device_totals_t ia_plugin_device_totals(int device) {
  ia_device_totals_t out = {0};
  if (!device_ready(device)) return out;
  ia_totals_t *t = &plugin.devices[device].totals;
  out.in_use = atomic_load(&t->in_use);
  out.in_use_peak = atomic_load(&t->in_use_peak);
  out.capacity = atomic_load(&t->capacity);
  out.capacity_peak = atomic_load(&t->capacity_peak);
  return out;
}

void _ia_stats_add(ia_stats_t *sum, const ia_stats_t *s) {
  uint64_t largest = sum->largest_free > s->largest_free ? sum->largest_free : s->largest_free;
#define ADD(type, name, doc) sum->name = _Generic(sum->name, double: sum->name, default: sum->name + s->name);
  IA_STAT_FIELDS(ADD)
#undef ADD
  sum->largest_free = largest;
}

void ia_plugin_device_stats(int device, ia_stats_t *out) {
  memset(out, 0, sizeof *out);
  if (!device_ready(device)) return;
  for (int p = 0; p < IA_POOL_COUNT; p++) {
    ia_arena_t *a = ia_plugin_arena(device, p);
    if (!a) continue;
    ia_stats_t s;
    ia_arena_stats(a, &s);
    _ia_stats_add(out, &s);
  }
  _ia_graph_add_stats(device, out);
  ia_device_totals_t t = ia_plugin_device_totals(device);
  out->in_use_peak = t.in_use_peak;
  out->capacity_peak = t.capacity_peak;
  out->fragmentation = out->free_bytes ? 1.0 - (double)out->largest_free / (double)out->free_bytes : 0.0;
}

void ia_plugin_reset_peaks(int device) {
  if (!device_ready(device)) return;
  for (int p = 0; p < IA_POOL_COUNT; p++)
    if (ia_plugin_arena(device, p)) ia_arena_reset_peaks(plugin.devices[device].arenas[p]);
  _ia_totals_reset_peaks(&plugin.devices[device].totals);
}

uint64_t ia_plugin_ooms(void) { return atomic_load(&plugin.ooms); }
uint64_t ia_plugin_retries(void) { return atomic_load(&plugin.retries); }
uint64_t ia_plugin_pool_refusals(void) { return pool_refusals; }

void ia_workspace_enter(void) { workspace_depth++; }
bool ia_workspace_exit(void) {
  if (workspace_depth <= 0) return false;
  workspace_depth--;
  return true;
}
int ia_workspace_depth(void) { return workspace_depth; }

/* ---- tracing ---------------------------------------------------------------------------------- */

ia_status_t ia_plugin_trace_start(size_t capacity) {
  pthread_mutex_lock(&plugin.lock);
  ia_status_t st = IA_OK;
  if (!plugin.trace) st = ia_trace_create(capacity, &plugin.trace);
  if (st == IA_OK) {
    ia_trace_set_enabled(plugin.trace, true);
    for (int d = 0; d < MAX_DEVICES; d++)
      if (atomic_load(&plugin.devices[d].ready) == 1)
        for (int p = 0; p < IA_POOL_COUNT; p++)
          if (ia_plugin_arena(d, p)) ia_arena_set_trace(plugin.devices[d].arenas[p], plugin.trace, d, (uint8_t)p);
  }
  pthread_mutex_unlock(&plugin.lock);
  return st;
}

ia_trace_t *ia_plugin_trace(void) { return plugin.trace; }

/* ---- the PyTorch entry points ----------------------------------------------------------------- */

static void raise_oom(const char *message) {
  atomic_fetch_add(&plugin.ooms, 1);
  if (plugin.config.raise_oom) plugin.config.raise_oom(message); /* throws */
  fprintf(stderr, "indexer-arena: %s\nindexer-arena: no out-of-memory hook is set; aborting\n", message);
  abort();
}

static size_t describe_arena(ia_arena_t *a, char *buf, size_t len) {
  ia_stats_t s;
  ia_arena_stats(a, &s);
  char cap[32], used[32], largest[32], page[32], pages[64] = "";
  if (ia_arena_page_size(a))
    snprintf(pages, sizeof pages, " mapped in %s pages", _ia_format_bytes(ia_arena_page_size(a), page, sizeof page));
  return (size_t)snprintf(buf, len, "holds %s%s, %s in use, largest free block %s",
                          _ia_format_bytes(s.capacity, cap, sizeof cap), pages,
                          _ia_format_bytes(s.in_use, used, sizeof used),
                          _ia_format_bytes(s.largest_free, largest, sizeof largest));
}

static void report_hint(char *buf, size_t len) {
  if (!plugin.config.oom_report_path) {
    buf[0] = '\0';
    return;
  }
  bool written = ia_plugin_write_report(plugin.config.oom_report_path);
  snprintf(buf, len, written ? " Memory report written to %s." : " (Could not write the memory report to %s.)",
           plugin.config.oom_report_path);
}

/* Bytes the device's CUDA graph pools hold: of one pool, or of all (NULL). */
static uint64_t graph_pools_held(int device, const ia_pool_id_t *id) {
  ia_graph_pool_info_t info[64];
  size_t n = ia_graph_pools(device, info, 64);
  uint64_t held = 0;
  for (size_t i = 0; i < n && i < 64; i++)
    if (!id || (info[i].first == id->first && info[i].second == id->second)) held += info[i].capacity;
  return held;
}

/* Why a growable arena of the device could not grow, as a sentence that follows another. */
static void growth_refusal(ia_status_t st, int device, char *buf, size_t len) {
  if (st == IA_ERR_LIMIT)
    snprintf(buf, len, " The pools may hold at most %.0f MiB here (torch.cuda.set_per_process_memory_fraction).",
             (double)atomic_load(&plugin.devices[device].totals.limit) / (double)MiB);
  else if (st == IA_ERR_HOST_MEMORY_GUARD) snprintf(buf, len, " %s.", ia_guard_last_message());
  else if (st == IA_ERR_BACKEND_OUT_OF_MEMORY || (st == IA_ERR_BACKEND && ia_cuda_last_error()[0]))
    snprintf(buf, len, " %s.", ia_cuda_last_error()); /* a driver call's own words (mapping, too) */
  else snprintf(buf, len, " %s.", ia_status_str(st));
}

__attribute__((noinline)) static void fail_alloc(int device, int pool, size_t size, ia_status_t st) {
  char message[2048], req[32], state[256], hint[512], budget[32], graphs[32];
  _ia_format_bytes(size, req, sizeof req);
  if (pool < 0) {
    snprintf(message, sizeof message, "CUDA out of memory on device %d: cannot allocate %s: %s", device,
             req, failure);
    raise_oom(message);
  }
  ia_arena_t *a = plugin.devices[device].arenas[pool];
  describe_arena(a, state, sizeof state);
  report_hint(hint, sizeof hint);
  if (pool == IA_POOL_WORKSPACE) {
    snprintf(message, sizeof message,
             "CUDA out of memory on device %d: workspace request of %s (%zu bytes) does not fit the "
             "workspace arena (budget %s; it %s). The workspace arena never grows: raise budget_mb in "
             "INDEXER_ARENA_CONF (or VLLM_SPARSE_INDEXER_MAX_LOGITS_MB), or plan smaller pieces.%s",
             device, req, size, _ia_format_bytes(plugin.config.budget, budget, sizeof budget), state, hint);
  } else {
    char why[640], range[32];
    ia_region_info_t r;
    if (st == IA_ERR_OUT_OF_MEMORY && ia_arena_address_range(a, &r))
      snprintf(why, sizeof why, " No gap of its %s address range can take it (mapped pools reserve the "
               "device's memory in address space, once).", _ia_format_bytes(r.size, range, sizeof range));
    else
      growth_refusal(st, device, why, sizeof why);
    snprintf(message, sizeof message,
             "CUDA out of memory on device %d: request of %s (%zu bytes) for the general %s pool "
             "(it %s; the workspace arena holds a further %s, CUDA graph pools %s).%s Free tensors or "
             "call torch.cuda.empty_cache(), or lower budget_mb in INDEXER_ARENA_CONF to leave the "
             "device more room.%s",
             device, req, size, pool_names[pool], state,
             ia_plugin_arena(device, IA_POOL_WORKSPACE) ? _ia_format_bytes(plugin.config.budget, budget, sizeof budget)
                                                        : "nothing (not reserved yet)",
             _ia_format_bytes(graph_pools_held(device, NULL), graphs, sizeof graphs), why, hint);
  }
  raise_oom(message);
}

__attribute__((noinline)) static void fail_graph_alloc(int device, ia_pool_id_t id, int kind, size_t size,
                                                       ia_status_t st) {
  char message[2048], req[32], held[32], budget[32], state[256] = "", why[640], hint[512];
  _ia_format_bytes(size, req, sizeof req);
  if (st == IA_ERR_INVALID_ARGUMENT) snprintf(why, sizeof why, " %.600s.", failure[0] ? failure :
                                              "PyTorch is not allocating to that pool now");
  else growth_refusal(st, device, why, sizeof why);
  report_hint(hint, sizeof hint);
  if (kind == GRAPH_WORKSPACE) {
    ia_arena_t *ws = ia_plugin_arena(device, IA_POOL_WORKSPACE);
    if (ws) describe_arena(ws, state, sizeof state);
    snprintf(message, sizeof message,
             "CUDA out of memory on device %d: workspace request of %s while capturing into CUDA graph "
             "pool (%" PRIu64 ", %" PRIu64 ") does not fit the workspace arena (budget %s; it %s). "
             "A graph keeps the workspace blocks it allocates until it is released: raise budget_mb in "
             "INDEXER_ARENA_CONF, or capture smaller pieces.%s",
             device, req, id.first, id.second, _ia_format_bytes(plugin.config.budget, budget, sizeof budget),
             state, hint);
  } else {
    snprintf(message, sizeof message,
             "CUDA out of memory on device %d: request of %s (%zu bytes) for CUDA graph pool (%" PRIu64 ", %" PRIu64
             "), which holds %s.%s A graph keeps what it allocates during capture until it is released: free "
             "eager tensors and call torch.cuda.empty_cache() before capturing, or lower budget_mb in "
             "INDEXER_ARENA_CONF.%s",
             device, req, size, id.first, id.second,
             _ia_format_bytes(graph_pools_held(device, &id), held, sizeof held), why, hint);
  }
  raise_oom(message);
}

static void *graph_alloc(device_slot_t *slot, int device, size_t size, ia_stream_t stream, ia_pool_id_t id) {
  int kind = workspace_depth ? GRAPH_WORKSPACE : size <= SMALL_REQUEST ? GRAPH_SMALL : GRAPH_LARGE;
  ia_status_t st = workspace_depth ? ensure_workspace(slot, device) : IA_OK;
  ia_arena_t *arena = st == IA_OK ? _ia_graph_arena(device, id, kind, stream, &st) : NULL;
  void *p = NULL;
  if (arena) st = ia_arena_alloc(arena, size, stream, &p);
  if (st != IA_OK) fail_graph_alloc(device, id, kind, size, st);
  return p;
}

void *ia_torch_alloc(size_t size, int device, void *stream, const ia_pool_id_t *graph_pool) {
  if (size == 0) return NULL;
  ia_status_t st;
  device_slot_t *slot = device_slot(device, &st);
  if (slot && plugin.config.scope != IA_SCOPE_PROCESS) {
    snprintf(failure, sizeof failure, "the allocator is installed for workspace pools only, not as the "
             "process's allocator: its MemPools call ia_pool_alloc");
    st = IA_ERR_INVALID_ARGUMENT;
  }
  if (st == IA_OK && graph_pool) return graph_alloc(slot, device, size, (ia_stream_t)stream, *graph_pool);
  if (slot && workspace_depth) st = ensure_workspace(slot, device);
  if (st != IA_OK) fail_alloc(device, -1, size, st);
  int pool = workspace_depth ? IA_POOL_WORKSPACE : size <= SMALL_REQUEST ? IA_POOL_SMALL : IA_POOL_LARGE;
  void *p;
  st = ia_arena_alloc(slot->arenas[pool], size, (ia_stream_t)stream, &p);
  if (st != IA_OK && pool != IA_POOL_WORKSPACE) {
    /* The other general pool may be caching whole regions this request could use. */
    if (ia_arena_release_cached(slot->arenas[IA_POOL_SMALL + IA_POOL_LARGE - pool])) {
      atomic_fetch_add(&plugin.retries, 1);
      st = ia_arena_alloc(slot->arenas[pool], size, (ia_stream_t)stream, &p);
    }
  }
  if (st != IA_OK) fail_alloc(device, pool, size, st);
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
  if (atomic_load_explicit(&plugin.devices[owner->device].totals.captures, memory_order_relaxed) &&
      _ia_graph_defer_free(owner->device, arena, owner, ptr))
    return;
  _ia_free_owned(arena, owner, ptr);
}

void ia_torch_record_stream(void *ptr, void *stream) {
  const _ia_owner_t *owner;
  ia_arena_t *arena = _ia_registry_find(ptr, &owner);
  if (arena) ia_arena_record_stream(arena, ptr, (ia_stream_t)stream);
}

ia_totals_t *_ia_plugin_totals(int device) {
  return device >= 0 && device < MAX_DEVICES ? &plugin.devices[device].totals : NULL;
}

ia_status_t _ia_plugin_graph_arena(int device, int kind, ia_stream_t stream, const _ia_owner_t *owner,
                                   ia_arena_t **out) {
  device_slot_t *slot = &plugin.devices[device];
  ia_arena_options_t o;
  ia_arena_default_options(&o);
  o.growable = true;
  ia_backend_t *backend;
  ia_status_t st = make_backend(device, slot->unified, false, &backend); /* graph pools keep regions */
  if (st != IA_OK) return st;
  if (kind == GRAPH_WORKSPACE) {
    /* Regions of exactly what is asked, so that the graph holds no more of the budget than it uses. */
    o.alignment = o.region_round = o.region_min = plugin.config.alignment;
    st = _ia_carve_backend_create(slot->arenas[IA_POOL_WORKSPACE], stream, backend, &backend);
  } else {
    o.alignment = 512;
    o.region_round = 2 * MiB;
    o.region_min = kind == GRAPH_SMALL ? 2 * MiB : 20 * MiB;
    o.region_exact_above = kind == GRAPH_SMALL ? SIZE_MAX : 10 * MiB;
  }
  if (st == IA_OK) st = ia_arena_create(&o, backend, out);
  /* A carve-out's bytes are already counted by the workspace arena it comes from. */
  if (st == IA_OK && kind != GRAPH_WORKSPACE) _ia_arena_set_totals(*out, &slot->totals);
  if (st == IA_OK && kind == GRAPH_WORKSPACE) _ia_arena_watch_captures(*out, &slot->totals.captures);
  if (st == IA_OK) _ia_arena_set_region_hook(*out, _ia_registry_hook, (void *)owner);
  return st;
}

void _ia_plugin_flush_events(int device) {
  if (!device_ready(device)) return;
  for (int p = 0; p < IA_POOL_COUNT; p++)
    if (ia_plugin_arena(device, p)) _ia_arena_flush_events(plugin.devices[device].arenas[p]);
  _ia_graph_pools_flush_events(device);
}

/* torch.cuda.set_per_process_memory_fraction: everything the device's pools hold, the workspace
 * arena included, stays under fraction x the device's memory; the general pools stop growing there
 * (and raise out-of-memory, after giving back their cached regions). */
void ia_torch_memory_fraction(double fraction, int device) {
  ia_status_t st;
  device_slot_t *slot = device_slot(device, &st);
  size_t free_bytes, total;
  if (!slot || ia_cuda_mem_info(device, &free_bytes, &total) != IA_OK) return;
  atomic_store(&slot->totals.limit, (uint64_t)(fraction * (double)total));
}

ia_status_t ia_torch_enable_peer_access(int dev, int dev_to_access) {
  if (dev < 0 || dev >= MAX_DEVICES || dev_to_access < 0 || dev_to_access >= MAX_DEVICES) return IA_ERR_INVALID_ARGUMENT;
  device_slot_t *slot = &plugin.devices[dev_to_access];
  pthread_mutex_lock(&plugin.lock); /* a device made now sees the bit, or is ready once it is set */
  slot->peers |= 1ull << dev;
  bool ready = atomic_load(&slot->ready) == 1;
  pthread_mutex_unlock(&plugin.lock);
  ia_status_t st = IA_OK;
  for (int p = IA_POOL_SMALL; ready && st == IA_OK && p < IA_POOL_COUNT; p++)
    if (slot->arenas[p]) st = _ia_arena_grant_access(slot->arenas[p], dev);
  return st;
}

void ia_torch_empty_cache(void) {
  for (int d = 0; d < MAX_DEVICES; d++)
    for (int p = IA_POOL_SMALL; p < IA_POOL_COUNT; p++)
      if (ia_plugin_arena(d, p)) ia_arena_release_cached(plugin.devices[d].arenas[p]);
}

static const ia_torch_entry_points_t entry_points = {
    .alloc = ia_torch_alloc,
    .free = ia_torch_free,
    .record_stream = ia_torch_record_stream,
    .empty_cache = ia_torch_empty_cache,
    .memory_fraction = ia_torch_memory_fraction,
    .graph_begin = ia_graph_begin,
    .graph_end = ia_graph_end,
    .graph_incref = ia_graph_incref,
    .graph_release = ia_graph_release,
    .graph_use_count = ia_graph_use_count,
    .graph_blocks = ia_graph_blocks,
    .graph_restore = ia_graph_restore,
    .device_stats = ia_plugin_device_stats,
    .reset_peaks = ia_plugin_reset_peaks,
    .ooms = ia_plugin_ooms,
    .retries = ia_plugin_retries,
    .status_str = ia_status_str,
    .enable_peer_access = ia_torch_enable_peer_access,
};

const ia_torch_entry_points_t *ia_torch_entry_points(void) { return &entry_points; }

/* ---- workspace scope: the MemPool's backend ------------------------------------------------- */

static void describe_pool_refusal(device_slot_t *slot, int device, size_t size, void *stream) {
  char req[32], left[32], other[384] = "";
  ia_stats_t s;
  ia_arena_stats(slot->arenas[IA_POOL_WORKSPACE], &s);
  ia_stream_t first = atomic_load(&slot->pool_stream);
  if (first != (ia_stream_t)stream)
    snprintf(other, sizeof other, " The budget's segment belongs to stream %#" PRIxPTR " and this request "
             "came on stream %#" PRIxPTR ": PyTorch gives a segment's blocks to its own stream only, so in "
             "workspace scope keep each device's workspaces on one stream, or use the process scope.",
             (uintptr_t)first, (uintptr_t)stream);
  snprintf(failure, sizeof failure, "the pool of device %d asked its arena for another segment of %s on stream "
           "%#" PRIxPTR ", and the arena has %s left in one piece.%s", device, _ia_format_bytes(size, req, sizeof req),
           (uintptr_t)stream, _ia_format_bytes(s.largest_free, left, sizeof left), other);
}

IA_EXPORT void *ia_pool_alloc(ssize_t size, int device, void *stream) {
  if (size <= 0) return NULL;
  ia_status_t st;
  device_slot_t *slot = device_slot(device, &st);
  if (slot && plugin.config.scope != IA_SCOPE_WORKSPACE) {
    snprintf(failure, sizeof failure, "the allocator is installed for the whole process, not for workspace pools");
    st = IA_ERR_INVALID_ARGUMENT;
  }
  if (st == IA_OK) st = ensure_workspace(slot, device);
  void *p = NULL;
  if (st == IA_OK) {
    ia_stream_t none = IA_STREAM_NONE;
    atomic_compare_exchange_strong(&slot->pool_stream, &none, (ia_stream_t)stream);
    st = ia_arena_alloc(slot->arenas[IA_POOL_WORKSPACE], (size_t)size, (ia_stream_t)stream, &p);
    if (st != IA_OK) describe_pool_refusal(slot, device, (size_t)size, stream);
  }
  if (st != IA_OK) {
    pool_refusals++;
    if (plugin.config.raise_oom) {
      /* The core's own figures only: PyTorch's view of the pool's blocks would need Python, and
       * taking the GIL here, under PyTorch's allocator lock, can deadlock against a thread that
       * holds the GIL and waits for that lock (freeing a tensor does). workspace() adds it. */
      char budget[32], message[sizeof failure + 256];
      snprintf(message, sizeof message, "CUDA out of memory on device %d: a workspace request does not fit "
               "the workspace pool (budget %s): %s", device,
               _ia_format_bytes(plugin.config.budget, budget, sizeof budget), failure);
      raise_oom(message);
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

/* ---- the out-of-memory report ----------------------------------------------------------------- */

static void write_pool(FILE *f, const char *sep_before, const char *name, ia_arena_t *a) {
  ia_stats_t s;
  ia_arena_stats(a, &s);
  fprintf(f, "%s{\"pool\": \"%s\", \"stats\": {", sep_before, name);
  const char *sep = "";
#define IA_STAT_JSON(type, name, doc)                                                               \
  fprintf(f, _Generic(s.name, double: "%s\"%s\": %.6f", default: "%s\"%s\": %" PRIu64), sep, #name, s.name); \
  sep = ", ";
  IA_STAT_FIELDS(IA_STAT_JSON)
#undef IA_STAT_JSON
  fprintf(f, "}, \"blocks\": [");
  size_t count = ia_arena_blocks(a, NULL, 0);
  ia_block_info_t *blocks = calloc(count + 1, sizeof *blocks);
  if (blocks) count = ia_arena_blocks(a, blocks, count);
  for (size_t i = 0; blocks && i < count; i++)
    fprintf(f, "%s[%" PRIu64 ", %" PRIu64 ", %" PRIu64 ", %" PRIu64 ", %d, %" PRIu64 "]", i ? ", " : "",
            (uint64_t)blocks[i].region_base, (uint64_t)(blocks[i].address - blocks[i].region_base),
            blocks[i].size, blocks[i].requested, blocks[i].is_free ? 0 : 1, (uint64_t)blocks[i].stream);
  free(blocks);
  fprintf(f, "]}");
}

typedef struct {
  FILE *f;
  const char *sep;
} report_t;

static void write_graph_pool(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *a) {
  report_t *r = ctx;
  if (kind == GRAPH_WORKSPACE) return;
  char name[96];
  snprintf(name, sizeof name, "graph (%" PRIu64 ", %" PRIu64 ") %s", id.first, id.second,
           kind == GRAPH_SMALL ? "small" : "large");
  write_pool(r->f, r->sep, name, a);
  r->sep = ", ";
}

/* JSON, so that `python -m alloc report FILE` reads it back: per device and pool, the statistics
 * and every block; CUDA graph pools as pools "graph (first, second) small|large" (their workspace
 * carve-outs are blocks of the workspace pool) and, per device, "graph_pools" with each pool's
 * figures. Written with stdio only: this runs while allocations fail. */
bool ia_plugin_write_report(const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return false;
  fprintf(f, "{\"format\": \"indexer-arena-report-1\", \"budget\": %zu, \"devices\": [", plugin.config.budget);
  bool first_device = true;
  for (int d = 0; d < MAX_DEVICES; d++) {
    device_slot_t *slot = &plugin.devices[d];
    if (atomic_load(&slot->ready) != 1) continue;
    fprintf(f, "%s{\"device\": %d, \"unified\": %s, \"expandable\": %s, \"pools\": [", first_device ? "" : ", ",
            d, slot->unified ? "true" : "false", slot->expandable ? "true" : "false");
    first_device = false;
    const char *sep = "";
    for (int p = 0; p < IA_POOL_COUNT; p++)
      if (ia_plugin_arena(d, p)) {
        write_pool(f, sep, pool_names[p], slot->arenas[p]);
        sep = ", ";
      }
    report_t r = {f, sep};
    _ia_graph_each_arena(d, write_graph_pool, &r);
    ia_graph_pool_info_t pools[64];
    size_t n = ia_graph_pools(d, pools, 64);
    n = n < 64 ? n : 64;
    fprintf(f, "], \"graph_pools\": [");
    for (size_t i = 0; i < n; i++)
      fprintf(f, "%s{\"id\": [%" PRIu64 ", %" PRIu64 "], \"use_count\": %d, \"capacity\": %" PRIu64
              ", \"in_use\": %" PRIu64 ", \"workspace\": %" PRIu64 "}", i ? ", " : "", pools[i].first,
              pools[i].second, (int)pools[i].use_count, pools[i].capacity, pools[i].in_use, pools[i].workspace);
    fprintf(f, "]}");
  }
  fprintf(f, "]}\n");
  return fclose(f) == 0;
}
