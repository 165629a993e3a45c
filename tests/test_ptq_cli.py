"""`adahop ptq` end to end on a 4-step llama-tiny run: the folder loads in transformers, its perplexity is
the printed one, the packed artifact rebuilds the weights, bad input is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def run_dir(prepare_real_text, tmp_path_factory) -> Path:
    from adahop.train import TrainConfig, train

    out = tmp_path_factory.mktemp("ptq") / "bf16"
    train(TrainConfig(model="llama-tiny", data=str(prepare_real_text(150_000)), out=str(out), seq_len=32, batch_size=4,
                      steps=4, warmup_steps=1, eval_every=4, eval_batches=2, ckpt_every=4, log_every=1, device="cpu",
                      recipe="bf16"))
    return out


def _same_to_bf16_rounding(rebuilt: torch.Tensor, exported: torch.Tensor) -> None:
    """The export is the rebuilt FP32 weight rounded to BF16; FP32 rounding differences in the rebuild
    may flip a rounding that falls on a BF16 tie, by one BF16 ulp (2^-8 relative)."""
    same = rebuilt.to(torch.bfloat16).float() == exported
    assert same.float().mean() > 0.999
    torch.testing.assert_close(rebuilt, exported, rtol=2**-8, atol=1e-7)


def _ptq(run_dir: Path, out: Path, *extra: str) -> int:
    from adahop.cli import main

    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    harp = ["--harp-steps", "3"] if any(a.startswith("harp-") for a in extra) else []  # the other methods refuse it
    return main(["ptq", str(run_dir), "--calib-data", data, "--calib-tokens", "256", "--batch-size", "4",
                 "--eval-batches", "2", *harp, "--out", str(out), *extra])


def test_harp_gptq_folder_loads_in_transformers_with_the_printed_perplexity(run_dir, tmp_path, capsys):
    import transformers

    from adahop.eval.perplexity import perplexity
    from adahop.ptq.export import dequantize_packed

    out = tmp_path / "harp2"
    assert _ptq(run_dir, out, "--method", "harp-gptq", "--bits", "2", "--group-size", "64") == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "ptq.json").read_text())
    assert res["method_options"] == {"damp": 0.01, "harp_steps": 3, "harp_lr": 0.03, "hbd_lambda": 0.1, "hbd_block": 8}
    ppl = res["perplexity"]["perplexity"]
    assert f"| harp-gptq | 2 | int | {res['bits_per_weight']:.3f} | {ppl:.4f} |" in printed
    assert "| unquantized | 16 |" in printed

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # any tool can load it
    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    again = perplexity(model.eval(), data, seq_len=res["seq_len"], batch_size=4, max_batches=2, device=torch.device("cpu"), bf16=False)
    assert again["perplexity"] == ppl  # the printed number is the folder's, to the last bit
    assert ppl > res["baseline"]["perplexity"] * 0.9  # sanity: 2 bits does not make the model much better

    # the packed artifact alone rebuilds every quantized weight (the export is it rounded to BF16)
    rebuilt = dequantize_packed(out / "ptq_packed.safetensors")
    sd = model.state_dict()
    assert len(rebuilt) == 14  # 2 blocks × (q, k, v, o, gate, up, down)
    for name, w in rebuilt.items():
        _same_to_bf16_rounding(w, sd[name + ".weight"])
    # bits/weight: 2-bit codes, FP16 scales per 64, signs and the FP16 Cayley parameters of both sides
    n_w = sum(w.numel() for w in rebuilt.values())
    assert res["quantized_weights"] == n_w
    assert res["bits_per_weight"] == pytest.approx(sum(v["stored_bits"] for v in res["layers"].values()) / n_w)
    assert 2 + 16 / 64 < res["bits_per_weight"] < 6
    assert all(v["harp"]["steps"] == 3 for v in res["layers"].values())


def test_int8_rotation_parameters_halve_harps_bits_and_still_rebuild_every_weight(run_dir, tmp_path):
    import transformers

    from adahop.ptq.export import dequantize_packed
    from adahop.ptq.rotation import HARPRotation

    out = tmp_path / "int8"
    assert _ptq(run_dir, out, "--method", "harp-rtn", "--bits", "4", "--theta-format", "int8", "--skip-baseline") == 0
    res = json.loads((out / "ptq.json").read_text())
    assert res["rotation"]["theta_format"] == "int8"
    sd = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    rebuilt = dequantize_packed(out)  # the folder names its artifact
    for name, w in dequantize_packed(out / "ptq_packed.safetensors").items():
        _same_to_bf16_rounding(w, sd[name + ".weight"])
        assert torch.equal(rebuilt[name], w)
    with pytest.raises(ValueError, match="no such file; pass the ptq_packed.safetensors"):
        dequantize_packed(tmp_path)

    def theta_bits(d: int, fmt: str) -> int:
        return sum(8 * p.numel() * p.element_size() for p in HARPRotation(d, theta_format=fmt).packed_params().values())

    for v in res["layers"].values():  # 4-bit codes, an FP16 scale per 128, a sign per row and column, Θ
        m, n = v["shape"]
        assert v["stored_bits"] == 4 * m * n + 16 * m * n // 128 + m + n + theta_bits(m, "int8") + theta_bits(n, "int8")
        assert theta_bits(m, "int8") + theta_bits(n, "int8") < 0.6 * (theta_bits(m, "fp16") + theta_bits(n, "fp16"))


def test_the_folder_decodes_from_its_codes_with_packed_linears(run_dir, tmp_path, repo_script, capsys):
    """load_packed_model: every quantized linear a PackedLinear on the artifact; the logits those give equal the
    BF16 export's up to its weight rounding, and a folder without the artifact is refused."""
    import transformers

    from adahop.ptq.decode import PackedLinear, load_packed_model

    out = tmp_path / "dec"
    assert _ptq(run_dir, out, "--method", "harp-rtn", "--bits", "2", "--group-size", "64", "--skip-baseline") == 0
    packed = load_packed_model(out, dtype=torch.float32)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 14
    plain = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = packed(ids).logits, plain(ids).logits
    assert float((a - b).norm() / b.norm()) < 4e-3  # 7.7e-4 seen: the export's BF16 weights, ~2^-9 relative each
    with pytest.raises(ValueError, match="no ptq_packed.safetensors"):
        load_packed_model(run_dir)
    with pytest.raises(ValueError, match="does not exist; pass a folder written by `adahop ptq`"):
        load_packed_model(tmp_path / "none")
    if not torch.cuda.is_available():  # refused before the weights load, not torch's AssertionError after
        with pytest.raises(ValueError, match="torch sees no CUDA GPU; pass device='cpu'"):
            load_packed_model(out, device="cuda")
    with pytest.raises(NotImplementedError, match="is saved already: copy its folder"):  # transformers crashed in it
        packed.save_pretrained(tmp_path / "again")
    (out / "ptq.json").rename(tmp_path / "ptq.json")
    with pytest.warns(UserWarning, match="has no ptq.json: the `adahop ptq` run that wrote it did not finish"):
        load_packed_model(out, dtype=torch.float32)
    (tmp_path / "ptq.json").rename(out / "ptq.json")
    bench = repo_script("scripts/bench_decode.py")  # its end-to-end mode, as a user times a folder
    assert bench.main(["--folder", str(out), "--tokens", "3", "--device", "cpu", "--json", str(tmp_path / "d.json")]) == 0
    res = json.loads((tmp_path / "d.json").read_text())
    assert res["bf16 export"] > 0 and res["packed"] > 0 and res["ratio"] == pytest.approx(res["packed"] / res["bf16 export"])
    assert 0 <= res["same_tokens"] <= 3
    # the teacher-forced logits' gap: the export's BF16 weight rounding, in logits of a few units at most
    assert 0 < res["max_logit_gap"] < 0.5, res
    assert ("margin_at_split" in res) == (res["same_tokens"] < 3)
    forced = bench.teacher_forced_logits(plain, seq := bench.dynamic_decode(plain, 4, torch.device("cpu"))[0], "cpu")
    assert forced.shape == (4, plain.config.vocab_size) and forced.argmax(-1).tolist() == seq  # its own greedy tokens
    # the static-cache step the GPU replays from a CUDA graph, run eagerly here: the dynamic cache's tokens
    cpu = torch.device("cpu")
    with torch.no_grad():
        seq = bench.dynamic_decode(packed, 6, cpu)[0]
        assert len(set(seq)) > 1, seq  # tokens that change, so that a wrong position would show
        assert bench.static_decode(packed, 6, cpu, graph=False)[0] == seq
        assert bench.static_decode(plain, 6, cpu, graph=False)[0] == bench.dynamic_decode(plain, 6, cpu)[0]
    for bad, msg in ((["--folder", str(run_dir)], "no ptq_packed.safetensors there"),
                     (["--folder", str(out), "--tokens", "0"], "--tokens (0) and --rows (1) must be >= 1"),
                     (["--folder", str(out), "--device", "junk"], "--device 'junk': give cpu or cuda"),
                     (["--folder", str(out), "--bits", "3"], "--folder decodes the folder's own layers"),
                     (["--folder", str(out), "--json", str(tmp_path / "no" / "d.json")], "does not exist")):
        with pytest.raises(SystemExit):  # a usage error, not a traceback after timing the BF16 model
            bench.main(bad)
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("method,quantizer", [("rht-rtn", "mxfp4"), ("gptq", "nvfp4")])
def test_fp4_grids_round_trip_through_the_artifact(run_dir, tmp_path, method, quantizer):
    import transformers

    from adahop.ptq.export import dequantize_packed

    out = tmp_path / method
    assert _ptq(run_dir, out, "--method", method, "--bits", "4", "--quantizer", quantizer, "--skip-baseline") == 0
    res = json.loads((out / "ptq.json").read_text())
    assert res["baseline"] is None
    assert res["method_options"] == ({"damp": 0.01} if method == "gptq" else {})
    sd = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, w in dequantize_packed(out / "ptq_packed.safetensors").items():
        _same_to_bf16_rounding(w, sd[name + ".weight"])
    n_w, rows_cols = res["quantized_weights"], sum(sum(v["shape"]) for v in res["layers"].values())
    per_layer = 0 if quantizer == "mxfp4" else 32  # NVFP4's FP32 tensor scale
    expect = (4.25 if quantizer == "mxfp4" else 4.5) + (14 * per_layer + (rows_cols if method.startswith("rht") else 0)) / n_w
    assert res["bits_per_weight"] == pytest.approx(expect, rel=1e-12)  # + one sign bit per row and column for RHT


