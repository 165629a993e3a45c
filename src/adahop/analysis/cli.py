"""`adahop analyze`: train a model in BF16 (or continue a run from its checkpoint) with every linear
layer hooked, and write the outlier-pattern census, the paper's figures and the plan they imply.

    adahop analyze --model llama-60m --data default --steps 300 --out analysis/NAME
    adahop analyze --run runs/NAME --steps 50 --out analysis/NAME
    adahop analyze --synthetic --out analysis/synthetic

Step numbers in the outputs count the analysis's own optimizer steps (1 … --steps); with --run
they are steps after the checkpoint. The model trains exactly as `adahop train --recipe bf16`
does (same optimizer, master-weight storage, schedule and data order; BF16 autocast on CUDA, FP32 on
CPU), unconverted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..hadamard import block_hadamard
from ..optim import convert_master_weights
from ..optim.master import unpack_state_dict
from ..patterns import Plan, pattern_stats
from ..recipes import get_recipe
from ..recipes.spec import CalibSpec
from ..train.config import TrainConfig, config_from
from ..train.export import read_run_section, runs_inside
from ..train.setup import build_optimizer, lr_at, make_model, make_streams, resolve_data, resolve_device
from ..utils import unreadable_weights
from . import census as cs
from . import figures, report
from .foid import foid_markdown, foid_on_captures
from .scale_range import range_hits_on_captures, range_markdown
from .options import NOT_TRAIN_FLAGS, add_arguments
from .recorder import PatternRecorder, linear_names

__all__ = ["add_arguments", "run", "bf16_step", "record_steps", "vote_window", "window_sentence", "pick_layer", "capture_layers"]

def record_steps(total: int, every: int | None, explicit: list[int] | None) -> list[int]:
    """The 1-based steps to record: ``1, every, 2·every, …, total`` ∪ ``explicit`` (every step
    when neither is given), within ``1 … total``.

    Raises:
        ValueError: ``every`` < 1, or an ``explicit`` step outside ``1 … total`` (it would be dropped silently).
    """
    if every is not None and every < 1:
        raise ValueError(f"--record-every must be >= 1, got {every}")
    outside = sorted(x for x in explicit or [] if not 1 <= x <= total)
    if outside:
        raise ValueError(f"--record-steps {','.join(map(str, outside))}: outside the run's steps 1..{total} (--steps); "
                         f"drop them or raise --steps")
    if every is None and not explicit:
        every = 1
    s = set(explicit or [])
    if every:
        s |= {1, *range(every, total + 1, every), total}
    return sorted(x for x in s if 1 <= x <= total)


def vote_window(total: int, calib_steps: int) -> list[int]:
    """The optimizer steps the vote covers: ``1 … min(calib_steps, total)``, the steps training's
    calibration votes over (`specs/adahop.md` §2.4). Every one of them is recorded.

    Raises:
        ValueError: ``calib_steps`` < 1.
    """
    if calib_steps < 1:
        raise ValueError(f"--calib-steps must be >= 1, got {calib_steps}")
    return list(range(1, min(calib_steps, total) + 1))


def window_sentence(window: list[int], calib_steps: int, calibration: dict) -> str:
    """The census's statement of what it voted over (census.md, report.md)."""
    gates = [f"{k} {calibration[k]}" for k in ("floor", "min_peak") if calibration.get(k) is not None]
    short = (f" (--steps ended the window before --calib-steps {calib_steps})" if window[-1] < calib_steps else "")
    return (f"Voted over optimizer steps {window[0]}–{window[-1]}{short}, every step recorded, one observation per "
            f"layer and tensor per step (the first micro-batch); detector rule {calibration['rule']}, "
            f"τ = {calibration['threshold']}" + (f", gates: {', '.join(gates)}" if gates else ", no gates") + ".")


