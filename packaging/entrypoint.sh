#!/bin/sh
# Container entrypoint for omnid: the daemon becomes the container's main process.
#
#   docker run --gpus all --stop-timeout 120 -v ./units:/etc/omnid/units:ro -p 9321:9321 IMAGE
#   docker run IMAGE --log-format console       # extra daemon flags
#   docker run IMAGE omnid check                # any other command runs as given
#
# omnid runs fine as PID 1 (see packaging/README.md): it handles SIGTERM and
# SIGINT itself (`docker stop` = ordered stop, exit 0), and every unit descends
# from its spawner, a child subreaper that reaps the stack's orphans. What it does
# not reap are strangers re-parented to PID 1, such as background processes left
# by `docker exec` / `kubectl exec`; set OMNID_INIT=tini (or run with
# `docker run --init`) to put tini in front for those.
set -eu

units=${OMNID_UNITS:-/etc/omnid/units}
# Probes come from outside the container's network namespace: listen on all
# addresses (numeric, so no resolver thread is started).
health=${OMNID_HEALTH_LISTEN:-0.0.0.0:9321}
log_format=${OMNID_LOG_FORMAT:-json}

# Not root and no XDG_RUNTIME_DIR (usual in containers): put the control socket
# somewhere this user can create a 0700 directory.
if [ "$(id -u)" != 0 ] && [ -z "${XDG_RUNTIME_DIR:-}" ] && [ -z "${OMNID_CONTROL:-}" ]; then
    OMNID_CONTROL=/tmp/omnid-$(id -u)/control.sock
    export OMNID_CONTROL
fi

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    # First argument is not a flag: run that command instead of the daemon.
    exec "$@"
fi

set -- omnid daemon -u "$units" --health-listen "$health" --log-format "$log_format" "$@"

case ${OMNID_INIT:-} in
    "")
        exec "$@"
        ;;
    tini)
        # Plain tini, NOT `tini -g`: -g would also signal the daemon's process
        # group, whose spawner must outlive the ordered stop (units die with it).
        exec tini -- "$@"
        ;;
    *)
        echo "entrypoint: OMNID_INIT must be empty or 'tini', not '$OMNID_INIT'" >&2
        exit 2
        ;;
esac
