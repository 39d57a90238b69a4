#!/bin/sh
# The testbed image's entry point: `aggregator` or `worker`, configured by environment variables.
set -e
role="${1:-worker}"
case "$role" in
aggregator)
    extra=""
    if [ -n "${LOSS:-}" ] && [ "$LOSS" != "0" ]; then
        # Real packet loss on the container's interface when tc netem is there (needs NET_ADMIN),
        # otherwise the aggregator drops datagrams itself.
        if command -v tc >/dev/null 2>&1 && tc qdisc add dev eth0 root netem loss "$LOSS" 2>/dev/null; then
            echo "testbed: netem loss $LOSS on eth0"
        else
            echo "testbed: tc netem unavailable, the aggregator simulates loss $LOSS"
            extra="--loss $LOSS"
        fi
    fi
    exec zerosum aggregator --workers "${WORKERS:-4}" --listen "0.0.0.0:${PORT:-48879}" --job "${JOB:-1}" \
        --idle-exit "${IDLE_EXIT:-15}" $extra
    ;;
worker)
    exec zerosum check --rank "${RANK:?set RANK}" --world "${WORKERS:-4}" \
        --aggregators ${AGGREGATORS:-aggregator:48879} --job "${JOB:-1}" --size "${SIZE:-1000000}" \
        --densities "${DENSITIES:-1.0,0.1,0.01}" --timeout "${TIMEOUT:-60}" --results /results
    ;;
*)
    exec "$@"
    ;;
esac
