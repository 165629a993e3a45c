"""The converted linear and `convert_model`: BF16 parity, MXFP4 gradient quality, conversion
rules, saved-for-backward memory, reproducibility, and a tiny Llama trained on real text across
the calibration → frozen-plan transition (`specs/adahop.md` §2.4, §9; `DESIGN.md` §2–§4)."""

from __future__ import annotations

import copy
import dataclasses
import lzma
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import adahop
from adahop.recipes import GemmSpec, OperandSpec, Recipe, Transform

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus_small.txt.xz"



def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _grads(lin: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    lin(x).backward(dy)
    return x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad


# ---- one layer: parity and gradient quality -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(96,), (2, 48)], ids=["2d", "3d"])
def test_bf16_recipe_grads_equal_nn_linear_exactly(shape, dtype, gen):
    ref = nn.Linear(64, 96).to(dtype)
    conv = adahop.convert_model(nn.Sequential(copy.deepcopy(ref)), "bf16")[0]
    x = torch.randn(*shape, 64, generator=gen).to(dtype)
    dy = torch.randn(*shape, 96, generator=gen).to(dtype)
    torch.testing.assert_close(conv(x), ref(x), atol=0, rtol=0)
    for g, g_ref, what in zip(_grads(conv, x, dy), _grads(ref, x, dy), ("x", "weight", "bias")):
        torch.testing.assert_close(g, g_ref, atol=0, rtol=0, msg=lambda m: f"grad {what}: {m}")


def test_mxfp4_had_grads_close_to_bf16(gen):
    T, K, N = 256, 512, 384
    ref = nn.Linear(K, N, bias=False)
    conv = adahop.convert_model(nn.Sequential(copy.deepcopy(ref)), "mxfp4-had")[0]
    x, dy = torch.randn(T, K, generator=gen), torch.randn(T, N, generator=gen)
    (dx, dw, _), (dx_ref, dw_ref, _) = _grads(conv, x, dy), _grads(ref, x, dy)
    assert _cos(dx, dx_ref) >= 0.97, f"dX cosine {_cos(dx, dx_ref):.4f} is too low"
    assert _cos(dw, dw_ref) >= 0.97, f"dW cosine {_cos(dw, dw_ref):.4f} is too low"
    assert not torch.equal(dw, dw_ref)  # it really ran in low precision


# ---- convert_model --------------------------------------------------------------------------


def _tiny_llama(vocab_size: int = 256):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_convert_keeps_parameters_and_skips_lm_head():
    model = _tiny_llama()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    adahop.convert_model(model, "adahop-lv2")
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert type(model.lm_head) is nn.Linear
    converted = [n for n, m in model.named_modules() if isinstance(m, adahop.LowPrecisionLinear)]
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per block
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n != "lm_head")


def test_convert_exclude_patterns():
    model = adahop.convert_model(_tiny_llama(), "mxfp4", exclude=("lm_head", "*.mlp.*", "model.layers.1.self_attn.q_proj"))
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds["model.layers.0.mlp.up_proj"] is nn.Linear
    assert kinds["model.layers.1.self_attn.q_proj"] is nn.Linear
    assert kinds["model.layers.0.self_attn.q_proj"] is adahop.LowPrecisionLinear
    assert kinds["model.layers.1.self_attn.k_proj"] is adahop.LowPrecisionLinear
    # a plain name also matches as a suffix
    seq = adahop.convert_model(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), "mxfp4", exclude="1")
    assert type(seq[0]) is adahop.LowPrecisionLinear and type(seq[1]) is nn.Linear


def test_an_exclude_pattern_naming_a_module_keeps_every_linear_inside_it():
    """exclude=("model.layers.0",) or ("mlp",) matched a module but no linear's own name: nothing was kept out, and
    the unmatched-pattern warning stayed silent since the pattern did match a module (probe api)."""
    for exclude, kept in ((("lm_head", "model.layers.0"), lambda n: n.startswith("model.layers.0.")),
                          (("lm_head", "mlp"), lambda n: ".mlp." in n),
                          (("lm_head", "layers.1.self_attn"), lambda n: n.startswith("model.layers.1.self_attn."))):
        model = adahop.convert_model(_tiny_llama(), "mxfp4", exclude=exclude)
        kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
        assert {n for n, k in kinds.items() if k is nn.Linear} == {n for n in kinds if kept(n)}, exclude
    # a pattern names a module by its whole last parts, not a prefix of one: "layers.1" keeps no "layers.11"
    seq = nn.Module()
    seq.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32)) for _ in range(12)])
    adahop.convert_model(seq, "mxfp4", exclude=("layers.1",))
    assert [type(b[0]) is nn.Linear for b in seq.layers] == [i == 1 for i in range(12)]


