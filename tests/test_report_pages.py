"""A benchmark report's page keeps what is written by hand below its notes marker."""

from moeswarm_bench.bench.markdown import NOTES, write_page


def test_a_new_report_keeps_the_notes_and_replaces_the_rest(tmp_path):
    page = tmp_path / "bench-x.md"
    write_page(page, "# Report\n\nold table\n")
    assert page.read_text() == "# Report\n\nold table\n"  # no marker yet: nothing kept
    page.write_text(page.read_text() + f"\n{NOTES}\n\n## Other hosts\n\nrun A: 0.8x\n")
    write_page(page, "# Report\n\nnew table\n")
    write_page(page, "# Report\n\nnewer table\n")  # again: the notes once, no blank lines piling up
    assert page.read_text() == f"# Report\n\nnewer table\n\n{NOTES}\n\n## Other hosts\n\nrun A: 0.8x\n"
