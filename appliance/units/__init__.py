"""The systemd side of the appliance: a templated unit, per-instance env files and serve scripts.

- :func:`render` ``(profile, instance, options) -> {relative path: RenderedFile(content, mode)}``
- :func:`install` ``(profile, instance, root=Path("/"), options=...)`` writes them under
  ``root`` atomically with their modes, keeps the instance's ``VLLM_IMAGE``, and creates its
  API key file (0600).
- :func:`render_to` writes a rendered tree for review (``appliance render --out DIR``).
- :mod:`.examples`: the committed examples under ``systemd/`` and ``scripts/serve/`` and their
  drift check.
"""

from __future__ import annotations

from .template import (
    DEFAULT_IMAGE,
    ENV_DIR,
    LIBEXEC_DIR,
    UNIT_TEMPLATE,
    Options,
    Paths,
    RenderedFile,
    check_instance,
    container_name,
    parse_env,
    paths,
    render,
    unit_name,
)
from .writer import WriteResult, atomic_write, install, render_to, write_tree

__all__ = [
    "DEFAULT_IMAGE",
    "ENV_DIR",
    "LIBEXEC_DIR",
    "UNIT_TEMPLATE",
    "Options",
    "Paths",
    "RenderedFile",
    "WriteResult",
    "atomic_write",
    "check_instance",
    "container_name",
    "install",
    "parse_env",
    "paths",
    "render",
    "render_to",
    "unit_name",
    "write_tree",
]
