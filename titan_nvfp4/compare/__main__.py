"""``python -m titan_nvfp4.compare``."""

from .cli import main

raise SystemExit(main())
