"""`zerosum bench` / `zerosum demo`: the OmniReduce microbenchmark against torch's gloo allreduce.

Every rank holds a float32 tensor whose non-zero blocks are chosen at random per rank with probability
`density`. Per density, each rank runs warm-up and timed ZeroSum allreduces, then the same tensor
through torch.distributed's gloo allreduce in the same processes. A round's time is the slowest rank's;
the table shows the median over rounds.

Per row (world size and density) the bench also measures, over the timed allreduces only, the entries
retransmitted, and the CPU time per datagram sent or received of each worker process and of the
aggregator process(es). Workers record cumulative counters around each allreduce; the aggregators are
asked for theirs (`LocalAggregator.snapshot`) while every rank waits at a checkpoint before the first
and after the last timed allreduce. The summaries and the table are pure functions of those records.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import resource
import statistics
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .aggregator_service import MAX_JOB_SLOTS
from .floor import ProcessDied, makespan, next_report, read_pass, run_floor
from .local import CTX, LocalAggregator, new_key
from .udp import free_port as _free_port

CHECKPOINT_TIMEOUT = 600.0   # seconds a rank waits for the others (and for the aggregators' snapshot)


def bench_tensor(rank: int, density: float, n: int, block_size: int, seed: int = 0) -> np.ndarray:
    """Standard normal values in the non-zero blocks, chosen independently per rank."""
    rng = np.random.default_rng([seed, rank, int(density * 1e6)])
    nblocks = -(-n // block_size)
    keep = rng.random(nblocks) < density
    x = np.zeros(nblocks * block_size, np.float32)
    idx = np.flatnonzero(keep)
    x.reshape(nblocks, block_size)[idx] = rng.standard_normal((len(idx), block_size), np.float32)
    return x[:n]


# -- in the worker processes -------------------------------------------------------------------------

def _meter(w) -> dict:
    """This worker process's cumulative counters: CPU seconds (the worker runs in the process's main
    thread; other threads, such as gloo's, idle during ZeroSum allreduces), datagrams sent + received,
    entries retransmitted and bytes sent."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    s = w.stats
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "datagrams": s.datagrams_sent + s.datagrams_received,
            "retransmitted_entries": s.retransmitted_entries, "bytes_sent": s.bytes_sent,
            # what resent them: probes confirming losses (R-L2) or RACK (R-C4); how many were spurious
            "probes": s.probes, "tail_probes": s.tail_probes, "spurious_entries": s.spurious_entries,
            "delay_cuts": s.window_cuts[0], "loss_cuts": s.window_cuts[1]}