def pick_layer(names: list[str], requested: str | None) -> str:
    """``requested`` (a full name or a unique suffix), else the middle-depth down_proj (or the middle layer)."""
    if requested:
        hits = [n for n in names if n == requested] or [n for n in names if n.endswith(requested)]
        if len(hits) != 1:
            raise ValueError(f"--layer {requested!r} matches {len(hits)} layers; use one of: {', '.join(names)}")
        return hits[0]
    downs = [n for n in names if n.endswith(("down_proj", ".w2", ".fc2", "c_proj"))]
    return downs[len(downs) // 2] if downs else names[len(names) // 2]


def capture_layers(names: list[str], n: int, chosen: str) -> list[str]:
    """All layers when there are at most ``n``, else ``n`` evenly spread ones; ``chosen`` always."""
    if len(names) <= n:
        return list(names)
    idx = {round(i * (len(names) - 1) / max(n - 1, 1)) for i in range(n)}
    picked = [names[i] for i in sorted(idx)]
    return picked if chosen in picked else [*picked, chosen]


def run(args: argparse.Namespace) -> dict[str, Path]:
    """Run `adahop analyze`; returns ``{output name: path}``."""
    from ..utils import check_out_path

    check_out_path(args.out, "--out", folder=True)  # before mkdir: "" or " " made the working directory or " " the folder
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.synthetic:
        return _run_synthetic(args, out)
    return _run_model(args, out)


# ---- synthetic Figure 3 -------------------------------------------------------------------------


def _run_synthetic(args, out: Path) -> dict[str, Path]:
    from .synthetic import figure3_table, to_csv, to_markdown

    seeds = tuple(int(s) for s in args.synthetic_seeds.split(",") if s.strip())
    n = args.synthetic_size
    rows = figure3_table(m=n, k=n, n=n, n_out=args.synthetic_n_out, scale=args.synthetic_scale, seeds=seeds,
                         oe_rank=args.oe_rank)
    head = (f"# Synthetic Figure 3: GEMM error per strategy and pattern pair\n\n{n}×{n}·{n}×{n}, {args.synthetic_n_out} "
            f"outlier rows/columns ×{args.synthetic_scale:g}, OE rank {args.oe_rank}, seeds {list(seeds)} "
            "(protocol of `specs/adahop.md` §10.3). Relative error ‖Ĉ − AB‖_F / ‖AB‖_F.\n\n")
    paths = {"md": out / "figure3_synthetic.md", "csv": out / "figure3_synthetic.csv", "png": out / "figure3_synthetic.png"}
    paths["md"].write_text(head + to_markdown(rows))
    paths["csv"].write_text(to_csv(rows))
    figures.plot_synthetic({r.pair: r.errors for r in rows}, {r.pair: r.assigned(args.table) for r in rows}, paths["png"],
                           title=f"Synthetic GEMM error ({n}³, outliers ×{args.synthetic_scale:g}); ★ = {args.table} choice")
    print(paths["md"].read_text())
    print(f"wrote {out}: " + ", ".join(p.name for p in paths.values()))
    return paths


# ---- model analysis -----------------------------------------------------------------------------


def bf16_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, x: torch.Tensor, y: torch.Tensor,
              device: torch.device, autocast) -> float:
    """One optimizer step of the unconverted model as `adahop train --recipe bf16` takes it: ``x``, ``y``
    int64 ``[batch, seq_len]`` split into ``cfg.grad_accum`` micro-batches, cross-entropy, ``--grad-clip``,
    then the step. Returns the step's mean loss (float). Hooks on the model see every backward. Raises
    nothing of its own (the model's and optimizer's errors pass through). Source: ours, the BF16 step of
    `adahop train` that the census's calibration window observes (`specs/adahop.md` §2.3)."""
    micro, loss_sum = cfg.batch_size // cfg.grad_accum, 0.0
    for xm, ym in zip(x.split(micro), y.split(micro)):
        with autocast:
            logits = model(input_ids=xm.to(device), use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ym.to(device).flatten()) / cfg.grad_accum
        loss.backward()
        loss_sum += loss.item()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum


