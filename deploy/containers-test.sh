#!/usr/bin/env bash
# Build the image and run the compose cluster on a real container engine, then check it end
# to end with deploy/containers_check.py. Opt-in (`make containers-test`, not part of
# `make test`); needs root. Made for machines that reach Debian's and PyPI's mirrors but no
# image registry:
#   1. installs docker.io, docker-compose and debootstrap (apt) when they are missing;
#   2. starts dockerd when none answers, and at exit stops only the one it started;
#   3. builds a Debian bookworm base image offline (debootstrap --variant=minbase, python3,
#      the host's CA bundle) and loads it with `docker import`, unless it already exists;
#   4. builds tokenline:latest from deploy/Dockerfile on that base, with the torch wheel
#      served from $CT_WHEELS on loopback (the build runs with --network host);
#   5. `docker-compose up -d`, the checks, `docker-compose down -v` (also on failure).
# Exits non-zero when any step or check fails. Environment (all optional):
#   CT_BASE_IMAGE   base to build on; when set, step 3 is skipped
#   CT_WHEELS       directory holding the torch wheel (default: $PIP_FIND_LINKS or /opt/wheels)
#   CT_PROJECT      compose project name (default: tokenline-ct)
#   CT_HTTP_PORT / CT_GRPC_PORT  loopback ports published for the gateway and the frontend
#                   (default: 8000 / 50051, or a free port when that one is taken)
#   CT_WORK         scratch directory: root filesystem, logs (default: /var/tmp/tokenline-containers)
#   DOCKER          docker client (default: docker.io's, which matches its daemon)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CT_WORK=${CT_WORK:-/var/tmp/tokenline-containers}
CT_PROJECT=${CT_PROJECT:-tokenline-ct}
CT_WHEELS=${CT_WHEELS:-${PIP_FIND_LINKS:-/opt/wheels}}
LOCAL_BASE=tokenline-base:bookworm
IMAGE=tokenline:latest
WHEEL_PORT=${CT_WHEEL_PORT:-18765}  # fixed: the wheel URL is part of the build cache key
DEBIAN_MIRROR=${CT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-/usr/bin/docker}
export DOCKER DOCKER_BUILDKIT=0  # BuildKit's frontend image cannot be pulled here
PY=$ROOT/.venv/bin/python

DOCKERD_PID=""
MADE_DOCKER0=0
WHEEL_SERVER_PID=""
COMPOSE_UP=0

