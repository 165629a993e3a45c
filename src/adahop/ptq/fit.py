"""Fitting HARP's rotations of linear layers to their weights and Hessians (the ``proxy`` strategy).

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
spec does not say whether the original normalizes; it is a choice of ours). All blocks of a stage,
of every layer fitted together (:func:`fit_harp_many`), are one batched solve and one batched einsum,
on whatever device ``W`` is on; on CUDA each step replays a captured CUDA graph.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from .grids import Grid
from .incoherence import TwoSided
from .rotation import HARPRotation, cayley, stage

__all__ = ["FitOptions", "fit_harp", "fit_harp_many", "proxy_loss", "offblock_energy"]


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
    """``‖offblockdiag_b(h)‖²_F / n²`` for ``h`` ``[..., n, n]`` (one value per leading index): the energy
    outside the ``b×b`` diagonal blocks (a last partial block counts as one block)."""
    n = h.shape[-1]
    idx = torch.arange(n, device=h.device) // b
    mask = idx[:, None] != idx[None, :]
    return (h * mask).pow(2).sum((-2, -1)) / n**2


def _rtn(grid: Grid, wt: torch.Tensor) -> torch.Tensor:
    """``Q(wt)`` of each ``[m, n]`` matrix of ``wt`` ``[..., m, n]``: one call over all rows, since each
    row's groups are rounded on their own, unless the grid has a scale over the whole tensor (NVFP4)."""
    if grid.tensor_scale:
        return torch.stack([grid.fake_quantize(x) for x in wt.reshape(-1, *wt.shape[-2:])]).reshape(wt.shape)
    return grid.fake_quantize(wt.reshape(-1, wt.shape[-1])).reshape(wt.shape)


def proxy_loss(wt: torch.Tensor, ht: torch.Tensor, grid: Grid, opts: FitOptions, target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, L_q)`` of §2.3 for a rotated weight ``wt`` ``[..., m, n]`` and Hessian ``ht`` ``[..., n, n]``
    (``ht`` already normalized to mean diagonal 1), one value per leading index (0-d for one layer).
    ``target``: a fixed ``T``; None: ``Q(wt)`` now."""
    with torch.no_grad():
        t = _rtn(grid, wt.detach()) if target is None else target
        s = wt.detach().pow(2).mean((-2, -1), keepdim=True).sqrt().clamp(min=1e-12)
        d = torch.diagonal(ht.detach(), dim1=-2, dim2=-1).abs()
        h = (d / d.mean(-1, keepdim=True).clamp(min=1e-30)).unsqueeze(-2)
    lq = (((wt - t) / s).pow(2) * h).mean((-2, -1))
    loss = lq
    if opts.hbd_lambda > 0 and ht.shape[-1] < opts.hbd_max_n:
        loss = loss + opts.hbd_lambda * offblock_energy(ht, opts.hbd_block)
    return loss, lq


class _Stacked:
    """The :class:`HARPRotation` s of several layers of one size as one: each stage's ``Θ`` stacked into
    ``[L, d/b, b, b]``, so that a stage is one batched solve and one einsum for all L layers."""

    def __init__(self, rots: list[HARPRotation]):
        r0 = rots[0]
        if any((r.d, r.stages, r.mixer, r.seed) != (r0.d, r0.stages, r0.mixer, r0.seed) for r in rots):
            raise ValueError("rotations fitted together must have the same size, schedule, mixer and seed")
        self.rots, self.stages = rots, r0.stages
        self.mixers = [getattr(r0, f"mixer_{b}") for b, _ in self.stages]
        self.thetas = [torch.stack([r.thetas[i].detach() for r in rots]).requires_grad_() for i in range(len(self.stages))]

    def kernels(self) -> list[torch.Tensor]:
        return [cayley(th) @ mx for th, mx in zip(self.thetas, self.mixers)]

    def apply(self, x: torch.Tensor, ks: list[torch.Tensor]) -> torch.Tensor:
        """``x_l·R_l`` for ``x`` ``[L, r, d]`` (HARPRotation.apply, layer by layer)."""
        for k, (b, st) in zip(ks, self.stages):
            x = stage(x, k, b, st)
        return x

    @torch.no_grad()
    def write_back(self) -> None:
        for i, th in enumerate(self.thetas):
            for r, t in zip(self.rots, th):
                r.thetas[i].copy_(t)


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


#: Set once a capture failed in this process: later fits run eager (a failed capture can leave PyTorch's
#: allocator in a state where another capture crashes).
_CAPTURE_FAILED = [False]

#: Eager steps before a CUDA graph is captured: they build Adam's state and the cached grid
#: constants outside the capture (and are real steps of the fit).
GRAPH_WARMUP = 3


def fit_harp(w: torch.Tensor, h: torch.Tensor, transform: TwoSided, grid: Grid, opts: FitOptions = FitOptions(),
             *, cuda_graph: bool | None = None) -> FitResult:
    """Fit one layer's ``transform.u`` and ``transform.v``: :func:`fit_harp_many` of one layer."""
    return fit_harp_many([w], [h], [transform], grid, opts, cuda_graph=cuda_graph)[0]


