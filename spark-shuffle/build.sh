#!/usr/bin/env bash
# Builds Tern's Spark shuffle plugin: the native library (cargo) and, from one source tree, a jar
# per Spark line, each with the libraries inside:
#   spark-shuffle/build.sh [--release] [--host | --tests]
#     -> target/tern-spark/tern-spark-3.5.jar   Spark 3.5: Scala 2.12, javac --release 8 against
#                                               pyspark 3.5.3's jars
#     -> target/tern-spark/tern-spark-4.jar     Spark 4.0 to 4.3: Scala 2.13, javac --release 17
#                                               against pyspark 4.3.0's jars
#   (both paths printed, in that order).
# The sources: src/main/java (every line) plus src/spark3.5/java or src/spark4/java, the thin layer
# of what differs between lines (SparkLine; ARCHITECTURE.md, "Spark lines").
#
# By default the library is built for Linux on x86_64 and aarch64 against glibc 2.17 (with
# cargo-zigbuild, installed from PyPI into target/zigbuild-venv when missing), so the jar loads on
# the cluster images people run, not only on this machine; each .so is checked to need no newer
# glibc, and lands in each jar at native/linux-<arch>/libtern_spark.so. Where the aarch64 Rust
# target cannot be installed, the jars are built for x86_64 alone and this says so on stderr.
# --host builds for this machine only, with plain cargo (quicker, for development; the jars then
# need this machine's glibc).
# --tests makes the jars the test suite runs without building every dependency again: the x86_64
# library is the one the workspace's test build made (`cargo nextest run --workspace` links
# target/debug/deps/libtern_spark.so with the features the tests unify; this machine's glibc),
# and aarch64 is still cross-built against glibc 2.17 and checked, but unoptimised: it is never
# loaded here, only shown to build, link and need no newer glibc (in CI this saved the second
# optimised cross build, about 9 of the Spark jars' 13 minutes).
# SPARK35_HOME defaults to the installed pyspark package (3.5.x; SPARK_HOME if set); SPARK4_HOME to
# pyspark 4.3.0 in its venv under ~/.cache/tern/pyspark (spark-shuffle/pyspark-venv.sh installs it
# there once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=debug
cargo_flags=()
host=0
tests=0
for arg in "$@"; do
    case "$arg" in
        --release) profile=release; cargo_flags=(--release) ;;
        --host) host=1 ;;
        --tests) tests=1 ;;
        *) echo "spark-shuffle/build.sh: unknown argument $arg (expected --release, --host, --tests)" >&2; exit 2 ;;
    esac
done
if [[ "$tests" -eq 1 && ( "$host" -eq 1 || "$profile" == release ) ]]; then
    echo "spark-shuffle/build.sh: --tests takes the test build's library; it goes with neither --host nor --release" >&2
    exit 2
fi
# The oldest glibc the library may need: CentOS 7 / RHEL 7 and every newer distribution have it.
glibc=2.17
# Fails unless the Spark at $1 is the one a line compiles against (its spark-core jar's name
# begins with $2); $3 is the variable that names it.
spark_jars() {
    local home=$1 core=$2 variable=$3
    [[ -n "$(compgen -G "$home/jars/$core*.jar")" ]] || {
        echo "spark-shuffle/build.sh: no $core*.jar under $home/jars (set $variable to that Spark)" >&2
        exit 1
    }
}
SPARK35_HOME="${SPARK35_HOME:-${SPARK_HOME:-$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')}}"
spark_jars "$SPARK35_HOME" spark-core_2.12-3.5. SPARK35_HOME
if [[ -z "${SPARK4_HOME:-}" ]]; then
    venv4="$(spark-shuffle/pyspark-venv.sh 4.3.0)"
    SPARK4_HOME="$("$venv4/bin/python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
fi
spark_jars "$SPARK4_HOME" spark-core_2.13-4.3. SPARK4_HOME

target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
out="$target_dir/tern-spark"
# The libraries built, as ARCH=PATH, for the jars.
libraries=()
add_library() {
    libraries+=("$1=$2")
}

if [[ "$host" -eq 1 ]]; then
    cargo build -p tern-spark "${cargo_flags[@]}" >&2
    add_library "$(uname -m)" "$target_dir/$profile/libtern_spark.so"
