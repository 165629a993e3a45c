"""AdaHOP through torchtitan 0.3.0's converter mechanism: the config transform, the Module protocol,
and torchtitan's own Trainer training the Llama 3 debug model on the CPU, with the plan frozen by the
post-optimizer hook.

torchtitan targets CUDA and PyTorch nightlies; to run its Trainer on this CPU with torch 2.13.0 the
test changes three things and nothing else: a CPU stand-in for its device module (it picks "cuda"
when no accelerator exists), a no-op for ``set_pg_timeouts`` (it calls ``torch.distributed.set_timeout``,
absent from torch 2.13.0), and SDPA for FlexAttention (FlexAttention has no CPU backward)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
import torch

import adahop


@pytest.fixture
def titan_on_cpu(monkeypatch, tmp_path):
    import torchtitan.tools.utils as tu

    class _Props:
        total_memory, name = 64 << 30, "cpu"

    cpu = types.SimpleNamespace(set_device=lambda *a: None, device_count=lambda: 1, current_device=lambda: 0,
                                get_device_name=lambda *a: "cpu", get_device_properties=lambda *a: _Props(),
                                reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
                                memory_stats=lambda *a: {}, synchronize=lambda *a: None, is_available=lambda: True)
    import torchtitan.distributed.utils as du
    import torchtitan.trainer  # noqa: F401  (loads the modules that copy the device globals at import)

    orig_type, orig_module = tu.device_type, tu.device_module
    for mod in [m for n, m in sys.modules.items() if n.startswith("torchtitan") and m is not None]:
        if getattr(mod, "device_type", None) is orig_type and isinstance(orig_type, str):
            monkeypatch.setattr(mod, "device_type", "cpu")
        if getattr(mod, "device_module", None) is orig_module:
            monkeypatch.setattr(mod, "device_module", cpu)
    monkeypatch.setattr(du, "set_pg_timeouts", lambda **k: None)
    for k, v in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561").items():
        monkeypatch.setenv(k, v)
    yield tmp_path
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _debug_spec(n_layers: int = 2, **converter):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from adahop.integrations.torchtitan import AdaHOPConverter, with_adahop

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:n_layers]
    for _fqn, _c, parent, attr in spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return with_adahop(spec, AdaHOPConverter.Config(**converter))


def test_converter_turns_every_in_layer_linear_and_keeps_lm_head_and_the_module_protocol():
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3.model import Llama3Model

    from adahop.integrations.torchtitan import AdaHOPLinear

    spec = _debug_spec(recipe="mxfp4")
    assert isinstance(spec.model, Llama3Model.Config) and spec.model.adahop.recipe == "mxfp4"
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()  # what torchtitan's Trainer checks right after the build
    assert isinstance(model, Llama3Model)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("lm_head") is Linear
    assert set(kinds.values()) == {AdaHOPLinear} and len(kinds) == 2 * 5  # wqkv, wo, w1, w2, w3 per block
    # torchtitan initializes it through the original param_init, on a real device after to_empty
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    w1 = model.get_submodule("layers.0.feed_forward.w1").weight
    assert torch.isfinite(w1).all() and 0.01 < float(w1.std()) < 0.03  # trunc_normal std 0.02 of the debug model
    # the state-dict keys are torchtitan's own (checkpoints and the HF adapter see no difference)
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        plain = model_registry("debugmodel").model.build()
    assert set(model.state_dict()) <= set(plain.state_dict())


def test_converter_refuses_an_unknown_recipe_and_a_double_listing():
    from adahop.integrations.torchtitan import AdaHOPConverter

    with pytest.raises(ValueError, match="unknown recipe"):
        AdaHOPConverter.Config(recipe="adahop-lv9").build()
    spec = _debug_spec()
    with pytest.raises(ValueError, match="listed twice"):
        AdaHOPConverter.Config().build().convert(spec.model)


def test_converter_warns_of_an_exclude_pattern_that_matches_nothing():
    # a typo converted lm_head, which it meant to keep, with no word (convert_model warned; the converter did not)
    spec = _debug_spec(recipe="mxfp4", exclude=["lm_hed"])
    with pytest.warns(UserWarning, match="exclude pattern 'lm_hed' matches no module"), torch.device("meta"):
        model = spec.model.build()
    assert type(model.get_submodule("lm_head")).__name__ == "AdaHOPLinear"


def test_torchtitan_trainer_trains_the_debug_model_and_the_hook_freezes_the_plan(titan_on_cpu):
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models.llama3 import config_registry

    class Tok(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config=None, *, tokenizer_path=None):
            super().__init__()
            self.eos_id = 0

        def encode(self, *a, **k):
            return [1]

        def decode(self, *a, **k):
            return ""

        def get_vocab_size(self):
            return 2048

    class Tokens(BaseDataLoader):  # sequences where each token repeats the one two back: learnable
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, **kw):
            self.bs, self.seq, self.i = kw["local_batch_size"], kw["seq_len"], 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(self.i % 4)
                self.i += 1
                x = torch.randint(0, 2048, (self.bs, self.seq + 1), generator=g)
                x[:, 2:] = x[:, :-2].clone()
                yield {"input": x[:, :-1], "positions": torch.arange(self.seq).expand(self.bs, -1).contiguous()}, x[:, 1:]

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, sd):
            self.i = sd["i"]

    out = titan_on_cpu / "titan"
    cfg = config_registry.llama3_debugmodel()
    cfg.model_spec = _debug_spec(recipe="adahop-lv2", calib_steps=2, plan_out=str(out / "plan.json"))
    cfg.tokenizer, cfg.dataloader, cfg.dump_folder = Tok.Config(), Tokens.Config(), str(out)
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = 64, 2, 4
    cfg.training.disable_cuda_graphs = True
    cfg.checkpoint.enable, cfg.validator.enable = False, False
    cfg.optimizer.implementation = "foreach"  # "fused" is CUDA-only
    trainer = cfg.build()
    model = trainer.model_parts[0]
    ctrl = adahop.get_controller(model)
    assert ctrl.calibrating
    losses = []
    orig = trainer.forward_backward_step
    trainer.forward_backward_step = lambda **kw: losses.append(float(out_ := orig(**kw))) or out_
    trainer.train()
    trainer.close()
    assert trainer.step == 4 and ctrl.step == 4  # the hook ran once per optimizer step
    # the plan is keyed by the names at conversion, before torchtitan wraps blocks for activation checkpointing
    assert not ctrl.calibrating and set(ctrl.plan.layers) == {lay.name for lay in ctrl.layers} and len(ctrl.layers) == 10
    assert "layers.1.feed_forward.w2" in ctrl.plan.layers
    assert json.loads((out / "plan.json").read_text()) == json.loads(ctrl.plan.to_json())
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert ctrl.calibrator is None and all(lay.strategies()["fprop"] != "calibrating" for lay in ctrl.layers)


def test_the_readme_torchtitan_block_runs_verbatim_and_its_shell_config_parses(tmp_path, monkeypatch):
    import contextlib
    import io
    import re
    from pathlib import Path

    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.model import Llama3Model

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"\n### torchtitan\n.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(block, "README.md", "exec"), ns)
    assert "recipe='adahop-lv2'" in out.getvalue()
    cfg = ns["config"]
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    model.verify_module_protocol()
    assert isinstance(model, Llama3Model) and len(adahop.get_controller(model).layers) == 6 * 5
    # the shell form: torchtitan's own ConfigManager finds the config in adahop.integrations.torchtitan
    parsed = ConfigManager().parse_args(["--module", "adahop.integrations.torchtitan", "--config", "llama3_debugmodel_adahop"])
    assert parsed.model_spec.model.adahop.recipe == "adahop-lv2"
    assert parsed.model_spec.post_optimizer_build_fn.func.__name__ == "adahop_post_optimizer_build_fn"
