#!/usr/bin/env bash
# Knob embedding_cache_overlap on one GPU (benchmarks/h200_knob_ab.sh): the GPU tests of the caches, the store
# (overlap trains bitwise as without it) and overlap itself; profiles and `sg-opt bench --vs` of BASE (default:
# the 2026-12-02 large-cached run's best) without and with it.
# Usage: OUT=/dir [BASE=...] [SIZE=large-cached] [BLOCKS=10] [PARTS=...] bash benchmarks/h200_cache_overlap.sh
SET="embedding_cache_overlap = true" \
BASE=${BASE:-docs/results/2026-12-02-h200-large-cached-s20/best_config.toml} \
TESTS="tests/haste_rec/test_cache.py tests/haste_rec/test_embeddings.py tests/haste_rec/test_cache_overlap.py" \
    exec bash "$(dirname "$0")/h200_knob_ab.sh"
