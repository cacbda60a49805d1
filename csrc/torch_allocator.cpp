// The process scope's CUDA allocator: PyTorch's allocator interface over the C core.
//
// PyTorch's CUDAPluggableAllocator, which torch.cuda.memory.change_current_allocator installs,
// keeps its own map of every live pointer, forwards CUDA graph pools through std::function hooks
// that C cannot set, and refuses the calls CUDA graph trees (torch.compile mode="reduce-overhead")
// and torch.cuda.memory_stats() make. This class derives from it, keeps its simple forwards
// (empty_cache, record_stream, memory fraction) and serves the rest from the C core:
//   - allocation and free without the map: the core finds a block's arena by address;
//   - graph pools: begin/end/release, the capture filters PyTorch hands over, pool use counts;
//   - CUDA graph trees: live-allocation checks and checkpoints of a pool;
//   - getDeviceStats, PyTorch's statistics as the core fills them.
// It is compiled against the installed torch on first use (alloc/shims.py) and installed with
// torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator.
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

extern "C" {
#include "arena.h"
}

namespace {

using c10::cuda::MempoolId_t;
namespace cca = c10::cuda::CUDACachingAllocator;

const ia_torch_entry_points_t* core = nullptr;

ia_pool_id_t to_id(MempoolId_t id) { return {id.first, id.second}; }

void delete_block(void* ptr) { core->free(ptr); }

void check(ia_status_t st, const char* what, MempoolId_t id) {
  TORCH_CHECK(st == IA_OK, "indexer-arena: ", what, " of CUDA graph pool (", id.first, ", ", id.second,
              ") refused: ", core->status_str(st));
}

struct PoolCheckpoint final : cca::AllocatorState {
  MempoolId_t id;
  std::vector<ia_block_info_t> blocks;
};

std::vector<ia_block_info_t> pool_blocks(c10::DeviceIndex device, MempoolId_t id) {
  std::vector<ia_block_info_t> blocks;
  for (;;) {  // the pool may gain blocks between the two calls
    size_t n = core->graph_blocks(device, to_id(id), blocks.data(), blocks.size());
    if (n <= blocks.size()) {
      blocks.resize(n);
      return blocks;
    }
    blocks.resize(n + 16);
  }
}

class ArenaAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  ArenaAllocator()
      : CUDAPluggableAllocator(
            [](size_t, int, cudaStream_t) -> void* { TORCH_CHECK(false, "indexer-arena: unreachable alloc"); },
            [](void*, size_t, int, cudaStream_t) { TORCH_CHECK(false, "indexer-arena: unreachable free"); }) {
    set_reset_fn([] { core->empty_cache(); });
    set_memory_fraction_fn([](double fraction, int device) { core->memory_fraction(fraction, device); });
    set_record_stream_fn([](void* ptr, cudaStream_t stream) { core->record_stream(ptr, stream); });
  }

