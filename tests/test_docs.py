"""The README and docs/ as a reader meets them: a README of one screen's worth of sections (at most 200 lines),
links that lead somewhere (a file that exists, a heading that exists), and no wording whose time is the
writer's ("this session", "recently"), stale the day it is read."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RELATIVE_TIME = re.compile(r"\b(this session|last session|previous session|recently|yesterday|today|"
                           r"earlier today|currently|at the moment|never evaluated before|as of now)\b", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_the_slug_is_githubs():
    assert slug("Set-up and running on GPUs") == "set-up-and-running-on-gpus"
    assert slug("PPO recipes: memory per GPU") == "ppo-recipes-memory-per-gpu"
    assert slug("The demos (30 steps, 2 turns)") == "the-demos-30-steps-2-turns"


def test_the_readme_fits_in_200_lines():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO) if REPO in file.parents else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [missing](other.md) [no heading](#bottom)\n")
    found = [target for target in links(page)]
    assert found == ["#top", "other.md", "#bottom"]
    assert "top" in anchors(page) and "bottom" not in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_wording_whose_time_is_the_writers(page):
    found = [f"line {number}: {match.group(0)!r}"
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for match in RELATIVE_TIME.finditer(line)]
    assert not found, f"{page.name}: " + "; ".join(found)


def test_the_map_of_features_to_tests_names_every_test_file_and_only_those():
    text = (REPO / "docs" / "testing.md").read_text()
    section = text.split("## Where each feature is tested", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+\.py)`", section))
    assert named == {path.name for path in (REPO / "tests").glob("test_*.py")}
