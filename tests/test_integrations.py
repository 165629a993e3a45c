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
    x = torch.randn(8, 64)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():  # the weights alone: a fresh model calibrates, with exact GEMMs (README: what to restore)
        assert not torch.equal(fresh(x), model(x))
    load_controller_state(fresh, state)
    ctrl = adahop.get_controller(fresh)
    assert not ctrl.calibrating and ctrl.calibrator is None and ctrl.step == 5
    assert json.loads(ctrl.plan.to_json()) == state["plan"]
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))

    cont = adahop.convert_model(make(), recipe, exclude=None)
    load_controller_state(cont, mid)
    c = adahop.get_controller(cont)
    assert c.calibrating and c.step == 2 and c.calibrator.history == mid["calibration_history"]
    assert len(mid["calibration_history"]["0"]["x"]) == 2  # two steps of votes kept, not restarted


def _short_calibration(name: str, steps: int):
    import dataclasses

    r = adahop.get_recipe(name)
    return dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, steps=steps))


# ---- Hugging Face Trainer ---------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    """Fixed random sequences with a learnable rule (each token repeats the one two back)."""

    def __init__(self, n: int = 64, seq: int = 32, vocab: int = 128):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, vocab, (n, seq), generator=g)
        x[:, 2:] = x[:, :-2].clone()
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(out: Path, steps: int, callback_kw: dict | None = None, report_to=("tensorboard",), recipe="adahop-lv2",
             **args_kw):
    from transformers import Trainer, TrainingArguments

    from adahop.integrations.transformers import AdaHOPCallback

    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=2e-3,
                             save_steps=20, logging_steps=10, report_to=list(report_to), use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, **args_kw)
    trainer = Trainer(model=_tiny_llama(), args=args, train_dataset=_Tokens())
    cb = AdaHOPCallback(recipe, trainer=trainer, **(callback_kw or {}))
    trainer.add_callback(cb)
    return trainer, cb


