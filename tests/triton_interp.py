"""Test helper: Triton's CPU interpreter without its redundant re-patching of triton.language.

Under TRITON_INTERPRET=1 a kernel launch (``GridExecutor.__call__``) patches the builtins of
``triton.language`` (and of ``tl.core``, ``tl.math``, ``tl.tensor``) with interpreted versions, runs the
grid and restores them. Every call of a nested ``@triton.jit`` function (``InterpretedFunction.__call__``)
calls the same ``_patch_lang`` again, inspecting every member of those modules (``inspect.getmembers``)
to find builtins that the launch has already replaced: nothing is left to patch, yet it costs about
3 ms a call, a quarter to a third of the interpreter's time on these kernels (hundreds of nested calls
per program). Here a nested call inside a launch whose patch already covers the language modules
its function sees skips that scan; every launch and any other call still patches as Triton does.
The interpreted kernels compute the same values either way (the patched members are the same). Also
kept once computed: the interpreter's numpy dtype of each Triton dtype (_get_np_dtype builds its table at every
call).

Installed by tests/conftest.py and, through dist_util's fork-server preload, in the gloo ranks.
If Triton's interpreter changes shape (the names below are missing), nothing is patched.
"""

from __future__ import annotations

import inspect
import os


class _NoRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Patch the interpreter (once); False where there is nothing to patch or
    TITAN_NVFP4_TEST_TRITON_REPATCH=1 asks for Triton's own behaviour (to compare)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or os.environ.get("TITAN_NVFP4_TEST_TRITON_REPATCH") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter as itp
    except ImportError:  # pragma: no cover
        return False
    grid_executor = getattr(itp, "GridExecutor", None)
    original = getattr(itp, "_patch_lang", None)
    if grid_executor is None or original is None or getattr(original, "_titan_nvfp4", False):
        return False
    launch = grid_executor.__call__

    # the launches in progress: [language modules patched by it, or None before its own _patch_lang]
    active: list[list] = []

    seen: dict[int, tuple] = {}

    def langs(fn) -> frozenset[int]:
        # as _patch_lang chooses them: the modules tl and tl.core among fn's globals (per function)
        hit = seen.get(id(fn))
        if hit is None or hit[0] is not fn:
            mods = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            hit = seen[id(fn)] = (fn, mods)
        return hit[1]

    def patch_lang(fn):
        if active:
            top = active[-1]
            if top[0] is None:  # the launch's own patch: as Triton does it
                top[0] = langs(fn)
                return original(fn)
            mods = langs(fn)
            if mods <= top[0]:  # a nested call: its modules are patched already
                return _NoRestore()
            # a nested call into modules the launch did not patch (triton.language.core, from tl.randint's
            # Philox): patched as Triton does it, once per launch (Triton keeps no handle to undo a nested call's
            # patch, so those modules stay patched for the rest of the launch either way)
            top[0] = top[0] | mods
        return original(fn)

    def call(self, *args, **kwargs):
        active.append([None])
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    patch_lang._titan_nvfp4 = True
    itp._patch_lang = patch_lang
    grid_executor.__call__ = call
    _cache_np_dtype(itp, tl)
    import interp_memo  # a launch already run on the same inputs is replayed (tests/interp_memo.py)

    interp_memo.install(itp, grid_executor, call)
    return True


def _cache_np_dtype(itp, tl) -> None:
    """The interpreter's _get_np_dtype builds its table of numpy dtypes afresh at each of its calls (one or more per
    interpreted op); the answer for a scalar dtype, kept once asked, is the same."""
    original = getattr(itp, "_get_np_dtype", None)
    if original is None:
        return
    known: dict = {}

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return original(tt_dtype)
        hit = known.get(key)
        if hit is None:
            hit = known[key] = original(key)
        return hit

    itp._get_np_dtype = np_dtype


install()
