"""PNG plots (matplotlib, headless) and a self-contained HTML page that embeds them."""

from __future__ import annotations

import base64
import html
from datetime import datetime
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.report.runs import Run, plottable

WIDTH, HEIGHT, DPI = 800, 450, 100

# file stem -> (title, y label, [(series kind, metric key, label suffix)], scale)
PLOTS: dict[str, tuple[str, str, list[tuple[str, str, str]], float]] = {
    "loss": ("Loss", "cross-entropy", [("train", "loss", "train"), ("val", "val_loss", "validation")], 1.0),
    "lr": ("Learning rate", "lr", [("train", "lr", "")], 1.0),
    "throughput": ("Throughput", "tokens/s", [("train", "tokens_per_s", "")], 1.0),
    "mfu": ("Model FLOPs utilisation", "MFU (%)", [("train", "mfu", "")], 100.0),
    "memory": ("Peak memory", "GiB", [("train", "peak_memory_gib", "")], 1.0),
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("report: needs matplotlib (pip install 'fsdpkit[report]')") from None
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[Run], stem: str, out: Path) -> Path | None:
    """One PNG of WIDTH x HEIGHT pixels with every run overlaid; None when no run has the metric.
    Restarts are dotted vertical lines in the run's colour."""
    plt = _pyplot()
    title, ylabel, series, scale = PLOTS[stem]
    fig, ax = plt.subplots(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    drawn = False
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for kind, key, suffix in series:
            rows = [r for r in (run.train if kind == "train" else run.val) if plottable(r, key)]
            if not rows:
                continue
            style = "-" if kind == "train" else "--"
            label = f"{run.name} {suffix}".strip()
            ax.plot([r["step"] for r in rows], [r[key] * scale for r in rows], style, color=color, label=label,
                    marker="o" if len(rows) < 3 else None)
            drawn = True
        for step in run.restarts:
            ax.axvline(step, color=color, linestyle=":", linewidth=1)
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=DPI)  # no bbox_inches: the image keeps its stated size
    plt.close(fig)
    return path


def plot_cluster(cluster: dict[str, Any], runs: list[Run], out: Path) -> Path | None:
    """Each node's GPU utilisation from Prometheus (`fsdpkit metrics --out`) over wall-clock time,
    and on a second axis the runs' tokens/s at the same times: a dip that is the cluster's (one node)
    and one that is the trainer's (data, checkpoints) look different side by side."""
    nodes = [n for n in cluster.get("nodes") or [] if n.get("series", {}).get("gpu_util_pct")]
    if not nodes:
        return None
    plt = _pyplot()
    t0 = min(t for n in nodes for t, _ in n["series"]["gpu_util_pct"])
    fig, ax = plt.subplots(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    for n in nodes:
        points = n["series"]["gpu_util_pct"]
        ax.plot([(t - t0) / 60 for t, _ in points], [v for _, v in points], label=f"{n['node']} ({n['pod']})")
    ax.set_ylim(0, 105)
    ax.set_xlabel(f"minutes since {datetime.fromtimestamp(t0):%Y-%m-%d %H:%M}")
    ax.set_ylabel("GPU utilisation (%)")
    ax.set_title(f"GPU utilisation by node: {cluster.get('job', '')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    trainer = [(run, [r for r in run.train if "time" in r and plottable(r, "tokens_per_s")]) for run in runs]
    if any(rows for _, rows in trainer):
        right = ax.twinx()
        for run, rows in trainer:
            right.plot([(r["time"] - t0) / 60 for r in rows], [r["tokens_per_s"] for r in rows], "k--",
                       linewidth=1, label=f"{run.name} tokens/s")
        right.set_ylabel("tokens/s (trainer)")
        right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out / "cluster_gpu.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _fmt(v: object, spec: str = ".4f") -> str:
    if v is None:
        return "–"
    return format(v, spec) if isinstance(v, float) else str(v)


def _title(stem: str) -> str:
    return PLOTS[stem][0] if stem in PLOTS else "GPU utilisation by node (Prometheus)"


def write_report(runs: list[Run], out: Path, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write OUT/<plot>.png and OUT/report.html; returns what was written and each run's summary.
    With `cluster` (what `fsdpkit metrics --out` wrote), also each node's GPU utilisation."""
    out.mkdir(parents=True, exist_ok=True)
    plots = {stem: p for stem in PLOTS if (p := plot(runs, stem, out)) is not None}
    if cluster is not None and (p := plot_cluster(cluster, runs, out)) is not None:
        plots["cluster_gpu"] = p
    summaries = [r.summary() for r in runs]
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in (
            s["name"], "finished" if s["finished"] else "running or stopped", str(s["steps"]), _fmt(s["first_loss"]),
            _fmt(s["final_loss"]), _fmt(s["final_val_loss"]), _fmt(s["median_tokens_per_s"], ",.0f"),
            _fmt(s["median_mfu"] * 100 if s["median_mfu"] is not None else None, ".1f"),
            _fmt(s["peak_memory_gib"], ".2f"), str(s["restarts"]))) + "</tr>"
        for s in summaries)
    scores = "".join(
        f"<tr><td>{html.escape(s['name'])}</td><td>{html.escape(task)}</td><td>{html.escape(metric)}</td>"
        f"<td>{_fmt(value)}</td></tr>"
        for s in summaries for task, metrics in s["eval"].items() for metric, value in metrics.items())
    if scores:
        scores = ("<h2>Evaluation (fsdpkit eval)</h2><table><tr><th>run</th><th>task</th><th>metric</th><th>score</th>"
                  f"</tr>{scores}</table>")
    figures = "".join(
        f'<figure><a href="{p.name}"><img alt="{html.escape(_title(stem))}" width="{WIDTH}" height="{HEIGHT}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></a>'
        f"<figcaption>{html.escape(_title(stem))} (<a href=\"{p.name}\">{p.name}</a>)</figcaption></figure>"
        for stem, p in plots.items())
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fsdpkit report</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:60em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:right}}td:first-child{{text-align:left}}
figure{{margin:1.5em 0}}</style></head><body>
<h1>fsdpkit report</h1>
<p>{len(runs)} run(s), written {datetime.now():%Y-%m-%d %H:%M:%S}. Dotted lines mark restarts.</p>
<table><tr><th>run</th><th>state</th><th>steps</th><th>first loss</th><th>final loss</th><th>final val loss</th>
<th>tokens/s (median)</th><th>MFU % (median)</th><th>peak GiB</th><th>restarts</th></tr>{rows}</table>
{scores}
{figures}
</body></html>
"""
    report = out / "report.html"
    report.write_text(page)
    return {"html": str(report), "plots": {stem: str(p) for stem, p in plots.items()}, "runs": summaries}
