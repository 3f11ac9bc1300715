"""benchmarks/RESULTS.md keeps the current figures only, and its links into the notes resolve.

RESULTS.md: at most 200 lines, one ``### <suite>, NVIDIA <GPU>`` heading per table, the
columns ``auto`` and ``auto / torch_sdpa_cudnn`` wherever torch's cuDNN SDPA is a peer;
the dated measurement notes live in benchmarks/NOTES.md, whose sections it links.
"""
from __future__ import annotations

import pathlib
import re
import unicodedata
from typing import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text()
NOTES = (ROOT / "benchmarks" / "NOTES.md").read_text()


def github_anchors(markdown: str) -> Iterator[str]:
    """The anchors GitHub gives a file's headings (lower case; letters, digits, ``_``,
    ``-`` and spaces kept, spaces to ``-``; a repeated anchor gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else re.match(r"#{1,6} (.+)$", line)
        if match:
            slug = "".join(ch for ch in match[1].strip().lower()
                           if ch in " -" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc")
            slug = slug.replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_results_holds_current_figures_only():
    assert len(RESULTS.splitlines()) <= 200
    assert "](NOTES.md)" in RESULTS
    headings = re.findall(r"^### (.+)$", RESULTS, re.MULTILINE)
    assert len(headings) >= 9 and all(re.search(r", NVIDIA [\w ]+$", h) for h in headings), headings
    # every dated section moved to the notes
    assert not re.search(r"^## .*\(20\d\d-\d\d-\d\d", RESULTS, re.MULTILINE)


def test_tables_with_a_torch_sdpa_peer_show_auto_and_its_ratio():
    headers = [line for line in RESULTS.splitlines() if line.startswith("| ") and "torch_sdpa_cudnn" in line]
    assert len(headers) >= 2
    for header in headers:
        columns = [c.strip() for c in header.strip("|").split("|")]
        assert "auto" in columns and "auto / torch_sdpa_cudnn" in columns, header


def test_links_into_the_notes_resolve():
    anchors = set(github_anchors(NOTES))
    for name, text in [("RESULTS.md", RESULTS), ("NOTES.md", NOTES),
                       ("README.md", (ROOT / "README.md").read_text()),
                       ("benchmarks/README.md", (ROOT / "benchmarks" / "README.md").read_text())]:
        targets = re.findall(r"\]\((?:benchmarks/)?NOTES\.md#([^)]+)\)", text)
        targets += re.findall(r"\]\(#([^)]+)\)", text) if name == "NOTES.md" else []
        missing = [t for t in targets if t not in anchors]
        assert not missing, (name, missing)
    assert len(re.findall(r"NOTES\.md#", RESULTS)) >= 8
