"""The machine-readable rows of `adahop bench` and the file they merge into (``--json``), e.g.
``docs/benchmarks.json``. Torch-free.

Every row is one JSON object with at least :data:`ROW_FIELDS` (None where a row has no value: a
failed row, the CPU's peak memory); the rest (step time, strategy counts, the GPU, the date...)
varies by benchmark. A file holds a JSON list of rows. Merging a run into it replaces the rows
measured again (same :data:`KEY_FIELDS`, ignoring the date) and appends the new ones, so one file
keeps the current row of every configuration.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["ROW_FIELDS", "KEY_FIELDS", "normalize_row", "row_key", "merge_rows"]

#: Fields every row has: tokens per second, its ratio to the BF16 row of the same model and mode,
#: peak GPU memory (GiB), and the seconds of the untimed warm-up (calibration, compile, graphs).
ROW_FIELDS = ("model", "recipe", "mode", "tok_per_s", "vs_bf16", "peak_mem_gib", "warmup_s")
#: What makes two rows the same measurement (a later run's row replaces the earlier one).
KEY_FIELDS = ("bench", "model", "layers", "layer", "K", "N", "tokens", "seq_len", "batch", "recipe", "mode",
              "bf16_small_gemms", "gpu")


def _clean(v):
    # strict JSON: NaN and inf are no numbers there
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def normalize_row(row: dict) -> dict:
    """``row`` with every field of :data:`ROW_FIELDS` (missing ones None) first, and NaN/inf as None."""
    return _clean({**{k: row.get(k) for k in ROW_FIELDS}, **row})


def row_key(row: dict) -> tuple:
    """The identity of a row's measurement: its :data:`KEY_FIELDS` values."""
    return tuple(json.dumps(row.get(k)) for k in KEY_FIELDS)


def merge_rows(path: str | Path, rows: list[dict]) -> list[dict]:
    """Merge ``rows`` into the JSON list at ``path`` (created if absent) and return the file's rows.

    A row of the file whose :func:`row_key` equals a new row's is replaced in place; the other new
    rows are appended in their order. Written atomically (a temporary file renamed over ``path``).

    Raises:
        ValueError: ``path`` exists but is not a JSON list of objects (the message names the file).
    """
    path = Path(path)
    old: list[dict] = []
    if path.exists():
        try:
            old = json.loads(path.read_text() or "[]")
        except json.JSONDecodeError as e:
            raise ValueError(f"--json {path}: not valid JSON ({e}); give a new file or fix this one") from None
        if not isinstance(old, list) or not all(isinstance(r, dict) for r in old):
            raise ValueError(f"--json {path}: holds {type(old).__name__}, not a list of row objects; give a new file")
    new = [normalize_row(r) for r in rows]
    at = {row_key(r): i for i, r in enumerate(old)}
    merged = list(old)
    for r in new:
        k = row_key(r)
        if k in at:
            merged[at[k]] = r
        else:
            at[k] = len(merged)
            merged.append(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=1) + "\n")
    os.replace(tmp, path)
    return merged