def test_trainer_40_steps_then_resume_keeps_the_plan(tmp_path, monkeypatch):
    """40 steps under adahop-lv2 (calibration 30): the plan freezes at step 30, goes to plan.json, into
    checkpoint-40 and to the Trainer's loggers; a resume from checkpoint-40 starts with that very plan
    (no calibration), and a resume from checkpoint-20 continues the vote and freezes the same plan."""
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer, cb = _trainer(tmp_path / "run", 40)
    trainer.train()
    ctrl = adahop.get_controller(trainer.model)
    assert not ctrl.calibrating and ctrl.step == 40
    plan = json.loads(ctrl.plan.to_json())
    assert json.loads((tmp_path / "run" / "plan.json").read_text()) == plan
    assert json.loads((tmp_path / "run" / "checkpoint-40" / "plan.json").read_text()) == plan
    assert not (tmp_path / "run" / "checkpoint-20" / "plan.json").exists()  # still calibrating at step 20
    assert len(plan["layers"]) == 14 and "lm_head" not in plan["layers"]  # 2 blocks x 7 linears
    # the strategy counts went through trainer.log: every report_to logger got them at step 30
    logged = next(r for r in trainer.state.log_history if "adahop/fprop/iht" in r or "adahop/fprop/bf16" in r)
    assert logged["step"] == 30
    # the step's own loss is logged too (the callback's trainer.log cleared should_log, and the Trainer dropped it)
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [10, 20, 30, 40]
    counts = {k[len("adahop/"):]: v for k, v in logged.items() if k.startswith("adahop/")}
    assert counts == {k: float(v) for k, v in adahop.nn.convert.strategy_counts(trainer.model).items()}
    assert sum(v for k, v in counts.items() if k.startswith("fprop/")) == 14
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    tags = acc.Tags()
    assert any(t.startswith("train/adahop/fprop/") for t in tags["scalars"]) and "adahop/plan/text_summary" in tags["tensors"]
    text = acc.Tensors("adahop/plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "model.layers.1.mlp.down_proj" in text

    # resume from the last checkpoint: the plan is there at train begin, calibration does not restart
    resumed, cb2 = _trainer(tmp_path / "run", 45)
    seen = {}  # what the model holds right after the callback's train-begin
    orig = cb2.on_train_begin

    def spy(args, state, control, model=None, **kw):
        orig(args, state, control, model=model, **kw)
        c = adahop.get_controller(model)
        seen.update(calibrating=c.calibrating, calibrator=c.calibrator, step=c.step, plan=json.loads(c.plan.to_json()))

    cb2.on_train_begin = spy
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-40"))
    assert seen == {"calibrating": False, "calibrator": None, "step": 40, "plan": plan}
    assert json.loads(adahop.get_controller(resumed.model).plan.to_json()) == plan
    assert adahop.get_controller(resumed.model).step == 45

    # resume from step 20, mid-calibration: the vote continues (10 more steps) and freezes the same plan
    mid, _ = _trainer(tmp_path / "mid", 40)
    import shutil

    shutil.copytree(tmp_path / "run" / "checkpoint-20", tmp_path / "mid" / "checkpoint-20")
    mid.train(resume_from_checkpoint=str(tmp_path / "mid" / "checkpoint-20"))
    assert json.loads(adahop.get_controller(mid.model).plan.to_json()) == plan

    # the same with the Trainer restoring callbacks itself: it replaces the callback by one built from the saved
    # JSON args (no trainer=, no module_filter_fn=); the replacement takes them back, so the freeze at step 30 is
    # logged and the filter applies (before: no strategy counts, and every linear converted)
    seen_names = []
    keep = lambda mod, name: seen_names.append(name) or "down_proj" not in name  # noqa: E731
    first, _ = _trainer(tmp_path / "restored", 20, callback_kw={"module_filter_fn": keep})
    first.train()
    restored, cb3 = _trainer(tmp_path / "restored", 40, callback_kw={"module_filter_fn": keep},
                             restore_callback_states_from_checkpoint=True)
    seen_names.clear()
    restored.train(resume_from_checkpoint=str(tmp_path / "restored" / "checkpoint-20"))
    from adahop.integrations.transformers import AdaHOPCallback

    (now,) = [c for c in restored.callback_handler.callbacks if isinstance(c, AdaHOPCallback)]
    assert now is not cb3 and now.trainer is restored and seen_names
    layers = json.loads(adahop.get_controller(restored.model).plan.to_json())["layers"]
    assert len(layers) == 12 and not any("down_proj" in k for k in layers)
    assert [r["step"] for r in restored.state.log_history if any(k.startswith("adahop/") for k in r)] == [30]
    # votes saved for layers this conversion leaves out would enter the plan and its counts: refused
    foreign, _ = _trainer(tmp_path / "mid", 40, callback_kw={"module_filter_fn": keep})
    with pytest.raises(ValueError, match="votes for 2 layer.*down_proj.*another exclude"):
        foreign.train(resume_from_checkpoint=str(tmp_path / "mid" / "checkpoint-20"))

    # a checkpoint of one recipe resumed under another is refused, before a step runs
    other, _ = _trainer(tmp_path / "run", 45, recipe="mxfp4")
    with pytest.raises(ValueError, match="saved AdaHOP state is of recipe 'adahop-lv2'.*converted with 'mxfp4'"):
        other.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-40"))

    # checkpoints without AdaHOP state: past the window refused, inside it the vote covers what is left, and
    # plan.json says so (the entry is kept empty: the Trainer itself fails to save one whose entry is missing)
    for step in (20, 40):
        shutil.copytree(tmp_path / "run" / f"checkpoint-{step}", tmp_path / "bare" / f"checkpoint-{step}")
        f = tmp_path / "bare" / f"checkpoint-{step}" / "trainer_state.json"
        ts = json.loads(f.read_text())
        ts["stateful_callbacks"]["AdaHOPCallback"]["attributes"] = {"adahop_state": None}
        f.write_text(json.dumps(ts))
    late, _ = _trainer(tmp_path / "bare", 45)
    with pytest.raises(ValueError, match="past the calibration window"):
        late.train(resume_from_checkpoint=str(tmp_path / "bare" / "checkpoint-40"))
    part, _ = _trainer(tmp_path / "bare", 30)
    with pytest.warns(UserWarning, match="fewer than half"):  # 10 of 30 steps observed
        part.train(resume_from_checkpoint=str(tmp_path / "bare" / "checkpoint-20"))
    assert json.loads((tmp_path / "bare" / "plan.json").read_text())["calibration"]["steps"] == [21, 30]


# ---- accelerate ---------------------------------------------------------------------------------------


def test_prepare_adahop_warns_that_accelerate_cannot_checkpoint_packed_masters(tmp_path):
    """accelerator.save_state failed deep inside accelerate ("invalid python storage") on FP8/FP4 masters."""
    from accelerate import Accelerator

    from adahop.integrations.accelerate import prepare_adahop
    from adahop.optim import SRAdamW, convert_master_weights

    model = convert_master_weights(nn.Sequential(nn.Linear(64, 64)), "fp8")
    with pytest.warns(UserWarning, match="packed fp8 master weights, which accelerator.save_state cannot store"):
        prepare_adahop(model, SRAdamW(model.parameters()), "mxfp4", accelerator=Accelerator(cpu=True), exclude=None)


def test_accelerate_counts_optimizer_steps_not_micro_steps_and_save_state_keeps_the_plan(tmp_path):
    from accelerate import Accelerator

    from adahop.integrations.accelerate import prepare_adahop

    def run(n_micro: int, load: Path | None = None):
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, project_dir=str(tmp_path / "proj"))
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prepare_adahop(model, opt, "adahop-lv2", accelerator=acc, exclude=None, calib_steps=3)
        model, opt = acc.prepare(model, opt)
        if load is not None:
            acc.load_state(str(load))
        freeze_at = None
        g = torch.Generator().manual_seed(0)
        for i in range(n_micro):
            with acc.accumulate(model):
                acc.backward(model(torch.randn(8, 64, generator=g)).square().mean())
                opt.step()
                opt.zero_grad()
            if freeze_at is None and not adahop.get_controller(model).calibrating:
                freeze_at = i + 1
        return acc, model, freeze_at

    acc, model, freeze_at = run(10)
    ctrl = adahop.get_controller(model)
    assert freeze_at == 6 and ctrl.step == 5  # 3 optimizer steps = 6 micro-batches; 10 micro-batches = 5 steps
    assert json.loads((tmp_path / "proj" / "plan.json").read_text()) == json.loads(ctrl.plan.to_json())
    acc.save_state(str(tmp_path / "ckpt"))
    _, again, freeze_again = run(0, load=tmp_path / "ckpt")
    c2 = adahop.get_controller(again)
    assert not c2.calibrating and c2.calibrator is None and c2.step == 5
    assert c2.plan.to_json() == ctrl.plan.to_json()


