"""adahop.models: presets, config files, compatibility checks, parameter and FLOP counts (CPU)."""

import json

import pytest
import torch
import transformers

from adahop.models import (PRESETS, build_model, check_compat, list_models, model_config, model_flops_per_token,
                           param_counts)

SMALL = ["llama-tiny", "llama-20m", "llama-60m"]  # built for real; the rest on the meta device
# Released sizes with the Llama 3 vocabulary (128,256 tokens).
RELEASED = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248}


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None)  # transformers >= 5
    return rope["rope_theta"] if rope else config.rope_theta


def test_list_models():
    assert list_models() == list(PRESETS) == ["llama-tiny", "llama-20m", "llama-60m", "llama-125m", "llama-350m",
                                              "llama3.2-1b", "llama3.2-3b", "llama3.1-8b"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_config_and_meta_build(name):
    cfg = model_config(name, vocab_size=8192, max_seq_len=256)
    assert isinstance(cfg, transformers.LlamaConfig)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (8192, 256)
    assert _rope_theta(cfg) == 500000.0 and cfg.hidden_act == "silu" and cfg.rms_norm_eps == 1e-5
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.tie_word_embeddings == (name in ("llama3.2-1b", "llama3.2-3b"))
    if name.startswith("llama-") and name != "llama-tiny":  # tiny keeps 3x hidden (384)
        assert cfg.intermediate_size % 64 == 0 and abs(cfg.intermediate_size - 8 / 3 * cfg.hidden_size) <= 32
    with torch.device("meta"):
        model = build_model(name, vocab_size=8192, max_seq_len=256, dtype=torch.bfloat16)
    assert isinstance(model, transformers.LlamaForCausalLM) and model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.bfloat16
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.embedding == counts.lm_head == 8192 * cfg.hidden_size
    L, d, hd = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    per_layer = d * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * d * cfg.intermediate_size + 2 * d
    assert counts.non_embedding == L * per_layer + d


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_shapes_match_real_parameter_counts(name):
    assert param_counts(model_config(name, vocab_size=128256, max_seq_len=8192)).total == RELEASED[name]


@pytest.mark.parametrize("name", SMALL)
def test_small_presets_build_and_run(name):
    torch.manual_seed(0)
    model = build_model(name, vocab_size=512, max_seq_len=64)
    assert next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == param_counts(model.config).total
    if name == "llama-tiny":
        x = torch.randint(0, 512, (2, 64))
        out = model(x, labels=x)
        assert out.logits.shape == (2, 64, 512) and torch.isfinite(out.loss)
        out.loss.backward()
        assert model.get_output_embeddings().weight.grad is not None


def test_unknown_model_lists_known():
    with pytest.raises(ValueError, match="llama-tiny.*llama3.1-8b"):
        model_config("gpt-5", vocab_size=8192, max_seq_len=128)
    with pytest.raises(ValueError, match="exactly one"):
        model_config(vocab_size=8192, max_seq_len=128)
    with pytest.raises(ValueError, match="exactly one"):
        model_config("llama-tiny", config_path="x.json", vocab_size=8192, max_seq_len=128)
    with pytest.raises(ValueError, match="vocab_size"):
        model_config("llama-tiny")


def test_check_compat():
    cfg = model_config("llama-tiny", vocab_size=1000, max_seq_len=128)
    check_compat(cfg, vocab_size=1000, seq_len=128)
    check_compat(cfg, vocab_size=900, seq_len=64)
    with pytest.raises(ValueError, match="--seq-len 256 exceeds.*128"):
        check_compat(cfg, vocab_size=1000, seq_len=256)
    with pytest.raises(ValueError, match="vocabulary \\(1001 tokens\\).*--vocab-size"):
        check_compat(cfg, vocab_size=1001, seq_len=128)


def test_config_path_json_and_folder(tmp_path):
    raw = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    model = build_model(config_path=str(path), vocab_size=300, max_seq_len=32)
    assert isinstance(model, transformers.LlamaForCausalLM) and model.config.vocab_size == 300
    model.config.save_pretrained(tmp_path / "folder")
    assert model_config(config_path=tmp_path / "folder").hidden_size == 64
    with pytest.raises(ValueError, match="--seq-len 64 exceeds"):
        build_model(config_path=str(path), vocab_size=300, max_seq_len=64)
    with pytest.raises(ValueError, match="vocab_size >= 301"):
        build_model(config_path=str(path), vocab_size=301, max_seq_len=32)
    del raw["model_type"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="model_type"):
        model_config(config_path=path)
    with pytest.raises(ValueError, match="neither a config JSON"):
        model_config(config_path=tmp_path / "missing.json")


def test_model_flops_per_token():
    cfg = model_config("llama-tiny", vocab_size=8192, max_seq_len=128)
    c = param_counts(cfg)
    assert c.non_embedding == 393_856 and c.lm_head == 8192 * 128 and not c.tied
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 128
    assert model_flops_per_token(cfg, 128) == 6 * (393_856 + 8192 * 128) + attn
    tied = model_config("llama3.2-1b", vocab_size=128256, max_seq_len=4096)
    tc = param_counts(tied)
    assert tc.tied and tc.non_embedding == RELEASED["llama3.2-1b"] - 128256 * 2048
    assert model_flops_per_token(tied, 4096) == 6 * (tc.non_embedding + tc.lm_head) + 12 * 16 * 32 * 64 * 4096


def test_malformed_json_names_the_file(tmp_path):
    bad = tmp_path / "cfg.json"
    bad.write_text('{"hidden_size": 64,}')
    with pytest.raises(ValueError, match=r"--model-config .*cfg.json is not valid JSON"):
        build_model(config_path=bad, vocab_size=256, max_seq_len=16)


def test_a_config_transformers_refuses_is_a_value_error_naming_the_file(tmp_path):
    """hidden 100 with 4 heads (head_dim 25, odd for RoPE) ended in a 25-line transformers traceback."""
    import json

    cfg = tmp_path / "odd.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 100, "intermediate_size": 256, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}))
    with pytest.raises(ValueError, match=r"--model-config .*odd.json: transformers refuses it \(.*head_dim.*\); fix the config"):
        build_model(config_path=cfg, vocab_size=256, max_seq_len=16)
