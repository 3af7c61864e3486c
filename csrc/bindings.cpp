// The only pybind11 file: exposes the C++ core as pyreducer._C.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "bucket.h"
#include "bucketing.h"
#include "comm_hook.h"
#include "quorum_hook.h"
#include "reducer.h"
#include "timeline.h"

namespace py = pybind11;

namespace pyreducer {
namespace {

py::list assign_buckets_py(const std::vector<int64_t>& sizes_bytes,
                           const std::vector<std::string>& group_keys,
                           const std::vector<int64_t>& walk_order,
                           const std::vector<int64_t>& caps_bytes,
                           const std::vector<bool>& sparse) {
  if (sizes_bytes.size() != group_keys.size() ||
      (!sparse.empty() && sparse.size() != sizes_bytes.size())) {
    throw std::invalid_argument("assign_buckets: expected one group key per size (and one "
                                "sparse flag, if any), got " + std::to_string(group_keys.size()) +
                                " keys and " + std::to_string(sparse.size()) + " flags for " +
                                std::to_string(sizes_bytes.size()) + " sizes");
  }
  std::vector<ParamSpec> params(sizes_bytes.size());
  for (size_t i = 0; i < params.size(); ++i) {
    params[i] = ParamSpec{sizes_bytes[i], group_keys[i], !sparse.empty() && sparse[i]};
  }
  py::list result;
  for (const BucketSpec& bucket : assign_buckets(params, walk_order, caps_bytes)) {
    py::dict entry;
    entry["param_indices"] = bucket.param_indices;
    entry["size_bytes"] = bucket.size_bytes;
    entry["cap_bytes"] = bucket.cap_bytes;
    result.append(entry);
  }
  return result;
}

py::list bucket_layout(const Reducer& reducer) {
  std::vector<std::vector<int64_t>> plan;
  std::vector<int64_t> sizes;
  {
    py::gil_scoped_release no_gil;  // See bind_reducer
    plan = reducer.plan();
    sizes = reducer.bucket_sizes_bytes();
  }
  py::list result;
  for (size_t b = 0; b < plan.size(); ++b) {
    py::dict entry;
    entry["param_indices"] = plan[b];
    entry["size_bytes"] = sizes[b];
    result.append(entry);
  }
  return result;
}

// torch DDP's GradBucket interface, for Python communication hooks.
struct PyGradBucket {
  GradBucketView view;
  at::Tensor buffer() const { return view.buffer; }
  void set_buffer(const at::Tensor& tensor) { view.buffer = tensor; }
};

// A Python hook(state, bucket) -> torch.futures.Future[Tensor]; see Note [Communication hooks].
class PythonCommHook : public CommHook {
 public:
  PythonCommHook(py::object state, py::object hook)
      : state_(std::move(state)), hook_(std::move(hook)) {
    name_ = py::str(py::getattr(hook_, "__qualname__", py::repr(hook_)));
  }
  ~PythonCommHook() override {
    py::gil_scoped_acquire gil;
    state_ = py::object();
    hook_ = py::object();
  }
  FuturePtr run(GradBucketView& bucket) override {
    py::gil_scoped_acquire gil;
    py::object result;
    try {
      result = hook_(state_, PyGradBucket{bucket});
    } catch (py::error_already_set& error) {
      throw std::runtime_error("pyreducer: communication hook " + name_ + " raised for bucket " +
                               std::to_string(bucket.index) + ": " + error.what());
    }
    try {
      return result.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
    } catch (py::cast_error&) {
      // torch's wording (its tests and users match on it), then the hook and bucket.
      py::handle type = py::type::handle_of(result);
      throw std::runtime_error(
          "DDP communication hook's callback must return a torch.futures.Future object, but "
          "got " + py::str(type.attr("__module__")).cast<std::string>() + "." +
          py::str(type.attr("__qualname__")).cast<std::string>() + " (pyreducer: hook " + name_ +
          ", bucket " + std::to_string(bucket.index) + ")");
    }
  }
  at::Tensor parse_result(const c10::IValue& value) override {
    if (!value.isPyObject()) return CommHook::parse_result(value);
    py::gil_scoped_acquire gil;
    py::object obj = torch::jit::toPyObject(value);
    if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) obj = obj[py::int_(0)];
    return obj.cast<at::Tensor>();
  }
  std::string name() const override { return name_; }
  bool checked_result() const override { return true; }

