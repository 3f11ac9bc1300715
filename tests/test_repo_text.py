"""The repository's files speak of the project alone.

No tracked file may point at files outside the repository (a sibling ``shared``
folder, its anchor or style notes) or describe where figures came from in words of the
setting it was developed in instead of the hardware ("an NVIDIA H200"); vLLM's
FlashAttention backend is called by its name, not "the seed". "The seed" of a random
generator (sampling, tests) is fine: a line that also speaks of randomness passes.
"""
from __future__ import annotations

import pathlib
import re
import subprocess

_REPO = pathlib.Path(__file__).resolve().parents[1]
_THIS = pathlib.Path(__file__).resolve()

FORBIDDEN = re.compile(
    r"lent (nvidia|machine|h200)|the lent|device tool|\.\./shared|shared/(anchors|style|reference)"
    r"|anchors\.md|\banchors\b|style\.md|project brief|the[ _]seed",
    re.IGNORECASE,
)
RANDOMNESS = re.compile(r"random|prng|rng|sampl|jax\.random|key", re.IGNORECASE)
_SKIPPED_SUFFIXES = {".png", ".jpg", ".safetensors", ".npz", ".npy"}


def tracked_files() -> list[pathlib.Path]:
    """The files git tracks (every file under the repo, minus caches, outside a checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=_REPO, check=True, capture_output=True).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(_REPO)) for p in _REPO.rglob("*")
                 if p.is_file() and not {".git", "__pycache__", ".pytest_cache", ".hypothesis"} & set(p.parts)]
    return [_REPO / n for n in names]


def offending_lines(path: pathlib.Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError):
        return []
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        match = FORBIDDEN.search(line)
        if match is None:
            continue
        if match.group(0).lower().replace("_", " ") == "the seed" and RANDOMNESS.search(line):
            continue
        hits.append(f"{path.relative_to(_REPO)}:{number}: {line.strip()[:160]}")
    return hits


def test_no_tracked_file_points_outside_the_repository_or_at_its_setting():
    files = [p for p in tracked_files() if p.resolve() != _THIS and p.suffix not in _SKIPPED_SUFFIXES]
    assert len(files) > 20  # the listing found the repository
    hits = [hit for path in files for hit in offending_lines(path)]
    assert not hits, "\n".join(hits)


def test_the_check_catches_each_phrase_and_spares_a_prng_seed():
    bad = ["shapes of shared/ANCHORS.md", "see ../shared/STYLE.md", "the lent `nvidia-h200` machine",
           "the device tool brings it back", "ports the seed builder", "Differences from the seed"]
    good = ["the seed of the PRNG key", "sampling with the seed of each request", "an NVIDIA H200"]
    path = _REPO / "README.md"  # any tracked path: offending_lines only reads its text
    for line in bad:
        assert FORBIDDEN.search(line), line
    for line in good:
        match = FORBIDDEN.search(line)
        assert match is None or RANDOMNESS.search(line), line
    assert offending_lines(path) == []
