"""Compile-time constants of the P4 program, shared by its generator, the emulator and the control plane."""
from __future__ import annotations

from .. import spec
from ..spec import COUNTERS, DEFAULT_PORT

ELEMENTS = 64          # int32 values per packet: 20+16+256 bytes of ZeroSum in a 1500-byte MTU
PORT = DEFAULT_PORT    # the UDP port the switch aggregates on
POOL_SLOTS = 4096      # aggregation slots of all jobs together (2 banks of ELEMENTS values each)
MAX_MEMBERS = 256      # workers of all jobs together
MAX_JOBS = 16
# ECN (docs/protocol.md, R-E1): an ECN-capable packet leaves marked CE when the egress queue held at least
# this many packets as it was queued (v1model's enq_qdepth; DCTCP's K for 1 Gbit/s, SIGCOMM'10: 20 of
# bmv2's 64 per port). The control plane may set another (SwitchControl.set_ecn_threshold).
ECN_THRESHOLD = 20

# The `zerosum_stats` counter's indices (and each job's in `job_stats`): the first SWITCH_COUNTERS of
# spec.COUNTERS, named as the software aggregator's counters.
SWITCH_COUNTERS = COUNTERS[:spec.SWITCH_COUNTERS]
COUNTER_INDEX = {name: i for i, name in enumerate(SWITCH_COUNTERS)}

# Names of the P4 objects, as in the P4Info: the ingress stages are controls of their own (instances
# validate, admission, slot_state, accumulate, reply), which prefix the names of what they hold.
INGRESS, EGRESS = "ZeroSumIngress.", "ZeroSumEgress."
ADMISSION, SLOT_STATE, ACCUMULATE = INGRESS + "admission.", INGRESS + "slot_state.", INGRESS + "accumulate."
L2_FORWARD, ZEROSUM_SERVICE = INGRESS + "l2_forward", INGRESS + "zerosum_service"
JOBS, MEMBERSHIP, WORKER_ADDRESS = ADMISSION + "jobs", ADMISSION + "membership", EGRESS + "worker_address"
ECN_MARKING = EGRESS + "ecn_marking"
ZEROSUM_STATS, JOB_STATS = INGRESS + "zerosum_stats", INGRESS + "job_stats"


def job_stats_base(job_index: int) -> int:
    """Where a job's counters start in `job_stats` (job_index * counters; the entries after the last
    job count packets of none), as the P4 program's set_job computes it."""
    return job_index * len(SWITCH_COUNTERS)


def element_names(n: int = ELEMENTS) -> list[str]:
    """Field names of the data header (v00, v01, ...) and suffixes of the pool_* registers."""
    return [f"v{i:02d}" for i in range(n)]