def _worker(events, acks, sync, rank, world, addresses, plan, gloo_port):
    try:
        _worker_body(events, acks, sync, rank, world, addresses, plan, gloo_port)
    except Exception as e:
        events.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _worker_body(events, acks, sync, rank, world, addresses, plan, gloo_port):
    import zerosum
    gloo_host = "127.0.0.1"
    if plan.get("namespaces"):      # --mtu: this rank is a host of its own, gloo on the same link
        from . import netns
        netns.enter(plan["namespaces"][rank])
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        gloo_host = netns.worker_ip(0)
    dist = None
    if plan["baseline"]:
        try:
            import torch
            import torch.distributed as dist
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://{gloo_host}:{gloo_port}", rank=rank,
                                    world_size=world)
        except ImportError:
            dist = None
    # Every timed allreduce starts together, with or without gloo: a rank that started while another was
    # still restoring its input would count that wait as ZeroSum's time, or miss it. And every rank
    # waits for the others to finish before it restores its input: a rank that finished first copied
    # its whole tensor while the others still reduced, on the same cores and memory bus.
    barrier = dist.barrier if dist else (lambda: sync.wait(CHECKPOINT_TIMEOUT))

    def checkpoint(row: int, phase: str) -> None:
        """Every rank waits here while rank 0 has the bench snapshot the aggregators' counters."""
        sync.wait(CHECKPOINT_TIMEOUT)
        if rank == 0:
            events.put(("checkpoint", row, phase))
            acks.get(timeout=CHECKPOINT_TIMEOUT)
        sync.wait(CHECKPOINT_TIMEOUT)

    with zerosum.Worker(rank, world, addresses, block_size=plan["block_size"], loss=plan["loss"],
                        seed=rank, max_datagram=plan.get("max_datagram"), key=plan["key"],
                        multicast=plan.get("multicast"), window=plan.get("window"),
                        congestion=plan.get("congestion", True)) as w:
        for row, density in enumerate(plan["densities"]):
            x = bench_tensor(rank, density, plan["size"], plan["block_size"])
            data = _Staged(x, plan.get("device", "cpu"))
            zs, marks, reads, phases = [], [], [], []

            def read_alone() -> tuple[float, float]:
                """The ranks read their restored inputs once, started as an allreduce is, between the
                timed allreduces (--floor): the read floor of the same minutes, on the same buffers."""
                data.restore()
                barrier()
                t0 = time.monotonic()          # one clock for every process on the host
                read_pass(data.y)
                span = (t0, time.monotonic())
                barrier()
                return span

            for i in range(plan["warmup"] + plan["rounds"]):
                # In place, as gloo's all_reduce is: restore the input (untimed), then reduce it.
                data.restore()
                if i == plan["warmup"]:
                    checkpoint(row, "start")
                barrier()
                before = _meter(w)
                started = time.monotonic()     # one clock for every process on the host
                t0 = time.perf_counter()
                w.allreduce(data.y, out=data.y)
                data.wait()
                dt = time.perf_counter() - t0
                marks.append((before, _meter(w)))
                barrier()
                if i == 0:
                    result = data.result()
                    digest = hashlib.sha1(result.tobytes()).hexdigest()
                    if plan["verify"] and rank == 0:
                        from .reference import reference_allreduce
                        ref = reference_allreduce([bench_tensor(r, density, plan["size"], plan["block_size"])
                                                   for r in range(world)], plan["block_size"])
                        if ref.tobytes() != result.tobytes():
                            raise AssertionError(f"density {density}: result differs from the reference")
                if i >= plan["warmup"]:
                    zs.append(dt)
                    phases.append((started, *w.stats.exchange))
                    if plan.get("read_beside"):
                        reads.append(read_alone())
                events.put(("step", rank))
            checkpoint(row, "end")
            base = []
            if dist is not None:
                for i in range(plan["warmup"] + plan["rounds"]):
                    data.restore()
                    barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(data.y_tensor())
                    data.wait()
                    dt = time.perf_counter() - t0
                    barrier()
                    if i >= plan["warmup"]:
                        base.append(dt)
                    events.put(("step", rank))
            events.put(("result", rank, row,
                        {"zerosum_s": zs, "gloo_s": base, "marks": marks, "digest": digest, "read_spans": reads,
                         "phases": phases,
                         "window_bytes": w.stats.window, "srtt_s": w.stats.srtt, "host_wait_s": w.stats.host_wait,
                         "window": w.config.window, "slots": w.slots}))
    if dist is not None:
        dist.destroy_process_group()
    events.put(("done", rank))