def test_a_gpt2_converted_with_its_lm_head_alone_is_warned_about():
    """GPT-2's linear maps are transformers Conv1D: with exclude=() only lm_head converted, and the model passed for
    an MXFP4 one with no word (probe api); the default exclude is refused (test_convert_refuses_a_model_...)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0))
    with pytest.warns(UserWarning, match=r"4 transformers Conv1D weights \(GPT-2 style\) are not nn.Linear layers .*"
                                         r"transformer.h.0.attn.c_attn.weight.*run unconverted, not in 'mxfp4'"):
        adahop.convert_model(gpt2, "mxfp4", exclude=())


def test_a_recipe_with_bf16_edge_blocks_warns_when_the_names_show_no_block():
    """nvfp4 keeps its last block in BF16, found by the block index in the names ('layers.N.', 'h.N.', ...): a model
    whose blocks are named otherwise ('block.N', T5 / CLIP style) ran every block in NVFP4, silently (probe api)."""
    def blocks(name):
        m = nn.Module()
        setattr(m, name, nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(3)]))
        return m

    with pytest.warns(UserWarning, match=r"recipe 'nvfp4' keeps its first 0 and last 1 transformer blocks in BF16, but "
                                         r"no converted layer's name holds a block index .*'block.0.0'"):
        m = adahop.convert_model(blocks("block"), "nvfp4")
    assert all(l.strategies()["fprop"] == "none" for l in adahop.nn.get_controller(m).layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = adahop.convert_model(blocks("layers"), "nvfp4")  # found: the last block is BF16, nothing to say
        adahop.convert_model(blocks("block"), "mxfp4")  # no BF16 blocks to keep
        adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "nvfp4")  # one layer: no block to keep
    assert [l.strategies()["fprop"] for l in adahop.nn.get_controller(m).layers] == ["none"] * 4 + ["bf16"] * 2


def test_on_step_and_describe_reach_the_model_inside_a_wrapper():
    """adahop.on_step(ddp_model, step) said "model is not converted; call adahop.convert_model" of a converted model
    wrapped after its conversion (DDP, DataParallel, torch.compile), which the loop then converted again (probe api)."""
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "adahop-lv2", exclude=None, calib_steps=2)
    wrapper = nn.Module()
    wrapper.module = m  # what DistributedDataParallel and DataParallel hold
    assert adahop.nn.get_controller(wrapper) is adahop.nn.get_controller(m)
    assert adahop.on_step(wrapper, 1) is False and adahop.nn.get_controller(m).step == 1
    assert "recipe adahop-lv2, step 1" in adahop.describe(torch.compile(m))
    with pytest.raises(ValueError, match="not converted"):
        wrapper.module = nn.Sequential(nn.Linear(64, 64))
        adahop.on_step(wrapper, 2)


def test_a_frozen_layer_votes_its_fprop_on_the_x_and_w_of_its_training_calls():
    """A layer whose weight and input need no gradient (a LoRA model's first layers, a frozen block) ran its
    training forwards outside the autograd function, unobserved: its plan came from no data (X voted None where
    it was Column, so the fprop took another strategy), with a warning to call on_step, which the loop did (probe api)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    adahop.convert_model(m, "adahop-lv2", exclude=None, calib_steps=2)
    x = torch.randn(64, 64)
    x[:, 5] *= 50  # a Column outlier in layer 0's X
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "observed on fewer than half" warning: the frozen layer has no backward
        for step in (1, 2):
            m(x).square().mean().backward()
            adahop.on_step(m, step)
    plan = adahop.nn.get_controller(m).plan
    assert plan.layers["0"]["x"] == "C" and plan.layers["1"]["x"] != "-"


def test_auto_backend_is_decided_per_call_and_a_bad_backend_is_refused():
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4")
    assert m[0].backend == "auto"  # a model converted on the CPU and moved to a GPU takes the fast path there
    ref = adahop.convert_model(copy.deepcopy(nn.Sequential(nn.Linear(64, 64))), "mxfp4", backend="reference")
    ref[0].weight, ref[0].bias = m[0].weight, m[0].bias
    x = torch.randn(16, 64)
    assert torch.equal(m(x), ref(x))  # on the CPU "auto" is the reference
    with pytest.raises(ValueError, match="backend='cuda' is not supported; use one of"):
        adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4", backend="cuda")


def test_convert_errors():
    with pytest.raises(ValueError, match="unknown recipe 'fp3'.*adahop-lv2"):
        adahop.convert_model(nn.Sequential(nn.Linear(32, 32)), "fp3")
    model = adahop.convert_model(nn.Sequential(nn.Linear(32, 32)), "mxfp4")
    with pytest.raises(ValueError, match="already converted"):
        adahop.convert_model(model, "mxfp4")
    with pytest.raises(ValueError, match="not converted"):
        adahop.describe(nn.Sequential(nn.Linear(32, 32)))


def test_odd_dims_stay_bf16_with_one_warning():
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 64), nn.Linear(64, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adahop.convert_model(model, "mxfp4")
    msgs = [str(w.message) for w in caught if "adahop" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "0 (64->48)" in msgs[0] and "2 (48->64)" in msgs[0] and "3 (" not in msgs[0]
    assert model[0].strategies() == model[2].strategies() == {"fprop": "bf16", "dgrad": "bf16", "wgrad": "bf16"}
    assert model[3].strategies() == {"fprop": "none", "dgrad": "none", "wgrad": "none"}
    assert adahop.nn.get_controller(model).unquantizable == ["0", "2"]  # what the run summary counts
    x = torch.randn(8, 64)
    assert model(x).shape == (8, 64)


def test_plain_sequential_trains_and_repr_shows_recipe(gen):
    model = adahop.convert_model(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)), "mxfp4-had")
    x = torch.randn(4, 16, 64, generator=gen)
    y = model(x)
    assert y.shape == (4, 16, 32)
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    text = repr(model)
    assert text.count("recipe=mxfp4-had") == 2 and "fprop=iht" in text
    assert "fixed strategies" in adahop.describe(model)


def test_saved_bytes_mxfp4_had_bf16():
    T, K, N = 1024, 512, 512
    # mixed precision (FP32 masters, BF16 autocast): nn.Linear saves BF16 copies of X and of W
    model = adahop.convert_model(nn.Sequential(nn.Linear(K, N, bias=False)), "mxfp4-had")
    x = torch.randn(T, K, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    ours, bf16_xw = adahop.saved_bytes(model)
    assert bf16_xw == (T * K + N * K) * 2
    # X packed along T and W packed along N: 4.25 bits per element each
    assert ours == (T * K + N * K) * 17 // 32, ours
    assert ours < bf16_xw / 3.5, f"saved {ours} B vs BF16 X+W {bf16_xw} B: only {bf16_xw / ours:.2f}x smaller"
    # a BF16 model without autocast: nn.Linear saves X and keeps W itself (no copy), so only X counts
    model.to(torch.bfloat16)
    model(x.detach().bfloat16()).sum().backward()
    ours, plain = adahop.saved_bytes(model)
    assert plain == T * K * 2 and ours == (T * K + N * K) * 17 // 32


def _held_bytes(fn):
    """``(bytes, fn())``: the CPU allocator's bytes handed out during ``fn()`` and not freed when it
    returns, i.e. what its result keeps alive (for a loss: everything its graph holds for backward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


@pytest.mark.parametrize("recipe", ["mxfp4-had", "averis", "nvfp4"])
def test_a_layer_holds_what_saved_bytes_reports(recipe):
    """The allocator count that the checkpointing test relies on sees a converted layer's packed
    saved operands: a forward holds exactly its output plus :func:`adahop.saved_bytes`."""
    model = adahop.convert_model(nn.Sequential(nn.Linear(256, 512)), recipe, exclude=None)
    x = torch.randn(128, 256, requires_grad=True)
    model(x).sum().backward()  # the device constants (Hadamard blocks, tables) exist before the count
    held, y = _held_bytes(lambda: model(x))
    assert held == y.numel() * y.element_size() + adahop.saved_bytes(model)[0] > y.numel() * y.element_size()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", ["mxfp4-had", "averis", "nvfp4"])
def test_checkpointed_blocks_hold_only_their_inputs(recipe, reentrant):
    """Between forward and backward a checkpointed region keeps its input, nothing more. The packed
    X and W of the converted layers were attributes of their autograd ctx, which the non-reentrant
    checkpoint's saved-tensor hooks never see: each layer held them as without checkpointing
    (487 KiB more than BF16 for this model under mxfp4-had). They now go through save_for_backward."""
    from torch.utils.checkpoint import checkpoint as ckpt

    T, C, H = 256, 256, 512
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(C, H), nn.GELU(), nn.Linear(H, C)) for _ in range(2))
    adahop.convert_model(blocks, recipe, exclude=None, seed=0)
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(3), requires_grad=True)

    def loss(checkpointed: bool):
        h = x
        for b in blocks:
            h = ckpt(b, h, use_reentrant=reentrant) if checkpointed else b(h)
        return h.square().mean()

    loss(True).backward()  # the device constants exist before the count
    held, out = _held_bytes(lambda: loss(True))
    # block 1's input (block 0's output), block 1's output (saved by square), the loss, and the CPU
    # RNG state each checkpoint keeps to replay its region
    expect = 2 * T * C * 4 + 4 + 2 * torch.get_rng_state().numel()
    assert held == expect, f"{recipe}: checkpointed blocks hold {held} B, their inputs {expect} B"
    out.backward()
    plain, out = _held_bytes(lambda: loss(False))
    out.backward()
    # uncheckpointed, the same forward holds the packed operands too (and the GELU inputs)
    assert plain - held >= adahop.saved_bytes(blocks)[0] > 0, (plain, held)


def test_the_plain_linear_figure_counts_the_cast_weight_only_under_autocast():
    """saved_bytes' second figure is what a plain nn.Linear saves: X alone in FP32 (W is the parameter
    itself, no copy), X and the BF16 copy of W under autocast."""
    model = adahop.convert_model(nn.Sequential(nn.Linear(64, 32)), "mxfp4", exclude=None)
    x = torch.randn(8, 64)
    model(x).sum().backward()
    assert adahop.saved_bytes(model)[1] == 8 * 64 * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert adahop.saved_bytes(model)[1] == (8 * 64 + 64 * 32) * 2


# ---- reproducibility ------------------------------------------------------------------------

_SR = OperandSpec(fmt="mxfp4", rounding="stochastic", scale_rule="rceil")
_SR_RECIPE = Recipe(name="test-sr", fprop=GemmSpec(strategy="iht", a=_SR, b=_SR, inner=Transform(signs="per_call")),
                    dgrad=GemmSpec(strategy="iht", a=_SR, b=_SR, inner=Transform(signs="per_call")),
                    wgrad=GemmSpec(strategy="iht+oe_right", a=_SR, b=_SR, oe_rank=8))


def _sr_grads(seed: int, step: int = 0):
    torch.manual_seed(0)
    model = adahop.convert_model(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32)), _SR_RECIPE, seed=seed)
    adahop.on_step(model, step)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model(x).square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_stochastic_runs_are_reproducible_under_a_seed():
    a, b = _sr_grads(seed=0), _sr_grads(seed=0)
    assert all(torch.equal(g, h) for g, h in zip(a, b))
    other_seed, other_step = _sr_grads(seed=1), _sr_grads(seed=0, step=1)
    assert not torch.equal(a[0], other_seed[0])  # the bits depend on the seed ...
    assert not torch.equal(a[0], other_step[0])  # ... and are fresh at every step


def _sr_grads_after_eval(evaluate: bool, recipe: str = "tseng", mode=torch.no_grad):
    """Gradients of the training step that follows a step-0 evaluation (or none) of an SR recipe."""
    torch.manual_seed(0)
    model = adahop.convert_model(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32)), recipe, seed=0)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    out = None
    if evaluate:
        with mode():
            out = model(x)
    model(x).square().sum().backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tseng", "averis"])  # SR in backward only; SR in fprop too
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_an_evaluation_leaves_the_next_training_step_unchanged(recipe, mode):
    """Forward-only calls draw stochastic-rounding bits from their own stream, so a run that
    evaluates between steps trains bit for bit like one that does not (resume stays exact). Under
    inference_mode too, where forward-mode AD is off as inside an autograd.Function's forward: such
    a call is not taken for a reentrant checkpoint's first forward (which draws training bits)."""
    out, after_eval = _sr_grads_after_eval(True, recipe, mode)
    _, plain = _sr_grads_after_eval(False, recipe, mode)
    assert all(torch.equal(a, b) for a, b in zip(after_eval, plain))
    assert out is not None and out.requires_grad is False and torch.isfinite(out).all()


