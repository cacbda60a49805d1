/* A mapping backend over the CUDA driver's virtual memory management, for the general pools
 * (arena_mapped.c): an arena's one address range is reserved with cuMemAddressReserve,
 * and each page is a physical allocation of its own (cuMemCreate of the driver's granularity,
 * 2 MiB on current GPUs), mapped with cuMemMap and made readable and writable by the device with
 * cuMemSetAccess (and by the peer devices granted access, as cudaDeviceEnablePeerAccess grants
 * cudaMalloc memory); cuMemUnmap and cuMemRelease give a page back to the device at once, so
 * cudaMemGetInfo sees it. One allocation per page is what lets any page go on its own: the driver
 * unmaps only whole mappings. This is what PyTorch's expandable segments do, with the page as the
 * unit where they use 2 or 20 MiB.
 *
 * libcuda.so.1 is loaded with dlopen like the runtime, so the build needs no CUDA; the few types
 * below restate cuda.h's. Driver calls run with the backend's device current, the runtime's context
 * of that device bound to the thread and the thread in relaxed capture mode (as the runtime
 * backend's calls do); events and ordinary reservations are the runtime backend's. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
  int type; /* CUmemLocationType */
  int id;
} CUmemLocation;

typedef struct {
  int type;                 /* CUmemAllocationType */
  int requestedHandleTypes; /* CUmemAllocationHandleType */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_HANDLE_TYPE_NONE = 0,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
};

#define DRIVER_FUNCTIONS(X)                                                                       \
  X(cuInit, (unsigned))                                                                           \
  X(cuDeviceGet, (int *, int))                                                                    \
  X(cuDeviceGetAttribute, (int *, int, int))                                                      \
  X(cuCtxGetCurrent, (void **))                                                                   \
  X(cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, int))                   \
  X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))         \
  X(cuMemAddressFree, (CUdeviceptr, size_t))                                                      \
  X(cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
  X(cuMemRelease, (CUmemGenericAllocationHandle))                                                 \
  X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))     \
  X(cuMemUnmap, (CUdeviceptr, size_t))                                                            \
  X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                        \
  X(cuGetErrorString, (CUresult, const char **))

static struct {
#define DECLARE(name, args) CUresult(*name) args;
  DRIVER_FUNCTIONS(DECLARE)
#undef DECLARE
  void *handle;
} drv;

/* Guards loading the driver; takes no other lock (the lock order of the whole core: Note [Device
 * lifetime], csrc/torch/plugin.h). */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

static ia_status_t driver_fail(CUresult err, const char *what, int device) {
  const char *text = NULL;
  if (drv.cuGetErrorString) drv.cuGetErrorString(err, &text);
  _ia_cuda_error("%s on device %d failed: %s (CUDA driver error %d)", what, device, text ? text : "?", err);
  return err == CUDA_ERROR_OUT_OF_MEMORY ? IA_ERR_BACKEND_OUT_OF_MEMORY : IA_ERR_BACKEND;
}

/* The first successful load stays for the life of the process. */
static ia_status_t load_driver(void) {
  pthread_mutex_lock(&load_lock);
  ia_status_t st = IA_OK;
  if (!drv.handle) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      _ia_cuda_error("cannot load the CUDA driver library libcuda.so.1: %s", dlerror());
      st = IA_ERR_BACKEND;
    }
#define RESOLVE(name, args)                                                                          \
  if (st == IA_OK && !(*(void **)&drv.name = dlsym(h, #name))) {                                     \
    _ia_cuda_error("the CUDA driver (libcuda.so.1) lacks %s: mapping pages needs CUDA 10.2 or newer", #name); \
    st = IA_ERR_BACKEND;                                                                              \
  }
    DRIVER_FUNCTIONS(RESOLVE)
#undef RESOLVE
    CUresult err = st == IA_OK ? drv.cuInit(0) : CUDA_SUCCESS;
    if (err != CUDA_SUCCESS) st = driver_fail(err, "cuInit", -1);
    if (st == IA_OK) drv.handle = h;
    else if (h) dlclose(h);
  }
  pthread_mutex_unlock(&load_lock);
  return st;
}

/* Pages a network card can read and write too where the device allows it (GPUDirect RDMA: what
 * cudaMalloc memory gets by default), as PyTorch's expandable segments ask. */
static CUmemAllocationProp page_properties(int device, bool rdma) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, device};
  prop.allocFlags.gpuDirectRDMACapable = rdma;
  return prop;
}

