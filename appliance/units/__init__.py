"""The systemd side of the appliance: one templated unit, one serve program, per-instance files.

- :func:`render` ``(profile, instance, options) -> {relative path: RenderedFile(content, mode)}``:
  the shared unit and serve program, the instance's env file (the operator's) and args file (the
  profile's engine arguments, data the serve program reads).
- :func:`install` ``(profile, instance, root=Path("/"), options=...)`` writes them under
  ``root`` atomically with their modes, keeps what the env file already says (``VLLM_IMAGE``
  above all) and creates the API key file (0600).
- :func:`uninstall` removes what install wrote for an instance of either shape (the shared
  files with the last).
- :mod:`.instance`: :func:`instance.read` ``(root, name) -> Instance``, an installed instance's
  facts read once from its env file.
- :func:`render_to` writes a rendered tree for review (``appliance instance render --out DIR``).
- :mod:`.examples`: the committed examples under ``systemd/``.
"""

from __future__ import annotations

from ..host.names import (
    ENV_DIR,
    STATE_UNIT,
    UNIT_TEMPLATE,
    check_instance,
    container_name,
    unit_name,
)
from .template import DEFAULT_IMAGE, SERVE_SCRIPT, Options, RenderedFile, render
from .writer import (
    Planned,
    WriteResult,
    install,
    named_profile,
    planned,
    render_to,
    uninstall,
    write_tree,
)

__all__ = [
    "DEFAULT_IMAGE",
    "ENV_DIR",
    "SERVE_SCRIPT",
    "STATE_UNIT",
    "UNIT_TEMPLATE",
    "Options",
    "Planned",
    "RenderedFile",
    "WriteResult",
    "check_instance",
    "container_name",
    "install",
    "named_profile",
    "planned",
    "render",
    "render_to",
    "uninstall",
    "unit_name",
    "write_tree",
]
