"""`adahop compare`: the same run under several recipes, then one table and two plots.

Each recipe trains in its own process (same data, seed, model and hyper-parameters), so its
peak memory and speed are its own and one failing recipe does not take the others down. Ctrl-C
reaches the running recipe's process once per press, through this one: the first makes it finish
its step and write a checkpoint, a second aborts it at once (its last complete checkpoint stays);
either way the comparison stops and says how to continue.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..plots import plot_compare
from ..recipes import get_recipe
from ..utils import folder_locked, read_json
from .checkpoint import latest_checkpoint
from .config import TrainConfig
from .metrics import read_metrics
from .setup import ERROR_FILE, RESULT_NEUTRAL_KEYS, data_changes, resolve_data, settings_diff

__all__ = ["compare", "format_table", "COLUMNS", "Interrupted"]


class Interrupted(Exception):
    """Ctrl-C stopped ``adahop compare``; the message says what was kept and how to continue."""

COLUMNS = ("recipe", "final val loss", "gap to bf16 %", "val bpb", "tokens/s", "peak memory MiB", "saved for bwd MiB (vs plain nn.Linear)",
           "weights+state B/param")


def _run_args(cfg: TrainConfig) -> list[str]:
    args = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None or v == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            args.append(flag if v else "--no-" + f.name.replace("_", "-"))
        else:
            args += [flag, str(v)]
    return args


def format_table(summaries: dict[str, dict], baseline: str = "bf16") -> list[list[str]]:
    """Rows of :data:`COLUMNS` from each recipe's summary.json."""
    base = summaries.get(baseline, {}).get("final_val_loss")
    rows = []
    for name, s in summaries.items():
        if "error" in s:
            rows.append([name, f"failed: {_cell(s['error'])}", "-", "-", "-", "-", "-", "-"])  # the reason beside it, no column mislabelled
            continue
        vl = s.get("final_val_loss")
        gap = f"{100 * (vl - base) / base:+.2f}" if (base and vl is not None) else "-"
        tps = s.get("tok_per_s")
        mem = s.get("peak_memory_bytes")
        saved = f"{s['saved_bytes'] / 2**20:.2f} ({s['saved_bytes_bf16'] / 2**20:.2f})" if s.get("saved_bytes_bf16") else "-"
        note = "; ".join(filter(None, [_bf16_note(s), "selective recompute" if s.get("recompute") else ""]))
        if note:  # GEMMs that ran BF16 (the row is partly or wholly BF16's result), or memory traded for time
            name = f"{name} ({note})"
        rows.append([name, f"{vl:.4f}" if vl is not None else "-", gap, f"{s['final_val_bpb']:.4f}" if s.get("final_val_bpb") else "-",
                     f"{tps:,.0f}" if tps else "-", f"{mem / 2**20:,.0f}" if mem else "-", saved,
                     f"{s['bytes_per_param']:.2f}" if s.get("bytes_per_param") else "-"])
    return rows


