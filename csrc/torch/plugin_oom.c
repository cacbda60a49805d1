/* What the plugin says when memory runs out: the out-of-memory messages, and the JSON report
 * (ia_plugin_write_report) they point to. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin.h"

void _ia_raise_oom(const char *message) {
  atomic_fetch_add(&_ia_plugin.ooms, 1);
  if (_ia_plugin.config.raise_oom) _ia_plugin.config.raise_oom(message); /* throws */
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
                          _ia_format_bytes((uint64_t)s.capacity.current, cap, sizeof cap), pages,
                          _ia_format_bytes((uint64_t)s.in_use.current, used, sizeof used),
                          _ia_format_bytes(s.largest_free, largest, sizeof largest));
}

static void report_hint(char *buf, size_t len) {
  if (!_ia_plugin.config.oom_report_path) {
    buf[0] = '\0';
    return;
  }
  bool written = ia_plugin_write_report(_ia_plugin.config.oom_report_path);
  snprintf(buf, len, written ? " Memory report written to %s." : " (Could not write the memory report to %s.)",
           _ia_plugin.config.oom_report_path);
}

/* The core's own words format bytes with _ia_format_bytes (messages.c); this one differs on
 * purpose: a byte count as PyTorch's allocator writes it in its messages (bytes, KiB, MiB, then
 * GiB only), so that what searches logs for PyTorch's words finds these too. */
static const char *torch_size(uint64_t size, char *buf, size_t len) {
  if (size <= 1024) snprintf(buf, len, "%" PRIu64 " bytes", size);
  else if (size <= 1048576) snprintf(buf, len, "%.2f KiB", (double)size / 1024.0);
  else if (size <= 1073741824ull) snprintf(buf, len, "%.2f MiB", (double)size / 1048576.0);
  else snprintf(buf, len, "%.2f GiB", (double)size / 1073741824.0);
  return buf;
}

/* The opening PyTorch's allocator gives its out-of-memory errors, with this device's figures, then
 * "indexer-arena: " and the arena's own account. */
static void torch_words(int device, size_t size, char *buf, size_t len) {
  char req[32], total_s[32], free_s[32], allowed[64] = "", used[32], idle[32];
  size_t free_bytes, total;
  if (device < 0 || device >= IA_MAX_DEVICES || ia_cuda_mem_info(device, &free_bytes, &total) != IA_OK) {
    snprintf(buf, len, "CUDA out of memory. Tried to allocate %s. indexer-arena: ", torch_size(size, req, sizeof req));
    return;
  }
  ia_device_totals_t t = ia_plugin_device_totals(device);
  uint64_t limit = atomic_load(&_ia_plugin.devices[device].totals.limit);
  if (limit) snprintf(allowed, sizeof allowed, "%s allowed; ", torch_size(limit, used, sizeof used));
  uint64_t in_use = (uint64_t)t.in_use.current, held = (uint64_t)t.capacity.current;
  snprintf(buf, len,
           "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s is free. %sOf "
           "the allocated memory %s is allocated by PyTorch, and %s is reserved by PyTorch but unallocated. "
           "indexer-arena: ",
           torch_size(size, req, sizeof req), device, torch_size(total, total_s, sizeof total_s),
           torch_size(free_bytes, free_s, sizeof free_s), allowed, torch_size(in_use, used, sizeof used),
           torch_size(held > in_use ? held - in_use : 0, idle, sizeof idle));
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
             (double)atomic_load(&_ia_plugin.devices[device].totals.limit) / (double)IA_MiB);
  else if (st == IA_ERR_HOST_MEMORY_GUARD) snprintf(buf, len, " %s.", ia_guard_last_message());
  else if ((st == IA_ERR_BACKEND_OUT_OF_MEMORY || st == IA_ERR_BACKEND) && ia_cuda_last_error()[0])
    snprintf(buf, len, " %s.", ia_cuda_last_error()); /* a driver call's own words (mapping, too) */
  else snprintf(buf, len, " %s.", ia_status_str(st)); /* the host backend has no driver words */
}