def _config_from_args(args) -> TrainConfig:
    return config_from(args, TrainConfig, recipe="bf16", out=str(args.out), calib_steps=args.calib_steps)


def _load_run(args) -> tuple[TrainConfig, Path, Path]:
    """(the run's TrainConfig with --device applied, its data folder, its newest checkpoint)."""
    run_dir = Path(args.run)
    given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(TrainConfig)
             if f.name not in ("device", "steps", *NOT_TRAIN_FLAGS) and hasattr(args, f.name) and getattr(args, f.name) != f.default]
    if given:  # the run's own config is used: such a flag would be silently ignored
        raise ValueError(f"--run {run_dir} uses the run's own model, data and optimizer settings; drop {', '.join(given)} "
                         "(of the training flags only --device and --steps, the analysis's own steps, apply with --run)")
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists() and (runs := runs_inside(run_dir)):
        raise ValueError(f"--run {run_dir} holds {len(runs)} runs (a folder of runs, such as `adahop compare`'s: one per recipe), not one "
                         f"run; pass one of them: {', '.join(str(r) for r in runs)}")
    if not cfg_path.exists():
        raise ValueError(f"--run {run_dir}: no config.json (is it a run folder of `adahop train`?)")
    section = read_run_section(run_dir)
    if not section or "config" not in section or "data_dir" not in section:
        raise ValueError(f"--run {run_dir}: config.json has no 'adahop' section with 'config' and 'data_dir'")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in section["config"].items() if k in known})
    cfg = dataclasses.replace(cfg, device=args.device, resume=False, reschedule=False)  # a run resumed --reschedule
    cks = sorted((run_dir / "checkpoints").glob("step_*"))
    if cks and not (cks[-1] / "model.safetensors").exists() and any(cks[-1].glob("*.distcp")):
        raise ValueError(f"--run {run_dir}: its newest checkpoint ({cks[-1].name}) is a sharded one of --parallel ddp/fsdp "
                         "(torch.distributed.checkpoint), which analyze does not read; resume the run in one process "
                         "for a step (adahop train --out RUN --resume --steps N+1) to write a single-file checkpoint")
    if not cks or not (cks[-1] / "model.safetensors").exists():
        raise ValueError(f"--run {run_dir}: no checkpoints/step_*/model.safetensors")
    data_dir = Path(section["data_dir"])
    if not (data_dir / "manifest.json").is_file():
        raise ValueError(f"--run {run_dir}: its prepared data {data_dir} is not there"
                         + (" (a path relative to the folder the run was started from)" if not data_dir.is_absolute() else "")
                         + f"; run analyze from where the run trained, or prepare the same data into {data_dir}")
    from ..train.setup import prepared_data_changes

    if changes := prepared_data_changes(run_dir, data_dir):  # another corpus or tokenizer under the recorded name
        raise ValueError(f"--run {run_dir}: {data_dir} is not the data the run trained on ({'; '.join(changes)}); "
                         "prepare the run's own data there again, or run analyze where the run trained")
    return cfg, data_dir, cks[-1]


