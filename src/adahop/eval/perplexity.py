"""Perplexity and bits per byte on a split of a prepared data folder, by the definition `adahop train`
uses for its validation loss: :func:`adahop.train.loop.evaluate` over the split's windows in order
(:meth:`adahop.data.TokenStream.val_batches`), so the same model, split, ``--seq-len``,
``--batch-size`` and number of batches give the same loss as the run's ``val_loss``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

__all__ = ["perplexity", "scored_batches", "prepared_data", "check_same_tokenizer", "default_window"]

#: Perplexity window of a model that `adahop train` did not write, at most: a Llama-3 config's 131,072
#: positions would make one window of the whole split (the GPTQ/QuIP literature scores at 2048).
FOREIGN_WINDOW = 2048


def default_window(run_config: dict | None, max_position_embeddings: int | None, ptq_meta: dict | None = None) -> int:
    """The perplexity window when ``--seq-len`` is not given: the run's own ``seq_len`` (so that the
    score equals ``adahop train``'s validation loss), else the window `adahop ptq` scored a quantized
    folder at (its config's ``adahop_ptq``, so that the score equals the one it printed), else
    ``min(max_position_embeddings, 2048)``.

    Args: ``run_config`` the run's ``config.json`` training settings (None or {} for a model adahop did
    not train); ``max_position_embeddings`` the model config's, or None; ``ptq_meta`` the model
    config's ``adahop_ptq`` section, or None. Returns tokens per window (int). Raises nothing.
    Source: ours (2048 is the window GPTQ and QuIP# report perplexity at)."""
    if run_config and run_config.get("seq_len"):
        return int(run_config["seq_len"])
    if ptq_meta and ptq_meta.get("seq_len"):
        return int(ptq_meta["seq_len"])
    return min(max_position_embeddings or FOREIGN_WINDOW, FOREIGN_WINDOW)


#: The training settings that decide how ``--data`` text becomes a prepared folder (which tokens, which split).
DATA_SETTINGS = ("data", "tokenizer", "vocab_size", "val_fraction")


def prepared_data(data: str, run_config: dict | None, model_dir: str | Path | None = None) -> Path:
    """The prepared folder of ``--data``: itself when it holds a ``manifest.json``, else what
    ``adahop train --data`` makes of it ('default' or text files, prepared once and cached) with the
    run's tokenizer settings (``run_config``: the run's ``adahop train`` config, or None). Text other than
    the run's own corpus is tokenized with the model's ``tokenizer.json`` (in ``model_dir``) where it has
    one: a BPE trained on that text would never match the model's vocabulary.

    Raises:
        ValueError: ``data`` is a model or run folder (its ``metrics.jsonl`` was taken for a corpus),
            or as :func:`adahop.train.setup.resolve_data`; the messages name ``--data``.
    """
    from ..train.config import TrainConfig
    from ..train.export import read_run_section
    from ..train.setup import resolve_data

    p = Path(data)
    if (p / "manifest.json").exists():
        return p
    if (p / "config.json").is_file():
        section = read_run_section(p) or {}
        own = f"pass the data it trained on, {section['data_dir']}" if section.get("data_dir") else \
            "pass a folder made by `adahop data prepare`, 'default', or text files"
        raise ValueError(f"--data {p} is a model folder (config.json), not data; {own}")
    rc = run_config or {}
    kw = {k: rc[k] for k in DATA_SETTINGS if k != "data" and k in rc}
    own_tok = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if rc.get("data") != data and own_tok is not None and own_tok.is_file():
        kw.pop("vocab_size", None)  # the model's tokenizer brings its own (resolve_data refuses one beside it)
        # a tiktoken run's tokenizer.json alone matches a literal <|endoftext|> as EOS, which its data holds as text:
        # through transformers (the folder's split_special_tokens) it gives the data's ids
        kw["tokenizer"] = (f"hf:{Path(model_dir).resolve()}" if _splits_special_tokens(Path(model_dir))
                           else f"bpe:{own_tok.resolve()}")  # the name a manifest records for a tokenizer.json
        if (kept := _kept_data(data, Path(model_dir), kw["tokenizer"])) is not None:
            return kept
    elif rc.get("data") != data and model_dir is not None:
        # a model's tokenizer in another form (vocab.json + merges.txt, SentencePiece): through transformers.
        # Never a BPE trained on the text: its ids would mean other tokens than the model's
        if any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES):
            kw.pop("vocab_size", None)
            kw["tokenizer"] = f"hf:{Path(model_dir).resolve()}"
        elif not rc:
            raise ValueError(f"--data {data}: {model_dir} holds no tokenizer to tokenize the text with; pass a folder "
                             f"prepared with the model's tokenizer (adahop data prepare --source {data} --tokenizer "
                             f"hf:NAME_OR_PATH --out DIR, then --data DIR)")
    try:
        return resolve_data(TrainConfig(data=data, **kw))
    except ValueError as e:  # the data preparation's own messages name its sources, not the option
        if str(e).startswith("--data"):
            raise
        raise ValueError(f"--data {data}: {e}") from None


