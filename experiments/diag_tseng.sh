#!/usr/bin/env bash
# Device command that diagnosed tseng's non-training GPU run (docs/results.md): per-parameter gradient
# norms of one llama-60m step, fast path vs reference, for tseng and quartet; then a short tseng run.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
for r in tseng quartet; do timeout 60 python3 scripts/diag_grads.py --recipe $r 2>&1 | grep -v -i warn; done; echo "diag at $(el) s"
for nk in "128 512" "512 1344"; do set -- $nk
  timeout 30 python3 scripts/grad_check.py --recipes tseng --tokens 16384 --n $1 --k $2 --dy-scale 1e-6 2>&1 | grep -v -i warn | sed "s/^/n=$1 k=$2 /"
done; echo "grad checks at $(el) s"
timeout 80 python3 -m adahop train --recipe tseng --model llama-60m --data .carry/small --steps 12 --seq-len 512 --batch-size 32 \
  --lr 2e-3 --warmup-steps 20 --log-every 1 --eval-every 0 --ckpt-every 0 --out /tmp/ts > $OUT/ts.log 2>&1
python3 -c "import json; [print(r['step'], round(r['loss'],3), '%.3g' % r['grad_norm']) for r in map(json.loads, open('/tmp/ts/metrics.jsonl')) if 'loss' in r and r['step'] % 3 == 0]"
echo "done at $(el) s"
