"""The fleet role's own tasks, read through ansible's loader and run where they can be without a
fleet (issue 55 §4, review S9's package window and N13): Debian's Prometheus listens on
loopback from the moment the role installs it, and a failed pip install is tried again.

The real tools: ansible-core's DataLoader and ansible-playbook (connection local), dpkg on a
throwaway --root, the Debian prometheus package this machine has (scripts/setup-system.sh).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROLE = Path(__file__).resolve().parents[1] / "deploy/ansible/roles/gemma4_appliance"
DEFAULT_FILE = "/etc/default/prometheus"
LOOPBACK_ARG = "--web.listen-address=127.0.0.1:9090"


def _tasks(name: str) -> list[dict]:
    # Read in a child: importing ansible patches sys.intern in this process, and every later
    # import of torch (vLLM's) in the same pytest then fails (substitute_in_graph TypeError).
    code = (
        "import json, sys\n"
        "from ansible.parsing.dataloader import DataLoader\n"
        "print(json.dumps(DataLoader().load_from_file(sys.argv[1])))"
    )
    path = str(ROLE / "tasks" / name)
    out = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def _named(tasks: list[dict], name: str) -> dict:
    return next(t for t in tasks if t.get("name") == name)


def _package_block() -> list[dict]:
    return _named(_tasks("monitoring.yml"), "Install Debian's prometheus package")["block"]


def test_the_default_file_is_written_before_the_package_and_names_loopback():
    block = _package_block()
    modules = [next(k for k in t if k.startswith("ansible.builtin.")) for t in block]
    written = next(i for i, t in enumerate(block) if t.get("ansible.builtin.copy"))
    installed = modules.index("ansible.builtin.apt")
    assert written < installed, modules  # before the postinst's first start
    copy = block[written]["ansible.builtin.copy"]
    assert copy["dest"] == DEFAULT_FILE
    args = re.search(r'^ARGS="([^"]*)"$', copy["content"], re.MULTILINE).group(1)
    assert shlex.split(args) == [LOOPBACK_ARG]
    # Only over a package not installed: an operator's own Prometheus keeps its file.
    asked = next(t for t in block[:written] if "dpkg-query" in str(t))
    assert block[written]["when"] == f"{asked['register']}.stdout != 'installed'"
    apt = block[installed]["ansible.builtin.apt"]
    assert {"force-confold", "force-confdef"} <= set(apt["dpkg_options"].split(","))


def _installed_prometheus() -> tuple[str, str]:
    """The Debian package's conffiles and its unit, as this machine has them."""
    res = subprocess.run(
        ["dpkg-query", "--show", "--showformat=${Conffiles}", "prometheus"],
        capture_output=True,
        text=True,
        check=False,
    )
    unit = Path("/lib/systemd/system/prometheus.service")
    if res.returncode != 0 or not unit.exists():
        pytest.fail("Debian's prometheus package missing: run scripts/setup-system.sh")
    return res.stdout, unit.read_text()


def test_the_debian_package_reads_its_listen_address_from_that_file():
    # What the role relies on, from the package itself: the unit runs `prometheus $ARGS` with
    # ARGS from /etc/default/prometheus, a conffile (kept by dpkg when it is there first).
    conffiles, unit = _installed_prometheus()
    assert DEFAULT_FILE in conffiles.split()
    assert f"EnvironmentFile={DEFAULT_FILE}" in unit.splitlines()
    assert re.search(r"^ExecStart=/usr/bin/prometheus \$ARGS$", unit, re.MULTILINE)
    help_text = subprocess.run(
        ["/usr/bin/prometheus", "--help"], capture_output=True, text=True, check=False
    )
    assert "--web.listen-address" in help_text.stdout + help_text.stderr


def _package_with_default_file(tmp_path: Path) -> Path:
    """A package shipping /etc/default/prometheus as a conffile with Debian's ARGS="", no
    maintainer scripts: the conffile handling of the real package, without its server."""
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "etc/default").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(
        "Package: x-prometheus-conffile\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: test <test@localhost>\nDescription: a conffile like prometheus'\n"
    )
    (pkg / "DEBIAN/conffiles").write_text(DEFAULT_FILE + "\n")
    (pkg / DEFAULT_FILE.lstrip("/")).write_text('ARGS=""\n')
    deb = tmp_path / "x.deb"
    subprocess.run(["dpkg-deb", "-b", "--root-owner-group", str(pkg), str(deb)], check=True)
    return deb