#: What a transformers folder may keep its tokenizer in besides tokenizer.json.
_TOKENIZER_FILES = ("tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")


def _kept_data(data: str, run: Path, tokenizer: str) -> Path | None:
    """The run's own prepared folder when ``data`` tokenized with ``tokenizer`` (the run's tokenizer.json) is
    the same data by content: the sources' sha256, the tokenizer's fingerprint and the split. A run of
    ``adahop compare`` trained on that folder's path, not on 'default', and preparing the corpus again under
    the run's tokenizer.json took minutes for the same tokens. None when it is not, or cannot be told."""
    from ..data.cache import cached_path
    from ..data.identity import identity_changes
    from ..train.export import read_run_section

    section = read_run_section(run) or {}
    kept, old = section.get("data_dir"), section.get("data_identity")
    if not kept or old is None or not (Path(kept) / "manifest.json").is_file():
        return None
    split = old.get("split", {})
    try:
        _, new = cached_path([x for x in data.split(",") if x], tokenizer=tokenizer, vocab_size=0,
                             val_fraction=split.get("val_fraction"), seed=split.get("seed", 0),
                             text_field=split.get("text_field", "text"))
    except (ValueError, OSError):  # a missing or unreadable source: resolve_data says so in its own words
        return None
    # the tokenizer's name is how it was given ('bpe' then, the file now); its fingerprint is what it is
    nameless = lambda i: {**i, "tokenizer": {k: v for k, v in i.get("tokenizer", {}).items() if k != "name"}}  # noqa: E731
    return None if identity_changes(nameless(old), nameless(new)) else Path(kept)


