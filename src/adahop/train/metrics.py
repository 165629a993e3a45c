"""metrics.jsonl writing, peak memory, and the loss-curve plot of one run."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

__all__ = ["Metrics", "peak_memory", "reset_peak_memory", "read_metrics"]


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file (an empty list if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Metrics:
    """Appends one JSON object per line. On resume, records after the resumed step are dropped so
    the file reads as one uninterrupted run."""

    def __init__(self, path: Path, *, resume_from: int | None = None, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self.records = read_metrics(self.path) if resume_from is not None else []
        self.records = [r for r in self.records if r["step"] <= (resume_from or 0)]
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def log(self, **rec) -> None:
        """Append one record (a dict with at least ``step``)."""
        self.records.append(rec)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def last(self, key: str):
        """The newest value logged under ``key`` (None if never)."""
        return next((r[key] for r in reversed(self.records) if key in r), None)

    def plot(self, path: Path, *, title: str) -> None:
        """Write the run's loss curves to ``path``."""
        from ..plots import plot_run

        plot_run(self.records, path, title=title)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement on ``device`` (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Peak bytes: the CUDA allocator's peak on a GPU, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
