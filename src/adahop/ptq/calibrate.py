"""Calibration: per-layer Hessians ``H = E[x xᵀ]`` from forward hooks, one decoder block at a time,
and the block-sequential quantization loop built on them.

GPTQ's sequential procedure (Frantar et al. §4, "layer-wise" with the outputs of the quantized
earlier blocks as inputs): block ``k``'s Hessians are taken with blocks ``0 … k−1`` already
quantized, so each block is fitted to the activations the deployed model will really give it.
To stay independent of each architecture's decoder-layer signature (attention masks, rotary
embeddings, caches) the calibration runs the whole model and stops it at the end of block ``k``
(a hook raises); that costs ``~L/2`` model forwards over the calibration set in all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["decoder_blocks", "block_linears", "calibration_batches", "block_hessians", "quantize_model"]


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of decoder blocks: the longest ``nn.ModuleList`` whose entries hold
    ``nn.Linear`` layers (``model.layers`` of Llama/Qwen, ``gpt_neox.layers``, ...); its name and itself.

    Raises:
        ValueError: no such list (the model is not a stack of blocks built of ``nn.Linear``).
    """
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and all(any(isinstance(x, nn.Linear) for x in b.modules()) for b in mod):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError("the model has no list of decoder blocks built of nn.Linear layers "
                         "(GPT-2's Conv1D layers are not nn.Linear); pass a Llama/Qwen-style causal LM")
    return best


def block_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of a block, in module order (q, k, v, o, gate, up, down for Llama)."""
    return [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def calibration_batches(data_dir: str | Path, *, tokens: int, seq_len: int, batch_size: int, seed: int = 0) -> list[torch.Tensor]:
    """``ceil(tokens / (seq_len·batch_size))`` batches of the **train** split (int64 ``[B, seq_len]``),
    drawn as ``adahop train`` draws them (:class:`adahop.data.TokenStream`, shuffled windows).

    Raises:
        ValueError: ``tokens < 1``, more tokens than the split's windows hold (they would repeat), or as
            :class:`~adahop.data.TokenStream` (a split too small).
    """
    from ..data import TokenStream

    if tokens < 1:
        raise ValueError(f"--calib-tokens {tokens} must be >= 1")
    stream = TokenStream(data_dir, "train", seq_len, batch_size, seed=seed)
    if tokens > stream.tokens_per_epoch:  # later epochs repeat the same windows: no new statistics, only time
        raise ValueError(f"--calib-tokens {tokens:,} is more than the train split of {data_dir} holds in windows of "
                         f"--seq-len {seq_len} ({stream.tokens_per_epoch:,}); pass --calib-tokens "
                         f"{stream.tokens_per_epoch} or less, or prepare more data")
    return [stream.batch(i)[0] for i in range(math.ceil(tokens / (seq_len * batch_size)))]


class _Stop(Exception):
    """Raised by the hook at the end of the block being calibrated: the rest of the model is not needed."""


@torch.no_grad()
def block_hessians(model: nn.Module, block: nn.Module, batches: list[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``H = E[x xᵀ]`` (float32 ``[n, n]``, mean over every calibration token) of the input of each
    ``nn.Linear`` of ``block``, from forwards of ``model`` stopped after ``block``."""
    linears = block_linears(block)
    sums = {n: torch.zeros(m.in_features, m.in_features, device=device) for n, m in linears}
    counts = dict.fromkeys(sums, 0)
    hooks = []
    for name, mod in linears:
        def grab(_mod, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name].addmm_(x.T, x)
            counts[name] += x.shape[0]
        hooks.append(mod.register_forward_pre_hook(grab))

    def stop(*_):
        raise _Stop
    hooks.append(block.register_forward_hook(stop))
    try:
        for ids in batches:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for hk in hooks:
            hk.remove()
    return {n: sums[n] / max(counts[n], 1) for n in sums}


def quantize_model(model: nn.Module, batches: list[torch.Tensor], quantize: Callable, *, device: torch.device,
                   log: Callable[[str], None] = print, prepare: Callable | None = None) -> dict[str, object]:
    """Quantize every ``nn.Linear`` of every decoder block, block by block, in place.

    Args:
        model: a causal LM on ``device`` (FP32).
        batches: calibration input ids (:func:`calibration_batches`).
        quantize: ``quantize(name, weight [m, n] float32, H [n, n]) -> LayerResult``
            (:func:`adahop.ptq.quantize.quantize_layer` with the method bound).
        device: where the model runs.
        log: one line per block.
        prepare: ``prepare([(name, weight, H), ...])``, called with each block's layers before ``quantize``
            sees them one by one (HARP fits a block's layers of one shape together there).

    Returns:
        ``{qualified layer name: LayerResult}``. Each layer's weight is replaced by the result's,
        rounded to BF16 as the export stores it, so later blocks see exactly the deployed weights.
        The LM head, embeddings and norms stay as they are.
    """
    prefix, blocks = decoder_blocks(model)
    model.eval()
    out = {}
    for i, block in enumerate(blocks):
        t0 = time.perf_counter()
        hs = block_hessians(model, block, batches, device)
        items = [(f"{prefix}.{i}.{name}", lin.weight.detach().float(), hs[name]) for name, lin in block_linears(block)]
        if prepare is not None:
            prepare(items)
        for (full, w, h), (_, lin) in zip(items, block_linears(block)):
            res = quantize(full, w, h)
            with torch.no_grad():
                lin.weight.copy_(res.weight.to(torch.bfloat16).to(lin.weight.dtype))
            out[full] = res
        log(f"block {i + 1}/{len(blocks)}: {len(hs)} layers in {time.perf_counter() - t0:.1f} s")
    return out