 private:
  py::object state_;
  py::object hook_;
  std::string name_;
};

// One iteration's event times as a dict (names as in pyreducer/wrapper/timeline.py).
py::dict event_times(const EventTimes& t, const std::vector<std::vector<int64_t>>& plan) {
  py::dict entry;
  entry["backward_start_ns"] = t.backward_start_ns;
  entry["backward_end_ns"] = t.backward_end_ns;
  entry["wait_start_ns"] = t.wait_start_ns;
  entry["wait_end_ns"] = t.wait_end_ns;
  entry["finalize_end_ns"] = t.finalize_end_ns;
  entry["grad_ready_ns"] = t.grad_ready_ns;
  py::list buckets;
  for (size_t b = 0; b < t.bucket_ready_ns.size(); ++b) {
    py::dict bucket;
    bucket["param_indices"] = plan.at(b);
    bucket["ready_ns"] = t.bucket_ready_ns[b];
    bucket["launch_ns"] = t.bucket_launch_ns[b];
    bucket["done_ns"] = t.bucket_done_ns[b];
    buckets.append(bucket);
  }
  entry["buckets"] = buckets;
  return entry;
}

// Completed iteration records as plain Python data (see Note [Timeline]); times in ns, 0 where
// an event did not happen. "clock" says whose clock: "host", or "device" (Note [Device
// timeline]), which then also gives the host times under "host". The C++ read-out, which may
// wait for device events, runs without the GIL.
py::list timeline_records(const Reducer& reducer, size_t last) {
  std::vector<IterationTimes> records;
  {
    py::gil_scoped_release no_gil;
    records = reducer.timeline(last);
  }
  py::list result;
  for (const IterationTimes& r : records) {
    py::dict entry = event_times(r.times, r.plan);
    entry["iteration"] = r.iteration;
    entry["plan_version"] = r.plan_version;
    entry["clock"] = r.device_clock ? "device" : "host";
    if (r.device_clock) entry["host"] = event_times(r.host, r.plan);
    result.append(entry);
  }
  return result;
}

// The planner and the build's constants (csrc/bucketing.h, csrc/bucket.h).
void bind_planner(py::module_& m) {
  m.attr("DEFAULT_FIRST_BUCKET_CAP_BYTES") = kDefaultFirstBucketCapBytes;
  m.attr("DEFAULT_BUCKET_CAP_BYTES") = kDefaultBucketCapBytes;
#ifdef PYREDUCER_WITH_CUDA
  m.attr("WITH_CUDA") = true;  // CUDA kernels compiled in (csrc/cuda)
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("assign_buckets", &assign_buckets_py, py::arg("sizes_bytes"), py::arg("group_keys"),
        py::arg("walk_order"), py::arg("caps_bytes"), py::arg("sparse") = std::vector<bool>{},
        "Partition parameters into buckets; see csrc/bucketing.h.");
  m.def("reverse_order", &reverse_order, py::arg("num_params"));
  m.def("group_key", &group_key, py::arg("tensor"),
        "The bucket group key, \"dtype/device\", of a tensor (csrc/bucket.h).");
  m.def("size_bytes", &size_bytes, py::arg("tensor"),
        "Bytes of a tensor's elements, its slot in a bucket (csrc/bucket.h).");
  m.def("shard_numel", &shard_numel, py::arg("numel"), py::arg("shards"), py::arg("element_size"),
        "Elements of each shard of a sharded bucket: Gloo's ring all-reduce chunk "
        "(csrc/bucket.h).");
}

// ReducerOptions, its defaults taken from C++ (csrc/reducer.h): Python sets what it changes.
void bind_options(py::module_& m) {
  py::class_<ReducerOptions>(m, "ReducerOptions", "See ReducerOptions in csrc/reducer.h.")
      .def(py::init<>())
      .def_readwrite("find_unused_parameters", &ReducerOptions::find_unused_parameters)
      .def_readwrite("static_graph", &ReducerOptions::static_graph)
      .def_readwrite("gradient_as_bucket_view", &ReducerOptions::gradient_as_bucket_view)
      .def_readwrite("rebuild_buckets", &ReducerOptions::rebuild_buckets)
      .def_readwrite("rebuild_caps_bytes", &ReducerOptions::rebuild_caps_bytes)
      .def_readwrite("batched_grad_copy", &ReducerOptions::batched_grad_copy)
      .def_readwrite("lazy_bucket_allocation", &ReducerOptions::lazy_bucket_allocation)
      .def_readwrite("timeline_iterations", &ReducerOptions::timeline_iterations)
      .def_readwrite("sparse_params", &ReducerOptions::sparse_params)
      .def_readwrite("skip_all_reduce_unused_params",
                     &ReducerOptions::skip_all_reduce_unused_params)
      .def_readwrite("check_finite", &ReducerOptions::check_finite);
}

// A BackwardStats as a dict (see csrc/reducer.h; read by pyreducer/wrapper/ddp_logging.py).
py::dict backward_stats(const Reducer& reducer) {
  BackwardStats stats;
  {
    py::gil_scoped_release no_gil;  // See bind_reducer
    stats = reducer.last_backward_stats();
  }
  py::dict entry;
  entry["iteration"] = stats.iteration;
  entry["backward_start_ns"] = stats.backward_start_ns;
  entry["comm_start_ns"] = stats.comm_start_ns;
  entry["backward_end_ns"] = stats.backward_end_ns;
  entry["comm_end_ns"] = stats.comm_end_ns;
  entry["buckets_reduced"] = stats.buckets_reduced;
  entry["ready_order"] = stats.ready_order;
  entry["unused"] = stats.unused;
  return entry;
}

AveragingHook::Post post_op(const std::string& name) {
  if (name == "none") return AveragingHook::Post::kNone;
  if (name == "multiply") return AveragingHook::Post::kMultiply;
  if (name == "divide") return AveragingHook::Post::kDivide;
  throw std::invalid_argument("averaging hook: expected post 'none', 'multiply' or 'divide', "
                              "got '" + name + "'");
}

// torch DDP's GradBucket, as Python communication hooks see it.
void bind_grad_bucket(py::module_& m) {
  py::class_<PyGradBucket>(m, "GradBucket", "A bucket as torch DDP's communication hooks see it.")
      .def("index", [](const PyGradBucket& b) { return b.view.index; })
      .def("is_last", [](const PyGradBucket& b) { return b.view.is_last; })
      .def("buffer", &PyGradBucket::buffer)
      .def("set_buffer", &PyGradBucket::set_buffer, py::arg("tensor"))
      .def("gradients", [](const PyGradBucket& b) { return b.view.gradients; })
      .def("parameters", [](const PyGradBucket& b) { return b.view.parameters; });
}

std::shared_ptr<CommHook> builtin_hook(ProcessGroupPtr group, const std::string& name) {
  if (name == "fp16") return std::make_shared<CompressHook>(std::move(group), at::kHalf);
  if (name == "bf16") return std::make_shared<CompressHook>(std::move(group), at::kBFloat16);
  throw std::invalid_argument("unknown builtin hook '" + name + "'; expected 'fp16' or 'bf16'");
}

void register_averaging_hook(Reducer& reducer, ProcessGroupPtr group,
                             std::optional<at::ScalarType> dtype, double pre_multiplier,
                             const std::string& post, double post_value, const std::string& name) {
  AveragingHook::Options options;
  options.reduce_dtype = dtype;
  options.pre_multiplier = pre_multiplier;
  options.post = post_op(post);
  options.post_value = post_value;
  options.name = name;
  py::gil_scoped_release no_gil;  // See bind_reducer
  reducer.register_comm_hook(std::make_shared<AveragingHook>(std::move(group), options));
}

// See Note [Deferred completion]; `on_deferred` (a Python callable or None) runs with the GIL.
void set_deferred_completion(Reducer& reducer, bool deferred, py::object on_deferred) {
  std::function<void()> callback;
  if (!on_deferred.is_none()) {
    // Held so that it is released with the GIL, from whichever thread drops it.
    std::shared_ptr<py::object> held(new py::object(std::move(on_deferred)), [](py::object* obj) {
      py::gil_scoped_acquire gil;
      delete obj;
    });
    callback = [held] {
      py::gil_scoped_acquire gil;
      (*held)();
    };
  }
  py::gil_scoped_release no_gil;
  reducer.set_deferred_completion(deferred, std::move(callback));
}

// See Reducer::set_failure_context; `context` (a Python callable: phase -> text) runs with the
// GIL. Its own failure never hides the collective's error.
void set_failure_context(Reducer& reducer, py::object context) {
  std::shared_ptr<py::object> held(new py::object(std::move(context)), [](py::object* obj) {
    py::gil_scoped_acquire gil;
    delete obj;
  });
  py::gil_scoped_release no_gil;  // See bind_reducer
  reducer.set_failure_context([held](const std::string& phase) -> std::string {
    py::gil_scoped_acquire gil;
    try {
      return (*held)(phase).cast<std::string>();
    } catch (const std::exception& error) {
      return std::string(" (naming the lost ranks failed: ") + error.what() + ")";
    }
  });
}

// See Note [Quorum all-reduce] in csrc/quorum_hook.h; `on_error` (a Python callable: message
// -> None) runs with the GIL, on the thread that saw the failure; its own failure is printed as
// unraisable (it must not reach a communication thread).
std::shared_ptr<QuorumHook> make_quorum_hook(py::object on_error) {
  std::shared_ptr<py::object> held(new py::object(std::move(on_error)), [](py::object* obj) {
    py::gil_scoped_acquire gil;
    delete obj;
  });
  return std::make_shared<QuorumHook>([held](const std::string& message) {
    py::gil_scoped_acquire gil;
    try {
      (*held)(message);
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("pyreducer.torchft: reporting a failed all-reduce");
    }
  });
}

void bind_quorum_hook(py::module_& m) {
  const auto RELEASE = py::call_guard<py::gil_scoped_release>();
  py::class_<CommHook, std::shared_ptr<CommHook>>(m, "CommHook",
                                                  "A communication hook in C++ (comm_hook.h).")
      .def("name", &CommHook::name);
  py::class_<QuorumHook, CommHook, std::shared_ptr<QuorumHook>>(
      m, "QuorumHook", py::release_gil_before_calling_cpp_dtor())
      .def(py::init(&make_quorum_hook), py::arg("on_error"),
           "See Note [Quorum all-reduce] in csrc/quorum_hook.h.")
      .def("begin_step", &QuorumHook::begin_step, py::arg("process_group"),
           py::arg("participants"), py::arg("participating"), RELEASE)
      .def("skip_step", &QuorumHook::skip_step, py::arg("why"), RELEASE)
      .def("refuse_step", &QuorumHook::refuse_step, py::arg("why"), RELEASE)
      .def("step_error", &QuorumHook::step_error, RELEASE)
      .def("holds_group", &QuorumHook::holds_group, RELEASE);
}

// Note [Letting the Reducer go without the GIL]
// The Reducer holds its process group, and may hold the last reference to it (a script that
// called destroy_process_group() before its model went out of scope). The last reference to a
// ProcessGroupGloo joins Gloo's worker threads, and a worker freeing a finished work drops that
// work's tensors, which takes the GIL when a tensor has a Python object: destroying the group
// with the GIL held then waits forever for a thread that waits for the GIL. pybind11 destroys a
// holder with the GIL held unless told otherwise, so the Reducer's class releases it first
// (py::release_gil_before_calling_cpp_dtor), as torch does for its own process-group objects
// (pytorch/pytorch#56297; torch DDP's Reducer, bound without it, hangs that way at exit).
// ~Reducer needs no GIL: the Python hook it may hold takes the GIL itself.

// The Reducer, held by shared_ptr (see Reducer::create), let go without the GIL (see Note
// [Letting the Reducer go without the GIL]). Every method that takes the Reducer's lock does so
// without the GIL: the autograd thread holds that lock while a Python communication hook runs,
// which takes the GIL, so a caller waiting for the lock with the GIL (a thread reading the
// logging data during backward) would deadlock both.
// The methods of deferred completion and sharded buckets (see Note [Deferred completion] and
// Note [Sharded buckets] in csrc/reducer.h).
template <typename Class>
void bind_completion(Class& reducer) {
  const auto RELEASE = py::call_guard<py::gil_scoped_release>();
  reducer
      .def("set_deferred_completion", &set_deferred_completion, py::arg("deferred"),
           py::arg("on_deferred") = py::none(),
           "See Note [Deferred completion] in csrc/reducer.h.")
      .def("complete_bucket", &Reducer::complete_bucket, py::arg("bucket"), RELEASE)
      .def("complete_all", &Reducer::complete_all, RELEASE)
      .def("pending_buckets", &Reducer::pending_buckets, RELEASE)
      .def("used_map_pending", &Reducer::used_map_pending, RELEASE)
      .def("set_sharded", &Reducer::set_sharded, py::arg("sharded"), py::arg("backend"),
           py::arg("ring") = nullptr, RELEASE, "See Note [Sharded buckets] in csrc/reducer.h.")
      .def("shard_buffers", &Reducer::shard_buffers, RELEASE)
      .def("release_bucket_buffer", &Reducer::release_bucket_buffer, py::arg("bucket"), RELEASE)
      .def("acquire_bucket_buffer", &Reducer::acquire_bucket_buffer, py::arg("bucket"), RELEASE)
      .def("globally_unused", &Reducer::globally_unused, RELEASE);
}

// Ring collectives for sharded buckets on Gloo (see Note [Ring collectives on Gloo] in ring.h).
void bind_ring(py::module_& m) {
  const auto RELEASE = py::call_guard<py::gil_scoped_release>();
  py::class_<RingJob, std::shared_ptr<RingJob>>(m, "RingJob")
      .def("wait", &RingJob::wait, RELEASE)
      .def("is_completed", &RingJob::done, RELEASE)
      .def("done_ns", &RingJob::done_ns, RELEASE)
      .def("wait_range", &RingJob::wait_range, py::arg("begin"), py::arg("end"), RELEASE)
      .def("mark_ready", &RingJob::mark_ready, py::arg("begin"), py::arg("end"), RELEASE)
      .def("cancel", &RingJob::cancel, py::arg("why"), RELEASE);
  py::class_<RingCollectives, std::shared_ptr<RingCollectives>>(
      m, "RingCollectives", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](BackendPtr backend, int64_t timeout_ms) {
             return std::make_shared<RingCollectives>(std::move(backend),
                                                      std::chrono::milliseconds(timeout_ms));
           }),
           py::arg("backend"), py::arg("timeout_ms"))
      .def_readonly_static("max_world_size", &RingCollectives::kMaxWorldSize)
      .def("all_gather",
           py::overload_cast<at::Tensor, std::string>(&RingCollectives::all_gather),
           py::arg("flat"), py::arg("what"), RELEASE)
      .def("all_gather_planned",  // See Note [Gathers in read order]
           [](RingCollectives& ring, at::Tensor flat, std::vector<int64_t> begins,
              std::vector<int64_t> ends, std::vector<int64_t> sends,
              std::vector<int64_t> receives, std::string what) {
             return ring.all_gather(std::move(flat),
                                    GatherPlan{std::move(begins), std::move(ends),
                                               std::move(sends), std::move(receives)},
                                    std::move(what));
           },
           py::arg("flat"), py::arg("begins"), py::arg("ends"), py::arg("sends"),
           py::arg("receives"), py::arg("what"), RELEASE)
      .def("reduce_scatter",
           [](RingCollectives& ring, at::Tensor flat, at::Tensor shard, std::string what) {
             return ring.reduce_scatter(std::move(flat), std::move(shard), std::move(what));
           },
           py::arg("flat"), py::arg("shard"), py::arg("what"), RELEASE);
}

