"""experiments/embedding_order.py (E8): the results file keeps the rows of other networks, --rate refuses
to run without root, and (as root) a small run over shaped links in network namespaces."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("scipy.sparse", reason="zerosum.placement needs scipy (pip install -e '.[layout]')")
pytest.importorskip("torch", reason="the embedding example needs torch")
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
SCRIPT = EXPERIMENTS / "embedding_order.py"
import embedding_order as E  # noqa: E402


def test_a_run_replaces_only_the_rows_of_its_own_network(tmp_path):
    path = tmp_path / "e8.json"
    # a file from before --rate: top-level configuration, rows without "where" (all on loopback)
    path.write_text(json.dumps({"workers": 4, "rows": 100, "results": [{"ids": "zipf", "order": "random"}]}))
    configs, rows = E.merge(path, {"where": "1gbit", "workers": 2}, [{"where": "1gbit", "order": "frequency"}])
    assert configs["loopback"]["workers"] == 4 and configs["1gbit"] == {"where": "1gbit", "workers": 2}
    assert rows == [{"where": "loopback", "ids": "zipf", "order": "random"}, {"where": "1gbit", "order": "frequency"}]
    path.write_text(json.dumps({"configs": configs, "results": rows}))
    configs, rows = E.merge(path, {"where": "loopback", "workers": 3}, [{"where": "loopback", "order": "x"}])
    assert configs == {"1gbit": {"where": "1gbit", "workers": 2}, "loopback": {"where": "loopback", "workers": 3}}
    assert rows == [{"where": "1gbit", "order": "frequency"}, {"where": "loopback", "order": "x"}]
    assert E.merge(tmp_path / "missing.json", {"where": "loopback"}, []) == ({"loopback": {"where": "loopback"}}, [])


def test_each_network_has_a_name_of_its_own():
    from argparse import Namespace
    names = [E.where_label(Namespace(rate=rate, aggregator_rate=agg, window=window))
             for rate, agg, window in [(None, None, "auto"), ("1gbit", None, "auto"), ("1gbit", "1gbit", "auto"),
                                       ("1gbit", "10gbit", "auto"), ("1gbit", None, 1000), (None, None, 1000),
                                       (None, None, None)]]
    assert names == ["loopback", "1gbit", "1gbit", "1gbit, aggregator 10gbit", "1gbit, window 1000",
                     "loopback, window 1000", "loopback, window none"]


def test_rate_needs_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="--rate needs root"):
        E.main(["--rate", "1gbit", "--json", "", "--figure", ""])
    with pytest.raises(SystemExit):                      # argparse: not a rate
        E.main(["--rate", "fast"])


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                    reason="needs root, iproute2 and tc (network namespaces, a bridge, tbf qdiscs)")
def test_orders_over_shaped_links(tmp_path):
    """2 workers and the aggregator on hosts of their own (2gbit links): every order trains the same
    model, the rows say where they ran and count drops, and no namespace is left behind."""
    out = tmp_path / "e8.json"
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--rate", "2gbit", "--workers", "2", "--rows", "2000",
                          "--steps", "4", "--repeats", "1", "--ids", "zipf", "--profile", "2", "--json", str(out),
                          "--figure", str(tmp_path / "e8.png")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 0, text[-3000:]
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {"2gbit"} and data["configs"]["2gbit"]["mtu"] == 9000
    rows = {r["order"]: r for r in data["results"]}
    assert set(rows) == set(E.ORDERS)
    for r in rows.values():
        assert r["where"] == r["rate"] == r["aggregator_rate"] == "2gbit"
        assert min(r["shaper_drops"], r["socket_drops"], r["send_errors"], r["retransmitted"]) >= 0
        assert r["rounds"] > 0 and r["sent"] > 0 and len(r["losses"]) == 4
        assert r["loss_diff_vs_random"] < 1e-5 and r["param_diff_vs_random"] < 1e-5
    assert rows["frequency"]["blocks"] < rows["random"]["blocks"]
    assert (tmp_path / "e8.png").stat().st_size > 0
    tag = f"zs{p.pid % 100000:05d}"                      # shaped_star's names for this process's hosts
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
