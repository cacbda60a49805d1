// Turns the arena's out-of-memory message into the exception PyTorch users catch.
//
// The C core cannot throw; PyTorch turns a NULL from the allocator into a tensor at address 0, and
// a std::bad_alloc into a plain RuntimeError. Only c10::OutOfMemoryError, thrown by code built
// against the installed torch's headers and linked to its libc10, reaches Python as
// torch.OutOfMemoryError. So this one function is compiled at install time (alloc/oom_shim.py),
// kept apart from the core so the core builds without torch.
#include <c10/util/Exception.h>

extern "C" [[noreturn]] __attribute__((visibility("default"))) void
indexer_arena_raise_oom(const char* message) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  __builtin_unreachable();
}
