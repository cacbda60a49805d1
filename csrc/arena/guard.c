/* The unified-memory guard. On an integrated GPU the device allocates from host memory, and the
 * driver keeps granting reservations until the machine itself runs dry (then the process hangs in
 * the driver instead of failing). So before every reservation the guard reads what the host can
 * still give and refuses early, with a reason, when the request would eat into the headroom.
 *
 * Over a mapping backend physical memory is committed when pages are mapped, not when the address
 * range is reserved, so the check moves to every map (and the commit with it), and the guard counts
 * what it let through. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

static __thread char last_message[1024];

/* Only an integrated GPU takes cudaMalloc memory from the host's RAM. A coherent discrete GPU
 * (Grace Hopper: pageable access through host page tables, concurrent managed access) can read
 * host memory, but its cudaMalloc still comes from its own HBM, which the driver accounts for and
 * refuses properly; guarding it against MemAvailable would refuse reservations for no reason. */
bool ia_memory_is_unified(const ia_memory_attributes_t *a) { return a->integrated == 1; }

const char *ia_guard_last_message(void) { return last_message; }

/* One cgroup file such as memory.max: "max" (no limit: *out is UINT64_MAX, which no number of
 * bytes a cgroup can hold reaches; 0 is a limit like any other) or a decimal number of bytes,
 * each alone on its line. Anything else, a sign, a number past 64 bits, text after the
 * digits, is refused naming the file rather than read as whatever strtoull makes of it ("-5" was
 * 2**64 - 5, no limit). 1 read, 0 absent (the other layout may be there), -1 malformed. */
static int read_limit_file(const char *path, bool may_be_max, uint64_t *out) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char text[64] = {0};
  bool ok = fgets(text, sizeof text, f) != NULL;
  fclose(f);
  text[strcspn(text, "\r\n")] = '\0';
  if (ok && may_be_max && strcmp(text, "max") == 0) {
    *out = UINT64_MAX;
    return 1;
  }
  uint64_t v = 0;
  const char *p = text;
  for (; ok && *p >= '0' && *p <= '9'; p++) {
    unsigned digit = (unsigned)(*p - '0');
    ok = v <= (UINT64_MAX - digit) / 10;
    v = v * 10 + digit;
  }
  if (!ok || p == text || *p != '\0' || v == UINT64_MAX) {
    snprintf(last_message, sizeof last_message,
             "%s: bad value '%.40s': a cgroup memory file must hold %sa number of bytes "
             "from 0 to 2**64 - 2", path, text, may_be_max ? "'max' or " : "");
    return -1;
  }
  *out = v;
  return 1;
}

/* 1 with the limit and usage (*limited false: no limit, "max"), 0 where no layout is there, -1
 * malformed. */
static int read_cgroup(const char *root, bool *limited, uint64_t *limit, uint64_t *usage) {
  static const char *const layouts[][2] = {
      {"memory.max", "memory.current"},                            /* v2 */
      {"memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"}, /* v1 */
  };
  char lpath[4096], upath[4096];
  for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
    snprintf(lpath, sizeof lpath, "%s/%s", root, layouts[i][0]);
    snprintf(upath, sizeof upath, "%s/%s", root, layouts[i][1]);
    int found = read_limit_file(lpath, true, limit);
    if (found < 0) return -1;
    if (found) {
      /* cgroup v1 writes "no limit" as a page-rounded LONG_MAX */
      *limited = *limit < (1ull << 62);
      if (!*limited) *limit = 0;
      *usage = 0;
      return *limited ? (read_limit_file(upath, false, usage) < 0 ? -1 : 1) : 1;
    }
  }
  return 0;
}

/* The kB of a MemAvailable line, "MemAvailable:" then blanks, digits, blanks and "kB", read with
 * its bound checked: kB whose bytes a uint64_t holds, 2**54 - 1 at most. (sscanf's %llu took
 * "-5" as 2**64 - 5, which the shift to bytes wrapped as it did 2**54 + 4, read as 4 KiB.) */
#define MAX_KIB (UINT64_MAX >> 10)
static bool parse_kib(const char *text, uint64_t *out) {
  const char *p = text + strspn(text, " \t");
  if (*p < '0' || *p > '9') return false;
  uint64_t kib = 0;
  for (; *p >= '0' && *p <= '9'; p++) {
    unsigned digit = (unsigned)(*p - '0');
    if (kib > (MAX_KIB - digit) / 10) return false;
    kib = kib * 10 + digit;
  }
  p += strspn(p, " \t");
  if (strncmp(p, "kB", 2) != 0 || p[2 + strspn(p + 2, " \t\r\n")] != '\0') return false;
  *out = kib;
  return true;
}