def _grads_checkpointed(recipe: str, checkpoint: str | None, micro: int = 2, shared: bool = False,
                        forwards_first: bool = False):
    """Loss and gradients of a two-block MLP over ``micro`` micro-batches of one optimizer step,
    each block one region of ``torch.utils.checkpoint`` when ``checkpoint`` is ``"non-reentrant"``
    (as ``gradient_checkpointing_enable()`` of transformers 5 does it) or ``"reentrant"`` (its
    default before 5); ``shared``: one block applied twice, each use its own region;
    ``forwards_first``: every micro-batch's forward, then their backwards in the same order."""
    from torch.utils.checkpoint import checkpoint as ckpt

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))
    adahop.convert_model(blocks, recipe, exclude=None, seed=0)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(micro):
        h = torch.randn(64, 64, generator=g, requires_grad=True)  # a reentrant region needs an input that does
        for b in ([blocks[0]] * 2 if shared else blocks):
            h = ckpt(b, h, use_reentrant=checkpoint == "reentrant") if checkpoint else b(h)
        loss = h.square().mean()
        if not forwards_first:
            loss.backward()
        losses.append(loss)
    for loss in losses if forwards_first else ():
        loss.backward()
    return [v.item() for v in losses], [p.grad.clone() for p in blocks.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", ["averis", "quartet"])
def test_gradient_checkpointing_recomputes_the_forward_with_its_own_random_bits(recipe, checkpoint):
    """A checkpointed block runs its forward again in backward; the converted layers counted that as a
    new call and drew new stochastic-rounding bits, so an SR-fprop recipe (averis) got gradients of a
    forward other than the one that made the loss: 30% away from the same step run without
    checkpointing. The recompute now takes the bits of the call it repeats. A reentrant checkpoint
    runs the first forward under no_grad, which drew averis's fprop bits from the evaluation
    stream: the loss differed, and the gradients by 37%. That forward is now a training call."""
    plain_loss, plain = _grads_checkpointed(recipe, None)
    ck_loss, ck = _grads_checkpointed(recipe, checkpoint)
    assert ck_loss == plain_loss
    assert len(ck) == len(plain) == 8
    for a, b in zip(plain, ck):
        assert torch.equal(a, b), f"{recipe}: max |Δgrad| {(a - b).abs().max().item():.3g}"
    assert _grads_checkpointed(recipe, None, micro=1)[1][0].ne(plain[0]).any()  # the 2nd micro-batch counts


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", ["averis", "quartet"])
def test_two_forwards_then_their_backwards_recompute_each_with_its_bits(recipe, checkpoint):
    """Two micro-batches' forwards, then the first loss's backward: its recomputes took the latest
    queued call's bits (the second forward's), so the gradients were 27-80% away from the same step
    without checkpointing, silently. A recompute now takes the call of the graph its backward reaches."""
    plain_loss, plain = _grads_checkpointed(recipe, None, forwards_first=True)
    ck_loss, ck = _grads_checkpointed(recipe, checkpoint, forwards_first=True)
    assert ck_loss == plain_loss and len(ck) == len(plain) == 8
    for a, b in zip(plain, ck):
        assert torch.equal(a, b), f"{recipe}: max |Δgrad| {(a - b).abs().max().item():.3g}"
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads_checkpointed(recipe, None)[1]))  # the order is no number


