"""Small pieces every benchmark shares: Markdown tables, medians, JSON files and grouped bar plots."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    """Numbers right-aligned, text left-aligned, None as a dash."""
    cells = [[str(h) for h in headers]] + [[fmt(v, digits) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    for values, row in zip(rows, cells[1:]):
        lines.append("| " + " | ".join(c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)
                                       for v, c, w in zip(values, row, widths)) + " |")
    return "\n".join(lines)


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], p: float) -> float | None:
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def bar_plot(groups: dict[str, dict[str, float | None]], path: Path, title: str,
             units: dict[str, str] | None = None) -> Path:
    """One panel per metric (units differ), one bar per series in each: groups[metric][series] = value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m, values in groups.items() if any(v is not None for v in values.values())]
    cols = min(4, max(1, len(metrics)))
    rows = -(-len(metrics) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    colors = {s: f"C{i}" for i, s in enumerate(series)}
    for ax, metric in zip(axes.flat, metrics):
        names = [s for s, v in groups[metric].items() if v is not None]
        values = [groups[metric][s] for s in names]
        bars = ax.bar(range(len(names)), values, color=[colors[s] for s in names])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=9)
        if units and metric in units:
            ax.set_ylabel(units[metric], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
