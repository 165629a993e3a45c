#!/usr/bin/env python
"""Thin wrapper: the code and its usage are in `adahop.bench.profile_model` (src/adahop/bench/profile_model.py)."""
from adahop.bench.profile_model import main

if __name__ == "__main__":
    main()
