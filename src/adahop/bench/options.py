"""The options of `adahop bench` (its code is in :mod:`adahop.bench`). Torch-free, so that
``adahop --help`` and option errors answer at once."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "COMPILE_MODES"]

#: How ``bench model`` runs the model: eager, ``torch.compile`` (default mode),
#: ``torch.compile(mode="reduce-overhead")``, which replays CUDA graphs and so removes the host
#: time of the many small launches of a quantized layer, and ``auto``: the mode ``adahop train
#: --compile`` runs once the plan is frozen (:func:`adahop.compile_modes.frozen_mode`: CUDA graphs
#: on a GPU, the default mode on the CPU).
COMPILE_MODES = {"eager": None, "compiled": "default", "compiled+cudagraphs": "reduce-overhead", "auto": "auto"}


_JSON_HELP = ("merge the rows into this JSON list (created if absent; a row of the same configuration is replaced, "
              "others are appended), e.g. docs/benchmarks.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``adahop bench linear`` and ``adahop bench model``."""
    sub = p.add_subparsers(dest="bench_cmd", required=True)
    lin = sub.add_parser("linear", help="one linear layer, forward + backward")
    lin.add_argument("--shapes", default="llama3.1-8b", help="comma-separated: llama-125m, llama-350m, llama3.2-1b, llama3.1-8b (default: %(default)s)")
    lin.add_argument("--tokens", default="8192,16384", help="comma-separated token counts, the rows of X (default: %(default)s)")
    lin.add_argument("--reps", type=int, default=20, help="timed repetitions per row, median taken (default: %(default)s)")
    lin.add_argument("--cuda-graphs", action="store_true",
                     help="also time each layer replayed from a CUDA graph (device time, no host launch cost)")
    lin.add_argument("--json", metavar="PATH", help=_JSON_HELP)
    mod = sub.add_parser("model", help="end-to-end training step")
    mod.add_argument("--model", default="llama3.2-1b", help="a model preset (default: %(default)s)")
    mod.add_argument("--layers", type=int, help="keep only the first N blocks (e.g. 4 with llama3.1-8b)")
    mod.add_argument("--recipes", default="bf16,adahop-lv2,mxfp4",
                     help="comma-separated: adahop presets (adahop recipes lists them) and torchao's float8 training, "
                          "torchao-fp8-rowwise, torchao-fp8-tensorwise (CUDA sm_89+, needs torchao); any of them with "
                          "+recompute (adahop-lv2+recompute, bf16+recompute): the blocks under selective activation "
                          "recompute (adahop.nn.recompute)")
    mod.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: %(default)s)")
    mod.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: %(default)s)")
    mod.add_argument("--steps", type=int, default=6, help="timed steps after 5 untimed ones, median taken (default: %(default)s)")
    mod.add_argument("--modes", default="eager,auto",
                     help=f"comma-separated, of {', '.join(COMPILE_MODES)} (auto: what `adahop train --compile` runs "
                          "once the plan is frozen, compiled+cudagraphs on a GPU); a calibrating recipe calibrates "
                          "eagerly and is compiled at the freeze")
    mod.add_argument("--bf16-small-gemms", action="store_true",
                     help="adahop recipes run the GEMMs too small to gain from FP8 in BF16 (Recipe.bf16_small_gemms, "
                          "the default SmallGemmRule); each row counts them (small_gemms_bf16)")
    mod.add_argument("--max-batch", type=int, metavar="N",
                     help="after each row, find the largest batch up to N that trains without running out of GPU "
                          "memory (doubling from --batch-size, then bisection; each try builds the model and runs its "
                          "calibration and 3 steps in the row's mode, from the memory the row freed): the row's largest_batch, "
                          "batches_tried and search_start_mem_gib; largest_batch_error when it is not valid")
    mod.add_argument("--json", metavar="PATH", help=_JSON_HELP)
