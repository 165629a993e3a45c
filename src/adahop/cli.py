"""The `adahop` command line: data prepare, train, compare, recipes, analyze, bench, eval, ptq.

Building the parser imports nothing heavy (no torch, transformers or kernels): ``--help`` and option
errors answer at once; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .train.config import add_config_flags, config_from

__all__ = ["main", "build_parser"]


_BPE_VOCAB = 8192  # `data prepare --vocab-size`'s default


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose option errors (an invalid choice, a missing or mistyped value) are one
    line and a pointer to ``--help``, not the whole usage (``adahop train``'s runs to 40 lines);
    exit code 2, as argparse's. Subcommands inherit it (``add_subparsers`` uses the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nsee `{self.prog} --help`\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unknown option is named by the (sub)command that was given it, with a pointer
        to that command's ``--help`` (argparse names the root, whose help lists no option of a subcommand)."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self
            while True:  # down to the innermost subcommand given
                sub = _subcommands(parser)
                if sub is None or getattr(ns, sub.dest, None) not in sub.choices:
                    break
                parser = sub.choices[getattr(ns, sub.dest)]
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every ``adahop`` subcommand."""
    from .train.config import TrainConfig

    p = _Parser(prog="adahop", description="Train LLMs with MXFP4 GEMMs at BF16 quality (AdaHOP).")
    sub = p.add_subparsers(dest="cmd", required=True)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_cmd", required=True)
    prep = data.add_parser("prepare", help="tokenize text into train/val token shards")
    prep.add_argument("--source", action="append", required=True,
                      help="'default', a .txt/.jsonl/.parquet file or folder (.xz/.gz/.zst ok), or hf:NAME[:CONFIG][:SPLIT]; repeatable")
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--tokenizer", default="bpe", help="bpe (trained on the corpus), gpt2, tiktoken:PATH, hf:NAME (default: %(default)s)")
    prep.add_argument("--vocab-size", type=int, default=_BPE_VOCAB, help="BPE vocabulary size (default: %(default)s)")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="held-out share, spread across the corpus (default: %(default)s)")
    prep.add_argument("--text-field", default="text", help="the JSONL field / Parquet or dataset column holding the text (default: %(default)s)")
    prep.add_argument("--seed", type=int, default=0, help="seed of which blocks go to the val split (default: %(default)s)")
    prep.add_argument("--overwrite", action="store_true", help="replace the data already prepared in --out")

    tr = sub.add_parser("train", help="pretrain a model from scratch with a recipe")
    add_config_flags(tr, TrainConfig)

    cmp = sub.add_parser("compare", help="train several recipes on the same data; table and plots")
    cmp.add_argument("--recipes", default="bf16,adahop-lv2", help="comma-separated recipe names")
    add_config_flags(cmp, TrainConfig, skip=("recipe", "resume", "reschedule", "parallel"), defaults={"out": "runs/compare"})
    cmp.add_argument("--eval-tasks", default=None, help="after training, `adahop eval` each recipe on these tasks "
                     "(e.g. piqa,hellaswag,arc_easy,lambada_openai) and add their columns")
    cmp.add_argument("--eval-limit", type=int, default=None, help="`adahop eval --limit` of --eval-tasks")
    cmp.add_argument("--eval-max-length", type=int, default=None, metavar="TOKENS",
                     help="`adahop eval --max-length` of --eval-tasks (default: the --seq-len window; PIQA needs 512 "
                          "at --seq-len 128)")
    cmp.add_argument("--task-data", default=None, help="`adahop eval --task-data` of --eval-tasks")

    rec = sub.add_parser("recipes", help="list the recipe presets and what each GEMM does")
    rec.add_argument("names", nargs="*", metavar="NAME",
                     help="only these recipes, variants included (e.g. mxfp4-had@only-wgrad); default: every preset")

    an = sub.add_parser("analyze", help="outlier-pattern census and the paper's figures")
    from .analysis.options import add_arguments as add_analyze

    add_analyze(an)

    bench = sub.add_parser("bench", help="speed and memory against BF16 and other MXFP4 emulations")
    from .bench.options import add_arguments as add_bench

    add_bench(bench)

    ev = sub.add_parser("eval", help="zero-shot tasks (lm-eval, offline data) and perplexity of a trained model")
    from .eval.cli import add_arguments as add_eval  # light: heavy imports happen inside run()

    add_eval(ev)

    pq = sub.add_parser("ptq", help="post-training quantization: RTN / GPTQ, with RHT or HARP rotations, 2-4 bits")
    from .ptq.cli import add_arguments as add_ptq  # light: heavy imports happen inside run()

    add_ptq(pq)
    _name_commands(p)
    return p


