#!/usr/bin/env bash
# 1 vs 2 GPUs under torchrun + FSDP2: llama-350m, bf16 and adahop-lv2, same global batch and seed.
# Usage (on the 2-GPU machine, from anywhere):
#   bash experiments/scaling/run.sh DATA RUNS
# DATA: a folder made by `adahop data prepare`, or a source to prepare first (a corpus file or
#       'default'; tokenizer from $TOKENIZER) into $PREP_DIR. RUNS: where the run folders go (big
#       files are deleted after each run). When $OUT is set, the small outputs end up in
#       $OUT/scaling.tgz and the report in $OUT/report.md. See experiments/scaling/README.md.
# PLAIN="" skips the plain single-process run(s). CPU smoke test of the same logic:
#   DEVICE=cpu MODEL=llama-tiny STEPS=6 SEQ_LEN=64 BATCH=8 CALIB=2 bash experiments/scaling/run.sh default /tmp/sc_cpu
set -u
DATA=${1:?usage: run.sh DATA RUNS}
RUNS=${2:?usage: run.sh DATA RUNS}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }  # relative to the caller's folder
[ -e "$DATA" ] && DATA=$(abspath "$DATA")
RUNS=$(abspath "$RUNS")
[ -n "${PREP_DIR:-}" ] && PREP_DIR=$(abspath "$PREP_DIR")
cd "$REPO"                        # from here on, relative paths (TOKENIZER=tiktoken:...) are relative to the repo root
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }

# ---- settings (override any of them from the environment) ---------------------------------------
DEVICE=${DEVICE:-cuda}            # cuda: NCCL; cpu: gloo (smoke test)
MODEL=${MODEL:-llama-350m}
STEPS=${STEPS:-50}
SEQ_LEN=${SEQ_LEN:-1024}
BATCH=${BATCH:-32}                # global batch, sequences per optimizer step (all ranks)
CALIB=${CALIB:-10}                # adahop-lv2 calibration steps: BF16 GEMMs, the plan freezes after this step
LR=${LR:-1e-3}
WARMUP=${WARMUP:-10}
SEED=${SEED:-0}
EVAL_BATCHES=${EVAL_BATCHES:-2}   # one validation pass, at the last step
RECIPES=${RECIPES:-bf16 adahop-lv2}
GPUS=${GPUS:-1 2}                 # torchrun --nproc-per-node values (all --parallel fsdp)
PLAIN=${PLAIN-bf16}               # recipes that also run one plain single process (--parallel none):
                                  # the gap between two BF16 setups of one GPU, a yardstick for (1)
if [ "$DEVICE" = cpu ]; then BACKEND=${BACKEND:-auto}; else BACKEND=${BACKEND:-triton}; fi  # triton = the fast path, or fail
RUN_TIMEOUT=${RUN_TIMEOUT:-180}   # seconds per run
BUDGET_S=${BUDGET_S:-400}         # start no new run after this many seconds (one device command: 600 s at most)
PORT=${PORT0:-29611}
TOKENIZER=${TOKENIZER:-bpe}
PREP_DIR=${PREP_DIR:-/tmp/scaling_data}
FORCE=${FORCE:-0}                 # 1: redo runs that already have summary.json

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ADAHOP_CACHE=${ADAHOP_CACHE:-/tmp/adahop_cache}
SITE=""
if ! python3 -c "import zstandard" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # as experiments/gpu_call.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  SITE=/tmp/site:
fi
export PYTHONPATH=$SITE$REPO/src${PYTHONPATH:+:$PYTHONPATH}
ENTRY=(-m adahop)  # adahop train checks that all ranks froze one plan and records every rank's peak memory

mkdir -p "$RUNS/logs"
{
  date -u +"%F %T UTC"; echo "git $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) uncommitted paths"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null
  echo "DEVICE=$DEVICE MODEL=$MODEL STEPS=$STEPS SEQ_LEN=$SEQ_LEN BATCH=$BATCH CALIB=$CALIB LR=$LR WARMUP=$WARMUP SEED=$SEED BACKEND=$BACKEND RECIPES='$RECIPES' GPUS='$GPUS' PLAIN='$PLAIN'"
} 2>&1 | tee -a "$RUNS/logs/env.log"

# ---- data: prepared once, before any rank starts -----------------------------------------------
if [ -f "$DATA/manifest.json" ]; then
  DATA_DIR=$DATA
else
  DATA_DIR=$PREP_DIR
  if [ ! -f "$DATA_DIR/manifest.json" ]; then
    python3 -m adahop data prepare --source "$DATA" --tokenizer "$TOKENIZER" --out "$DATA_DIR" > "$RUNS/logs/prepare.log" 2>&1 \
      || { tail -5 "$RUNS/logs/prepare.log"; echo "data preparation failed"; exit 1; }
  fi
  tail -1 "$RUNS/logs/prepare.log" 2>/dev/null
