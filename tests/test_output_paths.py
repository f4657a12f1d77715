"""A path nothing can be written to is one ``Error:`` line and a non-zero exit before any work,
never a traceback after it, and nothing is written (issue 45 §3, the newcomer review's D1).

The table is every command that writes a file or a folder the operator names, against the bad
outputs of the review: a place no file can be made (``/proc``, ``/sys``), an existing folder
where a file goes (or a file where a folder goes) and a file used as a folder. The endpoints are
a dead port: the path must be refused before any request is sent. The engine test at the end
is the review's own case: a real engine, where the old code measured first and then crashed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DEAD = "http://127.0.0.1:1"


def _commands(tmp: Path) -> list[tuple[list[str], str, bool]]:
    """(argv before the path, the option, whether it names a folder)."""
    inventory = tmp / "inventory.json"
    inventory.write_text(json.dumps({"_meta": {"hostvars": {}}, "all": {"children": []}}))
    root = ["--root", str(tmp / "host")]
    remote = ["--remote-write", "http://c:9090/api/v1/write"]
    return [
        (["bench", "run", "--url", DEAD, "--limit", "1", "--runs", "1"], "--out", False),
        (["bench", "run", "--url", DEAD, "--limit", "1", "--runs", "1"], "--report", False),
        (["canary", "record", "--url", DEAD], "--out", False),
        (
            ["bench", "tune", "--url", DEAD, "--profile", "cpu-tiny-mtp", "--baseline-url", DEAD],
            "--write",
            False,
        ),
        (["fleet", "scrape-config", "--host", "h", *remote], "--out", False),
        (["fleet", "snapshot", "a1", *root], "--out", False),
        (["fleet", "targets", str(inventory)], "--out", False),
        (["fleet", "targets", str(inventory)], "--state-out", False),
        (["canary", "record", "g1", *root], "--out", False),
        (["image", "save", "gemma4-vllm:mtp"], "--out", False),
        (["models", "export", "--profile", "l4x4-31b-mtp", *root], "--to", True),
        (["dev", "demo"], "--report", False),
        (["instance", "render", "a1", "-p", "cpu-tiny-mtp"], "--out", True),
        (["observability", "write"], "--out", True),
    ]


def _bad_paths(tmp: Path, folder: bool) -> list[Path]:
    a_file = tmp / "a-file"
    a_file.write_text("mine\n")
    a_folder = tmp / "a-folder"
    a_folder.mkdir(exist_ok=True)
    return [
        Path("/proc/nope/out"),
        Path("/sys/kernel/nope/out"),
        a_file if folder else a_folder,
        a_file / "out",
    ]


def _tree(tmp: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(tmp)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(tmp.rglob("*"))
    }


def _one_error_line(res) -> str | None:
    """What is wrong with one refused call, or None when it is as it should be."""
    if not isinstance(res.exception, SystemExit) or res.exit_code == 0:
        return f"exit {res.exit_code}, {type(res.exception).__name__}: {res.exception}"
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    if len(lines) != 1 or not lines[0].startswith("Error: "):
        return f"stderr {lines}"
    return None


def test_every_bad_output_is_one_line_a_non_zero_exit_and_nothing_written(tmp_path, cli_run):
    wrong = []
    for argv, option, folder in _commands(tmp_path):
        for path in _bad_paths(tmp_path, folder):
            before = _tree(tmp_path)
            res = cli_run([*argv, option, str(path)], code=None)
            problem = _one_error_line(res)
            if problem is None and str(path) not in res.stderr:
                problem = f"the line does not name {path}: {res.stderr.strip()}"
            if problem is None and _tree(tmp_path) != before:
                problem = "wrote " + ", ".join(sorted(set(_tree(tmp_path)) ^ set(before)))
            if problem:
                wrong.append(f"{' '.join(argv)} {option} {path}: {problem}")
    assert not wrong, "\n".join(wrong)


def test_an_os_error_anywhere_in_a_command_is_one_line_naming_the_path(tmp_path, cli_run):
    """Past the options, the host's own refusal (here: a --root no folder can be made in) is one
    line too, with exit 1: an OSError is the host's answer, not the appliance's bug."""
    for argv in (
        ["instance", "install", "a1", "--profile", "cpu-tiny-mtp", "--root", "/proc/nope"],
        ["status", "--write-metrics", "--quiet", "--root", "/proc/nope"],
    ):
        res = cli_run(argv, code=None)
        assert _one_error_line(res) is None, (argv, res.exception, res.output)
        assert "/proc/nope" in res.stderr, res.stderr


@pytest.mark.engine
def test_a_measurement_with_a_bad_output_is_refused_before_it_starts(mtp_engine, tmp_path, cli_run):
    """The review's D1 calls against a real engine: the old code ran the whole measurement, then
    ended in a FileNotFoundError traceback with nothing printed."""
    url = mtp_engine.url
    calls = [
        ["bench", "run", "--url", url, "--limit", "1", "--runs", "1", "--max-tokens", "8", "--out"],
        ["canary", "record", "--url", url, "--out"],
        ["bench", "tune", "--url", url, "--profile", "cpu-tiny-mtp", "--baseline-url", url]
        + ["--limit"]
        + ["1", "--concurrency", "1", "--requests", "1", "--write"],
    ]
    for argv in calls:
        res = cli_run([*argv, "/proc/nope/x.json"], code=None)
        assert _one_error_line(res) is None, (argv, res.exception, res.output)
        assert res.stdout == "", res.stdout  # refused before the progress bar and the figures
