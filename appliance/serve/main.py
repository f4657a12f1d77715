"""``serve INSTANCE COMMAND``: the unit's commands (see :mod:`appliance.serve`).

Every line goes to stderr, prefixed ``gemma4-vllm@INSTANCE:``, which the journal keeps. Exit 78
(EX_CONFIG, which the unit never restarts) for a configuration problem, 75 (EX_TEMPFAIL) for a
model folder not there yet (a late mount), 1 for another failure a restart may fix, 2 for a wrong
command line.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .. import models, progress
from ..engine_api import shed
from ..errors import ApplianceError, UsageError
from ..host import apikey, cdi
from ..host.layout import Layout, Shape
from ..host.names import check_instance
from ..host.values import LOOPBACK, is_loopback, probe_host
from ..models import EX_CONFIG, ModelsNotReady, ModelSpec
from ..models import token as tokens
from ..models import verify as model_verify
from . import argsfile, container, docker, environment, health
from .argsfile import ServeArgs
from .environment import Settings

COMMANDS = ("run", "print", "wait-healthy", "wait-generates", "probe", "stop", "remove")
USAGE = f"usage: serve INSTANCE {'|'.join(COMMANDS)}"


class Unit:
    """One instance's files, as the unit sees them (``APPLIANCE_ROOT`` prefixes them for an
    instance installed with ``appliance instance install --root``; the unit never sets it)."""

    def __init__(self, instance: str, env: dict[str, str]) -> None:
        self.instance = instance
        self.env = env
        self.root = Path(env.get("APPLIANCE_ROOT") or "/")
        layout = Layout(self.root)
        self.env_file = str(layout.env_file(instance))
        self.args_file = layout.args_file(instance)
        self.key_file = layout.api_key_file(instance)

    def log(self, line: str, level: str | None = None) -> None:
        """One line on stderr; an ``error`` or ``warning`` one with its journal priority when
        stderr is the journal (``journalctl -p warning`` finds it; E11)."""
        prefix = progress.journal_prefix(level) if level else ""
        print(f"{prefix}gemma4-vllm@{self.instance}: {line}", file=sys.stderr, flush=True)

    def args(self) -> ServeArgs:
        try:
            return argsfile.read(self.args_file)
        except UsageError as exc:  # the file, not the operator's input: install rewrites it
            raise UsageError(
                exc.message, fix=f"appliance instance install {self.instance}"
            ) from None

    def key(self, settings: Settings) -> str | None:
        """The instance's API key by :mod:`appliance.host.apikey`'s rule; None when it has no key
        file, which is allowed only when vLLM listens on loopback."""
        key = apikey.read(self.key_file)
        if key is None:
            if settings.host not in LOOPBACK:
                raise UsageError(
                    f"no API key file {self.key_file}: refusing to serve on {settings.host} "
                    "without one",
                    fix=f"appliance instance install {self.instance} writes one",
                )
            self.log(
                f"no API key file {self.key_file}: vLLM on {settings.host}:{settings.port} "
                "accepts any caller on this host",
                "warning",
            )
        return key

    def check_models(self, args: ServeArgs, settings: Settings) -> None:
        """Every model the args name is on this host and looks complete (``models verify
        --quick``), else a ModelsNotReady naming each problem and the command that fixes it."""
        if not args.models:
            self.log(
                f"{self.args_file} names no models: not checked at start; re-run "
                f"`appliance instance install {self.instance}` to check them",
                "warning",
            )
            return
        layouts = {m.layout for m in args.models}
        if len(layouts) > 1:
            raise UsageError(f"{self.args_file} mixes models in MODEL_DIR and the hub cache")
        specs = [ModelSpec(m.role, m.name, m.revision) for m in args.models]
        if layouts == {"dir"}:
            if not settings.model_dir:
                raise UsageError(f"MODEL_DIR is not set in {self.env_file}")
            report = model_verify.verify_model_dir(Path(settings.model_dir), specs, quick=True)
            fix = models.model_dir_fix(self.env_file)
        else:
            if not settings.hf_cache_dir:
                raise UsageError(f"HF_CACHE_DIR is not set in {self.env_file}")
            report = model_verify.verify_hub(Path(settings.hf_cache_dir) / "hub", specs, quick=True)
            fix = models.hub_fix([self.instance])
        line = report.one_line(fix)
        if not report.ok:
            raise ModelsNotReady(line)
        self.log(f"{line} (quick check; `appliance models verify {self.instance}` hashes them)")

    def command(self, args: ServeArgs, *, check_models: bool) -> container.Command:
        """The checked docker command for ``args`` (``run`` checks the models; ``print`` shows
        the command whether or not the models are there yet)."""
        if name := tokens.unused_env(self.env):
            self.log(
                f"{name} is set but not used: the engine runs offline from the cache "
                "`appliance models pull` filled, which reads the hub token from "
                f"{tokens.DEFAULT_TOKEN_FILE} only; take it out of {self.env_file} (or the "
                "unit's drop-in), which every user may read",
                "warning",
            )
        settings = environment.settings(self.env, args, self.instance, self.env_file)
        if check_models:
            self.check_models(args, settings)
        # Never pulled: the image must already be on this host (built, loaded or tagged there).
        image_labels = docker.image_labels(settings.image)
        if image_labels is None:
            raise UsageError(
                f"image {settings.image} is not on this host (the unit never pulls)",
                fix=f"build or load it, or fix VLLM_IMAGE in {self.env_file}",
            )
        container.check_build(settings, image_labels)  # before Docker is asked anything more
        key = self.key(settings)
        devices = self.devices(settings)
        cmd = container.command(
            self.instance, args, settings, image_labels, key, self.key_file, devices
        )
        for note in cmd.notes:
            self.log(note)
        return cmd

    def devices(self, settings: Settings) -> list[str] | None:
        """How the instance's GPUs go to Docker, said in the journal: CDI devices where Docker
        has CDI on and a spec in its folders (under ``APPLIANCE_ROOT``) names each, else
        ``--gpus`` (:func:`appliance.host.cdi.passing`, as ``host check`` says it). None: a
        CPU instance."""
        if not settings.gpus:
            return None
        dirs = docker.cdi_spec_dirs()
        specs = cdi.read(self.root, dirs or cdi.DIRS)
        way = cdi.passing(settings.gpus, None, specs, bool(dirs))
        listed = cdi.refs(settings.gpus)
        if way.stale and dirs and listed:
            # A spec of index names (nvidia-ctk's default) and an env file of UUIDs: the index
            # of each, as nvidia-smi lists them.
            if known := gpu_listing():
                way = cdi.passing(settings.gpus, [known.get(r, {r}) for r in listed], specs, True)
            else:  # the unit's PrivateDevices=yes hides the GPUs from nvidia-smi
                way = replace(way, why=f"{way.why}; nvidia-smi does not answer here for indexes")
        if way.stale:
            self.log(f"GPUs: {' '.join(way.args)}: {way.why}; `{cdi.GENERATE}`", "warning")
        else:
            self.log(f"GPUs: {' '.join(way.args)}: {way.why}")
        return way.args

    def endpoint(self) -> tuple[str, int]:
        host, port = environment.endpoint(self.env, self.env_file)
        return probe_host(host), port


def gpu_listing() -> dict[str, set[str]]:
    """``nvidia-smi -L``'s devices by UUID, with their indexes (none where it does not answer)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return cdi.aliases(done.stdout) if done.returncode == 0 else {}


