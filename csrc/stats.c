/* Statistics: names, descriptions and a printer, all built from the one field list in arena.h. */
#include <inttypes.h>
#include <stdio.h>

#include "internal.h"

#define IA_STAT_NAME(type, name, doc) #name,
#define IA_STAT_DOC(type, name, doc) doc,
static const char *const stat_names[] = {IA_STAT_FIELDS(IA_STAT_NAME)};
static const char *const stat_docs[] = {IA_STAT_FIELDS(IA_STAT_DOC)};
#define STAT_COUNT (sizeof stat_names / sizeof stat_names[0])

size_t ia_stat_count(void) { return STAT_COUNT; }
const char *ia_stat_name(size_t i) { return i < STAT_COUNT ? stat_names[i] : NULL; }
const char *ia_stat_doc(size_t i) { return i < STAT_COUNT ? stat_docs[i] : NULL; }

static int print_value(char *buf, size_t len, uint64_t v) { return snprintf(buf, len, "%" PRIu64, v); }
static int print_value_d(char *buf, size_t len, double v) { return snprintf(buf, len, "%.4f", v); }
#define PRINT_VALUE(buf, len, v) _Generic((v), double: print_value_d, default: print_value)(buf, len, v)

size_t ia_stats_format(const ia_stats_t *s, char *buf, size_t len) {
  size_t used = 0;
#define IA_STAT_PRINT(type, name, doc)                                                              \
  used += (size_t)snprintf(used < len ? buf + used : NULL, used < len ? len - used : 0, "%s = ", #name); \
  used += (size_t)PRINT_VALUE(used < len ? buf + used : NULL, used < len ? len - used : 0, s->name);   \
  used += (size_t)snprintf(used < len ? buf + used : NULL, used < len ? len - used : 0, "\n");
  IA_STAT_FIELDS(IA_STAT_PRINT)
#undef IA_STAT_PRINT
  return used;
}

const char *_ia_format_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  unsigned u = 0;
  while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024.0;
    u++;
  }
  if (u == 0) snprintf(buf, len, "%" PRIu64 " B", bytes);
  else snprintf(buf, len, "%.2f %s", v, units[u]);
  return buf;
}

const char *ia_status_str(ia_status_t st) {
  switch (st) {
  case IA_OK: return "ok";
  case IA_ERR_OUT_OF_MEMORY: return "out of memory: no free block is large enough";
  case IA_ERR_BACKEND_OUT_OF_MEMORY: return "the backend could not reserve the memory";
  case IA_ERR_HOST_MEMORY_GUARD: return "refused by the unified-memory guard: host memory would run out";
  case IA_ERR_LIMIT: return "growth would cross the arena's limit";
  case IA_ERR_DOUBLE_FREE: return "double free: the pointer lies in the arena but is not a live block";
  case IA_ERR_FOREIGN_POINTER: return "foreign pointer: the arena never handed it out";
  case IA_ERR_INVALID_ARGUMENT: return "invalid argument";
  case IA_ERR_BACKEND: return "the backend failed";
  case IA_ERR_NO_HOST_MEMORY: return "host memory for the arena's bookkeeping ran out";
  }
  return "unknown status";
}
