// What timeline recording costs the Reducer per iteration, measured without Python (the Timeline
// of csrc/timeline.h alone, linked with the core): one simulated iteration does what the Reducer
// does per iteration (begin, one stamp per gradient, three per bucket and its collective's
// completion stamp, four at the end).
//
//   build/cmake/bench_timeline_recording NUM_PARAMS NUM_BUCKETS [ITERATIONS]
// prints the mean nanoseconds per iteration (benchmarks/bench_timeline_overhead.py runs it).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "reducer.h"
#include "timeline.h"

namespace {

double recording_cost_ns(size_t num_params, size_t num_buckets, size_t iterations) {
  using pyreducer::IterationRecord;
  using pyreducer::Timeline;
  Timeline timeline(pyreducer::ReducerOptions{}.timeline_iterations, num_params);
  const int64_t start = Timeline::now_ns();
  for (size_t it = 0; it < iterations; ++it) {
    IterationRecord* r = timeline.begin(static_cast<int64_t>(it), 0, num_buckets,
                                        Timeline::now_ns());
    for (size_t i = 0; i < num_params; ++i) r->grad_ready_ns[i] = Timeline::now_ns();
    for (size_t b = 0; b < num_buckets; ++b) {
      r->bucket_ready_ns[b] = Timeline::now_ns();
      r->bucket_launch_ns[b] = Timeline::now_ns();
      auto done = std::make_shared<pyreducer::CompletionStamp>();  // one per collective
      done->stamp();
      r->bucket_done_ns[b] = done->ns();
    }
    r->backward_end_ns = Timeline::now_ns();
    r->wait_start_ns = Timeline::now_ns();
    r->wait_end_ns = Timeline::now_ns();
    r->finalize_end_ns = Timeline::now_ns();
    r->complete = true;
  }
  return static_cast<double>(Timeline::now_ns() - start) / static_cast<double>(iterations);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s NUM_PARAMS NUM_BUCKETS [ITERATIONS]\n", argv[0]);
    return 2;
  }
  const size_t num_params = std::stoul(argv[1]);
  const size_t num_buckets = std::stoul(argv[2]);
  const size_t iterations = argc > 3 ? std::stoul(argv[3]) : 2000;
  if (num_buckets > num_params || iterations == 0) {
    std::fprintf(stderr, "expected NUM_BUCKETS <= NUM_PARAMS and ITERATIONS > 0, got %zu, %zu, %zu\n",
                 num_buckets, num_params, iterations);
    return 2;
  }
  std::printf("%.1f\n", recording_cost_ns(num_params, num_buckets, iterations));
  return 0;
}
