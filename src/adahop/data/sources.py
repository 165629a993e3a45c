"""Text sources for ``adahop data prepare``: local files and folders, Hugging Face datasets, the default corpus.

A source spec (one string) resolves to one or more :class:`Source` objects. Each source streams
*documents*; a document is an iterator of text chunks (a whole text file is one document read in
1 MiB chunks; a JSONL line or a Parquet row is one document of one chunk).

Supported specs:

- a file: ``.txt``/``.text``/``.md`` (plain UTF-8 text), ``.jsonl`` (one JSON object per line, text in
  ``text_field``), ``.parquet`` (text in column ``text_field``); text and JSONL files may be compressed
  as ``.gz``, ``.xz`` or ``.zst``. A named archive (``.tar``, ``.tar.gz``, ``.zip``, ...) or ``.bz2`` is
  refused, and so is a ``.json`` file (JSON Lines are read as ``.jsonl``); a named file with another suffix is
  read as plain text. A folder's files of other kinds are left out with a warning.
- a folder: every supported file below it, recursively, in sorted path order (hidden files skipped).
- ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset through ``datasets`` (split defaults to ``train``).
- ``default``: the built-in corpus (State of the Union addresses + Moby-Dick), see
  :mod:`adahop.data.default_corpus`.

Plain text is read with universal newlines (``\\r\\n`` becomes ``\\n``) and a UTF-8 BOM is dropped.
Every read error (truncated archive, invalid UTF-8, a JSONL line that is not JSON or holds a lone
surrogate escape such as ``"\\ud800"``, a missing column) is raised as ``ValueError`` naming the file (and line, for JSONL).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import warnings
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zstandard

__all__ = ["SourceInfo", "Source", "FileSource", "HFSource", "resolve_sources", "sha256_file"]

TEXT_SUFFIXES = (".txt", ".text", ".md")
COMPRESSED_SUFFIXES = (".gz", ".xz", ".zst")
_ARCHIVE_SUFFIXES = (".tar", ".tgz", ".tbz2", ".txz", ".tar.gz", ".tar.xz", ".tar.zst", ".zip", ".7z", ".rar", ".bz2",
                     ".lz4", ".lzma", ".z", ".br")  # compared lower-cased (.Z is compress's)
_CHUNK_CHARS = 1 << 20  # plain text is streamed in 1 MiB chunks
_READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error, zstandard.ZstdError, UnicodeDecodeError)

Document = Iterator[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceInfo:
    """What a prepared corpus was made from; one entry per file (or dataset) in ``manifest.json``."""

    name: str
    """The file's absolute path, or the ``hf:`` / ``default`` spec."""
    sha256: str
    """Hex sha256 of the file's raw bytes as stored (compressed, if it is); for a Hugging Face
    dataset, of the UTF-8 text of its documents, each followed by a NUL byte."""
    bytes: int
    """Size of what ``sha256`` covers, in bytes."""


class Source:
    """One resolved input. Subclasses implement :meth:`documents` and :meth:`info`."""

    name: str

    def documents(self, text_field: str) -> Iterator[Document]:
        """Yield the documents, in a fixed order; each document is an iterator of str chunks.

        Raises:
            ValueError: unreadable input, naming the file (and line for JSONL) and the fix.
        """
        raise NotImplementedError

    def info(self, text_field: str) -> SourceInfo:
        """Hash and size of the source (reads it once)."""
        raise NotImplementedError


