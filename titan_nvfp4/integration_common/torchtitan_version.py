"""Which TorchTitan generation is installed ("0.2", "0.3" or None), read from package metadata without
importing TorchTitan, so each integration package is picked explicitly."""

from importlib.metadata import PackageNotFoundError, version

INTEGRATIONS = {"0.2": "titan_nvfp4.integration", "0.3": "titan_nvfp4.integration_v03"}


def installed_generation() -> str | None:
    """"0.2" or "0.3" for an installed torchtitan 0.2.x / 0.3.x, its "major.minor" otherwise, None if absent."""
    try:
        v = version("torchtitan")
    except PackageNotFoundError:
        return None
    return ".".join(v.split("+")[0].split(".")[:2])


def require_generation(wanted: str) -> None:
    """Raise an ImportError naming the installed TorchTitan when it is missing or the other generation."""
    have = installed_generation()
    # only a known other generation is refused: a source checkout may report another version (e.g. 0.0.0)
    if have != wanted and (have is None or have in INTEGRATIONS):
        other = INTEGRATIONS.get(have or "")
        hint = f"; for it use {other}" if other else ""
        raise ImportError(f"{INTEGRATIONS[wanted]} is the TorchTitan {wanted} integration, but "
                          f"{'no torchtitan' if have is None else f'torchtitan {version_string()}'} is installed{hint}")


def version_string() -> str:
    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "none"
