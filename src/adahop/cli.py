"""The `adahop` command line: data prepare, train, compare, recipes, analyze, bench, eval."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

__all__ = ["main", "build_parser"]


def _add_config_flags(p: argparse.ArgumentParser, cls, *, skip=()) -> None:
    """One ``--flag`` per dataclass field, typed from the annotation, help from its docstring."""
    from .train.config import field_docs

    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = hints[f.name]
        base = next((a for a in typing.get_args(t) if a is not type(None)), t)
        help_ = f"{docs.get(f.name, '')} (default: {f.default})"
        if base is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            p.add_argument(flag, type=base, default=f.default, help=help_, metavar=f.name.upper())


def _config_from(args, cls, **override):
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(args).items() if k in fields}
    kw.update(override)
    return cls(**kw)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every ``adahop`` subcommand."""
    from .train.config import TrainConfig

    p = argparse.ArgumentParser(prog="adahop", description="Train LLMs with MXFP4 GEMMs at BF16 quality (AdaHOP).")
    sub = p.add_subparsers(dest="cmd", required=True)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_cmd", required=True)
    prep = data.add_parser("prepare", help="tokenize text into train/val token shards")
    prep.add_argument("--source", action="append", required=True,
                      help="'default', a .txt/.jsonl/.parquet file or folder (.xz/.gz/.zst ok), or hf:NAME[:CONFIG][:SPLIT]; repeatable")
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--tokenizer", default="bpe", help="bpe (trained on the corpus), gpt2, tiktoken:PATH, hf:NAME")
    prep.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="held-out share, spread across the corpus")
    prep.add_argument("--text-field", default="text", help="the JSONL field / Parquet or dataset column holding the text")
    prep.add_argument("--seed", type=int, default=0)

    tr = sub.add_parser("train", help="pretrain a model from scratch with a recipe")
    _add_config_flags(tr, TrainConfig)

    cmp = sub.add_parser("compare", help="train several recipes on the same data; table and plots")
    cmp.add_argument("--recipes", default="bf16,adahop-lv2", help="comma-separated recipe names")
    _add_config_flags(cmp, TrainConfig, skip=("recipe", "resume"))
    cmp.set_defaults(out="runs/compare")
    cmp.add_argument("--eval-tasks", default=None, help="after training, `adahop eval` each recipe on these tasks "
                     "(e.g. piqa,hellaswag,arc_easy,lambada_openai) and add their columns")
    cmp.add_argument("--eval-limit", type=int, default=None, help="`adahop eval --limit` of --eval-tasks")
    cmp.add_argument("--task-data", default=None, help="`adahop eval --task-data` of --eval-tasks")

    sub.add_parser("recipes", help="list the recipe presets and what each GEMM does")

    an = sub.add_parser("analyze", help="outlier-pattern census and the paper's figures")
    from .analysis.cli import add_arguments as add_analyze

    add_analyze(an)

    bench = sub.add_parser("bench", help="speed and memory against BF16 and other MXFP4 emulations")
    from .bench import add_arguments as add_bench

    add_bench(bench)

    ev = sub.add_parser("eval", help="zero-shot tasks (lm-eval, offline data) and perplexity of a trained model")
    from .eval.cli import add_arguments as add_eval  # light: heavy imports happen inside run()

    add_eval(ev)
    return p


def _leave_error(args, message: str) -> None:
    """A failed ``train`` leaves its error in ``--out``/error.txt, where ``compare`` points."""
    if args.cmd != "train" or not getattr(args, "out", None):
        return
    from .train.setup import ERROR_FILE

    try:
        (Path(args.out) / ERROR_FILE).write_text(message + "\n")
    except OSError:  # no folder there (or not writable): stderr already has it
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the ``adahop`` command line; returns the exit code (2 for a bad option, named in the message)."""
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "data":
            from .data import prepare

            m = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                        val_fraction=args.val_fraction, seed=args.seed, text_field=args.text_field)
            print(f"wrote {args.out}: train {m.train.tokens:,} tokens, val {m.val.tokens:,} tokens, "
                  f"tokenizer {m.tokenizer.name} (vocab {m.tokenizer.vocab_size})")
        elif args.cmd == "train":
            from .train import TrainConfig, train
            from .train.distributed import init_from_env, shutdown

            cfg = _config_from(args, TrainConfig)
            d = init_from_env(cfg.device)  # under torchrun (WORLD_SIZE set): join the process group
            try:
                s = train(cfg, rank=d.rank, world=d.world)
            finally:
                shutdown()
            if s.get("interrupted"):  # the checkpoint is written; a script must not take this for a finished run
                return 130
            if d.is_main:
                tps = f"{s['tok_per_s']:,.0f} tokens/s" if s["tok_per_s"] else "tokens/s not measured (too few steps after warm-up)"
                val = (f"final val loss {s['final_val_loss']}, val bpb {s['final_val_bpb']}" if s["final_val_loss"] is not None
                       else "no validation (--eval-every 0)")
                print(f"{val}, {tps}")
        elif args.cmd == "compare":
            from .train import TrainConfig
            from .train.compare import compare

            cfg = _config_from(args, TrainConfig)
            ev = dict(eval_tasks=args.eval_tasks, eval_limit=args.eval_limit, task_data=args.task_data) if args.eval_tasks else {}
            summaries = compare([r.strip() for r in args.recipes.split(",") if r.strip()], cfg, Path(cfg.out), **ev)
            failed = [r for r, s in summaries.items() if "error" in s]
            if failed:  # the table is written; a script must still see that it is incomplete
                print(f"adahop compare: error: {', '.join(failed)} failed (see the table)", file=sys.stderr)
                return 1
        elif args.cmd == "recipes":
            from .recipes.table import describe_recipes

            print(describe_recipes())
        elif args.cmd == "analyze":
            from .analysis.cli import run

            run(args)
        elif args.cmd == "bench":
            from .bench import run as run_bench

            run_bench(args)
        elif args.cmd == "eval":
            from .eval.cli import run as run_eval

            run_eval(args)
    except ValueError as e:
        print(f"adahop {args.cmd}: error: {e}", file=sys.stderr)
        _leave_error(args, f"adahop {args.cmd}: error: {e}")
        return 2
    except RuntimeError as e:
        from .train.loop import Diverged

        if not isinstance(e, Diverged):
            raise
        print(f"adahop {args.cmd}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # files and network (a download that cannot reach its host): one line, no traceback
        print(f"adahop {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        _leave_error(args, f"adahop {args.cmd}: error: {type(e).__name__}: {e}")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
