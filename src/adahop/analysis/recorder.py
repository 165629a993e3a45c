"""Hooks that record the outlier pattern of X, W and ∇Y of every linear layer at chosen steps.

Each hooked layer gets one forward hook. At a recorded step it classifies X (the layer input,
flattened to ``[T, K]``) and W (``[N, K]``), and puts a tensor hook on the output that classifies
∇Y (``[T, N]``) during backward — the same tensors, in the same layouts, that training's
calibration observes (`specs/adahop.md` §2.3). Only the detector statistics are kept; full-size
tensors are kept only for the layers asked to ``capture`` (X and ∇Y cut to their first
``capture_tokens`` rows) and, when ``dump_dir`` is set, written to one safetensors file per step.

One observation per layer and tensor per recorded step, as in training's calibration
(:class:`adahop.patterns.Calibrator`): with gradient accumulation only the first micro-batch of a
step is recorded, and a call with no tokens (an MoE expert that got none) records nothing, not even W.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..nn.convert import _excluded
from ..patterns import classify, pattern_stats, peak_ratios

__all__ = ["Record", "PatternRecorder", "linear_names"]


def linear_names(model: nn.Module, exclude=("lm_head",)) -> list[str]:
    """Qualified names of the linear layers :func:`adahop.convert_model` would convert, in
    module order (``model.layers.0.self_attn.q_proj``, ...)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _excluded(n, exclude)]


@dataclass(frozen=True, slots=True)
class Record:
    """One classified tensor: its step, layer, tensor ("x", "w", "dy"), pattern and statistics
    (:func:`adahop.patterns.pattern_stats` and :func:`~adahop.patterns.peak_ratios`), so that any
    rule or gate can be re-applied afterwards."""

    step: int
    layer: str
    tensor: str
    pattern: str
    cv_row: float
    cv_col: float
    row_peak: float = float("nan")
    col_peak: float = float("nan")


