"""``TokenStream``: stateless, seeded batches of token windows from a prepared data folder.

A *window* is ``seq_len + 1`` consecutive tokens of one shard; windows start every ``seq_len``
tokens, so they overlap by the one token that is the last target of a window and the first input
of the next. The batch at a step is a pure function of ``(seed, step, rank, world_size)``: resuming
needs no loader state, only the step.

Sampling (train): sample ``g = step·world_size·batch_size + rank·batch_size + i`` (``i`` the row in
the batch) takes window ``perm_e[g mod n]`` with ``e = g // n``, ``n`` the number of windows and
``perm_e`` a permutation of ``range(n)`` seeded by ``(seed, e)``. So within an epoch no window is
drawn twice, across all ranks; epochs are reshuffled. Validation (:meth:`TokenStream.val_batches`)
walks the windows in order instead.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from adahop.data.manifest import Manifest

__all__ = ["TokenStream"]


class TokenStream:
    """Batches ``(x, y)`` of one split of a prepared data folder (see module doc for the sampling).

    Args:
        data_dir: folder written by :func:`adahop.data.prepare`.
        split: ``"train"`` or ``"val"``.
        seq_len: tokens per sequence (``--seq-len``); windows hold ``seq_len + 1``.
        batch_size: sequences per batch on this rank.
        seed: shuffling seed (>= 0).
        rank, world_size: this process's index among the data-parallel processes.

    Raises:
        ValueError: a bad argument, or a split with no window (fewer than ``seq_len + 1`` tokens in
            every shard); the message names ``--seq-len`` and the fix.
        FileNotFoundError: ``data_dir`` was not prepared.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"--seq-len ({seq_len}) and --batch-size ({batch_size}) must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        if seed < 0:
            raise ValueError(f"--seed {seed} must be >= 0")
        self.data_dir = Path(data_dir)
        self.manifest = Manifest.load(self.data_dir)
        self.split = split
        self.info = self.manifest.split(split)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._shards = [np.memmap(self.data_dir / s.file, dtype=self.manifest.dtype, mode="r")
                        for s in self.info.shards if s.tokens > seq_len]
        counts = [(len(m) - 1) // seq_len for m in self._shards]
        self._offsets = np.cumsum([0] + counts)  # window index where each shard starts
        self.n_windows = int(self._offsets[-1])
        if self.n_windows == 0:
            raise ValueError(f"the {split} split of {self.data_dir} has {self.info.tokens} tokens, fewer than "
                             f"--seq-len + 1 = {seq_len + 1} in any shard; lower --seq-len or prepare more data"
                             + (" (or a larger --val-fraction)" if split == "val" else ""))
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        self._scored_bpt: dict[int, float] = {}  # max_batches -> bytes per scored target token
        self._table = False  # the tokenizer's bytes per id, loaded on first use (None: cannot be loaded)

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens in one pass over all windows (all ranks together): ``n_windows * seq_len``."""
        return self.n_windows * self.seq_len

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches (``batch_size * world_size`` windows) in one epoch."""
        return self.n_windows // (self.batch_size * self.world_size)

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 text bytes per token of this split, from the manifest (EOS tokens included in the count)."""
        return self.info.text_bytes / self.info.tokens

    def scored_bytes_per_token(self, max_batches: int | None = None) -> float:
        """UTF-8 text bytes per target token of the windows :meth:`val_batches` (``max_batches``) scores on
        all ranks together (EOS targets count 0 bytes), from the data folder's tokenizer
        (:meth:`adahop.data.tokenizer.Tokenizer.token_bytes`); cached per ``max_batches``. Falls back to
        the split's :attr:`bytes_per_token` when the tokenizer cannot be loaded here."""
        key = self.steps_per_epoch if max_batches is None else min(max_batches, self.steps_per_epoch)
        cache = self._scored_bpt
        if key not in cache:
            table = self._token_bytes()
            if table is None:
                cache[key] = self.bytes_per_token
            else:
                windows = range(key * self.world_size * self.batch_size)  # val_batches' windows, every rank's
                nbytes = sum(int(table[self._window(j)[1:].astype(np.int64)].sum()) for j in windows)
                cache[key] = nbytes / (len(windows) * self.seq_len)
        return cache[key]

    def _token_bytes(self) -> np.ndarray | None:
        if self._table is False:  # not loaded yet (None: cannot be here)
            from .tokenizer import load_tokenizer

            try:
                self._table = load_tokenizer(self.manifest.tokenizer.spec, base_dir=self.data_dir).token_bytes()
            except (OSError, ValueError, ImportError) as e:
                warnings.warn(f"adahop: bits per byte of {self.data_dir} use the split's bytes per token, not the scored "
                              f"windows': its tokenizer ({self.manifest.tokenizer.spec}) cannot be loaded here ({e})",
                              stacklevel=3)
                self._table = None
        return self._table

    def bits_per_byte(self, loss_nats: float, max_batches: int | None = None) -> float:
        """Bits per UTF-8 byte of a mean cross-entropy ``loss_nats`` (nats/token) over the windows
        ``val_batches(max_batches)`` scores: ``loss_nats / (ln 2 · their bytes per target token)``
        (:meth:`scored_bytes_per_token`). Until 2026-12-05 the split's bytes per token was used for any
        ``max_batches``: on the default corpus the first windows hold ~7% more bytes per token than the
        split, so a run's val bpb read ~7% high."""
        return loss_nats / (math.log(2) * self.scored_bytes_per_token(max_batches))

    def _window(self, j: int) -> np.ndarray:
        """Window ``j`` in ``[0, n_windows)``: ``seq_len + 1`` tokens, shape [seq_len + 1], shard dtype."""
        s = int(np.searchsorted(self._offsets, j, side="right")) - 1
        start = (j - int(self._offsets[s])) * self.seq_len
        return self._shards[s][start:start + self.seq_len + 1]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # one epoch is cached; a batch spans at most two
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def _stack(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xy = torch.from_numpy(np.stack([self._window(j) for j in windows]).astype(np.int64))  # (B, T+1)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T), (B, T)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` for this rank.

        Returns:
            ``x, y``: int64 CPU tensors of shape [batch_size, seq_len]; ``y[:, t] == x[:, t + 1]``
            and ``y[:, -1]`` is the token after the window's inputs.

        Raises:
            ValueError: ``step < 0``.
        """
        if step < 0:
            raise ValueError(f"step {step} must be >= 0")
        first = (step * self.world_size + self.rank) * self.batch_size
        windows = []
        for g in range(first, first + self.batch_size):
            epoch, pos = divmod(g, self.n_windows)
            windows.append(int(self._permutation(epoch)[pos]))
        return self._stack(windows)

    def val_batches(self, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed, sequential batches for evaluation: the same windows on every call.

        Batch ``k`` of this rank holds windows ``(k·world_size + rank)·batch_size + i``. Only full
        global batches are used, so every rank yields the same number of batches.

        Args:
            max_batches: at most this many batches (None: all full batches).

        Yields:
            ``x, y`` as in :meth:`batch`.

        Raises:
            ValueError: not even one full global batch of windows (message names the options).
        """
        n = self.steps_per_epoch if max_batches is None else min(max_batches, self.steps_per_epoch)
        if self.steps_per_epoch == 0:
            per = " (--batch-size x world size)" if self.world_size > 1 else " (--batch-size)"
            raise ValueError(f"the {self.split} split has {self.n_windows} windows of --seq-len + 1 = "
                             f"{self.seq_len + 1} tokens, fewer than one batch of {self.batch_size * self.world_size}"
                             f"{per}; lower --batch-size or --seq-len, or prepare more data")
        return (self._stack(list(range(first, first + self.batch_size)))
                for first in ((k * self.world_size + self.rank) * self.batch_size for k in range(n)))
