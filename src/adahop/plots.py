"""Loss plots (matplotlib, headless Agg backend): one run's curves, and the comparison figures
(all recipes' loss curves; loss difference to BF16, like Figure 1 of the AdaHOP paper)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_run", "plot_compare"]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(records: list[dict], path: Path, *, title: str) -> None:
    """Training and validation loss against step."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, style in (("loss", "-"), ("val_loss", "o-")):
        s, v = _series(records, key)
        if s:
            ax.plot(s, v, style, label="train loss" if key == "loss" else "validation loss", ms=3)
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(runs: dict[str, list[dict]], out_dir: Path, *, baseline: str = "bf16", title: str = "") -> list[Path]:
    """Write ``loss_curves.png`` (train loss of every recipe) and, when ``baseline`` is present,
    ``loss_diff.png`` (each recipe's train loss minus the baseline's at the same steps)."""
    out_dir = Path(out_dir)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, recs in runs.items():
        s, v = _series(recs, "loss")
        ax.plot(s, v, label=name, lw=1.2)
    ax.set(xlabel="optimizer step", ylabel="training loss (nats/token)", title=title or "loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "loss_curves.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if baseline in runs:
        bs, bv = _series(runs[baseline], "loss")
        base = dict(zip(bs, bv))
        fig, ax = plt.subplots(figsize=(8, 4.8))
        for name, recs in runs.items():
            if name == baseline:
                continue
            s, v = _series(recs, "loss")
            pts = [(st, val - base[st]) for st, val in zip(s, v) if st in base]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=1.2)
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xlabel="optimizer step", ylabel=f"training loss − {baseline} loss", title=f"loss difference to {baseline}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "loss_diff.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
