#!/usr/bin/env bash
# One call on a lent GPU machine (minutes of lease): check the CUDA path, profile a step, run the
# GPU benchmark. Figures go to $OUT (the device tool brings that folder back); append them here with
#   python -m benchmarks.train_throughput --from-json <that folder>/gpu.json
#   python -m benchmarks.optimizer_step --from-json <that folder>/optim.json
#   python -m benchmarks.lora_finetune --from-json <that folder>/lora.json
# The machine has PyTorch but not this checkout installed, so the source tree goes on PYTHONPATH
# (in front of the caller's, which brings the wheels carried over). It has no network either:
# every case runs on local data (BENCH_ARGS=--dry-run sets the case list up without training,
# which is how the suite checks that on a CPU).
set -u
OUT=${OUT:-/tmp/fsdpkit-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-smoke,optim,lora,profile,bench}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

if [[ $SECTIONS == *smoke* ]]; then
  echo "== CUDA path: nccl under torchrun, bf16, compile, checkpoint save and exact resume"
  ck=$(mktemp -d)
  timeout 240 $PY -m torch.distributed.run --standalone --nproc-per-node=1 -m fsdpkit.train --preset tiny \
    --device cuda --max_steps 12 --checkpoint_dir "$ck" --checkpoint_freq 6 --compile 1 --logging_freq 6 \
    --progress off --run_dir "$ck/run" 2>&1 | tail -8
  timeout 120 $PY -m fsdpkit.train --preset tiny --device cuda --max_steps 14 --checkpoint_dir "$ck" \
    --resume_from_checkpoint auto --logging_freq 2 --progress off --run_dir "$ck/run2" 2>&1 | tail -4
fi
if [[ $SECTIONS == *optim* ]]; then
  echo "== optimizer step: gradient norm, clipping and AdamW over llama3_2_1b's fp32 weights"
  timeout 180 $PY -m benchmarks.optimizer_step --preset llama3_2_1b --device cuda --no-results-md \
    --out "$OUT/optim.json" 2>&1 | tail -8
fi
if [[ $SECTIONS == *lora* ]]; then
  echo "== LoRA against full fine-tuning: llama3_2_1b (8 layers), seq 2048 x 4, bf16"
  timeout 240 $PY -m benchmarks.lora_finetune --preset llama3_2_1b --layers 8 --seq-len 2048 --batch 4 \
    --device cuda --no-results-md --out "$OUT/lora.json" 2>&1 | grep "tokens/s"
fi
if [[ $SECTIONS == *profile* ]]; then
  echo "== profile: llama3_2_1b, seq 2048 x 4, bf16, compile ${PROFILE_COMPILE:-0}"
  timeout 180 $PY -m benchmarks.profile_step --top 30 --skip 3 -- --preset llama3_2_1b --device cuda \
    --dataset embedded --tokenizer bytes --seq_len 2048 --train_batch_size 4 --max_steps 7 --mixed_precision bf16 --compile ${PROFILE_COMPILE:-0} --run_dir /tmp/prof \
    2>&1 | grep -v "^Batch\|^fsdpkit" | tee "$OUT/profile.txt" | tail -40
fi
if [[ $SECTIONS == *bench* ]]; then
  echo "== benchmark (gpu section)"
  $PY -m benchmarks.train_throughput --only gpu --case-timeout ${CASE_TIMEOUT:-200} --no-results-md \
    ${SELECT:+--select "$SELECT"} ${BENCH_ARGS:-} --out "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log" | grep --line-buffered -v "^  "
fi
