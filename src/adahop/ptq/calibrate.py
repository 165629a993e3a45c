"""Calibration: per-layer Hessians ``H = E[x xᵀ]`` from forward hooks, one decoder block at a time,
and the block-sequential quantization loop built on them.

GPTQ's sequential procedure (Frantar et al. §4, "layer-wise" with the outputs of the quantized
earlier blocks as inputs): block ``k``'s Hessians are taken with blocks ``0 … k−1`` already
quantized, so each block is fitted to the activations the deployed model will really give it.
To stay independent of each architecture's decoder-layer signature (attention masks, rotary
embeddings, per-layer masks) one forward of the whole model records, per calibration batch, the
first block's input and every block's other arguments as the model passes them (hooks; the model
stops before the last block). Block ``k`` then runs alone on the outputs of the quantized block
``k−1``, with its own recorded arguments: two block forwards per block (its Hessians, then its
quantized outputs), ``~3L`` in all, where running the model up to each block took ``~L²/2``. The
hidden states are the same tensors the whole model would compute (tested to the last bit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["decoder_blocks", "block_linears", "check_unshared", "unquantized_weights", "calibration_batches",
           "record_block_calls", "block_hessians", "whole_model_hessians", "quantize_model", "BlockCall"]


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of decoder blocks: the longest ``nn.ModuleList`` whose entries hold
    ``nn.Linear`` layers (``model.layers`` of Llama/Qwen, ``gpt_neox.layers``, ...); its name and itself.

    Raises:
        ValueError: no such list (the model is not a stack of blocks built of ``nn.Linear``).
    """
    best = None
    for name, mod in model.named_modules():
        # a block holds linears and is none itself (a list of bare projections, e.g. Gemma3n's altup_projections, is no stack)
        if isinstance(mod, nn.ModuleList) and len(mod) and all(
                not isinstance(b, nn.Linear) and any(isinstance(x, nn.Linear) for x in b.modules()) for b in mod):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError("the model has no list of decoder blocks built of nn.Linear layers "
                         "(GPT-2's Conv1D layers are not nn.Linear); pass a Llama/Qwen-style causal LM")
    return best


def block_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of a block, in module order (q, k, v, o, gate, up, down for Llama)."""
    return [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def check_unshared(blocks: nn.ModuleList, prefix: str) -> None:
    """Check that no linear belongs to two decoder blocks (``blocks`` of :func:`decoder_blocks`, named under
    ``prefix``): GPTQ's sequential procedure (Frantar et al. §4) quantizes each block's layers once.

    Raises:
        ValueError: a shared linear (Zamba2's shared transformer), named by both its places: quantized at each
            block, it would be quantized again on the earlier result, and calibrated at a block that may not use it."""
    seen: dict[int, str] = {}
    for i, block in enumerate(blocks):
        for name, lin in block_linears(block):
            here = f"{prefix}.{i}.{name}"
            if id(lin) in seen:
                raise ValueError(f"{here} is the same layer as {seen[id(lin)]}: the model's decoder blocks share "
                                 "modules, which adahop ptq cannot quantize once per use; it supports stacks of "
                                 "independent blocks (Llama, Qwen, Mistral, Gemma...)")
            seen[id(lin)] = here


def unquantized_weights(blocks: nn.ModuleList) -> tuple[int, list[str]]:
    """Weights of the decoder blocks that are not in an ``nn.Linear`` and so stay as they are: matrices and
    larger (norms and biases are vectors), e.g. the fused experts of a mixture-of-experts block. Their count and
    the first few names."""
    linear_params = {id(p) for b in blocks for _, lin in block_linears(b) for p in lin.parameters()}
    left = [(n, p) for n, p in blocks.named_parameters() if p.dim() >= 2 and id(p) not in linear_params]
    return sum(p.numel() for _, p in left), [n for n, _ in left[:3]]


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
    per_batch = seq_len * batch_size
    n = math.ceil(tokens / per_batch)
    if n * per_batch > stream.tokens_per_epoch:  # later epochs repeat the same windows: no new statistics, only time
        # (whole batches are drawn: a request just under the split's size was rounded up into repeated windows)
        most = stream.tokens_per_epoch // per_batch * per_batch
        raise ValueError(f"--calib-tokens {tokens:,} takes {n} batches of {batch_size} x {seq_len} tokens "
                         f"({n * per_batch:,}), more than the train split of {data_dir} holds in windows of --seq-len "
                         f"{seq_len} ({stream.tokens_per_epoch:,}); pass --calib-tokens {most} or less, or prepare "
                         "more data")
    return [stream.batch(i)[0] for i in range(n)]


class _Stop(Exception):
    """Raised by a hook where the rest of the model's forward is not needed (before the last block when
    recording; after the block in :func:`whole_model_hessians`)."""


def _hidden(out) -> torch.Tensor:
    """A block's hidden-state output: blocks return it alone or first in a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


