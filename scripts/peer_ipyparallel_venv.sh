#!/usr/bin/env bash
# Creates (or completes) the side venv holding ipyparallel, for the `broadcast_vs_ipyparallel`
# benchmark row (benchmarks/scale_ipp.py). Idempotent: a step already done is skipped.
# Lives outside the repo: $MNB_IPP_VENV, default ~/.cache/monarch_nb/peer-ipyparallel.
# No torch: the engines run a no-op. Optional: PYTHON (default python3),
# IPYPARALLEL (the requirement, default ipyparallel==9.2.0). Not run by CI.
# Prints the venv's path on its last line.
set -euo pipefail

VENV="${MNB_IPP_VENV:-$HOME/.cache/monarch_nb/peer-ipyparallel}"
PY="${PYTHON:-python3}"
REQ="${IPYPARALLEL:-ipyparallel==9.2.0}"

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c "import ipyparallel" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet "$REQ" psutil
fi

"$VENV/bin/python" -c "import ipyparallel; print('ipyparallel ok', ipyparallel.__version__)" >&2
echo "$VENV"