/* The driver's page for the device and the properties of its pages, after checking that it maps. */
static ia_status_t device_page(int device, size_t *page, CUmemAllocationProp *out) {
  int dev = 0, supported = 0, rdma = 0;
  CUresult err = drv.cuDeviceGet(&dev, device);
  if (err != CUDA_SUCCESS) return driver_fail(err, "cuDeviceGet", device);
  err = drv.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (err != CUDA_SUCCESS) return driver_fail(err, "cuDeviceGetAttribute", device);
  if (!supported) {
    _ia_cuda_error("device %d does not support CUDA virtual memory management "
                   "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)", device);
    return IA_ERR_BACKEND;
  }
  /* An older driver may not know the attribute: then the pages are plain. */
  if (drv.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev) != CUDA_SUCCESS)
    rdma = 0;
  CUmemAllocationProp prop = page_properties(device, rdma != 0);
  err = drv.cuMemGetAllocationGranularity(page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (err != CUDA_SUCCESS) return driver_fail(err, "cuMemGetAllocationGranularity", device);
  if (!_ia_is_pow2(*page)) {
    _ia_cuda_error("device %d maps pages of %zu bytes, not a power of two", device, *page);
    return IA_ERR_BACKEND;
  }
  if (out) *out = prop;
  return IA_OK;
}

ia_status_t ia_vmm_supported(int device, const char *cudart_path) {
  ia_status_t st = ia_cuda_load(cudart_path);
  if (st == IA_OK) st = load_driver();
  size_t page;
  return st == IA_OK ? device_page(device, &page, NULL) : st;
}

typedef struct vmm_range {
  uintptr_t base;
  size_t size;
  CUmemGenericAllocationHandle *handles; /* one per page */
  uint8_t *mapped;                       /* whether handles[i] is live and mapped */
  struct vmm_range *next;
} vmm_range_t;

typedef struct {
  ia_backend_t base;
  ia_backend_t *runtime; /* events, ordinary reservations */
  int device;
  CUmemAllocationProp prop;
  vmm_range_t *ranges; /* the arena calls under its lock, so these need no lock of their own */
  CUmemAccessDesc access[IA_MAX_DEVICES + 1]; /* the device, then the peers granted access */
  size_t n_access;
} vmm_backend_t;

static vmm_backend_t *vmm(ia_backend_t *b) { return (vmm_backend_t *)b; }
static ia_backend_t *vmm_runtime(ia_backend_t *b) { return vmm(b)->runtime; }
IA_FORWARD_EVENTS(vmm, vmm_runtime)

static ia_status_t vmm_reserve(ia_backend_t *self, size_t size, void **out) {
  return vmm_runtime(self)->reserve(vmm_runtime(self), size, out);
}
static void vmm_release(ia_backend_t *self, void *base, size_t size) {
  vmm_runtime(self)->release(vmm_runtime(self), base, size);
}
static ia_status_t vmm_commit(ia_backend_t *self, void *base, size_t size) {
  return vmm_runtime(self)->commit(vmm_runtime(self), base, size);
}

/* Driver calls need the device's context bound to the calling thread; a thread that never made a
 * runtime call may have none, which cudaFree(NULL) makes the runtime bind. */
static ia_status_t enter(vmm_backend_t *v, _ia_cuda_scope_t *scope) {
  ia_status_t st = _ia_cuda_enter(scope, v->device);
  if (st != IA_OK) return st;
  void *context = NULL;
  if (drv.cuCtxGetCurrent(&context) != CUDA_SUCCESS || !context) st = _ia_cuda_bind_context();
  if (st != IA_OK) _ia_cuda_exit(scope);
  return st;
}

static vmm_range_t *range_of(vmm_backend_t *v, uintptr_t at, size_t size) {
  for (vmm_range_t *r = v->ranges; r; r = r->next)
    if (at >= r->base && at - r->base < r->size && size <= r->size - (at - r->base)) return r;
  return NULL;
}

