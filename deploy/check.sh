#!/usr/bin/env bash
# Checks what is under deploy/ without a cluster (CI runs it from scripts/test.sh):
#   kubernetes  render every overlay with `kubectl kustomize` and validate every object strictly
#               (deploy/kubernetes/validate.py: Kubernetes 1.30 schemas, and the CRDs' own
#               schemas for ServiceMonitor and ScaledObject);
#   systemd     `systemd-analyze verify` every unit; any output at all fails (it reports typos
#               as warnings with exit status 0);
#   monitoring  promtool parses the alert rules and every query of the Grafana dashboard, and
#               runs the rules' unit tests (deploy/monitoring/alerts-test.yaml). That the metrics
#               they name exist is the black-box test tests/integration/monitoring.rs.
# With no argument it runs all three. The systemd check needs target/debug/tern (the binary the
# units start is checked to exist): build it first (`cargo build --bin tern`).
# Installs what it needs when missing: a Python venv in target/deploy-venv, systemd via apt,
# promtool unpacked from Debian's package into target/deploy-tools.
set -euo pipefail
cd "$(dirname "$0")/.."

work=target/deploy-check
venv=target/deploy-venv
# Pinned, so a new release of a schema package cannot change the verdict unnoticed.
python_packages=(
    kubernetes-validate==1.37.0
    cloudcoil-models-prometheus-operator==0.80.1.0
    cloudcoil-models-keda==2.16.1.0
)

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
apt_update() { $sudo apt-get update; }
apt_install() {
    apt_update
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@"
}

check_kubernetes() {
    command -v kubectl >/dev/null || { echo "deploy/check.sh: kubectl is missing (it renders the overlays: kubectl kustomize)" >&2; return 1; }
    if ! "$venv/bin/python" -c 'import kubernetes_validate, cloudcoil.models.keda, cloudcoil.models.prometheus_operator' 2>/dev/null; then
        echo "installing ${python_packages[*]} into $venv..." >&2
        python3 -m venv "$venv" 2>/dev/null || { apt_install python3-venv && python3 -m venv "$venv"; }
        "$venv/bin/pip" install --quiet "${python_packages[@]}"
    fi
    mkdir -p "$work"
    local rendered=() overlay name
    for overlay in deploy/kubernetes/overlays/*/; do
        name=$(basename "$overlay")
        kubectl kustomize "$overlay" > "$work/$name.yaml"
        rendered+=("$work/$name.yaml")
    done
    [ "${#rendered[@]}" -gt 0 ] || { echo "deploy/check.sh: no overlays under deploy/kubernetes/overlays" >&2; return 1; }
    echo "kubernetes: rendered ${#rendered[@]} overlays: ${rendered[*]}"
    "$venv/bin/python" deploy/kubernetes/validate.py --self-test "${rendered[@]}"
}

check_systemd() {
    command -v systemd-analyze >/dev/null || apt_install systemd
    [ -x target/debug/tern ] || { echo "deploy/check.sh: target/debug/tern is missing: run cargo build --bin tern first" >&2; return 1; }
    # A root holding the units, systemd's own units (the targets they hang from) and the tern
    # binary at the path ExecStart names, so verify checks all of it without installing anything.
    local root="$work/systemd-root"
    rm -rf "$root/etc/systemd/system"
    mkdir -p "$root/etc/systemd/system" "$root/usr/local/bin" "$root/usr/lib" "$root/etc/tern"
    [ -d "$root/usr/lib/systemd" ] || cp -a /usr/lib/systemd "$root/usr/lib/"
    ln -f target/debug/tern "$root/usr/local/bin/tern" 2>/dev/null || cp target/debug/tern "$root/usr/local/bin/tern"
    cp deploy/systemd/*.service "$root/etc/systemd/system/"
    local units=() output
    for unit in deploy/systemd/*.service; do units+=("$(basename "$unit")"); done
    local rc=0
    output=$(systemd-analyze verify --man=no --root="$root" "${units[@]}" 2>&1) || rc=$?
    if [ -n "$output" ] || [ "$rc" -ne 0 ]; then
        echo "systemd-analyze verify exited $rc and reported (any output fails):" >&2
        echo "$output" >&2
        return 1
    fi
    echo "systemd: ${#units[@]} units verify with no output: ${units[*]}"
}

# promtool from Debian's prometheus package, unpacked under target/ rather than installed (the
# package would also install and start a Prometheus server).
run_promtool() {
    local tools=target/deploy-tools
    if type -P promtool >/dev/null; then
        promtool "$@"
        return
    fi
    if [ ! -x "$tools/usr/bin/promtool" ]; then
        echo "unpacking promtool from Debian's prometheus package into $tools..." >&2
        mkdir -p "$tools"
        (cd "$tools" && { apt-get download prometheus 2>/dev/null || { apt_update && apt-get download prometheus; }; })
        dpkg-deb -x "$tools"/prometheus_*.deb "$tools"
        rm -f "$tools"/prometheus_*.deb
    fi
    "$tools/usr/bin/promtool" "$@"
}

check_monitoring() {
    mkdir -p "$work"
    run_promtool check rules deploy/monitoring/alerts.yaml
    python3 deploy/monitoring/dashboard_rules.py deploy/monitoring/grafana-dashboard.json > "$work/dashboard-rules.json"
    run_promtool check rules "$work/dashboard-rules.json"
    run_promtool test rules deploy/monitoring/alerts-test.yaml
}

case "${1:-all}" in
    kubernetes) check_kubernetes ;;
    systemd) check_systemd ;;
    monitoring) check_monitoring ;;
    all) check_kubernetes && check_systemd && check_monitoring ;;
    *) echo "usage: deploy/check.sh [kubernetes|systemd|monitoring|all]" >&2; exit 2 ;;
esac