def test_bad_input_is_refused_with_the_fix(run_dir, tmp_path, capsys):
    assert _ptq(run_dir, tmp_path / "a", "--method", "gptq", "--bits", "3", "--quantizer", "mxfp4") == 2
    assert "--quantizer mxfp4 stores 4-bit E2M1 elements, --bits 3 cannot be; pass --bits 4" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # refused before anything was loaded or written
    assert _ptq(run_dir, tmp_path / "b", "--method", "rtn", "--bits", "4", "--calib-tokens", "0") == 2
    assert "--calib-tokens 0: must be >= 1" in capsys.readouterr().err
    # HARP's options are named by their flags (the rotation's and the fit's own messages name arguments)
    for flags, msg in ((("--radix", "1"), "--radix 1: must be >= 2"),
                       (("--harp-lr", "-1"), "--harp-lr -1.0: must be finite and > 0"),
                       (("--hbd-lambda", "-0.5"), "--hbd-lambda -0.5: must be finite and >= 0"),
                       (("--harp-lr", "inf"), "--harp-lr inf: must be finite"),  # it failed after a whole fit
                       (("--hbd-lambda", "inf"), "--hbd-lambda inf: must be finite")):  # blamed on --harp-lr
        assert _ptq(run_dir, tmp_path / "c", "--method", "harp-rtn", "--bits", "4", *flags) == 2
        assert msg in capsys.readouterr().err
    assert _ptq(run_dir, tmp_path / "d", "--method", "gptq", "--bits", "4", "--damp", "inf") == 2
    assert "--damp inf: must be finite and > 0" in capsys.readouterr().err  # "raise --damp" before


