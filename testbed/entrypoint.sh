#!/bin/sh
# The testbed image's entry point: `aggregator` or `worker`, configured by environment variables.
# AGGREGATOR=software (default) runs the software aggregator; AGGREGATOR=switch runs the emulated P4
# switch in UDP mode, which knows its workers by source address: worker k sends from
# 172.28.5.(10+k):48880 (MEMBERS overrides the list), one 64-value block per datagram.
set -e
role="${1:-worker}"
kind="${AGGREGATOR:-software}"
case "$kind" in software|switch) ;; *) echo "testbed: AGGREGATOR must be software or switch, not $kind" >&2; exit 2;; esac
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
    if [ "$kind" = switch ]; then
        [ "${TASK:-check}" = check ] || { echo "testbed: AGGREGATOR=switch runs TASK=check only" >&2; exit 2; }
        members="${MEMBERS:-}"
        if [ -z "$members" ]; then
            k=0
            while [ "$k" -lt "${WORKERS:-4}" ]; do
                members="$members 172.28.5.$((10 + k)):${WORKER_PORT:-48880}"; k=$((k + 1))
            done
        fi
        exec zerosum switch --udp "0.0.0.0:${PORT:-48879}" --members $members --job "${JOB:-1}" \
            --idle-exit "${IDLE_EXIT:-15}" --announce $extra
    fi
    # Training runs gloo first and leaves ZeroSum idle meanwhile: wait longer before exiting.
    idle="${IDLE_EXIT:-15}"
    [ "${TASK:-check}" = train ] && idle="${IDLE_EXIT:-600}"
    exec zerosum aggregator --workers "${WORKERS:-4}" --listen "0.0.0.0:${PORT:-48879}" --job "${JOB:-1}" \
        --idle-exit "$idle" $extra
    ;;
worker)
    if [ "${TASK:-check}" = train ]; then
        # The training example across containers: one process per container, rank 0 is the master.
        python3 -c "import torch" 2>/dev/null || { echo "testbed: TASK=train needs an image built with WITH_TORCH=1" >&2; exit 2; }
        export ZEROSUM_AGGREGATORS="${AGGREGATORS:-aggregator:48879}" ZEROSUM_JOB="${JOB:-1}"
        export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-eth0}" OMP_NUM_THREADS=1
        exec torchrun --nnodes "${WORKERS:-4}" --nproc-per-node 1 --node-rank "$RANK" \
            --master-addr "${MASTER_ADDR:-172.28.5.10}" --master-port "${MASTER_PORT:-29500}" \
            -m "zerosum.examples.${EXAMPLE:-embedding}" --steps "${STEPS:-20}"
    fi
    wire="--block-size ${BLOCK_SIZE:-256}"
    [ "$kind" = switch ] && wire="--block-size 64 --max-entries 1 --bind 0.0.0.0:${WORKER_PORT:-48880}"
    exec zerosum check --rank "${RANK:?set RANK}" --world "${WORKERS:-4}" $wire \
        --aggregators ${AGGREGATORS:-aggregator:48879} --job "${JOB:-1}" --size "${SIZE:-1000000}" \
        --densities "${DENSITIES:-1.0,0.1,0.01}" --timeout "${TIMEOUT:-60}" --results /results
    ;;
*)
    exec "$@"
    ;;
esac
