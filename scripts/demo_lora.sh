#!/usr/bin/env bash
# A LoRA you can see learn: teach the trained demo model a colour word it never saw ("orange"), then judge
# the held-out orange prompts (shape/direction pairs never trained in orange) with the LoRA and without it,
# and the demo's own held-out prompts with it (what the LoRA costs them). About 1-2 minutes on a 2-core CPU.
# Needs the demo's run (bash scripts/demo.sh; DEMO_RUN to use another); trains it first if it is missing.
# Extra arguments are recipe overrides for the LoRA run, e.g. `bash scripts/demo_lora.sh train.max_steps=100`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BASE=${DEMO_RUN:-runs/demo}
RUN=${DEMO_LORA_RUN:-runs/demo_lora}
if [ ! -f "$BASE/checkpoints/latest" ]; then
  echo "[demo_lora] no trained demo in $BASE: training it first (bash scripts/demo.sh trains it and more)"
  "$PY" train.py --config configs/demo.yaml "run.output_dir=$BASE"
fi
# The LoRA: rank 8 on every Linear of the blocks, over the frozen demo; half of its clips orange (the
# colour list repeats it), the rest the demo's colours, so "orange" is learnt as one more colour word.
# 200 steps at lr 2e-3, the last 40% cooled down, learn it as 400 at a constant 1e-3 did (orange read 100% of
# the time; docs/benchmarks_history.md, "LoRA"). The schedule is pinned here, not taken from the demo's recipe.
LORA=(--config configs/demo.yaml "model.pretrained=$BASE" "run.output_dir=$RUN" lora.rank=8
  "data.synthetic_colors=[orange,orange,orange,orange,orange,orange,red,green,blue,yellow,magenta,cyan]"
  train.lr=2.0e-3 train.lr_decay=linear train.decay_fraction=0.4 train.max_steps=200 train.warmup_steps=20
  train.checkpoint_every=200 train.ema_decay=0.95
  "sample.prompts=[an orange circle moving right]")
"$PY" train.py "${LORA[@]}" "$@"
"$PY" scripts/eval_demo.py --config configs/demo.yaml "run.output_dir=$BASE" --colors orange \
  --output "$RUN/eval_base_orange.json" --sheet "$RUN/contact_sheet_base_orange.png"
"$PY" scripts/eval_demo.py "${LORA[@]}" "$@" --colors orange \
  --output "$RUN/eval_lora_orange.json" --sheet "$RUN/contact_sheet_lora_orange.png"
"$PY" scripts/eval_demo.py "${LORA[@]}" "$@" --seeds 2 --output "$RUN/eval_lora_demo.json" \
  --sheet "$RUN/contact_sheet_lora_demo.png"
echo "[demo_lora] orange, without the LoRA: $RUN/eval_base_orange.json; with it: $RUN/eval_lora_orange.json;" \
  "the demo's own held-out prompts with it: $RUN/eval_lora_demo.json; contact sheets beside them"
