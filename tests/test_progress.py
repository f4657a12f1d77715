"""Long work says what it is doing (issue 56 §3): a bar that says what and how much on a
terminal, plain lines in a pipe or the journal, nothing under ``-q``; error lines carry their
journal priority when stderr is the journal's stream."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugins.http_servers import Route

from appliance import progress
from appliance.host.layout import Layout


class Terminal(io.StringIO):
    """A stream that says it is a terminal (what tqdm draws on)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _normal():
    progress.set_verbosity(progress.NORMAL)
    yield
    progress.set_verbosity(progress.NORMAL)


def test_a_terminal_gets_a_bar_that_says_what_and_how_much():
    out = Terminal()
    with progress.meter("saving gemma4-vllm:0.32.0-mtp", 2_940_000_000, out) as m:
        assert m.mode == "bar"
        m.update(1_200_000_000)
    text = out.getvalue()
    assert "saving gemma4-vllm:0.32.0-mtp" in text
    assert "1.20G/2.94G" in text  # tqdm's bytes, in the CLI's decimal GB
    assert "\r" in text  # redrawn in place


def test_a_pipe_gets_plain_lines_a_log_keeps():
    out = io.StringIO()
    m = progress.Meter("hashing the cached files of target org/model", 2_000_000_000, out)
    m.every = 0.0  # a line at every update, not every 10 s
    m.update(500_000_000)
    m.update(500_000_000)
    m.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "hashing the cached files of target org/model: 2.00 GB"
    assert lines[1].startswith(
        "hashing the cached files of target org/model: 0.50 of 2.00 GB (25%), "
    )
    assert lines[2].startswith(
        "hashing the cached files of target org/model: 1.00 of 2.00 GB (50%), "
    )
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_pipe_gets_a_line_only_every_ten_seconds():
    out = io.StringIO()
    with progress.meter("loading x.tar into the engine", 10_000_000, out) as m:
        for _ in range(100):
            m.update(100_000)
    assert out.getvalue() == "loading x.tar into the engine: 10.0 MB\n"


def test_quiet_prints_nothing_and_line_keeps_only_warnings_and_errors():
    progress.set_verbosity(progress.QUIET)
    for stream in (io.StringIO(), Terminal()):
        with progress.meter("saving x", 100, stream) as m:
            m.update(100)
        progress.line("target org/model@main: downloading", stream=stream)
        progress.line("a warning", "warning", stream=stream)
        assert stream.getvalue() == "a warning\n"


def test_the_journal_prefix_only_on_the_journal_stream(tmp_path, monkeypatch):
    path = tmp_path / "stderr"
    with path.open("w") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        progress.line("the model folder is not there", "error", stream=f)
        progress.line("no API key file", "warning", stream=f)
        progress.line("downloading", stream=f)
        with (tmp_path / "other").open("w") as other:  # a redirect below the unit
            progress.line("not the journal", "error", stream=other)
    assert path.read_text().splitlines() == [
        "<3>the model folder is not there",
        "<4>no API key file",
        "<6>downloading",
    ]
    assert (tmp_path / "other").read_text() == "not the journal\n"