fi
echo "data $DATA_DIR ready at $(el) s"

# ---- the small outputs: $OUT/scaling.tgz, refreshed after every run (a killed command keeps the finished runs)
pack() {
  [ -n "${OUT:-}" ] || return 0
  (cd "$RUNS" && find . -type f \( -name metrics.jsonl -o -name summary.json -o -name 'plan*.json' -o -name config.json \
     -o -name 'summary.rank*.json' -o -name '*.log' -o -name '*.cmd' -o -name '*.smi' -o -name '*.err' -o -name loss.png \
     -o -name times.tsv -o -name report.md \) -not -path '*/checkpoints/*' -print0 | tar czf "$OUT/scaling.tgz" --null -T -)
}

# ---- one run -----------------------------------------------------------------------------------
# run_one NAME NPROC RECIPE MODE   (MODE: fsdp = torchrun --nproc-per-node NPROC --parallel fsdp;
#                                   plain = one process, --parallel none)
run_one() {
  local name=$1 n=$2 recipe=$3 mode=$4 dir=$RUNS/$1 vis cmd rc t smi_pid=""
  if [ -f "$dir/summary.json" ] && [ "$FORCE" != 1 ]; then echo "$name: has summary.json, skipped"; return; fi
  if [ "$(el)" -gt "$BUDGET_S" ]; then echo "$name: not started (BUDGET_S=$BUDGET_S s spent)"; return; fi
  rm -rf "$dir"
  local flags=(--recipe "$recipe" --model "$MODEL" --data "$DATA_DIR" --out "$dir" --seq-len "$SEQ_LEN"
               --batch-size "$BATCH" --steps "$STEPS" --lr "$LR" --warmup-steps "$WARMUP" --seed "$SEED"
               --calib-steps "$CALIB" --eval-every "$STEPS" --eval-batches "$EVAL_BATCHES"
               --ckpt-every 0 --keep-ckpts 1 --log-every 1 --device "$DEVICE" --backend "$BACKEND")
  if [ "$mode" = plain ]; then
    cmd=(python3 "${ENTRY[@]}" train "${flags[@]}")
  else
    PORT=$((PORT + 1))
    cmd=(python3 -m torch.distributed.run --nproc-per-node "$n" --master-addr 127.0.0.1 --master-port "$PORT"
         "${ENTRY[@]}" train --parallel fsdp "${flags[@]}")
  fi
  vis=$(seq -s, 0 $((n - 1)))
  echo "CUDA_VISIBLE_DEVICES=$vis ${cmd[*]}" > "$RUNS/logs/$name.cmd"
  if [ "$DEVICE" != cpu ] && command -v nvidia-smi >/dev/null; then  # every GPU's memory.used, 5 times a second
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$RUNS/logs/$name.smi" 2>/dev/null &
    smi_pid=$!
  fi
  t=$(date +%s.%N)
  CUDA_VISIBLE_DEVICES=$vis timeout -k 15 "$RUN_TIMEOUT" "${cmd[@]}" > "$RUNS/logs/$name.log" 2>&1
  rc=$?
  t=$(python3 -c "import time; print(f'{time.time() - $t:.1f}')")
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null && wait "$smi_pid" 2>/dev/null
  rm -rf "$dir/checkpoints" "$dir"/*.safetensors "$dir"/.*.tmp  # keep only the small files
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$recipe" "$n" "$mode" "$rc" "$t" >> "$RUNS/times.tsv"
  echo "$name: exit $rc, $t s (at $(el) s)"
  if [ "$rc" != 0 ]; then grep -v -i warn "$RUNS/logs/$name.log" | tail -8; fi
  pack
}

# ---- the runs, most important first (BUDGET_S cuts the extras) --------------------------------
for recipe in $RECIPES; do
  for n in $GPUS; do run_one "$recipe-${n}gpu" "$n" "$recipe" fsdp; done
done
for recipe in $PLAIN; do run_one "$recipe-1gpu-plain" 1 "$recipe" plain; done

# ---- report and the small outputs ---------------------------------------------------------------
python3 experiments/scaling/report.py "$RUNS" > "$RUNS/report.md" 2> "$RUNS/logs/report.err"
cat "$RUNS/report.md"; tail -3 "$RUNS/logs/report.err"
if [ -n "${OUT:-}" ]; then
  cp "$RUNS/report.md" "$OUT/report.md"
  pack
  echo "wrote $OUT/scaling.tgz ($(du -k "$OUT/scaling.tgz" | cut -f1) KiB) and $OUT/report.md"
fi
echo "all done at $(el) s"
