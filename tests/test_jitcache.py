"""numba's cache of the kernels follows every source they depend on (zerosum.jitcache)."""
import ast

from zerosum import jitcache


def test_the_digest_covers_every_module_the_kernels_import():
    """What the stamp hashes: the kernel modules and, transitively, the package's modules they import,
    as Python's own parser finds the imports (the digest's reader is a regular expression)."""
    sources = set(jitcache.kernel_sources())
    assert set(jitcache.KERNEL_MODULES) <= sources
    assert {"spec", "worker_state"} <= sources     # constants the kernels compile in
    for name in sources:
        tree = ast.parse((jitcache.PACKAGE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported = [node.module] if node.module else [a.name for a in node.names]
                for module in imported:
                    if (jitcache.PACKAGE / f"{module.split('.')[0]}.py").is_file():
                        assert module.split(".")[0] in sources, (name, module)


def test_every_module_with_cached_kernels_is_listed():
    """A module whose kernels numba caches (cache=True, or the package's JIT options) and that
    KERNEL_MODULES leaves out would keep stale kernels after its imports change: the list is the set of
    such modules, found here from the sources."""
    def caches(call):
        return any((k.arg == "cache" and isinstance(k.value, ast.Constant) and k.value.value is True)
                   or (k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "JIT")
                   for k in call.keywords)
    cached = set()
    for path in jitcache.PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "njit" and caches(node):
                cached.add(path.stem)
    assert cached == set(jitcache.KERNEL_MODULES)


def test_a_changed_source_clears_only_the_kernels_cache(tmp_path, monkeypatch):
    kernel_files = ["worker_kernels.drive-992.py311.nbi", "worker_kernels.drive-992.py311.1.nbc",
                    "transport.receive2-250.py311.nbi"]
    others = ["numpy_user.f-3.py311.nbi", "notes.txt"]
    for name in kernel_files + others:
        (tmp_path / name).write_bytes(b"x")
    # nothing says what the files were cached from: cleared, and stamped
    assert jitcache.refresh(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others + [jitcache.STAMP])
    assert (tmp_path / jitcache.STAMP).read_text() == jitcache.digest()
    # the same sources: kept
    (tmp_path / kernel_files[0]).write_bytes(b"x")
    assert not jitcache.refresh(tmp_path)
    assert (tmp_path / kernel_files[0]).exists()
    # a source changed: cleared again
    monkeypatch.setattr(jitcache, "digest", lambda: "another")
    assert jitcache.refresh(tmp_path)
    assert not (tmp_path / kernel_files[0]).exists() and (tmp_path / others[0]).exists()
    assert (tmp_path / jitcache.STAMP).read_text() == "another"


def test_the_package_cache_is_stamped_on_import():
    assert (jitcache.cache_dir() / jitcache.STAMP).read_text() == jitcache.digest()
