"""Whether a directory may hold programs this process runs: the program store's files
and JAX's persistent compilation cache are native code (or what becomes it), so whoever
can write there chooses the code the engine runs. As ssh and pip judge their own
directories: owned by this user, not writable by group or others, nor any ancestor
unless sticky. Used by `jax_paged_attn.engine.startup` (JAX's cache) and
`jax_paged_attn.engine.program_store` (the store beside it).
"""
from __future__ import annotations

import os
import pathlib
import stat


def untrusted_directory_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a directory, existing or not) cannot be trusted with programs this
    process will run, or None where it can: as ssh and pip judge theirs, the directory
    must be owned by this user and not writable by group or others, and each ancestor
    owned by this user or root and not writable by group or others unless sticky
    (``/tmp``); a missing directory is judged by its nearest existing ancestor."""
    if not hasattr(os, "getuid"):  # pragma: no cover - POSIX only
        return "file ownership cannot be checked on this platform"
    uid = os.getuid()
    current = pathlib.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    is_target = True
    while True:
        try:
            info = os.stat(current)  # follows links: the directory the files land in
        except FileNotFoundError:
            if current.parent == current:
                return f"{current} does not exist"
            current, is_target = current.parent, False
            continue
        except OSError as error:
            return f"{current} cannot be examined ({error})"
        if not stat.S_ISDIR(info.st_mode):
            return f"{current} is not a directory"
        writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if is_target:
            if info.st_uid != uid:
                return f"{current} is owned by uid {info.st_uid}, not by this user (uid {uid})"
            if writable_by_others:
                return f"{current} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
        else:
            if info.st_uid not in (uid, 0):
                return f"its ancestor {current} is owned by uid {info.st_uid}, neither this user nor root"
            if writable_by_others and not info.st_mode & stat.S_ISVTX:
                return (f"its ancestor {current} is writable by group or others and not sticky "
                        f"(mode {stat.S_IMODE(info.st_mode):o})")
        if current.parent == current:
            return None
        current, is_target = current.parent, False


def make_private_directory(path: str | os.PathLike) -> str | None:
    """Creates ``path`` and its missing ancestors with mode 0o700 and returns
    `untrusted_directory_reason` of it (None: trusted). An existing directory is left as
    it is: a loose one is refused, not repaired behind the user's back."""
    path = pathlib.Path(os.path.expanduser(os.fspath(path)))
    reason = untrusted_directory_reason(path)
    if reason is not None and path.exists():
        return reason
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first: judged below
            pass
        except OSError as error:
            return f"{directory} cannot be created ({error})"
    return untrusted_directory_reason(path)
