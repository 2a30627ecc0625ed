#!/bin/bash
# Issue 3 on the GPU machine: our nodes beside a native ComfyUI model, one ComfyUI process with
# DynamicVRAM on, under a VRAM cap (bench/comfy_coexist.py says what is measured).
#
# Here (no GPU), once, to fill the ignored folder .gpu/ that travels with carry [".gpu", ".whl"]:
#   bash bench/comfy_coexist.sh prep [COMFY_TREE=/work/comfyui-2026]
#     .gpu/comfyui         the 2026 ComfyUI tree without tests, CI, docs, blueprints, API nodes and
#                          tokenizer data files but Qwen2.5-VL's (image_pipeline_node.py reads it)
#     .gpu/native_anchor   make_wan_sd.py + native_bench.py (from ../shared/reference/native_anchor)
#     .gpu/whl             wheels the GPU image lacks: comfy-aimdo, torchsde, trampoline, SQLAlchemy,
#                          pydantic (+core, annotated-types, typing-inspection, typing-extensions),
#                          pydantic-settings + python-dotenv (else ComfyUI warns once per node file), and
#                          comfy-kitchen 0.2.31 repacked as tar.xz without its ROCm (hip) backend
#   (.whl holds the diffusers wheel; PyAV is not carried: its 36 MB wheel would not fit, the script
#    stubs it, nothing here encodes video.)
#
# On the GPU machine, from the repo root:
#   bash bench/comfy_coexist.sh run [CAP=24] [LAYERS=20] [EXTRA ARGS for comfy_coexist.py...]
# Output: $OUT/coexist.log (everything), $OUT/coexist.jsonl (JSON lines). WORK=dir overrides where
# the models and ComfyUI's base dir go (default /dev/shm/coexist when tmpfs has room, else /tmp).
# BUDGET_S (420) bounds the python run.
set -u
cd "$(dirname "$0")/.." || exit 2
MODE=${1:-run}

if [ "$MODE" = prep ]; then
  SRC=${2:-/work/comfyui-2026}
  ANCHOR=${ANCHOR:-../shared/reference/native_anchor}
  PY=${PY:-python3}
  set -e
  grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
  mkdir -p .gpu/whl .gpu/native_anchor
  rm -rf .gpu/comfyui
  cp -a "$SRC" .gpu/comfyui
  (cd .gpu/comfyui && rm -rf .git .ci .github tests tests-unit blueprints comfy_api_nodes script_examples \
     openapi.yaml .coderabbit.yaml .spectral.yaml AGENTS.md QUANTIZATION.md CONTRIBUTING.md SECURITY.md \
     CODEOWNERS README.md)
  # tokenizer data (vocab/merges/tokenizer.json/.model): read only when a text encoder is built;
  # Qwen2.5-VL's kept (image_pipeline_node.py reads it)
  find .gpu/comfyui/comfy -path '*tokenizer*' -type f ! -name '*.py' ! -path '*/qwen25_tokenizer/*' -delete
  find .gpu/comfyui -name __pycache__ -type d -prune -exec rm -rf {} +
  cp "$ANCHOR/make_wan_sd.py" "$ANCHOR/native_bench.py" .gpu/native_anchor/
  dl() {  # dl DEST NAME==VERSION: a cp312 manylinux (or pure-Python) wheel, no dependencies
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "$2"
  }
  for p in comfy-aimdo==0.4.13 torchsde==0.2.6 trampoline==0.1.2 SQLAlchemy==2.1.9 pydantic==2.14.4 \
           pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
           pydantic-settings==2.16.3 python-dotenv==1.2.4; do
    ls .gpu/whl | grep -qi "^$(echo "${p%%==*}" | tr - _)-${p##*==}-" || dl .gpu/whl "$p"
  done
  if [ ! -f .gpu/whl/comfy_kitchen-0.2.31-cp312-nohip.tar.xz ]; then  # 58 MB wheel -> ~21 MB, takes ~2 min
    T=$(mktemp -d)
    dl "$T" comfy-kitchen==0.2.31
    (cd "$T" && unzip -q comfy_kitchen-0.2.31-*.whl && rm -rf comfy_kitchen/backends/hip comfy_kitchen-*.whl \
       && tar -cf - comfy_kitchen comfy_kitchen-0.2.31.dist-info | xz -9 -T2 > comfy_kitchen.tar.xz)
    mv "$T/comfy_kitchen.tar.xz" .gpu/whl/comfy_kitchen-0.2.31-cp312-nohip.tar.xz
    rm -rf "$T"
  fi
  rm -f .gpu/whl/comfy_kitchen-*.whl
  for d in .gpu/* .gpu .whl; do du -sh "$d"; done
  du -sbc .gpu .whl $(git ls-files) 2>/dev/null | tail -1 | awk '{printf "travels: %.1f MiB (limit 64)\n", $1/1048576}'
  exit 0
fi

[ "$MODE" = run ] || { echo "usage: $0 prep [COMFY_TREE] | run [CAP] [LAYERS] [args...]"; exit 2; }
CAP=${2:-24}
LAYERS=${3:-20}
shift $(( $# < 3 ? $# : 3 ))
OUT=${OUT:-/tmp/coexist_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/coexist.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl .whl/*.whl || exit 3
mkdir -p /tmp/site && tar -xJf .gpu/whl/comfy_kitchen-0.2.31-cp312-nohip.tar.xz -C /tmp/site || exit 3
export PYTHONPATH=/tmp/site
echo "== [$((SECONDS-T0))s] installed"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
# Two random models of ~0.7 GB per block each: on tmpfs when it has room (no disk writes), else /tmp.
NEED_GB=$(( LAYERS * 3 / 2 + 4 ))
SHM_GB=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ -z "${WORK:-}" ]; then
  if [ -n "$SHM_GB" ] && [ "$SHM_GB" -ge "$NEED_GB" ]; then WORK=/dev/shm/coexist; else WORK=/tmp/coexist; fi
fi
echo "work dir $WORK (needs ~${NEED_GB} GB; /dev/shm has ${SHM_GB:-?} GB)"
df -h /tmp /dev/shm | tail -2; free -g | head -2
timeout -k 10 ${BUDGET_S:-420} python3 bench/comfy_coexist.py --comfy-dir .gpu/comfyui --work "$WORK" \
  --cap "$CAP" --layers "$LAYERS" --json "$OUT/coexist.jsonl" "$@"
rc=$?
echo "== [$((SECONDS-T0))s] comfy_coexist rc=$rc"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
exit $rc
