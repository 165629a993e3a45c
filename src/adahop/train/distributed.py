"""Data parallelism under ``torchrun``: process group, DDP / FSDP2 wrapping, reductions across
ranks, one AdaHOP plan for every rank, sharded checkpoints (DCP) and the rank-0 export.

Everything here is a no-op for a single process (``world == 1`` and ``--parallel none``), so the
single-process loop stays bit-identical. `docs/distributed.md` explains the design and the
numerics (what matches a single-process run exactly and what only closely).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..nn import get_controller
from ..nn.convert import own_calibration_history
from ..patterns import Calibrator, Plan
from ..utils import mix_seed
from .checkpoint import publish_checkpoint

__all__ = ["DistInfo", "init_from_env", "shutdown", "local_device", "rank_seed", "optimizer_seed", "wrap", "grad_sync",
           "mean_over_ranks", "any_rank", "main_first", "agree_on_plan", "merge_histories", "is_sharded",
           "save_sharded", "load_sharded", "resume", "export", "min_over_ranks"]


# ---- process group ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistInfo:
    """This process's place among the data-parallel processes (``torchrun`` sets the env vars)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_from_env(device: str = "auto") -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` set), else return
    rank 0 of 1. The backend is NCCL on CUDA and gloo on CPU; on CUDA the process takes GPU
    ``LOCAL_RANK``. ``device`` is ``--device``."""
    if "WORLD_SIZE" not in os.environ:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    cuda = device != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=info.rank, world_size=info.world,
                                device_id=torch.device("cuda", info.local_rank) if cuda else None)
    return info


def shutdown() -> None:
    """Leave the process group (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: torch.device) -> torch.device:
    """Under torchrun, ``cuda`` → this process's GPU (``cuda:LOCAL_RANK``, set by
    :func:`init_from_env`); otherwise ``device`` unchanged."""
    if device.type == "cuda" and device.index is None and dist.is_available() and dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def rank_seed(seed: int, rank: int, world: int) -> int:
    """Seed of this rank's stochastic-rounding and random-sign streams: ``seed`` itself for one
    process (so single-process runs are unchanged), else a hash of (seed, rank): every rank draws
    its own noise, reproducibly. A resume on another number of ranks draws other streams."""
    return seed if world == 1 else mix_seed(seed, "rank", rank)


def optimizer_seed(seed: int, rank: int, world: int, parallel: str) -> int:
    """Seed of the optimizer's stochastic rounding of the master weights: per rank (:func:`rank_seed`)
    under FSDP2, where each rank updates only its own shard, but one for all ranks otherwise: DDP keeps a
    whole copy on every rank and never re-syncs the parameters, so ranks that rounded the same update
    differently would drift apart (``tests/test_distributed.py::test_bf16_masters_and_madam_states_shard_like_params``
    compares the two replicas' weights). Raises nothing. Source: ours."""
    return rank_seed(seed, rank, world) if parallel == "fsdp" else seed


