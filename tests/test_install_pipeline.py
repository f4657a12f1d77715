"""`appliance instance install` is one pipeline for both shapes (issue 53 §2): plan (the profile,
the kept values, a port chosen across every installed NAME) -> render (single-node or group
templates) -> host check -> write under the NAME's lock (keys created or tightened, the
operator's profile copy, a mounts drop-in per unit, the scrape targets) -> the `next:` line.

Each behaviour is one test over ``[instance, group --role both]``, through the CLI against a
throwaway ``--root``. The GPU host check runs on this machine's real answer (no nvidia-smi on
PATH: no NVIDIA driver), as tests/test_hostcheck.py does.
"""

from __future__ import annotations

import json
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from plugins.cli import invoke
from test_units import snapshot

from appliance import profiles
from appliance.host import envfile
from appliance.host import lock as locks
from appliance.host.layout import Layout
from appliance.host.names import STATE_UNIT, node_unit, unit_name

NO_DOCKER = "unix:///nonexistent/docker.sock"
IMAGE = "gemma4-vllm:0.32.0-mtp"
CPU_IMAGE = "gemma4-vllm:0.32.0-mtp-cpu"


@dataclass(frozen=True)
class Shape:
    """One shape of NAME, as `instance install` is asked for it."""

    id: str
    cpu: str  # a CPU profile of this shape (port 8000)
    gpu: str  # a GPU profile of this shape
    other_gpu: str  # a GPU profile of this shape serving another target model
    role: tuple[str, ...]  # the install's --role argument

    def argv(self, name: str, root: Path, profile: str | None, *more: str) -> list[str]:
        argv = ["instance", "install", name, "--root", str(root), *self.role, *more]
        return [*argv, "-p", profile] if profile else argv

    def keys(self, root: Path, name: str) -> list[Path]:
        layout = Layout(root)
        if not self.role:
            return [layout.api_key_file(name)]
        return [layout.node_api_key_file(name, r) for r in ("head", "worker")]

    def unit_files(self, name: str) -> list[str]:
        """The units that serve NAME on this host."""
        if not self.role:
            return [unit_name(name)]
        return [node_unit(name, r) for r in ("head", "worker")]

    @property
    def noun(self) -> str:
        return "group" if self.role else "instance"

    def start_unit(self, name: str) -> str:
        """The unit `enable --now` starts (a group's head starts its local worker first)."""
        return unit_name(name) if not self.role else node_unit(name, "head")

    def timers(self, name: str) -> list[str]:
        """A head's generation probe timer: it generates through the head every 30 s."""
        return [f"gemma4-vllm-probe@{name}.timer"] if self.role else []

    def restart_unit(self, name: str) -> str:
        # Where the worker shares the head's host, its restart reaches the head (PartOf=).
        return unit_name(name) if not self.role else node_unit(name, "worker")


INSTANCE = Shape("instance", "cpu-tiny-mtp", "l4x4-31b-mtp", "l4x4-26b-a4b-mtp", ())
GROUP = Shape(
    "group", "cpu-tiny-mtp-2node", "l4x4x2-31b-mtp", "spark2-31b-nvfp4-mtp", ("--role", "both")
)
SHAPES = [pytest.param(INSTANCE, id="instance"), pytest.param(GROUP, id="group-both")]


def other(shape: Shape) -> Shape:
    return GROUP if shape is INSTANCE else INSTANCE


@pytest.fixture(autouse=True)
def no_docker(monkeypatch):
    """No Docker engine answers (the image is not judged); this machine's nvidia-smi, if any,
    is not on PATH: a host without the NVIDIA driver."""
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    dirs = shutil.os.environ["PATH"].split(":")
    monkeypatch.setenv("PATH", ":".join(d for d in dirs if not (Path(d) / "nvidia-smi").exists()))


def run(argv: list[str], code: int | None = 0):
    return invoke(argv, code=code)


def next_line(output: str) -> str | None:
    found = [ln for ln in output.splitlines() if ln.startswith("next: ")]
    assert len(found) <= 1, output
    return found[0].removeprefix("next: ") if found else None


def engines(root: Path) -> list[dict]:
    path = root / "etc/gemma4-vllm/prometheus/engines.json"
    return json.loads(path.read_text()) if path.exists() else []


