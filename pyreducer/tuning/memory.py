"""Remembered tuning decisions: a run that starts like an earlier one starts from its decisions.

When bucket autotune decides, rank 0 writes the chosen bucket plan and its measured step time to
a small JSON file; when an overlapped optimizer's schedule tuner decides for that plan, the
schedule (launch order, chunks, barrier) and its measured step join it. A later run looks the
entry up after its link probe and, on a match, applies the plan (and then installs the
schedule) and times one window of each instead of the whole search; the decision stands if the
window is within RECALL_TOLERANCE of the remembered time, and the full search runs otherwise.

The key: the parameters (names, shapes, dtypes, devices' types, in registration order; a hash),
the world size, the backend and whether sparse gradients or a communication hook are in
play. An entry matches a key when its link was measured alike: bandwidth within a factor
BANDWIDTH_FACTOR of the probed one, latency within a factor LATENCY_FACTOR. The factors are wide
because the probe is small (autotune runs it in pieces beside training: Note [Probe in pieces]):
on the emulated 1 Gbit/s link, ten runs probed 0.91-1.70 Gbit/s (tc's token bucket lets a burst
through after compute left the link idle) and 0.56-2.4 ms; they still tell 1 from 10 Gbit/s,
and a wrong match costs one window (the recall is timed, then dropped). An entry is ignored, and the search runs, when: the file is missing,
unreadable or of another format version (a warning for the last two); no entry has the key or
a link that close; the plan does not fit the model's parameters; the confirming window is too
slow. Each new decision replaces the entry of its key.

Where: `AutotuneConfig(cache=...)`: True (default) for $PYREDUCER_TUNING_CACHE if set, else
$XDG_CACHE_HOME/pyreducer/tuning.json (~/.cache/... without it); a path for that file; False
for no cache (nor does PYREDUCER_TUNING_CACHE=off read or write one). Only rank 0 reads and
writes it; its decision is broadcast, so the ranks' files may differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings

FORMAT = "pyreducer.tuning_cache"
VERSION = 1
BANDWIDTH_FACTOR = 2.0
LATENCY_FACTOR = 4.0
RECALL_TOLERANCE = 0.10  # a recalled decision's window may be this much slower than remembered
MAX_ENTRIES = 256  # the oldest go first


def cache_path(setting) -> str | None:
    """The cache file of AutotuneConfig.cache (see the module docstring), or None: off."""
    if setting is False or setting is None:
        return None
    if isinstance(setting, (str, os.PathLike)):
        return os.fspath(setting)
    env = os.environ.get("PYREDUCER_TUNING_CACHE")
    if env:
        return None if env.lower() in ("off", "0", "false", "none") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyreducer", "tuning.json")


def model_key(params, backend: str, extra: str = "") -> str:
    """The cache key of a wrapper's parameters (pyreducer.wrapper.params.ReducedParams), world size
    and backend; `extra` distinguishes set-ups whose decisions differ (e.g. a comm hook)."""
    digest = hashlib.sha256()
    for name, tensor, key in zip(params.names, params.tensors, params.group_keys):
        digest.update(f"{name}:{tuple(tensor.shape)}:{key}\n".encode())
    return f"{digest.hexdigest()[:32]}/ranks{params.world_size}/{backend}{extra}"


def link_matches(remembered: dict, link) -> bool:
    """Whether a remembered link (latency_s, bandwidth_bytes_per_s) is `link`, measured again."""
    bandwidth = remembered.get("bandwidth_bytes_per_s", 0.0)
    latency = remembered.get("latency_s", 0.0)
    if bandwidth <= 0 or latency <= 0:
        return False
    bandwidth_ratio = link.bandwidth_bytes_per_s / bandwidth
    latency_ratio = link.latency_s / latency
    return 1 / BANDWIDTH_FACTOR <= bandwidth_ratio <= BANDWIDTH_FACTOR and \
        1 / LATENCY_FACTOR <= latency_ratio <= LATENCY_FACTOR


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            document = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"pyreducer: tuning cache {path} unreadable ({error}); tuning from scratch",
                      RuntimeWarning, stacklevel=3)
        return {}
    if not isinstance(document, dict) or document.get("format") != FORMAT or \
            document.get("version") != VERSION:
        warnings.warn(f"pyreducer: tuning cache {path} is not a {FORMAT} file of version "
                      f"{VERSION}; tuning from scratch (the next decision rewrites it)",
                      RuntimeWarning, stacklevel=3)
        return {}
    return document.get("entries", {})


def recall(path: str | None, key: str, link, num_params: int) -> tuple[dict | None, str]:
    """(the remembered entry for `key` on `link`, "") or (None, why not): see the module
    docstring."""
    if path is None:
        return None, "no cache (off)"
    entry = _read(path).get(key)
    if not isinstance(entry, dict):
        return None, f"no entry for this model, world size and backend in {path}"
    seen = entry.get("link", {})
    if not link_matches(seen, link):
        return None, (f"link differs: probed {link.bandwidth_bytes_per_s * 8e-9:.2f} Gbit/s, "
                      f"{link.latency_s * 1e6:.0f} us; remembered "
                      f"{seen.get('bandwidth_bytes_per_s', 0) * 8e-9:.2f} Gbit/s, "
                      f"{seen.get('latency_s', 0) * 1e6:.0f} us")
    plan = entry.get("plan")
    flat = sorted(i for bucket in plan or [] for i in bucket) if isinstance(plan, list) else None
    if flat != list(range(num_params)):
        return None, "the remembered plan is not one of this model's parameters"
    return entry, ""


def remember(path: str | None, key: str, for_plan=None, **fields) -> None:
    """Writes (or updates) the entry of `key`: fields replace the entry's own. A new `plan`
    replaces the whole entry (a schedule belongs to its plan); fields for an existing entry
    (a schedule) are written only if its plan is `for_plan`. Failures warn, never raise."""
    if path is None:
        return
    try:
        entries = _read(path)
        entry = {} if "plan" in fields else dict(entries.get(key, {}))
        if "plan" not in fields and entry.get("plan") != for_plan:
            return  # a schedule without its plan's entry: nothing to attach it to
        entry.update(fields)
        entries.pop(key, None)
        entries[key] = entry  # last: the newest
        while len(entries) > MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tuning-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(dict(format=FORMAT, version=VERSION, entries=entries), f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new
    except OSError as error:
        warnings.warn(f"pyreducer: could not write the tuning cache {path}: {error}",
                      RuntimeWarning, stacklevel=3)
