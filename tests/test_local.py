"""zerosum.local: the slots an aggregator started on loopback gives a job, from the last-level cache."""
import pytest

from procs import sparse_tensor
from test_worker_api import run_threads
from zerosum import local
from zerosum.aggregator_service import MAX_JOB_SLOTS
from zerosum.reference import reference_allreduce


def _cache_dir(root, entries):
    for i, (kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir()
        if kind is not None:
            (d / "type").write_text(kind + "\n")
            (d / "size").write_text(size + "\n")


def test_the_last_level_cache_is_the_largest_data_or_unified_one(tmp_path):
    _cache_dir(tmp_path, [("Data", "32K"), ("Instruction", "64M"), ("Unified", "512K"), ("Unified", "32768K"),
                          (None, "")])     # an instruction cache holds no data; a directory without files is skipped
    assert local.last_level_cache(str(tmp_path)) == 32 << 20
    assert local.last_level_cache(str(tmp_path / "absent")) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    _cache_dir(empty, [("Data", "garbage")])
    assert local.last_level_cache(str(empty)) is None


@pytest.mark.parametrize("cache_mib", [4, 16, 32, 96])
@pytest.mark.parametrize("block_size", [64, 256, 1024])
def test_loopback_slots_are_the_most_whose_blocks_in_flight_fit_a_quarter_of_the_cache(monkeypatch, cache_mib,
                                                                                       block_size):
    cache = cache_mib << 20
    monkeypatch.setattr(local, "last_level_cache", lambda: cache)
    for world in (1, 2, 3, 4, 8, 16, 32):
        slots, why = local.loopback_slots(world, block_size)
        in_flight = world * slots * block_size * 4
        assert local.LEAST_LOOPBACK_SLOTS <= slots <= MAX_JOB_SLOTS and slots & (slots - 1) == 0
        assert f"{slots:,} slots per job" in why and f"{cache_mib:g} MiB last-level cache" in why
        if slots == local.LEAST_LOOPBACK_SLOTS and in_flight * local.CACHE_SHARE > cache:
            assert "the least on loopback" in why
        else:
            assert in_flight * local.CACHE_SHARE <= cache and "at most a quarter" in why
            # the most that fit: twice as many would not (or the job's most)
            assert slots == MAX_JOB_SLOTS or 2 * in_flight * local.CACHE_SHARE > cache


def test_loopback_slots_on_this_kind_of_cache_and_without_one(monkeypatch):
    monkeypatch.setattr(local, "last_level_cache", lambda: 32 << 20)
    assert [local.loopback_slots(w)[0] for w in (2, 4, 8, 16, 32)] == [2048, 2048, 1024, 512, 256]
    monkeypatch.setattr(local, "last_level_cache", lambda: None)
    assert local.loopback_slots(8) == (MAX_JOB_SLOTS, f"{MAX_JOB_SLOTS:,} slots per job (the cache's size is "
                                                      "unknown here)")


def test_loopback_listen_addresses_are_told_from_others():
    assert local._on_loopback("127.0.0.1:0") and local._on_loopback("localhost:5000")
    assert local._on_loopback("[::1]:5000") and not local._on_loopback("10.0.0.1:48879")


def test_workers_of_a_local_aggregator_get_the_cache_sized_slots_and_exact_sums(monkeypatch):
    monkeypatch.setattr(local, "last_level_cache", lambda: 4 << 20)     # 4 workers: 256 slots
    world, n = 4, 300_000
    xs = [sparse_tensor(r, 5, n, 0.3) for r in range(world)]
    agg = local.LocalAggregator(world)
    try:
        assert agg.slots_note.startswith("256 slots per job")
        got = run_threads(world, agg.address, lambda rank, w: (w.allreduce(xs[rank]), w.slots))
    finally:
        agg.stop()
    assert [slots for _, slots in got] == [256] * world
    ref = reference_allreduce(xs)
    assert all(result.tobytes() == ref.tobytes() for result, _ in got)
    given = local.LocalAggregator(world, slots=512)       # slots given: as given, no note
    try:
        assert given.slots_note is None
    finally:
        given.stop()
