"""The command grammar as a whole: what `appliance --help` shows, the one contract of exit codes
(README.md, "Exit codes and --json"), and every --json as one JSON object."""

from __future__ import annotations

import ast
import json
import re
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest
from packaging.version import Version

from appliance import __version__, canary, images, units
from appliance.canary import Record, Settings
from appliance.canary.record import Output
from appliance.cli import aliases, cli
from appliance.cutover import preflight
from appliance.cutover.preflight import ImageInfo
from appliance.engine.local import free_port
from appliance.errors import ApplianceError
from appliance.host import reach
from appliance.host.systemd import Systemd, SystemdError
from appliance.oci import labels
from appliance.profiles import get

REPO = Path(__file__).resolve().parent.parent
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
VERBS = {"cutover", "rollback", "status", "history"}


def test_the_top_level_shows_the_noun_groups_and_the_four_lifecycle_verbs(cli_run):
    res = cli_run(["--help"])
    listed = res.output.split("Commands:\n", 1)[1].splitlines()
    shown = {line.split()[0] for line in listed if line.startswith("  ") and line.split()}
    ctx = click.Context(cli)
    groups = {name for name in shown if isinstance(cli.get_command(ctx, name), click.Group)}
    assert VERBS <= shown and shown - VERBS == groups
    assert {"bench", "instance", "dev"} <= groups and "tune" not in shown


# --- old spellings --------------------------------------------------------------------------------

# A line of each old form (before --help), and the command it runs now.
OLD_LINES = {
    "demo": ([], "dev demo"),
    "devmodel build": (["DIR"], "dev devmodel"),
    "dev devmodel build": (["DIR"], "dev devmodel"),
    "doctor": ([], "instance doctor"),
    "generate": ([], "dev generate"),
    "install": (["x"], "instance install"),
    "local serve": ([], "dev serve"),
    "dev local serve": ([], "dev serve"),
    "render": (["x"], "instance render"),
    "tune": ([], "bench tune"),
    "uninstall": (["x"], "instance uninstall"),
    "multinode install": (["-g", "g1", "--role", "both"], "instance install"),
    "multinode cutover": ([], "cutover"),
    "multinode rollback": ([], "rollback"),
    "multinode canary": ([], "canary record"),
    "bench": (["--sweep-k", "1,2"], "bench sweep"),
}


def test_the_table_of_old_spellings_is_the_one_walked_here():
    assert [entry.old for entry in aliases.OLD] == list(OLD_LINES)


@pytest.mark.parametrize("entry", aliases.OLD, ids=[e.old for e in aliases.OLD])
def test_an_old_spelling_runs_its_current_command_until_the_release_that_removes_it(entry, cli_run):
    rest, runs = OLD_LINES[entry.old]
    res = cli_run([*entry.old.split(), *rest, "--help"])
    assert res.stdout.startswith(f"Usage: appliance {runs} "), res.stdout
    if entry.removed_in is None:  # the README's `appliance demo`: kept, and quiet
        assert (entry.old, res.stderr) == ("demo", "")
        return
    assert Version(entry.removed_in) > Version(__version__)
    [warning] = res.stderr.splitlines()
    assert warning.startswith(f"warning: `appliance {entry.old.split()[0]}")
    assert warning.endswith(f"` (the old spelling goes in {entry.removed_in})")
    assert f" is now `appliance {runs}" in warning


def _options_shown_and_hidden() -> tuple[set[str], set[str]]:
    shown, hidden = set(), set()

    def walk(cmd: click.Command) -> None:
        for p in cmd.params:
            if isinstance(p, click.Option):
                (hidden if p.hidden else shown).update(p.opts)
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name))

    walk(cli)
    return shown, hidden


