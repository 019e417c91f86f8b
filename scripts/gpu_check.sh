#!/usr/bin/env bash
# The GPU fast paths on one CUDA GPU, bounded for a short rental: at most 10 minutes in all on a fresh machine
# (start-up, compiles and autotunes included), --quick at most 4. Every step has a time limit, printed in the plan at
# the start and again as the step begins; a step is also cut to what is left of the total, and a step the total
# does not reach is listed as `not run` (never as passed). The steps (their keys in the plan):
#   1. gpu_check: every fast path against its torch reference, outputs and gradients (attnzoo-bench gpu_check: SDPA
#      flash, flex_attention, fla's ops and mixers, cheap cases first; each row streamed to OUT/gpu_check.jsonl as
#      it ends, a per-case limit, the first call's compile / autotune timed apart from the check);
#   2. mixers-torch: the mixer benchmark in bf16 with model.impl=torch;
#   3. mixers-auto: the same with model.impl=auto (the speed-up of the kernels);
#   4. train-gqa, train-gdn: the training-step benchmark (bf16-mixed, model.impl=auto) for gqa and gated_deltanet;
#   5. fsdp-*: a run on 1 GPU vs trainer=fsdp on 1 GPU (fp32: the same losses), and the per-rank bytes per parameter
#      with bf16 gathers (attnzoo-bench fsdp --device cuda); docs/distributed.md.
#   6. decode-equal, decode-bench: the compiled static-cache step under CUDA graphs (mode=reduce-overhead) gives the
#      eager step's greedy tokens, then attnzoo-bench decode (tokens/s vs the memory roofline, vs transformers).
# --quick: steps 1, 3 and 4 (gqa) at tiny sizes and the decode check.
# Needs a CUDA build of torch and the gpu extra (fla-core + triton): pip install -e '.[gpu]'. docs/gpu.md.
# Usage: scripts/gpu_check.sh [--quick] [--plan] [OUT_DIR]   (default OUT_DIR: gpu_check_results)
#   --plan: print the steps and their limits, run nothing.
# Exit status: 0 all ok; 1 a fast path disagrees with its reference, timed out, or decode disagrees; 2 no GPU (or a
# bad option); 3 a benchmark step failed or timed out, or a step was not run.
# GPU_CHECK_DEVICE=cpu rehearses the script on a CPU (tiny sizes, torch paths, fla cases skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=full
PLAN_ONLY=0
OUT=
for a in "$@"; do
  case "$a" in
    --quick) MODE=quick ;;
    --plan) PLAN_ONLY=1 ;;
    -*) echo "gpu_check: unknown option $a; allowed: --quick, --plan, OUT_DIR" >&2; exit 2 ;;
    *) OUT=$a ;;
  esac
done
OUT=${OUT:-gpu_check_results}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
DEVICE=${GPU_CHECK_DEVICE:-cuda}

# ---------------------------------------------------------------------------------------------- the plan
# key, limit in seconds, what it runs. The limits add up to at most TOTAL; each step is also cut to what is left
# of TOTAL when it starts (minus 5 s: `timeout -k 5` kills what ignores its TERM).
KILL_GRACE=5
if [ "$MODE" = quick ]; then
  TOTAL=230
  PLAN=(
    "probe         10 CUDA visible to $PY"
    "gpu_check    115 attnzoo-bench gpu_check --quick (--budget 100, --case-limit 50)"
    "mixers-auto   30 attnzoo-bench mixers --quick, bf16, model.impl=auto"
    "train-gqa     30 attnzoo-bench train --quick, gqa, bf16-mixed"
    "decode-equal  45 decode: CUDA graphs vs eager, greedy tokens"
  )
  GC_BUDGET=100; GC_CASE=50
else
  TOTAL=600
  PLAN=(
    "probe         10 CUDA visible to $PY"
    "gpu_check    260 attnzoo-bench gpu_check (--budget 245, --case-limit 80)"
    "mixers-torch  30 attnzoo-bench mixers, bf16, model.impl=torch"
    "mixers-auto   45 attnzoo-bench mixers, bf16, model.impl=auto"
    "train-gqa     35 attnzoo-bench train, gqa, bf16-mixed"
    "train-gdn     35 attnzoo-bench train, gated_deltanet, bf16-mixed"
    "fsdp-plain    25 attnzoo-train, 8 steps, fp32, 1 GPU"
    "fsdp-fsdp     25 attnzoo-train trainer=fsdp, 8 steps, fp32, 1 GPU"
    "fsdp-equal     5 the two runs' losses equal"
    "fsdp-memory   25 attnzoo-bench fsdp: bytes per parameter"
    "decode-equal  50 decode: CUDA graphs vs eager, greedy tokens"
    "decode-bench  50 attnzoo-bench decode --device cuda"
  )
  GC_BUDGET=245; GC_CASE=80
