"""``prepare``: turn text sources into train/val token shards plus ``manifest.json``.

Passes over the corpus, each streaming (memory stays at a few batches of text):

1. scan: read every source once, which validates it (errors name the file) and hashes it;
2. count the blocks (:mod:`adahop.data.blocks`), so the val blocks can be spread exactly;
3. (``bpe`` only) train the tokenizer on at most ~20 MB of train-split text, spread over the corpus;
4. tokenize blocks in batches of ~4 MB on all cores and append them to the shards of their split.

Documents are followed by the EOS id. Shards are raw arrays of ``uint16`` (every id < 65536) or
``uint32``, little-endian, at most ``shard_tokens`` ids each. Each shard, the tokenizer files and
the manifest are written to a temporary name and moved into place with ``os.replace``; the old
manifest is removed first, so an interrupted run never leaves a manifest that lies. One process
at a time writes a folder: a second ``prepare`` of it waits for the first (a lock on
``.prepare.lock`` inside it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from adahop.data.blocks import Block, ValSelector, block_chars_for, iter_blocks
from adahop.data.manifest import MANIFEST_FORMAT, SPLITS, Manifest, ShardInfo, SplitInfo, TokenizerInfo
from adahop.data.sources import Source, SourceInfo, resolve_sources
from adahop.data.tokenizer import Tokenizer, check_bpe_vocab_size, load_tokenizer, train_bpe

__all__ = ["prepare", "file_lock"]

log = logging.getLogger(__name__)

BPE_TRAIN_CHARS = 20_000_000
BATCH_CHARS = 4 << 20
DEFAULT_SHARD_TOKENS = 100_000_000


def _documents(sources: Sequence[Source], text_field: str) -> Iterator[Iterator[str]]:
    for src in sources:
        yield from src.documents(text_field)


def _refuse_duplicates(infos: Sequence[SourceInfo], texts: Sequence[str]) -> None:
    """Raise ValueError when two sources hold the same text (one file listed twice, a folder and a file in it,
    two copies, or one text compressed two ways: ``texts`` are digests of the decoded documents): it would be in
    the corpus twice, and the val blocks of one copy would be train blocks of the other, so the val loss would be
    measured on text the model trained on."""
    seen: dict[str, str] = {}
    for info, text in zip(infos, texts):
        if text in seen:
            raise ValueError(f"sources {seen[text]} and {info.name} hold the same text: the corpus would hold it "
                             "twice and its val split would overlap the train split; pass it once")
        seen[text] = info.name


def _scan(sources: Sequence[Source], text_field: str) -> tuple[list[SourceInfo], list[str], int]:
    """Read every source once: its :class:`SourceInfo`, a digest of its decoded documents, and the corpus
    size in characters."""
    infos, texts, total = [], [], 0
    for src in sources:
        chars, has_text, h = 0, False, hashlib.sha256()
        for doc in src.documents(text_field):
            for chunk in doc:
                chars += len(chunk)
                has_text = has_text or not chunk.isspace()
                h.update(chunk.encode("utf-8", "surrogatepass"))
            h.update(b"\0")  # document ends count: the same characters cut otherwise are other documents
        if not has_text:
            hint = "" if getattr(src, "kind", None) == "text" else f", or check `adahop data prepare --text-field` ({text_field!r})"
            raise ValueError(f"source {src.name} holds no text; remove it{hint}")
        infos.append(src.info(text_field))
        texts.append(h.hexdigest())
        total += chars
    return infos, texts, total


class _SplitWriter:
    """Appends token arrays to ``{split}_000.bin``, ``{split}_001.bin``, … of at most ``shard_tokens`` ids."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[ShardInfo] = []
        self.text_bytes = self.documents = 0
        self._f = None
        self._in_shard = 0

    def _path(self, i: int) -> Path:
        return self.out_dir / f"{self.split}_{i:03d}.bin"

    def write(self, ids: np.ndarray, text_bytes: int, documents: int) -> None:
        self.text_bytes += text_bytes
        self.documents += documents
        while len(ids):
            if self._f is None:
                self._f = open(self._path(len(self.shards)).with_suffix(".bin.tmp"), "wb")
            n = min(len(ids), self.shard_tokens - self._in_shard)
            self._f.write(ids[:n].tobytes())
            self._in_shard += n
            ids = ids[n:]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        path = self._path(len(self.shards))
        self._f.close()
        os.replace(path.with_suffix(".bin.tmp"), path)
        self.shards.append(ShardInfo(file=path.name, tokens=self._in_shard))
        self._f, self._in_shard = None, 0

    def finish(self) -> SplitInfo:
        if self._f is not None:
            self._close_shard()
        return SplitInfo(tokens=sum(s.tokens for s in self.shards), text_bytes=self.text_bytes,
                         documents=self.documents, shards=tuple(self.shards))


