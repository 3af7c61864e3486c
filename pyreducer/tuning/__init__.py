"""Bucket tuning: a cost model of the step (link + step models), an exact bucket planner, and
online autotune. The simulator for more hosts than you have is a tool:
pyreducer/tools/simulate.py. See the README."""
from pyreducer.tuning.autotune import AutotuneConfig
from pyreducer.tuning.linkmodel import LinkModel, fit_link_model, probe_contention, probe_link
from pyreducer.tuning.planner import best_plan, brute_force_plan
from pyreducer.tuning.stepmodel import Profile, predict_step_ms

__all__ = ["AutotuneConfig", "LinkModel", "fit_link_model", "probe_link", "probe_contention",
           "Profile", "predict_step_ms", "best_plan", "brute_force_plan"]
