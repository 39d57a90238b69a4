import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
# The tests' helper modules, then the experiment scripts (which tests import as modules): one place for
# both, and processes the tests start with multiprocessing inherit it.
sys.path[:0] = [TESTS, os.path.join(os.path.dirname(TESTS), "experiments")]


def pytest_sessionstart(session):
    # Compile the kernels once, in this process, before any test starts worker and aggregator processes
    # that would otherwise all compile them at once on a fresh machine's empty cache.
    from zerosum.warmup import warm_up
    warm_up()
