#!/usr/bin/env bash
# The rules of the tree that no compiler checks (ARCHITECTURE.md, "Rooms"):
# - only tern-scheduler itself and the `tern` binary depend on the scheduler's policy and server
#   (`tern-scheduler`); whoever only calls the scheduler depends on `tern-scheduler-api`;
# - no production Rust file is over 900 lines (the lines above its `#[cfg(test)]` module): a
#   module that grows past that holds more than one concern and becomes a folder;
# - every crate-local clippy.toml repeats each `disallowed-methods` / `disallowed-types` entry of
#   the workspace's /clippy.toml unchanged: clippy reads only the clippy.toml nearest a crate, so a
#   crate with its own file would otherwise silently drop the workspace's rules.
# (Clock reads in the metadata state, the policy and the planner are refused by clippy's
# disallowed-methods, in the crate-local clippy.toml files.)
set -euo pipefail
cd "$(dirname "$0")/.."

cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
allowed = {"tern"}
bad = [p["name"] for p in json.load(sys.stdin)["packages"]
       if p["name"] not in allowed and any(d["name"] == "tern-scheduler" for d in p["dependencies"])]
if bad:
    sys.exit("check-layout: %s depend on tern-scheduler (the policy and server); depend on tern-scheduler-api" % ", ".join(bad))
'

git ls-files '*/clippy.toml' | python3 -c '
import sys, tomllib
keys = ("disallowed-methods", "disallowed-types")
with open("clippy.toml", "rb") as f:
    workspace = tomllib.load(f)
missing = []
for path in sys.stdin.read().split():
    with open(path, "rb") as f:
        local = tomllib.load(f)
    for key in keys:
        for entry in workspace.get(key, []):
            if entry not in local.get(key, []):
                missing.append("check-layout: %s lacks %s entry %r of /clippy.toml (clippy reads only the nearest clippy.toml: copy it unchanged)" % (path, key, entry))
if missing:
    sys.exit("\n".join(missing))
'

limit=900
over=0
while IFS= read -r file; do
    lines=$(awk '/^#\[cfg\(test\)\]/ { exit } { n++ } END { print n + 0 }' "$file")
    if [ "$lines" -gt "$limit" ]; then
        echo "check-layout: $file has $lines production lines (limit $limit): split it by concern" >&2
        over=1
    fi
done < <(git ls-files '*.rs' | grep -v '^fuzz/')
[ "$over" -eq 0 ] || exit 1
echo "check-layout: ok (scheduler dependents, crate-local clippy.toml copies, production files at most $limit lines)"
