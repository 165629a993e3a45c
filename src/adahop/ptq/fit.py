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

import contextlib
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

import torch

from .grids import Grid
from .incoherence import TwoSided
from .ldlq import require_finite, require_hessian
from .rotation import HARPRotation, cayley, stage

__all__ = ["FitOptions", "fit_harp", "fit_harp_many", "fit_harp_groups", "proxy_loss", "offblock_energy"]


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
        for name in ("steps", "hbd_block", "hbd_max_n", "refresh"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"HARP {name}={v!r} must be an integer >= 1")
        for name in ("lr", "hbd_lambda"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Real):
                raise ValueError(f"HARP {name}={getattr(self, name)!r} must be a number")
        if not (math.isfinite(self.lr) and self.lr > 0) or not (math.isfinite(self.hbd_lambda) and self.hbd_lambda >= 0):
            raise ValueError(f"HARP lr ({self.lr}) must be finite and > 0, and hbd_lambda ({self.hbd_lambda}) finite and >= 0")


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
    graph_error: str = ""
    """Why the CUDA graph capture failed (its first line), empty if it did not or none was tried."""


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
        ValueError: lists of different lengths or shapes, a weight, Hessian and transform of sizes that do not
            fit each other, a weight or Hessian with NaN or inf, ``cuda_graph=True`` off CUDA or with
            ``opts.refresh > 1``, or fitted parameters that overflow FP16 (a diverged fit: lower the lr).

    Source: `specs/related_methods.md` §2.3–§2.4 (the objective, Adam at lr 0.03 for 1200 steps); the
    stacking and the CUDA graph are ours and change no update.
    """
    return fit_harp_groups([(ws, hs, transforms)], grid, opts, cuda_graph=cuda_graph)[0]


def fit_harp_groups(groups: list[tuple[list[torch.Tensor], list[torch.Tensor], list[TwoSided]]], grid: Grid,
                    opts: FitOptions = FitOptions(), *, cuda_graph: bool | None = None,
                    labels: list[str] | None = None) -> list[list[FitResult]]:
    """:func:`fit_harp_many` of several groups ``(ws, hs, transforms)`` (a block's shapes: q+o, k+v,
    gate+up, down), each group's layers of one shape. Returns each group's results, in order.

    On CUDA with graphs, every group's step is captured first, then the graphs are replayed step by step,
    each on a stream of its own: a step's ~400 kernels are too small to fill the GPU, so the groups'
    kernels overlap, where fitting one group after the other leaves the GPU mostly idle. The updates are
    the same as separate fits (no group reads another's tensors). Elsewhere the groups run one after the
    other. ``seconds`` of every result is the call's wall time divided by all its layers.

    Raises:
        ValueError: as :func:`fit_harp_many`, for any group, before any fit runs (shapes, options) or
            after all ran (FP16 overflow); the message starts with the group's entry of ``labels``, if given;
            ``labels`` of another length than ``groups``.

    Source: ours (`specs/related_methods.md` §2.3 fits one layer at a time; this changes no update).
    """
    if labels is not None and len(labels) != len(groups):
        raise ValueError(f"fit_harp_groups: {len(labels)} labels for {len(groups)} groups; give one label a group")

    def labelled(k: int, fn):  # the group's label in front of its error
        try:
            return fn()
        except ValueError as e:
            if labels is None:
                raise
            raise ValueError(f"{labels[k]}: {e}") from None

    fits = [labelled(k, lambda g=g: _Fit(*g, grid, opts, cuda_graph)) for k, g in enumerate(groups)]
    if not fits:
        return []
    device, on_cuda = fits[0].device, fits[0].on_cuda
    if on_cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with _capturable_linalg(on_cuda):  # eager fits too: eager and graphed steps run the same solver
        replayed = [f for f in fits if f.capture()]  # a fit that is not captured runs all its steps eager here
        if replayed:
            streams = [torch.cuda.Stream(device) for _ in replayed]
            for st in streams:
                st.wait_stream(torch.cuda.current_stream(device))
            for i in range(GRAPH_WARMUP, opts.steps):
                for f, st in zip(replayed, streams):
                    with torch.cuda.stream(st):
                        f.replay(i)
            for st in streams:
                torch.cuda.current_stream(device).wait_stream(st)
    for k, f in enumerate(fits):
        labelled(k, f.write_back)
    if on_cuda:
        torch.cuda.synchronize(device)
    secs = (time.perf_counter() - t0) / sum(len(f.ws) for f in fits)
    return [f.results(secs) for f in fits]


class _Fit:
    """One group's fit: its layers' stacked weights, Hessians and rotations, their Adam, and one step."""

    def __init__(self, ws: list[torch.Tensor], hs: list[torch.Tensor], transforms: list[TwoSided], grid: Grid,
                 opts: FitOptions, cuda_graph: bool | None):
        if not ws or not len(ws) == len(hs) == len(transforms) or len({tuple(x.shape) for x in ws}) != 1:
            raise ValueError(f"fit_harp_many needs as many weights ({len(ws)}), Hessians ({len(hs)}) and transforms "
                             f"({len(transforms)}), at least one, and weights of one shape ({sorted({tuple(x.shape) for x in ws})})")
        for l, (w, h, t) in enumerate(zip(ws, hs, transforms)):
            _check_layer(l, w, h, t)
        self.device = ws[0].device
        self.on_cuda = self.device.type == "cuda"
        if cuda_graph and (not self.on_cuda or opts.refresh != 1):
            raise ValueError(f"cuda_graph=True needs w on CUDA (it is on {self.device}) and refresh=1 (it is {opts.refresh})")
        self.use_graph = ((self.on_cuda and opts.refresh == 1 and not grid.tensor_scale) if cuda_graph is None
                          else cuda_graph) and opts.steps > GRAPH_WARMUP
        self.ws, self.transforms, self.grid, self.opts = ws, transforms, grid, opts
        self.hns = [h.float().to(self.device) / torch.diagonal(h).float().mean().clamp(min=1e-30) for h in hs]
        self.w, self.hn = torch.stack([x.float() for x in ws]), torch.stack(self.hns)
        self.s_out = torch.stack([t.s_out for t in transforms]).float()
        self.s_in = torch.stack([t.s_in for t in transforms]).float()
        self.su, self.sv = _Stacked([t.u for t in transforms]), _Stacked([t.v for t in transforms])
        # capturable on every CUDA fit: the step count on the GPU, and eager and graphed fits the same arithmetic
        self.opt = torch.optim.Adam(self.su.thetas + self.sv.thetas, lr=opts.lr, capturable=self.on_cuda)
        self.target = None
        self.hist: list[torch.Tensor] = []  # the losses every 50 steps, read to the host at the end (no sync per read)
        self.graph, self.static_loss, self.error = None, None, ""
        self.start = self.losses()

    def losses(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, through each TwoSided (what the artifact's rotations give)."""
        with torch.no_grad():
            return [proxy_loss(t.weight(x), t.hessian(hn_l), self.grid, self.opts)
                    for t, x, hn_l in zip(self.transforms, self.ws, self.hns)]

    def step(self, i: int) -> torch.Tensor:
        """One Adam step (gradients None on entry); each layer's loss before it, detached ``[L]``."""
        su, sv, s_in, s_out = self.su, self.sv, self.s_in, self.s_out
        ku, kv = su.kernels(), sv.kernels()  # once per step: W and both sides of H share V's solves
        wt = su.apply((sv.apply(self.w * s_in[:, None, :], kv) * s_out[:, :, None]).transpose(1, 2), ku).transpose(1, 2)
        ht = sv.apply(sv.apply(self.hn * s_in[:, :, None] * s_in[:, None, :], kv).transpose(1, 2), kv).transpose(1, 2)
        if i % self.opts.refresh == 0:
            with torch.no_grad():
                self.target = _rtn(self.grid, wt.detach())
        loss, _ = proxy_loss(wt, ht, self.grid, self.opts, self.target)
        loss.sum().backward()
        self.opt.step()
        return loss.detach()

    def record(self, i: int, loss: torch.Tensor) -> None:
        if i % 50 == 0:
            self.hist.append(loss.clone())  # a replayed graph overwrites its loss: keep a copy

    def capture(self) -> bool:
        """Capture one step's CUDA graph after :data:`GRAPH_WARMUP` eager steps (PyTorch's whole-network
        recipe): True if it is to be replayed; else all the fit's steps ran eager here."""
        if not self.use_graph or _CAPTURE_FAILED[0]:
            self.eager_steps(0, self.opts.steps)
            return False
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.eager_steps(0, GRAPH_WARMUP)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)  # backward inside the capture allocates the grads from the graph's pool
        try:
            with torch.cuda.graph(g):
                self.static_loss = self.step(GRAPH_WARMUP)  # refresh == 1: every step takes a fresh target
        except RuntimeError as e:  # nothing ran during the capture: the parameters are those after warm-up
            _CAPTURE_FAILED[0] = True
            self.error = (str(e).splitlines() or [type(e).__name__])[0][:200]
            warnings.warn(f"HARP fit: CUDA graph capture failed ({self.error}); this and later fits run eager")
            torch.cuda.synchronize(self.device)
            self.eager_steps(GRAPH_WARMUP, self.opts.steps)
            return False
        self.graph = g
        return True

    def eager_steps(self, first: int, stop: int) -> None:
        for i in range(first, stop):
            self.opt.zero_grad(set_to_none=True)
            self.record(i, self.step(i))

    def replay(self, i: int) -> None:
        self.graph.replay()
        self.record(i, self.static_loss)

    def write_back(self) -> None:
        """The stacked parameters into each layer's rotations, rounded to what the artifact stores.

        Raises:
            ValueError: a parameter that overflows FP16 (the fit diverged).
        """
        self.su.write_back()
        self.sv.write_back()
        for t in self.transforms:
            t.u.round_params()
            t.v.round_params()
        if not all(bool(torch.isfinite(th).all()) for t in self.transforms for th in [*t.u.thetas, *t.v.thetas]):
            raise ValueError("HARP's fitted rotation parameters overflow FP16, the format the artifact stores them in: the fit "
                             f"diverged at lr {self.opts.lr}; lower --harp-lr")

    def results(self, secs: float) -> list[FitResult]:
        hist = torch.stack(self.hist).T.tolist() if self.hist else [[] for _ in self.ws]
        return [FitResult(float(l0), float(l1), float(q0), float(q1), secs, self.opts.steps, hl, self.graph is not None,
                          self.error)
                for (l0, q0), (l1, q1), hl in zip(self.start, self.losses(), hist)]


