"""Build the results table and plots of the quality experiment from its run folders.

    python experiments/quality/report.py OUT --docs docs/results [--refs DIR ...]

Writes ``table.md`` (with the zero-shot scores of runs that have an eval.json) (recipe, final val loss, gap to BF16 absolute and %, val bits per byte,
tokens/s, peak memory, saved-for-backward bytes; then, for recipes with several seeds, the gap as
mean ± std over seeds; then the per-GEMM ablation's arms beside their full recipes), ``loss_curves.png`` and ``loss_diff.png`` (training loss minus BF16's of
the same seed, Figure 1 of the AdaHOP paper) into --docs, and prints the table. Run folders are
``RECIPE-sSEED`` (``-ref``: the reference backend); interrupted runs are left out.

Each run's gap is taken to a finished BF16 run (recipe ``bf16``, FP32 AdamW) of the same seed and
data seed. Code revisions can move BF16 by more than the gaps (`docs/results.md`, "revisions"), so a
BF16 run of the same ``git_revision`` is preferred; else the first found in ``--refs`` order (folders
of other launchers, such as reruns at a later revision or the optimizer experiment), then OUT's own.
The table names the reference's revision beside the run's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from adahop.eval import report as eval_report
from adahop.plots import plot_compare
from adahop.train.export import read_run_section
from adahop.train.metrics import read_metrics
from adahop.train.setup import data_order_seed


NAME = re.compile(r"^(?P<recipe>.+)-s(?P<seed>\d+)(?P<ref>-ref)?$")


def _recipe(name: str) -> str:
    m = NAME.match(name)
    return m["recipe"] + (m["ref"] or "")


def _seed(name: str) -> str:
    return NAME.match(name)["seed"]


def _identity(folder: Path) -> tuple[str, str, tuple, int | None, int | None]:
    """(recipe, short revision, (optimizer, master weights, optimizer states), seed, data-order seed)
    of a run folder, from its config.json (None for settings an older adahop did not record)."""
    sec = read_run_section(folder) or {}
    cfg = sec.get("config", {})
    opt = (cfg.get("optimizer"), cfg.get("master_weights"), cfg.get("optimizer_states"))
    seed = cfg.get("seed")
    return (cfg.get("recipe", ""), (sec.get("git_revision") or "?")[:7], opt,
            seed, data_order_seed(seed, cfg.get("data_seed")))


def _finished(folder: Path) -> dict | None:
    p = folder / "summary.json"
    if not p.exists():
        return None
    s = json.loads(p.read_text())
    return None if s.get("interrupted") or s.get("final_val_loss") is None else s


def _references(folders: list[Path]) -> list[tuple[tuple, str, float, Path]]:
    """BF16 runs with FP32 AdamW (master weights and states FP32) found in ``folders`` (a folder of
    runs, or one run folder itself), in order: ``[((seed, data seed), revision, final val loss, folder)]``."""
    refs = []
    for d in folders:
        for p in [d] if (d / "summary.json").exists() else sorted(d.iterdir()):
            s = _finished(p) if p.is_dir() else None
            if s is None:
                continue
            recipe, rev, opt, seed, data_seed = _identity(p)
            if recipe == "bf16" and opt in (("adamw", "fp32", "fp32"), (None, None, None)):
                refs.append(((seed, data_seed), rev, s["final_val_loss"], p))
    return refs


def _pick(folder: Path, refs: list) -> tuple[float, str, Path] | None:
    """(loss, revision, folder) of ``folder``'s BF16 reference: same seeds, its own revision first."""
    _, rev, _, seed, data_seed = _identity(folder)
    same = [r for r in refs if r[0] == (seed, data_seed)]
    same.sort(key=lambda r: r[1] != rev)  # stable: --refs order within each class
    return (same[0][2], same[0][1], same[0][3]) if same else None


def _mean_std(runs: dict, base: dict) -> list[str]:
    """Per recipe with at least two seeds that have a BF16 reference: final val loss and gap % to
    it, mean ± sample std over seeds."""
    by: dict[str, list[tuple[float, float]]] = {}
    for n, s in runs.items():
        b = base.get(n, (None,))[0]
        if b:
            by.setdefault(_recipe(n), []).append((s["final_val_loss"], 100 * (s["final_val_loss"] - b) / b))
    rows = {r: v for r, v in by.items() if len(v) >= 2}
    if not rows:
        return []
    out = ["", "| recipe | seeds | final val loss (mean ± std) | gap % to BF16 (mean ± std) |", "|---|---|---|---|"]
    for r, v in sorted(rows.items(), key=lambda kv: statistics.mean(g for _, g in kv[1])):
        loss, gap = [x for x, _ in v], [g for _, g in v]
        out.append(f"| {r} | {len(v)} | {statistics.mean(loss):.4f} ± {statistics.stdev(loss):.4f} | "
                   f"{statistics.mean(gap):+.2f} ± {statistics.stdev(gap):.2f} |")
    return out


ARM = re.compile(r"^(?P<recipe>.+)@only-(?P<gemm>fprop|dgrad|wgrad)$")


