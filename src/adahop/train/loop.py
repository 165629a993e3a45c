"""`adahop train`: pretraining from scratch with a recipe, read top to bottom in the order a step
happens (nanoGPT): lr, forward/backward with accumulation, clip, step, hook, log, eval, checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..kernels import resolve_backend
from ..compile_modes import CALIBRATION_MODE, dynamo_counts, frozen_mode, mark_step
from ..nn import convert_model, get_controller, on_step, saved_bytes, seed_compiled_rng
from ..nn.recompute import calibrates_under_recompute, selective_recompute, undo_selective_recompute
from ..optim import convert_master_weights, memory_bytes
from ..utils import first_nonfinite, folder_locked, out_of_memory_error
from . import distributed as dp
from .checkpoint import complete_checkpoints, latest_checkpoint, save_checkpoint
from .config import TrainConfig
from .export import save_hf_tokenizer, write_config
from .metrics import Metrics, peak_memory, reset_peak_memory
from .setup import (build_optimizer, check_data_fits, check_run_dir, converted_layers, epochs_of, loss_ceiling, lr_at,
                    make_model, make_streams, prepared_data_changes, resolve_data, resolve_device, resolve_recipe,
                    startup_summary)

__all__ = ["train", "Diverged", "OutOfGPUMemory", "evaluate"]


class Diverged(RuntimeError):
    """The loss became NaN or Inf, or rose above :func:`~adahop.train.setup.loss_ceiling`; the run
    stopped and kept its last good checkpoint."""


class OutOfGPUMemory(torch.OutOfMemoryError):
    """The GPU ran out of memory during training (a ``torch.OutOfMemoryError``, so callers that catch torch's still
    do); the message says whether the plan was calibrating, what takes less memory, and which checkpoint is kept
    (the run's earlier checkpoints are untouched)."""


def _oom_message(cfg: TrainConfig, recipe, run: Path, world: int, oom: BaseException,
                 calib_recompute: bool = False) -> str:
    """What :class:`OutOfGPUMemory` says: the first line of ``oom`` (torch's error in the chain,
    :func:`adahop.utils.out_of_memory_error`), whether the plan was still calibrating (its train steps run eagerly
    in BF16, so at a size where the compiled steps fit they may not: round 34, docs/benchmarks.md), the options that
    take less memory and that train accepts, and the last checkpoint. ``calib_recompute``: the calibration steps
    were running under selective recompute (:func:`_recompute_calibration`)."""
    first = str(oom).strip().splitlines()[0] if str(oom).strip() else type(oom).__name__
    calibrating = recipe.calibration is not None and cfg.plan is None and not (run / "plan.json").exists()
    phase = f" during {recipe.name}'s calibration" if calibrating else ""
    recomputed = cfg.recompute or (calibrating and calib_recompute)
    why = ((" Its train steps run eagerly in BF16 under selective recompute, also under --compile." if recomputed else
            " Its train steps run eagerly in BF16, also under --compile, and need more memory than the compiled steps "
            "after it.") if calibrating else "")
    fixes = [] if recomputed else ["--recompute (selective activation recompute: at Llama-3.2-1B 4096 x 8 it took "
                                   "the peak to 0.74x of BF16's)"]
    # --batch-size is the step's batch, split over the ranks and then into --grad-accum micro-batches
    more = next((g for g in range(cfg.grad_accum + 1, cfg.batch_size // world + 1) if cfg.batch_size % (world * g) == 0),
                None)
    fixes.append(f"--grad-accum {more} (micro-batches of {cfg.batch_size // (world * more)} sequences a rank, the same "
                 f"{cfg.batch_size} a step; a new run)" if more else "a shorter --seq-len (a new run)")
    if not cfg.compile and not calibrating:
        fixes.append("--compile (Inductor's graphs keep less for backward)")
    ckpts = complete_checkpoints(run)
    can_add = " and ".join(f for f, on in (("--recompute", recomputed), ("--compile", cfg.compile)) if not on)
    kept = (f"The checkpoint of step {int(ckpts[-1].name.removeprefix('step_'))} is kept: `adahop train --out {run} "
            f"--resume` goes on from it{f' (and may add {can_add})' if can_add else ''}." if ckpts
            else "No checkpoint had been written yet.")
    return f"out of GPU memory{phase} ({first}).{why} To fit, try {'; or '.join(fixes)}. {kept}"


def _recompute_calibration(cfg: TrainConfig, device: torch.device, model) -> bool:
    """Whether this run's calibration steps run under selective recompute though ``--recompute`` is off: in one
    process, where :func:`adahop.nn.recompute.calibrates_under_recompute` says so (a GPU; not for a model without
    transformers' gradient checkpointing, such as jetmoe or gpt_neox_japanese: they train as before)."""
    return not cfg.recompute and cfg.parallel == "none" and calibrates_under_recompute(model, device)


def _kept(run: Path, step: int, first_bad: torch.Tensor, is_main: bool, start: int) -> str:
    """What a diverged run leaves behind, as the message says it. The loss of step ``first_bad`` (the first
    non-finite or too-high loss) comes from the weights after step ``first_bad − 1``: when that is ``step``,
    the last checkpoint saved holds the weights that diverged, and a resume would diverge again; it is moved
    aside (``checkpoints/diverged_step_*``, which resume skips) and the one before it is the last good one.
    Not the checkpoint this process resumed from (``start``): its next step was fine in the run that wrote it."""
    ckpts = run / "checkpoints"
    note = ""
    first = dp.min_over_ranks(int(first_bad) or 2**62)  # the earliest bad step on any rank (0 on a rank: none)
    bad = ckpts / f"step_{step:07d}"
    if step and step != start and first == step + 1 and bad.exists():
        aside, n = ckpts / f"diverged_{bad.name}", 1
        while aside.exists():  # a resume that diverged again at the same step
            aside, n = ckpts / f"diverged_{bad.name}.{n}", n + 1
        if is_main:
            bad.rename(aside)
        note = f"The checkpoint of step {step} holds the weights whose next loss diverged: moved aside to {aside}. "
        older = [p for p in complete_checkpoints(run) if p.name != bad.name]  # other ranks may still see it
        step = int(older[-1].name.removeprefix("step_")) if older else 0
    if step and ckpts.exists():
        return note + f"The last good checkpoint (step {step}) is kept in {ckpts}."
    if first <= 2:  # step 1's checkpoint is followed by the bad step 2: no checkpoint can be good
        return note + (f"No good checkpoint can exist: the first bad loss was step {first}'s, so only the initial "
                       "weights are good; no --ckpt-every helps, a lower --lr (or longer --warmup-steps) does.")
    if first < 2**62:  # a checkpoint is good when its next step (s + 1) is before the first bad one
        return note + (f"No good checkpoint is kept: the first bad loss was step {first}'s, so only a checkpoint of step "
                       f"{first - 2} or earlier is good; set --ckpt-every below {max(first - 1, 2)} and --keep-ckpts 2 or more.")
    return note + "No good checkpoint is kept (set --ckpt-every below the step it diverged at, and --keep-ckpts 2 or more)."


def _check_diverged(bad: torch.Tensor, dead: torch.Tensor, peak_loss: torch.Tensor, ceiling: float, vocab: int, done: int,
                    bar, kept) -> None:
    """Raise Diverged when, on any rank, a step's loss or gradient norm was non-finite (``bad``), its gradient norm
    exactly 0 (``dead``: weights blown up until every prediction is flat, loss ln V, which the ceiling does not
    catch), or its loss rose above the ceiling (host syncs); ``kept()`` says what the run leaves behind (:func:`_kept`)."""
    retry = "Start again with a lower --lr in a new --out (resuming keeps the run's saved --lr), or use a safer recipe."
    if dp.any_rank(bad):
        bar.close()
        raise Diverged(f"loss or gradient norm became non-finite at or before step {done}; stopped. {kept()} {retry}")
    if dp.any_rank(dead):
        bar.close()
        raise Diverged(f"the gradient norm was exactly 0 at or before step {done}: the model no longer learns (its weights "
                       f"blew up until every prediction is flat); stopped. {kept()} {retry}")
    if dp.any_rank(peak_loss > ceiling):
        peak = peak_loss.item()
        bar.close()
        raise Diverged(f"the training loss rose {f'to {peak:.4g} ' if peak > ceiling else ''}at or before step {done}, "
                       f"above {ceiling:.3g} "
                       f"(2 x the larger of ln(vocab {vocab}) = {math.log(vocab):.3g} and the first step's loss): the run "
                       f"diverged; stopped. {kept()} {retry}")


def _plan_frozen(model) -> bool | None:
    """True once the model's AdaHOP plan is frozen (or was given), False while it still calibrates,
    None for a recipe without calibration."""
    try:
        ctrl = get_controller(model)
    except ValueError:  # a BF16 run: nothing converted
        return None
    return None if ctrl.recipe.calibration is None else ctrl.plan is not None


def _graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process (it counts each when it compiles a frame)."""
    return dynamo_counts()["graph_breaks"]


@torch.no_grad()
def evaluate(model, val, device, autocast, max_batches: int, micro: int = 1) -> tuple[float, float]:
    """Mean validation loss (nats/token) over ``max_batches`` fixed batches, and bits per byte.

    ``micro``: forward each batch as this many equal slices (``--grad-accum``'s micro-batches: a whole batch
    in one forward set the run's peak memory, and ran out of memory where only the micro-batch fits); each
    slice holds as many tokens, so the mean of their means is the batch's."""
    model.eval()
    total, n = 0.0, 0
    for x, y in val.val_batches(max_batches):
        part = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with autocast:
                logits = model(input_ids=xs.to(device), use_cache=False).logits
            part += F.cross_entropy(logits.float().flatten(0, 1), ys.to(device).flatten()).item()
        total += part / micro
        n += 1
    model.train()
    loss = total / max(n, 1)
    return loss, val.bits_per_byte(loss, max_batches)


def train(cfg: TrainConfig, *, rank: int = 0, world: int = 1) -> dict:
    """Run (or resume) one training run; returns its summary (also written to summary.json).

    ``rank`` / ``world``: this process among ``world`` data-parallel processes (``torchrun``, with
    the process group joined by :func:`adahop.train.distributed.init_from_env`). Every rank runs
    this function; rank 0 alone writes files and shows progress, and holds a lock on ``--out`` for
    the run's duration (``<out>/.lock``), so that a second run into the same folder is refused.

    Ctrl-C (SIGINT) or SIGTERM (``timeout``, SLURM's preemption, ``docker stop``) stops the run at the end of
    the step, with a checkpoint (``summary["interrupted"]``); a second one aborts at once (KeyboardInterrupt),
    keeping the last complete checkpoint.

    Raises:
        ValueError: a bad option, data too small for the run, a recipe that converts no layer of the
            model, or ``--out`` in use by another run, before any training starts.
        Diverged: non-finite loss or gradient norm, or a loss above :func:`~adahop.train.setup.loss_ceiling`.
        OutOfGPUMemory: the GPU ran out of memory (torch's OutOfMemoryError, with what to change).
        CheckpointWriteError: a checkpoint could not be written (disk full, I/O error).
    """
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with folder_locked(Path(cfg.out), take=rank == 0):  # released also when the run fails
        live = {}  # what the run does now: calib_recompute (its calibration steps under recompute), for the OOM message
        try:
            return _train(cfg, rank, world, live)
        except Exception as e:
            if isinstance(e, OutOfGPUMemory) or (oom := out_of_memory_error(e)) is None:
                raise
            raise OutOfGPUMemory(_oom_message(cfg, resolve_recipe(cfg)[0], Path(cfg.out), world, oom,
                                              live.get("calib_recompute", False))) from e
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)


def _on_sigint(stop: dict):
    """SIGINT and SIGTERM handler: the first stops the run after the step (with a checkpoint), the second aborts.

    It sets only ``stop["asked"]``; the loop alone sets ``stop["now"]``, the stop step all ranks agreed on (an
    all-reduce of ``asked`` once per step). The handler set ``now`` itself until 2026-12-06: a signal that
    landed while a rank waited in that all-reduce was overwritten by its result (the run went on to its last
    step, exit 0), and one that landed after it (logging, validation, a checkpoint write) sent that rank alone
    into the checkpoint and out of the loop while the others trained on: a hang or a crash, no checkpoint."""
    def handler(signum, frame):
        if stop["asked"]:  # waiting for a long step to end is what the user refuses now
            raise KeyboardInterrupt
        stop["asked"] = True
        name, again = (b"Ctrl-C", b"Ctrl-C again") if signum == signal.SIGINT else (b"SIGTERM", b"a second SIGTERM or a Ctrl-C")
        os.write(2, b"\n" + name + b": stopping after this step and writing a checkpoint; " + again + b" aborts at "
                    b"once (the last complete checkpoint stays)\n")  # os.write: print is not safe inside a handler
    return handler


def _fall_back(run: Path) -> str:
    """How to resume from the checkpoint before the newest one (which is damaged)."""
    older = complete_checkpoints(run)[:-1]
    return f"delete that folder to resume from {older[-1].name if older else 'the start (no older checkpoint is left)'}"


def _saved_steps(run: Path) -> int | None:
    """--steps of the run saved in ``run/config.json`` (None without one)."""
    from .export import read_run_section

    return (read_run_section(run) or {}).get("config", {}).get("steps")


def _schedule_steps(cfg: TrainConfig, meta: dict | None, saved_steps: int | None, start: int, verbose: bool) -> int:
    """The step at which the lr reaches its final value: --steps for a new run; on resume the
    original run's (state.json's, or ``saved_steps`` from config.json for a checkpoint older than
    that key), unless --reschedule fits the decay to a changed --steps. Says which, when they differ."""
    if meta is None:
        return cfg.steps
    saved = meta.get("schedule_steps") or saved_steps or cfg.steps
    if saved == cfg.steps:
        return saved
    new = cfg.steps if cfg.reschedule else saved
    if verbose and cfg.reschedule:
        print(f"--reschedule: the cosine decay now ends at step {cfg.steps} instead of {saved}; the lr at step {start + 1} "
              f"goes from {lr_at(cfg, start, saved):.3g} to {lr_at(cfg, start, cfg.steps):.3g}")
    elif verbose:
        after = f"; steps {saved + 1}..{cfg.steps} run at its final lr {lr_at(cfg, saved, saved):.3g}" if cfg.steps > saved else ""
        print(f"--resume: keeping the run's lr schedule (cosine decay ending at step {saved}{after}); pass --reschedule "
              f"to fit the decay to --steps {cfg.steps}")
    return new


#: summary.json keys measured while steps run: a process that ran none (a resume at the run's last step) has none
MEASURED_KEYS = ("tok_per_s", "peak_memory_bytes", "peak_memory_bytes_per_rank", "saved_bytes", "saved_bytes_bf16")


def _measured_before(run: Path, done: int) -> dict:
    """The :data:`MEASURED_KEYS` of ``run``'s summary.json when it was written at step ``done`` (the steps that
    measured them), else {}. A resume that ran no step measured nothing: it loaded, validated and exported, so
    its own peak memory, tokens/s (null) and saved bytes (0) would replace the training's in the summary and in
    `adahop compare`'s table. Raises nothing (an unreadable summary gives {})."""
    try:
        old = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: old[k] for k in MEASURED_KEYS if k in old} if old.get("steps") == done else {}


EAGER_GPU_NOTE = ("  note            eager on a GPU: the converted layers launch their kernels one Python call at a time, so "
                  "small models are host-bound (llama-125m adahop-lv2 on an H200: 0.28x BF16's tokens/s eager, 0.68x with "
                  "--compile; docs/benchmarks.md). Pass --compile")


def _eager_gpu(device_type: str, cfg: TrainConfig, recipe) -> bool:
    """Whether the run gets :data:`EAGER_GPU_NOTE`: a low-precision recipe on a GPU without --compile."""
    return device_type == "cuda" and not cfg.compile and not recipe.is_bf16


def _fmt_time(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s" if m else f"{s} s"


def _train(cfg: TrainConfig, rank: int, world: int, live: dict) -> dict:
    # ---- setup ---------------------------------------------------------------------------------
    if world > 1 and cfg.parallel == "none":
        raise ValueError(f"--parallel none under torchrun with {world} processes; pass --parallel ddp or fsdp")
    run = Path(cfg.out)
    resuming = check_run_dir(cfg, run) is not None
    saved_steps = _saved_steps(run) if cfg.resume else None  # read now: rank 0 rewrites config.json later
    device = dp.local_device(resolve_device(cfg.device))
    try:  # a backend this machine cannot run fails here, before data and model are built
        resolve_backend(cfg.backend, device)
    except RuntimeError as e:
        raise ValueError(f"--backend {cfg.backend}: {e}") from None
    data_dir = dp.main_first(lambda: resolve_data(cfg))
    if resuming and (changes := prepared_data_changes(run, data_dir)):
        raise ValueError(f"--resume: the data, once prepared, differs from the checkpointed run's in {run}: "
                         f"{'; '.join(changes)}. Resume with the run's own --data (or the prepared folder it recorded), "
                         "or start a new run with a new --out")
    train_s, val_s = make_streams(cfg, data_dir, rank, world)
    check_data_fits(cfg, train_s, val_s)
    recipe, plan = resolve_recipe(cfg)
    if recipe.calibration is not None and plan is None and cfg.steps <= recipe.calibration.steps and rank == 0:
        print(f"warning: --steps {cfg.steps} ends within {recipe.name}'s calibration ({recipe.calibration.steps} steps): "
              f"no step runs with its frozen plan, so every converted GEMM runs in BF16 and the results are BF16's. "
              f"Pass --steps above {recipe.calibration.steps}, a smaller --calib-steps, or a --plan", file=sys.stderr)
    model = make_model(cfg, train_s.manifest, device)
    convert_model(model, recipe, seed=dp.rank_seed(cfg.seed, rank, world), plan=plan, backend=cfg.backend)
    bf16_layers = converted_layers(model)[1]
    dp.agree_on_plan(model)
    convert_master_weights(model, cfg.master_weights)  # --master-weights: the Parameters hold the master as stored
    if cfg.recompute:
        selective_recompute(model)
    # --compile: the final mode once the plan is frozen (CUDA graphs on one GPU). While the plan calibrates, one
    # process runs eagerly (compiling the calibrating model cost more than its few steps: about 20 s against 3 s for
    # 10 steps of llama-20m on the H200); under ddp/fsdp the wrapped model is compiled in the default mode from the start
    final_mode = frozen_mode(device.type, cfg.parallel) if cfg.compile else None
    calibrating = _plan_frozen(model) is False
    mode = final_mode if not calibrating else CALIBRATION_MODE if cfg.compile and cfg.parallel != "none" else None
    fwd = dp.wrap(model, cfg.parallel, device, compile=cfg.compile and mode is not None, mode=mode or "default")
    opt = build_optimizer(cfg, model, seed=dp.optimizer_seed(cfg.seed, rank, world, cfg.parallel))
    start, meta = 0, None
    if cfg.resume and (ck := latest_checkpoint(run)) is not None:
        try:
            meta = dp.resume(ck, model, opt, cfg.parallel)
            start = meta["step"]
        except Exception as e:  # a damaged file: say which checkpoint, and how to fall back to the one before
            if type(e) is ValueError:  # ours: the checkpoint does not fit this model or --parallel (already explained)
                raise
            raise ValueError(f"--resume: the newest checkpoint {ck} cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                             f"if it is damaged, {_fall_back(run)}") from e
        bad = None if cfg.parallel == "fsdp" else first_nonfinite(model.state_dict())  # FSDP's DTensors: a collective
        if bad is not None:  # only a good step is checkpointed, so this file was damaged after: not a matter of --lr
            raise ValueError(f"--resume: the newest checkpoint {ck} holds NaN or inf in {bad[0]}; a run checkpoints only "
                             f"finite weights, so the file was damaged after it was written: {_fall_back(run)}")
    if mode != final_mode and cfg.parallel == "none" and _plan_frozen(model) is not False:  # resumed after the freeze
        mode, fwd = final_mode, dp.wrap(model, cfg.parallel, device, compile=True, mode=final_mode)
    calib_recompute = _plan_frozen(model) is False and _recompute_calibration(cfg, device, model)
    if calib_recompute:
        selective_recompute(model)
    live["calib_recompute"] = ran_calib_recompute = calib_recompute
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    is_main = rank == 0
    schedule = _schedule_steps(cfg, meta, saved_steps, start, verbose=is_main)
    epochs = epochs_of(cfg, train_s)
    if is_main:
        print(startup_summary(cfg, model, recipe, train_s, val_s, start, schedule), flush=True)
        if _eager_gpu(device.type, cfg, recipe):
            print(EAGER_GPU_NOTE, flush=True)
        if epochs > 1:
            print(f"warning: --steps {cfg.steps} x --batch-size {cfg.batch_size} makes {epochs:.2f} passes over the "
                  f"training split ({train_s.n_windows:,} windows of --seq-len {cfg.seq_len}): later passes repeat the "
                  f"same windows. Pass fewer --steps or more --data", file=sys.stderr)
        write_config(run, cfg, model, data_dir, recipe, world)
        save_hf_tokenizer(run, data_dir)  # now, with the data the run reads: the folder may be prepared again meanwhile
        if plan is not None:  # the plan that runs (re-mapped if it came from the other level) belongs in the run folder
            get_controller(model).plan.save(run / "plan.json")
    metrics = Metrics(run / "metrics.jsonl", resume_from=start if cfg.resume else None, enabled=is_main, log_to=cfg.log_to,
                      config=cfg.to_dict())
    micro = cfg.batch_size // world // cfg.grad_accum
    tokens_per_step = cfg.batch_size * cfg.seq_len
    stop = {"now": False, "asked": False}  # asked: by a signal (this rank); now: agreed by all ranks

    def validate(step: int) -> None:  # the val loss of the weights after ``step`` steps, into the metrics
        vl = dp.mean_over_ranks(evaluate(model, val_s, device, autocast, cfg.eval_batches, cfg.grad_accum)[0])
        metrics.log(step=step, val_loss=vl, val_bpb=val_s.bits_per_byte(vl, cfg.eval_batches))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_sigint(stop))
    bad = torch.zeros((), dtype=torch.bool, device=device)  # non-finite loss or gradient norm (on the device)
    dead = torch.zeros((), dtype=torch.bool, device=device)  # a gradient norm of exactly 0 (the model no longer learns)
    peak_loss = torch.full((), -math.inf, device=device)  # the highest step loss, against the ceiling
    # the first step whose loss was non-finite or passed the ceiling (0: none yet): it tells whether the last
    # checkpoint's weights are the ones that diverged
    first_bad = torch.zeros((), dtype=torch.int64, device=device)

    def kept() -> str:  # read when a divergence is raised: last_good and first_bad as they are then
        return _kept(run, last_good, first_bad, is_main, start)
    vocab = model.config.vocab_size
    # loss_ceiling, set from the run's first step and kept in its checkpoints: a resume after a divergence must
    # not take its own (already diverged) first loss as the reference, or the limit loosens and training goes on
    ceiling = meta.get("loss_ceiling") if meta else None
    reset_peak_memory(device)
    # ---- TRAINING SECTION ----------------------------------------------------------------------
    # progress on rank 0; TQDM_DISABLE=1 turns it off, and into a log file it is written every 30 s
    quiet = os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not is_main or quiet,
               dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 30)
    # tokens/s is the steady state: the clock starts 2 steps after the start and again 2 steps after
    # an AdaHOP plan freezes (kernels compiling, a torch.compile recompile, caches filling)
    clock, timed_tokens, last_good, warm_from = 0.0, 0, start, start + 2
    timed_steps, estimated = 0, False  # the time estimate is printed once 3 steps are timed (again after a freeze)
    plan_ranks = 0  # ranks whose frozen plan was checked against rank 0's (0: no freeze in this run)
    if start and recipe.calibration is not None and get_controller(model).plan is not None:
        plan_ranks = dp.check_same_plan(model)  # resumed after the freeze: each rank loaded the plan on its own
    breaks_from = _graph_breaks()  # compiled runs: graph breaks counted from the last (re)compile on
    frames_from, compiled_at = None, start  # dynamo frames compiled once the step after the last (re)compile ended
    done = start
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(cfg, step, schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = train_s.batch(step)
        loss_sum = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(zip(x.split(micro), y.split(micro))):
            if cfg.compile:  # compiled layers' random draws: seeded per step, micro-batch and rank
                seed_compiled_rng(model, step, i)
            if i == 0:  # CUDA graphs: a new iteration (the last step's outputs and gradients are consumed)
                mark_step(mode)
            with autocast:  # no KV cache in training: it costs memory and makes dynamo recompile per layer
                logits = fwd(input_ids=xm.to(device), use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ym.to(device).flatten()) / cfg.grad_accum
            with dp.grad_sync(fwd, i == cfg.grad_accum - 1):  # reduce gradients across ranks once per step
                loss.backward()
            loss_sum += loss.detach()
        # the norm is computed without clipping too: a non-finite gradient is a divergence even while
        # the loss is finite, and its step must not reach a checkpoint as the "last good" one
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step(model, step + 1):  # every rank freezes the same plan (dp.agree_on_plan)
            plan_ranks = dp.check_same_plan(model)
            if calib_recompute:  # the steps with the plan run as asked (before a recompile sees the blocks)
                undo_selective_recompute(model)
                calib_recompute = live["calib_recompute"] = False
            clock, timed_tokens, warm_from, timed_steps, estimated = 0.0, 0, step + 3, 0, False
            if is_main:
                get_controller(model).plan.save(run / "plan.json")
                metrics.log_plan(step + 1, get_controller(model).plan, model)
            if cfg.compile:  # recompile once, with the frozen plan, as whole graphs, in the final mode
                torch.compiler.reset()
                breaks_from, frames_from, compiled_at = _graph_breaks(), None, step + 1
                if mode != final_mode and cfg.parallel == "none":
                    mode, fwd = final_mode, dp.wrap(model, cfg.parallel, device, compile=True, mode=final_mode)
        elif cfg.compile and frames_from is None and step >= compiled_at:  # the first step of the final graphs is done
            frames_from = dynamo_counts()["frames"]
        bad |= ~(torch.isfinite(loss_sum) & torch.isfinite(gnorm))  # on the device; synced only at log/checkpoint time
        # a gradient of exactly zero everywhere: the model no longer learns (weights blown up until the softmax is
        # flat: loss ln V, gradient 0, which the loss ceiling does not see); the weights before this step are dead
        zero = gnorm == 0
        dead |= zero
        peak_loss = torch.maximum(peak_loss, loss_sum)
        if ceiling is None:  # one host sync, at the run's first step (or a resume from a checkpoint that predates it)
            ceiling = loss_ceiling(vocab, dp.mean_over_ranks(loss_sum).item())
        over = ~torch.isfinite(loss_sum) | (loss_sum > ceiling) | zero  # the loss judges the weights; a NaN gradient, the update
        first_bad = torch.where((first_bad == 0) & over, step + 1, first_bad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        if step >= warm_from:
            clock += step_s
            timed_tokens += tokens_per_step
            timed_steps += 1
        done = step + 1
        if timed_steps == 3 and not estimated and done < cfg.steps and is_main:
            estimated = True
            bar.write(f"estimate: {clock / timed_steps:.3g} s/step over the last {timed_steps} steps, so about "
                      f"{_fmt_time(clock / timed_steps * (cfg.steps - done))} for the {cfg.steps - done} steps left "
                      f"(validation and checkpoints come on top)")
        last = done == cfg.steps
        stop["now"] = dp.any_rank(stop["asked"])  # all ranks stop (and checkpoint) at the same step
        if done % cfg.log_every == 0 or last or stop["now"]:
            _check_diverged(bad, dead, peak_loss, ceiling, vocab, done, bar, kept)
            tps = timed_tokens / clock if clock else None  # None (null): not measured yet, the first steps are warm-up
            loss_val = dp.mean_over_ranks(loss_sum).item()
            metrics.log(step=done, loss=loss_val, lr=lr, grad_norm=float(gnorm), tokens=done * tokens_per_step, tok_per_s=tps,
                        step_s=step_s, memory_mb=peak_memory(device) / 2**20)
            # no refresh here: tqdm syncs its count lazily while iterating, so a forced refresh showed the count of its
            # last timed update (0/40 for a whole short run); the bar prints the postfix at its own next update
            bar.set_postfix(loss=f"{loss_val:.3f}", **({"tok_s": f"{tps:,.0f}"} if tps is not None else {}), refresh=False)
        if cfg.eval_every and (done % cfg.eval_every == 0 or last):
            validate(done)
        if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or last or stop["now"]:
            _check_diverged(bad, dead, peak_loss, ceiling, vocab, done, bar, kept)
            (save_checkpoint if cfg.parallel == "none" else dp.save_sharded)(run, done, model, opt, keep=cfg.keep_ckpts,
                                                                             extra={"schedule_steps": schedule, "loss_ceiling": ceiling})
            last_good = done
        if stop["now"]:
            bar.close()
            if is_main:
                print(f"interrupted: checkpoint of step {done} written to {run / 'checkpoints'}; resume with --resume")
            break
    bar.close()
    if calib_recompute:  # the run ended before its plan froze
        undo_selective_recompute(model)
    val_at = next((r["step"] for r in reversed(metrics.records) if "val_loss" in r), None)
    if cfg.eval_every and not stop["now"] and val_at != done:
        # a resume with --steps at the checkpoint's step ran no step: the last val loss on record is an earlier
        # step's, and the summary would give it as the final one
        validate(done)
    # ---- summary -------------------------------------------------------------------------------
    ours, bf16 = saved_bytes(model)
    peak = peak_memory(device)
    breaks = _graph_breaks() - breaks_from if cfg.compile else None
    # frames dynamo compiled after the first step of the last compile (0: no recompile in the steady state)
    recompiles = dynamo_counts()["frames"] - frames_from if cfg.compile and frames_from is not None else None
    if recompiles and is_main:
        print(f"warning: torch.compile recompiled {recompiles} frame(s) after the model's last compile; "
              f"rerun with TORCH_LOGS=recompiles to see why")
    if breaks and is_main:
        print(f"warning: torch.compile logged {breaks} graph break(s) after the model's last compile; "
              f"rerun with TORCH_LOGS=graph_breaks to see where")
    summary = dict(recipe=cfg.recipe, steps=done, tokens=done * tokens_per_step,  # steps done (< --steps if interrupted)
                   final_val_loss=metrics.last("val_loss"), final_val_bpb=metrics.last("val_bpb"),
                   final_train_loss=metrics.last("loss"), tok_per_s=timed_tokens / clock if clock else None,
                   peak_memory_bytes=peak, peak_memory_bytes_per_rank=dp.gather_float(peak),
                   plan_frozen=_plan_frozen(model), plan_checked_on_ranks=plan_ranks, world_size=world,
                   graph_breaks_steady_state=breaks, recompiles_steady_state=recompiles,
                   compile_mode=mode, recompute=cfg.recompute, calibration_recompute=ran_calib_recompute,
                   saved_bytes=ours, saved_bytes_bf16=bf16,
                   unquantizable_layers=len(get_controller(model).unquantizable), bf16_layers=bf16_layers,
                   parameters=sum(p.numel() for p in model.parameters()), epochs=epochs, lr_schedule_steps=schedule,
                   device=str(device), interrupted=stop["now"], optimizer=cfg.optimizer, master_weights=cfg.master_weights,
                   optimizer_states=cfg.optimizer_states, master_rounding=getattr(opt, "rounding", None),
                   **memory_bytes(model, opt))  # bytes of this rank's shards
    if done == start and start:  # a resume that ran no step (its export had failed, or Ctrl-C came in the last step)
        summary.update(_measured_before(run, done))
    if is_main:
        (run / "summary.json").write_text(json.dumps(summary, indent=1))
        metrics.plot(run / "loss.png", title=f"{cfg.recipe} on {cfg.model}")
    metrics.close()
    if not stop["now"]:
        dp.export(run, model, data_dir, cfg.parallel)  # rank 0 writes; FSDP gathers the weights first
    return summary