def _load_checkpoint(ck: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int | None]:
    """Load the master weights (packed FP8/FP4 ones as stored) and optimizer state of a checkpoint
    (`train/checkpoint.py`) into an unconverted model; returns its step and the step its lr schedule ends at
    (``schedule_steps``: after a resume that kept the run's schedule it is not config.json's --steps; None for a
    checkpoint older than that key)."""
    from safetensors.torch import load_file

    with unreadable_weights(ck / "model.safetensors", "the checkpoint's weights"):  # a truncated file: a clear error
        weights = unpack_state_dict(load_file(ck / "model.safetensors"), model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied weights come back through the embedding
    if missing or unexpected:
        raise ValueError(f"checkpoint {ck} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    meta = json.loads((ck / "state.json").read_text()) if (ck / "state.json").exists() else {}
    if (ck / "optimizer.safetensors").exists() and "param_groups" in meta:
        state: dict = {}
        with unreadable_weights(ck / "optimizer.safetensors", "the checkpoint's optimizer states"):
            saved = load_file(ck / "optimizer.safetensors")
        for key, v in saved.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = v
        for key, v in meta.get("scalars", {}).items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = v
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return int(meta.get("step", int(ck.name.split("_")[-1]))), meta.get("schedule_steps")


def _run_model(args, out: Path) -> dict[str, Path]:
    # ---- setup ---------------------------------------------------------------------------------
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.run:
        cfg, data_dir, ck = _load_run(args)
    else:
        cfg, ck = _config_from_args(args), None
        data_dir = resolve_data(cfg)
    device = resolve_device(cfg.device)
    train_s, _ = make_streams(cfg, data_dir, val=False)  # analyze never validates
    model = make_model(cfg, train_s.manifest, device)
    convert_master_weights(model, cfg.master_weights)  # --master-weights, as `adahop train` stores them
    opt = build_optimizer(cfg, model)
    start, schedule = _load_checkpoint(ck, model, opt) if ck is not None else (0, None)
    schedule = schedule or cfg.steps  # the schedule `adahop train --resume` continues
    steps = args.steps
    detector = CalibSpec(table=args.table, steps=args.calib_steps, threshold=args.threshold, rule=args.rule,
                         floor=args.floor, min_peak=args.min_peak)
    detector.validate("adahop analyze (--calib-steps, --rule, --threshold, --floor, --min-peak)")
    explicit = [int(s) for s in args.record_steps.split(",") if s.strip()] if args.record_steps else None
    figure_steps = record_steps(steps, args.record_every, explicit)
    window = vote_window(steps, args.calib_steps)
    recorded = sorted(set(figure_steps) | set(window))
    names = linear_names(model)
    chosen = pick_layer(names, args.layer)
    captured = capture_layers(names, args.gain_layers, chosen)
    rec = PatternRecorder(model, layers=names, threshold=args.threshold, rule=args.rule, floor=args.floor,
                          min_peak=args.min_peak, capture=captured, capture_tokens=args.gain_tokens,
                          dump_dir=out / "dumps" if args.dump else None)
    use_bf16 = device.type == "cuda"  # as `adahop train`: BF16 autocast on CUDA, FP32 on CPU
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    losses: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    # ---- TRAINING SECTION (BF16, unconverted; patterns recorded at the chosen steps) -------------
    todo = set(recorded)
    for i in tqdm(range(steps), desc="analyze", disable=None, dynamic_ncols=True):
        step, s = start + i, i + 1  # global optimizer step (lr, data); analysis step (records)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step, schedule)
        if s in todo:
            rec.start(s, capture=s == recorded[-1])
        x, y = train_s.batch(step)
        loss_sum = bf16_step(model, opt, cfg, x, y, device, autocast)
        if s in todo:
            rec.stop()
        losses.append((s, loss_sum))
    rec.close()
    seconds = time.perf_counter() - t0
    # ---- analysis -------------------------------------------------------------------------------
    _, in_window = rec.history(window)
    voted = cs.vote(in_window, len(window))
    rsteps, history = rec.history(figure_steps)  # the figure and the stability: the --record-every sample
    census_ = cs.census(voted)
    stab = cs.stability(history, voted)
    calibration = {"steps": [window[0], window[-1]], "observation": "first micro-batch of each optimizer step",
                   "rule": args.rule, "threshold": args.threshold, "floor": args.floor, "min_peak": args.min_peak,
                   "source": "adahop analyze"}
    plan = Plan.from_patterns(voted, args.table, calibration=calibration)
    # the layer shapes, so that training with this plan refuses a model of other widths (same layer names)
    mods = dict(model.named_modules())
    plan.shapes = {n: [mods[n].in_features, mods[n].out_features] for n in plan.layers if n in mods}
    window_text = window_sentence(window, args.calib_steps, calibration)
    q = get_recipe(f"adahop-{args.table}").fprop.a  # the quantizer settings training would use
    gain_rows = cs.iht_gain(rec.captures, patterns=rec.patterns_at(rec.capture_step), oe_rank=args.oe_rank,
                            scale_rule=q.scale_rule, max_scale_range=q.max_scale_range)
    by_pair = cs.gain_by_pair(gain_rows, args.table)
    # ---- outputs --------------------------------------------------------------------------------
    paths = {k: out / v for k, v in dict(census_md="census.md", census_csv="census.csv", patterns="patterns.csv",
                                         records="records.csv", plan="plan.json", over_steps="patterns_over_steps.png",
                                         by_depth="patterns_by_depth.png", gain_png="iht_gain.png",
                                         gain_csv="iht_gain.csv", foid="foid.md", scale_range="scale_range.md", report="report.md",
                                         meta="analysis.json").items()}
    what = f"run {Path(args.run).name}" if args.run else f"{Path(cfg.model_config).stem if cfg.model_config else cfg.model} on {cfg.data}"
    paths["census_md"].write_text(report.census_markdown(census_, table=args.table, window=window_text,
                                                         title=f"Outlier-pattern pair census — {what}"))
    paths["census_csv"].write_text(report.census_csv(census_))
    paths["patterns"].write_text(report.patterns_csv(voted, stab, plan.layers))
    paths["records"].write_text(report.records_csv(rec.records))
    plan.save(paths["plan"])
    figures.plot_patterns_over_steps(rsteps, history, paths["over_steps"], calib_steps=window[-1],
                                     title=f"Outlier pattern of X, W, ∇Y per layer over training — {what}")
    figures.plot_patterns_by_depth(voted, paths["by_depth"], title=f"Voted outlier pattern by depth — {what}")
    figures.plot_iht_gain(by_pair, paths["gain_png"], rows=gain_rows,
                          title=f"Error reduction vs plain MXFP4 on real GEMMs (step {rec.capture_step}) — {what}")
    paths["gain_csv"].write_text(report.gain_csv(gain_rows, args.table))
    foid_rows = foid_on_captures(rec.captures, rank=args.oe_rank, scale_rule=q.scale_rule, max_scale_range=q.max_scale_range)
    paths["foid"].write_text(f"# FOID against the exact top-k on real GEMMs (step {rec.capture_step}) — {what}\n\n"
                             "`adahop.analysis.foid`: OE-Left on dgrad, OE-Right on wgrad and fprop, whatever the plan "
                             "assigns; OE rank min(rank, outer dim / 4); FOID's prefix 64.\n\n" + foid_markdown(foid_rows))
    msr = q.max_scale_range if q.max_scale_range is not None else 8
    paths["scale_range"].write_text(
        f"# Blocks raised by the exponent-range limit (max_scale_range {msr}) on real GEMMs (step {rec.capture_step}) — {what}\n\n"
        "`adahop.analysis.scale_range`: both operands of every captured GEMM, blocks of 32 along Kc after IHT-32, "
        f"scale rule {q.scale_rule}.\n\n"
        + range_markdown(range_hits_on_captures(rec.captures, scale_rule=q.scale_rule, max_scale_range=msr), msr))
    paths["tensor_3d"] = _plot_3d(rec.captures, chosen, out, what)
    figs = {"census (markdown)": "census.md", "census (CSV)": "census.csv",
            "patterns over steps (Figures 4/8)": "patterns_over_steps.png", "patterns by depth": "patterns_by_depth.png",
            "IHT/OE error reduction on real GEMMs (Figure 3, right)": "iht_gain.png", "IHT/OE per GEMM (CSV)": "iht_gain.csv",
            "FOID against the exact OE top-k per GEMM": "foid.md",
            "blocks raised by the FP8 fold's exponent-range limit": "scale_range.md",
            f"3-D tensors of {chosen} and left vs right Hadamard (Figure 2)": paths["tensor_3d"].name,
            f"plan ({args.table}; `adahop train --plan plan.json`)": "plan.json",
            "voted patterns, stability and strategies per layer": "patterns.csv",
            "every recorded tensor (step, pattern, cv_row, cv_col, row_peak, col_peak)": "records.csv"}
    start_txt = f"checkpoint {ck.name} of {args.run} (step {start}); " if ck is not None else ""
    info = {"title": f"adahop analyze — {what}", "lines": [
        f"{start_txt}model {cfg.model_config or cfg.model}, {len(names)} linear layers (lm_head excluded), "
        f"data {data_dir}", f"{steps} training steps as `adahop train --recipe bf16` (unquantized GEMMs; "
        f"{'BF16 autocast' if use_bf16 else 'FP32'} on {device}), batch {cfg.batch_size} × seq {cfg.seq_len}, "
        f"lr {cfg.lr}; {seconds:.0f} s; loss {losses[0][1]:.3f} → {losses[-1][1]:.3f}",
        window_text, f"{len(rsteps)} steps in the patterns-over-steps figure and the stability ({_steps_text(rsteps)})",
        f"iht_gain: {len(rec.captures)} layers captured at step {rec.capture_step} (first {args.gain_tokens} tokens), "
        f"OE rank min({args.oe_rank}, outer dim / 4), quantizer of adahop-{args.table}"]}
    paths["report"].write_text(report.report_markdown(info=info, census_=census_, voted=voted, stab=stab,
                                                      mean_stab=cs.mean_stability(stab), gain_by_pair=by_pair,
                                                      figures=figs, table=args.table))
    meta = {"args": {k: v for k, v in vars(args).items() if not callable(v)}, "config": cfg.to_dict(),
            "data_dir": str(data_dir), "checkpoint": str(ck) if ck else None, "start_step": start,
            "recorded_steps": recorded, "figure_steps": rsteps, "vote_window": [window[0], window[-1]],
            "captured_layers": captured, "layer_3d": chosen, "losses": losses}
    paths["meta"].write_text(json.dumps(meta, indent=1, default=str))
    print(paths["census_md"].read_text())
    print("mean stability: " + ", ".join(f"{cs.TENSOR_LABELS[t]} {100 * v:.1f}%" for t, v in cs.mean_stability(stab).items()))
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in paths.values())))
    return paths


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}, {steps[1]}, …, {steps[-1]}"


