"""An instance's devices go to Docker as CDI devices where the host offers them (a CDI spec
naming each, and Docker with CDI on), else as ``--gpus device=...`` (appliance/host/cdi.py);
``host check`` says which, from the specs of the tree it is given, and the serve program
decides the same way at each start.

The specs are written from NVIDIA's documented format (tests/data/cdi/README.md); nvidia-smi
is the captures' (tests/data/nvidia-smi/), printed by the fake of tests/test_hostcheck.py.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_hostcheck import CAPTURES, NO_DOCKER, as_machine, fake_nvidia_smi
from test_models import serve_program

from appliance import units
from appliance.host import cdi
from appliance.hostcheck import docker as hc_docker
from appliance.oci import labels
from appliance.profiles import get

SPECS = Path(__file__).parent / "data" / "cdi"
IMAGE = "gemma4-vllm:0.32.0"
H100 = [
    line.split("UUID: ")[1].rstrip(")")
    for line in (CAPTURES / "h100x8.L.txt").read_text().splitlines()
]
MIG = [
    line.split("UUID: ")[1].rstrip(")")
    for line in (CAPTURES / "rtxpro6000-mig.L.txt").read_text().splitlines()
    if "MIG " in line
]


def put(root: Path, spec: str, folder: str = "etc/cdi") -> Path:
    """The fixture ``spec`` as the tree's ``nvidia`` spec in ``folder``."""
    dest = root / folder / f"nvidia{Path(spec).suffix}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SPECS / spec, dest)
    return dest


# --- the specs -----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", sorted(p.name for p in SPECS.iterdir() if p.suffix != ".md"))
def test_the_stdlib_reader_agrees_with_a_yaml_parser_on_every_spec(spec):
    text = (SPECS / spec).read_text()
    doc = json.loads(text) if spec.endswith(".json") else yaml.safe_load(text)
    want = (doc["kind"], tuple(str(d["name"]) for d in doc["devices"]))
    assert cdi.parse(text, as_json=spec.endswith(".json")) == want
    assert "NVIDIA_VISIBLE_DEVICES=void" in text  # the spec keeps the image's "all" out


def test_sequences_written_flush_with_their_key_read_the_same():
    # YAML allows a block sequence at its key's own column (yaml.v2 writes it so).
    text = (
        "---\ncdiVersion: 0.5.0\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\n"
        'devices:\n- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: "0"\n'
        "- name: all\n  containerEdits:\n    env:\n    - name: x\nkind: nvidia.com/gpu\n"
    )
    doc = yaml.safe_load(text)
    names = tuple(d["name"] for d in doc["devices"])
    assert cdi.parse(text) == (doc["kind"], names) == ("nvidia.com/gpu", ("0", "all"))


def test_only_the_trees_own_gpu_specs_are_read(tmp_path):
    root = tmp_path / "root"
    assert cdi.read(root) == ()
    index = put(root, "h100x8.index.yaml")
    mig = put(root, "rtxpro6000-mig.uuid.json", "var/run/cdi")
    other = root / "etc/cdi/vendor.yaml"
    other.write_text("cdiVersion: 0.5.0\nkind: vendor.com/device\ndevices:\n- name: dev0\n")
    (root / "etc/cdi/notes.txt").write_text("kind: nvidia.com/gpu\n")
    assert [(s.path, s.names[0]) for s in cdi.read(root)] == [(index, "0"), (mig, MIG[0])]
    # Docker's own folders, when it names them: only those.
    assert [s.path for s in cdi.read(root, ["/var/run/cdi"])] == [mig]


def test_a_device_is_named_by_uuid_first_then_by_index():
    both = cdi.read(SPECS.parent, ["/cdi"])  # the fixtures folder as a tree's CDI folder
    index_only = [s for s in both if s.path.name == "h100x8.index.yaml"]
    with_uuid = [s for s in both if s.path.name == "h100x8.index-uuid.yaml"]
    gpu3 = {H100[3], "3"}
    assert cdi.name(gpu3, with_uuid) == f"nvidia.com/gpu={H100[3]}"
    assert cdi.name(gpu3, index_only) == "nvidia.com/gpu=3"
    assert cdi.name({H100[3]}, index_only) is None  # a UUID alone, a spec of indexes
    assert cdi.name({"0:2"}, [cdi.Spec(Path("x"), ("mig0:2",))]) == "nvidia.com/gpu=mig0:2"
    assert cdi.names([{"1"}, {"9"}], index_only) is None  # one not named: none


# --- host check says which -----------------------------------------------------------------


