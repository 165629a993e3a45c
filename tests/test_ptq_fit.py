"""HARP fitting (`specs/related_methods.md` §2.3): the proxy loss falls from its RHT start, the weight
stays exactly representable, and the fitted rotations are the ones the artifact stores."""

from __future__ import annotations

import pytest
import torch

from adahop.ptq.fit import FitOptions, fit_harp, fit_harp_groups, fit_harp_many, offblock_energy, proxy_loss
from adahop.ptq.grids import make_grid
from adahop.ptq.incoherence import RHTRotation, TwoSided
from adahop.ptq.rotation import HARPRotation


def _layer(gen, m=32, n=64):
    w = torch.randn(m, n, generator=gen)
    w[:, 5] *= 6  # an outlier input channel, as trained weights have
    x = torch.randn(1024, n, generator=gen) @ (torch.eye(n) + 0.3 * torch.randn(n, n, generator=gen) / n**0.5)
    return w, x.T @ x / 1024


@pytest.mark.parametrize("q,bits", [("int", 2), ("mxfp4", 4)])
def test_fitting_lowers_the_proxy_loss_from_the_rht_start(q, bits, gen):
    w, h = _layer(gen)
    grid = make_grid(q, bits, 32 if q == "int" else None)
    t = TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=gen)
    rht = TwoSided(RHTRotation(32), RHTRotation(64), t.s_out, t.s_in)
    opts = FitOptions(steps=60, lr=0.03)
    hn = h / torch.diagonal(h).mean()
    start, _ = proxy_loss(rht.weight(w), rht.hessian(hn), grid, opts)  # Θ = 0 is this RHT exactly
    res = fit_harp(w, h, t, grid, opts)
    assert res.loss_start == pytest.approx(float(start), rel=1e-5)
    assert res.loss_end < 0.97 * res.loss_start, (res.loss_start, res.loss_end)
    with torch.no_grad():
        torch.testing.assert_close(t.weight_inverse(t.weight(w)), w, rtol=0, atol=1e-4)  # still an exact transform
        end, _ = proxy_loss(t.weight(w), t.hessian(hn), grid, opts)
    assert float(end) == pytest.approx(res.loss_end, rel=1e-6)  # measured with the FP16-rounded, stored Θ


def test_offblock_energy_counts_only_outside_the_diagonal_blocks():
    h = torch.arange(36.0).reshape(6, 6)
    mask = torch.ones(6, 6)
    mask[:4, :4] = 0
    mask[4:, 4:] = 0  # blocks of 4: [0..3], [4, 5] (the partial last block is a block)
    assert float(offblock_energy(h, 4)) == pytest.approx(float((h * mask).pow(2).sum() / 36))
    assert float(offblock_energy(torch.eye(6), 2)) == 0.0


def test_bad_fit_options_are_refused():
    with pytest.raises(ValueError, match="steps=0"):
        FitOptions(steps=0)
    with pytest.raises(ValueError, match="lr"):
        FitOptions(lr=0.0)
    for kw, msg in [({"steps": 2.5}, "steps=2.5 must be an integer"), ({"hbd_block": "8"}, "hbd_block='8' must be an integer"),
                    ({"lr": "0.03"}, "lr='0.03' must be a number"), ({"refresh": True}, "refresh=True must be an integer"),
                    ({"lr": float("inf")}, r"lr \(inf\) must be finite"), ({"hbd_lambda": float("nan")}, r"hbd_lambda \(nan\) finite")]:
        with pytest.raises(ValueError, match=msg):
            FitOptions(**kw)


def test_shared_stage_kernels_give_the_same_rotated_weight_and_hessian(gen):
    """The fitting step computes each rotation's kernels once and rotates W and both sides of H with them."""
    w, h = _layer(gen, m=24, n=40)  # 24 = 8·3, 40 = 8·5: mixed radix on both sides
    t = TwoSided.random_signs(HARPRotation(24), HARPRotation(40), generator=gen)
    with torch.no_grad():
        for th in list(t.u.thetas) + list(t.v.thetas):
            th.normal_(0, 0.3, generator=gen)
        ks = t.kernels()
        torch.testing.assert_close(t.weight(w, ks), t.weight(w), rtol=0, atol=0)
        torch.testing.assert_close(t.hessian(h, ks), t.hessian(h), rtol=0, atol=0)
    rht = TwoSided(RHTRotation(32), RHTRotation(64), torch.ones(32), torch.ones(64))
    assert rht.kernels() == (None, None)  # no parameters: nothing to share


def test_bench_harp_counts_every_decoder_linear_once(repo_script):
    shapes = repo_script("scripts/bench_harp.py").linear_shapes("llama-350m")
    assert shapes == {(1024, 1024): 48, (256, 1024): 48, (2752, 1024): 48, (1024, 2752): 24}


