"""The one shape of every command's ``--json``: one JSON object holding the command's records
(``{"instances": [...]}``, ``{"entries": [...]}``, a report's fields), so that a script reads
the whole output with one ``json.loads``, whichever command printed it."""

from __future__ import annotations

import json

import click


def echo_json(record: dict) -> None:
    """Print ``record`` as one JSON object: keys sorted, indented, values JSON has no type for
    (paths, datetimes) as their text."""
    if not isinstance(record, dict):  # a list or JSON lines would break the contract
        raise TypeError(f"--json prints one object, not {type(record).__name__}")
    click.echo(json.dumps(record, indent=2, sort_keys=True, default=str))
