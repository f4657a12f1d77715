"""``appliance instance install|render|uninstall|status|history|cutover|rollback|doctor NAME``:
one noun for an instance of either shape (a single-node instance, or this host's nodes of a
multi-node group). ``cutover``, ``rollback``, ``status`` and ``history`` are also top-level
commands, the same ones: the verbs an operator types at 3 a.m."""

from __future__ import annotations

import click

from .cutover import cutover, history_, rollback, status
from .doctor import doctor
from .units import install, render, uninstall


@click.group()
def instance() -> None:
    """An instance NAME: install, inspect, move between images, remove.

    NAME is a single-node instance (gemma4-vllm@NAME), or a multi-node group whose nodes this
    host runs (gemma4-vllm-head@NAME, gemma4-vllm-worker@NAME): every command takes either.
    """


for command in (install, render, uninstall, status, history_, cutover, rollback, doctor):
    instance.add_command(command)
