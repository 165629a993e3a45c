"""Data for adahop: text sources → tokenizer → token shards (``prepare``) → training batches (``TokenStream``).

Typical use::

    from adahop.data import prepare, TokenStream
    prepare(["default"], "data/sotu", tokenizer="bpe", vocab_size=8192)
    train = TokenStream("data/sotu", "train", seq_len=1024, batch_size=8, seed=0)
    x, y = train.batch(step)            # int64 [8, 1024] each, y = x shifted by one

Modules: :mod:`~adahop.data.sources` (files, folders, ``hf:``, ``default``),
:mod:`~adahop.data.default_corpus` (the npm-fetched default corpus), :mod:`~adahop.data.tokenizer`,
:mod:`~adahop.data.blocks` (blocking and the train/val rule), :mod:`~adahop.data.shards` (``prepare``),
:mod:`~adahop.data.manifest`, :mod:`~adahop.data.identity` (what makes two preparations the same data),
:mod:`~adahop.data.cache` (``--data`` text files prepared once per content), :mod:`~adahop.data.stream`
(``TokenStream``).
"""

from adahop.data.default_corpus import cache_dir, default_corpus_path
from adahop.data.manifest import Manifest, ShardInfo, SplitInfo, TokenizerInfo
from adahop.data.shards import prepare
from adahop.data.sources import SourceInfo, resolve_sources
from adahop.data.stream import TokenStream
from adahop.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "prepare", "Manifest", "ShardInfo", "SplitInfo", "TokenizerInfo", "SourceInfo", "TokenStream",
    "Tokenizer", "load_tokenizer", "train_bpe", "resolve_sources", "default_corpus_path", "cache_dir",
]
