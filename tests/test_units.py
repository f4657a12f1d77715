"""The unit, the one serve program, and each instance's env and args files: rendered, written,
upgraded in place, uninstalled, and verified by the tools that consume them.

systemd-analyze verify and shellcheck are the real tools (a test fails on ANY output: both only
warn for some defects); the installed serve program itself runs (the host's /usr/bin/python3,
as the unit runs it) wherever it gets no further than the files, i.e. before its first docker
call. Install and render are driven through the
CLI and the Python API against temporary roots; bad inputs must leave the tree byte-for-byte as
it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from plugins.cli import invoke

from appliance import models, profiles, units
from appliance.dev import generate
from appliance.engine import devmodel
from appliance.errors import UsageError
from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.models import verify as model_verify
from appliance.models import where
from appliance.oci import labels
from appliance.profiles.validate import ProfileError
from appliance.serve import argsfile, container, docker, environment
from appliance.units import engine_args, instance, template, timing

REPO = Path(__file__).resolve().parents[1]
# The profiles whose units are committed examples (the hand-made ones and the seed hosts');
# the other generated profiles render the same units with other figures.
SHIPPED = sorted(n for n, p in profiles.examples().items() if p.multinode is None)
EVERY = sorted(n for n, p in profiles.all_profiles().items() if p.multinode is None)
MIG = "mig24-e4b-mtp"


@pytest.fixture(scope="session")
def no_docker_path(tmp_path_factory) -> str:
    """A PATH without docker (whatever the host has installed): the serve program needs no
    other tool, so it stops at its first docker call."""
    return str(tmp_path_factory.mktemp("no-docker-bin"))


def opts_for(name: str, **kw) -> units.Options:
    if name == MIG:
        kw.setdefault("gpus", "device=0:1")
    return units.Options(**kw)


def run(*args: str):
    return invoke(list(args), code=None)


def snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under root: bytes, mode and mtime (an unchanged tree has equal snapshots).
    A lock file only by its mode: each holder (an install too) writes its PID into it."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix == ".lock" and path.parent.name == "locks":
            out[str(path.relative_to(root))] = (b"", path.stat().st_mode, 0)
        elif path.is_file():
            st = path.stat()
            out[str(path.relative_to(root))] = (path.read_bytes(), st.st_mode, st.st_mtime_ns)
    return out


def of_kind(text: str, kind: str) -> list[str]:
    """One list of an args file as the serve program reads it (``profile``: the profile)."""
    args = argsfile.parse(text, "args")
    return [args.profile] if kind == "profile" else list(getattr(args, kind.replace("-", "_")))


def serve(root: Path, name: str, command: str, path: str, **env: str):
    """The installed serve script, run as the unit runs it: the env file's values in its
    environment (systemd's EnvironmentFile=), ``env`` on top, files under ``root``, and ``path``
    as PATH."""
    values = envfile.read(Layout(root).env_file(name)).values
    return subprocess.run(
        [str(Layout(root).serve_program), name, command],
        env={**values, **env, "PATH": path, "APPLIANCE_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- golden examples ---------------------------------------------------------------------------


def test_committed_examples_match_what_the_profiles_render():
    units_source = [src for src in generate.sources() if src.name == "units"]
    assert generate.check(REPO, only=units_source) == [], generate.FIX


def test_every_shipped_profile_has_committed_env_and_args_and_one_script_serves_all():
    for name in SHIPPED:
        assert (REPO / "systemd" / "env" / f"{name}.env").is_file()
        assert (REPO / "systemd" / "args" / f"{name}.args").is_file()
    assert (REPO / "systemd" / "gemma4-vllm@.service").is_file()
    # One serve script, read where it lives: no rendered per-instance copies anywhere.
    assert not (REPO / "scripts" / "serve").exists()
    assert template.serve_program().startswith(b"#!/usr/bin/python3 -IS\n")


# --- the serve script: shellcheck, and the facts it shares with Python ----------------------------


def shellcheck(path: Path) -> subprocess.CompletedProcess:
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (scripts/setup-system.sh)")
    return subprocess.run(["shellcheck", str(path)], check=False, capture_output=True, text=True)


def test_committed_scripts_pass_shellcheck():
    for script in sorted((REPO / "scripts").rglob("*.sh")):
        proc = shellcheck(script)
        assert (proc.returncode, proc.stdout + proc.stderr) == (0, ""), script


def test_shellcheck_is_not_vacuous(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/bin/bash\nargs=(a "b c")\nexec docker ${args[@]}\n')
    assert "SC2068" in shellcheck(bad).stdout


# --- systemd-analyze verify ----------------------------------------------------------------------


def verify_root(tmp_path: Path) -> Path:
    """A root holding the host's own unit files, so verify resolves docker.service and friends."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    return root


def verify(root: Path, *names: str) -> subprocess.CompletedProcess:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed (scripts/setup-system.sh)")
    # A template is verified through an instance name: that resolves %i in every path.
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *map(units.unit_name, names)],
        check=False,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_installed_unit_passes_systemd_analyze_verify_silently(tmp_path, name):
    root = verify_root(tmp_path)
    units.install(name, name, root=root, options=opts_for(name))
    proc = verify(root, name)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_two_instances_of_two_profiles_share_one_serve_script(tmp_path):
    root = verify_root(tmp_path)
    units.install("l4x4-31b-mtp", "big", root=root)
    units.install("cpu-tiny", "small", root=root, options=units.Options(port=8123))
    libexec = root / "usr/local/libexec/gemma4-vllm"
    assert [p.name for p in libexec.iterdir()] == ["serve"]
    assert (libexec / "serve").read_bytes() == template.serve_program()
    # One unit; each instance has only its mounts drop-in.
    unit_files = sorted(p.name for p in (root / "etc/systemd/system").glob("gemma4-vllm@*"))
    dropins = [f"gemma4-vllm@{i}.service.d" for i in ("big", "small")]
    assert unit_files == ["gemma4-vllm@.service", *dropins]
    for name, profile, port in (("big", "l4x4-31b-mtp", "8050"), ("small", "cpu-tiny", "8123")):
        env = envfile.read(Layout(root).env_file(name))
        assert (env.get("APPLIANCE_PROFILE"), env.get("VLLM_PORT")) == (profile, port)
        args = Layout(root).args_file(name).read_text()
        assert of_kind(args, "profile") == [profile]
    proc = verify(root, "big", "small")
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_verify_is_not_vacuous(tmp_path):
    """The same check reports an instance whose serve script is not executable."""
    root = verify_root(tmp_path)
    units.install("cpu-tiny", "a", root=root)
    Layout(root).serve_program.chmod(0o644)
    proc = verify(root, "a")
    assert "gemma4-vllm/serve is not executable" in proc.stdout + proc.stderr


# --- what the files say ------------------------------------------------------------------------


def test_unit_runs_the_one_script_with_the_instance_its_env_file_restart_policy_and_timeout():
    unit = files_of_render("l4x4-31b-mtp", "x")["unit"]
    serve_path = "/usr/local/libexec/gemma4-vllm/serve"
    for line in (
        "Type=exec",
        "EnvironmentFile=/etc/gemma4-vllm/%i.env",
        f"ExecStartPre={serve_path} %i remove",
        f"ExecStart={serve_path} %i run",
        f"ExecStartPost={serve_path} %i wait-healthy",
        f"ExecStop={serve_path} %i stop",
        f"ExecStopPost=-{serve_path} %i remove",
        # always: vLLM exits 0 when its engine core dies (vllm#48966).
        "Restart=always",
        "RestartPreventExitStatus=78",
    ):
        assert line in unit.splitlines(), line
    timeout = next(x for x in unit.splitlines() if x.startswith("TimeoutStartSec="))
    assert int(timeout.split("=")[1]) >= 2 * 471  # the seed's 31B load, with margin
    # The unit is the same for every instance and profile: nothing of a profile is in it.
    assert files_of_render("cpu-tiny", "y")["unit"] == unit


