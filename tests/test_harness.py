"""The test harness's own behaviour (tests/conftest.py): the bytecode folder that the
suite's processes share where the environment turned Python's bytecode cache off."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

from conftest import share_bytecode


def test_a_run_without_bytecode_gets_a_private_folder_its_children_write_to(tmp_path):
    """PYTHONDONTWRITEBYTECODE set: a fresh folder only its owner can enter, named in
    PYTHONPYCACHEPREFIX with the variable removed; a child process given that environment
    writes its bytecode there and nothing beside the source."""
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": os.environ.get("PATH", "")}
    folder = share_bytecode(environ)
    try:
        assert folder is not None and os.path.isdir(folder)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert environ["PYTHONPYCACHEPREFIX"] == folder and "PYTHONDONTWRITEBYTECODE" not in environ
        (tmp_path / "harness_probe_module.py").write_text("VALUE = 7\n")
        done = subprocess.run([sys.executable, "-c", "import harness_probe_module as m; print(m.VALUE)"],
                              cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "7", done.stderr
        # (the folder mirrors each source's absolute path; the standard library's modules the
        # child imported are there too)
        mirrored = os.path.join(folder, str(tmp_path).lstrip(os.sep))
        assert [f for f in os.listdir(mirrored) if f.endswith(".pyc")] == [
            f"harness_probe_module.{sys.implementation.cache_tag}.pyc"]
        assert not (tmp_path / "__pycache__").exists()
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def test_an_environment_that_caches_bytecode_or_names_its_own_folder_is_left_alone():
    for environ in ({}, {"PYTHONDONTWRITEBYTECODE": ""},
                    {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/somewhere/of/the/users"}):
        before = dict(environ)
        assert share_bytecode(environ) is None
        assert environ == before
