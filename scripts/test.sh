#!/usr/bin/env bash
# Every check a change must pass: formatting, lints, and all tests (unit and black-box).
# Installs what it needs; safe to run on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's time, printed as it ends and all together when the script exits (passed or not):
# where CI's time goes (budget: 45 minutes on 2 cores).
step_name="" step_started=$SECONDS steps=""
step() {
    if [ -n "$step_name" ]; then
        local took=$((SECONDS - step_started))
        steps+=$(printf '  %-10s %3dm%02ds' "$step_name" $((took / 60)) $((took % 60)))$'\n'
        echo "test.sh: $step_name took $((took / 60))m$((took % 60))s" >&2
    fi
    step_name=$1 step_started=$SECONDS
}
report_times() {
    step ""
    printf "test.sh: steps (%dm%02ds in all):\n%s" $((SECONDS / 60)) $((SECONDS % 60)) "$steps" >&2
    # The tests step's own breakdown, once it has run (nextest's JUnit report, .config/nextest.toml).
    [ ! -f target/nextest/ci/junit.xml ] || python3 scripts/slowest-tests.py 15 >&2 || true
}
trap report_times EXIT

step setup

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
apt_install() {
    $sudo apt-get update
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@"
}

if ! cargo nextest --version >/dev/null 2>&1; then
    echo "installing cargo-nextest..." >&2
    cargo install cargo-nextest --locked
fi
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt clippy

# `tern bench io` measures a real redis-server beside Tern; its test requires one here.
if ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server..." >&2
    apt_install redis-server
fi
export TERN_TEST_REQUIRE_REDIS=1

# The multi-host tests make network namespaces, veths and a bridge (ip) and slow links (tc).
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    echo "installing iproute2..." >&2
    apt_install iproute2
fi

# .ci/run compiles C through ccache (CC="ccache cc").
if [[ "${CC:-}" == ccache* ]] && ! command -v ccache >/dev/null 2>&1; then
    echo "installing ccache..." >&2
    apt_install ccache
fi

# The test build carries RDMA (the `rdma` feature: verbs through rdma-sys, which needs headers and
# libclang), so the RDMA step below and the container image use the very binary the tests run.
# Built without it, the tests and the RDMA step each rebuilt every crate above tern-rdma (about
# 4 minutes each in CI).
bash scripts/rdma-deps.sh
features=(--features tern/rdma)

# The pyspark installs (about 400 MB each, network and disk more than CPU) run in the background
# beside the lint and the builds instead of in the Spark steps' time; the Spark steps wait for them.
pyspark_log=$(mktemp /tmp/tern-pyspark-install.XXXXXX)
(
    python3 -c 'import pyspark, sys; sys.exit(pyspark.__version__ != "3.5.3")' 2>/dev/null \
        || python3 -m pip install --user --quiet pyspark==3.5.3 py4j==0.10.9.7
    # 4.3.0 for the plugin's Spark 4 jar and suite; the others for the Spark 4 smoke test.
    for version in 4.3.0 4.0.5 4.1.4 4.2.1; do spark-shuffle/pyspark-venv.sh "$version" >/dev/null; done
) >"$pyspark_log" 2>&1 &
pyspark_installs=$!

step lint
cargo fmt --all --check
cargo clippy --workspace --all-targets "${features[@]}" -- -D warnings
bash scripts/check-layout.sh

# Every test binary and `tern` itself, built once with the whole workspace's features (a plain
# `cargo build --bin tern` unifies fewer features, so the test build would then rebuild tokio and
# everything above it: 5 minutes in CI).
step build
cargo nextest run --workspace --profile ci --no-run "${features[@]}"

# The Spark plugin jars the tests run (`build.sh --tests`: the x86_64 native library is the test
# build's; aarch64 is cross-built against glibc 2.17 with cargo-zigbuild, unoptimised): built in
# the background from here, beside the deploy step (apt, debootstrap and image layers: disk and
# network more than CPU), so the Spark tests' own call of `build.sh --tests` finds them done
# instead of spending their time limit on it. build.sh compiles against pyspark 3.5.3's jars and
# 4.3.0's (in its venv under ~/.cache/tern/pyspark, installed there once per machine). The RDMA
# step's cargo call waits for cargo's lock on target/ while the cross build holds it.
jars_log=$(mktemp /tmp/tern-spark-jars.XXXXXX)
(
    # The pyspark installs are this shell's job, not the subshell's: it cannot `wait` for them.
    while kill -0 "$pyspark_installs" 2>/dev/null; do sleep 1; done
    bash spark-shuffle/build.sh --tests
) >"$jars_log" 2>&1 &
spark_jars=$!

# deploy/: manifests rendered and validated, systemd units verified, and the container image
# built from that debug binary and smoke-tested.
step deploy
bash deploy/check.sh
$sudo bash deploy/image/build.sh --profile debug

# RDMA over soft-RoCE in a QEMU guest: takes the test build's `tern` (the build there is a no-op)
# and a Debian kernel (downloaded when missing), runs the RDMA checks in the guest (hard limit
# 420 s), and prints `rdma-test: PASS` or FAIL; 1m48s in a fresh clone here.
step rdma
bash scripts/rdma-test.sh

# What is left of the jars' build (above) once RDMA is done.
step spark-jars
wait "$pyspark_installs" || { echo "test.sh: installing pyspark failed:" >&2; cat "$pyspark_log" >&2; exit 1; }
wait "$spark_jars" || { echo "test.sh: spark-shuffle/build.sh --tests failed:" >&2; cat "$jars_log" >&2; exit 1; }

step tests
# Every JVM the tests start (Spark drivers and executors, through pyspark, local-cluster, Tern's
# executors and the benches) compiles with C1 only: they live seconds to minutes, and C2's
# compiler threads on 2 cores cost more than its faster code gives back. Measured on 2026-12-02:
# spark::the_small_jobs_bench_compares_results_and_times 78.5 s with the default tiers, 46.6 s with
# C1 only. (Each JVM prints "Picked up JAVA_TOOL_OPTIONS" on stderr.) The benchmarks themselves
# run without it.
export JAVA_TOOL_OPTIONS="-XX:TieredStopAtLevel=1"
cargo nextest run --workspace --profile ci "${features[@]}"
