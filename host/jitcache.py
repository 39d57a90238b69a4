"""numba's on-disk cache of the kernels, kept in step with their sources.

numba keys a cached kernel on the modification time of its own file only. A kernel that calls one
defined in another file, or reads another module's constants, keeps what it was compiled against after
that file changes, and runs it without a word (worker_kernels.drive kept transport.receive2's old body after
receive2 changed). So the package stamps the cache with a digest of the kernels' sources and of every
module of the package they import; at import, a digest that differs clears the package's cached
kernels, which then compile anew (warmup.warm_up compiles them all).
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

PACKAGE = Path(__file__).parent
# the modules that define kernels (numba's cache=True)
KERNEL_MODULES = ("stores", "transport", "wire", "block_scan", "congestion", "worker_rounds", "worker_kernels",
                  "aggregator_kernels")
STAMP = "zerosum-kernels.digest"

_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\w*)\s+import\s+\(?([\w\s,]*)", re.MULTILINE)


def _imported_modules(name: str) -> set[str]:
    """The package's modules that module `name` imports (`from .x import ...`, `from . import x`)."""
    found = set()
    for module, names in _RELATIVE_IMPORT.findall((PACKAGE / f"{name}.py").read_text()):
        candidates = [module] if module else [n.split(" as ")[0].strip() for n in names.split(",")]
        found.update(c for c in candidates if c and (PACKAGE / f"{c}.py").is_file())
    return found


def kernel_sources() -> list[str]:
    """The kernel modules and every module of the package they import, directly or not (sorted)."""
    seen, todo = set(), list(KERNEL_MODULES)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imported_modules(name) - seen)
    return sorted(seen)


def digest() -> str:
    h = hashlib.sha256()
    for name in kernel_sources():
        h.update(name.encode() + b"\0" + (PACKAGE / f"{name}.py").read_bytes() + b"\0")
    return h.hexdigest()


def cache_dir() -> Path:
    """Where numba caches this package's kernels (beside the sources, or its user-wide directory where
    the package is read-only, or NUMBA_CACHE_DIR)."""
    from numba.core.caching import FunctionCache
    return Path(FunctionCache(_probe)._cache_path)


def _probe():
    """A function of this package's directory, for numba to locate the cache by."""


def cached_kernels(directory: Path) -> list[Path]:
    """The cache files of the package's kernel modules in `directory` (numba names them
    `<module>.<function>-<line>.py<version>.nbi` / `.nbc`)."""
    if not directory.is_dir():
        return []
    return [f for f in directory.iterdir()
            if f.suffix in (".nbi", ".nbc") and f.name.split(".", 1)[0] in KERNEL_MODULES]


def refresh(directory: Path | None = None) -> bool:
    """Clear the cached kernels if the sources changed since they were cached (or nothing says what
    they were cached from); True if it cleared any. Errors on the way (a read-only cache) leave numba
    to its own checks."""
    directory = cache_dir() if directory is None else directory
    want = digest()
    stamp = directory / STAMP
    try:
        if stamp.read_text() == want:
            return False
    except OSError:
        pass
    cleared = False
    for f in cached_kernels(directory):
        try:
            f.unlink()
            cleared = True
        except OSError:
            pass
    try:
        directory.mkdir(parents=True, exist_ok=True)
        part = directory / f"{STAMP}.{os.getpid()}"
        part.write_text(want)
        os.replace(part, stamp)
    except OSError:
        pass
    return cleared