void bind_reducer(py::module_& m) {
  const auto RELEASE = py::call_guard<py::gil_scoped_release>();
  py::class_<Reducer, std::shared_ptr<Reducer>> reducer(m, "Reducer",
                                                        py::release_gil_before_calling_cpp_dtor());
  bind_completion(reducer);
  reducer
      .def(py::init(&Reducer::create), py::arg("params"), py::arg("param_names"),
           py::arg("initial_plan"), py::arg("process_group"), py::arg("options"))
      .def("register_comm_hook",
           [](Reducer& reducer, py::object state, py::object hook) {
             auto held = std::make_shared<PythonCommHook>(std::move(state), std::move(hook));
             py::gil_scoped_release no_gil;
             reducer.register_comm_hook(std::move(held));
           })
      .def("register_cpp_hook",
           [](Reducer& reducer, std::shared_ptr<CommHook> hook) {
             reducer.register_comm_hook(std::move(hook));
           },
           py::arg("hook"), RELEASE)
      .def("register_builtin_hook",
           [](Reducer& reducer, ProcessGroupPtr group, const std::string& name) {
             reducer.register_comm_hook(builtin_hook(std::move(group), name));
           },
           RELEASE)
      .def("register_averaging_hook", &register_averaging_hook,
           py::arg("process_group"), py::arg("reduce_dtype"), py::arg("pre_multiplier"),
           py::arg("post"), py::arg("post_value"), py::arg("name"),
           "See AveragingHook in csrc/comm_hook.h.")
      .def("set_sparse_backend", &Reducer::set_sparse_backend, py::arg("backend"), RELEASE,
           "See Note [Sparse gradients beside Gloo's race] in csrc/reducer.h.")
      .def("set_static_graph", &Reducer::set_static_graph, py::arg("rebuild"), RELEASE)
      .def("set_failure_context", &set_failure_context, py::arg("context"),
           "See Reducer::set_failure_context in csrc/reducer.h.")
      .def("set_launch_order", &Reducer::set_launch_order, py::arg("order"),
           py::arg("chunks") = std::vector<int64_t>{}, RELEASE)
      .def("launch_order", &Reducer::launch_order, RELEASE)
      .def("launch_chunks", &Reducer::launch_chunks, RELEASE)
      .def("has_comm_hook", &Reducer::has_comm_hook, RELEASE)
      .def("plan_version", &Reducer::plan_version, RELEASE)
      .def("rebuild_pending", &Reducer::rebuild_pending, RELEASE)
      .def("divide_next_backward_by", &Reducer::divide_next_backward_by, py::arg("ranks"),
           RELEASE)
      .def_property_readonly("num_iterations",
                             py::cpp_function(&Reducer::num_iterations, RELEASE))
      .def_property_readonly("num_backwards",
                             py::cpp_function(&Reducer::num_backwards, RELEASE))
      .def("backward_stats", &backward_stats)
      .def("last_error", &Reducer::last_error, RELEASE)
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::arg("outputs"), RELEASE)
      .def("note_unsynced_forward", &Reducer::note_unsynced_forward, RELEASE)
      .def("shadow_backward", &Reducer::shadow_backward, RELEASE)
      .def("apply_plan", &Reducer::apply_plan, py::arg("plan"), RELEASE)
      .def("rebuild_buckets", &Reducer::rebuild_buckets, RELEASE)
      .def("bucket_layout", &bucket_layout)
      .def("bucket_buffers", &Reducer::bucket_buffers, RELEASE)
      .def("timeline", &timeline_records, py::arg("last"))
      .def_static("now_ns", &Timeline::now_ns)
      .def_property_readonly("armed", py::cpp_function(&Reducer::armed, RELEASE))
      .def_property_readonly("world_size", &Reducer::world_size);
}

}  // namespace
}  // namespace pyreducer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyreducer C++ core: bucket planner and gradient Reducer";
  pyreducer::bind_planner(m);
  pyreducer::bind_options(m);
  pyreducer::bind_grad_bucket(m);
  pyreducer::bind_ring(m);
  pyreducer::bind_quorum_hook(m);
  pyreducer::bind_reducer(m);
}
