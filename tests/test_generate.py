"""The one generator: the committed files are current, and every kind of drift fails --check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from plugins.cli import invoke

from appliance.dev import generate as gen

REPO = Path(__file__).resolve().parents[1]


def run(*args: str):
    return invoke(list(args), code=None)


def _produced() -> dict[str, gen.GeneratedFile]:
    out: dict[str, gen.GeneratedFile] = {}
    for src in gen.sources():
        out.update(src.files())
    return out


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """A copy of the repository's generated folders, as committed."""
    folders = {f for src in gen.sources() for f in src.folders}
    folders |= {str(Path(rel).parent) for rel in _produced()}
    for folder in sorted(folders):
        if (REPO / folder).is_dir():
            shutil.copytree(REPO / folder, tmp_path / folder, dirs_exist_ok=True)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_committed_files_are_current() -> None:
    result = run("dev", "generate", "--check", "--repo", str(REPO))
    assert result.exit_code == 0, result.output
    assert "generated files are up to date" in result.output


def _sample() -> list[str]:
    """The first and the last generated file of each folder: every file goes through the same
    comparison (generate._state), and each hand-edit run checks and regenerates the whole
    repository (~1.5 s), so one run per generated profile (65 of them) would add minutes."""
    by_folder: dict[str, list[str]] = {}
    for rel in sorted(_produced()):
        by_folder.setdefault(str(Path(rel).parent), []).append(rel)
    return sorted({f for files in by_folder.values() for f in (files[0], files[-1])})


@pytest.mark.parametrize("rel", _sample())
def test_a_hand_edit_of_any_generated_file_fails_check_with_the_fix(
    repo_copy: Path, rel: str, cli_run
) -> None:
    path = repo_copy / rel
    path.write_text(path.read_text() + "# hand edit\n")
    result = cli_run(["dev", "generate", "--check", "--repo", str(repo_copy)], code=1)
    assert f"{rel}: out of date" in result.output
    assert "(run: appliance dev generate)" in result.output
    assert result.output.count("\n") == 1  # one line, no traceback
    # The fix named works: generate rewrites it, and the check passes again.
    assert run("dev", "generate", "--repo", str(repo_copy)).output.startswith(f"wrote {rel}")
    assert run("dev", "generate", "--check", "--repo", str(repo_copy)).exit_code == 0


def test_missing_and_stray_files_fail_check(repo_copy: Path, cli_run) -> None:
    produced = sorted(_produced())
    (repo_copy / produced[0]).unlink()
    src = gen.sources()[0]
    stray = repo_copy / src.folders[0] / "hand-made.json"
    stray.write_text("{}\n")
    problems = gen.check(repo_copy)
    assert f"{produced[0]}: missing" in problems
    assert any(p.startswith(f"{src.folders[0]}/hand-made.json: not produced") for p in problems)
    # generate restores what is missing, but a stray file is the operator's to remove: it fails.
    result = cli_run(["dev", "generate", "--repo", str(repo_copy)], code=1)
    assert f"wrote {produced[0]}" in result.output
    assert "hand-made.json: not produced by appliance dev generate (remove it" in result.output
    stray.unlink()
    assert gen.check(repo_copy) == []


def test_executable_bit_is_checked(repo_copy: Path) -> None:
    produced = _produced()
    rel = next(r for r, f in sorted(produced.items()) if not f.executable)
    (repo_copy / rel).chmod(0o755)
    assert gen.check(repo_copy) == [f"{rel}: should not be executable"]
    run("dev", "generate", "--repo", str(repo_copy))
    assert gen.check(repo_copy) == []


def test_generate_is_idempotent(repo_copy: Path) -> None:
    run("dev", "generate", "--repo", str(repo_copy))
    result = run("dev", "generate", "--repo", str(repo_copy))
    assert result.output == "nothing to write: up to date\n"


def test_a_producer_problem_fails_check(repo_copy: Path) -> None:
    broken = gen.Source("broken", dict, (), lambda: ["series x is used but not defined"])
    assert gen.check(repo_copy, only=[broken]) == ["series x is used but not defined"]


def test_outside_a_checkout_nothing_is_written(tmp_path: Path, cli_run) -> None:
    for args in ([], ["--check"]):
        res = cli_run(["dev", "generate", "--repo", str(tmp_path), *args], code=2)
        assert res.output == (
            f"Error: {tmp_path} is not a checkout of the appliance (no pyproject.toml naming "
            "gemma4-appliance) (run it at the repository's top, or give --repo)\n"
        )
    assert list(tmp_path.iterdir()) == []
