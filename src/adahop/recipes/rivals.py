"""The rival FP4 training recipes as presets: Tseng et al., HALO, NVIDIA NVFP4, Averis, Quartet.

Each recipe is one small function returning a frozen :class:`~adahop.recipes.spec.Recipe`; its
docstring cites the paper and the spec section and tables what each GEMM does. ``presets.py``
registers :data:`RIVALS` between the plain MXFP4 presets and the AdaHOP ones.

Shared conventions (`specs/baselines.md` §0): fprop ``Y = X·Wᵀ`` contracts K, dgrad ``∇X = ∇Y·W``
contracts N, wgrad ``∇W = ∇Yᵀ·X`` contracts T. Every operand is quantized along its GEMM's
contracted dimension from the high-precision tensor, as TransformerEngine does; no recipe here
re-quantizes an already quantized tensor. Choices that apply to all of them:

- E2M1 rounding is round-half-to-even (RNE) where a paper says "round to nearest" (Quartet's
  Triton code rounds ties toward zero, microxcaling's ``nearest`` away from zero).
- MXFP4 operands keep ``max_scale_range=8``, as the ``mxfp4`` preset does, so every recipe can run
  on the exact FP8 fold of the Hopper fast path (`DESIGN.md` §3). Only blocks more than 2^8
  below the largest block of their row get a coarser scale. ``max_scale_range=None`` gives the
  papers' unlimited E8M0 range (reference backend only).
- Under stochastic rounding NVFP4 rounds the E4M3 block scale *up*, so nothing clips and SR stays
  unbiased (`adahop.formats.nvfp4`); TE rounds it to nearest and accepts the rare clip
  (`specs/baselines.md` §1.7).
"""

from __future__ import annotations

from .spec import GemmSpec, OperandSpec, Recipe, Transform

__all__ = ["tseng", "halo", "nvfp4", "averis", "quartet", "RIVALS", "TE_WGRAD_SIGN_SEED", "TE_WGRAD_SIGNS"]

MX_RNE = OperandSpec(fmt="mxfp4", rounding="nearest", scale_rule="floor", max_scale_range=8)
"""MXFP4, OCP floor scale, round-to-nearest-even."""
MX_SR_TSENG = OperandSpec(fmt="mxfp4", rounding="stochastic", scale_rule="tseng", max_scale_range=8)
"""MXFP4, floor scale with the 3/4 pre-scale (decoded ×4/3, so ×16/9 per GEMM), stochastic rounding."""
MX_SR_CEIL = OperandSpec(fmt="mxfp4", rounding="stochastic", scale_rule="rceil", max_scale_range=8)
"""MXFP4, non-clipping rceil scale, stochastic rounding."""
NV_RNE = OperandSpec(fmt="nvfp4", rounding="nearest")
"""NVFP4 1×16 blocks, RNE."""
NV_SR = OperandSpec(fmt="nvfp4", rounding="stochastic")
"""NVFP4 1×16 blocks, stochastic rounding."""
NV_W_RNE = OperandSpec(fmt="nvfp4", rounding="nearest", tile_2d=True)
"""NVFP4 16×16 tiles (weights: the fprop and dgrad copies of W are identical), RNE."""
NV_W_SR = OperandSpec(fmt="nvfp4", rounding="stochastic", tile_2d=True)
"""NVFP4 16×16 tiles, stochastic rounding."""
BF16 = GemmSpec(strategy="bf16")

TE_WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TransformerEngine's hard-coded sign vector of the NVFP4 wgrad RHT (``get_wgrad_sign_vector``)."""
TE_WGRAD_SIGN_SEED = 28389
"""The ``sign_seed`` whose ``random_signs(16)`` (CPU generator) is exactly :data:`TE_WGRAD_SIGNS`;
found by search and pinned by ``tests/test_recipes.py``."""


