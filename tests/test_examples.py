"""The torch training examples run under torchrun and train identically with gloo and ZeroSum."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'zerosum[torch]')")


@pytest.mark.parametrize("example", ["embedding", "mlp"])
def test_example_under_torchrun(example, tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc-per-node", "2", "-m", f"zerosum.examples.{example}",
        "--steps", "5", "--warmup", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ZEROSUM_AGGREGATORS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {m.group(1): m.group(0).split() for m in re.finditer(r"^(gloo|zerosum)\s.*$", r.stdout, re.M)}
    assert set(rows) == {"gloo", "zerosum"}, r.stdout
    # same data, same initial model: the loss after training agrees, and every rank ends identical
    assert abs(float(rows["gloo"][4]) - float(rows["zerosum"][4])) < 1e-3, r.stdout
    assert rows["zerosum"][-1] == "True" and rows["gloo"][-1] == "True"
    assert "speedup over gloo" in r.stdout


def test_local_mode_trains_without_sending_anything(tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc-per-node", "2", "-m", "zerosum.examples.mlp", "--mode", "local",
        "--steps", "4", "--warmup", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    row = re.search(r"^local\s.*$", r.stdout, re.M).group(0).split()
    assert float(row[5]) == 0.0 and row[-1] == "n/a", r.stdout
    assert "speedup" not in r.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                    reason="needs root, iproute2 and tc (network namespaces, a bridge, tbf qdiscs)")
def test_training_over_shaped_links_in_namespaces(tmp_path):
    """experiments/shaped_network.py: 4 workers and their aggregators in namespaces behind rate-limited
    links; gloo and ZeroSum train to the same loss, ZeroSum sends a fraction of gloo's bytes (from the
    protocol's own accounting), and nothing is left behind."""
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "shaped_network.py")
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "shaped.json"
    r = subprocess.run([sys.executable, script, "--rate", "2gbit", "--json", str(out), "--",
                        "--steps", "5", "--warmup", "2", "--rows", "20000"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (run,) = json.loads(out.read_text())
    by = {m["mode"]: m for m in run["reports"]}
    assert set(by) == {"local", "gloo", "zerosum"} and run["rate"] == "2gbit"
    assert by["zerosum"]["identical_on_all_ranks"] and by["gloo"]["identical_on_all_ranks"]
    assert len(by["gloo"]["losses"]) == len(by["zerosum"]["losses"]) == 5
    gap = max(abs(a - b) for a, b in zip(by["gloo"]["losses"], by["zerosum"]["losses"]))
    assert gap < 1e-3 and run["loss_curve_gap"] == gap   # same curve
    assert 0 < by["zerosum"]["bytes_sent_per_step"] < 0.3 * by["gloo"]["bytes_sent_per_step"]
    assert re.search(r"^\s*2gbit\s+zerosum\s+\d+\s+[\d.]+x", r.stdout, re.M), r.stdout
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


def test_scheme_names_parse_or_fail_clearly():
    from zerosum.examples import schemes as S
    assert S.parse("topk:0.01") == S.Scheme("topk:0.01", "topk", (0.01,))
    assert S.parse("localsgd:8:10").args == (8.0, 10.0) and S.parse("delayed").uses_zerosum
    assert not S.parse("gloo").uses_zerosum and not S.parse("local").uses_zerosum
    assert S.parse("tracked").args == () and S.parse("tracked").compressor(2, 0, 0).segment_steps == 4
    assert S.parse("tracked:8").compressor(2, 0, 0).segment_steps == 8 and S.parse("tracked").density(2) is None
    assert S.parse("tracked:4:0.01").compressor(2, 0, 0).start_density == 0.01
    # DGC's momentum correction: the paper's 0.9, or none where the optimiser has its own (Adam)
    assert S.parse("dgc:0.01").compressor(2, 0, 0).m == 0.9 and S.parse("dgc:0.01").carries_momentum
    assert S.parse("dgc:0.01:0").compressor(2, 0, 0).m == 0.0 and not S.parse("dgc:0.01:0").carries_momentum
    from zerosum.examples.harness import optimizer_for
    assert optimizer_for(S.parse("dgc:0.01"), "momentum") == "sgd"
    assert optimizer_for(S.parse("dgc:0.01:0"), "momentum") == "momentum"
    assert optimizer_for(S.parse("dgc:0.01:0"), "adam") == "adam"
    for bad, words in [("topk", "takes 1"), ("topk:2", "density"), ("qsgd:2.5", "levels"), ("fancy", "unknown"),
                       ("localsgd:0", "period"), ("localsgd:2:-1", "warm-up"), ("delayed:1", "takes 0"),
                       ("topk:x", "numbers"), ("tracked:0", "segment"), ("tracked:1:2", "starting density"),
                       ("tracked:1:0.1:3", "takes 0 to 2"), ("dgc:0.01:1", "momentum correction"),
                       ("dgc:0.01:0.9:1", "takes 1 to 2")]:
        with pytest.raises(ValueError, match=words):
            S.parse(bad)
    with pytest.raises(ValueError, match="twice"):
        S.parse_list("zerosum,zerosum")


def test_schemes_side_by_side_under_torchrun(tmp_path):
    """--schemes: the same model and batches trained by several schemes in one run; each scheme's bytes
    are its own (top-k and local SGD send less than every-step ZeroSum), the per-step mean losses over
    ranks and the clock are reported, and delayed gradients differ from every-step training."""
    torchrun = shutil.which("torchrun")
    out = tmp_path / "r.json"
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc-per-node", "2", "-m", "zerosum.examples.mlp", "--schemes",
        "zerosum,topk:0.05,localsgd:4:1,delayed,tracked", "--steps", "6", "--warmup", "2", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ZEROSUM_AGGREGATORS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    by = {m["mode"]: m for m in json.loads(out.read_text())["reports"]}
    assert list(by) == ["zerosum", "topk:0.05", "localsgd:4:1", "delayed", "tracked"]
    z = by["zerosum"]
    assert by["topk:0.05"]["bytes_sent_per_step"] < 0.2 * z["bytes_sent_per_step"]
    assert by["localsgd:4:1"]["bytes_sent_per_step"] < 0.7 * z["bytes_sent_per_step"]
    for m in by.values():
        assert len(m["mean_losses"]) == len(m["clock_s"]) == 6
        assert m["clock_s"][:2] == [None, None] and all(b > a for a, b in zip(m["clock_s"][2:], m["clock_s"][3:]))
        assert m["losses"][0] == z["losses"][0]      # same initial model, same first batch
    assert z["identical_on_all_ranks"] and by["delayed"]["identical_on_all_ranks"]
    assert by["delayed"]["losses"][1] != z["losses"][1]   # the first step applied nothing
    assert by["tracked"]["identical_on_all_ranks"] and by["tracked"]["levels"]      # its k per bucket and step
    assert all(len(b["k"]) in (5, 6) and b["k"][0] == b["blocks"] for b in by["tracked"]["levels"])


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                    reason="needs root, iproute2 and tc (network namespaces, a bridge, tbf qdiscs)")
def test_training_schemes_script_over_shaped_links(tmp_path):
    """experiments/training_schemes.py (E6's script) in a short configuration over 1 Gbit/s links:
    every scheme reports bytes, step time and a loss curve against wall-clock time."""
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "training_schemes.py")
    r = subprocess.run([sys.executable, script, "e6", "--rate", "1gbit", "--workers", "2", "--example", "mlp",
                        "--schemes", "gloo,zerosum,topk:0.01", "--steps", "8", "--warmup", "2", "--smooth", "2",
                        "--seeds", "0,1", "--out", "none"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| scheme")}
    assert set(rows) == {"gloo", "zerosum", "topk:0.01"}, r.stdout
    assert "over seeds 0, 1" in r.stdout     # the last table is over both seeds
    sent = {k: float(v.split("|")[2].split()[0]) for k, v in rows.items()}
    assert sent["topk:0.01"] < 0.1 * sent["zerosum"]
