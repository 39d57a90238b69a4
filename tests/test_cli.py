"""The command line: --help everywhere, one-line errors for bad arguments, never a traceback."""
import json
import subprocess
import sys

import pytest


def zerosum(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "zerosum", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["aggregator"], ["bench"], ["demo"], ["check"]])
def test_help(cmd):
    r = zerosum(*cmd, "--help")
    assert r.returncode == 0 and "usage: zerosum" in r.stdout


@pytest.mark.parametrize("args, text", [
    (["aggregator", "--min-job-slots", "4096"], "exceeds what one job may get"),
    (["aggregator", "--workers", "x"], "not an integer"),
    (["aggregator", "--workers", "2", "--listen", "127.0.0.1:99999"], "bad port"),
    (["aggregator", "--workers", "40"], "at most 32"),
    (["aggregator", "--workers", "2", "--loss", "150%"], "loss must be"),
    (["aggregator", "--max-datagram", "30"], "max_datagram must be"),
    (["bench", "--densities", "0.5,2"], "densities must be in"),
    (["bench", "--workers", "40", "--no-baseline"], "at most 32"),
    (["bench", "--device", "mps"], "--device must be cpu or a CUDA device"),
    (["bench", "--device", "cuda:7"], "--device cuda:7: "),       # no 8 GPUs here (or none at all)
    (["check", "--rank", "3", "--world", "2"], "--rank must be"),
    (["switch", "-i", "1@lo", "--members", "10.0.0.1:1"], "--members needs --udp"),
    (["switch", "--udp", "127.0.0.1:0", "--members", "10.0.0.1:1", "10.0.0.1:1"], "given twice"),
    (["switch", "--udp", "127.0.0.1:0", "--members", "10.0.0.1"], "expected HOST:PORT"),
    (["check", "--rank", "0", "--world", "1", "--bind", "nonsense"], "cannot resolve host"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_give_one_line(args, text):
    r = zerosum(*args)
    assert r.returncode in (1, 2)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_check_through_the_emulated_switch_in_udp_mode():
    """`zerosum switch --udp --members` serves a job of `zerosum check` ranks that send from those
    addresses, one 64-value block per datagram; every rank verifies every sum."""
    from zerosum.udp import free_port
    port, members = free_port(), [free_port() for _ in range(2)]
    switch = subprocess.Popen([sys.executable, "-m", "zerosum", "switch", "--udp", f"127.0.0.1:{port}",
                               "--members", *[f"127.0.0.1:{m}" for m in members], "--job", "3",
                               "--idle-exit", "3", "--announce"], stdout=subprocess.PIPE, text=True)
    try:
        assert switch.stdout.readline().startswith("zerosum-switch-ready")
        ranks = [subprocess.Popen([sys.executable, "-m", "zerosum", "check", "--rank", str(r), "--world", "2",
                                   "--aggregators", f"127.0.0.1:{port}", "--job", "3", "--block-size", "64",
                                   "--max-entries", "1", "--bind", f"127.0.0.1:{members[r]}", "--size", "20000",
                                   "--timeout", "20"], stdout=subprocess.PIPE, text=True) for r in range(2)]
        outputs = [p.communicate(timeout=120)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], outputs
        assert all("2 of 2 ranks got exact sums: OK" in out for out in outputs), outputs
        switch.wait(timeout=30)
        counters = json.loads(switch.stdout.read().strip().splitlines()[-1])
        assert counters["switch"]["rounds"] > 0 and counters["switch"]["joins"] >= 2
    finally:
        switch.kill()


def test_aggregator_jobs_file_declares_several_jobs_and_refuses_bad_ones(tmp_path):
    import json
    from zerosum.cli import _declared_jobs, build_parser
    good = tmp_path / "jobs.json"
    good.write_text(json.dumps({"1": 4, "7": 2}))
    args = build_parser().parse_args(["aggregator", "--jobs", str(good), "--workers", "3", "--job", "9"])
    assert _declared_jobs(args) == {9: 3, 1: 4, 7: 2}
    bad = tmp_path / "bad.json"
    for text, message in (("[1, 2]", "expected a JSON object"), ('{"1": 40}', "worker counts 1..32"),
                          ('{"x": 2}', "expected a JSON object")):
        bad.write_text(text)
        args = build_parser().parse_args(["aggregator", "--jobs", str(bad)])
        with pytest.raises(ValueError, match=message):
            _declared_jobs(args)


def test_help_shows_defaults_and_explains_every_option():
    from zerosum.cli import build_parser
    r = zerosum("aggregator", "--help")
    for default in ("0.0.0.0:48879", "(default: 8192)", "(default: 16)", "(default: 64)", "(default: 2048)",
                    "(default: 60.0)", "(default: 30.0)"):
        assert default in " ".join(r.stdout.split()), default
    assert "(default: 256)" in zerosum("bench", "--help").stdout
    top = zerosum("--help").stdout
    assert all(name in top.split("positional")[0] for name in ("aggregator", "stats", "demo", "bench", "check",
                                                               "switch"))
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            assert action.help, f"zerosum {name} {'/'.join(action.option_strings) or action.dest} has no help"


def test_bench_takes_worlds_and_stats_help_names_every_counter():
    from zerosum import spec
    from zerosum.cli import build_parser
    assert build_parser().parse_args(["bench", "--worlds", "2", "4"]).workers == [2, 4]
    text = " ".join(zerosum("stats", "--help").stdout.split())
    assert all(name in text for name in spec.COUNTERS) and "docs/protocol.md" in text


def test_join_timeout_message_names_what_the_worker_knows():
    import zerosum as zs
    from zerosum.udp import free_port
    with pytest.raises(zs.ZeroSumTimeout) as e:
        with zs.Worker(0, 2, [f"127.0.0.1:{free_port(2)}"], job=7, timeout=0.3):
            pass
    msg = str(e.value)
    assert "no answer to JOIN from aggregator 127.0.0.1:" in msg and "--workers" not in msg
    assert msg.count("(") == msg.count(")") and "0.0.0.0" not in msg and "this worker sends from 127.0.0.1:" in msg
