#!/usr/bin/env bash
# Offline install of megarl from this kit folder (built by tools/gpu/build_kit.py) on a machine
# that already has a CUDA build of torch, then the GPU test tier. No package index is contacted.
#
#   bash install_and_test.sh [RESULT_FILE]        (default: ./gpu_tier_result.txt beside this script)
#
# Environment: PYTHON (default python3), WORK (default ./work beside this script: the unpacked
# source tree, pytest's log and junit XML), PIP_ARGS (extra pip flags, e.g. --user).
# The result file records the machine (GPU, torch, CUDA, Python), what pip installed, every
# test's outcome with the numbers it measured, and pytest's exit status. Exit status: pytest's.
set -u
KIT=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
WORK=${WORK:-$KIT/work}
RESULT=${1:-$KIT/gpu_tier_result.txt}
mkdir -p "$WORK"
RESULT=$(cd "$(dirname "$RESULT")" && pwd)/$(basename "$RESULT")

{
  echo "# megarl GPU tier, $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname)"
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    print(f"gpu {i}:", torch.cuda.get_device_name(i))
EOF
} > "$RESULT" 2>&1 || { echo "torch is not importable with $PY; see $RESULT"; exit 3; }

# --no-index: the kit folder is the only source; what the machine has already is kept.
if ! "$PY" -m pip install --no-index --find-links "$KIT" ${PIP_ARGS:-} "megarl" pytest \
      > "$WORK/pip.log" 2>&1; then
  { echo "pip install FAILED (tail of $WORK/pip.log):"; tail -n 30 "$WORK/pip.log"; } >> "$RESULT"
  cat "$RESULT"
  exit 4
fi
{ echo "installed:"; grep -E "^Successfully installed" "$WORK/pip.log" || echo "(nothing new)"; } >> "$RESULT"

rm -rf "$WORK/src" && mkdir -p "$WORK/src"
tar -xzf "$KIT/megarl-src.tar.gz" -C "$WORK/src"
cd "$WORK/src" || exit 5
"$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider --junitxml="$WORK/junit.xml" > "$WORK/pytest.log" 2>&1
rc=$?
"$PY" "$WORK/src/tools/gpu/summarize_junit.py" "$WORK/junit.xml" >> "$RESULT" 2>&1
{ echo "pytest exit status: $rc"; echo "--- tail of $WORK/pytest.log"; tail -n 40 "$WORK/pytest.log"; } >> "$RESULT"
cat "$RESULT"
exit $rc
