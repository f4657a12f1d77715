"""The one generator of every committed generated file, and its drift check.

Each :class:`Source` produces its files as ``{repository path: GeneratedFile}`` and names the
folders it owns. :func:`generate` writes what is stale or missing; :func:`check` writes nothing
and lists every problem: a file that is stale, missing, has the wrong executable bit, or sits in
an owned folder without being produced (a hand-made or renamed file). ``appliance dev generate``
runs the first and fails on any problem left; ``appliance dev generate --check`` runs the second
(the test suite calls it), so a committed file and its generator never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import ApplianceError, UsageError
from ..fsutil import write_atomic

COMMAND = "appliance dev generate"
FIX = f"run: {COMMAND}"
PROJECT = 'name = "gemma4-appliance"'  # the line of pyproject.toml that marks a checkout
# Written by hand beside generated files, in any owned folder.
HAND_WRITTEN = frozenset({"README.md"})


class StaleError(ApplianceError):
    """Generated files differ from what the code produces."""


@dataclass(frozen=True)
class GeneratedFile:
    """One generated file: its exact text and whether it is executable."""

    content: str
    executable: bool = False

    @property
    def mode(self) -> int:
        return 0o755 if self.executable else 0o644


@dataclass(frozen=True)
class Source:
    """A producer of generated files and the folders whose every file it must produce."""

    name: str
    files: Callable[[], dict[str, GeneratedFile]]
    folders: tuple[str, ...]
    # Problems the producer itself finds (e.g. a recorded series nobody defines).
    problems: Callable[[], list[str]] = list
    # Called after its files were written: a later source may read them (the shipped profiles
    # are read once per process, and the units examples are rendered from them).
    written: Callable[[], None] = lambda: None


@dataclass
class Result:
    """What :func:`generate` wrote and what is still wrong, by repository path."""

    written: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def sources() -> list[Source]:
    """Every source of generated files in the repository."""
    from .. import profiles
    from ..multinode import examples as group_examples
    from ..observability import generate as observability
    from ..profiles import generated as profile_files
    from ..units import examples

    return [
        Source(
            "profiles",
            lambda: {p: GeneratedFile(t) for p, t in profile_files.outputs().items()},
            (profile_files.FOLDER,),
            written=profiles.reload,
        ),
        Source(
            "observability",
            lambda: {p: GeneratedFile(t) for p, t in observability.outputs().items()},
            observability.FOLDERS,
            observability.problems,
        ),
        Source(
            "units",
            lambda: {
                p: GeneratedFile(f.content, bool(f.mode & 0o100))
                for p, f in {
                    **examples.example_files(),
                    **group_examples.example_files(),
                }.items()
            },
            examples.FOLDERS,
        ),
    ]


def _state(path: Path, want: GeneratedFile) -> str | None:
    """Why ``path`` does not hold ``want`` (None when it does)."""
    try:
        current = path.read_text()
    except FileNotFoundError:
        return "missing"
    except (OSError, UnicodeDecodeError):
        return "unreadable"
    if current != want.content:
        return "out of date (edited by hand, or the code changed)"
    # git records only the executable bit; the rest is the checkout's umask.
    if bool(path.stat().st_mode & 0o100) != want.executable:
        return "should be executable" if want.executable else "should not be executable"
    return None


def _strays(repo: Path, src: Source, produced: dict[str, GeneratedFile]) -> list[str]:
    out = []
    for folder in src.folders:
        for path in sorted((repo / folder).glob("*")):
            rel = path.relative_to(repo).as_posix()
            if path.is_file() and rel not in produced and path.name not in HAND_WRITTEN:
                out.append(f"{rel}: not produced by {COMMAND} (remove it, or add it to the code)")
    return out


def require_checkout(repo: Path) -> None:
    """Refuse a folder that is not a checkout of this repository (its pyproject.toml): run
    anywhere else, generate would scatter the repository's folders into it."""
    try:
        ours = PROJECT in (repo / "pyproject.toml").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        ours = False
    if not ours:
        raise UsageError(
            f"{repo.resolve()} is not a checkout of the appliance (no pyproject.toml naming "
            "gemma4-appliance)",
            fix="run it at the repository's top, or give --repo",
        )


def _run(repo: Path, *, write: bool, only: list[Source] | None) -> Result:
    repo = Path(repo)
    require_checkout(repo)
    result = Result()
    for src in only if only is not None else sources():
        produced = src.files()
        wrote = False
        for rel, want in sorted(produced.items()):
            why = _state(repo / rel, want)
            if why is None:
                continue
            if write:
                write_atomic(repo / PurePosixPath(rel), want.content, mode=want.mode)
                result.written.append(rel)
                wrote = True
            else:
                result.problems.append(f"{rel}: {why}")
        if wrote:
            src.written()
        result.problems += _strays(repo, src, produced)
        result.problems += src.problems()
    return result


def generate(repo: Path | str, only: list[Source] | None = None) -> Result:
    """Write every stale or missing generated file under ``repo``; list what is still wrong."""
    return _run(Path(repo), write=True, only=only)


def check(repo: Path | str, only: list[Source] | None = None) -> list[str]:
    """Every problem with the generated files under ``repo``; writes nothing."""
    return _run(Path(repo), write=False, only=only).problems


def require_current(repo: Path | str) -> None:
    """Raise :class:`StaleError` naming every problem, with the command that fixes it."""
    problems = check(repo)
    if problems:
        raise StaleError(
            f"{len(problems)} generated file problem(s): " + "; ".join(problems), fix=FIX
        )
