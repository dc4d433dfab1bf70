// Work split over XLA's CPU thread pool, for the FFI kernels beside this file.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Runs body(piece) for piece in [0, pieces) on the calling thread and the pool's. A task that
// starts after every piece is taken returns without touching `body`, so the caller waits only for
// the pieces, not for tasks the pool has not started yet.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t pieces, const Body& body) {
  int64_t helpers = std::min<int64_t>(pool.num_threads(), pieces) - 1;
  if (helpers <= 0) {
    for (int64_t p = 0; p < pieces; ++p) body(p);
    return;
  }
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, pieces, &body] {
    for (int64_t p; (p = counters->next.fetch_add(1)) < pieces;) {
      body(p);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < pieces) {
#if defined(__AVX2__)
    _mm_pause();
#endif
  }
}

}  // namespace jaxserve
