"""`adahop train`, unchanged, plus one file per rank: the plan it froze and its own summary.

    torchrun --nproc-per-node 2 experiments/scaling/train_ranks.py train --parallel fsdp ...
    python3 experiments/scaling/train_ranks.py train ...          # single process

Same arguments and same code path as ``python -m adahop train`` (it calls ``adahop.cli.main``).
The library writes ``plan.json`` and ``summary.json`` from rank 0 only; to check that every rank
froze the same AdaHOP plan, and to read every GPU's peak memory, this wrapper hooks the two
functions the training loop calls (as ``tests/test_distributed.py`` does) and writes

* ``OUT/ranks/plan.rank{R}.json``: ``Plan.to_json()`` of rank R, right when the plan freezes;
* ``OUT/ranks/summary.rank{R}.json``: the summary ``train`` returned on rank R (its own
  ``peak_memory_bytes``, its own clock's ``tok_per_s``), plus rank, world size and device.

Nothing else changes: the hooks run after the library's own calls and only write files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import adahop.train as train_pkg
import adahop.train.loop as loop
from adahop.cli import main
from adahop.nn import get_controller

_ctx: dict = {}
_real_on_step, _real_train = loop.on_step, train_pkg.train


def _rank_file(name: str) -> Path | None:
    if "out" not in _ctx:
        return None
    d = _ctx["out"] / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.rank{_ctx['rank']}.json"


def on_step(model, step: int) -> bool:
    frozen = _real_on_step(model, step)
    if frozen and (path := _rank_file("plan")) is not None:
        path.write_text(get_controller(model).plan.to_json())
    return frozen


def train(cfg, *, rank: int = 0, world: int = 1) -> dict:
    _ctx.update(out=Path(cfg.out), rank=rank, world=world)
    summary = _real_train(cfg, rank=rank, world=world)
    path = _rank_file("summary")
    path.write_text(json.dumps(dict(summary, rank=rank, world=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")), indent=1))
    return summary


loop.on_step = on_step  # the loop looks the name up in its module at every step
train_pkg.train = train  # adahop.cli.main imports `train` from adahop.train at call time

if __name__ == "__main__":
    sys.exit(main())
