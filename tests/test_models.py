"""``appliance models``: pull from a stand-in hub on 127.0.0.1, export/import, verify.

The hub is tests/plugins/hub.py: a real HTTP server standing in for the whole Hugging Face Hub
API, because no hub is reachable from these machines or from CI and its gating and resume faults
cannot be produced on demand. The client is the real huggingface_hub (the version the stand-in
mimics, checked below) pointed at it with HF_ENDPOINT. The models are the tiny pair from
appliance.engine.devmodel, under hub-style repo ids given by a profile file of the test's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import huggingface_hub
import pytest
from plugins.cli import invoke
from plugins.hub import (
    DRAFTER_REPO,
    HUB_CLIENT_VERSION,
    HUB_TOKEN,
    TARGET_REPO,
    HubFile,
    HubRepo,
)
from test_cutover_lock import _squatter

from appliance import profiles, units
from appliance.doctor.host import models_check
from appliance.host import envfile
from appliance.host.layout import Layout, Shape
from appliance.models import cache, where
from appliance.models import verify as mv
from appliance.units import instance

PROFILE_TOML = f"""
name = "tiny-hub-mtp"
description = "The tiny pair under hub repo ids (tests)"
model = "{TARGET_REPO}"
served_model_name = "gemma4-tiny"
dtype = "float32"
max_model_len = 512
enforce_eager = true
min_vllm = "0.32.0"
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "auto" }}

[speculative]
method = "mtp"
model = "{DRAFTER_REPO}"
num_speculative_tokens = 2

[hardware]
device = "cpu"
"""

SHARD = "model.safetensors"


@pytest.fixture()
def profile_file(tmp_path) -> Path:
    path = tmp_path / "tiny-hub-mtp.toml"
    path.write_text(PROFILE_TOML)
    return path


@pytest.fixture()
def token_file(tmp_path) -> Path:
    path = tmp_path / "hf-token"
    path.write_text(HUB_TOKEN + "\n")
    path.chmod(0o600)
    return path


def _args(profile_file: Path, cache_dir: Path) -> list[str]:
    return ["--profile-file", str(profile_file), "--hf-cache-dir", str(cache_dir)]


def _run(args: list[str], env: dict[str, str] | None = None, prefix: bool = False):
    """``appliance models ARGS`` (``prefix``: ARGS[0] is a group option such as ``-q``)."""
    argv = [args[0], "models", *args[1:]] if prefix else ["models", *args]
    return invoke(argv, env=env, code=None)


def _pull_cmd(profile_file, cache_dir, token_file) -> list[str]:
    return [
        str(Path(sys.executable).parent / "appliance"),
        "models",
        "pull",
        *_args(profile_file, cache_dir),
        "--token-file",
        str(token_file),
    ]


def _env(hub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(Path(os.environ.get("TMPDIR", "/tmp"))))
    return env


@pytest.fixture()
def pulled(tmp_path, local_hub, profile_file, token_file) -> Path:
    """A cache with both tiny models pulled from the local hub."""
    cache_dir = tmp_path / "hf"
    result = _run(
        ["pull", *_args(profile_file, cache_dir), "--token-file", str(token_file)],
        env={"HF_ENDPOINT": local_hub.url},
    )
    assert result.exit_code == 0, result.output
    return cache_dir


def test_the_stand_in_hub_mimics_the_installed_client():
    """plugins/hub.py answers as the hub answers one huggingface_hub release: another one may
    ask for other routes or headers, so an upgrade fails here until the stand-in is checked
    against it and HUB_CLIENT_VERSION bumped with the pin."""
    constraints = (Path(__file__).resolve().parents[1] / "constraints.txt").read_text()
    pinned = re.search(r"^huggingface_hub==(\S+)$", constraints, re.MULTILINE)
    assert pinned is not None, "constraints.txt no longer pins huggingface_hub"
    assert (pinned.group(1), huggingface_hub.__version__) == (HUB_CLIENT_VERSION,) * 2, (
        f"the stand-in hub mimics huggingface_hub {HUB_CLIENT_VERSION}; constraints.txt pins "
        f"{pinned.group(1)}, {huggingface_hub.__version__} is installed: check tests/plugins/"
        "hub.py against the new client, then bump HUB_CLIENT_VERSION"
    )


def _snapshot(cache_dir: Path, repo_id: str) -> Path:
    repo = cache.repo_dir(cache_dir / "hub", repo_id)
    return repo / "snapshots" / cache.read_ref(repo)


# --- pull ------------------------------------------------------------------------------------


def test_pull_downloads_both_models_with_the_token_and_a_second_run_transfers_nothing(
    tmp_path, local_hub, profile_file, token_file
):
    cache_dir = tmp_path / "hf"
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        _pull_cmd(profile_file, cache_dir, token_file),
        env=_env(local_hub),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "models ok: target appliance-test/gemma4-tiny-it@" in proc.stdout
    # In a pipe: a plain line naming each model, none of the hub client's \r-drawn bars.
    assert f"target {TARGET_REPO}@main: downloading into {cache_dir}/hub" in proc.stderr
    assert f"drafter {DRAFTER_REPO}@main: downloading into {cache_dir}/hub" in proc.stderr
    assert "\r" not in proc.stderr
    for repo_id, directory in ((TARGET_REPO, "target"), (DRAFTER_REPO, "drafter")):
        snap = _snapshot(cache_dir, repo_id)
        assert snap.name == local_hub.repos[repo_id].commit
        served = local_hub.repos[repo_id].files[SHARD].data
        assert (snap / SHARD).read_bytes() == served
    # The gated target was fetched with the token (the hub answers 401 without it).
    assert all(r.authorized for r in local_hub.downloads())
    first = len(local_hub.downloads())
    assert first == sum(len(r.files) for r in local_hub.repos.values())

    again = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        _pull_cmd(profile_file, cache_dir, token_file),
        env=_env(local_hub),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert len(local_hub.downloads()) == first  # nothing transferred the second time
    # The token never reaches argv, output or the cache.
    assert HUB_TOKEN not in " ".join(_pull_cmd(profile_file, cache_dir, token_file))
    assert HUB_TOKEN not in proc.stdout + proc.stderr + again.stdout + again.stderr
    for path in cache_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert HUB_TOKEN.encode() not in path.read_bytes(), path


def _big_safetensors(n: int) -> bytes:
    """A valid safetensors file of one ``n``-byte tensor (random: nothing compresses it)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + os.urandom(n)


