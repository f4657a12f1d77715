"""Every `appliance` command line in the README, the gotchas, the ADRs and docs/ parses as written,
and says it in the current grammar; so does every mention in what the appliance writes and says.

A line in a code block is a command an operator pastes: click parses it whole (the command path,
every option, every argument), the way it would before running. An inline mention (`appliance
instance doctor 31b` in a sentence, or a synopsis such as `canary compare BEFORE AFTER [--profile
P]`) must name a real command, and each of its options must be one that command has. None may be
an old spelling (cli/aliases.py) or a hidden synonym (`--instance`): the docs, the appliance's
source (its messages, fixes, help and comments), the templates it writes on every host and the
committed examples under systemd/ all name the current form. The endpoint commands are run for
real on an installed instance in tests/test_endpoint.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from appliance.cli import COMMANDS, cli
from appliance.cli.aliases import OLD, match

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
    """The command ``words`` name and the words left for it, found as click finds it."""
    cmd, ctx = cli, cli.make_context("appliance", [], resilient_parsing=True)
    while isinstance(cmd, click.Group) and words:
        name, sub, rest = cmd.resolve_command(ctx, words)
        if sub is None and words[0].startswith("-"):
            break  # the group's own option (--version, --help)
        assert sub is not None, f"no command {words[0]!r} under {ctx.command_path!r}"
        assert not sub.hidden, f"{ctx.command_path} {name} is hidden"
        cmd, words = sub, rest
        ctx = click.Context(cmd, info_name=name, parent=ctx, resilient_parsing=True)
    return cmd, words, ctx


def _current(words: list[str]) -> list[str]:
    """``words`` themselves when they are the current grammar; an old spelling fails, naming
    its new form (a shortcut kept without a removal, the README's `appliance demo`, is read as
    what it runs)."""
    found = match(words)
    if found is None:
        return words
    entry, new_words, old, new = found
    assert entry.removed_in is None, f"`appliance {old}` is an old spelling of `appliance {new}`"
    return new_words


def _named_options(cmd: click.Command, rest: list[str]) -> set[str]:
    """The options ``rest`` names, each one ``cmd`` shows (not a hidden synonym)."""
    shown = {o for p in cmd.params if not getattr(p, "hidden", False) for o in p.opts}
    shown |= {o for p in cmd.params for o in p.secondary_opts} | {"--help", "-h"}
    named = {w.strip("[]").split("=")[0] for w in rest if w.strip("[]").startswith("-")}
    return named - shown


LINES = _lines()


def test_the_docs_hold_commands_to_check():
    assert sum(block for _, _, block in LINES) >= 10 and len(LINES) >= 50


@pytest.mark.parametrize(("doc", "line", "block"), LINES, ids=[f"{d}:{ln}" for d, ln, _ in LINES])
def test_a_documented_command_line_parses(doc, line, block):
    words = _current(_words(line))
    cmd, rest, ctx = _command(words)
    if block:
        # The whole line, as the shell hands it over (NAME and the other placeholders included).
        cmd.make_context(cmd.name, rest, parent=ctx.parent)
    unshown = _named_options(cmd, rest)
    assert not unshown, f"{doc}: `{line}`: {sorted(unshown)} not shown options of {cmd.name}"


# --- what the appliance writes and says -----------------------------------------------------------

# Every file the appliance ships or writes, and the committed examples of what it writes; the
# table of old spellings is the one place that names them.
SOURCES = [
    p
    for p in sorted([*(REPO / "appliance").rglob("*"), *(REPO / "systemd").rglob("*")])
    if p.is_file()
    and p.suffix
    in (
        ".py",
        ".j2",
        ".toml",
        ".md",
        ".service",
        ".timer",
        ".conf",
        ".env",
        ".args",
        ".sh",
        ".yml",
        ".yaml",
        ".json",
        "",
    )
    and "__pycache__" not in p.parts
    and p != REPO / "appliance/cli/aliases.py"
]
# `appliance WORDS`: the words of a command line, up to what ends one in prose or code.
MENTION = re.compile(r"\bappliance((?: +[^\s`'\"()|;,{}<>\\]+)+)")
FIRST = set(COMMANDS) | {entry.words[0] for entry in OLD}


def _mentions() -> list[tuple[str, str]]:
    """(file:line, `appliance ...`) for each mention of a command in :data:`SOURCES`."""
    out = []
    for path in SOURCES:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in MENTION.finditer(line):
                words = [w.rstrip(":.,") for w in m.group(1).split()]
                if words[0] in FIRST:
                    out.append((f"{path.relative_to(REPO)}:{n}", " ".join(words)))
    return out


MENTIONS = _mentions()


def test_the_appliance_mentions_commands_to_check():
    assert len(MENTIONS) >= 100, len(MENTIONS)
    assert any(where.startswith("systemd/") for where, _ in MENTIONS)
    assert any(where.endswith(".j2:" + where.split(":")[-1]) for where, _ in MENTIONS)


@pytest.mark.parametrize(("where", "mention"), MENTIONS, ids=[w for w, _ in MENTIONS])
def test_what_the_appliance_writes_and_says_names_the_current_command(where, mention):
    words = _current(mention.split())
    cmd, ctx = cli, click.Context(cli, info_name="appliance")
    while isinstance(cmd, click.Group) and words:
        sub = cmd.get_command(ctx, words[0])
        if sub is None:
            return  # prose goes on after a group's name ("the appliance instance name")
        assert not sub.hidden, f"{where}: `appliance {mention}`: {words[0]} is hidden"
        cmd, words, ctx = sub, words[1:], click.Context(sub, info_name=words[0], parent=ctx)
    rest = words
    unshown = _named_options(cmd, rest)
    assert not unshown, f"{where}: `appliance {mention}`: {sorted(unshown)} not shown options"


# --- the indexes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["gotchas", "adr"])
def test_every_page_is_listed_in_its_folders_index_and_every_link_is_a_page(folder):
    """A page the index does not list is one nobody finds (two gotchas went unlisted)."""
    linked = set(re.findall(r"\]\(([^)#/]+\.md)\)", (REPO / folder / "README.md").read_text()))
    pages = {p.name for p in (REPO / folder).glob("*.md")} - {"README.md"}
    assert (sorted(pages - linked), sorted(linked - pages)) == ([], [])
