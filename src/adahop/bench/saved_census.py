"""What a training step keeps for backward, by module kind and dtype: the activation side of
``bench model``'s peak memory, counted on any device (the CPU included) from autograd's saved tensors.

    python -m adahop.bench.saved_census --model llama3.2-1b --layers 1 --seq-len 512 --recipes bf16,mxfp4,adahop-lv2

For each recipe, ``bench model``'s model and step (:func:`adahop.bench.harness.model_step`, eager; a
calibrating recipe first calibrates for its 2 steps, so the frozen plan is counted) runs one more step
under :func:`torch.autograd.graph.saved_tensors_hooks`. Every tensor saved for backward is attributed to
the innermost module running when it was saved, and counted once per storage (q, k and v save one X).
Parameters are not activations and are left out; autocast's BF16 copies of the weights are counted.
Issue 18's memory target (Lv2 ≤ 0.85× BF16's peak at Llama-3.2-1B, 4096 × 8) is bounded by these
bytes: the recipes differ in nothing else a step holds but the optimizer's states, which are equal.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from .options import COMPILE_MODES  # torch-free

__all__ = ["census", "linear_fit", "project", "main"]


def _kind(module: torch.nn.Module, name: str) -> str:
    """The row a saved tensor counts in: the linears (by role), norms, attention, MLP, embedding, head, loss."""
    from ..nn import LowPrecisionLinear

    leaf = name.rsplit(".", 1)[-1]
    scope = "block" if ".layers." in f".{name}." else "model"
    if isinstance(module, (torch.nn.Linear, LowPrecisionLinear)):
        return f"{scope}: {leaf}"
    cls = type(module).__name__.lower()
    for key in ("norm", "attention", "mlp", "embedding"):
        if key in cls:
            return f"{scope}: {key}"
    return f"{scope}: other (logits, loss, glue)"


#: the row of every tensor a compiled step saves: its graph runs no module hooks, so only dtype and shape name it
COMPILED_KIND = "compiled graph (no module attribution)"


def census(model: str, recipe: str, seq_len: int, batch: int, layers: int | None = None, device: str = "cpu",
           mode: str = "eager") -> dict:
    """Bytes saved for backward by one training step of ``bench model``'s ``model`` in ``recipe``.

    ``mode`` is a key of :data:`adahop.bench.options.COMPILE_MODES`. Eager, each saved tensor is
    attributed to the module that saved it; compiled, autograd sees the graph's saved tensors (the
    partitioner's choice between saving and recomputing) but no modules, so every byte is in the row
    :data:`COMPILED_KIND` and ``by_shape`` names them.

    Returns a dict: ``total`` (bytes), ``per_token`` (bytes per token), ``by_kind`` (bytes per module kind,
    see :func:`_kind`), ``by_dtype`` (bytes per dtype name), ``by_shape`` (bytes per ``"dtype[shape]"``,
    largest first), ``layers``, ``tokens`` and ``mode``.

    Raises:
        ValueError: as :func:`adahop.bench.harness.model_step` (an unknown recipe); an unknown ``mode``.
    """
    from .harness import model_step, split_recompute

    if mode not in COMPILE_MODES:
        raise ValueError(f"saved_census: unknown mode {mode!r}; use one of {', '.join(COMPILE_MODES)}")
    if mode == "eager" and split_recompute(recipe)[1]:
        # the checkpoint's own saved-tensor hooks take over inside each block, and its cache of kept outputs
        # passes no hook: this census would count the blocks' inputs alone
        raise ValueError(f"saved_census: {recipe!r} in eager mode: a recomputed block keeps its tensors in the checkpoint's "
                         "cache, which saved-tensor hooks do not see; count it with --mode compiled, or read bench model's "
                         "peak_mem_gib")
    from ..compile_modes import dynamo_counts

    # every census compiles the model anew: past dynamo's recompile limit (8 frames of one code object in a
    # process) the step would run eagerly and this census count the checkpointed blocks' inputs alone
    torch.compiler.reset()
    m, step = model_step(model, recipe, mode, seq_len, batch, layers, device)
    # eager: a calibrating recipe calibrates for 2 steps and freezes its plan; compiled: then the compiling
    # step and two more (CUDA-graph trees warm up, then record), so the counted step is a replay
    warm = 2 if step.first_compiled is None else step.first_compiled + 3
    frames = dynamo_counts()["frames"]
    for i in range(warm):
        step(i)
    if step.first_compiled is not None and dynamo_counts()["frames"] == frames:
        raise RuntimeError(f"saved_census: {recipe} in mode {mode} compiled no frame: the step ran eagerly, and a compiled "
                           "census of it would be wrong")
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    names = {mod: n for n, mod in m.named_modules()} if step.first_compiled is None else {}
    stack: list[torch.nn.Module] = []
    def enter(mod, args) -> None:
        stack.append(mod)

    def leave(mod, args, out) -> None:  # returns None: the output stays as it is
        stack.pop()

    hooks = [mod.register_forward_pre_hook(enter) for mod in names] + [mod.register_forward_hook(leave) for mod in names]
    seen: set[int] = set()
    by_kind: dict[str, int] = defaultdict(int)
    by_dtype: dict[str, int] = defaultdict(int)
    by_shape: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in seen and ptr not in params and s.nbytes():
            seen.add(ptr)
            mod = stack[-1] if stack else m
            kind = _kind(mod, names.get(mod, "")) if names else COMPILED_KIND
            by_kind[kind] += s.nbytes()
            dtype = str(t.dtype).removeprefix("torch.")
            by_dtype[dtype] += s.nbytes()
            by_shape[f"{dtype}{list(t.shape)}"] += s.nbytes()
        return t

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(warm)
    finally:
        for h in hooks:
            h.remove()
    # what the step allocated above its start at its peak: saved tensors, transients, the CUDA graphs' pool
    # when recorded in it (a replay allocates nothing there, so under CUDA graphs this misses the pool)
    step_peak = torch.cuda.max_memory_allocated() - before if cuda else None
    total = sum(by_kind.values())
    return dict(model=model, recipe=recipe, mode=mode, step_peak=step_peak, layers=layers or m.config.num_hidden_layers,
                tokens=seq_len * batch, total=total, per_token=total / (seq_len * batch),
                by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), by_dtype=dict(by_dtype),
                by_shape=dict(sorted(by_shape.items(), key=lambda kv: -kv[1])))


def linear_fit(small: dict, large: dict) -> dict[str, tuple[float, float]]:
    """Per kind, ``(fixed bytes, bytes per token)`` from two censuses of one model at two token counts:
    what a step saves whatever its batch (autocast's BF16 weight copies, scales of the weights) apart from
    what grows with the tokens (activations). Block kinds are per block (divided by ``layers``).

    Raises:
        ValueError: the two censuses have the same token count."""
    t1, t2 = small["tokens"], large["tokens"]
    if t1 == t2:
        raise ValueError("linear_fit needs two different token counts")
    out = {}
    for k in dict.fromkeys([*small["by_kind"], *large["by_kind"]]):
        b1, b2 = small["by_kind"].get(k, 0), large["by_kind"].get(k, 0)
        per = small["layers"] if k.startswith("block") else 1
        slope = (b2 - b1) / (t2 - t1)
        out[k] = ((b1 - slope * t1) / per, slope / per)
    return out


def project(fit: dict[str, tuple[float, float]], layers: int, tokens: int) -> float:
    """Bytes saved for backward by a step of ``tokens`` tokens through ``layers`` blocks, from :func:`linear_fit`."""
    return sum((a + b * tokens) * (layers if k.startswith("block") else 1) for k, (a, b) in fit.items())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--layers", type=int, default=1, help="blocks to build (the census is per block; default 1)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1, help="the census runs at this batch and twice it")
    p.add_argument("--recipes", default="bf16,mxfp4,adahop-lv2")
    p.add_argument("--project", default="16:32768", metavar="LAYERS:TOKENS",
                   help="the step to project the saved bytes to (default: Llama-3.2-1B's 16 blocks at 4096 x 8); eager "
                        "only: a compiled census has no per-block rows to scale")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="eager", choices=list(COMPILE_MODES),
                   help="how the step runs (bench model's --modes); compiled: the census is by dtype and shape only")
    p.add_argument("--shapes", type=int, default=0, metavar="N",
                   help="also print each recipe's N largest saved (dtype, shape) groups at the larger token count")
    p.add_argument("--json", help="write the censuses and fits here")
    a = p.parse_args(argv)
    pl, pt = (int(x) for x in a.project.split(":"))
    runs = []
    for r in a.recipes.split(","):
        small, large = (census(a.model, r, a.seq_len, b, a.layers, a.device, a.mode)
                        for b in (a.batch_size, 2 * a.batch_size))
        fit = linear_fit(small, large)
        # compiled, no byte is known to be a block's, so the blocks cannot be scaled to another depth
        runs.append(dict(recipe=r, small=small, large=large, fit=fit,
                         projected=project(fit, pl, pt) if a.mode == "eager" else None))
    kinds = list(dict.fromkeys(k for c in runs for k in c["fit"]))
    print(f"saved for backward, {a.model}: bytes per token (per block for block rows), and the fixed bytes of a step "
          f"(MiB; autocast's weight copies), from {a.seq_len} x {a.batch_size} and x {2 * a.batch_size} tokens")
    print("| kind | " + " | ".join(f"{c['recipe']} B/token | fixed MiB" for c in runs) + " |")
    print("|---" * (2 * len(runs) + 1) + "|")
    for k in kinds:
        cells = [c["fit"].get(k, (0.0, 0.0)) for c in runs]
        print(f"| {k} | " + " | ".join(f"{b:,.0f} | {fx / 2**20:,.1f}" for fx, b in cells) + " |")
    if a.mode == "eager":
        base = runs[0]["projected"]
        print(f"projected to {pl} blocks x {pt} tokens: " + ", ".join(
            f"{c['recipe']} {c['projected'] / 2**30:.1f} GiB ({c['projected'] / base:.3f}x)" for c in runs))
    else:  # per token, at the blocks built: the rows above, not projected (--project is for eager censuses)
        base = runs[0]["fit"][COMPILED_KIND][1]
        print(f"compiled, {a.layers} blocks and the head, per token: " + ", ".join(
            f"{c['recipe']} {c['fit'][COMPILED_KIND][1]:,.0f} B ({c['fit'][COMPILED_KIND][1] / base:.3f}x)" for c in runs))
    for c in runs if a.shapes else ():
        large = c["large"]
        peak = "" if large["step_peak"] is None else f"; the step's peak above its start {large['step_peak'] / 2**30:.2f} GiB"
        print(f"{c['recipe']} ({a.mode}), {large['tokens']} tokens: the {a.shapes} largest saved groups, B/token{peak}")
        for key, n in list(large["by_shape"].items())[:a.shapes]:
            print(f"  {key:40s} {n / large['tokens']:10,.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