# ---- host check ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_the_host_check_refuses_a_gpu_profile_on_a_host_without_a_gpu(tmp_path, shape):
    """Old: a GPU group installed on a host with no GPU while the same profile's instance was
    refused (the check ran on the single-node branch only)."""
    root = tmp_path / "root"
    argv = shape.argv("x1", root, shape.gpu, "--host-check", "--image", IMAGE)
    res = run(argv, code=1)
    assert res.output.startswith(
        f"Error: host not ready for profile {shape.gpu}: nvidia.driver: nvidia-smi not found"
    ), res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not root.exists(), "nothing written"
    run([*argv, "--force", " "], code=2)  # a reason, not a blank
    forced = run([*argv, "--force", "GPUs arrive tomorrow"])
    assert "warning: installed despite BLOCKER nvidia.driver: " in forced.output
    assert "(--force: GPUs arrive tomorrow)" in forced.output
    assert Layout(root).env_file("x1").exists()


def test_a_worker_hosts_check_asks_nothing_of_the_api_port(tmp_path):
    """A host that runs only a group's worker binds no API port: its check does not block on
    what listens there (an instance of its own, say), as a head's or an instance's does."""
    root = tmp_path / "root"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        base = ["instance", "install", "--root", str(root), "--port", port, "--host-check"]
        worker = [*base, "w1", "-p", GROUP.cpu, "--role", "worker", "--rank", "1"]
        head = [*base, "h1", "-p", GROUP.cpu, "--role", "head"]
        for argv, says in ((worker, False), (head, True)):
            res = run([*argv, "--force", "no Docker here"])
            assert (f"BLOCKER port: 127.0.0.1:{port} is in use" in res.output) is says, res.output


@pytest.mark.parametrize("shape", SHAPES)
def test_a_name_keeps_its_shape(tmp_path, shape):
    """A profile of the other shape for an installed NAME is refused, writing nothing (old: the
    other shape's files were written beside the first's, and the host's readers took NAME for
    a group with a single-node profile, or the reverse)."""
    root = tmp_path / "root"
    run(shape.argv("s1", root, shape.cpu))
    before = snapshot(root)
    res = run(other(shape).argv("s1", root, other(shape).cpu), code=2)
    assert f"s1 is installed here as a{'' if shape.role else 'n'} {shape.noun}" in res.output
    assert "appliance instance uninstall s1" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert snapshot(root) == before


# ---- the port ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_the_port_is_chosen_across_both_shapes(tmp_path, shape):
    """Old: three groups all got 8000 and engines.json listed 127.0.0.1:8000 twice; a group
    could take an instance's port."""
    root = tmp_path / "root"
    run(other(shape).argv("a1", root, other(shape).cpu))  # the other shape holds 8000
    run(shape.argv("b1", root, shape.cpu))
    run(shape.argv("b2", root, shape.cpu))
    ports = {
        name: envfile.read(Layout(root).env_file(name)).get("VLLM_PORT")
        for name in ("a1", "b1", "b2")
    }
    assert ports == {"a1": "8000", "b1": "8001", "b2": "8002"}
    listed = sorted((t["labels"]["instance"], t["targets"][0]) for t in engines(root))
    assert listed == [("a1", "127.0.0.1:8000"), ("b1", "127.0.0.1:8001"), ("b2", "127.0.0.1:8002")]
    before = snapshot(root)
    res = run(shape.argv("b3", root, shape.cpu, "--port", "8000"), code=2)
    assert f"port 8000 is already {other(shape).noun} a1's" in res.output
    assert "--port 8003" in res.output and len(res.output.strip().splitlines()) == 1
    assert snapshot(root) == before


# ---- keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_a_reinstall_tightens_a_key_readable_by_others(tmp_path, shape):
    """Old: a re-install left a group head's key at 0644 (an instance's was set to 0600)."""
    root = tmp_path / "root"
    run(shape.argv("k1", root, shape.cpu))
    keys = shape.keys(root, "k1")
    secrets = [k.read_bytes() for k in keys]
    for key in keys:
        assert key.stat().st_mode & 0o7777 == 0o600
        key.chmod(0o644)
    run(shape.argv("k1", root, None))
    assert [k.stat().st_mode & 0o7777 for k in keys] == [0o600] * len(keys)
    assert [k.read_bytes() for k in keys] == secrets, "tightened, never replaced"


# ---- the operator's profile -----------------------------------------------------------------


