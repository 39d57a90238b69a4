"""Writes zerosum.p4 from zerosum.p4.j2: the wire format from zerosum.spec, the per-element code for ELEMENTS values.

The header types, packet types, sentinels and counter indices come from zerosum.spec (the one source of
the format); P4 has no loops, so the template expands the ELEMENTS per-element registers and their
read/add/write statements.
Run `python -m zerosum.switch_p4.generate --compile` after editing (it runs p4c-bm2-ss --p4v 16
--p4runtime-files zerosum.p4info.txtpb -o zerosum.json zerosum.p4 and notes the compiler's version in
COMPILED_WITH); tests check that the committed zerosum.p4 is what this script writes and, where p4c is
installed, that the committed JSON and P4Info are what it compiles.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from .. import spec
from .layout import ECN_THRESHOLD, ELEMENTS, MAX_JOBS, MAX_MEMBERS, POOL_SLOTS, PORT, SWITCH_COUNTERS, element_names

HERE = Path(__file__).resolve().parent
TEMPLATE_FILE = HERE / "zerosum.p4.j2"   # the program, with the protocol's constants and per-element code left to fill
P4_FILE = HERE / "zerosum.p4"
JSON_FILE = HERE / "zerosum.json"
P4INFO_FILE = HERE / "zerosum.p4info.txtpb"
VERSION_FILE = HERE / "COMPILED_WITH"   # which p4c built the committed JSON and P4Info


def render() -> str:
    """zerosum.p4: the template with the wire format of zerosum.spec and the switch's layout."""
    import jinja2   # only for writing the program (the switch's users read the committed files)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return env.get_template(TEMPLATE_FILE.name).render(
        typedefs=spec.TYPEDEFS, version=spec.VERSION, types=spec.TYPES, has_data=spec.HAS_DATA,
        congestion=spec.CONGESTION, ecn_mask=spec.ECN_MASK, not_ect=spec.NOT_ECT, ect0=spec.ECT0, ce=spec.CE,
        ecn_threshold=ECN_THRESHOLD,
        end=spec.END, boot=spec.BOOT, no_exp=spec.NO_EXP & 0xFFFF, aggregator_rank=spec.AGGREGATOR_RANK,
        refused_unknown_job=spec.REFUSED_UNKNOWN_JOB, refused_conflict=spec.REFUSED_CONFLICT, header_bytes=spec.PACKET_HEADER.size,
        entry_bytes=spec.ENTRY_HEADER.size, join_ack_bytes=spec.JOIN_ACK_BODY.size,
        refused_bytes=spec.REFUSED_BODY.size,
        headers=(spec.PACKET_HEADER, spec.ENTRY_HEADER, spec.JOIN_ACK_BODY, spec.REFUSED_BODY),
        counters=SWITCH_COUNTERS, elements=ELEMENTS, element_names=element_names(), port=PORT,
        pool_slots=POOL_SLOTS, max_members=MAX_MEMBERS, max_jobs=MAX_JOBS)


def compile_p4(out_json: Path = JSON_FILE, out_p4info: Path = P4INFO_FILE) -> str:
    """Compile zerosum.p4 with p4c-bm2-ss; returns the compiler's version line."""
    p4c = shutil.which("p4c-bm2-ss")
    if p4c is None:
        raise FileNotFoundError("p4c-bm2-ss is not on PATH: build p4lang/p4c (see switch_p4/README.md)")
    # Compile from the source's directory with a relative name: the JSON records the file name.
    # (the spec's constants are all declared, also those the switch does not use: no unused warnings)
    subprocess.run([p4c, "--p4v", "16", "--Wdisable=unused", "--p4runtime-files", str(out_p4info), "-o",
                    str(out_json), P4_FILE.name], check=True, cwd=HERE)
    out = subprocess.run([p4c, "--version"], capture_output=True, text=True, check=True)
    words = (out.stdout + out.stderr).split()
    return " ".join(["p4c-bm2-ss"] + words[1:])   # e.g. "p4c-bm2-ss Version 1.2.5.16 (...)"; no local path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if zerosum.p4 is not up to date")
    parser.add_argument("--compile", action="store_true",
                        help="also compile it with p4c-bm2-ss into zerosum.json and zerosum.p4info.txtpb")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = P4_FILE.read_text() if P4_FILE.exists() else ""
        if current != text:
            print(f"{P4_FILE.name} is out of date: run python -m zerosum.switch_p4.generate")
            return 1
        return 0
    P4_FILE.write_text(text)
    print(f"wrote {P4_FILE.name} ({ELEMENTS} elements per block)")
    if args.compile:
        version = compile_p4()
        VERSION_FILE.write_text(version + "\n")
        print(f"compiled {JSON_FILE.name} and {P4INFO_FILE.name} with {version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
