"""The unit, env file and serve script: rendered, written, verified by the tools that consume them.

systemd-analyze verify and shellcheck are the real tools (a test fails on ANY output: both only
warn for some defects). Install and render are driven through the CLI and the Python API against
temporary roots; bad inputs must leave the tree byte-for-byte as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import profiles, units
from appliance.cli import cli
from appliance.profiles.validate import ProfileError
from appliance.units import examples

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(profiles.all_profiles())
MIG = "mig24-e4b-mtp"


def opts_for(name: str, **kw) -> units.Options:
    if name == MIG:
        kw.setdefault("gpus", "device=0:1")
    return units.Options(**kw)


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under root: bytes, mode and mtime (an unchanged tree has equal snapshots)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(root))] = (path.read_bytes(), st.st_mode, st.st_mtime_ns)
    return out


# --- golden examples ---------------------------------------------------------------------------


def test_committed_examples_match_what_the_profiles_render():
    assert examples.check(REPO) == [], "run: appliance render-examples"


def test_every_shipped_profile_has_committed_examples():
    for name in SHIPPED:
        assert (REPO / "systemd" / "env" / f"{name}.env").is_file()
        assert os.access(REPO / "scripts" / "serve" / f"serve-{name}.sh", os.X_OK)
    assert (REPO / "systemd" / "gemma4-vllm@.service").is_file()


def test_the_drift_check_fails_on_a_stale_missing_or_stray_example(tmp_path):
    for folder in ("systemd", "scripts/serve"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    assert examples.check(tmp_path) == []
    script = tmp_path / "scripts/serve/serve-l4x4-31b-mtp.sh"
    script.write_text(script.read_text().replace("--port 8050", "--port 8051"))
    (tmp_path / "systemd/env/cpu-tiny.env").unlink()
    (tmp_path / "systemd/env/handmade.env").write_text("VLLM_IMAGE=x\n")
    problems = examples.check(tmp_path)
    assert "scripts/serve/serve-l4x4-31b-mtp.sh: out of date" in problems
    assert "systemd/env/cpu-tiny.env: missing" in problems
    assert any(p.startswith("systemd/env/handmade.env: not generated") for p in problems)
    result = run("render-examples", "--check", "--repo", str(tmp_path))
    assert result.exit_code == 1
    assert "Error: 3 example(s) out of date (run: appliance render-examples)" in result.output
    assert run("render-examples", "--repo", str(tmp_path)).exit_code == 0
    (tmp_path / "systemd/env/handmade.env").unlink()
    assert run("render-examples", "--check", "--repo", str(tmp_path)).exit_code == 0


# --- systemd-analyze verify and shellcheck -----------------------------------------------------


def verify_root(tmp_path: Path) -> Path:
    """A root holding the host's own unit files, so verify resolves docker.service and friends."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    return root


