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
