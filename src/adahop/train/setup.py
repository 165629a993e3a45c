"""Everything a run needs before its first step: device, data, model, recipe, optimizer."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path

import torch

from ..data import Manifest, TokenStream
from ..data.cache import cached_path, is_cached, prepare_cached
from ..data.identity import changed_sources, identity_changes, manifest_identity
from ..models import build_model, check_compat
from ..optim.names import PACKED_FORMATS, resolved_rounding
from ..patterns import Plan
from ..recipes import Recipe, get_recipe
from .config import ERROR_FILE, TrainConfig

__all__ = ["resolve_device", "resolve_data", "prepared_path", "settings_diff", "data_changes", "prepared_data_changes", "resolve_recipe", "build_optimizer",
           "lr_at", "make_streams", "make_model", "check_data_fits", "epochs_of", "converted_layers", "loss_ceiling", "startup_summary"]


#: Settings a resumed run must share with the run that wrote the checkpoint (the model, the
#: numerics, the data order and the val set); others (--steps, --eval-every, --out...) may change.
RESUME_KEYS = ("recipe", "model", "model_config", "seq_len", "batch_size", "grad_accum", "seed", "data_seed", "data", "vocab_size",
               "tokenizer", "calib_steps", "plan", "backend",
               # the optimizer and its schedule: a resumed run continues the same one (--steps may grow)
               "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "beta1", "beta2",
               "optimizer", "master_weights", "optimizer_states", "madam_form", "madam_mul_lr", "master_rounding",
               # the val windows: one run's val curve and final val loss are measured on one set
               "eval_batches")

#: Settings that do not change a finished run's results (`adahop compare` reuses a run whose other
#: settings all equal the new ones).
RESULT_NEUTRAL_KEYS = ("out", "resume", "log_every", "ckpt_every", "keep_ckpts", "log_to")


def settings_diff(cfg: TrainConfig, run: Path, keys, definition: bool = False) -> list[str]:
    """The settings among ``keys`` in which ``cfg`` differs from the run saved in ``run/config.json``,
    as ``--flag old → new`` strings (empty if the folder holds no config). ``--data`` is left to
    :func:`data_changes`, which compares the data by content, where the run recorded its data's
    identity; for a run of an older adahop it is compared as the prepared folder it names. ``--calib-steps``
    is compared as the steps that run (none given: the preset's own), and not for a recipe without calibration.
    ``definition``: also compare the recipe's definition (its GEMM specs, calibration...) with the one the
    run recorded, where the names agree: a preset changed by a newer adahop trains other numbers under
    the same name.

    Raises:
        ValueError: ``run/config.json`` is not valid JSON, or ``cfg.data`` names a missing path.
    """
    from .export import model_config_file, read_run_section

    if (section := read_run_section(run)) is None:
        return []
    saved, now = section.get("config", {}), cfg.to_dict()
    diff = []
    for k in keys:
        if k == "model_config" and now.get(k) and saved.get(k) == now[k] and "model_config_file" in section:
            old, new = section["model_config_file"], model_config_file(now[k])  # the same path: the same file?
            if old != new:
                old, new = old or {}, new or {}
                changed = [f"{c} {old.get(c)!r} → {new.get(c)!r}" for c in sorted(set(old) | set(new), key=str)
                           if old.get(c) != new.get(c)]
                diff.append(f"--model-config {now[k]!r} was edited since the run ({', '.join(changed[:4]) or 'unreadable'}"
                            f"{', ...' if len(changed) > 4 else ''})")
            continue
        if k not in saved or saved[k] == now.get(k):
            continue
        if k == "calib_steps":  # none under a recipe without calibration (train warns so), else the preset's own
            cal = get_recipe(cfg.recipe).calibration
            if cal is None or (saved[k] or cal.steps) == (now.get(k) or cal.steps):
                continue
        if k == "data_seed" and (data_order_seed(saved.get("seed"), saved["data_seed"])
                                 == data_order_seed(now.get("seed"), now.get("data_seed"))):  # --data-seed 0 on a run of --seed 0
            continue
        if k == "data" and ("data_identity" in section or
                            "data_dir" in section and _same_path(section["data_dir"], prepared_path(cfg))):
            continue
        diff.append(f"--{k.replace('_', '-')} {saved[k]!r} → {now.get(k)!r}")
    if definition and section.get("recipe") and saved.get("recipe") == cfg.recipe:
        # today's preset under the run's own --calib-steps: a changed flag is reported above as the flag, not as
        # a definition that changed (which points at another adahop version)
        as_run = dataclasses.replace(cfg, calib_steps=saved["calib_steps"]) if "calib_steps" in saved else cfg
        old, new = (_DESCRIPTION.sub("", r) for r in (section["recipe"], repr(_configured_recipe(as_run))))
        old, new = _without_added_defaults(old, new)
        if old != new:  # the description's words change no number
            diff.append(f"the {cfg.recipe} recipe's definition changed since the run ({_repr_changes(old, new)}; "
                        f"an adahop of another version?)")
    return diff


_DESCRIPTION = re.compile(r"description=(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"), ")


#: Recipe fields an earlier adahop had, at the value that ran the numbers today's Recipe runs without them
#: (``dual_layout``: the @dual-layout read, removed when it timed slower than the separate calls on an H100).
_REMOVED_FIELDS = {"dual_layout": False}


def _without_added_defaults(old: str, new: str) -> tuple[str, str]:
    """The run's recorded :class:`~adahop.recipes.Recipe` repr ``old`` and today's ``new``, each without the
    ``, field=default`` items of a field the other adahop lacks: one added since the run (``saved_operands``),
    absent from ``old``, or one removed since (:data:`_REMOVED_FIELDS`), absent from ``new``. At its default
    such a field runs the numbers the other adahop runs, so an earlier run stays resumable and reusable; a
    removed field at another value stays in ``old`` (a change)."""
    for f in dataclasses.fields(Recipe):
        if f.default is not dataclasses.MISSING and f"{f.name}=" not in old:
            new = new.replace(f", {f.name}={f.default!r}", "")
    for name, default in _REMOVED_FIELDS.items():
        old = old.replace(f", {name}={default!r}", "")
    return old, new


def _repr_changes(old: str, new: str, most: int = 3) -> str:
    """The ``field=value`` items of two dataclass reprs that differ, as ``old → new`` strings (at most ``most``)."""
    split = lambda r: [t for t in re.split(r"[(),]\s*", r) if "=" in t]  # noqa: E731
    a, b = split(old), split(new)
    gone, came = [t for t in a if t not in b], [t for t in b if t not in a]
    pairs = [f"{g} → {c}" for g, c in zip(gone, came)] + gone[len(came):] + [f"→ {c}" for c in came[len(gone):]]
    return ", ".join(pairs[:most]) + (", ..." if len(pairs) > most else "") if pairs else "their order"


def data_order_seed(seed: int | None, data_seed: int | None) -> int | None:
    """The seed of the training data order: ``--data-seed``, else ``--seed``."""
    return seed if data_seed is None else data_seed


def _same_path(a, b) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def data_changes(cfg: TrainConfig, run: Path) -> tuple[list[str], str]:
    """How the data ``cfg.data`` gives now differs from the data the run in ``run`` trained on
    (:func:`adahop.data.identity.identity_changes` of the identity recorded in its config.json and
    the current one: the sources' sha256 and size, the tokenizer's vocabulary, the split settings),
    and a hint how to fix it. Nothing is prepared to find out: data not prepared yet is compared
    by its planned identity. Empty when the folder holds no config, or a config of an adahop that
    recorded neither identity nor a prepared folder that still exists.

    Raises:
        ValueError: ``run/config.json`` is not valid JSON, or ``cfg.data`` names a missing path.
    """
    from .export import read_run_section

    if (section := read_run_section(run)) is None:
        return [], ""
    old, kept = section.get("data_identity"), section.get("data_dir")
    kept_ok = kept is not None and (Path(kept) / "manifest.json").is_file()
    if old is None:  # a run of an adahop before data identities: its prepared folder tells, if still there
        if not kept_ok:
            return [], ""
        old = manifest_identity(Manifest.load(kept))
    changes = identity_changes(old, _data_identity(cfg))
    if kept_ok and not identity_changes(old, manifest_identity(Manifest.load(kept))):
        fix = f"pass --data {kept} (the run's prepared data, still there)"
    else:
        fix = "pass the run's own --data, --val-fraction and --tokenizer with its source files as they were"
    return changes, fix


def prepared_data_changes(run: Path, data_dir: Path) -> list[str]:
    """How the prepared data in ``data_dir`` differs from the data the run in ``run`` recorded (empty when it
    recorded no identity). Run once the data is prepared: then a ``hf:`` dataset's content and a trained BPE's
    vocabulary are known, which :func:`data_changes` could only compare by name or not at all (a resume from
    the raw text of a run trained on its prepared folder trained a new 8192-id BPE, and the checkpoint was then
    reported damaged).

    Raises:
        ValueError: ``run/config.json`` or ``data_dir/manifest.json`` is not valid JSON."""
    from .export import read_run_section

    old = (read_run_section(run) or {}).get("data_identity")
    return [] if old is None else identity_changes(old, manifest_identity(Manifest.load(data_dir)))


def _data_identity(cfg: TrainConfig) -> dict:
    """The identity of the data ``cfg.data`` gives now, without preparing it."""
    p = Path(cfg.data)
    if p.is_dir() and (p / "manifest.json").exists():
        return manifest_identity(Manifest.load(p))
    folder, planned = cached_path(_sources(cfg), tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                                  val_fraction=cfg.val_fraction)
    return manifest_identity(Manifest.load(folder)) if (folder / "manifest.json").is_file() else planned


def _refuse_foreign_out(run: Path) -> None:
    """Raise ValueError when ``--out`` (with no checkpoint) holds what a new run would overwrite: prepared data,
    an exported model or finished run (``model.safetensors``), or another model's ``config.json``. A start of a
    run that died before its first checkpoint (its own config.json, no weights) may be started again."""
    from .export import read_run_section

    if (run / "manifest.json").exists():
        raise ValueError(f"--out {run} is a prepared data folder (manifest.json), which the run would write into; "
                         f"pass it as --data and choose a new --out")
    if (run / "model.safetensors").exists():
        raise ValueError(f"--out {run} holds a model (model.safetensors) and no checkpoint to resume; the run would "
                         f"overwrite it. Choose a new --out (or delete the folder)")
    if (run / "config.json").is_file() and not read_run_section(run):
        raise ValueError(f"--out {run} holds another model's config.json, which the run would overwrite; choose a new --out")


def check_run_dir(cfg: TrainConfig, run: Path) -> int | None:
    """Check ``--out`` against ``--resume`` before anything is built; return the checkpoint step
    to resume from, or None to start at step 0.

    Raises:
        ValueError: an ``--out`` that cannot be created or written, or that holds data, a model or a finished
            run and no checkpoint (:func:`_refuse_foreign_out`); checkpoints of an earlier run
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
    ck = latest_checkpoint(run)
    if ck is None:
        _refuse_foreign_out(run)
        if cfg.resume:
            print(f"--resume: no checkpoint in {run / 'checkpoints'}; starting at step 0")
        _clear_error(run)
        return None
    step = int(ck.name.split("_")[1])
    if not cfg.resume:
        raise ValueError(f"--out {run} holds checkpoints of an earlier run (up to step {step}); pass --resume to "
                         f"continue that run, or choose a new --out (or delete the folder)")
    diff = settings_diff(cfg, run, RESUME_KEYS, definition=True)
    if diff:
        raise ValueError(f"--resume: these settings differ from the checkpointed run in {run}: {'; '.join(diff)}. "
                         f"Resume with the run's own settings, or start a new run with a new --out")
    changes, fix = data_changes(cfg, run)
    if changes:
        raise ValueError(f"--resume: the data differs from the checkpointed run's in {run}: {'; '.join(changes)}. "
                         f"To fix: {fix}; or start a new run with a new --out")
    if cfg.steps < step or (cfg.steps == step and (run / "model.safetensors").exists()):
        raise ValueError(f"--resume: the run in {run} is already at step {step}; pass --steps above {step} to train further")
    toggled = settings_diff(cfg, run, ("compile",))
    if toggled:  # allowed (an eager run may finish compiled), but then it is not the uninterrupted run to the bit
        if get_recipe(cfg.recipe).draws_random_bits:  # compiled layers draw from another stream (seed_compiled_rng)
            why = (f"recipe {cfg.recipe} draws random bits (stochastic rounding or random signs), and compiled layers "
                   "draw them from another stream than eager ones (adahop.nn.seed_compiled_rng), so the resumed run is "
                   "another sample of the recipe, not an uninterrupted one to float rounding")
        else:
            why = ("compiled and eager steps agree to float rounding, not bit for bit (Inductor fuses reductions, and a "
                   "quantizer's rounding can flip on such a difference), so the resumed run will not equal an "
                   "uninterrupted one exactly")
        print(f"warning: --resume with {toggled[0]}: {why}", file=sys.stderr)
    _clear_error(run)
    return step  # == --steps: the run ended before its export was written; resuming writes it


def _clear_error(run: Path) -> None:
    """Remove an earlier attempt's error.txt once this one is accepted (rank 0 alone: another rank, started
    late, removed an early failure's)."""
    if os.environ.get("RANK", "0") == "0":
        (run / ERROR_FILE).unlink(missing_ok=True)


def resolve_device(spec: str) -> torch.device:
    """'auto' → cuda if available else cpu. Raises ValueError for cuda without a GPU, or a string that
    names no device (e.g. 'tpu')."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible; use --device cpu")
    try:
        return torch.device(spec)
    except RuntimeError:  # torch's message lists every device type it knows: name ours instead
        raise ValueError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None


def prepared_path(cfg: TrainConfig) -> Path:
    """The prepared data folder ``cfg.data`` names, without preparing it: ``cfg.data`` itself when it
    holds manifest.json, otherwise a cache folder keyed by the sources' content and the settings
    (:func:`adahop.data.cache.cached_path`).

    Raises:
        ValueError: empty ``--data`` or a source path that does not exist.
    """
    p = Path(cfg.data)
    if p.is_dir() and (p / "manifest.json").exists():
        return p
    return cached_path(_sources(cfg), tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                       val_fraction=cfg.val_fraction)[0]


def _sources(cfg: TrainConfig) -> list[str]:
    """The ``--data`` sources, once each exists (ValueError naming the first that does not)."""
    sources = [s for s in cfg.data.split(",") if s]
    if not sources:
        raise ValueError("--data is empty; pass 'default', a prepared folder or text files")
    for s in sources:
        if s != "default" and not s.startswith("hf:") and not Path(s).exists():
            raise ValueError(f"--data: {s!r} does not exist; pass 'default', a folder made by "
                             "`adahop data prepare`, or text files (.txt, .jsonl, .parquet, .xz, .gz, .zst)")
    return sources


def _check_tokenizer_file(data: Path, manifest: Manifest) -> None:
    """Raise ValueError when the prepared folder's tokenizer is no longer the one its tokens were made with
    (``manifest.json``'s fingerprint): the run would export a tokenizer whose ids are not the model's."""
    from ..data.tokenizer import load_tokenizer

    info = manifest.tokenizer
    if info.sha256 is None:  # format 1: no fingerprint recorded
        return
    try:
        now = load_tokenizer(info.spec, base_dir=data).fingerprint()
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {data}: its tokenizer ({info.spec}) cannot be loaded ({e}); prepare the data again "
                         f"(adahop data prepare ... --out {data} --overwrite)") from None
    if now != info.sha256:
        raise ValueError(f"--data {data}: its tokenizer ({info.spec}) has another vocabulary or merges than the tokens were made with (fingerprint "
                         f"{now[:12]}, manifest.json {info.sha256[:12]}); prepare the data again "
                         f"(adahop data prepare ... --out {data} --overwrite) or restore the tokenizer file")


def _refuse_preparing_flags(cfg: TrainConfig, manifest: Manifest) -> None:
    """Raise ValueError when --tokenizer, --vocab-size or --val-fraction was set away from its default to a
    value the prepared folder was not made with: those flags only prepare text, so they would be ignored
    here, yet config.json would record them (and a later resume or compare would trust the record)."""
    defaults, tok = TrainConfig(), manifest.tokenizer
    wrong = []
    if cfg.val_fraction != defaults.val_fraction and cfg.val_fraction != manifest.val_fraction:
        wrong.append(f"--val-fraction {cfg.val_fraction} (it was made with {manifest.val_fraction})")
    if cfg.tokenizer != defaults.tokenizer and cfg.tokenizer != tok.name and not _same_tokenizer(cfg.tokenizer, tok):
        wrong.append(f"--tokenizer {cfg.tokenizer} (it was made with {tok.name})")
    # the manifest holds the vocabulary trained, which a small corpus keeps below the size asked for: only fewer
    # ids than the folder's are surely another tokenizer
    if cfg.vocab_size != defaults.vocab_size and (tok.name != "bpe" or cfg.vocab_size < tok.vocab_size):
        wrong.append(f"--vocab-size {cfg.vocab_size} (it was made with {tok.vocab_size} ids by --tokenizer {tok.name})")
    if wrong:
        raise ValueError(f"--data {cfg.data} is a prepared folder, whose tokens are fixed; {', '.join(wrong)} "
                         f"would be ignored. To fix: drop the flag, or prepare the text again with it "
                         f"(adahop data prepare --source ... --out NEW_FOLDER)")


def _same_tokenizer(spec: str, info) -> bool:
    """Whether ``spec`` loads the tokenizer ``info`` describes (the same vocabulary and merges), e.g. one file
    spelled two ways; False when it cannot be loaded here or ``info`` has no fingerprint."""
    from ..data.tokenizer import load_tokenizer

    try:
        return info.sha256 is not None and load_tokenizer(spec).fingerprint() == info.sha256
    except Exception:  # noqa: BLE001 - a spec this machine cannot load is not shown to be the same
        return False


def resolve_data(cfg: TrainConfig) -> Path:
    """The prepared data folder for ``cfg.data`` (:func:`prepared_path`), prepared once if missing
    (safe when several runs need it at once). A prepared folder given as ``--data`` is refused when
    a source it was made from has changed since (checked where the file is still found).

    Raises:
        ValueError: a source missing or changed (named, with the fix), or as :func:`adahop.data.prepare`.
    """
    p = Path(cfg.data)
    if p.is_dir() and (p / "manifest.json").exists():
        manifest = Manifest.load(p)
        changed = [] if is_cached(p) else changed_sources(manifest)  # a cache entry is its content
        if changed:
            raise ValueError(f"--data {p}: the files it was prepared from have changed since: {'; '.join(changed)}. "
                             f"Its tokens are of the old text. To fix: prepare it again (adahop data prepare "
                             f"--source ... --out {p}), pass the changed files themselves as --data (prepared once "
                             f"per content), or restore them")
        _check_tokenizer_file(p, manifest)
        _refuse_preparing_flags(cfg, manifest)
        return p
    if cfg.tokenizer != "bpe" and cfg.vocab_size != TrainConfig.vocab_size:  # as `adahop data prepare` refuses it
        raise ValueError(f"--vocab-size {cfg.vocab_size} is for --tokenizer bpe; --tokenizer {cfg.tokenizer} brings its "
                         "own vocabulary (the run would record the one given and name its cache after it): drop --vocab-size")
    return prepare_cached(_sources(cfg), tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                          val_fraction=cfg.val_fraction)


def make_streams(cfg: TrainConfig, data_dir: Path, rank: int = 0, world: int = 1,
                 val: bool = True) -> tuple[TokenStream, TokenStream | None]:
    """Train and validation streams; each rank reads ``batch_size / world`` sequences per step. ``val=False``:
    no validation stream (None), for a caller that never validates (``adahop analyze``), so that a val split
    shorter than one window is no error there."""
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by world size {world} x --grad-accum {cfg.grad_accum}")
    per_rank = cfg.batch_size // world
    train = TokenStream(data_dir, "train", cfg.seq_len, per_rank, seed=data_order_seed(cfg.seed, cfg.data_seed), rank=rank,
                        world_size=world)
    if not val:
        return train, None
    return train, TokenStream(data_dir, "val", cfg.seq_len, per_rank, seed=cfg.seed, rank=rank, world_size=world)


def check_data_fits(cfg: TrainConfig, train: TokenStream, val: TokenStream) -> None:
    """Refuse data too small for the run before any step: a training split holding less than one
    batch of windows (each batch would repeat windows), or with ``--eval-every`` a validation split
    holding fewer than ``--eval-batches`` batches (found at the first evaluation otherwise, with the
    steps before it lost).

    Raises:
        ValueError: naming the flags that fix it.
    """
    batch = cfg.batch_size  # all ranks together: the stream's windows are shared out among them
    if train.n_windows < batch:
        raise ValueError(f"--data: the training split holds {train.n_windows} windows of --seq-len + 1 = {cfg.seq_len + 1} "
                         f"tokens ({train.info.tokens:,} tokens), fewer than one batch of --batch-size {batch}; lower "
                         f"--batch-size or --seq-len, or pass more data")
    if cfg.eval_every and val.steps_per_epoch < cfg.eval_batches:
        fit = f"pass --eval-batches {val.steps_per_epoch} or fewer, " if val.steps_per_epoch else ""
        raise ValueError(f"--eval-batches {cfg.eval_batches}: the validation split holds {val.n_windows} windows of "
                         f"--seq-len + 1 = {cfg.seq_len + 1} tokens ({val.info.tokens:,} tokens), "
                         f"{val.steps_per_epoch} batch(es) of --batch-size {batch}; {fit}lower --batch-size or "
                         f"--seq-len, prepare the data with a larger --val-fraction, or pass --eval-every 0")


def epochs_of(cfg: TrainConfig, train: TokenStream) -> float:
    """Passes over the training split's windows that ``--steps`` batches of ``--batch-size`` make."""
    return cfg.steps * cfg.batch_size / train.n_windows


def converted_layers(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """(the converted layers that run the recipe's GEMMs, {layer: why it runs BF16} for the others)
    of a model converted by :func:`adahop.convert_model`; both empty for the ``bf16`` recipe."""
    from ..nn import get_controller

    ctrl = get_controller(model)
    if ctrl.recipe.is_bf16:
        return [], {}
    odd = set(ctrl.unquantizable)
    run = [m.name for m in ctrl.layers if not m.force_bf16]
    rest = {m.name: (f"shape {m.in_features}->{m.out_features}" if m.name in odd else "in a BF16 block of the recipe")
            for m in ctrl.layers if m.force_bf16}
    return run, rest


def loss_ceiling(vocab: int, first_loss: float) -> float:
    """The training loss above which a run counts as diverged: ``2 · max(ln vocab, first_loss)``.

    ``ln vocab`` is the loss of a uniform guess over the vocabulary; a freshly initialized model
    starts near it (``first_loss``, the first step's loss, may be a little above) and a learning
    run only goes down from there, spikes included. Twice that is a model confidently wrong about
    every token: what a blown-up run looks like (``--lr 10`` on llama-tiny with a 512-token BPE:
    917 nats at the second step).
    """
    return 2 * max(math.log(vocab), first_loss)


def _short_run_note(cfg: TrainConfig, schedule_steps: int) -> str:
    """A warning line when the warm-up does not end before the run does: the lr never reaches --lr."""
    if cfg.warmup_steps < schedule_steps:
        return ""
    peak = lr_at(cfg, schedule_steps - 1, schedule_steps)
    what = (f"the lr reaches --lr {cfg.lr:g} only at the last step and never decays" if peak >= cfg.lr else
            f"the lr peaks at {peak:g}, never --lr {cfg.lr:g}")
    return (f"\n  warning         --warmup-steps {cfg.warmup_steps} >= the schedule's {schedule_steps} steps: {what}; pass a "
            f"--warmup-steps below {schedule_steps} (e.g. {schedule_steps // 10})")


def startup_summary(cfg: TrainConfig, model: torch.nn.Module, recipe, train: TokenStream, val: TokenStream,
                    start: int, schedule_steps: int) -> str:
    """What the run is about to do, printed before its first step: model and recipe, parameters
    (total, and in the layers that run the recipe's GEMMs), the layers left BF16, data, tokens per
    step, epochs, and the recipe's GEMM table (``adahop recipes``)."""
    run, rest = converted_layers(model)
    mods = dict(model.named_modules())
    total = sum(p.numel() for p in model.parameters())
    conv = sum(p.numel() for n in run for p in mods[n].parameters())
    per_step = cfg.batch_size * cfg.seq_len
    where = f"resuming at step {start} of {cfg.steps}" if start else f"{cfg.steps} steps"
    lines = [f"adahop train: {cfg.model_config or cfg.model}, recipe {recipe.name}, {where}, into {cfg.out}",
             f"  parameters      {total:,} total; " + ("every GEMM runs in BF16" if recipe.is_bf16 else
             f"{conv:,} ({100 * conv / total:.1f}%) in the {len(run)} linear layers that run {recipe.name}'s GEMMs "
             f"(the LM head, embeddings and norms stay BF16)")]
    if rest:
        lines.append(f"  BF16 layers     {len(rest)} converted layers run BF16 GEMMs: "
                     + ", ".join(f"{n} ({why})" for n, why in rest.items()))
    lines += [f"  data            {train.info.tokens:,} training tokens, {val.info.tokens:,} validation tokens ({train.data_dir})",
              f"  tokens per step {per_step:,} (--batch-size {cfg.batch_size} x --seq-len {cfg.seq_len}); "
              f"{cfg.steps * per_step:,} tokens in all = {epochs_of(cfg, train):.2f} epochs over the training split",
              f"  lr schedule     warm-up {cfg.warmup_steps} steps, cosine decay toward {cfg.min_lr_ratio:g} x --lr {cfg.lr:g} "
              f"over {schedule_steps} steps (its last step runs at lr {lr_at(cfg, cfg.steps - 1, schedule_steps):.3g})"
              + _short_run_note(cfg, schedule_steps),
              f"  GEMMs of {recipe.name}:"]
    lines += ["    " + line for line in _gemm_lines(cfg, recipe)]
    return "\n".join(lines + _run_notes(cfg, recipe))


def _gemm_lines(cfg: TrainConfig, recipe: Recipe) -> list[str]:
    """The recipe's GEMM table (:func:`adahop.recipes.table.gemm_table`) as the start-up printout shows it: with a
    given plan no calibration runs (:func:`_run_notes` says so), so the table's calibration line is left out."""
    from ..recipes.table import gemm_table

    table = gemm_table(recipe).splitlines()
    return [line for line in table if not line.startswith("calibration:")] if cfg.plan else table


def _run_notes(cfg: TrainConfig, recipe=None) -> list[str]:
    """Start-up lines about this run's settings that the recipe's table cannot show: --calib-steps
    with a ``recipe`` that has no calibration (it does nothing), a given plan (no calibration runs,
    whatever the table's calibration note says) and packed master weights under round to nearest
    (which lose every update below half a step of their format)."""
    notes = []
    if cfg.calib_steps is not None and recipe is not None and recipe.calibration is None:
        # a warning, not an error: launchers pass one --calib-steps to every recipe of a comparison
        notes.append(f"  warning         --calib-steps {cfg.calib_steps} does nothing: recipe {recipe.name} has no AdaHOP "
                     "calibration (its GEMM strategies are fixed); drop --calib-steps, or use a calibrating recipe "
                     "such as adahop-lv2")
    if cfg.plan:
        notes.append(f"  plan            frozen from {cfg.plan}: no calibration runs; the 'calibrated' GEMMs take their "
                     "strategies from it")
    if cfg.master_weights in PACKED_FORMATS and resolved_rounding(cfg.optimizer, cfg.master_rounding) == "nearest":
        notes.append(f"  warning         --master-weights {cfg.master_weights} with round to nearest: updates below half a "
                     "step of the format are lost (docs/results.md: an FP4 master stalled at 6.69, FP8 ended 5.8% behind); "
                     "pass --master-rounding stochastic")
    return notes


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


def _configured_recipe(cfg: TrainConfig):
    """``--recipe`` with ``--calib-steps`` applied: the recipe a run trains (and records in config.json).
    Raises ValueError for an unknown name (:func:`adahop.get_recipe`)."""
    recipe = get_recipe(cfg.recipe)
    if cfg.calib_steps is not None and recipe.calibration is not None:
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, steps=cfg.calib_steps))
    return recipe


def resolve_recipe(cfg: TrainConfig):
    """The recipe with --calib-steps applied (:func:`_configured_recipe`), and the plan from --plan (or None)."""
    recipe = _configured_recipe(cfg)
    plan = None
    if cfg.plan:
        if not Path(cfg.plan).exists():
            raise ValueError(f"--plan {cfg.plan}: no such file")
        if Path(cfg.plan).is_dir():
            hint = Path(cfg.plan) / "plan.json"
            raise ValueError(f"--plan {cfg.plan} is a folder; pass the plan file itself"
                             + (f" (--plan {hint})" if hint.exists() else " (a plan.json of a run, a checkpoint or analyze)"))
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
                 mul_lr_scale=cfg.madam_mul_lr, rounding=cfg.master_rounding, seed=cfg.seed if seed is None else seed,
                 backend=cfg.backend)


def lr_at(cfg: TrainConfig, step: int, total: int | None = None) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr-ratio · --lr at step ``total`` (default
    --steps; a resumed run keeps its original run's), and that final lr after it."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, (total or cfg.steps) - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
