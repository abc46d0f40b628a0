#!/usr/bin/env bash
# Installs real SGLang from PyPI into its own virtualenv, for the `sglang` test tier on CPU.
#
# SGLang pins its own torch and transformers, so it never shares megarl's environment; the venv
# lives outside the repository (default ~/.cache/megarl/sglang-venv, ~11 GB, ~2 min the first
# time with uv). Idempotent: a complete venv (stamp file) with the pinned version is reused at once.
# The last line of stdout is the venv's python; progress goes to stderr.
#
#   tools/sglang_cpu/install.sh
#   MEGARL_SGLANG_VENV=/path MEGARL_SGLANG_VERSION=0.5.23 tools/sglang_cpu/install.sh
set -euo pipefail

VERSION="${MEGARL_SGLANG_VERSION:-0.5.23}"
VENV="${MEGARL_SGLANG_VENV:-$HOME/.cache/megarl/sglang-venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.megarl-sglang-$VERSION"

if [[ -f "$STAMP" && -x "$PY" ]]; then
    echo "$PY"
    exit 0
fi

echo "[sglang_cpu] installing sglang==$VERSION into $VENV (one-time: 1-3 min with uv, ~11 GB)" >&2
# A venv's scripts hard-code its path, so it is built in place; without the stamp (an earlier
# install was cut short) it is started over.
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"${MEGARL_SGLANG_BASE_PYTHON:-python3}" -m venv "$VENV"
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# uv downloads the ~11 GB in parallel: ~2 min here where pip took ~8; pip is the fallback.
if quiet "$PY" -m pip install -q uv >&2; then
    "$PY" -m uv pip install --python "$PY" -q "sglang==$VERSION" >&2
else
    quiet "$PY" -m pip install -q --progress-bar off "sglang==$VERSION" >&2
fi
"$PY" - >&2 <<EOF
import importlib.metadata as m
got = m.version("sglang")
assert got == "$VERSION", f"installed sglang {got}, wanted $VERSION"
print("[sglang_cpu] sglang", got, "torch", m.version("torch"), "transformers", m.version("transformers"))
EOF
touch "$STAMP"
echo "$PY"