class _ZstdReader(io.RawIOBase):
    """Raw binary reader over a (multi-frame) ``.zst`` file that raises ``EOFError`` when truncated.

    ``zstandard``'s own ``stream_reader`` ends silently on a truncated frame, so we drive
    ``decompressobj`` ourselves and check that the last frame reached its end.
    """

    def __init__(self, path: Path):
        self._f = open(path, "rb")
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False  # bytes of an unfinished frame have been fed
        self._pending, self._pos = b"", 0  # decompressed bytes not yet returned: _pending[_pos:]

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos == len(self._pending):
            raw = self._f.read(1 << 20)
            if not raw:
                if self._in_frame:
                    raise EOFError("zstd stream ended inside a frame (file truncated?)")
                return 0
            out = []
            while raw:
                out.append(self._obj.decompress(raw))
                self._in_frame = not self._obj.eof
                raw = self._obj.unused_data if self._obj.eof else b""
                if self._obj.eof:
                    self._obj = self._dctx.decompressobj()
            self._pending, self._pos = b"".join(out), 0
        n = min(len(b), len(self._pending) - self._pos)
        b[:n] = self._pending[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_binary(path: Path) -> io.BufferedIOBase:
    """Open ``path`` for reading decompressed bytes, by its last suffix (.gz/.xz/.zst or none)."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".zst":
        return io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)
    return open(path, "rb")


def _open_text(path: Path) -> io.TextIOWrapper:
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8-sig", errors="strict")


def _file_kind(path: Path) -> str | None:
    """``"text"``, ``"jsonl"``, ``"parquet"`` or None (unsupported) from the file's suffixes."""
    name = path.name.lower()
    for comp in COMPRESSED_SUFFIXES:
        if name.endswith(comp):
            name = name[: -len(comp)]
            break
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return None if name != path.name.lower() else "parquet"  # compressed parquet: unsupported
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


_hashed: dict[tuple, str] = {}  # (path, device, inode, size, mtime, ctime) -> sha256, for this process


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of the file's raw bytes. Within one process a file is read once while its size,
    mtime and ctime stay the same (any write changes them): a run start asks for the hash of each
    source several times (cache key, resume check, manifest).

    Raises:
        OSError: the file cannot be read.
    """
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _hashed:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _hashed[key] = h.hexdigest()
    return _hashed[key]


class FileSource(Source):
    """A local file of kind ``"text"``, ``"jsonl"`` or ``"parquet"``.

    Args:
        path: the file.
        kind: how to read it (see :func:`resolve_sources` for how the kind follows the suffix).
        label: name recorded in the manifest; defaults to the absolute path (so that a check of
            the sources finds the same file from any working directory).
    """

    def __init__(self, path: Path, kind: str, label: str | None = None):
        self.path = path
        self.kind = kind
        self.name = label or os.path.abspath(path)

    def info(self, text_field: str) -> SourceInfo:
        return SourceInfo(name=self.name, sha256=sha256_file(self.path), bytes=self.path.stat().st_size)

    def documents(self, text_field: str) -> Iterator[Document]:
        if self.kind == "text":
            yield self._text_stream()
        elif self.kind == "jsonl":
            yield from self._jsonl_docs(text_field)
        else:
            yield from self._parquet_docs(text_field)

    @contextmanager
    def _naming_errors(self):
        """Re-raise a read/decode error as ``ValueError`` that names this file."""
        try:
            yield
        except _READ_ERRORS as e:
            hint = " (convert it to UTF-8, e.g. with iconv)" if isinstance(e, UnicodeDecodeError) else ""
            raise ValueError(f"cannot read source {self.path}: {type(e).__name__}: {e}{hint}") from e

    def _text_stream(self) -> Document:
        with self._naming_errors(), _open_text(self.path) as f:
            while chunk := f.read(_CHUNK_CHARS):
                yield chunk

    def _jsonl_docs(self, text_field: str) -> Iterator[Document]:
        with self._naming_errors(), _open_text(self.path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}, line {lineno}: not valid JSON ({e.msg}); "
                                     "each line of a .jsonl source must be one JSON object") from e
                text = row.get(text_field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{self.path}, line {lineno}: no string field {text_field!r}; "
                                     "prepare it with `adahop data prepare --source ... --text-field NAME --out DIR`, "
                                     "then train with --data DIR")
                try:  # JSON's \ud800-style escapes may leave a lone surrogate, which no tokenizer encodes
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"{self.path}, line {lineno}: field {text_field!r} holds a lone surrogate "
                                     f"(\\u{ord(text[e.start]):04x}, an escape of half a UTF-16 pair), which is no "
                                     "text; fix or drop that line") from None
                if text:
                    yield iter((text,))

    def _parquet_docs(self, text_field: str) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"cannot read parquet source {self.path}: {e}") from e
        columns = pf.schema_arrow.names
        if text_field not in columns:
            raise ValueError(f"{self.path}: no column {text_field!r} (columns: {columns}); "
                             "pass the right column with `adahop data prepare --text-field NAME`")
        try:
            for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield iter((_text_value(text, f"{self.path}, column {text_field!r}"),))
        except pa.ArrowException as e:
            raise ValueError(f"cannot read parquet source {self.path}: {e}") from e


def _text_value(text, where: str) -> str:
    """``text`` if it is a string; a column of bytes or of lists was tokenized as its Python repr
    ("b'...'", "['...']", newlines as the two characters \\n)."""
    if not isinstance(text, str):
        raise ValueError(f"{where} holds {type(text).__name__} values, not text; convert the column to strings "
                         "(decoded UTF-8, lists joined) or pass a text column with --text-field NAME")
    return text


class HFSource(Source):
    """A Hugging Face dataset split, loaded with ``datasets.load_dataset(name, config, split=split)``."""

    def __init__(self, spec: str, name: str, config: str | None, split: str):
        self.name, self._ds_name, self._config, self._split = spec, name, config, split
        self._ds = None

    def _dataset(self, text_field: str):
        if self._ds is None:
            try:
                import datasets
            except ImportError as e:
                raise ImportError(f"source {self.name!r} needs the `datasets` package: pip install datasets") from e
            self._ds = datasets.load_dataset(self._ds_name, self._config, split=self._split)
        if text_field not in self._ds.column_names:
            raise ValueError(f"{self.name}: no column {text_field!r} (columns: {self._ds.column_names}); "
                             "pass the right column with `adahop data prepare --text-field NAME`")
        return self._ds

    def documents(self, text_field: str) -> Iterator[Document]:
        for row in self._dataset(text_field).select_columns([text_field]):
            text = row[text_field]
            if text:
                yield iter((_text_value(text, f"{self.name}, column {text_field!r}"),))

    def info(self, text_field: str) -> SourceInfo:
        h, n = hashlib.sha256(), 0
        for doc in self.documents(text_field):
            for chunk in doc:
                raw = chunk.encode("utf-8")
                h.update(raw)
                n += len(raw)
            h.update(b"\0")
        return SourceInfo(name=self.name, sha256=h.hexdigest(), bytes=n)


def _parse_hf(spec: str) -> HFSource:
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"bad Hugging Face source {spec!r}; expected hf:NAME[:CONFIG][:SPLIT], "
                         "e.g. hf:roneneldan/TinyStories or hf:wikitext:wikitext-103-raw-v1:train")
    name, config, split = (parts + [None, None])[:3]
    return HFSource(spec, name, config or None, split or "train")


def _folder_sources(folder: Path) -> list[Source]:
    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    kinds = {p: _file_kind(p) for p in files}
    out: list[Source] = [FileSource(p, kind) for p, kind in kinds.items() if kind]
    if not out:
        raise ValueError(f"source folder {folder} holds no usable files; expected .txt/.md/.jsonl/.parquet "
                         f"(text and .jsonl may end in {'/'.join(COMPRESSED_SUFFIXES)})")
    skipped = [p for p, kind in kinds.items() if kind is None]
    if skipped:  # e.g. JSON Lines saved as .json: left out without a word, the corpus was smaller than the folder
        warnings.warn(f"source folder {folder}: {len(skipped)} file(s) of other kinds are not read "
                      f"({', '.join(str(p.relative_to(folder)) for p in skipped[:3])}{', ...' if len(skipped) > 3 else ''}); "
                      "only .txt/.text/.md/.jsonl/.parquet are (JSON Lines saved as .json: rename them .jsonl)",
                      stacklevel=2)
    return out


def resolve_sources(specs: str | Path | Sequence[str | Path]) -> list[Source]:
    """Turn ``--source`` specs into concrete sources, in the order given (folders expand sorted).

    Args:
        specs: file paths, folder paths, ``hf:NAME[:CONFIG][:SPLIT]`` or ``default`` (one, or a sequence).

    Returns:
        list of :class:`Source`, at least one.

    Raises:
        ValueError: no specs, a path that does not exist, an empty folder, a compressed parquet, an archive
            (.tar, .zip, ...) or a compression other than .gz/.xz/.zst.
        RuntimeError: ``default`` could not be fetched (see :func:`adahop.data.default_corpus.default_corpus_path`).
    """
    specs = [str(specs)] if isinstance(specs, (str, Path)) else [str(s) for s in specs]
    if not specs:
        raise ValueError("no sources given; pass --source PATH (file or folder), --source hf:NAME or --source default")
    out: list[Source] = []
    for spec in specs:
        if spec == "default":
            from adahop.data.default_corpus import default_corpus_path

            out.append(FileSource(default_corpus_path(), "text", label="default"))
        elif spec.startswith("hf:"):
            out.append(_parse_hf(spec))
        else:
            path = Path(spec).expanduser()
            if path.is_dir():
                out.extend(_folder_sources(path))
            elif path.is_file():
                kind = _file_kind(path)
                if path.name.lower().endswith(_ARCHIVE_SUFFIXES):  # read as text, their headers would be tokens
                    raise ValueError(f"{path}: an archive or a compression adahop does not read; unpack or decompress "
                                     f"it (a folder of text files is read whole), or recompress the text as "
                                     f"{'/'.join(COMPRESSED_SUFFIXES)}")
                if path.name.lower().endswith(tuple(".json" + c for c in ("", *COMPRESSED_SUFFIXES))):
                    # read as plain text, its keys and quotes and escapes were tokens (datasets' to_json writes these)
                    raise ValueError(f"{path}: a .json file; if it holds one JSON object per line (JSON Lines, as "
                                     "datasets' to_json writes), rename it .jsonl; other JSON is not read (write its "
                                     "text as .txt or .jsonl)")
                if kind is None and path.name.lower().endswith(tuple(".parquet" + c for c in COMPRESSED_SUFFIXES)):
                    raise ValueError(f"{path}: compressed parquet is not supported; decompress it first "
                                     "(parquet compresses its columns itself)")
                out.append(FileSource(path, kind or "text"))
            else:
                raise ValueError(f"source {spec!r} is not a file, a folder, hf:NAME or 'default'")
    return out
