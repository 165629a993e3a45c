"""Fitting HARP's rotations of one linear layer to its weight and Hessian (the ``proxy`` strategy).

`specs/related_methods.md` §2.3–§2.4. With ``W̃ = Uᵀ(S W S)V`` and ``H̃ = Vᵀ(S H S)V``::

    s   = RMS(W̃)                                  (detached)
    T   = Q(W̃)                                    (stop-gradient, refreshed every ``refresh`` steps)
    h   = |diag H̃| / mean |diag H̃|               (detached)
    L_q = mean_ij ((W̃_ij − T_ij) / s)² · h_j
    L   = L_q + λ_hbd · ‖offblockdiag_b(H̃)‖²_F / n²

minimized by Adam on every ``Θ`` of ``U`` and ``V`` (lr 0.03, 1200 steps in the paper). The spec's
target is ``Q_codebook(W̃/s)`` with ``s = RMS/c``; our grids pick their own group scales, so the
target is the grid's RTN of ``W̃`` and ``s`` only normalizes (``c`` drops out). ``H`` is divided by
its mean diagonal first so that ``λ_hbd`` does not depend on the scale of the activations (the
spec does not say whether the original normalizes; it is a choice of ours). All blocks of a stage
are one batched solve and one batched einsum (:class:`~adahop.ptq.rotation.HARPRotation`), on
whatever device ``W`` is on.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from .grids import Grid
from .incoherence import TwoSided

__all__ = ["FitOptions", "fit_harp", "proxy_loss", "offblock_energy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FitOptions:
    """HARP fitting settings; the defaults are the paper scripts' (`specs/related_methods.md` §2.4)."""

    steps: int = 1200
    """Adam steps per linear layer."""
    lr: float = 0.03
    """Adam learning rate of every Θ (U and V alike)."""
    hbd_lambda: float = 0.1
    """Weight of the Hessian off-block-diagonal energy."""
    hbd_block: int = 8
    """Block size of that term (8: QuIP#'s E8 vector size)."""
    hbd_max_n: int = 24672
    """Skip the term for input dims at least this large (memory), as the original does."""
    refresh: int = 1
    """Recompute the stop-gradient target every this many steps."""

    def __post_init__(self):
        for name in ("steps", "hbd_block", "refresh"):
            if getattr(self, name) < 1:
                raise ValueError(f"HARP {name}={getattr(self, name)} must be >= 1")
        if not self.lr > 0 or not self.hbd_lambda >= 0:
            raise ValueError(f"HARP lr ({self.lr}) must be > 0 and hbd_lambda ({self.hbd_lambda}) >= 0")


def offblock_energy(h: torch.Tensor, b: int) -> torch.Tensor:
    """``‖offblockdiag_b(h)‖²_F / n²`` for ``h`` ``[n, n]``: the energy outside the ``b×b`` diagonal
    blocks (a last partial block counts as one block)."""
    n = h.shape[0]
    idx = torch.arange(n, device=h.device) // b
    mask = idx[:, None] != idx[None, :]
    return (h * mask).pow(2).sum() / n**2


