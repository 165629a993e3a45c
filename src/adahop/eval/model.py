"""The model `adahop eval` scores: a run folder of `adahop train` or any `transformers` causal-LM folder,
optionally converted to a recipe's forward numerics."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..utils import unreadable_weights

__all__ = ["LoadedModel", "load_model", "check_window"]


def check_window(model: torch.nn.Module, tokens: int | None, flag: str) -> None:
    """Raise ValueError naming ``flag`` when windows of ``tokens`` exceed a learned position table
    (GPT-2's ``wpe``, OPT's ``embed_positions``: an ``nn.Embedding`` besides the token embeddings
    with ``max_position_embeddings`` rows, OPT's two offset rows allowed), where the forward would
    fail with an IndexError. RoPE and other models extend past their training length and pass."""
    n = getattr(model.config, "max_position_embeddings", None)
    if tokens is None or not n or tokens <= n:
        return
    tok = model.get_input_embeddings()
    if any(isinstance(m, torch.nn.Embedding) and m is not tok and n <= m.num_embeddings <= n + 2 for m in model.modules()):
        raise ValueError(f"{flag} {tokens}: the model has learned position embeddings for {n} positions "
                         f"(max_position_embeddings) and cannot score longer windows; pass {flag} {n} or less")


def warn_beyond_training(trained: int | None, flag: str, tokens: int | None, what: str = "scores") -> None:
    """Print a warning (stderr) when windows of ``tokens`` (``flag``) run past the ``trained`` sequence length
    of the run: a RoPE model is usually worse there, so the number is not the trained window's."""
    if trained and tokens and tokens > trained:
        print(f"warning: {flag} {tokens} {what} positions beyond the {trained} tokens the run trained at; a RoPE model "
              f"is usually worse there, so this is not the trained window's score", file=sys.stderr)


@dataclass
class LoadedModel:
    """A model ready to score, its tokenizer, and what was loaded (for the results JSON)."""

    model: torch.nn.Module
    tokenizer: object
    info: dict = field(default_factory=dict)
    """``path``, ``weights`` (which file the weights came from), ``recipe``, ``plan``."""
    run_config: dict | None = None
    """The ``adahop train`` config of a run folder (config.json's "adahop" section), else None."""
    data_dir: str | None = None
    """The prepared data folder a run trained on, else None."""
    run_world_size: int = 1
    """The data-parallel ranks that validated the run (config.json's ``world_size``; summary.json's for a run of
    an adahop that did not record it there; 1 when neither says, or for a model folder)."""


def _load_weights(model: torch.nn.Module, path: Path) -> str:
    """Load a checkpoint's master weights (``model.safetensors``) into the FP32 ``model``, tied weights
    coming back through the one stored (as :func:`adahop.train.checkpoint.load_checkpoint` does).
    Masters stored packed (``--master-weights fp8/fp4/nvfp4``: codes and scales) are dequantized,
    BF16 ones widened: the values are exactly the master's. Returns the masters' format."""
    from safetensors.torch import load_file

    from ..optim.master import PackedMaster, master_format, unpack_state_dict
    from ..train.checkpoint import tied_keys

    state = unpack_state_dict(load_file(path), model)
    formats = {master_format(v) for v in state.values() if v.is_floating_point() and v.ndim == 2}
    state = {k: v.dequantize() if isinstance(v, PackedMaster) else v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in tied_keys(model.state_dict())]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the model of config.json: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}; pass the run folder it belongs to")
    return "/".join(sorted(formats)) or "fp32"


