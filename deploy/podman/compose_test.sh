#!/usr/bin/env bash
# `make test-compose`: docker-compose.yml for real, with podman and podman-compose on this
# machine. Builds what no registry can give here (each step skipped when its image exists):
#   1. a Debian 12 root filesystem (mmdebstrap from the apt mirror, this host's extra CA
#      certificates trusted), imported as localhost/surge-debian:bookworm;
#   2. localhost/surge-base:torch2.13.0-cpu (deploy/podman/base.Containerfile): a venv with the
#      CPU wheel of torch 2.13.0 that `pip install torch==2.13.0` takes on this host;
#   3. localhost/surge-prometheus:debian (deploy/podman/prometheus.Containerfile): Debian's
#      prometheus, for prom/prometheus;
# then `podman-compose build` (deploy/Dockerfile on that base; podman's layer cache makes a
# rerun on unchanged sources quick) and runs the README's compose commands word for word,
# with podman-compose for docker-compose:
#   docker-compose up -d
#   docker-compose run --rm surgectl dataset prepare --name stdlib --version v1
#   docker-compose run --rm surgectl submit examples/jobs/demo.yaml --follow
# The demo job must finish; then the stack's own Prometheus is asked for surge_train_loss
# of the job, which must be a finite number. `podman-compose down -v` and the removal of
# every container, volume and network of the project run on exit, failed or not.
#
# podman 4.3 (Debian 12) has no systemd here to run health checks on a timer, and
# podman-compose ignores `condition: service_healthy` below podman 4.6: after `up -d` this
# script runs `podman healthcheck run` on every service until all are healthy (what
# `docker-compose up -d` waits for before starting the services that depend on them).
#
# Environment: SURGE_COMPOSE_PROJECT (project name, default surge-compose-test),
# SURGE_COMPOSE_CACHE (build context of the base image, default /var/tmp/surge-compose),
# SURGE_COMPOSE_REBUILD=1 (rebuild the three local images), COMPOSE (default podman-compose).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
export CONTAINERS_CONF=${CONTAINERS_CONF:-$REPO/deploy/podman/containers.conf}
export COMPOSE_PROJECT_NAME=${SURGE_COMPOSE_PROJECT:-surge-compose-test}
CACHE=${SURGE_COMPOSE_CACHE:-/var/tmp/surge-compose}
COMPOSE=${COMPOSE:-podman-compose}
DEBIAN_IMAGE=localhost/surge-debian:bookworm
export SURGE_BASE_IMAGE=${SURGE_BASE_IMAGE:-localhost/surge-base:torch2.13.0-cpu}
export SURGE_PROMETHEUS_IMAGE=${SURGE_PROMETHEUS_IMAGE:-localhost/surge-prometheus:debian}
PIP=${PIP:-$REPO/.venv/bin/pip}
PY=${PY:-$REPO/.venv/bin/python}
T0=$(date +%s)

say() { printf '[compose-test %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
  say "FAILED: $*"
  exit 1
}
elapsed() { echo $(($(date +%s) - $1)); }

command -v podman >/dev/null || die "podman is not installed (make test-compose installs it with apt-get)"
command -v "$COMPOSE" >/dev/null || die "$COMPOSE is not installed (make test-compose installs podman-compose with pip)"

# Host ports of control and Prometheus: free ones, so that a local stack on 50051/9090 is no
# obstacle (docker-compose.yml: SURGE_CONTROL_HOST_PORT, SURGE_PROMETHEUS_HOST_PORT).
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export SURGE_CONTROL_HOST_PORT=${SURGE_CONTROL_HOST_PORT:-$(free_port)}
export SURGE_PROMETHEUS_HOST_PORT=${SURGE_PROMETHEUS_HOST_PORT:-$(free_port)}

# ---- local images ---------------------------------------------------------------------
rebuild=${SURGE_COMPOSE_REBUILD:-0}
build_start=$(date +%s)
if [ "$rebuild" = 1 ] || ! podman image exists "$DEBIAN_IMAGE"; then
  command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (make test-compose installs it with apt-get)"
  say "making the Debian 12 root filesystem (mmdebstrap)"
  mkdir -p "$CACHE"
  # This host's own CA certificates (e.g. a TLS-inspecting proxy's) go into the image, so
  # that pip and apt inside the builds reach what the host reaches. ($1: the new root, for
  # mmdebstrap's hook shell.)
  # shellcheck disable=SC2016
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,wget \
    --customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"; for c in /usr/local/share/ca-certificates/*.crt; do [ -e "$c" ] && cp "$c" "$1/usr/local/share/ca-certificates/"; done; chroot "$1" update-ca-certificates >/dev/null' \
    bookworm "$CACHE/debian.tar" http://deb.debian.org/debian
  podman import -q --change 'CMD ["/bin/bash"]' "$CACHE/debian.tar" "$DEBIAN_IMAGE" >/dev/null
  rm -f "$CACHE/debian.tar"
