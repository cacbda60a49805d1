/* The words the core uses in messages: byte counts and status descriptions. */
#include <inttypes.h>
#include <stdio.h>

#include "internal.h"

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
