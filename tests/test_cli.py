"""The command line: --help everywhere, one-line errors for bad arguments, never a traceback."""
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
    (["aggregator"], "--workers"),
    (["aggregator", "--workers", "x"], "not an integer"),
    (["aggregator", "--workers", "2", "--listen", "127.0.0.1:99999"], "bad port"),
    (["aggregator", "--workers", "40"], "at most 32"),
    (["aggregator", "--workers", "2", "--loss", "150%"], "loss must be"),
    (["bench", "--densities", "0.5,2"], "densities must be in"),
    (["bench", "--workers", "40", "--no-baseline"], "at most 32"),
    (["check", "--rank", "3", "--world", "2"], "--rank must be"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_give_one_line(args, text):
    r = zerosum(*args)
    assert r.returncode in (1, 2)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], r.stderr
    assert "Traceback" not in r.stderr