ia_status_t ia_host_memory_read(const char *meminfo_path, const char *cgroup_root, ia_host_memory_t *out) {
  *out = (ia_host_memory_t){0};
  if (!meminfo_path) meminfo_path = "/proc/meminfo";
  FILE *f = fopen(meminfo_path, "r");
  if (!f) {
    snprintf(last_message, sizeof last_message, "cannot read %s", meminfo_path);
    return IA_ERR_BACKEND;
  }
  char line[256];
  bool found = false, parsed = false;
  uint64_t kib = 0;
  while (!found && fgets(line, sizeof line, f)) {
    found = strncmp(line, "MemAvailable:", 13) == 0;
    parsed = found && parse_kib(line + 13, &kib);
  }
  fclose(f);
  if (!found) {
    snprintf(last_message, sizeof last_message, "%s has no MemAvailable line", meminfo_path);
    return IA_ERR_BACKEND;
  }
  if (!parsed) {
    line[strcspn(line, "\r\n")] = '\0';
    snprintf(last_message, sizeof last_message,
             "%s: bad line '%.100s': MemAvailable must be a number of kB from 0 to %" PRIu64
             " (2**54 - 1, so that its bytes fit in 64 bits)", meminfo_path, line, (uint64_t)MAX_KIB);
    return IA_ERR_BACKEND;
  }
  out->mem_available = kib << 10;
  out->available = out->mem_available;
  if (!cgroup_root) cgroup_root = "/sys/fs/cgroup";
  int cgroup = cgroup_root[0] ? read_cgroup(cgroup_root, &out->cgroup_limited, &out->cgroup_limit,
                                             &out->cgroup_usage) : 0;
  if (cgroup < 0) return IA_ERR_BACKEND;
  if (cgroup && out->cgroup_limited) {
    uint64_t room = out->cgroup_limit > out->cgroup_usage ? out->cgroup_limit - out->cgroup_usage : 0;
    if (room < out->available) out->available = room;
  }
  return IA_OK;
}

typedef struct {
  ia_backend_t base;
  ia_backend_t *inner;
  ia_guard_options_t opts;
  char *meminfo_path, *cgroup_root;
  ia_mapping_counters_t counters; /* under the arena's lock, like every backend call */
} guard_backend_t;

static guard_backend_t *guard(ia_backend_t *b) { return (guard_backend_t *)b; }

/* IA_OK when `size` more bytes of device memory leave the headroom of host memory; `verb` says
 * what was asked ("reserving", "mapping"). */
static ia_status_t check_room(guard_backend_t *g, size_t size, const char *verb) {
  char need[32], avail[32], head[32];
  ia_host_memory_t mem = {0};
  if (g->opts.available_fn) {
    mem.available = mem.mem_available = g->opts.available_fn(g->opts.available_ctx);
  } else if (ia_host_memory_read(g->meminfo_path, g->cgroup_root, &mem) != IA_OK) {
    /* Unknown host memory on a unified device: refusing is the only answer that cannot hang. */
    char why[640]; /* last_message is rewritten below: a path and a quoted line fit whole */
    snprintf(why, sizeof why, "%.639s", last_message);
    snprintf(last_message, sizeof last_message,
             "unified memory: %s, so the host memory left is unknown and %s %s was refused; point "
             "meminfo in INDEXER_ARENA_CONF at a readable file in /proc/meminfo format",
             why, verb, _ia_format_bytes(size, need, sizeof need));
    return IA_ERR_HOST_MEMORY_GUARD;
  }
  if (size > mem.available || mem.available - size < g->opts.headroom) {
    char cg[96] = "";
    if (mem.cgroup_limited)
      snprintf(cg, sizeof cg, ", cgroup limit %" PRIu64 " MiB with %" PRIu64 " MiB in use",
               mem.cgroup_limit >> 20, mem.cgroup_usage >> 20);
    snprintf(last_message, sizeof last_message,
             "unified memory: %s %s would leave less than the %s headroom of host memory "
             "(available %s: MemAvailable %" PRIu64 " MiB%s); the GPU takes its memory from the "
             "host here, so the request was refused before asking the driver",
             verb, _ia_format_bytes(size, need, sizeof need), _ia_format_bytes(g->opts.headroom, head, sizeof head),
             _ia_format_bytes(mem.available, avail, sizeof avail), mem.mem_available >> 20, cg);
    return IA_ERR_HOST_MEMORY_GUARD;
  }
  return IA_OK;
}

