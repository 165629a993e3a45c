"""Scoring with lm-evaluation-harness on the offline documents.

The route (no network, no code of ours between lm-eval and the model's log-likelihoods):

1. :func:`adahop.eval.tasks.read_docs` rebuilds each task's documents from the task-data root and
   they are written as Arrow streams into a temporary folder;
2. one YAML per task there, ``include:``-ing lm-eval's own task file (prompt, choices, metrics and
   version stay lm-eval's) and overriding only ``dataset_path: arrow`` with ``data_files`` pointing
   at that stream (the Hugging Face cache of the load goes to the same temporary folder);
3. ``lm_eval.tasks.TaskManager(include_path=<folder>, include_defaults=False)`` indexes only those,
   and ``lm_eval.simple_evaluate`` scores them with the model wrapped as lm-eval's ``HFLM``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import subprocess
import tempfile
from pathlib import Path

from .tasks import TaskSpec, read_docs
from .wheel import TaskDataError, sha256_of

__all__ = ["require_lm_eval", "hf_lm", "score", "BOOTSTRAP_ITERS"]

#: bootstrap resamples for the standard error of LAMBADA's perplexity (lm-eval's CLI uses 100000;
#: the error of the error at 1000 is about 2%, and 100000 takes minutes on the full set)
BOOTSTRAP_ITERS = 1000


def require_lm_eval():
    """Import and return ``lm_eval``, or raise a ValueError that says how to install it."""
    try:
        import lm_eval
    except ImportError as e:
        raise ValueError(f"zero-shot tasks are scored with lm-evaluation-harness, which is not installed ({e}); "
                         f"pip install 'adahop[eval]' (or pip install lm-eval) after torch") from None
    return lm_eval


def hf_lm(model, tokenizer, *, batch_size: int = 8, dtype: str = "fp32", max_length: int | None = None):
    """``lm_eval.models.huggingface.HFLM`` around a loaded ``transformers`` causal LM.

    Args:
        model: a ``transformers.PreTrainedModel`` (possibly converted by :func:`adahop.convert_model`),
            already on its device.
        tokenizer: its tokenizer (a ``transformers`` tokenizer).
        batch_size: sequences per forward pass.
        dtype: ``fp32`` or ``bf16`` (forward under BF16 autocast, the weights kept as loaded).
        max_length: context window in tokens; longer contexts lose their left part, as in lm-eval
            (default: the model config's ``max_position_embeddings``).
    """
    require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    import torch

    with _quiet():  # its warning about a model object instead of a name is expected here
        return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                    mixed_precision_dtype=torch.bfloat16 if dtype == "bf16" else None)


@contextlib.contextmanager
def _quiet():
    """lm-eval's and datasets' info and warnings (num_fewshot overrides, split generation bars) off;
    its errors and the progress bar of the requests stay."""
    import datasets

    log = logging.getLogger("lm_eval")
    level, bars = log.level, datasets.is_progress_bar_enabled()
    log.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    import lm_eval.evaluator as ev  # callers have checked that lm-eval is installed (require_lm_eval)

    git_hash = getattr(ev, "get_git_commit_hash", None)
    if git_hash is not None:  # its `git describe` printed "fatal: not a git repository" outside a repository
        ev.get_git_commit_hash = _git_commit_hash
    try:
        yield
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
        if git_hash is not None:
            ev.get_git_commit_hash = git_hash


def _git_commit_hash() -> str | None:
    """What lm-eval records as ``git_hash`` (``git describe --always`` in the working folder), with git's
    error output dropped: outside a repository it is None."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _write_task_configs(specs: list[TaskSpec], root: Path, folder: Path) -> dict[str, dict]:
    """Docs as Arrow streams + one overriding YAML per task in ``folder``; returns per-task data info."""
    import lm_eval
    import pyarrow.ipc as ipc
    import yaml

    lm_tasks = Path(lm_eval.__file__).parent / "tasks"
    info = {}
    for spec in specs:
        table = read_docs(spec, root)
        data = folder / "docs" / f"{spec.name}.arrow"
        data.parent.mkdir(parents=True, exist_ok=True)
        with open(data, "wb") as f, ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
        base = _lm_eval_yaml(lm_tasks, spec.name)
        # only the scored split exists offline: the others (few-shot sources) are switched off
        splits = {k: (spec.split if k.startswith(spec.split) else None)
                  for k in ("training_split", "validation_split", "test_split", "fewshot_split")}
        cfg = {"include": str(base), "task": spec.name, "dataset_path": "arrow", "dataset_name": None,
               "dataset_kwargs": {"data_files": {spec.split: str(data)}, "cache_dir": str(folder / "hf_cache")}, **splits}
        (folder / f"{spec.name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        info[spec.name] = {"source": spec.source, "source_sha256": sha256_of(Path(root) / spec.source), "split": spec.split,
                           "docs": table.num_rows, "lm_eval_yaml": str(base)}
    return info


def _lm_eval_yaml(lm_tasks: Path, name: str) -> Path:
    """lm-eval's own YAML of task ``name`` (the file whose ``task:`` is ``name``)."""
    import yaml

    folder = {"arc_easy": "arc", "arc_challenge": "arc", "lambada_openai": "lambada"}.get(name, name)
    for p in sorted((lm_tasks / folder).glob("*.yaml")):
        text = p.read_text()
        if f"task: {name}\n" in text:  # cheap check first; the YAML may hold !function tags
            return p
    raise TaskDataError(f"lm-eval {_version()} has no task {name!r} under {lm_tasks / folder}; install a version that "
                        f"has it (pip install 'lm-eval>=0.4.5')")


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _close_progress_bars() -> None:
    """Close the tqdm bars still open, which ends their line: our error message followed the bar on it, and
    the bar's last refresh came after the message."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def score(lm, specs: list[TaskSpec], root: Path, *, limit: int | None = None, seed: int = 0) -> dict:
    """Score ``lm`` on ``specs`` with lm-eval, zero-shot, from the documents under ``root``.

    Args:
        lm: an ``lm_eval.api.model.LM`` (e.g. :func:`hf_lm`).
        specs: the tasks (:func:`adahop.eval.tasks.get_tasks`).
        root: a task-data root (:func:`adahop.eval.wheel.ensure_members`).
        limit: score only the first ``limit`` documents of each task (None: all).
        seed: lm-eval's random seeds (they matter for no zero-shot task here; recorded).

    Returns:
        ``{"tasks": {name: {"metrics": {metric: value}, "stderr": {metric: value}, "chance": {metric: value},
        "version": ..., "docs": n, ...}}, "lm_eval_version": ..., "limit": ..., "bootstrap_iters": ...}``;
        accuracies are fractions in [0, 1], LAMBADA's perplexity in tokens (exp of the mean negative
        log-likelihood per continuation, lm-eval's definition).

    Raises:
        ValueError: lm-eval is missing; TaskDataError: missing or damaged documents.
    """
    lm_eval = require_lm_eval()
    from lm_eval.tasks import TaskManager

    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit}: must be >= 1 (or left out for every document)")
    with tempfile.TemporaryDirectory(prefix="adahop-lm-eval-") as tmp, _quiet():
        info = _write_task_configs(specs, Path(root), Path(tmp))
        tm = TaskManager(include_path=tmp, include_defaults=False)
        built = tm.load([s.name for s in specs])["tasks"]
        chance = {s.name: _chance(built[s.name], limit) for s in specs}
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=[built[s.name] for s in specs], task_manager=tm, limit=limit,
                                          num_fewshot=0, bootstrap_iters=BOOTSTRAP_ITERS, log_samples=False,
                                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed)
        except AssertionError as e:  # HFLM asserts that each continuation fits its window
            _close_progress_bars()  # lm-eval's bar was left open: the message would follow it on its line
            window = getattr(lm, "max_length", None)
            raise ValueError(f"lm-eval stopped on its check {str(e)[:100] or 'of a request'}: most likely an answer "
                             f"longer than the model's window of {window} tokens (a model trained at a short --seq-len); "
                             f"pass a larger --max-length (a RoPE model then scores positions beyond its training "
                             f"length) or fewer tasks") from None
    tasks = {}
    for s in specs:
        r = out["results"][s.name]
        metrics = {k.split(",")[0]: v for k, v in r.items() if "," in k and "_stderr" not in k and _num(v)}
        stderr = {k.split(",")[0].removesuffix("_stderr"): v for k, v in r.items() if "_stderr" in k and _num(v)}
        tasks[s.name] = dict(metrics=metrics, stderr=stderr, chance=chance[s.name], shown=s.metric,
                             version=out["versions"].get(s.name), n_samples=out.get("n-samples", {}).get(s.name),
                             **info[s.name])
    return {"tasks": tasks, "lm_eval_version": _version(), "limit": limit, "num_fewshot": 0,
            "bootstrap_iters": BOOTSTRAP_ITERS}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _chance(task, limit: int | None) -> dict:
    """The score of a uniform random guess on the scored documents of an lm-eval ``task``: the mean of
    1 / (number of choices) for a multiple-choice task (acc and acc_norm alike); LAMBADA's open
    vocabulary has none."""
    if task.OUTPUT_TYPE != "multiple_choice":
        return {}
    docs = list(task.eval_docs)[:limit]
    p = sum(1 / len(task.doc_to_choice(d)) for d in docs) / max(len(docs), 1)
    return {"acc": p, "acc_norm": p} if not math.isnan(p) else {}
