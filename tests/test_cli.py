"""The command line as a surface: its options are frozen (a change to them is deliberate), and
`--help` / option errors answer without importing torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

SURFACE = Path(__file__).with_name("cli_surface.json")
UPDATE = f"python {Path(__file__).relative_to(Path(__file__).parents[1])}"  # rewrites cli_surface.json


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})


def cli_surface() -> dict[str, list[dict]]:
    """Every (sub)command of ``adahop`` → its options: flags, default, type, choices, nargs, required."""
    from adahop.cli import build_parser

    out: dict[str, list[dict]] = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        subs = _subparsers(p)
        opts = []
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            opts.append({"flags": list(a.option_strings) or [a.dest], "default": a.default,
                         "type": getattr(a.type, "__name__", None), "choices": list(a.choices) if a.choices else None,
                         "nargs": a.nargs, "required": a.required, "action": type(a).__name__})
        if opts or not subs:
            out[name] = opts
        for sub_name, sub in subs.items():
            walk(sub, f"{name} {sub_name}")

    walk(build_parser(), "adahop")
    return json.loads(json.dumps(out, default=str))  # as the JSON file holds it


def test_cli_surface_is_frozen():
    """A new, removed or changed option must come with its README entry: regenerate the listing
    deliberately (the command is in the message) and commit it with the change."""
    frozen = json.loads(SURFACE.read_text())
    now = cli_surface()
    lines = []
    for cmd in sorted(set(frozen) | set(now)):
        a = {o["flags"][0]: o for o in frozen.get(cmd, [])}
        b = {o["flags"][0]: o for o in now.get(cmd, [])}
        lines += [f"{cmd}: {f} removed" for f in a.keys() - b.keys()]
        lines += [f"{cmd}: {f} added" for f in b.keys() - a.keys()]
        lines += [f"{cmd}: {f} changed: {a[f]} -> {b[f]}" for f in a.keys() & b.keys() if a[f] != b[f]]
    assert not lines, ("the adahop CLI surface changed:\n  " + "\n  ".join(sorted(lines)) +
                       f"\nIf that is deliberate, run `{UPDATE}` to rewrite tests/{SURFACE.name}, commit it, and document "
                       f"the options in README.md.")


def test_help_and_option_errors_import_no_torch():
    """`--help` and a refused value answer before torch, transformers or the kernels are imported
    (they took ~4.5 s on every command); and importing what a run needs logs nothing."""
    code = """