def test_the_synonyms_are_hidden_and_still_work(tmp_path, cli_run):
    shown, hidden = _options_shown_and_hidden()
    assert {"--instance", "--profile-file"} <= hidden and not {
        "--instance",
        "--profile-file",
    } & shown
    for argv in (["bench", "run"], ["models", "verify"]):
        res = cli_run([*argv, "--instance", "nosuch", "--root", str(tmp_path)], code=2)
        assert res.output.startswith("Error: no instance nosuch: no "), res.output
    mine = tmp_path / "mine.toml"
    mine.write_text("not a profile = [")
    res = cli_run(["models", "verify", "--profile-file", str(mine)], code=2)
    assert str(mine) in res.output


def test_a_current_line_that_looks_like_an_old_one_is_left_alone(cli_run):
    """`dev devmodel build` alone is the current command given a directory named build."""
    assert aliases.match(["dev", "devmodel", "build"]) is None
    assert aliases.match(["bench", "run", "x"]) is None and aliases.match(["bench"]) is None


def test_an_old_spelling_after_the_top_levels_own_flags_is_found():
    got = aliases.current(["-q", "install", "x", "-p", "cpu-tiny"], warn=False)
    assert got == ["-q", "instance", "install", "x", "-p", "cpu-tiny"]
    assert aliases.current(["--version"], warn=False) == ["--version"]


# --- exit codes ----------------------------------------------------------------------------------


def _readme_codes() -> dict[int, str]:
    section = REPO.joinpath("README.md").read_text().split("## Exit codes and --json\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return {int(m[1]): m[2] for m in re.finditer(r"^\| +(\d+) \| (.+) \|$", section, re.MULTILINE)}


def _codes_in_code() -> set[int]:
    """Every exit code the CLI can give: the error family's ``exit_code`` values and the codes
    handed to ``sys.exit``/``SystemExit``/click's ``Exit``. The serve program (appliance/serve)
    is left out: it answers systemd, not an operator (its codes are in its docstring)."""
    named = {"EX_CONFIG": 78}
    found = {2}  # click's own usage errors

    def values(node: ast.AST) -> set[int]:
        out = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and type(n.value) is int:
                out.add(n.value)
            elif isinstance(n, ast.Name) and n.id in named:
                out.add(named[n.id])
        return out

    for path in (REPO / "appliance").rglob("*.py"):
        if "serve" in path.relative_to(REPO / "appliance").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "exit_code" for t in node.targets
            ):
                found |= values(node.value)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "sys.exit",
                "SystemExit",
                "click.exceptions.Exit",
            ):
                found |= values(node)
    return found


def test_the_readme_lists_every_exit_code_the_cli_gives_and_no_other():
    documented = _readme_codes()
    assert set(documented) == _codes_in_code(), documented
    assert "Ctrl-C" in documented[130] and "unknown instance NAME" in documented[2]


# The commands whose NAME is the instance they create, not one that must exist.
CREATE = {"instance install", "instance render"}


def _name_commands() -> dict[str, click.Command]:
    """Every command whose first argument is NAME (an instance), found in the click tree."""
    out = {}

    def walk(cmd: click.Command, path: list[str]) -> None:
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name])
            return
        arguments = [p for p in cmd.params if isinstance(p, click.Argument)]
        if arguments and arguments[0].name == "name":
            out[" ".join(path)] = cmd

    walk(cli, [])
    return out


NAMED = _name_commands()


def test_an_instance_is_called_name_wherever_a_command_takes_one():
    assert {"fleet snapshot", "fleet soak", "fleet status", "bench run", "cutover"} <= set(NAMED)
    assert CREATE <= set(NAMED)
    for path, cmd in NAMED.items():
        [name] = [p for p in cmd.params if p.name == "name"]
        assert name.human_readable_name in ("NAME", "[NAME]"), path


