#!/usr/bin/env bash
# Accuracy of the bundled reference model with a full cache: inside its 2,048-token window
# (context 1,900 tokens + question + answer <= 2,048 positions), and at 4x / 16x the window.
# Run from the repository root on CPU:  bash benchmarks/reference-model/run.sh
set -euo pipefail
out=records/reference-model
in_window="--lengths 1900 --depths 0.05,0.15,0.25,0.35,0.45,0.55,0.65,0.75,0.85,0.95 --method full --device cpu"
kvpot eval passkey $in_window --samples 10 --out $out/passkey-window
kvpot eval niah    $in_window --samples 10 --out $out/niah-window
few="--lengths 1900 --depths 0.05,0.5,0.95 --samples 10 --method full --device cpu"
kvpot eval niah $few --task-set num_keys=4   --out $out/niah-multikey-window
kvpot eval niah $few --task-set num_values=4 --out $out/niah-multivalue-window
kvpot eval kv     $few --out $out/kv-window
kvpot eval vt     $few --out $out/vt-window
kvpot eval recall $few --out $out/recall-window
beyond="--method full --depths 0.1,0.5,0.9 --device cpu"
kvpot eval passkey $beyond --lengths 8k  --samples 4 --out $out/passkey-8k
kvpot eval niah    $beyond --lengths 8k  --samples 4 --out $out/niah-8k
kvpot eval passkey $beyond --lengths 32k --samples 2 --out $out/passkey-32k
kvpot eval niah    $beyond --lengths 32k --samples 2 --out $out/niah-32k
