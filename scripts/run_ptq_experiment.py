"""The PTQ table of issue 22: method × bits for each model, then MXFP4 W4 with RHT and HARP.

    # GPU (the lead's H200): models trained with `adahop train`, a prepared corpus
    python scripts/run_ptq_experiment.py --data data/main --models runs/m125-bf16,runs/m125-lv2,runs/m350-bf16,runs/m350-lv2 \
        --out experiments/ptq --budget-s 5400
    # CPU smoke run: trains llama-tiny for 60 steps on the default corpus, then a short table (~10 min on 2 cores)
    python scripts/run_ptq_experiment.py --smoke --out experiments/ptq-smoke

Each cell is one `adahop ptq` process (a crash or an out-of-memory error costs that cell only) writing
``OUT/<model>/<method>-w<bits>-<quantizer>/``; a cell whose ``ptq.json`` exists is finished and is
skipped when the script runs again, so an interrupted or budget-cut run resumes where it stopped
(``OUT/settings.json`` keeps the options that decide the numbers; a run with others is refused).
The unquantized perplexity of each model (Δ's reference) is the first cell's `adahop ptq` baseline: the
model rounded to BF16 as its export reloads, on the same windows (``OUT/<model>/baseline.json``). Cells start
only while ``--budget-s`` lasts, and each is given what is left of it as its timeout. The results go
to ``OUT/summary.json`` and ``OUT/summary.md`` (tables, the ordering target of the issue checked cell
by cell, the BF16- vs adahop-lv2-trained comparison at MXFP4 W4, and HARP fitting time per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

INT_METHODS = ("rtn", "gptq", "rht-gptq", "harp-gptq")
MX_METHODS = ("rht-gptq", "harp-gptq")


def cells(models: list[str], bits: list[int], methods: list[str], mx: bool,
          seeds: list[int] = (), repeat_bits: list[int] = (2,)) -> list[tuple[str, str, int, str, int]]:
    """(model, method, bits, quantizer, seed) in the order they run: the cheap cells of every model first,
    then HARP (the expensive one), 2 bits first, where the issue expects the largest gap. ``seeds``: the int
    cells at ``repeat_bits`` (W2 by default) of the methods that calibrate (gptq, rht-gptq, harp-gptq) again
    with each of these ``--seed`` s (other signs and calibration windows), the cheap ones before HARP, HARP's
    last: the spread that says whether a gap between methods is more than noise."""
    cheap = [m for m in methods if not m.startswith("harp")]
    harp = [m for m in methods if m.startswith("harp")]
    again = [m for m in methods if m.endswith("gptq")]
    rb = [b for b in bits if b in repeat_bits]
    out = [(mo, me, b, "int", 0) for mo in models for b in bits for me in cheap]
    if mx:
        out += [(mo, me, 4, "mxfp4", 0) for mo in models for me in MX_METHODS if not me.startswith("harp")]
    out += [(mo, me, b, "int", sd) for sd in seeds for b in rb for mo in models for me in again if me in cheap]
    out += [(mo, me, b, "int", 0) for b in bits for mo in models for me in harp]
    if mx:
        out += [(mo, me, 4, "mxfp4", 0) for mo in models for me in MX_METHODS if me.startswith("harp")]
    out += [(mo, me, b, "int", sd) for sd in seeds for b in rb for mo in models for me in again if me in harp]
    return out


def cell_dir(out: Path, model: str, method: str, bits: int, quantizer: str, seed: int = 0) -> Path:
    return out / Path(model).name / (f"{method}-w{bits}-{quantizer}" + (f"-s{seed}" if seed else ""))


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int | str, float]:
    """Run ``cmd`` with its output in ``log``; returns (exit code or "timeout", seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout, 1), env={**os.environ, "TQDM_DISABLE": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.perf_counter() - t0


def baseline(out: Path, model: str) -> dict | None:
    """The unquantized model's perplexity kept from an earlier cell (``OUT/<model>/baseline.json``), or None."""
    path = out / Path(model).name / "baseline.json"
    return json.loads(path.read_text())["perplexity"] if path.exists() else None


def keep_baseline(out: Path, model: str, d: Path) -> dict | None:
    """The baseline cell ``d`` scored (`adahop ptq`'s ``baseline``: the unquantized model rounded to
    BF16, as its export reloads), written beside the model's cells; None if it scored none."""
    res = json.loads((d / "ptq.json").read_text())
    if res.get("baseline") is None:
        return None
    path = out / Path(model).name / "baseline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"perplexity": res["baseline"], "perplexity_fp32": res.get("baseline_fp32"), "cell": d.name}))
    return res["baseline"]


def ptq_cmd(args, model, method, bits, quantizer, seed, d: Path, with_baseline: bool = False) -> list[str]:
    """The `adahop ptq` command of one cell; ``with_baseline`` also scores the unquantized model (once per model)."""
    cmd = [sys.executable, "-m", "adahop", "ptq", model, "--method", method, "--bits", str(bits), "--quantizer", quantizer,
           "--calib-data", args.data, "--calib-tokens", str(args.calib_tokens), "--batch-size", str(args.batch_size),
           "--device", args.device, "--out", str(d)]
    cmd += ["--seed", str(seed)] if seed else []
    cmd += ["--harp-steps", str(args.harp_steps)] if method.startswith("harp-") else []  # the others refuse it (unused)
    cmd += ["--theta-format", args.theta_format] if method.startswith("harp-") and args.theta_format != "fp16" else []
    cmd += [] if with_baseline else ["--skip-baseline"]
    cmd += ["--seq-len", str(args.seq_len)] if args.seq_len is not None else []  # 0 too: ptq refuses it, by name
    cmd += ["--eval-batches", str(args.eval_batches)] if args.eval_batches is not None else []
    cmd += ["--group-size", str(args.group_size)] if quantizer == "int" and args.group_size is not None else []
    return cmd


def smoke_model(args, out: Path) -> str:
    """llama-tiny trained for 60 steps on the default corpus (once), for the CPU smoke mode."""
    run_dir = out / "_models" / "smoke-llama-tiny"  # not OUT/<model name>: the cells' folders go there, outside the model
    if not (run_dir / "summary.json").exists():
        cmd = [sys.executable, "-m", "adahop", "train", "--recipe", "bf16", "--model", "llama-tiny", "--data", "default",
               "--steps", "60", "--device", "cpu", "--out", str(run_dir)]
        rc, secs = run(cmd, out / "smoke-train.log", 3600)
        if rc != 0:
            raise SystemExit(f"training the smoke model failed ({rc}); see {out / 'smoke-train.log'}")
        print(f"trained {run_dir} in {secs:.0f} s")
    return str(run_dir)


def summarize(out: Path, rows: list[dict], bases: dict[str, dict | None]) -> str:
    """summary.md: per model the method × bits table, the ordering check, MXFP4 by training recipe, fit times."""
    lines = [f"# PTQ experiment ({time.strftime('%Y-%m-%d')})", "", f"Command: `{' '.join(sys.argv)}`", ""]
    models = sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m))
    seeds = [r for r in rows if r.get("seed")]
    rows = [r for r in rows if not r.get("seed")]  # the tables: seed 0; the repeats get their own section
    for mo in models:
        base = bases.get(mo)
        lines += [f"## {mo}", "", f"Unquantized perplexity: {base['perplexity']:.4f}" if base else "Unquantized: not measured", "",
                  "| method | bits | quantizer | bits/weight | perplexity | Δ ppl % | quantize s | HARP s/layer |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["model"] == mo):
            if r.get("perplexity") is None:
                lines.append(f"| {r['method']} | {r['bits']} | {r['quantizer']} | - | {r['status']} | - | - | - |")
                continue
            gap = f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}" if base else "-"
            fit = f"{r['harp_s_per_layer']:.2f}" if r.get("harp_s_per_layer") else "-"
            lines.append(f"| {r['method']} | {r['bits']} | {r['quantizer']} | {r['bits_per_weight']:.3f} | "
                         f"{r['perplexity']:.4f} | {gap} | {r['seconds_quantize']:.0f} | {fit} |")
        lines += ["", "Target (issue 22): harp-gptq < rht-gptq < gptq < rtn in perplexity, int grid:", ""]
        for b in sorted({r["bits"] for r in rows if r["model"] == mo and r["quantizer"] == "int"}):
            got = {r["method"]: r.get("perplexity") for r in rows if r["model"] == mo and r["bits"] == b and r["quantizer"] == "int"}
            order = [m for m in ("harp-gptq", "rht-gptq", "gptq", "rtn") if got.get(m) is not None]
            ok = all(got[a] < got[c] for a, c in zip(order, order[1:]))
            gap = ""
            if got.get("harp-gptq") and got.get("rht-gptq"):
                gap = f"; harp-gptq vs rht-gptq {100 * (got['harp-gptq'] / got['rht-gptq'] - 1):+.2f}%"
            lines.append(f"- W{b}: {' < '.join(order) if ok else 'not in that order'} "
                         f"({', '.join(f'{m} {got[m]:.3f}' for m in order)}){gap}")
        lines.append("")
    if seeds:
        lines += _seed_spread(rows, seeds)
    mx = [r for r in rows if r["quantizer"] == "mxfp4" and r.get("perplexity") is not None and bases.get(r["model"])]
    if mx:
        lines += ["## MXFP4 W4: perplexity lost by training recipe", "",
                  "| model | method | unquantized | W4 MXFP4 | Δ ppl % |", "|---|---|---|---|---|"]
        for r in mx:
            b = bases[r["model"]]["perplexity"]
            lines.append(f"| {r['model']} | {r['method']} | {b:.4f} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / b - 1):+.2f} |")
        lines.append("")
    fits = {}
    for r in rows:
        for shape, s in (r.get("harp_fit_by_shape") or {}).items():
            fits.setdefault((r["model"], shape), []).extend(s)
    if fits:
        lines += ["## HARP fitting time per layer", "", "| model | layer shape (out × in) | layers | mean s | max s |", "|---|---|---|---|---|"]
        for (mo, shape), s in sorted(fits.items()):
            lines.append(f"| {mo} | {shape} | {len(s)} | {sum(s) / len(s):.2f} | {max(s):.2f} |")
        lines.append("")
    return "\n".join(lines)


