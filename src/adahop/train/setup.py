"""Everything a run needs before its first step: device, data, model, recipe, optimizer."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from pathlib import Path

import torch

from ..data import Manifest, TokenStream, prepare
from ..data.default_corpus import cache_dir
from ..data.shards import PREPARE_REVISION
from ..models import build_model, check_compat
from ..patterns import Plan
from ..recipes import get_recipe
from .config import TrainConfig

__all__ = ["resolve_device", "resolve_data", "prepared_path", "settings_diff", "resolve_recipe", "build_optimizer", "lr_at", "make_streams", "make_model"]


#: Settings a resumed run must share with the run that wrote the checkpoint (the model, the
#: numerics and the data order); others (--steps, --eval-every, --out...) may change.
RESUME_KEYS = ("recipe", "model", "model_config", "seq_len", "batch_size", "grad_accum", "seed", "data", "vocab_size",
               "tokenizer", "calib_steps", "plan", "backend",
               # the optimizer and its schedule: a resumed run continues the same one (--steps may grow)
               "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "beta1", "beta2",
               "optimizer", "master_weights", "optimizer_states", "madam_form", "madam_mul_lr")

#: Settings that do not change a finished run's results (`adahop compare` reuses a run whose other
#: settings all equal the new ones).
RESULT_NEUTRAL_KEYS = ("out", "resume", "log_every", "ckpt_every", "keep_ckpts")


def settings_diff(cfg: TrainConfig, run: Path, keys) -> list[str]:
    """The settings among ``keys`` in which ``cfg`` differs from the run saved in ``run/config.json``,
    as ``--flag old → new`` strings (empty if the folder holds no config). ``--data`` is compared as
    the prepared folder it names, so ``default`` and its cache path, or two spellings of one path,
    are the same data.

    Raises:
        ValueError: ``run/config.json`` is not valid JSON, or ``cfg.data`` names a missing path.
    """
    from ..utils import read_json

    if not (run / "config.json").exists():
        return []
    section = read_json(run / "config.json", "the run's config").get("adahop", {})
    saved, now = section.get("config", {}), cfg.to_dict()
    diff = []
    for k in keys:
        if k not in saved or saved[k] == now.get(k):
            continue
        if k == "data" and "data_dir" in section and _same_path(section["data_dir"], prepared_path(cfg)):
            continue
        diff.append(f"--{k.replace('_', '-')} {saved[k]!r} → {now.get(k)!r}")
    return diff


def _same_path(a, b) -> bool:
    return Path(a).resolve() == Path(b).resolve()


#: where a failed ``adahop train`` leaves its error (``compare`` points there); a new attempt removes it
ERROR_FILE = "error.txt"


def check_run_dir(cfg: TrainConfig, run: Path) -> int | None:
    """Check ``--out`` against ``--resume`` before anything is built; return the checkpoint step
    to resume from, or None to start at step 0.

    Raises:
        ValueError: an ``--out`` that cannot be created or written; checkpoints of an earlier run
            in ``--out`` without ``--resume`` (a new run would
            mix its files with theirs); with ``--resume``, a setting that differs from the
            checkpointed run's (listed), or ``--steps`` not above the checkpoint's step.
    """
    from .checkpoint import latest_checkpoint

    try:  # an --out that cannot hold the run fails now, not after the first checkpoint interval
        run.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {run}: cannot create the run folder ({e.strerror or e}); pass a folder you can "
                         f"write to") from None
    if not os.access(run, os.W_OK):
        raise ValueError(f"--out {run}: the folder is not writable; pass a folder you can write to")
    (run / ERROR_FILE).unlink(missing_ok=True)
    ck = latest_checkpoint(run)
    if ck is None:
        if cfg.resume:
            print(f"--resume: no checkpoint in {run / 'checkpoints'}; starting at step 0")
        return None
    step = int(ck.name.split("_")[1])
    if not cfg.resume:
        raise ValueError(f"--out {run} holds checkpoints of an earlier run (up to step {step}); pass --resume to "
                         f"continue that run, or choose a new --out (or delete the folder)")
    diff = settings_diff(cfg, run, RESUME_KEYS)
    if diff:
        raise ValueError(f"--resume: these settings differ from the checkpointed run in {run}: {'; '.join(diff)}. "
                         f"Resume with the run's own settings, or start a new run with a new --out")
    if cfg.steps < step or (cfg.steps == step and (run / "model.safetensors").exists()):
        raise ValueError(f"--resume: the run in {run} is already at step {step}; pass --steps above {step} to train further")
    return step  # == --steps: the run ended before its export was written; resuming writes it


def resolve_device(spec: str) -> torch.device:
    """'auto' → cuda if available else cpu. Raises ValueError for cuda without a GPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible; use --device cpu")
    return torch.device(spec)


