"""Disk for the weights: the free space at the instance's Hugging Face cache against the
profile's ``weights_gib``, less what the cache already holds of its models."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..profiles import Profile
from .findings import Finding


def weights_finding(profile: Profile, hf_home: Path) -> Finding:
    if profile.uses_devmodel:
        return Finding("disk.weights", "ok", f"profile {profile.name} serves the tiny dev models")
    where = _existing(hf_home)
    free = shutil.disk_usage(where).free
    free_gib = free / 2**30
    if not profile.weights_gib:
        return Finding(
            "disk.weights",
            "warn",
            f"profile {profile.name} states no weights_gib: {free_gib:.1f} GiB free at {where}, "
            "not compared",
        )
    have = sum(_size(hf_home / "hub" / f"models--{m.replace('/', '--')}") for m in _models(profile))
    need = profile.weights_gib * 2**30 - have
    if free < need:
        return Finding(
            "disk.weights",
            "blocker",
            f"{free_gib:.1f} GiB free at {where}, the weights need {need / 2**30:.1f} GiB more "
            f"({profile.weights_gib:g} GiB in all)",
            "free space there, or install with --hf-cache-dir on a larger disk",
        )
    return Finding(
        "disk.weights",
        "ok",
        f"{free_gib:.1f} GiB free at {where} for {max(need, 0) / 2**30:.1f} GiB of weights to come",
    )


def _models(profile: Profile) -> list[str]:
    spec = profile.speculative
    return [profile.model] + ([spec.model] if spec is not None and spec.model else [])


def _existing(path: Path) -> Path:
    """The cache dir, or its nearest existing parent (not created before the first pull)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
