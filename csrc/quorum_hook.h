// The communication hook of pyreducer.torchft: every bucket all-reduced among the replicas of
// this step's quorum.
//
// Note [Quorum all-reduce]
// Under torchft (pyreducer/torchft.py) the replica groups that reduce together change from step
// to step: each step's quorum (torchft's Manager, agreed through its Lighthouse) names the
// participants, and the Manager builds a new Gloo process group among them whenever the quorum
// changes. So the group a bucket is all-reduced on is the step's, not the wrapper's: the
// wrapper hands it over once per step, after the forward (begin_step), and every bucket of the
// coming backward is all-reduced on it from C++ as it fills, without Python. The arithmetic is
// torchft's Manager.allreduce, so that the result is torchft's own DDP's bit for bit: gradients
// copied in unscaled, SUM, then divided by the number of participants; a replica that is in the
// quorum but not participating (healing: it loads a peer's state in should_commit, after this
// backward) contributes zeros. A failed all-reduce (a peer died, froze or left) is not an error
// of backward: it is recorded, reported once to the Manager through the error sink (which makes
// its should_commit() say no, so the optimizer does not step on this step's gradients), the
// bucket completes as it is, and the buckets after it are not launched. A step the Manager has
// already errored (skip_step) reduces nothing, as torchft's allreduce returns its input then.
// A survivor may still wait in an all-reduce that another survivor gave up at its own failure
// (Gloo's ring: that replica sends no further chunks of it), until that replica's next quorum
// rebuilds its group (the old group's connections close: this hook lets go of each step's
// group when its backward ends, so only the Manager holds it then) or the Gloo timeout ends the
// wait: 2.1-2.2 s on emulated hosts with the Lighthouse's 2 s heartbeat timeout
// (benchmarks/results/torchft_failure_20261207.md). Launching the later buckets anyway did not
// shorten it (measured), and torch 2.13's Gloo backend cannot be aborted.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm.h"
#include "comm_hook.h"

namespace pyreducer {

class QuorumHook : public CommHook {
 public:
  // `on_error(message)` is called once per step, for its first failure, from the thread that
  // saw it (a communication thread or the autograd thread), without any lock of this hook.
  using ErrorSink = std::function<void(const std::string&)>;

  explicit QuorumHook(ErrorSink on_error);

  // The quorum of the coming backward (see Note [Quorum all-reduce]): its process group, the
  // number of participants (the divisor; >= 1), and whether this replica contributes its
  // gradients (false: zeros). std::invalid_argument if `group` is null or participants < 1.
  // Python thread, between backwards.
  void begin_step(ProcessGroupPtr group, int64_t participants, bool participating);

  // The coming backward reduces nothing: every bucket completes as it is. `why` is what
  // step_error() then says. Python thread, between backwards.
  void skip_step(const std::string& why);

  // No quorum stands for the coming backward (none was started, or the last one was used by a
  // backward that should_commit() has judged): a forward may end without its backward (an
  // evaluation with grad on), but a bucket that reaches its all-reduce throws
  // std::runtime_error(why) from the backward, on this replica, before any collective. Python
  // thread, between backwards.
  void refuse_step(const std::string& why);

  // See CommHook::backward_ended: the step's process group is let go, so that a dead quorum's
  // connections close when the Manager replaces its group, not at the next step's begin_step
  // (a survivor blocked in an all-reduce that another gave up waits for them).
  void backward_ended() override;

  // The first failure of the last step begun ("" if none), and whether it reduced nothing.
  std::string step_error() const;

  // Whether it holds a step's process group (between begin_step and the end of that step's
  // backward). Any thread.
  bool holds_group() const;

  FuturePtr run(GradBucketView& bucket) override;
  std::string name() const override { return "torchft quorum all-reduce"; }

 private:
  // One step's quorum; the continuations of its buckets hold it.
  struct Step {
    ProcessGroupPtr group;  // null: skipped (or, once its backward ended, let go)
    int64_t participants = 0;
    bool participating = false;
    std::string refused;  // non-empty: refuse_step's message
    std::mutex mutex;
    std::string error;  // the first failure, or why the step was skipped
    // Records `message` as the step's failure; true if it is the first.
    bool fail(const std::string& message);
    bool failed();
  };

  ErrorSink on_error_;
  mutable std::mutex mutex_;
  std::shared_ptr<Step> step_;
};

}  // namespace pyreducer