def proxy_loss(wt: torch.Tensor, ht: torch.Tensor, grid: Grid, opts: FitOptions, target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, L_q)`` of §2.3 for a rotated weight ``wt`` ``[m, n]`` and Hessian ``ht`` ``[n, n]``
    (``ht`` already normalized to mean diagonal 1). ``target``: a fixed ``T``; None: ``Q(wt)`` now."""
    with torch.no_grad():
        t = grid.fake_quantize(wt.detach()) if target is None else target
        s = wt.detach().pow(2).mean().sqrt().clamp(min=1e-12)
        d = torch.diagonal(ht.detach()).abs()
        h = d / d.mean().clamp(min=1e-30)
    lq = (((wt - t) / s).pow(2) * h).mean()
    loss = lq
    if opts.hbd_lambda > 0 and ht.shape[0] < opts.hbd_max_n:
        loss = loss + opts.hbd_lambda * offblock_energy(ht, opts.hbd_block)
    return loss, lq


@dataclass
class FitResult:
    """What a fit did: losses at the RHT start and at the end (each with a fresh target), time, and
    whether its steps replayed a CUDA graph."""

    loss_start: float
    loss_end: float
    lq_start: float
    lq_end: float
    seconds: float
    steps: int
    history: list[float] = field(default_factory=list)
    cuda_graph: bool = False


#: Eager steps before a CUDA graph is captured: they build Adam's state and the cached grid
#: constants outside the capture (and are real steps of the fit).
GRAPH_WARMUP = 3


def fit_harp(w: torch.Tensor, h: torch.Tensor, transform: TwoSided, grid: Grid, opts: FitOptions = FitOptions(),
             *, cuda_graph: bool | None = None) -> FitResult:
    """Fit ``transform.u`` and ``transform.v`` (:class:`~adahop.ptq.rotation.HARPRotation` modules,
    on ``w``'s device) in place, then round their parameters to what the artifact stores (FP16).

    Args:
        w: the weight ``[m, n]`` (float32). h: ``E[x xᵀ]`` ``[n, n]``.
        transform: signs and the two rotations; the signs stay fixed.
        grid: the quantizer whose RTN is the target.
        opts: :class:`FitOptions`.
        cuda_graph: replay each Adam step from one captured CUDA graph (None: on CUDA when the target
            is refreshed every step and the grid is ``capturable``: not NVFP4, whose tensor scale is read
            to the host). A step is ~1,300 small ops, so on a GPU the host's launches, not the
            arithmetic, set its time; the graph removes them. A capture that fails falls back to eager
            steps with a warning.

    Returns:
        A :class:`FitResult`; ``history`` holds the loss every 50 steps.

    Raises:
        ValueError: ``cuda_graph=True`` off CUDA or with ``opts.refresh > 1``.
    """
    on_cuda = w.device.type == "cuda"
    if cuda_graph and (not on_cuda or opts.refresh != 1):
        raise ValueError(f"cuda_graph=True needs w on CUDA (it is on {w.device}) and refresh=1 (it is {opts.refresh})")
    graph = on_cuda and opts.refresh == 1 and grid.capturable if cuda_graph is None else cuda_graph
    hn = h.float() / torch.diagonal(h).float().mean().clamp(min=1e-30)
    params = list(transform.u.parameters()) + list(transform.v.parameters())
    opt = torch.optim.Adam(params, lr=opts.lr, capturable=graph)  # capturable: its step count lives on the GPU

    def losses():
        return proxy_loss(transform.weight(w), transform.hessian(hn), grid, opts)

    target = None

    def step(i: int) -> torch.Tensor:
        """One Adam step (gradients must be None or zero on entry); the loss before it, detached."""
        nonlocal target
        ks = transform.kernels()  # once per step: W and both sides of H share V's solves
        wt = transform.weight(w, ks)
        if i % opts.refresh == 0:
            with torch.no_grad():
                target = grid.fake_quantize(wt.detach())
        loss, _ = proxy_loss(wt, transform.hessian(hn, ks), grid, opts, target)
        loss.backward()
        opt.step()
        return loss.detach()

    def eager(first: int) -> None:
        for i in range(first, opts.steps):
            opt.zero_grad(set_to_none=True)
            loss = step(i)
            if i % 50 == 0:
                hist.append(float(loss))

    with torch.no_grad():
        l0, q0 = losses()
    if on_cuda:
        torch.cuda.synchronize(w.device)
    t0 = time.perf_counter()
    hist: list[float] = []
    if graph and opts.steps > GRAPH_WARMUP:
        graph = _graphed(step, eager, opt, opts.steps, hist, w.device)
    else:
        eager(0)
    transform.u.round_params_fp16()
    transform.v.round_params_fp16()
    if on_cuda:
        torch.cuda.synchronize(w.device)
    secs = time.perf_counter() - t0
    with torch.no_grad():
        l1, q1 = losses()
    return FitResult(float(l0), float(l1), float(q0), float(q1), secs, opts.steps, hist, bool(graph))


def _graphed(step, eager, opt, steps: int, hist: list, device) -> bool:
    """Run ``steps`` Adam steps: :data:`GRAPH_WARMUP` eager on a side stream, then one captured step
    replayed (PyTorch's whole-network capture recipe). False if the capture failed and the rest ran eager."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(GRAPH_WARMUP):
            opt.zero_grad(set_to_none=True)
            loss = step(i)
            if i % 50 == 0:
                hist.append(float(loss))
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # backward inside the capture allocates the grads from the graph's pool
    try:
        with torch.cuda.graph(g):
            static_loss = step(GRAPH_WARMUP)  # refresh == 1: every step takes a fresh target
    except RuntimeError as e:  # nothing ran during the capture: the parameters are those after warm-up
        warnings.warn(f"HARP fit: CUDA graph capture failed ({str(e).splitlines()[0][:160]}); the steps run eager")
        torch.cuda.synchronize(device)
        eager(GRAPH_WARMUP)
        return False
    for i in range(GRAPH_WARMUP, steps):
        g.replay()
        if i % 50 == 0:
            hist.append(float(static_loss))
    return True
