"""Naming numba's kernels for perf: with ZEROSUM_PERF_MAP=1 each ZeroSum process writes perf's map of them.

numba places compiled kernels (and those loaded from its cache) in anonymous memory, so `perf report`
shows their samples as "[unknown]" or "[JIT] tid N", and a profile of the driver loop cannot tell the
streaming stores of sums from the encoder. perf reads /tmp/perf-<pid>.map for such code ("START SIZE
name" per line, hex; tools/perf/Documentation/jit-interface.txt). With ZEROSUM_PERF_MAP=1 in the
environment, `zerosum` keeps a copy of each object file numba hands to its JIT engine and writes that
map at exit (and when a Worker closes: a multiprocessing child ends without running atexit), every
function of those objects at the address the engine gave it:

    ZEROSUM_PERF_MAP=1 perf record -a -g -- zerosum bench --workers 4 --densities 0.01
    perf report --sort comm,sym

Functions that numba inlined have no entry of their own: their samples count for their caller. numba
offers no public way to see its object code, so this hooks the two class methods through which it
passes (`JITCodeLibrary._object_compiled_hook` and `_object_getbuffer_hook`); where they are missing
or change, install() says so and profiling goes on without names.
"""
from __future__ import annotations

import atexit
import io
import os
import re
import sys
import warnings

ENV = "ZEROSUM_PERF_MAP"

_objects: list[bytes] = []
_installed = False


def path(pid: int | None = None) -> str:
    """perf's map file of process `pid` (this one by default)."""
    return f"/tmp/perf-{os.getpid() if pid is None else pid}.map"


def installed() -> bool:
    return _installed


def install_if_asked() -> bool:
    """install() where ENV is set (to anything but "" or "0"); the package calls it on import, before
    any kernel is compiled or loaded."""
    return os.environ.get(ENV, "") not in ("", "0") and install()


def install() -> bool:
    """Keep the object code numba compiles or loads from here on, and write the map at exit. True when
    the hooks are in place."""
    global _installed
    if _installed:
        return True
    try:
        from numba.core.codegen import JITCodeLibrary
        compiled = JITCodeLibrary._object_compiled_hook.__func__
        loaded = JITCodeLibrary._object_getbuffer_hook.__func__
    except (ImportError, AttributeError) as e:
        warnings.warn(f"{ENV}: this numba has no object-code hooks ({e}); perf will not name the kernels")
        return False

    def on_compiled(cls, ll_module, buf):
        _objects.append(bytes(buf))
        return compiled(cls, ll_module, buf)

    def on_loaded(cls, ll_module):
        buf = loaded(cls, ll_module)
        if buf:
            _objects.append(bytes(buf))
        return buf

    JITCodeLibrary._object_compiled_hook = classmethod(on_compiled)
    JITCodeLibrary._object_getbuffer_hook = classmethod(on_loaded)
    atexit.register(write)
    _installed = True
    return True


def short_name(symbol: str) -> str:
    """numba's mangled symbol made readable: `_ZN7zerosum10block_scan11scan_blocksB2v1B52...E...` ->
    `zerosum.block_scan.scan_blocks[v1]`; its Python wrapper `cpython:...`, its C wrapper `cfunc:...`;
    other names unchanged."""
    prefix = ""
    if symbol.startswith("cfunc."):
        prefix, symbol = "cfunc:", symbol[len("cfunc."):]
    if not symbol.startswith("_ZN"):
        return prefix + symbol
    parts, i = [], 3
    while i < len(symbol) and symbol[i].isdigit():
        m = re.match(r"\d+", symbol[i:])
        n = int(m.group())
        start = i + len(m.group())
        parts.append(symbol[start:start + n])
        i = start + n
    if parts and parts[0] == "cpython":
        prefix, parts = prefix + "cpython:", parts[1:]
    version = re.match(r"B\d+(v\d+)", symbol[i:])
    return prefix + ".".join(parts) + (f"[{version.group(1)}]" if version else "")


def functions() -> list[tuple[int, int, str]]:
    """(address, size, symbol) of every function in the object code kept so far that numba's engine
    has placed in memory, by address."""
    from elftools.elf.elffile import ELFFile
    from numba.core.registry import cpu_target
    engine = cpu_target.target_context.codegen()._engine
    found = set()
    for buf in _objects:
        symbols = ELFFile(io.BytesIO(buf)).get_section_by_name(".symtab")
        if symbols is None:
            continue
        for sym in symbols.iter_symbols():
            if sym["st_info"]["type"] != "STT_FUNC" or sym["st_shndx"] == "SHN_UNDEF" or not sym["st_size"]:
                continue
            address = engine.get_function_address(sym.name)
            if address:
                found.add((address, sym["st_size"], sym.name))
    return sorted(found)


def write() -> str | None:
    """Write this process's map (path()); returns its path, or None where it could not be written."""
    try:
        entries = functions()
        with open(path(), "w") as f:
            for address, size, symbol in entries:
                f.write(f"{address:x} {size:x} {short_name(symbol)}\n")
    except (ImportError, OSError) as e:
        print(f"zerosum: {ENV}: no map written ({e})", file=sys.stderr)
        return None
    return path()
