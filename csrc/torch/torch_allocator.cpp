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
//   - getDeviceStats, PyTorch's statistics as the core fills them;
//   - PyTorch's memory tools: snapshot() from the core's segments and blocks, recordHistory()
//     from the core's trace events (its sink) with the stacks PyTorch's recorder gathers here,
//     the profiler's memory events, out-of-memory observers.
// It is compiled against the installed torch on first use (alloc/shims.py) and installed with
// torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator.
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <sys/types.h>

#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/util/ApproximateClock.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

extern "C" {
#include "allocator.h"
}

namespace {

using c10::cuda::MempoolId_t;
namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using Context = std::shared_ptr<c10::GatheredContext>;

const ia_torch_entry_points_t* core = nullptr;

ia_pool_id_t to_id(MempoolId_t id) { return {id.first, id.second}; }

// ---- memory history (torch.cuda.memory._record_memory_history)
// The core hands every event of every arena to on_event while history is on; the stacks come from
// PyTorch's recorder, gathered by the thread that allocates or frees before it calls the core
// (on_event runs under the core's locks, Note [Device lifetime]: gathering a stack there could deadlock).
struct History {
  std::mutex mu;
  std::atomic<bool> on{false};
  cda::CreateContextFn recorder = nullptr;
  cda::RecordContext when = cda::RecordContext::NEVER;
  size_t max_entries = 0;
  std::vector<bool> skip = std::vector<bool>(cda::TraceEntry::OOM + 1);
  std::vector<std::deque<cda::TraceEntry>> traces;  // per device, oldest first
  std::unordered_map<uintptr_t, Context> block_context, segment_context;
  std::string user_metadata;
};
History history;
thread_local Context op_context;           // the stack of this thread's allocation or free under way
thread_local MempoolId_t op_pool{0, 0};    // the graph pool it allocates to
thread_local bool attaching = false;       // the core replays the regions it holds: not history
thread_local std::vector<std::string> compile_contexts;  // torch.compile's regions this thread is in

// Gathers this thread's stack for the operation it starts when history wants one at `level`.
struct OpScope {
  explicit OpScope(cda::RecordContext level, MempoolId_t pool = {0, 0}) {
    op_pool = pool;
    if (!history.on.load(std::memory_order_relaxed)) return;
    cda::CreateContextFn recorder;
    {
      std::lock_guard<std::mutex> lock(history.mu);
      recorder = history.when >= level ? history.recorder : nullptr;
    }
    if (recorder) op_context = recorder();
  }
  ~OpScope() {
    op_context.reset();
    op_pool = {0, 0};
  }
};

// Under history.mu. PyTorch keeps stacks in the trace from RecordContext::ALLOC up. An entry's
// metadata is the user's (torch.cuda.memory._set_memory_metadata), else what the memory is when it
// is not an ordinary tensor's: the workspace arena's, or a CUDA graph pool's.
void record(cda::TraceEntry::Action action, int device, uintptr_t addr, size_t size, void* stream, Context ctx,
            MempoolId_t pool, int tag = IA_POOL_SMALL) {
  if (history.skip[action] || device < 0) return;
  auto& trace = history.traces.at(device);
  std::string metadata = history.user_metadata;
  if (metadata.empty() && (tag == IA_POOL_WORKSPACE || tag == IA_TRACE_POOL_GRAPH_WORKSPACE))
    metadata = "indexer-arena workspace";
  else if (metadata.empty() && tag >= IA_TRACE_POOL_GRAPH)
    metadata = "indexer-arena CUDA graph pool";
  trace.emplace_back(action, static_cast<c10::DeviceIndex>(device), addr, size, stream, pool,
                     c10::getApproximateTime(), history.when >= cda::RecordContext::ALLOC ? std::move(ctx) : nullptr,
                     compile_contexts.empty() ? "N/A" : compile_contexts.back(), std::move(metadata));
  while (history.max_entries && trace.size() > history.max_entries) trace.pop_front();
}

void on_event(void*, const ia_trace_event_t* e) {
  if (attaching) return;
  std::lock_guard<std::mutex> lock(history.mu);
  if (!history.on.load(std::memory_order_relaxed) || e->device < 0 ||
      static_cast<size_t>(e->device) >= history.traces.size())
    return;
  void* stream = reinterpret_cast<void*>(e->stream == UINTPTR_MAX ? 0 : e->stream);
  bool mapped = e->pool < IA_POOL_COUNT && e->pool != IA_POOL_WORKSPACE && core->device_expandable(e->device);
  using A = cda::TraceEntry;
  switch (e->action) {
    case IA_TRACE_ALLOC:
      if (history.when >= cda::RecordContext::STATE) history.block_context[e->address] = op_context;
      record(A::ALLOC, e->device, e->address, e->size, stream, op_context, op_pool, e->pool);
      break;
    case IA_TRACE_FREE:
      history.block_context.erase(e->address);
      record(A::FREE_REQUESTED, e->device, e->address, e->size, stream, op_context, {0, 0}, e->pool);
      record(A::FREE_COMPLETED, e->device, e->address, e->size, stream, op_context, {0, 0}, e->pool);
      break;
    case IA_TRACE_RESERVE:  // PyTorch keeps a segment's stack only when recording them all
      if (history.when == cda::RecordContext::ALL) history.segment_context[e->address] = op_context;
      record(mapped ? A::SEGMENT_MAP : A::SEGMENT_ALLOC, e->device, e->address, e->size, stream,
             history.when == cda::RecordContext::ALL ? op_context : nullptr, op_pool, e->pool);
      break;
    case IA_TRACE_RELEASE:
      history.segment_context.erase(e->address);
      record(mapped ? A::SEGMENT_UNMAP : A::SEGMENT_FREE, e->device, e->address, e->size, stream,
             history.when == cda::RecordContext::ALL ? op_context : nullptr, {0, 0}, e->pool);
      break;
    default:  // a refusal: the out-of-memory entry is recorded where the error is raised
      break;
  }
}

// ---- PyTorch's roundup_power2_divisions (torch.cuda.memory._set_allocator_settings or
// PYTORCH_CUDA_ALLOC_CONF): a request of more than 512 bytes times the divisions set for its size
// takes a block rounded up to the next of that many equal steps between the powers of two around
// it. Off (one division) by default; then the core's own 512-byte rounding stands.
size_t rounded(size_t size) {
  constexpr size_t min_block = 512;
  size_t divisions = c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
  if (divisions <= 1 || size <= min_block * divisions || (size & (size - 1)) == 0) return size;
  size_t floor = size_t{1} << (63 - __builtin_clzll(size));
  size_t step = floor >> (63 - __builtin_clzll(divisions));  // divisions as a power of two, rounded down
  if (step == 0) return floor << 1;
  size_t base = size & ~(step - 1);
  return base == size ? size : base + step;
}

// ---- PyTorch's graph_capture_record_stream_reuse, handed to the core as it changes, read where a
// capture begins or allocates: a free inside a capture sees what the capture began with or since.
void sync_record_stream_reuse() {
  static std::atomic<int> known{-1};
  int on = cca::CUDAAllocatorConfig::graph_capture_record_stream_reuse() ? 1 : 0;
  if (known.exchange(on, std::memory_order_relaxed) != on) core->graph_set_record_stream_reuse(on);
}

// ---- snapshot (torch.cuda.memory._snapshot)
struct SnapshotWalk {
  int device;
  MempoolId_t only;  // {0, 0}: every pool
  std::vector<cda::SegmentInfo>* out;
};

void add_segment(void* ctx, const ia_segment_info_t* seg, const ia_block_info_t* blocks, size_t n) {
  auto* walk = static_cast<SnapshotWalk*>(ctx);
  MempoolId_t pool{seg->graph_pool.first, seg->graph_pool.second};
  if ((walk->only.first || walk->only.second) && pool != walk->only) return;
  cda::SegmentInfo info;
  info.device = static_cast<c10::DeviceIndex>(walk->device);
  info.address = seg->address;
  info.total_size = seg->size;
  info.stream = reinterpret_cast<void*>(seg->stream == UINTPTR_MAX ? 0 : seg->stream);
  info.is_large = !(seg->pool == IA_POOL_SMALL || seg->pool == IA_TRACE_POOL_GRAPH_SMALL);
  info.is_expandable = seg->expandable;
  info.owner_private_pool_id = pool;
  std::lock_guard<std::mutex> lock(history.mu);
  auto found = history.segment_context.find(seg->address);
  if (found != history.segment_context.end()) info.context_when_allocated = found->second;
  for (size_t i = 0; i < n; i++) {
    cda::BlockInfo b;
    b.size = blocks[i].size;
    b.requested_size = blocks[i].requested;
    b.allocated = b.active = !blocks[i].is_free;
    if (b.allocated) {
      info.allocated_size += b.size;
      info.active_size += b.size;
      info.requested_size += b.requested_size;
      auto ctx_found = history.block_context.find(blocks[i].address);
      if (ctx_found != history.block_context.end()) b.context_when_allocated = ctx_found->second;
    }
    info.blocks.push_back(std::move(b));
  }
  walk->out->push_back(std::move(info));
}

// The bytes of every live block, kept while PyTorch's profiler records memory (the profiler's
// events carry the size on free too).
std::mutex profiled_mu;
std::unordered_map<void*, std::pair<size_t, int>> profiled;  // size, device

void report_to_profiler(void* ptr, int64_t size, int device) {
  ia_stats_t s;
  core->device_stats(device, &s);
  c10::reportMemoryUsageToProfiler(ptr, size, s.in_use.current, s.capacity.current,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

void delete_block(void* ptr) {
  OpScope scope(cda::RecordContext::ALL);
  if (c10::memoryProfilingEnabled() && ptr) {
    std::pair<size_t, int> block{0, 0};
    {
      std::lock_guard<std::mutex> lock(profiled_mu);
      auto found = profiled.find(ptr);
      if (found != profiled.end()) {
        block = found->second;
        profiled.erase(found);
      }
    }
    core->free(ptr);
    if (block.first) report_to_profiler(ptr, -static_cast<int64_t>(block.first), block.second);
    return;
  }
  core->free(ptr);
}

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

// A MemPool's own allocator, called by the core for the pool's regions (C frames: nothing throws).
using Held = std::shared_ptr<cca::CUDAAllocator>;

void* pool_alloc(void* ctx, size_t size, int, void* stream) {
  try {
    return (*static_cast<Held*>(ctx))->raw_alloc_with_stream(size, static_cast<cudaStream_t>(stream));
  } catch (const std::exception&) {
    return nullptr;  // the core reports it as the pool's allocator refusing
  }
}

void pool_free(void* ctx, void* ptr, size_t, int, void*) {
  try {
    (*static_cast<Held*>(ctx))->raw_delete(ptr);
  } catch (const std::exception& e) {
    fprintf(stderr, "indexer-arena: a MemPool's allocator refused to free %p: %s\n", ptr, e.what());
  }
}

class ArenaAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  ArenaAllocator()
      : CUDAPluggableAllocator(
            [](size_t, int, cudaStream_t) -> void* { TORCH_CHECK(false, "indexer-arena: unreachable alloc"); },
            [](void*, size_t, int, cudaStream_t) { TORCH_CHECK(false, "indexer-arena: unreachable free"); }) {
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
    constexpr size_t one_exa_bytes = 1ull << 60;  // PyTorch's own bound, and its words
    TORCH_CHECK_WITH(OutOfMemoryError, size < one_exa_bytes,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    if (size == 0) return nullptr;
    MempoolId_t route{0, 0};
    if (routing_.load(std::memory_order_acquire) > 0) {
      // The pool begun last wins, as in PyTorch: use_mem_pool blocks nest, and each inner pool
      // takes the thread's allocations until it ends.
      std::lock_guard<std::mutex> lock(routes_mutex_);
      for (auto r = routes_.rbegin(); r != routes_.rend(); ++r)
        if (r->device == device && r->filter(stream)) {
          route = r->id;
          break;
        }
    }
    bool in_pool = route.first || route.second;
    if (in_pool) sync_record_stream_reuse();
    ia_pool_id_t pool = to_id(route);
    OpScope scope(cda::RecordContext::STATE, route);
    void* ptr;
    try {
      ptr = core->alloc(size, rounded(size), device, stream, in_pool ? &pool : nullptr);
    } catch (const c10::OutOfMemoryError&) {
      out_of_memory(device, size, stream, route);
      throw;
    }
    if (c10::memoryProfilingEnabled()) {
      {
        std::lock_guard<std::mutex> lock(profiled_mu);
        profiled[ptr] = {size, device};
      }
      report_to_profiler(ptr, static_cast<int64_t>(size), device);
    }
    return ptr;
  }

  // What PyTorch's allocator does when it raises out-of-memory besides the error itself.
  void out_of_memory(c10::DeviceIndex device, size_t size, cudaStream_t stream, MempoolId_t pool) {
    size_t device_free = 0, device_total = 0;
    if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
    if (history.on.load()) {
      std::lock_guard<std::mutex> lock(history.mu);
      if (static_cast<size_t>(device) < history.traces.size())
        record(cda::TraceEntry::OOM, device, device_free, size, stream, op_context, pool);
    }
    ia_stats_t s;
    core->device_stats(device, &s);
    c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(size), s.in_use.current, s.capacity.current,
                                     c10::Device(c10::DeviceType::CUDA, device));
    auto observers = [this] {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      return oom_observers_;
    }();
    double fraction = core->get_memory_fraction(device);
    size_t allowed = fraction < 1.0 ? static_cast<size_t>(fraction * static_cast<double>(device_total)) : device_total;
    for (const auto& observer : observers) observer(device, size, allowed, device_free);
  }

  // The device asked once (a CUDA runtime call each), as PyTorch's allocator does.
  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = alloc_on(size, device, c10::cuda::getCurrentCUDAStream(device));
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }
  void* raw_alloc(size_t size) override { return allocate(size).release_context(); }  // freed by raw_delete
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    return alloc_on(size, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { delete_block(ptr); }  // the DataPtrs' own free, as in PyTorch

  // ---- graph pools: PyTorch calls begin before the capture starts and end after it stopped.
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    for (auto& r : routes_)
      TORCH_CHECK(!(r.device == device && r.id == id), "indexer-arena: already allocating to CUDA graph pool (",
                  id.first, ", ", id.second, ")");
    sync_record_stream_reuse();
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

  // A MemPool with an allocator of its own: the pool's regions come from that allocator, which
  // the pool keeps alive until it is gone and holds nothing (tensors may outlive the MemPool).
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    if (allocator && allocator.get() != this) {
      auto* held = new std::shared_ptr<cca::CUDAAllocator>(std::move(allocator));
      ia_pool_allocator_t own{pool_alloc, pool_free, [](void* ctx) { delete static_cast<Held*>(ctx); }, held};
      ia_status_t st = core->graph_set_allocator(device, to_id(id), &own);
      if (st != IA_OK) delete held;
      check(st, "giving its own allocator to", id);
    }
    check(core->graph_incref(device, to_id(id)), "creating or holding", id);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) override {
    return core->graph_use_count(device, to_id(id));
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
    check(core->graph_set_use_on_oom(device, to_id(id), use_on_oom), "setting use_on_oom of", id);
  }

  void setNoSplit(c10::DeviceIndex device, MempoolId_t id) override {
    check(core->graph_set_no_split(device, to_id(id)), "setting no_split of", id);
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

  // ---- PyTorch's memory tools
  bool isHistoryEnabled() override { return history.on.load(); }

  void recordHistory(bool enabled, cda::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cda::RecordContext when, bool clearHistory, const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(when == cda::RecordContext::NEVER || context_recorder,
                "indexer-arena: recording stacks needs PyTorch's context recorder");
    {
      std::lock_guard<std::mutex> lock(history.mu);
      history.when = enabled ? when : cda::RecordContext::NEVER;
      history.recorder = enabled ? context_recorder : nullptr;
      history.max_entries = alloc_trace_max_entries;
      history.traces.resize(std::max<size_t>(history.traces.size(), c10::cuda::device_count()));
      std::fill(history.skip.begin(), history.skip.end(), false);
      for (const auto& name : skip_actions) history.skip.at(cda::parseTraceEntryAction(name)) = true;
      if (!enabled || clearHistory)
        for (auto& trace : history.traces) trace.clear();
      if (!enabled) history.block_context.clear(), history.segment_context.clear();
      history.on.store(enabled);
    }
    attaching = true;  // the core replays its regions to a new sink: they are not history
    ia_status_t st = core->trace_sink(enabled ? on_event : nullptr, nullptr);
    attaching = false;
    TORCH_CHECK(st == IA_OK, "indexer-arena: recording memory history failed: ", core->status_str(st));
  }

  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    cca::SnapshotInfo out{};  // its configuration's fields zero, not indeterminate
    int devices = c10::cuda::device_count();
    for (int d = 0; d < devices; d++) {
      SnapshotWalk walk{d, mempool_id, &out.segments};
      core->segments(d, add_segment, &walk);
    }
    std::sort(out.segments.begin(), out.segments.end(),
              [](const auto& a, const auto& b) { return a.address < b.address; });
    std::lock_guard<std::mutex> lock(history.mu);
    for (int d = 0; d < devices; d++) {
      out.device_traces.emplace_back();
      if (include_traces && static_cast<size_t>(d) < history.traces.size())
        out.device_traces.back().assign(history.traces[d].begin(), history.traces[d].end());
    }
    out.config_metadata.last_allocator_settings = "indexer-arena";
    return out;
  }

  void pushCompileContext(std::string& md) override { compile_contexts.push_back(md); }
  void popCompileContext() override { if (!compile_contexts.empty()) compile_contexts.pop_back(); }

  // torch.cuda.empty_cache() (pool {0, 0}), MemPool.empty_cache() and a MemPool's end (its id).
  void emptyCache(MempoolId_t mempool_id) override {
    OpScope scope(cda::RecordContext::ALL);
    if (mempool_id.first || mempool_id.second) {
      for (int d = 0; d < c10::cuda::device_count(); d++) core->graph_empty_cache(d, to_id(mempool_id));
      return;
    }
    core->empty_cache();
  }

  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(history.mu);
    history.user_metadata = metadata;
  }
  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(history.mu);
    return history.user_metadata;
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  double getMemoryFraction(c10::DeviceIndex device) override { return core->get_memory_fraction(device); }

