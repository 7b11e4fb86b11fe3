#!/usr/bin/env bash
# The GPU checks, in one run on a machine with an NVIDIA GPU and no network access:
#   1. tests/test_devices.py's decode jobs on the GPU (TG_DS4_GPU) over the whole prompt, float32 and the GPU's default
#      half precision;
#   2. the reference tests on the GPU in float32 (TG_DS4_TEST_DEV, TG_DS4_PRECISION=f32): the deepseek2 fixtures,
#      deepseek4 and GPT-2 against the stored transformers and llama.cpp logits, at the CPU's tolerances;
#   3. profile of the V2-Lite-shaped benchmark file (made here by profiles/make_bench_model.py) with tinygrad's own kernel
#      heuristic (TG_DS4_KERNEL_OPTS=0) and with ours (backend/gpu/kernel_opts.py), then bench with ours;
#   4. (STEPS=...v4...) the same profile and bench for the V4-Flash-shaped file (9.5 GB, its quant mix).
#   5. (STEPS=...parallel...) bench --parallel 4 of the V2-Lite-shaped file: 4 sequences a step where decode reads memory.
#   6. (STEPS=...speculative...) bench --speculative 4 of the V2-Lite-shaped file drafting for itself (every draft
#      accepted: speculation's ceiling against plain decode, where a 5-row verify step should cost about one step).
#   8. (STEPS=...llama...) llama.cpp built from its source (LLAMA_SRC: .gpu/llama.cpp-src.tar.xz, carried beside the tree, or
#      ../shared/gpu/) in the background while the steps above run, then llama-bench (pp128, pp512, tg64, tg at depth
#      16k) and llama-batched-bench (1 and 4 streams) on the same files, and one table of both engines (gpu_measured.py table).
#   7. (STEPS=...predict..., with v2lite/v4) each kernel's time measured here beside the GPU cost model's prediction
#      (tools/gpu_cost.py): $OUT/gpu/<gpu>-<commit>-<file>.csv, to be copied into profiles/gpu/ and committed, where
#      tests/test_gpu_cost.py holds the model to it.
# STEPS picks among jobs, v2lite, stock, f32, parallel, speculative, predict and v4 (default: jobs v2lite stock f32 predict).
# Each step has its own time limit and log under $OUT. Wheels for what the machine lacks (tinygrad, gguf, the server's
# libraries) travel in .whl/ at the repository root, installed offline; everything else comes from the machine's python3.
set -u
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ! python3 -c "import tinygrad, gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
DEADLINE=${DEADLINE:-540}  # seconds for the whole script: a step gets its own limit or what is left, whichever is less
step() {  # step NAME SECONDS COMMAND...: the command's output to $OUT/NAME.log, its status and time to the summary
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$secs" ] && secs=$left
  [ "$secs" -lt 10 ] && { echo "$name skipped: out of time" | tee -a "$OUT/summary"; return; }
  timeout -s INT -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary"
  tail -n 4 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary"
GPU=${GPU:-CUDA}
if [ -z "${NVRTC_PATH:-}" ] && ! ldconfig -p | grep -q libnvrtc.so; then  # tinygrad's CUDA compiler: NVIDIA's NVRTC
  lib=$(find /usr/local/cuda*/ /opt -name 'libnvrtc.so*' 2>/dev/null | grep -v builtins | sort | head -1)
  [ -n "$lib" ] && export NVRTC_PATH=$lib && echo "NVRTC_PATH=$lib"
fi
DEV=$GPU python3 -c "from tinygrad import Tensor, Device; print(Device.DEFAULT, (Tensor([1., 2.]) + 1).tolist())" || {
  GPU=NV; DEV=NV python3 -c "from tinygrad import Tensor, Device; print(Device.DEFAULT, (Tensor([1., 2.]) + 1).tolist())" || exit 1; }
echo "device $GPU" | tee -a "$OUT/summary"
FLOAT32=${F32_K:-_transformers}
STEPS=${STEPS:-jobs v2lite stock f32 predict}
LLAMA=/tmp/lc/llama.cpp/build/bin
if on llama; then  # the build takes the cores (~6.5 minutes on 16): started first, waited for at the end
  LLAMA_SRC=${LLAMA_SRC:-$(ls .gpu/llama.cpp-src.tar.xz ../shared/gpu/llama.cpp-src.tar.xz 2>/dev/null | head -1)}
  ( mkdir -p /tmp/lc && tar xJf "$LLAMA_SRC" -C /tmp/lc && cd /tmp/lc/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
      && cmake --build build -j 13 --target llama-bench llama-batched-bench ) >"$OUT/llama_build.log" 2>&1 &
  BUILD_PID=$!
fi
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h'); KIND=${KIND:-h200}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo worktree)
measure() {  # measure NAME FILE PARALLEL: profile and bench on the GPU, then the CSV of both beside the prediction
  local name=$1 file=$2 par=$3 extra=""
  [ "$par" -gt 1 ] && extra="--parallel $par"
  step "profile_json_$name" ${PROFILE_S:-90} sh -c "python3 -m tg_ds4 profile -m '$file' --json $extra > '$OUT/profile-$name.json'"
  step "bench_json_$name" ${BENCH_S:-120} sh -c "python3 -m tg_ds4 bench -m '$file' --prompt-tokens 128 --gen 64 --repeat 2 --json $extra > '$OUT/bench-$name.json'"
  mkdir -p "$OUT/gpu"
  step "predict_$name" ${PREDICT_S:-120} python3 profiles/gpu_measured.py device --gpu "$KIND" --model "$file" --profile "$OUT/profile-$name.json" \
    --bench "$OUT/bench-$name.json" --parallel "$par" --out "$OUT/gpu/$KIND-$COMMIT-$name.csv"
}
on() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
export TG_DS4_TEST_DEV=$GPU
on jobs && step decode_jobs ${JOBS_S:-110} env TG_DS4_GPU=$GPU python3 -m pytest -q -s -p no:cacheprovider --durations=5 tests/test_devices.py -k decodes
unset TG_DS4_TEST_DEV
export DEV=$GPU
BENCHES=$(python3 -c "import sys; sys.path.insert(0, '.'); from tg_ds4.backend.cache import cache_dir; print(cache_dir() / 'bench')")
if on v2lite; then
  step make_bench ${MAKE_S:-60} python3 profiles/make_bench_model.py v2lite
  BENCH=$BENCHES/v2lite-4L-Q4_0.gguf
  on stock && step profile_stock ${PROFILE_S:-90} env TG_DS4_KERNEL_OPTS=0 python3 -m tg_ds4 profile -m "$BENCH" --out /tmp/profile_stock
  step profile ${PROFILE_S:-90} python3 -m tg_ds4 profile -m "$BENCH" --out /tmp/profile_ours
  step bench ${BENCH_S:-120} python3 -m tg_ds4 bench -m "$BENCH" --prompt-tokens 128 --gen 64 --repeat 2
  on parallel && step bench_parallel ${PARALLEL_S:-180} python3 -m tg_ds4 bench -m "$BENCH" --prompt-tokens 32 --gen 32 --repeat 2 --parallel 4
  on predict && measure "$(basename "$BENCH" .gguf)" "$BENCH" 1
  if on llama; then  # what llama-bench measures beside: a 512-token prompt, decode at depth 16k
    step bench_512 ${BENCH_S:-120} sh -c "python3 -m tg_ds4 bench -m '$BENCH' --prompt-tokens 512 --gen 32 --repeat 2 --json > '$OUT/bench-512-v2lite-4L-Q4_0.json'"
    step bench_depth ${BENCH_S:-120} sh -c "python3 -m tg_ds4 bench -m '$BENCH' --prompt-tokens 16384 --gen 32 --repeat 1 --json > '$OUT/bench-depth-v2lite-4L-Q4_0.json'"
  fi
  on predict && on parallel && measure "$(basename "$BENCH" .gguf)-p4" "$BENCH" 4
  on speculative && step bench_speculative ${SPECULATIVE_S:-150} python3 -m tg_ds4 bench -m "$BENCH" --prompt-tokens 32 --gen 64 --repeat 2 \
    --speculative 4 --draft "$BENCH"
fi
if on v4; then
  step make_bench_v4 ${MAKE_V4_S:-150} python3 profiles/make_bench_model.py v4flash
  BENCH=$BENCHES/v4flash-4L-q2.gguf
  step profile_v4 ${PROFILE_S:-150} python3 -m tg_ds4 profile -m "$BENCH" --out /tmp/profile_v4
  step bench_v4 ${BENCH_S:-150} python3 -m tg_ds4 bench -m "$BENCH" --prompt-tokens 128 --gen 64 --repeat 2
  on predict && measure "$(basename "$BENCH" .gguf)" "$BENCH" 1
fi
export TG_DS4_TEST_DEV=$GPU
on f32 && step f32 ${F32_S:-180} env TG_DS4_PRECISION=f32 python3 -m pytest -q -s -p no:cacheprovider --durations=5 tests/test_reference.py \
  tests/test_ds4.py tests/test_gpt2.py -k "$FLOAT32"
if on llama; then
  left=$((DEADLINE - SECONDS)); waited=0
  while kill -0 "$BUILD_PID" 2>/dev/null && [ $waited -lt $((left - 60)) ]; do sleep 5; waited=$((waited + 5)); done
  if [ -x "$LLAMA/llama-bench" ]; then
    for f in "$BENCHES"/v2lite-4L-Q4_0.gguf "$BENCHES"/v4flash-4L-q2.gguf; do
      [ -f "$f" ] || continue; name=$(basename "$f" .gguf)
      step "llama_bench_$name" ${LLAMA_S:-120} sh -c "'$LLAMA/llama-bench' -m '$f' -ngl 99 -p 128,512 -n 64 -r 3 -o json > '$OUT/llama-$name.json'"
      step "llama_depth_$name" ${LLAMA_S:-120} sh -c "'$LLAMA/llama-bench' -m '$f' -ngl 99 -p 0 -n 32 -d 16384 -r 1 -o json > '$OUT/llama-depth-$name.json'"
      step "llama_batched_$name" ${LLAMA_S:-120} "$LLAMA/llama-batched-bench" -m "$f" -ngl 99 -c 4096 -npp 32 -ntg 32 -npl 1,4
    done
    python3 profiles/gpu_measured.py table "$OUT" | tee -a "$OUT/summary"
  else echo "llama.cpp not built in time: $OUT/llama_build.log" | tee -a "$OUT/summary"; fi
fi
cat "$OUT/summary"
