#!/usr/bin/env bash
# Start or stop LocalStack (S3, STS, IAM) on the host, without Docker, bound to 127.0.0.1 only.
#
#   localstack/host.sh start [PORT]   start in the background, wait for /_localstack/health,
#                                     print http://127.0.0.1:PORT (default PORT 4566)
#   localstack/host.sh stop           SIGTERM the PID in the pid file, SIGKILL after a timeout
#
# Environment: LOCALSTACK_PIDFILE (default .localstack.pid), LOCALSTACK_VENV (default
# .venv-localstack next to this directory), LOCALSTACK_LOG (default <pidfile>.log),
# LOCALSTACK_START_TIMEOUT_S (default 60). The process is always stopped by its PID, never by name.
# State lives in a fresh temporary FILESYSTEM_ROOT, removed on stop (LocalStack state is ephemeral).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
pidfile="${LOCALSTACK_PIDFILE:-.localstack.pid}"
venv="${LOCALSTACK_VENV:-$repo/.venv-localstack}"
logfile="${LOCALSTACK_LOG:-$pidfile.log}"
timeout_s="${LOCALSTACK_START_TIMEOUT_S:-60}"

die() { echo "localstack/host.sh: $*" >&2; exit 1; }

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

healthy() { "$venv/bin/python" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/_localstack/health", timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
}

start() {
    local port="${1:-4566}"
    local url="http://127.0.0.1:$port"
    [ -x "$venv/bin/python" ] || die "no LocalStack venv at $venv; run: make .venv-localstack/.installed"
    if [ -f "$pidfile" ] && alive "$(head -n1 "$pidfile")"; then
        die "already running with PID $(head -n1 "$pidfile") (pid file $pidfile); run '$0 stop' first"
    fi
    local root
    root="$(mktemp -d "${TMPDIR:-/tmp}/localstack-root.XXXXXX")"
    # setsid: own process group, so stop can signal LocalStack and its helpers by PID.
    env GATEWAY_SERVER=hypercorn GATEWAY_LISTEN="127.0.0.1:$port" OVERRIDE_IN_DOCKER=0 \
        FILESYSTEM_ROOT="$root" SERVICES=s3,sts,iam DNS_ADDRESS=0 SKIP_SSL_CERT_DOWNLOAD=1 \
        DISABLE_EVENTS=1 LOCALSTACK_HOST="127.0.0.1:$port" \
        setsid "$venv/bin/python" -m localstack.runtime.main >"$logfile" 2>&1 </dev/null &
    local pid=$!
    printf '%s\n%s\n' "$pid" "$root" >"$pidfile"
    local deadline=$((SECONDS + timeout_s))
    until healthy "$url"; do
        if ! alive "$pid"; then
            echo "localstack/host.sh: LocalStack (PID $pid) exited during start; last lines of $logfile:" >&2
            tail -n 40 "$logfile" >&2 || true
            rm -f "$pidfile"; rm -rf "$root"
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "localstack/host.sh: LocalStack not healthy at $url after ${timeout_s}s; last lines of $logfile:" >&2
            tail -n 40 "$logfile" >&2 || true
            stop >/dev/null 2>&1 || true
            exit 1
        fi
        sleep 0.2
    done
    echo "$url"
}

stop() {
    [ -f "$pidfile" ] || { echo "localstack/host.sh: no pid file $pidfile; nothing to stop" >&2; return 0; }
    local pid root
    pid="$(sed -n 1p "$pidfile")"
    root="$(sed -n 2p "$pidfile")"
    if alive "$pid"; then
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then
            echo "localstack/host.sh: PID $pid ignored SIGTERM for 10 s; sending SIGKILL" >&2
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pidfile"
    case "$root" in
        */localstack-root.*) rm -rf "$root" ;;
    esac
}

case "${1:-}" in
    start) shift; start "$@" ;;
    stop) stop ;;
    *) echo "usage: $0 start [PORT] | stop" >&2; exit 2 ;;
esac