fi
declare -A LIMIT
SUM=0
for p in "${PLAN[@]}"; do
  read -r key limit _ <<<"$p"
  LIMIT[$key]=$limit
  SUM=$((SUM + limit))
done
echo "gpu_check.sh ($MODE, device $DEVICE): ${#PLAN[@]} steps, limits adding up to $SUM s of a $TOTAL s total"
for p in "${PLAN[@]}"; do
  read -r key limit what <<<"$p"
  printf '  %-13s %4d s  %s\n' "$key" "$limit" "$what"
done
[ "$PLAN_ONLY" = 1 ] && exit 0

# ---------------------------------------------------------------------------------------------- the steps
declare -A STATUS SPENT
ORDER=()
step() {  # step KEY CMD...: CMD under its limit (cut to what is left of TOTAL); records ok / failed / timeout / not run
  local key=$1; shift
  local limit=${LIMIT[$key]} left=$((TOTAL - SECONDS - KILL_GRACE)) t0=$SECONDS rc
  ORDER+=("$key")
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    STATUS[$key]="not run (the $TOTAL s total ran out)"; SPENT[$key]=0
    echo; echo "== [$(printf '%3d' "$SECONDS") s of $TOTAL] $key: not run (the $TOTAL s total ran out)"
    return 125
  fi
  echo; echo "== [$(printf '%3d' "$SECONDS") s of $TOTAL] $key (limit $limit s of ${LIMIT[$key]})"
  timeout -k "$KILL_GRACE" "$limit" "$@"
  rc=$?
  SPENT[$key]=$((SECONDS - t0))
  case $rc in
    0) STATUS[$key]=ok ;;
    124|137) STATUS[$key]="timeout (> $limit s)" ;;
    *) STATUS[$key]="failed (exit status $rc)" ;;
  esac
  return $rc
}
skip() {  # skip KEY WHY: a step that cannot run because one before it did not finish
  ORDER+=("$1"); STATUS[$1]="not run ($2)"; SPENT[$1]=0
}

step probe "$PY" -c "import torch, sys; sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 1)"
if [ "${STATUS[probe]}" != ok ]; then
  echo "gpu_check: no CUDA device is visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing)); this script needs one GPU (${STATUS[probe]})" >&2
  exit 2
fi
if [ "$DEVICE" = cuda ]; then
  QUICK=(); TRAINER=(trainer=gpu); FSDP=(trainer=fsdp trainer.devices=1 trainer.fsdp.param_dtype=null)
else
  QUICK=(--quick); TRAINER=(); FSDP=(trainer=fsdp_cpu trainer.devices=1 trainer.fsdp.param_dtype=null)