def tseng() -> Recipe:
    """Tseng, Yu, Park, "Training LLMs with MXFP4" (arXiv 2502.20586, AISTATS 2025).

    Returns
    -------
    Recipe
        ``"tseng"``: BF16 forward; MXFP4 backward with a 64-block random Hadamard transform (RHT)
        and stochastic rounding, which make the gradient estimate unbiased.

    Notes
    -----
    `specs/baselines.md` §2.1 (the paper's recipe is ``BW_USE_MXFP4=3`` in its code)::

        GEMM   A         B        Kc  format / rounding / scale        transform
        fprop  X         Wᵀ       K   BF16                             -
        dgrad  ∇Y        W        N   MXFP4, SR, 3/4 pre-scale (both)  RHT64 along N
        wgrad  ∇Yᵀ       X        T   MXFP4, SR, 3/4 pre-scale (both)  RHT64 along T

    The RHT ``D_s·H_64`` draws fresh signs ``s`` at every GEMM call (``signs="per_call"``),
    separately for dgrad and wgrad, shared by all blocks and by both operands of the call. The
    3/4 pre-scale (``scale_rule="tseng"``): floor E8M0 exponent, elements quantized as
    ``0.75·x/2^e`` so nothing clips, decoded with ×4/3 (×16/9 on the GEMM output).

    Choices: the paper's optional FP8 forward (TE delayed scaling) is not offered; fprop is
    BF16, as in its headline runs. SR bits come from the layer generator, not microxcaling's.
    """
    bwd = GemmSpec(strategy="iht", a=MX_SR_TSENG, b=MX_SR_TSENG, inner=Transform(block_size=64, signs="per_call"))
    return Recipe(
        name="tseng",
        description="Tseng et al. 2025: BF16 fprop; MXFP4 dgrad/wgrad with RHT-64 (fresh signs per call), "
        "stochastic rounding and the 3/4 pre-scale.",
        fprop=BF16, dgrad=bwd, wgrad=bwd,
    )  # fmt: skip


def halo(level: int) -> Recipe:
    """HALO, Ashkboos et al. (arXiv 2501.02625, NeurIPS 2025): Hadamard placements, in MXFP4.

    Parameters
    ----------
    level : int
        0, 1 or 2 (the paper's HALO-0/1/2).

    Returns
    -------
    Recipe
        ``"halo-<level>"``: MXFP4 RNE with the OCP floor scale on all three GEMMs, plus the
        full-dimension, unsigned Hadamards of that level.

    Raises
    ------
    ValueError
        ``level`` not in (0, 1, 2).

    Notes
    -----
    `specs/baselines.md` §2.2 (default ``HaloLinear`` classes). H = H_K along in_features, H_T
    along the tokens; "outer" rotations are undone on the GEMM output::

        level  fprop              dgrad                          wgrad
        0      Q(X)·Q(W)ᵀ         Q(∇Y)·Q(W)                     Q(∇Yᵀ)·Q(X)
        1      Q(XH)·Q(WH)ᵀ       [Q(∇Y)·Q(WH)]·Hᵀ               [Q(∇Yᵀ)·Q(XH)]·Hᵀ
        2      Q(XH)·Q(WH)ᵀ       H_T·[Q(H_Tᵀ∇Y)·Q(WH)]·Hᵀ       [Q(∇Yᵀ)·Q(XH)]·Hᵀ

    In adahop fields: fprop ``inner=Transform(block_size=0)`` (H along Kc = K, cancels in the
    product); dgrad and wgrad ``outer_b`` (H along B's columns K, undone on the output); HALO-2
    dgrad also ``outer_a`` (H_T along ∇Y's rows T, undone on the output).

    Choices: HALO itself is an 8-bit recipe (FP8/INT8, per-tensor absmax, RTN); only its Hadamard
    placements are taken here, in MXFP4 with RTN and the OCP floor scale. HALO reuses the
    forward-quantized Q(XH), Q(WH) in the backward (per-tensor scales allow it); MX blocks run
    along each GEMM's contracted dim, so adahop quantizes them again from high precision. HALO
    supports H sizes c·2^m (c ∈ {12, 20, 28, ...}); adahop only powers of two: ``outer_b`` needs
    in_features a power of two and HALO-2's ``outer_a`` needs batch_size·seq_len a power of two
    (the GEMM raises ValueError saying so). An outer transform's result (W·H, X·H, H_Tᵀ·∇Y) is held in the
    operand's dtype, BF16 under autocast, before it is quantized: a second rounding (≤ 2^-9 relative, far
    below MXFP4's step) that an FP32 copy of the rotated operand, at twice its bytes, would avoid.
    """
    if level not in (0, 1, 2):
        raise ValueError(f"HALO level={level!r}; allowed 0, 1, 2")
    full = Transform(block_size=0)  # whole dimension, no signs
    plain = GemmSpec(strategy="none", a=MX_RNE, b=MX_RNE)
    if level == 0:
        fprop = dgrad = wgrad = plain
    else:
        fprop = GemmSpec(strategy="iht", a=MX_RNE, b=MX_RNE, inner=full)
        wgrad = GemmSpec(strategy="none", a=MX_RNE, b=MX_RNE, outer_b=full)
        dgrad = GemmSpec(strategy="none", a=MX_RNE, b=MX_RNE, outer_b=full, outer_a=full if level == 2 else None)
    what = {0: "no Hadamard", 1: "full Hadamard along K on X and W (fprop inner, backward undone on the output)",
            2: "HALO-1 plus a full token Hadamard on ∇Y in dgrad (needs batch*seq a power of two)"}[level]
    return Recipe(name=f"halo-{level}", description=f"HALO-{level} placements in MXFP4 (RNE, OCP floor): {what}.",
                  fprop=fprop, dgrad=dgrad, wgrad=wgrad)