def run(unit: Unit) -> None:
    """Exec the engine's container: from here on the docker client is the unit's main process.
    A multi-node worker first waits for its head's rendezvous (:func:`health.wait_listening`)."""
    args = unit.args()  # read once per start
    cmd = unit.command(args, check_models=True)
    if (head := args.rendezvous()) is not None:
        health.notify_status(health.waiting_for_head(cmd.image, *head))
        took = health.wait_listening(*head, unit.log)
        health.notify_status(f"{cmd.image}: joined the head's rendezvous")
        if took >= health.POLL_S:
            unit.log(f"the head's rendezvous at {head[0]}:{head[1]} answers after {took:.0f} s")
    os.environ.update(cmd.env)
    if cmd.key is not None:
        fd = key_pipe(cmd.key)
        os.dup2(fd, 0)
        os.close(fd)
    sys.stdout.flush()
    os.execvp("docker", ["docker", *cmd.argv])


def key_pipe(key: str) -> int:
    """A pipe's read end holding ``key`` alone, then its end: the container's stdin. The key was
    checked here (:mod:`appliance.host.apikey`), so the image's entry point takes it as it comes."""
    read, write = os.pipe()
    try:
        data = key.encode()
        # At most apikey.MAX_KEY_BYTES, within a pipe's buffer: written whole before the exec.
        if os.write(write, data) != len(data):
            raise OSError("the API key did not fit in the pipe to the container's stdin")
    finally:
        os.close(write)
    return read


def print_command(unit: Unit) -> None:
    cmd = unit.command(unit.args(), check_models=False)
    line = shlex.join(["docker", *cmd.argv])
    print(f"{line} < {shlex.quote(str(cmd.stdin))}" if cmd.stdin else line)


def wait_healthy(unit: Unit) -> None:
    host, port = unit.endpoint()
    hint = ""
    if not (host.startswith("127.") or host in LOOPBACK):
        # The unit's IPAddressAllow=localhost blocks the probe to any other address.
        hint = (
            "; the unit lets the probe reach only loopback: add a drop-in with "
            f"IPAddressAllow={host}"
        )
    took = health.wait_healthy(host, port, unit.log, hint)
    unit.log(f"vLLM healthy on {host}:{port} after {took:.0f} s")


