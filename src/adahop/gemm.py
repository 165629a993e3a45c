"""One low-precision GEMM ``C = A·B`` under a :class:`~adahop.recipes.spec.GemmSpec`.

Split in two steps so the autograd function can save operands already prepared for backward
(`DESIGN.md` §2): :func:`prepare` (mean split → outer transform → OE extraction → inner transform →
quantize along Kc) runs per operand, :func:`multiply` combines two prepared operands. Shapes use
the spec's letters: A ``[M, Kc]``, B ``[Kc, N]``.

Strategies (`specs/adahop.md` §3–§5): ``bf16`` exact; ``none`` plain MX; ``iht`` block Hadamard
along Kc on both operands; ``iht+oe_left`` the top-k rows of A (L2 norm) go through a high-
precision GEMM and are scatter-added; ``iht+oe_right`` likewise for the top-k columns of B. ``GemmSpec.oe_select="foid"`` ranks them by
the norm of the first 64 elements along Kc only (FOID, the paper's Figure 9).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .device_constants import on_device
from .formats import MXTensor, NVFP4Tensor
from .hadamard import block_hadamard, hashed_signs, random_signs
from .recipes.spec import GemmSpec, OperandSpec, Transform

__all__ = ["Prepared", "prepare", "multiply", "gemm", "lowp_matmul", "draw_signs", "without_quantization", "oe_indices", "top_indices", "check_outer",
           "TOPK_CHUNK", "TOPK_TWO_PASS"]

Quantized = MXTensor | NVFP4Tensor


@dataclass(eq=False)
class Prepared:
    """An operand ready for :func:`multiply`.

    Attributes:
        side: ``"a"`` or ``"b"``.
        q: the quantized clean operand (None for a BF16 GEMM).
        hp: the high-precision operand, kept when this GEMM's math needs it: ``bf16`` strategy, or
            OE on the *other* side (OE-Left multiplies A's slab by B in high precision).
        oe_idx / oe_slab: extracted row (A) or column (B) indices and the high-precision slab.
        mean: Averis: the dequantized mean vector (``inner``: [M] or [N]), or with ``mean_bf16`` the
            BF16 one (``a_rows``: [Kc]; else it rides in ``q`` as its last row).
        signs: the sign vector used by the inner transform (shared by both operands).
        rows: the unpadded outer size (M of A or N of B); Kc: the contracted size after padding.
    """

    side: str
    q: Quantized | None = None
    hp: torch.Tensor | None = None
    oe_idx: torch.Tensor | None = None
    oe_slab: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    signs: torch.Tensor | None = None
    rows: int = 0
    Kc: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this prepared operand holds (what saving it for backward costs)."""
        n = self.q.nbytes if self.q is not None else 0
        for t in (self.hp, self.oe_idx, self.oe_slab, self.mean, self.signs):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


def _kernels():
    from . import kernels  # layer 5; imported lazily so adahop.gemm stays cheap to import

    return kernels


@torch.compiler.assume_constant_result
def _fixed_signs(n: int, seed: int) -> tuple[int, ...]:
    # a constant to the compiler: a torch.Generator cannot be created inside a traced graph (outside
    # dynamo, draw_signs calls this under on_device, which builds outside any fake mode)
    return tuple(int(v) for v in random_signs(n, generator=torch.Generator().manual_seed(seed)))


def draw_signs(spec: GemmSpec, generator: torch.Generator | None, device, *, seed: torch.Tensor | None = None,
               salt: int = 0) -> torch.Tensor | None:
    """The ±1 signs (float32 ``[block_size]``) of this GEMM call's inner transform, or None when it has none.

    ``fixed`` signs are one vector per ``sign_seed``. ``per_call`` signs come from ``generator``
    (eager mode), or, given ``seed`` (a 0-d int64 tensor, the compiled path), are
    :func:`~adahop.hadamard.hashed_signs` of (``seed``, ``salt``): a pure function of a graph input,
    so that a compiled backward that recomputes them gets the forward's vector."""
    t = spec.transform
    if t is None or t.signs == "none":
        return None
    n = t.block_size
    if t.signs == "fixed":  # one vector for every layer and step (cached per device; a fresh copy of it)
        return on_device(("fixed_signs", n, t.sign_seed),
                         lambda: torch.tensor(_fixed_signs(n, t.sign_seed), dtype=torch.float32), device).clone()
    if seed is not None:
        s = hashed_signs(seed, n, salt=salt)
        # no no-op .to(): under torch.compile an alias of a saved tensor breaks the autograd.Function's capture
        return s if s.device == torch.device(device) else s.to(device)
    return random_signs(n, generator=generator, device=generator.device if generator is not None else device)


def _pad_kc(t: torch.Tensor, kc_axis: int, multiple: int) -> torch.Tensor:
    pad = (-t.shape[kc_axis]) % multiple
    if not pad:
        return t
    return F.pad(t, (0, pad)) if kc_axis == 1 else F.pad(t, (0, 0, 0, pad))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_outer(n: int, tr: Transform | None, axis: int, what: str) -> None:
    """Raise ValueError unless the outer Hadamard ``tr`` (None: nothing to check) fits a dimension of size ``n``
    along ``axis`` (0: A's rows, ``GemmSpec.outer_a``; 1: B's columns, ``outer_b``); ``what`` names the operand."""
    if tr is None:
        return
    b = tr.block_size or n
    if b & (b - 1) or n % b:
        name, fix = ("outer_a", "HALO-2 rotates the dgrad ∇Y along tokens: make batch_size*seq_len a power of two "
                     "(a DataLoader's short last batch: drop_last=True)") \
            if axis == 0 else ("outer_b", "HALO-1/2 rotate X and W along in_features: it must be a power of two")
        raise ValueError(
            f"{what}: the outer Hadamard (GemmSpec.{name}, block_size={tr.block_size}) needs a power-of-two size "
            f"dividing the dimension; got dimension {n}. To fix: {fix}"
        )


def _outer(t: torch.Tensor, tr: Transform | None, axis: int, what: str) -> torch.Tensor:
    """Full-size (or block) Hadamard along an outer dim; undone on the output."""
    if tr is None:
        return t
    check_outer(t.shape[axis], tr, axis, what)
    return block_hadamard(t, block_size=tr.block_size or t.shape[axis], axis=axis)


@dataclass(frozen=True, eq=False)
class Unquantized:
    """Stand-in for a quantized tensor when quantization is switched off (``fmt="none"``)."""

    values: torch.Tensor
    shape: tuple[int, ...] = ()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.values.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


def without_quantization(spec: GemmSpec) -> GemmSpec:
    """``spec`` with both operands unquantized: transforms, OE and splits still run, so the result
    must equal the exact product to FP32 rounding (the placement test of every recipe)."""
    none = OperandSpec(fmt="none")
    return replace(spec, a=none, b=none)


def _quantize(t: torch.Tensor, axis: int, op: OperandSpec, tr: Transform | None, signs, generator, backend: str,
              outputs: str = "all", zero_rows: torch.Tensor | None = None):
    """Zero the OE rows (``zero_rows`` along the other axis), inner transform along ``axis``, quantize
    along it. ``outputs`` as in :func:`adahop.kernels.iht_quantize_mxfp4`; for NVFP4 ``"fp8"`` (the
    GEMM's operand form) asks for the BF16 values (:func:`adahop.kernels.iht_quantize_nvfp4`)."""
    if op.fmt == "mxfp4":  # the kernel zeroes the OE rows as it reads: no copy of t
        if outputs == "fp8" and not _kernels().folds_exactly(op.max_scale_range):
            outputs = "all"  # no exact FP8 fold without the range limit: the GEMM multiplies the BF16 dequantized codes
        return _kernels().iht_quantize_mxfp4(
            t, axis=axis, hadamard_block=tr.block_size if tr is not None else None, signs=signs,
            rounding=op.rounding, scale_rule=op.scale_rule, max_scale_range=op.max_scale_range,
            generator=generator, backend=backend, outputs=outputs, zero_rows=zero_rows,
        )  # fmt: skip
    if op.fmt == "nvfp4":  # fused likewise: transform, quantize and, for the GEMM at once, its BF16 operand
        return _kernels().iht_quantize_nvfp4(
            t, axis=axis, hadamard_block=tr.block_size if tr is not None else None, signs=signs,
            rounding=op.rounding, tile_2d=op.tile_2d, generator=generator, backend=backend,
            outputs={"fp8": "values", "codes": "codes"}.get(outputs, "all"), zero_rows=zero_rows,
        )  # fmt: skip
    if zero_rows is not None:
        t = t.index_fill(1 - axis, zero_rows, 0)
    if op.fmt == "none":
        if tr is not None:
            t = block_hadamard(t.float(), block_size=tr.block_size, axis=axis, signs=signs)
        # a copy of its own: an alias of the input (a no-op .float()) saved for backward breaks torch.compile's capture
        return Unquantized(t.to(torch.float32, copy=True), tuple(t.shape))
    raise ValueError(f"unknown operand format {op.fmt!r}")


def prepare(
    t: torch.Tensor,
    side: str,
    spec: GemmSpec,
    *,
    signs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: str = "reference",
    outputs: str = "all",
) -> Prepared:
    """Prepare operand ``t`` (A ``[M, Kc]`` when ``side="a"``, B ``[Kc, N]`` when ``side="b"``).

    ``outputs``: what the fused MXFP4 quantizer writes: ``"fp8"`` for an operand multiplied at once,
    ``"codes"`` for one saved for backward, ``"all"`` (`adahop.kernels.iht_quantize_mxfp4`).

    Raises:
        ValueError: bad side, non-2-D input, or an outer transform that does not fit.
    """
    if side not in ("a", "b"):
        raise ValueError(f"side must be 'a' or 'b', got {side!r}")
    if t.ndim != 2:
        raise ValueError(f"GEMM operands are 2-D, got shape {tuple(t.shape)} for operand {side.upper()}")
    kc_axis, outer_axis = (1, 0) if side == "a" else (0, 1)
    rows, kc = t.shape[outer_axis], t.shape[kc_axis]
    strategy = spec.strategy
    if strategy == "calibrated":
        raise ValueError("GemmSpec strategy 'calibrated' must be resolved from the plan before the GEMM runs")
    if strategy == "bf16":
        return Prepared(side=side, hp=t, rows=rows, Kc=kc)
    other_oe = "iht+oe_right" if side == "a" else "iht+oe_left"
    prep = Prepared(side=side, rows=rows, signs=signs, hp=t if strategy == other_oe else None)

    if spec.mean_split == "a_rows" and side == "a":  # Averis fprop/dgrad: token mean over M
        mu = t.float().mean(dim=0, keepdim=True)  # [1, Kc]
        if spec.mean_bf16:  # kept apart, unquantized: multiply() adds mean · B
            mu = mu.to(torch.bfloat16).float()  # R takes the mean's BF16 rounding: R + 1·μ is A exactly
            t = t.float() - mu
            prep.mean = mu.flatten()
        else:
            t = torch.cat((t.float() - mu, mu), dim=0)  # the mean rides along as one extra row
    elif spec.mean_split == "inner":  # Averis wgrad: token means over Kc
        mu = t.float().mean(dim=kc_axis, keepdim=True)
        if spec.mean_bf16:  # as above: the residual takes the BF16 rounding, the split stays exact
            mu = mu.to(torch.bfloat16).float()
        t = t.float() - mu
        prep.mean = mu.flatten().clone()  # a vector of its own: a view saved for backward breaks torch.compile's capture

    t = _outer(t, spec.outer_a if side == "a" else spec.outer_b, outer_axis, f"operand {side.upper()}")
    own_oe = "iht+oe_left" if side == "a" else "iht+oe_right"
    if strategy == own_oe:
        idx = oe_indices(t.narrow(outer_axis, 0, rows), kc_axis, min(spec.oe_rank, rows),
                         None if spec.oe_select == "exact" else spec.foid_prefix)
        prep.oe_idx = idx
        prep.oe_slab = t.index_select(outer_axis, idx)  # [k, Kc] or [Kc, k], high precision

    tr = spec.transform
    if tr is not None:
        b = tr.block_size or _next_pow2(kc)
        tr = replace(tr, block_size=b)
        t = _pad_kc(t, kc_axis, b)  # zero rows/cols along Kc leave A·B unchanged
    prep.Kc = t.shape[kc_axis]
    op = spec.a if side == "a" else spec.b
    prep.q = _quantize(t, kc_axis, op, tr, signs, generator, backend, outputs, prep.oe_idx)  # OE rows quantize as 0
    if spec.mean_split == "inner" and not spec.mean_bf16:  # the mean vector is quantized on its own
        if op.fmt == "nvfp4":  # as one row, through the fused quantizer (the reference's numbers under RNE)
            q = _kernels().iht_quantize_nvfp4(prep.mean.reshape(1, -1), axis=1, rounding=op.rounding,
                                              tile_2d=op.tile_2d, generator=generator, backend=backend, outputs="values")
            prep.mean = q.dequantize(prep.mean.dtype).flatten().clone()
        elif op.fmt != "none":
            from .formats import fake_quantize

            prep.mean = fake_quantize(prep.mean, op.fmt, **op.quant_kwargs(), generator=generator).clone()
    return prep


def oe_indices(t: torch.Tensor, kc_axis: int, k: int, prefix: int | None = None) -> torch.Tensor:
    """The ``k`` indices along the outer axis of ``t`` with the largest L2 norm along ``kc_axis``:
    the rows (``kc_axis=1``) or columns (``kc_axis=0``) OE extracts. With ``prefix`` the norm covers
    the first ``prefix`` elements along Kc only: FOID (`GemmSpec.oe_select`, the paper's Figure 9).

    Args:
        t: a 2-D operand. kc_axis: 0 or 1. k: how many, ``1 <= k <= outer size``.
        prefix: FOID's prefix length (64 in the paper), or None for the exact top-k.

    Returns:
        int64 ``[k]`` indices, in decreasing norm order.

    Raises:
        ValueError: ``t`` not 2-D, a bad axis, or ``k`` out of range.
    """
    if t.ndim != 2 or kc_axis not in (0, 1):
        raise ValueError(f"oe_indices needs a 2-D operand and kc_axis 0 or 1, got shape {tuple(t.shape)}, axis {kc_axis}")
    outer = t.shape[1 - kc_axis]
    if not 1 <= k <= outer:
        raise ValueError(f"k={k} must be in [1, {outer}] (the operand's outer size)")
    scan = t if prefix is None else t.narrow(kc_axis, 0, min(prefix, t.shape[kc_axis]))
    # norms in FP32 without an FP32 copy of t (a float64 t keeps float64: vector_norm refuses to narrow)
    dtype = torch.promote_types(t.dtype, torch.float32)
    return top_indices(torch.linalg.vector_norm(scan, dim=kc_axis, dtype=dtype), k)


#: The slice length of :func:`top_indices`'s first pass.
TOPK_CHUNK = 1024
#: The lengths :func:`top_indices` takes in two passes (inclusive). Replayed from a CUDA graph on an H100
#: (`scripts/bench_topk.py`, round 33, k = 64), two passes against one ``torch.topk``: 4,096 long 0.79×,
#: 8,192 1.15×, 16,384 1.87×, 32,768 1.09×, 65,536 0.96×; ``torch.topk`` of one slice goes multi-block
#: itself past about 20,000.
TOPK_TWO_PASS = (8192, 32768)


def top_indices(v: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest values of the 1-D ``v``, largest first: ``torch.topk(v, k).indices``
    up to the order of ties, in two passes for the lengths :data:`TOPK_TWO_PASS`. There ``torch.topk``
    of one vector runs on the GPU as a single thread block (``sbtopk::gatherTopK``, 2.74 ms of a
    llama-125m AdaHOP-Lv2 step at 16,384 tokens, `docs/benchmarks.md` round 17); the top ``k`` of each
    :data:`TOPK_CHUNK`-long slice runs a block per slice, and the top ``k`` overall are among those
    candidates, so a second top-k over them is exact. Source: OE's runtime index selection, `specs/adahop.md` §4.

    Args:
        v: 1-D, floating point (NaN counts as largest, as in ``torch.topk``). k: ``1 <= k <= len(v)``.

    Returns:
        int64 ``[k]`` indices into ``v``.

    Raises:
        ValueError: ``v`` not 1-D, or ``k`` out of range.
    """
    if v.ndim != 1 or not 1 <= k <= v.numel():
        raise ValueError(f"top_indices needs a 1-D tensor and 1 <= k <= its length, got shape {tuple(v.shape)}, k={k}")
    n = v.numel()
    if not TOPK_TWO_PASS[0] <= n <= TOPK_TWO_PASS[1] or 4 * k > TOPK_CHUNK:  # or too few values dropped by pass one
        return torch.topk(v, k).indices
    full = n - n % TOPK_CHUNK
    first = torch.topk(v[:full].view(-1, TOPK_CHUNK), k, dim=1)
    where = (first.indices + torch.arange(0, full, TOPK_CHUNK, device=v.device).unsqueeze(1)).flatten()
    values = first.values.flatten()
    if full < n:  # the tail, shorter than a slice, is all candidates (no padding value that could tie with v's)
        values = torch.cat((values, v[full:]))
        where = torch.cat((where, torch.arange(full, n, device=v.device)))
    return where[torch.topk(values, k).indices]


def _own(c: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``c[:rows, :cols]`` in ``dtype`` as a tensor of its own, never a view or a no-op alias: the
    layer's output must take in-place ops as ``nn.Linear``'s does, and under torch.compile an
    alias of an intermediate lost its gradient (dynamo bound dY to the duplicate)."""
    if c.shape != (rows, cols):
        c = c[:rows, :cols]
        return c.to(dtype) if c.dtype != dtype else c.clone()
    return c.to(dtype) if c.dtype != dtype else c


def _kc_sums(q, kc_axis: int) -> torch.Tensor:
    """A quantized operand's sums along its contracted axis, float32 (Averis's cross terms)."""
    if isinstance(q, NVFP4Tensor):  # no FP32 dequantized copy: the exact BF16 block values, FP32 sums
        return _kernels().nvfp4_kc_sums(q)
    return q.dequantize(torch.float32).sum(dim=kc_axis)


def multiply(pa: Prepared, pb: Prepared, spec: GemmSpec, *, out_dtype: torch.dtype = torch.float32, backend: str = "reference") -> torch.Tensor:
    """``C = A·B`` from prepared operands, FP32 accumulation, returned as ``out_dtype`` ``[M, N]``."""
    if spec.strategy == "bf16":
        c = pa.hp @ pb.hp
        return c if c.dtype == out_dtype else c.to(out_dtype)
    if pa.q is None or pb.q is None or pa.Kc != pb.Kc:
        raise ValueError(f"operands were not prepared for the same GEMM (Kc {pa.Kc} vs {pb.Kc})")
    # No term to add after the GEMM except OE's: the GEMM writes out_dtype itself (no FP32 round
    # trip through memory). OE zeroed its rows of A (columns of B) before quantizing, so those rows
    # (columns) of the product are exactly 0 and the slab products are written there, not added.
    oe_only = spec.outer_a is None and spec.outer_b is None and spec.mean_split == "none"
    if isinstance(pa.q, MXTensor) and isinstance(pb.q, MXTensor):
        c = _kernels().mx_matmul(pa.q, pb.q, out_dtype=out_dtype if oe_only else torch.float32, backend=backend,
                                 accumulation=spec.accumulation)
    elif isinstance(pa.q, NVFP4Tensor) and isinstance(pb.q, NVFP4Tensor):  # BF16 tensor cores, FP32 sums
        c = _kernels().nvfp4_matmul(pa.q, pb.q, out_dtype=out_dtype if oe_only else torch.float32, backend=backend)
    else:  # unquantized (fmt="none") or mixed formats: the FP32 product of the dequantized operands
        c = pa.q.dequantize(torch.float32) @ pb.q.dequantize(torch.float32)
    if oe_only:
        c = _own(c, pa.rows, pb.rows, c.dtype)
        if pa.oe_idx is not None:  # OE-Left: C[idx, :] = A_slab · B  (high precision)
            c.index_copy_(0, pa.oe_idx, (pa.oe_slab @ pb.hp).to(c.dtype))
        if pb.oe_idx is not None:  # OE-Right: C[:, idx] = A · B_slab
            c.index_copy_(1, pb.oe_idx, (pa.hp @ pb.oe_slab).to(c.dtype))
        return _own(c, pa.rows, pb.rows, out_dtype)
    # undo the outer transforms (HALO): Hadamards without signs are their own inverse
    if spec.outer_a is not None:
        c = _outer(c, spec.outer_a, 0, "output")
    if spec.outer_b is not None:
        c = _outer(c, spec.outer_b, 1, "output")
    if spec.mean_split == "a_rows" and pa.mean is not None:  # mean_bf16: the BF16 mean times Q(B), broadcast
        c = c + pa.mean.reshape(1, -1) @ pb.q.dequantize(torch.float32)  # no transform, no padded Kc (validate)
    elif spec.mean_split == "a_rows":
        c = c[:-1] + c[-1:]  # residual rows + the broadcast rank-one mean term
    elif spec.mean_split == "inner":
        kc = pa.q.shape[1]
        c = c + kc * torch.outer(pa.mean, pb.mean)
        if spec.mean_cross_terms:
            ra, rb = _kc_sums(pa.q, 1), _kc_sums(pb.q, 0)  # Q(R_A)·1 [M], 1ᵀ·Q(R_B) [N]
            c = c + torch.outer(ra, pb.mean) + torch.outer(pa.mean, rb)
    c = _own(c, pa.rows, pb.rows, c.dtype)
    if pa.oe_idx is not None:  # OE-Left with an outer transform or a mean split: C[idx, :] += A_slab · B
        c = c.index_add(0, pa.oe_idx, (pa.oe_slab @ pb.hp).float())
    if pb.oe_idx is not None:  # OE-Right, likewise: C[:, idx] += A · B_slab
        c = c.index_add(1, pb.oe_idx, (pa.hp @ pb.oe_slab).float())
    return _own(c, pa.rows, pb.rows, out_dtype)


def gemm(a: torch.Tensor, b: torch.Tensor, spec: GemmSpec, *, generator: torch.Generator | None = None,
         out_dtype: torch.dtype | None = None, backend: str = "reference", seed: torch.Tensor | None = None, salt: int = 0) -> torch.Tensor:
    """``A·B`` under ``spec``: prepare both operands (sharing one sign draw, see :func:`draw_signs`
    for ``seed`` and ``salt``) and multiply."""
    signs = draw_signs(spec, generator, a.device, seed=seed, salt=salt)
    pa = prepare(a, "a", spec, signs=signs, generator=generator, backend=backend, outputs="fp8")
    pb = prepare(b, "b", spec, signs=signs, generator=generator, backend=backend, outputs="fp8")
    return multiply(pa, pb, spec, out_dtype=out_dtype or a.dtype, backend=backend)


def lowp_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    strategy: str,
    fmt: str = "mxfp4",
    oe_rank: int = 64,
    oe_select: str = "exact",
    rounding: str = "nearest",
    scale_rule: str = "floor",
    max_scale_range: int | None = None,
    generator: torch.Generator | None = None,
    quantize: bool = True,
    backend: str = "reference",
) -> torch.Tensor:
    """``a @ b`` with an AdaHOP strategy (`specs/adahop.md` §3–§5).

    Args:
        a: ``[M, K]`` float tensor. b: ``[K, N]`` float tensor.
        strategy: ``"bf16"``, ``"none"``, ``"iht"``, ``"iht+oe_left"`` or ``"iht+oe_right"``.
        fmt: ``"mxfp4"`` or ``"nvfp4"``. oe_rank: rows/columns extracted by OE (64).
        oe_select: ``"exact"`` (top-k of the full norm along K) or ``"foid"`` (of the first 64
            elements along K; `adahop.recipes.spec.OE_SELECTS`).
        rounding, scale_rule, max_scale_range: quantizer settings for both operands. The defaults are plain
            OCP MXFP4 (floor rule, no exponent-range limit), not a recipe's: the recipes use
            ``max_scale_range=8`` and the AdaHOP ones ``scale_rule="adahop"`` (``adahop.recipes.presets``);
            :func:`gemm` with a recipe's ``GemmSpec`` runs exactly its GEMM.
        generator: stochastic-rounding bits.
        quantize: False runs every strategy with the quantizer switched off (the transforms and
            OE still run), which must equal ``a @ b`` to FP32 rounding.

    Returns:
        ``[M, N]`` tensor in ``a``'s dtype; zeros where ``M``, ``K`` or ``N`` is 0, as ``a @ b`` gives.

    Raises:
        ValueError: unknown strategy/format, or shapes that do not chain.
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"lowp_matmul needs a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    direct = ("bf16", "none", "iht", "iht+oe_left", "iht+oe_right")  # 'calibrated' is resolved from a layer's plan
    if strategy not in direct:
        raise ValueError(f"lowp_matmul: strategy={strategy!r}; pass one of {direct}"
                         + (" ('calibrated' is a recipe's GEMM, resolved from its layer's plan)" if strategy == "calibrated" else ""))
    op = OperandSpec(fmt=fmt, rounding=rounding, scale_rule=scale_rule, max_scale_range=max_scale_range)
    spec = GemmSpec(strategy=strategy, a=op, b=op, oe_rank=oe_rank, oe_select=oe_select)
    spec.validate("lowp_matmul")
    if a.numel() == 0 or b.numel() == 0:  # torch's answer for an empty product (zeros when K = 0); no block to quantize
        return a.new_zeros(a.shape[0], b.shape[1])
    if not quantize:
        spec = without_quantization(spec)
    return gemm(a, b, spec, generator=generator, backend=backend)