def test_pull_resumes_a_dropped_transfer_with_a_range_request(tmp_path, local_hub, token_file):
    # The hub client writes in 10 MiB chunks and resumes from what it wrote: a 24 MB shard
    # dropped 12 MB in must come back with "Range: bytes=<written>-", not from zero.
    big = "appliance-test/one-big-shard"
    files = dict(local_hub.repos[TARGET_REPO].files)
    files[SHARD] = HubFile(_big_safetensors(24_000_000), lfs=True)
    local_hub.add(HubRepo(big, files))
    profile = tmp_path / "big.toml"
    profile.write_text(
        PROFILE_TOML.split("[speculative]")[0].replace(TARGET_REPO, big)
        + '[hardware]\ndevice = "cpu"\n'
    )
    cut = 12_000_000
    local_hub.drop_after[SHARD] = cut
    cache_dir = tmp_path / "hf"
    result = _run(
        ["pull", *_args(profile, cache_dir), "--token-file", str(token_file)],
        env={"HF_ENDPOINT": local_hub.url},
    )
    assert result.exit_code == 0, result.output
    size = len(files[SHARD].data)
    shard = [(r.range, r.status, r.sent) for r in local_hub.downloads(SHARD)]
    assert len(shard) == 2 and shard[0] == (None, 200, cut), shard
    rng, status, sent = shard[1]
    start = int(rng.removeprefix("bytes=").rstrip("-"))
    assert status == 206 and 0 < start <= cut and sent == size - start
    assert (_snapshot(cache_dir, big) / SHARD).read_bytes() == files[SHARD].data


