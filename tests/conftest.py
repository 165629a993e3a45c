"""Shared fixtures. Keep this file small: a fixture belongs here only once two test files need it."""

from __future__ import annotations

import importlib.util
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_script():
    """``repo_script("scripts/x.py")``: a script of the repo (not a package module) imported by path."""
    def load(rel: str):
        spec = importlib.util.spec_from_file_location(Path(rel).stem, REPO / rel)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed, so every random test is reproducible."""
    return torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Run the tests on one intra-op thread. The reference numerics use tiny tensors, where waking a
    second OpenMP thread costs more than the work (tens of ms per op on a busy 2-core runner);
    results do not depend on the thread count. Tests that spawn processes set their own."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _read_small_corpus(chars: int) -> str:
    src = SHARED_DATA / "corpus_small.txt.xz"
    if not src.exists():
        pytest.skip("../shared/data/corpus_small.txt.xz is not beside the repo")
    with lzma.open(src, "rt", encoding="utf-8") as f:
        return f.read(chars)


@pytest.fixture(scope="session")
def small_corpus():
    """``small_corpus(chars)``: the first ``chars`` characters of ../shared/data/corpus_small;
    skips when ../shared is not beside the repo."""
    return _read_small_corpus


@pytest.fixture(scope="session")
def prepare_real_text(tmp_path_factory):
    """``prepare_real_text(chars)``: the first ``chars`` characters of ../shared/data/corpus_small
    prepared with a 512-token BPE (5% validation); skips when ../shared is not beside the repo."""
    made: dict[int, Path] = {}

    def make(chars: int) -> Path:
        if chars not in made:
            text = _read_small_corpus(chars)
            from adahop.data import prepare

            root = tmp_path_factory.mktemp("data")
            (root / "text.txt").write_text(text)
            prepare([str(root / "text.txt")], root / "prepared", tokenizer="bpe", vocab_size=512, val_fraction=0.05)
            made[chars] = root / "prepared"
        return made[chars]

    return make


@pytest.fixture
def compare_folder(tmp_path) -> Path:
    """What `adahop compare --out` leaves, as far as the commands that take one run can tell: a folder of
    run folders (config.json with an "adahop" section), one per recipe, and the comparison's own files."""
    import json

    root = tmp_path / "cmp"
    for recipe in ("bf16", "mxfp4"):
        (root / recipe).mkdir(parents=True)
        (root / recipe / "config.json").write_text(json.dumps({"adahop": {"config": {"recipe": recipe}}}))
    (root / "compare.md").write_text("| recipe |\n")
    return root


@pytest.fixture
def fwd_bwd():
    """``fwd_bwd(fn, layer, x0, dy)``: ``fn`` (a linear module or its compiled form) on a fresh copy
    of ``x0`` with ``layer``'s gradients cleared, backward with ``dy``; returns ``(y, dX, dW)``."""
    def run(fn, layer, x0, dy):
        x = x0.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = fn(x)
        y.backward(dy)
        return y.detach(), x.grad, layer.weight.grad.clone()
    return run


@pytest.fixture(scope="session")
def interp_child():
    """``run(test_file, group=None)``: the file's ``interp_*`` tests (those of the ``-k`` expression ``group`` too,
    if given) in a child pytest started with ``TRITON_INTERPRET=1`` (Triton's interpreter must be chosen before
    triton is first imported, and torch may import it); fails with the child's output unless they pass. Groups
    let pytest-xdist spread a slow file's interpreted tests over its workers."""

    def run(test_file: str, group: str | None = None) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        sel = "interp_" if group is None else f"interp_ and ({group})"
        cmd = [sys.executable, "-m", "pytest", test_file, "-o", "addopts=", "-q", "-k", sel, "-p", "no:cacheprovider", "-W", "ignore"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]

    return run
