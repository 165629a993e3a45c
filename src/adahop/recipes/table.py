"""Text tables of what a recipe's GEMMs do; ``adahop recipes`` prints :func:`describe_recipes`."""

from __future__ import annotations

from .presets import get_recipe, list_recipes
from .spec import GEMMS, GemmSpec, OperandSpec, Recipe, Transform

__all__ = ["gemm_table", "describe_recipes"]

#: Per GEMM: (A operand, B operand, contracted dim, A's outer dim, B's outer dim) in the spec's letters.
_OPERANDS = {
    "fprop": ("X [T,K]", "Wᵀ [K,N]", "K", "T", "N"),
    "dgrad": ("∇Y [T,N]", "W [N,K]", "N", "T", "K"),
    "wgrad": ("∇Yᵀ [N,T]", "X [T,K]", "T", "N", "K"),
}
_HEAD = ("GEMM", "strategy", "operand", "format", "round", "scale", "inner transform (Kc)", "outer transform",
         "mean split")


def _fmt(op: OperandSpec) -> str:
    if op.fmt == "mxfp4":
        return "mxfp4 1x32"
    if op.fmt == "nvfp4":
        return "nvfp4 16x16" if op.tile_2d else "nvfp4 1x16"
    return "none"


def _scale(op: OperandSpec) -> str:
    if op.fmt == "mxfp4":
        return op.scale_rule + (f" r{op.max_scale_range}" if op.max_scale_range is not None else "")
    return "e4m3+fp32" if op.fmt == "nvfp4" else "-"


def _transform(t: Transform | None, dim: str) -> str:
    if t is None:
        return "-"
    size = f"H{t.block_size}" if t.block_size else f"H_{dim} full"
    signs = {"none": "", "fixed": f", fixed signs (seed {t.sign_seed})", "per_call": ", signs per call"}[t.signs]
    return f"{size} on {dim}{signs}"


def _strategy(spec: GemmSpec, strategy_table: str | None) -> str:
    if spec.strategy == "calibrated" and strategy_table == "iht":  # every pair IHT: no OE to describe
        return "calibrated (all IHT)"
    if spec.strategy.startswith("iht+oe") or spec.strategy == "calibrated":
        sel = "" if spec.oe_select == "exact" else f", FOID first {spec.foid_prefix}"
        return f"{spec.strategy} (OE k={spec.oe_rank}{sel})"
    return spec.strategy


def _rows(name: str, spec: GemmSpec, strategy_table: str | None) -> list[tuple[str, ...]]:
    op_a, op_b, kc, out_a, out_b = _OPERANDS[name]
    rows = []
    sides = (("a", op_a, spec.a, spec.outer_a, out_a), ("b", op_b, spec.b, spec.outer_b, out_b))
    for side, label, op, outer, out_dim in sides:
        first = side == "a"
        head = (name if first else "", _strategy(spec, strategy_table) if first else "", f"{side.upper()}={label}")
        if spec.strategy == "bf16":
            rows.append(head + ("bf16", "-", "-", "-", "-", "-"))
            continue
        inner = "by plan" if spec.strategy == "calibrated" else _transform(spec.transform, kc)
        outer_txt = "-" if outer is None else _transform(outer, out_dim) + ", undone on output"
        if spec.mean_split == "a_rows":
            split = "token mean (rank-1 row)" if first else "-"
        elif spec.mean_split == "inner":
            split = "token mean, " + ("4 terms" if spec.mean_cross_terms else "2 terms")
        else:
            split = "-"
        if spec.mean_bf16 and split != "-":
            split += ", mean BF16"
        rnd = {"nearest": "RNE", "stochastic": "SR"}[op.rounding] if op.fmt != "none" else "-"
        rows.append(head + (_fmt(op), rnd, _scale(op), inner, outer_txt, split))
    return rows


def gemm_table(recipe: Recipe) -> str:
    """A text table of what each of ``recipe``'s GEMMs does, one row per operand.

    Parameters
    ----------
    recipe : Recipe
        Any recipe, preset or not.

    Returns
    -------
    str
        Columns: GEMM, strategy, operand (A/B with its shape), format, rounding (RNE/SR),
        scale rule, the inner transform along the contracted dim Kc, an outer transform (undone
        on the output), the mean split. Empty columns (every row "-") are dropped, and a last
        line gives the BF16 blocks, the saved form and the calibration when the recipe has them.
    """
    strategy_table = recipe.calibration.table if recipe.calibration is not None else None
    rows = [row for g in GEMMS for row in _rows(g, recipe.gemm(g), strategy_table)]
    keep = [i for i in range(len(_HEAD)) if i < 3 or any(r[i] not in ("-", "") for r in rows)]
    table = [tuple(_HEAD[i] for i in keep)] + [tuple(r[i] for i in keep) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keep))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = []
    if recipe.bf16_first_layers or recipe.bf16_last_layers:
        notes.append(f"BF16 blocks: first {recipe.bf16_first_layers}, last {recipe.bf16_last_layers}")
    if recipe.saved_operands == "fp8":
        notes.append("saved for backward: X and W as their FP8 fold (8 bits/element; no fold kernel in backward)")
    if recipe.calibration is not None:
        c = recipe.calibration
        gates = "".join(f", {k} {getattr(c, k)}" for k in ("floor", "min_peak") if getattr(c, k) is not None)
        notes.append(f"calibration: {c.steps} BF16 steps, table {c.table}, detector {c.rule} τ={c.threshold}{gates}; "
                     "'calibrated' GEMMs take their strategy from the frozen plan")
    return "\n".join(lines + notes)


def describe_recipes(names: list[str] | None = None) -> str:
    """Every preset, in :func:`~adahop.recipes.list_recipes` order, or the recipes ``names`` (variants
    such as ``mxfp4-had@only-wgrad`` included): its name, its one-line description and its
    :func:`gemm_table` (what ``adahop recipes [NAME ...]`` prints).

    Raises:
        ValueError: a name :func:`~adahop.recipes.get_recipe` refuses (its message names the fix)."""
    blocks = []
    for name in names or list_recipes():
        r = get_recipe(name)
        table = "\n".join("    " + line for line in gemm_table(r).splitlines())
        blocks.append(f"{name}: {r.description}\n{table}")
    return "\n\n".join(blocks)
