// The allocator's own share of a torch.empty + del, timed from C++ (bench_torch_alloc.py's C++
// rows): n allocate() calls on the allocator PyTorch uses for CUDA, each DataPtr dropped (freed)
// at once, the sizes taken in turn. No Python and no tensor around the memory, so a row's
// difference between two allocators is the allocators' alone. stats() does the same for
// torch.cuda.memory_stats(): the allocator's getDeviceStats without the dictionaries Python builds.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/extension.h>

#include <chrono>
#include <vector>

double pairs(const std::vector<int64_t>& sizes, int64_t n) {
  TORCH_CHECK(!sizes.empty() && n > 0, "pairs: give at least one size and one pair");
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  size_t count = sizes.size();
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; i++) {
    c10::DataPtr memory = allocator->allocate(static_cast<size_t>(sizes[static_cast<size_t>(i) % count]));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double stats(int64_t n) {
  TORCH_CHECK(n > 0, "stats: give at least one call");
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  c10::DeviceIndex device = c10::cuda::current_device();
  int64_t sink = 0;
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; i++) sink += allocator->getDeviceStats(device).num_ooms;
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TORCH_CHECK(sink >= 0, "stats: a negative out-of-memory count");  // keeps the calls
  return seconds;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pairs", &pairs, "seconds for n allocate + free pairs");
  m.def("stats", &stats, "seconds for n getDeviceStats calls on the current device");
}