  // A mapped pool's pages are reachable from another device only once it is granted them; the
  // base class's cudaDeviceEnablePeerAccess covers cudaMalloc memory (regions) alone.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    ia_status_t st = core->enable_peer_access(dev, dev_to_access);
    TORCH_CHECK(st == IA_OK, "indexer-arena: giving cuda:", static_cast<int>(dev), " access to the mapped pools of cuda:",
                static_cast<int>(dev_to_access), " failed: ", core->status_str(st),
                " (expandable:off in INDEXER_ARENA_CONF serves the pools from regions instead)");
  }

  void* alloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (size == 0) return nullptr;
    if (routing_.load(std::memory_order_acquire) > 0) {
      ia_pool_id_t pool{};
      bool in_pool = false;
      {
        std::lock_guard<std::mutex> lock(routes_mutex_);
        for (auto& r : routes_)
          if (r.device == device && r.filter(stream)) {
            pool = to_id(r.id);
            in_pool = true;
            break;
          }
      }
      if (in_pool) return core->alloc(size, device, stream, &pool);
    }
    return core->alloc(size, device, stream, nullptr);
  }

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = alloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }
  void* raw_alloc(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return alloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    return alloc_on(size, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { core->free(ptr); }

  // ---- graph pools: PyTorch calls begin before the capture starts and end after it stopped.
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    for (auto& r : routes_)
      TORCH_CHECK(!(r.device == device && r.id == id), "indexer-arena: already allocating to CUDA graph pool (",
                  id.first, ", ", id.second, ")");
    check(core->graph_begin(device, to_id(id)), "beginning allocation", id);
    routes_.push_back({device, id, std::move(filter)});
    routing_.fetch_add(1, std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) override {
    {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      auto it = routes_.begin();
      while (it != routes_.end() && !(it->device == device && it->id == id)) ++it;
      TORCH_CHECK(it != routes_.end(), "indexer-arena: not allocating to CUDA graph pool (", id.first, ", ",
                  id.second, ")");
      routes_.erase(it);
      routing_.fetch_sub(1, std::memory_order_release);
    }
    check(core->graph_end(device, to_id(id)), "ending allocation", id);
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t id) override {
    check(core->graph_release(device, to_id(id)), "release", id);
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(!allocator || allocator.get() == this,
                "indexer-arena: a torch.cuda.MemPool with an allocator of its own cannot run under the process "
                "scope, which serves every CUDA allocation itself; install with scope='workspace' instead");
    check(core->graph_incref(device, to_id(id)), "creating or holding", id);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) override {
    return core->graph_use_count(device, to_id(id));
  }

  // A MemPool's destructor turns use_on_oom off whatever it was created with.
  void setUseOnOOM(c10::DeviceIndex, MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "indexer-arena: MemPool(use_on_oom=True) is not supported: a pool's memory "
                             "serves only allocations made inside it");
  }

  void setNoSplit(c10::DeviceIndex, MempoolId_t) override {
    TORCH_CHECK(false, "indexer-arena: MemPool(no_split=True) is not supported under the process scope");
  }

  // ---- CUDA graph trees
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    size_t live = 0;
    for (const auto& b : pool_blocks(device, id)) {
      if (b.is_free) continue;
      if (!expected.count(reinterpret_cast<void*>(b.address))) return false;
      live++;
    }
    return live == expected.size();
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->id = id;
    state->blocks = pool_blocks(device, id);
    return state;
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<PoolCheckpoint>(as);
    TORCH_CHECK(state, "indexer-arena: that checkpoint was not taken by this allocator");
    cca::CheckpointDelta delta;
    for (const auto& b : pool_blocks(device, state->id))
      if (!b.is_free) delta.ptrs_freed.push_back(reinterpret_cast<void*>(b.address));
    check(core->graph_restore(device, to_id(state->id), state->blocks.data(), state->blocks.size()),
          "restoring a checkpoint", state->id);
    for (const auto& b : state->blocks)
      if (!b.is_free) {
        void* ptr = reinterpret_cast<void*>(b.address);
        delta.dataptrs_allocd.emplace_back(ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device));
      }
    return delta;
  }

  bool isHistoryEnabled() override { return false; }

  // ---- statistics
  // PyTorch's families come filled by the core (ia_plugin_torch_stats: IA_STAT_QUADS names each),
  // indexed as c10's StatType is: aggregate, small pool, large pool (IA_KIND_*).
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    ia_torch_stats_t s;
    core->torch_stats(device, &s);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto copy = [](auto& stats, const ia_stat_t* from) {
      for (int kind = 0; kind < IA_KIND_COUNT; kind++) {
        stats[kind].current = from[kind].current;
        stats[kind].peak = from[kind].peak;
        stats[kind].allocated = from[kind].allocated;
        stats[kind].freed = from[kind].freed;
      }
    };
#define IA_COPY(name, torch, doc) copy(out.torch, s.torch);
    IA_STAT_QUADS(IA_COPY)
#undef IA_COPY
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    return out;
  }

  void resetPeakStats(c10::DeviceIndex device) override { core->reset_peaks(device); }

  void resetAccumulatedStats(c10::DeviceIndex) override {
    TORCH_CHECK(false, "indexer-arena keeps its accumulated counters for the life of the process: take "
                       "differences of torch.cuda.memory_stats() instead of resetting them");
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    ia_stats_t s;
    core->device_stats(device, &s);
    *largest = s.largest_free;
  }

 private:
  struct Route {
    c10::DeviceIndex device;
    MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };
  std::mutex routes_mutex_;
  std::vector<Route> routes_;
  std::atomic<int> routing_{0};
};

std::string install_error;

}  // namespace

// Returns NULL once installed, or why not.
extern "C" __attribute__((visibility("default"))) const char* indexer_arena_install_allocator(
    const ia_torch_entry_points_t* entry_points) {
  try {
    core = entry_points;
    auto allocator = std::make_shared<ArenaAllocator>();
    allocator->init(c10::cuda::device_count());
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
    return nullptr;
  } catch (const std::exception& e) {
    install_error = e.what();
    return install_error.c_str();
  }
}