fi
if [ "$rebuild" = 1 ] || ! podman image exists "$SURGE_BASE_IMAGE"; then
  say "building $SURGE_BASE_IMAGE"
  rm -rf "$CACHE/base" && mkdir -p "$CACHE/base"
  # The wheel `pip install torch==2.13.0` takes on this host (its find-links, index or cache),
  # and only a CPU build: a CUDA wheel from PyPI would be gigabytes of unused libraries.
  "$PIP" download -q torch==2.13.0 --no-deps --only-binary=:all: -d "$CACHE/base"
  ls "$CACHE"/base/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
    || die "pip found no CPU wheel of torch 2.13.0 ($(ls "$CACHE/base")); add https://download.pytorch.org/whl/cpu to pip's extra-index-url"
  podman build -q --build-arg DEBIAN="$DEBIAN_IMAGE" -f "$REPO/deploy/podman/base.Containerfile" \
    -t "$SURGE_BASE_IMAGE" "$CACHE/base" >/dev/null
  rm -f "$CACHE"/base/*.whl
fi
if [ "$rebuild" = 1 ] || ! podman image exists "$SURGE_PROMETHEUS_IMAGE"; then
  say "building $SURGE_PROMETHEUS_IMAGE"
  podman build -q --build-arg DEBIAN="$DEBIAN_IMAGE" -f "$REPO/deploy/podman/prometheus.Containerfile" \
    -t "$SURGE_PROMETHEUS_IMAGE" "$REPO/deploy/podman" >/dev/null
fi

# ---- the stack, removed on any exit ---------------------------------------------------
cleanup() {
  rc=$?
  trap - EXIT INT TERM
  if [ "$rc" != 0 ]; then
    say "logs of the failed run (last 40 lines per service):"
    for c in $(podman ps -a -q --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME"); do
      echo "---- $(podman inspect -f '{{.Name}}' "$c")"
      podman logs --tail 40 "$c" 2>&1 || true
    done
  fi
  say "tearing down: $COMPOSE down -v"
  "$COMPOSE" --profile cli down -v -t 15 >/dev/null 2>&1 || true
  # Whatever down left: containers (a `run --rm` cut short), volumes, networks of the project.
  podman ps -a -q --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME" | xargs -r podman rm -f -t 5 >/dev/null 2>&1 || true
  podman volume ls -q --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
  podman network ls -q --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME" | xargs -r podman network rm -f >/dev/null 2>&1 || true
  left=$(podman ps -a -q --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME")
  [ -z "$left" ] || say "warning: containers left: $left"
  say "whole test: $(elapsed "$T0") s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# A previous run killed before its trap ran.
"$COMPOSE" --profile cli down -v -t 5 >/dev/null 2>&1 || true

say "building the Surge image: $COMPOSE build"
"$COMPOSE" build >/dev/null
# podman-compose builds once per service: the earlier builds of surge:latest are left untagged.
podman image prune -f --filter label=io.surge.image=surge >/dev/null
say "images ready in $(elapsed "$build_start") s"

# The README's commands (section "Docker Compose and many machines", its first bash block),
# docker-compose replaced by $COMPOSE; on `run`, with `--profile cli`: docker-compose starts a
# service of an inactive profile when `run` names it, podman-compose says "missing services".
mapfile -t README_CMDS < <(awk '/^## Docker Compose and many machines/{s=1} s&&/^```bash/{b=1;next} b&&/^```/{exit} b' README.md)
[ "${#README_CMDS[@]}" = 3 ] || die "README compose block: expected 3 commands, found: ${README_CMDS[*]}"
readme() {
  local cmd=${README_CMDS[$1]}
  say "README: $cmd"
  cmd=${cmd//docker-compose run/docker-compose --profile cli run}
  eval "${cmd//docker-compose/\"\$COMPOSE\"}"
}

up_start=$(date +%s.%N)
# (podman's complaint about the systemd timers of health checks, once per container, and the
# ids of the volumes and network it makes, left out)
set +e
readme 0 2>&1 | grep -v -e 'unable to get systemd connection' -e 'failed to connect to syslog' -e '^[0-9a-f]\{64\}$'
up_rc=${PIPESTATUS[0]}
set -e
[ "$up_rc" = 0 ] || die "up -d failed (exit $up_rc)"
# `up -d` returns while podman is still creating the containers: wait for the first (was: checked
# at once, and a fresh machine's first run said "started nothing" with all six starting).
started_by=$(($(date +%s) + 60))
until podman ps -aq --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME" | grep -q .; do
  [ "$(date +%s)" -lt "$started_by" ] || die "up -d started nothing within 60 s"
  sleep 1
done

say "waiting for every service's health check"
services=(store data control worker-0 worker-1 prometheus)
deadline=$(($(date +%s) + 180))
for s in "${services[@]}"; do
  c=$(podman ps -q --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME" --filter "label=io.podman.compose.service=$s")
  [ -n "$c" ] || die "service $s is not running"
  until podman healthcheck run "$c" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || die "service $s not healthy after 180 s"
    sleep 2
  done
done
say "all healthy $(${PY} -c "import time; print(round(time.time() - $up_start, 1))") s after up"

readme 1
# podman-compose gives `run` a terminal, so surgectl draws its live progress bar: the filter
# prints the other lines and one progress line per 50 steps (all of it: $CACHE/submit.log).
readme 2 | tee "$CACHE/submit.log" | "$PY" -u -c '
import re, sys
ansi, seen = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]"), -50
for raw in sys.stdin:
    for part in re.split(r"\x1b\[2K|\r", raw):
        line = ansi.sub("", part).rstrip()
        m = re.search(r" (\d+)/\d+ loss ", line)
        if m and int(m.group(1)) - seen < 50:
            continue
        seen = int(m.group(1)) if m else seen
        if line:
            print(line)
'
job=$(grep -ao 'submitted [^ ]*' "$CACHE/submit.log" | head -1 | cut -d' ' -f2 | sed 's/\x1b\[[0-9;]*m//g')
[ -n "$job" ] || die "no job id in the submit output"

# The job's events (JSON Lines): when it started, took its first step and ended, from `up`.
"$COMPOSE" --profile cli run --rm -T surgectl events "$job" -o json 2>/dev/null >"$CACHE/events.jsonl" \
  || die "surgectl events $job failed"
JOB=$job UP=$up_start "$PY" - "$CACHE/events.jsonl" <<'PYEOF' || die "the job did not finish"
import json, os, sys
up = float(os.environ["UP"])
evs = [json.loads(line) for line in open(sys.argv[1]) if line.strip().startswith("{")]
first = lambda pred: next((e for e in evs if pred(e)), None)
submit = evs[0]["unix_time"] if evs else up
running = first(lambda e: e["status"]["state"] == "RUNNING")
step = first(lambda e: e["type"] == "step")
last = evs[-1]["status"] if evs else {}
t = lambda e: f"{e['unix_time'] - up:.1f} s" if e else "never"
print(f"[compose-test] {os.environ['JOB']}: submitted {submit - up:.1f} s after up, RUNNING at {t(running)}, "
      f"first step at {t(step)}; {len(evs)} events, ends {last.get('state')} {last.get('outcome')} "
      f"at step {last.get('step')}/{last.get('total_steps')}, train loss {last.get('train_loss')}")
sys.exit(0 if last.get("step") == last.get("total_steps") and last.get("state") == "TERMINATED" and last.get("outcome") == "FINISHED" else 1)
PYEOF

# The stack's Prometheus: the store's gauge surge_train_loss{job=...}, after a scrape.
say "asking Prometheus (127.0.0.1:$SURGE_PROMETHEUS_HOST_PORT) for surge_train_loss{job=\"$job\"}"
loss=""
for _ in $(seq 1 30); do
  loss=$(curl -fsS --get "http://127.0.0.1:$SURGE_PROMETHEUS_HOST_PORT/api/v1/query" \
    --data-urlencode "query=surge_train_loss{job=\"$job\"}" |
    "$PY" -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")') || true
  [ -n "$loss" ] && break
  sleep 2
done
[ -n "$loss" ] || die "Prometheus has no surge_train_loss for $job"
"$PY" -c "import math, sys; v = float('$loss'); sys.exit(0 if math.isfinite(v) else 1)" || die "surge_train_loss = $loss, not finite"
say "PASS: $job trained to the end; surge_train_loss = $loss (from the compose stack's Prometheus)"
