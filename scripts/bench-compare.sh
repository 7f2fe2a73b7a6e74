#!/usr/bin/env bash
# Before and after a change that should not move performance (a restructure): the same
# benchmarks on two release binaries, alternated round by round (before/after, then after/before,
# ...), so drift in the machine's load falls on both builds alike. Prints, per figure, each
# build's median and range over the rounds, and whether the after-build's median stays inside
# the before-build's range. The raw JSON of every run is kept in OUT.
#
#   scripts/bench-compare.sh BEFORE_BIN AFTER_BIN [OUT] [ROUNDS]
#
# Build the binaries from two checkouts (each `cargo build --release --bin tern`). ROUNDS is 3 by
# default. Each round runs, per build: `tern bench scheduler --json`,
# `tern bench io --quick --runs 1 --seconds 1 --systems tern-tcp,tern-nvme --json` and
# `tern terasort --size 1GiB --json`: under 2 minutes a round (both builds) on 2 cores.
set -euo pipefail

before=${1:?usage: bench-compare.sh BEFORE_BIN AFTER_BIN [OUT] [ROUNDS]}
after=${2:?usage: bench-compare.sh BEFORE_BIN AFTER_BIN [OUT] [ROUNDS]}
out=${3:-$(mktemp -d /tmp/tern-bench-compare.XXXXXX)}
rounds=${4:-3}
for bin in "$before" "$after"; do
    [ -x "$bin" ] || { echo "bench-compare: $bin is not an executable tern binary" >&2; exit 2; }
done
mkdir -p "$out"
scratch=$(mktemp -d /tmp/tern-bench-scratch.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

run_build() { # NAME BIN ROUND
    local name=$1 bin=$2 round=$3
    echo "bench-compare: round $round, $name build" >&2
    "$bin" bench scheduler --json > "$out/$name-$round-scheduler.json"
    "$bin" bench io --quick --runs 1 --seconds 1 --systems tern-tcp,tern-nvme --dir "$scratch" --no-progress \
        --json "$out/$name-$round-io.jsonl" > /dev/null
    "$bin" terasort --size 1GiB --json > "$out/$name-$round-terasort.json"
}

for round in $(seq 1 "$rounds"); do
    if [ $((round % 2)) -eq 1 ]; then
        run_build before "$before" "$round"; run_build after "$after" "$round"
    else
        run_build after "$after" "$round"; run_build before "$before" "$round"
    fi
done

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def figures(name, r):
    f = {}
    s = json.load(open(f"{out}/{name}-{r}-scheduler.json"))
    f["bench scheduler tiny tasks/s"] = s["tasks_per_s"]
    f["bench scheduler whole-CPU tasks/s"] = s["whole_cpu_tasks_per_s"]["median"]
    f["bench scheduler cold start p50 ms"] = s["cold_start_ms_p50"]
    t = json.load(open(f"{out}/{name}-{r}-terasort.json"))
    if not (t["sorted"] and t["input_checksum"] == t["output_checksum"]):
        sys.exit(f"bench-compare: {name} round {r}: terasort output is not valid")
    f["terasort 1 GiB sort MB/s"] = t["sort_mb_per_s"]
    for line in open(f"{out}/{name}-{r}-io.jsonl"):
        c = json.loads(line)
        size = f"{c['size_bytes'] >> 20} MiB" if c["size_bytes"] >= 1 << 20 else f"{c['size_bytes'] >> 10} KiB"
        f[f"io {c['system']} {c['op']} {size} x{c['concurrency']} MiB/s"] = c["throughput_mib_s"]
    return f

runs = {n: [figures(n, r) for r in range(1, rounds + 1)] for n in ("before", "after")}
inside = 0
print(f"| figure | before: median (min-max) | after: median (min-max) | after's median in before's range |")
print("| --- | --- | --- | --- |")
for key in runs["before"][0]:
    b = [f[key] for f in runs["before"]]
    a = [f[key] for f in runs["after"]]
    ok = min(b) <= statistics.median(a) <= max(b)
    inside += ok
    fmt = lambda v: f"{statistics.median(v):,.3g} ({min(v):,.3g}-{max(v):,.3g})"
    print(f"| {key} | {fmt(b)} | {fmt(a)} | {'yes' if ok else 'NO'} |")
print(f"\n{inside} of {len(runs['before'][0])} figures: the after-build's median inside the before-build's range ({rounds} rounds, raw JSON in {out})")
EOF
