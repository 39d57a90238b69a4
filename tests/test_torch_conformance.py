"""torch's own distributed test suite against the `zerosum` backend (tests/torch_conformance.py), at world
sizes 2 and 3, in a subprocess as torch runs it (BACKEND, WORLD_SIZE, TEMP_DIR).

The whole suite (285 tests) takes 15-20 minutes a world size on 2 cores, most of it spawning ranks for
tests that then skip (CUDA, NCCL/MPI-only, or gated on gloo by name: README "Conformance"). CI runs the
tests that apply to a CPU-only plugin backend at world size 2, and those whose outcome depends on the
world size (groups, subgroups, collectives, DDP) at 3; ZEROSUM_TORCH_SUITE=full runs all of them.
"""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("expecttest", reason="torch's test suite needs the expecttest package (pip install expecttest)")

HERE = os.path.dirname(os.path.abspath(__file__))

# Every test of the suite that ran (did not skip) on this machine, at world sizes 2 and 3 alike.
APPLIES = """
test_Backend_enum_class test_DistributedDataParallelCPU test_DistributedDataParallelCPU_grad_is_view
test_DistributedDataParallel_requires_grad test_all_gather test_all_gather_coalesced_complex
test_all_gather_coalesced_full_group test_all_gather_coalesced_simple test_all_gather_coalesced_with_empty
test_all_gather_complex test_all_gather_full_group test_all_reduce_coalesced_max_complex_unsupported
test_all_reduce_complex_unsupported_ops test_all_reduce_full_group_max test_all_reduce_full_group_min
test_all_reduce_full_group_product test_all_reduce_full_group_sum test_all_reduce_max test_all_reduce_min
test_all_reduce_product test_all_reduce_sum test_all_reduce_sum_async test_all_reduce_sum_complex test_barrier
test_barrier_full_group test_broadcast test_broadcast_full_group test_ddp_create_graph test_ddp_logging_data_cpu
test_destroy_full_group test_destroy_group test_dump_DDP_relevant_env_vars test_gather test_gather_checks
test_gather_full_group test_get_backend test_get_rank test_get_rank_size_full_group test_get_rank_size_group
test_irecv test_isend test_isend_autograd_profiler test_isend_torch_profiler test_reduce_full_group_max
test_reduce_full_group_min test_reduce_full_group_product test_reduce_full_group_sum test_reduce_max
test_reduce_min test_reduce_product test_reduce_sum test_reduce_sum_twice test_scatter test_scatter_checks
test_scatter_complex test_scatter_full_group test_send_recv test_send_recv_any_source
test_send_recv_any_source_autograd_profiler test_send_recv_any_source_torch_profiler
test_send_recv_autograd_profiler test_send_recv_torch_profiler test_send_recv_with_tag
test_send_recv_with_tag_autograd_profiler test_send_recv_with_tag_torch_profiler test_static_graph_api_cpu
""".split()
# At world size 3: what a third rank changes (groups that leave a rank out, rings of odd length, DDP).
AT_THREE = [t for t in APPLIES if re.search(r"group|all_reduce_sum|barrier|DistributedDataParallelCPU$|"
                                            r"static_graph|broadcast$", t)]


@pytest.mark.parametrize("world", [2, 3])
def test_torch_distributed_suite(world, tmp_path):
    full = os.environ.get("ZEROSUM_TORCH_SUITE") == "full"
    selected = [] if full else [f"torch_conformance.py::TestZeroSumBackend::{t}"
                                for t in (APPLIES if world == 2 else AT_THREE)]
    env = dict(os.environ, BACKEND="zerosum", WORLD_SIZE=str(world), TEMP_DIR=str(tmp_path),
               PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                        *(selected or ["torch_conformance.py"])], cwd=HERE, env=env, capture_output=True,
                       text=True, timeout=3600)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert "failed" not in summary and "error" not in summary, summary
    if not full:
        assert passed == len(selected), summary      # none of them skips: they all apply here
