/* CUDA backend over the CUDA runtime, loaded with dlopen so the core builds and imports on machines
 * without CUDA. Only the handful of entry points below are used; their C types are restated here
 * (handles are pointers, errors are ints) instead of including cuda_runtime_api.h.
 *
 * The runtime loaded should be the one PyTorch already loaded, so that both share its state; the
 * Python layer passes that library's path. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_MEMORY_ALLOCATION = 2,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_EVENT_DISABLE_TIMING = 2,
  CUDA_CAPTURE_STATUS_NONE = 0,
  CUDA_CAPTURE_MODE_RELAXED = 2,
};

#define CUDART_FUNCTIONS(X)                                                                         \
  X(cudaMalloc, int, (void **, size_t))                                                          \
  X(cudaFree, int, (void *))                                                                      \
  X(cudaGetDevice, int, (int *))                                                                  \
  X(cudaSetDevice, int, (int))                                                                    \
  X(cudaEventCreateWithFlags, int, (void **, unsigned))                                          \
  X(cudaEventDestroy, int, (void *))                                                              \
  X(cudaEventRecord, int, (void *, void *))                                                       \
  X(cudaEventQuery, int, (void *))                                                                \
  X(cudaStreamWaitEvent, int, (void *, void *, unsigned))                                         \
  X(cudaMemGetInfo, int, (size_t *, size_t *))                                                    \
  X(cudaDeviceGetAttribute, int, (int *, int, int))                                               \
  X(cudaMemset, int, (void *, int, size_t))                                                        \
  X(cudaDeviceSynchronize, int, (void))                                                             \
  X(cudaGetLastError, int, (void))                                                                \
  X(cudaEventSynchronize, int, (void *))                                                          \
  X(cudaStreamIsCapturing, int, (void *, int *))                                                  \
  X(cudaThreadExchangeStreamCaptureMode, int, (int *))                                            \
  X(cudaRuntimeGetVersion, int, (int *))                                                          \
  X(cudaGetErrorString, const char *, (int))

/* cudaGraphEdgeData: an edge orders the whole of its upstream node before the whole of its
 * downstream node only when ports and type are all 0 (a programmatic launch's edge does not). */
typedef struct {
  unsigned char from_port, to_port, type, reserved[5];
} edge_data_t;

static bool full_edge(const edge_data_t *e) { return !e || (!e->from_port && !e->to_port && !e->type); }

static struct {
#define DECLARE(name, ret, args) ret(*name) args;
  CUDART_FUNCTIONS(DECLARE)
#undef DECLARE
  /* The capture graph's queries changed shape in CUDA 13 (edge data added); one pair is set. */
  int (*capture_info_12)(void *stream, int *status, unsigned long long *id, void **graph, const void *const **deps,
                         size_t *n);
  int (*capture_info_13)(void *stream, int *status, unsigned long long *id, void **graph, const void *const **deps,
                         const edge_data_t **edges, size_t *n);
  int (*dependencies_12)(const void *node, const void **deps, size_t *n);
  int (*dependencies_13)(const void *node, const void **deps, edge_data_t *edges, size_t *n);
  void *handle;
} rt;

/* Guards loading the runtime; takes no other lock (the lock order of the whole core: Note [Device
 * lifetime], csrc/torch/plugin.h). */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread char last_error[512];

const char *ia_cuda_last_error(void) { return last_error; }

static ia_status_t fail(int err, const char *what) {
  snprintf(last_error, sizeof last_error, "%s failed: %s (CUDA error %d)", what,
           rt.cudaGetErrorString ? rt.cudaGetErrorString(err) : "?", err);
  /* Clear the runtime's last error so PyTorch's next launch check does not report ours. */
  if (rt.cudaGetLastError) rt.cudaGetLastError();
  return err == CUDA_ERROR_MEMORY_ALLOCATION ? IA_ERR_BACKEND_OUT_OF_MEMORY : IA_ERR_BACKEND;
}

