"""Shared fixtures. Keep this file small: a fixture belongs here only once two test files need it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed, so every random test is reproducible."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread. The reference numerics use tiny tensors, where waking a
    second OpenMP thread costs more than the work (tens of ms per op on a busy 2-core runner);
    results do not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