def unit_settings(unit: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of a unit (the last assignment of a key wins, as in systemd)."""
    out = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out[key] = value
    return out


@pytest.mark.parametrize("name", SHIPPED)
def test_the_start_limit_trips_when_every_start_fails_slowly(name):
    """systemd counts starts in a fixed window of StartLimitIntervalSec and refuses the start
    after StartLimitBurst of them. The slowest crash loop: each start hangs to TimeoutStartSec,
    then waits RestartSec. The start after the burst must still fall inside the window (with
    margin for the stop commands), or a broken image is reloaded forever."""
    unit = unit_settings(files_of_render(name, "x")["unit"])
    burst = int(unit["StartLimitBurst"])
    interval = int(unit["StartLimitIntervalSec"])
    start_timeout, restart_sec = int(unit["TimeoutStartSec"]), int(unit["RestartSec"])
    stop_timeout = int(unit["TimeoutStopSec"])
    # Starts of the slowest loop, relative to the first; the last is the one to refuse.
    starts = [k * (start_timeout + restart_sec) for k in range(burst + 1)]
    assert starts[-1] < interval, (burst, interval, start_timeout, restart_sec)
    # The margin covers a stop that takes its whole timeout after each hung start.
    assert starts[-1] + burst * stop_timeout <= interval
    assert 2 <= burst <= 5  # a transient failure gets a retry; a broken image few reloads
    rendered = timing.unit_timing()
    assert (
        interval
        == timing.start_limit_interval(
            rendered.start_timeout_s, rendered.restart_sec, rendered.start_limit_burst
        )
        == burst * (start_timeout + restart_sec) + timing.START_LIMIT_MARGIN_S
    )


def security_exposure(root: Path, name: str) -> tuple[float, str]:
    """``systemd-analyze security --offline=yes`` of instance ``name``: (exposure, output)."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed (scripts/setup-system.sh)")
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}",
         "--no-pager", units.unit_name(name)],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert m, out
    return float(m.group(1)), out


def test_the_unit_is_hardened_to_an_exposure_of_at_most_2_5(tmp_path):
    root = verify_root(tmp_path)
    units.install("cpu-tiny-mtp", "x", root=root)
    exposure, out = security_exposure(root, "x")
    print(f"\nsystemd-analyze security --offline=yes: exposure {exposure}")
    assert exposure <= 2.5, out
    unit = Layout(root).unit_template.read_text()
    settings = unit_settings(unit)
    # The probe reaches loopback only; the Docker socket and the probe's families, nothing else.
    assert (settings["IPAddressDeny"], settings["IPAddressAllow"]) == ("any", "localhost")
    assert settings["RestrictAddressFamilies"] == "AF_UNIX AF_INET AF_INET6"
    assert settings["CapabilityBoundingSet"] == "" and settings["ProtectSystem"] == "strict"
    # One directive a line, each of the [Service] section's settings preceded by its reason
    # somewhere above in a comment block: no bare trailing settings after a blank line.
    assert all(" " not in k for k in settings), settings
    # Not vacuous: the same unit without its hardening scores as the review found (9.4 UNSAFE).
    bare = "\n".join(
        ln for ln in unit.splitlines()
        if not ln.startswith(tuple(HARDENING)) and not ln.startswith("NoNewPrivileges=")
    )  # fmt: skip
    Layout(root).unit_template.write_text(bare + "\n")
    assert security_exposure(root, "x")[0] > 9.0


HARDENING = (
    "CapabilityBoundingSet=", "AmbientCapabilities=", "ProtectSystem=", "ProtectHome=",
    "PrivateTmp=", "PrivateMounts=", "PrivateDevices=", "ProtectKernel", "ProtectControlGroups=",
    "ProtectClock=", "ProtectHostname=", "ProtectProc=", "ProcSubset=", "RestrictNamespaces=",
    "RestrictRealtime=", "RestrictSUIDSGID=", "LockPersonality=", "MemoryDenyWriteExecute=",
    "KeyringMode=", "SystemCall", "RestrictAddressFamilies=", "IPAddress", "UMask=",
)  # fmt: skip


def files_of_render(profile: str, name: str) -> dict[str, str]:
    files = units.render(profile, name, opts_for(profile))
    rel = Layout(Path())
    paths = {"unit": rel.unit_template, "env": rel.env_file(name), "args": rel.args_file(name)}
    return {role: files[str(path)].content for role, path in paths.items()}


def test_args_carry_the_profile_flags_and_mtp_only_as_mtp_records():
    f = files_of_render(MIG, "m0")
    serve_args = of_kind(f["args"], "serve")
    assert serve_args[serve_args.index("--max-num-batched-tokens") + 1] == "4096"
    assert "--enable-prefix-caching" in serve_args
    # Host and port are the env file's (the operator's): the script adds them from there.
    assert "--host" not in serve_args and "--port" not in serve_args
    assert "VLLM_HOST=127.0.0.1" in f["env"].splitlines()
    assert of_kind(f["args"], "mtp")[0] == "--speculative-config"
    assert "--speculative-config" not in serve_args
    # One GPU: a private /dev/shm (only tensor-parallel GPU profiles share the host's IPC).
    assert "--shm-size" in of_kind(f["args"], "docker")
    assert of_kind(f["args"], "require") == ["VLLM_GPUS", "HF_CACHE_DIR", "VLLM_CACHE_DIR"]
    cpu = files_of_render("cpu-tiny-mtp", "c")
    cpu_docker = of_kind(cpu["args"], "docker")
    assert cpu_docker[cpu_docker.index("--shm-size") + 1] == "1g"
    assert of_kind(cpu["args"], "serve")[0] == "/models/target"
    assert of_kind(cpu["args"], "mtp") == [
        "--speculative-config",
        '{"method":"mtp","model":"/models/drafter","num_speculative_tokens":2}',
    ]
    assert of_kind(cpu["args"], "per-request") == ["--per-request-spec-decode-metrics", "detailed"]
    assert "VLLM_GPUS" not in of_kind(cpu["args"], "require")
    # The baseline profile has no speculative decoding records at all.
    base = files_of_render("l4x4-31b", "b")["args"]
    assert of_kind(base, "mtp") == [] and of_kind(base, "per-request") == []


def test_args_records_are_the_profiles_exact_serve_arguments():
    for name in EVERY:
        prof = profiles.get(name)
        dm = "/models" if prof.uses_devmodel else None
        args = files_of_render(name, "e")["args"]
        expected = prof.serve_args(devmodel=dm, speculative=False)
        i = expected.index("--host")
        del expected[i : i + 4]  # --host H --port P: from the env file
        # Then the media guard (tests/test_profile_args.py).
        expected += ["--allowed-media-domains", engine_args.MEDIA_DOMAIN_NONE]
        assert of_kind(args, "serve") == expected, name
        assert of_kind(args, "mtp") == prof.speculative_args(devmodel=dm), name


def test_the_api_key_reaches_docker_on_stdin_or_by_name_never_as_a_value(tmp_path):
    key_file = tmp_path / "k.api-key"
    args = engine_args.serve_args(profiles.get("cpu-tiny-mtp"), ["MODEL_DIR"])
    settings = environment.Settings("img:1", "127.0.0.1", 8000, None, "/m", None, None)
    stdin_image = {labels.API_KEY_STDIN: "true", labels.MTP: "true"}
    cmd = container.command("k", args, settings, stdin_image, "s3cret", key_file)
    assert (cmd.stdin, cmd.key, cmd.env) == (key_file, "s3cret", {})
    assert "s3cret" not in repr(cmd)
    assert cmd.argv[cmd.argv.index("--interactive") + 2] == f"{labels.API_KEY_STDIN_ENV}=1"
    old = container.command("k", args, settings, {labels.MTP: "true"}, "s3cret", key_file)
    assert (old.stdin, old.env) == (None, {"VLLM_API_KEY": "s3cret"})
    assert old.argv[old.argv.index("VLLM_API_KEY") - 1] == "--env"
    assert "older appliance" in " ".join(old.notes)
    for c in (cmd, old):
        assert not [a for a in c.argv if "s3cret" in a or a.startswith("--api-key")]
    keyless = container.command("k", args, settings, stdin_image, None, key_file)
    assert (keyless.stdin, keyless.key, keyless.env) == (None, None, {})
    assert "--interactive" not in keyless.argv


def test_the_container_stdin_holds_the_checked_key_alone(tmp_path):
    """What the serve program hands the image's entry point: the key its file holds by the one
    rule (CRLF and spaces around it are not part of it), then the end of the input."""
    from appliance.host import apikey
    from appliance.serve.main import key_pipe

    key_file = tmp_path / "k.api-key"
    key_file.write_bytes(b"\r\n  s3cret-Key_1 \t\r\n")
    fd = key_pipe(apikey.read(key_file))
    with os.fdopen(fd, "rb") as stdin:
        assert stdin.read() == b"s3cret-Key_1"