def _operators_profile(tmp_path: Path, shipped: str, name: str) -> Path:
    text = profiles.shipped_text(shipped).replace(f'name = "{shipped}"', f'name = "{name}"')
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("shape", SHAPES)
def test_an_operators_profile_is_kept_beside_the_name(tmp_path, shape):
    """Old: a group installed from an operator's file kept no copy; every later reader (a
    re-install, the scrape targets, cutover, doctor, canary) exited 2 "unknown profile"."""
    root = tmp_path / "root"
    mine = _operators_profile(tmp_path, shape.cpu, "mine-tiny")
    run(shape.argv("p1", root, str(mine)))
    copy = Layout(root).profile_copy("p1")
    assert copy.read_bytes() == mine.read_bytes()
    assert profiles.installed(root, "p1", "mine-tiny").name == "mine-tiny"
    mine.unlink()  # the operator's file is gone: the copy serves
    again = run(shape.argv("p1", root, None, "--port", "8123"))
    assert "unknown profile" not in again.output
    assert envfile.read(Layout(root).env_file("p1")).get("APPLIANCE_PROFILE") == "mine-tiny"
    # Another NAME's install rewrites the scrape targets: p1 is read through its copy.
    other_install = run(INSTANCE.argv("q1", root, INSTANCE.cpu))
    assert "left out of the scrape targets" not in other_install.output
    listed = {t["labels"]["instance"]: t["labels"]["profile"] for t in engines(root)}
    assert listed == {"p1": "mine-tiny", "q1": "cpu-tiny-mtp"}
    # A shipped profile again: the copy goes; and with NAME.
    run(shape.argv("p1", root, shape.cpu))
    assert not copy.exists()
    run(shape.argv("p1", root, str(_operators_profile(tmp_path, shape.cpu, "mine-tiny"))))
    run(["instance", "uninstall", "p1", "--root", str(root)])
    assert not copy.exists()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("command", "stops_at"),
    [
        pytest.param(["instance", "doctor", "p1"], "profile mine-tiny runs on cpu", id="doctor"),
        pytest.param(["canary", "record", "p1"], "", id="canary"),
        pytest.param(["cutover", "p1", CPU_IMAGE, "--check"], "Docker", id="cutover-check"),
        pytest.param(["rollback", "p1"], "has no rollback target", id="rollback"),
    ],
)
def test_the_readers_of_a_name_find_its_operators_profile(tmp_path, shape, command, stops_at):
    """Old: each of these exited 2 "unknown profile 'mine-tiny' (known profiles: ...)" for a
    group installed from the operator's file. Each stops further on here (no engine, no Docker,
    no rollback target), having read the profile."""
    root = tmp_path / "root"
    mine = _operators_profile(tmp_path, shape.cpu, "mine-tiny")
    with socket.socket() as s:  # a port nothing listens on: the engine is not running
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run(shape.argv("p1", root, str(mine), "--port", str(port)))
    mine.unlink()
    argv = [*command, "--root", str(root)]
    if command[0] == "canary":
        argv += ["--out", str(tmp_path / "canary.json")]
    res = run(argv, code=None)
    assert "unknown profile" not in res.output and "Usage:" not in res.output, res.output
    assert stops_at in res.output


def test_an_unknown_profile_is_one_short_line_with_the_close_names(tmp_path):
    """Old: `unknown profile 'x' (known profiles: ...)`, some 2,000 characters naming 71."""
    res = run(INSTANCE.argv("u1", tmp_path / "root", "cpu-tiny-mpt"), code=2)
    line = res.output.strip()
    assert "\n" not in line and len(line) < 240, line
    assert "unknown profile 'cpu-tiny-mpt'" in line
    assert "cpu-tiny-mtp" in line and "appliance profiles list" in line


# ---- mounts --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_every_unit_waits_for_the_mounts_its_folders_are_on(tmp_path, shape):
    """Old: an instance got `gemma4-vllm@i1.service.d/mounts.conf`, a group's nodes none."""
    root = tmp_path / "root"
    argv = shape.argv("m1", root, shape.cpu, "--model-dir", "/srv/tiny")
    run([*argv, "--vllm-cache-dir", "/mnt/cache/m1"])
    unit_dir = root / "etc/systemd/system"
    for unit in shape.unit_files("m1"):
        dropin = unit_dir / f"{unit}.d" / "mounts.conf"
        text = dropin.read_text()
        assert "RequiresMountsFor=/srv/tiny /mnt/cache/m1\n" in text, unit
        assert dropin.stat().st_mode & 0o777 == 0o644
    run(["instance", "uninstall", "m1", "--root", str(root)])
    assert not any(unit_dir.glob("*.d")), "the drop-ins and their folders go with NAME"


# ---- the lock ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_install_is_refused_while_a_cutover_holds_the_lock(tmp_path, shape):
    """Old: install rewrote the env file and the scrape targets during a cutover, which then
    wrote back what it had read."""
    root = tmp_path / "root"
    run(shape.argv("l1", root, shape.cpu))
    path = Layout(root).lock_file("l1")
    with locks.hold(path, "l1", f"cutover to {CPU_IMAGE}"):
        before = snapshot(root)
        res = run(shape.argv("l1", root, None, "--port", "8123"), code=3)
        assert "instance l1 is busy" in res.output and len(res.output.strip().splitlines()) == 1
        assert snapshot(root) == before
    done = run(shape.argv("l1", root, None, "--port", "8123"))
    assert "wrote" in done.output
    assert envfile.read(Layout(root).env_file("l1")).get("VLLM_PORT") == "8123"