def load_model(path: str | Path, *, device: torch.device, recipe: str | None = None, plan: str | None = None,
               backend: str = "auto") -> LoadedModel:
    """Load MODEL for scoring, in FP32 on ``device``, in eval mode.

    A run folder of ``adahop train`` (config.json with an "adahop" section) gives the master
    weights of its newest checkpoint in FP32 (BF16 masters widened, packed FP8/FP4/NVFP4 ones
    dequantized, both exactly), the very weights its validation loss was measured with (so
    :func:`adahop.eval.perplexity.perplexity` reproduces that loss of an FP32-master run); a data-parallel run's sharded
    checkpoint is read in this one process (``torch.distributed.checkpoint``); a run without checkpoints, or whose
    shards do not load (a warning says why), gives the BF16 export ``model.safetensors``. Any other
    folder is loaded with ``transformers.AutoModelForCausalLM.from_pretrained``.

    Args:
        path: the folder (config.json, weights, tokenizer).
        device: where the model runs.
        recipe: a preset of ``adahop recipes``: convert the model's linear layers
            (:func:`adahop.convert_model`, ``lm_head`` excluded as in training) so the forward runs
            that recipe's fprop GEMMs (e.g. MXFP4). None: as loaded.
        plan: for an AdaHOP recipe, its frozen plan.json (default: the run folder's plan.json).
        backend: kernel backend of the converted layers (never changes numerics).

    Raises:
        ValueError: no config.json (a folder of runs, e.g. of ``adahop compare``, lists them), no
            tokenizer, an unknown recipe, a recipe none of whose GEMMs fits a layer of the model, an
            AdaHOP recipe without a plan or with a plan of another model (an entry missing, or one
            for a layer the model lacks), a checkpoint that does not fit or cannot be read, weights holding NaN or
            inf, or a transformers folder whose weights lack tensors of its causal-LM class (they would load
            random); each message names the fix.
    """
    import transformers

    from ..models import _dtype_kwarg
    from ..train.export import read_run_section, runs_inside
    from ..utils import first_nonfinite

    p = Path(path)
    if not p.exists():
        raise ValueError(f"MODEL {p} does not exist; pass a run folder of `adahop train` or a transformers model folder")
    if not (p / "config.json").is_file() and (runs := runs_inside(p)):
        raise ValueError(f"MODEL {p} holds {len(runs)} runs (a folder of runs, such as `adahop compare`'s: one per recipe), not one "
                         f"model; pass one of them: {', '.join(str(r) for r in runs)}")
    if not (p / "config.json").is_file():
        raise ValueError(f"MODEL {p}: no config.json; pass a run folder of `adahop train` or a transformers "
                         f"model folder")
    section = read_run_section(p)
    loaded = _newest_checkpoint(p) if section else None
    state = {}  # the checkpoint's state.json: its step, and the step counter that seeds random bits
    if loaded is not None:
        model, ck, ck_weights, fmt = loaded
        weights = f"{ck_weights} ({fmt.upper()} master weights{'' if fmt == 'fp32' else ', as FP32'})"
        state = _checkpoint_state(ck)
        _warn_if_unfinished(p, state.get("step"), section)
    else:
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise ValueError(f"MODEL {p}: no weights (model.safetensors or a checkpoint); "
                             f"{'let the run finish or resume it' if section else 'pass a folder holding a model'}")
        with unreadable_weights(p):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(p, output_loading_info=True,
                                                                            **_dtype_kwarg(torch.float32))
        if info.get("missing_keys"):  # transformers fills them with random values and only warns: a made-up score
            miss = sorted(info["missing_keys"])
            raise ValueError(f"MODEL {p}: its weights lack {len(miss)} tensors of {type(model).__name__} "
                             f"({', '.join(miss[:4])}{', ...' if len(miss) > 4 else ''}), which would be random; pass a "
                             f"causal-LM folder saved whole (e.g. by `save_pretrained` of the *ForCausalLM model, not "
                             f"of its base model)")
        weights = f"{p} ({'the BF16 export' if section else 'from_pretrained'})"
    if (hit := first_nonfinite(model.state_dict())) is not None:  # scored "perplexity inf", or a plausible number
        raise ValueError(f"MODEL {p}: {hit[0]} holds {hit[1]} NaN or inf values of {hit[2]} ({weights}); the weights "
                         "are broken (a run that diverged?): use an earlier, finite checkpoint")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError) as e:
        tokenizer = _tokenizer_of_data(section)  # a run exported before its tokenizer was written as transformers files
        if tokenizer is None:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            why = why if len(why) <= 240 else why[:240].rsplit(" ", 1)[0] + " ..."  # whole words, marked as cut
            raise ValueError(f"MODEL {p}: no tokenizer could be loaded ({why}); put the tokenizer files "
                             f"(tokenizer.json, tokenizer_config.json) in that folder") from None
    info = {"path": str(p), "weights": weights, "recipe": recipe, "plan": None}
    if recipe is not None:
        info["plan"] = _convert(model, recipe, plan, p, section, backend)
        if state.get("controller_step") is not None:
            # random bits (averis's stochastic rounding) are seeded by step: the run's validation drew the checkpoint's
            # (step 0 gave averis 6.69891 for a run's val_loss of 6.69856); an older checkpoint without it: step 0
            from ..nn.convert import load_controller_state

            load_controller_state(model, {"step": state["controller_step"]})
    return LoadedModel(model=model.to(device).eval(), tokenizer=tokenizer, info=info,
                       run_config=section.get("config") if section else None,
                       data_dir=section.get("data_dir") if section else None,
                       run_world_size=_run_world_size(p, section))


def _convert(model, recipe_name: str, plan_path: str | None, folder: Path, section: dict | None, backend: str):
    """Convert ``model`` to ``recipe_name``'s numerics; returns the plan file used (or None)."""
    from ..nn import convert_model
    from ..patterns import Plan
    from ..recipes import get_recipe

    recipe = get_recipe(recipe_name)
    plan = None
    if recipe.calibration is not None:  # AdaHOP: the strategies come from the run's frozen plan
        plan_path = plan_path or (str(folder / "plan.json") if (folder / "plan.json").exists() else None)
        if plan_path is None:
            raise ValueError(f"--recipe {recipe_name} needs a frozen AdaHOP plan and {folder} has no plan.json; pass "
                             f"--plan PLAN.json (from a run or `adahop analyze`), or a fixed recipe such as mxfp4")
        try:
            plan = Plan.load(plan_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"--plan {plan_path}: {e}; pass a plan.json written by `adahop train` or `adahop analyze`") from None
    elif plan_path is not None:
        raise ValueError(f"--plan is for AdaHOP recipes; --recipe {recipe_name} has fixed strategies. Drop --plan")
    seed = (section or {}).get("config", {}).get("seed", 0)
    convert_model(model, recipe, seed=seed, plan=plan, backend=backend)
    if plan is not None:  # a larger model's plan covers every layer of this one, so conversion alone accepts it
        from ..nn import LowPrecisionLinear

        converted = {n for n, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}
        foreign = [n for n in plan.layers if n not in converted]
        if foreign:
            raise ValueError(f"--plan {plan_path} has entries for {len(foreign)} layer(s) this model does not have "
                             f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): it was made for another "
                             f"model; pass the plan.json of the run MODEL is")
    return plan_path


