#!/usr/bin/env bash
# One device command of this session's GPU work (see docs/benchmarks.md and docs/results.md).
# Usage on the device machine: bash experiments/gpu_call.sh STAGE   (STAGE = 1 or 2)
set -u
STAGE=${1:-1}
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ADAHOP_CACHE=/tmp/adahop_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
el() { echo $(( $(date +%s) - T0 )); }
python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1
tail -1 $OUT/prepare.log; echo "data ready at $(el) s"
if [ "$STAGE" = 1 ]; then
  timeout 120 python3 scripts/gpu_smoke.py 2>&1 | tee $OUT/smoke.log | grep -v Warning
  echo "smoke done at $(el) s"
  timeout 120 python3 -m adahop bench linear --shapes llama3.1-8b --tokens 8192 --reps 20 --json $OUT/bench_linear.json 2>&1 | tail -22
  echo "bench linear done at $(el) s"
  python3 experiments/quality/run.py --data /tmp/main --out /tmp/q --steps 120 --eval-every 40 --budget-s $(( 470 - $(el) )) 2>&1 | grep -E "exit|budget" 
else
  timeout 120 python3 -m adahop analyze --model llama-125m --data /tmp/main --steps 300 --record-every 10 --seq-len 512 --batch-size 8 --gain-layers 12 --out /tmp/an125 > $OUT/analyze.log 2>&1; tail -3 $OUT/analyze.log
  tar czf $OUT/analysis.tgz -C /tmp an125 2>/dev/null
  echo "analyze done at $(el) s"
  python3 experiments/quality/run.py --data /tmp/main --out /tmp/q --steps 120 --eval-every 40 --recipes "${RECIPES:-tseng,nvfp4}" --second-seed "" --budget-s $(( 200 - $(el) )) 2>&1 | grep -E "exit|budget"
fi
tar czf $OUT/quality$STAGE.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude='tokenizer*' -C /tmp q 2>/dev/null
echo "stage $STAGE done at $(el) s"
