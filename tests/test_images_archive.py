"""``appliance image save/load`` against the real Docker engine (docker tier).

Each test imports its own tiny image (one small file, a unique label, so a unique ID) under a
repository of its own, saves it, removes it, and loads it back, or makes the archive wrong in the
way a copy to a host goes wrong (truncated, corrupt, another image than expected). The 4-9 GB CPU
images never travel here. One fast test reads an archive in the OCI layout that Docker 25 and
later write (the engine here, 20.10, writes the legacy one), built by hand.
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from pathlib import Path

import docker.errors
import pytest
from plugins.cli import invoke
from plugins.docker_engine import tiny_rootfs

from appliance.images import archive

REPO = "gemma4-archive-test"


def _invoke(*args: str):
    return invoke(list(args), code=None)


def _error_line(result) -> str:
    """The refusal: exactly one line, ``Error: ...``, after the progress lines that said what
    was being done (``checking FILE: SIZE``); nothing on stdout."""
    assert result.stdout == "", result.output
    *said, last = result.stderr.strip().splitlines()
    assert last.startswith("Error: ") and not any(ln.startswith("Error") for ln in said)
    assert all(ln.startswith(("checking ", "saving ", "loading ")) for ln in said), said
    return last


@pytest.fixture
def image(docker_engine):
    """A tiny image with two tags (``a-<uid>``, ``b-<uid>``); removed, tags and all, after."""
    uid = uuid.uuid4().hex[:12]
    docker_engine.api.import_image_from_data(
        tiny_rootfs(f"archive test {uid}"),
        repository=REPO,
        tag=f"a-{uid}",
        changes=[f'LABEL io.gemma4-appliance.test="{uid}"'],
    )
    img = docker_engine.images.get(f"{REPO}:a-{uid}")
    img.tag(REPO, f"b-{uid}")
    yield docker_engine.images.get(img.id)
    try:
        docker_engine.images.remove(img.id, force=True)
    except docker.errors.ImageNotFound:
        pass


def _gone(client, image) -> None:
    client.images.remove(image.id, force=True)
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(image.id)


def _absent(client, image_id: str) -> bool:
    try:
        client.images.get(image_id)
    except docker.errors.ImageNotFound:
        return True
    return False


@pytest.mark.docker
def test_save_rm_load_gives_the_same_id_and_the_saved_tag(docker_engine, image, tmp_path):
    tag_a, tag_b = sorted(image.tags)
    out = tmp_path / "image.tar"
    saved = _invoke("image", "save", tag_a, "--out", str(out), "--json")
    assert saved.exit_code == 0, saved.output
    record = json.loads(saved.stdout)  # stderr: the save's progress lines
    assert record["image_id"] == image.id
    # Only the tag named: another tag of the image does not move on the target host unasked.
    assert record["tags"] == [tag_a]
    # Nothing but the archive in the directory: the temporary file was renamed, not copied.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.tar"]
    assert record["size_bytes"] == out.stat().st_size
    assert len(record["archive_sha256"]) == 64

    _gone(docker_engine, image)
    loaded = _invoke("image", "load", str(out), "--expect-id", image.id)
    assert loaded.exit_code == 0, loaded.output
    assert f"loaded {image.id}" in loaded.output
    assert record["archive_sha256"] in loaded.output
    back = docker_engine.images.get(image.id)
    assert back.id == image.id
    assert back.tags == [tag_a] and tag_b not in back.tags
    assert back.labels == image.labels

    # Without --expect-id the archive's own manifest names the image; a second load is a no-op.
    again = _invoke("image", "load", str(out), "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["image_id"] == image.id


@pytest.mark.docker
def test_save_and_load_say_what_they_do_in_a_pipe_and_nothing_with_quiet(
    docker_engine, image, tmp_path
):
    """Issue 56 §3: a save or a load of GBs says what it is doing (here in a pipe: plain lines
    on stderr), the result stays on stdout, and ``-q`` keeps only the result."""
    tag = min(image.tags)
    out = tmp_path / "image.tar"
    saved = _invoke("image", "save", tag, "--out", str(out))
    assert saved.exit_code == 0, saved.output
    assert saved.stderr.startswith(f"saving {tag} to {out}: "), saved.stderr
    assert saved.stdout.startswith(f"saved {tag} to {out} (")
    loaded = _invoke("image", "load", str(out))
    assert loaded.exit_code == 0, loaded.output
    size = out.stat().st_size / 1e6
    assert loaded.stderr.splitlines() == [
        f"checking {out}: {size:.1f} MB",
        f"loading {out} into the engine: {size:.1f} MB",
    ]
    assert "\r" not in saved.stderr + loaded.stderr
    quiet_save = _invoke("-q", "image", "save", tag, "--out", str(out))
    quiet_load = _invoke("-q", "image", "load", str(out))
    assert quiet_save.exit_code == quiet_load.exit_code == 0
    assert quiet_save.stderr == quiet_load.stderr == ""
    assert quiet_load.stdout.startswith(f"loaded {image.id} from {out}")


@pytest.mark.docker
def test_save_by_id_carries_no_tag_and_loads_by_id(docker_engine, image, tmp_path):
    out = tmp_path / "by-id.tar"
    r = archive.save(docker_engine, image.id, out)
    assert r.tags == [] and r.image_id == image.id
    _gone(docker_engine, image)
    loaded = archive.load(lambda: docker_engine, out, expect_id=image.id.removeprefix("sha256:"))
    assert loaded.image_id == image.id
    assert docker_engine.images.get(image.id).tags == []


@pytest.mark.docker
def test_expect_id_mismatch_is_refused_before_loading(docker_engine, image, tmp_path):
    out = tmp_path / "image.tar"
    archive.save(docker_engine, min(image.tags), out)
    _gone(docker_engine, image)
    other = "sha256:" + "0" * 64
    result = _invoke("image", "load", str(out), "--expect-id", other)
    assert result.exit_code != 0
    line = _error_line(result)
    assert f"holds image {image.id}, not the expected {other}" in line
    assert _absent(docker_engine, image.id)  # refused before the engine saw it

    short = _invoke("image", "load", str(out), "--expect-id", image.id[:19])
    assert short.exit_code == 2
    assert "is not a full image ID" in _error_line(short)
    assert _absent(docker_engine, image.id)


@pytest.mark.docker
def test_truncated_archive_is_refused_and_nothing_loaded(docker_engine, image, tmp_path):
    out = tmp_path / "image.tar"
    archive.save(docker_engine, min(image.tags), out)
    _gone(docker_engine, image)
    data = out.read_bytes()
    # Cut inside a member (a copy that stopped mid-file) and at a member boundary (the manifest,
    # written last, lost whole).
    with tarfile.open(out) as tar:
        manifest = tar.getmember("manifest.json")
    for size, why in ((len(data) // 2, "unexpected end of data"), (manifest.offset, "manifest")):
        cut = tmp_path / f"cut-{size}.tar"
        cut.write_bytes(data[:size])
        result = _invoke("image", "load", str(cut))
        assert result.exit_code != 0
        line = _error_line(result)
        assert "is not a complete image archive" in line and why in line, line
        assert _absent(docker_engine, image.id)


@pytest.mark.docker
def test_corrupt_config_is_refused_and_nothing_loaded(docker_engine, image, tmp_path):
    out = tmp_path / "image.tar"
    archive.save(docker_engine, min(image.tags), out)
    _gone(docker_engine, image)
    # The same archive with one byte of the image config changed (same length, valid tar).
    bad = tmp_path / "bad.tar"
    with tarfile.open(out) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            f = src.extractfile(m) if m.isfile() else None
            data = f.read() if f else None
            if m.name == f"{image.id[7:]}.json" or m.name == f"blobs/sha256/{image.id[7:]}":
                data = data.replace(b'"', b"'", 1)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    result = _invoke("image", "load", str(bad))
    assert result.exit_code != 0
    assert "is corrupt" in _error_line(result)
    assert _absent(docker_engine, image.id)


@pytest.mark.docker
def test_save_into_a_missing_directory_is_refused_with_nothing_written(image, tmp_path):
    out = tmp_path / "missing" / "image.tar"
    result = _invoke("image", "save", min(image.tags), "--out", str(out))
    assert result.exit_code == 2
    assert "the directory" in _error_line(result) and "does not exist" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.docker
def test_save_of_an_unknown_image_is_refused_with_nothing_written(docker_engine, tmp_path):
    result = _invoke(
        "image", "save", f"{REPO}:never-{uuid.uuid4().hex}", "--out", str(tmp_path / "x")
    )
    assert result.exit_code == 2
    assert "no image" in _error_line(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.docker
def test_interrupted_save_leaves_nothing_behind(docker_engine, image, tmp_path):
    """A Ctrl-C in the middle of the engine's stream. A fake for the interruption only: the
    real stream of a tiny image is over in milliseconds, too soon to signal into; the stream
    itself is the engine's."""

    class Interrupting:
        def __init__(self, client):
            self.images = client.images
            self.api = self

        def get_image(self, name, chunk_size):
            stream = docker_engine.api.get_image(name, chunk_size=512)
            yield next(stream)
            raise KeyboardInterrupt

    out = tmp_path / "image.tar"
    with pytest.raises(KeyboardInterrupt):
        archive.save(Interrupting(docker_engine), min(image.tags), out)
    assert list(tmp_path.iterdir()) == []
    # An existing archive stays as it was.
    out.write_bytes(b"the previous archive")
    with pytest.raises(KeyboardInterrupt):
        archive.save(Interrupting(docker_engine), min(image.tags), out)
    assert [p.name for p in tmp_path.iterdir()] == ["image.tar"]
    assert out.read_bytes() == b"the previous archive"


