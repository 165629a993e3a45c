"""`TrainConfig`: every option of `adahop train`, documented at the declaration (STYLE §2.9).

The CLI builds its flags from these fields (``--seq-len`` for ``seq_len``, :func:`add_config_flags`),
so the help text is the docstring under each field. This module imports nothing heavy (no torch):
``adahop --help`` and option errors stay fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass

__all__ = ["TrainConfig", "field_docs", "add_config_flags", "config_from", "ERROR_FILE"]

#: where a failed ``adahop train`` leaves its error (``compare`` points there); a new attempt removes it
ERROR_FILE = "error.txt"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Options of one training run. Validated when built; errors name the ``--flag``."""

    recipe: str = "adahop-lv2"
    """Recipe preset (``adahop recipes`` lists them)."""
    model: str = "llama-tiny"
    """Model preset (llama-tiny, llama-20m, llama-60m, llama-125m, llama-350m, llama3.2-1b, llama3.2-3b, llama3.1-8b)."""
    model_config: str | None = None
    """A transformers config JSON (file or folder) used instead of --model."""
    data: str = "default"
    """'default' (built-in corpus), a folder made by `adahop data prepare`, or comma-separated text files."""
    tokenizer: str = "bpe"
    """Tokenizer when --data must be prepared: bpe, gpt2, tiktoken:PATH or hf:NAME."""
    vocab_size: int = 8192
    """BPE vocabulary size when --data must be prepared with --tokenizer bpe."""
    out: str = "runs/default"
    """Run folder: config.json, metrics.jsonl, checkpoints/, plots, the exported model."""
    seq_len: int = 128
    """Tokens per sequence."""
    batch_size: int = 16
    """Sequences per optimizer step (all ranks and micro-batches together)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; --batch-size must be divisible by it. AdaHOP's calibration observes the
    first micro-batch of each step, so its plan may differ from that of --grad-accum 1."""
    steps: int = 300
    """Optimizer steps."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of --lr."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; norms and biases get none)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    optimizer: str = "adamw"
    """adamw, sr-adamw (stochastic rounding of the master update), kahan-adamw (compensated) or m+adam (docs/optim.md)."""
    master_weights: str = "fp32"
    """Master-weight storage: fp32, bf16, fp8 (E4M3, a power-of-two scale per 32), fp4 (MXFP4) or nvfp4; no wider copy is kept."""
    optimizer_states: str = "fp32"
    """Dtype of the optimizer states (moments, Kahan buffer): fp32 or bf16."""
    madam_form: str = "arxiv-relative"
    """M+Adam update form: arxiv-relative, arxiv (the literal third-party reading) or workshop (docs/optim.md)."""
    madam_mul_lr: float = 10.0
    """M+Adam's multiplicative learning rate as a multiple of --lr (it follows the same schedule)."""
    master_rounding: str = "auto"
    """Rounding of each low-precision master write: auto (stochastic for sr-adamw, nearest otherwise), nearest or stochastic."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    eval_every: int = 50
    """Steps between validation passes (and at the last step); 0: no validation at all."""
    eval_batches: int = 8
    """Validation batches per pass: the first --eval-batches × --batch-size windows of the val split, so runs of
    other --batch-size score other windows (compare val losses at one batch size); run in --grad-accum's
    micro-batches."""
    ckpt_every: int = 100
    """Steps between checkpoints (and at the last step); 0 keeps only the final one."""
    keep_ckpts: int = 2
    """Checkpoints kept on disk (the newest)."""
    log_every: int = 10
    """Steps between metric lines."""
    log_to: str = "jsonl"
    """Loggers, comma-separated: jsonl (metrics.jsonl, always written), tensorboard (<out>/tensorboard), wandb (offline unless WANDB_MODE is set)."""
    seed: int = 0
    """Seed of initialization, data order, stochastic rounding and random signs."""
    data_seed: int | None = None
    """Seed of the training data order alone (default: --seed), as Hugging Face's data_seed: it separates init from data order in a seed study."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda'."""
    compile: bool = False
    """torch.compile the model once the AdaHOP plan is frozen (calibration steps run eagerly), in mode reduce-overhead (Inductor replayed from CUDA graphs) in one CUDA process, in the default mode (Inductor, no CUDA graphs) on the CPU; under --parallel ddp/fsdp compiled in the default mode from the start and recompiled at the freeze."""
    recompute: bool = False
    """Selective activation recompute of the transformer blocks (adahop.nn.recompute): GEMM and attention outputs kept, the rest (norms, SiLU·mul, RoPE) recomputed in backward, and the converted layers' X prepared there; less memory for a little time, the same numbers eager (compiled: equal to rounding; recipes with random bits draw others of the same distribution)."""
    backend: str = "auto"
    """Kernel backend: auto (fast path on CUDA), triton or reference. Never changes numerics."""
    calib_steps: int | None = None
    """Override the recipe's AdaHOP calibration steps (30 in the paper)."""
    plan: str | None = None
    """A plan.json (from `adahop analyze` or a run): use it and skip calibration."""
    resume: bool = False
    """Continue from the newest checkpoint in --out."""
    reschedule: bool = False
    """With --resume and a larger --steps: stretch the cosine decay over the new --steps (the lr jumps up). Default: keep the original run's schedule; steps past its end run at the final lr."""
    parallel: str = "none"
    """Data parallelism under torchrun: none, ddp or fsdp."""
    val_fraction: float = 0.01
    """Share of the corpus held out when --data must be prepared."""

    def __post_init__(self) -> None:
        def bad(flag: str, msg: str) -> None:
            raise ValueError(f"--{flag.replace('_', '-')}: {msg}")

        for f in dataclasses.fields(self):  # NaN passes every comparison below (nan < 0 is False): check first
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                bad(f.name, f"must be a finite number, got {v}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "log_every", "keep_ckpts"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.data_seed is not None and self.data_seed < 0:
            bad("data_seed", f"must be >= 0, got {self.data_seed}")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "seed", "grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            bad("grad_accum", f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}")
        if not self.lr > 0:
            bad("lr", f"must be > 0, got {self.lr}")
        if self.lr * self.weight_decay >= 1:  # decoupled decay multiplies each weight by 1 - lr·wd every step
            bad("weight_decay", f"--lr {self.lr:g} x --weight-decay {self.weight_decay:g} = {self.lr * self.weight_decay:g} "
                                f">= 1: the decay would multiply every weight by {1 - self.lr * self.weight_decay:g} each step, "
                                f"flipping or zeroing them; lower --lr or --weight-decay")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, f"must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            bad("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.model_config is None:  # a typo fails here, before any data is prepared or warning printed
            from ..models import PRESETS

            if self.model not in PRESETS:
                bad("model", f"unknown model {self.model!r}; known models: {', '.join(PRESETS)} "
                             "(or pass --model-config PATH to a transformers config JSON)")
        if not str(self.out).strip():  # Path("") is the working directory: the run's files would land among the user's
            bad("out", "is empty; pass the run folder to write, e.g. --out runs/my-run")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad("device", f"{self.device!r}; use auto, cpu or cuda")
        if self.backend not in ("auto", "triton", "reference"):
            bad("backend", f"{self.backend!r}; use auto, triton or reference")
        if self.parallel not in ("none", "ddp", "fsdp"):
            bad("parallel", f"{self.parallel!r}; use none, ddp or fsdp")
        if self.calib_steps is not None and self.calib_steps < 1:
            bad("calib_steps", f"must be >= 1, got {self.calib_steps}")
        if self.calib_steps is not None and self.plan:  # the start-up table said "calibration: N steps" regardless
            bad("calib_steps", f"{self.calib_steps} with --plan: the plan is frozen, so no calibration runs; drop one "
                "(AdaHOPCallback and prepare_adahop refuse the same)")
        if self.reschedule and not self.resume:  # it only changes the schedule a resumed run keeps
            bad("reschedule", "only applies with --resume (it stretches a resumed run's cosine decay over a larger "
                "--steps); add --resume to continue the run in --out, or drop --reschedule")
        from .metrics import parse_log_to

        parse_log_to(self.log_to)  # an unknown or uninstalled logger fails before any work

        from ..optim.checks import check_optimizer_options  # the optimizer's own choices and combinations

        check_optimizer_options(self, bad)

    def to_dict(self) -> dict:
        """The config as a plain dict (stored in config.json)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Rebuild a config from :meth:`to_dict` output; ValueError for unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


def field_docs(cls=TrainConfig) -> dict[str, str]:
    """The docstring under each dataclass field (used as --help text)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def add_config_flags(p: argparse.ArgumentParser, cls=TrainConfig, *, skip=(), defaults: dict | None = None) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` to ``p``: typed from the annotation (a bool
    becomes ``--flag/--no-flag``), help text from the docstring under the field (:func:`field_docs`).

    ``skip``: field names to leave out. ``defaults``: field name -> default of this parser (e.g.
    ``compare``'s ``--out runs/compare``), shown as such in ``--help``.
    """
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = hints[f.name]
        base = next((a for a in typing.get_args(t) if a is not type(None)), t)
        default = defaults.get(f.name, f.default)
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if base is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            p.add_argument(flag, type=base, default=default, help=help_, metavar=f.name.upper())


def config_from(args: argparse.Namespace, cls=TrainConfig, **override):
    """``cls`` built from the parsed ``args`` that name its fields, with ``override`` on top.

    Raises:
        ValueError: a value the config's validation refuses (the message names the ``--flag``).
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(args).items() if k in fields}
    kw.update(override)
    return cls(**kw)
