#!/usr/bin/env bash
# The GPU fast paths on one CUDA GPU, in under 10 minutes (each step has its own time limit):
#   1. every fast path against its torch reference, outputs and gradients (attnzoo-bench gpu_check:
#      fla linear_attention / deltanet / gated_deltanet, flex_attention sliding window / sinks / causal,
#      SDPA flash for gqa in bf16), tolerances printed per case;
#   2. the mixer benchmark in bf16 with model.impl=torch, then model.impl=auto (the speed-up of the kernels);
#   3. the training-step benchmark (bf16-mixed, model.impl=auto) for gqa and gated_deltanet;
#   4. FSDP2: a run on 1 GPU vs trainer=fsdp on 1 GPU (fp32: the same losses), and the per-rank bytes per parameter
#      with bf16 gathers (attnzoo-bench fsdp --device cuda); docs/distributed.md.
#   5. decode: the compiled static-cache step under CUDA graphs (mode=reduce-overhead) gives the eager step's greedy
#      tokens, then attnzoo-bench decode (tokens/s vs the memory roofline, vs transformers); docs/inference.md.
# Needs a CUDA build of torch and the gpu extra (fla-core + triton): pip install -e '.[gpu]'. docs/gpu.md.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: gpu_check_results). JSON + markdown land in OUT_DIR.
# Exit status: 0 all ok; 1 a fast path disagrees with its reference; 2 no GPU; 3 a benchmark failed / timed out.
# GPU_CHECK_DEVICE=cpu rehearses the script on a CPU (tiny sizes, torch paths, fla cases skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_results}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
    echo "gpu_check: no CUDA device is visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing)); this script needs one GPU" >&2
    exit 2
  }
  QUICK=(); TRAINER=(trainer=gpu); FSDP=(trainer=fsdp trainer.devices=1 trainer.fsdp.param_dtype=null)
else
  QUICK=(--quick); TRAINER=(); FSDP=(trainer=fsdp_cpu trainer.devices=1 trainer.fsdp.param_dtype=null)
fi
mkdir -p "$OUT"
BENCH=("$PY" -m attnzoo.bench)
MIXERS=(gqa sliding_window linear_attention deltanet gated_deltanet)
check=0
bench=0
step() { echo; echo "== [$(printf '%3d' "$SECONDS") s] $*"; }
run() {  # run LIMIT_SECONDS CMD...: a benchmark step; a failure or timeout is reported, then the next step runs
  local limit=$1; shift
  timeout "$limit" "$@" || { echo "gpu_check: step failed or exceeded ${limit} s (status $?): $*" >&2; bench=3; }
}

step "1/6 fast paths vs torch references (limit 200 s)"
timeout 200 "${BENCH[@]}" --out "$OUT" gpu_check --device "$DEVICE" || check=$?

step "2/6 mixers, bf16 autocast, model.impl=torch (limit 75 s)"
run 75 "${BENCH[@]}" --out "$OUT/mixers-torch" mixers --precision bf16-mixed --impl torch --mixers "${MIXERS[@]}" \
  --d-model 1024 --n-heads 16 --n-kv-heads 4 --window 512 --batch 4 --lengths 2048 8192 "${QUICK[@]}"

step "3/6 mixers, bf16 autocast, model.impl=auto (limit 120 s; first calls compile the Triton kernels)"
run 120 "${BENCH[@]}" --out "$OUT/mixers-auto" mixers --precision bf16-mixed --impl auto --mixers "${MIXERS[@]}" \
  --d-model 1024 --n-heads 16 --n-kv-heads 4 --window 512 --batch 4 --lengths 2048 8192 "${QUICK[@]}"

step "4/6 training step, bf16-mixed, model.impl=auto (limit 80 s each)"
for m in gqa gated_deltanet; do
  run 80 "${BENCH[@]}" --out "$OUT/train-$m" train --mixer "$m" --precisions bf16-mixed --steps 5 "${QUICK[@]}" \
    --overrides "${TRAINER[@]}" model.impl=auto data.tokenizer=char data.max_chars=400000
