"""Where users already train: `convert_model(module_filter_fn=)` (torchao's filter signature), the
step hook through the optimizer, the Hugging Face `Trainer` callback (train, checkpoint, resume with
the plan kept), accelerate, and the README blocks of each integration, run as printed."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import adahop
from adahop.nn.convert import controller_state, load_controller_state, register_step_hook

README = Path(__file__).resolve().parents[1] / "README.md"


def _tiny_llama(seed: int = 0, vocab: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _readme_block(title: str) -> str:
    """The first ```python block under the README heading ``title``."""
    text = README.read_text()
    m = re.search(rf"\n#+ {re.escape(title)}\n.*?```python\n(.*?)```", text, re.S)
    assert m, f"README has no python block under {title!r}"
    return m.group(1)


def _run_readme_block(title: str, tmp_path: Path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_readme_block(title), "README.md", "exec"), {"__name__": "__readme__"})
    return out.getvalue()


# ---- convert_model(module_filter_fn=) -------------------------------------------------------------


def test_a_torchao_filter_selects_the_same_layers_as_in_torchao():
    """A filter written for torchao's convert_to_float8_training converts exactly the layers torchao does."""
    from torchao.float8 import convert_to_float8_training

    def filt(mod: nn.Module, fqn: str) -> bool:  # torchao style: skip attention and small layers
        return "self_attn" not in fqn and mod.in_features >= 128

    ours = adahop.convert_model(_tiny_llama(), "mxfp4", exclude=None, module_filter_fn=filt)
    theirs = convert_to_float8_training(_tiny_llama(), module_filter_fn=filt)
    converted = {n for n, m in ours.named_modules() if isinstance(m, adahop.LowPrecisionLinear)}
    f8 = {n for n, m in theirs.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == f8 == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}


def test_module_filter_fn_and_exclude_both_apply_and_bad_filters_are_refused():
    seen = []

    def filt(mod, fqn):
        seen.append((type(mod), fqn))
        return not fqn.endswith("q_proj")

    m = adahop.convert_model(_tiny_llama(), "mxfp4", exclude=("lm_head", "*.mlp.*"), module_filter_fn=filt)
    converted = sorted(n for n, x in m.named_modules() if isinstance(x, adahop.LowPrecisionLinear))
    assert converted == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "o_proj", "v_proj")]
    # the filter sees only the nn.Linear layers that exclude keeps, with their qualified names
    assert {t for t, _ in seen} == {nn.Linear} and len(seen) == 8 and not any("mlp" in f or "lm_head" in f for _, f in seen)
    with pytest.raises(TypeError, match=r"returned None; it must return True"):
        adahop.convert_model(_tiny_llama(), "mxfp4", module_filter_fn=lambda mod, fqn: None)
    with pytest.raises(TypeError, match="must be a callable"):
        adahop.convert_model(_tiny_llama(), "mxfp4", module_filter_fn="q_proj")
    with pytest.raises(ValueError, match="module_filter_fn leave none"):
        adahop.convert_model(_tiny_llama(), "mxfp4", module_filter_fn=lambda mod, fqn: False)


# ---- the step hook and the controller state ---------------------------------------------------------


def test_step_hook_counts_optimizer_steps_and_state_round_trips():
    """register_step_hook freezes the plan after the calibration's last optimizer step; the state
    restores that plan (no new calibration) into a fresh model, and a mid-calibration state continues."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))  # noqa: E731
    recipe = _short_calibration("adahop-lv2", 3)
    model = adahop.convert_model(make(), recipe, exclude=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    frozen = []
    register_step_hook(model, opt, on_freeze=lambda m: frozen.append(adahop.get_controller(m).step))
    for step in range(5):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            mid = json.loads(json.dumps(controller_state(model)))  # what a checkpoint stores: plain JSON
    assert frozen == [3] and controller_state(model)["step"] == 5
    state = json.loads(json.dumps(controller_state(model)))
    assert state["plan"]["layers"].keys() == {"0", "2"} and state["calibration_history"] is None

    fresh = adahop.convert_model(make(), recipe, exclude=None)
    load_controller_state(fresh, state)
    ctrl = adahop.get_controller(fresh)
    assert not ctrl.calibrating and ctrl.calibrator is None and ctrl.step == 5
    assert json.loads(ctrl.plan.to_json()) == state["plan"]

    cont = adahop.convert_model(make(), recipe, exclude=None)
    load_controller_state(cont, mid)
    c = adahop.get_controller(cont)
    assert c.calibrating and c.step == 2 and c.calibrator.history == mid["calibration_history"]
    assert len(mid["calibration_history"]["0"]["x"]) == 2  # two steps of votes kept, not restarted


def _short_calibration(name: str, steps: int):
    import dataclasses

    r = adahop.get_recipe(name)
    return dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=steps))