def nvfp4() -> Recipe:
    """NVIDIA, "Pretraining LLMs with NVFP4" (arXiv 2509.25149) = TE ``NVFP4BlockScaling``.

    Returns
    -------
    Recipe
        ``"nvfp4"``: NVFP4 on all three GEMMs, 16×16 weight tiles, a fixed-sign 16-point RHT on
        the wgrad operands, SR on the gradients, the last transformer block in BF16.

    Notes
    -----
    `specs/baselines.md` §2.4 (TE @d0067d0 defaults)::

        GEMM   A            B              Kc  transform
        fprop  X   1×16 RNE  Wᵀ 16×16 RNE  K   -
        dgrad  ∇Y  1×16 SR   W  16×16 RNE  N   -
        wgrad  ∇Yᵀ 1×16 SR   X  1×16 RNE   T   RHT16 along T, one fixed sign vector

    NVFP4 = E2M1 + E4M3 scale per 16 + FP32 tensor scale (computed after the RHT, as TE's
    ``with_post_rht_amax``). The 2-D weight tiles make the fprop and dgrad copies of W equal.
    The RHT signs are TE's hard-coded vector (:data:`TE_WGRAD_SIGNS`), shared by every layer and
    step: ``Transform(block_size=16, signs="fixed", sign_seed=TE_WGRAD_SIGN_SEED)``.

    Choices: the paper keeps about 15% of the linear layers in BF16, mostly the last blocks
    (12B model: first 2 and last 8 [recall]). A fixed count cannot be 15% of a model it has not
    seen, so the default is ``bf16_last_layers=1``, right for the small models adahop trains
    (≤ ~10 blocks); for a model of L blocks set about ``round(0.15·L)`` with
    ``dataclasses.replace(get_recipe("nvfp4"), bf16_last_layers=n, bf16_first_layers=m)``.
    The E4M3 scale is rounded up under SR (module docstring), TE rounds it to nearest.
    """
    return Recipe(
        name="nvfp4",
        description="NVIDIA NVFP4 (TE NVFP4BlockScaling): 16x16 weight tiles, 1x16 X/dY, fixed-sign RHT-16 on the "
        "wgrad operands, SR on gradients, last block in BF16.",
        fprop=GemmSpec(strategy="none", a=NV_RNE, b=NV_W_RNE),
        dgrad=GemmSpec(strategy="none", a=NV_SR, b=NV_W_RNE),
        wgrad=GemmSpec(strategy="iht", a=NV_SR, b=NV_RNE,
                       inner=Transform(block_size=16, signs="fixed", sign_seed=TE_WGRAD_SIGN_SEED)),
        bf16_last_layers=1,
    )  # fmt: skip