def _subcommands(parser: argparse.ArgumentParser):
    """``parser``'s group of subcommands (its ``add_subparsers`` action), or None."""
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand group the metavar its help shows, ``{linear,model}``: argparse names a missing
    one by its dest otherwise ("the following arguments are required: bench_cmd")."""
    sub = _subcommands(parser)
    if sub is not None:
        sub.metavar = sub.metavar or "{" + ",".join(sub.choices) + "}"
        for child in sub.choices.values():
            _name_commands(child)


def _leave_error(args, message: str) -> None:
    """A failed ``train`` leaves its error in ``--out``/error.txt, where ``compare`` points: the
    one-line ``message`` first (what ``compare`` shows), then any detail (a traceback). Under torchrun the
    first rank to fail writes it and names itself: the others' errors (a peer that closed its connection) come
    after, and overwrote the cause."""
    if args.cmd != "train" or not getattr(args, "out", None):
        return
    from .train.config import ERROR_FILE

    out = Path(args.out)
    if (out / "manifest.json").exists() or (out / "ptq.json").exists():  # refused as --out: data, a PTQ folder, not a run's
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        first, _, rest = message.partition("\n")
        message = f"{first}\n(rank {os.environ.get('RANK', '?')} of {world}, the first rank to fail)" + (f"\n{rest}" if rest else "")
    try:
        with open(out / ERROR_FILE, "x" if world > 1 else "w") as f:  # "x": a later rank's error leaves the first's
            f.write(message + "\n")
    except OSError:  # no folder there (or not writable, the disk full, or another rank wrote first): stderr has it
        pass


def _holds_finished_run(out: str) -> bool:
    """Whether ``--out`` holds a run that ended (its export and a summary not marked interrupted): an error.txt
    there would say the run failed. Compare's refused children keep theirs: compare reruns unfinished ones only."""
    p = Path(out) if out and out.strip() else None
    try:
        return (p is not None and (p / "model.safetensors").is_file()
                and not json.loads((p / "summary.json").read_text()).get("interrupted", False))
    except (OSError, ValueError):
        return False


def _one_line_warnings() -> None:
    """Show adahop's own warnings (their text starts with "adahop") as ``warning: MESSAGE`` lines, as the
    commands print theirs; Python's default format adds the file, the line number and the source line
    of the call. Other libraries' warnings keep that format."""
    import warnings

    default = warnings.formatwarning
    if getattr(default, "_adahop", False):  # main() runs many times in one process (tests): wrap once
        return

    def fmt(message, category, filename, lineno, line=None):
        text = str(message)
        if not text.startswith("adahop"):
            return default(message, category, filename, lineno, line)
        return f"warning: {text.removeprefix('adahop: ')}\n"

    fmt._adahop = True
    warnings.formatwarning = fmt


