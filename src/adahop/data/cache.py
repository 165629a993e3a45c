"""The prepared-data cache: text sources given to ``adahop train --data`` are prepared once per content.

A cache entry is a folder ``<cache_dir>/prepared/<name>-<tokenizer>-<vocab>-<key>``, where
``key`` hashes the :func:`planned identity <adahop.data.identity.planned_identity>` without the
sources' names: the sources' sha256 and size (and kind: text, JSONL, Parquet), the tokenizer
(``bpe`` and the requested vocabulary, or a given tokenizer's fingerprint), the split settings and
the prepare revision. An edited file is
therefore a new entry, and a renamed or copied one the same entry. (A ``hf:`` dataset is keyed by
its spec: hashing it would mean reading all of it.)

Two processes that need the same new entry at once do not race: the first prepares it under a
lock (``<entry>.lock``) in a temporary folder that is renamed into place when complete; the second
waits for the lock and finds the entry made.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

from adahop.data.default_corpus import cache_dir
from adahop.data.identity import identity_changes, manifest_identity, planned_identity
from adahop.data.shards import file_lock, prepare
from adahop.data.sources import FileSource, resolve_sources
from adahop.data.tokenizer import load_tokenizer

__all__ = ["cached_path", "prepare_cached", "is_cached"]


def _root() -> Path:
    return cache_dir() / "prepared"


def cached_path(specs: Sequence[str], *, tokenizer: str, vocab_size: int, val_fraction: float, seed: int = 0,
                text_field: str = "text") -> tuple[Path, dict]:
    """The cache folder that these sources and settings are prepared into, and their planned
    identity; nothing is prepared (the folder may not exist yet).

    Args:
        specs: ``--data`` sources as for :func:`adahop.data.sources.resolve_sources` (``default``
            is fetched here if it is not cached yet).
        tokenizer, vocab_size, val_fraction, seed, text_field: as for :func:`adahop.data.prepare`.

    Returns:
        ``(folder, identity)``.

    Raises:
        ValueError: a source that does not exist, or a tokenizer that cannot be loaded.
        OSError: a source file cannot be read.
    """
    srcs = resolve_sources(specs)
    tok = "bpe" if tokenizer == "bpe" else load_tokenizer(tokenizer)
    planned = planned_identity(srcs, tokenizer=tok, val_fraction=val_fraction, seed=seed, text_field=text_field)
    content = [(s.kind if isinstance(s, FileSource) else "dataset", i["sha256"] or i["name"], i["bytes"])
               for s, i in zip(srcs, planned["sources"])]
    vocab = vocab_size if tokenizer == "bpe" else None  # a given tokenizer is keyed by its fingerprint
    key = hashlib.sha256(json.dumps([content, vocab, planned["tokenizer"]["sha256"], planned["split"],
                                     planned["prepare_revision"]]).encode()).hexdigest()[:16]
    name = "default" if list(specs) == ["default"] else "data"
    # named by the tokenizer's kind, not its path: the key holds its fingerprint, so one tokenizer.json
    # copied into many folders (every `adahop ptq` output) shares one prepared copy of the corpus
    kind = tokenizer.split(":", 1)[0].replace("/", "_")
    return _root() / f"{name}-{kind}-{vocab_size}-{key}", planned


def is_cached(folder: str | Path) -> bool:
    """Whether ``folder`` lies in the prepared-data cache (its contents are its key's, whatever
    happened since to the files first prepared into it)."""
    try:
        return Path(folder).resolve().is_relative_to(_root().resolve())
    except OSError:
        return False


def prepare_cached(specs: Sequence[str], *, tokenizer: str, vocab_size: int, val_fraction: float, seed: int = 0,
                   text_field: str = "text") -> Path:
    """The cache folder of :func:`cached_path`, prepared first if it is not complete yet; safe to call
    from several processes at once (see the module doc).

    Raises:
        ValueError: as :func:`adahop.data.prepare`, or a source that changed while it was prepared
            (run again).
        RuntimeError: ``default`` could not be fetched.
    """
    out, planned = cached_path(specs, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction, seed=seed,
                               text_field=text_field)
    if (out / "manifest.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(out.name + ".lock"), str(out)):
        if (out / "manifest.json").is_file():  # another process made it while this one waited
            return out
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # a killed process's (only the lock holder makes them)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()  # with the umask's mode, like the folders prepare makes
        try:
            m = prepare(list(specs), tmp, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction,
                        seed=seed, text_field=text_field)
            changed = identity_changes(planned, manifest_identity(m))
            if changed:  # the key names content the folder does not hold: never publish it
                raise ValueError(f"--data: a source changed while it was being prepared ({'; '.join(changed)}); "
                                 "run again once the files stay as they are")
            if out.exists():  # a folder there without its manifest is no entry (damaged): replace it
                shutil.rmtree(out)
            os.rename(tmp, out)  # the entry appears complete, or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
