#!/usr/bin/env bash
# Run 107 (for the next session, on an H200 if one is lent): run 106's record (fused query
# prologue, steady timing), then the GPU reference tests of the fused path (dims cases; the
# whole class takes > 4 min).
set -u
out=$1
bash "$(dirname "$0")/run106.sh" "$out"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic and test_matches_reference and dims" > "$out/tests.log" 2>&1
echo "tests rc=$?"; tail -c 300 "$out/tests.log"; echo