class _Staged:
    """A rank's input `x` and the buffer `y` it is reduced in, on the host (numpy) or on a torch device
    (--device cuda: a GPU worker's tensors; Worker.allreduce finds their blocks on the device, and gloo
    reduces the same tensor). `wait` ends a timed call only when the device has finished it."""

    def __init__(self, x: np.ndarray, device: str):
        self.device = device
        if device == "cpu":
            self.x, self.y = x, np.empty_like(x)
        else:
            import torch
            self.torch = torch
            self.x = torch.from_numpy(x).to(device)
            self.y = torch.empty_like(self.x)

    def restore(self) -> None:
        if self.device == "cpu":
            np.copyto(self.y, self.x)
        else:
            self.y.copy_(self.x)
            self.wait()

    def wait(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize(self.device)

    def result(self) -> np.ndarray:
        return self.y if self.device == "cpu" else self.y.cpu().numpy()

    def y_tensor(self):
        """y as a torch tensor (sharing its memory), for gloo."""
        if self.device == "cpu":
            import torch
            return torch.from_numpy(self.y)
        return self.y


# -- in the bench process ----------------------------------------------------------------------------

STAR_GROUP = "239.255.77.1"   # results' group on the veth star (--mtu), at STAR_PORT unless given one
STAR_PORT = 48900


def star_results_group(setting: str, hosts: Mapping[str, tuple[str, str]]) -> tuple[str | None, str]:
    """--multicast on the veth star (--mtu; hosts: name -> (namespace, address), aggregators "a<i>",
    workers "w<r>"), as local.choose_group reads it. Every aggregator sends its results to one
    GROUP:PORT (STAR_PORT unless given), the workers tell them apart by source address; the probe: one
    datagram from each aggregator reaches every worker across the bridge."""
    from . import netns
    from .local import choose_group

    def probe(group: str, port: int | None) -> tuple[int, str | None]:
        port = port or STAR_PORT
        return port, netns.multicast_problem(group, port, {h: v for h, v in hosts.items() if h.startswith("a")},
                                             {h: v for h, v in hosts.items() if h.startswith("w")})
    return choose_group(setting, STAR_GROUP, probe, "across the veth links")


def run_world(world: int, plan: dict, aggregators: int, port: int, on_step=lambda: None) -> dict:
    """One world size: on loopback, or with plan["mtu"] on hosts in network namespaces (netns.star),
    where plan["multicast"] is still the --multicast setting (star_results_group resolves it there)."""
    if not plan.get("mtu"):
        return _run_world(world, plan, aggregators, port, on_step)
    from . import netns
    hosts = {f"a{i}": netns.aggregator_ip(i) for i in range(aggregators)}
    hosts.update({f"w{r}": netns.worker_ip(r) for r in range(world)})
    with netns.star(hosts, plan["mtu"]) as (ns, _):
        group, note = star_results_group(plan["multicast"], {h: (ns[h], ip) for h, ip in hosts.items()})
        here = dict(plan, namespaces=[ns[f"w{r}"] for r in range(world)], multicast=group,
                    listen=[f"{netns.aggregator_ip(i)}:{port or 48879}" for i in range(aggregators)],
                    prefixes=[["ip", "netns", "exec", ns[f"a{i}"]] for i in range(aggregators)])
        return dict(_run_world(world, here, aggregators, port, on_step), multicast=group, multicast_note=note)


def _run_world(world: int, plan: dict, aggregators: int, port: int, on_step) -> dict:
    listen = plan.get("listen") or [f"127.0.0.1:{port + i if port else 0}" for i in range(aggregators)]
    plan = dict(plan, key=new_key())     # only this run's workers can join its aggregators
    aggs = [LocalAggregator(world, slots=plan["slots"], listen=listen[i], max_datagram=plan.get("max_datagram"),
                            prefix=plan["prefixes"][i] if plan.get("prefixes") else (),
                            multicast=plan.get("multicast"), key=plan["key"], block_size=plan["block_size"])
            for i in range(aggregators)]
    slots_note = aggs[0].slots_note or (f"{plan['slots']:,} slots per aggregator" if plan["slots"] else
                                        f"{MAX_JOB_SLOTS:,} slots per job (the aggregator's default)")
    events, acks, sync = CTX.Queue(), CTX.Queue(), CTX.Barrier(world)
    gloo_port = 29500 if plan.get("namespaces") else _free_port()
    procs = [CTX.Process(target=_worker, daemon=True,
                         args=(events, acks, sync, r, world, [a.address for a in aggs], plan, gloo_port))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, list[dict]] = {}
    snapshots: dict[int, dict[str, list[dict]]] = {}
    done = 0
    try:
        while done < world:
            ev = next_event(events, procs)
            if ev[0] == "error":
                raise RuntimeError(f"rank {ev[1]} failed: {ev[2]}")
            if ev[0] == "step" and ev[1] == 0:
                on_step()
            elif ev[0] == "checkpoint":
                snapshots.setdefault(ev[1], {})[ev[2]] = [a.snapshot() for a in aggs]
                acks.put(True)
            elif ev[0] == "result":
                results.setdefault(ev[2], []).append(ev[3])
            elif ev[0] == "done":
                done += 1
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        agg_counters = [a.stop() for a in aggs]
    rows = [summarize_row(world, density, plan, results[row], snapshots[row]["start"], snapshots[row]["end"])
            for row, density in enumerate(plan["densities"])]
    return {"rows": rows, "aggregators": agg_counters, "slots_note": slots_note}


def next_event(events, procs, timeout: float = 600) -> tuple:
    """The next report of the bench's worker processes; a process that died without one (killed, or a
    crash below Python), or silence for `timeout` seconds, is an error at once: the others would wait
    for it at the next barrier for as long as the barrier's timeout."""
    try:
        return next_report(events, procs, range(len(procs)), timeout)
    except ProcessDied as e:
        return ("error", e.rank, f"its process died (exit code {e.exitcode})")
    except queue.Empty:
        raise RuntimeError(f"benchmark workers stopped reporting for {timeout:.0f} s") from None


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each cumulative counter grew by between two snapshots (a counter absent before was 0)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in {*before, *after}}


