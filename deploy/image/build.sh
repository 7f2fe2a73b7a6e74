#!/usr/bin/env bash
# Builds Tern's container image with buildah (no Docker engine needed) and runs it once.
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() {
    cat <<'EOF'
usage: deploy/image/build.sh [--profile debug|release] [--tag NAME] [--no-smoke-test]

Builds Tern's one image for every role (entrypoint `tern`, user tern, uid 10001) from
deploy/image/Containerfile, on a minimal Debian base made here (debootstrap --variant=minbase of
this machine's Debian release, so the binary finds the glibc it was linked against, with the
verbs and rdma_cm libraries and providers its RDMA transport loads; imported with podman as
localhost/tern-base:<release>-verbs and reused by later runs), then runs it once:
`tern --version`, and `tern up` in a container (host network, free loopback ports) checked from
a second container (`tern status`, a `tern fs put`/`get` round trip compared byte for byte) and
from here (/health, /ready and /metrics on the metadata and storage admin ports), then stopped
with SIGTERM, which must end it with status 0.

  --profile debug|release  which build of `tern` goes in [release]: release runs
                           `cargo build --release --features rdma --bin tern`; debug takes
                           target/debug/tern (built so if missing). CI uses debug: the
                           test build already made it, so no release compile is spent on CI.
                           Either way the binary's debug info is stripped in the image.
  --tag NAME               image name [localhost/tern:latest]
  --no-smoke-test          build only

Needs root (podman and buildah with the vfs storage driver, runc). Installs buildah, podman,
runc and debootstrap with apt-get when missing. Export the image with
`buildah push NAME oci-archive:tern.tar` or push it to a registry with `buildah push NAME
docker://REGISTRY/tern:TAG`.
EOF
}

profile=release
tag=localhost/tern:latest
smoke=1
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) profile="${2:?--profile needs debug or release}"; shift 2 ;;
        --profile=*) profile="${1#--profile=}"; shift ;;
        --tag) tag="${2:?--tag needs a name}"; shift 2 ;;
        --tag=*) tag="${1#--tag=}"; shift ;;
        --no-smoke-test) smoke=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "build.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
case "$profile" in
    debug | release) ;;
    *) echo "build.sh: --profile must be debug or release, not '$profile'" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || { echo "build.sh: run as root (podman and buildah use root's vfs storage here)" >&2; exit 1; }

log() { echo "image: $*" >&2; }

# --- tools -------------------------------------------------------------------------------------
missing=()
for tool in buildah podman runc debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}..."
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y buildah podman runc debootstrap
fi
# vfs: works in any container or VM (no overlay mounts needed); runc: crun fails on setrlimit here.
podman=(podman --storage-driver vfs)
buildah=(buildah --storage-driver vfs)
run=("${podman[@]}" --runtime runc run --network host --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)

# --- the binary --------------------------------------------------------------------------------
# With RDMA (the image's base has the verbs libraries); the debug build unifies features across the
# workspace as scripts/test.sh's test build does, so that build's binary is this one.
if [ "$profile" = release ]; then
    bash scripts/rdma-deps.sh build
    cargo build --release --features rdma --bin tern
    binary=target/release/tern
else
    [ -x target/debug/tern ] || { bash scripts/rdma-deps.sh build && cargo build --workspace --features tern/rdma --bin tern; }
    binary=target/debug/tern
fi
context=target/image-context
rm -rf "$context"
mkdir -p "$context"
cp deploy/image/Containerfile "$context/"
objcopy --strip-debug "$binary" "$context/tern"

# --- the base: minimal Debian, made here once ------------------------------------------------
. /etc/os-release
suite="${VERSION_CODENAME:?/etc/os-release names no Debian release}"
# (-verbs: the base made before the image carried RDMA lacked these libraries.)
base="localhost/tern-base:$suite-verbs"
if "${podman[@]}" image exists "$base"; then
    log "reusing $base"
