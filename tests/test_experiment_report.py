"""The experiment scripts share docs/compression.md: each replaces its own sections, nothing else."""
from report import update_sections


def test_a_section_is_replaced_in_place_and_others_kept(tmp_path):
    doc = tmp_path / "c.md"
    doc.write_text("# Title\n\nintro\n\n## E1: one\n\na\n\n## E2: two (old)\n\nold\n\n## E6: six\n\nz\n")
    update_sections(doc, ["", "## E2: two (new)", "", "new", ""])
    assert doc.read_text() == "# Title\n\nintro\n\n## E1: one\n\na\n\n## E2: two (new)\n\nnew\n\n## E6: six\n\nz\n"


def test_new_sections_are_appended_and_the_preamble_replaced_on_request(tmp_path):
    doc = tmp_path / "c.md"
    doc.write_text("# Old\n\n## E1: one\n\na\n")
    update_sections(doc, ["# New", "", "## E5: five", "", "e"], preamble=True)
    assert doc.read_text() == "# New\n\n## E1: one\n\na\n\n## E5: five\n\ne\n"
    update_sections(tmp_path / "fresh.md", ["## E6: six", "x"])
    assert (tmp_path / "fresh.md").read_text() == "## E6: six\nx\n"


def _row(scheme, step_ms, final_loss, time_s, samples=None):
    return {"scheme": scheme, "step_ms": step_ms, "sent_mb": 1.0, "received_mb": 2.0, "final_loss": final_loss,
            "samples": 1000, "time_to_target_s": time_s, "samples_to_target": samples}


def test_training_schemes_table_gives_medians_and_spread_over_seeds():
    from training_schemes import table
    runs = [[_row("zerosum", 10, 0.5, 2.0, 100), _row("topk:0.01", 8, 0.7, 3.0, 300), _row("local", 5, 0.9, None)],
            [_row("zerosum", 12, 0.4, 4.0, 200), _row("topk:0.01", 8, 0.6, None), _row("local", 5, 0.9, None)],
            [_row("zerosum", 11, 0.6, 3.0, 150), _row("topk:0.01", 9, 0.8, 2.0, 100), _row("local", 5, 0.9, None)]]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table(runs, [1.0, 1.0, 1.0]).splitlines()[2:]}
    assert rows["zerosum"][3:8] == ["11 (10-12)", "0.5000 (0.4000-0.6000)", "3.0 (2.0-4.0)", "150", "1.00x"]
    # topk reached its target in two runs of three: times and ratios over those two
    assert rows["topk:0.01"][5:8] == ["2.5 (2.0-3.0) (2 of 3 runs)", "200", "1.08x (0.67-1.50)"]
    assert rows["local"][3:8] == ["5", "0.9000", "never", "never", "-"]


def test_rerunning_one_model_keeps_the_others_results(tmp_path):
    import json
    from training_schemes import with_earlier_models
    settings = {"experiment": "E6", "rate": "1gbit", "workers": 4, "steps": 300, "warmup": 5, "smooth": 20}
    old_rows = [_row("zerosum", 10, 0.5, 2.0, 100)]
    earlier = tmp_path / "e6.json"
    # a file written before runs had seeds: one run, "rows" and "target"
    earlier.write_text(json.dumps({**settings, "models": {"embedding": {"target": 0.6, "rows": old_rows},
                                                         "mlp": {"target": 1.7, "rows": old_rows}}}))
    new_mlp = {"seeds": [0, 1], "targets": [0.3, 0.31], "runs": [old_rows, old_rows]}
    merged = with_earlier_models({**settings, "models": {"mlp": new_mlp}}, earlier)
    assert merged["models"]["mlp"] == new_mlp
    assert merged["models"]["embedding"] == {"seeds": [0], "targets": [0.6], "runs": [old_rows]}
    # other settings: the earlier models are not comparable and are not kept
    other = with_earlier_models({**settings, "steps": 100, "models": {"mlp": new_mlp}}, earlier)
    assert list(other["models"]) == ["mlp"]
    assert with_earlier_models({**settings, "models": {}}, tmp_path / "absent.json")["models"] == {}