__attribute__((noinline)) void _ia_fail_alloc(int device, int pool, size_t size, ia_status_t st) {
  char message[3072], opening[512], req[32], state[256], hint[512], budget[32], graphs[32];
  _ia_format_bytes(size, req, sizeof req);
  torch_words(device, size, opening, sizeof opening);
  if (pool < 0) {
    snprintf(message, sizeof message, "%sdevice %d cannot allocate %s: %s", opening, device, req, _ia_failure);
    _ia_raise_oom(message);
  }
  ia_arena_t *a = _ia_plugin.devices[device].arenas[pool];
  describe_arena(a, state, sizeof state);
  report_hint(hint, sizeof hint);
  if (pool == IA_POOL_WORKSPACE) {
    snprintf(message, sizeof message,
             "%sworkspace request of %s (%zu bytes) on device %d does not fit the "
             "workspace arena (budget %s; it %s). The workspace arena never grows: raise budget_mb in "
             "INDEXER_ARENA_CONF (or VLLM_SPARSE_INDEXER_MAX_LOGITS_MB), or plan smaller pieces.%s",
             opening, req, size, device, _ia_format_bytes(_ia_plugin.config.budget, budget, sizeof budget), state, hint);
  } else {
    char why[640], range[32];
    ia_region_info_t r;
    if (st == IA_ERR_OUT_OF_MEMORY && ia_arena_address_range(a, &r))
      snprintf(why, sizeof why, " No gap of its %s address range can take it (mapped pools reserve the "
               "device's memory in address space, once).", _ia_format_bytes(r.size, range, sizeof range));
    else
      growth_refusal(st, device, why, sizeof why);
    snprintf(message, sizeof message,
             "%srequest of %s (%zu bytes) on device %d for the general %s pool "
             "(it %s; the workspace arena holds a further %s, CUDA graph pools %s).%s Free tensors or "
             "call torch.cuda.empty_cache(), or lower budget_mb in INDEXER_ARENA_CONF to leave the "
             "device more room.%s",
             opening, req, size, device, ia_plugin_pool_name(pool), state,
             atomic_load(&_ia_plugin.devices[device].workspace_ready)
                 ? _ia_format_bytes(_ia_plugin.config.budget, budget, sizeof budget)
                 : "nothing (not reserved now)",
             _ia_format_bytes(graph_pools_held(device, NULL), graphs, sizeof graphs), why, hint);
  }
  _ia_raise_oom(message);
}

__attribute__((noinline)) void _ia_fail_graph_alloc(int device, ia_pool_id_t id, int kind, size_t size,
                                                       ia_status_t st) {
  char message[3072], opening[512], req[32], held[32], budget[32], state[256] = "", why[640], hint[512];
  _ia_format_bytes(size, req, sizeof req);
  torch_words(device, size, opening, sizeof opening);
  if (st == IA_ERR_INVALID_ARGUMENT) snprintf(why, sizeof why, " %.600s.", _ia_failure[0] ? _ia_failure :
                                              "PyTorch is not allocating to that pool now");
  else growth_refusal(st, device, why, sizeof why);
  report_hint(hint, sizeof hint);
  if (kind == IA_POOL_WORKSPACE) {
    ia_arena_t *ws = ia_plugin_arena(device, IA_POOL_WORKSPACE);
    if (ws) describe_arena(ws, state, sizeof state);
    snprintf(message, sizeof message,
             "%sworkspace request of %s on device %d while capturing into CUDA graph "
             "pool (%" PRIu64 ", %" PRIu64 ") does not fit the workspace arena (budget %s; it %s). "
             "A graph keeps the workspace blocks it allocates until it is released: raise budget_mb in "
             "INDEXER_ARENA_CONF, or capture smaller pieces.%s",
             opening, req, device, id.first, id.second, _ia_format_bytes(_ia_plugin.config.budget, budget, sizeof budget),
             state, hint);
  } else {
    snprintf(message, sizeof message,
             "%srequest of %s (%zu bytes) on device %d for CUDA graph pool (%" PRIu64 ", %" PRIu64
             "), which holds %s.%s A graph keeps what it allocates during capture until it is released: free "
             "eager tensors and call torch.cuda.empty_cache() before capturing, or lower budget_mb in "
             "INDEXER_ARENA_CONF.%s",
             opening, req, size, device, id.first, id.second,
             _ia_format_bytes(graph_pools_held(device, &id), held, sizeof held), why, hint);
  }
  _ia_raise_oom(message);
}

