#!/usr/bin/env python
"""Thin wrapper: the code and its usage are in `adahop.bench.optim_step` (src/adahop/bench/optim_step.py)."""
import sys

from adahop.bench.optim_step import main

if __name__ == "__main__":
    sys.exit(main())
