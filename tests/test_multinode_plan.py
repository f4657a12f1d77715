"""The fleet's move of a group across hosts, without hosts: each host's
preflight as `appliance multinode cutover GROUP IMAGE --check` prints it, and the play's
decisions (deploy/ansible/roles/gemma4_appliance/filter_plugins/multinode.py) on those answers.
The play itself, over SSH on two real hosts: tests/test_fleet_multinode.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest

from appliance import profiles, units
from appliance.host.layout import Layout, Node
from appliance.instance import installer
from appliance.units.instance import host_node

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "deploy/ansible/roles/gemma4_appliance/filter_plugins/multinode.py"
GROUP = "grp"
PROFILE = "cpu-tiny-mtp-2node"


def _plugin():
    """The filters as plain Python, as the plugin says tests load it. Not through ansible-core,
    which the fleet extra installs: importing it patches ``sys.intern`` for this whole process,
    and torch (imported in-process by a later test) then fails with "substitute_in_graph expects
    a function" (seen: the fast tier alone, tests/test_devmodel.py)."""
    spec = importlib.util.spec_from_file_location("gemma4_multinode_filters", PLUGIN)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    held = sys.modules.get("ansible", _ABSENT)
    sys.modules["ansible"] = None  # type: ignore[assignment]  # `import ansible.x` -> ImportError
    try:
        spec.loader.exec_module(mod)
    finally:
        if held is _ABSENT:
            del sys.modules["ansible"]
        else:
            sys.modules["ansible"] = held
    return mod


_ABSENT = object()


_FILTERS = _plugin()
plan, why = _FILTERS.multinode_plan, _FILTERS.multinode_why


def _check(
    roles,
    ranks,
    *,
    remote=(),
    env="img:old",
    image_id="sha256:new",
    env_id="sha256:old",
    runs=False,
    canary=None,
):
    return {
        "canary": "head" in roles if canary is None else canary,
        "name": GROUP,
        "roles": list(roles),
        "ranks": list(ranks),
        "remote_ranks": list(remote),
        "units": {r: f"gemma4-vllm-{r}@{GROUP}.service" for r in roles},
        "image": "img:new",
        "image_id": image_id,
        "env_image": env,
        "env_image_id": env_id,
        "runs_image": runs,
    }


def test_workers_move_before_the_head_which_moves_when_any_worker_does():
    checks = {
        "h0": _check(["head"], [], remote=[1, 2]),
        "h2": _check(["worker"], [2], runs=True),
        "h1": _check(["worker"], [1]),
    }
    got = plan(checks, "img:new")
    assert got["head"] == "h0" and got["workers"] == ["h1", "h2"]
    assert got["head_unit"] == f"gemma4-vllm-head@{GROUP}.service"  # stopped before h1 moves
    assert got["move_workers"] == ["h1"] and got["move_head"] is True
    assert got["old_image"] == "img:old" and got["split"] == {}
    # Every node on the image already: nothing moves (a re-run of a finished move).
    done = {h: {**c, "runs_image": True} for h, c in checks.items()}
    still = plan(done, "img:new")
    assert (still["move_workers"], still["move_head"]) == ([], False)


def test_the_heads_canary_runs_when_the_head_moves_from_a_whole_group():
    checks = {"h0": _check(["head"], [], remote=[1]), "h1": _check(["worker"], [1])}
    assert plan(checks, "img:new")["canary"] is True  # the head's profile says on
    assert plan(checks, "img:new", "false")["canary"] is False  # -e multinode_canary=false
    off = {**checks, "h0": _check(["head"], [], remote=[1], canary=False)}
    assert plan(off, "img:new")["canary"] is False
    assert plan(off, "img:new", True)["canary"] is True
    # No image before (nothing answered yet), or nothing moving: nothing to record.
    first = {h: {**c, "env_image": None} for h, c in checks.items()}
    assert plan(first, "img:new")["canary"] is False
    done = {h: {**c, "runs_image": True} for h, c in checks.items()}
    assert plan(done, "img:new")["canary"] is False
    with pytest.raises(_FILTERS._Refused, match="multinode_canary='maybe'"):
        plan(checks, "img:new", "maybe")


