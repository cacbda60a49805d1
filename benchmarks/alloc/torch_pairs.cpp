// The allocator's own share of a torch.empty + del, timed from C++ (bench_torch_alloc.py's C++
// rows): n allocate() calls on the allocator PyTorch uses for CUDA, each DataPtr dropped (freed)
// at once, the sizes taken in turn, from one thread or spread over several at once. No Python and
// no tensor around the memory, so a row's difference between two allocators is the allocators'
// alone; with several threads, no interpreter lock between them either, so they meet inside the
// allocator. stats() does the same for torch.cuda.memory_stats(): the allocator's getDeviceStats
// without the dictionaries Python builds.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

static void allocate_and_free(const std::vector<int64_t>& sizes, int64_t first, int64_t n) {
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  size_t count = sizes.size();
  for (int64_t i = first; i < first + n; i++) {
    c10::DataPtr memory = allocator->allocate(static_cast<size_t>(sizes[static_cast<size_t>(i) % count]));
  }
}

double pairs(const std::vector<int64_t>& sizes, int64_t n, int64_t threads) {
  TORCH_CHECK(!sizes.empty() && n > 0 && threads > 0, "pairs: give at least one size, one pair and one thread");
  if (threads == 1) {
    auto start = Clock::now();
    allocate_and_free(sizes, 0, n);
    return seconds_since(start);
  }
  c10::DeviceIndex device = c10::cuda::current_device();
  int64_t each = n / threads;
  std::atomic<int64_t> ready{0};
  std::atomic<bool> go{false};
  std::mutex failed_mu;
  std::string failed;  // the first thread's error, raised here once all have ended
  auto fail = [&](const std::exception& e) {
    std::lock_guard<std::mutex> lock(failed_mu);
    if (failed.empty()) failed = e.what();
  };
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; t++)
    pool.emplace_back([&, t] {
      try {
        // The device's context made current first, as on a serving worker's threads: a thread
        // without one pays the CUDA runtime's slow path on every device lookup, under either
        // allocator.
        c10::cuda::set_device(device);
        C10_CUDA_CHECK(cudaFree(nullptr));
      } catch (const std::exception& e) {
        fail(e);
      }
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      try {
        allocate_and_free(sizes, t * each, each);  // each thread starts at its own place in the list
      } catch (const std::exception& e) {
        fail(e);
      }
    });
  while (ready.load() < threads) std::this_thread::yield();
  auto start = Clock::now();
  go.store(true);
  for (auto& thread : pool) thread.join();
  double seconds = seconds_since(start);
  TORCH_CHECK(failed.empty(), "pairs: a thread failed: ", failed);
  return seconds;
}

double stats(int64_t n) {
  TORCH_CHECK(n > 0, "stats: give at least one call");
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  c10::DeviceIndex device = c10::cuda::current_device();
  int64_t sink = 0;
  auto start = Clock::now();
  for (int64_t i = 0; i < n; i++) sink += allocator->getDeviceStats(device).num_ooms;
  double seconds = seconds_since(start);
  TORCH_CHECK(sink >= 0, "stats: a negative out-of-memory count");  // keeps the calls
  return seconds;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pairs", &pairs, "seconds for n allocate + free pairs, spread over threads", pybind11::arg("sizes"),
        pybind11::arg("n"), pybind11::arg("threads") = 1);
  m.def("stats", &stats, "seconds for n getDeviceStats calls on the current device");
}