def test_bench_harp_runs_and_projects_the_whole_model(repo_script, tmp_path):
    import json
    bench = repo_script("scripts/bench_harp.py")
    assert bench.main(["--model", "llama-tiny", "--steps", "10", "--device", "cpu", "--json", str(tmp_path / "b.json")]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert sum(r["layers"] for r in res["rows"]) == 7 * 2  # llama-tiny: two blocks
    assert res["total_s"] == pytest.approx(sum(r["s_per_layer"] * r["layers"] for r in res["rows"]))
    assert all(r["ms_per_step"] > 0 and r["loss_end"] < r["loss_start"] for r in res["rows"])  # each fit from the RHT start
    block = bench.time_block("llama-tiny", 3, 3, bench.make_grid("int", 2), torch.device("cpu"))  # the GPU-only row, on the CPU
    assert block["layers"] == 7 and block["ms_per_step"] > 0 and block["loss_gap_rel"] == 0 and not block["cuda_graph"]


def test_cuda_graph_is_refused_where_it_cannot_run_and_off_by_default_on_the_cpu(gen):
    w, h = _layer(gen)
    grid = make_grid("int", 2, 32)

    def rot():
        return TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=torch.Generator().manual_seed(3))

    with pytest.raises(ValueError, match="cuda_graph=True needs w on CUDA"):
        fit_harp(w, h, rot(), grid, FitOptions(steps=4), cuda_graph=True)
    a, b = fit_harp(w, h, rot(), grid, FitOptions(steps=8)), fit_harp(w, h, rot(), grid, FitOptions(steps=8), cuda_graph=False)
    assert not a.cuda_graph and a.loss_end == b.loss_end and a.history == b.history  # the default on a CPU is the eager loop
    assert make_grid("nvfp4", 4).tensor_scale and not grid.tensor_scale  # NVFP4 reads its tensor scale to the host


@pytest.mark.parametrize("q,bits", [("int", 2), ("nvfp4", 4)])
def test_fitting_layers_together_equals_fitting_each_alone(q, bits, gen):
    """fit_harp_many sums independent losses: each Θ must follow the path its own fit takes (NVFP4's
    tensor scale is taken per layer, not over the stack)."""
    grid = make_grid(q, bits, 32 if q == "int" else None)
    layers = [_layer(gen) for _ in range(3)]
    layers[1] = (layers[1][0] * 5, layers[1][1])  # another scale: a shared target or RMS would show

    def rots():
        g = torch.Generator().manual_seed(11)
        return [TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=g) for _ in layers]

    opts = FitOptions(steps=2)  # few: the RTN target is discontinuous, so a float-rounding gap can flip an element's level
    alone, together = rots(), rots()
    res_alone = [fit_harp(w, h, t, grid, opts) for (w, h), t in zip(layers, alone)]
    res_together = fit_harp_many([w for w, _ in layers], [h for _, h in layers], together, grid, opts)
    for a, b, ra, rb in zip(alone, together, res_alone, res_together):
        for pa, pb in zip(list(a.u.thetas) + list(a.v.thetas), list(b.u.thetas) + list(b.v.thetas)):
            torch.testing.assert_close(pa.detach(), pb.detach(), rtol=0, atol=2.5e-4)  # one FP16 step of the stored Θ
        assert rb.loss_end == pytest.approx(ra.loss_end, rel=1e-4) and rb.loss_start == pytest.approx(ra.loss_start, rel=1e-6)
        assert rb.loss_end < rb.loss_start


def test_fit_harp_many_refuses_mixed_shapes(gen):
    grid = make_grid("int", 2, 32)
    (w, h), g = _layer(gen), torch.Generator().manual_seed(0)
    t = TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=g)
    with pytest.raises(ValueError, match="weights of one shape"):
        fit_harp_many([w, w[:16]], [h, h], [t, t], grid, FitOptions(steps=2))


def test_a_weight_hessian_or_transform_of_the_wrong_size_is_refused_before_fitting(gen):
    """A transposed weight or a Hessian of the other side once broadcast into a fit of the wrong layer."""
    grid = make_grid("int", 2, 32)
    (w, h), g = _layer(gen), torch.Generator().manual_seed(0)
    t = TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=g)
    t_in = TwoSided.random_signs(HARPRotation(64), HARPRotation(64), generator=g)
    for args, msg in [((w.T.contiguous(), torch.eye(32), t), r"sizes 32 \(output\) and 64 \(input\), the weight is \[64, 32\]"),
                      ((w, torch.eye(32), t), r"Hessian must be \[64, 64\]"),
                      ((w, h, t_in), r"sizes 64 \(output\) and 64 \(input\), the weight is \[32, 64\]"),
                      ((w[0], h, t), "must be 2-D")]:
        with pytest.raises(ValueError, match=msg):
            fit_harp(*args, grid, FitOptions(steps=2))