def test_a_split_left_by_a_stopped_move_is_named_and_the_way_back_is_the_heads():
    checks = {
        "h0": _check(["head"], [], remote=[1]),
        # Its env file names the image it moved to, another ID than the way back's: the
        # group's way back is the head's, and a second run that makes the group whole goes on.
        "h1": _check(["worker"], [1], env="img:new", env_id="sha256:new", runs=True),
    }
    got = plan(checks, "img:new")
    assert got["split"] == {"h1": "img:new"} and got["old_image"] == "img:old"
    assert got["move_workers"] == [] and got["move_head"] is True
    # The head lost its worker when that moved: it cannot answer the canary's before-record.
    assert got["canary"] is False


@pytest.mark.parametrize(
    ("checks", "says"),
    [
        ({"a": _check(["head"], [], remote=[1]), "b": _check(["head"], [])}, "2 heads (a, b)"),
        ({"b": _check(["worker"], [1])}, "0 heads (none)"),
        (
            {"a": _check(["head"], [], remote=[1, 2]), "b": _check(["worker"], [1])},
            "waits for worker ranks [1, 2] on other hosts, the play's worker hosts run ranks [1]",
        ),
        (
            {"a": _check(["head"], [], remote=[1]), "b": _check(["worker"], [1], image_id="x")},
            "img:new is a different image on different hosts",
        ),
        (  # the way back: the old tag names another image on the worker's host
            {"a": _check(["head"], [], remote=[1]), "b": _check(["worker"], [1], env_id="y")},
            "img:old is a different image on different hosts",
        ),
        ({}, "no host of the group answered"),
        (  # an older appliance's answer: the play could not stop the head before the workers
            {"a": {**_check(["head"], [], remote=[1]), "units": {}}, "b": _check(["worker"], [1])},
            "a did not name its head's unit",
        ),
    ],
)
def test_a_group_the_play_cannot_move_is_refused_in_one_line(checks, says):
    with pytest.raises(_FILTERS._Refused) as err:  # Ansible's own error: a failed task
        plan(checks, "img:new")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_why_a_step_failed_is_the_appliances_error_line():
    loop = {
        "failed": True,
        "msg": "One or more items failed",
        "results": [{"failed": True, "rc": 1, "stderr": "restarting\nError: gate 'unit' failed\n"}],
    }
    assert why(loop) == "Error: gate 'unit' failed"
    lost = "fleet-b became unreachable"
    assert why({"failed": True, "msg": lost}) == lost
    assert why(None) == "failed"


def _install(root: Path, node: Node) -> None:
    opts = units.Options(image="gemma4-vllm:0.32.0", model_dir="/srv/tiny")
    installer.install(PROFILE, GROUP, node=node, root=root, options=opts)


def test_a_head_whose_worker_runs_elsewhere_moves_only_without_its_own_way_back(tmp_path, cli_run):
    """The head moves as one step of the fleet's play (--no-rollback); alone it says why not
    and names the play."""
    _install(tmp_path, Node(("head",)))
    env = Layout(tmp_path).env_file(GROUP)
    before = env.read_bytes()
    state = {p: p.read_bytes() for p in (tmp_path / "var").rglob("*") if p.is_file()}
    assert list(state) == [Layout(tmp_path).lock_file(GROUP)]  # the install's lock, holder and all
    argv = ["cutover", GROUP, "gemma4-vllm:0.32.0-mtp", "--root", str(tmp_path)]
    result = cli_run(argv, code=None)
    assert result.exit_code != 0
    line = result.output.strip()
    assert "the worker(s) of rank 1 run on other hosts" in line and "\n" not in line, line
    assert "playbooks/multinode-cutover.yml" in line
    assert env.read_bytes() == before
    after = {p: p.read_bytes() for p in (tmp_path / "var").rglob("*") if p.is_file()}
    assert after == state, "nothing written: not even the lock's holder"