def _seed_spread(rows: list[dict], repeats: list[dict]) -> list[str]:
    """summary.md's int perplexity per ``--seed`` (signs and calibration windows), with mean and range, one
    table per repeated width."""
    seeds = sorted({r["seed"] for r in repeats})
    lines = []
    for b in sorted({r["bits"] for r in repeats}):
        lines += [f"## W{b} across seeds (signs and calibration windows)", "",
                  "| model | method | seed 0 | " + " | ".join(f"seed {sd}" for sd in seeds) + " | mean | max − min |",
                  "|---|---|---|" + "---|" * len(seeds) + "---|---|"]
        for r0 in (r for r in rows if r["bits"] == b and r["quantizer"] == "int" and r["method"] != "rtn"):
            vals = [r0.get("perplexity")] + [next((r.get("perplexity") for r in repeats if (r["model"], r["method"],
                                                   r["bits"], r["seed"]) == (r0["model"], r0["method"], b, sd)), None)
                                             for sd in seeds]
            got = [v for v in vals if v is not None]
            cells_ = " | ".join("-" if v is None else f"{v:.4f}" for v in vals)
            stats = f"{sum(got) / len(got):.4f} | {max(got) - min(got):.4f}" if len(got) > 1 else "- | -"
            lines.append(f"| {r0['model']} | {r0['method']} | {cells_} | {stats} |")
        lines.append("")
    return lines