@pytest.fixture
def h100x8(tmp_path, monkeypatch) -> Path:
    fake_nvidia_smi(tmp_path, monkeypatch, "h100x8.csv")
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)  # not answering: the spec decides
    as_machine(monkeypatch)
    return tmp_path / "root"


def devices_line(cli_run, root: Path, profile: str) -> str:
    res = cli_run(["host", "check", "--profile", profile, "--root", str(root)], code=None)
    [line] = [ln for ln in res.output.splitlines() if " gpu.devices: " in ln]
    return line


def test_host_check_passes_cdi_names_where_the_trees_spec_names_the_devices(h100x8, cli_run):
    root = h100x8
    where = "0 (NVIDIA H100 80GB HBM3), 1 (NVIDIA H100 80GB HBM3)"
    assert devices_line(cli_run, root, "h100x2-31b-mtp") == (
        f'OK      gpu.devices: {where}: docker --gpus "device={H100[0]},{H100[1]}" (no CDI '
        "spec names nvidia.com/gpu devices)"
    )
    spec = put(root, "h100x8.index-uuid.yaml", "var/run/cdi")
    assert devices_line(cli_run, root, "h100x2-31b-mtp") == (
        f"OK      gpu.devices: {where}: docker --device nvidia.com/gpu={H100[0]} --device "
        f"nvidia.com/gpu={H100[1]} (CDI devices named by {spec})"
    )
    # An older toolkit's spec, of indexes alone: the env file's UUIDs are not its names, and
    # the unit cannot ask nvidia-smi for the indexes, so --gpus, as the serve program does.
    spec.unlink()
    spec = put(root, "h100x8.index.yaml")
    line = devices_line(cli_run, root, "h100x2-31b-mtp")
    assert line.startswith(f'WARN    gpu.devices: {where}: docker --gpus "device={H100[0]},')
    assert f"(the CDI spec ({spec}) does not name {H100[0]}, {H100[1]} (made before" in line
    assert line.endswith("(fix: nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml)")


def test_a_spec_that_does_not_name_the_slices_is_a_warning_with_the_command(
    tmp_path, monkeypatch, cli_run
):
    fake_nvidia_smi(tmp_path, monkeypatch, "rtxpro6000-mig.csv")
    monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
    as_machine(monkeypatch)
    root = tmp_path / "root"
    stale = put(root, "h100x8.index.yaml")  # made before the slices were: indexes of GPUs
    assert devices_line(cli_run, root, "mig24-e4b-mtp") == (
        "WARN    gpu.devices: 0:0 (1g.24gb of NVIDIA RTX PRO 6000 Blackwell Server Edition): "
        f"docker --gpus device={MIG[0]} (the CDI spec ({stale}) does not name {MIG[0]} (made "
        "before these devices or MIG slices were, or by index alone?)) (fix: nvidia-ctk cdi "
        "generate --output=/var/run/cdi/nvidia.yaml)"
    )
    stale.unlink()
    spec = put(root, "rtxpro6000-mig.uuid.json", "var/run/cdi")
    assert devices_line(cli_run, root, "mig24-e4b-mtp").endswith(
        f": docker --device nvidia.com/gpu={MIG[0]} (CDI devices named by {spec})"
    )


def test_dockers_gpu_access_reads_the_trees_spec_in_the_folders_docker_names(tmp_path):
    root = tmp_path / "root"
    info = {"Runtimes": {"runc": {}}, "CDISpecDirs": ["/etc/cdi", "/var/run/cdi"]}
    f = hc_docker.gpu_access(info, root)
    assert f.status == "blocker"
    assert f.message == (
        "Docker cannot give containers GPUs: no nvidia runtime (runtimes: runc), no "
        "nvidia-container-runtime-hook, no CDI spec"
    )
    spec = put(root, "h100x8.index.yaml", "var/run/cdi")
    f = hc_docker.gpu_access(info, root)
    assert (f.status, f.message) == (
        "ok",
        f"Docker takes CDI devices (CDI on; spec {spec}, 9 device name(s))",
    )
    off = hc_docker.gpu_access({"Runtimes": {"runc": {}}}, root)  # no CDISpecDirs: CDI off
    assert off.status == "blocker" and off.message.startswith(
        f"a CDI spec ({spec}) but Docker's CDI is off, and no nvidia runtime"
    )
    assert off.fix.startswith('Docker 25 to 28.2: "features": {"cdi": true}')
    with_runtime = hc_docker.gpu_access({"Runtimes": {"runc": {}, "nvidia": {}}}, root)
    assert (with_runtime.status, with_runtime.message) == ("ok", "Docker has the nvidia runtime")


