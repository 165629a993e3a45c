"""`adahop compare`: the same run under several recipes, then one table and two plots.

Each recipe trains in its own process (same data, seed, model and hyper-parameters), so its
peak memory and speed are its own and one failing recipe does not take the others down.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from ..plots import plot_compare
from ..recipes import get_recipe
from ..utils import read_json
from .checkpoint import latest_checkpoint
from .config import TrainConfig
from .metrics import read_metrics
from .setup import ERROR_FILE, RESULT_NEUTRAL_KEYS, resolve_data, settings_diff

__all__ = ["compare", "format_table", "COLUMNS"]

COLUMNS = ("recipe", "final val loss", "gap to bf16 %", "val bpb", "tokens/s", "peak memory MB", "saved for bwd MB (vs plain nn.Linear)",
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
            rows.append([name, "failed", "", "", "", "", s["error"][:160], ""])
            continue
        vl = s.get("final_val_loss")
        gap = f"{100 * (vl - base) / base:+.2f}" if (base and vl is not None) else "-"
        tps = s.get("tok_per_s")
        mem = s.get("peak_memory_bytes")
        saved = f"{s['saved_bytes'] / 2**20:.2f} ({s['saved_bytes_bf16'] / 2**20:.2f})" if s.get("saved_bytes_bf16") else "-"
        if s.get("unquantizable_layers"):  # those layers ran BF16 GEMMs: the row is partly BF16's result
            name = f"{name} ({s['unquantizable_layers']} layers BF16: shape)"
        rows.append([name, f"{vl:.4f}" if vl is not None else "-", gap, f"{s['final_val_bpb']:.4f}" if s.get("final_val_bpb") else "-",
                     f"{tps:,.0f}" if tps else "-", f"{mem / 2**20:,.0f}" if mem else "-", saved,
                     f"{s['bytes_per_param']:.2f}" if s.get("bytes_per_param") else "-"])
    return rows


def write_csv(path: Path, rows: list[list[str]]) -> None:
    """Write ``rows`` (lists of cell strings, as :func:`format_table` makes) to ``path`` as CSV under the
    header :data:`COLUMNS`; cells holding a comma (``1,663`` tokens/s) are quoted. Raises OSError
    for a path that cannot be written."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([list(COLUMNS), *rows])


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def compare(recipes: list[str], cfg: TrainConfig, out: Path) -> dict[str, dict]:
    """Train ``cfg`` under each recipe into ``out/<recipe>``; write compare.md, compare.csv,
    compare.json, loss_curves.png and loss_diff.png into ``out``; print the table.

    Run again with the same ``out`` and settings, it reuses the recipes that finished and resumes
    the ones that were interrupted (from their last checkpoint).

    Raises:
        ValueError: no recipes or an unknown recipe name, or a run in ``out/<recipe>`` made with other
            settings (listed; its results would not be comparable) — all before anything trains.
    """
    if not recipes:
        raise ValueError("compare: no recipes given; pass --recipes bf16,adahop-lv2,...")
    if cfg.parallel != "none":
        raise ValueError(f"--parallel {cfg.parallel}: adahop compare runs each recipe as one process; for data-parallel "
                         "runs launch `torchrun ... -m adahop train --recipe R --out OUT/R` per recipe")
    for r in recipes:
        get_recipe(r)
    out = Path(out)
    keys = [f.name for f in dataclasses.fields(cfg) if f.name not in (*RESULT_NEUTRAL_KEYS, "recipe")]
    for r in recipes:  # every earlier run must be this comparison's, or its numbers would be mixed in
        diff = settings_diff(dataclasses.replace(cfg, recipe=r), out / r, keys)
        if diff:
            raise ValueError(f"compare: {out / r} holds a {r} run with other settings ({'; '.join(diff)}); its results "
                             f"would not be comparable. Use a new --out, or delete {out / r}")
    out.mkdir(parents=True, exist_ok=True)
    data_dir = resolve_data(cfg)  # prepare once, before the recipes run
    summaries, curves = {}, {}
    for r in recipes:
        run_cfg = dataclasses.replace(cfg, recipe=r, out=str(out / r), data=str(data_dir))
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
        proc = subprocess.run([sys.executable, "-m", "adahop", "train", *_run_args(run_cfg)])
        if proc.returncode != 0 or not summary_path.exists():
            err = out / r / ERROR_FILE
            why = err.read_text().strip().removeprefix("adahop train: error: ") if err.exists() else f"see {out / r}"
            summaries[r] = {"error": f"{why} (exit code {proc.returncode})"}
            continue
        summaries[r] = read_json(summary_path, "the run summary")
        curves[r] = read_metrics(out / r / "metrics.jsonl")
    rows = format_table(summaries)
    md = _markdown(rows)
    (out / "compare.md").write_text(md + "\n")
    write_csv(out / "compare.csv", rows)
    (out / "compare.json").write_text(json.dumps(summaries, indent=1))
    plot_compare(curves, out, title=f"{cfg.model}, {cfg.steps} steps x {cfg.batch_size * cfg.seq_len} tokens")
    print(md)
    return summaries