def _plot_3d(captures: dict[str, dict[str, torch.Tensor]], chosen: str, out: Path, what: str) -> Path:
    """``tensor_3d_<layer>.png``: W, X, ∇Y of ``chosen``, then |X|, |H·X|, |X·H| of the most
    column-outlier X among the captured layers (Figure 2)."""
    c = captures[chosen]
    short = figures.short_name(chosen)
    panels = [(f"|W| {short}  [N×K]", c["w"], ("out channel (N)", "in channel (K)")),
              (f"|X| {short}  [T×K]", c["x"], ("token (T)", "in channel (K)")),
              (f"|∇Y| {short}  [T×N]", c["dy"], ("token (T)", "out channel (N)"))]
    # the X with the strongest column pattern (ties: the chosen layer)
    name = max(captures, key=lambda n: (pattern_stats(captures[n]["x"])[1], n == chosen))
    xc = captures[name]["x"]
    xc = xc[: xc.shape[0] // 32 * 32, : xc.shape[1] // 32 * 32]
    cv_col = pattern_stats(xc)[1]
    lbl = ("token (T)", "in channel (K)")
    panels += [(f"|X| {figures.short_name(name)} (cv_col {cv_col:.1f})", xc, lbl),
               ("|H·X|: left Hadamard (mixes rows)\ncolumn outliers stay", block_hadamard(xc, block_size=32, axis=0), lbl),
               ("|X·H|: right Hadamard (mixes columns)\noutliers spread over their 32-block", block_hadamard(xc, block_size=32, axis=1), lbl)]
    path = out / f"tensor_3d_{chosen}.png"
    figures.plot_tensor_3d(panels, path, title=f"Magnitudes (max-pooled to ≤128×128) — {what}")
    return path
