"""adahop.device_constants and the module-level constant tables: built on the CPU whatever the
ambient default device. torchtitan builds its model under ``with torch.device("meta")``; adahop's
kernels first imported there built their byte tables as meta tensors, and the ``to_empty(device=...)``
that follows failed with "Cannot copy out of meta tensor" (found by CI after the NVFP4 GEMM's table)."""

from __future__ import annotations

import subprocess
import sys

import torch

from adahop.device_constants import on_device


def test_module_tables_imported_under_a_meta_device_are_cpu_tensors():
    code = ("import torch\n"
            "with torch.device('meta'):\n"
            "    import sys, adahop.kernels.fold, adahop.kernels.nvfp4_matmul, adahop.formats.e2m1\n"
            "f, n, e = (sys.modules[m] for m in ('adahop.kernels.fold', 'adahop.kernels.nvfp4_matmul', 'adahop.formats.e2m1'))\n"
            "print(f._TABLE.device.type, n._BYTE_PAIRS.device.type, e.E2M1_VALUES.device.type, int(f._TABLE[17]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    tables, fold_17 = out.stdout.split()[:3], int(out.stdout.split()[3])
    assert tables == ["cpu", "cpu", "cpu"]
    from adahop.kernels.fold import _TABLE

    assert fold_17 == int(_TABLE[17])  # the same bytes as a normal import (shift 1, code 1: 0.25 in E4M3)


def test_on_device_builds_on_the_cpu_under_a_meta_default():
    with torch.device("meta"):
        t = on_device(("test_meta_default", 3), lambda: torch.arange(3, dtype=torch.float32), "cpu")
    assert t.device.type == "cpu" and t.tolist() == [0.0, 1.0, 2.0]
