"""summary.md and the plots of benchmarks/bench_frameworks.py, from its results.json:

    python benchmarks/frameworks_report.py run/frameworks/results.json   # summary.md, PNGs again

Per framework and variant (aggregate()): the step time is each rank's median over its timed
steps, every repeat's pooled, and the slowest rank's is reported (with that rank's quartiles);
its ratio to stock divides medians measured in the same benchmark run, and "per repeat" divides
each repeat's by stock's of the same repeat. Memory per rank: optimizer state (the first run's:
it does not change between repeats), peak-RSS rise (median over repeats).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))

from pyreducer.tools.compare import summarize  # noqa: E402

NAMES = {"hf": "Hugging Face Trainer", "lightning": "Lightning"}
DESCRIBE = {"stock": "the framework's torch DDP",
            "overlap": "pyreducer, overlapped optimizer",
            "shard": "pyreducer, sharded optimizer",
            "shard_4mb": "pyreducer, sharded optimizer, bucket_cap_mb=4"}


def slowest_rank(runs: list[dict]) -> tuple[dict, list[float]]:
    """(summary, per-repeat medians) of the rank with the highest median step over `runs`
    (each rank's intervals pooled over them); per repeat: that repeat's slowest rank."""
    ranks = len(runs[0]["ranks"])
    pooled = [[s for run in runs for s in run["ranks"][r]["intervals_s"]] for r in range(ranks)]
    step = max((summarize(p) for p in pooled if p), key=lambda s: s["median_ms"], default=None)
    per_repeat = [max(statistics.median(rank["intervals_s"]) * 1e3 for rank in run["ranks"])
                  for run in runs if all(rank["intervals_s"] for rank in run["ranks"])]
    return step, per_repeat


def aggregate_variant(runs: list[dict]) -> dict:
    """One framework's variant over its successful runs (in repeat order)."""
    step, per_repeat = slowest_rank(runs)
    first = runs[0]["ranks"]
    rss = [statistics.median(run["ranks"][r]["peak_rss_rise_bytes"] for run in runs)
           for r in range(len(first))]
    diffs = [run.get("max_param_diff") for run in runs]
    return dict(step=step, per_repeat_ms=per_repeat, repeats=len(runs),
                optimizer_state_bytes=[r["optimizer_state_bytes"] for r in first],
                memory_bytes=first[0]["memory_bytes"], peak_rss_rise_bytes=rss,
                final_loss=first[0]["losses"][-1] if first[0]["losses"] else None,
                losses_equal=all(run.get("losses_equal") for run in runs),
                max_loss_diff=max((run.get("max_loss_diff") or 0.0 for run in runs)),
                max_param_diff=None if None in diffs else max(diffs),
                decided_at=[run["ranks"][0]["decided_at"] for run in runs],
                warmup=first[0]["total_steps"] - first[0]["timed_steps"],
                schedule=[run["ranks"][0]["schedule"] for run in runs],
                wrapper=first[0]["wrapper"], optimizer=first[0]["optimizer"],
                inner_optimizer=first[0]["inner_optimizer"], fused=first[0]["fused"],
                run_seconds=[run["seconds"] for run in runs])


def aggregate(doc: dict) -> dict:
    """{framework: {variant: figures}}, and each variant's ratio to the reference's (stock's:
    doc["reference"])."""
    reference, table = doc["reference"], {}
    for run in doc["runs"]:
        table.setdefault(run["framework"], {}).setdefault(run["variant"], [])
    for framework, variants in table.items():
        for variant in list(variants):
            runs = [r for r in doc["runs"] if r["framework"] == framework
                    and r["variant"] == variant]
            ok = sorted((r for r in runs if "ranks" in r), key=lambda r: r["repeat"])
            variants[variant] = dict(aggregate_variant(ok) if ok else {},
                                     errors=[r["error"] for r in runs if "error" in r])
        stock = variants.get(reference, {})
        for figures in variants.values():
            if figures.get("step") and stock.get("step"):
                figures["ratio"] = figures["step"]["median_ms"] / stock["step"]["median_ms"]
                figures["per_repeat_ratio"] = [a / b for a, b in zip(
                    figures["per_repeat_ms"], stock["per_repeat_ms"])]
    return table


def mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


HEADER = ("| variant | step ms (median, slowest rank) | IQR | / stock | / stock per repeat | "
          "optimizer state MiB per rank | peak RSS rise MiB per rank | final loss | "
          "losses = stock's | max abs param diff vs stock |\n|" + "---|" * 10)


def table_row(variant: str, f: dict) -> str:
    step = f.get("step")
    if not step:
        return f"| {variant} | failed: see below |" + " - |" * 8
    cells = [variant, f"{step['median_ms']:.1f}", f"{step['p25_ms']:.1f}-{step['p75_ms']:.1f}",
             f"{f['ratio']:.3f}" if "ratio" in f else "-",
             ", ".join(f"{r:.3f}" for r in f.get("per_repeat_ratio", [])) or "-",
             " / ".join(mib(b) for b in f["optimizer_state_bytes"]),
             " / ".join(mib(b) for b in f["peak_rss_rise_bytes"]),
             "-" if f["final_loss"] is None else f"{f['final_loss']:.4f}",
             "yes" if f["losses_equal"] else f"no (max diff {f['max_loss_diff']:.2g})",
             "-" if f["max_param_diff"] is None else f"{f['max_param_diff']:.2g}"]
    return "| " + " | ".join(cells) + " |"


def notes(variant: str, f: dict) -> list[str]:
    """What a table row cannot say: the classes it ran with, the overlap's schedule, errors."""
    lines = []
    if f.get("step"):
        fused = ", fused" if f["fused"] else ""
        lines.append(f"- {variant} ({DESCRIBE[variant]}): wrapper `{f['wrapper']}`, optimizer "
                     f"{f['optimizer']} ({f['inner_optimizer']}{fused}); runs of "
                     + ", ".join(f"{s:.0f}" for s in f["run_seconds"]) + " s (start-up "
                     "included)")
        if any(d is None or d > f["warmup"] for d in f["decided_at"]):
            lines.append(f"  - WARNING: the schedule tuner had decided at step(s) "
                         f"{f['decided_at']} (None: not by the run's end), not within the "
                         f"{f['warmup']} warm-up steps: the timed steps include its trials")
        chosen = [s["describe"] for s in f["schedule"] if s]
        if chosen:
            lines.append(f"  - schedule chosen (decided at step {f['decided_at']}): "
                         + "; ".join(f"`{c}`" for c in chosen))
        if variant.startswith("shard") and f["fused"]:
            lines.append("  - torch's fused AdamW (the Trainer's default optim): the sharded "
                         "optimizer matches its CPU kernel within 1e-6, not bit for bit "
                         "(docs/pages/guides/sharded-optimizer.md)")
        if f["memory_bytes"]:
            lines.append("  - memory_bytes() (rank 0, MiB): " + ", ".join(
                f"{k} {mib(v)}" for k, v in f["memory_bytes"].items()))
    lines += [f"- {variant}: FAILED: `{error[-600:]}`" for error in f.get("errors", [])]
    return lines


def model_line(model: dict) -> str:
    c = model["config"]
    return (f"GPT-2 from `GPT2Config(n_layer={c['n_layer']}, n_embd={c['n_embd']}, "
            f"n_head={c['n_head']}, vocab_size={c['vocab_size']}, "
            f"n_positions={c['n_positions']})` (model \"{model['name']}\"): "
            f"{model['parameters'] / 1e6:.2f} M parameters, {model['param_mib']:.1f} MiB of "
            f"fp32 gradients per step; {model['batch_per_rank']} sequences of "
            f"{model['sequence']} tokens per rank and step. Why this size: {model['why']}")


def summary_md(doc: dict) -> str:
    env, table = doc["environment"], aggregate(doc)
    s = env["settings"]
    lines = ["# The HF Trainer and Lightning on emulated hosts: stock DDP, pyreducer overlapped, "
             "pyreducer sharded", "", f"`{env['command']}`", "",
             f"torch {env['torch']}, transformers {env['transformers']}, lightning "
             f"{env['lightning']}, Python {env['python']}, {env['cores']} cores ({env['cpu']}), "
             f"Gloo, one thread per rank; {env['hosts']} hosts, link {env['link']} per host "
             f"({env['emulation']}); {env['date']}; {doc.get('seconds', 0) / 60:.1f} min.", "",
             model_line(doc["model"]), "",
             f"Each run: {s['warmup']} warm-up + {s['steps']} timed optimizer steps, its own "
             f"launch; {s['repeats']} repeat(s), round-robin; AdamW, linear warm-up, "
             + (f"clipping by norm at {s['clip']:g}" if s.get("clip", 1.0) else "no clipping")
             + ". Step time: the interval between "
             "consecutive step ends (HF: on_step_end; Lightning: on_train_batch_end), each "
             "rank's median over the timed steps of all repeats; the slowest rank's is shown "
             "with its quartiles. Optimizer state: this rank's state tensors (sharded: its "
             "memory_bytes()), rank 0 / rank 1. Peak RSS rise: ru_maxrss at the end minus "
             "just before the model was built. Losses and parameters: against the stock run "
             "of the same repeat, after the same number of steps.", ""]
    for framework, variants in table.items():
        lines += [f"## {NAMES[framework]}", "", HEADER]
        lines += [table_row(v, f) for v, f in variants.items()]
        lines.append("")
        for v, f in variants.items():
            lines += notes(v, f)
        lines.append("")
    return "\n".join(lines)


def panels(doc: dict, count: int, height: float):
    """A figure with `count` panels side by side, and the aggregated table."""
    from pyreducer.observe.plot import new_figure

    fig = new_figure(5.5 * count, height)
    return fig, fig.subplots(1, count, squeeze=False)[0], aggregate(doc)


def plot_step_times(doc: dict, path: str) -> str:
    """Median step time (slowest rank) per variant, a panel per framework; the IQR as the error
    bar, the ratio to stock above each bar."""
    from pyreducer.observe.plot import save

    frameworks = list(dict.fromkeys(r["framework"] for r in doc["runs"]))
    fig, axes, table = panels(doc, len(frameworks), 4.2)
    for ax, framework in zip(axes, frameworks):
        for i, (variant, f) in enumerate(table[framework].items()):
            step = f.get("step")
            if not step:
                ax.text(i, 0.02, "failed", ha="center", transform=ax.get_xaxis_transform())
                continue
            ax.bar(i, step["median_ms"], 0.6, color=f"C{i}",
                   yerr=[[step["median_ms"] - step["p25_ms"]],
                         [step["p75_ms"] - step["median_ms"]]], capsize=3)
            if "ratio" in f:
                ax.text(i, step["p75_ms"], f"{f['ratio']:.3f}", ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(table[framework])), list(table[framework]))
        ax.set_ylabel("median step ms (slowest rank)")
        ax.set_title(f"{NAMES[framework]}: step time (label: / stock)")
    return save(fig, path)


