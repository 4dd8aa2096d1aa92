#!/usr/bin/env bash
# Creates (or completes) the side venv holding Monarch's own tensor engine, torchmonarch 0.7.0,
# for the `tensor_vs_monarch` benchmark rows. Idempotent: a step already done is skipped.
# Lives outside the repo: $MNB_PEER_VENV, default ~/.cache/monarch_nb/peer-monarch.
# torch 2.13.0's CPU wheel goes in first, torchmonarch with --no-deps, then its other
# requirements with torch pinned beside them, so nothing can pull a CUDA torch or nvidia-*.
# Optional: PYTHON (default python3.11; the wheel is cp311), TORCHMONARCH_WHEEL (a wheel already
# downloaded with `pip download --no-deps torchmonarch==0.7.0`). Not run by CI.
# Prints the venv's path on its last line.
set -euo pipefail

VENV="${MNB_PEER_VENV:-$HOME/.cache/monarch_nb/peer-monarch}"
PY="${PYTHON:-python3.11}"
TORCH="torch==2.13.0+cpu" # "+cpu": where that wheel is not on offer pip fails, never takes CUDA's
# torchmonarch 0.7.0's Requires-Dist, less its extras (torch is not among them)
DEPS=(pyzmq "pyarrow>=17" requests "numpy>=1.26" pyre-extensions "typing-extensions>=4.12"
      cloudpickle lark tabulate opentelemetry-api clusterscope "flask>=2.0" py-spy xxhash)

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet "$@"; }

# the requirements given as arguments that are not installed, one a line
absent() {
    "$VENV/bin/python" - "$@" <<'PY'
import re, sys
from importlib import metadata
for req in sys.argv[1:]:
    try:
        metadata.version(re.split(r"[<>=!~;]", req)[0])
    except metadata.PackageNotFoundError:
        print(req)
PY
}

no_nvidia() {
    if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
        echo "refusing: nvidia-* packages are in $VENV ($1); remove the venv" >&2
        exit 1
    fi
}

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" \
        >/dev/null 2>&1; then
    pip_install "$TORCH"
fi
no_nvidia "a CUDA torch?"

if [ -n "$(absent torchmonarch)" ]; then
    pip_install --no-deps "${TORCHMONARCH_WHEEL:-torchmonarch==0.7.0}"
fi

mapfile -t missing < <(absent "${DEPS[@]}")
if [ "${#missing[@]}" -gt 0 ]; then
    pip_install "${missing[@]}" "$TORCH"
fi
no_nvidia "pulled by a requirement"

"$VENV/bin/python" -c "import monarch, torch; print('torchmonarch ok, torch', torch.__version__)" >&2
echo "$VENV"