void _ia_describe_pool_refusal(_ia_device_t *dev, int device, size_t size, void *stream) {
  char req[32], left[32], other[384] = "";
  ia_stats_t s;
  ia_arena_stats(dev->arenas[IA_POOL_WORKSPACE], &s);
  ia_stream_t first = atomic_load(&dev->pool_stream);
  if (first != (ia_stream_t)stream)
    snprintf(other, sizeof other, " The budget's segment belongs to stream %#" PRIxPTR " and this request "
             "came on stream %#" PRIxPTR ": PyTorch gives a segment's blocks to its own stream only, so in "
             "workspace scope keep each device's workspaces on one stream, or use the process scope.",
             (uintptr_t)first, (uintptr_t)stream);
  snprintf(_ia_failure, sizeof _ia_failure, "the pool of device %d asked its arena for another segment of %s on stream "
           "%#" PRIxPTR ", and the arena has %s left in one piece.%s", device, _ia_format_bytes(size, req, sizeof req),
           (uintptr_t)stream, _ia_format_bytes(s.largest_free, left, sizeof left), other);
}

/* ---- the out-of-memory report ----------------------------------------------------------------- */

static void write_pool(FILE *f, const char *sep_before, const char *name, ia_arena_t *a) {
  ia_stats_t s;
  ia_arena_stats(a, &s);
  fprintf(f, "%s{\"pool\": \"%s\", \"stats\": {", sep_before, name);
  const char *sep = "";
#define IA_QUAD_JSON(name, torch, doc)                                                              \
  fprintf(f, "%s\"%s\": %" PRId64 ", \"%s_peak\": %" PRId64 ", \"%s_allocated\": %" PRId64                  \
          ", \"%s_freed\": %" PRId64, sep, #name, s.name.current, #name, s.name.peak, #name, s.name.allocated,   \
          #name, s.name.freed);                                                                       \
  sep = ", ";
#define IA_STAT_JSON(type, name, doc)                                                               \
  fprintf(f, _Generic(s.name, double: "%s\"%s\": %.6f", default: "%s\"%s\": %" PRIu64), sep, #name, s.name); \
  sep = ", ";
  IA_STAT_QUADS(IA_QUAD_JSON)
  IA_STAT_COUNTERS(IA_STAT_JSON)
#undef IA_STAT_JSON
#undef IA_QUAD_JSON
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
  if (kind == IA_POOL_WORKSPACE) return;
  char name[96];
  snprintf(name, sizeof name, "graph (%" PRIu64 ", %" PRIu64 ") %s", id.first, id.second, ia_plugin_pool_name(kind));
  write_pool(r->f, r->sep, name, a);
  r->sep = ", ";
}

/* JSON, so that `python -m arena_tools report FILE` reads it back: per device and pool, the statistics
 * and every block; CUDA graph pools as pools "graph (first, second) small|large" (their workspace
 * carve-outs are blocks of the workspace pool) and, per device, "graph_pools" with each pool's
 * figures. Written with stdio only: this runs while allocations fail. */
bool ia_plugin_write_report(const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return false;
  fprintf(f, "{\"format\": \"indexer-arena-report-2\", \"budget\": %zu, \"devices\": [", _ia_plugin.config.budget);
  bool first_device = true;
  for (int d = 0; d < IA_MAX_DEVICES; d++) {
    _ia_device_t *dev = &_ia_plugin.devices[d];
    if (atomic_load(&dev->ready) != 1) continue;
    fprintf(f, "%s{\"device\": %d, \"unified\": %s, \"expandable\": %s, \"pools\": [", first_device ? "" : ", ",
            d, dev->unified ? "true" : "false", dev->expandable ? "true" : "false");
    first_device = false;
    const char *sep = "";
    for (int p = 0; p < IA_POOL_COUNT; p++)
      if (ia_plugin_arena(d, p)) {
        write_pool(f, sep, ia_plugin_pool_name(p), ia_plugin_arena(d, p));
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