def _argv(path: str, cmd: click.Command, root: Path, elsewhere: Path) -> list[str]:
    """``path nosuch`` with a stand-in for every other required argument and option: a file
    that exists where one must, else a path outside the tree (nothing may be written there)."""
    argv = [*path.split(), "nosuch"]
    for p in cmd.params:
        if not p.required or p.name == "name":
            continue
        if isinstance(p.type, click.Path) and p.type.exists:
            given = elsewhere / "in.json"
            given.write_text("{}")
            value = str(given)
        elif isinstance(p.type, click.Path) or "Path" in type(p.type).__name__:
            value = str(elsewhere / "out" / p.name)
        else:
            value = "gemma4-vllm:0.32.0-mtp" if isinstance(p, click.Argument) else "1"
        argv += [value] if isinstance(p, click.Argument) else [p.opts[0], value]
    return [*argv, "--root", str(root)]


@pytest.mark.parametrize("path", sorted(set(NAMED) - CREATE))
def test_an_unknown_instance_name_is_bad_input_exit_2_in_the_one_line(tmp_path, path, cli_run):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    res = cli_run(_argv(path, NAMED[path], root, elsewhere), code=2)
    [line] = res.output.splitlines()
    env = root / "etc/gemma4-vllm/nosuch.env"
    assert line.startswith(f"Error: no instance nosuch: no {env} (`appliance status` lists"), line
    assert list(root.iterdir()) == []  # nothing written on the way to the refusal
    assert not (elsewhere / "out").exists()


@pytest.mark.parametrize("argv", [["fleet", "targets"], ["image", "load"]], ids=" ".join)
def test_a_missing_input_file_is_bad_input_exit_2(tmp_path, argv, cli_run):
    res = cli_run([*argv, str(tmp_path / "missing")], code=2)
    assert str(tmp_path / "missing") in res.output.splitlines()[-1]


def test_a_rollback_with_nothing_to_return_to_is_a_refusal_exit_1(tmp_path, cli_run):
    """Well-formed and of a known instance: the state refuses it (security review T7)."""
    units.install(get("cpu-tiny-mtp"), "x", root=tmp_path, options=units.Options(port=free_port()))
    res = cli_run(["rollback", "x", "--root", str(tmp_path)], code=1)
    assert res.output.startswith("Error: instance x has no rollback target"), res.output


def test_an_image_of_the_other_build_is_one_refusal_exit_1_for_install_and_cutover(
    tmp_path, monkeypatch, cli_run
):
    """A CPU image for a GPU profile is a well-formed image the profile cannot run: a refusal,
    as the cutover's preflight and the host check's blocker say it (security review T7). The
    Docker engine is a stand-in here answering one image's labels (the real CPU image against
    both commands: test_images_variant.py, the docker tier)."""
    ref = "gemma4-vllm:0.32.0-mtp-cpu"
    found = {labels.VARIANT: "cpu", labels.VLLM_VERSION: "0.32.0", labels.MTP: "true"}

    # The one call install makes of the engine: images.get(ref).labels.
    image = types.SimpleNamespace(labels=found)
    engine = types.SimpleNamespace(images=types.SimpleNamespace(get={ref: image}.__getitem__))
    monkeypatch.setattr(images, "reachable", lambda *_a, **_k: engine)
    argv = ["instance", "install", "31b", "-p", "l4x4-31b-mtp", "--image", ref]
    res = cli_run([*argv, "--root", str(tmp_path)], code=1)
    line = _one_line(res.output)
    assert line.startswith(f"Error: image {ref} is a cpu build ({labels.VARIANT}=cpu)"), line
    assert list(tmp_path.iterdir()) == []
    # The cutover's preflight refuses the same image with the same code.
    info = ImageInfo(ref, "sha256:" + "a" * 64, "0.32.0", mtp=True, labels=found)
    with pytest.raises(ApplianceError) as by_cutover:
        preflight.check_compatible(info, get("l4x4-31b-mtp"), allow_no_mtp=False)
    assert by_cutover.value.exit_code == res.exit_code
    assert f"Error: {by_cutover.value}" == line


def _one_line(output: str) -> str:
    [line] = output.splitlines()
    return line


