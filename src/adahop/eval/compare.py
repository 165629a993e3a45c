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


def _eval_argv(run: Path, tasks: str, limit: int | None, task_data: str | None, device: str,
               max_length: int | None = None) -> list[str]:
    argv = ["eval", str(run), "--tasks", tasks, "--device", device, "--out", str(run / EVAL_FILE)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    if max_length is not None:
        argv += ["--max-length", str(max_length)]
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
                 task_data: str | None = None, device: str = "auto", max_length: int | None = None
                 ) -> tuple[list[str], dict[str, list[str]], list[str], dict[str, str]]:
    """Run `adahop eval` on every recipe of ``summaries`` that trained, in ``out/<recipe>``.

    The model scored is each run's trained weights (its final checkpoint), in BF16/FP32 numerics:
    the quality each recipe's training reached, as the paper's Table 2 compares it. ``max_length``:
    `adahop eval --max-length` (None: each model's window, its training ``--seq-len``).

    Returns:
        ``(titles, {recipe: cells}, chance cells, {recipe: why its evaluation failed})``: the zero-shot
        column titles, each recipe's cells (``"eval failed"`` cells where its evaluation failed; failed
        trainings are left out), and the chance row's cells. When no evaluation succeeded, one column
        ``zero-shot TASKS`` of ``"eval failed"`` cells and no chance row: the table never loses the
        columns that were asked for without a word.
    """
    results, failed = {}, {}
    for r, s in summaries.items():
        if "error" in s:
            continue
        run = Path(out) / r
        argv = _eval_argv(run, tasks, limit, task_data, device, max_length)
        res = _reusable(run, argv)
        if res is None:
            print(f"=== {r}: adahop eval ===", flush=True)
            proc = subprocess.run([sys.executable, "-m", "adahop", *argv])
            res = json.loads((run / EVAL_FILE).read_text()) if proc.returncode == 0 and (run / EVAL_FILE).exists() else None
            if res is None:
                failed[r] = f"adahop eval failed (exit code {proc.returncode}; its message is above)"
        if res is not None and "tasks" not in res:
            failed[r] = f"{run / EVAL_FILE} holds no task results"
        elif res is not None:
            results[r] = res
    if not results:
        return ([f"zero-shot {tasks}"], {r: ["eval failed"] for r in failed}, [], failed) if failed else ([], {}, [], {})
    header, rows = report.table_rows(results)
    titles = header[1:]
    cells = {row[0]: row[1:] for row in rows[:-1]}
    cells.update({r: ["eval failed"] * len(titles) for r in failed})
    return titles, cells, rows[-1][1:], failed
