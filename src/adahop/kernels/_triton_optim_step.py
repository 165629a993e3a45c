"""Triton kernel of the fused optimizer step (twin of ``optim_step.optim_step_reference``).

Imported lazily. One program updates BLOCK elements of one tensor: it loads w, g and the states
(BF16 ones through their int16 bits), runs the algorithm in FP32 registers, rounds the new weight
once (nearest-even by bit arithmetic, or stochastically with 16 bits of ``tl.randint``) and stores
everything. Compiled with ``enable_fp_fusion=False`` and ``div_rn``/``sqrt_rn`` so that every FP32
operation rounds as the reference's does.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.random import philox

from .exp2_poly import EXP_COEFFS, LN2

_LN2 = tl.constexpr(LN2)  # a global a @triton.jit function reads must be a constexpr instance (Triton 3.6)
_C0 = tl.constexpr(EXP_COEFFS[0])
_C1 = tl.constexpr(EXP_COEFFS[1])
_C2 = tl.constexpr(EXP_COEFFS[2])
_C3 = tl.constexpr(EXP_COEFFS[3])
_C4 = tl.constexpr(EXP_COEFFS[4])
_C5 = tl.constexpr(EXP_COEFFS[5])
_C6 = tl.constexpr(EXP_COEFFS[6])
_C7 = tl.constexpr(EXP_COEFFS[7])
_C8 = tl.constexpr(EXP_COEFFS[8])
BLOCK = 1024
TAB_COLS = tl.constexpr(9)  # int64 columns of the multi-tensor table (see _optim_multi_kernel)


@triton.jit
def _ld(ptr, offs, mask, BF16: tl.constexpr):
    if BF16:  # int16 bits of a bfloat16: the high half of the FP32
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _bf16_bits(x, r16, STOCHASTIC: tl.constexpr):
    """int32 whose low 16 bits are x rounded to BF16: nearest-even, or up with probability
    (dropped bits)/2^16 given 16 random bits ``r16``; NaN → 0x7FC0 (the reference's NaN)."""
    b = x.to(tl.int32, bitcast=True)
    if STOCHASTIC:
        h = (b + r16) >> 16
    else:
        h = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, h)