def check_same_tokenizer(data_dir: Path, model_dir: Path, vocab_size: int, flag: str = "--data") -> None:
    """Raise ValueError when the data in ``data_dir`` was tokenized with another tokenizer than the
    model's: the perplexity of a model on foreign token ids is a silently wrong number.

    The check compares the vocabulary, merges, normalizer, pre-tokenizer and special tokens of the
    ``tokenizer.json`` of both folders where both have one, the data's fingerprint against an adahop
    run's recorded one or, for another model, against the fingerprint of the tokenizer transformers loads
    from its folder (tokenizer.json, vocab.json + merges.txt, SentencePiece...; data of a tiktoken tokenizer
    has a fingerprint of another kind and is not compared), and the data's
    vocabulary against the model's embedding size (``vocab_size``) always. ``flag``: the option
    the messages name (``adahop ptq`` takes the data as ``--calib-data``).
    """
    from ..data import Manifest

    m = Manifest.load(data_dir)
    if m.tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{flag} {data_dir}: its tokenizer has {m.tokenizer.vocab_size} tokens, the model only "
                         f"{vocab_size}; prepare the data with the model's tokenizer (--tokenizer hf:{model_dir})")
    run = _run_tokenizer(Path(model_dir))  # an adahop run records its data's tokenizer fingerprint
    if run is not None and _tiktoken_kind(run[2]) and not _tiktoken_kind(m.tokenizer.name):
        # fingerprints of two kinds (tiktoken's hashes token bytes, the tokenizers library's its JSON) never match: for
        # a tiktoken run's model and data of the tokenizers library (prepared with hf:RUN), the run folder's own
        # tokenizer, as transformers loads it, is the reference. The other way round (a BPE run, tiktoken data) the
        # two kinds differ, and are refused below as other tokenizers
        run = (_hf_fingerprint(Path(model_dir)), run[1], run[2])
    if run is not None and run[0] and m.tokenizer.sha256 and run[0] != m.tokenizer.sha256:
        own = f"pass the run's own data ({flag} {run[1]}), or " if run[1] else ""
        raise ValueError(f"{flag} {data_dir} was tokenized with {m.tokenizer.name}, another tokenizer than the one "
                         f"{model_dir} trained on (their fingerprints differ); {own}prepare the data with "
                         f"--tokenizer hf:{model_dir}")
    a, b = Path(data_dir) / "tokenizer.json", Path(model_dir) / "tokenizer.json"
    if a.exists() and b.exists() and _text_to_ids(a) != _text_to_ids(b):
        raise ValueError(f"{flag} {data_dir} was tokenized with another tokenizer than {model_dir}'s (their "
                         f"tokenizer.json differ); prepare the data with --tokenizer hf:{model_dir}")
    # any other model: its tokenizer's fingerprint, as transformers loads it, against the data's, where both are of
    # the tokenizers library (a trained BPE, a tokenizer.json, hf:); tiktoken's fingerprint is another kind
    comparable = m.tokenizer.name == "bpe" or m.tokenizer.name.startswith(("bpe:", "hf:"))
    if run is None and m.tokenizer.sha256 and comparable:
        own = _hf_fingerprint(Path(model_dir))
        if own is not None and own != m.tokenizer.sha256:
            raise ValueError(f"{flag} {data_dir} was tokenized with {m.tokenizer.name}, another tokenizer than "
                             f"{model_dir}'s (their fingerprints differ); prepare the data with --tokenizer "
                             f"hf:{model_dir}")


def _hf_fingerprint(model_dir: Path) -> str | None:
    """The fingerprint of the tokenizer transformers loads from ``model_dir``; None when there is none to load."""
    from transformers import AutoTokenizer

    from ..data.tokenizer import transformers_fingerprint

    if not any((model_dir / f).is_file() for f in ("tokenizer.json", *_TOKENIZER_FILES)):
        return None
    try:
        return transformers_fingerprint(AutoTokenizer.from_pretrained(str(model_dir)))
    except (ValueError, OSError):  # not loadable here: nothing to compare with
        return None


def _run_tokenizer(model_dir: Path) -> tuple[str | None, str | None, str | None] | None:
    """(tokenizer fingerprint, data folder, tokenizer name) an adahop run's config.json records, or None for
    other models."""
    from ..train.export import read_run_section

    try:
        section = read_run_section(model_dir)
    except (OSError, ValueError):
        return None
    if not section:
        return None
    tok = section.get("data_identity", {}).get("tokenizer", {})
    return tok.get("sha256"), section.get("data_dir"), tok.get("name")


def _splits_special_tokens(model_dir: Path) -> bool:
    """Whether the transformers tokenizer of ``model_dir`` reads special tokens in text as plain text
    (``split_special_tokens`` in its tokenizer_config.json, as a tiktoken run's export sets it), which its
    tokenizer.json loaded alone does not. Raises nothing (False when the file is missing or unreadable)."""
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("split_special_tokens") is True
    except (OSError, ValueError, AttributeError):
        return False


def _tiktoken_kind(*names: str | None) -> bool:
    """Whether any of these tokenizer names (``--tokenizer`` values, as a manifest records them) is tiktoken's:
    ``gpt2``, ``tiktoken:PATH`` or a ``.tiktoken`` file. Its fingerprint is of another kind than a ``tokenizers``
    one (:meth:`adahop.data.tokenizer.Tokenizer.fingerprint`), so the two are never compared."""
    return any(isinstance(n, str) and (n == "gpt2" or n.startswith("tiktoken:") or n.endswith(".tiktoken"))
               for n in names)


