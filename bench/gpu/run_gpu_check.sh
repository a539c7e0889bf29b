#!/usr/bin/env bash
# The GPU route's check on a GPU machine (python -m concerto_jax.gpu_check), in two halves.
#
#   bash bench/gpu/run_gpu_check.sh prepare   # HERE, on a CPU machine, from the repo root
#   bash bench/gpu/run_gpu_check.sh device    # THERE: the command the GPU machine runs
#
# prepare: (1) the wheels the GPU machine lacks into .whl/ (it has Python 3.12, jax/jaxlib and
#   the CUDA plugin 0.11.2, flax, optax, numpy, pandas, absl-py, typing-extensions; no ortools,
#   no network): ortools and its missing dependencies (immutabledict; protobuf at the version
#   ortools was built against) plus this project's own wheel; (2) the calibration modules of
#   every suite case into .gpu_prepared/ (the modules before XLA's pipeline, stock's and ours,
#   which the GPU compiles with its autotuning; and XLA's deviceless scheduled modules), made
#   with jax 0.11.2, the GPU machine's version
#   ($PREPARE_PYTHON, default /work/venv0112/bin/python); (3) the CPU half of gpu_check.
#   Both folders are ignored by git (.gitignore); copy them to the GPU machine with the repository.
# device [ARGS]: installs the wheels into /tmp/site, runs gpu_check with that machine's own JAX
#   within 8 minutes ($GC_BUDGET_S, default 420 s, inside $GC_TIMEOUT_S, default 480 s; ARGS go to
#   gpu_check, e.g. `--items c --cases NAMES` for a second run on the same machine), and leaves at
#   most 8 files in $OUT/gc (checks, calibration tables, the log, the raw profiles as one tar.gz).
#
# probe: bench/gpu/dispatch_probe.py into $OUT/probe (plain jit vs the route vs optimize).
# nccl: bench/gpu/nccl_tuner_probe.py into $OUT/nccl (our NCCL tuner plugin in the machine's NCCL;
#   built there, or the copy prepare built into .gpu_prepared/nccl_tuner/).
# gemms: bench/gpu/gemm_sweep.py into $OUT/gemms (GEMM time by shape and dtype).
# split: bench/gpu/split_cost_probe.py into $OUT/split (a split's compute cost, several compiles).
# cache: bench/gpu/route_cache_probe.py into $OUT/cache (optimize twice over one cache directory).
#
# On the GPU machine, from the repository root (about 10 minutes; a limit of 560 s):
#   bash bench/gpu/run_gpu_check.sh device
# A re-check of the route's speed (about 3 minutes; a limit of 360 s): item a and b, then the probe:
#   GC_BUDGET_S=120 GC_TIMEOUT_S=170 bash bench/gpu/run_gpu_check.sh device --items a,b;
#   bash bench/gpu/run_gpu_check.sh probe
set -euo pipefail

ORTOOLS=9.15.6755
IMMUTABLEDICT=4.3.1
PROTOBUF=6.33.6

prepare() {
    local py="${PREPARE_PYTHON:-/work/venv0112/bin/python}"
    rm -rf .whl && mkdir -p .whl
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        "ortools==$ORTOOLS" "immutabledict==$IMMUTABLEDICT" "protobuf==$PROTOBUF"
    "$py" -m pip wheel --quiet --no-deps -w .whl .
    ls -la .whl
    rm -rf .gpu_prepared
    JAX_PLATFORMS=cpu "$py" -m concerto_jax.gpu_check --prepare .gpu_prepared --cases all \
        --out .gpu_prepared/report
    JAX_PLATFORMS=cpu "$py" -m concerto_jax.gpu_check --out .gpu_prepared/cpu_half
    "$py" -c 'import sys; from concerto_jax.autoccl import plugin; plugin.build(sys.argv[1])' .gpu_prepared/nccl_tuner
    du -sh .whl .gpu_prepared
}

install() {  # the carried wheels, once per machine
    if [ ! -f /tmp/site/.installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        touch /tmp/site/.installed
    fi
}

script() {  # script NAME TIMEOUT_S FILE SHOW...: bench/gpu/FILE --out $OUT/NAME, its log in $OUT/NAME/log,
    # the lines SHOW (a command reading the log on stdin) printed; exits with the script's status
    local name=$1 limit=$2 file=$3
    shift 3
    local out="${OUT:-/tmp/out}/$name"
    mkdir -p "$out"
    install
    set +e
    PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 timeout "$limit" \
        python3 "bench/gpu/$file" --out "$out" > "$out/log" 2>&1
    local rc=$?
    "$@" < "$out/log"
    set -e
    return "$rc"
}

probe() {  # where optimize's step time goes (bench/gpu/dispatch_probe.py): about a minute
    script probe "${PROBE_TIMEOUT_S:-150}" dispatch_probe.py sh -c 'grep dispatch_probe | tail -14'
}

nccl() {  # the NCCL tuner plugin in the machine's own NCCL: about 30 s
    script nccl "${NCCL_TIMEOUT_S:-150}" nccl_tuner_probe.py tail -5
}

gemms() {  # GEMM time by shape and dtype (bench/gpu/gemm_sweep.py): about two minutes
    script gemms "${GEMM_TIMEOUT_S:-200}" gemm_sweep.py sh -c 'grep gemm_sweep | tail -40'
}

cache() {  # optimize's plan cache across a restart (bench/gpu/route_cache_probe.py): about a minute
    script cache "${CACHE_TIMEOUT_S:-150}" route_cache_probe.py sh -c 'grep route_cache_probe | tail -4'
    local rc=$?
    rm -rf "${OUT:-/tmp/out}/cache/cache"  # the cached executables stay there
    return "$rc"
}

split() {  # a split's compute cost against compile-to-compile noise (bench/gpu/split_cost_probe.py)
    script split "${SPLIT_TIMEOUT_S:-200}" split_cost_probe.py tail -12
}

device() {
    local out="${OUT:-/tmp/out}/gc"
    mkdir -p "$out"
    install
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader || true
        # bitwise comparisons need deterministic kernels (scatter-add without atomics), in plain
        # jit too. Only with a GPU: without one (a rehearsal) XLA cannot autotune, and with this
        # flag its deviceless compile finds no GEMM config ("Failed to get configs").
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_exclude_nondeterministic_ops=true"
    fi
    python3 -c "import jax, ortools; print('jax', jax.__version__, jax.devices(), 'ortools', ortools.__version__)"
    set +e
    timeout "${GC_TIMEOUT_S:-480}" python3 -m concerto_jax.gpu_check --out "$out" --prepared .gpu_prepared \
        --budget-s "${GC_BUDGET_S:-420}" "$@" 2>&1 | tee "$out/gc.log"
    local rc=${PIPESTATUS[0]}
    set -e
    if [ -d "$out/profile" ]; then  # one file of at most 16 MB comes back: the first cases' profiles
        tar -czf "$out/profile.tar.gz" -C "$out" profile
        if [ "$(stat -c %s "$out/profile.tar.gz")" -gt 15000000 ]; then
            tar -czf "$out/profile.tar.gz" -C "$out" $(cd "$out" && ls -d profile/* | head -4)
        fi
        rm -rf "$out/profile"
    fi
    ls -la "$out"
    return "$rc"
}

case "${1:-}" in
    prepare) prepare ;;
    device) shift; device "$@" ;;
    probe) probe ;;
    nccl) nccl ;;
    gemms) gemms ;;
    split) split ;;
    cache) cache ;;
    *) echo "usage: $0 prepare|device [ARGS]|probe|nccl|gemms|split|cache" >&2; exit 2 ;;
esac
