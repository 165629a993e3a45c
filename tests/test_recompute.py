"""Selective activation recompute (adahop.nn.recompute): the same numbers, less saved for backward."""

import warnings

import pytest
import torch

from adahop.bench.harness import model_step, split_recompute
from adahop.nn.recompute import context_fn, mark_layers, policy, selective_recompute

STEPS = 4  # the calibrating recipe calibrates for 2 (model_step), so 2 steps run its frozen plan


def _run(recipe: str, mode: str = "eager") -> tuple[list[float], float, int]:
    from adahop.nn import saved_bytes

    m, step = model_step("llama-tiny", recipe, mode, 64, 2, None, "cpu")
    losses = [step(i, record=True)["loss"] for i in range(STEPS)]
    return losses, step(STEPS, record=True)["grad_norm"], saved_bytes(m)[0]


def test_eager_recompute_gives_the_same_losses_and_gradients_bit_for_bit():
    """Eager, a recomputed block gives every number of the plain run. tseng draws random bits in backward (stochastic
    rounding), so its layers run their forward again, on the bits of the forward they repeat; layers without random
    bits run as the opaque op, kept whole (adahop-lv2: test_train_with_recompute_logs_the_plain_runs_losses)."""
    recipe = "tseng"
    plain, rc = _run(recipe), _run(recipe + "+recompute")
    assert plain[:2] == rc[:2]
    assert plain[0][-1] < plain[0][0]  # it trains
    # what the layers hold between forward and backward: the prepared W alone (X is recomputed), not X too
    assert 0 < rc[2] < plain[2]


def _uint8_shapes_with(c: dict, n: int) -> list[str]:
    return [k for k in c["by_shape"] if k.startswith("uint8[") and str(n) in k[6:-1].split(", ")]


def test_compiled_recompute_saves_no_prepared_x():
    """The packed X of wgrad (uint8 [K, T/2]: T = 96 tokens, so 48, a size no weight of llama-tiny has) is among what
    an mxfp4 step saves (eager: the same saved operands as compiled, without a second compile), and a compiled step
    under recompute saves none: backward recomputes X and prepares it there. It saves less in all."""
    from adahop.bench.saved_census import census

    plain = census("llama-tiny", "mxfp4", 48, 2, layers=1, mode="eager")
    rc = census("llama-tiny", "mxfp4+recompute", 48, 2, layers=1, mode="compiled")
    assert _uint8_shapes_with(plain, 48) and not _uint8_shapes_with(rc, 48)
    assert rc["total"] < plain["total"]


def test_recompute_keys_the_opaque_ops_and_marks_only_converted_layers():
    """A layer that saves X by reference returns other saved tensors from its opaque op, so its specs digest (a graph
    constant keying dynamo's guards and Inductor's caches) must differ; mark_layers counts the converted layers."""
    from adahop.models import build_model
    from adahop.nn import convert_model

    m = build_model("llama-tiny", vocab_size=256, max_seq_len=32)
    convert_model(m, "mxfp4")
    layer = m.model.layers[0].self_attn.q_proj
    before = layer._specs_version
    assert mark_layers(m.model.layers[0]) == 7 and layer.recompute_x
    assert layer._specs_version != before
    assert mark_layers(m.model.layers[0], on=False) == 7 and layer._specs_version == before
    selective_recompute(m)
    assert all(b.self_attn.q_proj.recompute_x and b.gradient_checkpointing for b in m.model.layers)
    # the other order: convert_model marks the layers it makes inside blocks already under recompute
    m = selective_recompute(build_model("llama-tiny", vocab_size=256, max_seq_len=32))
    convert_model(m, "mxfp4")
    assert all(lin.recompute_x for b in m.model.layers for lin in (b.self_attn.o_proj, b.mlp.down_proj))
    from adahop.nn import describe

    assert "14 of 14 layers run under selective activation recompute" in describe(m)


