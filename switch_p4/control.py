"""The switch's control plane, over P4Runtime with p4runtime-shell: the same code configures bmv2
(`simple_switch_grpc`) and the emulator (`zerosum switch --grpc ...`).

    with SwitchControl("127.0.0.1:9559") as ctl:          # connects and installs the pipeline
        ctl.serve_at("10.0.0.254", "00:00:00:00:00:fe")     # the switch aggregates for this address
        ctl.add_l2([("00:00:00:00:00:01", 1), ...], ports=[1, 2, ...])
        ctl.add_job(1, [WorkerAddress("10.0.0.1", 48880, "00:00:00:00:00:01", 1), ...])
        ctl.stats()                                         # {counter name: packets}
        ctl.stats(job=1)                                    # the same, for one job

p4runtime-shell keeps one global connection, so a process has one SwitchControl at a time.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .layout import (INGRESS, JOB_STATS, JOBS, L2_FORWARD, MAX_JOBS, MAX_MEMBERS, MEMBERSHIP, POOL_SLOTS, PORT,
                     SWITCH_COUNTERS, WORKER_ADDRESS, ZEROSUM_SERVICE, ZEROSUM_STATS, ADMISSION, EGRESS,
                     ECN_MARKING, job_stats_base)

HERE = Path(__file__).resolve().parent
P4INFO = HERE / "zerosum.p4info.txtpb"
BMV2_JSON = HERE / "zerosum.json"
FLOOD_GROUP = 1          # multicast group of all ports, for frames to unknown/broadcast MACs
FIRST_JOB_GROUP = 2      # job_index i multicasts its results on group FIRST_JOB_GROUP + i


class ControlError(OSError):
    """The switch refused or could not be reached; the message says which and why (an OSError, so the
    command-line tools report it in one line like other I/O errors)."""


@dataclass(frozen=True)
class WorkerAddress:
    ip: str            # the worker's IPv4 address
    udp_port: int      # the UDP port its zerosum.Worker binds (bind="IP:PORT")
    mac: str = "00:00:00:00:00:00"
    switch_port: int = 1


@dataclass(frozen=True)
class JobPlan:
    """What add_job installed: where the job's slots and members live in the switch."""
    job: int
    job_index: int
    slot_base: int
    slots: int
    first_member: int
    mcast_grp: int
    workers: tuple[WorkerAddress, ...]


def _mac(text: str) -> str:
    parts = text.split(":")
    if len(parts) != 6 or not all(len(p) == 2 and int(p, 16) >= 0 for p in parts):
        raise ValueError(f"bad MAC address {text!r}: expected six hex bytes like 00:00:00:00:00:01")
    return text.lower()


