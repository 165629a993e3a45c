#!/usr/bin/env python
"""Thin wrapper: the code and its usage are in `adahop.bench.kernel_timings` (src/adahop/bench/kernel_timings.py)."""
from adahop.bench.kernel_timings import main

if __name__ == "__main__":
    main()
