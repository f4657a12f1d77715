"""The state textfile tells the truth about every instance, and node_exporter can read it
(issue 45 §4, review S2 and S8): one refused env file marks its own instance instead of
freezing the file for all, and the file is 0644 in a 0755 folder whatever the writer's umask,
proven with a real umask and a real other user (nobody, through setpriv)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.observability import state_metrics

APPLIANCE = str(Path(sys.executable).with_name("appliance"))
NOBODY = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]


def _appliance(*args: str, umask: str = "022") -> subprocess.CompletedProcess:
    # The umask of a real shell, set before the command starts (as an operator's would be).
    return subprocess.run(
        ["sh", "-c", f'umask {umask} && exec "$@"', "sh", APPLIANCE, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _samples(path: Path) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(path.read_text())
        for s in fam.samples
    }


@pytest.fixture
def host() -> Iterator[Path]:
    """A host tree other users may enter, with the /etc and /var/lib a host has (0755)."""
    root = Path(tempfile.mkdtemp(prefix="appliance-host-"))
    root.chmod(0o755)
    for folder in ("etc", "var/lib"):
        (root / folder).mkdir(parents=True, mode=0o755)
    yield root
    shutil.rmtree(root)


def test_one_refused_env_file_marks_its_instance_and_the_others_are_written(host):
    for name in ("a1", "a2"):
        res = _appliance("install", name, "-p", "cpu-tiny-mtp", "--root", str(host))
        assert res.returncode == 0, res.stderr
    layout = Layout(host)
    # A line systemd reads (as a\b) and the appliance refuses: the unit serves on.
    with layout.env_file("a2").open("a") as f:
        f.write('EXTRA="a\\b"\n')
    res = _appliance("status", "--write-metrics", "--quiet", "--root", str(host))
    assert res.returncode == 0, res.stderr
    got = _samples(layout.metrics_textfile())
    readable = state_metrics.ENV_FILE_READABLE
    assert got[(readable, (("instance", "a1"),))] == 1
    assert got[(readable, (("instance", "a2"),))] == 0
    info = {dict(k[1])["instance"] for k in got if k[0] == state_metrics.IMAGE_INFO}
    assert info == {"a1"}  # a2's image is unknown: no series claims one
    assert {dict(k[1])["instance"] for k in got if k[0] == state_metrics.UNIT_STATE} == {
        "a1",
        "a2",
    }
    [warning] = res.stderr.splitlines()
    assert warning.startswith(f"warning: a2: marked {readable} 0: {layout.env_file('a2')}:")


@pytest.mark.parametrize("umask", ["077", "027"])
def test_node_exporter_reads_the_textfile_whatever_the_writers_umask(host, umask):
    res = _appliance("install", "a1", "-p", "cpu-tiny-mtp", "--root", str(host), umask=umask)
    assert res.returncode == 0, res.stderr
    res = _appliance("status", "--write-metrics", "--quiet", "--root", str(host), umask=umask)
    assert res.returncode == 0, res.stderr
    textfile = Layout(host).metrics_textfile()
    # node_exporter runs as its own user: another user reads the file through every folder.
    read = subprocess.run(
        [*NOBODY, "cat", str(textfile)], capture_output=True, text=True, check=False
    )
    assert read.returncode == 0, read.stderr
    image = envfile.read(Layout(host).env_file("a1")).get(envfile.IMAGE_KEY)  # install's choice
    assert f'gemma4_appliance_image_info{{gpus="",image="{image}",instance="a1"' in read.stdout
    assert stat.S_IMODE(textfile.stat().st_mode) == 0o644
    assert stat.S_IMODE(textfile.parent.stat().st_mode) == 0o755
