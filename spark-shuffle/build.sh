#!/usr/bin/env bash
# Builds Tern's Spark shuffle plugin: the native library (cargo) and the Java classes (javac
# against pyspark 3.5.3's jars), packaged as one jar with the library inside.
#   spark-shuffle/build.sh [--release]      -> target/tern-spark/tern-spark.jar (path printed)
# SPARK_HOME defaults to the installed pyspark package (pip install pyspark==3.5.3).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=debug
cargo_flags=()
if [[ "${1:-}" == "--release" ]]; then
    profile=release
    cargo_flags=(--release)
fi
if [[ -z "${SPARK_HOME:-}" ]]; then
    SPARK_HOME="$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
fi
[[ -d "$SPARK_HOME/jars" ]] || { echo "no Spark jars under SPARK_HOME=$SPARK_HOME" >&2; exit 1; }

cargo build -p tern-spark "${cargo_flags[@]}" >&2
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
out="$target_dir/tern-spark"
rm -rf "$out/classes" && mkdir -p "$out/classes/native"
javac -nowarn -encoding UTF-8 --release 8 -cp "$SPARK_HOME/jars/*" -d "$out/classes" \
    $(find spark-shuffle/src/main/java -name '*.java') 2> >(grep -v '^warning: \[options\]' >&2)
cp "$target_dir/$profile/libtern_spark.so" "$out/classes/native/libtern_spark.so"
jar cf "$out/tern-spark.jar.tmp" -C "$out/classes" .
mv "$out/tern-spark.jar.tmp" "$out/tern-spark.jar"
echo "$out/tern-spark.jar"