def _newest_checkpoint(run: Path):
    """``(model, checkpoint folder, its weights file, master format)`` of a run's newest checkpoint, or None when it
    has none. A live run may prune the checkpoint between the choice and the read: then the new newest is read.

    Raises:
        ValueError: the checkpoints changed under two reads in a row, or the weights cannot be read."""
    import transformers

    from ..models import _dtype_kwarg
    from ..train.checkpoint import latest_checkpoint

    for attempt in range(2):
        ck = latest_checkpoint(run)
        if ck is None:
            return None
        ck_weights = ck / "model.safetensors" if (ck / "model.safetensors").is_file() else None
        sharded = ck_weights is None and any(ck.glob("*.distcp"))  # a ddp/fsdp run's (torch.distributed.checkpoint)
        if ck_weights is None and not sharded:
            return None
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(run),
                                                             **_dtype_kwarg(torch.float32))
        try:
            if sharded:
                return _sharded_master_weights(model, ck)
            with unreadable_weights(ck_weights):
                return model, ck, ck_weights, _load_weights(model, ck_weights)
        except FileNotFoundError:
            if attempt:
                raise ValueError(f"MODEL {run}: its checkpoints changed while they were read twice (the run is writing "
                                 f"and pruning them); try again, or wait for the run to end") from None
    return None


def _sharded_master_weights(model: torch.nn.Module, ck: Path):
    """``(model, ck, ck, master format)`` with a data-parallel run's checkpoint folder ``ck`` (its shards, written by
    :func:`adahop.train.distributed.save_sharded`) read into the FP32 ``model`` in this one process, BF16 masters
    widened exactly; None (the caller takes the BF16 export, and this warns why) when the shards do not load: a
    shard or the metadata missing or damaged.

    Raises:
        FileNotFoundError: the folder is gone (a live run pruned it): the caller reads the new newest."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled...": one process is what is meant here
            warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
            meta = dcp.FileSystemReader(str(ck)).read_metadata().state_dict_metadata
            dtypes = {meta[f"model.{k}"].properties.dtype for k, v in state.items() if v.is_floating_point() and v.ndim == 2}
            dcp.load({"model": state}, checkpoint_id=ck, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; the export still scores
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if not ck.exists():
            raise FileNotFoundError(ck) from None
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"warning: {ck}: its shards do not load into the model in one process ({type(e).__name__}: "
              f"{why[:200]}); scoring the BF16 export instead", file=sys.stderr)
        return None
    fmt = "/".join(sorted({"bf16" if d == torch.bfloat16 else "fp32" if d == torch.float32 else str(d) for d in dtypes}))
    return model, ck, ck, fmt or "fp32"


def _run_world_size(run: Path, section: dict | None) -> int:
    """:attr:`LoadedModel.run_world_size` of the folder ``run`` with config.json's "adahop" ``section``."""
    if not section:
        return 1
    if section.get("world_size"):
        return int(section["world_size"])
    try:
        return int(json.loads((run / "summary.json").read_text())["world_size"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    from ..train.checkpoint import latest_checkpoint

    ck = latest_checkpoint(run)  # an unfinished run of an older adahop: one shard file a rank (__RANK_0.distcp)
    return max(len(list(ck.glob("__*_0.distcp"))), 1) if ck is not None else 1


def _checkpoint_state(ck: Path) -> dict:
    """The checkpoint folder ``ck``'s state.json, or {} when it cannot be read."""
    try:
        return json.loads((ck / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _warn_if_unfinished(run: Path, step: int | None, section: dict) -> None:
    """Warn when the newest checkpoint's ``step`` is short of the run's --steps (an interrupted or running run),
    so that its score is not taken for the finished model's."""
    steps = section.get("config", {}).get("steps")
    if step is not None and steps is not None and step < steps:
        print(f"warning: MODEL {run} is unfinished: scoring its checkpoint of step {step} of --steps {steps}; "
              f"let the run finish, or continue it with `adahop train --out {run} --resume` and its settings",
              file=sys.stderr)  # a print: a warning would show this module's source line to the user


def _tokenizer_of_data(section: dict | None):
    """The transformers tokenizer of the prepared data folder a run names, or None (no run, no folder)."""
    data_dir = Path(section["data_dir"]) if section and section.get("data_dir") else None
    if data_dir is None or not (data_dir / "manifest.json").is_file():
        return None
    from ..data import Manifest

    return Manifest.load(data_dir).load_tokenizer(data_dir).to_transformers()
