"""The share of the validation text that also occurs in the training split: exact lines of at least
40 characters, per validation block, with the block split that `adahop data prepare` makes
(adahop.data.blocks). A large share would make the validation loss reward memorized duplicates.

    python scripts/val_overlap.py CORPUS [--val-fraction 0.01] [--seed 0]
"""

from __future__ import annotations

import argparse

from adahop.data.blocks import ValSelector, block_chars_for, iter_blocks
from adahop.data.shards import _documents, _scan
from adahop.data.sources import resolve_sources

MIN_LINE = 40


def _lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.split("\n")) if len(s) >= MIN_LINE]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", help="a source as `adahop data prepare --source` takes it")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0, help="`adahop data prepare --seed` (which blocks are val)")
    args = ap.parse_args()
    srcs = resolve_sources([args.corpus])
    _, total = _scan(srcs, "text")
    blocks = list(iter_blocks(_documents(srcs, "text"), block_chars_for(total, args.val_fraction)))
    is_val = ValSelector(len(blocks), args.val_fraction, args.seed)
    train, val = set(), []
    for b, block in enumerate(blocks):
        text = "".join(t for t, _ in block)
        if is_val(b):
            val.append((b, text))
        else:
            train.update(_lines(text))
    all_chars = dup_chars = 0
    for b, text in val:
        lines = _lines(text)
        dup = sum(len(s) for s in lines if s in train)
        all_chars, dup_chars = all_chars + len(text), dup_chars + dup
        print(f"val block {b} of {len(blocks)}: {len(text)} chars, {dup / max(1, len(text)):.1%} in lines found in train; "
              f"starts {text.lstrip()[:50]!r}")
    print(f"all val blocks: {dup_chars / all_chars:.1%} of the characters are in lines of >= {MIN_LINE} that train holds too")


if __name__ == "__main__":
    main()
