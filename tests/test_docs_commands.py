"""Every `appliance` command line in the README, the gotchas, the ADRs and docs/ parses as written.

A line in a code block is a command an operator pastes: click parses it whole (the command path,
every option, every argument), the way it would before running. An inline mention (`appliance
doctor 31b` in a sentence, or a synopsis such as `canary compare BEFORE AFTER [--profile P]`) must
name a real command, and each of its options must be one that command has. The endpoint commands
are run for real on an installed instance in tests/test_endpoint.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from appliance.cli import cli

REPO = Path(__file__).resolve().parent.parent
DOCS = [
    REPO / "README.md",
    *(doc for folder in ("gotchas", "adr", "docs") for doc in sorted((REPO / folder).glob("*.md"))),
]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(appliance [^`]+)`")


def _words(line: str) -> list[str]:
    """The command's words: up to a comment or the next shell operator."""
    words = []
    for w in shlex.split(line, comments=True)[1:]:
        if w in ("&&", "||", "|", ";", ">"):
            break
        words.append(w)
    return words


def _lines() -> list[tuple[str, str, bool]]:
    """(file, command line, in a code block) for each appliance command in the docs."""
    out = []
    for doc in DOCS:
        name, text = str(doc.relative_to(REPO)), doc.read_text()
        blocks = [m.group(1) for m in FENCE.finditer(text)]
        for block in blocks:
            for line in block.splitlines():
                if line.strip().startswith("appliance "):
                    out.append((name, line.strip(), True))
        prose = FENCE.sub("", text)
        out += [(name, m.group(1), False) for m in INLINE.finditer(prose)]
    return out


def _command(words: list[str]) -> tuple[click.Command, list[str], click.Context]:
    """The command ``words`` name and the words left for it, found as click finds it (an old
    spelling a group still takes, such as ``bench --url X``, included)."""
    cmd, ctx = cli, cli.make_context("appliance", [], resilient_parsing=True)
    while isinstance(cmd, click.Group) and words:
        name, sub, rest = cmd.resolve_command(ctx, words)
        if sub is None and words[0].startswith("-"):
            break  # the group's own option (--version, --help)
        assert sub is not None, f"no command {words[0]!r} under {ctx.command_path!r}"
        cmd, words = sub, rest
        ctx = click.Context(cmd, info_name=name, parent=ctx, resilient_parsing=True)
    return cmd, words, ctx


LINES = _lines()


def test_the_docs_hold_commands_to_check():
    assert sum(block for _, _, block in LINES) >= 10 and len(LINES) >= 50


@pytest.mark.parametrize(("doc", "line", "block"), LINES, ids=[f"{d}:{ln}" for d, ln, _ in LINES])
def test_a_documented_command_line_parses(doc, line, block):
    words = _words(line)
    cmd, rest, ctx = _command(words)
    if block:
        # The whole line, as the shell hands it over (NAME and the other placeholders included).
        cmd.make_context(cmd.name, rest, parent=ctx.parent)
        return
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    named = {w.strip("[]").split("=")[0] for w in rest if w.strip("[]").startswith("-")}
    assert named <= known, f"{doc}: `{line}`: {sorted(named - known)} not options of {cmd.name}"