def _appliance(args: list[str], stderr_path: Path, journal: bool) -> tuple[int, str]:
    env = dict(os.environ)
    env.pop("JOURNAL_STREAM", None)
    with stderr_path.open("w") as err:
        if journal:
            st = os.fstat(err.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        proc = subprocess.run(  # noqa: PLW1510 - the exit code is returned
            [str(Path(sys.executable).parent / "appliance"), *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            timeout=60,
        )
    return proc.returncode, stderr_path.read_text()


def test_the_cli_error_line_is_an_error_in_the_journal_and_plain_elsewhere(tmp_path):
    args = ["profiles", "show", "no-such-profile"]
    code, text = _appliance(args, tmp_path / "journal", journal=True)
    assert code == 2 and text.startswith("<3>Error: "), text
    code, text = _appliance(args, tmp_path / "file", journal=False)
    assert code == 2 and text.startswith("Error: "), text


def test_a_cli_warning_line_is_a_warning_in_the_journal(tmp_path):
    """An old spelling's warning, then the command's refusal: each at its priority (E11)."""
    args = ["doctor", "--url", "http://me:s3cret@127.0.0.1:8000"]
    code, text = _appliance(args, tmp_path / "journal", journal=True)
    warning, error = text.splitlines()
    assert code == 2 and warning.startswith("<4>warning: `appliance doctor` is now "), text
    assert error.startswith("<3>Error: "), text


def test_the_serve_programs_refusal_is_an_error_in_the_journal(tmp_path, monkeypatch):
    """E11: the unit's exit-78 reason was logged at info, invisible to ``journalctl -p err``.
    Here the instance has no args file (never installed under this root)."""
    from appliance.serve.main import main

    path = tmp_path / "journal"
    monkeypatch.setenv("APPLIANCE_ROOT", str(tmp_path))
    with path.open("w") as journal:
        st = os.fstat(journal.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        monkeypatch.setattr(sys, "stderr", journal)
        code = main(["31b", "print"])
    lines = path.read_text().splitlines()
    assert code == 78
    assert len(lines) == 1 and lines[0].startswith("<3>gemma4-vllm@31b: "), lines


# --- the top level's -q and -v (ecosystem review E10) ---------------------------------------------


def test_the_state_timers_run_prints_nothing_when_it_writes(tmp_path, cli_run):
    """gemma4-appliance-state.timer runs `status --write-metrics -q` every minute: a `wrote` line
    on each success was 1440 journal lines a day. The top level's -q is the same flag, and
    without either the write is said."""
    root = str(tmp_path)
    cli_run(["instance", "install", "a1", "-p", "cpu-tiny-mtp", "--root", root])
    textfile = Layout(tmp_path).metrics_textfile()
    for argv in (
        ["status", "--write-metrics", "-q", "--root", root],  # the unit's ExecStart
        ["status", "--write-metrics", "--quiet", "--root", root],
        ["-q", "status", "--write-metrics", "--root", root],
    ):
        textfile.unlink(missing_ok=True)
        res = cli_run(argv)
        assert (res.stdout, res.stderr) == ("", ""), argv
        assert 'instance="a1"' in textfile.read_text()
    said = cli_run(["status", "--write-metrics", "--root", root], code=None)
    assert f"wrote {textfile}\n" in said.stdout


def test_the_timers_run_still_says_a_warning_on_stderr(tmp_path, cli_run):
    root = str(tmp_path)
    cli_run(["instance", "install", "a1", "-p", "cpu-tiny-mtp", "--root", root])
    with Layout(tmp_path).env_file("a1").open("a") as f:
        f.write('EXTRA="a\\b"\n')  # systemd reads it; the appliance refuses it
    res = cli_run(["-q", "status", "--write-metrics", "--root", root])
    assert res.stdout == ""
    [warning] = res.stderr.splitlines()
    assert warning.startswith("warning: a1: marked "), warning


def test_status_q_alone_is_the_report_without_chatter(tmp_path, cli_run):
    """-q means results and errors only, wherever it is given: the report is status's result."""
    root = str(tmp_path)
    cli_run(["instance", "install", "a1", "-p", "cpu-tiny-mtp", "--root", root])
    plain = cli_run(["status", "--root", root], code=None)
    for argv in (["status", "-q", "--root", root], ["-q", "status", "--root", root]):
        res = cli_run(argv, code=None)
        assert (res.exit_code, res.stdout) == (plain.exit_code, plain.stdout), argv


def _doctor_lines(res) -> dict[str, str]:
    return {ln.split(":", 1)[0].split()[1]: ln for ln in res.stdout.splitlines()[:-1]}


def test_doctor_shows_a_passed_checks_evidence_only_with_v(routed_http_server, cli_run):
    """A warning's and a failure's evidence always (the why); a passed check's only with -v,
    and all of it in --json either way."""
    url = routed_http_server(
        {
            "/health": Route(200, b""),
            "/version": Route(200, b'{"version": "0.32.0"}'),
            "/v1/models": Route(200, b'{"data": [{"id": "m", "max_model_len": 8}]}'),
        }
    )
    argv = ["instance", "doctor", "--url", url, "--no-generate"]
    plain = _doctor_lines(cli_run(argv, code=None))
    verbose = _doctor_lines(cli_run(["-v", *argv], code=None))
    assert plain.keys() == verbose.keys()
    reachable = plain["engine.reachable"]
    assert reachable.startswith("OK ") and "[" not in reachable, reachable
    assert verbose["engine.reachable"] == f"{reachable} [url={url}]"
    failed = [name for name, ln in plain.items() if not ln.startswith("OK ")]
    assert failed, plain  # /metrics is not served: the MTP checks do not pass
    for name in failed:
        assert plain[name] == verbose[name], name
    as_json = json.loads(cli_run([*argv, "--json"], code=None).stdout)
    ok = next(c for c in as_json["checks"] if c["name"] == "engine.reachable")
    assert ok["evidence"]["url"] == url


def test_q_and_v_together_are_refused(cli_run):
    res = cli_run(["-q", "-v", "profiles", "list"], code=2)
    assert res.stderr == "Error: -q and -v together (give one of them)\n"


def test_a_commands_verbosity_ends_with_it(tmp_path, cli_run):
    """The tests' CliRunner and any caller running several commands in one process: each starts
    from its own flags, and the process's verbosity is put back."""
    cli_run(["-q", "status", "--root", str(tmp_path)], code=None)
    assert progress.verbosity() == progress.NORMAL
    cli_run(["-v", "status", "--root", str(tmp_path)], code=None)
    assert progress.verbosity() == progress.NORMAL