import sys
from adahop.cli import main
heavy = ("torch", "transformers", "triton", "adahop.kernels", "adahop.nn")
for argv in (["train", "--help"], ["compare", "--help"], ["analyze", "--help"], ["bench", "model", "--help"], ["--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
assert main(["train", "--lr", "inf"]) == 2
assert main(["compare", "--grad-clip", "nan"]) == 2
print("HEAVY", [m for m in heavy if m in sys.modules])
from adahop.cli import _quiet_imports
_quiet_imports()
import adahop.train.loop
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout, r.stdout[-2000:]
    assert "--lr: must be a finite number, got inf" in r.stderr and "--grad-clip: must be a finite number" in r.stderr
    noise = [ln for ln in r.stderr.splitlines() if not ln.startswith("adahop ")]  # the two refusals are ours
    assert noise == [], noise  # no third-party warning (torchao, torch's pytree) on the way to a run


@pytest.mark.parametrize("argv,error", [
    (["eval", "runs/a", "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16' (choose from "),
    (["ptq", "runs/a", "--method", "rtn", "--bits", "5", "--calib-data", "d", "--out", "q"],
     "argument --bits: invalid choice: 5 (choose from "),
    (["train", "--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["data", "prepare", "--out", "d"], "the following arguments are required: --source"),
    (["data"], "the following arguments are required: {prepare}"),  # was 'data_cmd', argparse's dest
    (["train", "--stesp", "20"], "unrecognized arguments: --stesp 20"),  # named `adahop: error`, `adahop --help`
    (["data", "prepare", "--source", "s", "--out", "d", "--lowercase"], "unrecognized arguments: --lowercase"),
])
def test_option_errors_are_one_line_and_a_pointer_to_help(argv, error, capsys):
    """An invalid choice printed the whole usage first (40 lines for `adahop train`), the error last."""
    from adahop.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    cmd = "adahop " + " ".join(argv[:2] if argv[0] == "data" else argv[:1])
    first, *rest = capsys.readouterr().err.splitlines()
    assert first.startswith(f"{cmd}: error: {error}") and rest == [f"see `{cmd} --help`"]  # (choices quoted by Python)


def test_eval_loads_a_model_without_third_party_import_noise(tmp_path):
    """`adahop eval` printed torchao's "Failed to load ..._C_mxfp8...so" and torch's pytree deprecation
    of torchao's enums on loading any model (train, compare, ptq, analyze and bench muted them already)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=300)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")  # no tokenizer: eval stops right after loading
    code = f"import sys; from adahop.cli import main; sys.exit(main(['eval', {str(tmp_path / 'm')!r}, '--tasks', 'none', " \
           "'--data', 'x', '--device', 'cpu']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no tokenizer could be loaded" in r.stderr, r.stderr[-2000:]  # the model did load
    noise = [ln for ln in r.stderr.splitlines() if "torchao" in ln or "_pytree" in ln]
    assert noise == [], noise


def test_compare_help_shows_its_own_out_default():
    from adahop.cli import build_parser

    cmp = _subparsers(build_parser())["compare"]
    assert cmp.parse_args([]).out == "runs/compare"
    text = " ".join(cmp.format_help().split())
    assert "(default: runs/compare)" in text and "runs/default" not in text


def test_analyze_rule_choices_are_the_detector_rules():
    """`adahop analyze --rule` spells the rules out (its options module imports no torch): they
    must be the detector's own."""
    from adahop.analysis.options import DETECTOR_RULES as cli_rules
    from adahop.recipes.spec import DETECTOR_RULES

    assert cli_rules == DETECTOR_RULES


if __name__ == "__main__":  # regenerate the frozen listing after a deliberate change of the CLI
    body = ",\n".join(f"  {json.dumps(cmd)}: [\n" + ",\n".join(f"    {json.dumps(o)}" for o in opts) + "\n  ]"
                      for cmd, opts in cli_surface().items())  # one option a line: small diffs, easy merges
    SURFACE.write_text("{\n" + body + "\n}\n")
    print(f"wrote {SURFACE}")


def test_adahops_own_warnings_print_as_one_line(monkeypatch):
    """A library warning under a command showed its file, line and source line (`controller = Controller(...)`),
    where the commands print `warning: ...` lines themselves (helper 25)."""
    import warnings

    from adahop import cli

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    cli._one_line_warnings()
    cli._one_line_warnings()  # once per process, not a wrapper per call
    assert warnings.formatwarning("adahop: the plan was frozen", UserWarning, "linear.py", 147, "x = 1") == \
        "warning: the plan was frozen\n"
    other = warnings.formatwarning("deprecated", FutureWarning, "lib.py", 3, "y = 2")
    assert "lib.py:3" in other and "FutureWarning" in other


def test_analyze_synthetic_refuses_the_model_flags_it_would_not_use(tmp_path, capsys):
    """--synthetic runs no model: --run, --model, --steps were taken and silently unused (helper 27)."""
    from adahop.cli import main

    for flags in (["--steps", "10"], ["--model", "llama-20m"], ["--run", str(tmp_path)]):
        assert main(["analyze", "--synthetic", *flags, "--out", str(tmp_path / "o")]) == 2
        assert f"{flags[0]} is for the model analysis and --synthetic runs none" in capsys.readouterr().err


def test_analyze_under_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    from adahop.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["analyze", "--synthetic", "--out", str(tmp_path / "o")]) == 2
    assert "adahop analyze runs in one process, and torchrun started 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_analyze_run_names_a_sharded_checkpoint(tmp_path, capsys):
    """A --parallel ddp/fsdp run's checkpoints are torch.distributed.checkpoint shards: analyze said only that
    there was no model.safetensors (helper 27)."""
    import json

    from adahop.cli import main

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000003").mkdir(parents=True)
    (run / "checkpoints" / "step_0000003" / "__0_0.distcp").write_bytes(b"")
    (run / "config.json").write_text(json.dumps({"adahop": {"config": {"model": "llama-tiny"}, "data_dir": "x"}}))
    assert main(["analyze", "--run", str(run), "--out", str(tmp_path / "o")]) == 2
    assert "is a sharded one of --parallel ddp/fsdp" in capsys.readouterr().err