# --- the serve program decides the same way ------------------------------------------------


def fake_docker(tmp_path: Path, cdi_dirs: list[str] | None) -> str:
    """A PATH whose ``docker`` answers ``image inspect`` with a CUDA image's labels and ``info``
    with ``cdi_dirs`` (None: a Docker without CDI on prints null); nvidia-smi beside it when
    the test put one there. Returns the PATH."""
    found = {
        labels.VLLM_VERSION: "0.32.0",
        labels.MTP: "true",
        labels.VERSION: "1",
        labels.VARIANT: "cuda",
    }
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "docker"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {shlex.quote(str(tmp_path / "docker.log"))}\n'
        f'if [ "$1" = image ]; then echo {shlex.quote(json.dumps(found))}; exit 0; fi\n'
        f'if [ "$1" = info ]; then echo {shlex.quote(json.dumps(cdi_dirs))}; exit 0; fi\n'
        "exit 1\n"
    )
    tool.chmod(0o755)
    return str(bin_dir)


def serve_print(root: Path, path: str) -> subprocess.CompletedProcess:
    return serve_program(root, "g", "print", path)


@pytest.fixture
def gpu_instance(tmp_path) -> Path:
    """Instance ``g`` of h100x2-31b-mtp given GPUs 2 and 3 of the 8x H100 by UUID, under a
    tree."""
    root = tmp_path / "root"
    (cache := tmp_path / "hf").mkdir()
    opts = units.Options(image=IMAGE, hf_cache_dir=str(cache), gpus=f"device={H100[2]},{H100[3]}")
    units.install(get("h100x2-31b-mtp"), "g", root=root, options=opts)
    return root


def test_the_serve_program_passes_cdi_devices_where_docker_and_the_spec_offer_them(
    tmp_path, gpu_instance, monkeypatch
):
    root = gpu_instance
    spec = put(root, "h100x8.index-uuid.yaml", "var/run/cdi")
    proc = serve_print(root, fake_docker(tmp_path, ["/etc/cdi", "/var/run/cdi"]))
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert "--gpus" not in argv
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "--device"]
    assert devices == [f"nvidia.com/gpu={H100[2]}", f"nvidia.com/gpu={H100[3]}"]
    assert (
        f"gemma4-vllm@g: GPUs: --device nvidia.com/gpu={H100[2]} --device "
        f"nvidia.com/gpu={H100[3]}: CDI devices named by {spec}"
    ) in proc.stderr.splitlines()
    # Docker with CDI off: --gpus, whatever the spec says, and the line says how to turn it on.
    proc = serve_print(root, fake_docker(tmp_path, None))
    argv = shlex.split(proc.stdout)
    assert argv[argv.index("--gpus") + 1] == f'"device={H100[2]},{H100[3]}"'
    assert "--device" not in argv
    assert "names them but Docker's CDI is off (docker info lists no CDI spec dirs)" in (
        proc.stderr
    )


def test_a_spec_of_indexes_is_matched_through_nvidia_smi(tmp_path, gpu_instance, monkeypatch):
    root = gpu_instance
    spec = put(root, "h100x8.index.yaml")
    path = fake_docker(tmp_path, ["/etc/cdi"])
    # No nvidia-smi answers (the unit's PrivateDevices=yes): the UUIDs are not the spec's names,
    # so --gpus, with a warning.
    proc = serve_print(root, path)
    argv = shlex.split(proc.stdout)
    assert argv[argv.index("--gpus") + 1] == f'"device={H100[2]},{H100[3]}"'
    assert (
        f'gemma4-vllm@g: GPUs: --gpus "device={H100[2]},{H100[3]}": the CDI spec ({spec}) '
        f"does not name {H100[2]}, {H100[3]} (made before these devices or MIG slices were, "
        "or by index alone?); nvidia-smi does not answer here for indexes; `nvidia-ctk cdi "
        "generate --output=/var/run/cdi/nvidia.yaml`"
    ) in proc.stderr.splitlines()
    # Where nvidia-smi -L answers (`serve NAME print` run by hand), each UUID has its index:
    # GPUs 2 and 3 by the spec's names.
    (tmp_path / "smi").mkdir()
    fake_nvidia_smi(tmp_path / "smi", monkeypatch, "h100x8.csv")
    proc = serve_print(root, f"{tmp_path / 'smi' / 'bin'}:{path}:/usr/bin:/bin")  # its cat
    argv = shlex.split(proc.stdout)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--device"] == [
        "nvidia.com/gpu=2",
        "nvidia.com/gpu=3",
    ]
    assert "--gpus" not in argv and proc.returncode == 0
