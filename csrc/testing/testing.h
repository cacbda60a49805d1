/* indexer-arena: what the tests and the harnesses reach beside the public interface
 * (indexer_arena.h), defined in this folder and built into the test build alone.
 *
 * The cffi builder of the test build (alloc._core_testing, alloc/_build.py) reads this file after
 * indexer_arena.h, the same way, so the Python tests see these too; the same rules hold: plain
 * declarations once preprocessed with IA_CDEF. */
#ifndef INDEXER_ARENA_TESTING_H
#define INDEXER_ARENA_TESTING_H

#ifndef IA_CDEF
#include "../indexer_arena.h"
#endif

/* CUDA graph capture, simulated for every host backend at once: the stream captures under the id
 * (non-zero) until ia_host_capture_end. Breaks of CUDA's capture rules are counted, not enforced
 * (see backend_host.c); a capturing stream's wait on an outside event counts as a host wait. */
bool ia_host_capture_begin(ia_stream_t stream, uint64_t capture);
void ia_host_capture_end(ia_stream_t stream);
/* Work captured on a capturing stream: a node after the stream's frontier, which it becomes (NULL
 * when the stream does not capture). */
const void *ia_host_capture_launch(ia_stream_t stream);
/* The waiter's next work follows the waited stream's frontier too (an event recorded on `waited`,
 * waited for on `waiter`); a waiter outside any capture joins the waited stream's. False when
 * `waited` does not capture or `waiter` captures another capture. */
bool ia_host_capture_wait(ia_stream_t waiter, ia_stream_t waited);
uint64_t ia_host_capture_violations(void);
uint64_t ia_host_capture_host_waits(void);

/* The backend the arena took, to read the host backend's or the guard's counters through it. */
const ia_backend_t *ia_arena_backend(const ia_arena_t *arena);

/* ia_arena_check over every arena of a CUDA graph pool. */
bool ia_graph_check(int device, ia_pool_id_t id, char *msg, size_t msg_len);

#endif /* INDEXER_ARENA_TESTING_H */