def test_a_tree_whose_systemd_or_docker_is_not_named_is_refused_alike(tmp_path, monkeypatch):
    """One code per kind of refusal: a --root tree that names neither its systemd nor its
    Docker engine is bad input (2) for both, and still a systemd error to systemd's callers."""
    monkeypatch.delenv(reach.SYSTEMD_ENV, raising=False)
    monkeypatch.delenv(reach.DOCKER_ENV, raising=False)
    with pytest.raises(ApplianceError) as by_docker:
        images.client(root=tmp_path)
    with pytest.raises(SystemdError) as by_systemd:
        Systemd.of_tree(tmp_path).restart("gemma4-vllm@x.service")
    assert by_docker.value.exit_code == by_systemd.value.exit_code == 2
    for refused, what in ((by_docker, "Docker"), (by_systemd, "systemd")):
        assert str(refused.value).startswith(f"--root {tmp_path} is not this host's /: its {what}")


def test_ctrl_c_exits_130_with_one_line_and_nothing_written(tmp_path):
    """A real SIGINT while bench waits on an engine that accepted the connection and never
    answers (the accept is the event: the request is in flight)."""
    out = tmp_path / "art.json"
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        # exec keeps an ignored signal ignored (a shell's background job ignores SIGINT, and
        # this process with it), but resets a handled one to its default, as a terminal's
        # foreground command has it.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            proc = subprocess.Popen(
                [APPLIANCE, "bench", "run", "--url", url, "--limit", "1", "--out", str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            signal.signal(signal.SIGINT, previous)
        server.settimeout(120)  # a bound on a broken run, not a wait standing for the event
        conn, _ = server.accept()
        with conn:
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stdout, stderr) == (130, "", "Error: interrupted\n")
    assert not out.exists()


# --- --json: one object --------------------------------------------------------------------------


def _commands_with_json() -> set[str]:
    out: set[str] = set()

    def walk(cmd: click.Command, path: list[str]) -> None:
        if any("--json" in p.opts for p in cmd.params):
            out.add(" ".join(path))
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if not sub.hidden:
                    walk(sub, [*path, name])

    walk(cli, [])
    return out


def _record(tokens: tuple[int, ...]) -> Record:
    out = Output("a", "prose", "text", tokens, len(tokens), "length", 0.1, None)
    return Record(
        "http://127.0.0.1:1", "m", "0.32.0", Settings(), "d", ("c.jsonl",), 0.0, 1.0, (out,)
    )