def _generation_target(unit: Unit) -> tuple[str, int, str, str | None]:
    host, port = unit.endpoint()
    model = unit.args().served_model_name()
    if not model:
        raise UsageError(f"{unit.args_file} names no --served-model-name")
    key = apikey.read(unit.key_file)
    if key is not None and not is_loopback(host):
        # As the instance unit, whose probe reaches only loopback: the key never leaves this
        # host in clear HTTP (gotchas/api-key-scope.md).
        raise UsageError(
            f"the head's generation probe would send its API key in clear to {host}:{port}: "
            "it asks loopback only",
            fix=f"bind the head to 127.0.0.1 or 0.0.0.0 (VLLM_HOST in {unit.env_file}), with a "
            "TLS proxy in front for other hosts",
        )
    return host, port, model, key


def wait_generates(unit: Unit) -> None:
    host, port, model, key = _generation_target(unit)
    took = health.wait_healthy(host, port, unit.log, ": are the workers up?")
    # Turned away at the queue bound (clients already at it): sent again, said, never a worker.
    tally = shed.Tally(note=unit.log)
    code = health.generate(host, port, model, key, tally=tally)
    if code != 200:
        raise ApplianceError(
            f"the head answers /health, but a generation got {code or 'no answer'}: a worker "
            "is gone (the head's engine exits now)"
        )
    unit.log(f"the head generates on {host}:{port} after {took:.0f} s{shed.noted(tally.shed)}")


def probe(unit: Unit) -> None:
    host, port, model, key = _generation_target(unit)
    tally = shed.Tally(note=unit.log)
    code = health.generate(host, port, model, key, tally=tally)
    if tally.shed:
        unit.log(f"a generation through the head got {code}; {tally.summary()}")
    if code != 200:
        raise ApplianceError(
            f"a generation through the head got {code or 'no answer'}: a node is gone; the "
            "head's engine exits and its unit restarts it once every node is back"
        )


def stop_line(unit: Unit) -> str:
    """Stop the instance's container (vLLM drains within the grace, else it is killed); what
    happened, as a journal line."""
    return docker.stop(Shape(unit.instance).container)


def stop(unit: Unit) -> None:
    unit.log(stop_line(unit))


def remove(unit: Unit) -> None:
    docker.remove(Shape(unit.instance).container)


ACTIONS = {
    "run": run,
    "print": print_command,
    "wait-healthy": wait_healthy,
    "wait-generates": wait_generates,
    "probe": probe,
    "stop": stop,
    "remove": remove,
}


# The unit's waits for the engine (ExecStartPost). A stop while the unit is still `activating`
# skips ExecStop: systemd sends SIGTERM to every process of the unit, the wait among them, and a
# control process killed by a signal fails the stop (Result=signal; SuccessExitStatus covers the
# main process only). The wait ends cleanly instead: the unit is going down anyway.
WAITS = ("wait-healthy", "wait-generates")


class _Stopping(BaseException):
    """SIGTERM during a wait (a BaseException: no `except Exception` on the way swallows it)."""


def _stopping(signum, frame) -> None:
    raise _Stopping


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status the unit acts on."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[1] not in ACTIONS:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        check_instance(argv[0])
    except UsageError:
        print(USAGE, file=sys.stderr)
        return 2
    unit = Unit(argv[0], dict(os.environ))
    try:
        if argv[1] in WAITS:
            signal.signal(signal.SIGTERM, _stopping)
            # A blocked signal stays blocked across exec: started so, the wait would never see
            # the stop's SIGTERM and wait on until the unit's timeout. One already pending is
            # delivered here, inside the try.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        ACTIONS[argv[1]](unit)
    except _Stopping:
        unit.log(f"{argv[1]}: the unit is stopping (SIGTERM), no longer waiting for vLLM")
        # The same SIGTERM went to the docker client, whose proxy passes it to vLLM; vLLM was
        # seen to go on loading all the same (the unit's 90 s ran out, Result=timeout), so the
        # container is stopped as ExecStop would, killed after the grace.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            unit.log(stop_line(unit))
        except docker.DockerError as exc:
            unit.log(str(exc), "warning")
        return 0
    except health.EngineExited as exc:
        unit.log(f"the engine exited (main process {exc}) before vLLM /health answered", "error")
        return 1
    except docker.DockerError as exc:
        unit.log(str(exc), "error")
        return 1
    except UsageError as exc:
        unit.log(str(exc), "error")
        return EX_CONFIG
    except ApplianceError as exc:
        unit.log(str(exc), "error")
        return exc.exit_code
    return 0
