#!/bin/bash
# Several bench rows in one GPU call, in order, while time is left; every output in one archive
# (a call returns at most 8 files). On the GPU machine (carry [".gpu", ".whl"]), from the repo root:
#   BUDGET_S=560 bash bench/gpu_batch.sh host fresh h3te
# Rows: host (host_profile.py, ~2 min), hostq4 (the same with GGUF Q4_K layers at caps 0 and 12),
# w4a8 (the blocks as ComfyUI W4A8 layers, comfy-kitchen's kernels, at 12 and 24 GiB), storedcompiled (W4A8, W4A4 and MXFP8 blocks compiled at 12 GiB; STORED_ROWS), flux / zimage / qwenimage / qwenedit / flux2 / klein9b (FLUX.1-dev's / Z-Image Turbo's / Qwen-Image's / Qwen-Image-Edit-2511's with one reference / FLUX.2 [dev]'s / [klein] 9B's transformer, bf16 and fp8 storage, at 12 and 24 GiB, 1024x1024; IMAGE_ROWS, IMAGE_CAPS), qwennative / flux2native (ComfyUI's native Qwen-Image / FLUX.2 [dev] step on a random fp8-block file, NATIVE_CAPS; carry .gpu), nvfp4 (the blocks as ComfyUI
# NVFP4 layers, then fp8 storage, at 12 and 24 GiB, image-like), int8 (ComfyUI int8_tensorwise
# blocks plain and convrot, at 12 and 24 GiB, image-like and video),
# trace (step_profile.py at 24 GiB with the trace's overlap and idle gaps, ~2 min), qwentrace (step_profile.py --model qwenedit, fp8 at 12 GiB in parts then whole blocks, traced), ringab (Qwen-Image-Edit, then Wan, fp8 at 12 GiB: parts bound whole with the plan's buffers, with a block's ahead, and per part), flux2ring (FLUX.2 [dev] fp8 at 12 GiB, CUDA graphs off: the plan's buffers, then 3, 4 and 6), poolprobe (graph_pool_probe.py: a capture into a graph pool whose last graph was reset, native and cudaMallocAsync), verdicts (graph_verdict_probe.py: Wan, Z-Image, FLUX.1, [klein] 9B and Qwen-Image with every block kept, as shipped, graphs forced on, graphs off, ~4 min; VERDICT_ARGS adds flags, e.g. "--models qwenimage --clocks 4 --cap 12": a streamed plan), fp8trace (the same
# for fp8 storage at 12 GiB; fasttrace: with fp8 matmuls), spread24 (the 24 GiB bf16 plan against its mirror, each with and without copies queued across a forward's end, in one process; spreadfast: the same for fp8 matmuls at 12 GiB), fast (wan_bench with fp8 matmuls at 12 and 24 GiB, ~4 min), cast (cast_probe.py: the fp8 cast and fp8 matmuls' input quantisation, torch against the kernels), castsweep (cast_probe.py --sweep: the fp8 cast kernel's widths), int8cast (int8_cast_probe.py: a Wan-14B block's int8 weights, torch's cast against the row kernel's widths), kdecode (kitchen_decode_probe.py: comfy-kitchen's NVFP4 and MXFP8 decode of a Wan-14B layer against its matmul), ggufk (gguf_dequant_probe.py, then GGUF Q4_K and Q8_0 blocks with the pack's GGUF kernel and without it, at 12 GiB), stepprof (the same in four
# fresh processes, with the launch's time to each block and the CUDA API calls' host time), fresh (three fresh 24 GiB image-like preload rows, ~3 min),
# h3te (H3 three plain runs, text encoder at full depth in bf16, ~4 min), h3fp8 (H3 at full depth
# in fp8 at 24 GiB), mapped (mapped_check.py --write, then --free-gb 16 with the LoRA row; ~8 min),
# wan22 (wan22_node.py at 12 GiB), single (single_file_node.py at 12 GiB; SINGLE_ARGS adds flags), gguf (Q8_0 and Q4_K at
# 12 GiB), ggufcompiled (the same compiled and not, with every block kept too), noexp (the fresh 24 GiB bf16 row and the GGUF Q4_K row with expandable segments left off:
# is the engine's slower image-like step the allocator setting or its hooks?), h2d (h2d_probe.py in three fresh
# processes: H2D from the model's registered pages against a pinned buffer, and the huge-page state),
# release (release_probe.py: what a release leaves on the device before a garbage collection),
# graphs (graph_bench.py, bf16 then fp8: CUDA graphs off and on, ~5 min), compile (compile_probe.py: Wan-14B blocks compiled vs eager, ~3 min), compiled / plain (wan_bench with compile_blocks at 24 and 12 GiB, and its uncompiled anchor at 24), compiledprof / compiledprof12 (step_profile: fp8 matmuls compiled at 24 / 12 GiB against every block kept, traced), fastcompiled (the same with fp8 matmuls, image-like and video: is the video step within 1.02 × the compiled reference?), cyclecost (cycle_cost.py: the driver's calls at a step's start and its variants, 12 GiB compiled), gpucompile (the compiled and graph GPU tests), gputests (tests/gpu), pairs (PAIRS fresh processes in turn at PAIR_CAP, default 4 at 24 GiB: ComfyUI's native fp8 step, then ours with fp8 storage as users run it; carry .gpu), castref (fp8 storage, bf16 compute compiled, every unit cast at each forward: the every-block-kept reference on the capped rows' cast path, then 12 and 24 GiB), imagepipe (image_pipeline_node.py: Qwen-Image's three fp8 files, ours then native, at PIPE_CAP; PIPE_PROMPTS, PIPE_SIDES; PIPE_PACKLOG=1 writes the pack's debug log), flux2pipe (the same for FLUX.2 [dev]'s three fp8 files, one process a side; PIPE_SIDES space-separated, a side+nomalloc runs ComfyUI with --disable-cuda-malloc, ours+nographs with our cuda_graphs off; PIPE_ARGS adds flags to both rows, e.g. --comfy-args=--disable-cuda-malloc; PIPE_PACKLOG=1 writes each side's pack debug log), readcheck (read_check.py on imagepipe's 20 GB denoiser file: pinned in place against PinSet.pin_all; after imagepipe). Output: $OUT/batch.log (everything, with a [seconds] stamp per row) and $OUT/rows.tgz.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/gpu_batch_out}
ROWS_DIR=/tmp/rows
mkdir -p "$OUT" "$ROWS_DIR"
exec > >(tee -a "$OUT/batch.log") 2>&1
source bench/gpu_env.sh 560

