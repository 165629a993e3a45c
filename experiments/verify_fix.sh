#!/usr/bin/env bash
# Device command: the kp=128 / Hadamard-64 quantizer fix checked on the H200, then tseng and averis-mxfp4 quality rows.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ADAHOP_CACHE=/tmp/adahop_cache
timeout 60 python3 scripts/diag_quantizer.py 2>&1 | grep -v -i warn | cut -c1-200
timeout 30 python3 scripts/grad_check.py --recipes tseng --tokens 16384 --n 128 --k 512 --dy-scale 1e-6 2>&1 | grep -v -i warn
echo "checks at $(el) s"
python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1
python3 experiments/quality/run.py --data /tmp/main --out /tmp/q --steps 120 --eval-every 40 --jobs tseng:0,averis-mxfp4:0 --budget-s $(( 150 - $(el) )) 2>&1 | grep -E "exit|budget"
tar czf $OUT/quality_c.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude='tokenizer*' -C /tmp q 2>/dev/null
echo "done at $(el) s"