class PatternRecorder:
    """Record patterns of the linear layers of ``model`` while it trains.

    Usage::

        rec = PatternRecorder(model, capture=["model.layers.1.mlp.down_proj"])
        for step in ...:
            rec.start(step, capture=step == last)    # or skip start() on unrecorded steps
            ...forward/backward...
            rec.stop()
        steps, history = rec.history()
        rec.close()

    Args:
        model: any module of ``nn.Linear`` layers (unconverted, or converted by adahop).
        layers: qualified names to hook; default :func:`linear_names` (every linear but lm_head).
        threshold, rule, floor, min_peak: the detector (:func:`adahop.patterns.classify`; the
            official ratio test with τ = 2 and no gates by default).
        capture: layers whose X, W, ∇Y are copied (float32, CPU) at steps started with ``capture=True``.
        capture_tokens: rows of X and ∇Y kept in a capture (the same rows for both).
        dump_dir: when set, every recorded step writes all hooked tensors at full size to
            ``dump_dir/step_NNNNNNN.safetensors`` (keys ``"<layer>.x"``, ``.w``, ``.dy``).
    """

    def __init__(self, model: nn.Module, *, layers: list[str] | None = None, threshold: float = 2.0,
                 rule: str = "ratio", floor: float | None = None, min_peak: float | None = None,
                 capture: list[str] | tuple[str, ...] = (), capture_tokens: int = 2048,
                 dump_dir: str | Path | None = None):
        self.names = list(layers) if layers is not None else linear_names(model)
        if not self.names:
            raise ValueError("the model has no linear layers to record (lm_head is excluded)")
        unknown = [c for c in capture if c not in self.names]
        if unknown:
            raise ValueError(f"capture layers {unknown} are not hooked layers; known: {self.names[:6]}...")
        classify(1.0, 1.0, rule=rule)  # an unknown rule fails here, not at the first recorded step
        self.detector = dict(rule=rule, threshold=threshold, floor=floor, min_peak=min_peak)
        self.capture_set, self.capture_tokens = set(capture), capture_tokens
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.records: list[Record] = []
        self.captures: dict[str, dict[str, torch.Tensor]] = {}
        self.capture_step: int | None = None
        self._step: int | None = None
        self._capture = False
        self._seen: set[tuple[str, str]] = set()
        self._dump: dict[str, torch.Tensor] = {}
        self._handles = [model.get_submodule(n).register_forward_hook(functools.partial(self._on_forward, n))
                         for n in self.names]

    # -- step control --------------------------------------------------------------------------
    def start(self, step: int, *, capture: bool = False) -> None:
        """Record the forward and backward passes that follow, as step ``step``."""
        self._step, self._capture, self._seen, self._dump = step, capture, set(), {}
        if capture:
            self.captures, self.capture_step = {}, step

    def stop(self) -> None:
        """End the recorded step (after backward); writes the dump file if one was asked for."""
        if self.dump_dir is not None and self._dump:
            from safetensors.torch import save_file

            self.dump_dir.mkdir(parents=True, exist_ok=True)
            save_file(self._dump, self.dump_dir / f"step_{self._step:07d}.safetensors")
        self._step, self._capture, self._dump = None, False, {}

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- results -------------------------------------------------------------------------------
    def history(self, steps=None) -> tuple[list[int], dict[str, dict[str, list[str]]]]:
        """Recorded steps (ascending) and ``{layer: {tensor: [pattern per recorded step]}}``,
        restricted to the steps in ``steps`` (any collection of ints) when given. A tensor missing
        at a step (its layer did not run, or got no tokens) is left out of that step."""
        keep = None if steps is None else set(steps)
        records = [r for r in self.records if keep is None or r.step in keep]
        hist: dict[str, dict[str, list[str]]] = {n: {"x": [], "w": [], "dy": []} for n in self.names}
        for r in sorted(records, key=lambda r: r.step):
            hist[r.layer][r.tensor].append(r.pattern)
        return sorted({r.step for r in records}), hist

    def patterns_at(self, step: int) -> dict[str, dict[str, str]]:
        """``{layer: {tensor: pattern}}`` as recorded at ``step``."""
        out: dict[str, dict[str, str]] = {}
        for r in self.records:
            if r.step == step:
                out.setdefault(r.layer, {})[r.tensor] = r.pattern
        return out

    # -- hooks ---------------------------------------------------------------------------------
    def _observe(self, layer: str, tensor: str, t: torch.Tensor) -> None:
        if (layer, tensor) in self._seen:
            return  # first micro-batch only
        self._seen.add((layer, tensor))
        t = t.detach()
        cv_row, cv_col = pattern_stats(t)
        row_peak, col_peak = peak_ratios(t)
        p = str(classify(cv_row, cv_col, row_peak=row_peak, col_peak=col_peak, **self.detector))
        self.records.append(Record(self._step, layer, tensor, p, cv_row, cv_col, row_peak, col_peak))
        if self._capture and layer in self.capture_set:
            keep = t if tensor == "w" else t[: self.capture_tokens]
            self.captures.setdefault(layer, {})[tensor] = keep.float().cpu().clone()
        if self.dump_dir is not None:
            self._dump[f"{layer}.{tensor}"] = t.cpu().contiguous().clone()

    def _on_forward(self, layer: str, mod: nn.Module, inputs, output) -> None:
        if self._step is None or not torch.is_grad_enabled():
            return
        x = inputs[0]
        if x.numel() == 0:
            return  # no tokens: nothing recorded (not even W); a later micro-batch with tokens counts
        self._observe(layer, "x", x.reshape(-1, x.shape[-1]))  # [T, K]
        self._observe(layer, "w", mod.weight)  # [N, K]
        if output.requires_grad and (layer, "dy_hook") not in self._seen:
            self._seen.add((layer, "dy_hook"))
            step = self._step
            output.register_hook(functools.partial(self._on_grad, layer, step))

    def _on_grad(self, layer: str, step: int, grad: torch.Tensor) -> None:
        if self._step == step:
            self._observe(layer, "dy", grad.reshape(-1, grad.shape[-1]))  # [T, N]