@pytest.mark.parametrize("forwards_first", [False, True])
@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
def test_a_layer_called_twice_in_one_region_recomputes_each_call_with_its_bits(checkpoint, forwards_first):
    """Region b(gelu(a(a(x)))): the recompute replays a's two calls in forward order and took the newest first,
    swapping their bits (gradients 29-41% off, helper 28's review); now the oldest call of the region goes first."""
    from torch.utils.checkpoint import checkpoint as ckpt

    def grads(ck: str | None):
        torch.manual_seed(0)
        m = adahop.convert_model(nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)]), "averis", exclude=None, seed=0)
        region = lambda x: m[1](torch.nn.functional.gelu(m[0](m[0](x))))  # noqa: E731
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(2):
            x = torch.randn(64, 64, generator=g, requires_grad=True)
            y = ckpt(region, x, use_reentrant=ck == "reentrant") if ck else region(x)
            losses.append(y.square().mean())
            if not forwards_first:
                losses[-1].backward()
        for loss in losses if forwards_first else ():
            loss.backward()
        return [p.grad for p in m.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(None), grads(checkpoint)))


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("summed", [False, True], ids=["two_backwards", "summed_loss"])
def test_parallel_branches_with_forwards_first_recompute_each_with_its_bits(summed, checkpoint):
    """Region a(x) + b(x), two micro-batches forward, then their backwards (or one of the summed loss, as a GPT-NeoX
    block trains): a's recompute starts from b's node and reaches neither of a's waiting forwards; it took the newest
    one's bits (21-22% off, helper 28), then raised. The region being recomputed is now found on the stack (the
    checkpoint's unpack hook the forward ran under), so every gradient is the unchecked run's, bit for bit. A reentrant
    region's recompute starts at its own checkpoint node, which reaches its forward."""
    from torch.utils.checkpoint import checkpoint as ckpt

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        m = adahop.convert_model(nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)]), "averis", exclude=None, seed=0)
        region = lambda x: m[0](x) + m[1](x)  # noqa: E731
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(64, 64, generator=g, requires_grad=True) for _ in range(2)]
        losses = [(ckpt(region, x, use_reentrant=checkpoint == "reentrant") if checkpointed else region(x)).square().mean()
                  for x in xs]
        if summed:
            (losses[0] + losses[1]).backward()
        else:
            for loss in losses:
                loss.backward()
        return [p.grad for p in m.parameters()]

    plain, ck = grads(False), grads(True)
    assert len(ck) == 4 and all(torch.equal(a, b) for a, b in zip(plain, ck))


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
def test_a_block_checkpointed_twice_recomputes_each_use_with_its_bits(checkpoint):
    """One block in two regions: backward recomputes the second use first, then the first, each
    with the bits of its own forward (the second use's are not taken twice)."""
    plain_loss, plain = _grads_checkpointed("averis", None, micro=1, shared=True)
    ck_loss, ck = _grads_checkpointed("averis", checkpoint, micro=1, shared=True)
    assert ck_loss == plain_loss and len(ck) == len(plain) == 4
    assert all(torch.equal(a, b) for a, b in zip(plain, ck))


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
def test_a_frozen_layer_in_a_checkpointed_region_recomputes_its_bits(checkpoint):
    """A frozen layer fed no tensor that needs grad runs forward-only even under grad mode; its
    output scales a trained branch, so its recompute must repeat its bits too. Such calls are
    training calls (eval-stream bits are for no-grad evaluation only), as in the reentrant first forward."""
    from torch.utils.checkpoint import checkpoint as ckpt

    def grads(checkpoint: str | None):
        torch.manual_seed(0)
        m = adahop.convert_model(nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)]), "averis", exclude=None, seed=0)
        m[1].requires_grad_(False)
        g = torch.Generator().manual_seed(3)
        x, c = torch.randn(64, 64, generator=g, requires_grad=True), torch.randn(64, 64, generator=g)
        region = lambda x, c: m[0](x) * m[1](c)  # noqa: E731
        y = ckpt(region, x, c, use_reentrant=checkpoint == "reentrant") if checkpoint else region(x, c)
        y.square().mean().backward()
        return x.grad, m[0].weight.grad

    assert all(torch.equal(a, b) for a, b in zip(grads(None), grads(checkpoint)))


def test_nested_reentrant_checkpoints_match_and_mixed_nesting_is_refused():
    """A reentrant region inside another runs its no-grad forward twice (the outer recompute runs
    it again) before its own recompute: all three take one forward's bits. A non-reentrant region
    inside a reentrant one recomputes a forward that drew no training bits; that, and a second
    backward through a checkpointed region, say which checkpoint to use instead of drawing bits
    of no forward."""
    from torch.utils.checkpoint import checkpoint as ckpt

    def grads(inner: str | None, outer: str | None):
        torch.manual_seed(0)
        b = adahop.convert_model(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), "averis",
                                 exclude=None, seed=0)
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
        first = (lambda h: ckpt(lambda y: b[1](b[0](y)), h, use_reentrant=inner == "reentrant")) if inner else \
            (lambda h: b[1](b[0](h)))
        region = lambda h: b[2](first(h))  # noqa: E731
        out = ckpt(region, x, use_reentrant=outer == "reentrant") if outer else region(x)
        out.square().mean().backward()
        return [p.grad for p in b.parameters()]

    plain = grads(None, None)
    for inner, outer in (("reentrant", "reentrant"), ("reentrant", "non-reentrant")):
        assert all(torch.equal(a, c) for a, c in zip(plain, grads(inner, outer))), (inner, outer)
    with pytest.raises(RuntimeError, match=r"no forward of step 0 left for it to repeat.*use_reentrant=False"):
        grads("non-reentrant", "reentrant")
    b = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "averis", exclude=None)
    y = ckpt(b, torch.randn(8, 64, requires_grad=True), use_reentrant=False).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="no retain_graph through a checkpointed region"):
        y.backward()


# nested checkpoints, as functions of (layers L, checkpoint ck(f, h, inner=True/False), x); tanh between layers so that a
# wrong bit shows in every gradient
_NESTED = {
    "inner at the start": lambda L, ck, x: L[3](ck(lambda h: L[2](ck(lambda y: L[1](L[0](y)), h, True)), x, False)),
    "inner in the middle": lambda L, ck, x: L[3](ck(lambda h: L[2](ck(lambda y: L[1](y).tanh(), L[0](h), True)), x, False)),
    "a layer twice in the inner":
        lambda L, ck, x: L[3](ck(lambda h: L[2](ck(lambda y: L[1](L[1](y).tanh()), L[0](h).tanh(), True)), x, False)),
    "one layer in two inner regions side by side":
        lambda L, ck, x: L[3](ck(lambda h: L[2](ck(L[1], ck(L[1], L[0](h).tanh(), True).tanh(), True)), x, False)),
    "one block nested in two outer regions":
        lambda L, ck, x: L[3](ck(lambda h: ck(L[1], L[2](h).tanh(), True).tanh(),
                                 ck(lambda h: ck(L[1], L[0](h).tanh(), True).tanh(), x, False), False)),
    "three levels": lambda L, ck, x: L[3](ck(lambda h: L[2](ck(lambda y: L[1](ck(L[1], L[0](y).tanh(), True)).tanh(),
                                                             h, True)), x, False)),
}