def test_arguments_an_already_converted_model_would_ignore_and_a_second_step_hook_are_refused(tmp_path):
    """prepare_adahop twice counted every optimizer step twice; plan= and calib_steps= were dropped silently
    for a model converted beforehand (30 BF16 steps ran where a plan was meant to skip them)."""
    from adahop.integrations.accelerate import prepare_adahop
    from adahop.integrations.transformers import AdaHOPCallback

    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepare_adahop(model, opt, "adahop-lv2", exclude=None, calib_steps=3)
    with pytest.raises(ValueError, match="already has a step hook.*count every optimizer step twice"):
        prepare_adahop(model, opt, "adahop-lv2", exclude=None, calib_steps=3)
    adahop.get_controller(model).step_hook.remove()  # removed, another may be attached
    prepare_adahop(model, opt, "adahop-lv2", exclude=None, calib_steps=3)
    with pytest.raises(ValueError, match="already converted with 3 calibration steps, and calib_steps=5 would not be applied"):
        prepare_adahop(model, opt, "adahop-lv2", exclude=None, calib_steps=5)
    plan = tmp_path / "plan.json"
    frozen = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    adahop.convert_model(frozen, "adahop-lv2", exclude=None)
    for _ in range(30):
        frozen(torch.randn(8, 64)).sum().backward()
        adahop.on_step(frozen, adahop.get_controller(frozen).step + 1)
    adahop.get_controller(frozen).plan.save(plan)
    other = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    adahop.convert_model(other, "adahop-lv2", exclude=None)
    cb = AdaHOPCallback("adahop-lv2", plan=str(plan))
    with pytest.raises(ValueError, match=r"already converted without plan, and plan= would not be applied"):
        cb.on_train_begin(None, None, None, model=other)