def test_the_queue_bound_reaches_only_an_image_whose_vllm_has_the_flag(tmp_path):
    # rtx5090x2-31b-fp8-mtp states max_num_seqs = 1: a bound of 2 (vLLM >= 0.29 has the flag).
    args = engine_args.serve_args(profiles.get("rtx5090x2-31b-fp8-mtp"), [])
    assert args.queue == ("--max-num-queued-reqs", "2")
    assert "--max-num-queued-reqs" not in args.serve
    assert argsfile.parse(args.to_json("x"), "x.args") == args  # the args file keeps it
    settings = environment.Settings("img:1", "127.0.0.1", 8000, "all", None, "/hf", None)

    def run(vllm: str | None):
        image = {labels.MTP: "true"} | ({labels.VLLM_VERSION: vllm} if vllm else {})
        return container.command("i", args, settings, image, None, tmp_path / "k")

    new = run("0.32.0")
    assert new.argv[-4:-2] == ["--max-num-queued-reqs", "2"]
    assert "queue bound --max-num-queued-reqs 2: 503 past it" in new.notes
    for old, shown in (("0.21.0", "0.21.0"), (None, "unlabelled")):
        cmd = run(old)
        assert "--max-num-queued-reqs" not in cmd.argv
        assert f"image's vLLM {shown} has no --max-num-queued-reqs (needs >= 0.29.0)" in (
            " ".join(cmd.notes)
        )
    # A profile without a bound says nothing about it.
    unbounded = dataclasses.replace(profiles.get("l4x4-31b-mtp"), max_num_seqs=None)
    plain = engine_args.serve_args(unbounded, [])
    cmd = container.command("i", plain, settings, {labels.VLLM_VERSION: "0.32.0"}, None, tmp_path)
    assert "--max-num-queued-reqs" not in cmd.argv and "queue" not in " ".join(cmd.notes)


def test_a_stop_lets_in_flight_requests_finish_on_an_image_whose_vllm_can(tmp_path):
    """vLLM's SIGTERM aborts in-flight requests unless --shutdown-timeout says how long they may
    finish (0.18 and later); the unit's stop grace leaves vLLM its teardown after that."""
    args = engine_args.serve_args(profiles.get("l4x4-31b-mtp"), [])
    settings = environment.Settings("img:1", "127.0.0.1", 8000, "all", None, "/hf", None)

    def run(vllm: str | None):
        image = {labels.MTP: "true"} | ({labels.VLLM_VERSION: vllm} if vllm else {})
        return container.command("i", args, settings, image, None, tmp_path / "k")

    assert 0 < docker.DRAIN_S < docker.STOP_GRACE_S
    for version in ("0.19.0", "0.32.0+cpu"):
        cmd = run(version)
        assert cmd.argv[-2:] == ["--shutdown-timeout", str(docker.DRAIN_S)], version
        assert (
            f"a stop lets in-flight requests finish for up to {docker.DRAIN_S} s "
            f"(--shutdown-timeout {docker.DRAIN_S})"
        ) in cmd.notes
    for old, shown in (("0.17.1", "0.17.1"), (None, "unlabelled")):
        cmd = run(old)
        assert "--shutdown-timeout" not in cmd.argv
        assert (
            f"image's vLLM {shown} has no --shutdown-timeout (needs >= 0.18.0): a stop ends "
            "in-flight requests at once"
        ) in cmd.notes


@pytest.mark.parametrize("parent", ["as systemd starts it", "with sigterm blocked"])
def test_a_wait_for_the_engine_ends_cleanly_on_the_stops_sigterm(tmp_path, parent):
    """A stop while the unit is still `activating` skips ExecStop and sends SIGTERM to the
    unit's processes, ExecStartPost's wait among them: the wait exits 0 with a line (killed by
    the signal, it failed the stop: Result=signal, seen under systemd). A process started with
    SIGTERM blocked keeps it blocked across exec; the wait then never saw the stop and waited on
    (how a CI run's wait looked: still waiting 150 s after its SIGTERM). It unblocks it, and a
    SIGTERM that came while it was blocked (sent here before the wait set anything) ends it as
    cleanly: delivered at the unblock, it once escaped the wait's handling (exit 1, a traceback)."""
    import signal

    from plugins import processes
    from plugins.http_servers import loading_health

    from appliance.engine.local import free_port

    port = free_port()
    units.install("cpu-tiny", "w", root=tmp_path, options=units.Options(port=port))
    values = envfile.read(Layout(tmp_path).env_file("w")).values
    env = {**values, "PATH": os.environ["PATH"], "APPLIANCE_ROOT": str(tmp_path)}
    argv = [str(Layout(tmp_path).serve_program), "w", "wait-healthy"]
    blocked = {signal.SIGTERM} if parent == "with sigterm blocked" else set()
    with loading_health(port):
        before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # what the child inherits
        try:
            wait = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        try:
            if not blocked:  # once /proc shows its handler: a request to the stand-in says less
                handler_set = processes.until(
                    lambda: processes.catches(wait.pid, signal.SIGTERM), 30
                )
                assert handler_set, f"the wait set no handler: {processes.signal_state(wait.pid)}"
            wait.send_signal(signal.SIGTERM)  # blocked: pending from the start
            _, err = wait.communicate(timeout=30)
        finally:
            if wait.poll() is None:
                wait.kill()
                wait.communicate()
    assert wait.returncode == 0, err
    assert "wait-healthy: the unit is stopping (SIGTERM), no longer waiting for vLLM" in err


def test_a_stop_turns_arrivals_away_with_503_only_on_an_image_with_the_stop_gate(tmp_path):
    """The stop gate is a module inside the image: passed to an image labelled as carrying it,
    never to an older one (vLLM would fail its start on the import), nor to a headless worker."""
    settings = environment.Settings("img:1", "127.0.0.1", 8000, "all", None, "/hf", None)
    gate = ["--middleware", "stop_gate.StopGate"]
    assert labels.STOP_GATE_MIDDLEWARE == "stop_gate.StopGate"  # the file the Dockerfiles copy
    head = engine_args.serve_args(profiles.get("l4x4-31b-mtp"), [])
    image = {labels.MTP: "true", labels.VLLM_VERSION: "0.32.0"}

    labelled = image | {labels.STOP_GATE: "true"}
    new = container.command("i", head, settings, labelled, None, tmp_path)
    assert new.argv[-2:] == gate and new.argv.count("--middleware") == 1
    assert new.argv[-4:-2] == ["--shutdown-timeout", str(docker.DRAIN_S)]
    assert (
        "from a stop's SIGTERM on, new requests and /health get 503 with Retry-After "
        "(--middleware stop_gate.StopGate)"
    ) in new.notes
    for old in (image, image | {labels.STOP_GATE: "false"}):
        cmd = container.command("i", head, settings, old, None, tmp_path)
        assert "--middleware" not in cmd.argv
        assert (
            f"image img:1 is not labelled {labels.STOP_GATE}=true (built by an older appliance):"
            " during a stop, new requests get vLLM's HTTP 500 and /health answers 200; rebuild "
            "the image with `appliance image build`"
        ) in cmd.notes
    worker = argsfile.ServeArgs(profile="p", serve=("/models/t", "--headless"))
    cmd = container.command("i", worker, settings, labelled, None, tmp_path)
    assert "--middleware" not in cmd.argv
    assert not [n for n in cmd.notes if "/health" in n]


# --- profile strings are data, never code -------------------------------------------------------

MARK = "/tmp/gemma4-units-pwned"


