"""Pictures of results: recall-at-K curves (matplotlib, drawn off-screen)."""

from __future__ import annotations

from pathlib import Path

import torch


def recall_curve(ranks: torch.Tensor, max_k: int) -> list[float]:
    """R@K for K = 1..max_k from 1-based ranks."""
    ranks = ranks.double()
    return [float((ranks <= k).double().mean()) for k in range(1, max_k + 1)]


def plot_recall_curves(ranks: dict[str, torch.Tensor], path: str | Path, title: str = "", max_k: int = 50) -> Path:
    """One line per entry of ``ranks`` (label -> 1-based ranks); writes a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ks = list(range(1, max_k + 1))
    for label, r in ranks.items():
        ax.plot(ks, recall_curve(r, max_k), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("K")
    ax.set_ylabel("recall@K")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write (making folders) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
