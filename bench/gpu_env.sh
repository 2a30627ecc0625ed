# Sourced by the GPU-machine scripts (fp8_native.sh, gpu_batch.sh) from the repo root, after they
# redirect their output: offline environment (an abort dumps the Python stacks: run 65), the carried
# wheels (.gpu/whl, .whl) and comfy-kitchen installed into /tmp/site, a time budget (BUDGET_S,
# default $1) with `left` for what remains.
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$SECONDS
BUDGET_S=${BUDGET_S:-$1}
left() { echo $(( BUDGET_S - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl .whl/*.whl || exit 3
tar -xJf .gpu/whl/comfy_kitchen-0.2.31-cp312-nohip.tar.xz -C /tmp/site || exit 3
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