else
    mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p; s/^deb \(\[[^]]*\] \)\{0,1\}\(http[^ ]*\) .*/\2/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v security | head -n1 || true)
    mirror="${mirror:-http://deb.debian.org/debian}"
    log "making $base: debootstrap --variant=minbase $suite from $mirror"
    rootfs=$(mktemp -d /var/tmp/tern-base.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    # The verbs and rdma_cm libraries with the NIC providers (mlx5, rxe, ...): `tern` links them.
    debootstrap --variant=minbase --include=libibverbs1,librdmacm1,ibverbs-providers \
        "$suite" "$rootfs" "$mirror" >/dev/null
    # Nothing a running image needs: package lists, caches, docs, man pages, locales.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*
    chmod 755 "$rootfs" # mktemp made it 0700: the image's / must be open to its non-root user
    tar -C "$rootfs" -c . | "${podman[@]}" import - "$base" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi

# --- the image ---------------------------------------------------------------------------------
log "building $tag ($profile tern on $base)"
"${buildah[@]}" bud --quiet --isolation chroot --build-arg "BASE=$base" -t "$tag" -f "$context/Containerfile" "$context" >/dev/null
rm -rf "$context"
# The image this tag named before is now unnamed: drop it, so repeated builds do not pile up.
"${podman[@]}" image prune -f >/dev/null
size=$("${podman[@]}" image inspect --format '{{.Size}}' "$tag")
mib=$((size / 1048576))
log "built $tag, $mib MiB"
[ "$smoke" -eq 1 ] || exit 0

# --- smoke test --------------------------------------------------------------------------------
version=$("${run[@]}" --rm "$tag" --version)
[[ "$version" == tern\ * ]] || { echo "build.sh: tern --version in the image printed '$version'" >&2; exit 1; }
user=$("${run[@]}" --rm --entrypoint id "$tag" -u)
[ "$user" = 10001 ] || { echo "build.sh: the image runs as uid $user, not 10001" >&2; exit 1; }
log "$version runs as uid $user"

# A free run of loopback ports as `tern up` lays them out (metadata PORT, admin PORT+1, storage
# server PORT+10 and PORT+11), below the ephemeral range.
free_port_range() {
    python3 - <<'EOF'
import random, socket
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False
for _ in range(200):
    base = random.randrange(20000, 31000)
    if all(free(p) for p in range(base, base + 12)):
        print(base)
        break
else:
    raise SystemExit("no 12 consecutive free ports between 20000 and 31000")
EOF
}
port=$(free_port_range)
name="tern-smoke-$$"
cleanup() { "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
fail() {
    echo "build.sh: smoke test: $*" >&2
    echo "--- tern up's output ---" >&2
    "${podman[@]}" logs "$name" >&2 || true
    exit 1
}
"${run[@]}" -d --name "$name" "$tag" up --port "$port" --storage-servers 1 --dram 64MiB >/dev/null
log "tern up in container $name on 127.0.0.1:$port"
# (The log is read whole, not piped into `grep -q`, which would cut podman off mid-write.)
up_said_so() { grep -q '^Tern is up' <<<"$("${podman[@]}" logs "$name" 2>&1)"; }
for _ in $(seq 120); do
    up_said_so && break
    [ "$("${podman[@]}" inspect --format '{{.State.Running}}' "$name")" = true ] || fail "tern up exited"
    sleep 0.5
done
up_said_so || fail "not up within 60 s"

# From a second container, as a client would: status, then a 3 MB file there and back.
"${run[@]}" --rm -e "TERN_METADATA=127.0.0.1:$port" --entrypoint sh "$tag" -euc '
    tern status
    head -c 3000000 /dev/urandom > /tmp/in
    tern fs put /tmp/in /smoke/file
    tern fs get /smoke/file /tmp/out
    cmp /tmp/in /tmp/out
    echo "round trip: 3000000 bytes put and got back equal"
' || fail "client commands from a second container failed"

# From here: the metadata server's and storage server 0's admin endpoints (PORT+1, PORT+11)
# answer /health and /ready, and serve metrics.
python3 - "$((port + 1))" "$((port + 11))" <<'EOF' || fail "an admin endpoint did not answer"
import sys, urllib.request
for port, role, metric in [(sys.argv[1], "metadata-server", "tern_metadata_requests"),
                           (sys.argv[2], "storage-server", "tern_storage_requests")]:
    get = lambda path: urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()
    health, ready, metrics = get("/health"), get("/ready"), get("/metrics")
    assert ready == "ready\n", f"{role} /ready: {ready!r}"
    for name in (metric, f'tern_build_info{{version="', "process_resident_memory_bytes"):
        assert name in metrics, f"no {name} in {role}'s /metrics"
    print(f"{role} admin: /health {health.strip()!r}, /ready {ready.strip()!r}, /metrics {len(metrics)} bytes")
EOF

# A clean stop: SIGTERM, and tern up stops its daemons and exits 0.
"${podman[@]}" stop --time 30 "$name" >/dev/null
code=$("${podman[@]}" inspect --format '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || fail "tern up exited with status $code after SIGTERM"
log "smoke test passed: --version, tern up, status, put/get round trip, /health, /ready, /metrics, clean stop"
