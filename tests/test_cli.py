"""The command grammar as a whole: what `appliance --help` shows."""

from __future__ import annotations

import click
from click.testing import CliRunner

from appliance.cli import cli

VERBS = {"cutover", "rollback", "status", "history"}


def test_the_top_level_shows_the_noun_groups_and_the_four_lifecycle_verbs():
    res = CliRunner().invoke(cli, ["--help"], catch_exceptions=False)
    assert res.exit_code == 0
    listed = res.output.split("Commands:\n", 1)[1].splitlines()
    shown = {line.split()[0] for line in listed if line.startswith("  ") and line.split()}
    ctx = click.Context(cli)
    groups = {name for name in shown if isinstance(cli.get_command(ctx, name), click.Group)}
    assert VERBS <= shown and shown - VERBS == groups
    assert {"bench", "instance", "dev"} <= groups and "tune" not in shown
