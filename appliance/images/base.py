"""The CPU images' base image: a Debian bookworm rootfs made with mmdebstrap, then imported.

No container registry is reachable from the machines this runs on, so ``FROM debian`` cannot
work. ``ensure_base()`` makes a minbase tree with the packages listed in
``docker/cpu/rootfs.txt`` (``bootstrap()``, which the suite's systemd machines use too), strips
apt's caches, and ``docker import``s the tree as
``gemma4-appliance-base:bookworm-<digest>``. The digest covers the package list and the suite,
so the image and the cached tarball (under the machine's cache directory) are reused until the
list changes.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApplianceError
from .files import digest, held

BASE_REPOSITORY = "gemma4-appliance-base"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# Merged /usr as on a debootstrap'd bookworm (usr-is-merged, not usrmerge and its perl).
MERGED_USR_HOOK = "/usr/share/mmdebstrap/hooks/merged-usr"


@dataclass(frozen=True)
class BaseImage:
    """The imported base: its reference and how long making it took (0 when cached)."""

    ref: str
    image_id: str
    seconds: float
    cached: bool


def packages(docker_dir: Path) -> list[str]:
    """The extra packages of the base rootfs (``docker/cpu/rootfs.txt``)."""
    text = (docker_dir / "cpu" / "rootfs.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def base_ref(docker_dir: Path) -> str:
    """The base image's reference, e.g. ``gemma4-appliance-base:bookworm-1a2b3c4d5e6f7a8b``."""
    key = digest(SUITE, MIRROR, "\n".join(packages(docker_dir)))
    return f"{BASE_REPOSITORY}:{SUITE}-{key}"


def make_rootfs_tar(docker_dir: Path, cache_dir: Path) -> Path:
    """The rootfs tarball for the current package list, bootstrapped unless cached."""
    ref = base_ref(docker_dir)
    tarball = cache_dir / "rootfs" / f"{ref.split(':', 1)[1]}.tar"
    if tarball.exists():
        return tarball
    with held(tarball.with_suffix(".lock")):
        if not tarball.exists():  # made by the build we waited for
            _make_tar(docker_dir, tarball)
    return tarball


def bootstrap(root: Path, include: Sequence[str]) -> None:
    """Make a minimal Debian ``SUITE`` tree at ``root`` (absent or empty) with ``include``.

    mmdebstrap, not debootstrap (ADR 0018): one apt run instead of unpacking every essential
    package twice; the same packages in 22 s and 24 CPU-seconds instead of 57 and 57."""
    if shutil.which("mmdebstrap") is None:
        raise ApplianceError(
            "mmdebstrap is not installed", fix="run scripts/setup-system.sh (apt mmdebstrap)"
        )
    cmd = [
        "mmdebstrap",
        "--mode=root",
        "--variant=minbase",
        f"--hook-dir={MERGED_USR_HOOK}",
        f"--include={','.join(include)}",
        SUITE,
        str(root),
        MIRROR,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise ApplianceError(f"mmdebstrap failed:\n{tail}")


def _make_tar(docker_dir: Path, tarball: Path) -> None:
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=tarball.parent) as tmp:
        root = Path(tmp) / "root"
        bootstrap(root, packages(docker_dir))
        # Caches and lists are dead weight in an image that never runs apt.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "var/log"):
            for child in (root / sub).glob("*"):
                if child.is_file():
                    child.unlink()
        partial = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], check=True
        )
        partial.replace(tarball)


def ensure_base(client, docker_dir: Path, cache_dir: Path) -> BaseImage:
    """The base image in the engine: imported from the (cached) rootfs unless already there."""
    import docker.errors

    ref = base_ref(docker_dir)
    try:
        return BaseImage(ref, client.images.get(ref).id, 0.0, True)
    except docker.errors.ImageNotFound:
        pass
    start = time.monotonic()
    tarball = make_rootfs_tar(docker_dir, cache_dir)
    # Two builds of different targets may start at once: one imports, the other then finds it.
    with held(tarball.with_suffix(".import.lock")):
        try:
            return BaseImage(ref, client.images.get(ref).id, 0.0, True)
        except docker.errors.ImageNotFound:
            pass
        repo, tag = ref.split(":", 1)
        client.api.import_image_from_file(
            str(tarball), repository=repo, tag=tag, changes=['CMD ["/bin/bash"]']
        )
        _forget_older_bases(client, ref, tarball)
    return BaseImage(ref, client.images.get(ref).id, time.monotonic() - start, False)


def _forget_older_bases(client, current: str, tarball: Path) -> None:
    """Untag superseded bases and delete their tarballs. Never forced: a base that images still
    sit on keeps its layers until those images are pruned."""
    import docker.errors

    for image in client.images.list(BASE_REPOSITORY):
        for tag in image.tags:
            if tag != current and tag.startswith(f"{BASE_REPOSITORY}:{SUITE}-"):
                try:
                    client.images.remove(tag, force=False)
                except docker.errors.APIError:
                    pass  # still needed by an image; the next prune frees it
    for old in tarball.parent.glob(f"{SUITE}-*.tar"):
        if old != tarball:
            old.unlink(missing_ok=True)