fi
[ "$MODE" = quick ] && QUICK=(--quick)
mkdir -p "$OUT"
BENCH=("$PY" -m attnzoo.bench)
MIXERS=(gqa sliding_window linear_attention deltanet gated_deltanet)
MIXER_SIZES=(--d-model 1024 --n-heads 16 --n-kv-heads 4 --window 512 --batch 4 --lengths 2048 8192)
[ ${#QUICK[@]} -gt 0 ] && MIXER_SIZES=()

step gpu_check "${BENCH[@]}" --out "$OUT" gpu_check --device "$DEVICE" "${QUICK[@]}" \
  --budget "$GC_BUDGET" --case-limit "$GC_CASE"

if [ "$MODE" = full ]; then
  step mixers-torch "${BENCH[@]}" --out "$OUT/mixers-torch" mixers --precision bf16-mixed --impl torch \
    --mixers "${MIXERS[@]}" "${MIXER_SIZES[@]}" "${QUICK[@]}"
fi
step mixers-auto "${BENCH[@]}" --out "$OUT/mixers-auto" mixers --precision bf16-mixed --impl auto \
  --mixers "${MIXERS[@]}" "${MIXER_SIZES[@]}" "${QUICK[@]}"

TRAIN=(--precisions bf16-mixed --steps 5 "${QUICK[@]}" --overrides "${TRAINER[@]}" model.impl=auto
       data.tokenizer=char data.max_chars=400000)  # --overrides last: it takes the rest
step train-gqa "${BENCH[@]}" --out "$OUT/train-gqa" train --mixer gqa "${TRAIN[@]}"
if [ "$MODE" = full ]; then
  step train-gdn "${BENCH[@]}" --out "$OUT/train-gated_deltanet" train --mixer gated_deltanet "${TRAIN[@]}"

  FSDP_RUN=(-m attnzoo.cli.train debug=smoke data.tokenizer=char trainer.max_steps=8 trainer.log_every_n_steps=1
            trainer.precision=32-true perf.measure_decode=false sample.max_new_tokens=0)
  step fsdp-plain "$PY" "${FSDP_RUN[@]}" "${TRAINER[@]}" hydra.run.dir="$OUT/fsdp/plain"
  step fsdp-fsdp "$PY" "${FSDP_RUN[@]}" "${FSDP[@]}" hydra.run.dir="$OUT/fsdp/fsdp"
  if [ "${STATUS[fsdp-plain]}" = ok ] && [ "${STATUS[fsdp-fsdp]}" = ok ]; then
    step fsdp-equal "$PY" - "$OUT/fsdp" <<'PYEOF'
import csv, sys
def losses(d):
    return [float(r["train/loss"]) for r in csv.DictReader(open(f"{sys.argv[1]}/{d}/csv/metrics.csv")) if r.get("train/loss")]
a, b = losses("plain"), losses("fsdp")
gap = max(abs(x - y) for x, y in zip(a, b))
print(f"fsdp vs plain on 1 device: {len(a)} steps, max |train/loss difference| {gap:.3g}")
sys.exit(0 if len(a) == len(b) == 8 and gap <= 1e-5 else 1)
PYEOF
  else
    skip fsdp-equal "a run it compares did not finish"
  fi
  if [ "$DEVICE" = cuda ]; then
    step fsdp-memory "${BENCH[@]}" --out "$OUT/fsdp-memory" fsdp --ranks 1 --device cuda --param-dtype bf16 \
      --d-model 1024 --n-layers 8
  else
    skip fsdp-memory "CUDA only"
  fi
fi

step decode-equal "$PY" - "$DEVICE" <<'PYEOF'
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
if [ "$MODE" = full ]; then
  if [ "$DEVICE" = cuda ]; then
    step decode-bench "${BENCH[@]}" --out "$OUT/decode" decode --device cuda --contexts 2048 8192 --batches 1 8 \
      --d-model 1024 --n-layers 8 --n-heads 16 --n-kv-heads 4 --d-ff 2816 --vocab 32000
  else
    skip decode-bench "CUDA only"
  fi
fi

# ---------------------------------------------------------------------------------------------- the summary
echo
echo "== gpu_check.sh summary ($MODE: $SECONDS s of a $TOTAL s total; results in $OUT)"
printf '  %-13s %6s %6s  %s\n' step limit spent status
for key in "${ORDER[@]}"; do
  printf '  %-13s %5ss %5ss  %s\n' "$key" "${LIMIT[$key]}" "${SPENT[$key]}" "${STATUS[$key]}"
done
if [ -s "$OUT/gpu_check.jsonl" ]; then
  echo "  gpu_check cases (first s: compile + autotune + one run; check s: the check):"
  "$PY" - "$OUT/gpu_check.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    t = "  ".join(f"{k} {r[k]:.1f}" for k in ("first s", "check s") if r.get(k) is not None)
    print(f"    {r['case']:<32} {r['status']}" + (f"  ({t})" if t else ""))
PYEOF
fi
# gpu_check's own status: 1 a case failed / errored / timed out, 4 cases not run (its budget), 124/137 killed whole
case "${STATUS[gpu_check]}" in
  ok) check=0 ;;
  "failed (exit status 4)") check=3 ;;
  *) check=1 ;;
esac
case "${STATUS[decode-equal]}" in "failed (exit status 1)") check=1 ;; esac  # tokens differ (or it raised)
bench=0
for key in "${ORDER[@]}"; do
  case "${STATUS[$key]}" in ok|"not run (CUDA only)") ;; *) bench=3 ;; esac
done
if [ "$check" -eq 1 ]; then
  echo "FAILED: a fast path disagrees with its reference, did not run or timed out, or decode disagrees: see $OUT/gpu_check.md"
  exit 1
fi
if [ "$check" -ne 0 ] || [ "$bench" -ne 0 ]; then
  echo "incomplete: what ran agrees, but a step failed, timed out or was not run (see the table above)"
  exit 3
fi
echo "ok: every fast path matches its reference within the limits; benchmarks in $OUT/mixers-*/ and $OUT/train-*/"
