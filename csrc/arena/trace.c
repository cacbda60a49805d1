/* Allocation trace: a fixed ring of events. Memory is bounded by the capacity chosen at creation;
 * a full ring overwrites its oldest entry, and `dropped` counts what was lost that way.
 * Every field is read and written under the lock once the trace is made (capacity too, which a
 * resize changes), which orders them on a weakly ordered CPU as on any other. The sink runs under
 * it, and under the recording arena's lock (the lock order of the whole core: Note [Device
 * lifetime], csrc/torch/plugin.h). */
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

struct ia_trace {
  pthread_mutex_t lock;
  bool enabled;             /* events go into the ring */
  ia_trace_sink_t sink;     /* and to the sink, whether or not the ring is enabled */
  void *sink_ctx;
  size_t capacity;
  uint64_t written; /* events ever recorded; the next one goes to written % capacity */
  ia_trace_event_t *ring;
};

static __thread uint64_t thread_id;

ia_status_t ia_trace_create(size_t capacity, ia_trace_t **out) {
  *out = NULL;
  if (capacity == 0) return IA_ERR_INVALID_ARGUMENT;
  ia_trace_t *t = calloc(1, sizeof *t);
  ia_trace_event_t *ring = t ? calloc(capacity, sizeof *ring) : NULL;
  if (!ring) {
    free(t);
    return IA_ERR_NO_HOST_MEMORY;
  }
  pthread_mutex_init(&t->lock, NULL);
  t->enabled = true;
  t->capacity = capacity;
  t->ring = ring;
  *out = t;
  return IA_OK;
}

void ia_trace_destroy(ia_trace_t *t) {
  if (!t) return;
  pthread_mutex_destroy(&t->lock);
  free(t->ring);
  free(t);
}

void ia_trace_set_enabled(ia_trace_t *t, bool on) {
  pthread_mutex_lock(&t->lock);
  t->enabled = on;
  pthread_mutex_unlock(&t->lock);
}

void ia_trace_set_sink(ia_trace_t *t, ia_trace_sink_t sink, void *ctx) {
  pthread_mutex_lock(&t->lock);
  t->sink = sink;
  t->sink_ctx = ctx;
  pthread_mutex_unlock(&t->lock);
}

bool ia_trace_recording(ia_trace_t *t) {
  pthread_mutex_lock(&t->lock);
  bool on = t->enabled || t->sink;
  pthread_mutex_unlock(&t->lock);
  return on;
}

size_t ia_trace_capacity(const ia_trace_t *t) {
  pthread_mutex_t *lock = (pthread_mutex_t *)&t->lock; /* reading changes the lock, not the trace */
  pthread_mutex_lock(lock);
  size_t capacity = t->capacity;
  pthread_mutex_unlock(lock);
  return capacity;
}

ia_status_t _ia_trace_resize(ia_trace_t *t, size_t capacity) {
  ia_trace_event_t *ring = capacity ? calloc(capacity, sizeof *ring) : NULL;
  if (!ring) return capacity ? IA_ERR_NO_HOST_MEMORY : IA_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&t->lock);
  ia_trace_event_t *old = t->ring;
  t->ring = ring;
  t->capacity = capacity;
  t->written = 0;
  pthread_mutex_unlock(&t->lock);
  free(old);
  return IA_OK;
}

void _ia_trace_record(ia_trace_t *t, ia_trace_action_t action, int32_t device, uint8_t pool,
                      uintptr_t address, uint64_t size, ia_stream_t stream) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (!thread_id) thread_id = (uint64_t)syscall(SYS_gettid);
  ia_trace_event_t e = {
      .time_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec,
      .thread = thread_id,
      .address = address,
      .size = size,
      .stream = stream,
      .device = device,
      .action = (uint8_t)action,
      .pool = pool,
  };
  pthread_mutex_lock(&t->lock);
  if (t->enabled) t->ring[t->written++ % t->capacity] = e;
  /* Under the lock, so that the sink sees events in the ring's order and is never called after
   * ia_trace_set_sink replaced it. */
  if (t->sink) t->sink(t->sink_ctx, &e);
  pthread_mutex_unlock(&t->lock);
}

size_t ia_trace_read(ia_trace_t *t, ia_trace_event_t *out, size_t cap, uint64_t *dropped) {
  pthread_mutex_lock(&t->lock);
  size_t held = t->written < t->capacity ? (size_t)t->written : t->capacity;
  uint64_t first = t->written - held;
  for (size_t i = 0; i < held && i < cap; i++) out[i] = t->ring[(first + i) % t->capacity];
  if (dropped) *dropped = first;
  pthread_mutex_unlock(&t->lock);
  return held;
}

void ia_trace_clear(ia_trace_t *t) {
  pthread_mutex_lock(&t->lock);
  t->written = 0;
  pthread_mutex_unlock(&t->lock);
}
