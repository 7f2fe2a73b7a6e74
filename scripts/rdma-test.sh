#!/usr/bin/env bash
# RDMA tests over soft-RoCE: builds `tern` and examples/rdma_check.rs with `--features rdma`,
# boots a QEMU guest (TCG, Debian's 6.1 kernel, rdma_rxe on a veth) whose initramfs holds them,
# and inside it starts a metadata server, two storage servers serving RDMA and one not (in the
# order RDMA_TEST_ORDER names, e.g. 312, else one of the six at random, printed), then checks over
# `--transport rdma`: file round trips (0 B, 1 B, block-1, block, block+1, 3 blocks+7, 50 MiB
# through the `tern fs` CLI), a shuffle written by 3 maps and read by map ranges, reads of DRAM
# blocks and pages on the servers serving RDMA as one-sided READs through memory windows (counted
# exactly, against each server's lend metrics), READs through
# a released and an expired window failing with a remote access error, a refused cross-job read
# and Lease, a killed storage server, and one log line for the fallback to TCP of the server
# without RDMA. Prints one line `rdma-test: PASS` or
# `rdma-test: FAIL (why)` and exits 0 or 1. The guest has no network device (`-nic none`): all
# RDMA traffic stays inside it.
#
# Needs root for apt-get when packages are missing (CI is root). Takes ~3 min beyond the build.
#   bash scripts/rdma-test.sh            # the whole test
#   RDMA_TEST_KEEP=1 bash scripts/...   # keep the work directory (printed) for a look
#   RDMA_TEST_ORDER=312 bash scripts/... # storage servers 3, 1, 2 start in that order
set -euo pipefail
cd "$(dirname "$0")/.."

# The guest's hard limit: TCG is slow, but a hang must not hold CI.
GUEST_TIMEOUT_S=${RDMA_TEST_TIMEOUT_S:-420}
KERNEL_PKG_PATTERN='^linux-image-6\.1\.0-[0-9]+-amd64$'

fail() { echo "rdma-test: FAIL ($*)"; exit 1; }

bash scripts/rdma-deps.sh || fail "installing what an RDMA build needs (scripts/rdma-deps.sh)"

work=$(mktemp -d /tmp/tern-rdma-test.XXXXXX)
if [ -z "${RDMA_TEST_KEEP:-}" ]; then trap 'rm -rf "$work"' EXIT; else echo "rdma-test: work dir $work" >&2; fi

echo "rdma-test: building tern and rdma_check with --features rdma" >&2
# With --workspace, features unify across the workspace exactly as in the test build
# (scripts/test.sh, which builds with this feature too), so after that build this one is done;
# `-p tern` alone would resolve tokio and everything above it with fewer features and build them all again.
cargo build --workspace --features tern/rdma --bin tern --example rdma_check || fail "cargo build --features rdma"
# Taken at once: another build in this target dir (without the feature) may replace target/debug/tern.
objcopy --strip-debug target/debug/tern "$work/tern"
objcopy --strip-debug target/debug/examples/rdma_check "$work/rdma_check"

# The guest kernel: Debian's 6.1 image (rdma_rxe as a module), cached under target/.
cache=target/rdma-guest
mkdir -p "$cache"
if ! ls "$cache"/k/boot/vmlinuz-* >/dev/null 2>&1; then
    [ -n "$(apt-cache search --names-only "$KERNEL_PKG_PATTERN" 2>/dev/null)" ] || apt-get update -qq
    pkg=$(apt-cache search --names-only "$KERNEL_PKG_PATTERN" | awk '{print $1}' | sort -V | tail -n1)
    [ -n "$pkg" ] || fail "no linux-image-6.1 package found by apt-cache"
    (cd "$cache" && rm -f linux-image-*.deb && apt-get download "$pkg" >/dev/null) || fail "apt-get download $pkg"
    rm -rf "$cache/k" && dpkg -x "$cache"/linux-image-*.deb "$cache/k"