def _text_to_ids(path: Path) -> list:
    """The parts of a tokenizer.json that decide which ids a text becomes (the export's
    ``save_pretrained`` adds a post-processor that inserts nothing, so whole files may differ)."""
    d = json.loads(path.read_text())
    return [d.get(k) for k in ("normalizer", "pre_tokenizer", "model", "added_tokens")]


def scored_batches(data_dir: str | Path, split: str, *, seq_len: int, batch_size: int, max_batches: int | None,
                   run_batches: int | None = None, given: bool = True):
    """The stream of ``split`` that :func:`perplexity` scores, and its number of batches (``max_batches``,
    or every full batch when None); cheap, so a command can check its data before the work.

    ``run_batches``: what an omitted ``--eval-batches`` stands for (a run folder's own ``--eval-batches`` on its
    val split), None where it is the whole split; ``given``: whether ``max_batches`` is the user's (False: it is
    that default), so that a refusal's advice is what the options would actually do.

    Raises:
        ValueError: an unknown split, too few tokens for one batch, or ``max_batches`` more batches than
            the split holds (``adahop train`` refuses that too); the message names the options.
    """
    from ..data import TokenStream

    stream = TokenStream(data_dir, split, seq_len, batch_size, seed=0)
    stream.val_batches(1)  # raises the split's own message when it holds no full batch
    if max_batches is not None and max_batches > stream.steps_per_epoch:  # scoring fewer would not be what was asked
        n = stream.steps_per_epoch
        what = (f"--eval-batches {max_batches}" if given else
                f"--eval-batches {max_batches} (not given: the run's own, the default on its val split)")
        fix = (f"pass --eval-batches {n} or fewer (--eval-batches {n} scores the whole split)" if run_batches is not None
               else f"pass --eval-batches {n} or fewer, or drop it to score the whole split")
        raise ValueError(f"{what}: the {split} split of {data_dir} holds {n} batch(es) of --batch-size {batch_size} "
                         f"windows of --seq-len + 1 = {seq_len + 1} tokens; {fix}")
    return stream, stream.steps_per_epoch if max_batches is None else max_batches


def perplexity(model: torch.nn.Module, data_dir: str | Path, *, split: str = "val", seq_len: int, batch_size: int,
               max_batches: int | None = None, device: torch.device, bf16: bool) -> dict:
    """Mean cross-entropy of ``model`` on ``split`` of ``data_dir``, as perplexity and bits per byte.

    Args:
        model: a causal LM taking ``input_ids`` [B, T] (int64) and returning logits [B, T, V].
        data_dir: a folder written by ``adahop data prepare``.
        split: ``val`` or ``train``.
        seq_len: tokens per window (``--seq-len``; ``adahop train`` validates at its own).
        batch_size: windows per batch.
        max_batches: the first this many batches (``adahop train --eval-batches``); None: every full batch.
        device: where the model is.
        bf16: forward under BF16 autocast (what ``adahop train`` validates with on CUDA).

    Returns:
        ``{"split", "loss" (nats/token), "perplexity" (exp of loss), "bpb" (bits per UTF-8 byte), "tokens"
        (scored), "batches", "seq_len", "batch_size"}``.

    Raises:
        ValueError: as :func:`scored_batches`.
    """
    from ..train.loop import evaluate

    stream, n = scored_batches(data_dir, split, seq_len=seq_len, batch_size=batch_size, max_batches=max_batches)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    loss, bpb = evaluate(model, stream, device, autocast, n)
    model.eval()  # evaluate() leaves the model in training mode, as the training loop needs
    ppl = math.exp(loss) if loss < 709.0 else math.inf  # exp overflows a float past ~709.8 nats (a diverged model)
    return {"split": split, "loss": loss, "perplexity": ppl, "bpb": bpb, "tokens": n * batch_size * seq_len,
            "batches": n, "seq_len": seq_len, "batch_size": batch_size}