def test_policy_keeps_gemms_attention_and_random_ops_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, torch.ops.aten.mm.default) == save
    assert policy(None, torch.ops.adahop.lp_linear_fwd.default) == save
    assert policy(None, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == save
    assert policy(None, torch.ops.aten.native_dropout.default) == save  # nondeterministic_seeded
    for op in (torch.ops.aten.mul.Tensor, torch.ops.aten.rsqrt.default, torch.ops.aten.silu.default):
        assert policy(None, op) == again
    assert context_fn() is not None


def test_recompute_refusals_and_the_bench_suffix():
    from adahop.bench.saved_census import census

    with pytest.raises(ValueError, match="not a transformers model with gradient checkpointing"):
        selective_recompute(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="checkpoint's cache.*--mode compiled"):
        census("llama-tiny", "bf16+recompute", 32, 1, layers=1, mode="eager")
    assert split_recompute("adahop-lv2+recompute") == ("adahop-lv2", True)
    assert split_recompute("bf16") == ("bf16", False)


def test_train_with_recompute_logs_the_plain_runs_losses(prepare_real_text, tmp_path, single_thread, monkeypatch):
    """``adahop train --recompute`` (adahop-lv2: calibration under the checkpoint, then the frozen plan, evaluations
    between steps): every logged loss and the final validation loss are the plain run's, and the policy did run
    (on the opaque op of the frozen layers too)."""
    import adahop.nn.recompute as recompute
    from adahop.train import TrainConfig, train
    from adahop.train.metrics import read_metrics

    seen = set()

    def counting(ctx, op, *args, **kwargs):
        seen.add(str(op))
        return policy(ctx, op, *args, **kwargs)

    monkeypatch.setattr(recompute, "policy", counting)

    data = prepare_real_text(150_000)
    cfg = dict(model="llama-tiny", data=str(data), seq_len=32, batch_size=4, steps=6, lr=3e-3, warmup_steps=2,
               eval_every=3, eval_batches=2, ckpt_every=0, log_every=1, device="cpu", recipe="adahop-lv2", calib_steps=3)
    runs = {rc: train(TrainConfig(out=str(tmp_path / str(rc)), recompute=rc, **cfg)) for rc in (False, True)}
    losses = {rc: [r["loss"] for r in read_metrics(tmp_path / str(rc) / "metrics.jsonl") if "loss" in r] for rc in runs}
    assert len(losses[True]) == 6 and losses[True] == losses[False]
    assert runs[True]["final_val_loss"] == runs[False]["final_val_loss"]
    assert runs[True]["recompute"] is True and runs[False]["recompute"] is False  # summary.json, so compare's table says it
    assert {"adahop.lp_linear_fwd.default", "aten.mm.default"} <= seen

    # On a GPU the calibration steps of a run without --recompute run under it (their eager BF16 steps need more
    # memory than the steps after: round 34), and it is turned off at the freeze: the same numbers and plan.
    import adahop.train.loop as loop

    undone, seen_before, real = [], set(), loop._recompute_calibration

    def undo(model):
        undone.append(recompute.is_recomputed(model))
        seen_before.update(seen)
        seen.clear()
        recompute.undo_selective_recompute(model)
        # transformers' checkpointing added a hook making the embeddings' output require grad: gone again
        assert not getattr(model, "_require_grads_hooks", None) and not recompute.is_recomputed(model)
        return model
    monkeypatch.setattr(loop, "_recompute_calibration", lambda c, device, model: not c.recompute)
    monkeypatch.setattr(loop, "undo_selective_recompute", undo)
    calib = train(TrainConfig(out=str(tmp_path / "calib"), recompute=False, **cfg))
    assert undone == [True] and seen_before and not seen  # recomputed while calibrating, never after the freeze
    assert [r["loss"] for r in read_metrics(tmp_path / "calib" / "metrics.jsonl") if "loss" in r] == losses[False]
    assert calib["final_val_loss"] == runs[False]["final_val_loss"] and calib["recompute"] is False
    assert calib["calibration_recompute"] is True and runs[False]["calibration_recompute"] is False
    assert (tmp_path / "calib" / "plan.json").read_text() == (tmp_path / "False" / "plan.json").read_text()
    llama, jetmoe = (type("M", (), {"supports_gradient_checkpointing": ok})() for ok in (True, False))
    plain, cuda = TrainConfig(out="x", **cfg), torch.device("cuda")
    assert real(plain, cuda, llama) and not real(plain, torch.device("cpu"), llama)
    assert not real(TrainConfig(out="x", recompute=True, **cfg), cuda, llama)
    assert not real(plain, cuda, jetmoe)  # no gradient checkpointing in transformers: it trains as before (helper 63)


def test_recompute_with_cpu_dropout_gives_the_plain_gradients():
    """CPU dropout is an in-place bernoulli_: kept by the policy, torch raised "Tensor cached during selective activation
    checkpoint has been mutated"; recomputed (the checkpoint restores the RNG state), it draws the forward's mask."""
    import torch.nn.functional as F

    from adahop.models import build_model
    from adahop.nn import convert_model

    assert policy(None, torch.ops.aten.bernoulli_.float) == torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for rc in (False, True):
        torch.manual_seed(0)
        m = build_model("llama-tiny", vocab_size=256, max_seq_len=16)
        for block in m.model.layers:
            block.self_attn.attention_dropout = 0.1
        convert_model(m, "mxfp4")
        if rc:
            selective_recompute(m)
        m.train()
        torch.manual_seed(7)
        F.cross_entropy(m(input_ids=ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_a_marked_layer_outside_any_checkpoint_warns(monkeypatch):
    """A layer that saves X by reference but runs where nothing is recomputed (transformers checkpoints only in train
    mode) keeps X in full precision, which saved_bytes leaves out: it says so, once."""
    import adahop.nn.linear as linear
    from adahop.models import build_model
    from adahop.nn import convert_model

    monkeypatch.setattr(linear, "_WARNED", set())
    m = selective_recompute(convert_model(build_model("llama-tiny", vocab_size=256, max_seq_len=16), "mxfp4"))
    ids = torch.randint(0, 256, (1, 16))
    m.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        m(input_ids=ids).logits.sum().backward()  # checkpointed: no warning
    m.eval()
    with pytest.warns(UserWarning, match="outside a checkpointed region"):
        m(input_ids=ids).logits.sum().backward()