@pytest.mark.parametrize("order", ["each", "forwards_first", "reversed", "summed"])
@pytest.mark.parametrize("nesting", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("case", list(_NESTED))
def test_nested_checkpoints_recompute_with_the_forwards_bits(case, nesting, order):
    """Nested checkpoints of one kind: the outer recompute runs the inner region's forward again before the inner
    region's own recompute, so the inner layers run twice in backward (three times two deep); every run takes the
    forward's bits, in forward order, also with two micro-batches' forwards first. Until 2026-12-07 the non-reentrant
    form raised, and the reentrant one took the newest call's bits with forwards first or with a layer used twice
    (gradients 3.7e-4 to 1.4e-3 off, silently)."""
    from torch.utils.checkpoint import checkpoint as ckpt

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        layers = adahop.convert_model(nn.ModuleList([nn.Linear(32, 32) for _ in range(4)]), "averis", exclude=None, seed=0)
        xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(3 + i), requires_grad=True) for i in range(2)]
        c = (lambda f, h, inner: ckpt(f, h, use_reentrant=nesting == "reentrant")) if checkpointed else \
            (lambda f, h, inner: f(h))
        loss = lambda x: _NESTED[case](layers, c, x).square().mean()  # noqa: E731
        if order == "each":
            for x in xs:
                loss(x).backward()
        elif order == "summed":
            sum(loss(x) for x in xs).backward()
        else:
            losses = [loss(x) for x in xs]
            for l in losses if order == "forwards_first" else losses[::-1]:
                l.backward()
        return [p.grad for p in layers.parameters()] + [x.grad for x in xs]

    plain, checked = grads(False), grads(True)
    # a layer shared by reentrant regions sums its weight gradient in another order: ~1e-7 relative, as BF16 recipes
    exact = nesting == "non-reentrant" or case in ("inner at the start", "inner in the middle")
    for a, b in zip(plain, checked):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-8), (a - b).abs().max()


@pytest.mark.parametrize("early_stop", [True, False])
def test_an_inner_reentrant_checkpoint_that_only_the_recompute_runs_gets_the_outer_calls(early_stop):
    """transformers' GradientCheckpointingLayer checkpoints a layer only when gradients are on: inside an outer
    reentrant checkpoint its no-grad forward runs plain, and only the recompute checkpoints it. With forwards first,
    the inner recompute found no forward it reached and raised until 2026-12-07."""
    from torch.utils.checkpoint import checkpoint as ckpt, set_checkpoint_early_stop

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        L = adahop.convert_model(nn.ModuleList([nn.Linear(32, 32) for _ in range(4)]), "averis", exclude=None, seed=0)
        c = (lambda f, h: ckpt(f, h, use_reentrant=True)) if checkpointed else (lambda f, h: f(h))
        cond = lambda h: c(L[1], h) if torch.is_grad_enabled() else L[1](h)  # noqa: E731
        loss = lambda x: L[3](c(lambda h: L[2](cond(L[0](h).tanh()).tanh()), x)).square().mean()  # noqa: E731
        xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(3 + i), requires_grad=True) for i in range(2)]
        with set_checkpoint_early_stop(early_stop):
            losses = [loss(x) for x in xs]
            for l in losses:
                l.backward()
        return [p.grad for p in L.parameters()] + [x.grad for x in xs]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))


@pytest.mark.parametrize("reused", [False, True], ids=["fresh_hooks", "one_reused_instance"])
def test_saved_tensor_hooks_of_a_user_name_no_checkpoint_region(reused):
    """A user's saved_tensors_hooks (here save_on_cpu) inside a reentrant checkpoint that holds a nested one and a
    second call of the same layer: only torch.utils.checkpoint's hooks name a region. Until 2026-12-07 one reused
    save_on_cpu instance was taken for a region that both calls ran in, and the second call got the first call's
    bits (averis gradients 0.31 relative off, silently); the hook stack is left as it was."""
    from torch.utils.checkpoint import checkpoint as ckpt

    shared = torch.autograd.graph.save_on_cpu()

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        layer = adahop.convert_model(nn.Sequential(nn.Linear(32, 32)), "averis", exclude=None, seed=0)[0]
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        c = (lambda f, h: ckpt(f, h, use_reentrant=True)) if checkpointed else (lambda f, h: f(h))

        def outer(h):
            with shared if reused else torch.autograd.graph.save_on_cpu():
                return layer(c(lambda y: layer(y).tanh(), h)).tanh()
        c(outer, x).square().mean().backward()
        return [layer.weight.grad, layer.bias.grad, x.grad]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_forward_only_calls_equal_the_training_forward_and_are_not_calibrated():
    from adahop.nn import get_controller

    torch.manual_seed(0)
    model = adahop.convert_model(nn.Sequential(nn.Linear(64, 64, bias=True)), "mxfp4-had")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y_eval = model(x)
    assert torch.equal(y_eval, model(x).detach())  # deterministic recipe: the same fprop
    cal_model = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "adahop-lv2")
    with torch.no_grad():
        cal_model(x)
    assert get_controller(cal_model).calibrator.history == {}  # evaluation batches do not vote
    cal_model(x).sum().backward()
    assert set(get_controller(cal_model).calibrator.history["0"]) == {"x", "w", "dy"}


# ---- a tiny Llama on real text --------------------------------------------------------------


def _byte_batches(n_steps: int, batch: int, seq: int) -> torch.Tensor:
    """[n_steps, batch, seq + 1] byte ids (vocab 256) from the first ~300 KB of the corpus."""
    if not CORPUS.exists():
        pytest.skip(f"corpus not found at {CORPUS}")
    with lzma.open(CORPUS, "rb") as f:
        data = torch.frombuffer(bytearray(f.read(300_000)), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, data.numel() - seq - 1, (n_steps, batch), generator=g)
    return data[starts[..., None] + torch.arange(seq + 1)]


def test_tiny_llama_adahop_lv2_trains_on_real_text():
    steps, calib = 50, 10
    model = _tiny_llama()
    base = adahop.get_recipe("adahop-lv2")
    recipe = dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, steps=calib))
    adahop.convert_model(model, recipe)
    assert "calibrating" in adahop.describe(model).splitlines()[0]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = _byte_batches(steps, batch=4, seq=64)
    losses, frozen_at = [], []
    for step in range(steps):
        ids = data[step]
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        assert torch.isfinite(loss), f"loss {loss.item()} at step {step}"
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if adahop.on_step(model, step + 1):
            frozen_at.append(step + 1)
        losses.append(loss.item())
    assert frozen_at == [calib]
    first, at_freeze, last = (sum(losses[i:i + 5]) / 5 for i in (0, calib, steps - 5))
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert last < at_freeze, f"loss rose after the plan froze: {at_freeze:.3f} -> {last:.3f}"

    text = adahop.describe(model)
    lines = text.splitlines()
    assert lines[0].startswith(f"recipe adahop-lv2, step {steps}, plan frozen")
    layers = lines[3:lines.index("")]  # the layer table, then a blank line and the recipe's GEMM table
    assert len(layers) == 14 and "each quantized GEMM of recipe adahop-lv2" in text
    for line in layers:
        cols = line.split()
        assert all(p in ("R", "C", "N") for p in cols[2:5]), line
        assert all(s in ("bf16", "none", "iht", "iht+oe_left", "iht+oe_right") for s in cols[5:8]), line
    for m in model.modules():
        if isinstance(m, adahop.LowPrecisionLinear):
            assert "calibrating" not in m.strategies().values()
            assert set(m.patterns) == {"x", "w", "dy"}