# ---- wrapping -----------------------------------------------------------------------------------
_BLOCK_LISTS = ("layers", "h", "blocks", "layer")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: children of a ``ModuleList`` named layers/h/blocks/layer."""
    return [b for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
            and name.rpartition(".")[2] in _BLOCK_LISTS for b in m]


def wrap(model: nn.Module, parallel: str, device: torch.device, *, compile: bool = False,
         mode: str = "default") -> nn.Module:
    """Make ``model`` data-parallel and/or compiled; returns the module to call for forward.

    * ``none``: ``model`` (``torch.compile(model, mode=mode)`` with ``compile``; the caller picks
      the mode, :mod:`adahop.compile_modes`).
    * ``ddp``: ``DistributedDataParallel(model)`` (compiled as a whole with ``compile``).
    * ``fsdp``: FSDP2 in place: ``fully_shard`` on each transformer block, then on the root.
      Master weights stay FP32 shards; on CUDA each block all-gathers BF16 parameters and
      reduce-scatters FP32 gradients (``MixedPrecisionPolicy(bf16, fp32)``); on CPU everything
      stays FP32. With ``compile`` each block is compiled before it is sharded.

    A converted linear reads ``self.weight`` inside forward, after FSDP2 has all-gathered it, so
    it quantizes the full weight exactly as a single process does.

    Build the optimizer *after* this call (FSDP2 replaces the Parameters by sharded DTensors).

    Raises:
        ValueError: ``parallel`` is ddp/fsdp but no process group runs (not under torchrun).
    """
    if parallel == "none":
        return torch.compile(model, mode=mode) if compile else model
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"--parallel {parallel} needs torchrun: torchrun --nproc-per-node N -m adahop train "
                         f"--parallel {parallel} ...; use --parallel none for a single process")
    if parallel == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return torch.compile(ddp) if compile else ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    blocks = _blocks(model)
    if not blocks:
        raise ValueError("--parallel fsdp: found no transformer blocks (a ModuleList named layers/h/blocks)")
    for block in blocks:
        if compile:
            block.compile()
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def grad_sync(fwd: nn.Module, sync: bool):
    """Context for one micro-batch's backward: gradients are reduced across ranks only when
    ``sync`` (the last micro-batch of a step); the others accumulate locally."""
    if isinstance(fwd, nn.parallel.DistributedDataParallel) and not sync:
        return fwd.no_sync()
    if hasattr(fwd, "set_requires_gradient_sync"):  # an FSDP2 module
        fwd.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


# ---- reductions ---------------------------------------------------------------------------------
def mean_over_ranks(x):
    """The mean of ``x`` (a float or a tensor) over all ranks; ``x`` itself for one process."""
    if not _active():
        return x
    t = torch.as_tensor(x, dtype=torch.float32, device=_comm_device()).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t /= dist.get_world_size()
    return t if torch.is_tensor(x) else t.item()


def any_rank(flag) -> bool:
    """Whether ``flag`` (a bool or a bool tensor) is true on any rank. Syncs with the host."""
    if not _active():
        return bool(flag)
    t = torch.tensor(float(bool(flag)), device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def min_over_ranks(x: int) -> int:
    """The smallest of an int over all ranks (a host sync); ``x`` itself for one process."""
    if not _active():
        return int(x)
    t = torch.tensor(int(x), dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def main_first(fn):
    """Run ``fn`` on rank 0 first, then on the others (e.g. data preparation into a shared cache)."""
    if not _active():
        return fn()
    if dist.get_rank() == 0:
        out = fn()
        dist.barrier()
    else:
        dist.barrier()
        out = fn()
    return out


# ---- one plan for every rank --------------------------------------------------------------------
def merge_histories(histories: list[dict]) -> dict[str, dict[str, list[str]]]:
    """Concatenate calibration histories in rank order: the vote then counts every rank's
    observations (all-reduced counts), ties going to the pattern rank 0 saw first."""
    out: dict[str, dict[str, list[str]]] = {}
    for h in histories:
        for layer, tensors in h.items():
            for k, seen in tensors.items():
                out.setdefault(layer, {}).setdefault(k, []).extend(seen)
    return out


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(cal: Calibrator) -> None:
    cal.history = merge_histories(_gather(cal.history))


def agree_on_plan(model: nn.Module) -> None:
    """Make every rank freeze the same AdaHOP plan: right before the plan freezes, each rank's
    pattern observations (of its own micro-batches) are all-gathered and voted on together."""
    if _active():
        get_controller(model).agree = _agree


def check_same_plan(model: nn.Module) -> int:
    """After the freeze, verify that every rank holds the very plan rank 0 holds; returns the
    number of ranks checked (1 without a process group).

    The pooled vote makes the plans equal by construction; this check turns any future way of
    breaking that (a tie decided differently, a rank resumed from another plan) into an error
    instead of ranks silently running different GEMMs.

    Raises:
        RuntimeError: naming the first rank and layers whose plan differs.
    """
    if not _active():
        return 1
    mine = get_controller(model).plan
    plans = _gather(mine.to_json())
    ref = json.loads(plans[0])["layers"]
    for r, text in enumerate(plans):
        other = json.loads(text)["layers"]
        if other != ref:
            diff = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
            raise RuntimeError(f"rank {r} froze a different AdaHOP plan than rank 0 for {len(diff)} layer(s), e.g. "
                               f"{diff[:3]}; every rank must run the same GEMMs. Re-run with a plan file "
                               f"(--plan run/plan.json) so that all ranks load one plan.")
    return len(plans)


def gather_float(x: float) -> list[float]:
    """``x`` from every rank, in rank order (``[x]`` without a process group)."""
    return [float(v) for v in _gather(float(x))] if _active() else [float(x)]


# ---- sharded checkpoints (torch.distributed.checkpoint) -----------------------------------------
def is_sharded(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` was written by :func:`save_sharded` (DCP)."""
    return (Path(path) / ".metadata").exists()


def _calibration_histories(model: nn.Module) -> list[dict] | None:
    cal = get_controller(model).calibrator
    if cal is None:
        return None
    return _gather(cal.history) if _active() else [cal.history]


def controller_state_all_ranks(model: nn.Module) -> dict:
    """Collective under torch.distributed (every rank calls it): :func:`adahop.nn.controller_state` with every
    rank's calibration votes (``calibration_histories``, and ``calibration_history`` merged), for a checkpoint
    one rank writes (the HF Trainer's, accelerate's): with this rank's alone, a resume mid-calibration gave
    every rank rank 0's votes. One process: :func:`controller_state` itself. Raises ValueError: ``model`` is not
    converted. Source: ours (docs/integrations.md)."""
    from ..nn.convert import controller_state

    state = controller_state(model)
    histories = _calibration_histories(model)
    if histories is not None and _active():
        state["calibration_histories"], state["calibration_history"] = histories, merge_histories(histories)
    return state