def window_total(marks: Iterable[tuple[Mapping[str, float], Mapping[str, float]]]) -> dict[str, float]:
    """The sum of `counter_delta` over (before, after) pairs: what the counters grew by inside the windows."""
    total: dict[str, float] = {}
    for before, after in marks:
        for k, v in counter_delta(before, after).items():
            total[k] = total.get(k, 0) + v
    return total


def us_per_datagram(cpu_s: float, datagrams: float) -> float | None:
    return cpu_s / datagrams * 1e6 if datagrams else None


def summarize_row(world: int, density: float, plan: dict, results: Sequence[dict],
                  agg_start: Sequence[Mapping], agg_end: Sequence[Mapping]) -> dict:
    """One table row from every rank's result (`zerosum_s`, `gloo_s`: timed rounds; `marks`: cumulative
    counters before and after each allreduce, warm-up included; `digest` of the first result) and the
    aggregators' snapshots at the start and end of the timed rounds. Retransmissions, CPU time and
    datagrams count the timed allreduces only (retransmissions in the warm-up are reported separately)."""
    rounds, warmup = plan["rounds"], plan["warmup"]
    if len({r["digest"] for r in results}) != 1:
        raise RuntimeError(f"density {density}: ranks got different results")
    zs = statistics.median(max(r["zerosum_s"][i] for r in results) for i in range(rounds))
    base = (statistics.median(max(r["gloo_s"][i] for r in results) for i in range(rounds))
            if results[0]["gloo_s"] else None)
    timed = [window_total(r["marks"][warmup:]) for r in results]
    warm = [window_total(r["marks"][:warmup]) for r in results]
    agg = [counter_delta(b, a) for b, a in zip(agg_start, agg_end)]
    wcpu, wdg = sum(t.get("cpu_s", 0) for t in timed), sum(t.get("datagrams", 0) for t in timed)
    acpu = sum(d.get("cpu_s", 0) for d in agg)
    adg = sum(d.get("datagrams", 0) + d.get("datagrams_sent", 0) for d in agg)
    return {
        "workers": world, "density": density, "zerosum_s": zs, "gloo_s": base,
        "speedup": (base / zs) if base else None,
        "wire_bytes_per_worker": statistics.mean(t.get("bytes_sent", 0) for t in timed) / rounds,
        "gloo_ring_bytes_per_worker": 2 * (world - 1) / world * plan["size"] * 4,
        "retransmitted_entries": sum(t.get("retransmitted_entries", 0) for t in timed),
        # per rank, in the timed allreduces: the congestion window's view of them (R-L2, R-C3, R-C4)
        "recovery": [{k: int(t.get(k, 0)) for k in ("retransmitted_entries", "spurious_entries", "probes",
                                                     "tail_probes", "delay_cuts", "loss_cuts")} for t in timed],
        "warmup_retransmitted_entries": sum(t.get("retransmitted_entries", 0) for t in warm),
        # Per allreduce: CPU seconds and datagrams (sent + received) of one worker process (the mean)...
        "worker_cpu_s": wcpu / world / rounds, "worker_datagrams": wdg / world / rounds,
        "worker_cpu_us_per_datagram": us_per_datagram(wcpu, wdg),
        # ... and of the aggregator process(es) together (received `datagrams` + `datagrams_sent`).
        "aggregator_cpu_s": acpu / rounds, "aggregator_datagrams": adg / rounds,
        "aggregator_cpu_us_per_datagram": us_per_datagram(acpu, adg),
        # where each worker's window and round trip settled (after the row's last allreduce)
        "window_bytes": [r.get("window_bytes") for r in results],
        "srtt_s": [r.get("srtt_s") for r in results],
        "host_wait_s": [r.get("host_wait_s") for r in results],    # longest read delay so far (R-C4)
        "window": results[0].get("window", plan.get("window")) if results else None,   # what "auto" became
        "slots": results[0].get("slots") if results else None,    # the job's slots, as JOIN_ACK granted them
        # (--floor) the ranks' read of their inputs alone, between the timed allreduces: first start to
        # last end, the median over rounds
        "read_s": makespan([r["read_spans"] for r in results]) if results and results[0].get("read_spans")
        else None,
        **phase_split([r["phases"] for r in results] if results and results[0].get("phases") else None),
    }


