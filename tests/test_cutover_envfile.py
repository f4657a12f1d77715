"""The env file: one parser with one rule (what systemd could read otherwise is refused), one
assignment changes while every other byte stays, and a kill never leaves half."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.errors import UsageError
from appliance.fsutil import write_atomic
from appliance.host import envfile
from appliance.host.layout import Layout

SEED_LIKE = (
    b"# gemma4-vllm@31b: written by appliance install\n"
    b"VLLM_IMAGE=gemma4-vllm:pre-mtp\n"
    b"APPLIANCE_PROFILE=l4x4-31b-mtp\n"
    b"  # operator note, indented\n"
    b"HF_HOME='/data/hf cache'\n"
)


def test_set_value_changes_only_the_image_line():
    new = envfile.set_value(SEED_LIKE, "VLLM_IMAGE", "gemma4-vllm:0.21.0-mtp")
    assert new == SEED_LIKE.replace(b"gemma4-vllm:pre-mtp", b"gemma4-vllm:0.21.0-mtp")
    parsed = envfile.EnvFile(Path("x.env"), new)
    assert parsed.get("VLLM_IMAGE") == "gemma4-vllm:0.21.0-mtp"
    assert parsed.get("HF_HOME") == "/data/hf cache"


def test_set_value_keeps_crlf_missing_newline_and_replaces_the_last_assignment():
    raw = b"VLLM_IMAGE=a:1\r\nX=1\r\nVLLM_IMAGE=b:2"  # systemd uses the last assignment
    new = envfile.set_value(raw, "VLLM_IMAGE", "c:3")
    assert new == b"VLLM_IMAGE=a:1\r\nX=1\r\nVLLM_IMAGE=c:3"
    assert envfile.EnvFile(Path("x"), new).get("VLLM_IMAGE") == "c:3"


def test_set_value_appends_when_absent():
    assert envfile.set_value(b"A=1", "VLLM_IMAGE", "x:1") == b"A=1\nVLLM_IMAGE=x:1\n"
    assert envfile.set_value(b"", "VLLM_IMAGE", "x:1") == b"VLLM_IMAGE=x:1\n"


def test_set_value_refuses_a_multiline_value():
    with pytest.raises(UsageError, match="one line"):
        envfile.set_value(SEED_LIKE, "VLLM_IMAGE", "x:1\nEVIL=1")


_line = st.text(
    alphabet=st.characters(blacklist_characters="\n\r\0", codec="utf-8"), max_size=40
).filter(lambda s: "VLLM_IMAGE" not in s)


@given(before=st.lists(_line, max_size=6), after=st.lists(_line, max_size=6))
def test_every_other_line_is_preserved_byte_for_byte(before, after):
    raw = "\n".join([*before, "VLLM_IMAGE=old:1", *after]).encode()
    new = envfile.set_value(raw, "VLLM_IMAGE", "new:2")
    assert new == "\n".join([*before, "VLLM_IMAGE=new:2", *after]).encode()


def test_an_edit_written_atomically_keeps_the_mode_and_reads_back(tmp_path):
    path = tmp_path / "etc" / "i.env"
    path.parent.mkdir()
    path.write_bytes(SEED_LIKE)
    path.chmod(0o600)
    new = envfile.read(path).with_value(envfile.IMAGE_KEY, "gemma4-vllm:mtp")
    write_atomic(path, new)
    assert path.read_bytes() == new
    assert envfile.read(path).get(envfile.IMAGE_KEY) == "gemma4-vllm:mtp"
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["i.env"]  # no temp file left


@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives a file to another owner")
def test_root_keeps_the_owner_of_another_users_file(tmp_path):
    """The writer chowns only a file another user owns: a unit's seccomp filter refuses every
    chown (tests/test_bare_host_systemd.py runs the state timer's second tick under it)."""
    theirs = tmp_path / "theirs.json"
    theirs.write_text("{}")
    os.chown(theirs, 472, 0)
    write_atomic(theirs, "[]")
    assert (theirs.stat().st_uid, theirs.stat().st_gid, theirs.read_text()) == (472, 0, "[]")
    ours = tmp_path / "ours.json"
    ours.write_text("{}")
    write_atomic(ours, "[]")
    assert (ours.stat().st_uid, ours.stat().st_gid) == (os.geteuid(), os.getegid())


# --- the one rule ---------------------------------------------------------------------------


BOTH_READ = (
    b"# a back\\slash inside a comment is harmless\n"
    b"; also a comment\n"
    b"\n"
    b"  A = 1  \n"
    b"B='two words'\n"
    b'C="x:1"\r\n'
    b"D=\n"
    b"E=a # not a comment in systemd either\n"
    b"A=last wins"
)
BOTH_READ_VALUES = {
    "A": "last wins",
    "B": "two words",
    "C": "x:1",
    "D": "",
    "E": "a # not a comment in systemd either",
}


def test_the_values_systemd_and_the_appliance_both_read():
    """What systemd itself reads from the same bytes: test_systemd_reads_..._as_the_appliance_does
    below, in the systemd tier."""
    assert envfile.parse(BOTH_READ) == BOTH_READ_VALUES


AMBIGUOUS = [
    # systemd < 254 joins the next line to a comment ending in a backslash (M9).
    (b"VLLM_IMAGE=a\n# note \\\nVLLM_IMAGE=b\n", 2, "comment ending in a backslash"),
    (b"VLLM_IMAGE=a\\\nb\n", 1, "could read this line differently"),  # continuation
    (b'VLLM_IMAGE="a"b\n', 1, "could read this line differently"),  # concatenation
    (b"VLLM_IMAGE=a'b'\n", 1, "could read this line differently"),
    (b'VLLM_IMAGE="a\nb"\n', 1, "could read this line differently"),  # multi-line quote
    (b'X="a\\"b"\n', 1, "could read this line differently"),  # an escaped quote
    (b"export VLLM_IMAGE=a\n", 1, "could read this line differently"),
    (b"VLLM_IMAGE\n", 1, "could read this line differently"),
    (b"1X=a\n", 1, "could read this line differently"),
    (b"X=\xff\n", 1, "not UTF-8"),
]


@pytest.mark.parametrize(("raw", "line", "why"), AMBIGUOUS)
def test_a_line_systemd_could_read_differently_is_refused_naming_it(raw, line, why):
    with pytest.raises(envfile.EnvFileSyntaxError, match=re.escape(f"x.env:{line}: ") + ".*" + why):
        envfile.parse(raw, "x.env")


def _systemd_reads(machine, raw: bytes) -> dict[str, str] | None:
    """The environment systemd gives a oneshot whose EnvironmentFile= holds ``raw``, less what
    systemd sets itself; None when systemd refuses the file (the unit does not start)."""
    (machine.root / "etc/envcheck.env").write_bytes(raw)
    machine.run("rm", "-f", "/run/envcheck.out")
    started = machine.systemctl("start", "envcheck.service", check=False)
    if started.returncode != 0:
        result = machine.systemctl("show", "-p", "Result", "--value", "envcheck.service")
        assert result.stdout.strip() == "resources", (raw, result.stdout, started.stderr)
        machine.systemctl("reset-failed", "envcheck.service")
        return None
    out = machine.run("cat", "/run/envcheck.out").stdout
    own = {"PATH", "INVOCATION_ID", "SYSTEMD_EXEC_PID", "LANG", "JOURNAL_STREAM"}
    pairs = (item.split("=", 1) for item in out.split("\0") if item)
    return {k: v for k, v in pairs if k not in own}


ENVCHECK_UNIT = """\
[Service]
Type=oneshot
EnvironmentFile=/etc/envcheck.env
ExecStart=/usr/bin/env -0
StandardOutput=truncate:/run/envcheck.out
"""


# Refused lines that systemd 252 reads as their plain ``KEY=rest of the line``: the refusal is
# for the other readers of the file (a shell reads ``ab``) and for other systemd releases.
PLAIN_TO_SYSTEMD_252 = {b"VLLM_IMAGE=a'b'\n", b"VLLM_IMAGE\n"}


@pytest.mark.systemd
def test_systemd_reads_the_env_file_as_the_appliance_does(systemd_instance):
    """Real systemd (252, in the session's booted machine) reads the one rule's values as the
    appliance does; each line the appliance refuses it reads as something else than the plain
    ``KEY=rest of the line`` (or refuses the whole file), but for PLAIN_TO_SYSTEMD_252."""
    m = systemd_instance.machine
    m.write("/etc/systemd/system/envcheck.service", ENVCHECK_UNIT)
    m.daemon_reload()
    try:
        assert _systemd_reads(m, BOTH_READ) == BOTH_READ_VALUES
        for raw, _line, _why in AMBIGUOUS:
            plain = dict(
                line.split("=", 1)
                for line in raw.decode(errors="replace").splitlines()
                if "=" in line and not line.startswith("#")
            )
            read = _systemd_reads(m, raw)
            assert (read == plain) == (raw in PLAIN_TO_SYSTEMD_252), (raw, read, plain)
    finally:
        (m.root / "etc/systemd/system/envcheck.service").unlink()
        (m.root / "etc/envcheck.env").unlink(missing_ok=True)
        m.daemon_reload()


def test_set_value_refuses_a_value_that_would_not_read_back():
    for value in ('a"b', "a\\b", "'a", "x:1\nEVIL=1"):
        with pytest.raises(UsageError):
            envfile.set_value(SEED_LIKE, "VLLM_IMAGE", value)


def test_read_missing_file_is_the_unknown_instance_refusal(tmp_path):
    with pytest.raises(envfile.EnvFileError, match="no instance nope: no .*instance install") as e:
        envfile.read(tmp_path / "nope.env")
    assert e.value.exit_code == 2


# A writer that alternates two large contents through the real atomic path as fast as it can.
_WRITER = """
import sys
from pathlib import Path
from appliance.fsutil import write_atomic
path, a, b = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes(), Path(sys.argv[3]).read_bytes()
print("go", flush=True)
while True:
    write_atomic(path, b)
    write_atomic(path, a)
"""


def _stopped_inside_a_write(proc: subprocess.Popen, directory: Path, name: str) -> Path:
    """Stop ``proc`` (SIGSTOP) at a moment its temporary file exists, i.e. inside a write;
    returns that file. The writer spends most of its time inside one, so few tries are needed;
    which try lands is the host's timing, never the outcome."""
    for _ in range(10_000):
        os.kill(proc.pid, signal.SIGSTOP)
        tmp = list(directory.glob(f".{name}.{proc.pid}.*.tmp"))
        if tmp:
            return tmp[0]
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.001)
    raise AssertionError("the writer was never stopped inside a write")