def plot_memory(doc: dict, path: str) -> str:
    """Per rank, optimizer state and peak-RSS rise (MiB): a bar per framework and variant
    (the largest rank), a dot per rank."""
    from pyreducer.observe.plot import save

    fig, axes, table = panels(doc, 2, 4.2)
    keys = (("optimizer_state_bytes", "optimizer state per rank (MiB)"),
            ("peak_rss_rise_bytes", "peak RSS rise per rank (MiB)"))
    frameworks = list(table)
    variants = list(dict.fromkeys(v for f in table.values() for v in f))
    width = 0.8 / max(1, len(variants))
    for ax, (key, title) in zip(axes, keys):
        for i, variant in enumerate(variants):
            for j, framework in enumerate(frameworks):
                values = [b / 2**20 for b in table[framework].get(variant, {}).get(key, [])]
                if not values:
                    continue
                x = j + (i - (len(variants) - 1) / 2) * width
                ax.bar(x, max(values), width, color=f"C{i}", label=variant if j == 0 else None)
                ax.plot([x] * len(values), values, "o", color="black", markersize=3)
                ax.text(x, max(values), f"{max(values):.1f}", ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(frameworks)), [NAMES[f] for f in frameworks])
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return save(fig, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    out = os.path.dirname(os.path.abspath(argv[0]))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_md(doc) + "\n")
    for name, draw in (("step_time.png", plot_step_times), ("memory.png", plot_memory)):
        print("wrote", draw(doc, os.path.join(out, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
