"""Where the appliance's run-time files are: ``docker/`` (Dockerfiles, entry point, locks),
``grafana/``, ``prometheus/`` and ``deploy/observability/`` (the plane).

In a checkout they are the repository's own folders (edited, generated and drift-checked
there). An installed package carries copies of them under ``appliance/_assets/``, laid there
when the wheel is built (``setup.py``, ADR 0017), so a host with the package and no checkout
builds images and writes the plane from the same files.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ApplianceError

# What the wheel carries (setup.py copies exactly these), relative to the repository root.
FOLDERS = ("docker", "grafana", "prometheus", "deploy/observability")
PACKAGED = Path(__file__).resolve().parent / "_assets"
_CHECKOUT = Path(__file__).resolve().parents[1]


class AssetsMissing(ApplianceError):
    """Neither a checkout nor the installed package holds the appliance's files."""


def root() -> Path:
    """The folder holding :data:`FOLDERS`: the checkout's root when running from one, else the
    installed package's copy."""
    if (_CHECKOUT / "pyproject.toml").is_file() and all((_CHECKOUT / f).is_dir() for f in FOLDERS):
        return _CHECKOUT
    if all((PACKAGED / f).is_dir() for f in FOLDERS):
        return PACKAGED
    raise AssetsMissing(
        f"the appliance's files ({', '.join(FOLDERS)}) are in neither a checkout nor {PACKAGED}",
        fix="reinstall the package from its wheel (pip install --force-reinstall)",
    )


def path(*parts: str) -> Path:
    """``root() / parts``: e.g. ``path("docker")``."""
    return root().joinpath(*parts)