def test_a_model_trained_again_with_other_seeds_adds_them(tmp_path):
    import json
    from training_schemes import with_earlier_models
    settings = {"experiment": "E6", "rate": "1gbit", "workers": 4, "steps": 300, "warmup": 5, "smooth": 20}
    a, b = [_row("zerosum", 10, 0.5, 2.0, 100)], [_row("zerosum", 11, 0.4, 3.0, 100)]
    earlier = tmp_path / "e6.json"
    earlier.write_text(json.dumps({**settings, "models": {"mlp": {
        "seeds": [0], "targets": [0.3], "runs": [a], "settings": ["--lr", "1"]}}}))
    new = {"seeds": [1, 2], "targets": [0.31, 0.32], "runs": [b, b], "settings": ["--lr", "1"]}
    merged = with_earlier_models({**settings, "models": {"mlp": new}}, earlier)["models"]["mlp"]
    assert (merged["seeds"], merged["targets"], merged["runs"]) == ([0, 1, 2], [0.3, 0.31, 0.32], [a, b, b])
    # the drops counted in each run add up (loopback runs count none)
    earlier.write_text(json.dumps({**settings, "models": {"mlp": {
        "seeds": [0], "targets": [0.3], "runs": [a], "settings": ["--lr", "1"], "shaper_drops": 197,
        "socket_buffer_drops": None}}}))
    merged = with_earlier_models({**settings, "models": {"mlp": {**new, "shaper_drops": 3, "socket_buffer_drops": 0}}},
                                 earlier)["models"]["mlp"]
    assert (merged["shaper_drops"], merged["socket_buffer_drops"]) == (200, 0)
    earlier.write_text(json.dumps({**settings, "models": {"mlp": {
        "seeds": [0], "targets": [0.3], "runs": [a], "settings": ["--lr", "1"]}}}))
    # the same seed again, other options or other schemes: this run replaces the earlier one
    for changed in ({"seeds": [0], "targets": [0.31], "runs": [b]}, {"settings": ["--lr", "2"]},
                    {"runs": [[_row("gloo", 1, 1, 1, 1)]] * 2}):
        again = {**new, **changed}
        assert with_earlier_models({**settings, "models": {"mlp": again}}, earlier)["models"]["mlp"] == again


def test_the_best_level_in_hindsight_has_the_fewest_mean_bits_among_levels_that_always_reach():
    from report import cheapest_level
    candidates = {1: [(90, 50), (None, 0)],          # cheapest seed, but one seed never reaches the target
                  2: [(40, 120), (44, 100)],         # mean 110
                  4: [(20, 100), (22, 110)],         # mean 105: the best
                  8: [(10, 105), (11, 105)]}         # mean 105 too: a tie goes to the level listed first
    assert cheapest_level(candidates) == (4, [(20, 100), (22, 110)])
    assert cheapest_level({1: [(None, 5)], 2: [(3, 1), (None, 1)]}) == (None, None)


def test_e6a_compares_the_level_set_before_training_with_the_best_in_hindsight():
    """E6a's levels table: per compressor, the stated level (τ = ⌈m/n⌉) and the level with the fewest mean
    seconds among those that reach the target in every seed, with the ratio seed by seed."""
    from end_to_end import families, levels_table
    names = families(4, 16)
    runs = {"gloo dense": [(230, 10.0, 1), (230, 10.0, 1)], "ZeroSum dense": [(230, 9.0, 2), (230, 9.0, 2)]}
    secs = {1: (None, 30.0), 2: (300, 8.0), 4: (230, 9.0), 8: (230, 8.5)}       # τ = 1 misses in one seed
    for family in ("top-k blocks + EF", "DIANA + random-k"):
        for t, name in names[family][0].items():
            steps, s = secs[t]
            runs[name] = [(steps, s, 1000 * t), (230, s + 1, 1000 * t)]
    for lv, name in names["QSGD"][0].items():
        runs[name] = [(300, 12.0 / lv, 500), (300, 12.0 / lv, 500)]
    table = levels_table(runs, 4, 16)
    topk = next(r for r in table if r.startswith("| top-k"))
    assert topk.split(" | ")[1:3] == ["4", "9.50 (9.00-10.00)"]             # τ = 4, stated before training
    assert topk.split(" | ")[5] == "2" and topk.endswith("| 1.12× (1.11-1.12) |")   # best: τ = 2, 8.5 s mean
    qsgd = next(r for r in table if r.startswith("| QSGD"))
    assert qsgd.split(" | ")[1] == "—" and qsgd.split(" | ")[5] == "16" and qsgd.endswith("| — |")


def test_every_training_schemes_experiment_names_schemes_that_parse_and_sets_its_target():
    from training_schemes import EXPERIMENTS
    from zerosum.examples.schemes import parse_list
    for exp in EXPERIMENTS.values():
        names = [s.text for s in parse_list(exp.schemes)]
        assert "zerosum" in names, exp.key        # every-step ZeroSum's run sets the target loss
