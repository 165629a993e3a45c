"""Tokenizers for ``adahop data prepare``: a trained byte-level BPE, GPT-2 (tiktoken), any Hugging Face tokenizer.

One small interface, :class:`Tokenizer`, over three backends, each named by a *spec* string:

=========================  ====================================================================
spec                       tokenizer
=========================  ====================================================================
``bpe:PATH``               a ``tokenizers`` JSON file (what :func:`train_bpe` writes as ``tokenizer.json``)
``gpt2``                   GPT-2 through ``tiktoken.get_encoding("gpt2")`` (downloads the ranks once)
``tiktoken:PATH``          GPT-2 from a ``.tiktoken`` ranks file: 50,256 merges + ``<|endoftext|>`` = 50256
``hf:NAME_OR_PATH``        ``transformers.AutoTokenizer.from_pretrained(NAME_OR_PATH)``
a folder                   the tokenizer recorded in its ``manifest.json`` (else its ``tokenizer.json``)
=========================  ====================================================================

Text is always encoded *ordinarily*: a literal ``<|endoftext|>`` in the text for tiktoken is plain
text (``tokenizers`` and ``transformers`` backends do match their special tokens in text). The
EOS id separating documents in the shards is added by :mod:`adahop.data.shards`, never by
``encode``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

__all__ = ["Tokenizer", "BPETokenizer", "TiktokenTokenizer", "HFTokenizer", "transformers_fingerprint", "train_bpe", "check_bpe_vocab_size",
           "load_tokenizer", "EOS"]

EOS = "<|endoftext|>"
# The GPT-2 pre-tokenizer split (contractions, letters, numbers, other symbols, whitespace runs).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Tokenizer:
    """Text ↔ token ids. Subclasses set ``name``, ``vocab_size``, ``eos_id`` and implement the methods.

    Attributes:
        name: the spec this tokenizer was loaded from (or ``"bpe"`` when just trained).
        vocab_size: number of ids, special tokens included; every id is in ``[0, vocab_size)``.
        eos_id: id of the end-of-text token that separates documents.
    """

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS/BOS added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, computed on all cores where the backend can."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ``decode(encode(s)) == s`` for the byte-level backends."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> str:
        """Write what is needed to reload this tokenizer into ``directory``.

        Returns:
            the spec that reloads it with ``load_tokenizer(spec, base_dir=directory)``.
        """
        raise NotImplementedError

    def to_transformers(self):
        """This tokenizer as a ``transformers.PreTrainedTokenizerFast`` (EOS set) that encodes text to
        the same ids, for a run folder that ``AutoTokenizer.from_pretrained`` and lm-eval load (the
        tiktoken ranks go through transformers' ``TikTokenConverter``).

        Raises:
            ImportError: ``transformers`` (or, for tiktoken, ``tiktoken``) is not installed."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Hex sha256 (64 characters) of the vocabulary in id order and the merges (tiktoken: the
        token bytes in id order and the split pattern). Equal fingerprints mean that every id
        stands for the same token; ``manifest.json`` records it, so that a retrained or edited
        vocabulary is never taken for the one a run trained on. A ``tokenizers`` JSON's normalizer,
        pre-tokenizer and decoder are not in it: one edited there alone (how text is cut into those
        tokens) keeps its fingerprint."""
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """int64 ``[vocab_size]``: the UTF-8 bytes of text each id stands for (special tokens such as EOS:
        0), so that a stretch of ids covers the sum of its entries' bytes (bits per byte of a scored
        stretch). This generic form decodes each id alone, exact where every id decodes to whole
        characters; the byte-level backends override it with the exact count."""
        out = np.array([len(self.decode([i]).encode("utf-8")) for i in range(self.vocab_size)], dtype=np.int64)
        out[self.eos_id] = 0
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _backend_token_bytes(tok, vocab_size: int, special: set[int]) -> np.ndarray | None:
    """:meth:`Tokenizer.token_bytes` of a ``tokenizers.Tokenizer``: with a byte-level decoder every character of
    a token's string is one byte (exact); with SentencePiece's metaspace (``▁`` for a space, ``<0xNN>`` byte
    pieces: Llama-2, Mistral, Gemma) a piece is its text with ``▁`` as one space byte (the decoder's strip of
    a text's first space is not subtracted: one byte per document). None for other decoders."""
    from tokenizers import pre_tokenizers

    decoder = json.loads(tok.to_str()).get("decoder")
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    if not byte_level and "\u2581" not in json.dumps(decoder, ensure_ascii=False):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    out = np.zeros(vocab_size, dtype=np.int64)
    for i in range(vocab_size):
        piece = tok.id_to_token(i)
        if piece is None:
            continue
        if not byte_level and _BYTE_PIECE.fullmatch(piece):
            out[i] = 1
        elif i in special:
            continue
        elif byte_level and set(piece) <= alphabet:
            out[i] = len(piece)
        else:  # a metaspace piece, or an added token spelled in plain text
            out[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
    return out


class BPETokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (byte-level BPE) whose EOS token is ``<|endoftext|>``."""

    def __init__(self, tok, name: str = "bpe"):
        self._tok = tok
        self.name = name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eos = tok.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"tokenizer {name!r} has no {EOS} token, which adahop uses to separate documents")
        self.eos_id = eos

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTok

        try:
            tok = HFTok.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception ("Model missing. at line 1 column 2")
            raise ValueError(f"tokenizer file {path} is not a tokenizers JSON ({str(e).strip()}); pass a tokenizer.json "
                             "written by `adahop data prepare` or Hugging Face tokenizers") from None
        return cls(tok, name or f"bpe:{path}")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        enc = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in enc(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        return _tokenizers_fingerprint(self._tok)

    def token_bytes(self) -> np.ndarray:
        special = set(self._tok.get_added_tokens_decoder())
        out = _backend_token_bytes(self._tok, self.vocab_size, special)
        return super().token_bytes() if out is None else out

    def to_transformers(self):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self._tok, eos_token=EOS)

    def save(self, directory: str | Path) -> str:
        path = Path(directory) / "tokenizer.json"
        tmp = path.with_name(path.name + ".tmp")
        self._tok.save(str(tmp))
        os.replace(tmp, path)
        return "bpe:tokenizer.json"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")).hexdigest()


def _tokenizers_fingerprint(tok) -> str:
    """Fingerprint of a ``tokenizers.Tokenizer``: its tokens in id order (added tokens included) and
    its model's merges. Read from the parsed JSON, not its text, whose layout moves between
    ``tokenizers`` versions (merges were "a b" strings, now pairs)."""
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    merges = json.loads(tok.to_str()).get("model", {}).get("merges", [])
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
    return _digest({"vocab": vocab, "merges": merges})


def check_bpe_vocab_size(vocab_size: int) -> None:
    """Raise ``ValueError`` naming ``--vocab-size`` unless a byte-level BPE can have ``vocab_size`` ids."""
    if not 257 <= vocab_size <= 1 << 20:
        raise ValueError(f"--vocab-size {vocab_size} is out of range for a byte-level BPE: it needs the 256 byte "
                         "tokens + <|endoftext|>; use 257 to 1048576 (default 8192)")


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenizer split, no prefix space) on ``texts``.

    Args:
        texts: training text pieces (any lengths); :mod:`adahop.data.shards` passes at most ~20 MB.
        vocab_size: target vocabulary size including the 256 byte tokens and ``<|endoftext|>``;
            the result is smaller when the text has too few distinct pairs to merge.

    Returns:
        the trained tokenizer; ``<|endoftext|>`` has id 0.

    Raises:
        ValueError: ``vocab_size`` outside [257, 2**20] (``--vocab-size``).
    """
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size)
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return BPETokenizer(tok)


class TiktokenTokenizer(Tokenizer):
    """GPT-2 through ``tiktoken``: from a ``.tiktoken`` ranks file, or ``get_encoding("gpt2")`` when ``path`` is None.

    A ranks file gets the GPT-2 split pattern and ``<|endoftext|>`` as the id after the last rank
    (50256 for GPT-2's 50,256 ranks), so the vocabulary is 50,257 and "Hello world" → [15496, 995].
    """

    def __init__(self, path: str | Path | None = None):
        import tiktoken

        if path is None:
            try:
                self._enc, self.name, self._path = tiktoken.get_encoding("gpt2"), "gpt2", None
            except OSError as e:  # requests' errors are OSErrors too: tiktoken downloads GPT-2's ranks once
                raise ValueError(f"tokenizer gpt2: tiktoken could not fetch GPT-2's ranks file ({type(e).__name__}); "
                                 f"without network, pass --tokenizer tiktoken:PATH to a local gpt2.tiktoken, or "
                                 f"--tokenizer bpe to train one on the data") from None
        else:
            from tiktoken.load import load_tiktoken_bpe

            self._path = Path(path)
            try:
                ranks = load_tiktoken_bpe(str(self._path))
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot load tiktoken ranks file {self._path}: {e}") from e
            self._enc = tiktoken.Encoding(name=self._path.stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={EOS: len(ranks)})
            self.name = f"tiktoken:{self._path}"
        self.vocab_size = self._enc.n_vocab
        self.eos_id = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=_threads())

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    def token_bytes(self) -> np.ndarray:
        special = self._enc.special_tokens_set
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            b = self._enc.decode_single_token_bytes(i)
            out[i] = 0 if b.decode("utf-8", "replace") in special else len(b)
        return out

    def to_transformers(self):
        # transformers' own tiktoken converter rebuilds the byte-level BPE from the ranks (id for id)
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        with tempfile.TemporaryDirectory() as d:
            ranks = self._path
            if ranks is None:
                from tiktoken.load import dump_tiktoken_bpe

                ranks = Path(d) / "gpt2.tiktoken"
                dump_tiktoken_bpe(self._enc._mergeable_ranks, str(ranks))
            specials = dict(self._enc._special_tokens)
            try:
                tok = TikTokenConverter(vocab_file=str(ranks), pattern=self._enc._pat_str,
                                        extra_special_tokens=specials).converted()
            except TypeError:  # transformers < 5 names it additional_special_tokens
                tok = TikTokenConverter(vocab_file=str(ranks), pattern=self._enc._pat_str,
                                        additional_special_tokens=specials).converted()
        # split_special_tokens: a literal <|endoftext|> in text is plain text, as encode_ordinary made the shards
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, split_special_tokens=True)

    def fingerprint(self) -> str:
        # tiktoken's merges are its ranks: the token bytes in id order define them, the pattern the split
        h = hashlib.sha256(getattr(self._enc, "_pat_str", "").encode() + b"\0")
        for i in range(self._enc.n_vocab):
            try:
                h.update(self._enc.decode_single_token_bytes(i).hex().encode() + b",")
            except KeyError:  # an id between the ranks and the special tokens that maps to nothing
                h.update(b"-,")
        return h.hexdigest()

    def save(self, directory: str | Path) -> str:
        if self._path is None:
            return "gpt2"
        dest = Path(directory) / self._path.name
        if not dest.exists() or not dest.samefile(self._path):
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.copyfile(self._path, tmp)
            os.replace(tmp, dest)
        return f"tiktoken:{dest.name}"


