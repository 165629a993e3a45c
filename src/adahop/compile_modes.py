"""Which ``torch.compile`` mode ``--compile`` runs, and dynamo's counts that check it (issue 18 item 1).

Torch-free at import. ``--help`` says the same (``TrainConfig.compile``'s docstring).

- Once the AdaHOP plan is frozen (from the start for a recipe without calibration, or with
  ``--plan``) a single-process run on CUDA uses ``mode="reduce-overhead"``: Inductor's code replayed
  from CUDA graphs, so no host time is spent between the many small kernels of a quantized layer
  (the issue's llama-125m table: compiled 0.19-0.25x BF16, compiled + CUDA graphs 0.75-0.83x).
- During calibration the converted layers run eagerly (their pattern detection syncs with the host).
  One process then runs the whole model eagerly and compiles it once, in the final mode, at the
  freeze (a compile of the calibrating model, split at every converted layer, cost more than the
  few steps it would speed up); under ``--parallel ddp/fsdp`` the wrapped model is compiled in the
  default mode from the start and recompiled at the freeze.
- On the CPU, and under ``--parallel ddp/fsdp`` (collectives and FSDP2's all-gathered parameters
  sit outside a replayable graph), the default mode (Inductor, no CUDA graphs).
"""

from __future__ import annotations

__all__ = ["CALIBRATION_MODE", "frozen_mode", "mark_step", "dynamo_counts"]

#: The mode while the plan is still calibrating under ``--parallel ddp/fsdp`` (the converted layers run eagerly then).
CALIBRATION_MODE = "default"


def frozen_mode(device_type: str, parallel: str = "none") -> str:
    """The ``torch.compile`` mode once the plan is frozen: ``"reduce-overhead"`` for one CUDA
    process, else ``"default"`` (module docstring)."""
    return "reduce-overhead" if device_type == "cuda" and parallel == "none" else "default"


def mark_step(mode: str | None) -> None:
    """Tell CUDA-graph trees that a new training iteration starts (``mode="reduce-overhead"``): the
    outputs of the previous replay may then be overwritten. Nothing in the other modes."""
    if mode == "reduce-overhead":
        import torch

        torch.compiler.cudagraph_mark_step_begin()


def dynamo_counts() -> dict[str, int]:
    """The compiler's process-wide counts so far: ``graph_breaks`` (counted when a frame compiles),
    ``frames`` (frames dynamo compiled, recompiles included) and ``cudagraph_skips`` (graphs that
    ``reduce-overhead`` ran without CUDA graphs, e.g. for a CPU input; correct, but slower).
    Differences between two calls say what a stretch of steps compiled; after the first step that
    follows the plan freeze, ``graph_breaks`` and ``frames`` must stay put."""
    from torch._dynamo.utils import counters

    return dict(graph_breaks=sum(counters["graph_break"].values()), frames=int(counters["frames"]["total"]),
                cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]))
