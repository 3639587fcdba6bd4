"""The pictures of `--plot FILE.png`, drawn with matplotlib: hit rate against pool size (`bench policy`)
and TTFT per turn (`bench multiturn`, `bench cluster`). `plot_path` checks where a picture will go before
a benchmark runs, so a bad path costs no benchmark."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def plot_path(path: str | None) -> str | None:
    """`path` if a PNG can be written there; a ValueError naming `plot` otherwise."""
    if path is None:
        return None
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise ValueError(f"plot: {path!r} must name a .png file")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"plot: cannot write into {str(folder)!r}")
    if p.exists() or p.is_symlink():  # (overwritten at the end: it must be a file this user may write)
        if not p.is_file():
            raise ValueError(f"plot: {path!r} exists and is not a file")
        if not os.access(p, os.W_OK):
            raise ValueError(f"plot: cannot overwrite {path!r}")
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hit_rate_vs_pool(results: list[dict], path: str) -> None:
    """One panel per trace: hit rate against pool size, a line per policy, Belady dashed on top."""
    plt = _pyplot()
    traces = list(dict.fromkeys(r["trace"] for r in results))
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, t in zip(axes[0], traces, strict=True):
        rs = [r for r in results if r["trace"] == t]
        for pol in dict.fromkeys(r["policy"] for r in rs):
            pts = sorted((r["num_blocks"], r["hit_rate"]) for r in rs if r["policy"] == pol)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol)
        opt = sorted({(r["num_blocks"], r["belady_hit_rate"]) for r in rs if r["belady_hit_rate"] is not None})
        if opt:
            ax.plot([x for x, _ in opt], [y for _, y in opt], "k--", marker="x", label="Belady (offline optimum)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pool size (blocks)")
        ax.set_ylabel("prefix-cache hit rate (tokens)")
        ax.set_title(f"{t} (concurrency {rs[0]['concurrency']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ttft_per_turn(path: str, systems: dict[str, dict[str, Any]], title: str = "TTFT per turn") -> None:
    """Mean TTFT of each turn of the conversations, one line per system (`ttft_mean_ms_by_turn`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    turns: set[int] = set()
    for name, s in systems.items():
        by_turn = s.get("ttft_mean_ms_by_turn") or {}
        pts = sorted((int(t) + 1, v) for t, v in by_turn.items())  # (JSON keys are strings)
        turns.update(t for t, _ in pts)
        if pts:
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=name)
    ax.set_xticks(sorted(turns))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
