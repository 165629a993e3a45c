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


def plot_compare(runs: dict[str, list[dict]], out_dir: Path, *, baseline: str | dict[str, str] = "bf16",
                 title: str = "") -> list[Path]:
    """Write ``loss_curves.png`` (train loss of every recipe that logged one; none when no run did) and, when
    the baseline is present, ``loss_diff.png`` (each run's train loss minus its baseline's at the same steps).

    ``baseline`` is one run name for all, or a mapping from run name to the name of its own
    baseline (e.g. the BF16 run of the same seed); runs without one are left out of the diff."""
    out_dir = Path(out_dir)
    curves = {name: c for name, recs in runs.items() if (c := _series(recs, "loss"))[0]}  # a run that logged no loss: no line
    for stale in ("loss_curves.png", "loss_diff.png"):  # never leave an earlier comparison's plot beside this one
        (out_dir / stale).unlink(missing_ok=True)
    if not curves:
        return []
    paths = [_line_plot(curves, out_dir / "loss_curves.png", ylabel="training loss (nats/token)",
                        title=title or "loss curves")]
    pairs = baseline if isinstance(baseline, dict) else {n: baseline for n in curves}
    diffs = {}
    for name, (s, v) in curves.items():
        ref = pairs.get(name)
        if ref is None or ref == name or ref not in curves:
            continue
        base = dict(zip(*curves[ref]))
        pts = [(st, val - base[st]) for st, val in zip(s, v) if st in base]
        label = name if isinstance(baseline, str) else f"{name} − {ref}"
        diffs[label] = ([p[0] for p in pts], [p[1] for p in pts])
    if diffs:
        what = baseline if isinstance(baseline, str) else "BF16 (same seed)"
        paths.append(_line_plot(diffs, out_dir / "loss_diff.png", ylabel=f"training loss − {what} loss",
                                title=f"loss difference to {what}", zero_line=True))
    return paths


def _line_plot(curves: dict[str, tuple[list, list]], path: Path, *, ylabel: str, title: str, zero_line: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (name, (s, v)) in enumerate(curves.items()):
        ax.plot(s, v, label=name, lw=1.2, ls=("-", "--", ":")[i // 10 % 3],  # the 10 colours repeat: vary the line
                marker="o" if len(s) <= 30 else None, ms=3)  # a short run's one or few points drew no line at all
    if zero_line:
        ax.axhline(0, color="k", lw=0.8)
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
