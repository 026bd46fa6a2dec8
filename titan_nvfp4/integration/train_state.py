"""The NVFP4 train state (titan_nvfp4/training/train_state.py: SR call counts and amax windows in the checkpointed
``train_state``) installed on TorchTitan 0.2's Trainer.

``install_on_running_trainers`` runs from the converter's import (torchtitan_fixes.apply) on the Trainer class
of the running ``python -m torchtitan.train`` (that module is ``__main__`` then, not ``torchtitan.train``) and
of an imported ``torchtitan.train``; a custom trainer calls ``install(MyTrainer)`` itself.
"""

from __future__ import annotations

from ..training.train_state import (HISTORY_KEY, KEY, amax_histories, empty_amax_histories, install, load_amax_histories,
                           load_sr_calls, sr_calls, sync_step_counters)


def install_on_running_trainers() -> None:
    """``install`` on the Trainer of ``python -m torchtitan.train`` and of an imported torchtitan.train."""
    import sys

    main = sys.modules.get("__main__")
    mods = [sys.modules.get("torchtitan.train")]
    if getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.train":
        mods.append(main)
    for mod in mods:
        cls = getattr(mod, "Trainer", None)
        if isinstance(cls, type) and hasattr(cls, "state_dict") and hasattr(cls, "load_state_dict"):
            install(cls)


__all__ = ["HISTORY_KEY", "KEY", "amax_histories", "empty_amax_histories", "install", "install_on_running_trainers", "load_amax_histories",
           "load_sr_calls", "sr_calls", "sync_step_counters"]
