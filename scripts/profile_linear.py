#!/usr/bin/env python
"""Thin wrapper: the code and its usage are in `adahop.bench.profile_linear` (src/adahop/bench/profile_linear.py)."""
from adahop.bench.profile_linear import main

if __name__ == "__main__":
    main()
