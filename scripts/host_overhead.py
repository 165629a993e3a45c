#!/usr/bin/env python
"""Thin wrapper: the code and its usage are in `adahop.bench.host_overhead` (src/adahop/bench/host_overhead.py)."""
from adahop.bench.host_overhead import main

if __name__ == "__main__":
    main()