def transformers_fingerprint(tok) -> str:
    """:meth:`Tokenizer.fingerprint` of a ``transformers`` tokenizer (no EOS needed, unlike :class:`HFTokenizer`):
    its backend's vocabulary and merges when it is fast, else its vocabulary."""
    if getattr(tok, "is_fast", False):
        return _tokenizers_fingerprint(tok.backend_tokenizer)
    return _digest({"vocab": sorted(tok.get_vocab().items(), key=lambda kv: kv[1])})  # a slow tokenizer


class HFTokenizer(Tokenizer):
    """Any ``transformers.AutoTokenizer``; its ``eos_token`` separates documents."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(name_or_path)
        except OSError as e:  # not on the Hub, gated, or no network
            raise ValueError(f"tokenizer hf:{name_or_path}: transformers could not load it ({str(e).splitlines()[0]}); "
                             f"pass a local folder (hf:PATH), a tokenizer.json, or --tokenizer bpe") from None
        self.name = f"hf:{name_or_path}"
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {self.name!r} has no EOS token, which adahop uses to separate documents; "
                             "choose another --tokenizer")
        self.eos_id = self._tok.eos_token_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if getattr(self._tok, "is_fast", False):  # the Rust backend: parallel, no max-length warnings
            return [e.ids for e in self._tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]
        return [self._tok.encode(t, add_special_tokens=False) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def fingerprint(self) -> str:
        return transformers_fingerprint(self._tok)

    def token_bytes(self) -> np.ndarray:
        out = None
        if getattr(self._tok, "is_fast", False):
            backend = self._tok.backend_tokenizer
            out = _backend_token_bytes(backend, self.vocab_size, set(self._tok.all_special_ids))
        return super().token_bytes() if out is None else out

    def to_transformers(self):
        return self._tok

    def save(self, directory: str | Path) -> str:
        self._tok.save_pretrained(str(Path(directory) / "hf_tokenizer"))
        return "hf:hf_tokenizer"


def load_tokenizer(spec: str | Path, *, base_dir: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer from a spec (table in the module doc) or a prepared data folder.

    Args:
        spec: ``bpe:PATH``, ``gpt2``, ``tiktoken:PATH``, ``hf:NAME_OR_PATH``, a ``.json``/``.tiktoken``
            file, or a folder with ``manifest.json`` or ``tokenizer.json``.
        base_dir: folder that relative paths in the spec are resolved against (a data folder).

    Raises:
        ValueError: an unknown spec (the message lists the valid forms) or an unreadable file.
    """
    spec = str(spec)
    base = Path(base_dir) if base_dir is not None else None

    def local(p: str) -> Path:
        path = Path(p).expanduser()
        return base / path if base is not None and not path.is_absolute() and (base / path).exists() else path

    as_path = local(spec)
    if as_path.is_dir():
        if (as_path / "manifest.json").is_file():
            recorded = json.loads((as_path / "manifest.json").read_text())["tokenizer"]["spec"]
            return load_tokenizer(recorded, base_dir=as_path)
        if (as_path / "tokenizer.json").is_file():
            return BPETokenizer.from_file(as_path / "tokenizer.json")
        raise ValueError(f"tokenizer folder {as_path} has neither manifest.json nor tokenizer.json")
    if spec == "gpt2":
        return TiktokenTokenizer()
    if spec.startswith("bpe:") or (spec.endswith(".json") and as_path.is_file()):
        path = local(spec.removeprefix("bpe:"))
        if not path.is_file():
            raise ValueError(f"tokenizer file {path} not found (spec {spec!r})")
        return BPETokenizer.from_file(path, name=f"bpe:{path}")
    if spec.startswith("tiktoken:") or (spec.endswith(".tiktoken") and as_path.is_file()):
        return TiktokenTokenizer(local(spec.removeprefix("tiktoken:")))
    if spec.startswith("hf:"):
        target = spec.removeprefix("hf:")
        path = local(target)
        return HFTokenizer(str(path) if path.exists() else target)
    raise ValueError(f"unknown tokenizer {spec!r}; use bpe (train one), bpe:PATH/tokenizer.json, gpt2, "
                     "tiktoken:PATH/gpt2.tiktoken, hf:NAME_OR_PATH, or a prepared data folder")
