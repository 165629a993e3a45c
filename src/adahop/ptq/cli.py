"""`adahop ptq MODEL`: post-training quantization (RTN, GPTQ; RHT or HARP incoherence) of a trained model.

    adahop ptq runs/lv2 --method harp-gptq --bits 2 --calib-data data/sotu --out runs/lv2-harp2
    adahop ptq runs/lv2 --method rht-gptq --bits 4 --quantizer mxfp4 --calib-data data/sotu --out runs/lv2-mx4

Calibration uses the train split of ``--calib-data``, perplexity its val split. The printed
perplexity is that of the written folder reloaded from disk (BF16 weights), so any tool that loads
``--out`` measures the same number at the same window (``seq_len`` in ptq.json and in config.json's
``adahop_ptq``, which `adahop eval` of the folder takes by default). The baseline it is compared with (``baseline`` in ptq.json, and
Δ ppl) is the unquantized model rounded to BF16, as its own BF16 export would reload: deployment
against deployment. ``baseline_fp32`` is the model as loaded (a run's FP32 master weights). This module
imports nothing heavy at the top.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

__all__ = ["add_arguments", "check_options", "run"]


# The options only some methods use, with their defaults: a value other than the default under a method
# that ignores it is refused (it would change nothing, and ptq.json would not say so).
_METHOD_DEFAULTS = {"damp": 0.01, "harp_steps": 1200, "harp_lr": 0.03, "hbd_lambda": 0.1, "hbd_block": 8, "radix": 8,
                    "max_radix": 8, "passes": 1, "mixer": "had_or_qr", "theta_format": "fp16"}
_GPTQ_ONLY = ("damp",)
_HARP_ONLY = ("harp_steps", "harp_lr", "hbd_lambda", "hbd_block", "radix", "max_radix", "passes", "mixer", "theta_format")
_EVAL_TASKS_ONLY = ("eval_limit", "eval_max_length", "task_data")


def _method_options(method: str) -> tuple[str, ...]:
    """The options of :data:`_METHOD_DEFAULTS` that ``method`` uses."""
    return (_GPTQ_ONLY if "gptq" in method else ()) + (_HARP_ONLY if method.startswith("harp-") else ())


DEFAULT_CALIB_TOKENS = 131072
#: The methods whose quantization reads no Hessian (plain round to nearest, after the RHT or not).
HESSIAN_FREE = ("rtn", "rht-rtn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `adahop ptq`."""
    from .names import METHODS, MIXERS, QUANTIZERS, THETA_FORMATS

    p.add_argument("model", metavar="MODEL", help="a run folder of `adahop train`, or a transformers causal-LM folder")
    p.add_argument("--method", required=True, choices=METHODS, help="backend, optionally after RHT or HARP incoherence")
    p.add_argument("--bits", required=True, type=int, choices=(2, 3, 4), help="bits per weight code")
    p.add_argument("--quantizer", default="int", choices=QUANTIZERS,
                   help="int (symmetric, FP16 group scales), mxfp4 (E8M0 per 32) or nvfp4 (E4M3 per 16); the last two need --bits 4")
    p.add_argument("--group-size", type=int, default=None, metavar="G", help="input columns per scale of --quantizer int (default 128)")
    p.add_argument("--calib-data", required=True, metavar="DATA", help="an `adahop data prepare` folder: calibration from its "
                   "train split, perplexity on its val split")
    p.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                   help=f"calibration tokens (default {DEFAULT_CALIB_TOKENS}; for rtn and rht-rtn, which read no Hessian, "
                        "one batch)")
    p.add_argument("--out", required=True, metavar="DIR", help="the quantized transformers folder, packed artifact and ptq.json")
    g = p.add_argument_group("evaluation")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per window, calibration and perplexity (default: the run's; for another model "
                   "its max_position_embeddings, at most 2048)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    g.add_argument("--eval-batches", type=int, default=None, metavar="N", help="perplexity on the first N val batches (default: all)")
    g.add_argument("--skip-baseline", action="store_true", help="do not score the unquantized model (its BF16 copy, "
                   "which Δ ppl is against, and the FP32 weights as loaded; with --eval-tasks, its zero-shot scores)")
    g.add_argument("--eval-tasks", default=None, help="also score these zero-shot tasks (as `adahop eval --tasks`)")
    g.add_argument("--eval-limit", type=int, default=None, metavar="N", help="first N documents of each task")
    g.add_argument("--eval-max-length", type=int, default=None, metavar="TOKENS",
                   help="context window of --eval-tasks, as `adahop eval --max-length` (default: the model's "
                        "max_position_embeddings, the run's --seq-len)")
    g.add_argument("--task-data", default=None, metavar="DIR", help="as `adahop eval --task-data`")
    g = p.add_argument_group("GPTQ and HARP")
    d = _METHOD_DEFAULTS
    g.add_argument("--damp", type=float, default=d["damp"], help="GPTQ damping, a fraction of mean(diag H) (default 0.01)")
    g.add_argument("--harp-steps", type=int, default=d["harp_steps"], help="Adam steps per layer (default 1200, the paper's)")
    g.add_argument("--harp-lr", type=float, default=d["harp_lr"], help="Adam learning rate (default 0.03)")
    g.add_argument("--hbd-lambda", type=float, default=d["hbd_lambda"],
                   help="weight of H̃'s off-block-diagonal energy (default 0.1)")
    g.add_argument("--hbd-block", type=int, default=d["hbd_block"], help="block of that term (default 8)")
    g.add_argument("--radix", type=int, default=d["radix"], help="HARP's preferred radix (default 8)")
    g.add_argument("--max-radix", type=int, default=d["max_radix"], help="largest other radix (default 8)")
    g.add_argument("--passes", type=int, default=d["passes"], help="repeats of the staged product (default 1)")
    g.add_argument("--mixer", default=d["mixer"], choices=MIXERS, help="fixed block mixer M_b (default had_or_qr)")
    g.add_argument("--theta-format", default=d["theta_format"], choices=THETA_FORMATS,
                   help="how the packed artifact stores the rotation parameters: fp16 (default), or int8 with one FP16 "
                        "scale per block (about half the rotation's bits; the fit is rounded to it before quantizing)")
    g.add_argument("--seed", type=int, default=0, help="random signs, calibration windows and QR mixers")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")


def check_options(argv: list[str]) -> None:
    """Check `adahop ptq`'s options ``argv`` (MODEL and ``--out`` included, neither read) as the command would
    before loading anything: the ranges, the options the method leaves unused, and the grid (``--group-size`` with
    ``--quantizer``). For a launcher that builds many commands (``scripts/run_ptq_experiment.py --dry-run``).

    Raises:
        ValueError: the option and the fix, as `adahop ptq` words it (argparse's own errors as its message).
    """
    from .grids import make_grid

    p = argparse.ArgumentParser(prog="adahop ptq", exit_on_error=False)
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:  # a missing required option still exits, exit_on_error or not
        raise ValueError(f"adahop ptq {' '.join(argv)}: {e}") from None
    _check_options(args)
    make_grid(args.quantizer, args.bits, args.group_size)


def _check(args) -> None:
    _check_options(args)
    _check_paths(args)


def _check_options(args) -> None:
    """The checks of :func:`_check` that read no file."""
    for flag in ("calib_tokens", "batch_size", "seq_len", "eval_batches", "eval_limit", "eval_max_length", "harp_steps",
                 "passes", "hbd_block"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {v}: must be >= 1")
    for flag in ("radix", "max_radix"):  # named here: HARPRotation's own message names its arguments, not the flags
        if getattr(args, flag) < 2:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 2 (a stage mixes blocks of that size)")
    for flag, low, why in (("harp_lr", "> 0", ""), ("hbd_lambda", ">= 0", ""),
                           ("damp", "> 0", " (GPTQ needs H + damp·I positive definite)")):
        v = getattr(args, flag)
        if not math.isfinite(v) or not (v > 0 if low == "> 0" else v >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} {v}: must be finite and {low}{why}")
    used = _method_options(args.method)
    for flags, methods in ((_GPTQ_ONLY, "gptq, rht-gptq or harp-gptq"), (_HARP_ONLY, "harp-rtn or harp-gptq")):
        for flag in flags:
            if flag not in used and getattr(args, flag) != _METHOD_DEFAULTS[flag]:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is unused by --method "
                                 f"{args.method}; drop it, or pass --method {methods}")
    from ..utils import refuse_unused

    if args.eval_tasks is None or args.eval_tasks.strip().lower() == "none":
        refuse_unused(args, _EVAL_TASKS_ONLY, "the zero-shot tasks and no --eval-tasks is given",
                      "add --eval-tasks piqa,... or drop it")


def _check_paths(args) -> None:
    """The checks of :func:`_check` of ``--out`` and MODEL."""
    from ..utils import check_out_path

    out = Path(args.out)
    from .export import RESULTS_FILE

    check_out_path(args.out, "--out", folder=True)  # the string: Path("") is "."

    if (out / RESULTS_FILE).exists():
        raise ValueError(f"--out {out} already holds a quantized model ({RESULTS_FILE}); pass another --out or delete it")
    model = Path(args.model).resolve()
    if out.resolve() == model:
        raise ValueError(f"--out {out} is MODEL itself: the quantized folder would replace the model's config.json and "
                         f"weights (a run's export and its training section); pass another --out")
    if out.resolve().is_relative_to(model):
        raise ValueError(f"--out {out} is inside MODEL {args.model} (a run's checkpoints or exports live there); "
                         f"pass a folder outside it")
    ours = "adahop_ptq" in _read_config(out / "config.json")  # a failed attempt of ours (no ptq.json): may be redone
    if (out / "config.json").is_file() and not ours:
        raise ValueError(f"--out {out} holds another model or run (its config.json is not one `adahop ptq` wrote), "
                         f"which the quantized folder would overwrite; pass a new --out")
    held = [p for p in out.iterdir() if p.name != ".lock"] if out.is_dir() else []  # .lock: an `adahop ptq`'s own
    if not ours and held:  # e.g. the --calib-data folder, or a model without config.json
        names = ", ".join(sorted(p.name for p in held)[:4])
        raise ValueError(f"--out {out} already holds files ({names}, ...) that the quantized folder could overwrite; "
                         f"pass a new or empty --out")
    source = _read_config(model / "config.json").get("adahop_ptq")
    if source:
        raise ValueError(f"MODEL {args.model} is already quantized by `adahop ptq` ({source.get('method')}, "
                         f"{source.get('bits')} bits): quantizing it again would score against the quantized model and hide "
                         f"the first quantization's loss; quantize its source model ({source.get('source_model')}) instead")


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _data(args, run_config: dict | None) -> Path:
    """The prepared folder of ``--calib-data`` (what ``adahop train --data`` takes is prepared once,
    text other than the run's corpus with the model's own tokenizer)."""
    from ..eval.perplexity import prepared_data

    return prepared_data(args.calib_data, run_config, args.model)


def run(args: argparse.Namespace) -> dict:
    """Run `adahop ptq`; returns the results written to ``DIR/ptq.json``. Raises ValueError for bad input, and
    for an ``--out`` another `adahop ptq` is writing (``DIR/.lock``, held from the end of the checks to the end:
    two into one folder each printed "wrote DIR", and the folder held the last one's model under the first
    one's numbers, or a mix).

    ``baseline`` (which Δ ppl is against) is the perplexity of the unquantized model rounded to BF16,
    ``baseline_fp32`` that of the model as loaded, ``baseline_zero_shot`` (with ``--eval-tasks``) the BF16 copy's
    zero-shot scores; all None with ``--skip-baseline``.
    """
    _check(args)
    from .grids import make_grid

    make_grid(args.quantizer, args.bits, args.group_size)  # a bad combination fails before anything loads
    tasks = _tasks(args)  # so do unknown tasks, a missing lm-eval or task data: not after hours of quantization
    from ..eval.model import load_model
    from ..eval.perplexity import check_same_tokenizer
    from ..train.setup import resolve_device
    from .calibrate import calibration_batches
    from .fit import FitOptions
    from .quantize import RotationOptions

    fit_opts = FitOptions(steps=args.harp_steps, lr=args.harp_lr, hbd_lambda=args.hbd_lambda, hbd_block=args.hbd_block)
    rot_opts = RotationOptions(radix=args.radix, max_radix=args.max_radix, passes=args.passes, mixer=args.mixer,
                               theta_format=args.theta_format)
    device = resolve_device(args.device)
    bf16 = device.type == "cuda"  # perplexity as `adahop train` validates: BF16 autocast on CUDA, FP32 on CPU
    t_start = time.perf_counter()
    loaded = load_model(args.model, device=device)
    model, rc = loaded.model, loaded.run_config or {}
    from .calibrate import block_linears, check_unshared, decoder_blocks, unquantized_weights

    prefix, blocks = decoder_blocks(model)  # an architecture it cannot quantize is refused before any check of the windows or data
    check_unshared(blocks, prefix)
    left, left_names = unquantized_weights(blocks)
    if left:  # e.g. a mixture of experts' fused expert tensors: say how much of the model stays as it is
        total = left + sum(lin.weight.numel() for b in blocks for _, lin in block_linears(b))
        warnings.warn(f"adahop: {left:,} of the decoder blocks' {total:,} matrix weights ({left / total:.0%}) are not in "
                      f"nn.Linear layers and stay unquantized (e.g. {', '.join(left_names)}): bits/weight and the "
                      "perplexity are those of the linears alone quantized")
    with _named("--data", "--calib-data"):
        data = _data(args, rc)
        check_same_tokenizer(data, Path(args.model), model.config.vocab_size, flag="--calib-data")
    if args.method.startswith("rht-"):
        _check_rht_dims(model, args.method)  # each layer's check came only when its block was reached
    if args.method.startswith("harp-") and args.hbd_lambda > 0:
        _check_hbd_block(model, args.hbd_block)
    from ..eval.model import check_window, warn_beyond_training
    from ..eval.perplexity import default_window, scored_batches

    seq_len = args.seq_len or default_window(rc, getattr(model.config, "max_position_embeddings", None))
    check_window(model, seq_len, "--seq-len")
    check_window(model, args.eval_max_length if tasks is not None else None, "--eval-max-length")
    warn_beyond_training(rc.get("seq_len"), "--seq-len", seq_len, "calibrates and scores")
    warn_beyond_training(rc.get("seq_len"), "--eval-max-length", args.eval_max_length if tasks is not None else None)

    # both splits are checked now: a val split short of one batch failed only after the whole quantization
    shown = data if Path(args.calib_data).resolve() == Path(data).resolve() else f"{args.calib_data} (prepared into {data})"
    try:
        with _named("the val split", f"--calib-data {shown}: the val split"):
            scored_batches(data, "val", seq_len=seq_len, batch_size=args.batch_size, max_batches=args.eval_batches)
    except ValueError as e:
        msg = str(e)
        if shown != data:  # text prepared here: its val split is a fixed share of it; say how to prepare a larger one
            msg += (f"; or prepare the text with a larger validation share, `adahop data prepare --source {args.calib_data} "
                    f"--tokenizer hf:{args.model} --val-fraction 0.2 --out DIR`, and pass --calib-data DIR")
        raise ValueError(msg) from None
    if args.calib_tokens is None:  # RTN reads no Hessian: one batch carries the blocks' inputs forward, and fits any split
        args.calib_tokens = args.batch_size * seq_len if args.method in HESSIAN_FREE else DEFAULT_CALIB_TOKENS
    batches = calibration_batches(data, tokens=args.calib_tokens, seq_len=seq_len, batch_size=args.batch_size, seed=args.seed)
    from ..utils import folder_locked

    with folder_locked(Path(args.out), "adahop ptq"):  # every refusal is behind: only now may --out be created
        _check(args)  # again under the lock: another `adahop ptq` may have finished into --out since the first check
        return _quantize_and_write(args, _Checked(t_start, loaded, data, seq_len, batches, tasks, device, bf16, left,
                                                  fit_opts, rot_opts))


@dataclasses.dataclass(frozen=True)
class _Checked:
    """What :func:`run` resolved and checked before ``--out`` is locked, for :func:`_quantize_and_write`."""
    t_start: float  # time.perf_counter() at the start of the run (the results' seconds_total)
    loaded: object  # adahop.eval.model.LoadedModel of --model
    data: Path  # the prepared calibration/validation folder
    seq_len: int
    batches: list  # calibration batches
    tasks: object  # zero-shot tasks to score after the export (None: none)
    device: object  # torch.device
    bf16: bool  # perplexity under BF16 autocast (CUDA)
    left: int  # matrix weights of the decoder blocks outside nn.Linear (stay unquantized)
    fit_opts: object  # adahop.ptq.fit.FitOptions
    rot_opts: object  # adahop.ptq.quantize.RotationOptions


def _quantize_and_write(args, c: _Checked) -> dict:
    """The rest of :func:`run` once every check passed and ``--out`` is locked: baseline, quantization, export."""
    import torch

    from ..eval.model import load_model
    from ..eval.perplexity import DATA_SETTINGS, perplexity
    from ..train.export import git_revision
    from ..utils import atomic_write_text
    from .calibrate import quantize_model
    from .export import PACKED_FILE, RESULTS_FILE, save_quantized
    from .grids import make_grid
    from .quantize import fit_block, quantize_layer

    model, rc = c.loaded.model, c.loaded.run_config or {}

    def ppl(m):
        with torch.no_grad():
            return perplexity(m, c.data, split="val", seq_len=c.seq_len, batch_size=args.batch_size,
                              max_batches=args.eval_batches, device=c.device, bf16=c.bf16)

    base = base_fp32 = base_zs = None
    if not args.skip_baseline:
        deployed = _bf16_rounded(model)
        base = ppl(deployed)
        base_fp32 = base if deployed is model else ppl(model)
        if c.tasks is not None:  # the unquantized row's zero-shot scores, beside the quantized one's in the table
            # (an answer longer than the window is refused here, before anything is quantized)
            base_zs = _zero_shot(args, SimpleNamespace(model=deployed, tokenizer=c.loaded.tokenizer), c.bf16, *c.tasks)
        del deployed
    gen = torch.Generator().manual_seed(args.seed)
    grid0 = make_grid(args.quantizer, args.bits, args.group_size)

    fitted = {}

    def prepare(items):  # harp-*: a block's layers of one shape share one fit (fewer, larger launches)
        fitted.clear()
        fitted.update(fit_block(items, args.method, make_grid(args.quantizer, args.bits, args.group_size), generator=gen,
                                rot_opts=c.rot_opts, fit_opts=c.fit_opts, seed=args.seed))

    def quantize(name, w, h):
        try:
            return quantize_layer(w, h, args.method, make_grid(args.quantizer, args.bits, args.group_size), generator=gen,
                                  rot_opts=c.rot_opts, fit_opts=c.fit_opts, damp=args.damp, seed=args.seed, fitted=fitted.get(name))
        except ValueError as e:  # name the layer: nothing is written
            raise ValueError(f"{name}: {e}") from None

    t_q = time.perf_counter()
    layers = quantize_model(model, c.batches, quantize, device=c.device, prepare=prepare)
    quant_s = time.perf_counter() - t_q
    n_weights = sum(r.weight.numel() for r in layers.values())
    bpw = sum(r.stored_bits for r in layers.values()) / n_weights
    meta = {"method": args.method, "bits": args.bits, "quantizer": args.quantizer, "group_size": grid0.group_size,
            "unquantized_block_weights": c.left,
            "seed": args.seed, "rotation": {k: getattr(c.rot_opts, k) for k in c.rot_opts.__slots__},
            # the method's own settings (rotation's are above), so that a folder says how it was made
            "method_options": {k: getattr(args, k) for k in _method_options(args.method) if k not in c.rot_opts.__slots__},
            "source_model": str(Path(args.model).resolve()), "source": c.loaded.info,  # which weights (a checkpoint's?)
            "calib_data": str(c.data), "calib_tokens": len(c.batches) * args.batch_size * c.seq_len,
            # what `adahop eval` of the folder takes by default, so that it scores the number printed here: the
            # window, the batching (a last partial batch is left out) and how the text was prepared (the source
            # run's settings; without them 'default' was prepared anew with another validation share)
            "seq_len": c.seq_len, "batch_size": args.batch_size, "eval_batches": args.eval_batches,
            "data_settings": {k: rc[k] for k in DATA_SETTINGS if k in rc}}
    out = Path(args.out)
    save_quantized(model, c.loaded.tokenizer, out, layers, meta)
    del model
    reloaded = load_model(out, device=c.device)  # the number printed is the written folder's
    res_ppl = ppl(reloaded.model)
    fits = [r.stats["harp"] for r in layers.values() if "harp" in r.stats]
    res = {**meta, "bits_per_weight": bpw, "quantized_weights": n_weights, "perplexity": res_ppl, "baseline": base,
           "baseline_fp32": base_fp32, "baseline_zero_shot": base_zs, "seq_len": c.seq_len, "device": str(c.device), "seconds_quantize": quant_s,
           "seconds_total": None,
           "harp_fit_seconds_per_layer": (sum(f["seconds"] for f in fits) / len(fits)) if fits else None,
           "git_revision": git_revision(), "packed": str(out / PACKED_FILE),
           "layers": {n: {"shape": list(r.weight.shape), "stored_bits": r.stored_bits, **r.stats} for n, r in layers.items()}}
    if c.tasks is not None:
        res["eval_max_length"] = args.eval_max_length
        try:
            res["zero_shot"] = _zero_shot(args, reloaded, c.bf16, *c.tasks)
        except ValueError as e:  # e.g. an answer longer than the window: keep the quantization, say how to score it
            msg = str(e)
            res["zero_shot_error"], res["seconds_total"] = msg, time.perf_counter() - c.t_start
            print(_table(res))
            atomic_write_text(out / RESULTS_FILE, json.dumps(res, indent=1))
            raise ValueError(f"{msg}. The quantized model and {RESULTS_FILE} are written to {out}; score it with "
                             f"`adahop eval {out} --tasks {args.eval_tasks}"
                             + (f" --limit {args.eval_limit}" if args.eval_limit else "") + " --max-length N`") from None
    res["seconds_total"] = time.perf_counter() - c.t_start
    print(_table(res))
    atomic_write_text(out / RESULTS_FILE, json.dumps(res, indent=1))  # written last: its presence means finished
    print(f"wrote {out} (transformers folder, {PACKED_FILE}, {RESULTS_FILE}) in {res['seconds_total']:.0f} s")
    return res


def _quantized_linears(model):
    """``(qualified name, nn.Linear)`` of every linear of the decoder blocks: the layers ptq quantizes."""
    from .calibrate import block_linears, decoder_blocks

    prefix, blocks = decoder_blocks(model)
    for i, block in enumerate(blocks):
        for name, lin in block_linears(block):
            yield f"{prefix}.{i}.{name}", lin


def _check_rht_dims(model, method: str) -> None:
    """Raise ValueError, naming the first layer and dimension, when a linear of the decoder blocks
    has a dimension the RHT cannot rotate (:func:`~adahop.ptq.incoherence.rht_block`)."""
    from .incoherence import rht_block

    for name, lin in _quantized_linears(model):
        for d in (lin.out_features, lin.in_features):
            try:
                rht_block(d)
            except ValueError as e:
                raise ValueError(f"--method {method}: layer {name} ({lin.in_features}->{lin.out_features}): {e}") from None


def _check_hbd_block(model, b: int) -> None:
    """Raise ValueError when ``--hbd-block`` is at least a layer's input dimension: the Hessian's
    off-block energy (the λ_hbd term of the fit) is then 0 for it, so ``--hbd-lambda`` silently did nothing."""
    for name, lin in _quantized_linears(model):
        if b >= lin.in_features:
            raise ValueError(f"--hbd-block {b} covers the whole input dimension of {name} ({lin.in_features}), where "
                             f"the off-block term of --hbd-lambda is 0; pass --hbd-block below {lin.in_features}, or "
                             f"--hbd-lambda 0")


def _bf16_rounded(model):
    """A copy of ``model`` whose state dict is rounded to BF16 and held in FP32: the unquantized model as
    its BF16 export (the dtype ``--out`` stores) reloads, so the baseline and the quantized folder are
    scored alike. ``model`` itself when rounding changes nothing (no copy, no second perplexity pass)."""
    import copy

    import torch

    def floats(m):  # what save_pretrained writes: parameters and persistent buffers (RoPE's inv_freq is rebuilt)
        return [t for t in m.state_dict(keep_vars=True).values() if t.is_floating_point()]

    if all(torch.equal(t, t.to(torch.bfloat16).to(t.dtype)) for t in floats(model)):
        return model
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for t in floats(copied):
            t.copy_(t.to(torch.bfloat16))
    return copied


@contextlib.contextmanager
def _named(flag: str, ours: str):
    """Re-raise a ValueError of the shared eval/train code, which names ``flag``, naming ``ours``."""
    try:
        yield
    except ValueError as e:
        msg = str(e)
        if not msg.startswith(flag):
            raise
        raise ValueError(ours + msg[len(flag):]) from None


def _tasks(args) -> tuple[list, Path] | None:
    """The specs and task-data root of ``--eval-tasks`` (None when it is unset or ``none``)."""
    if not args.eval_tasks:
        return None
    from ..eval import harness
    from ..eval.tasks import parse_tasks, task_root

    with _named("--tasks", "--eval-tasks"):
        specs = parse_tasks(args.eval_tasks)
    if not specs:
        return None
    harness.require_lm_eval()
    return specs, task_root(specs, args.task_data)


def _zero_shot(args, loaded, bf16: bool, specs: list, root: Path) -> dict:
    """``loaded.model``'s zero-shot scores; a ValueError of the harness names this command's --eval-max-length."""
    import torch

    from ..eval import harness

    lm = harness.hf_lm(loaded.model, loaded.tokenizer, batch_size=args.batch_size, dtype="bf16" if bf16 else "fp32",
                       max_length=args.eval_max_length)
    try:
        with torch.no_grad():
            return harness.score(lm, specs, root, limit=args.eval_limit)
    except ValueError as e:  # e.g. an answer longer than the window
        raise ValueError(str(e).replace("--max-length", "--eval-max-length")) from None


def _table(res: dict) -> str:
    """The printed table: the unquantized model (when scored) and the quantized one."""
    from ..eval.report import cells

    zs = "zero_shot" in res
    head = "| method | bits | quantizer | bits/weight | perplexity | Δ ppl % |" + (" zero-shot avg |" if zs else "")
    rows = [head, "|" + "---|" * (6 + zs)]
    base = res["baseline"]
    if base is not None:
        base_zs = res.get("baseline_zero_shot")
        rows.append(f"| unquantized | 16 | - | 16 | {base['perplexity']:.4f} | +0.00 |"
                    + ((f" {cells(base_zs)[-1]} |" if base_zs else " - |") if zs else ""))
    p = res["perplexity"]["perplexity"]
    gap = f"{100 * (p / base['perplexity'] - 1):+.2f}" if base is not None else "-"
    row = f"| {res['method']} | {res['bits']} | {res['quantizer']} | {res['bits_per_weight']:.3f} | {p:.4f} | {gap} |"
    if zs:
        row += f" {cells(res['zero_shot'])[-1]} |"
    rows.append(row)
    return "\n".join(rows)
