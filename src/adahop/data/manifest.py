"""``manifest.json``: what a prepared data folder holds and how it was made.

A data folder written by :func:`adahop.data.prepare` contains the shards ``train_000.bin``,
``train_001.bin``, …, ``val_000.bin``, … (raw little-endian token ids of ``dtype``, readable with
``np.memmap(path, dtype=dtype, mode="r")``), the tokenizer files, and this manifest.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from adahop.data.sources import SourceInfo
from adahop.utils import read_json

__all__ = ["Manifest", "ShardInfo", "SplitInfo", "TokenizerInfo", "MANIFEST_FORMAT", "SPLITS"]

#: 2 added the tokenizer's fingerprint, ``text_field`` and ``prepare_revision``; format 1 still loads
#: (those read as None: unknown, so never compared)
MANIFEST_FORMAT = 2
_READS = (1, 2)
SPLITS = ("train", "val")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardInfo:
    file: str
    """File name inside the data folder, e.g. ``train_000.bin``."""
    tokens: int
    """Number of token ids in the file (its size is ``tokens * itemsize``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitInfo:
    tokens: int
    """Token ids in the split, EOS separators included (the sum over its shards)."""
    text_bytes: int
    """UTF-8 bytes of the text those tokens encode (EOS adds none). Bits per byte of a mean loss
    ``L`` nats/token is ``L * tokens / (text_bytes * ln 2)``."""
    documents: int
    """Number of EOS separators (documents, or document ends) in the split."""
    shards: tuple[ShardInfo, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizerInfo:
    spec: str
    """Spec that reloads the tokenizer with ``load_tokenizer(spec, base_dir=data_dir)``."""
    name: str
    """The ``--tokenizer`` given to prepare (``bpe`` for a trained one)."""
    vocab_size: int
    eos_id: int
    sha256: str | None = None
    """:meth:`adahop.data.tokenizer.Tokenizer.fingerprint`: the vocabulary and merges (None in format 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """Contents of ``manifest.json``. Load with :meth:`load`, which also checks the shards' sizes."""

    format: int
    adahop_version: str
    created: str
    """UTC time of creation, ISO 8601."""
    sources: tuple[SourceInfo, ...]
    tokenizer: TokenizerInfo
    dtype: str
    """numpy dtype name of the shards: ``uint16`` when every id fits, else ``uint32``."""
    val_fraction: float
    seed: int
    block_chars: int
    """Size of the blocks the corpus was cut into before assigning them to a split."""
    train: SplitInfo
    val: SplitInfo
    text_field: str | None = None
    """The JSONL field / Parquet column read (None in format 1)."""
    prepare_revision: int | None = None
    """:data:`adahop.data.shards.PREPARE_REVISION` of the adahop that prepared it (None in format 1)."""

    def split(self, name: str) -> SplitInfo:
        """The :class:`SplitInfo` of ``name`` (``train`` or ``val``); ValueError for any other name."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
        return getattr(self, name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, data_dir: str | Path) -> Path:
        """Write ``manifest.json`` atomically (tmp file + ``os.replace``)."""
        path = Path(data_dir) / "manifest.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, data_dir: str | Path) -> Manifest:
        """Read ``data_dir/manifest.json`` and check that every shard file has the recorded size.

        Raises:
            FileNotFoundError: no manifest (the folder was not prepared).
            ValueError: an unknown manifest format, or a missing or wrongly sized shard.
        """
        data_dir = Path(data_dir)
        path = data_dir / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; prepare the data first: "
                                    f"adahop data prepare --source ... --out {data_dir}")
        raw = read_json(path, "the data manifest")
        if raw.get("format") not in _READS:
            raise ValueError(f"{path}: manifest format {raw.get('format')!r}, this adahop reads {MANIFEST_FORMAT}; "
                             "prepare the data again with adahop data prepare")

        def split(d: dict) -> SplitInfo:
            return SplitInfo(**{**d, "shards": tuple(ShardInfo(**s) for s in d["shards"])})

        m = cls(**{**raw, "sources": tuple(SourceInfo(**s) for s in raw["sources"]),
                   "tokenizer": TokenizerInfo(**raw["tokenizer"]), "train": split(raw["train"]),
                   "val": split(raw["val"])})
        itemsize = np.dtype(m.dtype).itemsize
        for name in SPLITS:
            for shard in m.split(name).shards:
                f = data_dir / shard.file
                size = f.stat().st_size if f.is_file() else None
                if size != shard.tokens * itemsize:
                    raise ValueError(f"{f}: expected {shard.tokens * itemsize} bytes ({shard.tokens} tokens of "
                                     f"{m.dtype}), found {'no file' if size is None else size}; "
                                     "prepare the data again with adahop data prepare")
        return m

    def load_tokenizer(self, data_dir: str | Path):
        """The tokenizer the shards were made with (see :func:`adahop.data.tokenizer.load_tokenizer`)."""
        from adahop.data.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer.spec, base_dir=data_dir)
