"""metrics.jsonl writing (and the TensorBoard / W&B loggers of ``--log-to``), peak memory, and the
loss-curve plot of one run."""

from __future__ import annotations

import json
import os
import resource
import sys
import uuid
from pathlib import Path

import torch

__all__ = ["Metrics", "peak_memory", "reset_peak_memory", "read_metrics", "LOGGERS", "parse_log_to"]

#: The loggers of ``--log-to``, each with the pip extra that installs its package. metrics.jsonl is
#: always written (``adahop compare``, the plots and the summary read it); the others are added.
LOGGERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}


def parse_log_to(spec: str) -> tuple[str, ...]:
    """``"jsonl,tensorboard"`` → ``("jsonl", "tensorboard")``, each logger checked to be known and installed.

    Raises:
        ValueError: an unknown name (lists the known ones), or a logger whose package is missing (names
            the extra: ``pip install 'adahop[tensorboard]'``)."""
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    for n in names:
        if n not in LOGGERS:
            raise ValueError(f"--log-to: unknown logger {n!r}; use a comma-separated list of {', '.join(LOGGERS)}")
    for n, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if n in names:
            import importlib.util

            if importlib.util.find_spec(module) is None:
                raise ValueError(f"--log-to {n}: the {module!r} package is not installed; install it with "
                                 f"pip install 'adahop[{LOGGERS[n]}]'")
    return names


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file (an empty list if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Metrics:
    """Appends one JSON object per line. On resume, records after the resumed step are dropped so
    the file reads as one uninterrupted run."""

    def __init__(self, path: Path, *, resume_from: int | None = None, enabled: bool = True, log_to: str = "jsonl",
                 config: dict | None = None):
        self.path, self.enabled = Path(path), enabled
        self.records = read_metrics(self.path) if resume_from is not None else []
        self.records = [r for r in self.records if r["step"] <= (resume_from or 0)]
        self.sinks = []
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            names = parse_log_to(log_to)
            if "tensorboard" in names:
                self.sinks.append(_TensorBoard(self.path.parent / "tensorboard", resume_from))
            if "wandb" in names:
                self.sinks.append(_Wandb(self.path.parent, config or {}))

    def log(self, **rec) -> None:
        """Append one record (a dict with at least ``step``); the loggers of ``--log-to`` get its numbers
        as ``train/<key>`` and, for keys starting with ``val_``, ``val/<rest>``."""
        self.records.append(rec)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            scalars = {(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}"): float(v)
                       for k, v in rec.items() if k != "step" and isinstance(v, (int, float)) and v is not None}
            for sink in self.sinks:
                sink.scalars(rec["step"], scalars)

    def log_plan(self, step: int, plan, model=None) -> None:
        """At the freeze: the strategy counts (``adahop/fprop/iht`` ...) and the plan as a table
        (TensorBoard text, a W&B Table); metrics.jsonl gets the counts (plan.json holds the plan). The counts
        are what ``model``'s layers run (a recipe variant may keep some of the plan's GEMMs in BF16), or the
        plan's own entries without a model."""
        from ..nn.convert import PLAN_COLUMNS, plan_rows, strategy_counts

        counts = strategy_counts(plan if model is None else model)
        self.log(step=step, plan_strategies=counts)
        for sink in self.sinks:
            sink.scalars(step, {f"adahop/{k}": float(v) for k, v in counts.items()})
            sink.table(step, "adahop/plan", list(PLAN_COLUMNS), plan_rows(plan))

    def close(self) -> None:
        """Flush and close the loggers (metrics.jsonl is written line by line already)."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def last(self, key: str):
        """The newest value logged under ``key`` (None if never)."""
        return next((r[key] for r in reversed(self.records) if key in r), None)

    def plot(self, path: Path, *, title: str) -> None:
        """Write the run's loss curves to ``path``."""
        from ..plots import plot_run

        plot_run(self.records, path, title=title)


class _TensorBoard:
    """``torch.utils.tensorboard`` into ``<run>/tensorboard``; on resume, events after the resumed step are
    marked stale (``purge_step``) so the curves read as one run."""

    def __init__(self, folder: Path, resume_from: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(folder), purge_step=resume_from + 1 if resume_from else None)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def table(self, step: int, tag: str, columns: list[str], rows: list[list[str]]) -> None:
        md = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        self.w.add_text(tag, md + "".join("| " + " | ".join(r) + " |\n" for r in rows), step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class _Wandb:
    """A W&B run in ``<run>/wandb``, offline unless ``WANDB_MODE`` says otherwise (no network needed;
    ``wandb sync <run>/wandb/offline-run-*`` uploads it later). Its id is kept in ``<run>/wandb_id``,
    so ``--resume`` continues the same W&B run."""

    def __init__(self, run: Path, config: dict):
        import wandb

        id_file = run / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "adahop"), name=run.name, id=run_id, resume="allow",
                              dir=str(run), config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, tag: str, columns: list[str], rows: list[list[str]]) -> None:
        self.run.log({tag: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement on ``device``: the CUDA allocator's peak, or on a Linux CPU the
    process's peak RSS (``/proc/self/clear_refs``; the data preparation and checkpoint load before training
    counted in it: 594 against 520 MiB for one run with and without a tokenizer to train). Elsewhere on the CPU
    nothing can be reset, and the peak is the process's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size (Linux >= 4.0)
        except OSError:
            pass


def peak_memory(device: torch.device) -> int:
    """Peak bytes: the CUDA allocator's peak on a GPU; on the CPU the peak RSS since
    :func:`reset_peak_memory` (Linux's VmHWM), else the process's."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