def _dpkg_install(tmp_path: Path, deb: Path, *, written: str | None) -> Path:
    root = tmp_path / "root"
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "etc/default"):
        (root / d).mkdir(parents=True)
    (root / "var/lib/dpkg/status").touch()
    if written is not None:
        (root / DEFAULT_FILE.lstrip("/")).write_text(written)
    apt = next(t for t in _package_block() if "ansible.builtin.apt" in t)["ansible.builtin.apt"]
    force = [f"--{o}" for o in apt["dpkg_options"].split(",")]
    subprocess.run(
        ["dpkg", f"--root={root}", "--force-not-root", *force, "-i", str(deb)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
    )
    return root / DEFAULT_FILE.lstrip("/")


def test_dpkg_keeps_the_file_the_role_wrote_first(tmp_path):
    block = _package_block()
    content = next(t for t in block if "ansible.builtin.copy" in t)["ansible.builtin.copy"][
        "content"
    ]
    deb = _package_with_default_file(tmp_path)
    kept = _dpkg_install(tmp_path / "role", deb, written=content)
    assert kept.read_text() == content  # the server's first start reads loopback
    assert Path(f"{kept}.dpkg-dist").read_text() == 'ARGS=""\n'  # the package's, beside it
    # Without it (the role before): the package's own, every address.
    assert _dpkg_install(tmp_path / "bare", deb, written=None).read_text() == 'ARGS=""\n'


# --- the pip install, tried again -------------------------------------------------------------

PIP_TASK = "Install or upgrade the appliance in its venv"


def _pip_task() -> dict:
    block = _named(
        _tasks("install.yml"), "Install the appliance from the wheelhouse (no index reached)"
    )
    return _named(block["block"], PIP_TASK)


def test_the_pip_install_is_tried_again_until_it_succeeds():
    task = _pip_task()
    assert task["until"] == f"{task['register']} is succeeded"
    assert int(task["retries"]) >= 2 and int(task["delay"]) > 0


def _run_pip_task(tmp_path: Path, fails: int) -> tuple[subprocess.CompletedProcess, int]:
    """The role's own task in a one-task play on this machine (connection local), its pip a
    stand-in that fails ``fails`` times then succeeds (a failed pip cannot be made on demand
    from a real wheelhouse); ``delay`` 0, so the test waits for nothing. Returns the run and
    how many times pip ran."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    count = tmp_path / "runs"
    count.write_text("0")
    pip = venv / "bin/pip"
    pip.write_text(
        "#!/bin/sh\n"
        f'n=$(($(cat "{count}") + 1)); echo "$n" > "{count}"\n'
        f'[ "$n" -gt {fails} ] || {{ echo "pip: interrupted" >&2; exit 1; }}\n'
    )
    pip.chmod(0o755)
    task = {**_pip_task(), "delay": 0}
    wheels = {"changed": True}
    given = {"appliance_venv": str(venv), "appliance_version": "", "appliance_wheels": wheels}
    run = _play(tmp_path, task, given)
    return run, int(count.read_text())


def _play(
    tmp_path: Path, task: dict, given: dict, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``task`` alone in a play on this machine (connection local) with the variables
    ``given``; ``env``: added to the environment its commands inherit."""
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {"ansible_python_interpreter": sys.executable, **given},
            "tasks": [task],
        }
    ]
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps(play))  # JSON is YAML; the loader's strings are str
    env = dict(
        os.environ,
        ANSIBLE_HOME=str(tmp_path),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
        **(env or {}),
    )
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", str(playbook)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )


def test_a_pip_install_that_fails_once_is_tried_again_and_the_play_goes_on(tmp_path):
    run, runs = _run_pip_task(tmp_path, fails=1)
    assert run.returncode == 0, run.stdout[-3000:]
    assert runs == 2 and "FAILED - RETRYING" in run.stdout


def test_a_pip_install_that_keeps_failing_fails_the_host_with_pips_words(tmp_path):
    run, runs = _run_pip_task(tmp_path, fails=99)
    assert run.returncode != 0
    assert runs == int(_pip_task()["retries"]) + 1  # the first try and each retry
    assert "pip: interrupted" in run.stdout