def prepared_path(cfg: TrainConfig) -> Path:
    """The prepared data folder ``cfg.data`` names, without preparing it: ``cfg.data`` itself when it
    holds manifest.json, otherwise a cache folder keyed by the sources, the tokenizer settings and
    :data:`adahop.data.shards.PREPARE_REVISION`.

    Raises:
        ValueError: empty ``--data`` or a source path that does not exist.
    """
    p = Path(cfg.data)
    if p.is_dir() and (p / "manifest.json").exists():
        return p
    sources = _sources(cfg)
    if not sources:
        raise ValueError("--data is empty; pass 'default', a prepared folder or text files")
    for s in sources:
        if s != "default" and not s.startswith("hf:") and not Path(s).exists():
            raise ValueError(f"--data: {s!r} does not exist; pass 'default', a folder made by "
                             "`adahop data prepare`, or text files (.txt, .jsonl, .parquet, .xz, .gz, .zst)")
    key = hashlib.sha256(repr((sorted(str(Path(s).resolve()) if Path(s).exists() else s for s in sources),
                               cfg.tokenizer, cfg.vocab_size, cfg.val_fraction, PREPARE_REVISION)).encode()).hexdigest()[:12]
    name = "default" if sources == ["default"] else "data"
    return cache_dir() / "prepared" / f"{name}-{cfg.tokenizer.replace('/', '_').replace(':', '_')}-{cfg.vocab_size}-{key}"


def _sources(cfg: TrainConfig) -> list[str]:
    return [s for s in cfg.data.split(",") if s]


def resolve_data(cfg: TrainConfig) -> Path:
    """The prepared data folder for ``cfg.data`` (:func:`prepared_path`), prepared once if missing."""
    out = prepared_path(cfg)
    if not (out / "manifest.json").exists():
        prepare(_sources(cfg), out, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction)
    return out


def make_streams(cfg: TrainConfig, data_dir: Path, rank: int = 0, world: int = 1) -> tuple[TokenStream, TokenStream]:
    """Train and validation streams; each rank reads ``batch_size / world`` sequences per step."""
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by world size {world} x --grad-accum {cfg.grad_accum}")
    per_rank = cfg.batch_size // world
    train = TokenStream(data_dir, "train", cfg.seq_len, per_rank, seed=cfg.seed, rank=rank, world_size=world)
    val = TokenStream(data_dir, "val", cfg.seq_len, per_rank, seed=cfg.seed, rank=rank, world_size=world)
    return train, val


def make_model(cfg: TrainConfig, manifest: Manifest, device: torch.device) -> torch.nn.Module:
    """The model in FP32 master weights, initialized from ``cfg.seed`` (same init for every recipe).
    Its config's BOS/EOS ids are the data's end-of-text token (the document separator), so that the
    exported model's ``generate`` stops where the training documents ended."""
    vocab = manifest.tokenizer.vocab_size
    torch.manual_seed(cfg.seed)
    model = build_model(None if cfg.model_config else cfg.model, config_path=cfg.model_config, vocab_size=vocab,
                        max_seq_len=cfg.seq_len)
    check_compat(model.config, vocab_size=vocab, seq_len=cfg.seq_len)
    eos = manifest.tokenizer.eos_id
    model.config.bos_token_id = model.config.eos_token_id = eos
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.bos_token_id = model.generation_config.eos_token_id = eos
    return model.to(device)


def resolve_recipe(cfg: TrainConfig):
    """The recipe with --calib-steps applied, and the plan from --plan (or None)."""
    recipe = get_recipe(cfg.recipe)
    if cfg.calib_steps is not None and recipe.calibration is not None:
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, steps=cfg.calib_steps))
    plan = None
    if cfg.plan:
        if not Path(cfg.plan).exists():
            raise ValueError(f"--plan {cfg.plan}: no such file")
        if recipe.calibration is None:
            raise ValueError(f"--plan is for AdaHOP recipes (they calibrate); --recipe {cfg.recipe} has fixed strategies "
                             f"and would ignore it. Use --recipe adahop-lv1 or adahop-lv2, or drop --plan")
        try:
            plan = Plan.load(cfg.plan)
        except ValueError as e:  # not JSON, or JSON that is not a plan
            raise ValueError(f"--plan {cfg.plan}: {e}; pass a plan.json written by `adahop train` or `adahop analyze`") from None
    return recipe, plan


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, seed: int | None = None) -> torch.optim.Optimizer:
    """``--optimizer`` (AdamW by default: ``torch.optim.AdamW`` with FP32 masters and states) with
    weight decay on matrices only (norm gains and biases are not decayed). ``seed``: this rank's
    stochastic-rounding seed (default ``--seed``). Build it after the master weights are converted
    (:func:`adahop.optim.convert_master_weights`) and the model is wrapped."""
    from ..optim import build_optimizer as build

    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return build(cfg.optimizer, groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, weight_decay=cfg.weight_decay,
                 master=cfg.master_weights, states=cfg.optimizer_states, madam_form=cfg.madam_form,
                 mul_lr_scale=cfg.madam_mul_lr, seed=cfg.seed if seed is None else seed, backend=cfg.backend)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr-ratio · --lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