static ia_status_t vmm_address_reserve(ia_backend_t *self, size_t size, void **out) {
  vmm_backend_t *v = vmm(self);
  size_t pages = size / self->page_size;
  vmm_range_t *r = calloc(1, sizeof *r);
  CUmemGenericAllocationHandle *handles = calloc(pages, sizeof *handles);
  uint8_t *mapped = calloc(pages, 1);
  if (!r || !handles || !mapped) {
    free(r);
    free(handles);
    free(mapped);
    return IA_ERR_NO_HOST_MEMORY;
  }
  _ia_cuda_scope_t scope;
  ia_status_t st = enter(v, &scope);
  CUdeviceptr base = 0;
  if (st == IA_OK) {
    CUresult err = drv.cuMemAddressReserve(&base, size, self->page_size, 0, 0);
    if (err != CUDA_SUCCESS) st = driver_fail(err, "cuMemAddressReserve", v->device);
    _ia_cuda_exit(&scope);
  }
  if (st != IA_OK) {
    free(r);
    free(handles);
    free(mapped);
    return st;
  }
  *r = (vmm_range_t){.base = (uintptr_t)base, .size = size, .handles = handles, .mapped = mapped, .next = v->ranges};
  v->ranges = r;
  *out = (void *)(uintptr_t)base;
  return IA_OK;
}

/* Unmaps and releases pages [first, first + n) of r that are mapped; the first failure is said. */
static void unmap_pages(vmm_backend_t *v, vmm_range_t *r, size_t first, size_t n) {
  size_t page = v->base.page_size;
  CUresult failed = CUDA_SUCCESS;
  const char *what = NULL;
  for (size_t i = first; i < first + n; i++) {
    if (!r->mapped[i]) continue;
    CUresult err = drv.cuMemUnmap(r->base + i * page, page);
    if (err == CUDA_SUCCESS) {
      err = drv.cuMemRelease(r->handles[i]);
      r->mapped[i] = 0;
      if (err != CUDA_SUCCESS && !what) failed = err, what = "cuMemRelease";
    } else if (!what) {
      failed = err, what = "cuMemUnmap";
    }
  }
  if (what) driver_fail(failed, what, v->device);
}

static ia_status_t vmm_map(ia_backend_t *self, void *at, size_t size) {
  vmm_backend_t *v = vmm(self);
  size_t page = self->page_size;
  vmm_range_t *r = range_of(v, (uintptr_t)at, size);
  if (!r) return IA_ERR_INVALID_ARGUMENT;
  size_t first = ((uintptr_t)at - r->base) / page, n = size / page, done = 0;
  for (size_t i = first; i < first + n; i++)
    if (r->mapped[i]) return IA_ERR_INVALID_ARGUMENT; /* the arena never asks; a handle would leak */
  _ia_cuda_scope_t scope;
  ia_status_t st = enter(v, &scope);
  if (st != IA_OK) return st;
  /* The driver creates page after page until one is refused, so a map wider than what the device
   * has free would first take all of it, and every other process on the device would see it full
   * (a context being created there fails with cudaErrorMemoryAllocation) until the pages of this
   * call go back. cudaMalloc refuses such a request whole; so does this, when it cannot fit. */
  size_t free_bytes = 0, total = 0;
  if (ia_cuda_mem_info(v->device, &free_bytes, &total) == IA_OK && size > free_bytes) {
    char need[32], left[32];
    _ia_cuda_error("cuMemCreate of %s of pages on device %d not asked: the device has %s free "
                   "(out of memory)", _ia_format_bytes(size, need, sizeof need), v->device,
                   _ia_format_bytes(free_bytes, left, sizeof left));
    _ia_cuda_exit(&scope);
    return IA_ERR_BACKEND_OUT_OF_MEMORY;
  }
  CUresult err = CUDA_SUCCESS;
  const char *what = NULL;
  for (; done < n && !what; done++) {
    size_t i = first + done;
    if ((err = drv.cuMemCreate(&r->handles[i], page, &v->prop, 0)) != CUDA_SUCCESS) {
      what = "cuMemCreate of a page";
      break;
    }
    if ((err = drv.cuMemMap(r->base + i * page, page, 0, r->handles[i], 0)) != CUDA_SUCCESS) {
      drv.cuMemRelease(r->handles[i]);
      what = "cuMemMap";
      break;
    }
    r->mapped[i] = 1;
  }
  /* One grant for the whole stretch and every device that reaches it: mapped pages are not
   * accessible before it. */
  if (!what && (err = drv.cuMemSetAccess((CUdeviceptr)(uintptr_t)at, size, v->access, v->n_access)) != CUDA_SUCCESS)
    what = "cuMemSetAccess";
  if (what) {
    char message[96];
    snprintf(message, sizeof message, "%s (%zu of %zu bytes mapped)", what, done * page, size);
    st = driver_fail(err, message, v->device);
    unmap_pages(v, r, first, n); /* the pages of this call go back; the message stays unless that fails */
  }
  _ia_cuda_exit(&scope);
  return st;
}