def phase_split(phases) -> dict:
    """Where a row's time went, from every rank's (call, exchange start, exchange end) per timed round
    (ranks x rounds x 3, one clock): `found_s`, from the first rank's call to the last rank's first
    datagram (every rank's blocks found: the exchange cannot complete a round before), and `exchange_s`,
    from there to the last rank's last result; medians over rounds."""
    if not phases:
        return {"found_s": None, "exchange_s": None}
    p = np.asarray(phases, np.float64)
    return {"found_s": makespan(p[:, :, :2]),          # first call to the last exchange's start
            "exchange_s": float(np.median(p[:, :, 2].max(axis=0) - p[:, :, 1].max(axis=0)))}


# -- reporting (pure functions of the results) ---------------------------------------------------------

# (header, legend): headers short enough for the table to fit 80 columns; the legend goes under it.
COLUMNS = [
    ("wkrs", "worker processes"),
    ("dens", "density, the fraction of non-zero blocks"),
    ("ZS s", "ZeroSum allreduce seconds (median over rounds of the slowest rank)"),
    ("gloo s", "the same for torch gloo's allreduce"),
    ("speedup", "gloo s / ZS s (above 1: ZeroSum is faster)"),
    ("ZS MB", "UDP payload a ZeroSum worker sends per allreduce"),
    ("ring MB", "what gloo's ring sends per worker"),
    ("retx", "entries retransmitted in the timed allreduces (all workers)"),
    ("wkr µs/dg", "CPU µs per datagram sent or received, in a worker process"),
    ("agg µs/dg", "the same in the aggregator process(es)"),
]


def ratio_label(ratio: float) -> str:
    return f"{ratio:.2f}×"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def microseconds(value: float | None) -> str:
    """CPU µs per datagram: whole µs, with a decimal below 10 (a veth run's MTU-sized datagrams cost a
    fraction of one, which "0" would hide)."""
    return _num(value, ".1f" if value is not None and value < 9.95 else ".0f")


def table_cells(r: Mapping) -> list[str]:
    """One row of the table, in the order of COLUMNS ("-" where a value is missing)."""
    mb = lambda key: _num(r[key] / 1e6 if r.get(key) is not None else None, ".1f")  # noqa: E731
    return [str(r["workers"]), f"{r['density']:g}", _num(r.get("zerosum_s"), ".3f"),
            _num(r.get("gloo_s"), ".3f"),
            ratio_label(r["speedup"]) if r.get("speedup") else "-", mb("wire_bytes_per_worker"),
            mb("gloo_ring_bytes_per_worker"), _num(r.get("retransmitted_entries"), "d"),
            microseconds(r.get("worker_cpu_us_per_datagram")),
            microseconds(r.get("aggregator_cpu_us_per_datagram"))]


def read_floor_summary(run: Mapping, size: int) -> str:
    """The read floor's line (`--floor`): how long the workers take to read their float32 tensors of
    `size` once, all starting together (`read_floor_s`: the median of the rows' reads), and what that
    leaves: no allreduce of dense input can take less, so gloo's time over it bounds the speed-up at any
    density."""
    world, read_s = run["rows"][0]["workers"], run["read_floor_s"]
    line = (f"{world} workers reading their tensors once, all starting together: {read_s:.4f} s from the first "
            f"start to the last end ({world * 4 * size / read_s / 1e9:.1f} GB/s), the least an allreduce of "
            "dense input takes at any density (finding the non-zero blocks reads every value)")
    gloo = [r["gloo_s"] for r in run["rows"] if r.get("gloo_s")]
    if gloo:
        line += f"; gloo's {min(gloo):.3f} s is {min(gloo) / read_s:.1f}x that, the most any density can gain here"
    return line


def floor_line(row: Mapping) -> str:
    """A row against the floors of its run (`--floor`): the sockets-only star's time, and the read of
    the ranks' inputs between the same timed allreduces (at low density ZeroSum's time is that read and
    an exchange after it: what is left over the read is the exchange's, and any wait between them)."""
    line = (f"{row['workers']} workers, density {row['density']:g}: ZeroSum {row['zerosum_s'] / row['floor_s']:.2f}x "
            f"the floor's time ({row['floor_s']:.3f} s; gloo beside the floor {row['floor_gloo_s']:.3f} s)")
    if row.get("read_s"):
        line += (f"; the read alone in the same rounds {row['read_s']:.4f} s, ZeroSum "
                 f"{row['zerosum_s'] / row['read_s']:.2f}x that ({row['zerosum_s'] - row['read_s']:.4f} s more)")
    if row.get("found_s") is not None:
        line += (f"; every rank's blocks found {row['found_s']:.4f} s after the first call, the exchange "
                 f"{row['exchange_s']:.4f} s after that")
    return line