  // ---- statistics: PyTorch's families come filled by the core (ia_plugin_torch_stats), indexed so:
  static_assert(int(cda::StatType::AGGREGATE) == IA_STAT_ALL && int(cda::StatType::SMALL_POOL) == IA_POOL_SMALL &&
                int(cda::StatType::LARGE_POOL) == IA_POOL_LARGE, "ia_torch_stats_t is indexed as c10's StatType");
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    ia_torch_stats_t s;
    core->torch_stats(device, &s);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto copy = [](auto& stats, const ia_stat_t* from) {
      for (int kind = 0; kind < IA_STAT_KINDS; kind++)
        stats[kind] = {from[kind].current, from[kind].peak, from[kind].allocated, from[kind].freed};
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
  void resetAccumulatedStats(c10::DeviceIndex device) override { core->reset_accumulated(device); }

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
  std::mutex routes_mutex_;  // and oom_observers_; held around core->graph_begin (Note [Device lifetime])
  std::vector<Route> routes_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
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
    // changeCurrentAllocator swaps what torch.cuda reaches, not c10's allocator table, which
    // torch.accelerator's memory functions read: without this they found PyTorch's own allocator,
    // never initialized, and answered an empty memory_stats().
    c10::SetAllocator(c10::DeviceType::CUDA, allocator.get());
    return nullptr;
  } catch (const std::exception& e) {
    install_error = e.what();
    return install_error.c_str();
  }
}