def _batches(blocks: Iterator[Block]) -> Iterator[list[tuple[int, Block]]]:
    """Group ``(index, block)`` pairs into batches of about :data:`BATCH_CHARS` characters."""
    batch, chars = [], 0
    for b, block in enumerate(blocks):
        batch.append((b, block))
        chars += sum(len(t) for t, _ in block)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _train_tokenizer(vocab_size: int, blocks: Iterator[Block], is_val: ValSelector, total_chars: int) -> Tokenizer:
    """A byte-level BPE trained on at most ~:data:`BPE_TRAIN_CHARS` of train-split text, spread over the corpus."""
    every = max(1, math.ceil(total_chars / BPE_TRAIN_CHARS))
    sample = (text for b, block in enumerate(blocks) if b % every == 0 and not is_val(b) for text, _ in block)
    log.info("training a byte-level BPE (vocab %d) on every %d-th block", vocab_size, every)
    return train_bpe(sample, vocab_size)


#: Bump whenever :func:`prepare` would write other tokens for the same sources and settings (the
#: tokenizer training, the split, the document order): cached preparations keyed without it would
#: otherwise be reused silently, and at the 0.5% scale of the gaps adahop measures that matters.
PREPARE_REVISION = 2


def _adahop_version() -> str:
    try:
        from adahop import __version__

        return __version__
    except ImportError:  # a source checkout without the package's __init__ version
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("adahop")
        except PackageNotFoundError:
            return "unknown"


@contextmanager
def file_lock(path: Path, what: str):
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the ``with`` block,
    waiting for another process that holds it (and saying so on stderr, naming ``what``). Where
    file locks are unavailable (no ``fcntl``, or a filesystem without them) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process that prepares {what} ...", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # a filesystem without flock (some network mounts)
            log.warning("no file lock on %s (%s); preparing unlocked", path, e)
        yield  # closing the file releases the lock


#: A shard file's name (or its temporary file's, while it is written).
_SHARD_NAME = re.compile(r"(train|val)_\d{3,}\.bin(\.tmp)?")


def _remove_stale(out_dir: Path, keep: set[str]) -> None:
    """Delete shard files of an earlier prepare in ``out_dir`` that the new manifest does not list."""
    for p in out_dir.iterdir():
        if _SHARD_NAME.fullmatch(p.name) and p.name not in keep:
            p.unlink()


#: What a prepared data folder holds besides its shards (``train_NNN.bin``, ``val_NNN.bin``).
_DATA_FILES = {"manifest.json", ".prepare.lock", "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"}


def _check_data_folder(out_dir: Path) -> None:
    """Raise ValueError when ``out_dir`` holds files of something else (a run, a model, other data): preparing
    rewrites its tokenizer.json and deletes shard files, so a run folder would lose its tokenizer silently."""
    if not out_dir.is_dir():
        return
    own = set(_DATA_FILES)
    try:  # the tokenizer files a prepared folder names itself (a tiktoken ranks file, hf_tokenizer/)
        spec = json.loads((out_dir / "manifest.json").read_text())["tokenizer"]["spec"]
        own.add(Path(spec.split(":", 1)[-1]).parts[0])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    other = sorted(p.name for p in out_dir.iterdir()
                   if p.name not in own and not _SHARD_NAME.fullmatch(p.name))
    if other:
        raise ValueError(f"--out {out_dir} holds other files ({', '.join(other[:4])}{', ...' if len(other) > 4 else ''}): "
                         "a run or model folder would lose its tokenizer to the new one; pass a new or empty folder, or "
                         "one that `adahop data prepare` wrote")


