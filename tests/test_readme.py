"""README.md's examples run as written, and README leads with use.

Every fenced ``python`` block right after a ``<!-- test:run NAME -->`` line is executed
here, in a fresh namespace, so the quickstart and the attention example cannot drift
from the code; the serve section's blocks (``<!-- test:serve NAME -->``) run in
tests/test_serve.py against a live server; every other ``python`` block is marked
``<!-- fragment -->`` (and says so in its text). The commands the README gives point at files and options that exist.
"""
from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUNNABLE = re.compile(r"<!-- test:run (?P<name>[\w-]+) -->\n```python\n(?P<code>.*?)\n```", re.DOTALL)
BLOCKS = {m["name"]: m["code"] for m in RUNNABLE.finditer(README)}
SECTIONS = re.findall(r"^## (.+)$", README, re.MULTILINE)


def run_block(name: str) -> str:
    """Executes README block ``name``; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[name], f"README.md:{name}", "exec"), {"__name__": f"readme_{name}"})
    return out.getvalue()


def test_readme_marks_its_runnable_examples():
    assert sorted(BLOCKS) == ["attention", "quickstart"]
    code_lines = [line for line in BLOCKS["quickstart"].splitlines() if line.strip()]
    assert len(code_lines) == 5  # the five-line quickstart stays five lines


def test_quickstart_runs():
    printed = run_block("quickstart")
    tokens = eval(printed.strip())  # the block prints one list of token ids
    assert isinstance(tokens, list) and len(tokens) == 8 and all(isinstance(t, int) for t in tokens)


def test_attention_example_runs():
    run_block("attention")  # it asserts the decode step equals the prefill rows itself


def test_every_python_block_runs_or_is_marked_a_fragment():
    markers = re.findall(r"(?:^(<!-- [^\n]* -->)\n)?^```python$", README, re.MULTILINE)
    assert len(markers) >= 4
    # test:serve blocks run in tests/test_serve.py, against its server
    assert all(m.startswith(("<!-- test:run ", "<!-- test:serve ")) or m == "<!-- fragment -->" for m in markers), markers


def test_readme_leads_with_use():
    """What it is, install, quickstart, the attention API, the model / engine API, then the
    figures (one table, linking to RESULTS.md); no run-time stamps outside RESULTS.md."""
    order = ["Install", "Quickstart", "Attention API", "KV cache and metadata", "Layers, models, engine",
             "Current figures"]
    found = [next(i for i, title in enumerate(SECTIONS) if title.startswith(name)) for name in order]
    assert found == sorted(found) and found[0] == 0, SECTIONS
    figures = README.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    assert "benchmarks/RESULTS.md" in figures and figures.count("\n| --- |") == 1
    assert not re.search(r"\d\d:\d\d UTC|earlier run", README)


@pytest.mark.parametrize("path", ["examples/generate.py", "examples/custom_model_loop.py"])
def test_readme_points_at_files_that_exist(path):
    assert path in README and (ROOT / path).is_file()


def test_readme_commands_use_existing_options():
    assert "python3 examples/generate.py --verify" in README
    assert "--verify" in (ROOT / "examples/generate.py").read_text()
    # CI runs the command after this marker (.ci/run): it must stay a bash block.
    assert re.search(r"<!-- ci:test-command -->\n```bash\npython3 -m pip install (--no-compile )?\"\.\[test\]\" && python3 -m pytest",
                     README)
