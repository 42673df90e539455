"""Every result file the README and the docs quote exists, and benchmarks/results/INDEX.md
says what it is (current, or superseded and kept because it is quoted): a number in the
README names the file it comes from, and that file must not go missing or go unlisted."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
QUOTERS = ["README.md", "benchmarks/README.md", *sorted(
    p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
# A path under benchmarks/results/, or a bare results file name in backquotes.
PATH = re.compile(r"benchmarks/results/([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*)")
BARE = re.compile(r"`([a-z0-9_.-]+\.(?:md|json))`")


def quoted(text: str) -> set[str]:
    """The results entries ``text`` names: a top-level file or folder of results/."""
    names = {m.split("/")[0] for m in PATH.findall(text)}
    names |= {m for m in BARE.findall(text) if (RESULTS / m).exists()}
    return {n.rstrip(".") for n in names if n.rstrip(".")}


def test_the_scan_finds_paths_and_bare_names():
    text = ("see `benchmarks/results/mttr-final.md`, and `goodput.md`; "
            "benchmarks/results/demo/summary.json; `docs.md` is no result")
    assert quoted(text) == {"mttr-final.md", "goodput.md", "demo"}


def listed(index: str) -> set[str]:
    """Every name INDEX.md gives in backquotes, ``a-{x,y}.png`` expanded."""
    names: set[str] = set()
    for token in re.findall(r"`([^`]+)`", index):
        match = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", token)
        parts = [f"{match[1]}{m}{match[3]}" for m in match[2].split(",")] if match else [token]
        names |= {n.rstrip("/") for n in parts}
    return names


def test_the_index_names_expand_braces():
    assert listed("`s.json`, `s-{a,b}.png`, `demo/`") == {"s.json", "s-a.png", "s-b.png", "demo"}


def test_every_quoted_result_exists_and_the_index_lists_it():
    index = listed((RESULTS / "INDEX.md").read_text())
    missing, unlisted = [], []
    for quoter in QUOTERS:
        for name in sorted(quoted((REPO / quoter).read_text())):
            # A command's output stem (``--out benchmarks/results/reform``) names its files.
            if not (RESULTS / name).exists() and not any(RESULTS.glob(f"{name}.*")):
                missing.append((quoter, name))
            elif name not in index and not any(n.startswith(f"{name}.") for n in index):
                unlisted.append((quoter, name))
    assert missing == [], f"quoted result files that do not exist: {missing}"
    assert unlisted == [], f"quoted result files INDEX.md does not list: {unlisted}"