@pytest.mark.parametrize("recipe", ["mxfp4", "tseng", "nvfp4", "adahop-lv2"])
def test_a_batch_without_tokens_gives_empty_output_and_zero_grads(recipe):
    """An MoE expert can receive no tokens: nothing to quantize, an exact empty product."""
    m = torch.nn.Sequential(torch.nn.Linear(64, 32))
    adahop.convert_model(m, recipe)
    x = torch.randn(2, 0, 64, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (2, 0, 32) and torch.equal(m[0].weight.grad, torch.zeros(32, 64))


def test_bare_linear_and_wrong_width_are_named():
    with pytest.raises(ValueError, match=r"wrap a bare layer first: convert_model\(nn.Sequential"):
        adahop.convert_model(torch.nn.Linear(64, 64), "mxfp4")
    m = adahop.convert_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mxfp4")
    with pytest.raises(ValueError, match=r"input has 65 features .* in_features=64"):
        m(torch.randn(4, 65))


def test_a_plan_for_another_model_is_refused_at_conversion():
    from adahop.patterns import Plan

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"no entry for layer '1'; it was made for another model"):
        adahop.convert_model(m, "adahop-lv2", plan=Plan.from_patterns({"0": {"x": "C", "w": "N", "dy": "N"}}))


def test_the_readme_training_loop_runs_verbatim():
    """The README's "In your own training loop" block runs as printed and freezes a plan."""
    import contextlib
    import io
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## In your own training loop\n\n```python\n(.*?)```", readme, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    table = out.getvalue()
    assert "model.layers.1.mlp.down_proj" in table and "calibrating" not in table and "iht" in table


def test_a_plan_of_the_other_level_is_remapped_not_run_under_this_name():
    """An Lv2 run's plan given to adahop-lv1 (e.g. `adahop compare --recipes adahop-lv1,adahop-lv2 --plan`):
    the strategies come from Lv1's table applied to the plan's patterns, with a warning, never Lv2's
    BF16 GEMMs under the Lv1 name."""
    from adahop.nn import get_controller
    from adahop.patterns import Plan

    pats = {"0": {"x": "C", "w": "C", "dy": "C"}}
    lv2, lv1 = Plan.from_patterns(pats, "lv2"), Plan.from_patterns(pats, "lv1")
    gemms = ("fprop", "dgrad", "wgrad")
    assert "bf16" in [lv2.layers["0"][g] for g in gemms] and "bf16" not in [lv1.layers["0"][g] for g in gemms]
    m = nn.Sequential(nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="re-derived from the plan's patterns"):
        adahop.convert_model(m, "adahop-lv1", plan=lv2)
    assert m[0].strategies() == {g: lv1.layers["0"][g] for g in gemms}
    m2 = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "adahop-lv1")  # set_plan (checkpoints) likewise
    with pytest.warns(UserWarning, match="re-derived"):
        get_controller(m2).set_plan(lv2)
    assert m2[0].strategies() == m[0].strategies() and get_controller(m2).plan.table == "lv1"


def test_set_plan_for_another_model_leaves_the_controller_as_it_was():
    from adahop.nn import get_controller
    from adahop.patterns import Plan

    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "adahop-lv2")
    ctrl = get_controller(m)
    with pytest.raises(ValueError, match="no entry for layer '0'"):
        ctrl.set_plan(Plan.from_patterns({"other.layer": {"x": "N", "w": "N", "dy": "N"}}))
    assert ctrl.calibrating and ctrl.calibrator is not None and ctrl.plan is None


def test_deepcopy_and_pickle_of_a_converted_model_keep_their_own_controller():
    """A copy made during calibration calibrates and freezes its own plan (its controller used to
    point at the original's layers, so the copy ran BF16 for good); torch.save of the whole model works."""
    import io

    from adahop.nn import get_controller

    torch.manual_seed(0)
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), "adahop-lv2")
    c = copy.deepcopy(m)
    x = torch.randn(32, 64)
    for s in range(30):
        c(x).sum().backward()
        adahop.on_step(c, s + 1)
    assert get_controller(c).plan is not None and all("calibrating" not in l.strategies().values() for l in (c[0], c[2]))
    assert get_controller(m).calibrating and [l.name for l in get_controller(c).layers] == ["0", "2"]
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    d = torch.load(buf, weights_only=False)
    assert get_controller(d).layers == [d[0], d[2]] and torch.equal(d(x), c(x))


def test_second_backward_through_a_quantized_layer_repeats_the_first():
    """The packed operands are saved tensors, so ``retain_graph=True`` keeps them for a second
    backward (mxfp4 draws no random bits: the same gradient again), and without it autograd says
    that they were freed (adahop freed them itself and refused any second backward)."""
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4")
    y = m(torch.randn(32, 64)).square().sum()
    y.backward(retain_graph=True)
    first = m[0].weight.grad.clone()
    y.backward()
    assert torch.equal(m[0].weight.grad, 2 * first) and first.abs().sum() > 0
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


@pytest.mark.parametrize("recipe", ["nvfp4", "quartet", "tseng", "averis"])
def test_random_recipes_copy_after_training_and_a_second_backward_draws_the_first_ones_bits(recipe):
    """Recipes that draw random bits: a deepcopy, pickle or AveragedModel after a training step raised
    "'Call' object is not subscriptable" (__getstate__ indexed the queued calls as lists); and a second backward
    of a retained graph drew new bits (0.17-0.23 relative off the first), so a monitoring autograd.grad before
    loss.backward() changed the training gradient (helper 65). The copy now trains as the original does."""
    import io
    import pickle

    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), recipe)
    x = torch.randn(32, 64)
    m(x).sum().backward()
    adahop.on_step(m, 1)
    m(x).sum()  # a forward whose backward never comes: its queued call is copied too
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), AveragedModel(m).module):
        adahop.on_step(c, 2)
        c[0].weight.grad = None
        c(x).sum().backward()
        assert c[0].weight.grad.abs().sum() > 0
    adahop.on_step(m, 2)
    m[0].weight.grad = None
    y = m(x)
    g = torch.randn_like(y)
    y.backward(g, retain_graph=True)
    first = m[0].weight.grad.clone()
    y.backward(g)
    assert first.abs().sum() > 0 and torch.equal(m[0].weight.grad, 2 * first)
    d = copy.deepcopy(m)
    m[0].weight.grad = d[0].weight.grad = None
    m(x).backward(g)
    d(x).backward(g)
    assert torch.equal(d[0].weight.grad, m[0].weight.grad)  # the copy draws the original's bits
    buf = io.BytesIO()
    torch.save(m, buf)