def prepare(sources: str | Path | Sequence[str | Path], out_dir: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 8192,
            val_fraction: float = 0.01, seed: int = 0, text_field: str = "text",
            shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Manifest:
    """Tokenize text sources into train/val shards and write ``manifest.json`` (``adahop data prepare``).

    Args:
        sources: specs as in :func:`adahop.data.sources.resolve_sources`: files (.txt/.md/.jsonl/
            .parquet, text and jsonl optionally .gz/.xz/.zst), folders, ``hf:NAME[:CONFIG][:SPLIT]``,
            ``default``.
        out_dir: folder to write into (created if missing).
        tokenizer: ``bpe`` trains a byte-level BPE on the corpus (saved as ``tokenizer.json``); or any
            spec of :func:`adahop.data.tokenizer.load_tokenizer` (``gpt2``, ``tiktoken:PATH``,
            ``hf:NAME``, ``bpe:PATH``).
        vocab_size: vocabulary size for ``bpe`` (ignored otherwise).
        val_fraction: share of the corpus, in (0, 0.5], held out for validation, spread across it.
        seed: picks which blocks are val (see :mod:`adahop.data.blocks`).
        text_field: JSONL field / Parquet or dataset column holding the text.
        shard_tokens: most token ids per shard file.

    Returns:
        the :class:`Manifest` written to ``out_dir/manifest.json``; shards are
        ``{train,val}_NNN.bin`` arrays of ``manifest.dtype``.

    Raises:
        ValueError: a bad option (named, with its allowed range), an unreadable or empty source
            (named), a corpus too small for two blocks, or an ``out_dir`` holding files of something else
            (a run or model folder).
        RuntimeError: ``default`` could not be fetched.
    """
    if not 0 < val_fraction <= 0.5:
        raise ValueError(f"--val-fraction {val_fraction} must be in (0, 0.5]")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens {shard_tokens} must be >= 1")
    if tokenizer == "bpe":
        check_bpe_vocab_size(vocab_size)
        tok = None  # trained below, once the blocks are known
    else:
        tok = load_tokenizer(tokenizer)  # before reading the corpus, so a bad spec fails fast
    out_dir = Path(out_dir)
    srcs = resolve_sources(sources)
    infos, texts, total_chars = _scan(srcs, text_field)
    _refuse_duplicates(infos, texts)
    block_chars = block_chars_for(total_chars, val_fraction)
    n_blocks = sum(1 for _ in iter_blocks(_documents(srcs, text_field), block_chars))
    if n_blocks < 2:
        raise ValueError(f"the corpus ({total_chars} characters) is too small to split into train and val; "
                         "add text with more --source")
    is_val = ValSelector(n_blocks, val_fraction, seed)
    log.info("%d characters in %d sources; %d blocks of ~%d characters, %d to val",
             total_chars, len(srcs), n_blocks, block_chars, is_val.m)

    _check_data_folder(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir / ".prepare.lock", str(out_dir)):  # one writer at a time
        (out_dir / "manifest.json").unlink(missing_ok=True)
        if tok is None:
            tok = _train_tokenizer(vocab_size, iter_blocks(_documents(srcs, text_field), block_chars), is_val, total_chars)
        tok_spec = tok.save(out_dir)
        dtype = np.dtype("<u2" if tok.vocab_size <= 1 << 16 else "<u4")
        writers = {s: _SplitWriter(out_dir, s, dtype, shard_tokens) for s in SPLITS}
        eos = np.array([tok.eos_id], dtype=dtype)
        done_chars = 0
        for batch in _batches(iter_blocks(_documents(srcs, text_field), block_chars)):
            ids = iter(tok.encode_batch([text for _, block in batch for text, _ in block]))
            for b, block in batch:
                parts = []
                for text, ends_doc in block:
                    parts.append(np.asarray(next(ids), dtype=dtype))
                    if ends_doc:
                        parts.append(eos)
                writers["val" if is_val(b) else "train"].write(
                    np.concatenate(parts), text_bytes=sum(len(t.encode("utf-8")) for t, _ in block),
                    documents=sum(e for _, e in block))
                done_chars += sum(len(t) for t, _ in block)
            log.info("tokenized %.1f%%", 100 * done_chars / total_chars)
        splits = {s: w.finish() for s, w in writers.items()}
        _remove_stale(out_dir, {sh.file for s in splits.values() for sh in s.shards})

        manifest = Manifest(
            format=MANIFEST_FORMAT, adahop_version=_adahop_version(),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"), sources=tuple(infos),
            tokenizer=TokenizerInfo(spec=tok_spec, name=tokenizer, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                                    sha256=tok.fingerprint()),
            dtype=np.dtype(dtype).name, val_fraction=val_fraction, seed=seed, block_chars=block_chars, **splits,
            text_field=text_field, prepare_revision=PREPARE_REVISION)
        manifest.save(out_dir)
    log.info("wrote %s: train %d tokens, val %d tokens", out_dir, manifest.train.tokens, manifest.val.tokens)
    return manifest