def test_eval_tasks_add_the_zero_shot_average(run_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from test_eval import make_task_data  # the wheel-layout fixture of the eval tests

    root = make_task_data(tmp_path / "tasks")
    out = tmp_path / "rtn4"
    assert _ptq(run_dir, out, "--method", "rtn", "--bits", "4", "--eval-tasks", "piqa", "--eval-limit", "3",
                "--task-data", str(root)) == 0
    res = json.loads((out / "ptq.json").read_text())
    acc = res["zero_shot"]["tasks"]["piqa"]["metrics"]["acc"]
    assert res["zero_shot"]["tasks"]["piqa"]["n_samples"]["effective"] == 3
    # the unquantized row is scored on the same documents (it showed "-": no Δ to read; helper 64)
    base = res["baseline_zero_shot"]["tasks"]["piqa"]
    assert base["n_samples"]["effective"] == 3 and 0 <= base["metrics"]["acc"] <= 1
    printed = capsys.readouterr().out
    assert "zero-shot avg |" in printed and f"| {100 * acc:.2f} |" in printed
    assert f"| +0.00 | {100 * base['metrics']['acc']:.2f} |" in printed  # the unquantized row's cell


def test_answers_beyond_the_window_need_eval_max_length_and_keep_the_quantization(run_dir, tmp_path, capsys):
    """The run trained at --seq-len 32, so lm-eval's window was 32 tokens and a longer PIQA answer
    stopped the zero-shot scoring after the whole quantization: the message named `--max-length`,
    which `adahop ptq` did not have, and no ptq.json was written (the quantization had to be redone)."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'adahop[eval]')")
    from test_eval import make_long_piqa

    root = make_long_piqa(tmp_path / "tasks")
    flags = ("--method", "rtn", "--bits", "4", "--skip-baseline", "--eval-tasks", "piqa", "--eval-limit", "2",
             "--task-data", str(root))
    short = tmp_path / "short"
    assert _ptq(run_dir, short, *flags) == 2
    err = capsys.readouterr().err
    assert "--eval-max-length" in err and f"adahop eval {short} --tasks piqa --limit 2 --max-length N" in err
    kept = json.loads((short / "ptq.json").read_text())  # the quantization's results are kept
    assert "zero_shot" not in kept and "window of 32 tokens" in kept["zero_shot_error"]
    wide = tmp_path / "wide"
    assert _ptq(run_dir, wide, *flags, "--eval-max-length", "256") == 0
    res = json.loads((wide / "ptq.json").read_text())
    assert res["eval_max_length"] == 256 and res["zero_shot"]["tasks"]["piqa"]["n_samples"]["effective"] == 2
    assert 0 <= res["zero_shot"]["tasks"]["piqa"]["metrics"]["acc"] <= 1
    assert res["perplexity"] == kept["perplexity"]  # the same quantization: seeded, deterministic
    assert _ptq(run_dir, tmp_path / "bad", "--method", "rtn", "--bits", "4", "--eval-max-length", "0") == 2
    assert "--eval-max-length 0: must be >= 1" in capsys.readouterr().err


def test_unknown_eval_tasks_are_refused_before_the_model_loads(tmp_path, capsys):
    """They were found only after the quantization (hours for HARP on a large model), named as --tasks."""
    from adahop.cli import main

    assert main(["ptq", str(tmp_path / "no-model"), "--method", "rtn", "--bits", "4", "--calib-data", "x",
                 "--eval-tasks", "piqa,foo", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--eval-tasks: unknown task 'foo'" in err and "does not exist" not in err


def test_a_compare_folder_as_model_lists_its_runs(compare_folder, tmp_path, capsys):
    from adahop.cli import main

    assert main(["ptq", str(compare_folder), "--method", "rtn", "--bits", "4", "--calib-data", "x",
                 "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"adahop ptq: error: MODEL {compare_folder} holds 2 runs (a folder of runs, such as `adahop compare`'s") and \
        err.rstrip().endswith(f"pass one of them: {compare_folder / 'bf16'}, {compare_folder / 'mxfp4'}")


def test_options_the_method_or_the_missing_eval_tasks_would_ignore_are_refused(tmp_path, capsys):
    """`--harp-steps 200 --method rht-gptq`, `--damp 0.1 --method rtn` and `--eval-limit 5` without
    `--eval-tasks` ran and wrote a ptq.json as if the option had been applied."""
    from adahop.cli import main

    base = ["ptq", str(tmp_path / "no-model"), "--bits", "4", "--calib-data", "x", "--out", str(tmp_path / "q")]
    for extra, msg in (
            (("--method", "rht-gptq", "--harp-steps", "200"),
             "--harp-steps 200 is unused by --method rht-gptq; drop it, or pass --method harp-rtn or harp-gptq"),
            (("--method", "gptq", "--mixer", "qr"), "--mixer qr is unused by --method gptq"),
            (("--method", "rtn", "--damp", "0.1"),
             "--damp 0.1 is unused by --method rtn; drop it, or pass --method gptq, rht-gptq or harp-gptq"),
            (("--method", "harp-rtn", "--damp", "0.1"), "--damp 0.1 is unused by --method harp-rtn"),
            (("--method", "rtn", "--eval-limit", "5"),
             "--eval-limit is for the zero-shot tasks and no --eval-tasks is given (it would be unused)"),
            (("--method", "rtn", "--eval-tasks", "none", "--task-data", "d"), "--task-data is for the zero-shot tasks"),
            (("--method", "rtn", "--eval-max-length", "512"), "--eval-max-length is for the zero-shot tasks")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and "does not exist" not in err, err  # refused before the model loads
    # the methods that use them take them (then the missing model is what stops it)
    assert main([*base, "--method", "harp-gptq", "--harp-steps", "200", "--damp", "0.1", "--mixer", "qr"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_out_that_cannot_be_a_folder_is_refused_before_the_model_loads(tmp_path, capsys):
    """An --out that is a file, or lies under one, failed with a FileExistsError after the quantization."""
    from adahop.cli import main

    (tmp_path / "f").write_text("")
    for out, msg in ((tmp_path / "f", f"--out {tmp_path / 'f'} is a file, not a folder; pass a folder"),
                     (tmp_path / "f" / "q", f"--out {tmp_path / 'f' / 'q'}: {tmp_path / 'f'} is a file, not a folder")):
        assert main(["ptq", str(tmp_path / "no-model"), "--method", "rtn", "--bits", "4", "--calib-data", "x",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "does not exist" not in err, err


def test_splits_too_small_for_the_options_are_refused_before_the_quantization(run_dir, tmp_path, capsys):
    """--calib-tokens beyond the train split drew the same windows again (100M tokens of a 2.5M-token
    split: 40 epochs held in memory); a val split short of one batch failed only after the whole
    quantization, at the perplexity."""
    from adahop.data import Manifest

    data = Path(json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"])
    m = Manifest.load(data)
    seq = json.loads((run_dir / "config.json").read_text())["adahop"]["config"]["seq_len"]
    def n_windows(split):  # as TokenStream counts them: seq_len + 1 tokens, overlapping by one
        return sum((s.tokens - 1) // seq for s in m.split(split).shards if s.tokens > seq)

    windows = n_windows("train")
    most = windows // 4 * 4 * seq  # whole batches of 4 windows (_ptq's --batch-size)
    # one token past the whole batches the split holds: drawn as whole batches, that repeated up to 3 windows
    # (accepted while the request alone was under the split's tokens)
    assert _ptq(run_dir, tmp_path / "a", "--method", "rtn", "--bits", "4", "--calib-tokens", str(most + 1)) == 2
    err = capsys.readouterr().err
    n = windows // 4 + 1
    assert f"--calib-tokens {most + 1:,} takes {n} batches of 4 x {seq} tokens ({n * 4 * seq:,}), more than the train " \
           f"split of {data} holds in windows of --seq-len {seq} ({windows * seq:,}); pass --calib-tokens {most} or less" in err
    assert not (tmp_path / "a").exists()
    big = n_windows("val") + 1  # one window more than the val split holds
    assert _ptq(run_dir, tmp_path / "b", "--method", "rtn", "--bits", "4", "--skip-baseline", "--batch-size", str(big)) == 2
    cap = capsys.readouterr()
    assert f"adahop ptq: error: --calib-data {data}: the val split has" in cap.err and "fewer than one batch" in cap.err
    assert "world size" not in cap.err and "--val-fraction" not in cap.err  # training's options, not ptq's
    assert "block 1/" not in cap.out + cap.err and not (tmp_path / "b").exists()  # nothing was quantized
    # RTN reads no Hessian: without --calib-tokens it takes one batch, where the default of the Hessian methods
    # (131,072 tokens, more than this split holds) was refused (helper 38)
    from adahop.cli import main

    assert windows * seq < 131072
    assert main(["ptq", str(run_dir), "--calib-data", str(data), "--batch-size", "4", "--eval-batches", "2",
                 "--method", "rtn", "--bits", "4", "--skip-baseline", "--out", str(tmp_path / "c")]) == 0
    assert json.loads((tmp_path / "c" / "ptq.json").read_text())["calib_tokens"] == 4 * seq
    assert main(["ptq", str(run_dir), "--calib-data", str(data), "--batch-size", "4", "--eval-batches", "2",
                 "--method", "gptq", "--bits", "4", "--skip-baseline", "--out", str(tmp_path / "d")]) == 2
    assert "--calib-tokens 131,072 takes" in capsys.readouterr().err


def test_a_missing_calib_data_is_named_as_calib_data(run_dir, tmp_path, capsys):
    assert _ptq(run_dir, tmp_path / "q", "--method", "rtn", "--bits", "4", "--calib-data", str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err
    assert err.startswith("adahop ptq: error: --calib-data:") and "does not exist" in err


def test_foreign_calib_data_is_refused_naming_calib_data_throughout(run_dir, tmp_path, capsys):
    """The message began with --calib-data but told the user to pass `--data RUN_DATA`, an option ptq does not have."""
    from adahop.data import prepare

    (tmp_path / "t.txt").write_text("Some other text, tokenized another way. " * 300)
    prepare([str(tmp_path / "t.txt")], tmp_path / "other", tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    own = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    assert _ptq(run_dir, tmp_path / "q", "--method", "rtn", "--bits", "4", "--calib-data", str(tmp_path / "other")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"adahop ptq: error: --calib-data {tmp_path / 'other'} was tokenized with bpe, another tokenizer")
    assert f"pass the run's own data (--calib-data {own})" in err and "--data " not in err


def test_an_out_holding_the_model_or_another_one_is_refused_not_overwritten(run_dir, tmp_path, capsys):
    """`adahop ptq RUN --out RUN` replaced the run's own export and config.json (its training section
    gone) with the quantized model; any folder holding another model was overwritten the same way."""
    import argparse
    import shutil

    from adahop.ptq.cli import _check

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = {f: (run / f).read_bytes() for f in ("config.json", "model.safetensors")}
    assert _ptq(run, run, "--method", "rtn", "--bits", "4") == 2
    assert "--out " + str(run) + " is MODEL itself" in capsys.readouterr().err
    assert _ptq(run_dir, run, "--method", "rtn", "--bits", "4") == 2  # another folder holding a run
    assert "holds another model or run" in capsys.readouterr().err
    assert {f: (run / f).read_bytes() for f in before} == before and not (run / "ptq.json").exists()
    left = tmp_path / "left"  # what a failed attempt of ours leaves (no ptq.json yet) may be redone
    left.mkdir()
    (left / "config.json").write_text(json.dumps({"model_type": "llama", "adahop_ptq": {"method": "rtn"}}))
    _check(argparse.Namespace(model=str(run_dir), out=str(left), calib_tokens=1, batch_size=1, seq_len=None,
                              eval_batches=None, eval_limit=None, eval_max_length=None, harp_steps=1, passes=1, damp=0.01,
                              hbd_block=8, radix=8, max_radix=8, harp_lr=0.03, hbd_lambda=0.1, mixer="had_or_qr",
                              theta_format="fp16", method="harp-gptq", eval_tasks=None, task_data=None))


def test_a_model_without_linear_blocks_is_refused_with_one_prefix(run_dir, tmp_path, capsys):
    """calibrate.py's message began with "adahop ptq:" and main() adds "adahop ptq: error: ", so the line read
    `adahop ptq: error: adahop ptq: the model has ...`. GPT-2 (Conv1D, not nn.Linear) reaches it."""
    import shutil

    import transformers

    from adahop.cli import main

    gpt2 = tmp_path / "gpt2"
    run_cfg = json.loads((run_dir / "config.json").read_text())
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64, vocab_size=run_cfg["vocab_size"],
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(gpt2)
    for f in run_dir.glob("tokenizer*"):  # the run's tokenizer, so the data's tokenizer check passes
        shutil.copy(f, gpt2)
    assert main(["ptq", str(gpt2), "--method", "rtn", "--bits", "4", "--calib-data", run_cfg["adahop"]["data_dir"],
                 "--calib-tokens", "256", "--batch-size", "4", "--seq-len", "128", "--skip-baseline",
                 "--out", str(tmp_path / "q")]) == 2  # 128 > its 64 positions: the architecture is refused first
    err = capsys.readouterr().err
    assert err.count("adahop ptq:") == 1
    assert err.splitlines()[-1] == ("adahop ptq: error: the model has no list of decoder blocks built of nn.Linear layers "
                                    "(GPT-2's Conv1D layers are not nn.Linear); pass a Llama/Qwen-style causal LM")


def test_a_missing_lm_eval_is_named_once_and_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The eval harness's message began with "adahop eval", printed after "adahop ptq: error: "."""
    import sys

    from adahop.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError, as when not installed
    with pytest.raises(ImportError) as why:
        import lm_eval  # noqa: F401
    assert main(["ptq", str(tmp_path / "no-model"), "--method", "rtn", "--bits", "4", "--calib-data", "x",
                 "--eval-tasks", "piqa", "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err == (f"adahop ptq: error: zero-shot tasks are scored with lm-evaluation-harness, which "
                                       f"is not installed ({why.value}); pip install 'adahop[eval]' (or pip install "
                                       f"lm-eval) after torch\n")


def test_the_baseline_is_the_bf16_export_of_the_unquantized_model(run_dir, tmp_path):
    """The quantized folder is a BF16 deployment, so Δ ppl is against the unquantized model as its BF16
    export reloads, not against the FP32 masters the run folder loads with."""
    import transformers

    from adahop.eval.model import load_model
    from adahop.eval.perplexity import perplexity

    out = tmp_path / "rtn4"
    assert _ptq(run_dir, out, "--method", "rtn", "--bits", "4") == 0
    res = json.loads((out / "ptq.json").read_text())
    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    cpu = torch.device("cpu")

    def ppl(m):
        with torch.no_grad():
            return perplexity(m, data, seq_len=res["seq_len"], batch_size=4, max_batches=2, device=cpu, bf16=False)["perplexity"]

    fp32 = ppl(load_model(run_dir, device=cpu).model)
    # independently of ptq's code: export in BF16 as `adahop ptq` exports its model, reload with transformers
    load_model(run_dir, device=cpu).model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    bf16 = ppl(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval())
    # Tolerance 0: both sides hold the same FP32 values (BF16 widened) and run the same single-thread CPU FP32
    # forward over the same two batches, so the result is deterministic; the quantized folder's perplexity
    # matches transformers' to the last bit the same way (first test). A tolerance allowing a reordered FP32
    # reduction (~1e-6 relative of ppl) would sit only ~10x below the FP32-vs-BF16 gap (~1.1e-5 here).
    assert res["baseline"]["perplexity"] == bf16
    assert res["baseline_fp32"]["perplexity"] == fp32
    assert abs(fp32 / bf16 - 1) > 1e-6, (fp32, bf16)  # the two baselines differ: the test tells them apart


def test_an_rht_dimension_without_a_block_is_refused_before_the_baseline_and_calibration(run_dir, tmp_path, capsys,
                                                                                          monkeypatch):
    """A dimension the RHT cannot rotate was found only when its layer's turn came: after the baseline
    perplexity and the block's calibration; the message named neither the layer nor --method."""
    import shutil

    import transformers

    import adahop.ptq.calibrate as calibrate
    from adahop.cli import main

    run_cfg = json.loads((run_dir / "config.json").read_text())
    folder = tmp_path / "d140"
    cfg = transformers.LlamaConfig(vocab_size=run_cfg["vocab_size"], hidden_size=64, intermediate_size=140,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                   max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in run_dir.glob("tokenizer*"):
        shutil.copy(f, folder)
    import adahop.eval.perplexity as perplexity

    called = []
    monkeypatch.setattr(calibrate, "block_hessians", lambda *a, **k: called.append("calibration"))
    monkeypatch.setattr(perplexity, "perplexity", lambda *a, **k: called.append("baseline"))
    assert main(["ptq", str(folder), "--method", "rht-gptq", "--bits", "4", "--calib-data", run_cfg["adahop"]["data_dir"],
                 "--calib-tokens", "256", "--batch-size", "4", "--seq-len", "32", "--out", str(tmp_path / "q")]) == 2
    cap = capsys.readouterr()
    assert cap.err.splitlines()[-1] == (
        "adahop ptq: error: --method rht-gptq: layer model.layers.0.mlp.gate_proj (64->140): dimension 140 has no "
        "power-of-two block >= 8 for the RHT (its largest power-of-two factor is 4); use a harp-* method (HARP's "
        "mixed-radix rotation fits any dimension) or a model whose dims are multiples of 8")
    assert called == []  # neither the baseline nor the calibration ran


def test_an_hbd_block_covering_a_layers_input_is_refused_before_the_work(run_dir, tmp_path, capsys, monkeypatch):
    """`--hbd-block 1000` on llama-tiny (128 wide) made the off-block term 0, so --hbd-lambda did nothing, silently."""
    import adahop.ptq.calibrate as calibrate

    called = []
    monkeypatch.setattr(calibrate, "block_hessians", lambda *a, **k: called.append("calibration"))
    assert _ptq(run_dir, tmp_path / "q", "--method", "harp-rtn", "--bits", "4", "--skip-baseline", "--hbd-block", "1000") == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("adahop ptq: error: --hbd-block 1000 covers the whole input dimension of ") and \
        err.endswith("q_proj (128), where the off-block term of --hbd-lambda is 0; pass --hbd-block below 128, or "
                     "--hbd-lambda 0") and called == []


def test_an_out_inside_the_model_and_a_missing_model_are_refused(run_dir, tmp_path, capsys):
    """--out RUN/checkpoints wrote the quantized folder among the run's checkpoints; a missing MODEL read 'no config.json'."""
    assert _ptq(run_dir, run_dir / "checkpoints" / "q", "--method", "rtn", "--bits", "4") == 2
    assert f"--out {run_dir / 'checkpoints' / 'q'} is inside MODEL" in capsys.readouterr().err
    assert not (run_dir / "checkpoints" / "q").exists()
    from adahop.cli import main

    assert main(["ptq", str(tmp_path / "nope"), "--method", "rtn", "--bits", "4", "--calib-data", "default",
                 "--out", str(tmp_path / "q")]) == 2
    assert f"MODEL {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_text_calib_data_is_tokenized_with_the_models_tokenizer(run_dir, tmp_path, monkeypatch):
    """Raw text trained a new BPE on itself, which the tokenizer check then refused: it could never work."""
    from adahop.data import Manifest
    from adahop.eval.perplexity import prepared_data

    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 2000)
    run_cfg = json.loads((run_dir / "config.json").read_text())["adahop"]["config"]
    data = prepared_data(str(text), run_cfg, run_dir)
    assert Manifest.load(data).tokenizer.name.endswith(str((run_dir / "tokenizer.json").resolve()))
    assert _ptq(run_dir, tmp_path / "q", "--method", "rtn", "--bits", "4", "--calib-data", str(text),
                "--calib-tokens", "128", "--seq-len", "16", "--skip-baseline") == 0
    assert json.loads((tmp_path / "q" / "ptq.json").read_text())["calib_data"] == str(data)


def test_a_window_past_the_trained_length_is_warned_of(run_dir, tmp_path, capsys):
    """`adahop eval` warned of --seq-len beyond the run's; ptq calibrated and scored there silently (helper 25)."""
    run_cfg = json.loads((run_dir / "config.json").read_text())["adahop"]
    assert _ptq(run_dir, tmp_path / "q", "--method", "rtn", "--bits", "4", "--calib-data", run_cfg["data_dir"],
                "--calib-tokens", "256", "--seq-len", "64", "--skip-baseline") == 0
    assert ("warning: --seq-len 64 calibrates and scores positions beyond the 32 tokens the run trained at"
            in capsys.readouterr().err)
    meta = json.loads((tmp_path / "q" / "ptq.json").read_text())
    # which weights were quantized: an absolute path and the file (a checkpoint's, for an unfinished run)
    assert meta["source_model"] == str(run_dir.resolve()) and meta["source"]["weights"]


def test_the_runs_own_corpus_given_as_text_reuses_its_prepared_folder(run_dir, tmp_path, monkeypatch):
    """A run trained on a prepared folder (as `adahop compare`'s children are), evaluated with the text that
    folder was made from: the same tokens, so the run's folder is used, not prepared again under its tokenizer.json."""
    from adahop.eval.perplexity import prepared_data

    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path / "cache"))
    section = json.loads((run_dir / "config.json").read_text())["adahop"]
    kept = Path(section["data_dir"])
    assert prepared_data(str(kept.parent / "text.txt"), section["config"], run_dir) == kept
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("manifest.json"))
    other = tmp_path / "other.txt"
    other.write_text((kept.parent / "text.txt").read_text()[:-1000])  # other content: prepared anew
    assert prepared_data(str(other), section["config"], run_dir) != kept


