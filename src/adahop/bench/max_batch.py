"""The largest batch a recipe trains at before the GPU runs out of memory: issue 18's memory target
asks for it beside the peak memory of one batch, for BF16 and the recipe alike (``bench model --max-batch``)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from ..utils import is_out_of_memory

__all__ = ["largest_fitting", "batch_fits"]


def largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> tuple[int, list[tuple[int, bool]]]:
    """The largest batch ``b`` in ``[1, limit]`` with ``fits(b)``, and every ``(b, fits(b))`` tried in order.

    Doubles from ``start`` while the batch fits (the last try clamped to ``limit``), then bisects between the
    largest batch that fitted and the smallest that did not; if ``start`` does not fit, bisects below it.
    Assumes ``fits`` is monotone (a batch that fits means every smaller one fits), as memory use grows
    with the batch. Returns 0 when not even a batch of 1 fits.

    Raises:
        ValueError: ``start`` or ``limit`` below 1, or ``start`` above ``limit``.
    """
    if not 1 <= start <= limit:
        raise ValueError(f"--max-batch {limit} must be at least --batch-size {start} (and both at least 1)")
    tried: list[tuple[int, bool]] = []

    def probe(b: int) -> bool:
        ok = bool(fits(b))
        tried.append((b, ok))
        return ok

    lo, hi = 0, limit + 1  # lo fits (0: nothing yet), hi does not (limit + 1: never tried)
    b = start
    while probe(b):
        lo = b
        if b == limit:
            return lo, tried
        b = min(2 * b, limit)
    hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def batch_fits(make_step: Callable[[int], tuple[torch.nn.Module, Callable[..., dict]]], batch: int) -> bool:
    """Whether ``make_step(batch)``'s model (:func:`adahop.bench.harness.model_step`'s ``(model, step)``) trains
    without running out of GPU memory: its eager steps (a calibrating recipe's calibration) and then three
    compiled ones (the compile, CUDA-graph warm-up and recording, a replay), or three eager steps. Frees the
    model, its compiled graphs and the allocator's cache afterwards, so the next try starts from the same
    memory. Other errors propagate.
    """
    model = step = None
    try:
        model, step = make_step(batch)
        for i in range((step.first_compiled or 0) + 3):
            step(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return True
    except Exception as e:  # noqa: BLE001 - any other error propagates below
        if is_out_of_memory(e):
            return False
        raise
    finally:
        del model, step
        gc.collect()
        torch.compiler.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
