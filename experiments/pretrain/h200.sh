#!/usr/bin/env bash
# The GPU half of issue 4, for a machine with 2 H200s and no network (run from the repo root), one step per
# command so that each fits a 10-minute limit:
#   bash experiments/pretrain/h200.sh one     a short based-360m pretraining on one H200 (loss, tokens/s, MFU)
#   bash experiments/pretrain/h200.sh ddp     the same run with DDP on two H200s
#   bash experiments/pretrain/h200.sh fsdp    the same run with FSDP2 on two H200s
#   bash experiments/pretrain/h200.sh bench   based-1b vs a same-size Llama, bf16, 1024 + 1024 tokens, batches
# Results go to ${OUT:-runs/h200}: the run dirs (metrics.jsonl, summary.json) and each step's log.
#
# Data: the GPU box cannot download, so the runs read the embedded corpus (zoo/data/corpus,
# ~15k tokens with its 1024-token BPE). The head keeps the real 50304-entry vocabulary so that FLOPs, MFU
# and memory match a real run. With ~15k tokens the loss curve past the first step is memorisation, not
# language modelling: it checks that training works and measures speed. For a real curve, pass a corpus:
#   DATA="data.source=/path/to/text data.tokenizer=/path/to/tokenizer.json" bash experiments/pretrain/h200.sh
set -euo pipefail
OUT=${OUT:-runs/h200}
STEPS=${STEPS:-300}
DATA=${DATA:-"lm_data@data=embedded data.seq_len=2048 data.valid_frac=0.12 vocab_from_tokenizer=false model.vocab_size=50304"}
COMMON="--config-name pretrain_h200 $DATA train.steps=$STEPS train.eval_every=100 train.progress=false runs_root=$OUT"
mkdir -p "$OUT"

case "${1:-}" in
  one) python -m zoo.pretrain $COMMON run=one_h200 2>&1 | tee "$OUT/one_h200.log" ;;
  ddp | fsdp)
    torchrun --standalone --nproc_per_node=2 -m zoo.pretrain $COMMON run="$1"_2xh200 train.parallel="$1" 2>&1 \
      | tee "$OUT/$1_2xh200.log" ;;
  bench) python experiments/bench/generation.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/generation.log" ;;
  *) echo "usage: bash experiments/pretrain/h200.sh one|ddp|fsdp|bench" >&2; exit 2 ;;
esac