static ia_status_t guard_reserve(ia_backend_t *self, size_t size, void **out) {
  guard_backend_t *g = guard(self);
  ia_status_t st = check_room(g, size, "reserving");
  if (st != IA_OK) return st;
  st = g->inner->reserve(g->inner, size, out);
  /* Touch the pages now, so later use of the reservation needs no new host memory. */
  if (st == IA_OK && g->inner->commit && (st = g->inner->commit(g->inner, *out, size)) != IA_OK)
    g->inner->release(g->inner, *out, size);
  return st;
}

static ia_backend_t *guard_inner(ia_backend_t *self) { return guard(self)->inner; }
static void guard_release(ia_backend_t *self, void *base, size_t size) {
  guard_inner(self)->release(guard_inner(self), base, size);
}
IA_FORWARD_EVENTS(guard, guard_inner)

static ia_status_t guard_address_reserve(ia_backend_t *self, size_t size, void **out) {
  ia_status_t st = guard_inner(self)->address_reserve(guard_inner(self), size, out);
  if (st == IA_OK) {
    guard(self)->counters.ranges++;
    guard(self)->counters.range_reserves++;
  }
  return st;
}

static void guard_address_free(ia_backend_t *self, void *base, size_t size) {
  guard_inner(self)->address_free(guard_inner(self), base, size);
  guard(self)->counters.ranges--;
}

static ia_status_t guard_map(ia_backend_t *self, void *at, size_t size) {
  guard_backend_t *g = guard(self);
  ia_mapping_counters_t *c = &g->counters;
  ia_status_t st = check_room(g, size, "mapping");
  if (st == IA_OK) st = g->inner->map(g->inner, at, size);
  /* Touch the pages now, so later use of them needs no new host memory. */
  if (st == IA_OK && g->inner->commit && (st = g->inner->commit(g->inner, at, size)) != IA_OK)
    g->inner->unmap(g->inner, at, size);
  if (st != IA_OK) {
    c->refusals++;
    return st;
  }
  c->maps++;
  c->pages_mapped += size / self->page_size;
  c->mapped += size;
  if (c->mapped > c->mapped_peak) c->mapped_peak = c->mapped;
  return IA_OK;
}

static void guard_unmap(ia_backend_t *self, void *at, size_t size) {
  guard_backend_t *g = guard(self);
  g->inner->unmap(g->inner, at, size);
  g->counters.unmaps++;
  g->counters.pages_unmapped += size / self->page_size;
  g->counters.mapped -= size;
}

static ia_status_t guard_grant_access(ia_backend_t *self, int peer) {
  ia_status_t st = guard_inner(self)->grant_access(guard_inner(self), peer);
  if (st == IA_OK && peer >= 0 && peer < 64) guard(self)->counters.peers |= 1ull << peer;
  return st;
}

void ia_guard_mapping_counters(const ia_backend_t *b, ia_mapping_counters_t *out) {
  *out = ((const guard_backend_t *)b)->counters;
}

static void guard_destroy(ia_backend_t *self) {
  guard_backend_t *g = guard(self);
  ia_backend_destroy(g->inner);
  free(g->meminfo_path);
  free(g->cgroup_root);
  free(g);
}

ia_status_t ia_guard_backend_create(ia_backend_t *inner, const ia_guard_options_t *opts, ia_backend_t **out) {
  *out = NULL;
  guard_backend_t *g = calloc(1, sizeof *g);
  if (!g) {
    ia_backend_destroy(inner);
    return IA_ERR_NO_HOST_MEMORY;
  }
  g->base = (ia_backend_t){
      .name = "guarded",
      .natural_alignment = inner->natural_alignment,
      .reserve = guard_reserve,
      .release = guard_release,
      IA_FORWARDED_EVENTS(guard, inner),
      .destroy = guard_destroy,
  };
  if (inner->page_size) {
    g->base.page_size = inner->page_size;
    g->base.address_reserve = guard_address_reserve;
    g->base.address_free = guard_address_free;
    g->base.map = guard_map;
    g->base.unmap = guard_unmap;
    g->base.grant_access = inner->grant_access ? guard_grant_access : NULL;
    g->counters.page_size = inner->page_size;
  }
  g->inner = inner;
  g->opts = *opts;
  g->meminfo_path = opts->meminfo_path ? strdup(opts->meminfo_path) : NULL;
  g->cgroup_root = opts->cgroup_root ? strdup(opts->cgroup_root) : NULL;
  *out = &g->base;
  return IA_OK;
}