fi
vmlinuz=$(ls "$cache"/k/boot/vmlinuz-* | head -n1)
moddir=$(ls -d "$cache"/k/lib/modules/*/ | head -n1)

# Modules and their dependencies (each .ko's own `depends=`, as the .deb has no modules.dep and
# the host may have no depmod), dependencies first.
root="$work/root"
mkdir -p "$root"/{bin,sbin,lib,lib64,usr/lib/x86_64-linux-gnu/libibverbs,etc/libibverbs.d,proc,sys,dev,tmp,mod,data}
declare -A seen=()
order=()
add_module() {
    local name=$1 path deps
    local pattern=${name//[-_]/[-_]}
    path=$(grep -E "(^|/)${pattern}\.ko(\.[a-z]+)?$" "$moddir/modules.order" | head -n1)
    [ -n "$path" ] || fail "module $name not in $moddir/modules.order"
    [ -n "${seen[$path]:-}" ] && return 0
    seen[$path]=1
    case "$path" in
        *.xz) deps=$(xz -dc "$moddir/$path" | tr '\0' '\n' | sed -n 's/^depends=//p' | head -n1 || true) ;;
        *.zst) deps=$(zstd -qdc "$moddir/$path" | tr '\0' '\n' | sed -n 's/^depends=//p' | head -n1 || true) ;;
        *) deps=$(tr '\0' '\n' <"$moddir/$path" | sed -n 's/^depends=//p' | head -n1 || true) ;;
    esac
    for dep in ${deps//,/ }; do add_module "$dep"; done
    order+=("$path")
}
for m in crc32_generic veth rdma_rxe rdma_ucm; do add_module "$m"; done
: >"$root/mod/order"
for path in "${order[@]}"; do
    name=$(basename "$path")
    case "$name" in
        *.ko.xz) xz -dc "$moddir/$path" >"$root/mod/${name%.xz}"; name=${name%.xz} ;;
        *.ko.zst) zstd -qdc "$moddir/$path" >"$root/mod/${name%.zst}"; name=${name%.zst} ;;
        *) cp "$moddir/$path" "$root/mod/$name" ;;
    esac
    echo "$name" >>"$root/mod/order"
done

# Binaries with every library they load.
copy_with_libs() {
    local src=$1 dst=$2
    cp -L "$src" "$root/$dst"
    ldd "$src" 2>/dev/null | grep -oE '/[^ ]+' | while read -r lib; do
        [ -e "$root$lib" ] || { mkdir -p "$root$(dirname "$lib")"; cp -L "$lib" "$root$lib"; }
    done
}
cp /bin/busybox "$root/bin/busybox"
for applet in $(/bin/busybox --list); do [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"; done
copy_with_libs "$(command -v ip)" bin/iproute2-ip
copy_with_libs "$(command -v rdma)" bin/rdma-tool
copy_with_libs "$work/tern" bin/tern
copy_with_libs "$work/rdma_check" bin/rdma_check
# ibv_devinfo, when the host has it, records what the guest's rxe device offers (memory windows).
if command -v ibv_devinfo >/dev/null 2>&1; then copy_with_libs "$(command -v ibv_devinfo)" bin/ibv_devinfo; fi
provider=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so
copy_with_libs "$provider" "${provider#/}"
cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"

cat >"$root/init" <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
T0=$(date +%s)
say() { echo "guest: [$(( $(date +%s) - T0 ))s] $*"; }
verdict() { echo "RDMA-GUEST-RESULT: $*"; poweroff -f; }
for m in $(cat /mod/order); do insmod /mod/$m || verdict "FAIL insmod $m"; done
/bin/iproute2-ip link add va type veth peer name vb || verdict "FAIL veth"
/bin/iproute2-ip addr add 10.77.0.1/24 dev va
/bin/iproute2-ip link set va up; /bin/iproute2-ip link set vb up; /bin/iproute2-ip link set lo up
/bin/rdma-tool link add rxe0 type rxe netdev va || verdict "FAIL rdma link add"
[ -e /dev/infiniband/rdma_cm ] || verdict "FAIL no /dev/infiniband/rdma_cm"
[ -x /bin/ibv_devinfo ] && ibv_devinfo -v | grep -iE "max_mw|max_qp_wr|max_mr:" | sed 's/^[[:space:]]*/guest: rxe0 /'
export RUST_LOG=info,tern_rdma=debug,tern_storage_server::service::leases=debug
BS=262144
tern metadata-server --listen 127.0.0.1:9060 --admin 127.0.0.1:9061 --dir /data/meta \
    --block-size 256KiB >/tmp/meta.log 2>&1 &
sleep 2
# Servers 1 and 2 serve RDMA; server 3 does not: clients must fall back to TCP for it, saying
# so once. They start in the order the kernel command line names (tern_order=312: server 3,
# then 1, then 2), each once the one before it registered ("listening on" follows its
# registration), so the placement planner sees them in that order.
ORDER=$(sed -n 's/.*tern_order=\([123]*\).*/\1/p' /proc/cmdline)
say "starting the storage servers in the order ${ORDER:-123}"
for n in $(echo "${ORDER:-123}" | sed 's/./& /g'); do
    rdma=on; [ "$n" = 3 ] && rdma=off
    tern storage-server --listen 10.77.0.1:907$(( 2 * n - 2 )) --admin 127.0.0.1:907$(( 2 * n - 1 )) \
        --trusted-network --metadata 127.0.0.1:9060 --dram 96MiB --set rdma=$rdma --set prefault=false \
        --set huge_pages=false --set drain_grace_ms=0 --set cluster_secret_file=/data/meta/cluster.secret \
        >/tmp/s$n.log 2>&1 &
    [ "$n" = 1 ] && S1=$!
    for i in $(seq 1 60); do grep -q "listening on" /tmp/s$n.log && break; sleep 1; done
    grep -q "listening on" /tmp/s$n.log || { cat /tmp/meta.log /tmp/s$n.log; verdict "FAIL storage server $n did not start"; }
    say "storage server $n: $(grep -o 'storage server [0-9]* listening on [^ ]*' /tmp/s$n.log)"
done
grep -q "RDMA on" /tmp/s1.log && grep -q "RDMA on" /tmp/s2.log || { cat /tmp/meta.log /tmp/s1.log /tmp/s2.log; verdict "FAIL storage servers not serving RDMA"; }
say "servers up"
# Deadlines for an emulated CPU (as rdma_check sets its own): an RDMA connect under TCG can take
# seconds, and a slow connect must not be taken for a server without RDMA.
export TERN_RDMA_CONNECT_TIMEOUT_MS=10000 TERN_CONNECT_TIMEOUT_MS=30000
SERVERS="10.77.0.1:9070=127.0.0.1:9071 10.77.0.1:9072=127.0.0.1:9073 10.77.0.1:9074=127.0.0.1:9075"
timeout 200 rdma_check 127.0.0.1:9060 $BS before $SERVERS >/tmp/c1.log 2>&1; rc=$?
cat /tmp/c1.log
say "rdma_check before: exit $rc"
[ $rc -eq 0 ] || { tail -n 30 /tmp/s1.log /tmp/s2.log; verdict "FAIL rdma_check before (exit $rc)"; }
head -c 52428800 /dev/urandom >/tmp/big
T="tern fs --metadata 127.0.0.1:9060 --transport rdma"
$T put /tmp/big /big50 >/tmp/put.log 2>&1 || { cat /tmp/put.log; verdict "FAIL tern fs put 50MiB"; }
$T get /big50 /tmp/big.back >/tmp/get.log 2>&1 || { cat /tmp/get.log; verdict "FAIL tern fs get 50MiB"; }
cmp /tmp/big /tmp/big.back || verdict "FAIL 50MiB differs"
say "ok: 50 MiB round trip through tern fs"
cat /tmp/put.log /tmp/get.log
for log in /tmp/put.log /tmp/get.log; do
    fallbacks=$(grep -c "storage server 10.77.0.1:9074: no RDMA" $log)
    [ "$fallbacks" -eq 1 ] || verdict "FAIL $log said $fallbacks times (not once) that it fell back to TCP for the server without RDMA"
done
say "ok: tern fs put and get each said once that they fell back to TCP for the server without RDMA"

kill -9 $S1
say "killed storage server 1"
timeout 150 rdma_check 127.0.0.1:9060 $BS after >/tmp/c2.log 2>&1; rc=$?
cat /tmp/c2.log
say "rdma_check after: exit $rc"
[ $rc -eq 0 ] || { tail -n 30 /tmp/s2.log /tmp/meta.log; verdict "FAIL rdma_check after (exit $rc)"; }
if grep -h "falling back to TCP\|RDMA transport asked for" /tmp/c1.log /tmp/c2.log /tmp/put.log /tmp/get.log | grep -v "10.77.0.1:9070\|10.77.0.1:9074" | grep -q .; then
    verdict "FAIL a client fell back to TCP with the server alive"
fi
n1=$(grep -c "RDMA connection from" /tmp/s1.log); n2=$(grep -c "RDMA connection from" /tmp/s2.log)
say "RDMA connections accepted: server 1 $n1, server 2 $n2"
[ "$n1" -gt 0 ] && [ "$n2" -gt 0 ] || verdict "FAIL the storage servers accepted no RDMA connection"
verdict PASS
EOF
chmod +x "$root/init"

(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$work/initrd.gz"
# The storage servers' start order: given, or one of the six at random (printed, to repeat it).
order=${RDMA_TEST_ORDER:-$(printf '%s\n' 123 132 213 231 312 321 | shuf -n1)}
case "$order" in 123|132|213|231|312|321) ;; *) fail "RDMA_TEST_ORDER=$order: expected an order of 1, 2 and 3, such as 312" ;; esac
echo "rdma-test: storage servers start in the order $order (RDMA_TEST_ORDER=$order to repeat it)" >&2
echo "rdma-test: booting the guest ($(du -h "$work/initrd.gz" | cut -f1) initramfs, at most ${GUEST_TIMEOUT_S}s)" >&2
set +e
timeout --kill-after=10 "$GUEST_TIMEOUT_S" qemu-system-x86_64 -accel tcg -cpu max -m 2048 -smp 2 -nographic \
    -no-reboot -nic none -kernel "$vmlinuz" -initrd "$work/initrd.gz" \
    -append "console=ttyS0 panic=-1 quiet tern_order=$order" </dev/null >"$work/console.log" 2>&1
rc=$?
set -e
grep -E "^(guest|rdma_check):" "$work/console.log" | tr -d '\r' >&2 || true
result=$({ grep -a "RDMA-GUEST-RESULT:" "$work/console.log" || true; } | tail -n1 | tr -d '\r' | sed 's/.*RDMA-GUEST-RESULT: //')
if [ "$result" = PASS ]; then
    echo "rdma-test: PASS"
    exit 0
fi
tail -n 60 "$work/console.log" | tr -d '\r' >&2
[ $rc -eq 124 ] && fail "the guest did not finish within ${GUEST_TIMEOUT_S}s"
fail "${result:-the guest printed no result (qemu exit $rc)}"