@triton.jit
def _st(ptr, offs, x, mask, BF16: tl.constexpr):
    if BF16:
        tl.store(ptr + offs, _bf16_bits(x, 0, False).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _adam_dir(m, v, g, b1, omb1, b2, omb2, eps, rbc1, rsbc2):
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    return m, v, tl.div_rn(m * rbc1, tl.sqrt_rn(v) * rsbc2 + eps)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _exp2_small(y):
    # the reference's steps (optim_step._exp2_small): y = n + f, n = 0 where |y| <= 1
    y = _clamp(y, -126.0, 126.0)
    n = tl.where(tl.abs(y) > 1.0, tl.floor(y + 0.5), 0.0)
    t = (y - n) * _LN2
    p = t * 0.0 + _C0
    p = p * t + _C1
    p = p * t + _C2
    p = p * t + _C3
    p = p * t + _C4
    p = p * t + _C5
    p = p * t + _C6
    p = p * t + _C7
    p = p * t + _C8
    return p * ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _step_block(w_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, s3_ptr, offs, mask, seed, stream,
                lr, b1, omb1, b2, omb2, eps, decay, wdlr, step_size, rbc1, rsbc2, mul_lr, tau, cap, w_max,
                ALG: tl.constexpr, W_BF16: tl.constexpr, G_BF16: tl.constexpr, S_BF16: tl.constexpr,
                STOCHASTIC: tl.constexpr):
    """The update of the elements ``offs`` (int32, under ``mask``) of one tensor, loaded, computed
    and stored; SR bits: Philox(key ``seed``, counter (offs, ``stream``, 0, 0)), word 0."""
    # FP32 arguments are FP32 on the GPU already; the interpreter hands them over as float64
    lr, b1, omb1, b2, omb2 = tl.cast(lr, tl.float32), tl.cast(b1, tl.float32), tl.cast(omb1, tl.float32), tl.cast(b2, tl.float32), tl.cast(omb2, tl.float32)
    eps, decay, wdlr, step_size = tl.cast(eps, tl.float32), tl.cast(decay, tl.float32), tl.cast(wdlr, tl.float32), tl.cast(step_size, tl.float32)
    rbc1, rsbc2, mul_lr, tau = tl.cast(rbc1, tl.float32), tl.cast(rsbc2, tl.float32), tl.cast(mul_lr, tl.float32), tl.cast(tau, tl.float32)
    cap, w_max = tl.cast(cap, tl.float32), tl.cast(w_max, tl.float32)
    w = _ld(w_ptr, offs, mask, W_BF16)
    g = _ld(g_ptr, offs, mask, G_BF16)
    s0 = _ld(s0_ptr, offs, mask, S_BF16)
    s1 = _ld(s1_ptr, offs, mask, S_BF16)
    if ALG == 0 or ALG == 1:  # adamw, kahan
        m, v, _ = _adam_dir(s0, s1, g, b1, omb1, b2, omb2, eps, rbc1, rsbc2)
        step = tl.div_rn(m, tl.sqrt_rn(v) * rsbc2 + eps) * step_size
        if ALG == 0:
            w_new = w * decay - step
        else:
            y = (-(w * wdlr) - step) + _ld(s2_ptr, offs, mask, S_BF16)
            w_new = w + y
    elif ALG == 2 or ALG == 3:  # madam-arxiv, madam-arxiv-relative
        m, v, _ = _adam_dir(s0, s1, g, b1, omb1, b2, omb2, eps, rbc1, rsbc2)
        ge = (w * _LN2) * g
        ve = _ld(s2_ptr, offs, mask, S_BF16) * b2 + (ge * ge) * omb2
        u_add = tl.div_rn(m, tl.sqrt_rn(v) * rsbc2 + eps) * step_size
        u_e = -tl.div_rn(ge * mul_lr, tl.sqrt_rn(ve) * rsbc2 + eps)
        rho = tl.where(w >= 0, 1.0, -1.0) * tl.maximum(tl.abs(w), tau, propagate_nan=tl.PropagateNan.ALL)
        if ALG == 2:
            mul = tl.div_rn(w * u_e, rho)
        else:
            mul = (rho * _LN2) * u_e
        w_new = (w * decay + mul) - u_add
    else:  # madam-workshop
        a = tl.maximum(tl.abs(w), tau, propagate_nan=tl.PropagateNan.ALL)
        p2 = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        mant = tl.div_rn(w, p2)
        mm, vm, r_m = _adam_dir(s0, s1, g * p2, b1, omb1, b2, omb2, eps, rbc1, rsbc2)
        me, ve, r_e = _adam_dir(_ld(s2_ptr, offs, mask, S_BF16), _ld(s3_ptr, offs, mask, S_BF16), (w * _LN2) * g,
                                b1, omb1, b2, omb2, eps, rbc1, rsbc2)
        r_m = _clamp(r_m, -cap, cap)
        r_e = _clamp(r_e, -cap, cap)
        w_new = ((mant * decay - r_m * lr) * p2) * _exp2_small(-(r_e * mul_lr))
        w_new = _clamp(w_new, -w_max, w_max)
    # round the weight once and store it
    if W_BF16:
        r16 = 0
        if STOCHASTIC:
            zero = tl.zeros_like(offs)
            # int32 counter words keep Philox4x32 (a stream >= 2^31 arrives as int64: its low 32 bits)
            # (zero + stream) first: a scalar argument equal to 1 arrives as a constexpr, which has no .to
            r, _r1, _r2, _r3 = philox(seed, offs, (zero + stream).to(tl.int32), zero, zero)
            r16 = (r & 0xFFFF).to(tl.int32)
        wb = _bf16_bits(w_new, r16, STOCHASTIC)
        tl.store(w_ptr + offs, wb.to(tl.int16), mask=mask)
        stored = (wb << 16).to(tl.float32, bitcast=True)
    else:
        tl.store(w_ptr + offs, w_new, mask=mask)
        stored = w_new
    if ALG == 0 or ALG == 1:
        _st(s0_ptr, offs, m, mask, S_BF16)
        _st(s1_ptr, offs, v, mask, S_BF16)
        if ALG == 1:
            _st(s2_ptr, offs, y - (stored - w), mask, S_BF16)
    elif ALG == 2 or ALG == 3:
        _st(s0_ptr, offs, m, mask, S_BF16)
        _st(s1_ptr, offs, v, mask, S_BF16)
        _st(s2_ptr, offs, ve, mask, S_BF16)
    else:
        _st(s0_ptr, offs, mm, mask, S_BF16)
        _st(s1_ptr, offs, vm, mask, S_BF16)
        _st(s2_ptr, offs, me, mask, S_BF16)
        _st(s3_ptr, offs, ve, mask, S_BF16)


@triton.jit(do_not_specialize=["seed", "stream"])  # one compile for every seed and stream
def _optim_step_kernel(w_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, s3_ptr, n, seed, stream,
                       lr, b1, omb1, b2, omb2, eps, decay, wdlr, step_size, rbc1, rsbc2, mul_lr, tau, cap, w_max,
                       ALG: tl.constexpr, W_BF16: tl.constexpr, G_BF16: tl.constexpr, S_BF16: tl.constexpr,
                       STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _step_block(w_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, s3_ptr, offs, offs < n, seed, stream,
                lr, b1, omb1, b2, omb2, eps, decay, wdlr, step_size, rbc1, rsbc2, mul_lr, tau, cap, w_max,
                ALG, W_BF16, G_BF16, S_BF16, STOCHASTIC)


@triton.jit
def _as_ptr(addr, BF16: tl.constexpr):
    """A table's int64 address as a pointer to int16 (BF16 bits) or float32, 16-byte aligned
    (the host checks it), so that loads vectorize as they do for pointer arguments."""
    if BF16:  # the hint goes on the pointer: on the integer it does not reach the loads
        return tl.multiple_of(addr.to(tl.pointer_type(tl.int16)), 16)
    else:
        return tl.multiple_of(addr.to(tl.pointer_type(tl.float32)), 16)


@triton.jit
def _optim_multi_kernel(tab_ptr, blk_ptr, seed,
                        lr, b1, omb1, b2, omb2, eps, decay, wdlr, step_size, rbc1, rsbc2, mul_lr, tau, cap, w_max,
                        ALG: tl.constexpr, W_BF16: tl.constexpr, G_BF16: tl.constexpr, S_BF16: tl.constexpr,
                        STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    # program → (tensor j, its block k): blk[pid] = j; row j of the table: 6 addresses (w, g, s0..s3),
    # numel, first block, Philox stream
    pid = tl.program_id(0)
    row = tab_ptr + tl.load(blk_ptr + pid).to(tl.int64) * TAB_COLS
    n = tl.load(row + 6).to(tl.int32)
    k = pid - tl.load(row + 7).to(tl.int32)
    stream = tl.load(row + 8).to(tl.int32)
    offs = k * BLOCK + tl.arange(0, BLOCK)
    w_ptr, g_ptr = _as_ptr(tl.load(row + 0), W_BF16), _as_ptr(tl.load(row + 1), G_BF16)
    s0_ptr, s1_ptr = _as_ptr(tl.load(row + 2), S_BF16), _as_ptr(tl.load(row + 3), S_BF16)
    s2_ptr, s3_ptr = _as_ptr(tl.load(row + 4), S_BF16), _as_ptr(tl.load(row + 5), S_BF16)
    if (k + 1) * BLOCK <= n:  # a full block: a constant mask lets the loads and stores vectorize
        _step_block(w_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, s3_ptr, offs, tl.full((BLOCK,), 1, tl.int1), seed, stream,
                    lr, b1, omb1, b2, omb2, eps, decay, wdlr, step_size, rbc1, rsbc2, mul_lr, tau, cap, w_max,
                    ALG, W_BF16, G_BF16, S_BF16, STOCHASTIC)
    else:  # the tensor's last block: n is a loaded value the compiler knows nothing of
        _step_block(w_ptr, g_ptr, s0_ptr, s1_ptr, s2_ptr, s3_ptr, offs, offs < n, seed, stream,
                    lr, b1, omb1, b2, omb2, eps, decay, wdlr, step_size, rbc1, rsbc2, mul_lr, tau, cap, w_max,
                    ALG, W_BF16, G_BF16, S_BF16, STOCHASTIC)


def _bits(t):
    """A BF16 tensor as its int16 bits (the kernel moves BF16 as integers); FP32 as is."""
    return t.view(__import__("torch").int16) if t.dtype.itemsize == 2 else t


def launch(alg: int, w, g, states: list, s, stochastic: bool, seed: int, stream: int = 0) -> None:
    """One launch over ``w.numel()`` elements (see ``optim_step.optim_step_triton``)."""
    import torch

    n = w.numel()
    if n == 0:
        return
    sdt = {t.dtype for t in states}
    if len(sdt) != 1:
        raise ValueError(f"the fused step needs every state in one dtype, got {sorted(map(str, sdt))}")
    ptrs = [_bits(t) for t in states] + [_bits(states[0])] * (4 - len(states))  # unused slots: never read
    _optim_step_kernel[(triton.cdiv(n, BLOCK),)](
        _bits(w), _bits(g), *ptrs, n, seed, stream,
        s.lr, s.b1, s.omb1, s.b2, s.omb2, s.eps, s.decay, s.wdlr, s.step_size, s.rbc1, s.rsbc2, s.mul_lr, s.tau,
        s.cap, s.w_max,
        ALG=alg, W_BF16=w.dtype == torch.bfloat16, G_BF16=g.dtype == torch.bfloat16,
        S_BF16=states[0].dtype == torch.bfloat16, STOCHASTIC=bool(stochastic) and w.dtype == torch.bfloat16,
        BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)


#: Elements per program and warps of the multi-tensor kernel (results do not depend on them: the
#: SR counter is the element's index in its tensor). ``scripts/bench_optim.py --multi-configs`` times others.
MULTI_BLOCK, MULTI_WARPS = 2048, 8


def build_table(ws: list, gs: list, states: list, streams: list, block: int):
    """``(table, block map, odd)`` for a multi-tensor launch: the table [tensors, TAB_COLS] int64
    (w, g, s0..s3 addresses, numel, first block, Philox stream) and the block map [blocks] int32
    (block → table row) on the tensors' device, copied from pinned memory without a host sync;
    ``odd``: indices of tensors with an address not 16-byte aligned (the table's loads assume it),
    which take the one-tensor kernel. Empty tensors are left out."""
    import torch

    rows, odd, first = [], [], 0
    for i, (w, g, st, k) in enumerate(zip(ws, gs, states, streams)):
        n = w.numel()
        if n == 0:
            continue
        a = [w.data_ptr(), g.data_ptr(), *(t.data_ptr() for t in st)]
        a += [a[2]] * (6 - len(a))  # unused state slots: never read
        if any(x & 15 for x in a):
            odd.append(i)
            continue
        rows.append([*a, n, first, k])
        first += (n + block - 1) // block
    if not rows:
        return None, None, odd
    tab = torch.tensor(rows, dtype=torch.int64)
    counts = torch.tensor([(r[6] + block - 1) // block for r in rows])
    blk = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), counts)
    dev = ws[0].device
    if dev.type == "cuda":
        tab = tab.pin_memory().to(dev, non_blocking=True)
        blk = blk.pin_memory().to(dev, non_blocking=True)
    return tab, blk, odd


def launch_table(alg: int, tab, blk, s, stochastic: bool, seed: int, w_dtype, g_dtype, s_dtype, block: int,
                 num_warps: int) -> None:
    """One launch of the multi-tensor kernel over a :func:`build_table` table (every weight of
    ``w_dtype``, gradient of ``g_dtype``, state of ``s_dtype``)."""
    import torch

    bf = torch.bfloat16
    _optim_multi_kernel[(blk.numel(),)](
        tab, blk, seed,
        s.lr, s.b1, s.omb1, s.b2, s.omb2, s.eps, s.decay, s.wdlr, s.step_size, s.rbc1, s.rsbc2, s.mul_lr, s.tau,
        s.cap, s.w_max,
        ALG=alg, W_BF16=w_dtype == bf, G_BF16=g_dtype == bf, S_BF16=s_dtype == bf,
        STOCHASTIC=bool(stochastic) and w_dtype == bf, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)