def test_an_out_with_other_files_and_an_already_quantized_model_are_refused(run_dir, tmp_path, capsys):
    """A new-user probe overwrote the --calib-data folder (its tokenizer.json replaced) and a folder holding
    a model.safetensors without config.json; and quantized a quantized folder against itself as baseline."""
    import shutil

    data = Path(json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"])
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    assert _ptq(run_dir, copy, "--method", "rtn", "--bits", "4") == 2
    assert "already holds files" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"someone else's weights")
    assert _ptq(run_dir, stray, "--method", "rtn", "--bits", "4") == 2
    assert (stray / "model.safetensors").read_bytes() == b"someone else's weights"
    capsys.readouterr()

    q = tmp_path / "q4"
    assert _ptq(run_dir, q, "--method", "rtn", "--bits", "4", "--seq-len", "16") == 0
    capsys.readouterr()
    from adahop.cli import main

    assert main(["ptq", str(q), "--calib-data", str(data), "--method", "rtn", "--bits", "2", "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "already quantized by `adahop ptq` (rtn, 4 bits)" in err and str(run_dir) in err


def test_eval_of_a_ptq_folder_scores_at_the_window_ptq_printed(run_dir, tmp_path, capsys):
    from adahop.cli import main

    q = tmp_path / "q4w16"
    assert _ptq(run_dir, q, "--method", "rtn", "--bits", "4", "--seq-len", "16") == 0
    capsys.readouterr()
    res = json.loads((q / "ptq.json").read_text())
    assert res["seq_len"] == 16 and json.loads((q / "config.json").read_text())["adahop_ptq"]["seq_len"] == 16
    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    assert main(["eval", str(q), "--tasks", "none", "--data", data, "--eval-batches", "2", "--batch-size", "4",
                 "--out", str(tmp_path / "e.json")]) == 0
    got = json.loads((tmp_path / "e.json").read_text())
    ppl = got["perplexity"]["perplexity"] if isinstance(got.get("perplexity"), dict) else got["perplexity"]
    assert ppl == res["perplexity"]["perplexity"]  # the same window (16, not the model's 32), the same number
    assert "has no ptq.json" not in capsys.readouterr().err
    # a folder whose run stopped after the export (ptq.json is written last) is scored with a warning
    (q / "ptq.json").unlink()
    assert main(["eval", str(q), "--tasks", "none", "--data", data, "--eval-batches", "1", "--batch-size", "4"]) == 0
    assert f"warning: {q} has no ptq.json: the `adahop ptq` run that wrote it did not finish" in capsys.readouterr().err


def test_eval_of_a_ptq_folder_of_a_text_trained_run_scores_the_split_and_batches_ptq_printed(
        prepare_real_text, tmp_path, capsys):
    """A run trained on a text file with a 5% validation share, quantized with --calib-data that text and
    --batch-size 3: `adahop eval FOLDER --data TEXT` with no other option scored a corpus prepared anew at
    the default 1% share (mostly the run's training text) in batches of 8 (another last partial batch),
    silently; it now prepares the text as the source run did and batches as ptq did: the same number."""
    from adahop.cli import main
    from adahop.train import TrainConfig, train

    text = prepare_real_text(150_000).parent / "text.txt"
    run = tmp_path / "run"
    train(TrainConfig(model="llama-tiny", data=str(text), val_fraction=0.05, tokenizer="bpe", vocab_size=512,
                      out=str(run), seq_len=32, batch_size=4, steps=2, warmup_steps=1, eval_every=2, eval_batches=2,
                      ckpt_every=2, log_every=1, device="cpu", recipe="bf16"))
    q = tmp_path / "q"
    assert main(["ptq", str(run), "--calib-data", str(text), "--calib-tokens", "256", "--batch-size", "3",
                 "--method", "rtn", "--bits", "4", "--skip-baseline", "--out", str(q)]) == 0
    res = json.loads((q / "ptq.json").read_text())
    assert res["data_settings"]["val_fraction"] == 0.05 and res["batch_size"] == 3
    capsys.readouterr()
    assert main(["eval", str(q), "--tasks", "none", "--data", str(text), "--out", str(tmp_path / "e.json")]) == 0
    got = json.loads((tmp_path / "e.json").read_text())["perplexity"]
    assert (got["tokens"], got["batch_size"]) == (res["perplexity"]["tokens"], 3)
    assert got["perplexity"] == res["perplexity"]["perplexity"]


def test_a_model_with_nan_weights_is_refused_before_the_calibration(run_dir, tmp_path, capsys, monkeypatch):
    """A diverged checkpoint's NaN reached GPTQ's Cholesky and was reported as "raise --damp"."""
    import shutil

    from safetensors.torch import load_file, save_file

    import adahop.ptq.calibrate as calibrate

    run = tmp_path / "nan-run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("checkpoints"))
    sd = load_file(run / "model.safetensors")
    key = next(k for k in sorted(sd) if k.endswith("mlp.down_proj.weight"))
    sd[key][0, :3] = float("nan")
    save_file(sd, run / "model.safetensors", metadata={"format": "pt"})
    called = []
    monkeypatch.setattr(calibrate, "block_hessians", lambda *a, **k: called.append("calibration"))
    assert _ptq(run, tmp_path / "q", "--method", "gptq", "--bits", "4", "--skip-baseline") == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"{key} holds 3 NaN or inf values of" in err and "use an earlier, finite checkpoint" in err
    assert "--damp" not in err and called == []


def test_a_redo_interrupted_mid_write_leaves_no_packed_codes_of_the_earlier_attempt(run_dir, tmp_path, capsys, monkeypatch):
    """A probe: an attempt killed before ptq.json, redone into the same --out with another method and killed
    between the BF16 weights and the packed artifact, left config.json and model.safetensors of gptq W4 beside
    the first attempt's rtn W2 codes; load_packed_model ran those, silently. The redo now clears them first."""
    from adahop.ptq import export

    q = tmp_path / "q"
    assert _ptq(run_dir, q, "--method", "rtn", "--bits", "2") == 0
    (q / "ptq.json").unlink()  # the first attempt, killed after writing the folder
    capsys.readouterr()

    class Killed(Exception):
        pass

    def killed(*_a, **_k):
        raise Killed

    monkeypatch.setattr(export, "save_file", killed)  # the second attempt, killed before the packed artifact
    with pytest.raises(Killed):
        _ptq(run_dir, q, "--method", "gptq", "--bits", "4")
    assert json.loads((q / "config.json").read_text())["adahop_ptq"]["method"] == "gptq"
    assert not (q / export.PACKED_FILE).exists()


def test_eval_of_a_ptq_folders_train_split_keeps_evals_defaults(run_dir, tmp_path, capsys):
    """A probe: `adahop eval PTQ_FOLDER --data D --split train` scored only the --eval-batches the folder's val
    perplexity was scored on (2 batches here), where a run folder's train split is scored whole; --help says
    the folder's batches are for its val perplexity."""
    from adahop.cli import main

    q = tmp_path / "q"
    assert _ptq(run_dir, q, "--method", "rtn", "--bits", "4", "--skip-baseline") == 0
    data = json.loads((run_dir / "config.json").read_text())["adahop"]["data_dir"]
    out = tmp_path / "e.json"
    assert main(["eval", str(q), "--tasks", "none", "--data", data, "--split", "train", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["settings"]["batch_size"] == 8 and got["settings"]["eval_batches"] is None
    assert got["perplexity"]["batches"] > 2


def test_a_second_ptq_into_an_out_being_written_is_refused(run_dir, tmp_path, capsys):
    """A probe: two `adahop ptq` into one --out both printed "wrote DIR" and exited 0; the folder held the
    last one's model (and ptq.json), the first one's user told otherwise. The run now holds DIR/.lock."""
    from adahop.utils import lock_folder

    q = tmp_path / "q"
    held = lock_folder(q, "adahop ptq")  # another `adahop ptq` writing q
    try:
        assert _ptq(run_dir, q, "--method", "rtn", "--bits", "4", "--skip-baseline") == 2
        assert "another adahop ptq is writing" in capsys.readouterr().err
        assert not (q / "ptq.json").exists()
    finally:
        held.close()
    assert _ptq(run_dir, q, "--method", "rtn", "--bits", "4", "--skip-baseline") == 0  # its own .lock is no stray file
    assert (q / "ptq.json").exists()