def _check_layer(l: int, w: torch.Tensor, h: torch.Tensor, t: TwoSided) -> None:
    """Layer ``l``'s weight, Hessian and transform fit each other and hold only finite numbers, so that no
    broadcast fits a wrong shape and no NaN reads as a diverged fit later."""
    if not (isinstance(t.u, HARPRotation) and isinstance(t.v, HARPRotation)):
        raise ValueError(f"layer {l}: HARP fits HARPRotation s, the transform holds {type(t.u).__name__} and "
                         f"{type(t.v).__name__}; build it with TwoSided.random_signs(HARPRotation(m), HARPRotation(n), ...)")
    if w.dim() != 2:
        raise ValueError(f"layer {l}: the weight must be 2-D [out, in]; it has shape {tuple(w.shape)}")
    m, n = w.shape
    if (t.u.d, t.v.d) != (m, n):
        raise ValueError(f"layer {l}: the transform's rotations are of sizes {t.u.d} (output) and {t.v.d} (input), the "
                         f"weight is [{m}, {n}]: build the TwoSided for this layer's shape")
    if tuple(h.shape) != (n, n):
        raise ValueError(f"layer {l}: the Hessian must be [{n}, {n}] (E[x xᵀ] of the layer's {n} inputs); it has shape "
                         f"{tuple(h.shape)}")
    require_finite(f"HARP fit, layer {l}", weight=w, Hessian=h)
    require_hessian(f"HARP fit, layer {l}", h)


@contextlib.contextmanager
def _capturable_linalg(on_cuda: bool):
    """cuSOLVER/cuBLAS as PyTorch's CUDA linear-algebra backend while a fit runs, then the previous one back.

    The capture of the fits with a 43×43 Cayley stage (2752 = 8·8·43, llama-350m's MLP) failed on the H200 in
    round 22 and they ran eager, 3–4× slower, while the 8×8 stages captured. Our reading of PyTorch's LU
    dispatch (not confirmed on the GPU: the error line was not kept): by default it factors a batch of more
    than 16 square matrices larger than 16×16 with MAGMA's batched LU, which synchronizes with the host;
    with cuSOLVER preferred, square batches under 512×512 take cuBLAS's batched LU, as the 8×8 stages do."""
    if not on_cuda:
        yield
        return
    prev = torch.backends.cuda.preferred_linalg_library()
    torch.backends.cuda.preferred_linalg_library("cusolver")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_linalg_library(prev)
