"""Which target a name is: the one place a cutover, a rollback, a recovery and ``status`` ask
the host layer for an instance's shape."""

from __future__ import annotations

from ..units.instance import read as read_instance
from .context import Context
from .group import group_target
from .target import InstanceTarget, Target


def target(ctx: Context, name: str) -> Target:
    """``name`` as this host runs it: the nodes of a group (by the args files installed), else
    a single-node instance (by its env file)."""
    inst = read_instance(ctx.layout.root, name)
    if inst.group:
        return group_target(ctx, inst)
    return InstanceTarget(inst, ctx.layout.root)
