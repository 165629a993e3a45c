"""Zero-shot columns for `adahop compare --eval-tasks`: `adahop eval` of each trained recipe's run folder,
in its own process (as each recipe trains in its own), its results kept in ``<out>/<recipe>/eval.json``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from . import report

__all__ = ["eval_columns", "EVAL_FILE"]

EVAL_FILE = "eval.json"


def _eval_argv(run: Path, tasks: str, limit: int | None, task_data: str | None, device: str) -> list[str]:
    argv = ["eval", str(run), "--tasks", tasks, "--device", device, "--out", str(run / EVAL_FILE)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    if task_data is not None:
        argv += ["--task-data", str(task_data)]
    return argv


def _reusable(run: Path, argv: list[str]) -> dict | None:
    """The earlier eval.json of ``run`` if it was made with the options of ``argv`` after the run's last export."""
    from .cli import add_arguments, settings

    p = argparse.ArgumentParser()
    add_arguments(p)
    path, model = run / EVAL_FILE, run / "model.safetensors"
    if not path.exists() or not model.exists() or path.stat().st_mtime < model.stat().st_mtime:
        return None
    try:
        res = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return res if res.get("settings") == settings(p.parse_args(argv[1:])) else None


def eval_columns(summaries: dict[str, dict], out: Path, tasks: str, *, limit: int | None = None,
                 task_data: str | None = None, device: str = "auto") -> tuple[list[str], dict[str, list[str]], list[str]]:
    """Run `adahop eval` on every recipe of ``summaries`` that trained, in ``out/<recipe>``.

    The model scored is each run's trained weights (its final checkpoint), in BF16/FP32 numerics:
    the quality each recipe's training reached, as the paper's Table 2 compares it.

    Returns:
        ``(titles, {recipe: cells}, chance cells)``: the zero-shot column titles, each recipe's cells
        (``"eval failed"`` cells where its evaluation failed; failed trainings are left out), and the
        chance row's cells. Empty titles when no evaluation succeeded.
    """
    results, failed = {}, []
    for r, s in summaries.items():
        if "error" in s:
            continue
        run = Path(out) / r
        argv = _eval_argv(run, tasks, limit, task_data, device)
        res = _reusable(run, argv)
        if res is None:
            print(f"=== {r}: adahop eval ===", flush=True)
            proc = subprocess.run([sys.executable, "-m", "adahop", *argv])
            res = json.loads((run / EVAL_FILE).read_text()) if proc.returncode == 0 and (run / EVAL_FILE).exists() else None
        if res is None or "tasks" not in res:
            failed.append(r)
        else:
            results[r] = res
    if not results:
        return [], {}, []
    header, rows = report.table_rows(results)
    titles = header[1:]
    cells = {row[0]: row[1:] for row in rows[:-1]}
    cells.update({r: ["eval failed"] * len(titles) for r in failed})
    return titles, cells, rows[-1][1:]