def test_sigkill_mid_write_leaves_old_or_new_never_part(tmp_path):
    # Large contents: each write takes a while, and the writer does nothing else.
    a = SEED_LIKE + b"# padding A\n" * 400_000
    b = envfile.set_value(a, "VLLM_IMAGE", "gemma4-vllm:0.32.0-mtp") + b"# padding B\n" * 10
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    target = tmp_path / "etc" / "i.env"
    target.parent.mkdir()
    target.write_bytes(a)

    for i in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(target), str(tmp_path / "a"), str(tmp_path / "b")],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert proc.stdout.readline() == b"go\n"
        time.sleep(0.01 * i)  # a different point of the write loop each time
        # The kill lands inside a write: the writer is stopped with its temporary file there.
        tmp = _stopped_inside_a_write(proc, target.parent, target.name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert tmp.exists(), f"kill {i}: the writer was not inside a write"
        got = target.read_bytes()
        assert got in (a, b), f"kill {i}: env file is partial ({len(got)} bytes)"
    # The killed writers' temporary files (full copies, secrets among them for a key file) go
    # with the next write of the file.
    write_atomic(target, a)
    assert sorted(p.name for p in target.parent.iterdir()) == ["i.env"]


@pytest.mark.parametrize("value", ["80x0", "0", "70000"])
def test_a_port_that_is_not_a_port_is_a_usage_error_naming_the_file(tmp_path, value, cli_run):
    env_path = Layout(tmp_path).env_file("i1")
    env_path.parent.mkdir(parents=True)
    env_path.write_text(
        "VLLM_IMAGE=gemma4-vllm:pre-mtp\nAPPLIANCE_PROFILE=cpu-tiny\nVLLM_HOST=127.0.0.1\n"
        f"VLLM_PORT={value}\n"
    )
    before = env_path.read_bytes()
    result = cli_run(["cutover", "i1", "gemma4-vllm:mtp", "--root", str(tmp_path)], code=2)
    assert f"Error: VLLM_PORT={value!r} in {env_path} is not a TCP port" in result.output
    assert "Traceback" not in result.output
    assert env_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["i1.env"]


def test_cutover_refuses_an_ambiguous_env_file_before_anything_is_touched(tmp_path, cli_run):
    """The M9 case: systemd 252 runs image a, a lax parser would read and rewrite b."""
    env_path = Layout(tmp_path).env_file("i1")
    env_path.parent.mkdir(parents=True)
    env_path.write_bytes(
        b"VLLM_IMAGE=gemma4-vllm:a\nAPPLIANCE_PROFILE=cpu-tiny\nVLLM_HOST=127.0.0.1\n"
        b"VLLM_PORT=8000\n# note \\\nVLLM_IMAGE=gemma4-vllm:b\n"
    )
    before = env_path.read_bytes()
    result = cli_run(["cutover", "i1", "gemma4-vllm:mtp", "--root", str(tmp_path)], code=2)
    assert f"Error: {env_path}:5: a comment ending in a backslash" in result.output
    assert env_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["i1.env"]


def test_status_of_an_env_file_it_cannot_use_is_not_serving_exit_1_whichever_line(
    tmp_path, cli_run
):
    """One code for an env file status cannot use (security review T7): a line the parser
    refuses, as a port that is not one, is shown as the instance's problem and exits 1 (not
    serving, README's table and status's help), never 2; status of all still lists the others."""
    layout = Layout(tmp_path)
    good = b"APPLIANCE_PROFILE=cpu-tiny\nVLLM_HOST=127.0.0.1\nVLLM_IMAGE=gemma4-vllm:pre-mtp\n"
    written = {
        "ambiguous": (
            good + b"VLLM_PORT=8000\n# note \\\nVLLM_IMAGE=gemma4-vllm:b\n",
            ":5: a comment ending in a backslash",
        ),
        "port": (good + b"VLLM_PORT=70000\n", "VLLM_PORT='70000' in"),
    }
    layout.env_dir.mkdir(parents=True)
    for name, (raw, _why) in written.items():
        layout.env_file(name).write_bytes(raw)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for name, (_raw, why) in written.items():
        result = cli_run(["status", name, "--root", str(tmp_path)], code=1)
        assert why in result.output and "Traceback" not in result.output, result.output
    result = cli_run(["status", "--json", "--root", str(tmp_path)], code=1)
    shown = {st["instance"]: st for st in json.loads(result.stdout)["instances"]}
    assert set(shown) == set(written)
    for name, (_raw, why) in written.items():
        assert why in shown[name]["instance_error"], shown[name]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
