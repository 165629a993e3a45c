"""Model presets: Llama-3-style ``transformers`` models, looked up by name, or any config JSON.

Every preset is a ``LlamaConfig`` (``LlamaForCausalLM``): RMSNorm (eps 1e-5), SwiGLU MLP, RoPE
with theta 500000, grouped-query attention, no biases, SDPA attention. ``vocab_size`` and
``max_position_embeddings`` come from the data (tokenizer) and ``--seq-len``. The small presets use
head_dim 64 (32 for ``llama-tiny``), an MLP width of 8/3 · hidden rounded to a multiple of 64 and
untied embeddings; the ``llama3.x`` presets copy the shapes of the released models (Llama 3.2 ties
the LM head to the embedding; the released models' long-context RoPE scaling is left out, since we
train from scratch at short lengths).

Parameter counts (exact, from :func:`param_counts`; ``non-emb`` excludes the input embedding
and an untied LM head):

=============  ======  =====  ==========  =======  ===============  ==============  ===============
preset         layers  d      heads / kv  ffn      non-emb          total, V=8192   total, V=50257
=============  ======  =====  ==========  =======  ===============  ==============  ===============
llama-tiny     2       128    4 / 2       384      0.39M            2.49M           13.26M
llama-20m      8       384    6 / 2       1024     12.59M           18.88M          51.19M
llama-60m      8       512    8 / 2       1344     21.77M           30.16M          73.23M
llama-125m     12      768    12 / 4      2048     75.52M           88.10M          152.71M
llama-350m     24      1024   16 / 4      2752     265.86M          282.64M         368.79M
llama3.2-1b    16      2048   32 / 8      8192     973.15M          989.92M         1076.07M
llama3.2-3b    28      3072   24 / 8      8192     2818.75M         2843.91M        2973.14M
llama3.1-8b    32      4096   32 / 8      14336    6979.59M         7046.70M        7391.29M
=============  ======  =====  ==========  =======  ===============  ==============  ===============

With the real Llama 3 vocabulary (128,256) the last three are 1,235,814,400, 3,212,749,824 and
8,030,261,248 parameters, as released.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from .utils import read_json

__all__ = ["PRESETS", "list_models", "model_config", "build_model", "check_compat", "param_counts",
           "ParamCounts", "model_flops_per_token"]

_LLAMA3 = dict(hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
               initializer_range=0.02, tie_word_embeddings=False)


def _small(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, head_dim: int = 64) -> dict:
    return {**_LLAMA3, "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": ffn, "head_dim": head_dim}


PRESETS: dict[str, dict] = {
    # CPU demo: a few hundred steps at seq 128, batch 8 on 2 cores in a couple of minutes.
    "llama-tiny": _small(2, 128, 4, 2, 384, head_dim=32),
    "llama-20m": _small(8, 384, 6, 2, 1024),
    "llama-60m": _small(8, 512, 8, 2, 1344),
    "llama-125m": _small(12, 768, 12, 4, 2048),
    "llama-350m": _small(24, 1024, 16, 4, 2752),
    # Shapes of the released models.
    "llama3.2-1b": {**_small(16, 2048, 32, 8, 8192), "tie_word_embeddings": True},
    "llama3.2-3b": {**_small(28, 3072, 24, 8, 8192, head_dim=128), "tie_word_embeddings": True},
    "llama3.1-8b": _small(32, 4096, 32, 8, 14336, head_dim=128),
}
"""``LlamaConfig`` keyword arguments of each preset, without ``vocab_size``/``max_position_embeddings``."""


def list_models() -> list[str]:
    """Names of the presets, in table order."""
    return list(PRESETS)


def _config_from_path(config_path: str | Path) -> transformers.PretrainedConfig:
    path = Path(config_path)
    if not path.is_dir() and not path.is_file():
        raise ValueError(f"--model-config {path} is neither a config JSON file nor a folder with config.json")
    raw = None if path.is_dir() else read_json(path, "--model-config")
    model_type = None if raw is None else raw.pop("model_type", None)
    if raw is not None and model_type is None:
        raise ValueError(f"--model-config {path} has no \"model_type\" (e.g. \"llama\"); add it to the JSON")
    try:
        if raw is None:
            return transformers.AutoConfig.from_pretrained(str(path))
        return transformers.AutoConfig.for_model(model_type, **raw)
    except ValueError:
        raise
    except Exception as e:  # transformers' own validation errors (e.g. a hidden size its heads do not divide)
        msg = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()[:300]
        raise ValueError(f"--model-config {path}: transformers refuses it ({type(e).__name__}: {msg}); fix the config") from None


def model_config(name: str | None = None, *, config_path: str | Path | None = None, vocab_size: int | None = None,
                 max_seq_len: int | None = None) -> transformers.PretrainedConfig:
    """The config of a preset, or of any ``transformers`` config JSON; no weights are made.

    Args:
        name: a preset of :data:`PRESETS` (``--model``); exactly one of ``name`` and ``config_path``.
        config_path: a config JSON file (with ``model_type``) or a folder with ``config.json``
            (``--model-config``). Its own vocab and length are kept; ``check_compat`` checks them
            against ``vocab_size`` and ``max_seq_len`` when those are given.
        vocab_size: vocabulary of the data (required for a preset).
        max_seq_len: training sequence length, used as ``max_position_embeddings`` of a preset.

    Returns:
        a ``LlamaConfig`` for presets, else the config class of the JSON's ``model_type``.

    Raises:
        ValueError: both or neither of name/config_path, an unknown preset (lists the valid
            names), a missing vocab_size/max_seq_len for a preset, or an incompatible config file.
    """
    if (name is None) == (config_path is None):
        raise ValueError("give exactly one of --model NAME or --model-config PATH")
    if config_path is not None:
        config = _config_from_path(config_path)
        if vocab_size is not None and max_seq_len is not None:
            check_compat(config, vocab_size=vocab_size, seq_len=max_seq_len)
        return config
    if name not in PRESETS:
        raise ValueError(f"unknown --model {name!r}; known models: {', '.join(PRESETS)} "
                         "(or pass --model-config PATH to a transformers config JSON)")
    if vocab_size is None or max_seq_len is None:
        raise ValueError(f"model {name!r} needs vocab_size (from the data) and max_seq_len (--seq-len)")
    return transformers.LlamaConfig(**PRESETS[name], vocab_size=vocab_size, max_position_embeddings=max_seq_len)


def check_compat(config: transformers.PretrainedConfig, *, vocab_size: int, seq_len: int) -> None:
    """Check that a model config can train on data of ``vocab_size`` at ``seq_len``.

    Raises:
        ValueError: ``seq_len`` > the config's ``max_position_embeddings`` (or ``n_positions``), or
            ``vocab_size`` > its embedding rows; the message names the option and the fix.
    """
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos is not None and seq_len > max_pos:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}; "
                         f"lower --seq-len to <= {max_pos} or raise max_position_embeddings in the model config")
    if vocab_size > config.vocab_size:
        raise ValueError(f"the data's vocabulary ({vocab_size} tokens) exceeds the model's embedding size "
                         f"({config.vocab_size}); prepare the data with a smaller tokenizer (--vocab-size) or set "
                         f"vocab_size >= {vocab_size} in the model config")


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    # transformers 5 renamed from_config's torch_dtype to dtype
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def build_model(name: str | None = None, *, config_path: str | Path | None = None, vocab_size: int,
                max_seq_len: int, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """Build a freshly initialised causal LM from a preset or a config file.

    Builds on the current default device (wrap in ``with torch.device("meta"):`` to allocate
    nothing). Presets use SDPA attention; config files keep transformers' default choice.

    Args:
        name, config_path, vocab_size, max_seq_len: as in :func:`model_config`.
        dtype: parameter dtype (e.g. ``torch.float32``, ``torch.bfloat16``).

    Returns:
        an ``AutoModelForCausalLM`` (``LlamaForCausalLM`` for presets): ``model(input_ids)`` takes
        int64 ids [B, T] with T <= max_seq_len and returns logits [B, T, vocab_size].

    Raises:
        ValueError: as :func:`model_config` and :func:`check_compat`.
    """
    config = model_config(name, config_path=config_path, vocab_size=vocab_size, max_seq_len=max_seq_len)
    kwargs = {"attn_implementation": "sdpa"} if name is not None else {}
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs, **_dtype_kwarg(dtype))


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamCounts:
    total: int
    """Distinct parameters (a tied LM head counted once)."""
    embedding: int
    """Input embedding table, vocab × d."""
    lm_head: int
    """Output projection, d × vocab, whether tied or not (it is a GEMM either way)."""
    non_embedding: int
    """``total`` minus the input embedding and an untied LM head: the transformer blocks and norms."""
    tied: bool


def param_counts(config: transformers.PretrainedConfig) -> ParamCounts:
    """Exact parameter counts of ``AutoModelForCausalLM.from_config(config)``, built on the meta device.

    Allocates no memory, so it works for 8B shapes on a laptop (about a second).
    """
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    tied = head is emb
    return ParamCounts(total=total, embedding=emb.numel(), lm_head=head.numel(), tied=tied,
                       non_embedding=total - emb.numel() - (0 if tied else head.numel()))


def model_flops_per_token(config: transformers.PretrainedConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward) of a decoder at sequence length ``seq_len``.

    Notes:
        ``6·N + 12·L·(n_heads·head_dim)·seq_len``, the formula of PaLM (Chowdhery et al. 2022,
        App. B): ``N`` = non-embedding parameters + the LM head (every weight that is a GEMM
        operand; the embedding lookup is not), 2 FLOPs per multiply-add, backward = 2× forward;
        the second term is the attention scores and weighted sum over the full ``seq_len × seq_len``
        matrix (a causal kernel does about half of it). Norms, activations and softmax are left out.
    """
    counts = param_counts(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6 * (counts.non_embedding + counts.lm_head) + 12 * config.num_hidden_layers * heads * head_dim * seq_len
