#!/usr/bin/env bash
# GPU check of the Pallas ragged paged attention (about 5 minutes on one GPU, 10 at most):
#   1. tests/test_pallas_attention.py compiled through Triton (HETERO_JAX_PALLAS_INTERPRET=0);
#   2. scripts/bench_attention.py: Pallas vs XLA vs jax.nn.dot_product_attention timings and
#      decode KV bandwidth as a fraction of measured copy bandwidth; JSON to $OUT if set.
#   3. scripts/bench_forward.py: engine steps of the small preset against their roofline.
# Uses $PYTHON (default: python), which must see a GPU jax; run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
# --noconftest: these tests need no fixtures, so torch/transformers need not be installed.
HETERO_JAX_PALLAS_INTERPRET=0 timeout 300 "$PY" -m pytest -q --noconftest -p no:cacheprovider \
    tests/test_pallas_attention.py
timeout 270 "$PY" scripts/bench_attention.py ${OUT:+--out "$OUT"}
# One mixed engine step of the small preset (Pallas attention on a GPU) against its roofline.
timeout 200 "$PY" scripts/bench_forward.py --preset small ${OUT:+--json "$OUT/bench_forward.json"}
