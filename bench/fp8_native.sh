#!/bin/bash
# fp8 storage against ComfyUI's native fp8 path, side by side in one GPU call (issue 23's bench):
# our wan_bench.py rows with --storage fp8_e4m3fn, then ComfyUI's own Wan with DynamicVRAM and
# UNETLoader weight_dtype fp8_e4m3fn (../shared/reference/native_anchor/native_bench.py) at the
# same caps, one process per cap.
#
# Here, once: `bash bench/comfy_coexist.sh prep <2026 ComfyUI tree>` fills the ignored .gpu/.
# On the GPU machine (carry [".gpu", ".whl"]), from the repo root:
#   bash bench/fp8_native.sh [CAPS="12 24"] [LAYERS=40] [OURS_ARGS="--sections stream,preload"] [GGUF="gguf_q8_0"]
# (NATIVE_WORKLOADS=small times native on the image-like workload only; STORAGE=fp8_e4m3fn_fast runs
# our rows with fp8 matmuls; NATIVE_DTYPES="fp8_e4m3fn fp8_e4m3fn_fast" times native at each dtype;
# NATIVE_ARGS="--runs 5" passes more options to native_bench.py; OURS_CAPS="0,24,12" gives our rows
# other caps, 0 for every block kept: the resident reference.)
# Then, while time is left, each GGUF storage of GGUF (one image-like row at the first cap).
# Output: $OUT/fp8_native.log, $OUT/native.jsonl, $OUT/cast_probe.json, $OUT/wan_bench_<storage>.json (+ .log).
set -u
cd "$(dirname "$0")/.." || exit 2
CAPS=${1:-"12 24"}
LAYERS=${2:-40}
OURS_ARGS=${3:-"--sections stream,preload"}
GGUF=${4-"gguf_q8_0"}
OUT=${OUT:-/tmp/fp8_native_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/fp8_native.log") 2>&1
source bench/gpu_env.sh 570

python3 bench/cast_probe.py | tee "$OUT/cast_probe.json"
STORAGE=${STORAGE:-fp8_e4m3fn}
echo "== [$((SECONDS-T0))s] ours: wan_bench --storage $STORAGE --caps ${CAPS// /,}"
timeout -k 10 $(( $(left) - 150 )) python3 bench/wan_bench.py --storage "$STORAGE" $OURS_ARGS \
  --caps "${OURS_CAPS:-${CAPS// /,}}" --out "$OUT"
echo "ours rc=$?"

M=/tmp/wan14b_L${LAYERS}_bf16.safetensors
echo "== [$((SECONDS-T0))s] native model (ComfyUI layout, bf16, $LAYERS layers)"
timeout -k 10 120 python3 .gpu/native_anchor/make_wan_sd.py --preset 14b --layers "$LAYERS" --device cuda \
  --out "$M" --skip-if-exists || exit 4
for wd in ${NATIVE_DTYPES:-fp8_e4m3fn}; do
for cap in $CAPS; do
  L=$(left)
  if [ "$L" -lt 40 ]; then echo "== skip native $wd cap=$cap: ${L}s left"; continue; fi
  echo "== [$((SECONDS-T0))s] native $wd cap=$cap"
  timeout -k 10 $(( L < 200 ? L : 200 )) python3 .gpu/native_anchor/native_bench.py --comfy-dir .gpu/comfyui \
    --model "$M" --cap-gb "$cap" --weight-dtype "$wd" --workloads "${NATIVE_WORKLOADS:-small,video}" \
    --tag "$wd" --json-out "$OUT/native.jsonl" ${NATIVE_ARGS:-}
  echo "native $wd cap=$cap rc=$?"
done
done
FIRST=${CAPS%% *}
for st in $GGUF; do
  L=$(left)
  if [ "$L" -lt 90 ]; then echo "== skip $st: ${L}s left"; continue; fi
  echo "== [$((SECONDS-T0))s] ours: wan_bench --storage $st --caps $FIRST (image-like)"
  timeout -k 10 $(( L - 10 )) python3 bench/wan_bench.py --storage "$st" --sections preload --caps "$FIRST" \
    --workloads small --out "$OUT"
  echo "$st rc=$?"
done
echo "== [$((SECONDS-T0))s] done"