else
    venv="$target_dir/zigbuild-venv"
    if ! "$venv/bin/cargo-zigbuild" --version >/dev/null 2>&1; then
        echo "installing cargo-zigbuild and zig from PyPI into $venv..." >&2
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet cargo-zigbuild ziglang
    fi
    archs=()
    if [[ "$tests" -eq 1 ]]; then
        built="$target_dir/debug/deps/libtern_spark.so"
        [[ -f "$built" ]] || {
            echo "spark-shuffle/build.sh --tests: no $built: build the tests first (cargo nextest run --workspace --no-run)" >&2
            exit 1
        }
        add_library x86_64 "$built"
        # Unoptimised: it is never loaded here, so only its build, link and glibc bound matter.
        cargo_flags=(--config 'profile.dev.opt-level=0' --config 'profile.dev.package."*".opt-level=0'
            --config 'profile.dev.debug=false')
    else
        archs=(x86_64)
    fi
    if rustup target list --installed | grep -qx aarch64-unknown-linux-gnu \
        || rustup target add aarch64-unknown-linux-gnu >&2; then
        archs+=(aarch64)
    else
        echo "WARNING: rustup cannot install the aarch64-unknown-linux-gnu target here:" \
            "the jar is built for linux-x86_64 ONLY and will not load on aarch64." >&2
    fi
    # One cargo run for every arch: build scripts and proc macros (host code) are built once.
    targets=()
    for arch in "${archs[@]}"; do targets+=(--target "$arch-unknown-linux-gnu.$glibc"); done
    if [[ ${#targets[@]} -gt 0 ]]; then
        PATH="$venv/bin:$PATH" cargo-zigbuild zigbuild -p tern-spark "${cargo_flags[@]}" "${targets[@]}" >&2
    fi
    for arch in "${archs[@]}"; do
        triple="$arch-unknown-linux-gnu"
        built="$target_dir/$triple/$profile/libtern_spark.so"
        # Every versioned glibc symbol the library binds must exist in glibc $glibc.
        newest=$(readelf -W --dyn-syms "$built" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n1)
        if [[ "$(printf '%s\n%s\n' "$newest" "$glibc" | sort -V | tail -n1)" != "$glibc" ]]; then
            echo "spark-shuffle/build.sh: $built needs glibc $newest, above $glibc" >&2
            exit 1
        fi
        echo "linux-$arch: libtern_spark.so needs glibc $newest at most" >&2
        add_library "$arch" "$built"
    done
fi

jars=("$out/tern-spark-3.5.jar" "$out/tern-spark-4.jar")
# Each Spark test calls this script: when both jars were built from these libraries, Sparks and
# sources (none newer than the first jar), they are printed as they are instead of compiled again.
inputs="$profile tests=$tests ${libraries[*]} $SPARK35_HOME $SPARK4_HOME"
if [[ -f "${jars[0]}" && -f "${jars[1]}" && "$(cat "$out/inputs" 2>/dev/null)" == "$inputs" ]] \
    && [[ -z "$(find spark-shuffle/src spark-shuffle/build.sh "${libraries[@]#*=}" -newer "${jars[0]}" -print -quit)" ]]; then
    printf '%s\n' "${jars[@]}"
    exit 0
fi

# (tern-spark.jar: the one jar of Spark 3.5 only, before the lines; removed so nothing runs it stale.)
rm -rf "$out/classes" "$out/native" "$out/tern-spark.jar" "$out/inputs" "${jars[@]}" && mkdir -p "$out/native"
# Each library goes into the jars' tree without its debug info (llvm-objcopy, shipped with the
# Rust toolchain, reads every architecture; it needs the toolchain's libLLVM).
sysroot="$(rustc --print sysroot)"
objcopy="$sysroot/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/rust-objcopy"
for library in "${libraries[@]}"; do
    arch=${library%%=*}
    mkdir -p "$out/native/linux-$arch"
    LD_LIBRARY_PATH="$sysroot/lib" "$objcopy" --strip-debug "${library#*=}" "$out/native/linux-$arch/libtern_spark.so"
    echo "linux-$arch" >> "$out/native/platforms.txt"
done

# One jar per line: the common sources and the line's own, against that line's Spark jars; the
# same native libraries, META-INF/services (Spark finds Tern's cluster manager, master tern:// or
# local-cluster-tern://, there) and bench drivers (io.tern.spark.tools) in each.
build_jar() {
    local line=$1 release=$2 home=$3
    local classes="$out/classes-$line"
    rm -rf "$classes" && mkdir -p "$classes"
    javac -nowarn -encoding UTF-8 --release "$release" -cp "$home/jars/*" -d "$classes" \
        $(find spark-shuffle/src/main/java "spark-shuffle/src/spark$line/java" -name '*.java') \
        2> >(grep -v '^warning: \[options\]\|^Note: ' >&2)
    cp -r spark-shuffle/src/main/resources/. "$classes/"
    cp -r "$out/native" "$classes/native"
    jar cf "$out/tern-spark-$line.jar.tmp" -C "$classes" .
    mv "$out/tern-spark-$line.jar.tmp" "$out/tern-spark-$line.jar"
    echo "$out/tern-spark-$line.jar"
}
build_jar 3.5 8 "$SPARK35_HOME"
build_jar 4 17 "$SPARK4_HOME"
echo "$inputs" > "$out/inputs"