def fit_harp_many(ws: list[torch.Tensor], hs: list[torch.Tensor], transforms: list[TwoSided], grid: Grid,
                  opts: FitOptions = FitOptions(), *, cuda_graph: bool | None = None) -> list[FitResult]:
    """Fit the rotations (:class:`~adahop.ptq.rotation.HARPRotation` modules, on the weights' device) of
    L layers of one shape at once, in place, then round their parameters to what the artifact stores (FP16).

    The layers' losses are summed: no parameter is shared, so each ``Θ`` gets its own layer's gradient and
    Adam (elementwise) makes the same updates as L separate fits, while each stage of all L layers is one
    batched solve and one einsum (q and o of a block, or k and v: half the launches).

    Args:
        ws: the weights, each ``[m, n]`` (float32). hs: their ``E[x xᵀ]``, each ``[n, n]``.
        transforms: each layer's signs and two rotations (same sizes, schedules, mixers and seeds); the
            signs stay fixed.
        grid: the quantizer whose RTN is the target.
        opts: :class:`FitOptions`.
        cuda_graph: replay each Adam step from one captured CUDA graph (None: on CUDA when the target
            is refreshed every step and the grid has no tensor-wide scale: NVFP4's is read to the host).
            A step is ~1,000 small ops, ~400 of them kernels (``scripts/bench_harp.py --count-ops``), so
            on a GPU the host's launches, not the arithmetic, set its time; the graph removes them. A
            capture that fails falls back to eager steps with a warning, and so do the process's later fits.

    Returns:
        One :class:`FitResult` per layer; ``seconds`` is the whole fit's time divided by L, and
        ``history`` the layer's loss every 50 steps.

    Raises:
        ValueError: lists of different lengths or shapes, ``cuda_graph=True`` off CUDA or with
            ``opts.refresh > 1``, or fitted parameters that overflow FP16 (a diverged fit: lower the lr).

    Source: `specs/related_methods.md` §2.3–§2.4 (the objective, Adam at lr 0.03 for 1200 steps); the
    stacking and the CUDA graph are ours and change no update.
    """
    if not ws or not len(ws) == len(hs) == len(transforms) or len({tuple(x.shape) for x in ws}) != 1:
        raise ValueError(f"fit_harp_many needs as many weights ({len(ws)}), Hessians ({len(hs)}) and transforms "
                         f"({len(transforms)}), at least one, and weights of one shape ({sorted({tuple(x.shape) for x in ws})})")
    on_cuda = ws[0].device.type == "cuda"
    if cuda_graph and (not on_cuda or opts.refresh != 1):
        raise ValueError(f"cuda_graph=True needs w on CUDA (it is on {ws[0].device}) and refresh=1 (it is {opts.refresh})")
    graph = (on_cuda and opts.refresh == 1 and not grid.tensor_scale and not _CAPTURE_FAILED[0]) if cuda_graph is None else cuda_graph
    hns = [h.float().to(ws[0].device) / torch.diagonal(h).float().mean().clamp(min=1e-30) for h in hs]
    w, hn = torch.stack([x.float() for x in ws]), torch.stack(hns)
    s_out = torch.stack([t.s_out for t in transforms]).float()
    s_in = torch.stack([t.s_in for t in transforms]).float()
    su, sv = _Stacked([t.u for t in transforms]), _Stacked([t.v for t in transforms])
    # capturable on every CUDA fit: the step count on the GPU, and eager and graphed fits the same arithmetic
    opt = torch.optim.Adam(su.thetas + sv.thetas, lr=opts.lr, capturable=on_cuda)

    def losses():  # per layer, through each TwoSided (what the artifact's rotations give)
        with torch.no_grad():
            return [proxy_loss(t.weight(x), t.hessian(hn_l), grid, opts) for t, x, hn_l in zip(transforms, ws, hns)]

    target = None

    def step(i: int) -> torch.Tensor:
        """One Adam step (gradients None on entry); each layer's loss before it, detached ``[L]``."""
        nonlocal target
        ku, kv = su.kernels(), sv.kernels()  # once per step: W and both sides of H share V's solves
        wt = su.apply((sv.apply(w * s_in[:, None, :], kv) * s_out[:, :, None]).transpose(1, 2), ku).transpose(1, 2)
        ht = sv.apply(sv.apply(hn * s_in[:, :, None] * s_in[:, None, :], kv).transpose(1, 2), kv).transpose(1, 2)
        if i % opts.refresh == 0:
            with torch.no_grad():
                target = _rtn(grid, wt.detach())
        loss, _ = proxy_loss(wt, ht, grid, opts, target)
        loss.sum().backward()
        opt.step()
        return loss.detach()

    hist: list[list[float]] = [[] for _ in ws]

    def record(i: int, loss: torch.Tensor) -> None:
        if i % 50 == 0:
            for hl, v in zip(hist, loss.tolist()):
                hl.append(v)

    def eager(first: int) -> None:
        for i in range(first, opts.steps):
            opt.zero_grad(set_to_none=True)
            record(i, step(i))

    start = losses()
    if on_cuda:
        torch.cuda.synchronize(ws[0].device)
    t0 = time.perf_counter()
    if graph and opts.steps > GRAPH_WARMUP:
        graph = _graphed(step, eager, record, opt, opts.steps, ws[0].device)
    else:
        graph = False
        eager(0)
    su.write_back()
    sv.write_back()
    for t in transforms:
        t.u.round_params_fp16()
        t.v.round_params_fp16()
    if not all(bool(torch.isfinite(th).all()) for t in transforms for th in [*t.u.thetas, *t.v.thetas]):
        raise ValueError("HARP's fitted rotation parameters overflow FP16, the format the artifact stores them in: the fit "
                         f"diverged at lr {opts.lr}; lower --harp-lr")
    if on_cuda:
        torch.cuda.synchronize(ws[0].device)
    secs = (time.perf_counter() - t0) / len(ws)
    return [FitResult(float(l0), float(l1), float(q0), float(q1), secs, opts.steps, hl, bool(graph))
            for (l0, q0), (l1, q1), hl in zip(start, losses(), hist)]


def _graphed(step, eager, record, opt, steps: int, device) -> bool:
    """Run ``steps`` Adam steps: :data:`GRAPH_WARMUP` eager on a side stream, then one captured step
    replayed (PyTorch's whole-network capture recipe). False if the capture failed and the rest ran eager."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(GRAPH_WARMUP):
            opt.zero_grad(set_to_none=True)
            record(i, step(i))
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # backward inside the capture allocates the grads from the graph's pool
    try:
        with torch.cuda.graph(g):
            static_loss = step(GRAPH_WARMUP)  # refresh == 1: every step takes a fresh target
    except RuntimeError as e:  # nothing ran during the capture: the parameters are those after warm-up
        _CAPTURE_FAILED[0] = True
        warnings.warn(f"HARP fit: CUDA graph capture failed ({str(e).splitlines()[0][:160]}); this and later fits run eager")
        torch.cuda.synchronize(device)
        eager(GRAPH_WARMUP)
        return False
    for i in range(GRAPH_WARMUP, steps):
        g.replay()
        record(i, static_loss)
    return True