run() {  # run NAME MIN_SECONDS COMMAND...: skipped when fewer than MIN_SECONDS are left
  local name=$1 need=$2
  shift 2
  local L
  L=$(left)
  if [ "$L" -lt "$need" ]; then echo "== skip $name: ${L}s left, needs ${need}s"; return; fi
  echo "== [$((SECONDS - T0))s] $name: $*"
  OUT="$ROWS_DIR" timeout -k 10 "$((L - 5))" "$@" > "$ROWS_DIR/$name.log" 2>&1
  echo "== [$((SECONDS - T0))s] $name rc=$?"
  grep -E '^\||"section": "(preload_auto|resident|fp8_resident|engine|auto|trace)"|^-- run|^   (text encode|move|denoise  )|row"|SUMMARY|EXCEEDS|within|passed|failed|Error' \
    "$ROWS_DIR/$name.log" | cut -c1-400 | tail -40
}

for row in "$@"; do
  case $row in
    host) run host 180 python3 bench/host_profile.py --caps 0,24,0 --out "$ROWS_DIR" ;;  # all kept again after streaming
    hostq4) run hostq4 150 python3 bench/host_profile.py --storage gguf_q4_k --caps 0,12 --forwards 4 \
              --out "$ROWS_DIR" ;;
    trace) run trace 120 python3 bench/step_profile.py --caps 24 --trace "$ROWS_DIR/trace.json" --out "$ROWS_DIR" ;;
    fp8trace) run fp8trace 120 python3 bench/step_profile.py --storage fp8_e4m3fn --caps 12 --per-part \
                --trace "$ROWS_DIR/fp8trace.json" --out "$ROWS_DIR" ;;
    qwentrace) for v in "" --whole-blocks; do  # Qwen-Image-Edit at 12 GiB in parts, then whole: where the parts' time goes
                 run "qwentrace${v:+_whole}" 150 python3 bench/step_profile.py --model qwenedit --storage fp8_e4m3fn \
                   --caps 12 $v --warmup 6 --trace "$ROWS_DIR/qwentrace${v:+_whole}.json" --out "$ROWS_DIR"
               done ;;
    fluxtrace) for v in "fp8_e4m3fn" "fp8_e4m3fn --whole-blocks" "bf16"; do  # FLUX.1 at 12 GiB: fp8 in parts, whole, bf16
                 tag=$(echo "$v" | tr -cs 'A-Za-z0-9\n' _ | sed 's/_*$//')
                 run "fluxtrace_$tag" 150 python3 bench/step_profile.py --model flux --storage $v --caps 12 --warmup 6 \
                   --trace "$ROWS_DIR/fluxtrace_$tag.json" --out "$ROWS_DIR"
               done
               run fluxring 200 python3 bench/step_profile.py --model flux --storage fp8_e4m3fn --caps 12 --warmup 6 \
                 --slots 12 --slots 16 --out "$ROWS_DIR" ;;  # more buffers ahead: is FLUX.1's 4 % the lookahead?
    ringab) run qwenring 300 python3 bench/step_profile.py --model qwenedit --storage fp8_e4m3fn --caps 12 --warmup 6 \
              --per-part --slots 8 --slots 9 --out "$ROWS_DIR"  # whole-bound parts: a unit ahead, a block ahead, or per part
            run wanring 200 python3 bench/step_profile.py --storage fp8_e4m3fn --caps 12 --warmup 6 \
              --per-part --slots 4 --slots 5 --out "$ROWS_DIR" ;;
    poolprobe) run poolprobe 60 python3 bench/graph_pool_probe.py ;;  # a capture into a pool whose last graph went, both allocators
    verdicts) run verdicts 240 python3 bench/graph_verdict_probe.py --out "$ROWS_DIR" ${VERDICT_ARGS:-} ;;  # graph_worth's verdict against graphs' gain
    flux2ring) run flux2ring 300 python3 bench/step_profile.py --model flux2 --storage fp8_e4m3fn --caps 12 --warmup 6 \
                 --no-graphs --slots 3 --slots 4 --slots 6 --out "$ROWS_DIR" ;;  # graphs off: the unbound plan's lookahead
    fasttrace) run fasttrace 120 python3 bench/step_profile.py --storage fp8_e4m3fn_fast --caps 12 \
                 --trace "$ROWS_DIR/fasttrace.json" --out "$ROWS_DIR" ;;
    compiledprof) run compiledprof 150 python3 bench/step_profile.py --storage fp8_e4m3fn_fast --compile --caps 24 \
                    --trace "$ROWS_DIR/trace.json" --json "$ROWS_DIR/compiledprof.jsonl" ;;  # the 24 GiB compiled step vs its reference
    compiledprof12) run compiledprof12 150 python3 bench/step_profile.py --storage fp8_e4m3fn_fast --compile --caps 12 \
                      --trace "$ROWS_DIR/trace12.json" --json "$ROWS_DIR/compiledprof12.jsonl" ;;  # the same at 12 GiB: the copies' gaps
    spread24) run spread24 150 python3 bench/step_profile.py --caps 24 --warmup 6 --streamed plan:nocross \
                --streamed mirror --streamed mirror:nocross --out "$ROWS_DIR" ;;  # issue 24's A/B, one process
    spreadfast) run spreadfast 150 python3 bench/step_profile.py --storage fp8_e4m3fn_fast --caps 12 --warmup 6 \
                  --streamed plan:nocross --streamed mirror --streamed mirror:nocross --out "$ROWS_DIR" ;;  # the same A/B, fp8 matmuls at 12 GiB
    fast) run fast 200 python3 bench/wan_bench.py --storage fp8_e4m3fn_fast --sections preload --caps 12,24 \
            --workloads small,video --warmup 6 --json "$ROWS_DIR/fast.json" ;;  # ours only (fp8_native.sh: with native)
    cast) run cast 30 python3 bench/cast_probe.py --repeats 10 ;;  # the cast and the fp8 matmul input quantisation
    castsweep) run castsweep 40 python3 bench/cast_probe.py --sweep ;;
    int8cast) run int8cast 30 python3 bench/int8_cast_probe.py ;;  # int8 units: torch's cast against the row kernel's widths
    kdecode) run kdecode 30 python3 bench/kitchen_decode_probe.py ;;  # comfy-kitchen's NVFP4/MXFP8 decode against the matmul
    ggufk) run ggufprobe 30 python3 bench/gguf_dequant_probe.py  # one weight per quant type: diffusers' ops against the kernel
           for st in ${GGUF_ROWS:-gguf_q4_k gguf_q4_k_torch gguf_q8_0 gguf_q8_0_torch}; do
             run "$st" 60 python3 bench/wan_bench.py --storage "$st" --sections preload --caps ${GGUF_CAPS:-12} --warmup 6 \
               --workloads small --out "$ROWS_DIR"
           done ;;
    stepprof) for i in $(seq "${STEPPROF_N:-4}"); do  # four fresh processes: the launch block by block and the driver calls' time
                run "stepprof$i" 100 python3 bench/step_profile.py --caps 24 --trace "$ROWS_DIR/trace$i.json" \
                  --json "$ROWS_DIR/stepprof$i.jsonl"
                rm -f "$ROWS_DIR"/trace"$i"*.json  # summarised in the rows; the traces are large
              done ;;
    fresh) for i in 1 2 3; do
             run "fresh$i" 70 python3 bench/wan_bench.py --sections preload --caps 24 --workloads small ${FRESH_ARGS:-} \
               --warmup 6 --json "$ROWS_DIR/fresh$i.json"  # (warm-up: the plan settles, then its graphs are captured)
           done ;;
    h3te) run h3te 240 python3 bench/h3_bench.py --runs plain,plain,plain,reprompt --te-layers 64 --out "$ROWS_DIR" ;;
    h3fp8) run h3fp8 300 python3 bench/h3_bench.py --blocks 50 --te-layers 64 --cap 24 --storage fp8_e4m3fn \
             --runs plain,reprompt,reprompt --out "$ROWS_DIR" ;;
    mapped) run mapped_write 200 python3 bench/mapped_check.py --write
            run mapped 240 python3 bench/mapped_check.py --free-gb 16 ;;
    wan22) run wan22 300 python3 bench/wan22_node.py --comfy-dir .gpu/comfyui --cap 12 --json "$ROWS_DIR/wan22.jsonl" ;;
    imagepipe) run imagepipe 200 python3 bench/image_pipeline_node.py --comfy-dir .gpu/comfyui --cap ${PIPE_CAP:-12} \
                 --steps 8 --prompts ${PIPE_PROMPTS:-first,seed,prompt} --sides ${PIPE_SIDES:-ours,native} \
                 --out "$ROWS_DIR" ${PIPE_ARGS:-} ${PIPE_PACKLOG:+--pack-log "$ROWS_DIR/imagepipe_pack.log"} ;;  # Qwen-Image's three fp8 files, whole pipeline, ours then native
    flux2pipe) rm -rf /tmp/image_pipeline_node/models; df -h /tmp | tail -1  # the disk holds one family's files
               for side in ${PIPE_SIDES:-ours native}; do  # one process a side: each side's host memory alone
                 case ${side#*+} in  # e.g. ours+nomalloc, ours+nographs
                   nomalloc) flags=--comfy-args=--disable-cuda-malloc ;; nographs) flags=--no-graphs ;; *) flags= ;;
                 esac
                 run "flux2pipe_${side/+/_}" 240 python3 bench/image_pipeline_node.py --family flux2 --work /tmp/flux2_pipeline \
                   --comfy-dir .gpu/comfyui --cap ${PIPE_CAP:-12} --steps 8 --prompts ${PIPE_PROMPTS:-first,seed,prompt} \
                   --sides "${side%+*}" --json "$ROWS_DIR/flux2pipe_${side/+/_}.jsonl" --out "$ROWS_DIR" ${PIPE_ARGS:-} $flags \
                   ${PIPE_PACKLOG:+--pack-log "$ROWS_DIR/flux2pipe_${side/+/_}_pack.log"}
               done ;;  # FLUX.2 [dev]'s three fp8 files (32B transformer, 24B Mistral pruned), whole pipeline
    readcheck) run readcheck 60 python3 bench/read_check.py \
                 ${READ_FILE:-/tmp/image_pipeline_node/models/diffusion_models/qwen_image_fp8_random.safetensors} \
                 --out "$ROWS_DIR" ;;  # after imagepipe (READ_FILE: another file)
    single) run single 300 python3 bench/single_file_node.py --comfy-dir .gpu/comfyui --cap 12 --layers 40 \
              --out "$ROWS_DIR" ${SINGLE_ARGS:-} ;;  # SINGLE_ARGS=--fp8-matmul: our loader's fp8 matmuls on
    gguf) for st in gguf_q8_0 gguf_q4_k; do
            run "$st" 60 python3 bench/wan_bench.py --storage "$st" --sections preload --caps 12 --workloads small \
              --out "$ROWS_DIR"
          done ;;
    ggufcompiled) for st in ${GGUF_ROWS:-gguf_q8_0 gguf_q4_k}; do  # GGUF blocks compiled against uncompiled, every block kept (0) and 12 GiB
                    for c in "" --compile; do
                      run "${st}${c:+_compiled}" 90 python3 bench/wan_bench.py --storage "$st" $c --sections preload --caps 0,12 \
                        --workloads small --warmup 10 --out "$ROWS_DIR"
                    done
                  done ;;
    w4a8) run w4a8 150 python3 bench/wan_bench.py --storage w4a8 --sections preload --caps 12,24 --workloads small \
            --out "$ROWS_DIR" ;;
    flux|zimage|qwenimage|qwenedit|flux2|klein9b) for st in ${IMAGE_ROWS:-bf16 fp8_e4m3fn}; do  # the carried config's transformer, 1024x1024
                        run "${row}_$st" 150 python3 bench/wan_bench.py --model "$row" --storage "$st" --sections preload \
                          --caps ${IMAGE_CAPS:-12,24} --warmup 6 --out "$ROWS_DIR"
                      done ;;
    qwennative) run qwenfile 200 python3 bench/native_image_anchor.py --write /tmp/qwen_image_fp8.safetensors
                for cap in ${NATIVE_CAPS:-12 24}; do  # ComfyUI's native Qwen-Image step beside the qwenimage rows
                  run "qwennative_$cap" 150 python3 bench/native_image_anchor.py --run /tmp/qwen_image_fp8.safetensors -- \
                    --comfy-dir .gpu/comfyui --cap-gb "$cap" --workloads image=1x16x1x128x128 --text-len 128 \
                    --text-dim 3584 --warmup 4 --runs 3 --json-out "$ROWS_DIR/qwennative.jsonl"
                done ;;
    flux2native) run flux2file 240 python3 bench/native_image_anchor.py --model flux2 --write /tmp/flux2_dev_fp8.safetensors
                 for cap in ${NATIVE_CAPS:-12 24}; do  # ComfyUI's native FLUX.2 [dev] step beside the flux2 rows
                   run "flux2native_$cap" 150 python3 bench/native_image_anchor.py --run /tmp/flux2_dev_fp8.safetensors -- \
                     --comfy-dir .gpu/comfyui --cap-gb "$cap" --workloads image=1x128x1x64x64 --text-len 512 \
                     --text-dim 15360 --warmup 4 --runs 3 --json-out "$ROWS_DIR/flux2native.jsonl"
                 done ;;
    storedcompiled) for st in ${STORED_ROWS:-w4a8 w4a4 mxfp8}; do  # stored layers in compiled blocks (their opaque ops)
                      run "${st}_compiled" 150 python3 bench/wan_bench.py --storage "$st" --compile --sections preload \
                        --caps 12 --workloads small --warmup 6 --out "$ROWS_DIR"
                    done ;;
    nvfp4) for st in ${NVFP4_ROWS:-nvfp4 fp8_e4m3fn}; do  # ComfyUI NVFP4 blocks (comfy-kitchen's CUDA decode), fp8 storage beside; NVFP4_ROWS=w4a4: ConvRot W4A4
             run "$st" 120 python3 bench/wan_bench.py --storage "$st" --sections preload --caps ${NVFP4_CAPS:-12,24} \
               --workloads ${NVFP4_WORK:-small} --warmup 6 --out "$ROWS_DIR"
           done ;;
    int8) for st in ${INT8_ROWS:-int8 int8_torchcast int8_convrot}; do  # ComfyUI int8_tensorwise blocks, convrot's input rotation
            run "$st" 120 python3 bench/wan_bench.py --storage "$st" --sections preload --caps ${INT8_CAPS:-12,24} \
              --workloads ${INT8_WORK:-small,video} --out "$ROWS_DIR"
          done ;;
    h2d) for i in 1 2 3; do  # three fresh processes: is a slow one a slow copy source (registered pages)?
           run "h2d$i" 60 python3 bench/h2d_probe.py --json "$ROWS_DIR/h2d$i.json"
         done ;;
    noexp) for st in bf16 gguf_q4_k; do  # the engine leaves expandable segments off: allocator vs hooks
             run "noexp_$st" 70 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False python3 bench/wan_bench.py \
               --storage "$st" --sections preload --caps "$([ "$st" = bf16 ] && echo 24 || echo 12)" --workloads small \
               --json "$ROWS_DIR/noexp_$st.json"
           done ;;
    release) run release 60 python3 bench/release_probe.py ;;
    compile) run compile 150 python3 bench/compile_probe.py --blocks 8 --workloads small,video ;;  # compiled blocks vs eager
    compiled) run compiled 150 python3 bench/wan_bench.py --compile --sections preload --warmup 6 \
                ${ROW_ARGS:---caps 24,12 --workloads small,video} --json "$ROWS_DIR/compiled.json" ;;  # compile_blocks, bf16
    fastcompiled) run fastcompiled 200 python3 bench/wan_bench.py --storage fp8_e4m3fn_fast --compile --sections preload \
                    --warmup 10 ${ROW_ARGS:---caps 24,12 --workloads small,video} --json "$ROWS_DIR/fastcompiled.json" ;;  # fp8 matmuls compiled
    castref) run castref 200 python3 bench/wan_bench.py --storage fp8_e4m3fn --compile --cast-each-forward \
               --sections preload --workloads small --warmup 10 --caps 0,12,24 ;;  # bf16 compute: the reference on the capped rows' cast path
    plain) run plain 120 python3 bench/wan_bench.py --sections preload --warmup 6 \
             ${ROW_ARGS:---caps 24 --workloads small,video} --json "$ROWS_DIR/plain.json" ;;  # uncompiled: the anchor
    cyclecost) for set in ${CYCLE_SETS:-fp8_e4m3fn_fast:12:--compile fp8_e4m3fn:12:--compile}; do  # storage:cap[:flags,...]
                 IFS=: read -r st cap flags <<< "$set"
                 tag=$(echo "${st}_${cap}_${flags}" | tr -cs 'A-Za-z0-9\n' _ | sed 's/_*$//')
                 run "cyclecost_$tag" 150 python3 bench/cycle_cost.py --storage "$st" --cap "$cap" ${flags//,/ } \
                   --json "$ROWS_DIR/cyclecost_$tag.jsonl"
               done ;;  # a step's start: the driver's calls, and variants of the copies across a forward's end
    pairs) M=/tmp/wan14b_L40_bf16.safetensors  # fresh processes in turn: native fp8, then ours as users run it (fp8 storage)
           run make_wan_sd 60 python3 .gpu/native_anchor/make_wan_sd.py --preset 14b --layers 40 --device cuda --out "$M" \
             --skip-if-exists
           for i in $(seq "${PAIRS:-4}"); do
             run "native$i" 40 python3 .gpu/native_anchor/native_bench.py --comfy-dir .gpu/comfyui --model "$M" \
               --cap-gb "${PAIR_CAP:-24}" --weight-dtype fp8_e4m3fn --workloads small --runs 5 --tag "pair$i" \
               --json-out "$ROWS_DIR/native.jsonl"
             run "ours$i" 70 python3 bench/wan_bench.py --storage fp8_e4m3fn --sections preload --caps "${PAIR_CAP:-24}" \
               --workloads small --warmup 10 --json "$ROWS_DIR/ours$i.json"
           done ;;
    gpucompile) run gpucompile 60 python3 -m pytest tests/gpu/test_compiled_blocks.py tests/gpu/test_cuda_graphs.py \
                  -v -p no:cacheprovider -p no:warnings -rs ;;
    gputests) run gputests 60 python3 -m pytest ${GPU_TESTS:-tests/gpu} -v -p no:cacheprovider -p no:warnings -rs ;;
    graphs) for st in bf16 fp8_e4m3fn; do  # CUDA graphs: off/on alternated, bits compared
              run "graphs_$st" 150 python3 bench/graph_bench.py --storage "$st" --caps "${GRAPH_CAPS:-0,24,12}" \
                $([ "$st" = bf16 ] && echo --video-cap 24) --out "$ROWS_DIR"
            done ;;
    *) echo "== unknown row $row" ;;
  esac
done
tar -czf "$OUT/rows.tgz" -C "$ROWS_DIR" .
echo "== [$((SECONDS - T0))s] done: $OUT/rows.tgz ($(du -h "$OUT/rows.tgz" | cut -f1))"
