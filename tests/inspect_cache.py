"""Test helper: ``inspect.getsource`` of a class answered once per source file's state, not re-parsed at every call.

TorchTitan's ConfigManager builds its job config as new dataclasses at every parse (``MergedJobConfig``, in module
``types``), and tyro asks ``inspect.getsource`` for each one's field docstrings: every call parses the whole of
``types.py`` to find a class that is not there (OSError), 24 times a parse, more than half of a parse's 0.3-0.4 s on
this machine. The suite parses job files hundreds of times (every documented command, every job file and preset).
Here the answer for a class, its text or its OSError, is kept per (source file, qualified name, the file's mtime and
size): the same answer Python gives, since it depends on nothing else.

Installed by tests/conftest.py and, through dist_util's fork-server preload, in the gloo ranks.
"""

from __future__ import annotations

import inspect
import os

_answers: dict[tuple, tuple[bool, object]] = {}


def install() -> None:
    original = inspect.getsource
    if getattr(original, "_titan_nvfp4", False):
        return

    def getsource(obj):
        if not inspect.isclass(obj):
            return original(obj)
        try:
            path = inspect.getsourcefile(obj)
            st = os.stat(path)
        except (TypeError, OSError):
            return original(obj)
        key = (path, obj.__qualname__, st.st_mtime_ns, st.st_size)
        hit = _answers.get(key)
        if hit is None:
            try:
                hit = _answers[key] = (True, original(obj))
            except OSError as e:
                hit = _answers[key] = (False, e.args)
        if not hit[0]:
            raise OSError(*hit[1])
        return hit[1]

    getsource._titan_nvfp4 = True
    getsource.original = original
    inspect.getsource = getsource


install()
