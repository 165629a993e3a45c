"""Report of the 1 vs N GPU FSDP2 runs of `experiments/scaling/run.sh`, as markdown on stdout.

    python experiments/scaling/report.py RUNS [--all-steps]

RUNS holds one folder per run, named RECIPE-Ngpu (torchrun --nproc-per-node N, --parallel fsdp) or
RECIPE-1gpu-plain (one process, --parallel none), each with adahop's config.json, metrics.jsonl,
summary.json (with ``plan_checked_on_ranks`` and ``peak_memory_bytes_per_rank``), plan.json, and
optionally ranks/ (plan.rankR.json, summary.rankR.json, from a wrapper of one's own); plus
times.tsv and logs/ from run.sh. It prints

(a) loss equality: per recipe, the N-GPU losses against the 1-GPU losses, step by step;
    whether every rank froze the same plan;
(b) throughput and memory: tokens/s total and per GPU over the steps after calibration,
    scaling efficiency, ratio to BF16 at the same GPU count, peak memory per GPU;
then the conclusions and the exact commands.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

NAME = re.compile(r"^(?P<recipe>.+)-(?P<n>\d+)gpu(?P<plain>-plain)?$")
BF16_U = 2.0 ** -8  # BF16 unit roundoff (8 significant bits): the relative error of storing a value in BF16
WARM = 2  # steps skipped after calibration ends (first quantized steps: kernel JIT/autotune, caches)
GIB = 2.0 ** 30


@dataclass
class Run:
    name: str
    recipe: str
    n: int
    plain: bool
    dir: Path
    cfg: dict
    losses: dict[int, float]
    val_loss: float | None
    step_s: dict[int, float]
    summary: dict
    rank_summaries: dict[int, dict]
    rank_plans: dict[int, dict]
    plan: dict | None
    rc: str | None = None
    wall_s: float | None = None
    smi_peak_mib: dict[int, float] = field(default_factory=dict)
    cmd: str | None = None

    @property
    def label(self) -> str:
        return f"{self.n} (plain, no FSDP)" if self.plain else str(self.n)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg["batch_size"] * self.cfg["seq_len"]


def _json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def step_seconds(records: list[dict], tokens_per_step: int) -> dict[int, float]:
    """Seconds of each optimizer step on rank 0's clock: the logged ``step_s`` (from its start to a
    CUDA synchronize after the optimizer step and the plan hook; logging, eval and checkpoints
    are outside it), or for logs without it, recovered from the cumulative ``tok_per_s``."""
    if any("step_s" in r for r in records):
        return {r["step"]: r["step_s"] for r in records if "step_s" in r and "loss" in r}
    out: dict[int, float] = {}
    prev_step, prev_clock = None, 0.0
    for r in records:
        if "loss" not in r:
            continue
        k, tps = r["step"], r.get("tok_per_s") or 0.0
        clock = max(0, k - 2) * tokens_per_step / tps if tps else 0.0
        if prev_step is not None and k > prev_step and clock > prev_clock:
            for s in range(prev_step + 1, k + 1):
                out[s] = (clock - prev_clock) / (k - prev_step)
        prev_step, prev_clock = k, clock
    return out


def load_run(d: Path, times: dict[str, list[str]]) -> Run | None:
    m = NAME.match(d.name)
    conf = _json(d / "config.json")
    if not m or conf is None or not (d / "metrics.jsonl").exists():
        return None
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = conf["adahop"]["config"]
    rs = {int(p.name.split("rank")[1].split(".")[0]): json.loads(p.read_text()) for p in sorted(d.glob("ranks/summary.rank*.json"))}
    rp = {int(p.name.split("rank")[1].split(".")[0]): json.loads(p.read_text()) for p in sorted(d.glob("ranks/plan.rank*.json"))}
    val = [r["val_loss"] for r in records if "val_loss" in r]
    run = Run(name=d.name, recipe=m["recipe"], n=int(m["n"]), plain=bool(m["plain"]), dir=d, cfg=cfg,
              losses={r["step"]: r["loss"] for r in records if "loss" in r}, val_loss=val[-1] if val else None,
              step_s=step_seconds(records, cfg["batch_size"] * cfg["seq_len"]), summary=_json(d / "summary.json") or {},
              rank_summaries=rs, rank_plans=rp, plan=_json(d / "plan.json"))
    if d.name in times:
        run.rc, run.wall_s = times[d.name][4], float(times[d.name][5])
    smi = d.parent / "logs" / f"{d.name}.smi"
    if smi.exists():
        for line in smi.read_text().splitlines():
            try:
                i, mib = (float(x) for x in line.split(","))
            except ValueError:
                continue
            run.smi_peak_mib[int(i)] = max(run.smi_peak_mib.get(int(i), 0.0), mib)
    cmd = d.parent / "logs" / f"{d.name}.cmd"
    run.cmd = cmd.read_text().strip() if cmd.exists() else None
    return run


def window(runs: list[Run]) -> tuple[int, int]:
    """The timed steps: after calibration ends (+WARM), to the last step; the same for every run."""
    calib = max((r.cfg.get("calib_steps") or 0) for r in runs)
    last = min(r.cfg["steps"] for r in runs)
    return calib + WARM + 1, last


def throughput(run: Run, lo: int, hi: int) -> tuple[float | None, list[float]]:
    dts = [run.step_s[s] for s in range(lo, hi + 1) if s in run.step_s]
    if not dts:
        return None, []
    return statistics.median(run.tokens_per_step / dt for dt in dts), dts


def fmt(x, spec: str = ",.0f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def loss_gap(a: Run, b: Run, steps=None) -> tuple[float, float, int]:
    """(max |Δloss|, max |Δloss| / loss, step of the max |Δ|) over the common (or given) steps."""
    common = sorted(set(a.losses) & set(b.losses) if steps is None else set(steps) & set(a.losses) & set(b.losses))
    if not common:
        return float("nan"), float("nan"), 0
    d = {s: abs(b.losses[s] - a.losses[s]) for s in common}
    s_max = max(d, key=d.get)
    return d[s_max], max(d[s] / abs(a.losses[s]) for s in common), s_max


def plan_diff(p: dict, q: dict) -> int:
    """Layers whose entry (patterns, pairs, strategies) differs between two plans."""
    lp, lq = p.get("layers", {}), q.get("layers", {})
    return sum(lp.get(k) != lq.get(k) for k in set(lp) | set(lq)) + (p.get("table") != q.get("table"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs")
    ap.add_argument("--all-steps", action="store_true", help="also print every step's losses and Δ")
    args = ap.parse_args()
    root = Path(args.runs)
    times = {}
    if (root / "times.tsv").exists():
        for line in (root / "times.tsv").read_text().splitlines():
            f = line.split("\t")
            if len(f) >= 6:
                times[f[0]] = f  # the last attempt of a name wins
    runs = [r for d in sorted(root.iterdir()) if d.is_dir() and (r := load_run(d, times)) is not None]
    if not runs:
        raise SystemExit(f"no run folders (RECIPE-Ngpu with config.json and metrics.jsonl) in {root}")
    recipes = list(dict.fromkeys(r.recipe for r in sorted(runs, key=lambda r: r.recipe != "bf16")))
    by = {(r.recipe, r.n, r.plain): r for r in runs}
    lo, hi = window(runs)
    calib = max((r.cfg.get("calib_steps") or 0) for r in runs)
    c0 = runs[0].cfg
    out: list[str] = []
    p = out.append

    p(f"# Data-parallel scaling: {c0['model']}, {', '.join(recipes)}, 1 vs N GPUs (torchrun, FSDP2)\n")
    env = root / "logs" / "env.log"
    if env.exists():
        p("```\n" + env.read_text().strip() + "\n```\n")
    p(f"Global batch {c0['batch_size']} × {c0['seq_len']} tokens = {c0['batch_size'] * c0['seq_len']:,} tokens/step, "
      f"{c0['steps']} steps, seed {c0['seed']}, lr {c0['lr']} (warm-up {c0['warmup_steps']}), "
      f"{c0['calib_steps']} AdaHOP calibration steps, backend {c0['backend']}, device {c0['device']}.\n")
    # same flags everywhere except the output folder and --parallel
    diffs = sorted({k for r in runs for k in r.cfg if k not in ("out", "parallel") and r.cfg[k] != c0[k] and k != "recipe"})
    p("Configs identical across runs (except recipe, --out, --parallel): " + ("yes" if not diffs else f"**no**: {diffs}") + "\n")
    if c0["device"] == "cpu":
        p("**CPU smoke test (gloo)**: the pipeline works end to end; its timings say nothing about GPUs (the single "
          "process uses every core, each of N ranks one thread under torchrun).\n")
    bad = [f"{r.name} (exit {r.rc})" for r in runs if r.rc not in (None, "0")]
    incomplete = [r.name for r in runs if max(r.losses, default=0) < r.cfg["steps"]]
    if bad or incomplete:
        p(f"**Failed or incomplete runs**: {', '.join(bad + incomplete)}\n")

    # ---- (a) loss equality -------------------------------------------------------------------
    marks = sorted({s for s in (1, calib, calib + 1, c0["steps"] // 2, c0["steps"]) if 1 <= s <= c0["steps"]})
    p("## (a) Losses: N GPUs vs 1 GPU (both FSDP2, same global batch and seed)\n")
    p(f"Δ = loss(N GPUs) − loss(1 GPU), training loss of each step (mean over ranks = the global batch mean). "
      f"Steps 1–{calib} are AdaHOP's calibration (BF16 GEMMs); from step {calib + 1} adahop-lv2 runs its frozen "
      f"MXFP4 plan. Tolerance: |Δ| ≤ u·loss with u = 2⁻⁸ (BF16's unit roundoff: the two losses agree to BF16 "
      f"precision), or within the gap between two BF16 setups of one GPU (plain single process vs 1-rank FSDP2, "
      f"when that run exists) if that is larger.\n")
    head = (["recipe", "N", f"max abs Δ (step)", "max Δ/loss", f"max abs Δ, steps 1–{calib}", f"max abs Δ, steps {calib + 1}–{c0['steps']}"]
            + [f"Δ step {s}" for s in marks] + ["Δ val loss", "ref: plain vs FSDP 1 GPU, max abs Δ (Δ/loss)", "within tolerance",
                                                "same plan on every rank", "plan vs 1-GPU plan"])
    p("| " + " | ".join(head) + " |")
    p("|" + "---|" * len(head))
    verdicts = {}
    for rec in recipes:
        one = by.get((rec, 1, False))
        if one is None:
            continue
        ref = by.get((rec, 1, True))
        ref_abs, ref_rel, _ = loss_gap(one, ref) if ref else (None, None, None)
        for multi in sorted((r for r in runs if r.recipe == rec and not r.plain and r.n > 1), key=lambda r: r.n):
            mx, rel, s_mx = loss_gap(one, multi)
            early, _, _ = loss_gap(one, multi, range(1, calib + 1))
            late, _, _ = loss_gap(one, multi, range(calib + 1, c0["steps"] + 1))
            at = [fmt(multi.losses[s] - one.losses[s], "+.2e") if s in multi.losses and s in one.losses else "—" for s in marks]
            dval = fmt(None if multi.val_loss is None or one.val_loss is None else multi.val_loss - one.val_loss, "+.2e")
            tol = max(BF16_U, ref_rel or 0.0)
            ok = rel <= tol
            verdicts[(rec, multi.n)] = (ok, mx, rel, s_mx, ref_rel)
            plans, same_plan, vs_one = multi.rank_plans, "—", "—"
            if rec.startswith("adahop") or plans or multi.plan:
                if len(plans) == multi.n:
                    first = plans[min(plans)]
                    same = all(q == first for q in plans.values()) and (multi.plan is None or multi.plan == first)
                    same_plan = (f"yes ({multi.n} ranks, {len(first.get('layers', {}))} layers)" if same
                                 else f"**no**: layers differing from rank 0: " + ", ".join(f"rank {k}: {plan_diff(first, q)}" for k, q in plans.items() if k))
                elif plans:
                    same_plan = f"unknown: plan files of ranks {sorted(plans)} only"
                elif multi.summary.get("plan_checked_on_ranks"):  # adahop train's own all-gather check
                    same_plan = f"yes ({multi.summary['plan_checked_on_ranks']} ranks, checked by adahop train)"
                else:
                    same_plan = "not checked (no ranks/plan.rank*.json and no plan_checked_on_ranks in summary.json)"
                ref_plan = one.plan or one.rank_plans.get(0)
                mine = multi.plan or plans.get(0)
                if ref_plan and mine:
                    k = plan_diff(ref_plan, mine)
                    vs_one = "identical" if k == 0 else f"{k} of {len(ref_plan.get('layers', {}))} layers differ"
            p(f"| {rec} | {multi.n} | {mx:.2e} (step {s_mx}) | {rel:.2e} | {early:.2e} | {late:.2e} | " + " | ".join(at)
              + f" | {dval} | " + (f"{ref_abs:.2e} ({ref_rel:.2e})" if ref else "not run")
              + f" | {'yes' if ok else '**no**'} (≤ {tol:.2e}) | {same_plan} | {vs_one} |")
    p("")
    if args.all_steps:
        for rec in recipes:
            cols = [r for r in (by.get((rec, 1, False)), *sorted((r for r in runs if r.recipe == rec and r.n > 1), key=lambda r: r.n),
                                by.get((rec, 1, True))) if r is not None]
            if len(cols) < 2:
                continue
            p(f"{rec}, every step (Δ against {cols[0].name}):\n")
            p("| step | " + " | ".join(c.name for c in cols) + " | " + " | ".join(f"Δ {c.name}" for c in cols[1:]) + " |")
            p("|" + "---|" * (1 + 2 * len(cols) - 1))
            for s in sorted(cols[0].losses):
                row = [fmt(c.losses.get(s), ".5f") for c in cols]
                dl = [fmt(None if s not in c.losses else c.losses[s] - cols[0].losses[s], "+.2e") for c in cols[1:]]
                p(f"| {s} | " + " | ".join(row) + " | " + " | ".join(dl) + " |")
            p("")

    # ---- (b) throughput and memory ----------------------------------------------------------
    p(f"## (b) Throughput and memory\n")
    p(f"tokens/s: median over steps {lo}–{hi} of the global tokens per step ({c0['batch_size'] * c0['seq_len']:,}) "
      f"divided by that step's time on rank 0's clock (recovered from the `tok_per_s` adahop logs every step; "
      f"the clock runs from the step's start to a CUDA synchronize after the optimizer step). Steps 1–{calib} are "
      f"excluded because adahop-lv2 calibrates there with BF16 GEMMs (and host syncs for pattern detection): only steps "
      f"after its plan froze count, minus {WARM} warm-up steps (Triton JIT, caches); BF16 is timed over the same steps. "
      f"adahop's `tokens/s` is global (all ranks); per GPU = total / N. Scaling efficiency = per-GPU tokens/s at N GPUs "
      f"/ per-GPU tokens/s at 1 GPU (both FSDP2). Peak memory: `torch.cuda.max_memory_allocated` of each rank "
      f"(reset after sharding, so it covers training and the final evaluation, not the full-model build nor the export); "
      f"the column lists max over ranks (each rank). nvidia-smi: the largest `memory.used` sampled every 0.2 s per "
      f"physical GPU (CUDA context and the allocator's cache included).\n")
    head = ["recipe", "GPUs", "tokens/s total", "tokens/s per GPU", "scaling efficiency", "× BF16 (same GPUs)",
            "step ms median (p10–p90)", "peak memory per GPU GiB (torch, per rank)", "nvidia-smi peak GiB per GPU",
            "tok/s as adahop prints it (steps 3–end)", "final train loss", "wall s"]
    p("| " + " | ".join(head) + " |")
    p("|" + "---|" * len(head))
    tps = {}
    for r in runs:
        tps[(r.recipe, r.n, r.plain)] = throughput(r, lo, hi)
    for rec in recipes:
        for r in sorted((r for r in runs if r.recipe == rec), key=lambda r: (r.plain, r.n)):
            total, dts = tps[(r.recipe, r.n, r.plain)]
            one = tps.get((rec, 1, False), (None, []))[0]
            eff = "—" if r.plain or total is None or one is None else f"{(total / r.n) / one:.1%}"
            if r.plain and total is not None and one is not None:
                eff = f"(1-rank FSDP2 = {one / total:.1%} of this)"
            b = tps.get(("bf16", r.n, r.plain), (None, []))[0]
            xb = "—" if total is None or b is None else f"{total / b:.2f}×"
            peaks = ([s.get("peak_memory_bytes") for _, s in sorted(r.rank_summaries.items())]
                     or r.summary.get("peak_memory_bytes_per_rank") or [r.summary.get("peak_memory_bytes")])
            peaks = [x for x in peaks if x is not None]
            mem = "—" if not peaks else f"{max(peaks) / GIB:.1f} (" + " / ".join(f"{x / GIB:.1f}" for x in peaks) + ")"
            if len(peaks) < r.n:
                mem += " rank 0 only"
            smi = " / ".join(f"GPU{i} {v / 1024:.1f}" for i, v in sorted(r.smi_peak_mib.items())) or "—"
            steps_ms = "—" if not dts else f"{1e3 * statistics.median(dts):.0f} ({1e3 * pct(dts, .1):.0f}–{1e3 * pct(dts, .9):.0f})"
            p(f"| {rec} | {r.label} | {fmt(total)} | {fmt(None if total is None else total / r.n)} | {eff} | {xb} | {steps_ms} | "
              f"{mem} | {smi} | {fmt(r.summary.get('tok_per_s'))} | {fmt(r.summary.get('final_train_loss'), '.4f')} | "
              f"{fmt(r.wall_s, '.0f')} |")
    p("")

    # ---- conclusions -------------------------------------------------------------------------
    p("## Conclusions\n")
    for (rec, n), (ok, mx, rel, s_mx, ref_rel) in verdicts.items():
        p(f"- {rec}, {n} vs 1 GPU: largest loss difference {mx:.2e} at step {s_mx} ({rel:.2e} of the loss): "
          + ("within" if ok else "**outside**") + f" BF16 tolerance (u = 2⁻⁸ = {BF16_U:.2e}"
          + (f"; the plain-vs-FSDP gap on one GPU is {ref_rel:.2e}" if ref_rel is not None else "") + ").")
    for rec in recipes:
        one = tps.get((rec, 1, False), (None, []))[0]
        for r in sorted((r for r in runs if r.recipe == rec and not r.plain and r.n > 1), key=lambda r: r.n):
            total = tps[(rec, r.n, False)][0]
            if one and total:
                p(f"- {rec}: {total:,.0f} tokens/s on {r.n} GPUs = {total / r.n:,.0f} per GPU vs {one:,.0f} on 1 GPU: "
                  f"scaling efficiency {(total / r.n) / one:.1%} ({total / one:.2f}× the 1-GPU throughput).")
    for rec in recipes:
        if rec == "bf16":
            continue
        ratios = {n: tps[(rec, n, False)][0] / tps[("bf16", n, False)][0] for (rr, n, pl) in tps
                  if rr == rec and not pl and ("bf16", n, False) in tps and tps[(rec, n, False)][0] and tps[("bf16", n, False)][0]}
        if not ratios:
            continue
        ns = sorted(ratios)
        txt = ", ".join(f"{ratios[n]:.2f}× on {n} GPU{'s' if n > 1 else ''}" for n in ns)
        if all(v > 1 for v in ratios.values()):
            kind = "faster than BF16 at every GPU count"
        elif all(v < 1 for v in ratios.values()):
            kind = "slower than BF16 at every GPU count: there is no speed-up over BF16 to hold"
        else:
            kind = "faster than BF16 at some GPU counts only"
        change = "" if len(ns) < 2 else f"; its ratio to BF16 changes by {ratios[ns[-1]] / ratios[ns[0]] - 1:+.1%} from {ns[0]} to {ns[-1]} GPUs"
        p(f"- {rec} vs BF16 (tokens/s, same GPU count): {txt}: {kind}{change}.")
    p("")

    # ---- commands ----------------------------------------------------------------------------
    cmds = [r.cmd for r in sorted(runs, key=lambda r: (r.recipe != "bf16", r.recipe, r.plain, r.n)) if r.cmd]
    if cmds:
        p("## Commands (as run by experiments/scaling/run.sh)\n")
        p("```bash\n" + "\n".join(cmds) + "\n```")
    print("\n".join(out))


if __name__ == "__main__":
    main()
