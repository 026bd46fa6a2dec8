"""``python -m titan_nvfp4.compare`` (importing this module, as a wheel check does, runs nothing)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