class SwitchControl:
    def __init__(self, grpc_addr: str = "127.0.0.1:9559", device_id: int = 0, election_id=(0, 1),
                 p4info: Path = P4INFO, bmv2_json: Path = BMV2_JSON, install_pipeline: bool = True):
        import p4runtime_sh.shell as sh   # imported here: only the control plane needs it
        self.sh = sh
        for path in (p4info, bmv2_json) if install_pipeline else (p4info,):
            if not Path(path).is_file():
                raise ControlError(f"{path} is missing: compile switch_p4/zerosum.p4 with p4c-bm2-ss "
                                   "(see switch_p4/README.md)")
        config = sh.FwdPipeConfig(str(p4info), str(bmv2_json)) if install_pipeline else None
        logging.getLogger().setLevel(logging.CRITICAL)   # p4runtime-shell logs failures, we raise them
        try:
            sh.setup(device_id=device_id, grpc_addr=grpc_addr, election_id=election_id, config=config,
                     verbose=False)
        except SystemExit:   # p4runtime-shell exits the process on connection or config errors
            raise ControlError(f"cannot configure the P4Runtime switch at {grpc_addr} (device {device_id}): "
                               "is simple_switch_grpc or `zerosum switch --grpc` running there?") from None
        except Exception as e:
            raise ControlError(f"P4Runtime switch at {grpc_addr}: {e}") from None
        self.grpc_addr = grpc_addr
        self.jobs: list[JobPlan] = []

    def __enter__(self) -> "SwitchControl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.sh.teardown()
        except Exception:
            pass

    def _write(self, what: str, entity, op: str = "insert") -> None:
        try:
            getattr(entity, op)()
        except Exception as e:
            raise ControlError(f"{what}: {e}".strip()) from None

    # -- configuration --------------------------------------------------------------------------------
    def serve_at(self, ip: str, mac: str, port: int = PORT) -> None:
        """Make the switch the aggregator for ZeroSum packets sent to ip:port (the workers' aggregator)."""
        te = self.sh.TableEntry(ZEROSUM_SERVICE)(action=INGRESS + "serve")
        te.match["hdr.ipv4.dstAddr"] = ip
        te.match["hdr.udp.dstPort"] = str(port)
        te.action["switch_mac"] = _mac(mac)
        self._write(f"service address {ip}:{port}", te)

    def add_l2(self, hosts, ports) -> None:
        """Plain L2 forwarding: a host (mac, switch port) list, and all ports for flooding."""
        for mac, port in hosts:
            te = self.sh.TableEntry(L2_FORWARD)(action=INGRESS + "forward")
            te.match["hdr.ethernet.dstAddr"] = _mac(mac)
            te.action["port"] = str(port)
            self._write(f"L2 entry {mac}", te)
        group = self.sh.MulticastGroupEntry(FLOOD_GROUP)
        for port in ports:
            group.add(port, 0)
        self._write("flood group", group)
        te = self.sh.TableEntry(L2_FORWARD)(is_default=True)
        te.action = self.sh.Action(INGRESS + "flood")
        te.action["group"] = str(FLOOD_GROUP)
        self._write("L2 default action", te, "modify")

    def add_job(self, job: int, workers, slots: int = 256) -> JobPlan:
        """Install a job: worker i of `workers` is rank i. Slots and members are taken from the pool
        after the jobs added before (by this control session)."""
        workers = tuple(workers)
        world = len(workers)
        if not 1 <= world <= 32:
            raise ValueError(f"a job has 1..32 workers, got {world}")
        job_index = len(self.jobs)
        slot_base = sum(j.slots for j in self.jobs)
        first_member = sum(len(j.workers) for j in self.jobs)
        if job_index >= MAX_JOBS:
            raise ValueError(f"the switch holds at most {MAX_JOBS} jobs")
        if not 1 <= slots or slot_base + slots > POOL_SLOTS:
            raise ValueError(f"{slots} slots do not fit: {POOL_SLOTS - slot_base} of {POOL_SLOTS} are free")
        if first_member + world > MAX_MEMBERS:
            raise ValueError(f"the switch holds at most {MAX_MEMBERS} workers")
        plan = JobPlan(job, job_index, slot_base, slots, first_member, FIRST_JOB_GROUP + job_index, workers)
        if any(j.job == job for j in self.jobs):
            raise ValueError(f"job {job} is configured already")
        te = self.sh.TableEntry(JOBS)(action=ADMISSION + "set_job")
        te.match["hdr.zerosum.job"] = str(job)
        for name, value in (("job_index", job_index), ("world", world), ("mcast_grp", plan.mcast_grp),
                            ("slot_base", slot_base), ("slots", slots)):
            te.action[name] = str(value)
        self._write(f"job {job}", te)
        group = self.sh.MulticastGroupEntry(plan.mcast_grp)
        for rank, w in enumerate(workers):
            member = first_member + rank
            te = self.sh.TableEntry(MEMBERSHIP)(action=ADMISSION + "set_member")
            te.match["hdr.ipv4.srcAddr"] = w.ip
            te.match["hdr.udp.srcPort"] = str(w.udp_port)
            for name, value in (("job", job), ("member", member), ("rank", rank), ("rank_bit", 1 << rank)):
                te.action[name] = str(value)
            self._write(f"member {w.ip}:{w.udp_port} (job {job} rank {rank})", te)
            te = self.sh.TableEntry(WORKER_ADDRESS)(action=EGRESS + "set_worker")
            te.match["standard_metadata.egress_rid"] = str(member + 1)
            te.action["mac"] = _mac(w.mac)
            te.action["ip"] = w.ip
            te.action["port"] = str(w.udp_port)
            self._write(f"worker address of rank {rank}", te)
            group.add(w.switch_port, member + 1)
        self._write(f"multicast group of job {job}", group)
        self.jobs.append(plan)
        # What a JOIN of a job not configured is told (R-J6): the jobs configured, the slots they hold.
        te = self.sh.TableEntry(JOBS)(is_default=True)
        te.action = self.sh.Action(ADMISSION + "refuse")
        te.action["jobs_configured"] = str(len(self.jobs))
        te.action["slots_in_use"] = str(slot_base + slots)
        self._write("the jobs table's refusal", te, "modify")
        return plan

    def set_ecn_threshold(self, depth: int) -> None:
        """ECN-capable packets leave marked CE once `depth` packets wait at their egress port (the
        default: layout.ECN_THRESHOLD; docs/protocol.md, R-E1). 0 marks every one, 2**19 - 1 none."""
        if not 0 <= depth < 1 << 19:
            raise ValueError(f"the ECN threshold is a queue depth of 0..{(1 << 19) - 1} packets, got {depth}")
        te = self.sh.TableEntry(ECN_MARKING)(is_default=True)
        te.action = self.sh.Action(EGRESS + "mark_above")
        te.action["depth"] = str(depth)
        self._write("ECN threshold", te, "modify")

    # -- monitoring ------------------------------------------------------------------------------------
    def stats(self, job: int | None = None) -> dict[str, int]:
        """{counter name: packets} for every counter (names as in docs/protocol.md): the switch's
        zerosum_stats, or with `job` that job's part of job_stats."""
        if job is None:
            name, first = ZEROSUM_STATS, 0
        else:
            plans = [p for p in self.jobs if p.job == job]
            if not plans:
                raise ValueError(f"job {job} was not configured by this control session")
            name, first = JOB_STATS, job_stats_base(plans[0].job_index)
        out = {}
        try:
            for entry in self.sh.CounterEntry(name).read():
                if first <= entry.index < first + len(SWITCH_COUNTERS):
                    out[SWITCH_COUNTERS[entry.index - first]] = entry.packet_count
        except Exception as e:
            raise ControlError(f"reading counters: {e}") from None
        return out


