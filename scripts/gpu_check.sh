#!/usr/bin/env bash
# One command on a fresh GPU machine (Python 3.12, jax 0.11.x with its CUDA plugin, no network;
# or any machine with `pip install -e '.[cuda12]'`). About 10 minutes on one H200, 14 at most:
#   1. pytest in ONE process (two would each preallocate the GPU's memory; preallocation is off
#      too): the Pallas kernel compiled through Triton against the XLA path and the float64
#      reference (decode, chunks, mixed, any head size, KV splits, the stacked cache), cascade
#      attention, and the engine's decode, mixed and cascade steps with the kernel against XLA;
#      with two GPUs also tensor parallelism.
#      With them the sampler (the two-round top-k on a 128,256 vocabulary), the batch's wire,
#      and async scheduling on against off (the next step reads the previous step's sampled
#      tokens on the device: `batch.link_tokens`, never run on a GPU before this script had it).
#   2. scripts/bench_attention.py: decode attention's share of HBM bandwidth, Pallas vs XLA.
#   2a. scripts/bench_cascade.py --impl pallas: one layer's decode attention at 64 x 2,048 plain,
#      with an empty cascade tile list (what every step without sharing now pays) and with
#      the planner's tiles.
#   2b. scripts/profile_step.py: where a step's time goes, host (pack, launch, collect) and
#      kernels, decode x1 and x64 at 2,048 cached tokens, with the kernel traces.
#   3. scripts/bench_forward.py on the `llama-8b-shape` preset in bfloat16: decode at 64 x 2,048
#      cached tokens against its roofline, and the mixed step against its parts.
#   3b. scripts/bench_overlap.py: the engine's decode step with the host overlap off and on at
#      64 running sequences (wall / max(host, device); the linked dispatch's first GPU number).
#   3c. scripts/bench_host.py: the host's CPU a step by phase (schedule, pack, launch, collect,
#      advance, settle) at 64 and 256 decoding sequences of the tiny preset, where a GPU step is
#      short enough for the host to bound it.
#   4. hetero-jax bench: IBS against homogeneous at 9:1, 5:5 and 1:9 on the same preset.
# Everything lands in one JSON, $OUT/gpu_check.json (OUT defaults to out/gpu_check). A stage that
# fails does not stop the later ones (a lease is short): each stage's exit status is printed and
# the script exits non-zero if any failed. STAGES="pytest attention" runs only the stages named
# (pytest attention cascade profile forward overlap host bench), to split the run over two commands
# where one may run at most 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false HETERO_JAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
"$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.__version__, jax.devices())" || exit 1
FAILED=""
stage() {  # stage NAME COMMAND...: run it (unless STAGES names others), note a failure, go on
    local name=$1; shift
    if [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $name "* ]]; then return; fi
    "$@"; local rc=$?
    echo "stage $name: exit $rc"
    if [ $rc -ne 0 ]; then FAILED="$FAILED $name"; fi
}
GPUS=$("$PY" -c "import jax; print(len(jax.devices()))")
TP_TESTS=""
if [ "$GPUS" -ge 2 ]; then TP_TESTS="tests/test_tensor_parallel.py"; fi
# -p no:xdist -o addopts="": one process, slow tests included (the engine test is slow on CPUs).
stage pytest timeout 360 "$PY" -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" \
    tests/test_pallas_attention.py tests/test_cascade.py \
    "tests/test_generate.py::test_pallas_attention_engine_matches_xla" $TP_TESTS \
    tests/test_wire.py tests/test_sampler.py \
    "tests/test_async_scheduling.py::test_a_mixed_batch_is_the_same_with_the_overlap_on_and_off" \
    -k "not seeded_sampling" \
    -rfE --tb=short --junitxml "$OUT/pytest.xml"
stage attention timeout 80 "$PY" scripts/bench_attention.py --out "$OUT"
stage cascade timeout 60 "$PY" scripts/bench_cascade.py --impl pallas --dtype bfloat16 \
    --seqs 64 --prefix 2048 --suffix 64 --heads 32,8,128 --json "$OUT/bench_cascade.json"
stage profile timeout 100 "$PY" scripts/profile_step.py --preset llama-8b-shape --batches 1,64 \
    --context 2048 --json "$OUT/profile.json" --traces "$OUT/traces"
stage forward timeout 150 "$PY" scripts/bench_forward.py --preset llama-8b-shape \
    --batches 1,16,64 --context 2048 --chunk 512 --repeats 5 --mixed 4:60:16 \
    --json "$OUT/bench_forward.json"
stage overlap timeout 90 "$PY" scripts/bench_overlap.py --preset llama-8b-shape --running 64 \
    --queued 100 --steps 10 --repeats 3 --json "$OUT/bench_overlap.json"
stage host timeout 120 "$PY" scripts/bench_host.py --preset tiny --running 64,256 --steps 10 \
    --repeats 3 --json "$OUT/bench_host.json"
stage bench timeout 120 "$PY" -m hetero_jax.cli bench --preset llama-8b-shape \
    --schedulers ibs,homogeneous --ratios 9:1,5:5,1:9 --repeats 1 --json "$OUT/bench.json"
"$PY" - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
merged = {os.path.splitext(os.path.basename(p))[0]: json.load(open(p))
          for p in sorted(glob.glob(os.path.join(out, "*.json"))) if not p.endswith("gpu_check.json")}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(merged, f, indent=1)
print("wrote", os.path.join(out, "gpu_check.json"), "with", ", ".join(merged))
EOF
if [ -n "$FAILED" ]; then echo "failed stages:$FAILED"; exit 1; fi
