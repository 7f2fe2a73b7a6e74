#!/usr/bin/env bash
# Makes sure pyspark VERSION is installed in a venv of its own and prints the venv's directory:
#   spark-shuffle/pyspark-venv.sh 4.3.0   -> ~/.cache/tern/pyspark/4.3.0
# Its Python is DIR/bin/python; its Spark (SPARK_HOME: bin/spark-submit, jars/) is the pyspark
# package inside. The cache (TERN_PYSPARK_CACHE, default ~/.cache/tern/pyspark) outlives a clone,
# as TPC-DS data under ~/.cache/tern/tpcds does: each version is downloaded (about 400 MB) once per
# machine. A venv whose pyspark is not VERSION (an install cut short) is made again.
set -euo pipefail
version=${1:?usage: spark-shuffle/pyspark-venv.sh VERSION}
cache=${TERN_PYSPARK_CACHE:-$HOME/.cache/tern/pyspark}
venv="$cache/$version"
has() {
    "$venv/bin/python" -c "import pyspark, sys; sys.exit(pyspark.__version__ != '$version')" 2>/dev/null
}
if ! has; then
    echo "installing pyspark==$version into $venv (once per machine)..." >&2
    mkdir -p "$cache"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "pyspark==$version" >&2
    has || { echo "spark-shuffle/pyspark-venv.sh: pyspark==$version did not install into $venv" >&2; exit 1; }
fi
echo "$venv"
