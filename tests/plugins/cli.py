"""One way to run `appliance` in the test's own process: click's CliRunner with
``catch_exceptions=False`` (a crash is the test's traceback, never an exit code to read past),
and the exit code asserted where it is run (``code=None``: the test reads it itself)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from click.testing import CliRunner, Result

from appliance.cli import cli


def invoke(argv: Sequence[str], *, code: int | None = 0, **kwargs) -> Result:
    """``appliance ARGV`` (``kwargs``: CliRunner.invoke's ``env``, ``input``...); asserts the
    exit code is ``code``, with the output in the message."""
    res = CliRunner().invoke(
        cli, list(argv), catch_exceptions=False, prog_name="appliance", **kwargs
    )
    if code is not None:
        assert res.exit_code == code, f"exit {res.exit_code}, not {code}:\n{res.output}"
    return res


@pytest.fixture(scope="session")  # a function of no state: any fixture may use it
def cli_run() -> Callable[..., Result]:
    """:func:`invoke`: ``cli_run(["status", "--json"], code=1)``."""
    return invoke