def test_a_second_derivative_through_a_quantized_backward_is_refused_not_dropped():
    """create_graph=True through a frozen low-precision layer returned a gradient penalty's derivative without the
    layer's second-order terms (‖∂pen/∂W0‖ 1.92 against BF16's 8.86, helper 65). The exact paths (calibration,
    bf16) stay twice differentiable; the quantized one raises when autograd reaches it."""
    def penalty_grad(recipe):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.LayerNorm(64))
        adahop.convert_model(m, recipe, exclude=())
        gs = torch.autograd.grad(m(torch.randn(16, 64)).pow(3).mean(), list(m.parameters()), create_graph=True)
        sum(g.pow(2).sum() for g in gs).backward()
        return m[0].weight.grad

    ref = penalty_grad("bf16")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.LayerNorm(64))
    gs = torch.autograd.grad(plain(torch.randn(16, 64)).pow(3).mean(), list(plain.parameters()), create_graph=True)
    sum(g.pow(2).sum() for g in gs).backward()
    torch.testing.assert_close(ref, plain[0].weight.grad)  # the bf16 recipe is nn.Linear, second derivative too
    with pytest.raises(RuntimeError, match="second derivative .* through a converted layer's low-precision backward"):
        penalty_grad("mxfp4")


def test_halo2_refuses_a_token_count_that_is_not_a_power_of_two_in_forward():
    """HALO-2's token Hadamard on ∇Y needs batch·seq a power of two: the forward ran and the backward raised (a
    DataLoader's short last batch crashed mid-epoch after its forward; helper 65). Now the forward refuses it."""
    m = adahop.convert_model(nn.Sequential(nn.Linear(128, 96)), "halo-2")
    with pytest.raises(ValueError, match=r"dgrad's ∇Y \[40, 96\].*power-of-two.*drop_last=True"):
        m(torch.randn(40, 128))
    m(torch.randn(2, 32, 128)).sum().backward()  # 64 tokens
    assert m[0].weight.grad.abs().sum() > 0
    with torch.no_grad():  # no backward, no token Hadamard: any count
        assert m(torch.randn(40, 128)).shape == (40, 96)


def test_on_step_and_a_0d_input_are_checked():
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4")
    for bad in (2.5, -3, True, "1"):
        with pytest.raises(TypeError, match="pass the number of optimizer steps done, an int >= 0"):
            adahop.on_step(m, bad)
    adahop.on_step(m, torch.tensor(3))  # NumPy's and 0-d tensors' ints are ints
    assert adahop.nn.get_controller(m).step == 3
    with pytest.raises(ValueError, match="a 0-d input; the layer takes"):
        m(torch.tensor(1.0))


def test_convert_refuses_a_model_it_would_leave_unconverted():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="Conv1D"):
        adahop.convert_model(gpt2, "mxfp4")
    with pytest.raises(ValueError, match="no nn.Linear layer"):
        adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4", exclude=("0",))
    class Sub(nn.Linear):
        pass

    with pytest.raises(ValueError, match=r"subclasses of nn.Linear \(Sub 0, ...\).*convert_layers\(model, "
                                         r"adahop.get_recipe\('mxfp4'\), names\)"):  # it said "or it has none"
        adahop.convert_model(nn.Sequential(Sub(64, 64)), "mxfp4")
    m = adahop.convert_model(nn.Sequential(nn.Linear(64, 64)), "mxfp4", exclude=None)  # None: exclude nothing
    assert type(m[0]).__name__ == "LowPrecisionLinear"


def test_describe_names_the_fp32_accumulation_of_the_nvfp4_gemms():
    """The NVFP4 GEMM (kernels.nvfp4_matmul) always sums in FP32 on the BF16 tensor cores; it does not
    read GemmSpec.accumulation. describe's first line said "fast-path accumulation fp8-mma" for the
    nvfp4 and averis recipes, a path they never take (fresh-user pass); MXFP4 recipes keep theirs."""
    def first_line(recipe):
        model = nn.Sequential(nn.Linear(64, 64, bias=False))
        adahop.convert_model(model, recipe, exclude=())
        return adahop.describe(model).splitlines()[0]

    for recipe in ("nvfp4", "averis"):
        assert "fast-path accumulation fp32 (on CUDA" in first_line(recipe), first_line(recipe)
    assert "fast-path accumulation fp8-mma (on CUDA" in first_line("mxfp4")
    assert "fast-path accumulation fp8-mma (on CUDA" in first_line("averis-mxfp4")


