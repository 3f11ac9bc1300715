"""The default run's covering subsets keep every feature of the kernel grids.

`conftest.covering_cases` marks ``full`` the cases of a hand-made grid that the others
cover; here, over the real grids, every feature word of a CPU case's id is still in a
case that runs by default, and the ``gpu`` cases are never marked.
"""
from __future__ import annotations

import pytest

import test_decode_kernel
import test_prefill_kernel
from conftest import covering_cases


def _is(param, mark: str) -> bool:
    return any(m.name == mark for m in param.marks)


@pytest.mark.parametrize("grid", [
    pytest.param(test_decode_kernel.GRID, id="decode"),
    pytest.param(test_decode_kernel.MOSAIC_GRID, id="mosaic-decode"),
    pytest.param([pytest.param(b, a, id=i) for i, b, a in test_prefill_kernel.MAIN_GRID], id="prefill"),
    pytest.param(test_prefill_kernel._tiling_params(test_prefill_kernel.MOSAIC_TILINGS), id="mosaic-tilings"),
])
def test_every_feature_of_a_cpu_case_runs_by_default(grid):
    params = covering_cases(grid)
    assert len(params) == len(grid)
    on_cpu = [p for p in params if not _is(p, "gpu")]
    default = [p for p in on_cpu if not _is(p, "full")]
    assert default
    features = {word for p in on_cpu for word in p.id.split("-")}
    assert features == {word for p in default for word in p.id.split("-")}
    assert not any(_is(p, "full") for p in params if _is(p, "gpu"))


def test_the_greedy_cover_takes_the_widest_case_after_those_kept():
    params = covering_cases(["a-b", "a", "b", "c-a"], keep=["b"])
    assert [p.id for p in params if not p.marks] == ["b", "c-a"]  # "b" as asked, then a and c at once
    assert [p.id for p in params if _is(p, "full")] == ["a-b", "a"]
