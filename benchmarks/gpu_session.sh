#!/bin/bash
# One call on a lent GPU machine (the device tool): install the scipy-openblas32 wheel carried in .whl/, build
# pycyxwiz (sm_90 only), then the stages named in STAGES, which share one deadline (BUDGET seconds); each
# stage's log goes to $OUT/<stage>.log and its tail to stdout. With benchmarks/.old.tar.gz (git archive of an
# older commit) that commit is built too, and the stages "ab" (NCCL per-call cost) and "cnnab" (a small ResNet's
# training against PyTorch, new/old alternating until the stage's time is up) time both builds side by side.
#   here:  git rev-parse --short HEAD > benchmarks/.commit; pip download scipy-openblas32 into .whl/ (device README)
#   there: STAGES="check pytestall train torch bf16" BUDGET=420 bash benchmarks/gpu_session.sh   (carry .whl)
set -u
BUDGET=${BUDGET:-420}
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
stage() {  # stage NAME MAXSECONDS CMD...
  local name=$1 max=$2; shift 2
  local l; l=$(left); (( l < max )) && max=$l
  if (( max < 15 )); then echo "== SKIP $name (no time left)"; return; fi
  echo "== $name (up to ${max}s) at $((SECONDS-START))s"
  timeout -k 5 $max "$@" > $OUT/$name.log 2>&1
  local rc=$?
  echo "== $name rc=$rc after $((SECONDS-START))s"
  tail -n ${TAILN:-25} $OUT/$name.log
}
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
build_to() {  # build_to SRC SITE BUILDDIR: a non-editable install of SRC into SITE
  python3 -m pip install -q --no-build-isolation --no-deps --target "$2" "$1" -Ccmake.define.CX_CUDA_ARCHS=90 \
    -Cbuild-dir="$3"
}
export -f build_to
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
cat benchmarks/.commit 2>/dev/null  # the working tree travels without .git: write the commit here first
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch, cupy; print(sys.version.split()[0], torch.__version__, cupy.__version__)" || true
if [ -f benchmarks/.old.tar.gz ]; then
  mkdir -p /tmp/old && tar xzf benchmarks/.old.tar.gz -C /tmp/old
  (build_to /tmp/old /tmp/old_site /tmp/cxb_old > $OUT/build_old.log 2>&1; echo "old build rc=$?") &
fi
TAILN=5 stage build 240 bash -c 'build_to . /tmp/new_site /tmp/cxb'
wait
export PYTHONPATH=/tmp/new_site:/tmp/site
python3 -c "import pycyxwiz as cx; print('kernels', cx._core.dist._cuda_kernels_built())" || exit 1
for s in ${STAGES:-check pytest train torch bf16}; do
  case $s in
    check) stage check 120 python3 benchmarks/gpu_check.py --no-build --no-train --max-mib 256 ;;
    pytest) TAILN=40 stage pytest 200 python3 -m pytest -q -p no:cacheprovider -x --timeout 120 tests/test_gpu.py ;;
    pytestall) TAILN=40 stage pytest 240 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/test_gpu.py ;;
    train) stage train 150 python3 benchmarks/gpu_train.py --samples 30000 --no-cpu ;;
    torch) stage torch 60 python3 -m pytest -q -p no:cacheprovider --timeout 50 tests/test_torch_backend.py -k cuda ;;
    bf16) stage bf16 100 python3 benchmarks/gpu_train.py --samples 30000 --no-cpu --precision bf16 ;;
    micro) TAILN=60 stage micro 120 bash -c 'nccl=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])")
        gcc -O2 -o /tmp/drvcost benchmarks/gpu_drvcost.c -ldl && /tmp/drvcost $nccl/lib/libnccl.so.2 &&
        python3 benchmarks/gpu_call_cost.py && python3 benchmarks/gpu_call_cost.py cpu' ;;
    ab) stage ab 150 bash -c 'for i in 1 2; do for v in old new; do echo "## $v"
        PYTHONPATH=/tmp/${v}_site:/tmp/site python3 benchmarks/gpu_call_cost.py; done; done' ;;
    cnnex) stage cnnex 60 bash -c 'export DISTRIBUTED_BACKEND=nccl
        ./launch_distributed.sh 1 python3 examples/train_cnn_digits.py --save "" --quiet &&
        ./launch_distributed.sh 1 python3 examples/train_digits.py --save "" 2>&1 | tail -3' ;;
    cnnbench) stage cnnbench 70 python3 benchmarks/gpu_train.py --cnn --samples 16384 ;;
    syncbn) stage syncbn 90 python3 benchmarks/gpu_train.py --cnn --sync-bn --samples 8192 ;;
    cnnab) stage cnnab 150 bash -c 'for v in new old new old; do echo "## $v"
        PYTHONPATH=/tmp/${v}_site:/tmp/site python3 benchmarks/gpu_train.py --cnn --samples 16384 \
          --batches ${CNN_BATCHES:-32,128,512,2048}; done' ;;
    cnntf32) stage cnntf32 60 python3 benchmarks/gpu_train.py --cnn --samples 16384 --precision tf32 \
        --batches ${CNN_BATCHES:-32,128,512,2048} ;;
    cnnprof) TAILN=45 stage cnnprof 90 bash -c "cd benchmarks &&
        python3 gpu_profile.py --sizes cnn --batch 512 --rows 22" ;;
    profile) stage profile 90 bash -c "cd benchmarks && python3 gpu_profile.py --sizes 784,256,10 --batch 64 &&
        python3 gpu_profile.py --sizes 784,2048,2048,10 --batch 4096" ;;
  esac
done
echo "== done at $((SECONDS-START))s"