def test_layers_reading_one_input_under_autocast_keep_one_copy_and_the_same_gradients(monkeypatch):
    """q, k and v read one FP32 X; under eager autocast each cast it to BF16 and kept its own copy for backward.
    One shared copy now: the saved storages hold one BF16 X, and every gradient equals, bit for bit, that of
    separate casts (the gradients reach X each on its own and are summed in FP32)."""
    import adahop.nn.linear as linear_mod
    from adahop.nn import convert_model
    from adahop.recipes import get_recipe

    def run():
        torch.manual_seed(0)
        m = torch.nn.ModuleDict({k: torch.nn.Linear(64, 64, bias=False) for k in ("q", "k", "v")})
        convert_model(m, get_recipe("adahop-lv2"))  # calibrating: each layer saves its BF16 input
        x = torch.randn(32, 64, requires_grad=True)
        storages = set()

        def pack(t):
            if t.dtype == torch.bfloat16 and t.shape[-1] == 64 and t.numel() == x.numel():
                storages.add(t.untyped_storage().data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            y = sum((m[k](x).float() * (i + 1)).sum() for i, k in enumerate(("q", "k", "v")))
        y.backward()
        return len(storages), x.grad, [m[k].weight.grad for k in ("q", "k", "v")]

    from adahop.nn.shared_cast import shared_cast
    x = torch.randn(4, 8)
    with torch.no_grad():
        a = shared_cast(x, torch.bfloat16)
        assert shared_cast(x, torch.bfloat16).data_ptr() == a.data_ptr()  # shared
        a.mul_(0)  # a write through the copy handed out: the next caller gets a fresh, right copy
        assert torch.equal(shared_cast(x, torch.bfloat16), x.to(torch.bfloat16))
        x.add_(1)  # a write to the source
        assert torch.equal(shared_cast(x, torch.bfloat16), x.to(torch.bfloat16))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # no version counters there
        xi = torch.randn(32, 64)
        assert shared_cast(xi, torch.bfloat16).dtype == torch.bfloat16
    n_one, gx_one, gw_one = run()
    layer = torch.nn.ModuleDict({"q": torch.nn.Linear(64, 64, bias=False)})
    convert_model(layer, get_recipe("adahop-lv2"))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # it raised on the version counter
        assert layer["q"](torch.randn(32, 64)).shape == (32, 64)
    monkeypatch.setattr(linear_mod, "shared_cast", lambda x, dtype: x.to(dtype))  # each layer its own cast
    n_sep, gx_sep, gw_sep = run()
    assert (n_sep, n_one) == (3, 1)
    assert torch.equal(gx_sep, gx_one) and all(torch.equal(a, b) for a, b in zip(gw_sep, gw_one))


def test_on_step_warns_of_a_step_that_goes_back():
    """Random bits are seeded by step: a counter that goes back repeats earlier steps' bits, which a deliberate
    replay wants (tests/test_compile.py compares modes at one step) and a counter bug does not (a new user's
    probe: on_step(3) after step 40 returned False and set the step to 3, silently)."""
    from adahop.nn import convert_model, get_controller, on_step
    from adahop.nn.convert import controller_state, load_controller_state
    from adahop.recipes import get_recipe
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    convert_model(m, get_recipe("tseng"), exclude=())
    on_step(m, 40)
    saved = controller_state(m)
    on_step(m, 40)  # the same step again changes nothing
    with pytest.warns(UserWarning, match=r"on_step\(3\) after step 40: the steps from 3 on repeat the random bits"):
        on_step(m, 3)
    assert get_controller(m).step == 3
    load_controller_state(m, {**saved, "step": 3})  # the way back to a checkpoint: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert on_step(m, 4) is False and get_controller(m).step == 4


def test_an_eval_mode_forward_with_gradients_on_is_warned_about_once(monkeypatch):
    """In eval mode with grad on, a forward is a training call (its random bits and calibration observations
    are the training run's): evaluating that way changes the training that follows. Said once, with the fix."""
    import adahop.nn.linear as linear_mod
    from adahop.nn import convert_model
    from adahop.recipes import get_recipe
    monkeypatch.setattr(linear_mod, "_WARNED", set())
    m = torch.nn.Sequential(torch.nn.Linear(64, 64))
    convert_model(m, get_recipe("tseng"), exclude=())
    x = torch.randn(8, 64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m(x).sum().backward()  # training mode: nothing to say
        m.eval()
        with torch.no_grad():
            m(x)  # the eval stream: nothing to say
        m(x)
        m(x)
    said = [w for w in seen if "eval mode with gradients enabled" in str(w.message)]
    assert len(said) == 1 and "torch.no_grad()" in str(said[0].message)


def test_a_linear_held_under_two_names_is_converted_at_both():
    """named_modules lists a shared module once, so its second holder kept the exact nn.Linear: half of a
    weight-shared model's calls ran unquantized while describe() showed it converted (helper 31)."""
    import adahop

    lin = torch.nn.Linear(64, 64)
    m = torch.nn.Module()
    m.a, m.b = lin, lin
    adahop.convert_model(m, "mxfp4", exclude=None)
    assert isinstance(m.a, adahop.nn.LowPrecisionLinear) and m.b is m.a


def test_weights_of_three_dimensions_are_warned_about_as_unconverted():
    """transformers 5 stores a mixture of experts' experts as 3-D Parameters (Qwen3-MoE: 80% of the tiny
    model's matrix weights): they stayed exact with no word while the model passed for an MXFP4 one."""
    import adahop

    m = torch.nn.Module()
    m.attn = torch.nn.Linear(64, 64)
    m.experts = torch.nn.Module()
    m.experts.gate_up_proj = torch.nn.Parameter(torch.randn(3, 128, 64))
    with pytest.warns(UserWarning, match=r"1 weights of 3 or more dimensions .*experts.gate_up_proj.*: 86% of the "
                                         r"matrix weights outside the embeddings run unconverted, not in 'mxfp4'"):
        adahop.convert_model(m, "mxfp4", exclude=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adahop.convert_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mxfp4", exclude=None)  # nothing to say


def test_a_low_precision_linear_built_without_a_recipe_is_refused_with_the_way_to_build_one():
    """LowPrecisionLinear(64, 64) built (nn.Linear's constructor) and failed at its first call with
    "'LowPrecisionLinear' object has no attribute 'controller'"; from_linear(controller=None) with a NoneType error."""
    import adahop
    from adahop.nn import LowPrecisionLinear

    with pytest.raises(TypeError, match="adahop.convert_model"):
        LowPrecisionLinear(64, 64)
    with pytest.raises(TypeError, match="from_linear: controller=None; pass the model's Controller"):
        LowPrecisionLinear.from_linear(torch.nn.Linear(64, 64), adahop.get_recipe("mxfp4"), name="x", layer_id=0,
                                       controller=None)
    assert adahop.register_step_hook is adahop.nn.convert.register_step_hook  # exported beside on_step


def test_a_region_recomputed_outside_backward_raises_instead_of_shifting_the_bits():
    """Unpacking a checkpointed region's saved tensor by hand recomputes it outside backward, and backward recomputes it
    again: its calls were counted as new forwards, shifting every later call's bits (tseng: gradients 2e-3 off with two
    micro-batches, helper 57). No count can tell such a rerun from a new forward, so it raises."""
    from torch.utils.checkpoint import checkpoint as ckpt

    torch.manual_seed(0)
    m = adahop.convert_model(nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)]), "tseng", exclude=None, seed=0)
    f = lambda x: m[1](m[0](x)).sin()  # noqa: E731
    y = ckpt(f, torch.randn(16, 64, requires_grad=True), use_reentrant=False)
    with pytest.raises(RuntimeError, match="recomputed outside backward"):
        y.grad_fn._saved_self
    y = ckpt(f, torch.randn(16, 64, requires_grad=True), use_reentrant=False)  # the ordinary path still runs
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_a_reentrant_region_inside_a_non_reentrant_one_with_forwards_first_recomputes_each_with_its_bits():
    """The outer region's recompute runs the inner reentrant forward again, which took the newest waiting call's bits:
    with two micro-batches forward first and their backwards in order, averis's gradients were ~1e-4 off (helper 57).
    It now takes the call of the outer region being recomputed, found on the stack."""
    from torch.utils.checkpoint import checkpoint as ckpt

    F = torch.nn.functional

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        m = adahop.convert_model(nn.ModuleList([nn.Linear(64, 64) for _ in range(3)]), "averis", exclude=None, seed=0)
        inner = lambda h: m[1](F.gelu(h))  # noqa: E731
        ci = (lambda h: ckpt(inner, h, use_reentrant=True)) if checkpointed else inner
        outer = lambda x: m[2](F.gelu(ci(F.gelu(m[0](x)))))  # noqa: E731
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(16, 64, generator=g, requires_grad=True) for _ in range(2)]
        losses = [(ckpt(outer, x, use_reentrant=False) if checkpointed else outer(x)).square().mean() for x in xs]
        for loss in losses:
            loss.backward()
        return [p.grad for p in m.parameters()]

    plain, ck = grads(False), grads(True)
    assert len(ck) == 6 and all(torch.equal(a, b) for a, b in zip(plain, ck))


def test_the_bias_gradient_is_summed_in_the_bias_dtype():
    """A BF16 weight beside an FP32 bias (FP32 input, no autocast): the bias gradient was rounded to the weight's
    BF16 on its way to the FP32 bias (helper 65); it is now ∑∇Y in the bias's own dtype."""
    for recipe in ("bf16", "mxfp4"):
        lin = nn.Linear(64, 32)
        lin.weight.data = lin.weight.data.bfloat16()
        m = adahop.convert_model(nn.Sequential(lin), recipe, exclude=())
        dy = torch.randn(16, 32) * 1e-3 + 1
        m(torch.randn(16, 64)).backward(dy)
        assert m[0].bias.grad.dtype == torch.float32
        torch.testing.assert_close(m[0].bias.grad, dy.sum(0), rtol=1e-6, atol=0)