@pytest.mark.parametrize("name", SHIPPED)
def test_installed_unit_passes_systemd_analyze_verify_silently(tmp_path, name):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (scripts/setup-system.sh)")
    root = verify_root(tmp_path)
    units.install(name, name, root=root, options=opts_for(name))
    # A template is verified through an instance name: that resolves %i in every path.
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", units.unit_name(name)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_verify_is_not_vacuous(tmp_path):
    """The same check reports an instance whose serve script is missing or not executable."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (scripts/setup-system.sh)")
    root = verify_root(tmp_path)
    units.install("cpu-tiny", "a", root=root)
    (root / units.paths("a").script).chmod(0o644)
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", units.unit_name("a")],
        check=False,
        capture_output=True,
        text=True,
    )
    assert "serve-a.sh is not executable" in proc.stdout + proc.stderr


def shellcheck(path: Path) -> subprocess.CompletedProcess:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/setup-system.sh)")
    return subprocess.run(["shellcheck", str(path)], check=False, capture_output=True, text=True)


@pytest.mark.parametrize("name", SHIPPED)
def test_rendered_serve_scripts_pass_shellcheck(tmp_path, name):
    units.render_to(name, name, tmp_path, opts_for(name))
    proc = shellcheck(tmp_path / units.paths(name).script)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_committed_scripts_pass_shellcheck():
    for script in sorted((REPO / "scripts").rglob("*.sh")):
        proc = shellcheck(script)
        assert (proc.returncode, proc.stdout + proc.stderr) == (0, ""), script


# --- what the files say -----------------------------------------------------------------------


def test_unit_runs_the_instance_script_with_its_env_file_restart_policy_and_timeout():
    files = units.render("l4x4-31b-mtp", "x")
    unit = files[units.paths("x").unit].content
    for line in (
        "EnvironmentFile=/etc/gemma4-vllm/%i.env",
        "ExecStartPre=/usr/local/libexec/gemma4-vllm/serve-%i.sh remove",
        "ExecStart=/usr/local/libexec/gemma4-vllm/serve-%i.sh run",
        "ExecStartPost=/usr/local/libexec/gemma4-vllm/serve-%i.sh wait-healthy",
        "ExecStop=/usr/local/libexec/gemma4-vllm/serve-%i.sh stop",
        "Restart=on-failure",
        "RestartPreventExitStatus=78",
    ):
        assert line in unit.splitlines(), line
    timeout = next(x for x in unit.splitlines() if x.startswith("TimeoutStartSec="))
    assert int(timeout.split("=")[1]) >= 2 * 471  # the seed's 31B load, with margin


def test_script_carries_the_profile_flags_and_mtp_only_behind_the_label():
    script = units.render("mig24-e4b-mtp", "m0", opts_for(MIG))[units.paths("m0").script].content
    assert "--max-num-batched-tokens 4096" in script
    assert "--enable-prefix-caching" in script
    assert "--host 127.0.0.1" in script and "--network host" in script
    assert '--gpus "$gpus"' in script and "--ipc host" in script
    spec = script.index("--speculative-config")
    assert script.rindex('if [[ "$mtp" == true ]]; then', 0, spec) > 0
    cpu = units.render("cpu-tiny-mtp", "c")[units.paths("c").script].content
    assert "--gpus" not in cpu and "--shm-size 1g" in cpu
    assert '--volume "$MODEL_DIR:/models:ro"' in cpu
    assert "/models/target" in cpu and '"model":"/models/drafter"' in cpu
    # The baseline profile never mentions speculative decoding flags.
    assert (
        "--speculative-config" not in units.render("l4x4-31b", "b")[units.paths("b").script].content
    )


def test_the_api_key_is_passed_by_name_only():
    script = units.render("l4x4-31b-mtp", "x")[units.paths("x").script].content
    assert 'VLLM_API_KEY="$(<"$API_KEY_FILE")"' in script
    assert "key_args=(--env VLLM_API_KEY)" in script
    assert "--api-key" not in script


# --- install: modes, idempotence, kept image ----------------------------------------------------


def test_install_writes_every_file_with_its_mode(tmp_path):
    result = run(
        "install", "--profile", "cpu-tiny-mtp", "--instance", "t1", "--root", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    p = units.paths("t1")
    modes = {
        rel: (tmp_path / rel).stat().st_mode & 0o777 for rel in (p.unit, p.env, p.script, p.api_key)
    }
    assert modes == {p.unit: 0o644, p.env: 0o644, p.script: 0o755, p.api_key: 0o600}
    key = (tmp_path / p.api_key).read_text().strip()
    assert len(key) >= 32
    assert key not in result.output
    env = units.parse_env((tmp_path / p.env).read_text())
    assert env["VLLM_IMAGE"] == units.DEFAULT_IMAGE
    assert not list(tmp_path.rglob(".*.tmp"))  # no temporary file left behind


def test_install_is_idempotent(tmp_path):
    units.install("l4x4-31b-mtp", "ref", root=tmp_path)
    before = snapshot(tmp_path)
    result = units.install("l4x4-31b-mtp", "ref", root=tmp_path)
    assert result.written == [] and len(result.unchanged) == 4
    assert snapshot(tmp_path) == before
    cli_result = run("install", "-p", "l4x4-31b-mtp", "-i", "ref", "--root", str(tmp_path))
    assert "wrote" not in cli_result.output and snapshot(tmp_path) == before


def test_install_keeps_the_image_values_and_port_already_there(tmp_path):
    units.install(
        "cpu-tiny-mtp", "c", root=tmp_path, options=units.Options(port=8123, model_dir="/srv/tiny")
    )
    env_path = tmp_path / units.paths("c").env
    key_before = (tmp_path / units.paths("c").api_key).read_bytes()
    # What a cutover does: rewrite the one assignment.
    env_path.write_text(
        env_path.read_text().replace(
            "VLLM_IMAGE=gemma4-vllm:latest", "VLLM_IMAGE=gemma4-vllm:pre-mtp"
        )
    )
    units.install("cpu-tiny-mtp", "c", root=tmp_path)
    env = units.parse_env(env_path.read_text())
    assert env["VLLM_IMAGE"] == "gemma4-vllm:pre-mtp"
    assert env["MODEL_DIR"] == "/srv/tiny"
    assert "readonly PORT=8123" in (tmp_path / units.paths("c").script).read_text()
    assert (tmp_path / units.paths("c").api_key).read_bytes() == key_before
    # An explicit --image is the operator saying so: it wins.
    units.install(
        "cpu-tiny-mtp", "c", root=tmp_path, options=units.Options(image="gemma4-vllm:mtp")
    )
    assert units.parse_env(env_path.read_text())["VLLM_IMAGE"] == "gemma4-vllm:mtp"


def test_install_tightens_a_key_file_readable_by_others(tmp_path):
    units.install("cpu-tiny", "k", root=tmp_path)
    key = tmp_path / units.paths("k").api_key
    content = key.read_bytes()
    key.chmod(0o644)
    result = units.install("cpu-tiny", "k", root=tmp_path)
    assert key.stat().st_mode & 0o777 == 0o600 and key.read_bytes() == content
    assert key in result.written


def test_render_out_writes_the_same_tree_without_a_key(tmp_path):
    result = run(
        "render", "-p", MIG, "-i", "slice1", "--gpus", "device=0:1", "--out", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    p = units.paths("slice1")
    assert (tmp_path / p.unit).is_file() and (tmp_path / p.script).is_file()
    assert not (tmp_path / p.api_key).exists()
    assert "VLLM_GPUS=device=0:1" in (tmp_path / p.env).read_text()


# --- bad inputs: a clear one-line error, exit 2, and the tree unchanged --------------------------

BAD = [
    (["-p", "cpu-tiny", "-i", "../etc"], "invalid instance name '../etc'"),
    (["-p", "cpu-tiny", "-i", "a b"], "invalid instance name 'a b'"),
    (["-p", "cpu-tiny", "-i", "-x"], "invalid instance name '-x'"),
    (["-p", "cpu-tiny", "-i", "x.service"], "invalid instance name 'x.service'"),
    (["-p", "cpu-tiny", "-i", "a" * 65], "invalid instance name"),
    (["-p", "nope", "-i", "x"], "unknown profile 'nope'"),
    (["-p", "cpu-tiny", "-i", "x", "--image", "gemma4 vllm:mtp"], "invalid image reference"),
    (["-p", "cpu-tiny", "-i", "x", "--image", "x;rm -rf /"], "invalid image reference"),
    (["-p", "cpu-tiny", "-i", "x", "--image", "x:$(id)"], "invalid image reference"),
    (["-p", "cpu-tiny", "-i", "x", "--image", "Gemma4:mtp"], "invalid image reference"),
    (["-p", "cpu-tiny", "-i", "x", "--image", "x:`id`"], "invalid image reference"),
    (["-p", MIG, "-i", "x"], "runs one instance per MIG slice"),
    (["-p", "l4x4-31b-mtp", "-i", "x", "--gpus", "all;id"], "invalid GPU selection"),
    (["-p", "cpu-tiny", "-i", "x", "--gpus", "all"], "runs on the CPU"),
    (["-p", "cpu-tiny", "-i", "x", "--port", "70000"], "invalid port 70000"),
    (["-p", "cpu-tiny", "-i", "x", "--model-dir", "rel/path"], "not a plain absolute path"),
    (["-p", "cpu-tiny", "-i", "x", "--model-dir", "/a b"], "not a plain absolute path"),
    (["-p", "l4x4-31b", "-i", "x", "--model-dir", "/m"], "tiny dev model profiles only"),
]


@pytest.fixture
def installed(tmp_path) -> Path:
    """A root with one instance installed already (the bad input must not touch it either)."""
    units.install("cpu-tiny-mtp", "x", root=tmp_path)
    return tmp_path


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
@pytest.mark.parametrize("command", ["install", "render"])
def test_bad_input_is_a_clear_error_and_writes_nothing(installed, command, args, message):
    before = snapshot(installed)
    where = ["--root", str(installed)] if command == "install" else ["--out", str(installed)]
    result = run(command, *args, *where)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
    assert snapshot(installed) == before


def test_a_profile_with_validation_errors_is_refused_before_writing(tmp_path):
    import dataclasses

    bad = dataclasses.replace(profiles.get("l4x4-31b-mtp"), kv_cache_dtype="fp8")
    with pytest.raises(ProfileError, match="SM 8.9"):
        units.install(bad, "x", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_invalid_image_already_in_the_env_file_is_refused(installed):
    env_path = installed / units.paths("x").env
    env_path.write_text(env_path.read_text().replace("gemma4-vllm:latest", "bad image"))
    before = snapshot(installed)
    result = run("install", "-p", "cpu-tiny-mtp", "-i", "x", "--root", str(installed))
    assert result.exit_code == 2 and "invalid image reference 'bad image'" in result.output
    assert snapshot(installed) == before
