"""Compile the decode kernels of `adahop ptq` (``adahop/ptq/_triton_decode.py``) for sm_90 (Hopper) on this CPU,
at a model's shapes: the int matvec at 2, 3 and 4 bits and on MXFP4 codes and each ``block_m`` that ``bench_decode --sweep`` times, and
the stage kernel at every merged stage of the HARP and RHT rotations of its layers. Prints compile seconds,
registers and spills per specialization; exits 1 if any fails to compile. Launches are specialized by Triton's own
binder on meta tensors (``compile_census.specialize``), so nothing runs. Run it under the GPU's Triton before a
GPU round (its compiler passes can fail where this machine's do not):

    pip install --no-deps --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36:src python scripts/compile_decode.py --model llama3.1-8b
"""

from __future__ import annotations

import argparse
import sys

import torch

from adahop.ptq._triton_decode import int_matvec_kernel, stage_kernel  # JIT kernels: before compile_census's interpreter

from bench_decode import shapes  # noqa: E402, I001  (scripts/ on the path when run as a script)
from compile_census import compile_one, specialize  # noqa: E402

import triton  # noqa: E402
from adahop.models import PRESETS  # noqa: E402
from adahop.ptq.decode import matvec_launch  # noqa: E402
from adahop.ptq.incoherence import RHTRotation  # noqa: E402
from adahop.ptq.rotation import HARPRotation  # noqa: E402
from adahop.ptq.staged import merge_stages, rotation_stages, stage_meta  # noqa: E402

H100_SMS = 132  # the split-K count, and so the TILES argument Triton specializes on, as on the GPU


def _meta(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)


def launches(model: str):
    """(label, kernel, kwargs) of each distinct launch the decode path makes at ``model``'s shapes."""
    out, dims = [], set()
    for m, n in shapes(model):
        dims |= {m, n}
        # the int grid at 2, 3 and 4 bits (groups of 128); MXFP4 (E2M1 codes, E8M0 scales, groups of 32)
        for bits, group, e2m1 in ((2, 128, False), (3, 128, False), (4, 128, False), (4, 32, True)):
            for bm in (32, 64, 128):
                g = -(-n // group)
                meta, sp, per_split = matvec_launch(m, n, bits, group, "e2m1" if e2m1 else "int", bm, 8, H100_SMS)
                out.append((f"int_matvec {m}x{n} {'MXFP4' if e2m1 else f'W{bits}'} block_m {bm}", int_matvec_kernel, dict(
                    x_ptr=_meta(1, n, dtype=torch.bfloat16), words_ptr=_meta(m * n * bits // 32, dtype=torch.int32),
                    scales_ptr=_meta(m, g, dtype=torch.uint8 if e2m1 else torch.float16),
                    y_ptr=_meta(sp, 1, m, dtype=torch.float32), M=m, N=n, G=g, ROWS=1, TILES=per_split,
                    ROW_WORDS=n * bits // 32, **meta)))
    for d in sorted(dims):
        for r in (HARPRotation(d), RHTRotation(d)):
            for k, b, s in merge_stages(rotation_stages(r), d) + merge_stages(rotation_stages(r, inverse=True), d):
                for parts in (1, 7):  # one x, or the split-K matvec's partial sums (the output side's first stage)
                    out.append((f"stage d={d} b={b} s={s} parts {parts}", stage_kernel, dict(
                        x_ptr=_meta(parts, 1, d, dtype=torch.bfloat16), k_ptr=_meta(*k.shape, dtype=torch.float32),
                        y_ptr=_meta(1, d, dtype=torch.float32), D=d, NBLK=d // b, B=b, S=s, ROWS=1, PARTS=parts,
                        **stage_meta(b))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=sorted(PRESETS))
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, {a.model}")
    seen, failed = set(), 0
    for label, kernel, kwargs in launches(a.model):
        key, src, options = specialize(kernel, kwargs)
        if key in seen:
            continue
        seen.add(key)
        try:
            total, _, ru = compile_one(src, options)
            print(f"ok    {label:44} {total:5.1f} s  {ru}")
        except Exception as e:  # noqa: BLE001  (a failure is what this script looks for)
            failed += 1
            print(f"FAIL  {label:44} {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    print(f"{len(seen)} specializations, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