@pytest.mark.parametrize("which", ["weight", "Hessian"])
def test_nan_in_the_weight_or_hessian_is_named_not_blamed_on_the_learning_rate(which, gen):
    w, h = _layer(gen)
    (w if which == "weight" else h)[1, 2] = float("nan")
    t = TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=f"layer 0: the {which} holds 1 NaN or inf values") as e:
        fit_harp(w, h, t, make_grid("int", 2, 32), FitOptions(steps=2))
    assert "harp-lr" not in str(e.value)


def test_a_diverged_fit_is_refused_naming_the_learning_rate(gen):
    """Θ past FP16's range cannot be stored: the layer used to decode to inf and be reported as a bug."""
    w, h = _layer(gen)
    t = TwoSided.random_signs(HARPRotation(32), HARPRotation(64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="overflow FP16.*lower --harp-lr"):
        fit_harp(w, h, t, make_grid("int", 2, 32), FitOptions(steps=5, lr=1e9))


def test_fits_on_cuda_switch_pytorch_to_cusolver_and_restore_its_backend_even_on_error(monkeypatch):
    # MAGMA's batched LU (PyTorch's default for >16 blocks larger than 16x16) cannot be captured in a CUDA graph
    from adahop.ptq import fit as fit_mod

    state = {"backend": "default"}
    calls = []

    def fake(backend=None):
        if backend is not None:
            calls.append(backend)
            state["backend"] = backend
        return state["backend"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_linalg_library", fake)
    with fit_mod._capturable_linalg(True):
        assert state["backend"] == "cusolver"
    assert state["backend"] == "default"
    with pytest.raises(RuntimeError, match="boom"), fit_mod._capturable_linalg(True):
        raise RuntimeError("boom")
    assert state["backend"] == "default" and calls == ["cusolver", "default", "cusolver", "default"]
    with fit_mod._capturable_linalg(False):  # CPU fits leave the setting alone (a CPU build cannot set cuSOLVER)
        pass
    assert len(calls) == 4


def test_fitting_groups_side_by_side_equals_fitting_each_group_and_names_a_failing_group(gen):
    """fit_harp_groups (a block's shapes at once; on a GPU their graphs replay on streams of their own) makes
    each group's fit_harp_many: the same parameters and losses; an error names its group's label."""
    grid = make_grid("int", 2, 32)
    shapes = [(32, 64), (32, 64), (64, 32)]
    layers = [_layer(gen, m, n) for m, n in shapes]

    def rots():
        g = torch.Generator().manual_seed(5)
        return [TwoSided.random_signs(HARPRotation(m), HARPRotation(n), generator=g) for m, n in shapes]

    opts = FitOptions(steps=6)
    a, b = rots(), rots()
    sep = [fit_harp_many([w for w, _ in layers[:2]], [h for _, h in layers[:2]], a[:2], grid, opts),
           fit_harp_many([layers[2][0]], [layers[2][1]], a[2:], grid, opts)]
    grouped = fit_harp_groups([([w for w, _ in layers[:2]], [h for _, h in layers[:2]], b[:2]),
                               ([layers[2][0]], [layers[2][1]], b[2:])], grid, opts)
    assert [len(r) for r in grouped] == [2, 1]
    for ra, rb in zip(sum(sep, []), sum(grouped, [])):
        assert (rb.loss_start, rb.loss_end, rb.history) == (ra.loss_start, ra.loss_end, ra.history)
        assert not rb.cuda_graph and rb.graph_error == ""
    for ta, tb in zip(a, b):
        for pa, pb in zip([*ta.u.thetas, *ta.v.thetas], [*tb.u.thetas, *tb.v.thetas]):
            assert torch.equal(pa, pb)
    assert fit_harp_groups([], grid, opts) == []
    w, h = layers[0]
    with pytest.raises(ValueError, match="^layers.1.mlp.up_proj: fit_harp_many needs as many weights"):
        fit_harp_groups([([w], [h], rots()[:1]), ([w, w], [h], rots()[:2])], grid, opts,
                        labels=["layers.1.mlp.gate_proj", "layers.1.mlp.up_proj"])
    with pytest.raises(ValueError, match="1 labels for 2 groups"):
        fit_harp_groups([([w], [h], rots()[:1]), ([w], [h], rots()[:1])], grid, opts, labels=["a"])
