"""PTQ grids and GPTQ: GPTQ with H = I is RTN, GPTQ beats RTN with correlated inputs, the grids are the
formats' own, bad options are refused with the fix, the bit packing round-trips."""

from __future__ import annotations

import pytest
import torch

from adahop.formats import fake_quantize
from adahop.ptq.fit import FitOptions
from adahop.ptq.ldlq import gptq, proxy_error
from adahop.ptq.grids import make_grid
from adahop.ptq.quantize import pack_bits, quantize_layer, unpack_bits

GRIDS = [("int", 2, 32), ("int", 3, 128), ("int", 4, 48), ("mxfp4", 4, None), ("nvfp4", 4, None)]


def _correlated(n: int, gen: torch.Generator, tokens: int = 2048) -> torch.Tensor:
    """E[x xᵀ] of inputs with correlated channels and a few outlier channels."""
    mix = torch.randn(n, n, generator=gen) / n**0.5 + torch.eye(n)
    x = torch.randn(tokens, n, generator=gen) @ mix
    x[:, :3] *= 8
    return x.T @ x / tokens


@pytest.mark.parametrize("q,bits,g", GRIDS)
def test_gptq_with_identity_hessian_is_rtn(q, bits, g, gen):
    w = torch.randn(24, 96, generator=gen)
    grid = make_grid(q, bits, g)
    out = gptq(w, torch.eye(96), grid)
    codes, scales, vals = make_grid(q, bits, g).quantize(w)
    assert torch.equal(out["q"], vals) and torch.equal(out["codes"], codes) and torch.equal(out["scales"], scales)
    assert torch.equal(vals, make_grid(q, bits, g).fake_quantize(w))


@pytest.mark.parametrize("q,bits,g", GRIDS)
def test_gptq_beats_rtn_on_the_proxy_error_with_correlated_inputs(q, bits, g, gen):
    w = torch.randn(32, 96, generator=gen)
    h = _correlated(96, gen)
    e_gptq = proxy_error(w, gptq(w, h, make_grid(q, bits, g))["q"], h)
    e_rtn = proxy_error(w, make_grid(q, bits, g).fake_quantize(w), h)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_group_scales_straddling_a_lazy_batch_see_its_pending_updates(gen):
    # a group of 96 over batches of 32: GPTQ by batches of 32 must equal GPTQ in one batch
    w, h = torch.randn(8, 192, generator=gen), _correlated(192, gen)
    a = gptq(w, h, make_grid("int", 3, 96), block=32)
    b = gptq(w, h, make_grid("int", 3, 96), block=192)
    torch.testing.assert_close(a["q"], b["q"], rtol=0, atol=1e-5)


def test_the_fp_grids_are_the_formats_own(gen):
    w = torch.randn(16, 64, generator=gen)
    assert torch.equal(make_grid("mxfp4", 4).fake_quantize(w), fake_quantize(w, "mxfp4", axis=1))
    assert torch.equal(make_grid("nvfp4", 4).fake_quantize(w), fake_quantize(w, "nvfp4", axis=1))


