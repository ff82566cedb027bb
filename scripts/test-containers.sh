#!/usr/bin/env bash
# Build both images from docker/*.Dockerfile with podman, run them as the compose file says,
# and check that a generation through the containers returns the same tokens as the repo's own
# processes (tests/test_containers.py). `make test-containers` runs this; CI calls it after
# `make test`.
#
# No image registry is reachable here, so the Python base image is built with debootstrap
# (Debian bookworm + python3 in a venv) from the host's own Debian mirror, and torch comes from
# a local CPU wheel (found in pip's find-links directories, or TORCH_WHEEL_DIR).
#
# Where any of that cannot work (no podman and no root to install it, podman cannot run
# containers, no CPU torch wheel, no Debian mirror) it prints `SKIP: <reason>` and exits 0.
# Set SPECWIRE_SKIP_CONTAINERS=1 to skip on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WORK=${SPECWIRE_CONTAINER_WORK:-/var/tmp/specwire-containers}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE_IMAGE=localhost/specwire-python:bookworm

skip() { echo "test-containers: SKIP: $*"; exit 0; }
step() { echo "test-containers: [$((SECONDS - START))s] $*"; }

[ "${SPECWIRE_SKIP_CONTAINERS:-}" = 1 ] && skip "SPECWIRE_SKIP_CONTAINERS=1"

# --- podman ---------------------------------------------------------------------------------
need=()
command -v podman >/dev/null 2>&1 || need+=(podman runc)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    skip "missing ${need[*]} and cannot install them (not root or no apt-get)"
  fi
  step "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || skip "apt-get install ${need[*]} failed"
fi
[ "$(id -u)" -eq 0 ] || skip "rootless podman is not set up here; run as root"

mkdir -p "$WORK"
# What was seen to work in containers without systemd or cgroup delegation: runc, cgroupfs,
# no default ulimits (raising nofile is not allowed in the sandbox), file events.
cat > "$WORK/containers.conf" <<'CONF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$WORK/containers.conf"
podman info >"$WORK/podman-info.log" 2>&1 || skip "podman info failed: $(tail -1 "$WORK/podman-info.log")"

# --- the CPU torch wheel --------------------------------------------------------------------
wheel=""
dirs="${TORCH_WHEEL_DIR:-} ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true)"
for d in $dirs; do
  for f in "$d"/torch-"$TORCH_VERSION"+cpu-*.whl; do [ -f "$f" ] && wheel=$f && break 2; done
done
[ -n "$wheel" ] || skip "no local CPU wheel torch-$TORCH_VERSION+cpu (set TORCH_WHEEL_DIR)"
# Hard link (same file system) or copy into the build context's wheel directory.
ln -f "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/

# --- the Python base image ------------------------------------------------------------------
CA=/etc/ssl/certs/ca-certificates.crt
[ -f "$CA" ] || skip "no CA bundle at $CA for pip inside the builds"
if ! podman image exists "$BASE_IMAGE"; then
  mirror=$(awk '/^URIs:/ {print $2; exit} /^deb / {print $2; exit}' \
    /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || skip "no Debian mirror in the host's apt sources for debootstrap"
  step "debootstrap bookworm + python3 from the host's mirror"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || skip "debootstrap failed: $(tail -1 "$WORK/debootstrap.log")"
  chroot "$WORK/rootfs" python3 -m venv /opt/venv
  tar -C "$WORK/rootfs" -c . | podman import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "ENV PIP_CERT=$CA" - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi
step "base image $BASE_IMAGE ready"

export SPECWIRE_CONTAINERS=1 PYTHON_IMAGE=$BASE_IMAGE CONTAINER_CA_BUNDLE=$CA
set +e
"$PY" -m pytest -q -ra -p no:cacheprovider --timeout 1500 tests/test_containers.py
rc=$?
set -e
step "done (pytest exit $rc)"
exit $rc
