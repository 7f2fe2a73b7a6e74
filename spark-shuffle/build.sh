#!/usr/bin/env bash
# Builds Tern's Spark shuffle plugin: the native library (cargo) and the Java classes (javac
# against pyspark 3.5.3's jars), packaged as one jar with the library inside.
#   spark-shuffle/build.sh [--release] [--host]   -> target/tern-spark/tern-spark.jar (path printed)
#
# By default the library is built for Linux on x86_64 and aarch64 against glibc 2.17 (with
# cargo-zigbuild, installed from PyPI into target/zigbuild-venv when missing), so the jar loads on
# the cluster images people run, not only on this machine; each .so is checked to need no newer
# glibc, and lands in the jar at native/linux-<arch>/libtern_spark.so. Where the aarch64 Rust
# target cannot be installed, the jar is built for x86_64 alone and this says so on stderr.
# --host builds for this machine only, with plain cargo (quicker, for development; the jar then
# needs this machine's glibc). SPARK_HOME defaults to the installed pyspark package.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=debug
cargo_flags=()
host=0
for arg in "$@"; do
    case "$arg" in
        --release) profile=release; cargo_flags=(--release) ;;
        --host) host=1 ;;
        *) echo "spark-shuffle/build.sh: unknown argument $arg (expected --release, --host)" >&2; exit 2 ;;
    esac
done
# The oldest glibc the library may need: CentOS 7 / RHEL 7 and every newer distribution have it.
glibc=2.17
if [[ -z "${SPARK_HOME:-}" ]]; then
    SPARK_HOME="$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
fi
[[ -d "$SPARK_HOME/jars" ]] || { echo "no Spark jars under SPARK_HOME=$SPARK_HOME" >&2; exit 1; }

target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
out="$target_dir/tern-spark"
rm -rf "$out/classes" && mkdir -p "$out/classes/native"

# Copies a built library into the jar's tree for `arch`, without its debug info (llvm-objcopy,
# shipped with the Rust toolchain, reads every architecture; it needs the toolchain's libLLVM).
sysroot="$(rustc --print sysroot)"
objcopy="$sysroot/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/rust-objcopy"
add_library() {
    local arch=$1 built=$2
    mkdir -p "$out/classes/native/linux-$arch"
    LD_LIBRARY_PATH="$sysroot/lib" "$objcopy" --strip-debug "$built" "$out/classes/native/linux-$arch/libtern_spark.so"
    echo "linux-$arch" >> "$out/classes/native/platforms.txt"
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
    archs=(x86_64)
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
    PATH="$venv/bin:$PATH" cargo-zigbuild zigbuild -p tern-spark "${cargo_flags[@]}" "${targets[@]}" >&2
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

javac -nowarn -encoding UTF-8 --release 8 -cp "$SPARK_HOME/jars/*" -d "$out/classes" \
    $(find spark-shuffle/src/main/java -name '*.java') 2> >(grep -v '^warning: \[options\]' >&2)
# META-INF/services: Spark finds Tern's cluster manager (master tern:// or local-cluster-tern://) there.
cp -r spark-shuffle/src/main/resources/. "$out/classes/"
jar cf "$out/tern-spark.jar.tmp" -C "$out/classes" .
mv "$out/tern-spark.jar.tmp" "$out/tern-spark.jar"
echo "$out/tern-spark.jar"