# ---- next: ---------------------------------------------------------------------------------


def _enable(root: Path, unit: str) -> None:
    """What `systemctl enable` leaves: the unit's link in its WantedBy target's folder."""
    link = Layout(root).wants_link(unit)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to("/dev/null")


@pytest.mark.parametrize("shape", SHAPES)
def test_the_next_step_is_decided_per_unit(tmp_path, shape):
    """Old: `restart` for a unit never enabled (a head installed, not enabled, then changed),
    nothing of `models pull` after a change of the model, and a head's probe timer never
    named."""
    root = tmp_path / "root"
    start, restart = shape.start_unit("n1"), shape.restart_unit("n1")
    timers = [*shape.timers("n1"), f"{STATE_UNIT}.timer"]
    enable = f"systemctl daemon-reload && systemctl enable --now {start} {' '.join(timers)}"
    first = run(shape.argv("n1", root, shape.gpu, "--image", IMAGE))
    # Its models are not on this tree's host (tests/test_models.py: where they are, no pull).
    assert next_line(first.output) == f"appliance models pull n1 --root {root} && {enable}"
    changed = run(shape.argv("n1", root, None, "--image", "gemma4-vllm:0.32.1-mtp"))
    assert next_line(changed.output) == enable, "never enabled: enable, not restart"
    _enable(root, start)
    assert next_line(run(shape.argv("n1", root, None, "--image", IMAGE)).output) == (
        f"systemctl daemon-reload && systemctl restart {restart} && "
        f"systemctl enable --now {' '.join(timers)}"
    )
    for timer in timers:
        _enable(root, timer)
    assert next_line(run(shape.argv("n1", root, None)).output) is None  # nothing changed
    again = run(shape.argv("n1", root, None, "--image", "gemma4-vllm:0.32.1-mtp"))
    assert next_line(again.output) == f"systemctl daemon-reload && systemctl restart {restart}"
    # Another target model: the engine runs offline, and would exit 78 without it.
    moved = run(shape.argv("n1", root, shape.other_gpu))
    assert next_line(moved.output) == (
        f"appliance models pull n1 --root {root} && "
        f"systemctl daemon-reload && systemctl restart {restart}"
    )
    # The tiny dev models are in MODEL_DIR, not the hub: nothing to pull.
    tiny = run(shape.argv("n2", root, shape.cpu))
    _enable(root, shape.start_unit("n2"))
    mine = _operators_profile(tmp_path, shape.cpu, "mine-tiny")
    mine.write_text(mine.read_text().replace("max_model_len = 512", "max_model_len = 384"))
    edited = run(shape.argv("n2", root, str(mine)))
    assert "appliance models pull" not in tiny.output + edited.output
    assert next_line(edited.output).startswith("systemctl daemon-reload && systemctl restart ")


# ---- GPUs ----------------------------------------------------------------------------------


def test_a_groups_node_gets_its_own_gpus_past_an_instances(tmp_path, monkeypatch):
    """On the 8x H100 capture: an instance takes one GPU, a group's head then the next four
    (its [hardware] gpus, per host), not `all` over the instance's (old: every group node was
    given all of them, silently)."""
    from test_hostcheck import as_machine, fake_nvidia_smi

    fake_nvidia_smi(tmp_path, monkeypatch, "h100x8.csv")
    as_machine(monkeypatch)  # the tree is a machine on this host: its GPUs are the fake's
    root = tmp_path / "root"
    text = profiles.shipped_text(GROUP.gpu).replace(f'name = "{GROUP.gpu}"', 'name = "h100x4x2"')
    text = text.replace('gpu_name = "NVIDIA L4"', 'gpu_name = "NVIDIA H100 80GB HBM3"')
    text = text.replace("gpu_memory_gib = 24", "gpu_memory_gib = 80")
    mine = tmp_path / "h100x4x2.toml"
    mine.write_text(text)
    force = ("--host-check", "--force", "no Docker here")
    run(INSTANCE.argv("i1", root, "h100-31b-mtp", *force))
    run(
        [
            "instance",
            "install",
            "g1",
            "--root",
            str(root),
            "-p",
            str(mine),
            "--role",
            "head",
            *force,
        ]
    )
    gpus = {n: envfile.read(Layout(root).env_file(n)).get("VLLM_GPUS") for n in ("i1", "g1")}
    held = [set(g.removeprefix("device=").split(",")) for g in gpus.values()]
    assert [len(h) for h in held] == [1, 4] and not held[0] & held[1], gpus
