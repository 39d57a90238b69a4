import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_sessionstart(session):
    # Compile the kernels once, in this process, before any test starts worker and aggregator processes
    # that would otherwise all compile them at once on a fresh machine's empty cache.
    from zerosum.warmup import warm_up
    warm_up()
