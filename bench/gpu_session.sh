#!/bin/bash
# One call on a lent CUDA machine (the device tool; see the note on issue 25): build the extension, run the
# Triton tests on the GPU, then bench_gpu.py with its table under $OUT. Steps as arguments, in order:
#     bash bench/gpu_session.sh tests bench profile families variants   (each bounded: TESTS_T, BENCH_T, PROFILE_T,
#                                                                         FAMILIES_T, VARIANTS_T s)
# A built extension carried in .dev/so/ (from an earlier call's $OUT) skips the build. BENCH_ARGS: more arguments
# for bench_gpu.py (e.g. --tune); BENCH_MD: the page it writes (default docs/results/gpu.md); PROFILE_ARGS: profile_gpu.py's (default --codecs; e.g. "--codecs --set
# CODEC_CHANNELS=32"); FAMILIES_ARGS: bench_gpu_families.py's (e.g. "--prompts 4096 --families DeepSeek"); TEST_FILES: the tests to run (default: the eight Triton test files); TEST_K: a pytest -k
# expression to choose among them.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # kvcx from this checkout (not installed there)
OUT=${OUT:-/tmp/kvcx-gpu}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
if ls .dev/so/_v*.so >/dev/null 2>&1 && cp .dev/so/_v*.so kvcx/codecs/cpu/ && python3 -c "import kvcx.codecs.cpu"
then
  log "extension carried"
else
  log build; python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  if ! ls kvcx/codecs/cpu/_v*.so >/dev/null 2>&1; then   # a setuptools too old for pyproject's metadata: without it
    mv pyproject.toml /tmp/kvcx-pyproject.toml && python3 setup.py -q build_ext --inplace 2>&1 | tail -3
    mv /tmp/kvcx-pyproject.toml pyproject.toml
  fi
  cp kvcx/codecs/cpu/_v*.so "$OUT"/ && log built
fi
python3 -c "import kvcx.codecs.cpu as c; print('kernels', c.variant)" || exit 1
for step in "$@"; do
  case $step in
    tests) log tests; timeout "${TESTS_T:-240}" python3 -m pytest -q -x -rs -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} \
             ${TEST_FILES:-tests/cache/test_static_cache.py tests/codecs/test_triton.py tests/codecs/test_paged.py \
             tests/codecs/test_triton_compile.py tests/cache/test_device_cache.py tests/test_bench_gpu.py \
             tests/codecs/test_triton_widths.py tests/codecs/test_triton_e8p.py} 2>&1 | tee "$OUT"/tests.log | tail -30 ;;
    bench) log bench; md=${BENCH_MD:-docs/results/gpu.md}
           timeout "${BENCH_T:-540}" python3 -m bench.bench_gpu ${BENCH_ARGS:-} --markdown "$md" \
             2>&1 | tee "$OUT"/bench.log | tail -60; cp "$md" "$OUT"/ ;;
    profile) log profile; timeout "${PROFILE_T:-180}" python3 -m bench.profile_gpu ${PROFILE_ARGS:---codecs} --markdown docs/results/gpu-profile.md \
             2>&1 | tee "$OUT"/profile.log | tail -40; cp docs/results/gpu-profile.md "$OUT"/ ;;
    families) log families; timeout "${FAMILIES_T:-240}" python3 -m bench.bench_gpu_families ${FAMILIES_ARGS:-} \
             --markdown docs/results/gpu-families.md 2>&1 | tee "$OUT"/families.log | tail -20
             cp docs/results/gpu-families.md "$OUT"/ ;;
    variants) log variants; timeout "${VARIANTS_T:-240}" python3 -m bench.bench_gpu --skip attention bandwidth \
             generate --variants --markdown "$OUT"/variants.md 2>&1 | tee "$OUT"/variants.log | tail -30 ;;
    *) echo "unknown step $step (tests, bench, profile, families, variants)"; exit 2 ;;
  esac
done
log done
