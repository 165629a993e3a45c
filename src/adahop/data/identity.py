"""Data identity: what decides the tokens of a prepared folder, and how two preparations differ.

Two preparations hold the same tokens when they read the same sources (sha256 and size of each,
in order), with the same tokenizer (its vocabulary and merges: :meth:`Tokenizer.fingerprint
<adahop.data.tokenizer.Tokenizer.fingerprint>`) and the same split settings (``val_fraction``,
``seed``, ``text_field``), under the same :data:`~adahop.data.shards.PREPARE_REVISION`. An identity
is a JSON-ready dict of these::

    {"sources": [{"name": "/abs/corpus.txt", "sha256": "…", "bytes": 123}],
     "tokenizer": {"name": "bpe", "vocab_size": 8192, "sha256": "…"},
     "split": {"val_fraction": 0.01, "seed": 0, "text_field": "text"}, "prepare_revision": 2}

A value of None is unknown (a tokenizer not trained yet, a manifest of format 1) and is never
compared. A run records the identity of its data in ``config.json`` (``adahop.data_identity``);
``--resume`` and ``adahop compare`` compare it with the data they are given now.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from adahop.data.manifest import Manifest
from adahop.data.shards import PREPARE_REVISION
from adahop.data.sources import FileSource, Source, sha256_file

__all__ = ["manifest_identity", "planned_identity", "identity_changes", "changed_sources"]


def manifest_identity(m: Manifest) -> dict:
    """The identity of a prepared folder, from its manifest (see the module doc for the layout)."""
    return {"sources": [{"name": s.name, "sha256": s.sha256, "bytes": s.bytes} for s in m.sources],
            "tokenizer": {"name": m.tokenizer.name, "vocab_size": m.tokenizer.vocab_size, "sha256": m.tokenizer.sha256},
            "split": {"val_fraction": m.val_fraction, "seed": m.seed, "text_field": m.text_field},
            "prepare_revision": m.prepare_revision}


def planned_identity(sources: Sequence[Source], *, tokenizer, val_fraction: float, seed: int, text_field: str) -> dict:
    """The identity that :func:`adahop.data.prepare` would give these sources and settings, known
    before preparing: local files are hashed (a ``hf:`` dataset is known by its spec only: its
    sha256 and size are None until it is read).

    Args:
        sources: resolved sources (:func:`adahop.data.sources.resolve_sources`).
        tokenizer: ``"bpe"`` (trained while preparing: vocabulary and fingerprint None) or a loaded
            :class:`~adahop.data.tokenizer.Tokenizer`.
        val_fraction, seed, text_field: as for :func:`adahop.data.prepare`.

    Raises:
        OSError: a source file cannot be read.
    """
    srcs = [{"name": s.name, "sha256": sha256_file(s.path), "bytes": s.path.stat().st_size}
            if isinstance(s, FileSource) else {"name": s.name, "sha256": None, "bytes": None} for s in sources]
    tok = ({"name": "bpe", "vocab_size": None, "sha256": None} if tokenizer == "bpe" else
           {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "sha256": tokenizer.fingerprint()})
    split = {"val_fraction": val_fraction, "seed": seed, "text_field": text_field}
    return {"sources": srcs, "tokenizer": tok, "split": split, "prepare_revision": PREPARE_REVISION}


def _known_differ(a, b) -> bool:
    return a is not None and b is not None and a != b


def _short(sha: str) -> str:
    return sha[:12] + "…"


def identity_changes(old: dict, new: dict) -> list[str]:
    """What differs from identity ``old`` to ``new``, one readable item each (empty: the same data),
    e.g. ``val_fraction 0.01 → 0.02`` or ``source /x/a.txt: sha256 1f2e… → 9c0d…, 1,200 → 1,260 bytes``.
    Source names are not compared (a renamed file holds the same data) unless a sha256 is unknown (a ``hf:``
    dataset not read yet, known by its name only); other values None are unknown."""
    out = []
    for k, v in old.get("split", {}).items():
        if _known_differ(v, new.get("split", {}).get(k)):
            out.append(f"{k} {v!r} → {new['split'][k]!r}")
    a, b = old.get("sources", []), new.get("sources", [])
    if len(a) != len(b):
        na, nb = [s["name"] for s in a], [s["name"] for s in b]
        item = f"{len(a)} → {len(b)} sources"
        for what, names in (("without", [n for n in na if n not in nb]), ("with", [n for n in nb if n not in na])):
            if names:
                item += f"; {what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
        out.append(item)
    else:
        for s, t in zip(a, b):
            if (s["sha256"] is None or t["sha256"] is None) and s["name"] != t["name"]:
                # a hf: dataset is known by its name until it is read: another name is other data
                out.append(f"source {s['name']} → {t['name']}")
            elif _known_differ(s["sha256"], t["sha256"]):
                size = (f", {s['bytes']:,} → {t['bytes']:,} bytes" if _known_differ(s["bytes"], t["bytes"])
                        else ", same size")
                out.append(f"source {t['name']}: sha256 {_short(s['sha256'])} → {_short(t['sha256'])}{size}")
    ta, tb = old.get("tokenizer", {}), new.get("tokenizer", {})
    if _known_differ(ta.get("name"), tb.get("name")):
        out.append(f"tokenizer {ta['name']!r} → {tb['name']!r}")
    if _known_differ(ta.get("vocab_size"), tb.get("vocab_size")):
        out.append(f"vocabulary {ta['vocab_size']} → {tb['vocab_size']} ids")
    if _known_differ(ta.get("sha256"), tb.get("sha256")):
        out.append(f"tokenizer vocabulary/merges sha256 {_short(ta['sha256'])} → {_short(tb['sha256'])}")
    if _known_differ(old.get("prepare_revision"), new.get("prepare_revision")):
        out.append(f"prepare revision {old['prepare_revision']} → {new['prepare_revision']} (another adahop tokenized it)")
    return out


def changed_sources(m: Manifest) -> list[str]:
    """The recorded source files of ``m`` that differ now from what was prepared, one readable item
    each (empty: none changed). Only files still found at their recorded paths are checked (not
    ``default``, pinned by its own hash, nor ``hf:`` datasets); the size is compared first, the
    sha256 only when the size is the same.

    Raises:
        OSError: a recorded file exists but cannot be read.
    """
    out = []
    for s in m.sources:
        path = Path(s.name)
        if s.name == "default" or s.name.startswith("hf:") or not path.is_file():
            continue
        size = path.stat().st_size
        if size != s.bytes:
            out.append(f"{s.name}: {s.bytes:,} → {size:,} bytes")
        elif (sha := sha256_file(path)) != s.sha256:
            out.append(f"{s.name}: sha256 {_short(s.sha256)} → {_short(sha)}, same size")
    return out
