"""The zero-shot table in the paper's layout: one row per model, the tasks as columns (each naming its
metric), an Avg column, and a row with each task's chance level."""

from __future__ import annotations

__all__ = ["columns", "cells", "chance_cells", "table_rows", "markdown"]


def columns(result: dict) -> list[str]:
    """Column titles of the tasks in ``result`` (:func:`adahop.eval.harness.score` output), Avg last."""
    from .tasks import TASKS

    out = []
    for name, r in result["tasks"].items():
        t = TASKS[name].title
        out.append(f"{t} {r['shown']}")
        if "perplexity" in r["metrics"]:
            out.append(f"{t} ppl")
    return out + ["Avg"]


def _pct(v: float, se: float | None) -> str:
    return f"{100 * v:.2f}" + (f" ± {100 * se:.2f}" if se is not None else "")


def cells(result: dict) -> list[str]:
    """The cells of one model's row: accuracies in % with their standard error, LAMBADA's perplexity,
    and Avg, the mean of the shown accuracies (perplexity left out)."""
    out, accs = [], []
    for r in result["tasks"].values():
        m = r["shown"]
        out.append(_pct(r["metrics"][m], r["stderr"].get(m)))
        accs.append(r["metrics"][m])
        if "perplexity" in r["metrics"]:
            se = r["stderr"].get("perplexity")
            out.append(f"{r['metrics']['perplexity']:.4g}" + (f" ± {se:.2g}" if se is not None else ""))
    return out + [f"{100 * sum(accs) / len(accs):.2f}"]


def chance_cells(result: dict) -> list[str]:
    """The chance row: a uniform guess's accuracy on the scored documents (0 for LAMBADA's open
    vocabulary; its perplexity has no chance level: '-'), Avg over the same columns as :func:`cells`."""
    out, accs = [], []
    for r in result["tasks"].values():
        c = r["chance"].get(r["shown"], 0.0)
        out.append(f"{100 * c:.2f}")
        accs.append(c)
        if "perplexity" in r["metrics"]:
            out.append("-")
    return out + [f"{100 * sum(accs) / len(accs):.2f}"]


def table_rows(named: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows for several models scored on the same tasks (``{row name: result}``), chance last.

    Raises:
        ValueError: the results are of different tasks (their columns would not line up).
    """
    first = next(iter(named.values()))
    header = columns(first)
    for name, r in named.items():
        if columns(r) != header:
            raise ValueError(f"{name} was scored on other tasks ({list(r['tasks'])}) than {list(first['tasks'])}")
    rows = [[name, *cells(r)] for name, r in named.items()]
    rows.append(["chance", *chance_cells(first)])
    return ["model", *header], rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
