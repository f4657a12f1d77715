"""The appliance images against the real Docker engine the tests start (docker tier).

The CPU images are built for real (cached per machine by their build digest), tagged per the
scheme and carry the labels; ``appliance image list`` reports them and who uses them; no prune
mode removes a protected image; the images hold the engines their labels claim, and the broken
one's engine exits at start. Small images for the prune/tag checks are ``docker import``ed with
labels under a repository of their own, so the shared ``gemma4-vllm`` tags are never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path

import docker.errors
import httpx
import pytest
from plugins.cli import invoke
from plugins.docker_engine import CACHE as DOCKER_CACHE
from plugins.docker_engine import tiny_rootfs

from appliance import profiles
from appliance.engine import devmodel
from appliance.engine.local import free_port
from appliance.engine_api import specdecode
from appliance.host.layout import Layout
from appliance.images import scheme
from appliance.oci import labels

# Containers of its own only, no session engine: either stream may run it (tests/conftest.py).
pytestmark = [pytest.mark.docker, pytest.mark.own_engines]

OCI = "org.opencontainers.image."


def _invoke(*args: str):
    result = invoke(list(args), code=None)
    return result


# --- the CPU images ---------------------------------------------------------------------------


def test_mtp_image_is_tagged_per_scheme_and_labelled(appliance_images, docker_engine):
    r = appliance_images["cpu-mtp"]
    tags = set(docker_engine.images.get(r.image_id).tags)
    assert {"gemma4-vllm:0.32.0-mtp-cpu", "gemma4-vllm:mtp-cpu", "gemma4-vllm:latest-cpu"} <= tags
    lab = docker_engine.images.get(r.image_id).labels
    assert lab[labels.VLLM_VERSION] == "0.32.0"
    assert lab[labels.MTP] == "true"
    assert lab[labels.VERSION] == "0.32.0-mtp"
    assert lab[OCI + "title"] == "gemma4-vllm"
    assert lab[OCI + "created"].endswith("Z")
    assert lab["io.gemma4-appliance.variant"] == "cpu"
    print(f"\ncpu-mtp: {r.size_bytes / 1e9:.2f} GB, {r.seconds:.0f}s, cached={r.cached}")


def test_pre_mtp_image_is_tagged_per_scheme_and_labelled(appliance_images, docker_engine):
    r = appliance_images["cpu-pre-mtp"]
    image = docker_engine.images.get(r.image_id)
    assert {"gemma4-vllm:0.19.0-cpu", "gemma4-vllm:pre-mtp-cpu"} <= set(image.tags)
    assert "gemma4-vllm:latest-cpu" not in image.tags
    assert image.labels[labels.VLLM_VERSION] == "0.19.0"
    assert image.labels[labels.MTP] == "false"
    assert image.labels[labels.VERSION] == "0.19.0"
    print(f"\ncpu-pre-mtp: {r.size_bytes / 1e9:.2f} GB, {r.seconds:.0f}s, cached={r.cached}")


def test_broken_image_keeps_mtp_labels_and_no_floating_tag(appliance_images, docker_engine):
    r = appliance_images["cpu-broken"]
    image = docker_engine.images.get(r.image_id)
    assert "gemma4-vllm:0.32.0-mtp-broken-cpu" in image.tags
    # No floating tag (a host upgraded from the old scheme may keep its old version tag).
    assert not [t for t in image.tags if scheme.floating(t)], image.tags
    assert image.labels[labels.MTP] == "true"  # every pre-cutover check passes...
    assert image.labels[scheme.BROKEN] == "true"
    assert image.labels[labels.VERSION] == "0.32.0-mtp-broken"
    # ...and it sits on the exact MTP image, one small layer up.
    assert r.size_bytes - appliance_images["cpu-mtp"].size_bytes < 1e6


def test_warm_build_is_a_cache_hit(appliance_images):
    result = _invoke("image", "build", "cpu-mtp", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["cached"] is True
    assert out["image_id"] == appliance_images["cpu-mtp"].image_id
    print(f"\nwarm build of cpu-mtp: {out['seconds']:.2f}s")


@pytest.mark.parametrize(
    ("target", "vllm", "torch"),
    [("cpu-mtp", "0.32.0", "2.13.0"), ("cpu-pre-mtp", "0.19.0", "2.10.0")],
)
def test_image_holds_the_engine_its_labels_claim(
    appliance_images, docker_engine, target, vllm, torch
):
    # Also: the installer stayed out of the image, and it byte-compiled what it installed (a module
    # no engine start has imported yet has its bytecode).
    code = (
        "import importlib.util as u, os, shutil, sys, vllm, torch; "
        "api = os.path.join(os.path.dirname(vllm.__file__), 'entrypoints/openai/api_server.py'); "
        "print(vllm.__version__, torch.__version__, shutil.which('uv'), "
        "os.path.exists('/tmp/installer'), os.path.exists(u.cache_from_source(api)))"
    )
    out = docker_engine.containers.run(
        appliance_images[target].image_id,
        ["-c", code],
        entrypoint="python3",
        remove=True,
        network_mode="none",
    ).decode()
    got_vllm, got_torch, *rest = out.split()
    assert got_vllm.startswith(vllm) and got_torch.startswith(torch)
    assert rest == ["None", "False", "True"], out
    assert appliance_images[target].labels[labels.VLLM_VERSION] == vllm


# In the image: the entry point's seeding, then vLLM's own questions about each architecture
# given, counting the Python processes vLLM starts to ask (none when it takes the build's answers:
# a miss asks in one and writes its own file, a new inode).
ASK_VLLM = """
import os, sys
sys.path.insert(0, "/opt/gemma4-appliance")
import vllm_main
vllm_main._seed_model_info_cache()
import vllm.model_executor.models.registry as registry
asked = []
run = registry.subprocess.run
registry.subprocess.run = lambda *a, **k: asked.append(a) or run(*a, **k)
folder = "/root/.cache/vllm/modelinfos"
def inodes():
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return {n: os.stat(os.path.join(folder, n)).st_ino for n in names}
before = inodes()
for arch in sys.argv[1:]:
    registry.ModelRegistry.models[arch].inspect_model_cls()
