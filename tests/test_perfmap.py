"""perf's map of numba's kernels (zerosum.perfmap, ZEROSUM_PERF_MAP=1): names made readable, and every
entry at the place the kernel really occupies in the process."""
import json
import os
import subprocess
import sys

import pytest

from zerosum import perfmap

pytest.importorskip("elftools", reason="pyelftools is not installed (pip install -e '.[profile]')")


def test_short_names_of_numba_symbols():
    kernel = ("_ZN7zerosum10block_scan11scan_blocksB2v1B52c8tJTIeFIjxB2IKSgI4CrvSCKg1MMfAwK4LJISUWsIgmAA_3d_3dE5"
              "ArrayIiLi1E1C7mutable7alignedExb5ArrayIxLi1E1C7mutable7alignedE")
    assert perfmap.short_name(kernel) == "zerosum.block_scan.scan_blocks[v1]"
    assert perfmap.short_name("_ZN7cpython7zerosum14worker_kernels5driveB4v427B52c8tJTIeFE") == \
        "cpython:zerosum.worker_kernels.drive[v427]"
    assert perfmap.short_name("cfunc._ZN7zerosum14worker_kernels5driveB4v427B52xE") == "cfunc:zerosum.worker_kernels.drive[v427]"
    assert perfmap.short_name("NRT_decref") == "NRT_decref"


CHILD = r"""
import json, os, sys
import numpy as np
import zerosum
from zerosum import blocks, perfmap
from numba import njit

@njit
def plus_one(x):          # compiled here, not loaded from the cache: the other hook
    return x + 1

assert plus_one(1) == 2
x = np.zeros(4096, np.float32); x[700] = 1.0
assert blocks.scan(x, 256)[0].tolist() == [2]
where = perfmap.write()
executable = []
with open("/proc/self/maps") as f:
    for line in f:
        span, perms = line.split()[:2]
        if "x" in perms:
            lo, hi = (int(v, 16) for v in span.split("-"))
            executable.append((lo, hi))
entries = []
with open(where) as f:
    for line in f:
        address, size, name = line.rstrip("\n").split(" ", 2)
        entries.append((int(address, 16), int(size, 16), name))
os.unlink(where)
print(json.dumps({"installed": perfmap.installed(), "path": where, "entries": entries, "executable": executable}))
"""


@pytest.mark.parametrize("run", ["first", "second"])
def test_the_map_names_loaded_and_compiled_kernels_where_they_lie(run):
    """The scan kernel is compiled where numba's cache lacks it and loaded from the cache in the second
    run at the latest (numba's two hooks); plus_one is compiled every time."""
    env = dict(os.environ, ZEROSUM_PERF_MAP="1")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["installed"] and got["path"].endswith(".map")
    names = [name for _, _, name in got["entries"]]
    assert any(n.startswith("zerosum.block_scan.scan_blocks[") for n in names), names
    assert any(".plus_one[" in n and not n.startswith(("cpython:", "cfunc:")) for n in names), names
    # every function inside an executable mapping of the process, and none overlapping another
    for address, size, name in got["entries"]:
        assert size > 0
        assert any(lo <= address and address + size <= hi for lo, hi in got["executable"]), name
    spans = sorted((a, a + s) for a, s, _ in got["entries"])
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_without_the_variable_nothing_is_hooked():
    env = {k: v for k, v in os.environ.items() if k != "ZEROSUM_PERF_MAP"}
    code = "import zerosum; from zerosum import perfmap; print(perfmap.installed())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
