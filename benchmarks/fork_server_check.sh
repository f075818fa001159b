#!/usr/bin/env bash
# The fork server's and the parameter digest's tests on this machine's GPU, written to $1; exits non-zero where
# they fail, so that a caller starts its workers as plain subprocesses:
#   bash benchmarks/fork_server_check.sh "$OUT/fork_server_check.txt" || export SG_OPT_FORK_SERVER=0
# On a GPU they include the CUDA tests: a forked child gets its own GPU; a device tensor digests as its host copy.
set -uo pipefail
if ! python3 -m pytest -q -p no:cacheprovider tests/test_fork_server.py tests/test_digest.py > "$1" 2>&1; then
    echo "fork server tests failed: workers start as plain subprocesses" | tee -a "$1"
    exit 1
fi