log() { printf '[containers-test %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

compose() {
  docker-compose --project-name "$CT_PROJECT" --project-directory "$ROOT" \
    --file "$ROOT/docker-compose.yml" "$@"
}

cleanup() {
  local rc=$?
  set +e
  if [[ $COMPOSE_UP == 1 ]]; then
    log "docker-compose down -v (cleanup)"
    compose down -v --timeout 20 >>"$CT_WORK/compose.log" 2>&1
  fi
  [[ -n $WHEEL_SERVER_PID ]] && kill "$WHEEL_SERVER_PID" 2>/dev/null
  if [[ -n $DOCKERD_PID ]]; then
    log "stopping the dockerd this script started (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null
    wait "$DOCKERD_PID" 2>/dev/null
    [[ $MADE_DOCKER0 == 1 ]] && ip link delete docker0 2>/dev/null
  fi
  exit "$rc"
}
free_port() {  # the wanted port when nothing listens on it, else one the kernel picks
  python3 - "$1" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
EOF
}

install_tools() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [[ -x $DOCKER ]] || DOCKER=$(command -v docker)
  ((${#missing[@]} == 0)) && return
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >"$CT_WORK/apt.log"
  [[ -x $DOCKER ]] || DOCKER=$(command -v docker)
}

start_dockerd() {
  if "$DOCKER" info >/dev/null 2>&1; then
    log "using the dockerd that already runs"
    return
  fi
  log "starting dockerd (log: $CT_WORK/dockerd.log)"
  [[ -e /sys/class/net/docker0 ]] || MADE_DOCKER0=1
  # The host's firewall and IP forwarding stay as they are: containers need no NAT here (the
  # build uses the host's network, the cluster talks over its own bridge and loopback ports).
  dockerd --iptables=false --ip-forward=false >"$CT_WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || die "dockerd exited; see $CT_WORK/dockerd.log"
    sleep 1
  done
  "$DOCKER" info --format 'dockerd {{.ServerVersion}}: {{.Driver}}, {{.CgroupDriver}}' >&2
}

build_local_base() {  # Debian bookworm minbase + python3 (3.11), as python:3.11-slim has it
  if "$DOCKER" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    log "base image $LOCAL_BASE exists"
    return
  fi
  local rootfs=$CT_WORK/rootfs
  rm -rf "$rootfs"
  log "debootstrap bookworm into $rootfs (log: $CT_WORK/debootstrap.log)"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,passwd,ca-certificates \
    bookworm "$rootfs" "$DEBIAN_MIRROR" >"$CT_WORK/debootstrap.log" 2>&1 \
    || die "debootstrap; see $CT_WORK/debootstrap.log"
  # The host's bundle: it holds the CA of any TLS proxy between this machine and PyPI.
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/{doc,man,info}/* "$rootfs"/tmp/*
  log "docker import $LOCAL_BASE"
  tar --numeric-owner -C "$rootfs" -c . | "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$rootfs"
}

build_image() {
  local base=$1 args=()
  args+=(--build-arg "BASE_IMAGE=$base")
  ls "$CT_WHEELS"/torch-2.13.0* >/dev/null 2>&1 || die "no torch 2.13.0 wheel in $CT_WHEELS"
  [[ $(free_port "$WHEEL_PORT") == "$WHEEL_PORT" ]] || die "port $WHEEL_PORT is taken (CT_WHEEL_PORT)"
  python3 -m http.server --bind 127.0.0.1 --directory "$CT_WHEELS" "$WHEEL_PORT" \
    >"$CT_WORK/wheels.log" 2>&1 &
  WHEEL_SERVER_PID=$!
  args+=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$WHEEL_PORT/")
  log "docker build $IMAGE on $base (log: $CT_WORK/build.log)"
  local start=$SECONDS
  "$DOCKER" build --network host --file deploy/Dockerfile --tag "$IMAGE" "${args[@]}" . \
    >"$CT_WORK/build.log" 2>&1 || { tail -n 40 "$CT_WORK/build.log" >&2; die "docker build"; }
  BUILD_SECONDS=$((SECONDS - start))
  kill "$WHEEL_SERVER_PID" 2>/dev/null
  wait "$WHEEL_SERVER_PID" 2>/dev/null || true
  WHEEL_SERVER_PID=""
}

main() {
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  [[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts dockerd)"
  mkdir -p "$CT_WORK"
  install_tools
  [[ -x $PY ]] || make -C "$ROOT" setup >&2
  start_dockerd
  local base=${CT_BASE_IMAGE:-}
  if [[ -z $base ]]; then
    build_local_base
    base=$LOCAL_BASE
  fi
  build_image "$base"

  export TOKENLINE_IMAGE=$IMAGE
  export TOKENLINE_HTTP_PORT=${CT_HTTP_PORT:-$(free_port 8000)}
  export TOKENLINE_GRPC_PORT=${CT_GRPC_PORT:-$(free_port 50051)}
  compose down -v --timeout 20 >"$CT_WORK/compose.log" 2>&1  # leftovers of an earlier run
  COMPOSE_UP=1
  log "docker-compose up -d (project $CT_PROJECT, gateway on 127.0.0.1:$TOKENLINE_HTTP_PORT)"
  local t0
  t0=$(date +%s.%N)
  compose up -d --no-build >>"$CT_WORK/compose.log" 2>&1 \
    || { compose logs --tail 40 >&2; die "docker-compose up; see $CT_WORK/compose.log"; }
  "$PY" deploy/containers_check.py \
    --project "$CT_PROJECT" --image "$IMAGE" --up-started-at "$t0" \
    --build-seconds "$BUILD_SECONDS" \
    --http-port "$TOKENLINE_HTTP_PORT" --grpc-port "$TOKENLINE_GRPC_PORT"
  COMPOSE_UP=0  # the checks end with `docker-compose down -v` and verify it
}

# Sourcing the file (to run one step by hand) defines the functions and runs nothing.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
