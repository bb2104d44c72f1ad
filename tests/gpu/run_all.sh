#!/usr/bin/env bash
# Every GPU test tier on a CUDA machine, with a summary. Run from anywhere:
#   bash tests/gpu/run_all.sh            # default, cuda and slow tiers
#   bash tests/gpu/run_all.sh default    # one tier (default | cuda | slow), or several
# Tiers:
#   default  python -m pytest -m "gpu and not slow" tests/gpu      kernels, graphs, no-sync checks
#   cuda     HYBRID_ENGINE_TEST_DEVICE=cuda python -m pytest -m "not gpu" tests   the CPU suite on CUDA
#   slow     python -m pytest -m "gpu and slow" tests/gpu          the exhaustive kernel sweeps
# Each tier runs as HYBRID_ENGINE_GPU_JOBS (3) pytest processes in parallel on the one GPU (logs
# <tier>.<j>.log; most of a tier's time is host work: Triton compiling, engines capturing graphs).
# Measured times are in README.md. A tier can also be split over several calls with
# HYBRID_ENGINE_GPU_SHARD=i/n (one n-th of the tests, 0 <= i < n, dealt in the order of a hash of
# their ids; it composes with the parallel processes):
#   HYBRID_ENGINE_GPU_SHARD=0/2 bash tests/gpu/run_all.sh slow   then   HYBRID_ENGINE_GPU_SHARD=1/2 ...
# Each process lists its 15 slowest tests; HYBRID_ENGINE_TEST_TIMES=file also logs every test's time
# as it ends (what to move out of the default tier, even from a run stopped by a time limit).
# tests/gpu/test_tensor_parallel_cuda.py needs 2 GPUs (skipped on one; its [ngram] case and the no-sync test took
# 85 s together on nvidia-h100-x2, each engine in its own process).
# Logs go to ${LOG_DIR:-/tmp/hybrid-engine-gpu-tests}/<tier>.log; exit status is non-zero if any
# tier failed. CI runs the CPU suite only (python -m pytest -m "not gpu").
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG_DIR=${LOG_DIR:-/tmp/hybrid-engine-gpu-tests}
JOBS=${HYBRID_ENGINE_GPU_JOBS:-3}
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/default.[0-9]*.log "$LOG_DIR"/cuda.[0-9]*.log "$LOG_DIR"/slow.[0-9]*.log
tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=(default cuda slow)
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: the GPU tiers need one')" || exit 2
summary=()
status=0
run_in_parallel() {
  # run_in_parallel TIER MARKEXPR PATH: the tier as $JOBS pytest processes on the one GPU, each with
  # its own HYBRID_ENGINE_GPU_SHARD (most of a GPU tier's time is Triton compiling and engines
  # capturing graphs: host work). An outer HYBRID_ENGINE_GPU_SHARD=i/n (a tier split over several
  # calls) composes: process j runs shard (i + n*j)/(n*JOBS), so the JOBS processes together run
  # shard i/n. (The shard hook is tests/gpu/conftest.py's; it sees every collected test.)
  local tier=$1 marks=$2 path=$3 pids=() j rc=0 outer_i=0 outer_n=1
  if [ -n "${HYBRID_ENGINE_GPU_SHARD:-}" ]; then
    outer_i=${HYBRID_ENGINE_GPU_SHARD%/*}; outer_n=${HYBRID_ENGINE_GPU_SHARD#*/}
  fi
  for ((j = 0; j < JOBS; j++)); do
    HYBRID_ENGINE_GPU_SHARD=$((outer_i + outer_n * j))/$((outer_n * JOBS)) \
      python -m pytest -q -p no:cacheprovider --durations=15 -m "$marks" "$path" > "$LOG_DIR/$tier.$j.log" 2>&1 &
    pids+=($!)
  done
  for j in "${!pids[@]}"; do
    wait "${pids[$j]}" || rc=1
    echo "-- $tier process $j/$JOBS: $(grep -E ' in [0-9.]+s' "$LOG_DIR/$tier.$j.log" | tail -1)"
  done
  cat "$LOG_DIR/$tier".[0-9]*.log > "$LOG_DIR/$tier.log"
  grep -E '^(FAILED|ERROR) ' "$LOG_DIR/$tier.log"
  return $rc
}

for tier in "${tiers[@]}"; do
  case "$tier" in
    default) cmd=(run_in_parallel default "gpu and not slow" tests/gpu) ;;
    cuda)    cmd=(run_in_parallel cuda "not gpu" tests) ;;
    slow)    cmd=(run_in_parallel slow "gpu and slow" tests/gpu) ;;
    *) echo "unknown tier '$tier' (default | cuda | slow)" >&2; exit 2 ;;
  esac
  echo "== $tier: ${cmd[*]}"
  t0=$(date +%s)
  [ "$tier" = cuda ] && export HYBRID_ENGINE_TEST_DEVICE=cuda || unset HYBRID_ENGINE_TEST_DEVICE
  "${cmd[@]}"; rc=$?
  totals=$(python - "$LOG_DIR" "$tier" <<'PY'
import re, sys, pathlib
n = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob(f"{sys.argv[2]}.[0-9]*.log")):
    lines = [l for l in f.read_text().splitlines() if re.search(r" in [0-9.]+s", l)]
    for k, v in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1] if lines else ""):
        n[v] = n.get(v, 0) + int(k)
print(", ".join(f"{v} {k}" for k, v in n.items()) or "no result")
PY
)
  secs=$(( $(date +%s) - t0 ))
  [ "$rc" -ne 0 ] && status=1
  summary+=("$(printf '%-8s rc=%-3s %5ss  %s' "$tier" "$rc" "$secs" "$totals")")
done

echo
echo "== summary (logs in $LOG_DIR)"
printf '%s\n' "${summary[@]}"
exit $status