def hostile(**changes) -> profiles.Profile:
    return dataclasses.replace(profiles.get("cpu-tiny-mtp"), **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"host": f"$(id>{MARK})"}, "is not an IP address or host name"),
        ({"host": "-x"}, "is not an IP address or host name"),
        ({"description": "tiny\nVLLM_IMAGE=evil:1"}, "description must be one line"),
        ({"name": "a b"}, "invalid profile name"),
        ({"name": "x\nVLLM_IMAGE=evil:1"}, "invalid profile name"),
        ({"env": {"A;id": "1"}}, "invalid environment variable name"),
        ({"env": {"A": "1\nVLLM_IMAGE=evil:1"}}, "cannot be passed as one argument"),
        ({"served_model_name": "tiny\nmtp --evil"}, "cannot be passed as one argument"),
        ({"extra_args": (" --lead-space",)}, "cannot be passed as one argument"),
        ({"port": 0}, "is not a TCP port"),
        ({"extra_args": ("--port=9",)}, "extra_args sets --port"),
        ({"extra_args": ("--shutdown-timeout", "5")}, "extra_args sets --shutdown-timeout"),
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, dict) else None,
)
def test_a_profile_string_that_could_be_code_is_refused(tmp_path, changes, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        units.install(hostile(**changes), "h", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


SHELL_TOKENS = (
    f"$(touch {MARK}-1)",
    f"`touch {MARK}-2`",
    f"x'; touch {MARK}-3; '",
    f'x"; touch {MARK}-4; "',
    f"a b && touch {MARK}-5 # c \\",
)


def test_shell_in_profile_tokens_is_one_argument_and_never_runs(tmp_path, no_docker_path):
    """Tokens a profile may hold (a served name, extra flags, env values) reach the args file
    verbatim, each one record; the real script reads them without running any of them."""
    for mark in Path("/tmp").glob("gemma4-units-pwned*"):
        mark.unlink()
    prof = hostile(
        served_model_name=SHELL_TOKENS[0],
        extra_args=SHELL_TOKENS[1:],
        env={"EVIL": SHELL_TOKENS[0]},
    )
    units.install(prof, "h", root=tmp_path, options=units.Options(model_dir=str(tmp_path)))
    args = Layout(tmp_path).args_file("h").read_text()
    serve_args = of_kind(args, "serve")
    assert serve_args[serve_args.index("--served-model-name") + 1] == SHELL_TOKENS[0]
    # The profile's extra flags, then the media guard every args file ends with.
    assert serve_args[-len(SHELL_TOKENS) - 1 : -2] == list(SHELL_TOKENS[1:])
    assert f"EVIL={SHELL_TOKENS[0]}" in of_kind(args, "docker")
    env_text = Layout(tmp_path).env_file("h").read_text()
    assert "touch" not in env_text
    assert "touch" not in Layout(tmp_path).unit_template.read_text()
    # The real script reads every record, checks the env, then stops at its first docker call.
    proc = serve(tmp_path, "h", "print", no_docker_path)
    assert proc.returncode == 78, proc.stderr
    assert "no docker client" in proc.stderr
    assert not list(Path("/tmp").glob("gemma4-units-pwned*"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("VLLM_HOST", f"$(touch {MARK})", "is not an IP address or host name"),
        ("VLLM_PORT", "80;id", "is not a TCP port"),
        ("VLLM_PORT", "70000", "is not a TCP port"),
        ("VLLM_IMAGE", f"x$(touch {MARK})", "is not a valid image reference"),
        ("VLLM_CACHE_DIR", "/tmp/a b", "is not a plain absolute path"),
        ("MODEL_DIR", "/var/tmp/gemma4-no-such-dir", "the unit has a private /tmp"),
        ("VLLM_GPUS", "all;id", "invalid GPU selection 'all;id'"),
        ("APPLIANCE_PROFILE", "cpu-tiny", "but the args file is profile cpu-tiny-mtp"),
        ("VLLM_HOST", "", "VLLM_HOST is not set"),
    ],
)
def test_a_bad_env_value_is_a_configuration_error_before_docker(
    tmp_path, no_docker_path, key, value, message
):
    units.install("cpu-tiny-mtp", "e", root=tmp_path, options=units.Options(model_dir="/tmp"))
    proc = serve(tmp_path, "e", "print", no_docker_path, **{key: value})
    assert proc.returncode == 78 and proc.stdout == "", proc.stderr
    assert message in proc.stderr and key in proc.stderr
    assert not Path(MARK).exists()


@pytest.mark.parametrize(
    ("profile", "key"), [("cpu-tiny-mtp", "MODEL_DIR"), ("l4x4-31b-mtp", "HF_CACHE_DIR")]
)
def test_a_model_folder_not_there_yet_is_a_failure_the_unit_retries(
    tmp_path, no_docker_path, profile, key
):
    """Review S11: models on a file system mounted late (NFS, a `nofail` disk) exited 78 at
    boot, which the unit never restarts. A folder that is not there at all is exit 75 now; the
    unit restarts on anything but 78 (tests/test_units_edges_systemd.py shows systemd doing it),
    and its drop-in makes systemd mount the folders before it starts the instance."""
    late = "/srv/gemma4-not-mounted-yet/models"
    units.install(profile, "e", root=tmp_path, options=units.Options(**{key.lower(): late}))
    proc = serve(tmp_path, "e", "run", no_docker_path, **{key: late})
    assert proc.returncode == 75, proc.stderr
    assert f"{key}={late}" in proc.stderr and "is not a directory (yet?)" in proc.stderr
    dropin = Layout(tmp_path).mounts_dropin("e").read_text()
    assert re.search(rf"^RequiresMountsFor={re.escape(late)} ", dropin, re.MULTILINE), dropin
    unit = unit_settings(Layout(tmp_path).unit_template.read_text())
    assert (unit["Restart"], unit["RestartPreventExitStatus"]) == ("always", "78")


def test_a_missing_or_foreign_args_file_is_a_configuration_error(tmp_path, no_docker_path):
    units.install("cpu-tiny", "e", root=tmp_path)
    args = Layout(tmp_path).args_file("e")
    good = json.loads(args.read_text())
    for change, says in (
        ({"format": 3}, "has format 3, this serve program reads 2"),
        ({"exec": ["rm -rf /"]}, "unknown field(s) exec"),
        ({"require": ["PATH"]}, "requires 'PATH'"),
        ({"serve": "x y"}, "serve = 'x y': expected a list of arguments"),
        ({"docker": ["--a", 7]}, "docker[1] 7 cannot be passed as one argument"),
        ({"models": [{"role": "target", "layout": "dir"}]}, "bad model record"),
    ):
        args.write_text(json.dumps({**good, **change}))
        proc = serve(tmp_path, "e", "print", no_docker_path)
        assert (proc.returncode, proc.stdout) == (78, ""), change
        assert says in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.rstrip().endswith("(appliance instance install e)"), proc.stderr
    args.write_text("{ not json")
    assert "is not valid JSON" in serve(tmp_path, "e", "print", no_docker_path).stderr
    args.unlink()
    proc = serve(tmp_path, "e", "print", no_docker_path)
    assert proc.returncode == 78 and "cannot read" in proc.stderr


def test_the_script_refuses_a_bad_instance_name_or_command(tmp_path):
    units.install("cpu-tiny", "e", root=tmp_path)
    script = str(Layout(tmp_path).serve_program)
    for argv in (["../e", "print"], ["e"], ["e", "explode"], ["$(id)", "run"]):
        proc = subprocess.run([script, *argv], capture_output=True, text=True, check=False)
        assert proc.returncode == 2 and "usage:" in proc.stderr, argv


# --- install: modes, idempotence, kept values ----------------------------------------------------


def test_install_writes_every_file_with_its_mode(tmp_path, cli_run):
    argv = ["instance", "install", "t1", "--profile", "cpu-tiny-mtp", "--root", str(tmp_path)]
    # No Docker to choose an image from: the CPU build's latest, and a warning that it floats.
    result = cli_run(argv, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert (
        "warning: no cpu appliance image (no Docker engine answered) for profile cpu-tiny-mtp: "
        "VLLM_IMAGE=gemma4-vllm:latest-cpu, a tag `appliance image build` moves"
    ) in result.stderr
    p = Layout(tmp_path)
    want = {
        p.unit_template: 0o644,
        p.env_file("t1"): 0o644,
        p.args_file("t1"): 0o644,
        p.serve_program: 0o755,
        p.api_key_file("t1"): 0o600,
    }
    assert {path: path.stat().st_mode & 0o777 for path in want} == want
    key = p.api_key_file("t1").read_text().strip()
    assert len(key) >= 32
    assert key not in result.output
    env = envfile.read(p.env_file("t1"))
    assert env.get("VLLM_IMAGE") == "gemma4-vllm:latest-cpu"
    assert not list(tmp_path.rglob(".*.tmp"))  # no temporary file left behind


def test_install_is_idempotent(tmp_path):
    units.install("l4x4-31b-mtp", "ref", root=tmp_path)
    before = snapshot(tmp_path)
    result = units.install("l4x4-31b-mtp", "ref", root=tmp_path)
    # the unit, its mounts drop-in, serve script, env, args, key, the state service and timer
    # and the scrape targets
    assert result.written == [] and result.removed == [] and len(result.unchanged) == 9
    assert snapshot(tmp_path) == before
    cli_result = run("instance", "install", "-p", "l4x4-31b-mtp", "ref", "--root", str(tmp_path))
    assert "wrote" not in cli_result.output and snapshot(tmp_path) == before


def test_install_keeps_the_image_values_host_and_port_already_there(tmp_path):
    units.install(
        "cpu-tiny-mtp",
        "c",
        root=tmp_path,
        options=units.Options(port=8123, host="::1", model_dir="/srv/tiny"),
    )
    env_path = Layout(tmp_path).env_file("c")
    key_before = Layout(tmp_path).api_key_file("c").read_bytes()
    # What a cutover does: rewrite the one assignment.
    env_path.write_bytes(envfile.read(env_path).with_value("VLLM_IMAGE", "gemma4-vllm:pre-mtp"))
    # No --profile: the one the env file names.
    assert run("instance", "install", "c", "--root", str(tmp_path)).exit_code == 0
    inst = instance.read(tmp_path, "c")
    assert (inst.image, inst.host, inst.port) == ("gemma4-vllm:pre-mtp", "::1", 8123)
    assert inst.base_url == "http://[::1]:8123"
    assert envfile.read(env_path).get("MODEL_DIR") == "/srv/tiny"
    assert Layout(tmp_path).api_key_file("c").read_bytes() == key_before
    # An explicit --image is the operator saying so: it wins.
    units.install(
        "cpu-tiny-mtp", "c", root=tmp_path, options=units.Options(image="gemma4-vllm:mtp")
    )
    assert instance.read(tmp_path, "c").image == "gemma4-vllm:mtp"


def test_the_compile_cache_is_rebuildable_data_under_var_cache_and_an_old_one_is_kept(
    tmp_path, cli_run
):
    """vLLM's compile cache is data the engine rebuilds (FHS: /var/cache, beside the image
    build's cache; issue 56 E17). An instance installed with the old default keeps its folder on
    re-install: a moved default must not cost it a cold compile of minutes at the next start."""
    no_docker = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    argv = ["instance", "install", "c", "--profile", "cpu-tiny-mtp", "--root", str(tmp_path)]
    cli_run(argv, env=no_docker)
    layout = Layout(tmp_path)
    env_path, mounts = layout.env_file("c"), layout.mounts_dropin("c")
    new = "/var/cache/gemma4-appliance/vllm/c"
    assert envfile.read(env_path).get("VLLM_CACHE_DIR") == new
    assert f"RequiresMountsFor=/var/lib/gemma4-vllm/models/tiny {new}\n" in mounts.read_text()
    # Named, never made: docker makes it at the first start, on the host; --root writes its tree.
    assert not (tmp_path / "var" / "cache").exists() and not Path(new).exists()
    old = "/var/lib/gemma4-vllm/cache/c"
    env_path.write_bytes(envfile.read(env_path).with_value("VLLM_CACHE_DIR", old))
    cli_run(["instance", "install", "c", "--root", str(tmp_path)], env=no_docker)
    assert envfile.read(env_path).get("VLLM_CACHE_DIR") == old
    assert f"RequiresMountsFor=/var/lib/gemma4-vllm/models/tiny {old}\n" in mounts.read_text()


def test_a_second_instance_of_a_profile_gets_the_next_free_port_recorded_in_its_env(tmp_path):
    # the MIG profile is meant for four slices per card, one instance each.
    ports = []
    for n in range(4):
        result = run(
            "install", f"s{n}", "-p", MIG, "--gpus", f"device=0:{n}", "--root", str(tmp_path)
        )
        assert result.exit_code == 0, result.output
        ports.append(instance.read(tmp_path, f"s{n}").port)
    base = profiles.get(MIG).port
    assert ports == [base, base + 1, base + 2, base + 3]
    assert envfile.read(Layout(tmp_path).env_file("s1")).get("VLLM_PORT") == str(base + 1)
    # A re-install keeps each instance's own port.
    assert run("instance", "install", "s1", "--root", str(tmp_path)).exit_code == 0
    assert instance.read(tmp_path, "s1").port == base + 1


def test_an_explicit_port_another_instance_serves_on_is_refused_and_nothing_written(tmp_path):
    assert (
        run("instance", "install", "a", "-p", "cpu-tiny-mtp", "--root", str(tmp_path)).exit_code
        == 0
    )
    port = instance.read(tmp_path, "a").port
    before = snapshot(tmp_path)
    result = run(
        "instance",
        "install",
        "b",
        "-p",
        "cpu-tiny-mtp",
        "--port",
        str(port),
        "--root",
        str(tmp_path),
    )
    assert result.exit_code == 2, result.output
    assert f"port {port} is already instance a's" in result.output
    assert f"--port {port + 1}" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before


def test_install_prints_enable_now_on_a_first_install_and_restart_after(tmp_path):
    first = run("instance", "install", "f", "-p", "cpu-tiny-mtp", "--root", str(tmp_path))
    assert (
        "next: systemctl daemon-reload && systemctl enable --now gemma4-vllm@f.service"
        in first.output
    )
    # Never enabled: a change is still `enable --now` (restart would leave it off at boot).
    changed = run("instance", "install", "f", "--image", "gemma4-vllm:1", "--root", str(tmp_path))
    assert "systemctl enable --now gemma4-vllm@f.service" in changed.output
    link = Layout(tmp_path).wants_link("gemma4-vllm@f.service")  # what `systemctl enable` links
    link.parent.mkdir(parents=True)
    link.symlink_to("/etc/systemd/system/gemma4-vllm@.service")
    again = run("instance", "install", "f", "--image", "gemma4-vllm:mtp", "--root", str(tmp_path))
    assert (
        "next: systemctl daemon-reload && systemctl restart gemma4-vllm@f.service" in again.output
    )


def test_install_and_uninstall_json_are_the_write_record(tmp_path, cli_run):
    """--json where scripts act (ecosystem review E15; the fleet role reads install's): the files
    written, unchanged and removed, whether anything changed and install's next step, as one
    object on stdout, the same facts as the lines without it; a refusal stays one Error: line."""
    layout = Layout(tmp_path)
    argv = ["instance", "install", "j", "-p", "cpu-tiny-mtp", "--root", str(tmp_path)]
    first = json.loads(cli_run([*argv, "--json"]).stdout)
    assert (first["changed"], first["first_install"]) == (True, True)
    assert (first["unchanged"], first["removed"], first["devices"]) == ([], [], None)
    assert {str(layout.env_file("j")), str(layout.args_file("j"))} <= set(first["written"])
    assert first["next_step"] == (
        "systemctl daemon-reload && systemctl enable --now gemma4-vllm@j.service "
        "gemma4-appliance-state.timer"
    )
    text = cli_run(argv).stdout
    again = json.loads(cli_run([*argv, "--json"]).stdout)
    assert (again["changed"], again["written"], again["next_step"]) == (False, [], None)
    assert sorted(again["unchanged"]) == sorted(first["written"])
    assert text.splitlines() == [f"unchanged {path}" for path in again["unchanged"]]

    root = ["--root", str(tmp_path)]
    refused = cli_run(["instance", "install", "k", "-p", "nosuch", *root, "--json"], code=2)
    assert refused.stdout == "" and refused.stderr.startswith("Error: unknown profile 'nosuch'")
    gone = json.loads(cli_run(["instance", "uninstall", "j", *root, "--json"]).stdout)
    assert gone["changed"] and sorted(gone["removed"]) == sorted(first["written"])
    assert not layout.env_file("j").exists()


def _my_profile(tmp_path: Path, **edits: str) -> Path:
    """The operator's own copy of cpu-tiny-mtp under another name, max_model_len changed."""
    text = (Path(profiles.__file__).parent / "data" / "cpu-tiny-mtp.toml").read_text()
    text = text.replace('name = "cpu-tiny-mtp"', 'name = "mine-tiny"')
    text = text.replace("max_model_len = 512", "max_model_len = 384")
    for old, new in edits.items():
        text = text.replace(old, new)
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


def test_an_operators_profile_file_is_validated_installed_next_to_the_instance_and_read(
    tmp_path, monkeypatch
):
    mine = _my_profile(tmp_path)
    root = tmp_path / "root"
    monkeypatch.chdir(tmp_path)
    result = run("instance", "install", "m", "--profile", "./mine.toml", "--root", str(root))
    assert result.exit_code == 0, result.output
    copy = Layout(root).profile_copy("m")
    assert copy.read_bytes() == mine.read_bytes() and copy.stat().st_mode & 0o777 == 0o644
    assert envfile.read(Layout(root).env_file("m")).get("APPLIANCE_PROFILE") == "mine-tiny"
    inst = instance.read(root, "m")
    assert (inst.profile.name, inst.profile.max_model_len) == ("mine-tiny", 384)
    args = Layout(root).args_file("m").read_text()
    assert '"384"' in args
    # A re-install reads the installed copy (the operator's file may be gone by then).
    mine.unlink()
    before = snapshot(root)
    assert run("instance", "install", "m", "--root", str(root)).exit_code == 0
    assert snapshot(root) == before
    # profiles show/validate read a file too.
    copy_arg = str(copy)
    shown = run("profiles", "show", copy_arg)
    assert shown.exit_code == 0 and "--max-model-len 384" in shown.output
    assert run("profiles", "validate", copy_arg).output.startswith("mine-tiny: ok")
    # uninstall takes the copy with the instance.
    assert run("instance", "uninstall", "m", "--root", str(root)).exit_code == 0
    assert not copy.exists()


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"max_model_len = 384": "max_modl_len = 384"}, "unknown field(s) max_modl_len"),
        ({'name = "mine-tiny"': 'name = "cpu-tiny"'}, "is the name of a shipped profile"),
        ({"num_speculative_tokens = 2": "num_speculative_tokens = 0"}, "num_speculative_tokens"),
    ],
)
def test_a_bad_profile_file_is_one_line_and_nothing_is_written(tmp_path, edits, message):
    mine = _my_profile(tmp_path, **edits)
    root = tmp_path / "root"
    result = run("instance", "install", "m", "--profile", str(mine), "--root", str(root))
    assert result.exit_code in (1, 2), result.output
    assert message in result.output
    assert not root.exists() or not any(p.is_file() for p in root.rglob("*"))