def _quiet_imports() -> None:
    """Import transformers' model code with two third-party loggers muted. When torchao is installed
    (the test extras), transformers imports it for its torchao quantizer, which adahop never uses;
    torchao then logs that its CUDA extensions do not load here, and torch logs a deprecation of
    torchao's pytree registrations. Neither concerns an adahop run; anything logged later is shown."""
    import logging

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import transformers.modeling_utils  # noqa: F401  (imports torchao when it is installed)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _prepare(args) -> None:
    """`adahop data prepare`: refuses to replace a prepared --out unless --overwrite (runs may train on
    it), and --vocab-size with a tokenizer that brings its own; says which vocabulary was used."""
    from .utils import check_out_path

    check_out_path(args.out, "--out", folder=True)
    if args.tokenizer != "bpe" and args.vocab_size != _BPE_VOCAB:  # not the default: given on purpose
        raise ValueError(f"--vocab-size {args.vocab_size} is for --tokenizer bpe; --tokenizer {args.tokenizer} brings "
                         f"its own vocabulary: drop --vocab-size")
    old = Path(args.out) / "manifest.json"
    existed = old.is_file()
    if existed and not args.overwrite:
        try:
            m = json.loads(old.read_text())
            what = (f"tokenizer {m['tokenizer']['name']}, vocab {m['tokenizer']['vocab_size']:,}, "
                    f"{m['train']['tokens']:,} training tokens, made {m['created']}")
        except (OSError, ValueError, KeyError, TypeError):
            what = "its manifest.json does not read"
        raise ValueError(f"--out {args.out} already holds prepared data ({what}); pass --overwrite to replace it, "
                         f"or choose a new --out")
    from .data import prepare

    m = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                val_fraction=args.val_fraction, seed=args.seed, text_field=args.text_field)
    vocab = f"vocab {m.tokenizer.vocab_size:,}"
    if args.tokenizer == "bpe" and m.tokenizer.vocab_size < args.vocab_size:  # the BPE ran out of pairs to merge
        vocab += (f", not the {args.vocab_size:,} asked: the corpus has too few distinct byte pairs to merge further "
                  f"(more text gives more)")
    print(f"{'replaced' if existed else 'wrote'} {args.out}: train {m.train.tokens:,} tokens, "
          f"val {m.val.tokens:,} tokens, tokenizer {m.tokenizer.name} ({vocab})")


def _kept_on_abort(run: Path) -> str:
    done = sorted(p.parent.name for p in (run / "checkpoints").glob("step_*/state.json"))  # state.json: written last
    return (f"; the last complete checkpoint, {run / 'checkpoints' / done[-1]}, is kept (continue with --resume)" if done
            else "; no checkpoint had been written")