class BlockCall:
    """How the model calls one block: the arguments other than the hidden states, and where those go."""

    __slots__ = ("rest", "kwargs", "positional")

    def __init__(self, rest: tuple, kwargs: dict, positional: bool):
        self.rest, self.kwargs, self.positional = rest, kwargs, positional

    def __call__(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _hidden(block(x, *self.rest, **self.kwargs) if self.positional else
                       block(*self.rest, hidden_states=x, **self.kwargs))


@torch.no_grad()
def record_block_calls(model: nn.Module, blocks: nn.ModuleList, batches: list[torch.Tensor],
                       device: torch.device) -> tuple[list[torch.Tensor], list[list[BlockCall]]]:
    """One forward of ``model`` per batch, stopped before the last block: the first block's hidden-state input
    per batch, and per batch every block's :class:`BlockCall` (masks, rotary embeddings... as the model passes
    them, so that a block run alone computes what it computes inside the model).

    Raises:
        ValueError: a block called without hidden states as its first argument or ``hidden_states=``, or not
            with the previous block's output (blocks out of order, skipped or repeated, or the hidden states
            changed between them).
    """
    firsts: list[torch.Tensor] = []
    calls: list[list[BlockCall]] = []
    last_out: list[torch.Tensor | None] = [None]

    def output(_mod, _args, out):
        last_out[0] = _hidden(out)

    def recorder(i: int):
        def hook(_mod, args, kwargs):
            if args:
                x, call = args[0], BlockCall(tuple(args[1:]), dict(kwargs), True)
            elif "hidden_states" in kwargs:
                kw = dict(kwargs)
                x, call = kw.pop("hidden_states"), BlockCall((), kw, False)
            else:
                raise ValueError("the model calls its decoder blocks without hidden states as the first argument or "
                                 "hidden_states=; adahop ptq supports Llama/Qwen-style causal LMs")
            if i == 0:
                firsts.append(x)
            elif len(calls[-1]) != i or not (x is last_out[0] or torch.equal(x, last_out[0])):
                # blocks run alone are chained output to input, in order: a model that skips, repeats or
                # reorders blocks, or changes the hidden states between them, would be calibrated on other inputs
                raise ValueError(f"the model does not feed decoder block {i} the output of block {i - 1} unchanged; "
                                 "adahop ptq supports Llama/Qwen-style stacks of blocks")
            calls[-1].append(call)
            if i == len(blocks) - 1:
                raise _Stop
        return hook

    hooks = [b.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(output) for b in blocks]
    try:
        for ids in batches:
            calls.append([])
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for hk in hooks:
            hk.remove()
    return firsts, calls


@torch.no_grad()
def block_hessians(block: nn.Module, inputs: list[torch.Tensor], calls: list[BlockCall]) -> dict[str, torch.Tensor]:
    """``H = E[x xᵀ]`` (float32 ``[n, n]``, mean over every calibration token) of the input of each
    ``nn.Linear`` of ``block``, from the block run alone on each batch's ``inputs`` (``[B, T, d]``, the hidden
    states the block receives) with its recorded ``calls`` (:func:`record_block_calls`). Returns
    ``{layer name in the block: H}``.

    Raises:
        ValueError: a linear of the block that no calibration token reached (GPTQ on its zero Hessian would
            round it to ~0), named."""
    return _hessians(block, lambda: [call(block, x) for x, call in zip(inputs, calls)])


@torch.no_grad()
def whole_model_hessians(model: nn.Module, block: nn.Module, batches: list[torch.Tensor],
                         device: torch.device) -> dict[str, torch.Tensor]:
    """The reference of :func:`block_hessians`, as the calibration ran before 2026-12-05: ``model`` from its
    embedding on each of ``batches`` (int64 ``[B, T]``), stopped after ``block``, so ~L²/2 block forwards over
    a model of L blocks. The same Hessians to the last bit for the same weights (``tests/test_ptq_gptq.py``,
    ``scripts/bench_calibration.py``).

    Raises:
        ValueError: as :func:`block_hessians`."""
    def run():
        stop = block.register_forward_hook(_raise_stop)
        try:
            for ids in batches:
                try:
                    model(input_ids=ids.to(device), use_cache=False)
                except _Stop:
                    pass
        finally:
            stop.remove()
    return _hessians(block, run)


def _raise_stop(*_):
    raise _Stop


def _hessians(block: nn.Module, run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """The Hessians of ``block``'s linears over whatever forwards ``run()`` makes it take."""
    linears = block_linears(block)
    device = linears[0][1].weight.device
    sums = {n: torch.zeros(m.in_features, m.in_features, device=device) for n, m in linears}
    counts = dict.fromkeys(sums, 0)
    hooks = []
    for name, mod in linears:
        def grab(_mod, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name].addmm_(x.T, x)
            counts[name] += x.shape[0]
        hooks.append(mod.register_forward_pre_hook(grab))
    try:
        run()
    finally:
        for hk in hooks:
            hk.remove()
    idle = [n for n in sums if counts[n] == 0]
    if idle:  # GPTQ on a zero Hessian rounds the layer to ~0: never quantize a layer that saw no input
        raise ValueError(f"{', '.join(idle)}: no calibration input reached this layer of the block (the model's forward "
                         "does not call it for these tokens); adahop ptq supports blocks that use every linear they hold")
    return {n: sums[n] / counts[n] for n in sums}


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
    check_unshared(blocks, prefix)
    model.eval()
    out = {}
    xs, calls = record_block_calls(model, blocks, batches, device)
    for i, block in enumerate(blocks):
        t0 = time.perf_counter()
        try:
            hs = block_hessians(block, xs, [c[i] for c in calls])
        except ValueError as e:
            raise ValueError(f"{prefix}.{i}: {e}") from None
        items = [(f"{prefix}.{i}.{name}", lin.weight.detach().float(), hs[name]) for name, lin in block_linears(block)]
        if prepare is not None:
            prepare(items)
        for (full, w, h), (_, lin) in zip(items, block_linears(block)):
            res = quantize(full, w, h)
            with torch.no_grad():
                lin.weight.copy_(res.weight.to(torch.bfloat16).to(lin.weight.dtype))
            out[full] = res
        if i + 1 < len(blocks):  # the next block's inputs: this block's outputs, now that it is quantized
            with torch.no_grad():
                for j, c in enumerate(calls):  # in place: one batch's states more, not a second list
                    xs[j] = c[i](block, xs[j])
        log(f"block {i + 1}/{len(blocks)}: {len(hs)} layers in {time.perf_counter() - t0:.1f} s")
    return out