def test_install_without_a_profile_needs_one_named_somewhere(tmp_path):
    result = run("instance", "install", "new", "--root", str(tmp_path))
    assert result.exit_code == 2
    assert "instance new names no profile" in result.output and "--profile" in result.output
    assert list(tmp_path.iterdir()) == []


def test_install_tightens_a_key_file_readable_by_others(tmp_path):
    units.install("cpu-tiny", "k", root=tmp_path)
    key = Layout(tmp_path).api_key_file("k")
    content = key.read_bytes()
    key.chmod(0o644)
    result = units.install("cpu-tiny", "k", root=tmp_path)
    assert key.stat().st_mode & 0o777 == 0o600 and key.read_bytes() == content
    assert key in result.written


def test_render_out_writes_the_same_tree_without_a_key(tmp_path):
    result = run(
        "instance", "render", "-p", MIG, "slice1", "--gpus", "device=0:1", "--out", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    p = Layout(tmp_path)
    assert p.unit_template.is_file() and p.serve_program.is_file()
    assert p.args_file("slice1").is_file()
    assert not p.api_key_file("slice1").exists()
    assert "VLLM_GPUS=device=0:1" in p.env_file("slice1").read_text()


# --- the instance record -------------------------------------------------------------------------


def test_the_instance_record_reads_the_env_file_once(tmp_path):
    units.install("l4x4-31b-mtp", "r", root=tmp_path, options=units.Options(host="0.0.0.0"))
    inst = instance.read(tmp_path, "r")
    assert inst.name == "r" and inst.profile.name == "l4x4-31b-mtp"
    assert (inst.unit, inst.container) == ("gemma4-vllm@r.service", "gemma4-vllm-r")
    assert (inst.host, inst.port, inst.base_url) == ("0.0.0.0", 8050, "http://127.0.0.1:8050")
    assert inst.served_model == "gemma-4-31b-it" and inst.image == units.DEFAULT_IMAGE
    assert inst.env_path == tmp_path / "etc/gemma4-vllm/r.env"
    assert inst.args_path == tmp_path / "etc/gemma4-vllm/r.args"
    assert inst.api_key() == (tmp_path / "etc/gemma4-vllm/r.api-key").read_text().strip()


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (("APPLIANCE_PROFILE", ""), "APPLIANCE_PROFILE is not set in"),
        (("APPLIANCE_PROFILE", "nope"), "unknown profile 'nope'"),
        (("VLLM_PORT", "80x0"), "VLLM_PORT='80x0' in"),
        (("VLLM_HOST", "a_b"), "VLLM_HOST='a_b' in"),
    ],
)
def test_the_instance_record_names_what_is_wrong(tmp_path, edit, error):
    units.install("cpu-tiny", "r", root=tmp_path)
    env_path = Layout(tmp_path).env_file("r")
    env_path.write_bytes(envfile.set_value(env_path.read_bytes(), *edit))
    with pytest.raises(UsageError, match=re.escape(error)):
        instance.read(tmp_path, "r")


