/* The entry points only the tests reach (testing.h) beside the simulated capture. */
#include "../torch/plugin.h"
#include "testing.h"

const ia_backend_t *ia_arena_backend(const ia_arena_t *arena) { return _ia_arena_backend(arena); }

typedef struct {
  ia_pool_id_t id;
  bool ok;
  char *msg;
  size_t msg_len;
} graph_check_t;

static void check_one(void *ctx, ia_pool_id_t id, int kind, ia_arena_t *arena) {
  graph_check_t *c = ctx;
  (void)kind;
  /* the first broken invariant's message stays */
  if (c->ok && id.first == c->id.first && id.second == c->id.second) c->ok = ia_arena_check(arena, c->msg, c->msg_len);
}

bool ia_graph_check(int device, ia_pool_id_t id, char *msg, size_t msg_len) {
  if (msg_len) msg[0] = '\0';
  graph_check_t c = {id, true, msg, msg_len};
  _ia_graph_each_arena(device, check_one, &c);
  return c.ok;
}