def save_sharded(run_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, *, keep: int = 2,
                 extra: dict | None = None) -> Path:
    """Collective: every rank writes its shards of the model and AdamW state to
    ``checkpoints/step_N/`` with DCP; rank 0 adds ``state.json`` (step, RNG, the AdaHOP plan, or
    every rank's calibration history, and ``extra``) and renames the folder into place. Loads on any
    number of ranks (:func:`load_sharded`). Same folder layout as
    :func:`~adahop.train.checkpoint.save_checkpoint`; a write that fails removes its partial folder
    (rank 0) and raises :class:`~adahop.train.checkpoint.CheckpointWriteError` for a storage error.
    """
    from .checkpoint import discard_failed_write

    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp_step_{step:07d}"
    try:
        return _save_sharded(root, tmp, step, model, opt, keep, extra)
    except BaseException as e:
        if _active() and dist.get_rank() != 0:
            raise
        err = discard_failed_write(tmp, step, e)
        if err is None:
            raise
        raise err from e


def _save_sharded(root: Path, tmp: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, keep: int,
                  extra: dict | None) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = root / f"step_{step:07d}"
    main = not _active() or dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if _active():
        dist.barrier()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    ctrl = get_controller(model)
    histories = _calibration_histories(model)  # collective
    if _active():
        dist.barrier()  # every rank's shards are on disk
    if main:
        meta = dict(step=step, controller_step=ctrl.step, rng=torch.get_rng_state().tolist(),
                    world_size=dist.get_world_size() if _active() else 1,
                    plan=json.loads(ctrl.plan.to_json()) if ctrl.plan else None,
                    calibration_history=merge_histories(histories) if histories is not None else None,
                    calibration_histories=histories, calibration_from=ctrl.calibrator.first_step if ctrl.calibrator else None,
                    **(extra or {}))
        (tmp / "state.json").write_text(json.dumps(meta))
        publish_checkpoint(tmp, final, keep)
    if _active():
        dist.barrier()
    return final


def load_sharded(path: Path, model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """Restore a :func:`save_sharded` checkpoint into ``model`` (plain, DDP or FSDP2, on any number
    of ranks: DCP reshards) and ``opt``; returns state.json.

    Calibration histories come back per rank when the world size is the one that saved them;
    otherwise rank 0 takes all of them merged (the vote counts are kept)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    path = Path(path)
    meta = json.loads((path / "state.json").read_text())
    state = {"model": sd.get_model_state_dict(model)}
    if opt is not None:
        state["optim"] = sd.get_optimizer_state_dict(model, opt)
    with warnings.catch_warnings():  # one process reading a checkpoint of several is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    sd.set_model_state_dict(model, state["model"])
    if opt is not None:
        sd.set_optimizer_state_dict(model, opt, state["optim"])
    torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    ctrl = get_controller(model)
    if meta.get("plan"):
        ctrl.set_plan(Plan.from_dict(meta["plan"]))
    elif meta.get("calibration_histories") is not None and ctrl.calibrator is not None:
        ctrl.calibrator.history = own_calibration_history(meta)
        ctrl.calibrator.first_step = meta.get("calibration_from", 0)  # the vote's window, as the plan records it
    ctrl.step = meta["controller_step"]
    return meta


def resume(path: Path, model: nn.Module, opt: torch.optim.Optimizer, parallel: str) -> dict:
    """Load the checkpoint folder ``path`` in whichever format it has; returns its state.json.

    Raises:
        ValueError: a single-process (safetensors) checkpoint resumed under ``--parallel fsdp``.
    """
    if is_sharded(path):
        return load_sharded(path, model, opt)
    if parallel == "fsdp":
        raise ValueError(f"--resume: {path} is a single-process checkpoint; FSDP resumes only sharded (DCP) "
                         "checkpoints. Resume it with --parallel ddp or none")
    from .checkpoint import load_checkpoint

    return load_checkpoint(path, model, opt)


# ---- export -------------------------------------------------------------------------------------
class _StateOnly:
    """What :func:`~adahop.train.export.export_hf` reads of a model: its state dict."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def export(run: Path, model: nn.Module, data_dir: Path, parallel: str) -> None:
    """Write the transformers folder from rank 0. Collective under FSDP: the full state dict is
    gathered to rank 0's CPU first."""
    from .export import export_hf

    main = not _active() or dist.get_rank() == 0
    if parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if main:
            export_hf(run, _StateOnly(full), data_dir)
    elif main:
        export_hf(run, model, data_dir)
    if _active():
        dist.barrier()
