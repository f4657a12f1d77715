"""A time limit is a finite number of seconds (review 2026-12-06 T5), fast tier.

click's FloatRange(min=1) let ``nan``, ``inf`` and ``1e400`` through: the deadline became NaN or
infinity, ``time.monotonic() >= deadline`` was never true, and a gate that never passed (and the
way back, which ignores signals meanwhile) waited until SIGKILL. Each is now refused as the
command line is parsed: one ``Error:`` line, exit 2, nothing written under the root.
"""

from __future__ import annotations

import pytest

BAD = ["nan", "NaN", "inf", "-inf", "1e400", "0", "-5", "0.5", "86401", "soon", ""]
COMMANDS = [
    ["cutover", "a1", "gemma4-vllm:0.32.0-mtp", "--timeout"],
    ["cutover", "a1", "gemma4-vllm:0.32.0-mtp", "--canary-timeout"],
    ["rollback", "a1", "--timeout"],
    ["instance", "cutover", "a1", "gemma4-vllm:0.32.0-mtp", "--timeout"],
]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:1] + a[-1:]))
def test_a_time_limit_that_is_no_finite_number_of_seconds_is_one_line(
    cli_run, tmp_path, argv, value
):
    res = cli_run([*argv, value, "--root", str(tmp_path)], code=2)
    option = argv[-1]
    assert res.output == (
        f"Error: {option} {value!r}: not a number of seconds from 1 to 86400\n"
    ), res.output
    assert list(tmp_path.iterdir()) == []  # refused before anything was read or written


@pytest.mark.parametrize("value", ["1", "30", " 90 ", "1e3", "86400"])
def test_a_finite_time_limit_passes_the_parser(cli_run, tmp_path, value):
    # Past the parser, the next refusal is the missing instance's: the value was taken.
    res = cli_run(["rollback", "a1", "--timeout", value, "--root", str(tmp_path)], code=2)
    assert res.output.startswith("Error: no instance a1:"), res.output
