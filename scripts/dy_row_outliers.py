"""Which tokens make ∇Y Row-wise? A diagnosis of the census's Row-wise output gradients (issue 19).

    PYTHONPATH=src python scripts/dy_row_outliers.py --model llama-60m --data /tmp/main60 --seq-len 512 \
        --batch-size 8 --lr 2e-3 --warmup-steps 20 --min-lr-ratio 0.1 --weight-decay 0.1 --grad-clip 1.0 \
        --steps 30 --out /tmp/dyrows

Trains as `adahop analyze` does (BF16 recipe, unconverted; FP32 on the CPU), and at the last step
keeps ∇Y of every linear layer with the batch's token ids. For each layer it applies the official
ratio test (:func:`adahop.patterns.classify`) to ∇Y as it is, and again with candidate rows removed:
the first position of every sequence, the end-of-text tokens (document separators) and the rows just
after them, and, as a control, as many random rows as the first group. A Row-wise ∇Y that turns None
when one group is removed is carried by that group. Writes ``dy_rows.md`` (the table) and prints it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from adahop.analysis.cli import bf16_step
from adahop.analysis.options import add_arguments
from adahop.analysis.recorder import linear_names
from adahop.patterns import classify, pattern_stats
from adahop.train.config import TrainConfig, config_from
from adahop.train.setup import build_optimizer, lr_at, make_model, make_streams, resolve_data, resolve_device


def _test(dy: torch.Tensor, keep: torch.Tensor) -> str:
    cr, cc = pattern_stats(dy[keep])
    return f"{classify(cr, cc).name[0]} ({cr:.1f}/{cc:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from(args, TrainConfig, recipe="bf16", out=str(out), calib_steps=args.calib_steps)
    if cfg.grad_accum != 1:
        raise SystemExit("dy_row_outliers.py: --grad-accum must be 1 (the hooks keep ∇Y of one backward, matched to the batch's ids)")
    device = resolve_device(cfg.device)
    train_s, _ = make_streams(cfg, resolve_data(cfg))
    model = make_model(cfg, train_s.manifest, device)
    opt = build_optimizer(cfg, model)
    eos = train_s.manifest.tokenizer.eos_id
    names = linear_names(model)
    grads: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(mod, gin, gout):
            grads[name] = gout[0].detach().float().reshape(-1, gout[0].shape[-1]).clone()
        return fn

    mods = dict(model.named_modules())
    ids = None
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        last = step == cfg.steps - 1
        handles = [mods[n].register_full_backward_hook(hook(n)) for n in names] if last else []
        x, y = train_s.batch(step)
        loss = bf16_step(model, opt, cfg, x, y, device, contextlib.nullcontext())  # FP32 on the CPU, as analyze
        for h in handles:
            h.remove()
        if last:
            ids = x.reshape(-1)
        print(f"step {step + 1}: loss {loss:.4f}", flush=True)

    tokens = ids.numel()
    pos = torch.arange(tokens) % cfg.seq_len
    first = pos == 0
    is_eos = ids == eos
    after_eos = torch.zeros_like(is_eos)
    after_eos[1:] = is_eos[:-1] & (pos[1:] != 0)
    rand = torch.zeros(tokens, dtype=torch.bool)
    rand[torch.randperm(tokens, generator=torch.Generator().manual_seed(0))[: int(first.sum())]] = True
    groups = {"first position": first, "EOS": is_eos, "after EOS": after_eos, f"{int(first.sum())} random rows": rand}
    seqs = tokens // cfg.seq_len
    perm = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    lines = [f"∇Y at step {cfg.steps} ({args.model}, {tokens} tokens; {int(is_eos.sum())} EOS tokens, id {eos}). "
             "Pattern (cv_row/cv_col) of the official ratio test, with each group of rows removed; then the "
             "share of the largest 1% of row RMS that each group holds.", "",
             "Then ∇Y with each row divided by the mean row RMS at its position (over the batch's sequences), which "
             "removes any profile along the position; as a control, each row divided by the mean RMS of a random group "
             "of as many rows (a random permutation cut into groups of that size), which removes as much spread "
             "without regard to position; the rank correlation of row RMS with position; and the mean RMS of the first "
             "four positions over the median row RMS.", "",
             "| layer | as is | − first position | − EOS | − after EOS | − random | top-1% rows: first / EOS / after EOS "
             "| position trend removed | control: random groups removed | corr(RMS, position) | RMS at positions 0-3 / median |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    everything = torch.ones(tokens, dtype=torch.bool)
    rank = lambda v: v.argsort().argsort().float()  # noqa: E731
    pos_rank = rank(pos.float())
    for n in names:
        dy = grads[n]
        rms = dy.square().mean(1).sqrt()
        top = rms >= torch.quantile(rms, 0.99)
        cells = [_test(dy, everything)] + [_test(dy, ~m) for m in groups.values()]
        shares = [f"{float((top & m).sum()) / float(top.sum()):.0%}" for m in (first, is_eos, after_eos)]
        by_pos = rms.reshape(seqs, cfg.seq_len).mean(0).clamp_min(1e-30)  # mean row RMS at each position
        detrended = _test(dy / by_pos.repeat(seqs)[:, None], everything)
        by_group = torch.empty(tokens)  # the control: the same kind of division, random groups of `seqs` rows
        by_group[perm] = rms[perm].reshape(-1, seqs).mean(1).clamp_min(1e-30).repeat_interleave(seqs)
        control = _test(dy / by_group[:, None], everything)
        head = float(by_pos[:4].mean() / rms.median())
        corr = float(torch.corrcoef(torch.stack([rank(rms), pos_rank]))[0, 1])
        short = n.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "")
        lines.append(f"| {short} | " + " | ".join(cells) + " | " + " / ".join(shares) + f" | {detrended} | {control} | {corr:+.2f} | {head:.1f} |")
        summary.append({"layer": n, "tests": cells, "top1pct_shares": shares, "detrended": detrended, "control": control,
                        "corr_rms_position": corr, "head_over_median": head})
    text = "\n".join(lines) + "\n"
    (out / "dy_rows.md").write_text(text)
    (out / "dy_rows.json").write_text(json.dumps(summary, indent=1))
    print(text)


if __name__ == "__main__":
    main()