def _ablation(runs: dict, base: dict) -> list[str]:
    """The per-GEMM ablation (``RECIPE@only-GEMM`` runs): each arm's gap % to BF16 per seed, with the full
    recipe's gap at the same seeds beside it, and the arm's share of that gap (paired per seed, then mean ±
    std). A seed without its full-recipe run shows the arm's gap alone."""
    gap = {n: 100 * (s["final_val_loss"] - base[n][0]) / base[n][0] for n, s in runs.items() if n in base}
    arms: dict[tuple[str, str], dict[str, float]] = {}
    for n, g in gap.items():
        if m := ARM.match(_recipe(n)):
            arms.setdefault((m["recipe"], m["gemm"]), {})[_seed(n)] = g
    if not arms:
        return []

    def ms(v: list[float]) -> str:
        return f"{statistics.mean(v):+.2f} ± {statistics.stdev(v):.2f}" if len(v) > 1 else (f"{v[0]:+.2f}" if v else "-")

    out = ["", "Per-GEMM ablation (gap % to BF16 of the same seed; share: the arm's gap over the full recipe's, per seed):", "",
           "| recipe | FP4 only in | gap % per seed | arm gap % | full recipe gap %, same seeds | share of the full gap % |",
           "|---|---|---|---|---|---|"]
    order = {"fprop": 0, "dgrad": 1, "wgrad": 2}
    for (r, g), by_seed in sorted(arms.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        seeds = sorted(by_seed, key=int)
        full = {s: gap[f"{r}-s{s}"] for s in seeds if f"{r}-s{s}" in gap}
        share = [100 * by_seed[s] / full[s] for s in full if full[s]]
        per = ", ".join(f"s{s} {by_seed[s]:+.2f}" for s in seeds)
        out.append(f"| {r} | {g} | {per} | {ms([by_seed[s] for s in seeds])} | {ms(list(full.values()))} | {ms(share)} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--docs", default="docs/results")
    ap.add_argument("--refs", nargs="*", default=[], help="more BF16 reference runs (folders of runs, or run folders), preferred in this order")
    args = ap.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    runs = {p.name: s for p in sorted(out.iterdir()) if NAME.match(p.name) and (s := _finished(p)) is not None}
    refs = _references([Path(d) for d in args.refs] + [out])
    base = {n: r for n in runs if (r := _pick(out / n, refs)) is not None}  # {run: (BF16 loss, its revision)}
    lines = ["| recipe | seed | revision | final val loss | BF16 reference (revision) | gap | gap % | val bits/byte | "
             "tokens/s | peak memory GiB | saved for bwd MiB (plain linear) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(runs, key=lambda n: (runs[n]["final_val_loss"] - base.get(n, (float("nan"),))[0], n))
    for name in order:
        s = runs[name]
        recipe, seed, rev = _recipe(name), _seed(name), _identity(out / name)[1]
        vl, (b, brev, _) = s["final_val_loss"], base.get(name, (None, "-", None))
        gap, pct = (vl - b, 100 * (vl - b) / b) if b else (float("nan"), float("nan"))
        ref = f"{b:.4f} ({brev})" if b else "-"
        lines.append(f"| {recipe} | {seed} | {rev} | {vl:.4f} | {ref} | {gap:+.4f} | {pct:+.2f} | {s['final_val_bpb']:.4f} | "
                     f"{s['tok_per_s']:,.0f} | {s['peak_memory_bytes'] / 2**30:.1f} | "
                     f"{s['saved_bytes'] / 2**20:,.0f} ({s['saved_bytes_bf16'] / 2**20:,.0f}) |")
    own = {_seed(n): s["final_val_loss"] for n, s in runs.items() if _recipe(n) == "bf16"}
    if len(own) > 1:  # the noise floor: the same recipe, another seed
        v = sorted(own.values())
        lines.append(f"\nBF16 across seeds: {', '.join(f'{x:.4f}' for x in own.values())} (spread {v[-1] - v[0]:.4f}, "
                     f"{100 * (v[-1] - v[0]) / v[0]:.2f}%).")
    lines += _mean_std(runs, base)
    lines += _ablation(runs, base)
    scored = {n: json.loads((out / n / "eval.json").read_text()) for n in order if (out / n / "eval.json").exists()}
    for rev, p in sorted({v[1:] for v in base.values()}):  # the BF16 references kept in other folders
        if p.parent != out and (p / "eval.json").exists():
            scored[f"{p.name} ({rev}, {p.parent.name})"] = json.loads((p / "eval.json").read_text())
    if scored:  # zero-shot scores of the runs that have them (`run.py --eval-tasks`), chance last
        header, rows = eval_report.table_rows(scored)
        lines += ["", f"Zero-shot ({len(scored)} runs scored; accuracy %, ± the standard error):", "",
                  eval_report.markdown(header, rows)]
    table = "\n".join(lines)
    (docs / "table.md").write_text(table + "\n")
    curves = {name: read_metrics(out / name / "metrics.jsonl") for name in runs}
    pairs = {name: f"bf16-s{_seed(name)}" for name in runs}
    plot_compare(curves, docs, baseline=pairs, title="llama-60m on the main corpus: training loss")
    print(table)


if __name__ == "__main__":
    main()