def collect(d: Path, model, method, bits, quantizer, seed, status) -> dict:
    row = {"model": Path(model).name, "path": model, "method": method, "bits": bits, "quantizer": quantizer, "seed": seed,
           "status": status}
    res_path = d / "ptq.json"
    if res_path.exists():
        res = json.loads(res_path.read_text())
        by_shape = {}
        for lay in res["layers"].values():
            if "harp" in lay:
                by_shape.setdefault("×".join(map(str, lay["shape"])), []).append(lay["harp"]["seconds"])
        row.update(status="done", perplexity=res["perplexity"]["perplexity"], loss=res["perplexity"]["loss"],
                   bits_per_weight=res["bits_per_weight"], seconds_quantize=res["seconds_quantize"],
                   seconds_total=res["seconds_total"], harp_s_per_layer=res["harp_fit_seconds_per_layer"],
                   harp_fit_by_shape=by_shape, device=res["device"], calib_tokens=res["calib_tokens"])
    return row


#: The options that decide a cell's numbers: a resumed table must keep them, or its kept cells (and the kept
#: baseline) would be compared with new ones made otherwise.
TABLE_SETTINGS = ("data", "calib_tokens", "harp_steps", "theta_format", "group_size", "seq_len", "batch_size",
                  "eval_batches", "device")


