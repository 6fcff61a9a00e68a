// A parallel loop whose pieces go to whichever thread asks next, for the kernels whose
// pieces are independent (each output written by one piece, so the split never changes a
// result).
//
// Why: at::parallel_for cuts the range into one fixed share per thread. On a 2-core host
// the services (gateway, frontend, the scheduler's RPC side, detokenizer) wake on the core
// of the engine's second thread for every token they deliver; that thread's share waits
// them out while the first thread, done with its own, spins at the region's end. Here the
// thread that keeps its core takes the pieces the other has not reached, and a weight loop
// bound by memory loses little running on one core for a while.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tokenline {

// Pieces per thread: enough that a thread held off its core for part of the loop leaves
// most of its share to the others, few enough that the shared counter's cache line moves
// between cores once in tens of microseconds.
constexpr int64_t kPiecesPerThread = 8;

// f(begin, end) over [0, n) in pieces, each handed out once.
template <typename F>
inline void parallel_for_shared(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  const int64_t piece = std::max<int64_t>(1, n / (threads * kPiecesPerThread));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(piece, std::memory_order_relaxed); begin < n;
         begin = next.fetch_add(piece, std::memory_order_relaxed)) {
      f(begin, std::min(n, begin + piece));
    }
  });
}

}  // namespace tokenline
