import numpy as np
import pytest
from hypothesis import given, strategies as st

from zerosum import protocol as P


def _datagram(n=3, B=8, rows_with_data=(0, 2), ptype=P.DATA, blocks=10):
    ent = P.entries_array(n)
    ent["slot"] = np.arange(n)
    ent["block"] = np.arange(n)
    ent["next"] = np.arange(n) + n
    ent["exp"] = 3
    ent["next_exp"] = 4
    for i in rows_with_data:
        ent["flags"][i] = P.HAS_DATA
    data = np.arange(len(rows_with_data) * B, dtype=np.int32).reshape(-1, B) - 5
    h = P.Header(ptype, 7, 2, 4, 99, blocks, B, n)
    return h, ent, data


def test_round_trip_exact_bytes():
    h, ent, data = _datagram()
    raw = P.encode(h, ent, data)
    assert len(raw) == 20 + 3 * 16 + 2 * 8 * 4
    d = P.decode(raw)
    assert d.header == h
    assert np.array_equal(d.entries, ent)
    assert np.array_equal(d.data, data)
    assert list(d.row) == [0, -1, 1]
    # big-endian on the wire: the header's job field is bytes 2..3
    assert raw[2:4] == b"\x00\x07" and raw[0] == P.VERSION and raw[1] == P.DATA


@given(n=st.integers(0, 40), B=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_round_trip_property(n, B, seed):
    rng = np.random.default_rng(seed)
    ent = P.entries_array(n)
    ent["slot"] = rng.permutation(1000)[:n]
    has = rng.random(n) < 0.5
    ent["flags"] = np.where(has, P.HAS_DATA, 0)
    ent["block"] = rng.integers(0, 500, n)
    ent["next"] = np.where(rng.random(n) < 0.5, P.END, ent["block"] + 1 + rng.integers(0, 400, n))
    ent["exp"] = rng.integers(-100, 100, n)
    data = rng.integers(-2**31, 2**31, (int(has.sum()), B), dtype=np.int64).astype(np.int32)
    h = P.Header(P.RESULT, 1, P.AGGREGATOR_RANK, 4, 5, 1000, B, n)
    d = P.decode(P.encode(h, ent, data))
    assert np.array_equal(d.entries, ent) and np.array_equal(d.data, data)


@pytest.mark.parametrize("mutate, reason", [
    (lambda b: b[:10], "short"),
    (lambda b: b"\x09" + b[1:], "version"),
    (lambda b: b[:1] + b"\x63" + b[2:], "type"),
    (lambda b: b[:-1], "length"),
    (lambda b: b + b"\x00", "length"),
    (lambda b: b[:18] + b"\x00\x09" + b[20:], "length"),  # entries count disagrees with the size
    (lambda b: b[:16] + b"\x00\x00" + b[18:], "length"),  # block_size 0
])
def test_malformed_is_rejected_with_reason(mutate, reason):
    h, ent, data = _datagram()
    with pytest.raises(P.ProtocolError) as e:
        P.decode(mutate(P.encode(h, ent, data)))
    assert e.value.reason == reason


def test_semantic_checks():
    h, ent, data = _datagram(blocks=10)
    bad = ent.copy(); bad["block"][1] = 10
    with pytest.raises(P.ProtocolError, match="range"):
        P.decode(P.encode(h, bad, data))
    bad = ent.copy(); bad["next"][0] = 0          # next must be after block
    with pytest.raises(P.ProtocolError, match="range"):
        P.decode(P.encode(h, bad, data))
    bad = ent.copy(); bad["slot"][1] = bad["slot"][0]   # a slot named twice in one datagram
    with pytest.raises(P.ProtocolError, match="range"):
        P.decode(P.encode(h, bad, data))
    bad = ent.copy(); bad["flags"][1] = 0x80
    with pytest.raises(P.ProtocolError, match="flags"):
        P.decode(P.encode(h, bad, data))
    bad = ent.copy(); bad["block"][0] = P.BOOT      # bootstrap entries carry no data
    with pytest.raises(P.ProtocolError, match="flags"):
        P.decode(P.encode(h, bad, data))
    bad = ent.copy(); bad["exp"][0] = P.NO_EXP
    with pytest.raises(P.ProtocolError, match="exponent"):
        P.decode(P.encode(h, bad, data))


def test_join_and_ack():
    h = P.Header(P.JOIN, 3, 1, 4, 0xDEADBEEF, 0, 256)
    d = P.decode(P.encode(h))
    assert d.header == h and d.body == b""
    ack = P.encode(P.Header(P.JOIN_ACK, 3, P.AGGREGATOR_RANK, 4, 5, 0, 256), body=P.JOIN_ACK_BODY.pack(64, 0b1011))
    assert P.JOIN_ACK_BODY.unpack(P.decode(ack).body) == (64, 0b1011)
    with pytest.raises(P.ProtocolError, match="length"):
        P.decode(P.encode(h) + b"x")


@given(st.binary(max_size=300))
def test_random_bytes_never_crash(raw):
    try:
        P.decode(raw)
    except P.ProtocolError:
        pass


def test_max_entries_fills_a_datagram():
    n = P.max_entries(P.MAX_DATAGRAM, 256)
    assert P.datagram_size(n, n, 256) <= P.MAX_DATAGRAM < P.datagram_size(n + 1, n + 1, 256)
    with pytest.raises(ValueError):
        P.max_entries(100, 256)