def check_settings(out: Path, args) -> None:
    """Write ``OUT/settings.json`` on the first run; on a later one, stop if an option of
    :data:`TABLE_SETTINGS` differs from it (the message names each)."""
    now = {k: getattr(args, k) for k in TABLE_SETTINGS}
    now["data"] = str(Path(args.data).resolve())
    if now["device"] == "auto":  # a GPU scores under BF16 autocast, the CPU in FP32: other numbers
        import torch

        now["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    path = out / "settings.json"
    if not path.exists():
        path.write_text(json.dumps(now, indent=1))
        return
    old = json.loads(path.read_text())
    diff = [f"--{k.replace('_', '-')} {old.get(k)} then, {now[k]} now" for k in TABLE_SETTINGS if old.get(k) != now[k]]
    if diff:
        raise SystemExit(f"{out} holds cells made with other settings ({'; '.join(diff)}): its kept cells and baseline "
                         "would be compared with new ones made otherwise. Pass the same settings to resume that table, "
                         "or another --out for a new one")


def run_cells(args, out: Path, todo: list, bases: dict, deadline: float) -> dict:
    """Run the unfinished cells of ``todo``, up to ``args.concurrent`` at once, in ``todo``'s order;
    returns ``{cell: status}``. The first cell started for a model scores its baseline; while that
    one runs, the model's other cells skip it (a failed baseline cell hands the task to the next one
    started). A cell starts only before ``deadline`` and gets what is left of it as its timeout."""
    status, pending, running = {}, [], {}  # running: future -> (cell, scores the baseline)
    width = max(1, args.concurrent)

    def tag(c):
        return f"[{todo.index(c) + 1}/{len(todo)}] {Path(c[0]).name} {c[1]} W{c[2]} {c[3]}" + (f" seed {c[4]}" if c[4] else "")

    for c in todo:
        if (cell_dir(out, *c) / "ptq.json").exists():
            made_from = json.loads((cell_dir(out, *c) / "ptq.json").read_text()).get("source_model")
            if made_from not in (None, str(Path(c[0]).resolve())):
                raise SystemExit(f"{cell_dir(out, *c)} holds a cell of {made_from}, not of {c[0]}: give each model "
                                 "its own folder name, or another --out")
            status[c] = "done"
            print(f"{tag(c)}: finished before, skipped")
        else:
            pending.append(c)
    with ThreadPoolExecutor(max_workers=width) as pool:  # threads wait on the child processes
        while pending or running:
            while pending and len(running) < width:
                c = pending.pop(0)
                left = deadline - time.time()
                if left <= 0:
                    status[c] = "not run (budget)"
                    continue
                need_base = bases.get(Path(c[0]).name) is None and not any(b and cell[0] == c[0] for cell, b in running.values())
                d = cell_dir(out, *c)
                running[pool.submit(run, ptq_cmd(args, *c, d, need_base), d.with_name(d.name + ".log"), left)] = (c, need_base)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                c, need_base = running.pop(f)
                rc, secs = f.result()
                status[c] = "done" if rc == 0 else ("timeout (budget)" if rc == "timeout" else f"failed (exit {rc})")
                print(f"{tag(c)}: {status[c]} in {secs:.0f} s", flush=True)
                if rc == 0 and need_base:
                    bases[Path(c[0]).name] = keep_baseline(out, c[0], cell_dir(out, *c))
                write_summary(out, todo, status, bases)  # kept up to date: an outer kill loses no finished cell
    return status


def write_summary(out: Path, todo: list, status: dict, bases: dict) -> list[dict]:
    """``OUT/summary.json`` of the cells with a status so far, in ``todo``'s order; returns its rows."""
    rows = [collect(cell_dir(out, *c), *c, status[c]) for c in todo if c in status]
    (out / "summary.json").write_text(json.dumps({"rows": rows, "baselines": bases, "argv": sys.argv}, indent=1))
    return rows


def check_options(p: argparse.ArgumentParser, args, todo: list) -> None:
    """Refuse, before any cell runs, what would fail every cell or run none: each distinct cell's `adahop ptq`
    options as that command checks them, a --data that does not exist, and a budget or concurrency below one."""
    from adahop.ptq.cli import check_options as check_ptq

    if not args.budget_s > 0:
        p.error(f"--budget-s {args.budget_s}: must be > 0 (no cell starts after it)")
    if args.concurrent < 1:
        p.error(f"--concurrent {args.concurrent}: must be >= 1 (cells at once)")
    if args.data != "default" and not args.data.startswith("hf:") and not Path(args.data).exists():
        p.error(f"--data {args.data} does not exist; pass a folder of `adahop data prepare`, 'default' or text files")
    for argv in dict.fromkeys(tuple(ptq_cmd(args, "MODEL", *c[1:], Path("OUT"))[4:]) for c in todo):
        try:
            check_ptq(list(argv))
        except ValueError as e:
            p.error(f"every such cell would fail: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a prepared data folder (calibration: train split; perplexity: val split)")
    p.add_argument("--models", help="comma-separated `adahop train` run folders (or transformers folders)")
    p.add_argument("--out", required=True, help="results folder (resumable)")
    p.add_argument("--budget-s", type=float, default=5400, help="start no cell after this many seconds (default 5400)")
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--methods", default=",".join(INT_METHODS))
    p.add_argument("--no-mx", action="store_true", help="skip the MXFP4 W4 cells")
    p.add_argument("--repeat-seeds", default="", help="comma-separated --seed values (> 0) to run the int cells of gptq, "
                   "rht-gptq and harp-gptq at --repeat-bits again with (after the others; summary.md gives their spread)")
    p.add_argument("--repeat-bits", default="2", help="the widths whose cells --repeat-seeds repeats, of --bits (default 2)")
    p.add_argument("--calib-tokens", type=int, default=131072)
    p.add_argument("--harp-steps", type=int, default=1200)
    p.add_argument("--theta-format", default="fp16", choices=("fp16", "int8"),
                   help="how the HARP cells store Θ (adahop ptq --theta-format; give the table its own --out)")
    p.add_argument("--group-size", type=int, default=None, help="--group-size of the int cells (default: adahop ptq's, 128)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrent", type=int, default=1,
                   help="cells at once (default 1): small models leave a GPU mostly idle, as the training launchers find")
    p.add_argument("--smoke", action="store_true", help="CPU: llama-tiny (trained here unless --models), short settings")
    p.add_argument("--dry-run", action="store_true", help="check the options and list the cells, run none (the models "
                   "need not exist yet: a GPU call checks its table before it trains them)")
    args = p.parse_args(argv)
    out = Path(args.out)
    t0 = time.time()
    deadline = t0 + args.budget_s
    if args.smoke and args.dry_run:
        p.error("--smoke trains a model and runs cells; --dry-run runs none: give one of them")
    if args.smoke:
        out.mkdir(parents=True, exist_ok=True)
        args.device = "cpu" if args.device == "auto" else args.device
        args.calib_tokens = min(args.calib_tokens, 4096)
        args.harp_steps = min(args.harp_steps, 40)
        args.eval_batches = 8 if args.eval_batches is None else args.eval_batches
        args.group_size = 64 if args.group_size is None else args.group_size
        if not args.models:
            args.models = smoke_model(args, out)
    if not args.models:
        p.error("--models is required (or --smoke)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    names = [Path(m).name for m in models]
    if len(set(names)) < len(names):  # their cells would share OUT/<name>/ and one would be shown as the other
        twice = sorted({n for n in names if names.count(n) > 1})
        p.error(f"--models: {', '.join(twice)} is the folder name of more than one model; each model's cells go to "
                "OUT/<folder name>/, so rename or link them under distinct names")
    if not args.data and args.dry_run:
        p.error("--dry-run needs --data (the models may not exist yet to name theirs)")
    if not args.data:
        args.data = json.loads((Path(models[0]) / "config.json").read_text()).get("adahop", {}).get("data_dir")
        if not args.data:
            p.error("--data is required for a model that is not an `adahop train` run folder")
    try:
        bits = [int(b) for b in args.bits.split(",")]
    except ValueError:
        p.error(f"--bits {args.bits!r}: give comma-separated widths of 2, 3 and 4")
    methods = [m.strip() for m in args.methods.split(",")]
    from adahop.ptq.names import METHODS  # torch-free
    if not set(bits) <= {2, 3, 4} or not set(methods) <= set(METHODS):
        p.error(f"--bits {args.bits} --methods {args.methods}: widths are 2, 3 and 4, methods {', '.join(METHODS)}")
    try:
        seeds = sorted({int(x) for x in args.repeat_seeds.split(",") if x.strip()})
    except ValueError:
        p.error(f"--repeat-seeds {args.repeat_seeds!r}: give comma-separated integers, e.g. 1,2")
    try:
        repeat_bits = [int(b) for b in args.repeat_bits.split(",") if b.strip()]
    except ValueError:
        p.error(f"--repeat-bits {args.repeat_bits!r}: give comma-separated widths, e.g. 3,4")
    if any(sd <= 0 for sd in seeds) or (seeds and not set(repeat_bits) <= set(bits)) or (seeds and not repeat_bits):
        p.error(f"--repeat-seeds {args.repeat_seeds}: the seeds must be > 0 (seed 0 is the table's own run) and the "
                f"repeats are cells of --repeat-bits {args.repeat_bits}, so --bits ({args.bits}) must include those widths")
    todo = cells(models, bits, methods, not args.no_mx, seeds, repeat_bits)
    check_options(p, args, todo)
    if args.dry_run:
        print(f"{len(todo)} cells, none run (--dry-run):")
        for c in todo:
            print(" ", c)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    check_settings(out, args)
    bases = {Path(m).name: baseline(out, m) for m in models}
    rows = write_summary(out, todo, run_cells(args, out, todo, bases, deadline), bases)
    md = summarize(out, rows, bases)
    (out / "summary.md").write_text(md)
    print(md)
    print(f"wrote {out / 'summary.json'} and {out / 'summary.md'} ({time.time() - t0:.0f} s)")
    return 0 if all(r["status"] == "done" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
