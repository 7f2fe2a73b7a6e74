#!/usr/bin/env bash
# Installs, where missing, what an RDMA build of Tern and its soft-RoCE guest test need: the verbs
# and rdma_cm headers and libclang (rdma-sys's bindgen), the rxe provider, and QEMU, busybox, cpio,
# the rdma tool and pkg-config for scripts/rdma-test.sh. Quick when all is there.
#   scripts/rdma-deps.sh          # all of it: scripts/test.sh, scripts/rdma-test.sh
#   scripts/rdma-deps.sh build    # only what the build needs: deploy/image/build.sh
# Needs root (or sudo) for apt-get when something is missing.
set -euo pipefail
case "${1:-all}" in
    all) guest=1 ;;
    build) guest=0 ;;
    *) echo "rdma-deps.sh: unknown argument $1 (expected build, or nothing)" >&2; exit 2 ;;
esac

need=()
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
[ -e /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
[ -e /usr/include/rdma/rdma_cma.h ] || need+=(librdmacm-dev)
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
if [ "$guest" -eq 1 ]; then
    for pair in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static cpio:cpio rdma:iproute2; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
    done
    [ -e /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so ] || need+=(ibverbs-providers)
    { ldd /bin/busybox 2>&1 || true; } | grep -qE "not a dynamic|statically linked" || need+=(busybox-static)
fi
if [ ${#need[@]} -gt 0 ]; then
    echo "rdma-deps: installing ${need[*]}" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