def slots_summary(results: Mapping) -> str:
    """One line: the slots each world's job was given, and why (LocalAggregator.slots_note)."""
    notes = [(run["rows"][0]["workers"], run["slots_note"]) for run in results["runs"] if run.get("slots_note")]
    if not notes:
        return "slots: not recorded"
    if len({note for _, note in notes}) == 1:
        return f"slots: {notes[0][1]}"
    return "slots: " + "; ".join(f"{world} workers {note}" for world, note in notes)


def window_summary(results: Mapping) -> str:
    """Where the workers' windows and round trips settled, per world size (their ranges over ranks and
    densities)."""
    plan = results["plan"]
    window = plan.get("window")
    used = [r.get("window", window) for run in results["runs"] for r in run["rows"]]
    if window == "auto" and used and all(u is None for u in used):
        return "no window (auto, with every aggregator on this host: no link to find the rate of)"
    kind = ("no window (every column at once)" if window is None else
            f"fixed window {window:,} B" if not plan.get("congestion", True) else
            "congestion window" + ("" if window == "auto" else f" (at most {window:,} B)"))
    parts = []
    for run in results["runs"]:
        rows = run["rows"]
        ws = [w for r in rows for w in r.get("window_bytes") or [] if w]
        rtts = [t for r in rows for t in r.get("srtt_s") or [] if t is not None]
        waits = [t for r in rows for t in r.get("host_wait_s") or [] if t is not None]
        if ws and rtts:
            parts.append(f"{rows[0]['workers']} workers: {min(ws) / 1e3:,.0f}-{max(ws) / 1e3:,.0f} kB, "
                         f"round trip {min(rtts) * 1e3:.2f}-{max(rtts) * 1e3:.2f} ms"
                         + (f", results read up to {max(waits) * 1e3:.1f} ms after they arrived" if waits else ""))
    return f"{kind}: " + ("; ".join(parts) if parts else "no allreduce measured")


def recovery_summary(results: Mapping) -> str | None:
    """The rows that retransmitted: what the aggregators said of it (spurious: they held the entry
    already), probes sent, and the congestion window's cuts (summed over ranks); None if none did."""
    lines = []
    for run in results["runs"]:
        for r in run["rows"]:
            ranks = r.get("recovery") or []
            if not r.get("retransmitted_entries") or not ranks:
                continue
            total = {k: sum(x[k] for x in ranks) for k in ranks[0]}
            lines.append(f"{r['workers']} workers, density {r['density']:g}: {total['retransmitted_entries']:,} "
                         f"entries resent, {total['spurious_entries']:,} of them held already (spurious); "
                         f"{total['probes']:,} probes ({total.get('tail_probes', 0):,} of them tail probes); "
                         f"window cuts {total['delay_cuts']} for delay, {total['loss_cuts']} for loss")
    return "\n".join(lines) if lines else None


def bench_table(results: Mapping):
    """The rich table of a bench's results, with a legend of its short headers as the caption."""
    from rich import box
    from rich.table import Table
    plan = results["plan"]
    aggs = results["aggregators"]
    on = f" on {plan['device']}" if plan.get("device", "cpu") != "cpu" else ""
    table = Table(title=f"ZeroSum vs gloo: {plan['size']:,} float32{on}, block {plan['block_size']}, "
                        f"{aggs} aggregator{'s' if aggs != 1 else ''}, {results['cpus']} CPUs",
                  caption="; ".join(f"{h}: {legend}" for h, legend in COLUMNS) + ".",
                  caption_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 0, 0, 1))   # one space of padding and one of box: columns 2 apart
    for header, _ in COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for run in results["runs"]:
        for r in run["rows"]:
            table.add_row(*table_cells(r))
    return table


NICE = tuple(round(m * 10.0 ** e, 6) for e in range(-6, 4) for m in (1, 2, 5))   # 1-2-5 ticks of a log axis


def nice_ticks(lo: float, hi: float) -> list[float]:
    """The 1-2-5 values (…, 0.2, 0.5, 1, 2, 5, …) within [lo, hi]."""
    return [t for t in NICE if lo <= t <= hi]