def _train(args) -> int:
    from .train.config import TrainConfig

    cfg = config_from(args, TrainConfig)  # a bad value is refused before torch is imported
    _quiet_imports()
    from .train import train
    from .train.distributed import init_from_env, shutdown

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
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``adahop`` command line; returns the exit code: 0 done, 1 a run that failed (diverged,
    a recipe of ``compare`` failed), 2 a bad option or path (named in the message), 130 interrupted."""
    args = build_parser().parse_args(argv)
    _one_line_warnings()
    finished = args.cmd == "train" and _holds_finished_run(args.out)
    try:
        if args.cmd == "data":
            _prepare(args)
        elif args.cmd == "train":
            return _train(args)
        elif args.cmd == "compare":
            if not args.eval_tasks:  # the evaluation's options without it: refused, not dropped
                from .utils import refuse_unused

                refuse_unused(args, ("eval_limit", "eval_max_length", "task_data"), "--eval-tasks and none is given",
                              "add --eval-tasks piqa,... or drop it")
            from .train.config import TrainConfig

            cfg = config_from(args, TrainConfig)
            _quiet_imports()
            from .recipes import get_recipe
            from .train.compare import Interrupted, compare

            recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
            calibrating = any(get_recipe(r).calibration is not None for r in recipes)
            if cfg.plan and not calibrating:
                raise ValueError(f"--plan {cfg.plan}: none of --recipes {','.join(recipes)} is an AdaHOP recipe (their "
                                 "GEMM strategies are fixed), so it would do nothing; drop --plan, or add adahop-lv2")
            if cfg.calib_steps is not None and not calibrating:
                raise ValueError(f"--calib-steps {cfg.calib_steps}: none of --recipes {','.join(recipes)} has an AdaHOP "
                                 "calibration (their GEMM strategies are fixed), so it would do nothing; drop "
                                 "--calib-steps, or add a calibrating recipe such as adahop-lv2")
            try:
                ev = dict(eval_tasks=args.eval_tasks, eval_limit=args.eval_limit, task_data=args.task_data,
                          eval_max_length=args.eval_max_length) if args.eval_tasks else {}
                summaries = compare(recipes, cfg, Path(cfg.out), **ev)
            except Interrupted as e:  # the running recipe wrote its checkpoint (or was aborted): say how to go on
                print(f"adahop compare: {e}", file=sys.stderr)
                return 130
            failed = [r for r, s in summaries.items() if "error" in s]
            no_eval = [r for r, s in summaries.items() if "eval_error" in s]
            if failed:  # the table is written; a script must still see that it is incomplete
                print(f"adahop compare: error: {', '.join(failed)} failed (see the table)", file=sys.stderr)
            if no_eval:
                print(f"adahop compare: error: the zero-shot evaluation of {', '.join(no_eval)} failed (its message is "
                      f"above; an answer longer than the window needs --eval-max-length, e.g. 512)", file=sys.stderr)
            if failed or no_eval:
                return 1
        elif args.cmd == "recipes":
            from .recipes.table import describe_recipes

            print(describe_recipes(args.names))
        elif args.cmd == "analyze":
            import os

            if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every process would run it whole into the same --out
                raise ValueError(f"adahop analyze runs in one process, and torchrun started {os.environ['WORLD_SIZE']} of "
                                 "them (each would run the whole analysis into the same --out); run it without torchrun")
            if args.synthetic:  # the model flags would be silently unused (the results do not record them)
                from .utils import refuse_unused

                defaults = vars(build_parser().parse_args(["analyze"]))
                refuse_unused(args, {k: v for k, v in defaults.items() if k not in ("cmd", "out", "synthetic", "oe_rank",
                                                                                     "table") and not k.startswith("synthetic_")},
                              "the model analysis and --synthetic runs none", "drop it, or drop --synthetic")
            _quiet_imports()
            from .analysis.cli import run

            run(args)
        elif args.cmd == "bench":
            _quiet_imports()
            from .bench import run as run_bench

            run_bench(args)
        elif args.cmd == "eval":
            _quiet_imports()  # it loads a transformers model, as train does
            from .eval.cli import run as run_eval

            run_eval(args)
        elif args.cmd == "ptq":
            _quiet_imports()
            from .ptq.cli import run as run_ptq

            run_ptq(args)
    except ValueError as e:
        print(f"adahop {args.cmd}: error: {e}", file=sys.stderr)
        if not finished:  # a refusal (bad option, another run's settings) leaves a finished run's folder as it was
            _leave_error(args, f"adahop {args.cmd}: error: {e}")
        return 2
    except OSError as e:  # files and network (a download that cannot reach its host): one line, no traceback
        ck = sys.modules.get("adahop.train.checkpoint")  # not imported: the error cannot be a checkpoint's
        msg = str(e) if ck is not None and isinstance(e, ck.CheckpointWriteError) else f"{type(e).__name__}: {e}"
        print(f"adahop {args.cmd}: error: {msg}", file=sys.stderr)
        _leave_error(args, f"adahop {args.cmd}: error: {msg}")
        return 2
    except KeyboardInterrupt:  # train: a second Ctrl-C (the first stops at the end of the step, with a checkpoint)
        print(f"adahop {args.cmd}: aborted" + (_kept_on_abort(Path(args.out)) if args.cmd == "train" else ""),
              file=sys.stderr)
        return 130
    except Exception as e:
        loop = sys.modules.get("adahop.train.loop")
        if loop is not None and isinstance(e, (loop.Diverged, loop.OutOfGPUMemory)):
            print(f"adahop {args.cmd}: {e}", file=sys.stderr)
            _leave_error(args, f"adahop {args.cmd}: {e}")
            return 1
        import traceback  # a bug: the run folder keeps the traceback too (compare shows its first line)

        _leave_error(args, f"adahop {args.cmd}: error: unexpected {type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        raise
    return 0