def apply_plan(ctl: SwitchControl, plan: dict) -> list[JobPlan]:
    """Install a whole configuration given as data (JSON), e.g. `zerosum switch --config FILE.json`:

    {"service": {"ip": "10.0.0.254", "mac": "00:00:00:00:00:fe"},
     "l2": {"hosts": [["00:00:00:00:00:01", 1], ...], "ports": [1, 2, ...]},
     "jobs": [{"job": 1, "slots": 256,
               "workers": [{"ip": "10.0.0.1", "udp_port": 48880, "mac": "00:00:00:00:00:01", "switch_port": 1},
                           ...]}]}
    """
    unknown = set(plan) - {"service", "l2", "jobs"}
    if unknown:
        raise ValueError(f"unknown configuration keys {sorted(unknown)}: expected service, l2, jobs")
    try:
        if "service" in plan:
            s = plan["service"]
            ctl.serve_at(s["ip"], s["mac"], int(s.get("port", PORT)))
        if "l2" in plan:
            ctl.add_l2([(mac, int(port)) for mac, port in plan["l2"].get("hosts", [])],
                       [int(p) for p in plan["l2"].get("ports", [])])
        return [ctl.add_job(int(j["job"]), [WorkerAddress(w["ip"], int(w["udp_port"]), w.get("mac", "00:00:00:00:00:00"),
                                                          int(w.get("switch_port", 1))) for w in j["workers"]],
                            int(j.get("slots", 256)))
                for j in plan.get("jobs", [])]
    except (KeyError, TypeError) as e:
        raise ValueError(f"bad switch configuration: missing or malformed {e}") from None
