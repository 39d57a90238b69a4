"""torch's own distributed test suite (torch.testing._internal.distributed.distributed_test, the one
torch's test/distributed/test_distributed_spawn.py runs for gloo) against the `zerosum` backend.

Run by tests/test_torch_conformance.py in a subprocess with BACKEND=zerosum, WORLD_SIZE and TEMP_DIR
set (the suite reads them when it is imported); by hand:

    BACKEND=zerosum WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) python -m pytest tests/torch_conformance.py -k all_reduce

The backend declares what it implements through the suite's own feature sets, before the suite is
imported (its decorators read them at import): "plugin" (a third-party backend), "ddp" (DDP on its
process groups) and "subgroup" (new_group, new_subgroups, destroy_process_group of a subgroup).
"""
import os

import zerosum.torch  # noqa: F401  (registers the backend here and, on import, in every spawned rank)
from torch.testing._internal.common_distributed import DistTestCases

if os.environ.get("BACKEND") != "zerosum" or "WORLD_SIZE" not in os.environ or "TEMP_DIR" not in os.environ:
    raise RuntimeError("set BACKEND=zerosum, WORLD_SIZE and TEMP_DIR (see the module's docstring)")
for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("zerosum")

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestZeroSumBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