def _tar(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_oci_layout_archive_names_the_config_and_the_manifest(tmp_path):
    import hashlib

    def blob(data: bytes) -> tuple[str, bytes]:
        return hashlib.sha256(data).hexdigest(), data

    layer = blob(b"")  # an empty layer is enough for the reader
    config = blob(json.dumps({"rootfs": {"type": "layers", "diff_ids": []}}).encode())
    manifest = blob(
        json.dumps(
            {"schemaVersion": 2, "config": {"digest": f"sha256:{config[0]}"}, "layers": []}
        ).encode()
    )
    stray = blob(b'{"config": {"digest": "sha256:other"}}')
    index = {"manifests": [{"digest": f"sha256:{manifest[0]}"}, {"digest": f"sha256:{stray[0]}"}]}
    files = {f"blobs/sha256/{h}": d for h, d in (layer, config, manifest, stray)}
    files["index.json"] = json.dumps(index).encode()
    files["manifest.json"] = json.dumps(
        [
            {
                "Config": f"blobs/sha256/{config[0]}",
                "RepoTags": ["gemma4-vllm:0.32.0-mtp"],
                "Layers": [f"blobs/sha256/{layer[0]}"],
            }
        ]
    ).encode()
    _tar(tmp_path / "oci.tar", files)
    info = archive.inspect(tmp_path / "oci.tar")
    assert info.image_id == f"sha256:{config[0]}"
    assert info.tags == ["gemma4-vllm:0.32.0-mtp"]
    # The containerd store's name for it (the manifest), not a digest leading elsewhere.
    assert info.ids == {info.image_id, f"sha256:{manifest[0]}"}

    del files[f"blobs/sha256/{layer[0]}"]
    _tar(tmp_path / "no-layer.tar", files)
    with pytest.raises(archive.ArchiveError, match="missing blobs/sha256/"):
        archive.inspect(tmp_path / "no-layer.tar")


ANSIBLE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "ansible"


def _load_play(tmp_path: Path, archive_file: Path, image_id: str):
    """The role's load_image.yml run for real on this machine (connection local), as the
    rollout imports it; the appliance on PATH is this venv's."""
    import os
    import subprocess
    import sys

    play = tmp_path / "load.yml"
    play.write_text(
        "- hosts: localhost\n"
        "  gather_facts: false\n"
        "  tasks:\n"
        "    - ansible.builtin.import_role:\n"
        "        name: gemma4_appliance\n"
        "        tasks_from: load_image.yml\n"
    )
    bindir = Path(sys.executable).parent
    extra = {
        "rollout_image_archive": str(archive_file),
        "rollout_image_id": image_id,
        "rollout_image_archive_dir": str(tmp_path / "host-images"),
        "appliance_path": f"{bindir}:{os.environ['PATH']}",
        "ansible_python_interpreter": sys.executable,
    }
    return subprocess.run(
        [
            str(bindir / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            json.dumps(extra),
            str(play),
        ],
        capture_output=True,
        text=True,
        env=dict(
            os.environ,
            ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
            ANSIBLE_HOME=str(tmp_path / "ansible"),
        ),
        cwd=ANSIBLE_DIR,
        timeout=300,
        check=False,
    )


@pytest.mark.docker
def test_rollout_role_copies_and_loads_the_archive_with_its_id(docker_engine, image, tmp_path):
    out = tmp_path / "image.tar"
    archive.save(docker_engine, min(image.tags), out)
    _gone(docker_engine, image)

    wrong = _load_play(tmp_path, out, "sha256:" + "1" * 64)
    assert wrong.returncode != 0
    assert f"Error: {tmp_path}/host-images/image.tar holds image {image.id}" in wrong.stdout
    assert _absent(docker_engine, image.id)

    right = _load_play(tmp_path, out, image.id)
    assert right.returncode == 0, right.stdout + right.stderr
    assert docker_engine.images.get(image.id).tags == [min(image.tags)]
    assert (tmp_path / "host-images" / "image.tar").read_bytes() == out.read_bytes()