# --- uninstall ----------------------------------------------------------------------------------


def test_uninstall_removes_the_instance_and_the_shared_files_with_the_last(tmp_path):
    units.install("l4x4-31b-mtp", "big", root=tmp_path)
    units.install("cpu-tiny", "small", root=tmp_path, options=units.Options(port=8123))
    layout = Layout(tmp_path)
    for name in ("big", "small"):  # what cutovers leave behind
        for path in (layout.history_file(name), layout.rollback_slot(name)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}\n")
    wants = tmp_path / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True)
    (wants / "gemma4-vllm@big.service").symlink_to("/etc/systemd/system/gemma4-vllm@.service")
    small_before = {
        k: v for k, v in snapshot(tmp_path).items() if "small" in k or "gemma4-vllm@." in k
    }

    result = run("instance", "uninstall", "big", "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    for rel in (
        "etc/gemma4-vllm/big.env",
        "etc/gemma4-vllm/big.args",
        "etc/gemma4-vllm/big.api-key",
    ):
        assert f"removed   {tmp_path / rel}" in result.output
        assert not (tmp_path / rel).exists()
    assert not os.path.lexists(wants / "gemma4-vllm@big.service")
    assert layout.history_file("big").exists() and layout.rollback_slot("big").exists()
    after = snapshot(tmp_path)
    assert {k: after[k] for k in small_before} == small_before  # the other instance untouched
    assert Layout(tmp_path).serve_program.exists()

    result = run("instance", "uninstall", "small", "--purge", "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert not layout.history_file("small").exists() and not layout.rollback_slot("small").exists()
    assert not (tmp_path / "usr/local/libexec/gemma4-vllm").exists()
    assert not Layout(tmp_path).unit_template.exists()
    assert layout.history_file("big").exists()  # big was not purged

    result = run("instance", "uninstall", "small", "--root", str(tmp_path))
    assert result.exit_code == 2 and "no instance small: no " in result.output


def test_uninstall_drops_the_instance_from_the_state_metrics_and_purge_leaves_the_tree_as_found(
    tmp_path,
):
    """What a host keeps after the last purge is what it had before the first install: the
    state textfile would otherwise show the instance serving on in Grafana, and a canary record
    or an empty folder would stay behind."""
    for folder in ("etc/systemd/system", "usr/local/bin", "var/lib"):  # a host's own
        (tmp_path / folder).mkdir(parents=True)
    token = tmp_path / "etc/gemma4-vllm/hf-token"  # the operator's, written before install
    token.parent.mkdir(parents=True)
    token.write_text("hf_x\n")
    before = snapshot(tmp_path)
    folders = sorted(p for p in tmp_path.rglob("*") if p.is_dir())
    layout = Layout(tmp_path)
    for name, port in (("big", 8124), ("small", 8123)):
        units.install("cpu-tiny", name, root=tmp_path, options=units.Options(port=port))
        for path in (  # what cutovers with the canary leave
            layout.history_file(name),
            layout.rollback_slot(name),
            layout.saved_env(name),
            layout.saved_slot(name),
            layout.lock_file(name),
            layout.canary_record(name, "before"),
            layout.canary_record(name, "after"),
            layout.canary_baseline(name),
        ):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}\n")
    status = run("status", "--write-metrics", "--quiet", "--root", str(tmp_path))
    assert status.exit_code == 0, status.output
    assert 'instance="big"' in layout.metrics_textfile().read_text()

    result = run("instance", "uninstall", "big", "--purge", "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert f"wrote     {layout.metrics_textfile()}" in result.output
    text = layout.metrics_textfile().read_text()
    assert 'instance="big"' not in text and 'instance="small"' in text

    result = run("instance", "uninstall", "small", "--purge", "--root", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert f"removed   {layout.state_dir}" in result.output
    assert snapshot(tmp_path) == before
    assert sorted(p for p in tmp_path.rglob("*") if p.is_dir()) == folders


# --- bad inputs: a clear one-line error, exit 2, and the tree unchanged --------------------------

BAD = [
    (["-p", "cpu-tiny", "../etc"], "invalid instance name '../etc'"),
    (["-p", "cpu-tiny", "a b"], "invalid instance name 'a b'"),
    (["-p", "cpu-tiny", "--", "-x"], "invalid instance name '-x'"),
    (["-p", "cpu-tiny", "x.service"], "invalid instance name 'x.service'"),
    (["-p", "cpu-tiny", "a" * 65], "invalid instance name"),
    (["-p", "nope", "x"], "unknown profile 'nope'"),
    (["-p", "cpu-tiny", "x", "--image", "gemma4 vllm:mtp"], "invalid image reference"),
    (["-p", "cpu-tiny", "x", "--image", "x;rm -rf /"], "invalid image reference"),
    (["-p", "cpu-tiny", "x", "--image", "x:$(id)"], "invalid image reference"),
    (["-p", "cpu-tiny", "x", "--image", "Gemma4:mtp"], "invalid image reference"),
    (["-p", "cpu-tiny", "x", "--image", "x:`id`"], "invalid image reference"),
    (["-p", MIG, "x"], "runs one instance per MIG slice"),
    (["-p", "l4x4-31b-mtp", "x", "--gpus", "all;id"], "invalid GPU selection"),
    (["-p", "cpu-tiny", "x", "--gpus", "all"], "runs on the CPU"),
    (["-p", "cpu-tiny", "x", "--port", "70000"], "port 70000 is not a TCP port"),
    (["-p", "cpu-tiny", "x", "--host", "$(id)"], "host '$(id)' is not an IP address"),
    (["-p", "cpu-tiny", "x", "--model-dir", "rel/path"], "not a plain absolute path"),
    (["-p", "cpu-tiny", "x", "--model-dir", "/a b"], "not a plain absolute path"),
    (["-p", "l4x4-31b", "x", "--model-dir", "/m"], "tiny dev model profiles only"),
]


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    """A root with one instance installed already (the bad input must not touch it either),
    whose host has no Docker to ask: with one named (``DOCKER_HOST``, which the tiers with
    machines set for their trees), a GPU profile's install was refused first for the CPU image
    the instance's env file keeps (exit 1), and the bad input went unjudged."""
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    units.install("cpu-tiny-mtp", "x", root=tmp_path)
    return tmp_path


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
@pytest.mark.parametrize("command", ["install", "render"])
def test_bad_input_is_a_clear_error_and_writes_nothing(installed, command, args, message):
    before = snapshot(installed)
    where = ["--root", str(installed)] if command == "install" else ["--out", str(installed)]
    result = run("instance", command, *where, *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
    assert snapshot(installed) == before


def test_a_profile_with_validation_errors_is_refused_before_writing(tmp_path):
    bad = dataclasses.replace(profiles.get("l4x4-31b-mtp"), kv_cache_dtype="fp8")
    with pytest.raises(ProfileError, match="SM 8.9"):
        units.install(bad, "x", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_invalid_image_already_in_the_env_file_is_refused(installed):
    env_path = Layout(installed).env_file("x")
    env_path.write_text(env_path.read_text().replace("gemma4-vllm:latest-cpu", "bad image"))
    before = snapshot(installed)
    result = run("instance", "install", "-p", "cpu-tiny-mtp", "x", "--root", str(installed))
    assert result.exit_code == 2 and "invalid image reference 'bad image'" in result.output
    assert snapshot(installed) == before


def test_an_env_file_systemd_could_read_differently_is_refused_by_install(installed):
    env_path = Layout(installed).env_file("x")
    env_path.write_text(env_path.read_text() + "# note \\\nVLLM_IMAGE=other:1\n")
    before = snapshot(installed)
    result = run("instance", "install", "-p", "cpu-tiny-mtp", "x", "--root", str(installed))
    assert result.exit_code == 2
    assert f"{env_path}:" in result.output and "comment ending in a backslash" in result.output
    assert snapshot(installed) == before


# --- the start-time model check (`serve I run`, before any docker call) ---------------------------
#
# The real script against a --root tree and a copy of the real tiny model pair (MODEL_DIR), with
# no docker on PATH: the check comes before the first docker call, so a model problem is exit 78
# with one line, and a complete pair gets as far as docker ("image ... is not on this host").


@pytest.fixture
def tiny_instance(tmp_path) -> tuple[Path, Path]:
    """Instance "m" of cpu-tiny-mtp under ``tmp_path/root``, its MODEL_DIR a fresh copy of the
    tiny pair (``tmp_path/models``): ``(root, model_dir)``."""
    model_dir = tmp_path / "models"
    shutil.copytree(devmodel.cached("copy").root, model_dir)
    root = tmp_path / "root"
    units.install("cpu-tiny-mtp", "m", root=root, options=units.Options(model_dir=str(model_dir)))
    return root, model_dir


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _break_missing_shard(d: Path) -> str:
    # Split in shards by its index: the second shard the index lists is not there.
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "target/model.safetensors.index.json").write_text(json.dumps(index))
    return "target {d}/target: weight shard model-00002-of-00002.safetensors missing"


def _break_missing_weights(d: Path) -> str:
    (d / "drafter/model.safetensors").unlink()
    return "drafter {d}/drafter: no weight files (*.safetensors)"


def _break_truncated(d: Path) -> str:
    size = (d / "target/model.safetensors").stat().st_size
    _truncate(d / "target/model.safetensors", size - 1000)
    return (
        f"target {{d}}/target: file model.safetensors is truncated ({size - 1000} of {size} bytes)"
    )


def _break_wrong_drafter(d: Path) -> str:
    shutil.rmtree(d / "drafter")
    shutil.copytree(d / "target", d / "drafter")  # a gemma4_text model where the drafter goes
    return "drafter {d}/drafter: is a gemma4_text model, not a Gemma 4 MTP drafter"


def _break_other_width(d: Path) -> str:
    config = json.loads((d / "drafter/config.json").read_text())
    config["backbone_hidden_size"] = 5376  # 31B's width, not this target's (128)
    (d / "drafter/config.json").write_text(json.dumps(config, indent=2))
    return "drafter {d}/drafter: drafts for a backbone of width 5376, the target {d}/target has 128"


def _break_missing_config(d: Path) -> str:
    (d / "target/config.json").unlink()
    return "target {d}/target: config.json missing"


def _break_missing_drafter(d: Path) -> str:
    shutil.rmtree(d / "drafter")
    return "drafter {d}/drafter: directory missing"


BREAKAGES = {
    "missing-shard": _break_missing_shard,
    "missing-weights": _break_missing_weights,
    "truncated": _break_truncated,
    "wrong-drafter": _break_wrong_drafter,
    "other-width": _break_other_width,
    "missing-config": _break_missing_config,
    "missing-drafter": _break_missing_drafter,
}


def test_run_checks_a_complete_model_pair_then_goes_on_to_docker(tiny_instance, no_docker_path):
    root, model_dir = tiny_instance
    proc = serve(root, "m", "run", no_docker_path)
    assert proc.returncode == 78, proc.stderr
    assert f"gemma4-vllm@m: models ok: target {model_dir}/target (" in proc.stderr
    assert f"; drafter {model_dir}/drafter (" in proc.stderr
    assert "(quick check; `appliance models verify m` hashes them)" in proc.stderr
    assert "models not ready" not in proc.stderr
    assert "no docker client" in proc.stderr  # it got to docker


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_run_refuses_a_broken_model_with_one_line_and_exit_78(
    tiny_instance, no_docker_path, breakage
):
    root, model_dir = tiny_instance
    want = BREAKAGES[breakage](model_dir).format(d=model_dir)
    proc = serve(root, "m", "run", no_docker_path)
    assert (proc.returncode, proc.stdout) == (78, ""), proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    env_path = Layout(root).env_file("m")
    fix = models.model_dir_fix(str(env_path))
    assert lines[0].startswith(f"gemma4-vllm@m: models not ready: {want}"), lines[0]
    assert lines[0].endswith(f" ({fix})")
    # The same problems, in the same words, as `appliance models verify --quick` (doctor's check).
    specs = where.dir_specs(profiles.get("cpu-tiny-mtp"))
    report = model_verify.verify_model_dir(model_dir, specs, quick=True)
    assert not report.ok
    assert lines[0] == f"gemma4-vllm@m: {report.one_line(fix)}"


def test_print_shows_the_command_without_the_models(tiny_instance, no_docker_path):
    root, model_dir = tiny_instance
    shutil.rmtree(model_dir / "target")
    proc = serve(root, "m", "print", no_docker_path)
    assert "models" not in proc.stderr and "no docker client" in proc.stderr


def test_an_args_file_that_names_no_models_is_served_without_the_check(
    tiny_instance, no_docker_path
):
    # An args file that names no models (made by hand): served, with one line saying the
    # models are not checked.
    root, model_dir = tiny_instance
    args = Layout(root).args_file("m")
    data = json.loads(args.read_text())
    del data["models"]
    args.write_text(json.dumps(data))
    shutil.rmtree(model_dir / "target")
    proc = serve(root, "m", "run", no_docker_path)
    assert "names no models: not checked at start" in proc.stderr
    assert "no docker client" in proc.stderr


def test_a_hand_edited_model_record_cannot_leave_its_directory(tiny_instance, no_docker_path):
    root, _ = tiny_instance
    args = Layout(root).args_file("m")
    args.write_text(args.read_text().replace('"name": "target"', '"name": "../../etc"'))
    proc = serve(root, "m", "run", no_docker_path)
    assert proc.returncode == 78
    assert "bad model record 'target dir ../../etc'" in proc.stderr


def test_args_name_each_model_the_check_looks_for():
    gpu = engine_args.serve_args(profiles.get("h100-31b-mtp"), ["HF_CACHE_DIR"])
    assert gpu.models == (
        argsfile.ModelRecord("target", "hub", "google/gemma-4-31B-it"),
        argsfile.ModelRecord("drafter", "hub", "google/gemma-4-31B-it-assistant"),
    )
    cpu = engine_args.serve_args(profiles.get("cpu-tiny"), ["MODEL_DIR"])
    assert cpu.models == (argsfile.ModelRecord("target", "dir", "target"),)
    pinned = dataclasses.replace(profiles.get("h100-31b-mtp"), revision="a" * 40)
    target = engine_args.serve_args(pinned, []).models[0]
    assert (target.name, target.revision) == ("google/gemma-4-31B-it", "a" * 40)
    with pytest.raises(UsageError, match="is not a hub repo id"):
        engine_args.serve_args(dataclasses.replace(pinned, model="../x"), [])


# --- stop and remove ---------------------------------------------------------------------------


@pytest.fixture
def program(tmp_path) -> str:
    """The serve program as ``appliance install`` writes it, outside any instance."""
    path = tmp_path / "serve"
    path.write_bytes(template.serve_program())
    path.chmod(0o755)
    return str(path)


def test_the_program_carries_exactly_the_modules_it_imports_and_runs_on_the_bare_host_python(
    program,
):
    """The host's /usr/bin/python3 with no site-packages (-I -S, the program's own shebang):
    everything the serve program imports comes from the bundle, and nothing it carries is dead."""
    from appliance.serve import bundle

    probe = (
        f"import sys; sys.path.insert(0, {program!r}); import appliance.serve.main; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('appliance', 'packaging'))))"
    )
    proc = subprocess.run(
        [bundle.INTERPRETER, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True
    )
    loaded = set(proc.stdout.split())
    carried = {
        ("appliance." + rel.removesuffix(".py").replace("/", ".")).removesuffix(".__init__")
        for rel in bundle.MODULES
    }
    assert {m for m in loaded if m.startswith("appliance")} == carried
    assert "packaging.version" in loaded
    assert bundle.build() == template.serve_program()  # the same bytes on every build


def test_a_stop_that_fails_is_logged_and_fails_not_discarded(program):
    """The real docker client against a daemon that does not answer: `stop` used to discard
    the error and exit 0, so a stop that never reached the container went unnoticed."""
    docker_cli = shutil.which("docker")
    if docker_cli is None:
        pytest.fail("no docker client (scripts/setup-system.sh)")
    env = dict(os.environ, DOCKER_HOST="unix:///nonexistent/docker.sock")
    for command, says in (("stop", "docker stop gemma4-vllm-x failed"),
                          ("remove", "the Docker daemon does not answer")):  # fmt: skip
        proc = subprocess.run(
            [program, "x", command],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert proc.returncode == 1, (command, proc.stderr)
        assert f"gemma4-vllm@x: {says}: Cannot connect to the Docker daemon" in proc.stderr


FAKE_DOCKER_AUTO_REMOVING = """#!/bin/bash
# Docker finishing an auto-removal (--rm): inspect still finds the container twice, `rm` answers
# as dockerd does then, and then the container is gone.
state="$FAKE_STATE"
n=0
if [[ -e "$state" ]]; then n=$(<"$state"); fi
echo "$*" >> "$state.log"
case "$1 $2" in
  "container inspect")
    echo $((n + 1)) > "$state"
    if ((n < 2)); then echo 1234; exit 0; fi
    echo "Error: No such container: gemma4-vllm-x" >&2; exit 1 ;;
  "rm --force")
    echo "Error response from daemon: removal of container gemma4-vllm-x is already in progress" >&2
    exit 1 ;;
  "version --format") echo 27.5.1 ;;
  *) echo "unexpected: $*" >&2; exit 99 ;;
esac
"""


def test_remove_waits_for_a_container_docker_is_still_auto_removing(
    tmp_path, no_docker_path, program
):
    """A fake docker: the race (the engine exited, dockerd is still removing its --rm container
    when ExecStartPre runs) cannot be produced on demand with the real daemon. The old script
    failed the start on docker's "removal ... already in progress"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text(FAKE_DOCKER_AUTO_REMOVING)
    fake.chmod(0o755)
    state = tmp_path / "state"
    env = dict(os.environ, PATH=f"{bin_dir}:{no_docker_path}", FAKE_STATE=str(state))
    proc = subprocess.run(
        [program, "x", "remove"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "")
    calls = (tmp_path / "state.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["container", "rm", "container", "rm", "container",
                                             "version"]  # fmt: skip


def test_the_units_state_reaches_the_state_metrics_one_series_per_state():
    from prometheus_client import generate_latest

    from appliance.observability import state_metrics

    show = {"ActiveState": "failed", "SubState": "failed", "Result": "start-limit-hit",
            "NRestarts": "2"}  # fmt: skip
    status = state_metrics.UnitStatus.from_show(show)
    assert (status.active, status.result, status.restarts) == ("failed", "start-limit-hit", 2)
    reg = state_metrics.build_registry(
        [state_metrics.InstanceState("31b", "img:1", "0.32.0", True, unit=status)]
    )
    lines = [
        ln for ln in generate_latest(reg).decode().splitlines()
        if ln.startswith(state_metrics.UNIT_STATE + "{")
    ]  # fmt: skip
    on = [ln for ln in lines if ln.endswith(" 1.0")]
    assert on == [
        'gemma4_appliance_unit_state{instance="31b",result="start-limit-hit",state="failed"} 1.0'
    ]
    assert len(lines) == len(state_metrics.UNIT_STATES)
    # An instance whose unit was not looked at has no unit series at all (not "inactive").
    reg = state_metrics.build_registry([state_metrics.InstanceState("a", "i", "0.32.0", True)])
    assert state_metrics.UNIT_STATE + "{" not in generate_latest(reg).decode()


OLD_SPELLINGS = [
    (["install", "o1", "-p", "cpu-tiny"], "instance install"),
    (
        ["multinode", "install", "-p", "cpu-tiny-mtp-2node", "-g", "o1", "--role", "both"],
        "instance install o1 --profile cpu-tiny-mtp-2node --role both",
    ),
]


@pytest.mark.parametrize(("old", "new"), OLD_SPELLINGS, ids=["install", "multinode-install"])
def test_an_old_spelling_still_works_and_names_the_new_form(tmp_path, old, new, cli_run):
    result = cli_run([*old, "--root", str(tmp_path)])
    # (The other warning names the floating default image: no Docker is asked for a tree.)
    [warning] = [line for line in result.stderr.splitlines() if "is now" in line]
    assert warning.startswith("warning: `appliance ") and f"is now `appliance {new}" in warning
    assert Layout(tmp_path).env_file("o1").is_file()
    gone = run("uninstall", "o1", "--root", str(tmp_path))
    assert gone.exit_code == 0 and "is now `appliance instance uninstall`" in gone.stderr
    assert not Layout(tmp_path).env_file("o1").exists()


def test_install_needs_the_name(tmp_path, cli_run):
    neither = cli_run(["instance", "uninstall", "--root", str(tmp_path)], code=2)
    assert "Missing argument 'NAME'" in neither.output


# --- the host's state-metrics timer ------------------------------------------------------------

STATE_UNITS = (f"{units.STATE_UNIT}.service", f"{units.STATE_UNIT}.timer")


def test_the_state_timer_and_service_pass_verify_and_the_service_is_hardened(tmp_path):
    """Installed with the first instance: verified silently, the service as hardened as the
    instance unit, and the one place it writes node_exporter's textfile directory."""
    root = verify_root(tmp_path)
    units.install("cpu-tiny-mtp", "x", root=root)
    # verify checks that ExecStart's program is there: the appliance's command, as the Ansible
    # role links it (any executable file will do for verify).
    bin_ = root / "usr/local/bin/appliance"
    bin_.parent.mkdir(parents=True)
    bin_.write_text("#!/bin/sh\n")
    bin_.chmod(0o755)
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *STATE_UNITS],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--no-pager",
         STATE_UNITS[0]],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m and float(m.group(1)) <= 2.5, proc.stdout + proc.stderr
    service = Layout(root).state_units[0].read_text()
    settings = unit_settings(service)
    assert settings["ExecStart"] == "/usr/local/bin/appliance status --write-metrics --quiet"
    assert (settings["StateDirectory"], settings["UMask"]) == ("gemma4-appliance", "0022")
    # Ordered after Docker, never pulling it up (a real systemd shows it:
    # tests/test_units_edges_systemd.py).
    assert settings["After"] == "docker.service" and "Wants" not in settings
    textfile = Layout(Path("/")).metrics_textfile()
    assert f"--collector.textfile.directory={textfile.parent}" in service
    assert "OnUnitActiveSec=1min" in Layout(root).state_units[1].read_text()


def test_the_state_units_stay_until_the_last_instance_goes(tmp_path):
    run("instance", "install", "a", "-p", "cpu-tiny-mtp", "--root", str(tmp_path))
    b = run("instance", "install", "b", "-p", "cpu-tiny-mtp", "--root", str(tmp_path))
    assert "gemma4-appliance-state.timer" in b.output  # the enable line names it
    unit_dir = tmp_path / "etc/systemd/system"
    # What `systemctl enable` would link: uninstall takes it with the timer.
    wants = unit_dir / "timers.target.wants"
    wants.mkdir()
    (wants / STATE_UNITS[1]).symlink_to(unit_dir / STATE_UNITS[1])
    assert run("instance", "uninstall", "a", "--root", str(tmp_path)).exit_code == 0
    assert all((unit_dir / u).exists() for u in STATE_UNITS)
    assert run("instance", "uninstall", "b", "--root", str(tmp_path)).exit_code == 0
    assert not any((unit_dir / u).exists() for u in STATE_UNITS)
    assert not os.path.lexists(wants / STATE_UNITS[1])
