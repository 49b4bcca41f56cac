"""The README tells the truth about the repository: its Results block is exactly what
benchmarks/results/results.json generates, and every file it (or docs/) points to is in the repository."""
import copy
import json
import re
from pathlib import Path

import pytest

from specmoe.bench import report
from specmoe.errors import SpecMoEError

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = json.loads((REPO / "benchmarks" / "results" / "results.json").read_text())


def block_of(text: str) -> str:
    i, j = text.index(report.BEGIN), text.index(report.END)
    return text[i:j + len(report.END)]


def test_readme_results_block_is_generated_from_results_json():
    assert block_of((REPO / "README.md").read_text()) == report.readme_block(RESULTS), \
        "README.md's results block is stale or hand-edited: run `python -m specmoe.bench.report`"


def test_results_page_is_generated_from_results_json():
    rdir = REPO / "benchmarks" / "results"
    page = report.report_text(RESULTS, preamble=(rdir / "preamble.md").read_text())
    assert (rdir / "README.md").read_text() == page, \
        "benchmarks/results/README.md is stale or hand-edited: run `python -m specmoe.bench.report`"
    # the hand-written preamble names runs, code and dtypes, but carries no measured figure
    prose = re.sub(r"`[^`]*`|\b[Rr]un \d\b|\bbf16\b", "", (rdir / "preamble.md").read_text())
    assert not re.search(r"\d", prose), \
        "preamble.md carries a figure: put it in the generated part (specmoe/bench/report.py) instead"


def test_a_hand_typed_figure_fails_the_check(tmp_path):
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    readme.write_text(text)
    assert report.main(["--readme", str(readme), "--check", "--readme-only"]) == 0
    block = block_of(text)
    figure = re.search(r"\d+\.\d+×", block).group(0)  # the first ratio in the headline table
    readme.write_text(text.replace(block, block.replace(figure, "9.99×", 1)))
    assert report.main(["--readme", str(readme), "--check", "--readme-only"]) == 1
    assert report.main(["--readme", str(readme), "--readme-only"]) == 0 and readme.read_text() == text  # regenerated


def test_the_block_follows_the_results():
    res = copy.deepcopy(RESULTS)
    sp = next(r for r in res["runs"] if r["model"] == "main" and r["tier"] == "disk" and r["system"] == "specmoe"
              and r["batch"] == 1)
    od = next(r for r in res["runs"] if r["model"] == "main" and r["tier"] == "disk" and r["system"] == "ondemand"
              and r["batch"] == 1)
    sp["tokens_per_s"] = od["tokens_per_s"] * 2
    sp["decode_bytes_per_token"] = od["decode_bytes_per_token"] / 4
    block = report.readme_block(res)
    assert block != report.readme_block(RESULTS)
    assert "| 1 | " + f"{sp['tokens_per_s']:.1f} | 2.00× |" in block
    assert "faster at batch 1," in block and "75%" in block  # the summary follows the rows too


def test_replace_block_needs_the_markers():
    with pytest.raises(SpecMoEError, match="no results block"):
        report.replace_block("# a README without markers\n", report.readme_block(RESULTS))


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a path in inline code: two or more segments, e.g. `models/specmoe-tiny-moe/README.md`, `../x/DESIGN.md`
CODE_PATH = re.compile(r"`((?:\.{1,2}/|/)?[\w.\-]+(?:/[\w.\-]+)+/?)`")
TOP = {p.name for p in REPO.iterdir()} - {".git", ".venv"}


def local_targets(md: Path):
    text = md.read_text()
    for m in LINK.finditer(text):
        t = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", t) or t.startswith("#"):  # http:, mailto:, an anchor in the page
            continue
        yield "link", t.split("#")[0]
    for m in CODE_PATH.finditer(text):
        yield "path", m.group(1)


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_point_only_at_files_in_the_repository(md):
    bad = []
    for kind, t in local_targets(md):
        target = (md.parent / t).resolve()
        if not target.is_relative_to(REPO):
            bad.append(f"{t} ({kind} outside the repository)")
        elif kind == "link" and not target.exists():
            bad.append(f"{t} (link to a missing file)")
        elif kind == "path" and t.split("/")[0] in TOP and not (REPO / t).exists():
            bad.append(f"{t} (names a missing file)")
    assert not bad, f"{md.name}: {bad}"


def test_the_link_check_sees_links_and_paths(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("[a](docs/A.md#x) ![p](p.png \"t\") [w](https://e.org) `../shared/DESIGN.md` `a/b.py`")
    assert list(local_targets(md)) == [("link", "docs/A.md"), ("link", "p.png"), ("path", "../shared/DESIGN.md"),
                                       ("path", "a/b.py")]


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_carry_no_merge_conflict_markers(md):
    """A merge once left `<<<<<<<` / `>>>>>>>` blocks in the README; every doc must be free of them."""
    bad = [i + 1 for i, line in enumerate(md.read_text().splitlines())
           if re.match(r"(<{7}|>{7})( |$)|={7}$", line)]
    assert not bad, f"{md.name}: conflict markers at lines {bad}"
