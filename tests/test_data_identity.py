"""Data identity (issue 24, defects 1, 2 and 6): a run's data is its content and settings, not its path.

Each test works on real files through the entry points: ``train`` (as ``adahop train`` calls it),
``compare`` and ``resolve_data``, with a tiny model and a few steps, and a cache in tmp_path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
from pathlib import Path

import pytest

from adahop.data import Manifest, prepare
from adahop.train import TrainConfig, train

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def text(small_corpus) -> str:
    return small_corpus(40_000)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The prepared-data cache of this test only."""
    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prepared"


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(model="llama-tiny", recipe="bf16", data=str(data), out=str(out), vocab_size=300, val_fraction=0.05,
                seq_len=32, batch_size=4, steps=2, lr=3e-3, warmup_steps=1, eval_every=0, ckpt_every=2, log_every=1,
                device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def _run_data(run: Path) -> Path:
    return Path(json.loads((run / "config.json").read_text())["adahop"]["data_dir"])


def test_resume_with_another_val_fraction_is_refused_before_preparing(text, tmp_path, cache, single_thread):
    """Defect 1: resuming with another --val-fraction re-prepared the text files with a new BPE (330
    of 8192 ids kept their meaning) and trained on. It is refused now, naming the change, before a
    tokenizer is trained for it; the run's own value still resumes."""
    src = tmp_path / "corpus.txt"
    src.write_text(text)
    cfg = _cfg(src, tmp_path / "run")
    train(cfg)
    made = _entries(cache)
    assert len(made) == 1
    with pytest.raises(ValueError, match=r"--resume: the data differs from the checkpointed run's .*"
                                         r"val_fraction 0\.05 → 0\.1\. To fix: pass --data .*"):
        train(dataclasses.replace(cfg, resume=True, steps=4, val_fraction=0.1))
    assert _entries(cache) == made  # nothing was prepared for the refused value
    # a run of an adahop that recorded no identity is checked against its prepared folder's manifest
    conf = tmp_path / "run" / "config.json"
    saved = conf.read_text()
    older = json.loads(saved)
    del older["adahop"]["data_identity"]
    conf.write_text(json.dumps(older))
    with pytest.raises(ValueError, match=r"val_fraction 0\.05 → 0\.1\. To fix"):
        train(dataclasses.replace(cfg, resume=True, steps=4, val_fraction=0.1))
    conf.write_text(saved)
    assert train(dataclasses.replace(cfg, resume=True, steps=4))["steps"] == 4
    identity = json.loads((tmp_path / "run" / "config.json").read_text())["adahop"]["data_identity"]
    m = Manifest.load(cache / made[0])
    assert identity["split"] == {"val_fraction": 0.05, "seed": 0, "text_field": "text"}
    assert identity["sources"] == [{"name": str(src), "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
                                    "bytes": src.stat().st_size}]
    assert identity["tokenizer"]["sha256"] == m.tokenizer.sha256 == m.load_tokenizer(cache / made[0]).fingerprint()


def test_an_edited_source_is_new_data_refused_on_resume_and_on_reuse(text, tmp_path, cache, single_thread):
    """Defect 2: editing a text file passed to --data reused the old prepared tokens (losses came
    out identical). The cache is keyed by content now: a new run trains on the new text, and
    --resume and compare's reuse of the run made on the old text refuse, naming the file."""
    from adahop.train.compare import compare

    src = tmp_path / "corpus.txt"
    src.write_text(text)
    cfg = _cfg(src, tmp_path / "cmp" / "bf16")
    old = train(cfg)
    src.write_text(text.replace(" the ", " a "))  # a real edit, in place
    change = rf"source {src}: sha256 [0-9a-f]{{12}}… → [0-9a-f]{{12}}…, 40,000 → \d\d,\d{{3}} bytes"
    with pytest.raises(ValueError, match=r"--resume: the data differs from the checkpointed run's .*" + change +
                       r"\. To fix: pass --data .*prepared.*\(the run's prepared data, still there\)"):
        train(dataclasses.replace(cfg, resume=True, steps=4))
    with pytest.raises(ValueError, match=r"compare: .*bf16 holds a bf16 run trained on other data \(" + change):
        compare(["bf16"], dataclasses.replace(cfg, out=str(tmp_path / "cmp")), tmp_path / "cmp")
    new = train(dataclasses.replace(cfg, out=str(tmp_path / "new")))
    old_dir, new_dir = _run_data(tmp_path / "cmp" / "bf16"), _run_data(tmp_path / "new")
    assert old_dir != new_dir and len(_entries(cache)) == 2
    assert Manifest.load(new_dir).sources[0].sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (new_dir / "train_000.bin").read_bytes() != (old_dir / "train_000.bin").read_bytes()
    assert new["final_train_loss"] != old["final_train_loss"]
    # the fix the refusal names: the run's own prepared folder, still in the cache, resumes it
    assert train(dataclasses.replace(cfg, resume=True, steps=4, data=str(old_dir)))["steps"] == 4
    # the same content under another name is the same data: the cache entry is reused
    twin = tmp_path / "twin.txt"
    twin.write_bytes(src.read_bytes())
    train(dataclasses.replace(cfg, data=str(twin), out=str(tmp_path / "twin")))
    assert _run_data(tmp_path / "twin") == new_dir and len(_entries(cache)) == 2


def test_a_prepared_folder_whose_sources_changed_is_refused(text, tmp_path, cache, single_thread):
    """A folder made by `adahop data prepare` from a file that was edited since holds the old text's
    tokens: a run given it is refused while the file is found changed at its recorded path."""
    src = tmp_path / "corpus.txt"
    src.write_text(text)
    prepared = tmp_path / "prepared"
    prepare([str(src)], prepared, vocab_size=300, val_fraction=0.05)
    src.write_text(text[:-1] + "!")  # the same size, other bytes: found by the sha256
    with pytest.raises(ValueError, match=rf"--data {prepared}: the files it was prepared from have changed since: "
                                         rf"{src}: sha256 [0-9a-f]{{12}}… → [0-9a-f]{{12}}…, same size\. .*prepare it again"):
        train(_cfg(prepared, tmp_path / "r"))
    src.write_text(text + "more")
    with pytest.raises(ValueError, match=r"40,000 → 40,004 bytes"):
        train(_cfg(prepared, tmp_path / "r"))
    src.write_text(text)  # restored: the folder is its data again
    assert train(_cfg(prepared, tmp_path / "r"))["steps"] == 2


def test_tokenizer_fingerprint_is_its_vocabulary(text):
    """The fingerprint recorded in the manifest: equal for a tokenizer trained again on the same
    text or loaded again, different for a vocabulary trained on other text."""
    from adahop.data import load_tokenizer, train_bpe

    a, b = train_bpe([text], 300), train_bpe([text], 300)
    other = train_bpe([text.replace(" the ", " a ")], 300)
    assert a.fingerprint() == b.fingerprint() != other.fingerprint()
    assert len(a.fingerprint()) == 64 and set(a.fingerprint()) <= set("0123456789abcdef")
    if (SHARED / "gpt2.tiktoken").is_file():
        spec = f"tiktoken:{SHARED / 'gpt2.tiktoken'}"
        assert load_tokenizer(spec).fingerprint() == load_tokenizer(spec).fingerprint() != a.fingerprint()


def _prepare_at_once(how: str, src: str, out: str, cache: str, barrier, results) -> None:
    """Child process: wait for the other one, then prepare ``src`` (``how``: through the cache as
    ``adahop train --data`` does, or into ``out`` as ``adahop data prepare`` does)."""
    import os

    os.environ["ADAHOP_CACHE"] = cache
    from adahop.train.setup import resolve_data

    try:
        barrier.wait(timeout=60)
        if how == "cache":
            folder = resolve_data(TrainConfig(data=src, vocab_size=300, val_fraction=0.05))
        else:
            prepare([src], out, vocab_size=300, val_fraction=0.05)
            folder = Path(out)
        results.put(("ok", str(folder)))
    except BaseException as e:  # the parent asserts on it
        results.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("how", ["cache", "prepare"])
def test_two_processes_preparing_one_corpus_at_once_both_succeed(text, tmp_path, cache, monkeypatch, how):
    """Defect 6: two runs preparing the same new corpus at once raced on the shared folder (one
    failed with FileNotFoundError). Each shard now waits a moment before it is moved into place, so
    that the two preparations overlap for sure; both must succeed with the same, intact folder."""
    import time

    import adahop.data.shards as shards

    src = tmp_path / "corpus.txt"
    src.write_text(text)
    reference = tmp_path / "reference"
    prepare([str(src)], reference, vocab_size=300, val_fraction=0.05)  # one process alone
    real_close = shards._SplitWriter._close_shard

    def slow_close(self):  # the race window of a large corpus, on a small one
        time.sleep(0.5)
        real_close(self)

    monkeypatch.setattr(shards._SplitWriter, "_close_shard", slow_close)
    ctx = multiprocessing.get_context("fork")  # the children inherit the slowed writer
    barrier, results = ctx.Barrier(2), ctx.Queue()
    args = (how, str(src), str(tmp_path / "out"), str(tmp_path / "cache"), barrier, results)
    procs = [ctx.Process(target=_prepare_at_once, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert [g[0] for g in got] == ["ok", "ok"], got
    assert got[0][1] == got[1][1]
    folder = Path(got[0][1])
    m = Manifest.load(folder)
    assert m.train.tokens == Manifest.load(reference).train.tokens
    for name in ("train_000.bin", "val_000.bin", "tokenizer.json"):
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), name
    if how == "cache":  # one entry, no temporary folder left beside it
        assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]


def test_a_hf_dataset_not_read_yet_is_compared_by_name():
    """An hf: source's sha256 is unknown until it is read, so `--resume` and `compare` took another, unprepared
    hf: dataset as the same data (steps 6-10 trained on it, with a newly trained BPE); a renamed local file,
    whose sha256 is known, is still the same data."""
    from adahop.data.identity import identity_changes

    def ident(name, sha):
        return {"sources": [{"name": name, "sha256": sha, "bytes": None if sha is None else 10}],
                "tokenizer": {}, "split": {}}

    assert identity_changes(ident("hf:/x/hfA", "ab" * 32), ident("hf:/x/hfB", None)) == ["source hf:/x/hfA → hf:/x/hfB"]
    assert identity_changes(ident("hf:/x/hfA", "ab" * 32), ident("hf:/x/hfA", None)) == []
    assert identity_changes(ident("/x/a.txt", "ab" * 32), ident("/y/renamed.txt", "ab" * 32)) == []


def test_a_resume_whose_prepared_data_turns_out_different_is_refused_not_called_damaged(text, tmp_path, cache,
                                                                                          single_thread):
    """Trained on a prepared folder (BPE of 300 ids), resumed from the raw text with the default 8192-id BPE: the
    text's planned identity knows no vocabulary yet, so the check before preparing passed, a new BPE was trained
    and the checkpoint was reported damaged ("delete that folder"). Once prepared, the data is compared again."""
    src = tmp_path / "w9.txt"
    src.write_text(text)
    prepare([str(src)], tmp_path / "pf9", vocab_size=300, val_fraction=0.05)
    cfg = _cfg(tmp_path / "pf9", tmp_path / "run", vocab_size=8192, val_fraction=0.01)
    train(cfg)
    with pytest.raises(ValueError, match=r"--resume: the data, once prepared, differs from the checkpointed run's.*"
                                         r"vocabulary 300 → \d+ ids"):
        train(dataclasses.replace(cfg, data=str(src), val_fraction=0.05, resume=True, steps=4))
    # the run's own folder still resumes
    assert train(dataclasses.replace(cfg, resume=True, steps=4))["steps"] == 4


def test_preparing_flags_that_a_prepared_folder_would_ignore_are_refused(text, tmp_path, cache):
    """--tokenizer, --vocab-size and --val-fraction only prepare text: set to other values than the prepared
    folder was made with, they would be ignored yet recorded in config.json, so they are refused; left at
    their defaults, or given as the folder was made, they pass."""
    from adahop.train.setup import resolve_data
    src = tmp_path / "corpus.txt"
    src.write_text(text)
    prepared = tmp_path / "prepared"
    prepare([str(src)], prepared, vocab_size=300, val_fraction=0.05)
    for kw, named in [({"val_fraction": 0.1}, r"--val-fraction 0\.1 \(it was made with 0\.05\)"),
                      ({"vocab_size": 299}, r"--vocab-size 299 \(it was made with 300 ids by --tokenizer bpe\)"),
                      ({"tokenizer": "gpt2"}, r"--tokenizer gpt2 \(it was made with bpe\)")]:
        with pytest.raises(ValueError, match=rf"is a prepared folder, whose tokens are fixed; {named} would be ignored"):
            resolve_data(TrainConfig(data=str(prepared), **kw))
    assert resolve_data(TrainConfig(data=str(prepared))) == prepared
    assert resolve_data(TrainConfig(data=str(prepared), vocab_size=300, val_fraction=0.05, tokenizer="bpe")) == prepared
    # a small corpus trains fewer ids than asked: the size asked for is no mismatch
    small = tmp_path / "small"
    prepare([str(src)], small, vocab_size=4000, val_fraction=0.05)
    assert Manifest.load(small).tokenizer.vocab_size < 4000
    assert resolve_data(TrainConfig(data=str(small), vocab_size=4000, val_fraction=0.05)) == small
    # one tokenizer file spelled another way is the same tokenizer (its fingerprint)
    tiktoken = SHARED / "gpt2.tiktoken"
    if tiktoken.exists():
        tk = tmp_path / "tk"
        prepare([str(src)], tk, tokenizer=f"tiktoken:{tiktoken}", val_fraction=0.05)
        assert resolve_data(TrainConfig(data=str(tk), tokenizer=f"tiktoken:{tiktoken.parent}/../data/gpt2.tiktoken",
                                        val_fraction=0.05)) == tk
