"""Everything that measures speed and memory, in one place (`adahop bench`, the profilers, the
emulated baselines). Torch-free to import: the names below load on first use (PEP 562), so
``adahop --help`` and ``adahop bench --help`` answer at once.

- ``options``: the options of ``adahop bench linear|model`` (torch-free);
- ``harness``: ``bench linear`` and ``bench model``, CUDA timing helpers;
- ``rows``: the machine-readable rows (``--json``) and how they merge into a file;
- ``torchao_fp8``: torchao's float8 training as ``bench model`` recipes;
- ``emulated`` and ``_triton_baselines``: MXFP4 emulated the two ways Hopper allows (``bench linear``'s baselines);
- ``profile_model``, ``profile_linear``: torch.profiler kernel breakdowns of a model step and a layer;
- ``kernel_timings``: microbenchmarks of the kernels against the measured ceilings;
- ``optim_step``: the fused optimizer step against ``AdamW(fused=True)``;
- ``max_batch``: the largest batch that trains before the GPU runs out of memory (``bench model --max-batch``);
- ``saved_census``: the bytes a training step saves for backward, by module kind and dtype (the activation side of peak memory; CPU too);
- ``host_overhead``: the host time of a converted layer with its kernels stubbed out.

The profilers run as ``python scripts/<name>.py`` (thin wrappers) or ``python -m adahop.bench.<module>``.
"""

from __future__ import annotations

__all__ = ["add_arguments", "run", "bench_linear", "bench_model", "model_step", "layer_step", "cuda_time_ms",
           "cuda_graph_time_ms", "LINEAR_SHAPES", "COMPILE_MODES"]


def __getattr__(name: str):
    if name in ("add_arguments", "COMPILE_MODES"):
        from . import options

        return getattr(options, name)
    if name in __all__:
        from . import harness

        return getattr(harness, name)
    raise AttributeError(f"module 'adahop.bench' has no attribute {name!r}")