static void vmm_unmap(ia_backend_t *self, void *at, size_t size) {
  vmm_backend_t *v = vmm(self);
  vmm_range_t *r = range_of(v, (uintptr_t)at, size);
  _ia_cuda_scope_t scope;
  if (!r || enter(v, &scope) != IA_OK) return;
  unmap_pages(v, r, ((uintptr_t)at - r->base) / self->page_size, size / self->page_size);
  _ia_cuda_exit(&scope);
}

/* The peer reaches every page mapped now (each run of mapped pages in one grant) and later. */
static ia_status_t vmm_grant_access(ia_backend_t *self, int peer) {
  vmm_backend_t *v = vmm(self);
  for (size_t i = 0; i < v->n_access; i++)
    if (v->access[i].location.id == peer) return IA_OK;
  if (peer < 0 || v->n_access > IA_MAX_DEVICES) return IA_ERR_INVALID_ARGUMENT;
  CUmemAccessDesc grant = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, peer}, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  size_t page = self->page_size;
  _ia_cuda_scope_t scope;
  ia_status_t st = enter(v, &scope);
  bool entered = st == IA_OK;
  for (vmm_range_t *r = v->ranges; r && st == IA_OK; r = r->next)
    for (size_t i = 0, pages = r->size / page; i < pages && st == IA_OK;) {
      size_t run = 0;
      while (i + run < pages && r->mapped[i + run]) run++;
      CUresult err = run ? drv.cuMemSetAccess(r->base + i * page, run * page, &grant, 1) : CUDA_SUCCESS;
      if (err != CUDA_SUCCESS) st = driver_fail(err, "cuMemSetAccess for a peer device", v->device);
      i += run ? run : 1;
    }
  if (entered) _ia_cuda_exit(&scope);
  if (st == IA_OK) v->access[v->n_access++] = grant;
  return st;
}

static void vmm_address_free(ia_backend_t *self, void *base, size_t size) {
  vmm_backend_t *v = vmm(self);
  vmm_range_t **link = &v->ranges;
  while (*link && (*link)->base != (uintptr_t)base) link = &(*link)->next;
  vmm_range_t *r = *link;
  if (!r) return;
  *link = r->next;
  _ia_cuda_scope_t scope;
  if (enter(v, &scope) == IA_OK) {
    unmap_pages(v, r, 0, r->size / self->page_size);
    CUresult err = drv.cuMemAddressFree((CUdeviceptr)(uintptr_t)base, size);
    if (err != CUDA_SUCCESS) driver_fail(err, "cuMemAddressFree", v->device);
    _ia_cuda_exit(&scope);
  }
  free(r->handles);
  free(r->mapped);
  free(r);
}

static void vmm_destroy(ia_backend_t *self) {
  vmm_backend_t *v = vmm(self);
  while (v->ranges) vmm_address_free(self, (void *)v->ranges->base, v->ranges->size);
  ia_backend_destroy(v->runtime);
  free(v);
}

ia_status_t ia_vmm_backend_create(int device, const char *cudart_path, ia_backend_t **out) {
  *out = NULL;
  ia_backend_t *runtime;
  ia_status_t st = ia_cuda_backend_create(device, cudart_path, &runtime);
  if (st != IA_OK) return st;
  size_t page = 0;
  CUmemAllocationProp prop;
  if ((st = load_driver()) != IA_OK || (st = device_page(device, &page, &prop)) != IA_OK) {
    ia_backend_destroy(runtime);
    return st;
  }
  vmm_backend_t *v = calloc(1, sizeof *v);
  if (!v) {
    ia_backend_destroy(runtime);
    return IA_ERR_NO_HOST_MEMORY;
  }
  v->base = (ia_backend_t){
      .name = "cuda (mapping)",
      .natural_alignment = runtime->natural_alignment,
      .reserve = vmm_reserve,
      .release = vmm_release,
      IA_FORWARDED_EVENTS(vmm, runtime),
      .destroy = vmm_destroy,
      .commit = vmm_commit,
      .page_size = page,
      .address_reserve = vmm_address_reserve,
      .address_free = vmm_address_free,
      .map = vmm_map,
      .unmap = vmm_unmap,
      .grant_access = vmm_grant_access,
  };
  v->runtime = runtime;
  v->device = device;
  v->prop = prop;
  v->access[0] = (CUmemAccessDesc){.location = {CU_MEM_LOCATION_TYPE_DEVICE, device},
                                   .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  v->n_access = 1;
  *out = &v->base;
  return IA_OK;
}