def test_int_grid_is_symmetric_with_all_codes_used(gen):
    grid = make_grid("int", 2, 64)
    w = torch.randn(4, 64, generator=gen)
    codes, scales, vals = grid.quantize(w)
    assert set(codes.unique().tolist()) == {0, 1, 2, 3}
    assert torch.equal(scales, scales.half().float())  # the FP16 scales the artifact stores are the ones used
    levels = (vals / scales.repeat_interleave(64, 1)).unique()
    torch.testing.assert_close(levels, torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    assert torch.equal(grid.decode(codes, grid.stored_scales(scales)), vals)
    # the clipping search never does worse than no clipping
    plain = make_grid("int", 2, 64)
    plain.clip = (1.0,)
    assert (vals - w).pow(2).sum() <= (plain.fake_quantize(w) - w).pow(2).sum()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_int_grid_scale_is_the_first_clipping_ratio_with_the_least_error(bits, gen):
    """The candidates are scored at once; each row's scale must be the one a ratio-by-ratio search keeps."""
    grid = make_grid("int", bits, 128)
    w = torch.randn(300, 128, generator=gen) * torch.rand(300, 1, generator=gen) * 3
    w[::7, :3] *= 20  # rows with outliers, where clipping wins
    amax = w.abs().amax(1, keepdim=True)
    best, best_err = None, None
    for r in grid.clip:
        s = (r * amax / (2 ** (bits - 1) - 0.5)).half().float()
        err = (grid.round(w, s)[1] - w).pow(2).sum(1, keepdim=True)
        best = s if best is None else torch.where(err < best_err, s, best)
        best_err = err if best_err is None else torch.minimum(err, best_err)
    assert torch.equal(grid.scales(w), best)
    assert (best != (amax / (2 ** (bits - 1) - 0.5)).half().float()).any()  # some rows do clip


@pytest.mark.parametrize("n", [64, 160, 300])
def test_a_shorter_last_group_is_quantized_on_its_own(n, gen):
    """n not a multiple of the group (2752 = 21·128 + 64): the whole groups run at once, the last alone;
    each group must get exactly what quantizing it by itself gives."""
    grid = make_grid("int", 2, 64)
    w = torch.randn(5, n, generator=gen) * torch.rand(1, n, generator=gen) * 4
    codes, scales, vals = grid.quantize(w)
    assert codes.shape == vals.shape == (5, n) and scales.shape == (5, -(-n // 64))
    for j, a in enumerate(range(0, n, 64)):
        c, s, v = grid.quantize(w[:, a:a + 64])
        assert torch.equal(scales[:, j:j + 1], s) and torch.equal(vals[:, a:a + 64], v) and torch.equal(codes[:, a:a + 64], c)


@pytest.mark.parametrize("q", ["mxfp4", "nvfp4"])
def test_fp_grid_codes_and_stored_scales_decode_to_the_values(q, gen):
    grid = make_grid(q, 4)
    w = torch.randn(8, 64, generator=gen) * 3
    codes, scales, vals = grid.quantize(w)
    assert torch.equal(grid.decode(codes, grid.stored_scales(scales)), vals)
    assert grid.bits_per_weight(8, 64) == (4.25 if q == "mxfp4" else 4.5 + 32 / (8 * 64))


def test_bad_grid_options_name_the_fix():
    with pytest.raises(ValueError, match=r"--quantizer mxfp4 stores 4-bit.*pass --bits 4"):
        make_grid("mxfp4", 2)
    with pytest.raises(ValueError, match=r"--quantizer nvfp4 has one scale per 16.*drop --group-size"):
        make_grid("nvfp4", 4, 128)
    with pytest.raises(ValueError, match="--quantizer 'fp3' is not known"):
        make_grid("fp3", 4)
    with pytest.raises(ValueError, match="--group-size 0"):
        make_grid("int", 4, 0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_bit_packing_round_trips(bits, gen):
    for n in (1, 8, 37, 1000):  # short of a byte, a group of eight codes, ragged ends
        codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.numel() == -(-n * bits // 8)
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bit_packing_layout_is_little_endian_within_each_byte():
    """The layout the decode kernel reads (adahop.ptq._triton_decode): the first code in the low bits."""
    assert pack_bits(torch.tensor([1, 2, 3, 0, 2], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4, 2]
    assert pack_bits(torch.tensor([0xA, 0x3, 0xF], dtype=torch.uint8), 4).tolist() == [0x3A, 0x0F]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0b10001101, 1]
    assert pack_bits(torch.tensor([5, 3, 7], dtype=torch.uint8), 3).tolist() == [5 | 3 << 3 | (7 & 3) << 6, 7 >> 2]
    assert pack_bits(torch.tensor([0x1F, 0x01], dtype=torch.uint8), 5).tolist() == [0x1F | 1 << 5, 0]


def test_quantize_layer_counts_every_stored_bit(gen):
    w, h = torch.randn(32, 64, generator=gen), _correlated(64, gen)
    for method, extra in (("gptq", 0), ("rht-gptq", 32 + 64), ("harp-rtn", 32 + 64 + 16 * (32 * 7 // 2 + 32 * 3 // 2 + 64 * 14 // 2))):
        r = quantize_layer(w, h, method, make_grid("int", 3, 32), generator=torch.Generator().manual_seed(0),
                           fit_opts=FitOptions(steps=2))
        assert r.stored_bits == 32 * 64 * 3 + 32 * 2 * 16 + extra, method


@pytest.mark.parametrize("q", ["int", "mxfp4", "nvfp4"])
def test_zero_groups_and_dead_inputs_quantize_to_finite_weights(q, gen):
    # a pruned head (zero rows) and inputs that never fire (GPTQ zeroes their columns): an int group
    # scale of 0 once decoded 0/0 = NaN and `adahop ptq` wrote the NaN model (found by a new-user probe)
    w = torch.randn(64, 128, generator=gen)
    w[:32] = 0.0
    x = torch.randn(512, 128, generator=gen)
    x[:, :32] = 0.0  # the first 32 inputs never fire: one whole group of dead columns at group size 32
    h = x.T @ x / x.shape[0]
    grid = make_grid(q, 4, 32 if q == "int" else None)
    codes, scales, deq = grid.quantize(w)
    assert torch.isfinite(deq).all() and deq[:32].abs().max() <= 2.0**-25
    out = gptq(w, h, make_grid(q, 4, 32 if q == "int" else None))
    assert torch.isfinite(out["q"]).all()
    # the finite rows still quantize as usual: the zero rows did not disturb them
    torch.testing.assert_close(deq[32:], make_grid(q, 4, 32 if q == "int" else None).quantize(w[32:])[2])


@pytest.mark.parametrize("method", ["rtn", "gptq", "rht-gptq"])
@pytest.mark.parametrize("which", ["weight", "Hessian"])
def test_a_non_finite_weight_or_hessian_is_refused_naming_it_not_the_damping(method, which, gen):
    """NaN in H once failed GPTQ's Cholesky and told the user to raise --damp."""
    w, h = torch.randn(32, 64, generator=gen), torch.eye(64)
    (w if which == "weight" else h)[3, 5] = float("inf")
    with pytest.raises(ValueError, match=f"{method}: the {which} holds 1 NaN or inf values of") as e:
        quantize_layer(w, h, method, make_grid("int", 4, 32), generator=gen)
    assert "--damp" not in str(e.value)
    with pytest.raises(ValueError, match=f"gptq: the {which} holds"):
        gptq(w, h, make_grid("int", 4, 32))


def test_fit_block_draws_the_signs_quantize_layer_would(gen):
    """HARP's block fit draws every layer's signs before any layer is quantized: they must be the ones the
    layer-by-layer path draws from the same generator, in the block's order (reproducible artifacts)."""
    from adahop.ptq.quantize import fit_block

    grid, opts = make_grid("int", 2, 32), FitOptions(steps=1)
    items = [(name, torch.randn(m, 64, generator=gen), torch.eye(64)) for name, m in (("q", 64), ("k", 32), ("o", 64))]
    fitted = fit_block(items, "harp-gptq", grid, generator=torch.Generator().manual_seed(5), fit_opts=opts)
    g = torch.Generator().manual_seed(5)
    for name, w, h in items:
        res = quantize_layer(w, h, "harp-gptq", grid, generator=g, fit_opts=opts)
        t = fitted[name][0]
        assert torch.equal(res.stored["signs_out"], pack_bits((t.s_out < 0).to(torch.uint8), 1)), name
        assert torch.equal(res.stored["signs_in"], pack_bits((t.s_in < 0).to(torch.uint8), 1)), name
    assert fit_block(items, "rht-gptq", grid, generator=torch.Generator()) == {}


def test_every_lazy_name_of_adahop_ptq_is_its_modules_object_after_the_submodules_load():
    """Importing a submodule binds its name on the package: a module named like one of the package's functions
    (``gptq`` once was) would shadow that function for every later ``adahop.ptq.<name>``."""
    import importlib

    import adahop.ptq as ptq

    mods = {m: importlib.import_module(f"adahop.ptq.{m}") for m in set(ptq._WHERE.values())}
    for name, m in ptq._WHERE.items():
        assert getattr(ptq, name) is getattr(mods[m], name), name
    assert callable(ptq.gptq)


def _qwen2_sliding_every_other_layer():
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("arch", ["llama-tiny", "qwen2 with sliding-window layers"])
def test_block_by_block_calibration_equals_running_the_whole_model_to_each_block(arch):
    """The calibration records each block's call once and runs blocks alone on the quantized previous block's
    outputs; the Hessians it takes equal, bit for bit, those of the whole model run up to each block with the
    earlier blocks already quantized (the GPTQ order, and how the calibration ran before). The Qwen2 model's
    layers get two different attention masks (a window of 8 of the 32 tokens on every other layer): each
    block's own recorded call must reach it."""
    from adahop.models import build_model
    from adahop.ptq.calibrate import decoder_blocks, quantize_model, whole_model_hessians
    from adahop.ptq.quantize import quantize_layer as ql

    torch.manual_seed(0)
    model = build_model("llama-tiny", vocab_size=128, max_seq_len=32) if arch == "llama-tiny" else \
        _qwen2_sliding_every_other_layer()
    batches = [torch.randint(0, 128, (2, 32)) for _ in range(3)]
    grid, seen = make_grid("int", 2, 16), {}

    def quantize(name, w, h):
        seen[name] = h
        return ql(w, h, "rtn", grid, generator=torch.Generator().manual_seed(0))

    reference = {}
    prefix, blocks = decoder_blocks(model)
    orig = quantize

    def quantize_checking(name, w, h):  # before this layer's weight changes, the reference of its whole block
        i = next(int(p) for p in name.split(".") if p.isdigit())
        if i not in reference:
            # the reference: the model from its embedding, stopped after the block
            reference[i] = whole_model_hessians(model, blocks[i], batches, torch.device("cpu"))
        return orig(name, w, h)
    quantize_model(model, batches, quantize_checking, device=torch.device("cpu"), log=lambda s: None)
    assert len(seen) == 7 * len(blocks) and set(reference) == set(range(len(blocks)))
    for name, h in seen.items():
        i = next(int(p) for p in name.split(".") if p.isdigit())
        assert torch.equal(h, reference[i][name.split(f"{prefix}.{i}.")[1]]), name


def test_shared_idle_and_non_linear_block_weights_are_named_not_quantized_silently():
    """From a new user's probe on non-Llama models: blocks sharing a module (Zamba2) quantized it twice, a layer a
    block never calls got a zero Hessian and GPTQ rounded it to ~0, a list of bare projections was taken for the
    stack of blocks, and fused MoE experts (parameters outside nn.Linear) stayed BF16 without a word."""
    from torch import nn

    from adahop.ptq.calibrate import (block_hessians, check_unshared, decoder_blocks, record_block_calls,
                                      unquantized_weights)

    class Block(nn.Module):
        def __init__(self, shared=None, idle=False):
            super().__init__()
            self.a = shared or nn.Linear(8, 8)
            self.b = nn.Linear(8, 8) if idle else None
            self.experts = nn.Parameter(torch.randn(2, 8, 8))

        def forward(self, x):
            return x + self.a(x)

    class Model(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(blocks)
            self.proj = nn.ModuleList([nn.Linear(8, 8) for _ in range(len(blocks) + 1)])  # longer, but no blocks

        def forward(self, input_ids, use_cache=False):
            x = self.embed(input_ids)
            for b in self.layers:
                x = b(x)
            return x

    shared = nn.Linear(8, 8)
    prefix, blocks = decoder_blocks(Model([Block(shared), Block(shared)]))
    assert prefix == "layers"
    with pytest.raises(ValueError, match=r"layers\.1\.a is the same layer as layers\.0\.a: the model's decoder blocks "
                                         r"share modules"):
        check_unshared(blocks, prefix)
    model = Model([Block(idle=True), Block()])
    _, blocks = decoder_blocks(model)
    xs, calls = record_block_calls(model, blocks, [torch.randint(0, 16, (2, 4))], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^b: no calibration input reached this layer"):
        block_hessians(blocks[0], xs, [c[0] for c in calls])
    assert unquantized_weights(blocks) == (2 * 2 * 8 * 8, ["0.experts", "1.experts"])
