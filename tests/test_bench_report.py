"""`zerosum bench` reporting: the table fits 80 columns, per-row counters are differences (not running
totals), the plot's ratio ticks, and one small real run that writes every new field."""
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from zerosum.bench import (COLUMNS, bench_table, counter_delta, floor_line, microseconds, plot, ratio_axis,
                           ratio_label, read_floor_summary, recovery_summary, summarize_row, tick_label,
                           window_total)
from zerosum.floor import makespan, read_pass
from zerosum.local import SNAPSHOT, LocalAggregator, SnapshotOnSignal

PLAN = {"densities": [1.0, 0.01], "size": 26_214_400, "block_size": 256, "rounds": 2, "warmup": 1,
        "baseline": True, "verify": True, "loss": 0.0, "slots": 2048}


def mark(cpu_s, datagrams, retransmitted, bytes_sent):
    return {"cpu_s": cpu_s, "datagrams": datagrams, "retransmitted_entries": retransmitted,
            "bytes_sent": bytes_sent}


def render(table, width=80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue()


def wide_results() -> dict:
    """Results with the widest values a run is likely to give (seconds ≥ 10, 5-digit retransmissions)."""
    row = {"workers": 8, "density": 0.04, "zerosum_s": 10.308, "gloo_s": 0.471, "speedup": 0.0457,
           "wire_bytes_per_worker": 106.7e6, "gloo_ring_bytes_per_worker": 183.5e6,
           "retransmitted_entries": 18432,
           "worker_cpu_us_per_datagram": 1512.4, "aggregator_cpu_us_per_datagram": 271.2}
    return {"plan": PLAN, "aggregators": 1, "cpus": 2,
            "runs": [{"rows": [row, {**row, "density": 0.01, "gloo_s": None, "speedup": None,
                                     "aggregator_cpu_us_per_datagram": None}]}]}


def test_the_table_fits_80_columns_with_whole_headers_and_a_legend():
    out = render(bench_table(wide_results()))
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out                       # no header and no value is cut
    header = next(line for line in lines if "wkrs" in line)
    cells = [c for c in header.split("  ") if c.strip()]
    assert [c.strip() for c in cells] == [h for h, _ in COLUMNS]
    assert "wkr µs/dg" in header and "agg µs/dg" in header
    legend = " ".join(" ".join(lines[lines.index(header) + 1:]).split())
    for h, _ in COLUMNS:
        assert f"{h}:" in legend
    assert "10.308" in out and "18432" in out and "1512" in out and "0.05×" in out


def test_the_table_shows_dashes_for_missing_values():
    out = render(bench_table(wide_results()))
    last = [line for line in out.splitlines() if line.strip().startswith("8  0.01")][0]
    assert last.split()[3:5] == ["-", "-"] and last.split()[-1] == "-"


def test_cpu_per_datagram_keeps_a_decimal_below_10_us():
    assert [microseconds(v) for v in (None, 0.2525, 1.6, 9.94, 9.96, 64.4, 1512.4)] == \
        ["-", "0.3", "1.6", "9.9", "10", "64", "1512"]


def test_counter_delta_and_window_total():
    assert counter_delta({"a": 3, "b": 1}, {"a": 5, "c": 2}) == {"a": 2, "b": -1, "c": 2}
    marks = [(mark(1.0, 10, 0, 100), mark(1.5, 20, 4, 300)), (mark(2.0, 25, 4, 350), mark(2.25, 30, 4, 400))]
    assert window_total(marks) == mark(0.75, 15, 4, 250)
    assert window_total([]) == {}


def test_retransmissions_are_per_row_not_running_totals():
    """A worker's counters are cumulative over densities: the first density retransmits 5 entries in its
    timed rounds, the second none in its timed rounds (3 in its warm-up): the rows say 5, then 0."""
    cum = [mark(0.0, 0, 0, 0), mark(1.0, 100, 0, 1000),    # density 1.0: warm-up
           mark(1.0, 100, 0, 1000), mark(2.0, 200, 2, 2000),  # timed
           mark(2.0, 200, 2, 2000), mark(3.0, 300, 5, 3000),  # timed
           mark(3.0, 300, 5, 3000), mark(3.5, 310, 8, 3100),  # density 0.01: warm-up
           mark(3.5, 310, 8, 3100), mark(3.6, 320, 8, 3200),  # timed
           mark(3.6, 320, 8, 3200), mark(3.7, 330, 8, 3300)]  # timed
    pairs = list(zip(cum[::2], cum[1::2]))
    agg = [{"datagrams": n, "datagrams_sent": n, "cpu_s": cpu}     # an aggregator's snapshots
           for n, cpu in [(0, 0.0), (400, 0.8), (420, 0.85), (460, 0.87)]]
    rows = []
    for i, density in enumerate(PLAN["densities"]):
        results = [{"zerosum_s": [0.5, 0.7], "gloo_s": [0.1, 0.1], "digest": "d",
                    "marks": pairs[3 * i:3 * i + 3]} for _ in range(2)]   # two ranks with the same counters
        rows.append(summarize_row(2, density, PLAN, results, [agg[2 * i]], [agg[2 * i + 1]]))
    assert [r["retransmitted_entries"] for r in rows] == [10, 0]       # 5 per rank, 2 ranks
    assert [r["warmup_retransmitted_entries"] for r in rows] == [0, 6]
    assert rows[0]["worker_cpu_us_per_datagram"] == pytest.approx(2.0 / 200 * 1e6)
    assert rows[1]["worker_cpu_us_per_datagram"] == pytest.approx(0.2 / 20 * 1e6)
    assert rows[0]["worker_cpu_s"] == pytest.approx(1.0) and rows[0]["worker_datagrams"] == 100
    assert rows[0]["aggregator_cpu_us_per_datagram"] == pytest.approx(0.8 / 800 * 1e6)
    assert rows[1]["aggregator_cpu_us_per_datagram"] == pytest.approx(0.02 / 80 * 1e6)
    assert rows[1]["aggregator_cpu_s"] == pytest.approx(0.01) and rows[1]["aggregator_datagrams"] == 40
    assert rows[0]["wire_bytes_per_worker"] == 1000
    assert rows[0]["zerosum_s"] == pytest.approx(0.6) and rows[0]["speedup"] == pytest.approx(0.1 / 0.6)


def test_recovery_is_per_rank_in_the_timed_rounds_and_summed_in_the_summary():
    """What the congestion window made of the row's retransmissions: each rank's counters over the timed
    allreduces only (the warm-up's spurious entry is left out), and one line per row that resent any."""
    def at(retx, spurious, probes, delay, loss, tail=0):
        return {**mark(0.0, 0, retx, 0), "spurious_entries": spurious, "probes": probes, "tail_probes": tail,
                "delay_cuts": delay, "loss_cuts": loss}
    ranks = [[(at(0, 0, 0, 0, 0), at(1, 1, 0, 1, 0)),               # warm-up
              (at(1, 1, 0, 1, 0), at(4, 3, 3, 2, 1, tail=1))],      # timed
             [(at(0, 0, 0, 0, 0), at(0, 0, 0, 0, 0)),
              (at(0, 0, 0, 0, 0), at(2, 2, 0, 0, 0))]]
    results = [{"zerosum_s": [0.5], "gloo_s": [], "digest": "d", "marks": m} for m in ranks]
    plan = {**PLAN, "rounds": 1}
    row = summarize_row(2, 1.0, plan, results, [{}], [{}])
    assert row["recovery"] == [{"retransmitted_entries": 3, "spurious_entries": 2, "probes": 3, "tail_probes": 1,
                                "delay_cuts": 1, "loss_cuts": 1},
                               {"retransmitted_entries": 2, "spurious_entries": 2, "probes": 0, "tail_probes": 0,
                                "delay_cuts": 0, "loss_cuts": 0}]
    clean = {**row, "density": 0.01, "retransmitted_entries": 0}
    text = recovery_summary({"runs": [{"rows": [row, clean]}]})
    assert text == ("2 workers, density 1: 5 entries resent, 4 of them held already (spurious); 3 probes (1 "
                    "of them tail probes); window cuts 1 for delay, 1 for loss")
    assert recovery_summary({"runs": [{"rows": [clean]}]}) is None


def test_rows_with_different_results_are_an_error():
    results = [{"zerosum_s": [1, 1], "gloo_s": [], "digest": d, "marks": []} for d in "ab"]
    with pytest.raises(RuntimeError, match="different results"):
        summarize_row(2, 0.5, PLAN, results, [], [])


@pytest.mark.parametrize("ratios, ticks", [
    ([1.76], [1, 2]),                                   # a tick above the point, not only 1×
    ([0.05, 1.74], [0.05, 0.1, 0.2, 0.5, 1, 2]),
    ([0.34, 3.27], [0.2, 0.5, 1, 2, 5]),                # a tick beyond the outermost points
    ([0.3, 12], [0.2, 0.5, 1, 2, 5, 10, 20]),
    ([0.2, 0.5], [0.2, 0.5, 1]),                        # 1× is always on the axis
    ([], [1]),
])
def test_ratio_ticks_are_the_1_2_5_values_around_the_data(ratios, ticks):
    (lo, hi), got = ratio_axis(ratios)
    assert got == ticks
    assert lo < min(ticks) and hi > max(ticks)          # a margin beyond the outermost ticks


def test_the_read_floor_is_the_makespan_of_all_reads_not_the_slowest_read():
    # 4 processes on 2 cores: two read from 0 to 6 ms, the other two from 6 to 12 ms (each 6 ms alone);
    # the next iteration the same shifted, and a third where all four overlap from 1 to 9 ms
    first = [[(0.000, 0.006), (0.100, 0.106), (0.201, 0.209)]] * 2
    second = [[(0.006, 0.012), (0.106, 0.112), (0.201, 0.209)]] * 2
    assert makespan(first + second) == pytest.approx(0.012)    # median of 12, 12 and 8 ms
    assert makespan([[(5.0, 5.25)]]) == pytest.approx(0.25)


def test_the_read_floor_line_bounds_the_gain_by_gloo():
    run = {"read_floor_s": 0.0125, "rows": [{"workers": 4, "gloo_s": 0.161}, {"workers": 4, "gloo_s": 0.158}]}
    line = read_floor_summary(run, 26_214_400)
    assert "0.0125 s from the first start to the last end (33.6 GB/s)" in line
    assert line.endswith("gloo's 0.158 s is 12.6x that, the most any density can gain here")
    assert "gloo" not in read_floor_summary({**run, "rows": [{"workers": 4, "gloo_s": None}]}, 26_214_400)


def test_a_row_has_the_read_of_its_own_rounds_beside_its_time():
    # two ranks, two timed rounds: reads of 10 and 14 ms from the first start to the last end
    results = [{"zerosum_s": [0.02, 0.03], "gloo_s": [0.2, 0.2], "marks": [({}, {})] * 3, "digest": "d",
                "read_spans": [(1.000, 1.008), (2.000, 2.014)]},
               {"zerosum_s": [0.02, 0.03], "gloo_s": [0.2, 0.2], "marks": [({}, {})] * 3, "digest": "d",
                "read_spans": [(1.002, 1.010), (2.001, 2.012)]}]
    # each rank's call, then its first datagram (its blocks found), then its last result: the last rank's
    # blocks found 9 and 11 ms after the first call, the last result 5 and 9 ms after that
    results[0]["phases"] = [(0.100, 0.106, 0.114), (0.200, 0.211, 0.220)]
    results[1]["phases"] = [(0.101, 0.109, 0.112), (0.203, 0.208, 0.215)]
    row = summarize_row(2, 0.01, PLAN, results, [{}], [{}])
    assert row["read_s"] == pytest.approx(0.012)              # median of 10 and 14 ms
    assert row["found_s"] == pytest.approx(0.010) and row["exchange_s"] == pytest.approx(0.007)
    bare = summarize_row(2, 0.01, PLAN, [{**r, "read_spans": [], "phases": []} for r in results], [{}], [{}])
    assert bare["read_s"] is None and bare["found_s"] is None and bare["exchange_s"] is None
    line = floor_line({**row, "floor_s": 0.010, "floor_gloo_s": 0.19})
    assert line.startswith("2 workers, density 0.01: ZeroSum 2.50x the floor's time (0.010 s; gloo beside "
                           "the floor 0.190 s)")
    assert line.endswith("; the read alone in the same rounds 0.0120 s, ZeroSum 2.08x that (0.0130 s more); "
                         "every rank's blocks found 0.0100 s after the first call, the exchange 0.0070 s after that")
    bare = floor_line({**row, "read_s": None, "found_s": None, "floor_s": 0.010, "floor_gloo_s": 0.19})
    assert bare.endswith("(0.010 s; gloo beside the floor 0.190 s)")


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1001])
def test_the_read_pass_reads_every_value(n):
    assert read_pass(np.zeros(0, np.float32)) == 0 and read_pass(np.zeros(n, np.float32)) == 0
    for at in {0, n // 2, n - 1}:                     # a single non-zero value anywhere is seen
        x = np.zeros(n, np.float32)
        x[at] = -0.0                                  # the sign bit alone
        assert read_pass(x) != 0
    grid = np.zeros((3, 5), np.int32)                 # any contiguous shape, read whole
    assert read_pass(grid) == 0
    grid[2, 4] = 1
    assert read_pass(grid) != 0


def test_ratio_labels():
    assert [tick_label(t) for t in (0.2, 0.5, 1.0, 2.0, 10.0)] == ["0.2×", "0.5×", "1×", "2×", "10×"]
    assert ratio_label(1.7571) == "1.76×" and ratio_label(0.0545) == "0.05×"


def test_plot_writes_a_png(tmp_path):
    results = wide_results()
    results["runs"].append({"rows": [{"workers": 2, "density": d, "speedup": s}
                                     for d, s in [(1, 0.05), (0.01, 1.76)]]})
    plot(results, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_local_aggregator_reports_its_counters_and_cpu_while_running():
    agg = LocalAggregator(2)
    try:
        first, second = agg.snapshot(), agg.snapshot()
        assert first["datagrams_sent"] == 0 and first.get("datagrams", 0) == 0
        assert 0 < first["cpu_s"] <= second["cpu_s"]
    finally:
        counters = agg.stop()
    assert counters["max_rss_bytes"] > 0


def test_a_snapshot_is_asked_by_the_signal_and_printed_between_batches_only(capsys):
    """The handler only notes the request: run between two bytecodes of the service ending a job, a
    snapshot printed from the handler missed that job's counters (SnapshotOnSignal)."""
    class Server:
        class machine:
            counters = {"rounds": 7}
        datagrams_sent = 3
    before = signal.getsignal(signal.SIGUSR1)
    try:
        snapshots = SnapshotOnSignal(Server)
        snapshots.answer()
        assert capsys.readouterr().out == ""                    # not asked: nothing
        os.kill(os.getpid(), signal.SIGUSR1)
        assert capsys.readouterr().out == ""                    # asked: nothing printed by the handler
        snapshots.answer()
        tag, body = capsys.readouterr().out.split(" ", 1)
        assert tag == SNAPSHOT and json.loads(body)["rounds"] == 7 and json.loads(body)["datagrams_sent"] == 3
        snapshots.answer()
        assert capsys.readouterr().out == ""                    # answered once per request
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_small_bench_reports_per_row_cpu_and_retransmissions(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zerosum", "bench", "--workers", "2", "--densities", "0.5",
                        "--size", "20000", "--rounds", "2", "--output", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "wkr µs/dg" in r.stdout and "…" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    bench = json.loads((tmp_path / "bench.json").read_text())
    (row,) = bench["runs"][0]["rows"]
    # Loss recovery may or may not retransmit on loopback; the counts are per row, never negative.
    assert all(isinstance(row[k], int) and row[k] >= 0
               for k in ("retransmitted_entries", "warmup_retransmitted_entries"))
    # A worker sends and receives one datagram per round of its columns; the aggregator receives one from
    # each of the 2 workers and sends the result to each, or once to the multicast group (the default on
    # loopback where it works: the line after the table says which).
    by_group = bench["plan"]["multicast"] is not None
    assert ("results by multicast" in " ".join(r.stdout.split())) == by_group
    fan_out = 1.5 if by_group else 2
    assert row["worker_datagrams"] > 0 and row["aggregator_datagrams"] >= fan_out * row["worker_datagrams"] * 0.9
    assert row["aggregator_datagrams"] < (fan_out + 0.25) * row["worker_datagrams"]
    assert row["worker_cpu_us_per_datagram"] > 0 and row["aggregator_cpu_us_per_datagram"] > 0
    # where the time went: every rank's blocks found, then the exchange (stamped by the workers)
    assert 0 < row["found_s"] and 0 < row["exchange_s"] and row["read_s"] is None   # no --floor: no read
    assert (tmp_path / "bench.png").exists() == (row["gloo_s"] is not None)
    # the job's slots, as the aggregator granted them, by the cache on loopback (local.loopback_slots)
    from zerosum.local import loopback_slots
    slots, why = loopback_slots(2)
    assert row["slots"] == slots and bench["runs"][0]["slots_note"] == why
    assert f"slots: {why}" in " ".join(r.stdout.split())


def test_the_slots_line_names_each_world_where_their_slots_differ():
    from zerosum.bench import slots_summary
    run = lambda world, note: {"rows": [{"workers": world}], "slots_note": note}     # noqa: E731
    assert slots_summary({"runs": [run(2, "2,048 a"), run(4, "2,048 a")]}) == "slots: 2,048 a"
    assert (slots_summary({"runs": [run(4, "2,048 a"), run(8, "1,024 b")]})
            == "slots: 4 workers 2,048 a; 8 workers 1,024 b")
    assert slots_summary({"runs": [{"rows": [{"workers": 2}]}]}) == "slots: not recorded"


def test_the_star_floor_runs_on_sizes_of_no_whole_block():
    from zerosum.floor import run_floor
    floor = run_floor(2, 1000, [1.0, 0.5], iters=1)        # 3 blocks and 232 values
    assert set(floor) == {1.0, 0.5} and all(star > 0 and gloo > 0 for star, gloo in floor.values())


def test_a_star_rank_that_dies_is_an_error_at_once_not_a_wait():
    import queue
    from types import SimpleNamespace
    from zerosum.floor import collect
    q = queue.Queue()
    q.put((0, {1.0: "r0"}))
    ps = [SimpleNamespace(exitcode=0), SimpleNamespace(exitcode=1)]
    with pytest.raises(RuntimeError, match="rank 1 died \\(exit code 1\\)"):
        collect(ps, q)
    ps = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]
    q.put((1, {1.0: "r1"}))
    with pytest.raises(RuntimeError, match="silent for 2 s"):
        collect(ps, q, timeout=2)
    q.put((1, {1.0: "r1"}))
    q.put((0, {1.0: "r0"}))
    assert collect(ps, q) == {0: {1.0: "r0"}, 1: {1.0: "r1"}}


def test_a_bench_worker_that_dies_without_a_word_is_reported_at_once():
    import queue
    from types import SimpleNamespace
    from zerosum.bench import next_event
    events = queue.Queue()
    procs = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]
    events.put(("step", 0))
    assert next_event(events, procs) == ("step", 0)
    procs[1].exitcode = -9                                 # SIGKILLed: no report, no "done"
    assert next_event(events, procs) == ("error", 1, "its process died (exit code -9)")
    procs[1].exitcode = 0                                  # ended, having reported
    with pytest.raises(RuntimeError, match="stopped reporting for 2 s"):
        next_event(events, procs, timeout=2)
