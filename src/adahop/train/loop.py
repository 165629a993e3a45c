"""`adahop train`: pretraining from scratch with a recipe, read top to bottom in the order a step
happens (nanoGPT): lr, forward/backward with accumulation, clip, step, hook, log, eval, checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..kernels import resolve_backend
from ..nn import convert_model, get_controller, on_step, saved_bytes, seed_compiled_rng
from ..optim import convert_master_weights, memory_bytes
from . import distributed as dp
from .checkpoint import complete_checkpoints, latest_checkpoint, save_checkpoint
from .config import TrainConfig
from .export import write_config
from .metrics import Metrics, peak_memory, reset_peak_memory
from .setup import (build_optimizer, check_run_dir, lr_at, make_model, make_streams, resolve_data, resolve_device,
                    resolve_recipe)

__all__ = ["train", "Diverged", "evaluate"]


class Diverged(RuntimeError):
    """The loss became NaN or Inf; the run stopped and kept its last good checkpoint."""


def _kept(run: Path, step: int) -> str:
    """What a diverged run leaves behind, as the message says it."""
    if step and (run / "checkpoints").exists():
        return f"The last good checkpoint (step {step}) is kept in {run / 'checkpoints'}."
    return "No checkpoint was written before that (set --ckpt-every below the step it diverged at)."


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
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


@torch.no_grad()
def evaluate(model, val, device, autocast, max_batches: int) -> tuple[float, float]:
    """Mean validation loss (nats/token) over ``max_batches`` fixed batches, and bits per byte."""
    model.eval()
    total, n = 0.0, 0
    for x, y in val.val_batches(max_batches):
        with autocast:
            logits = model(input_ids=x.to(device), use_cache=False).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()).item()
        n += 1
    model.train()
    loss = total / max(n, 1)
    return loss, val.bits_per_byte(loss)


def train(cfg: TrainConfig, *, rank: int = 0, world: int = 1) -> dict:
    """Run (or resume) one training run; returns its summary (also written to summary.json).

    ``rank`` / ``world``: this process among ``world`` data-parallel processes (``torchrun``, with
    the process group joined by :func:`adahop.train.distributed.init_from_env`). Every rank runs
    this function; rank 0 alone writes files and shows progress, and holds a lock on ``--out`` for
    the run's duration (``<out>/.lock``), so that a second run into the same folder is refused.

    Raises:
        ValueError: a bad option, or ``--out`` in use by another run, before any training starts.
        Diverged: non-finite loss or gradient norm.
    """
    lock = _lock_run_dir(Path(cfg.out)) if rank == 0 else None
    try:
        return _train(cfg, rank, world)
    finally:
        if lock is not None:
            lock.close()  # releases the lock (also when the run fails)


def _lock_run_dir(run: Path):
    """An exclusive lock on ``run/.lock`` (the open file; closing it releases the lock), or None where
    the folder cannot be created yet (check_run_dir explains why) or file locks are unavailable."""
    try:
        import fcntl

        run.mkdir(parents=True, exist_ok=True)
        f = open(run / ".lock", "w")
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"--out {run}: another adahop run is writing to this folder; wait for it to end, or pass "
                         "another --out") from None
    except OSError:  # a filesystem without flock: run unlocked
        pass
    return f


def _train(cfg: TrainConfig, rank: int, world: int) -> dict:
    # ---- setup ---------------------------------------------------------------------------------
    if world > 1 and cfg.parallel == "none":
        raise ValueError(f"--parallel none under torchrun with {world} processes; pass --parallel ddp or fsdp")
    run = Path(cfg.out)
    check_run_dir(cfg, run)
    device = dp.local_device(resolve_device(cfg.device))
    try:  # a backend this machine cannot run fails here, before data and model are built
        resolve_backend(cfg.backend, device)
    except RuntimeError as e:
        raise ValueError(f"--backend {cfg.backend}: {e}") from None
    data_dir = dp.main_first(lambda: resolve_data(cfg))
    train_s, val_s = make_streams(cfg, data_dir, rank, world)
    recipe, plan = resolve_recipe(cfg)
    if recipe.calibration is not None and plan is None and cfg.steps <= recipe.calibration.steps and rank == 0:
        print(f"warning: --steps {cfg.steps} ends within {recipe.name}'s calibration ({recipe.calibration.steps} steps): "
              f"no step runs with its frozen plan, so every converted GEMM runs in BF16 and the results are BF16's. "
              f"Pass --steps above {recipe.calibration.steps}, a smaller --calib-steps, or a --plan", file=sys.stderr)
    model = make_model(cfg, train_s.manifest, device)
    convert_model(model, recipe, seed=dp.rank_seed(cfg.seed, rank, world), plan=plan, backend=cfg.backend)
    dp.agree_on_plan(model)
    convert_master_weights(model, cfg.master_weights)  # --master-weights: the Parameters hold the master as stored
    fwd = dp.wrap(model, cfg.parallel, device, compile=cfg.compile)
    opt = build_optimizer(cfg, model, seed=dp.rank_seed(cfg.seed, rank, world))
    start = 0
    if cfg.resume and (ck := latest_checkpoint(run)) is not None:
        try:
            start = dp.resume(ck, model, opt, cfg.parallel)["step"]
        except Exception as e:  # a damaged file: say which checkpoint, and how to fall back to the one before
            if type(e) is ValueError:  # ours: the checkpoint does not fit this model or --parallel (already explained)
                raise
            older = complete_checkpoints(run)[:-1]
            raise ValueError(f"--resume: the newest checkpoint {ck} cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                             f"if it is damaged, delete that folder to resume from "
                             f"{older[-1].name if older else 'the start (no older checkpoint is left)'}") from e
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    is_main = rank == 0
    if is_main:
        write_config(run, cfg, model, data_dir, recipe)
        if plan is not None:  # the plan that runs (re-mapped if it came from the other level) belongs in the run folder
            get_controller(model).plan.save(run / "plan.json")
    metrics = Metrics(run / "metrics.jsonl", resume_from=start if cfg.resume else None, enabled=is_main)
    micro = cfg.batch_size // world // cfg.grad_accum
    tokens_per_step = cfg.batch_size * cfg.seq_len
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    bad = torch.zeros((), dtype=torch.bool, device=device)
    reset_peak_memory(device)
    # ---- TRAINING SECTION ----------------------------------------------------------------------
    # progress on rank 0; TQDM_DISABLE=1 turns it off, and into a log file it is written every 30 s
    quiet = os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not is_main or quiet,
               dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 30)
    # tokens/s is the steady state: the clock starts 2 steps after the start and again 2 steps after
    # an AdaHOP plan freezes (kernels compiling, a torch.compile recompile, caches filling)
    clock, timed_tokens, last_good, warm_from = 0.0, 0, start, start + 2
    plan_ranks = 0  # ranks whose frozen plan was checked against rank 0's (0: no freeze in this run)
    breaks_from = _graph_breaks()  # compiled runs: graph breaks counted from the last (re)compile on
    done = start
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = train_s.batch(step)
        if cfg.compile:  # compiled layers draw SR bits from the default generator: seed it per step and rank
            seed_compiled_rng(model, step)
        loss_sum = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(zip(x.split(micro), y.split(micro))):
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
            clock, timed_tokens, warm_from = 0.0, 0, step + 3
            if is_main:
                get_controller(model).plan.save(run / "plan.json")
            if cfg.compile:  # recompile once, with the frozen plan, as whole graphs
                torch.compiler.reset()
                breaks_from = _graph_breaks()
        bad |= ~(torch.isfinite(loss_sum) & torch.isfinite(gnorm))  # on the device; synced only at log/checkpoint time
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        if step >= warm_from:
            clock += step_s
            timed_tokens += tokens_per_step
        done = step + 1
        last = done == cfg.steps
        stop["now"] = dp.any_rank(stop["now"])  # all ranks stop (and checkpoint) at the same step
        if done % cfg.log_every == 0 or last or stop["now"]:
            if dp.any_rank(bad):
                bar.close()
                raise Diverged(f"loss or gradient norm became non-finite at or before step {done}; stopped. {_kept(run, last_good)} "
                               f"Lower --lr or use a safer recipe.")
            tps = timed_tokens / clock if clock else 0.0
            loss_val = dp.mean_over_ranks(loss_sum).item()
            metrics.log(step=done, loss=loss_val, lr=lr, grad_norm=float(gnorm), tokens=done * tokens_per_step, tok_per_s=tps,
                        step_s=step_s)
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tps:,.0f}")
        if cfg.eval_every and (done % cfg.eval_every == 0 or last):
            vl = dp.mean_over_ranks(evaluate(model, val_s, device, autocast, cfg.eval_batches)[0])
            metrics.log(step=done, val_loss=vl, val_bpb=val_s.bits_per_byte(vl))
        if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or last or stop["now"]:
            if dp.any_rank(bad):
                raise Diverged(f"loss or gradient norm became non-finite before step {done}; stopped. {_kept(run, last_good)} "
                               f"Lower --lr or use a safer recipe.")
            (save_checkpoint if cfg.parallel == "none" else dp.save_sharded)(run, done, model, opt, keep=cfg.keep_ckpts)
            last_good = done
        if stop["now"]:
            bar.close()
            if is_main:
                print(f"interrupted: checkpoint of step {done} written to {run / 'checkpoints'}; resume with --resume")
            break
    bar.close()
    # ---- summary -------------------------------------------------------------------------------
    ours, bf16 = saved_bytes(model)
    peak = peak_memory(device)
    breaks = _graph_breaks() - breaks_from if cfg.compile else None
    if breaks and is_main:
        print(f"warning: torch.compile logged {breaks} graph break(s) after the model's last compile; "
              f"rerun with TORCH_LOGS=graph_breaks to see where")
    summary = dict(recipe=cfg.recipe, steps=done, tokens=done * tokens_per_step,  # steps done (< --steps if interrupted)
                   final_val_loss=metrics.last("val_loss"), final_val_bpb=metrics.last("val_bpb"),
                   final_train_loss=metrics.last("loss"), tok_per_s=timed_tokens / clock if clock else None,
                   peak_memory_bytes=peak, peak_memory_bytes_per_rank=dp.gather_float(peak),
                   plan_frozen=_plan_frozen(model), plan_checked_on_ranks=plan_ranks, world_size=world,
                   graph_breaks_steady_state=breaks, saved_bytes=ours, saved_bytes_bf16=bf16,
                   unquantizable_layers=len(get_controller(model).unquantizable), device=str(device),
                   interrupted=stop["now"], optimizer=cfg.optimizer, master_weights=cfg.master_weights,
                   optimizer_states=cfg.optimizer_states, **memory_bytes(model, opt))  # bytes of this rank's shards
    if is_main:
        (run / "summary.json").write_text(json.dumps(summary, indent=1))
        metrics.plot(run / "loss.png", title=f"{cfg.recipe} on {cfg.model}")
    if not stop["now"]:
        dp.export(run, model, data_dir, cfg.parallel)  # rank 0 writes; FSDP gathers the weights first
    return summary
