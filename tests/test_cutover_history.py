"""The append-only history: begin and end lines, crash-cut lines, interrupted cutovers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from appliance.cutover import history, slot
from appliance.cutover.history import Entry, Gate
from appliance.host.layout import Layout


def _done(e: Entry, outcome: str) -> Entry:
    e.outcome = outcome
    e.finished = e.started + 42
    e.gates = [Gate("unit", True, 0.1, "active"), Gate("health", outcome == "ok", 40.0, "x")]
    return e


def test_begin_and_end_lines_merge_into_one_entry(tmp_path):
    path = tmp_path / "history" / "h.jsonl"
    e = Entry.begin("i1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:mtp")
    history.append(path, e)
    history.append(path, _done(e, "ok"))
    assert len(path.read_text().splitlines()) == 2  # append-only: the begin line stays
    assert path.parent.stat().st_mode & 0o777 == 0o700  # its folder: root's alone
    [got] = history.entries(path)
    assert (got.outcome, got.from_image, got.to_image) == (
        "ok",
        "gemma4-vllm:pre-mtp",
        "gemma4-vllm:mtp",
    )
    assert got.gates[1] == Gate("health", True, 40.0, "x")


def test_a_begin_without_end_is_interrupted_unless_still_running(tmp_path):
    path = tmp_path / "h.jsonl"
    e = Entry.begin("i1", "cutover", "a:1", "b:2")
    history.append(path, e)
    assert history.entries(path)[0].outcome == "interrupted"
    assert history.entries(path, live_ids=frozenset({e.id}))[0].outcome == "started"


def test_a_line_cut_short_by_a_crash_is_skipped_and_the_next_starts_fresh(tmp_path):
    path = tmp_path / "h.jsonl"
    first = Entry.begin("i1", "cutover", "a:1", "b:2")
    history.append(path, _done(first, "rolled_back"))
    with open(path, "a") as f:
        f.write('{"id":"cut","instance":"i1","kind":"cut')  # what a kill mid-write leaves
    second = Entry.begin("i1", "rollback", "b:2", "a:1")
    history.append(path, _done(second, "ok"))
    assert [e.id for e in history.entries(path)] == [first.id, second.id]


def test_history_command_prints_entries_with_gate_timings(tmp_path, cli_run):
    layout = Layout(tmp_path)
    e = Entry.begin("i1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:mtp")
    history.append(layout.history_file("i1"), _done(e, "rolled_back"))
    result = cli_run(["history", "i1", "--root", str(tmp_path)])
    assert "cutover  rolled_back gemma4-vllm:pre-mtp -> gemma4-vllm:mtp  (42s)" in result.output
    assert "gates: unit ok 0.1s, health FAILED 40.0s" in result.output
    as_json = cli_run(["history", "i1", "--json", "--root", str(tmp_path)])
    [entry] = json.loads(as_json.output)["entries"]
    assert Entry.from_dict(entry).id == e.id


def test_cutover_and_rollback_json_is_the_entry_history_keeps(tmp_path, cli_run, monkeypatch):
    """--json where scripts act (ecosystem review E15): a cutover or rollback that passed
    prints the entry it closed, as `history --json` gives it, and nothing else on stdout. The
    move itself is replaced here by the entry it returns (the real moves, through systemd and
    Docker: test_cutover_systemd.py's rollback by image ID); a refusal stays one Error: line."""
    from appliance.cli import cutover as cli_cutover

    cut = _done(Entry.begin("i1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:mtp"), "ok")
    back = _done(Entry.begin("i1", "rollback", "gemma4-vllm:mtp", "gemma4-vllm:pre-mtp"), "ok")
    monkeypatch.setattr(cli_cutover.flow, "cutover", lambda *_a, **_k: cut)
    monkeypatch.setattr(cli_cutover.recovery, "rollback", lambda *_a, **_k: back)
    root = ["--root", str(tmp_path)]
    for argv, entry in ((["cutover", "i1", "gemma4-vllm:mtp"], cut), (["rollback", "i1"], back)):
        text = cli_run([*argv, *root])
        assert f"{entry.to_image} (was {entry.from_image}); gates passed" in text.stdout
        shown = json.loads(cli_run([*argv, *root, "--json"]).stdout)
        assert Entry.from_dict(shown) == entry
        assert shown["gates"][1] == {"name": "health", "ok": True, "seconds": 40.0, "detail": "x"}
    monkeypatch.undo()
    refused = cli_run(["rollback", "nosuch", *root, "--json"], code=2)
    assert refused.stdout == "" and refused.stderr.startswith("Error: no instance nosuch")


def test_history_of_an_invalid_instance_name_is_a_usage_error(tmp_path, cli_run):
    result = cli_run(["history", "../etc", "--root", str(tmp_path)], code=2)
    assert "invalid instance name '../etc'" in result.output


def test_history_and_status_of_an_unknown_instance_is_one_line_and_exit_2(tmp_path, cli_run):
    for argv in (["history", "nosuch"], ["status", "nosuch"]):
        result = cli_run([*argv, "--root", str(tmp_path)], code=2)
        assert result.output == (
            f"Error: no instance nosuch: no {tmp_path}/etc/gemma4-vllm/nosuch.env"
            " (`appliance status` lists the installed instances;"
            " `appliance instance install nosuch --profile PROFILE` installs it)\n"
        )


def test_history_of_an_installed_instance_without_cutovers_says_so(tmp_path, cli_run):
    env = Layout(tmp_path).env_file("fresh")
    env.parent.mkdir(parents=True)
    env.write_text("VLLM_IMAGE=gemma4-vllm:mtp\n")
    result = cli_run(["history", "fresh", "--root", str(tmp_path)])
    assert result.output == "fresh: no cutover or rollback yet\n"
    result = cli_run(["history", "fresh", "--json", "--root", str(tmp_path)])
    assert json.loads(result.output) == {"entries": []}


def test_status_json_is_one_object_with_each_instance_and_its_history(tmp_path, cli_run):
    from appliance import units
    from appliance.profiles import get

    for port, name in enumerate(("a1", "b2"), start=9):  # two instances never share a port
        units.install(get("cpu-tiny"), name, root=tmp_path, options=units.Options(port=port))
    e = Entry.begin("a1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:mtp")
    history.append(Layout(tmp_path).history_file("a1"), _done(e, "rolled_back"))
    result = cli_run(["status", "--json", "--root", str(tmp_path)], code=1)
    # Exit 1: neither serves (no unit, nothing listening), and status says so by its code too.
    a1, b2 = json.loads(result.output)["instances"]
    assert (a1["instance"], a1["unit"], b2["instance"]) == ("a1", "gemma4-vllm@a1.service", "b2")
    # A tree's port on this host is not its instance's: not asked, and never healthy.
    assert a1["url"] == "http://127.0.0.1:9" and a1["healthy"] is None
    assert a1["health_note"].startswith(f"not asked: --root {tmp_path} is not this host's /")
    assert [x["outcome"] for x in a1["entries"]] == ["rolled_back"] and b2["entries"] == []
    one = cli_run(["status", "b2", "--json", "--root", str(tmp_path)], code=1)
    assert [st["instance"] for st in json.loads(one.output)["instances"]] == ["b2"]


def test_a_line_written_before_image_ids_were_kept_is_read_without_them(tmp_path):
    """The IDs are new fields: a line of an older appliance stays readable, IDs unknown."""
    path = tmp_path / "h.jsonl"
    e = Entry.begin("i1", "cutover", "a:1", "b:2", "sha256:" + "a" * 64, "sha256:" + "b" * 64)
    old = json.loads(_done(e, "ok").to_json())
    del old["from_image_id"], old["to_image_id"]
    path.write_text(json.dumps(old) + "\n")
    [got] = history.entries(path)
    assert (got.from_image, got.from_image_id, got.to_image_id) == ("a:1", None, None)
    history.append(path, Entry.begin("i1", "rollback", "b:2", "a:1", "sha256:" + "b" * 64))
    assert history.entries(path)[-1].from_image_id == "sha256:" + "b" * 64


def test_a_rollback_slot_keeps_the_image_id_and_an_older_slot_reads_without_it(tmp_path):
    layout = Layout(tmp_path)
    layout.rollback_slot("i1").parent.mkdir(parents=True)
    slot.write(layout, "i1", "gemma4-vllm:0.19.0", "e1", "sha256:" + "c" * 64)
    assert slot.read(layout, "i1") == slot.Slot("gemma4-vllm:0.19.0", "sha256:" + "c" * 64)
    layout.rollback_slot("i1").write_text('{"image": "gemma4-vllm:pre-mtp", "entry": "e0"}\n')
    assert slot.read(layout, "i1") == slot.Slot("gemma4-vllm:pre-mtp", None)
    assert slot.rollback_image(layout, "i1") == "gemma4-vllm:pre-mtp"


# Appends one begin line to the history at argv[1]; with argv[2] > 0, under a file size limit
# of that many bytes (RLIMIT_FSIZE: the kernel cuts the write short, then refuses it with EFBIG,
# as a full disk does; SIGXFSZ ignored so the write returns instead of killing the process).
_APPEND = """
import resource, signal, sys
from pathlib import Path
from appliance.cutover import history
entry = history.Entry.begin("i1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:0.32.0-mtp")
if int(sys.argv[2]):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]),) * 2)
history.append(Path(sys.argv[1]), entry)
"""
REPO = Path(__file__).resolve().parents[1]


def _append(path: Path, limit: int = 0, *tracer: str) -> subprocess.CompletedProcess:
    argv = [*tracer, sys.executable, "-c", _APPEND, str(path), str(limit)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)


def test_an_append_the_disk_cuts_short_fails_and_leaves_the_history_as_it_was(tmp_path):
    """The history's write result was ignored: a short write left half a line and the cutover
    went on as if its entry were recorded."""
    path = tmp_path / "history" / "i1.jsonl"
    assert _append(path).returncode == 0
    before = path.read_bytes()
    res = _append(path, len(before) + 20)
    assert res.returncode != 0 and "File too large" in res.stderr, res.stderr
    assert path.read_bytes() == before


def test_an_append_syncs_the_folder_that_holds_the_history(tmp_path):
    """A new history file is durable only once its folder is: the append fsyncs the folder
    after the file (seen in the real system calls, strace)."""
    path = tmp_path / "history" / "i1.jsonl"
    log = tmp_path / "strace.txt"
    res = _append(path, 0, "strace", "-qq", "-e", "trace=openat,fsync", "-o", str(log))
    assert res.returncode == 0, res.stderr
    calls = log.read_text()
    file_fd = re.search(rf'openat\(AT_FDCWD, "{re.escape(str(path))}", [^)]*\) = (\d+)', calls)
    dir_fds = re.findall(
        rf'openat\(AT_FDCWD, "{re.escape(str(path.parent))}", [^)]*O_DIRECTORY[^)]*\) = (\d+)',
        calls,
    )
    assert file_fd and f"fsync({file_fd.group(1)})" in calls, calls
    assert any(f"fsync({fd})" in calls for fd in dir_fds), calls