def ratio_axis(ratios: Iterable[float], pad: float = 1.15) -> tuple[tuple[float, float], list[float]]:
    """Limits and ticks of a log ratio axis: the data and 1×, out to the nearest 1-2-5 value on either
    side (so a 1.76× point has 1× and 2× around it), widened by the factor `pad`; the ticks are the
    1-2-5 values within."""
    values = [v for v in ratios if v and v > 0] + [1.0]
    lo = max([t for t in NICE if t <= min(values)], default=min(values))
    hi = min([t for t in NICE if t >= max(values)], default=max(values))
    return (lo / pad, hi * pad), nice_ticks(lo, hi)


def tick_label(ratio: float) -> str:
    return f"{ratio:g}×"


def check_device(device: str) -> None:
    """--device: a torch device this machine has (raises ValueError naming what is missing)."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"--device {device} needs torch (pip install 'zerosum[torch]')") from None
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device}: {e}") from None
    if d.type != "cuda":
        raise ValueError(f"--device must be cpu or a CUDA device (cuda, cuda:N), got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch finds no CUDA device on this machine")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def run_from_args(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from .protocol import MAX_WORLD
    if args.mtu:
        from .netns import available
        if available():
            raise ValueError("--mtu runs workers and aggregators on hosts in network namespaces: it "
                             f"{available()}")
    if any(w > MAX_WORLD for w in args.workers):
        raise ValueError(f"--worlds must be at most {MAX_WORLD}, got {max(args.workers)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.device != "cpu":
        check_device(args.device)
    console = Console()
    plan = {"densities": args.densities, "size": args.size, "block_size": args.block_size,
            "rounds": args.rounds, "warmup": args.warmup, "baseline": not args.no_baseline,
            "verify": args.verify, "loss": args.loss, "slots": args.slots,
            "max_datagram": args.max_datagram, "mtu": args.mtu,
            "window": args.window, "congestion": args.congestion, "device": args.device,
            "read_beside": args.floor and args.device == "cpu"}
    if args.mtu:
        plan["multicast"] = args.multicast     # resolved on each world's star (star_results_group)
    else:
        from .local import results_group
        plan["multicast"], loopback_note = results_group(args.multicast)   # GROUP:PORT or None
    if plan["baseline"]:
        try:
            import torch  # noqa: F401
        except ImportError:
            console.print("[yellow]torch is not installed: running without the gloo baseline "
                          "(pip install 'zerosum[torch]')[/]")
            plan["baseline"] = False
    # compile the kernels here once (numba's cache), not in every process the runs start at once
    from .warmup import warm_up
    with console.status("loading the compiled kernels (the first run compiles them: about a minute)"):
        warm_up()
    steps_per_world = len(args.densities) * (args.warmup + args.rounds) * (2 if plan["baseline"] else 1)
    results = {"plan": plan, "aggregators": args.aggregators, "cpus": os.cpu_count(), "runs": []}
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("allreduce rounds", total=steps_per_world * len(args.workers))
        for world in args.workers:
            progress.update(task, description=f"{world} workers")
            run = run_world(world, plan, args.aggregators, args.port, on_step=lambda: progress.advance(task))
            results["runs"].append(run)
            if args.floor:
                # right after this world's rows, not after every world's: this VM's speed moves by the minute
                progress.update(task, description=f"{world} workers: the sockets-only star")
                floor = run_floor(world, plan["size"], plan["densities"], iters=plan["rounds"])
                for r in run["rows"]:
                    r["floor_s"], r["floor_gloo_s"] = floor[r["density"]]
                reads = [r["read_s"] for r in run["rows"] if r.get("read_s")]
                if reads:
                    run["read_floor_s"] = statistics.median(reads)
    console.print(bench_table(results))
    from .transport import detect
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        console.print(f"datagram I/O: {detect(s).describe()}; largest datagram "
                      f"{plan['max_datagram'] or 'the path MTU - 28 (65,507 on loopback)'}"
                      + (f"; hosts in network namespaces on veth links of MTU {plan['mtu']}"
                         if plan.get("mtu") else "; loopback")
                      + "; " + ("; ".join(sorted({r["multicast_note"] for r in results["runs"]}))
                                if plan.get("mtu") else loopback_note))
    console.print(slots_summary(results))
    console.print(window_summary(results))
    recovery = recovery_summary(results)
    if recovery:
        console.print(recovery)
    for run in results["runs"]:
        if run.get("read_floor_s"):
            console.print(read_floor_summary(run, plan["size"]))
        for r in run["rows"]:
            if r.get("floor_s"):
                console.print(floor_line(r))
    rss = max(c["max_rss_bytes"] for run in results["runs"] for c in run["aggregators"])
    console.print(f"aggregator peak memory: {rss / 2**20:.0f} MiB"
                  + (" (sums verified against the fixed-point reference)" if args.verify else ""))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    if plan["baseline"]:
        plot(results, out / "bench.png")
    console.print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if plan["baseline"] else ""))
    return 0


def plot(results: Mapping, path: Path) -> None:
    """Speedup over gloo against density, one line per world size, each point labelled with its ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter, NullLocator
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    points, lines = [], []
    for run in results["runs"]:
        rows = [r for r in run["rows"] if r["speedup"]]
        if not rows:
            continue
        xs, ys = [r["density"] for r in rows], [r["speedup"] for r in rows]
        (line,) = ax.plot(xs, ys, "o-", ms=5, label=f"{rows[0]['workers']} workers")
        lines.append(line)
        points += [(x, y, line.get_color()) for x, y in zip(xs, ys)]
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    (lo, hi), ticks = ratio_axis(y for _, y, _ in points)
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FixedFormatter([tick_label(t) for t in ticks]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    if points:
        # Room for the labels beside the outermost points; at least a decade of density.
        x0, x1 = min(x for x, _, _ in points) / 1.6, max(x for x, _, _ in points) * 1.8
        widen = max(1.0, (10 * x0 / x1) ** 0.5)
        ax.set_xlim(x0 / widen, x1 * widen)
        xticks = nice_ticks(x0 / widen, x1 * widen)
        ax.xaxis.set_major_locator(FixedLocator(xticks))
        ax.xaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in xticks]))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("density (fraction of non-zero blocks)")
    ax.set_ylabel("speedup over gloo allreduce")
    ax.set_title("ZeroSum vs torch gloo on loopback")
    if points:
        ax.legend(loc="lower left")
    fig.tight_layout()
    _label_points(fig, ax, points, lines)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label_points(fig, ax, points, lines) -> None:
    """Label each (x, y, color) point with its ratio at the first place beside, above or below it that
    overlaps no label already placed, no marker, no line and nothing outside the axes (else the least
    bad one; lines count less than the rest)."""
    renderer = fig.canvas.get_renderer()
    k = fig.dpi / 72   # pixels per point
    pixels = ax.transData.transform([(x, y) for x, y, _ in points]) if points else []
    obstacles = [(px - 4 * k, py - 4 * k, px + 4 * k, py + 4 * k) for px, py in pixels]
    if ax.get_legend():
        obstacles.append(ax.get_legend().get_window_extent(renderer).extents)
    # Each line as small squares every 2 points along it.
    strokes = []
    for line in lines:
        xy = ax.transData.transform(line.get_xydata())
        for (xa, ya), (xb, yb) in zip(xy, xy[1:]):
            n = max(1, int(np.hypot(xb - xa, yb - ya) / (2 * k)))
            strokes += [(xa + (xb - xa) * t - k, ya + (yb - ya) * t - k, xa + (xb - xa) * t + k,
                         ya + (yb - ya) * t + k) for t in np.linspace(0, 1, n + 1)]
    frame = ax.get_window_extent(renderer).extents
    background = {"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.7}
    places = [(6, 0, "left", "center"), (-6, 0, "right", "center"), (0, 5, "center", "bottom"),
              (0, -5, "center", "top"), (5, 5, "left", "bottom"), (5, -5, "left", "top"),
              (-5, 5, "right", "bottom"), (-5, -5, "right", "top"), (0, 14, "center", "bottom"),
              (0, -14, "center", "top")]

    def overlap(a, b) -> float:
        return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))

    for x, y, color in points:
        best = None
        for dx, dy, ha, va in places:
            text = ax.annotate(ratio_label(y), (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha,
                               va=va, fontsize=7, color=color, bbox=background)
            box = text.get_window_extent(renderer).padded(k).extents
            area = (box[2] - box[0]) * (box[3] - box[1])
            cost = (sum(overlap(box, o) for o in obstacles) + area - overlap(box, frame)
                    + 0.1 * sum(overlap(box, o) for o in strokes))
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, text, box)
            else:
                text.remove()
            if cost == 0:
                break
        obstacles.append(best[2])