done

step "5/6 FSDP2 on 1 device vs plain (limit 90 s each), bytes per parameter (limit 90 s)"
FSDP_RUN=(-m attnzoo.cli.train debug=smoke data.tokenizer=char trainer.max_steps=8 trainer.log_every_n_steps=1
          trainer.precision=32-true perf.measure_decode=false sample.max_new_tokens=0)
run 90 "$PY" "${FSDP_RUN[@]}" "${TRAINER[@]}" hydra.run.dir="$OUT/fsdp/plain"
run 90 "$PY" "${FSDP_RUN[@]}" "${FSDP[@]}" hydra.run.dir="$OUT/fsdp/fsdp"
"$PY" - "$OUT/fsdp" <<'PYEOF' || bench=3
import csv, sys
def losses(d):
    return [float(r["train/loss"]) for r in csv.DictReader(open(f"{sys.argv[1]}/{d}/csv/metrics.csv")) if r.get("train/loss")]
a, b = losses("plain"), losses("fsdp")
gap = max(abs(x - y) for x, y in zip(a, b))
print(f"fsdp vs plain on 1 device: {len(a)} steps, max |train/loss difference| {gap:.3g}")
sys.exit(0 if len(a) == len(b) == 8 and gap <= 1e-5 else 1)
PYEOF
if [ "$DEVICE" = cuda ]; then
  run 90 "${BENCH[@]}" --out "$OUT/fsdp-memory" fsdp --ranks 1 --device cuda --param-dtype bf16 --d-model 1024 --n-layers 8
fi

step "6/6 decode: CUDA graphs == eager (limit 120 s), the decode benchmark (limit 240 s)"
timeout 120 "$PY" - "$DEVICE" <<'PYEOF' || check=1
import sys, torch
from attnzoo.models.decoding import Decoder
from attnzoo.models.decoder import DecoderLM
dev = sys.argv[1]
torch.manual_seed(0)
cfg = {"d_model": 256, "n_layers": 3, "n_heads": 8, "n_kv_heads": 2, "pattern": ["a", "w", "g"], "max_seq_len": 512,
       "mixers": {"a": {"name": "gqa"}, "w": {"name": "sliding_window", "window": 64, "sink_tokens": 4},
                  "g": {"name": "gated_deltanet"}}}
m = DecoderLM(cfg, vocab_size=512).to(dev).eval()
prompts = [list(range(1, 40)), [7, 8, 9], list(range(100, 300))]
fast, slow = Decoder(m, 3, 400), Decoder(m, 3, 400, compile=False)
a, b = fast.generate(prompts, 64), slow.generate(prompts, 64)
agree = [x == y for x, y in zip(a.tokens, b.tokens)]
print(f"decode ({fast.path}) vs eager static cache: greedy tokens identical per row {agree}")
sys.exit(0 if all(agree) else 1)
PYEOF
if [ "$DEVICE" = cuda ]; then
  run 240 "${BENCH[@]}" --out "$OUT/decode" decode --device cuda --contexts 2048 8192 32768 --batches 1 8 --d-model 1024 \
    --n-layers 8 --n-heads 16 --n-kv-heads 4 --d-ff 2816 --vocab 32000
fi

echo
echo "== gpu_check summary ($SECONDS s; results in $OUT)"
grep -E '^\| (fla|flex|sdpa)' "$OUT/gpu_check.md" 2>/dev/null | awk -F'|' '{printf "  %-34s %-6s %-5s %s\n", $2, $3, $4, $13}'
if [ "$check" -ne 0 ]; then
  echo "FAILED: a fast path disagrees with its reference or did not run (status $check): see $OUT/gpu_check.md"
  exit 1
fi
if [ "$bench" -ne 0 ]; then
  echo "fast paths ok; a benchmark step failed or timed out (see above)"
  exit 3
fi
echo "ok: every fast path matches its reference; benchmarks in $OUT/mixers-*/ and $OUT/train-*/"