ia_status_t ia_cuda_load(const char *cudart_path) {
  pthread_mutex_lock(&load_lock);
  ia_status_t st = IA_OK;
  if (!rt.handle) {
    static const char *const names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
    void *h = NULL;
    if (cudart_path) h = dlopen(cudart_path, RTLD_NOW | RTLD_LOCAL);
    /* Prefer a runtime already in the process; a torch that links it statically has none. */
    for (int pass = 0; pass < 2; pass++)
      for (size_t i = 0; !cudart_path && !h && i < sizeof names / sizeof names[0]; i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
    if (!h) {
      snprintf(last_error, sizeof last_error, "cannot load the CUDA runtime (%s): %s",
               cudart_path ? cudart_path : "libcudart.so.13/.12", dlerror());
      st = IA_ERR_BACKEND;
    } else {
#define RESOLVE(name, ret, args)                                                                         \
  if (st == IA_OK && !(*(void **)&rt.name = dlsym(h, #name))) {                                    \
    snprintf(last_error, sizeof last_error, "the CUDA runtime lacks %s", #name);                    \
    st = IA_ERR_BACKEND;                                                                            \
  }
      CUDART_FUNCTIONS(RESOLVE)
#undef RESOLVE
      /* Optional: without them a block other streams used waits for its capture's end. */
      int version = 0;
      if (st == IA_OK && rt.cudaRuntimeGetVersion(&version) == CUDA_SUCCESS && version >= 13000) {
        *(void **)&rt.capture_info_13 = dlsym(h, "cudaStreamGetCaptureInfo");
        *(void **)&rt.dependencies_13 = dlsym(h, "cudaGraphNodeGetDependencies");
      } else if (st == IA_OK) {
        *(void **)&rt.capture_info_12 = dlsym(h, "cudaStreamGetCaptureInfo_v2");
        *(void **)&rt.dependencies_12 = dlsym(h, "cudaGraphNodeGetDependencies");
      }
      if (st == IA_OK) rt.handle = h;
      else dlclose(h);
    }
  }
  pthread_mutex_unlock(&load_lock);
  return st;
}

/* Runs the runtime calls of one backend operation with its device current, then puts back
 * whichever device the caller had. */
typedef struct {
  int previous;
  bool switched;
} device_guard_t;

static int guard_enter(device_guard_t *g, int device) {
  g->switched = false;
  int err = rt.cudaGetDevice(&g->previous);
  if (err == CUDA_SUCCESS && g->previous != device) {
    err = rt.cudaSetDevice(device);
    g->switched = err == CUDA_SUCCESS;
  }
  return err;
}

static void guard_exit(device_guard_t *g) {
  if (g->switched) rt.cudaSetDevice(g->previous);
}

/* While any stream captures a CUDA graph in the default (global) mode, the runtime refuses calls
 * that may synchronize (cudaMalloc, cudaFree, event queries and synchronizes) from every thread,
 * and a refused call invalidates the capture. Like PyTorch's caching allocator, the calls below
 * run with this thread's capture mode exchanged to relaxed, which lets them through; none of them
 * is captured. */
static int relaxed_enter(void) {
  int mode = CUDA_CAPTURE_MODE_RELAXED;
  rt.cudaThreadExchangeStreamCaptureMode(&mode);
  return mode;
}

static void relaxed_exit(int mode) { rt.cudaThreadExchangeStreamCaptureMode(&mode); }

typedef struct {
  ia_backend_t base;
  int device;
} cuda_backend_t;

static int device_of(ia_backend_t *b) { return ((cuda_backend_t *)b)->device; }

static ia_status_t cuda_reserve(ia_backend_t *self, size_t size, void **out) {
  device_guard_t g;
  int err = guard_enter(&g, device_of(self));
  if (err == CUDA_SUCCESS) {
    int mode = relaxed_enter();
    err = rt.cudaMalloc(out, size);
    relaxed_exit(mode);
  }
  guard_exit(&g);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaMalloc");
}

static void cuda_release(ia_backend_t *self, void *base, size_t size) {
  (void)size;
  device_guard_t g;
  int err = guard_enter(&g, device_of(self));
  if (err == CUDA_SUCCESS) {
    int mode = relaxed_enter();
    err = rt.cudaFree(base);
    relaxed_exit(mode);
  }
  guard_exit(&g);
  if (err != CUDA_SUCCESS) fail(err, "cudaFree");
}

static ia_status_t cuda_commit(ia_backend_t *self, void *base, size_t size) {
  device_guard_t g;
  int err = guard_enter(&g, device_of(self));
  if (err == CUDA_SUCCESS) err = rt.cudaMemset(base, 0, size);
  if (err == CUDA_SUCCESS) err = rt.cudaDeviceSynchronize();
  guard_exit(&g);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "committing a reservation (cudaMemset)");
}

static ia_status_t cuda_event_create(ia_backend_t *self, void **event) {
  device_guard_t g;
  int err = guard_enter(&g, device_of(self));
  if (err == CUDA_SUCCESS) err = rt.cudaEventCreateWithFlags(event, CUDA_EVENT_DISABLE_TIMING);
  guard_exit(&g);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaEventCreateWithFlags");
}

static void cuda_event_destroy(ia_backend_t *self, void *event) {
  (void)self;
  rt.cudaEventDestroy(event);
}

static ia_status_t cuda_event_record(ia_backend_t *self, void *event, ia_stream_t stream) {
  device_guard_t g;
  int err = guard_enter(&g, device_of(self));
  if (err == CUDA_SUCCESS) err = rt.cudaEventRecord(event, (void *)stream);
  guard_exit(&g);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaEventRecord");
}

static bool cuda_event_done(ia_backend_t *self, void *event) {
  (void)self;
  int mode = relaxed_enter();
  int err = rt.cudaEventQuery(event);
  relaxed_exit(mode);
  if (err == CUDA_ERROR_NOT_READY) rt.cudaGetLastError();
  return err == CUDA_SUCCESS;
}

static bool cuda_stream_capturing(ia_backend_t *self, ia_stream_t stream) {
  (void)self;
  int status = CUDA_CAPTURE_STATUS_NONE;
  return rt.cudaStreamIsCapturing((void *)stream, &status) == CUDA_SUCCESS && status != CUDA_CAPTURE_STATUS_NONE;
}

static ia_status_t cuda_event_wait(ia_backend_t *self, void *event) {
  (void)self;
  int mode = relaxed_enter();
  int err = rt.cudaEventSynchronize(event);
  relaxed_exit(mode);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaEventSynchronize");
}

/* A capturing stream may not wait on an event recorded outside its capture, so the host waits for
 * it instead: the captured work runs at replay, after that wait. */
static ia_status_t cuda_stream_wait(ia_backend_t *self, ia_stream_t stream, void *event) {
  if (cuda_stream_capturing(self, stream)) {
    int mode = relaxed_enter();
    int err = rt.cudaEventSynchronize(event);
    relaxed_exit(mode);
    return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaEventSynchronize (a stream waiting while it captures)");
  }
  int err = rt.cudaStreamWaitEvent((void *)stream, event, 0);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaStreamWaitEvent");
}

enum { CUDA_CAPTURE_STATUS_ACTIVE = 1 };

/* Keeps the nodes whose edge orders them wholly before what follows (edges NULL: all of them).
 * Leaving one out only ever delays a reuse. */
static size_t full_nodes(const void *const *nodes, const edge_data_t *edges, size_t n, const void **out, size_t cap) {
  size_t kept = 0;
  for (size_t i = 0; i < n; i++)
    if (full_edge(edges ? &edges[i] : NULL)) {
      if (kept < cap) out[kept] = nodes[i];
      kept++;
    }
  return kept;
}

static size_t cuda_capture_frontier(ia_backend_t *self, ia_stream_t stream, uint64_t *capture, const void **out,
                                    size_t cap) {
  (void)self;
  int status = CUDA_CAPTURE_STATUS_NONE;
  unsigned long long id = 0;
  void *graph = NULL;
  const void *const *deps = NULL;
  const edge_data_t *edges = NULL; /* asked for, else edges with data fail the call */
  size_t n = 0;
  int err = rt.capture_info_13 ? rt.capture_info_13((void *)stream, &status, &id, &graph, &deps, &edges, &n)
                               : rt.capture_info_12((void *)stream, &status, &id, &graph, &deps, &n);
  if (err != CUDA_SUCCESS) rt.cudaGetLastError();
  *capture = err == CUDA_SUCCESS && status == CUDA_CAPTURE_STATUS_ACTIVE ? id : 0;
  return *capture ? full_nodes(deps, edges, n, out, cap) : 0;
}

/* A node whose parents cannot be read has none here: fewer ancestors only ever delay a reuse. */
static size_t cuda_node_parents(ia_backend_t *self, const void *node, const void **out, size_t cap) {
  (void)self;
  size_t n = 0;
  int err = rt.dependencies_13 ? rt.dependencies_13(node, NULL, NULL, &n) : rt.dependencies_12(node, NULL, &n);
  if (err != CUDA_SUCCESS || !n) {
    if (err != CUDA_SUCCESS) rt.cudaGetLastError();
    return 0;
  }
  const void **nodes = malloc(n * sizeof *nodes);
  edge_data_t *edges = rt.dependencies_13 ? malloc(n * sizeof *edges) : NULL;
  if (nodes && (edges || !rt.dependencies_13))
    err = rt.dependencies_13 ? rt.dependencies_13(node, nodes, edges, &n) : rt.dependencies_12(node, nodes, &n);
  else
    err = -1;
  if (err > 0) rt.cudaGetLastError();
  size_t kept = err == CUDA_SUCCESS ? full_nodes(nodes, edges, n, out, cap) : 0;
  free(nodes);
  free(edges);
  return kept;
}

static void cuda_destroy(ia_backend_t *self) { free(self); }

ia_status_t ia_cuda_backend_create(int device, const char *cudart_path, ia_backend_t **out) {
  ia_status_t st = ia_cuda_load(cudart_path);
  if (st != IA_OK) return st;
  cuda_backend_t *c = calloc(1, sizeof *c);
  if (!c) return IA_ERR_NO_HOST_MEMORY;
  c->base = (ia_backend_t){
      .name = "cuda",
      .natural_alignment = 256,
      .reserve = cuda_reserve,
      .release = cuda_release,
      .event_create = cuda_event_create,
      .event_destroy = cuda_event_destroy,
      .event_record = cuda_event_record,
      .event_done = cuda_event_done,
      .stream_wait = cuda_stream_wait,
      .destroy = cuda_destroy,
      .commit = cuda_commit,
      .stream_capturing = cuda_stream_capturing,
      .event_wait = cuda_event_wait,
  };
  bool graphs = (rt.capture_info_13 && rt.dependencies_13) || (rt.capture_info_12 && rt.dependencies_12);
  c->base.capture_frontier = graphs ? cuda_capture_frontier : NULL;
  c->base.node_parents = graphs ? cuda_node_parents : NULL;
  c->device = device;
  *out = &c->base;
  return IA_OK;
}

ia_status_t ia_cuda_device_attribute(int device, int attribute, int *value) {
  if (!rt.handle) return IA_ERR_BACKEND;
  int err = rt.cudaDeviceGetAttribute(value, attribute, device);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaDeviceGetAttribute");
}

ia_status_t ia_cuda_memory_attributes(int device, ia_memory_attributes_t *out) {
  enum { INTEGRATED = 18, PAGEABLE = 88, CONCURRENT_MANAGED = 89, HOST_PAGE_TABLES = 100 };
  ia_status_t st = ia_cuda_device_attribute(device, INTEGRATED, &out->integrated);
  if (st == IA_OK) st = ia_cuda_device_attribute(device, PAGEABLE, &out->pageable_memory_access);
  if (st == IA_OK) st = ia_cuda_device_attribute(device, CONCURRENT_MANAGED, &out->concurrent_managed_access);
  if (st == IA_OK) st = ia_cuda_device_attribute(device, HOST_PAGE_TABLES, &out->uses_host_page_tables);
  return st;
}

ia_status_t ia_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  if (!rt.handle) return IA_ERR_BACKEND;
  device_guard_t g;
  int err = guard_enter(&g, device);
  if (err == CUDA_SUCCESS) err = rt.cudaMemGetInfo(free_bytes, total_bytes);
  guard_exit(&g);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaMemGetInfo");
}

/* ---- for backend_vmm.c ------------------------------------------------------------------------- */

ia_status_t _ia_cuda_enter(_ia_cuda_scope_t *s, int device) {
  device_guard_t g;
  int err = guard_enter(&g, device);
  s->previous = g.previous;
  s->switched = g.switched;
  if (err != CUDA_SUCCESS) {
    guard_exit(&g);
    return fail(err, "cudaSetDevice");
  }
  s->mode = relaxed_enter();
  return IA_OK;
}

void _ia_cuda_exit(_ia_cuda_scope_t *s) {
  relaxed_exit(s->mode);
  device_guard_t g = {.previous = s->previous, .switched = s->switched};
  guard_exit(&g);
}

ia_status_t _ia_cuda_bind_context(void) {
  int err = rt.cudaFree(NULL);
  return err == CUDA_SUCCESS ? IA_OK : fail(err, "cudaFree(NULL), which binds the device's context to the thread");
}

void _ia_cuda_error(const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(last_error, sizeof last_error, format, args);
  va_end(args);
}