def test_a_worker_host_moves_only_while_its_head_is_down(tmp_path, cli_run, monkeypatch):
    """A worker started beside a running head joins that head's finished rendezvous and hangs
    once the head restarts (seen in the fleet tier): by hand, a worker host's move is refused
    while the head's rendezvous port answers (a real listener there), untouched; with nothing
    there, the move goes on to its next check (here the tree's Docker, not named)."""
    prof = profiles.get(PROFILE)
    head = socket.create_server(("127.0.0.1", 0))
    port = head.getsockname()[1]
    prof = dataclasses.replace(
        prof, multinode=dataclasses.replace(prof.multinode, master_port=port)
    )
    opts = units.Options(image="gemma4-vllm:0.32.0", model_dir="/srv/tiny")
    installer.install(prof, GROUP, node=Node(("worker",), 1), root=tmp_path, options=opts)
    # The tree's systemd named: its ports (the head's address among them) are the tree's own.
    monkeypatch.setenv("APPLIANCE_SYSTEMD_PREFIX", "true")
    env = Layout(tmp_path).env_file(GROUP)
    before = env.read_bytes()
    argv = ["cutover", GROUP, "gemma4-vllm:0.32.0-mtp", "--root", str(tmp_path)]
    with head:
        result = cli_run(argv, code=None)
    assert result.exit_code != 0
    line = result.output.strip()
    assert f"its head's rendezvous at 127.0.0.1:{port} answers" in line and "\n" not in line
    assert "playbooks/multinode-cutover.yml" in line
    assert env.read_bytes() == before
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    result = cli_run(argv, code=None)
    assert result.exit_code != 0 and "rendezvous" not in result.output
    assert "Docker" in result.output, result.output


def test_a_name_this_host_does_not_run_is_told_so(tmp_path, cli_run):
    _install(tmp_path, Node(("head",)))
    argv = ["rollback", "other", "--root", str(tmp_path)]
    result = cli_run(argv, code=2)
    assert "no instance other" in result.output


def test_a_worker_hosts_node_is_read_from_its_args_file(tmp_path):
    _install(tmp_path, Node(("worker",), rank=2 - 1))
    layout = Layout(tmp_path)
    assert host_node(layout, layout.shape(GROUP)) == Node(("worker",), 1)


@pytest.mark.docker
def test_each_hosts_check_is_what_the_play_plans_with(
    tmp_path, preflight_images, monkeypatch, cli_run
):
    """`--check` on a head host and on a worker host (two roots, the real Docker engine): JSON
    lines that the play's plan takes as they are; nothing is written on either host."""
    monkeypatch.setenv("APPLIANCE_SYSTEMD_PREFIX", "true")  # no systemd here: no unit loaded
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")  # the trees' Docker
    old, new = preflight_images["pre-mtp"], preflight_images["mtp"]
    checks = {}
    for host, node in (("a", Node(("head",))), ("b", Node(("worker",), 1))):
        root = tmp_path / host
        opts = units.Options(image=old, model_dir="/srv/tiny")
        installer.install(PROFILE, GROUP, node=node, root=root, options=opts)
        listing = sorted(p for p in root.rglob("*"))
        argv = ["cutover", GROUP, new, "--check", "--root", str(root)]
        result = cli_run(argv)
        checks[host] = json.loads(result.stdout)
        assert sorted(p for p in root.rglob("*")) == listing
    assert checks["a"]["remote_ranks"] == [1] and checks["b"]["ranks"] == [1]
    assert checks["a"]["image_id"] == checks["b"]["image_id"]
    assert checks["a"]["units"] == {"head": f"gemma4-vllm-head@{GROUP}.service"}
    assert checks["b"]["units"] == {"worker": f"gemma4-vllm-worker@{GROUP}.service"}
    got = plan(checks, new)
    assert (got["head"], got["move_workers"], got["move_head"]) == ("a", ["b"], True)
    assert got["head_unit"] == checks["a"]["units"]["head"]
    assert got["old_image"] == old
    assert (checks["a"]["canary"], checks["b"]["canary"]) == (True, False)
