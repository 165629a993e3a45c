"""Small shared helpers: atomic file writes, seed mixing, JSON reading, command-line checks, a finiteness scan and
the out-of-memory test."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temp file in the same folder, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes the file 0600: give it the mode open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Atomic UTF-8 text write (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ``parts`` (run seed, step, layer, GEMM, call...): stable across
    processes and platforms, different for any change of a part."""
    h = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def read_json(path: str | Path, what: str):
    """``json.loads`` of the file at ``path``; a file that is not JSON raises a ValueError naming
    ``what`` (the flag or role of the file) and the path, instead of a bare decoder message."""
    import json

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON ({e}); fix the file or write it again") from None


def check_out_path(path: str | Path, flag: str, *, folder: bool) -> None:
    """Raise ValueError naming ``flag`` when ``path`` cannot become a folder (``folder=True``) or a
    file: it is empty, it exists as the other kind, or a path above it is a file. Commands check this first, so
    that a bad ``--out`` does not lose the results of a long run at its very end."""
    if not str(path).strip():  # Path("") is the working directory: the outputs would land among the user's files
        raise ValueError(f"{flag} is empty; pass a {'folder' if folder else 'file'} path")
    p = Path(path)
    if p.exists() and p.is_dir() != folder:
        fix = "pass a folder" if folder else f"pass a file path, e.g. {p / 'eval.json'}"
        raise ValueError(f"{flag} {p} is {'a folder' if p.is_dir() else 'a file'}, not a {'folder' if folder else 'file'}; {fix}")
    for above in p.parents:
        if above.exists():
            if not above.is_dir():
                raise ValueError(f"{flag} {p}: {above} is a file, not a folder; pass another {flag}")
            break


def refuse_unused(args, flags, reason: str, fix: str) -> None:
    """Raise ValueError for the first option of ``flags`` that ``args`` sets although the part of the
    command it is for does not run (it would be silently unused, while the results record it):
    ``--FLAG is for REASON (it would be unused); FIX``. ``flags``: attribute names, unset when None,
    or a dict of attribute name -> its unset (default) value."""
    unset = flags if isinstance(flags, dict) else dict.fromkeys(flags)
    for flag, default in unset.items():
        if getattr(args, flag) != default:
            raise ValueError(f"--{flag.replace('_', '-')} is for {reason} (it would be unused); {fix}")


def out_of_memory_error(e: BaseException) -> BaseException | None:
    """The GPU's out-of-memory error in ``e``'s chain (``e`` itself, its causes and contexts), or None: torch's
    ``OutOfMemoryError`` where the chain holds one (a compiler's ``BackendCompilerFailed`` wraps it as its cause),
    else the first error that says "out of memory" (a library's allocation: cuBLAS workspaces, Triton's launches)."""
    import torch

    chain = []
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return (next((c for c in chain if isinstance(c, torch.OutOfMemoryError)), None)
            or next((c for c in chain if "out of memory" in str(c).lower()), None))


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is, or carries, the GPU running out of memory (:func:`out_of_memory_error`)."""
    return out_of_memory_error(e) is not None


def first_nonfinite(tensors) -> tuple[str, int, int] | None:
    """``(name, NaN-or-inf count, numel)`` of the first floating-point tensor of ``tensors`` (a mapping, e.g. a
    ``state_dict()``) that holds NaN or inf, or None when all are finite. Tensor methods only: no torch import here."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(t.isfinite().all()):
            return name, int((~t.isfinite()).sum()), t.numel()
    return None


@contextlib.contextmanager
def unreadable_weights(where: Path, what: str = "MODEL weights"):
    """A weights file that safetensors or torch cannot read (truncated, empty, a bad header) as a ValueError naming
    it, not the reader's traceback; other errors pass. ``what``: how the message names the file's role.

    Raises:
        ValueError: the reader inside the ``with`` raised a safetensors or unpickling error (the message names the
            file and the fix). Source: ours."""
    try:
        yield
    except Exception as e:  # safetensors raises its own error class (SafetensorError), torch.load an UnpicklingError
        if not any(k in type(e).__name__.lower() for k in ("safetensor", "pickl")):
            raise
        raise ValueError(f"{what} in {where} cannot be read ({type(e).__name__}: {str(e)[:160]}); the file is "
                         "damaged or incomplete: copy it again, or use an earlier checkpoint") from None


def lock_folder(folder: Path, who: str = "adahop run"):
    """An exclusive lock on ``folder/.lock`` (the open file; closing it releases the lock), or None where the
    folder cannot be created yet (the caller's checks explain why) or file locks are unavailable.

    Raises:
        ValueError: another process holds the lock (the message names the folder and the way on). Source: ours."""
    try:
        import fcntl

        Path(folder).mkdir(parents=True, exist_ok=True)
        f = open(Path(folder) / ".lock", "w")
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"--out {folder}: another {who} is writing to this folder; wait for it to end, or pass "
                         "another --out") from None
    except OSError:  # a filesystem without flock: run unlocked
        pass
    return f


@contextlib.contextmanager
def folder_locked(folder: Path, who: str = "adahop run", take: bool = True):
    """:func:`lock_folder` held for the ``with`` block and released at its end, also when it raises; ``take=False``
    (e.g. a rank other than 0) takes no lock.

    Raises:
        ValueError: another process holds the lock (from :func:`lock_folder`). Source: ours (one writer per
            ``--out`` for train, compare and ptq)."""
    f = lock_folder(folder, who) if take else None
    try:
        yield
    finally:
        if f is not None:
            f.close()