# --- the install, changed or not by its --json -----------------------------------------------

INSTALL_TASK = "Install the instance (unit, serve program, env, args, API key, scrape target)"


def _changed(run: subprocess.CompletedProcess) -> int:
    """The play recap's ``changed=N`` for the one host."""
    return int(re.search(r"^localhost\s*:.*\bchanged=(\d+)", run.stdout, re.MULTILINE).group(1))


def test_the_install_task_is_changed_by_what_installs_json_says(tmp_path):
    """The role reads `appliance instance install --json` (ecosystem review E15), not a grep of
    its text: the role's own task runs this venv's appliance on a tree (APPLIANCE_ROOT, the
    --root of every command; no Docker or systemd of the tree named, so none is asked). A first
    install is a change, the same install again is none, and a refusal fails the task with the
    appliance's own line (no object to read)."""
    root = tmp_path / "root"
    task = _named(_tasks("install.yml"), INSTALL_TASK)
    assert "'--json'" in task["ansible.builtin.command"]["argv"]
    given = {
        "appliance_path": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "appliance_instance": "t",
        "appliance_profile": "cpu-tiny-mtp",
        "appliance_env_file": {"stat": {"exists": False}},
        **dict.fromkeys(
            ("image", "host", "port", "gpus", "model_dir", "hf_cache_dir", "vllm_cache_dir"), ""
        ),
    }
    given = {k if k.startswith("appliance_") else f"appliance_{k}": v for k, v in given.items()}
    env = {"APPLIANCE_ROOT": str(root), "DOCKER_HOST": "", "APPLIANCE_SYSTEMD_PREFIX": ""}
    first = _play(tmp_path, task, given, env)
    assert first.returncode == 0 and _changed(first) == 1, first.stdout[-3000:]
    assert (root / "etc/gemma4-vllm/t.env").is_file()
    again = _play(tmp_path, task, given, env)
    assert again.returncode == 0 and _changed(again) == 0, again.stdout[-3000:]
    refused = _play(tmp_path, task, {**given, "appliance_profile": "nosuch"}, env)
    assert refused.returncode != 0
    assert "Error: unknown profile 'nosuch'" in refused.stdout, refused.stdout[-3000:]
    assert "from_json" not in refused.stdout and "conditional" not in refused.stdout


# --- the agent's config, changed or not by scrape-config's --json --------------------------------

CONFIG_TASK = "Write the agent's config (its loopback jobs, label host, remote_write; 0600)"
AGENT_CONFIG = "/etc/gemma4-prometheus-agent/prometheus.yml"


def test_the_agent_config_task_is_changed_by_what_scrape_configs_json_says(tmp_path):
    """The role read `changed` from a grep of `wrote ` in `appliance fleet scrape-config`'s text
    (ecosystem review E15); now from its --json, as the install task. The role's own task, its
    --out moved from /etc into the test's folder: a first write is a change, the same config
    again is none, and a refusal fails the task with the appliance's own line."""
    task = _named(_tasks("monitoring.yml"), CONFIG_TASK)
    argv = task["ansible.builtin.command"]["argv"]
    assert "'--json'" in argv and f"'{AGENT_CONFIG}'" in argv
    out = tmp_path / "agent/prometheus.yml"
    out.parent.mkdir()
    command = {**task["ansible.builtin.command"], "argv": argv.replace(AGENT_CONFIG, str(out))}
    task = {**task, "ansible.builtin.command": command}
    given = {
        "appliance_path": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "monitoring_remote_write_url": "http://10.0.0.5:9090/api/v1/write",
        "appliance_state_port": 9100,
        "monitoring_scrape_interval": "15s",
        "monitoring_scrape_auth_argv": [],
    }
    first = _play(tmp_path, task, given)
    assert first.returncode == 0 and _changed(first) == 1, first.stdout[-3000:]
    assert 'host: "localhost"' in out.read_text()
    again = _play(tmp_path, task, given)
    assert again.returncode == 0 and _changed(again) == 0, again.stdout[-3000:]
    refused = _play(tmp_path, task, {**given, "monitoring_scrape_interval": "15"})
    assert refused.returncode != 0
    assert "is not a Prometheus duration" in refused.stdout, refused.stdout[-3000:]
    assert "from_json" not in refused.stdout and "conditional" not in refused.stdout
