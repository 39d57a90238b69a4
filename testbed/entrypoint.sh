#!/bin/sh
# The testbed image's entry point: `aggregator` or `worker`, configured by environment variables.
# AGGREGATOR=software (default) runs the software aggregator; AGGREGATOR=switch runs the emulated P4
# switch in UDP mode, which knows its workers by source address: worker k sends from
# 172.28.5.(10+k):48880 (MEMBERS overrides the list), one 64-value block per datagram.
set -e
role="${1:-worker}"
kind="${AGGREGATOR:-software}"
port="${PORT:-48879}"
# The software aggregator admits only JOINs authenticated with a key (protected mode): it writes a fresh
# one into the run's shared tmpfs volume, which the workers wait for. (A switch takes no key.)
keys="${KEYS:-/keys}"
key_file="$keys/key"
new_key() {
    umask 077
    python3 -c 'import secrets; print(secrets.token_hex(32))' > "$key_file.tmp" && mv "$key_file.tmp" "$key_file"
}
wait_for_key() {
    n=0
    while [ ! -s "$key_file" ]; do
        n=$((n + 1)); [ "$n" -le 600 ] || { echo "testbed: no key in $key_file after 60 s" >&2; exit 2; }
        sleep 0.1
    done
}
case "$kind" in software|switch) ;; *) echo "testbed: AGGREGATOR must be software or switch, not $kind" >&2; exit 2;; esac
run_aggregator() {
    # The software aggregator or the emulated switch; $1: extra options (e.g. simulated loss).
    extra="$1"
    if [ "$kind" = switch ]; then
        [ "${TASK:-check}" = check ] || { echo "testbed: AGGREGATOR=switch runs TASK=check only" >&2; exit 2; }
        members="${MEMBERS:-}"
        if [ -z "$members" ]; then
            k=0
            while [ "$k" -lt "${WORKERS:-4}" ]; do
                members="$members 172.28.5.$((10 + k)):${WORKER_PORT:-48880}"; k=$((k + 1))
            done
        fi
        exec zerosum switch --udp "0.0.0.0:$port" --members $members --job "${JOB:-1}" \
            --idle-exit "${IDLE_EXIT:-15}" --announce $extra
    fi
    # Training runs gloo first and leaves ZeroSum idle meanwhile: wait longer before exiting.
    idle="${IDLE_EXIT:-15}"
    [ "${TASK:-check}" = train ] && idle="${IDLE_EXIT:-600}"
    exec zerosum aggregator --workers "${WORKERS:-4}" --listen "0.0.0.0:$port" --job "${JOB:-1}" \
        --idle-exit "$idle" --key-file "$key_file" $extra
}

case "$role" in
aggregator)
    [ "$kind" = switch ] || new_key
    extra=""
    kernel_drops=""
    if [ -n "${LOSS:-}" ] && [ "$LOSS" != "0" ]; then
        # Real packet loss in the container's kernel (needs NET_ADMIN): tc netem on eth0 where the kernel
        # has it; else iptables' statistic match, dropping that share of the aggregator's UDP datagrams
        # in both directions; else (no tools in the image) the aggregator drops datagrams itself.
        share="$(awk -v l="$LOSS" 'BEGIN { if (l ~ /%$/) { sub(/%$/, "", l); l /= 100 } printf "%.6f", l }')"
        if command -v tc >/dev/null 2>&1 && tc qdisc add dev eth0 root netem loss "$LOSS" 2>/dev/null; then
            echo "testbed: netem loss $LOSS on eth0"
        elif command -v iptables >/dev/null 2>&1 \
                && iptables -A INPUT -p udp --dport "$port" -m statistic --mode random --probability "$share" -j DROP 2>/dev/null \
                && iptables -A OUTPUT -p udp --sport "$port" -m statistic --mode random --probability "$share" -j DROP 2>/dev/null; then
            echo "testbed: kernel drops (iptables statistic) of loss $LOSS of the aggregator's UDP datagrams, both ways"
            kernel_drops=1
        else
            echo "testbed: no tc netem or iptables here, the aggregator simulates loss $LOSS"
            extra="--loss $LOSS"
        fi
    fi
    if [ -z "$kernel_drops" ]; then
        run_aggregator "$extra"     # execs: does not return
    fi
    # Run the aggregator as a child, so that the kernel's drop counts can be reported when it ends.
    run_aggregator "$extra" & child=$!
    trap 'kill -TERM "$child" 2>/dev/null' TERM INT
    rc=0
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done   # woken by a signal
    echo "testbed: the kernel dropped $(iptables -L INPUT -v -n -x | awk '/statistic/ { print $1 }') datagrams" \
         "to and $(iptables -L OUTPUT -v -n -x | awk '/statistic/ { print $1 }') from the aggregator"
    exit "$rc"
    ;;
worker)
    key_option=""
    if [ "$kind" = software ]; then
        wait_for_key
        key_option="--key-file $key_file"
        ZEROSUM_KEY="$(cat "$key_file")"; export ZEROSUM_KEY
    fi
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
        --densities "${DENSITIES:-1.0,0.1,0.01}" --timeout "${TIMEOUT:-60}" --results /results $key_option
    ;;
*)
    exec "$@"
    ;;
esac