print(sorted(before), len(asked), before == inodes())
"""


@pytest.mark.parametrize(
    ("target", "archs"),
    [("cpu-mtp", ["Gemma4ForCausalLM", "Gemma4MTPModel"]), ("cpu-pre-mtp", ["Gemma4ForCausalLM"])],
)
def test_vllm_takes_the_images_own_answers_about_its_model_classes(
    appliance_images, docker_engine, tmp_path, target, archs
):
    """gotchas/vllm-model-info-subprocess.md: on an empty cache (the unit's mount), the entry
    point puts the build's answers where vLLM looks, and vLLM asks no Python process of its own.
    With the answers hidden the same code asks (3 processes for one architecture, here)."""
    cache = tmp_path / "vllm"
    cache.mkdir()
    out = docker_engine.containers.run(
        appliance_images[target].image_id,
        ["-c", ASK_VLLM, *archs],
        entrypoint="python3",
        remove=True,
        network_mode="none",
        volumes={str(cache): {"bind": "/root/.cache/vllm", "mode": "rw"}},
    ).decode()
    seeded, asked, untouched = out.strip().splitlines()[-1].rsplit(" ", 2)
    assert (asked, untouched) == ("0", "True"), out
    names = json.loads(seeded.replace("'", '"'))
    assert "vllm-model_executor-models-gemma4-Gemma4ForCausalLM.json" in names
    assert sorted(os.listdir(cache / "modelinfos")) == names


def test_broken_image_engine_exits_at_start(appliance_images, docker_engine):
    container = docker_engine.containers.run(
        appliance_images["cpu-broken"].image_id,
        ["/models/target"],
        detach=True,
        network_mode="none",
    )
    try:
        status = container.wait(timeout=120)
        logs = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    assert status["StatusCode"] != 0
    assert "vllm.entrypoints.openai" in logs and "Error" in logs, logs[-2000:]


# --- list ---------------------------------------------------------------------------------------


def _instance(root: Path, name: str, image: str) -> None:
    layout = Layout(root)
    layout.env_dir.mkdir(parents=True, exist_ok=True)
    layout.env_file(name).write_text(f"# instance {name}\nVLLM_IMAGE={image}\n")


def _rollback(root: Path, name: str, image: str) -> None:
    slot = Layout(root).rollback_slot(name)
    slot.parent.mkdir(parents=True, exist_ok=True)
    slot.write_text(json.dumps({"image": image}))


def test_list_reports_tags_labels_and_which_instance_uses_which_image(appliance_images, tmp_path):
    _instance(tmp_path, "gpu0", "gemma4-vllm:mtp-cpu")
    _instance(tmp_path, "gpu1", "gemma4-vllm:0.32.0-mtp-cpu")
    _rollback(tmp_path, "gpu0", "gemma4-vllm:pre-mtp-cpu")
    _instance(tmp_path, "ghost", "gemma4-vllm:9.9.9-mtp")
    result = _invoke("image", "list", "--root", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    by_id = {row["id"]: row for row in data["images"]}
    mtp = by_id[appliance_images["cpu-mtp"].image_id]
    assert mtp["used_by"] == ["gpu0", "gpu1"]
    assert mtp["mtp"] is True and mtp["vllm_version"] == "0.32.0"
    assert "gemma4-vllm:latest-cpu" in mtp["tags"] and mtp["variant"] == "cpu"
    pre = by_id[appliance_images["cpu-pre-mtp"].image_id]
    assert pre["rollback_for"] == ["gpu0"] and pre["used_by"] == []
    assert pre["labels"][labels.MTP] == "false"
    assert data["missing"] == [
        {"instance": "ghost", "source": "env", "ref": "gemma4-vllm:9.9.9-mtp"}
    ]
    # The table says the same to a person.
    table = _invoke("image", "list", "--root", str(tmp_path)).output
    line = next(x for x in table.splitlines() if x.startswith(mtp["id"][7:19]))
    assert "gpu0,gpu1" in line and "0.32.0" in line and " yes " in line
    assert "missing: instance ghost" in table


# --- prune protection, tag ---------------------------------------------------------------------


@pytest.fixture
def test_repo(docker_engine):
    """A repository of its own; every image left in it is removed afterwards."""
    repo = f"gemma4-vllm-test-{uuid.uuid4().hex[:8]}"
    made: list[str] = []

    def make(tag: str, version: str = "1.0.0", mtp: bool = True) -> str:
        changes = [
            f'LABEL {labels.VLLM_VERSION}="{version}"',
            f'LABEL {labels.MTP}="{"true" if mtp else "false"}"',
            f'LABEL test.id="{uuid.uuid4().hex}"',  # a distinct image per call
        ]
        docker_engine.api.import_image_from_data(
            tiny_rootfs("prune test"), repository=repo, tag=tag, changes=changes
        )
        image_id = docker_engine.images.get(f"{repo}:{tag}").id
        made.append(image_id)
        return image_id

    make.repo = repo
    make.made = made
    yield make
    for image in docker_engine.images.list():
        for t in image.tags:
            if t.startswith(f"{repo}:"):
                docker_engine.images.remove(t)
    for image_id in made:
        # Most are gone already (their last tag went above, or a prune took them).
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_engine.images.remove(image_id)


def _tags_of(client, image_ids) -> dict[str, list[str] | None]:
    """Each image's tags (None when it is gone): only these images, since the engine is shared
    with other tests that build and remove their own while this one runs."""
    found = {}
    for image_id in image_ids:
        try:
            found[image_id] = sorted(client.images.get(image_id).tags)
        except docker.errors.ImageNotFound:
            found[image_id] = None
    return found


def _exists(client, image_id: str) -> bool:
    try:
        client.images.get(image_id)
        return True
    except docker.errors.ImageNotFound:
        return False


def test_protected_images_survive_every_prune(test_repo, docker_engine, appliance_images, tmp_path):
    repo = test_repo.repo
    # The real CPU image, under the test repository too, run by an instance.
    docker_engine.images.get(appliance_images["cpu-mtp"].image_id).tag(repo, "0.32.0-mtp")
    _instance(tmp_path, "real", f"{repo}:0.32.0-mtp")
    protected = {
        "real image, env file": appliance_images["cpu-mtp"].image_id,
        "env file by tag": test_repo("1.1.0-mtp"),
        "rollback slot": test_repo("0.9.0", "0.9.0", mtp=False),
        "saved env": test_repo("0.8.0", "0.8.0", mtp=False),
        "pre-mtp tag": test_repo("pre-mtp", "0.7.0", mtp=False),
    }
    _instance(tmp_path, "a", f"{repo}:1.1.0-mtp")
    _rollback(tmp_path, "a", f"{repo}:0.9.0")
    saved = Layout(tmp_path).saved_env("b")
    saved.parent.mkdir(parents=True)
    saved.write_text(f"VLLM_IMAGE={repo}:0.8.0\n")
    # Referenced by id only, and dangling: its tag moves to another image below.
    protected["env file by id, untagged"] = test_repo("moving")
    _instance(tmp_path, "c", protected["env file by id, untagged"])
    doomed_dangling = test_repo("moving-too")
    test_repo("moving")
    test_repo("moving-too")
    doomed_version_only = test_repo("0.1.0")
    doomed_floating = test_repo("latest")

    expect_gone = {
        "dangling": {doomed_dangling},
        "superseded": {doomed_version_only},
        "all": {doomed_floating},
    }
    for mode in ("dangling", "superseded", "all"):
        watched = {*test_repo.made, *protected.values()}
        before = _tags_of(docker_engine, watched)
        dry = _invoke(
            "image",
            "prune",
            "--mode",
            mode,
            "--dry-run",
            "--root",
            str(tmp_path),
            "--repository",
            repo,
        )
        assert dry.exit_code == 0, dry.output
        # It names what it would remove, and removes nothing at all.
        for image_id in expect_gone[mode]:
            assert f"would remove {image_id[7:19]}" in dry.output, dry.output
        for image_id in protected.values():
            assert f"would remove {image_id[7:19]}" not in dry.output, dry.output
        # --json: the same judgement as records, each kept image with its reason.
        argv = ["image", "prune", "--mode", mode, "--dry-run", "--root", str(tmp_path)]
        dry_json = _invoke(*argv, "--repository", repo, "--json")
        assert dry_json.exit_code == 0, dry_json.output
        shown = json.loads(dry_json.stdout)
        removed = {i["id"] for i in shown["removed"]}
        assert shown["dry_run"] is True and expect_gone[mode] <= removed, shown
        assert not removed & set(protected.values()), shown
        assert all(i["why"] for i in shown["kept"]), shown
        assert _tags_of(docker_engine, watched) == before
        result = _invoke(
            "image", "prune", "--mode", mode, "--root", str(tmp_path), "--repository", repo
        )
        assert result.exit_code == 0, result.output
        for why, image_id in protected.items():
            assert _exists(docker_engine, image_id), f"{mode} removed the image protected by {why}"
            if mode == "all":  # every image is selected, so each protected one says why
                assert f"kept {image_id[7:19]}" in result.output, result.output
        for image_id in expect_gone[mode]:
            assert not _exists(docker_engine, image_id), f"{mode} kept {image_id}"
    # The tags the instances name still resolve: nothing they use was untagged.
    assert docker_engine.images.get(f"{repo}:0.32.0-mtp").id == protected["real image, env file"]
    assert docker_engine.images.get(f"{repo}:pre-mtp").id == protected["pre-mtp tag"]
    # The shared images were never this prune's business.
    assert _exists(docker_engine, appliance_images["cpu-pre-mtp"].image_id)


def test_rm_refuses_a_referenced_image_and_removes_a_free_one(
    test_repo, docker_engine, tmp_path, cli_run
):
    repo = test_repo.repo
    used = test_repo("2.0.0-mtp")
    free = test_repo("0.2.0")
    _instance(tmp_path, "a", f"{repo}:2.0.0-mtp")
    result = cli_run(["image", "rm", f"{repo}:2.0.0-mtp", "--root", str(tmp_path)], code=2)
    assert "refusing to remove" in result.output and "instance a" in result.output
    assert _exists(docker_engine, used)
    result = _invoke("image", "rm", f"{repo}:0.2.0", "--root", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"ref": f"{repo}:0.2.0", "image_id": free}
    assert not _exists(docker_engine, free)


def test_rm_and_prune_of_an_image_a_stopped_container_uses_say_so_and_remove_nothing(
    test_repo, docker_engine, tmp_path, cli_run
):
    repo = test_repo.repo
    used = test_repo("3.0.0")
    # Created, never started: a stopped container still holds its image.
    container = docker_engine.containers.create(used, ["/README"])
    try:
        result = cli_run(["image", "rm", f"{repo}:3.0.0", "--root", str(tmp_path)], code=1)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, result.output
        assert lines[0].startswith(f"Error: cannot remove {repo}:3.0.0: the Docker engine refused")
        assert container.short_id in lines[0]
        assert "docker ps -a --filter ancestor=" in lines[0]
        assert docker_engine.images.get(f"{repo}:3.0.0").id == used
        # By id too (what `image rm` accepts): refused the same way, nothing removed.
        result = cli_run(["image", "rm", used, "--root", str(tmp_path)], code=1)
        assert "Error: cannot remove" in result.output and "Traceback" not in result.output
        # prune reports it as kept, with the engine's reason, and goes on.
        result = _invoke(
            "image", "prune", "--mode", "all", "--root", str(tmp_path), "--repository", repo
        )
        assert result.exit_code == 0, result.output
        assert f"kept {used[7:19]} {repo}:3.0.0: the engine refused" in result.output
        assert docker_engine.images.get(f"{repo}:3.0.0").id == used
    finally:
        container.remove(force=True)


def test_tag_the_engine_rejects_is_one_clear_line_and_tags_nothing(
    test_repo, docker_engine, cli_run
):
    repo = test_repo.repo
    # A valid version whose tag is longer than the engine's 128 characters: the scheme's rules
    # accept it, the engine refuses it.
    version = "0." + ".".join(["1"] * 70)
    image_id = test_repo("candidate", version, mtp=True)
    result = cli_run(["image", "tag", image_id, "--repository", repo], code=1)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"Error: cannot tag {image_id[:19]} as {repo}:{version}-mtp")
    assert "the Docker engine refused: invalid tag format" in lines[0]
    assert f"check --repository and the image's {labels.VLLM_VERSION} label" in lines[0]
    assert docker_engine.images.get(image_id).tags == [f"{repo}:candidate"]


def test_tag_moves_latest_and_keeps_the_last_non_mtp_image_as_pre_mtp(
    test_repo, docker_engine, cli_run
):
    repo = test_repo.repo
    old = test_repo("latest", "0.19.0", mtp=False)
    new = test_repo("candidate", "0.32.0", mtp=True)
    result = _invoke("image", "tag", new, "--repository", repo)
    assert result.exit_code == 0, result.output
    assert set(result.output.split()) >= {f"{repo}:0.32.0-mtp", f"{repo}:mtp", f"{repo}:latest"}
    # Again with --json: the same tags (the scheme applied twice changes nothing), one object.
    again = _invoke("image", "tag", new, "--repository", repo, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout) == {"source": new, "tags": result.output.split()}
    assert docker_engine.images.get(f"{repo}:latest").id == new
    assert docker_engine.images.get(f"{repo}:pre-mtp").id == old
    unlabelled = cli_run(["image", "tag", appliance_base_ref(docker_engine)], code=2)
    assert "no appliance labels" in unlabelled.output


def appliance_base_ref(client) -> str:
    base = [i for i in client.images.list("gemma4-appliance-base") if i.tags]
    return base[0].tags[0]


# --- the engines in the images, for real (docker + engine tiers) --------------------------------


# The machine's vLLM cache, mounted as a unit mounts its own: vLLM inspects the model's class in
# a subprocess (10-16 s of CPU) unless this cache already holds the answer for its version.
VLLM_CACHE = DOCKER_CACHE.parent / "docker-vllm-cache"


@contextlib.contextmanager
def _engine_container(client, image_id: str, args: list[str]):
    """Run an image's entry point (``vllm serve ARGS``) with the tiny models mounted at /models,
    on the host network so it binds the host's 127.0.0.1. Removed afterwards."""
    model = devmodel.cached("copy")
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    container = client.containers.run(
        image_id,
        args,
        detach=True,
        network_mode="host",
        shm_size="512m",  # the default 64 MiB kills the CPU engine at start
        volumes={
            str(model.root): {"bind": "/models", "mode": "ro"},
            str(VLLM_CACHE): {"bind": "/root/.cache/vllm", "mode": "rw"},
        },
        name=f"gemma4-images-test-{uuid.uuid4().hex[:8]}",
    )
    try:
        yield container
    finally:
        container.remove(force=True)


def _wait_healthy(container, url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        container.reload()
        if container.status == "exited":
            pytest.fail("engine exited:\n" + container.logs().decode(errors="replace")[-3000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    pytest.fail("engine not healthy in time:\n" + container.logs().decode(errors="replace")[-3000:])


def _chat(url: str, max_tokens: int = 24) -> dict:
    body = {
        "model": devmodel.SERVED_NAME,
        "messages": [{"role": "user", "content": "hello hello"}],
        "max_tokens": max_tokens,
        # Greedy: MTP drafts are greedy, so under sampling (vLLM's default temperature 1 with
        # this model's generation config) a draft is accepted only with the target's
        # probability of it, and a short run of the tiny model can accept none.
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


# This test and the next run in a docker-only run: with the systemd tests that prove the same on
# the same image under the real unit in the run, conftest.py deselects them (REPROVEN_BY_SYSTEMD).
@pytest.mark.engine
def test_mtp_image_serves_gemma4_mtp_and_the_counters_move(appliance_images, docker_engine):
    port = free_port()
    args = profiles.get("cpu-tiny-mtp").serve_args(devmodel="/models", host="127.0.0.1", port=port)
    url = f"http://127.0.0.1:{port}"
    with _engine_container(docker_engine, appliance_images["cpu-mtp"].image_id, args) as c:
        _wait_healthy(c, url)
        assert httpx.get(f"{url}/version").json()["version"] == "0.32.0"
        before = specdecode.parse(httpx.get(f"{url}/metrics").text)
        reply = _chat(url)
        after = specdecode.parse(httpx.get(f"{url}/metrics").text)
    assert reply["usage"]["completion_tokens"] == 24
    d = specdecode.delta(before, after)
    assert d.status == "ok" and d.drafts > 0 and d.accepted > 0, d


@pytest.mark.engine
def test_pre_mtp_image_serves_without_speculative_decoding(appliance_images, docker_engine):
    port = free_port()
    args = profiles.get("cpu-tiny").serve_args(devmodel="/models", host="127.0.0.1", port=port)
    url = f"http://127.0.0.1:{port}"
    with _engine_container(docker_engine, appliance_images["cpu-pre-mtp"].image_id, args) as c:
        _wait_healthy(c, url)
        assert httpx.get(f"{url}/version").json()["version"].startswith("0.19.0")
        reply = _chat(url, max_tokens=8)
        metrics = httpx.get(f"{url}/metrics").text
    assert reply["usage"]["completion_tokens"] == 8
    assert "vllm:spec_decode_num_drafts" not in metrics


@pytest.mark.engine
@pytest.mark.parametrize(
    ("spec", "fatal"),
    [
        # The profile's own flag, exactly what the serve script adds for an MTP-labelled image:
        # 0.19's transformers does not even know the Gemma 4 assistant (drafter) checkpoint.
        (None, "validation error for SpeculativeConfig"),
        # The method alone (the drafter left out): 0.19 has no "mtp" speculative method.
        ({"method": "mtp", "num_speculative_tokens": 2}, "Unsupported speculative method: 'mtp'"),
    ],
    ids=["profile-flag", "method-only"],
)
def test_pre_mtp_image_given_the_mtp_flag_fails_to_start(
    appliance_images, docker_engine, spec, fatal
):
    """Why the labels matter: the same rollback image, handed the MTP config as the serve script
    would hand it to an MTP-labelled image, never serves."""
    port = free_port()
    prof = profiles.get("cpu-tiny-mtp")
    args = prof.serve_args(devmodel="/models", host="127.0.0.1", port=port, speculative=False)
    if spec is None:
        args += prof.speculative_args(devmodel="/models")
    else:
        args += ["--speculative-config", json.dumps(spec)]
    with _engine_container(docker_engine, appliance_images["cpu-pre-mtp"].image_id, args) as c:
        status = c.wait(timeout=600)
        logs = c.logs().decode(errors="replace")
    assert status["StatusCode"] != 0
    lines = [ln.strip() for ln in logs.splitlines() if fatal in ln]
    assert lines, logs[-3000:]
    assert "Application startup complete" not in logs
    print(
        f"\npre-mtp image, {spec or 'the profile flag'}: exit {status['StatusCode']}: {lines[-1]}"
    )


def test_official_image_dockerfile_adds_entry_point_and_labels(
    appliance_images, docker_engine, test_repo
):
    """docker/Dockerfile, built for real. FAKE, and the only one here: no registry is reachable,
    so the official ``vllm/vllm-openai:v0.32.0`` is stood in for by our CPU image under that
    name (only if no real one is present); the Dockerfile's own steps all run for real."""
    official = "vllm/vllm-openai:v0.32.0"
    stood_in = False
    try:
        docker_engine.images.get(official)
    except docker.errors.ImageNotFound:
        docker_engine.images.get(appliance_images["cpu-mtp"].image_id).tag(official)
        stood_in = True
    try:
        result = _invoke(
            "image",
            "build",
            "cuda",
            "--vllm-version",
            "0.32.0",
            "--repository",
            test_repo.repo,
            "--json",
        )
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        test_repo.made.append(out["image_id"])
        assert set(out["tags"]) == {
            f"{test_repo.repo}:{t}" for t in ("0.32.0-mtp", "mtp", "latest")
        }
        lab = out["labels"]
        assert lab[labels.VLLM_VERSION] == "0.32.0" and lab[labels.MTP] == "true"
        assert lab["io.gemma4-appliance.variant"] == "cuda"
        assert lab[OCI + "base.name"] == official
        image = docker_engine.images.get(out["image_id"])
        assert image.attrs["Config"]["Entrypoint"] == ["/usr/local/bin/gemma4-entrypoint"]
        # The entry point runs vLLM's own CLI through the wrapper: `--help` answers.
        help_text = docker_engine.containers.run(
            out["image_id"], ["--help"], remove=True, network_mode="none"
        ).decode()
        assert "usage: vllm serve" in help_text
    finally:
        if stood_in:
            docker_engine.images.remove(official)


def test_a_new_base_forgets_superseded_ones(appliance_images, docker_engine, tmp_path):
    from appliance.images import base
    from appliance.images.build import docker_folder

    current = base.base_ref(docker_folder())
    stale = f"{base.BASE_REPOSITORY}:{base.SUITE}-{uuid.uuid4().hex[:16]}"
    repo, tag = stale.split(":")
    docker_engine.api.import_image_from_data(
        tiny_rootfs("prune test"), repository=repo, tag=tag, changes=['LABEL test.id="stale-base"']
    )
    (tmp_path / f"{tag}.tar").write_bytes(b"old")
    (tmp_path / f"{current.split(':')[1]}.tar").write_bytes(b"current")
    base._forget_older_bases(docker_engine, current, tmp_path / f"{current.split(':')[1]}.tar")
    with pytest.raises(docker.errors.ImageNotFound):
        docker_engine.images.get(stale)
    docker_engine.images.get(current)  # the base the CPU images sit on stays
    assert [p.name for p in tmp_path.iterdir()] == [f"{current.split(':')[1]}.tar"]


# --- the API key file (secrets stay secret) ----------------------------------------------------

# The image's vLLM replaced by a script that prints what the entry point handed it, mounted over
# vllm_main.py: the real image and the real entry point, without an engine start.
_SHOW_KEY = "import os, sys\nprint(repr(os.environ.get('VLLM_API_KEY')), sys.argv[1:])\n"


@pytest.mark.parametrize(
    ("content", "via"),
    [
        (b"k3y-Value_1.~+/=\n", "serve"),
        (b"\r\n  k3y-Value_1 \t\r\n\r\n", "serve"),  # CRLF: the same key as Python's strip()
        (b"k3y-Value_1\n", "file"),  # a mounted secret: its content, less the trailing newline
        (b"", "stdin"),  # a key promised on stdin and none there
        (b"\n", "file"),
    ],
)
def test_the_entry_point_takes_the_key_it_is_handed(appliance_images, tmp_path, content, via):
    """The key the serve program hands over (its key file read by the appliance's one rule,
    then written alone into the container's stdin), or a mounted secret file: the engine's
    VLLM_API_KEY is that key; none where one was promised is exit 78 and one line."""
    import subprocess

    from appliance.host import apikey
    from appliance.serve.main import key_pipe

    image = appliance_images["cpu-mtp"]
    assert image.labels[labels.API_KEY_STDIN] == "true"
    key_file, show = tmp_path / "api-key", tmp_path / "show.py"
    key_file.write_bytes(content)
    key_file.chmod(0o600)  # as `appliance install` writes it
    show.write_text(_SHOW_KEY)
    if via == "file":
        how, stdin, want = ["--volume", f"{key_file}:{labels.API_KEY_PATH}:ro"], None, content
    else:
        how = ["--interactive", "--env", f"{labels.API_KEY_STDIN_ENV}=1"]
        want = apikey.read(key_file).encode() if via == "serve" else content
        stdin = key_pipe(want.decode())
    try:
        proc = subprocess.run(
            ["docker", "run", "--rm", "--pull", "never", "--cap-drop", "ALL"]
            + ["--security-opt", "no-new-privileges", "--network", "none", *how]
            + ["--volume", f"{show}:/opt/gemma4-appliance/vllm_main.py:ro"]
            + [image.image_id, "/models/target", "--port", "1"],
            stdin=stdin,
            capture_output=True,
            timeout=120,
            check=False,
        )
    finally:
        if stdin is not None:
            os.close(stdin)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    key = want.decode().rstrip("\n")
    if not key:
        assert proc.returncode == 78 and out == "", (out, err)
        assert len(err.strip().splitlines()) == 1 and "API key" in err and "empty" in err
        return
    assert proc.returncode == 0, err
    assert out.strip() == f"{key!r} ['serve', '/models/target', '--port', '1']"


def test_without_a_key_file_the_entry_point_leaves_the_environment_alone(
    appliance_images, tmp_path
):
    """A VLLM_API_KEY given to the container (`docker run --env`, compose) is left as it is."""
    import subprocess

    show = tmp_path / "show.py"
    show.write_text(_SHOW_KEY)
    base = ["docker", "run", "--rm", "--pull", "never", "--network", "none"]
    base += ["--volume", f"{show}:/opt/gemma4-appliance/vllm_main.py:ro"]
    image = appliance_images["cpu-mtp"].image_id
    out = subprocess.run(
        [*base, "--env", "VLLM_API_KEY=from-env", image, "m"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.stdout.strip() == "'from-env' ['serve', 'm']", out.stderr
    out = subprocess.run([*base, image, "m"], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "None ['serve', 'm']", out.stderr
