"""The run folder as a Hugging Face model folder: config.json (with an "adahop" section holding the
run config), BF16 model.safetensors and the tokenizer, loadable with
``transformers.AutoModelForCausalLM.from_pretrained(run_dir)``."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import __version__
from ..data import Manifest
from ..data.identity import manifest_identity
from ..utils import atomic_write_text, read_json
from .checkpoint import CheckpointWriteError, storage_error, tied_keys
from .config import TrainConfig

__all__ = ["write_config", "read_run_section", "runs_inside", "export_hf", "save_hf_tokenizer", "git_revision"]


def git_revision() -> str | None:
    """The git revision of this adahop checkout, or None outside a checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_config(run: Path, cfg: TrainConfig, model, data_dir: Path, recipe, world: int = 1) -> None:
    """config.json = the model's transformers config + an "adahop" section (run config, recipe,
    data folder and the data's identity (:mod:`adahop.data.identity`: what --resume and compare
    check), the data-parallel ranks ``world`` that run it (each validates its own micro-batches, which
    ``adahop eval`` repeats), version, git revision)."""
    run.mkdir(parents=True, exist_ok=True)
    d = model.config.to_dict()
    d["torch_dtype"] = d["dtype"] = "bfloat16"  # the exported weights are BF16 (transformers 5 reads "dtype")
    # the data folder as an absolute path: a relative one named another folder from another working directory
    d["adahop"] = dict(config=cfg.to_dict(), recipe=repr(recipe), data_dir=str(Path(data_dir).resolve()),
                       data_identity=manifest_identity(Manifest.load(data_dir)), world_size=world,
                       version=__version__, git_revision=git_revision())
    if cfg.model_config:  # the file's content: --resume and compare check that it was not edited since
        d["adahop"]["model_config_file"] = model_config_file(cfg.model_config)
    atomic_write_text(run / "config.json", json.dumps(d, indent=1, default=str))


def model_config_file(path: str | Path) -> dict | None:
    """The JSON of a ``--model-config`` (a file, or a folder's ``config.json``) as written, or None when it
    cannot be read."""
    p = Path(path)
    try:
        return json.loads((p / "config.json" if p.is_dir() else p).read_text())
    except (OSError, ValueError):
        return None


def read_run_section(run: str | Path) -> dict | None:
    """The "adahop" section :func:`write_config` put in ``run/config.json`` (keys ``config``, ``recipe``,
    ``data_dir``, ``data_identity``, ``world_size``, ``version``, ``git_revision``), or None when the folder has no
    config.json or the file no such section (a plain transformers model folder).

    Raises:
        ValueError: config.json is not valid JSON (the message names the file).
    """
    path = Path(run) / "config.json"
    if not path.is_file():
        return None
    return read_json(path, "the run's config").get("adahop") or None


def runs_inside(folder: str | Path) -> list[Path]:
    """The run folders of ``adahop train`` directly inside ``folder``, sorted (an ``adahop compare``
    --out holds one per recipe); empty when there are none or ``folder`` is not a readable folder.
    For the error of a command given such a folder where it takes one run."""
    try:
        subs = sorted(d for d in Path(folder).iterdir() if d.is_dir())
    except OSError:
        return []
    runs = []
    for d in subs:
        try:
            if read_run_section(d) is not None:
                runs.append(d)
        except ValueError:  # a config.json that does not read: not a run to point to
            pass
    return runs


def export_hf(run: Path, model, data_dir: Path) -> None:
    """Write the BF16 master weights as model.safetensors and the tokenizer beside config.json.

    The tokenizer is written only while the data folder's is still the one the run recorded at its start
    (config.json's ``data_identity``): a ``data prepare --overwrite`` of the folder during the run would
    otherwise pair the weights with another tokenizer; then the one written at the start stays, with a warning."""
    full = model.state_dict()
    tied = tied_keys(full)
    state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in full.items() if k not in tied}
    tmp = run / ".model.safetensors.tmp"
    try:
        save_file(state, tmp, metadata={"format": "pt"})
        tmp.replace(run / "model.safetensors")
    except Exception as e:  # a full disk: one line naming the way on, as for a checkpoint, not a traceback
        tmp.unlink(missing_ok=True)
        if (found := storage_error(e)) is None:
            raise
        err = CheckpointWriteError(f"the final weights could not be exported to {run / 'model.safetensors'} ({found[1]}); "
                                   f"the run's checkpoints are complete. Free space (or fix the disk), then run the same "
                                   f"command with --resume to write the export")
        err.errno = found[0]
        raise err from None
    recorded = ((read_run_section(run) or {}).get("data_identity") or {}).get("tokenizer", {}).get("sha256")
    try:
        now = Manifest.load(data_dir).tokenizer.sha256
    except (OSError, ValueError):
        now = None
    if recorded and now != recorded:
        warnings.warn(f"{run}: the tokenizer of {data_dir} is no longer the one this run trained with (the folder was "
                      f"prepared again during the run?); the run keeps the tokenizer files written at its start"
                      + ("" if (run / "tokenizer.json").exists() else ", and has none: prepare its data again as it "
                         "was to score it"), stacklevel=2)
        return
    save_hf_tokenizer(run, data_dir)


def save_hf_tokenizer(run: Path, data_dir: Path) -> None:
    """Write the data's tokenizer (trained BPE, tiktoken GPT-2 or a Hugging Face one) into ``run`` as
    transformers files (tokenizer.json, tokenizer_config.json), so that ``AutoTokenizer`` and
    ``adahop eval`` load the run. A tokenizer that cannot be converted is warned about, not fatal:
    the weights are written either way."""
    try:
        Manifest.load(data_dir).load_tokenizer(data_dir).to_transformers().save_pretrained(str(run))
    except Exception as e:  # noqa: BLE001 - the export of the weights must not fail on the tokenizer
        warnings.warn(f"{run}: the tokenizer of {data_dir} was not written as transformers files "
                      f"({type(e).__name__}: {e}); `adahop eval` of this run needs them", stacklevel=2)