def averis(fmt: str = "nvfp4") -> Recipe:
    """Averis, Cao et al., "The Curse and Blessing of Mean Bias in FP4-Quantized LLM Training"
    (arXiv 2603.10444): mean-residual splitting.

    Parameters
    ----------
    fmt : str
        ``"nvfp4"`` (the paper's format; preset ``"averis"``) or ``"mxfp4"`` (``"averis-mxfp4"``).

    Returns
    -------
    Recipe
        The token mean of X and of ∇Y (per channel) is split off before quantization,
        quantized on its own and enters each GEMM as a rank-one term.

    Raises
    ------
    ValueError
        ``fmt`` not ``"nvfp4"`` or ``"mxfp4"``.

    Notes
    -----
    `specs/related_methods.md` §1.2–§1.4 (v1 §5, Eq. 11–12). ``μ_X``, ``μ_D``: token means,
    ``R = operand − 1·μᵀ``::

        GEMM   formula                                              adahop field
        fprop  Q(R_X)·Q(W)ᵀ + 1·(Q(μ_X)·Q(W)ᵀ)             (Eq. 11)  mean_split="a_rows"
        dgrad  Q(R_D)·Q(W)  + 1·(Q(μ_D)·Q(W))                        mean_split="a_rows"
        wgrad  Q(R_D)ᵀQ(R_X) + T·Q(μ_D)Q(μ_X)ᵀ                        mean_split="inner",
               + (Q(R_D)ᵀ1)Q(μ_X)ᵀ + Q(μ_D)(1ᵀQ(R_X))       (Eq. 12)  mean_cross_terms=True

    Weights are not split. The means are recomputed from each call's operand (no running
    statistic).

    Choices: v1 uses stochastic rounding for all FP4 tensors [3P], so every operand here (X, W,
    ∇Y) is SR; with MXFP4 SR needs the non-clipping ``rceil`` scale. Weights use 16×16 tiles in
    NVFP4 (as in the NVIDIA recipe and the spec's pseudo-code); block details beyond "NVFP4" are
    not disclosed. In fprop/dgrad the mean is quantized as one extra row of A: its own block
    scales, but (NVFP4) the FP32 tensor scale of A. In wgrad each mean vector is quantized on
    its own. No Hadamard (its composition with Averis is not published) and no BF16 blocks
    (not disclosed).
    """
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"averis fmt={fmt!r}; allowed 'nvfp4', 'mxfp4'")
    act, w = (NV_SR, NV_W_SR) if fmt == "nvfp4" else (MX_SR_CEIL, MX_SR_CEIL)
    return Recipe(
        name="averis" if fmt == "nvfp4" else "averis-mxfp4",
        description=f"Averis 2026 in {fmt.upper()}: per-channel token mean of X and dY split off, quantized on its "
        "own, added back as rank-one terms (wgrad keeps all four terms of Eq. 12); SR on every operand.",
        fprop=GemmSpec(strategy="none", a=act, b=w, mean_split="a_rows"),
        dgrad=GemmSpec(strategy="none", a=act, b=w, mean_split="a_rows"),
        wgrad=GemmSpec(strategy="none", a=act, b=act, mean_split="inner", mean_cross_terms=True),
    )  # fmt: skip


def quartet() -> Recipe:
    """Quartet, Castro et al. (arXiv 2505.14669, NeurIPS 2025): all three GEMMs in MXFP4.

    Returns
    -------
    Recipe
        ``"quartet"``: fprop with a fixed 32-point Hadamard and RTN; backward with a 32-point RHT
        (fresh signs per call) and stochastic rounding with the 3/4 pre-scale.

    Notes
    -----
    `specs/baselines.md` §2.3 (``IST-DASLab/Quartet`` @00ccd38 pseudo-quantization)::

        GEMM   A     B     Kc  format / rounding / scale          transform
        fprop  X     Wᵀ    K   MXFP4, RNE, OCP floor (both)       H32 along K, no signs
        dgrad  ∇Y    W     N   MXFP4, SR, 3/4 pre-scale (both)    RHT32 along N, signs per call
        wgrad  ∇Yᵀ   X     T   MXFP4, SR, 3/4 pre-scale (both)    RHT32 along T, signs per call

    Choices and differences:

    - Quartet's forward scale is QuEST (``2^⌊log2(0.48708·σ)⌋`` of each Hadamard-rotated group,
      clipping at about 2.9σ), which ``adahop.formats`` does not have. The forward uses the OCP
      floor rule instead, which also lets block maxima clip; set ``scale_rule="adahop"`` with
      ``dataclasses.replace`` for the lower-error AdaHOP rule. QuEST's trust mask (zero gradient
      where the forward clipped) is not applied: the backward is straight-through.
    - The backward uses the ``"tseng"`` rule (floor + 3/4 pre-scale), as Quartet's
      ``AlbertTsengQuantizer`` does, with SR (the QuTLASS kernels appear to use RTN).
    - Quartet's backward re-quantizes the *forward-quantized* X and W; adahop quantizes every
      operand from high precision, as TE does.
    - Quartet draws one sign vector per backward call, shared by dgrad and wgrad; adahop draws
      one per GEMM call (separate for dgrad and wgrad), which gives each GEMM the same
      distribution.
    """
    rht = Transform(block_size=32, signs="per_call")
    bwd = GemmSpec(strategy="iht", a=MX_SR_TSENG, b=MX_SR_TSENG, inner=rht)
    return Recipe(
        name="quartet",
        description="Quartet 2025: MXFP4 everywhere; fprop H32 + RTN (OCP floor in place of QuEST); dgrad/wgrad "
        "RHT-32 (fresh signs per call) + SR with the 3/4 pre-scale.",
        fprop=GemmSpec(strategy="iht", a=MX_RNE, b=MX_RNE, inner=Transform(block_size=32, signs="none")),
        dgrad=bwd, wgrad=bwd,
    )  # fmt: skip


#: The rival presets in the order ``adahop recipes`` lists them.
RIVALS: tuple[Recipe, ...] = (tseng(), halo(0), halo(1), halo(2), nvfp4(), averis("nvfp4"), averis("mxfp4"), quartet())
