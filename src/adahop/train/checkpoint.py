"""Checkpoints: safetensors for tensors, JSON for the rest, each written atomically.

A checkpoint is the folder ``checkpoints/step_NNNNNNN/`` holding ``model.safetensors`` (the master
weights in their own dtype; packed FP8/FP4 ones as codes and scales), ``optimizer.safetensors``
(the optimizer states in their own dtype), and ``state.json`` (step, optimizer
hyper-parameters, the AdaHOP plan or the calibration history so far, RNG state). It is written to a
temporary folder and renamed into place, so a crash never leaves a half-written checkpoint; a write
that fails (disk full, I/O error, an abort) removes its temporary folder and leaves the complete
checkpoints before it as they were.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..nn.convert import controller_state, load_controller_state
from ..optim.master import pack_state_dict, unpack_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "complete_checkpoints", "publish_checkpoint",
           "CheckpointWriteError", "discard_failed_write", "storage_error"]


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, I/O error). Its temporary folder is removed and
    the complete checkpoints before it are kept; the message names the last one and how to go on."""


def storage_error(e: BaseException) -> tuple[int, str] | None:
    """``(errno, reason)`` when ``e`` is a storage error (an ``OSError``, or safetensors' error wrapping the Rust
    writer's io::Error as text), else None. Raises nothing. Source: ours (a full disk must end a run with one line
    naming ``--resume``)."""
    if isinstance(e, OSError):
        return e.errno, e.strerror or str(e)
    if isinstance(e, SafetensorError) and "I/O error" in str(e):
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else errno.EIO
        return code, os.strerror(code)
    return None


def discard_failed_write(tmp: Path, step: int, e: BaseException) -> CheckpointWriteError | None:
    """Remove the partial checkpoint folder ``tmp`` after its write raised ``e``; return the
    :class:`CheckpointWriteError` to raise instead when ``e`` is a storage error (an ``OSError``, or
    safetensors' error wrapping one), None for anything else (re-raise ``e`` itself)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if (found := storage_error(e)) is None:
        return None
    code, why = found
    done = complete_checkpoints(tmp.parent.parent)
    kept = f"the last complete checkpoint, {done[-1]}, is kept" if done else "no earlier checkpoint exists"
    err = CheckpointWriteError(f"the checkpoint of step {step} could not be written to {tmp.parent} ({why}); its "
                               f"partial folder was removed and {kept}. Free space (or fix the disk), then continue "
                               f"with --resume")
    err.errno = code
    return err


def _optim_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, *, keep: int = 2,
                    extra: dict | None = None) -> Path:
    """Write the checkpoint of ``step`` atomically and keep only the newest ``keep``; ``extra``: more
    entries for state.json.

    Raises:
        CheckpointWriteError: the disk is full or failed (the partial folder is removed first).
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        full = model.state_dict()
        tied = tied_keys(full)
        state = {k: v.detach().cpu().contiguous() for k, v in full.items() if k not in tied}
        save_file(pack_state_dict(state), tmp / "model.safetensors")  # packed FP8/FP4 masters as their parts
        tensors, meta = _optim_tensors(opt)
        save_file(tensors, tmp / "optimizer.safetensors")
        cs = controller_state(model)
        meta.update(step=step, controller_step=cs["step"], rng=torch.get_rng_state().tolist(), plan=cs["plan"],
                    calibration_history=cs["calibration_history"], calibration_from=cs["calibration_from"], **(extra or {}))
        (tmp / "state.json").write_text(json.dumps(meta))
        return publish_checkpoint(tmp, final, keep)
    except BaseException as e:  # disk full, I/O error, a second Ctrl-C: no partial folder stays behind
        err = discard_failed_write(tmp, step, e)
        if err is None:
            raise
        raise err from e


def publish_checkpoint(tmp: Path, final: Path, keep: int) -> Path:
    """Make the fully written folder ``tmp`` the checkpoint ``final`` in one rename (after
    fsync of its files), then keep only the newest ``keep`` checkpoints beside it."""
    for f in tmp.rglob("*"):  # flush file contents before the rename makes them visible
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(final.parent.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def tied_keys(state: dict[str, torch.Tensor]) -> set[str]:
    """Keys of ``state`` (a model's own ``state_dict()``, before any copy) whose tensor is the same
    memory as an earlier key's: tied weights (the LM head and the embeddings, whatever their names).
    Safetensors stores one of each; loading restores the rest through the tie."""
    seen, tied = set(), set()
    for k, v in state.items():
        if v.numel() == 0 or v.device.type == "meta":
            continue
        key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if key in seen:
            tied.add(k)
        seen.add(key)
    return tied


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoint folders of ``run_dir`` (those with their ``state.json``, which is written
    last), oldest first; empty when there are none."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "state.json").exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of ``run_dir``, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """Restore model, optimizer, RNG, AdaHOP plan/calibration and step from ``path``; returns state.json."""
    path = Path(path)
    meta = json.loads((path / "state.json").read_text())
    weights = unpack_state_dict(load_file(path / "model.safetensors"), model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = tied_keys(model.state_dict())
    missing = [k for k in missing if k not in tied]  # tied weights come back through the one stored
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if opt is not None:
        tensors = load_file(path / "optimizer.safetensors")
        state: dict = {}
        for key, v in tensors.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = v
        for key, v in meta["scalars"].items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = v
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    load_controller_state(model, {"step": meta["controller_step"], "plan": meta.get("plan"),
                                  "calibration_history": meta.get("calibration_history"),
                                  "calibration_from": meta.get("calibration_from", 0)})
    return meta