def test_pull_killed_midway_then_resumed_completes_without_refetching_finished_files(
    tmp_path, local_hub, profile_file, token_file
):
    cache_dir = tmp_path / "hf"
    size = len(local_hub.repos[TARGET_REPO].files[SHARD].data)
    local_hub.throttle[SHARD] = 200_000  # ~12 s for the 2.3 MB shard
    proc = subprocess.Popen(
        _pull_cmd(profile_file, cache_dir, token_file),
        env=_env(local_hub),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while local_hub.streamed.get(SHARD, 0) < size // 4:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the shard never started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a real kill, midway through the shard
        proc.wait()
    # The hub client wrote refs/main before the files: half a model, which verify must catch
    # (from the listing it keeps), in one line, exit 78.
    half = _run(["verify", "--quick", *_args(profile_file, cache_dir)])
    assert half.exit_code == 78
    assert len(half.output.strip().splitlines()) == 1
    assert f"target {TARGET_REPO}: file {SHARD} missing" in half.output

    fetched_before = {r.path for r in local_hub.downloads() if not r.path.endswith(SHARD)}
    local_hub.throttle.clear()
    n_before = len(local_hub.downloads())
    again = subprocess.run(  # noqa: PLW1510 - the exit code is asserted
        _pull_cmd(profile_file, cache_dir, token_file),
        env=_env(local_hub),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert "removed 1 partial file(s)" in again.stdout
    refetched = {r.path for r in local_hub.downloads()[n_before:]}
    assert not fetched_before & refetched  # files finished before the kill came from the cache
    assert not list(cache_dir.rglob("*.incomplete"))
    ok = _run(["verify", *_args(profile_file, cache_dir)])
    assert ok.exit_code == 0, ok.output


def test_pull_of_a_gated_model_without_a_token_is_one_line_naming_the_token_file(
    tmp_path, local_hub, profile_file
):
    missing = tmp_path / "etc" / "gemma4-vllm" / "hf-token"
    result = _run(
        ["pull", *_args(profile_file, tmp_path / "hf"), "--root", str(tmp_path)],
        env={"HF_ENDPOINT": local_hub.url},
    )
    assert result.exit_code == 1
    # The progress line that named the model, then the one error line; nothing on stdout.
    assert result.stdout == ""
    progress_line, *lines = result.stderr.strip().splitlines()
    assert progress_line == f"target {TARGET_REPO}@main: downloading into {tmp_path}/hf/hub"
    assert len(lines) == 1
    assert f"target {TARGET_REPO} is gated and no token was given (" in lines[0]
    assert "HF_TOKEN" not in lines[0]  # not set here: nothing to say about it
    assert f"read token in {missing} (chmod 600)" in lines[0]


def test_pull_with_HF_TOKEN_set_says_in_one_line_that_it_is_not_used_and_why(
    tmp_path, local_hub, profile_file
):
    """``HF_TOKEN`` is huggingface_hub's variable: the pull never reads a token from the
    environment (gotchas/models-gated-and-air-gapped.md), and says so instead of being silent."""
    missing = tmp_path / "etc" / "gemma4-vllm" / "hf-token"
    result = _run(
        ["pull", *_args(profile_file, tmp_path / "hf"), "--root", str(tmp_path)],
        env={"HF_ENDPOINT": local_hub.url, "HF_TOKEN": HUB_TOKEN},
    )
    assert result.exit_code == 1
    warning, _progress, error = result.stderr.strip().splitlines()
    assert warning == (
        f"warning: HF_TOKEN is set but not used: the pull reads the hub token only from "
        f"{missing} (mode 0600), which is not there; the environment passes a token to every "
        "process a command starts"
    )
    assert error.startswith(
        f"Error: target {TARGET_REPO} is gated and no token was given (HF_TOKEN is set but not "
        f"used: put it in {missing}, chmod 600) "
    )
    assert HUB_TOKEN not in result.output
    assert local_hub.log and not any(r.authorized for r in local_hub.log)


def test_pull_with_a_token_file_and_HF_TOKEN_uses_the_file_and_says_so(
    tmp_path, local_hub, profile_file, token_file
):
    result = _run(
        ["pull", *_args(profile_file, tmp_path / "hf"), "--token-file", str(token_file)],
        env={"HF_ENDPOINT": local_hub.url, "HF_TOKEN": "hf_someOtherToken"},
    )
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        (
            f"warning: HF_TOKEN is set but not used: the pull reads the hub token only from "
            f"{token_file} (mode 0600); the environment passes a token to every process a "
            "command starts"
        )
    ]
    assert any(r.authorized for r in local_hub.downloads())  # the file's token, not HF_TOKEN's


def test_a_token_file_others_may_read_is_refused(tmp_path, local_hub, profile_file, token_file):
    token_file.chmod(0o644)
    result = _run(
        ["pull", *_args(profile_file, tmp_path / "hf"), "--token-file", str(token_file)],
        env={"HF_ENDPOINT": local_hub.url},
    )
    assert result.exit_code == 2
    assert "mode 0644" in result.output and f"chmod 600 {token_file}" in result.output
    assert HUB_TOKEN not in result.output
    assert local_hub.log == []  # refused before any request


# --- verify ----------------------------------------------------------------------------------


def test_verify_passes_on_a_pulled_cache_and_checks_every_hash(pulled, profile_file):
    result = _run(["verify", *_args(profile_file, pulled)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("models ok: target ")
    # The hashing says what it hashes (here in a pipe: a plain line per model, on stderr).
    said = result.stderr.splitlines()
    assert [ln.split(":")[0] for ln in said] == [
        f"hashing target {TARGET_REPO}",
        f"hashing drafter {DRAFTER_REPO}",
    ]
    assert all(ln.endswith(" MB") for ln in said), said
    assert _run(["-q", "verify", *_args(profile_file, pulled)], prefix=True).stderr == ""
    report = mv.verify(where.locate(profile_file=profile_file, hf_cache_dir=pulled))
    assert report.ok and [m.hashed for m in report.models] == [m.files for m in report.models]
    assert all(m.files >= 5 for m in report.models)
    as_json = json.loads(_run(["verify", "--json", *_args(profile_file, pulled)]).stdout)
    assert as_json["ok"] and as_json["problems"] == [] and as_json["fix"] is None
    assert [(m["role"], m["hashed"]) for m in as_json["models"]] == [
        (m.spec.role, m.hashed) for m in report.models
    ]


def _fails(profile_file, cache_dir, *flags):
    """The one Error line (after the lines that said what was being hashed)."""
    result = _run(["verify", *flags, *_args(profile_file, cache_dir)])
    assert result.exit_code == 78, result.output
    assert result.stdout == ""
    lines = [ln for ln in result.stderr.strip().splitlines() if not ln.startswith("hashing ")]
    assert len(lines) == 1, lines
    assert f"appliance models pull --profile-file {profile_file}" in lines[0]
    return lines[0]


def test_verify_missing_model(tmp_path, profile_file):
    line = _fails(profile_file, tmp_path / "empty", "--quick")
    assert f"target {TARGET_REPO}: not in the model cache" in line
    assert f"drafter {DRAFTER_REPO}: not in the model cache" in line
    res = _run(["verify", "--json", *_args(profile_file, tmp_path / "empty")])
    body = json.loads(res.output)
    assert res.exit_code == 78 and not body["ok"]
    assert [(p["role"], p["repo_id"]) for p in body["problems"]] == [
        ("target", TARGET_REPO),
        ("drafter", DRAFTER_REPO),
    ]
    assert body["fix"].startswith(f"fix: appliance models pull --profile-file {profile_file}")


def test_verify_missing_shard(pulled, profile_file):
    (_snapshot(pulled, TARGET_REPO) / SHARD).resolve().unlink()  # the blob behind the link
    for flags in ((), ("--quick",)):
        line = _fails(profile_file, pulled, *flags)
        assert f"target {TARGET_REPO}: file {SHARD} missing" in line


def test_verify_sharded_model_missing_a_listed_shard(pulled, profile_file):
    # A model split in shards whose index lists one that is not there (no hub listing).
    snap = _snapshot(pulled, DRAFTER_REPO)
    repo = cache.repo_dir(pulled / "hub", DRAFTER_REPO)
    (repo / "trees" / f"{snap.name}.json").unlink()
    index = {"metadata": {}, "weight_map": {"a": SHARD, "b": "model-00002-of-00002.safetensors"}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    line = _fails(profile_file, pulled)
    assert "weight shard model-00002-of-00002.safetensors missing" in line


def test_verify_truncated_file(pulled, profile_file):
    blob = (_snapshot(pulled, TARGET_REPO) / SHARD).resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) // 2])
    line = _fails(profile_file, pulled, "--quick")
    assert f"file {SHARD} has {len(data) // 2} of {len(data)} bytes" in line
    # Without the hub's listing the safetensors header still gives the length away.
    repo = cache.repo_dir(pulled / "hub", TARGET_REPO)
    for tree in (repo / "trees").iterdir():
        tree.unlink()
    line = _fails(profile_file, pulled, "--quick")
    assert f"file {SHARD} is truncated ({len(data) // 2} of {len(data)} bytes)" in line


def test_verify_corrupt_file_same_size_is_caught_by_the_hash(pulled, profile_file):
    blob = (_snapshot(pulled, DRAFTER_REPO) / SHARD).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert _run(["verify", "--quick", *_args(profile_file, pulled)]).exit_code == 0
    line = _fails(profile_file, pulled)
    assert f"drafter {DRAFTER_REPO}: file {SHARD} is corrupt (sha256" in line


def test_verify_wrong_drafter(pulled, tmp_path):
    # A profile whose drafter is the target itself: a gemma4_text model, not an MTP drafter.
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(PROFILE_TOML.replace(f'model = "{DRAFTER_REPO}"', f'model = "{TARGET_REPO}"'))
    line = _fails(wrong, pulled)
    assert f"drafter {TARGET_REPO}: is a gemma4_text model, not a Gemma 4 MTP drafter" in line


def test_verify_drafter_for_another_target_width(pulled, profile_file):
    snap = _snapshot(pulled, DRAFTER_REPO)
    config = json.loads((snap / "config.json").read_text())
    config["backbone_hidden_size"] = 5376  # 31B's width: not this target's
    link = snap / "config.json"
    link.unlink()
    link.write_text(json.dumps(config))
    line = _fails(profile_file, pulled, "--quick")
    assert "drafts for a backbone of width 5376" in line and "has 128" in line


def test_verify_instance_reads_profile_and_cache_from_the_env_file(pulled, tmp_path):
    root = tmp_path / "root"
    env = root / "etc" / "gemma4-vllm" / "31b.env"
    env.parent.mkdir(parents=True)
    env.write_text(
        "VLLM_IMAGE=x\nAPPLIANCE_PROFILE=l4x4-31b-mtp\n"
        "HF_CACHE_DIR=/var/lib/gemma4-vllm/huggingface\n"
    )
    result = _run(["verify", "--quick", "--instance", "31b", "--root", str(root)])
    assert result.exit_code == 78
    line = result.output.strip()
    assert "target google/gemma-4-31B-it: not in the model cache " in line
    assert str(root / "var/lib/gemma4-vllm/huggingface/hub") in line
    assert f"appliance models pull 31b --root {root}" in line
    assert len(line.splitlines()) == 1


# --- export / import -------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["dir", "tar"])
def test_export_then_import_into_an_empty_cache_verifies(pulled, profile_file, tmp_path, form):
    copy = tmp_path / ("copy" if form == "dir" else "copy.tar")
    out = _run(["export", *_args(profile_file, pulled), "--to", str(copy)])
    assert out.exit_code == 0, out.output
    fresh = tmp_path / "fresh"
    got = _run(["import", *_args(profile_file, fresh), "--from", str(copy)])
    assert got.exit_code == 0, got.output
    assert "models ok" in got.output
    for repo_id in (TARGET_REPO, DRAFTER_REPO):
        a, b = _snapshot(pulled, repo_id), _snapshot(fresh, repo_id)
        assert a.name == b.name
        assert {p.name: p.read_bytes() for p in a.iterdir()} == {
            p.name: p.read_bytes() for p in b.iterdir()
        }
        assert all(p.is_symlink() for p in b.iterdir())  # the hub client's layout
    assert _run(["verify", *_args(profile_file, fresh)]).exit_code == 0


def test_import_refuses_a_corrupt_copy_and_lays_nothing(pulled, profile_file, tmp_path):
    copy = tmp_path / "copy"
    assert _run(["export", *_args(profile_file, pulled), "--to", str(copy)]).exit_code == 0
    manifest = json.loads((copy / "manifest.json").read_text())
    drafter = next(m for m in manifest["models"] if m["repo_id"] == DRAFTER_REPO)
    member = copy / "models" / DRAFTER_REPO.replace("/", "--") / SHARD
    data = bytearray(member.read_bytes())
    data[100] ^= 1
    member.write_bytes(bytes(data))
    fresh = tmp_path / "fresh"
    got = _run(["import", *_args(profile_file, fresh), "--from", str(copy)])
    assert got.exit_code == 1
    assert f"{SHARD} is corrupt (sha256" in got.output and len(got.output.splitlines()) == 1
    assert drafter["files"]
    hub = fresh / "hub"
    assert sorted(p.name for p in hub.iterdir()) == [cache.LOCK_NAME]  # nothing laid


def test_import_tarball_missing_a_file_lays_nothing(pulled, profile_file, tmp_path):
    copy = tmp_path / "copy.tar"
    assert _run(["export", *_args(profile_file, pulled), "--to", str(copy)]).exit_code == 0
    cut = tmp_path / "cut.tar"
    with tarfile.open(copy) as src, tarfile.open(cut, "w") as dst:
        for info in src.getmembers():
            if not info.name.endswith(f"{DRAFTER_REPO.replace('/', '--')}/{SHARD}"):
                dst.addfile(info, src.extractfile(info))
    fresh = tmp_path / "fresh"
    got = _run(["import", *_args(profile_file, fresh), "--from", str(cut)])
    assert got.exit_code == 1 and "lacks 1 file(s)" in got.output
    assert sorted(p.name for p in (fresh / "hub").iterdir()) == [cache.LOCK_NAME]


def test_export_refuses_a_broken_source(pulled, profile_file, tmp_path):
    (_snapshot(pulled, TARGET_REPO) / "config.json").unlink()
    got = _run(["export", *_args(profile_file, pulled), "--to", str(tmp_path / "c.tar")])
    assert got.exit_code == 78 and "config.json missing" in got.output
    assert not (tmp_path / "c.tar").exists()


def test_manifest_paths_cannot_escape_the_cache(pulled, profile_file, tmp_path):
    copy = tmp_path / "copy"
    assert _run(["export", *_args(profile_file, pulled), "--to", str(copy)]).exit_code == 0
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"][0]["files"][0]["path"] = "../../../etc/passwd"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    fresh = tmp_path / "fresh"
    got = _run(["import", *_args(profile_file, fresh), "--from", str(copy)])
    assert got.exit_code == 2 and "bad file path" in got.output
    # Refused before anything was laid: the cache holds its lock file and nothing else.
    laid = sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*"))
    assert laid == ["hub", f"hub/{cache.LOCK_NAME}"]


# --- weights you can trust (security review N3, N10) ----------------------------------------


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("form", ["dir", "tar"])
def test_reimport_replaces_a_corrupt_blob_of_the_right_size(pulled, profile_file, tmp_path, form):
    copy = tmp_path / ("copy" if form == "dir" else "copy.tar")
    assert _run(["export", *_args(profile_file, pulled), "--to", str(copy)]).exit_code == 0
    blob = (_snapshot(pulled, DRAFTER_REPO) / SHARD).resolve()
    size = blob.stat().st_size
    _flip_last_byte(blob)  # same size: only a hash can tell
    got = _run(["import", *_args(profile_file, pulled), "--from", str(copy)])
    assert got.exit_code == 0, got.output
    assert blob.stat().st_size == size
    full = _run(["verify", *_args(profile_file, pulled)])
    assert full.exit_code == 0, full.output


def test_repull_replaces_a_corrupt_blob_of_the_right_size(
    pulled, local_hub, profile_file, token_file
):
    blob = (_snapshot(pulled, DRAFTER_REPO) / SHARD).resolve()
    _flip_last_byte(blob)
    before = len(local_hub.downloads(SHARD))
    got = _run(
        ["pull", *_args(profile_file, pulled), "--token-file", str(token_file)],
        env={"HF_ENDPOINT": local_hub.url},
    )
    assert got.exit_code == 0, got.output
    assert f"drafter {DRAFTER_REPO}: removed 1 corrupt file(s) from the cache" in got.output
    assert len(local_hub.downloads(SHARD)) == before + 1  # only the bad one fetched again
    assert blob.read_bytes() == local_hub.repos[DRAFTER_REPO].files[SHARD].data
    full = _run(["verify", *_args(profile_file, pulled)])
    assert full.exit_code == 0, full.output


def test_import_refuses_a_manifest_whose_commit_is_not_the_pin(pulled, local_hub, tmp_path):
    pin = local_hub.repos[TARGET_REPO].commit
    pinned = tmp_path / "pinned.toml"
    pinned.write_text(PROFILE_TOML.replace("dtype =", f'revision = "{pin}"\ndtype ='))
    copy = tmp_path / "copy"
    assert _run(["export", *_args(pinned, pulled), "--to", str(copy)]).exit_code == 0
    manifest = json.loads((copy / "manifest.json").read_text())
    target = next(m for m in manifest["models"] if m["repo_id"] == TARGET_REPO)
    assert target["revision"] == pin
    target["commit"] = "b" * 40  # the revision still names the pin: the commit does not
    (copy / "manifest.json").write_text(json.dumps(manifest))
    got = _run(["import", *_args(pinned, pulled), "--from", str(copy)])
    assert got.exit_code == 2, got.output
    assert f"holds target {TARGET_REPO} at bbbbbbbbbbbb, the profile pins {pin}" in got.output
    assert len(got.output.strip().splitlines()) == 1
    repo = cache.repo_dir(pulled / "hub", TARGET_REPO)
    assert cache.read_ref(repo) == pin  # refs/main never moved off the pin
    assert not (repo / "snapshots" / ("b" * 40)).exists()


@pytest.mark.parametrize("form", ["dir", "tar"])
def test_export_prints_the_copy_sha256_and_import_checks_it(pulled, profile_file, tmp_path, form):
    copy = tmp_path / ("copy" if form == "dir" else "copy.tar")
    out = _run(["export", *_args(profile_file, pulled), "--to", str(copy)])
    assert out.exit_code == 0, out.output
    hashed = copy / "manifest.json" if form == "dir" else copy
    digest = hashlib.sha256(hashed.read_bytes()).hexdigest()  # what sha256sum prints
    assert f"sha256: {digest}" in out.output
    fresh = tmp_path / "fresh"
    wrong = _run(
        ["import", *_args(profile_file, fresh), "--from", str(copy), "--expect-sha256", "0" * 64]
    )
    assert wrong.exit_code == 1, wrong.output
    assert f"has sha256 {digest}, expected {'0' * 64}" in wrong.output
    assert len(wrong.output.strip().splitlines()) == 1
    assert sorted(p.name for p in (fresh / "hub").iterdir()) == [cache.LOCK_NAME]  # nothing laid
    bad = _run(["import", *_args(profile_file, fresh), "--from", str(copy), "--expect-sha256", "x"])
    assert bad.exit_code == 2 and "64 hex digits" in bad.output
    right = _run(
        ["import", *_args(profile_file, fresh), "--from", str(copy), "--expect-sha256", digest]
    )
    assert right.exit_code == 0, right.output
    assert "models ok" in right.output


def test_pull_export_and_import_json_are_one_object_each_from_their_records(
    tmp_path, local_hub, profile_file, token_file
):
    """--json where scripts act (ecosystem review E15): each prints one object on stdout, the
    records its text says (each model and its commit; the copy and its sha256) and the check
    after it, as `models verify --json` says it; a refusal stays the one Error: line."""
    cache_dir, copy, fresh = tmp_path / "hf", tmp_path / "copy.tar", tmp_path / "fresh"
    argv = ["pull", *_args(profile_file, cache_dir), "--token-file", str(token_file), "--json"]
    pulled = _run(argv, env={"HF_ENDPOINT": local_hub.url})
    assert pulled.exit_code == 0, pulled.output
    body = json.loads(pulled.stdout)
    assert [(p["spec"]["role"], p["spec"]["repo_id"]) for p in body["pulled"]] == [
        ("target", TARGET_REPO),
        ("drafter", DRAFTER_REPO),
    ]
    for p in body["pulled"]:
        assert p["snapshot"] == str(_snapshot(cache_dir, p["spec"]["repo_id"]))
        assert Path(p["snapshot"]).name == p["commit"]
        assert (p["partial_removed"], p["corrupt_removed"]) == (0, 0)
    assert body["verify"]["ok"] and body["verify"]["quick"] and body["verify"]["problems"] == []

    exported = _run(["export", *_args(profile_file, cache_dir), "--to", str(copy), "--json"])
    assert exported.exit_code == 0, exported.output
    out = json.loads(exported.stdout)
    assert (out["copy"], out["sha256_of"], out["profile"]) == (str(copy), str(copy), "tiny-hub-mtp")
    assert out["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest()  # what sha256sum says
    assert [(m["repo_id"], m["commit"]) for m in out["models"]] == [
        (p["spec"]["repo_id"], p["commit"]) for p in body["pulled"]
    ]

    where_to = [*_args(profile_file, fresh), "--from", str(copy), "--json"]
    wrong = _run(["import", *where_to, "--expect-sha256", "0" * 64])
    assert wrong.exit_code == 1 and wrong.stdout == "", wrong.output
    assert wrong.stderr.startswith("Error: ") and len(wrong.stderr.splitlines()) == 1
    laid = _run(["import", *where_to, "--expect-sha256", out["sha256"]])
    assert laid.exit_code == 0, laid.output
    got = json.loads(laid.stdout)
    assert [
        (i["spec"]["repo_id"], i["commit"], i["files"], i["bytes"]) for i in got["imported"]
    ] == [(m["repo_id"], m["commit"], m["files"], m["bytes"]) for m in out["models"]]
    assert got["verify"]["ok"] and got["verify"]["fix"] is None


def test_location_defaults(tmp_path):
    loc = where.locate(root=tmp_path, profile="l4x4-31b-mtp")
    assert loc.hub == tmp_path / "var/lib/gemma4-vllm/huggingface/hub"
    assert loc.token_file == tmp_path / "etc/gemma4-vllm/hf-token"
    assert [s.repo_id for s in loc.specs] == [
        "google/gemma-4-31B-it",
        "google/gemma-4-31B-it-assistant",
    ]
    report = mv.verify(loc, quick=True)
    assert not report.ok and len(report.problems) == 2


# --- the serve program's start-time check on the Hugging Face cache layout -----------------
#
# The real serve program of an instance installed (under a temporary root) with the test's
# hub-repo profile and HF_CACHE_DIR the pulled cache; no docker on PATH: the check runs before
# the first docker call, so a complete cache gets as far as "no docker client".

SCRIPT_FIX = "fix: appliance models pull h; air-gapped: appliance models import h --from COPY"


@pytest.fixture()
def no_docker_path(tmp_path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    return str(bin_dir)


def _install(root: Path, profile_file: Path, cache_dir: Path) -> None:
    prof = profiles.load_file(profile_file)
    units.install(prof, "h", root=root, options=units.Options(hf_cache_dir=str(cache_dir)))


def serve_program(root: Path, name: str, verb: str, path: str) -> subprocess.CompletedProcess:
    """The installed serve program's ``NAME VERB`` as its unit runs it: the env file's values
    as its environment, ``path`` as its PATH (stand-ins for the tools it calls)."""
    values = envfile.read(Layout(root).env_file(name)).values
    return subprocess.run(
        [str(Layout(root).serve_program), name, verb],
        env={**values, "PATH": path, "APPLIANCE_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _script_refuses(root, path, profile_file, cache_dir) -> str:
    """The script's one line, checked against `models verify --quick`'s problems, word for word."""
    proc = serve_program(root, "h", "run", path)
    assert (proc.returncode, proc.stdout) == (78, ""), proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    report = mv.verify(where.locate(profile_file=profile_file, hf_cache_dir=cache_dir), quick=True)
    assert lines[0] == f"gemma4-vllm@h: {report.one_line(SCRIPT_FIX)}"
    return lines[0]


def test_serve_script_passes_a_complete_cache_then_goes_on_to_docker(
    pulled, profile_file, tmp_path, no_docker_path
):
    _install(tmp_path / "root", profile_file, pulled)
    proc = serve_program(tmp_path / "root", "h", "run", no_docker_path)
    assert proc.returncode == 78
    assert f"models ok: target {TARGET_REPO}@" in proc.stderr
    assert f"; drafter {DRAFTER_REPO}@" in proc.stderr
    assert "no docker client" in proc.stderr  # past the check, at the first docker call


def test_serve_script_with_HF_TOKEN_in_the_unit_env_says_it_is_not_used(
    profile_file, tmp_path, no_docker_path
):
    """The engine runs offline: a hub token in the unit's environment (its env file, which
    every user may read) does nothing there, and the serve program says so at each start."""
    root = tmp_path / "root"
    _install(root, profile_file, tmp_path)
    env_file = Layout(root).env_file("h")
    env_file.write_text(env_file.read_text() + f"HF_TOKEN={HUB_TOKEN}\n")
    values = envfile.read(env_file).values
    proc = subprocess.run(
        [str(Layout(root).serve_program), "h", "print"],
        env={**values, "PATH": no_docker_path, "APPLIANCE_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 78 and "no docker client" in proc.stderr  # went on to docker
    assert proc.stderr.splitlines()[0] == (
        "gemma4-vllm@h: HF_TOKEN is set but not used: the engine runs offline from the cache "
        "`appliance models pull` filled, which reads the hub token from "
        f"/etc/gemma4-vllm/hf-token only; take it out of {env_file} (or the unit's drop-in), "
        "which every user may read"
    )
    assert HUB_TOKEN not in proc.stderr


def test_serve_script_refuses_a_missing_shard(pulled, profile_file, tmp_path, no_docker_path):
    _install(tmp_path / "root", profile_file, pulled)
    (_snapshot(pulled, TARGET_REPO) / SHARD).resolve().unlink()  # the blob behind the link
    line = _script_refuses(tmp_path / "root", no_docker_path, profile_file, pulled)
    assert f"target {TARGET_REPO}: file {SHARD} missing" in line


def test_serve_script_refuses_a_truncated_file_by_the_hub_listing(
    pulled, profile_file, tmp_path, no_docker_path
):
    _install(tmp_path / "root", profile_file, pulled)
    # Not a weight file: only the listing (trees/COMMIT.json, read in bash) knows its size.
    blob = (_snapshot(pulled, DRAFTER_REPO) / "tokenizer.json").resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[:100])
    line = _script_refuses(tmp_path / "root", no_docker_path, profile_file, pulled)
    assert f"file tokenizer.json has 100 of {len(data)} bytes (truncated or replaced)" in line


def test_serve_script_refuses_a_truncated_shard_without_a_listing(
    pulled, profile_file, tmp_path, no_docker_path
):
    _install(tmp_path / "root", profile_file, pulled)
    blob = (_snapshot(pulled, TARGET_REPO) / SHARD).resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) // 2])
    for tree in (cache.repo_dir(pulled / "hub", TARGET_REPO) / "trees").iterdir():
        tree.unlink()
    line = _script_refuses(tmp_path / "root", no_docker_path, profile_file, pulled)
    assert f"file {SHARD} is truncated ({len(data) // 2} of {len(data)} bytes)" in line


def test_serve_script_refuses_a_wrong_drafter(pulled, profile_file, tmp_path, no_docker_path):
    # Install refuses a profile naming a wrong drafter; what is under the drafter's repo id in
    # the cache can still be another model: here the target's config (a gemma4_text model).
    _install(tmp_path / "root", profile_file, pulled)
    link = _snapshot(pulled, DRAFTER_REPO) / "config.json"
    link.unlink()
    link.write_text((_snapshot(pulled, TARGET_REPO) / "config.json").read_text())
    line = _script_refuses(tmp_path / "root", no_docker_path, profile_file, pulled)
    assert f"drafter {DRAFTER_REPO}: is a gemma4_text model, not a Gemma 4 MTP drafter" in line


def test_serve_script_refuses_a_missing_model_and_a_half_done_download(
    pulled, profile_file, tmp_path, no_docker_path
):
    _install(tmp_path / "root", profile_file, pulled)
    repo = cache.repo_dir(pulled / "hub", DRAFTER_REPO)
    (repo / "blobs" / ("0" * 64 + ".incomplete")).write_bytes(b"half")
    line = _script_refuses(tmp_path / "root", no_docker_path, profile_file, pulled)
    assert (
        f"drafter {DRAFTER_REPO}: a download was interrupted (blobs/{'0' * 64}.incomplete" in line
    )
    shutil.rmtree(cache.repo_dir(pulled / "hub", TARGET_REPO))
    line = _script_refuses(tmp_path / "root", no_docker_path, profile_file, pulled)
    assert f"target {TARGET_REPO}: not in the model cache {pulled}/hub" in line


# --- doctor's instance.models check ----------------------------------------------------------


def test_doctor_checks_the_instance_models_quick_with_the_fix(pulled, profile_file, tmp_path):
    # HF_CACHE_DIR=/hf in the env file; under --root that is ROOT/hf (here: the pulled cache).
    root = tmp_path / "root"
    prof = profiles.load_file(profile_file)
    units.install(prof, "h", root=root, options=units.Options(hf_cache_dir="/hf"))
    (root / "hf").symlink_to(pulled)
    # The profile is the test's own file, not a shipped one that the env file could name: the
    # record is built with it directly (doctor.run builds it from the env file: test_doctor.py).
    env = envfile.read(Layout(root).env_file("h"))
    inst = instance.Instance(
        "h", prof, env.get("VLLM_IMAGE"), "127.0.0.1", 8000, env, Path("/x"), Path("/y"), Shape("h")
    )
    check = models_check(inst, root)
    assert check.status == "ok", check
    assert check.summary.startswith(f"models ok: target {TARGET_REPO}@")
    (_snapshot(pulled, TARGET_REPO) / SHARD).resolve().unlink()
    check = models_check(inst, root)
    assert check.status == "fail"
    assert f"target {TARGET_REPO}: file {SHARD} missing" in check.summary
    assert f"fix: appliance models pull h --root {root}" in check.summary
    assert check.evidence["full_check"] == "appliance models verify h"


def test_another_user_cannot_hold_the_cache_lock_and_block_every_pull(tmp_path):
    """Review S5: the cache lock was 0644, so any local user could hold `flock -s` on it and
    refuse every `models pull` and `import` (the repair path of a corrupt blob). A real other
    user (nobody) tries; a lock file an older appliance made 0644 is tightened too."""
    base = Path(tempfile.mkdtemp(prefix="appliance-cache-"))  # other users may enter it
    try:
        base.chmod(0o755)
        hub = base / "hub"
        hub.mkdir(mode=0o755)
        (hub / cache.LOCK_NAME).write_text("")
        (hub / cache.LOCK_NAME).chmod(0o644)  # as an older appliance left it
        with cache.locked(hub):
            pass
        nobody = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
        proc, said = _squatter(hub / cache.LOCK_NAME, *nobody)
        try:
            with cache.locked(hub):  # not refused as "another ... pull or import is writing"
                pass
            assert said == "refused"
        finally:
            proc.kill()
            proc.wait()
        assert stat.S_IMODE((hub / cache.LOCK_NAME).stat().st_mode) == 0o600
    finally:
        shutil.rmtree(base)


# --- progress (issue 56 §3) --------------------------------------------------------------------


def test_models_pull_in_a_pipe_says_which_model_and_quiet_says_nothing(
    pulled, local_hub, profile_file, token_file
):
    """A re-pull (the cache full): the appliance hashes what is there, then asks the hub; in a
    pipe each step is a plain line naming the model, and the hub's ``\\r`` bars stay off."""
    args = ["pull", "--profile-file", str(profile_file), "--hf-cache-dir", str(pulled)]
    args += ["--token-file", str(token_file)]
    env = {"HF_ENDPOINT": local_hub.url}
    res = invoke(["models", *args], env=env)
    err = res.stderr.splitlines()
    for role, repo in (("target", TARGET_REPO), ("drafter", DRAFTER_REPO)):
        assert any(
            line.startswith(f"hashing the cached files of {role} {repo}: ") and line.endswith(" MB")
            for line in err
        ), res.stderr
        assert f"{role} {repo}@main: downloading into {pulled}/hub" in err, res.stderr
    assert "\r" not in res.stderr and "%|" not in res.stderr
    assert f"target {TARGET_REPO}@" in res.stdout  # the results stay on stdout

    quiet = invoke(["-q", "models", *args], env=env)
    assert quiet.stderr == ""
    assert quiet.stdout == res.stdout


def test_models_pull_on_a_terminal_labels_the_hub_bars_with_the_model(
    tmp_path, local_hub, profile_file, token_file
):
    """On a terminal the hub client draws its bars; each says which model it is for."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 0x0 draws none
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=local_hub.url)
    cmd = [str(Path(sys.executable).parent / "appliance"), "models", "pull"]
    cmd += ["--profile-file", str(profile_file), "--hf-cache-dir", str(tmp_path / "hf")]
    cmd += ["--token-file", str(token_file)]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    for role, repo in (("target", TARGET_REPO), ("drafter", DRAFTER_REPO)):
        assert f"{role} {repo}: Fetching" in text, repr(text)
        assert f"{role} {repo}@main: downloading into" in text


def test_a_first_install_names_the_pull_unless_its_models_are_on_the_host(pulled, profile_file):
    """The engine runs offline: a first install whose models are not in the cache its env file
    names says `models pull` first; one whose models are there does not (before, a first
    install never named it and the unit exited 78 at its start)."""
    roots = pulled.parent / "bare", pulled.parent / "stocked"
    shutil.copytree(pulled, roots[1] / "hf", symlinks=True)
    said = {}
    for root in roots:
        argv = ["instance", "install", "m1", "--profile", str(profile_file), "--root", str(root)]
        out = invoke([*argv, "--hf-cache-dir", "/hf", "--image", "gemma4-vllm:0.32.0-mtp-cpu"])
        said[root.name] = [ln for ln in out.output.splitlines() if ln.startswith("next: ")]
    assert said["bare"][0].startswith(f"next: appliance models pull m1 --root {roots[0]} && ")
    assert said["stocked"][0].startswith("next: systemctl daemon-reload && "), said