# Each read command run here, on an installed instance nobody serves (NAME x) and the shipped
# profiles; {root} and {dir} are the test's folders.
WALKED = {
    "status": ["status", "--root", "{root}"],
    "instance status": ["instance", "status", "x", "--root", "{root}"],
    "history": ["history", "x", "--root", "{root}"],
    "instance history": ["instance", "history", "x", "--root", "{root}"],
    "profiles list": ["profiles", "list"],
    "profiles show": ["profiles", "show", "cpu-tiny-mtp"],
    "profiles validate": ["profiles", "validate", "cpu-tiny-mtp"],
    "host check": ["host", "check", "x", "--root", "{root}"],
    "instance doctor": ["instance", "doctor", "x", "--no-generate", "--root", "{root}"],
    "models verify": ["models", "verify", "--profile", "l4x4-31b-mtp", "--root", "{root}"],
    "fleet status": ["fleet", "status", "x", "--root", "{root}"],
    "canary compare": ["canary", "compare", "{dir}/a.json", "{dir}/b.json"],
}
_ROLLBACK_BY_ID = (
    "test_cutover_systemd.py::"
    "test_rollback_returns_to_the_image_id_the_slot_recorded_when_its_tag_moved"
)
_MODELS_JSON = (
    "test_models.py::test_pull_export_and_import_json_are_one_object_each_from_their_records"
)
# The ones that need an engine, Docker, systemd, a hub or a fleet, or that change what the other
# commands here read, and the test that reads their --json whole.
ELSEWHERE = {
    "bench run": "test_bench_engine.py::test_api_key_file_lets_bench_through",
    "bench load": "test_bench_engine.py::_appliance_level",
    "bench compare": "test_reports.py::paired_run",
    "bench tune": "test_bench_engine.py::test_tune_writes_a_schedule_that_vllms_config_applies",
    # nvidia-smi's captured answers, printed by its one fake (no GPU here).
    "profiles suggest": (
        "test_profiles_suggest.py::test_the_suggested_profile_passes_host_check_for_the_captures_gpus"
    ),
    "dev demo": "test_demo.py::test_demo_json_records_add_up_to_the_engines_counter_deltas",
    "image build": "test_images_docker.py::test_warm_build_is_a_cache_hit",
    "image list": (
        "test_images_docker.py::test_list_reports_tags_labels_and_which_instance_uses_which_image"
    ),
    "image save": "test_images_archive.py::test_save_rm_load_gives_the_same_id_and_the_saved_tag",
    "image load": "test_images_archive.py::test_save_rm_load_gives_the_same_id_and_the_saved_tag",
    "image prune": "test_images_docker.py::test_protected_images_survive_every_prune",
    "image rm": "test_images_docker.py::test_rm_refuses_a_referenced_image_and_removes_a_free_one",
    "image tag": (
        "test_images_docker.py::test_tag_moves_latest_and_keeps_the_last_non_mtp_image_as_pre_mtp"
    ),
    # The commands that act (ecosystem review E15), each where it acts for real.
    "instance install": "test_units.py::test_install_and_uninstall_json_are_the_write_record",
    "instance uninstall": "test_units.py::test_install_and_uninstall_json_are_the_write_record",
    "cutover": _ROLLBACK_BY_ID,
    "instance cutover": _ROLLBACK_BY_ID,
    "rollback": _ROLLBACK_BY_ID,
    "instance rollback": _ROLLBACK_BY_ID,
    "models pull": _MODELS_JSON,
    "models import": _MODELS_JSON,
    "models export": _MODELS_JSON,
    "canary record": "test_canary_engine.py::test_cli_record_and_compare_end_to_end",
    "fleet scrape-config": (
        "test_fleet_soak.py::test_scrape_config_json_says_whether_the_config_changed"
    ),
    # No test drives these through the CLI with --json; they print through the same
    # cli/output.echo_json, which refuses anything but one object.
    "bench sweep": None,
    "fleet soak": None,
}


def test_every_command_with_json_is_walked_here_or_named_with_its_test():
    assert _commands_with_json() == set(WALKED) | set(ELSEWHERE)
    for where in filter(None, ELSEWHERE.values()):
        module, name = where.split("::")
        text = (REPO / "tests" / module).read_text()
        assert re.search(rf"^def {name}\(", text, re.MULTILINE), where
        body = text.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
        assert "--json" in body and "json.loads(" in body, where


def test_one_json_printer_in_the_cli():
    """Every --json (and cutover --check's object) goes through cli/output.py's echo_json."""
    printers = {
        str(path.relative_to(REPO))
        for path in (REPO / "appliance/cli").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("json.dumps", "json.dump")
    }
    assert printers == {"appliance/cli/output.py"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    root, files = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("files")
    units.install(get("cpu-tiny-mtp"), "x", root=root, options=units.Options(port=free_port()))
    canary.save(_record((1, 2)), files / "a.json")
    canary.save(_record((1, 3)), files / "b.json")
    return root, files


@pytest.mark.parametrize("command", sorted(WALKED))
def test_json_is_one_object_on_stdout(installed, command, cli_run):
    root, files = installed
    argv = [a.format(root=root, dir=files) for a in WALKED[command]]
    res = cli_run([*argv, "--json"], code=None)
    # What is checked may be unready (nothing serves x, no models): 1 or 78, with the report.
    assert res.exit_code in (0, 1, 78), res.output
    assert isinstance(json.loads(res.stdout), dict), res.stdout