def test_the_readme_accelerate_example_runs_verbatim(tmp_path, monkeypatch):
    out = _run_readme_block("accelerate", tmp_path, monkeypatch)
    assert "plan frozen" in out and "model.layers.1.mlp.down_proj" in out and (tmp_path / "ckpt").is_dir()


def test_the_readme_trainer_example_runs_verbatim(tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = _run_readme_block("Hugging Face Trainer", tmp_path, monkeypatch)
    assert "plan frozen" in out and "model.layers.1.mlp.down_proj" in out
    plan = json.loads((tmp_path / "runs" / "hf" / "plan.json").read_text())
    assert json.loads((tmp_path / "runs" / "hf" / "checkpoint-40" / "plan.json").read_text()) == plan


def test_adahop_imports_and_converts_under_the_meta_device():
    """torchtitan builds models under torch.device("meta"); adahop's kernels, first imported there,
    used to build a module constant on the meta device and fail (Tensor.item() on a meta tensor)."""
    import subprocess
    import sys

    code = ("import torch\nwith torch.device('meta'):\n    import adahop.kernels\n    import adahop\n"
            "    m = adahop.convert_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), 'mxfp4')\n"
            "print(m[0].weight.device, type(m[0]).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["meta", "LowPrecisionLinear"]


def test_convert_model_takes_a_plan_path_and_names_arguments_it_would_misuse(tmp_path):
    """convert_model(plan="plan.json") ended in AttributeError, recipe None in another, a plan under mxfp4 was
    accepted (and describe said "plan frozen"), and an integer input named an internal quantizer."""
    def mlp():
        return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    src = mlp()
    adahop.convert_model(src, "adahop-lv2", exclude=None)
    for _ in range(30):
        src(torch.randn(8, 64)).sum().backward()
        adahop.on_step(src, adahop.get_controller(src).step + 1)
    adahop.get_controller(src).plan.save(tmp_path / "plan.json")
    m = adahop.convert_model(mlp(), "adahop-lv2", exclude=None, plan=str(tmp_path / "plan.json"))
    assert adahop.get_controller(m).plan.to_json() == adahop.get_controller(src).plan.to_json()
    with pytest.raises(ValueError, match="plan= is for AdaHOP recipes; recipe 'mxfp4' has fixed strategies"):
        adahop.convert_model(mlp(), "mxfp4", exclude=None, plan=str(tmp_path / "plan.json"))
    with pytest.raises(TypeError, match="recipe must be a preset name"):
        adahop.convert_model(mlp(), None)
    with pytest.raises(TypeError, match="seed must be an int, got 1.5"):
        adahop.convert_model(mlp(), "mxfp4", seed=1.5)
    with pytest.raises(ValueError, match=r"^0: input of dtype torch.int64; the layer takes a floating-point tensor"):
        m(torch.ones(2, 64, dtype=torch.long))


def test_convert_model_takes_calib_steps_as_the_integrations_do():
    """The integrations and `train --calib-steps` took calib_steps; convert_model raised TypeError on it."""
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    adahop.convert_model(m, "adahop-lv2", exclude=None, calib_steps=3)
    ctrl = adahop.get_controller(m)
    assert ctrl.recipe.calibration.steps == 3
    for step in range(1, 4):
        assert ctrl.plan is None  # still calibrating before the third step ends
        m(torch.randn(8, 64)).sum().backward()
        adahop.on_step(m, step)
    assert ctrl.plan is not None and ctrl.plan.calibration["steps"] == [1, 3]
    with pytest.raises(ValueError, match="'mxfp4' has fixed strategies and no calibration"):
        adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4", calib_steps=3)
    with pytest.raises(ValueError, match="calibration steps must be an int >= 1, got 0"):
        adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "adahop-lv2", calib_steps=0)


def test_an_exclude_pattern_matching_nothing_is_warned_about_and_a_converted_part_is_named():
    """exclude=("lm-head",) kept nothing out, silently; a submodule of a converted model read as "no nn.Linear"."""
    model = _tiny_llama()
    with pytest.warns(UserWarning, match="exclude pattern 'lm-head' matches no module"):
        adahop.convert_model(model, "mxfp4", exclude=("lm-head",))
    assert type(model.lm_head).__name__ == "LowPrecisionLinear"  # what the typo did: the head converted
    with pytest.raises(ValueError, match="already holds converted layers"):
        adahop.convert_model(model.model.layers[0], "mxfp4")


def test_a_plan_records_its_layer_shapes_and_refuses_a_model_of_other_widths(tmp_path):
    """A plan from a 128-wide model, applied to a 64-wide one with the same layer names, ran silently."""
    def mlp(d):
        return nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    src = adahop.convert_model(mlp(128), "adahop-lv2", exclude=None)
    for _ in range(30):
        src(torch.randn(8, 128)).sum().backward()
        adahop.on_step(src, adahop.get_controller(src).step + 1)
    plan = adahop.get_controller(src).plan
    assert plan.shapes == {"0": [128, 128], "2": [128, 128]}
    plan.save(tmp_path / "plan.json")
    assert adahop.Plan.load(tmp_path / "plan.json").shapes == plan.shapes
    with pytest.raises(ValueError, match=r"frozen on another model: layer '0' is 64->64 here and 128->128 in the plan"):
        adahop.convert_model(mlp(64), "adahop-lv2", exclude=None, plan=str(tmp_path / "plan.json"))
    small = adahop.convert_model(mlp(64), "adahop-lv2", exclude=None)
    with pytest.raises(ValueError, match="frozen on another model"):
        adahop.get_controller(small).set_plan(plan)
    assert adahop.get_controller(small).calibrating  # left as it was


def test_the_trainer_state_file_gets_every_ranks_votes_in_the_callbacks_entry(tmp_path):
    """Under torchrun the callback's on_save (every rank) gathers the votes and rank 0 writes them into the
    checkpoint's trainer_state.json, which the Trainer wrote with rank 0's alone: where they go, as the resume
    reads them (the one entry, or the first of several callbacks of the class)."""
    from adahop.integrations.transformers import _keep_state, _saved_state

    every = {"recipe": "adahop-lv2", "step": 4, "plan": None, "calibration_history": {"a": {"x": ["R"] * 4}},
             "calibration_histories": [{"a": {"x": ["R"] * 2}}, {"a": {"x": ["R"] * 2}}], "calibration_from": 0}
    for entry in ({"args": {}, "attributes": {"adahop_state": {"step": 4}}},
                  [{"args": {}, "attributes": {"adahop_state": {"step": 4}}}, {"args": {}, "attributes": {}}]):
        f = tmp_path / "trainer_state.json"
        f.write_text(json.dumps({"global_step": 4, "stateful_callbacks": {"AdaHOPCallback": entry}}))
        _keep_state(f, "AdaHOPCallback", every)

        class State:
            stateful_callbacks = json.loads(f.read_text())["stateful_callbacks"]

        assert _saved_state(State, "AdaHOPCallback") == every


def test_calib_steps_with_a_recipe_that_does_not_calibrate_is_refused_by_the_integrations():
    """AdaHOPCallback("mxfp4", calib_steps=5) and prepare_adahop(..., "mxfp4", calib_steps=5) dropped the steps
    silently, where adahop.convert_model refuses them (probe api)."""
    from adahop.integrations.accelerate import prepare_adahop
    from adahop.integrations.transformers import AdaHOPCallback

    with pytest.raises(ValueError, match="recipe 'mxfp4' has fixed strategies and no calibration"):
        AdaHOPCallback("mxfp4", calib_steps=5)
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="recipe 'mxfp4' has fixed strategies and no calibration"):
        prepare_adahop(model, torch.optim.AdamW(model.parameters()), "mxfp4", exclude=None, calib_steps=5)
    assert AdaHOPCallback("adahop-lv2", calib_steps=5).recipe.calibration.steps == 5