def _cell(text: str, width: int = 160) -> str:
    """``text`` on one line of at most ``width`` characters, a longer reason cut with a pointer to where it is whole."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width].rstrip() + " … (whole: compare.json, or the run's error.txt)"


def _bf16_note(s: dict) -> str:
    """What of a run's low-precision GEMMs ran BF16 instead, from its summary.json: a plan that never froze
    (an AdaHOP run shorter than its calibration), layers of a shape the recipe cannot quantize, layers of
    the blocks the recipe keeps BF16 (NVFP4's last ones)."""
    parts = ["plan never froze: all BF16"] if s.get("plan_frozen") is False else []
    layers = s.get("bf16_layers") or {}
    shape = sum(str(why).startswith("shape") for why in layers.values()) if layers else s.get("unquantizable_layers") or 0
    if shape:
        parts.append(f"{shape} layers BF16: shape")
    if len(layers) > shape:
        parts.append(f"{len(layers) - shape} layers BF16: the recipe's BF16 blocks")
    return "; ".join(parts)


def write_csv(path: Path, rows: list[list[str]], header=COLUMNS) -> None:
    """Write ``rows`` (lists of cell strings, as :func:`format_table` makes) to ``path`` as CSV under
    ``header`` (default :data:`COLUMNS`); cells holding a comma (``1,663`` tokens/s) are quoted. Raises OSError
    for a path that cannot be written."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([list(header), *rows])


def _markdown(rows: list[list[str]], header=COLUMNS) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]  # a '|' in a cell would split its row
    return "\n".join(lines)


def _run_child(argv: list[str]) -> tuple[int, int]:
    """Run one recipe's ``adahop train`` and wait for it; returns (its exit code, the Ctrl-Cs passed on).

    The child runs in a process group of its own, so that the terminal's Ctrl-C (sent to our group)
    reaches it once, from here: were it in ours it would get each press twice. A hang-up or
    terminate signal is passed on too, then ends this process as it would have without the handler.
    """
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        return subprocess.run(argv).returncode, 0
    proc: subprocess.Popen | None = None
    ctrl_c = 0

    def on_sigint(signum, frame):
        nonlocal ctrl_c
        ctrl_c += 1
        if proc is not None:
            proc.send_signal(signal.SIGINT)

    def on_end(signum, frame):
        if proc is not None:
            proc.send_signal(signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    old = {sig: signal.signal(sig, h) for sig, h in ((signal.SIGINT, on_sigint), (signal.SIGTERM, on_end),
                                                     (signal.SIGHUP, on_end))}
    try:
        proc = subprocess.Popen(argv, process_group=0)
        for _ in range(ctrl_c):  # pressed before the child existed
            proc.send_signal(signal.SIGINT)
        return proc.wait(), ctrl_c
    except BaseException:  # never leave a child of ours training in its own group
        if proc is not None:
            proc.kill()
            proc.wait()
        raise
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _interrupted(out: Path, recipe: str, left: list[str], *, aborted: bool) -> str:
    """What a Ctrl-C left of the comparison, and the command that continues it."""
    ck = latest_checkpoint(out / recipe)
    kept = (f"its {'last complete ' if aborted else ''}checkpoint {ck} is kept" if ck is not None
            else "it had written no checkpoint yet")
    rest = f" and train {', '.join(left)}" if left else ""
    return (f"{'aborted' if aborted else 'interrupted'} during {recipe}: {kept}. Run the same `adahop compare` command "
            f"again (same --out and settings) to resume {recipe}{rest}; the table is written when every recipe is done")


#: settings that reach the calibrating (AdaHOP) recipes only: a fixed-strategy run neither gets nor is compared on them
_CALIB_ONLY_KEYS = ("plan", "calib_steps")


def _recipe_cfg(cfg: TrainConfig, recipe: str) -> TrainConfig:
    """``cfg`` for ``recipe``'s run: ``--plan`` and ``--calib-steps`` go to the recipes that calibrate (AdaHOP)
    only; the others (BF16, the fixed-strategy baselines) would refuse the plan (and fail after the AdaHOP runs
    had trained) and warn that the steps do nothing."""
    if get_recipe(recipe).calibration is not None:
        return dataclasses.replace(cfg, recipe=recipe)
    return dataclasses.replace(cfg, recipe=recipe, **dict.fromkeys(_CALIB_ONLY_KEYS))


def compare(recipes: list[str], cfg: TrainConfig, out: Path, *, eval_tasks: str | None = None,
            eval_limit: int | None = None, task_data: str | None = None, eval_max_length: int | None = None) -> dict[str, dict]:
    """Train ``cfg`` under each recipe into ``out/<recipe>``; write compare.md, compare.csv,
    compare.json, loss_curves.png and loss_diff.png into ``out``; print the table. With
    ``eval_tasks`` (e.g. ``"piqa,hellaswag"``), `adahop eval` scores each trained run on them
    (first ``eval_limit`` documents, data from ``task_data``, a window of ``eval_max_length`` tokens)
    and the table gets their columns (:func:`adahop.eval.compare.eval_columns`); a recipe whose
    evaluation failed gets ``"eval failed"`` cells and an ``eval_error`` in its summary.

    Run again with the same ``out`` and settings, it reuses the recipes that finished and resumes
    the ones that were interrupted (from their last checkpoint).

    Raises:
        ValueError: no recipes, a recipe named twice or an unknown recipe name, or a run in ``out/<recipe>`` made with other
            settings or other data (listed; its results would not be comparable) — all before anything trains.
        Interrupted: Ctrl-C while a recipe trained (it checkpointed, or a second Ctrl-C aborted it).
    """
    if not recipes:
        raise ValueError("compare: no recipes given; pass --recipes bf16,adahop-lv2,...")
    twice = sorted({r for r in recipes if recipes.count(r) > 1})
    if twice:  # one folder per recipe: a second run would resume or reuse the first, not repeat it
        raise ValueError(f"compare: --recipes names {', '.join(twice)} more than once; each recipe trains once, into "
                         f"{Path(out) / twice[0]}: drop the repeat (for another seed, run compare again with --seed and "
                         f"a new --out)")
    if cfg.parallel != "none":
        raise ValueError(f"--parallel {cfg.parallel}: adahop compare runs each recipe as one process; for data-parallel "
                         "runs launch `torchrun ... -m adahop train --recipe R --out OUT/R` per recipe")
    for r in recipes:
        get_recipe(r)
    if eval_tasks:  # a bad task name or window fails now, not after the training
        from ..eval.tasks import get_tasks

        get_tasks(eval_tasks)
        for flag, v in (("--eval-limit", eval_limit), ("--eval-max-length", eval_max_length)):
            if v is not None and v < 1:
                raise ValueError(f"{flag} {v}: must be >= 1")
    out = Path(out)
    keys = [f.name for f in dataclasses.fields(cfg) if f.name not in (*RESULT_NEUTRAL_KEYS, "recipe")]
    fixed = [r for r in recipes if get_recipe(r).calibration is None]
    if cfg.plan and fixed:
        print(f"note: --plan is for the calibrating recipes; {', '.join(fixed)} (fixed strategies) run without it",
              flush=True)
    for r in recipes:  # every earlier run must be this comparison's, or its numbers would be mixed in
        calibrates = get_recipe(r).calibration is not None  # --calib-steps/--plan change nothing else (nor did they)
        diff = settings_diff(_recipe_cfg(cfg, r), out / r, [k for k in keys if calibrates or k not in _CALIB_ONLY_KEYS],
                             definition=True)
        if diff:
            raise ValueError(f"compare: {out / r} holds a {r} run with other settings ({'; '.join(diff)}); its results "
                             f"would not be comparable. Use a new --out, or delete {out / r}")
        changes, fix = data_changes(cfg, out / r)  # by content: an edited source is other data under the same name
        if changes:
            raise ValueError(f"compare: {out / r} holds a {r} run trained on other data ({'; '.join(changes)}); its "
                             f"results would not be comparable. To fix: {fix}; or use a new --out, or delete {out / r}")
    # one compare per --out: two into one folder each trained one recipe and tabled the other's as failed
    with folder_locked(out, "adahop compare"):
        return _train_and_table(recipes, cfg, out, eval_tasks, eval_limit, task_data, eval_max_length)


def _train_and_table(recipes, cfg: TrainConfig, out: Path, eval_tasks, eval_limit, task_data, eval_max_length) -> dict:
    """:func:`compare` once its arguments are checked and ``out`` is locked."""
    data_dir = resolve_data(cfg)  # prepare once, before the recipes run
    summaries, curves = {}, {}
    for r in recipes:
        run_cfg = dataclasses.replace(_recipe_cfg(cfg, r), out=str(out / r), data=str(data_dir))
        summary_path = out / r / "summary.json"
        done = read_json(summary_path, "the run summary") if summary_path.exists() else {}
        if done.get("steps") == cfg.steps and not done.get("interrupted") and (out / r / "model.safetensors").exists():
            print(f"=== {r}: trained earlier in {out / r} with the same settings; its results are reused ===", flush=True)
            summaries[r], curves[r] = done, read_metrics(out / r / "metrics.jsonl")
            continue
        if latest_checkpoint(out / r) is not None:  # an interrupted run of this comparison: continue it
            run_cfg = dataclasses.replace(run_cfg, resume=True)
        print(f"=== {r} ===", flush=True)
        (out / r).mkdir(exist_ok=True)  # so that a run failing on its options still leaves its error.txt there
        code, ctrl_c = _run_child([sys.executable, "-m", "adahop", "train", *_run_args(run_cfg)])
        if ctrl_c or code == 130:
            raise Interrupted(_interrupted(out, r, recipes[recipes.index(r) + 1:], aborted=ctrl_c > 1))
        if code != 0 or not summary_path.exists():
            err = out / r / ERROR_FILE
            first = err.read_text().strip().splitlines()[:1] if err.exists() else []  # the one-line message
            why = first[0].removeprefix("adahop train: error: ").removeprefix("adahop train: ") if first else f"see {out / r}"
            summaries[r] = {"error": f"{why} (exit code {code})"}
            continue
        summaries[r] = read_json(summary_path, "the run summary")
        curves[r] = read_metrics(out / r / "metrics.jsonl")
    rows, header = format_table(summaries), list(COLUMNS)
    if eval_tasks:  # zero-shot columns, and a chance row under them
        from ..eval.compare import eval_columns

        titles, cells, chance, failed = eval_columns(summaries, out, eval_tasks, limit=eval_limit, task_data=task_data,
                                                     device=cfg.device, max_length=eval_max_length)
        for r, why in failed.items():
            summaries[r] = {**summaries[r], "eval_error": why}
        rows = [row + cells.get(r, [""] * len(titles)) for r, row in zip(summaries, rows)]
        header += titles
        rows += [["chance"] + [""] * (len(COLUMNS) - 1) + chance] if chance else []
    md = _markdown(rows, header)
    (out / "compare.md").write_text(md + "\n")
    write_csv(out / "compare.csv", rows, header)
    (out / "compare.json").write_text(json.dumps(summaries, indent=1))
    plot_compare(curves, out, title=f"{cfg.model}, {cfg.steps} steps x {cfg.batch_size * cfg.seq_len} tokens")
    print(md)
    return summaries
