"""The old spellings of commands: one table, each entry with the release that removes it.

An old command line still runs until then: it is rewritten to the current grammar before click
parses it, after one line on stderr naming the new form (scripts keep working while their
authors move). Nothing else in the CLI knows an old spelling; the doc-commands test refuses any
in the docs and in what the appliance writes and says (tests/test_docs_commands.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import progress

# The release that removes every old spelling below: they ran for one release (0.1.x).
NEXT = "0.2.0"

# An old line's words after the old command's own, rewritten: (the current words, the old form
# and the new one as the warning shows them), or None when the line is not that old form.
Rewrite = Callable[[list[str]], "tuple[list[str], str, str] | None"]


@dataclass(frozen=True)
class Old:
    """``appliance OLD ...`` runs as ``appliance NEW ...``."""

    old: str
    new: str
    removed_in: str | None = NEXT  # None: a shortcut kept, without a warning (README's demo)
    rewrite: Rewrite | None = None  # the rest of the line, where more than the words change

    @property
    def words(self) -> list[str]:
        return self.old.split()


def _options_with_values(rest: list[str], valued: set[str]) -> list[str]:
    """The positional words of ``rest``, skipping options and the values of ``valued`` ones."""
    out, skip = [], False
    for word in rest:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in valued  # --seed 1; --seed=1 carries its value
        else:
            out.append(word)
    return out


def _devmodel_build(rest: list[str]) -> tuple[list[str], str, str] | None:
    """``dev devmodel build DIR``: only with a DIR after it (``dev devmodel build`` alone is
    the current command given a directory named build)."""
    if not _options_with_values(rest, {"--drafter", "--seed"}):
        return None
    return ["dev", "devmodel", *rest], "dev devmodel build", "dev devmodel"


def _multinode_install(rest: list[str]) -> tuple[list[str], str, str] | None:
    """``multinode install --group G [--role R] [--rank N]`` is ``instance install G``, its role
    given (the old default was the head; a head has no rank)."""
    args, group, role, rank, profile = [], None, "head", None, "PROFILE"
    words = iter(rest)
    for word in words:
        name, eq, value = word.partition("=")
        if name in ("--group", "-g", "--role", "--rank", "--profile", "-p"):
            value = value if eq else next(words, "")
            if name in ("--group", "-g"):
                group = value
                continue
            if name == "--role":
                role = value
                continue
            if name == "--rank":
                rank = value
                continue
            profile = value
            args += ["--profile", value]
            continue
        args.append(word)
    if group is None:  # nothing to name the group: the current command says what is missing
        return ["instance", "install", *args], "multinode install", "instance install NAME"
    node = ["--role", role] + (["--rank", rank] if rank and role != "head" else [])
    new = f"instance install {group} --profile {profile} --role {role}"
    new += f" --rank {rank}" if rank and role != "head" else ""
    return (
        ["instance", "install", group, *args, *node],
        f"multinode install --group {group}",
        new,
    )


# The old single `appliance bench` command's modes, by the option that chose each (the first
# found wins), and how the old spelling reads now.
BENCH_MODES = (
    ("--sweep-k", "sweep", "bench --sweep-k K,K", "bench sweep --k K,K"),
    ("--mtp-url", "compare", "bench --mtp-url URL", "bench compare --mtp-url URL"),
    ("--baseline-url", "compare", "bench --baseline-url URL", "bench compare --baseline-url URL"),
    ("--concurrency", "load", "bench NAME --concurrency N", "bench load NAME --concurrency N"),
)
BENCH_SUBCOMMANDS = {"run", "compare", "sweep", "load", "tune"}


def _bench(rest: list[str]) -> tuple[list[str], str, str] | None:
    """``bench OPTIONS`` or ``bench NAME ...``, naming no subcommand: the one its options
    chose."""
    if not rest or rest[0] in BENCH_SUBCOMMANDS or rest[0] in ("--help", "-h"):
        return None
    given = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    for option, sub, old, new in BENCH_MODES:
        if option in given:
            if sub == "sweep":  # --sweep-k became sweep's --k
                rest = [
                    ("--k" + a[len(option) :]) if a.split("=")[0] == option else a for a in rest
                ]
            return ["bench", sub, *rest], old, new
    return ["bench", "run", *rest], "bench NAME", "bench run NAME"


OLD: tuple[Old, ...] = (
    Old("demo", "dev demo", removed_in=None),  # the README's first command, kept as written
    Old("devmodel build", "dev devmodel"),
    Old("dev devmodel build", "dev devmodel", rewrite=_devmodel_build),
    Old("doctor", "instance doctor"),
    Old("generate", "dev generate"),
    Old("install", "instance install"),
    Old("local serve", "dev serve"),
    Old("dev local serve", "dev serve"),
    Old("render", "instance render"),
    Old("tune", "bench tune"),
    Old("uninstall", "instance uninstall"),
    Old("multinode install", "instance install NAME --role ROLE", rewrite=_multinode_install),
    Old("multinode cutover", "cutover"),
    Old("multinode rollback", "rollback"),
    Old("multinode canary", "canary record"),
    Old("bench", "bench run|compare|sweep|load", rewrite=_bench),
)


def match(args: list[str]) -> tuple[Old, list[str], str, str] | None:
    """The entry an ``appliance ARGS`` line is the old spelling of (the longest that applies),
    the line in the current grammar, and the old and new forms; None for a current line."""
    for entry in sorted(OLD, key=lambda e: -len(e.words)):
        n = len(entry.words)
        if args[:n] != entry.words:
            continue
        rest = args[n:]
        if entry.rewrite is None:
            return entry, [*entry.new.split(), *rest], entry.old, entry.new
        found = entry.rewrite(rest)
        if found is not None:
            return entry, *found
    return None


def current(args: list[str], *, warn: bool = True) -> list[str]:
    """``args`` in the current grammar; an old spelling says its new form on stderr first.
    The top level's own options before the command (all flags: ``-q``) stay where they are."""
    lead = 0
    while lead < len(args) and args[lead].startswith("-"):
        lead += 1
    found = match(list(args[lead:]))
    if found is None:
        return list(args)
    entry, new_args, old, new = found
    new_args = [*args[:lead], *new_args]
    if warn and entry.removed_in:
        progress.line(
            f"warning: `appliance {old}` is now `appliance {new}` "
            f"(the old spelling goes in {entry.removed_in})",
            "warning",
        )
    return new_args
