"""Input refused at the door (issue 55 §3; security review T6, T10, newcomer D7, D9, D10, S9):
each bad value is one ``Error:`` line and exit 2 before any work, never a traceback, never a
request to a host the operator did not mean."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from appliance import doctor, profiles
from appliance.engine.local import free_port
from appliance.engine_api.vllm_client import engine_url
from appliance.host import envfile
from appliance.host.layout import Layout
from appliance.profiles import validate as pv

# Not UTF-8 from the first byte (0x84 cannot start a character): what a binary file gives.
BINARY = bytes([0x84, 0xFF, 0x00, 0x9C]) * 64
CPU_PROFILE = Path(profiles.__file__).parent / "data" / "cpu-tiny-mtp.toml"


def _one_error_line(output: str) -> str:
    lines = output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), output
    return lines[0]


# --- the three tracebacks of the 2026-12-06 review (T6) ------------------------------------


def test_a_binary_profile_file_is_one_line(tmp_path, cli_run):
    path = tmp_path / "binary.toml"
    path.write_bytes(BINARY)
    res = cli_run(["profiles", "validate", "-f", str(path)], code=2)
    assert _one_error_line(res.output).startswith(f"Error: cannot read profile {path}: ")


def test_a_binary_inventory_is_one_line_from_a_file_and_from_stdin(tmp_path, cli_run):
    path = tmp_path / "inventory.json"
    path.write_bytes(BINARY)
    res = cli_run(["fleet", "targets", str(path)], code=2)
    assert _one_error_line(res.output).startswith(f"Error: {path}: not JSON: ")
    res = cli_run(["fleet", "targets", "-"], input=BINARY, code=2)
    assert _one_error_line(res.output).startswith("Error: -: not JSON: ")


# --- one URL type for every --url (T6, D7) -----------------------------------------------------

BAD_URLS = [
    ("http://[::1", "Invalid IPv6 URL"),
    ("ftp://127.0.0.1:1", "scheme 'ftp' is not http or https"),  # was http://ftp://127.0.0.1:1
    ("http://127.0.0.1:99999", "the port is not a number within 1..65535"),
    ("http://127.0.0.1:0", "the port is not a number within 1..65535"),
    ("http://127.0.0.1:eighty", "the port is not a number within 1..65535"),
    ("http://bad host:8000", "'bad host' is not a host name or IP address"),
    ("http://-h:8000", "'-h' is not a host name or IP address"),
    ("http://:8000", "'' is not a host name or IP address"),
]


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_doctor_refuses_a_bad_url_before_any_request(url, why, cli_run):
    res = cli_run(["instance", "doctor", "--url", url], code=2)
    assert why in _one_error_line(res.output)
    # The same words when it comes from the environment.
    res = cli_run(["instance", "doctor"], env={"APPLIANCE_URL": url}, code=2)
    assert why in _one_error_line(res.output)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "run", "--url", "ftp://h:1"],
        ["bench", "compare", "--mtp-url", "ftp://h:1", "--baseline-url", "http://h:2"],
        ["bench", "compare", "--mtp-url", "http://h:1", "--baseline-url", "ftp://h:1"],
        ["bench", "sweep", "--k", "1", "--k-url", "1=ftp://h:1"],
        ["bench", "tune", "--url", "http://h:1", "--baseline-url", "ftp://h:1"],
        ["canary", "record", "--url", "ftp://h:1", "--out", "x.json"],
    ],
)
def test_every_url_option_is_the_same_type(argv, cli_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = cli_run(argv, code=2)
    assert "'ftp://h:1': scheme 'ftp' is not http or https" in _one_error_line(res.output)


def test_a_user_and_password_in_the_url_is_refused_without_echoing_them(cli_run):
    res = cli_run(["instance", "doctor", "--url", "http://me:s3cret@127.0.0.1:8000"], code=2)
    assert "s3cret" not in _one_error_line(res.output)


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("HTTP://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://gpu-host.example", "https://gpu-host.example"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://gemma4_vllm-a1:8000", "http://gemma4_vllm-a1:8000"),
    ],
)
def test_a_good_url_is_normalised(given, base):
    assert engine_url(given) == base


def test_dev_local_serve_refuses_a_port_out_of_range_at_parse_time(cli_run):
    # The parser's refusal (click's usage error): the command body, which boots vLLM, never ran.
    for port in ("99999", "0"):
        res = cli_run(["dev", "serve", "--port", port], code=2)
        assert "Invalid value for '--port'" in res.output and "1<=x<=65535" in res.output


# --- profile numbers and folders (T10) ---------------------------------------------------------


def _profile(tmp_path: Path, **top: str) -> Path:
    text = CPU_PROFILE.read_text().replace('name = "cpu-tiny-mtp"', 'name = "mine"')
    lines = text.splitlines()
    for key, value in top.items():
        lines = [line for line in lines if not line.startswith(f"{key} =")]
        lines.insert(1, f"{key} = {value}")
    path = tmp_path / "mine.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_num_seqs", "99999999999999999999999999", "within 1..4096"),  # the review's 1e26
        ("max_num_seqs", "4097", "within 1..4096"),
        ("max_model_len", "1048577", "within 1..1048576"),
        ("max_num_batched_tokens", "99999999999999999999999999", "within 1..1048576"),
        ("max_num_queued_reqs", "65537", "within 1..65536"),
        ("tensor_parallel_size", "65", "within 1..64"),
        ("pipeline_parallel_size", "100000", "within 1..64"),
        ("weights_gib", "1e26", "within 0..16384"),
    ],
)
def test_a_number_beyond_any_host_is_refused_naming_the_field(
    tmp_path, field, value, rule, cli_run
):
    path = _profile(tmp_path, **{field: value})
    res = cli_run(["profiles", "validate", "-f", str(path)], code=2)
    line = _one_error_line(res.output)
    assert line.startswith(f"Error: mine.toml: {field} = ") and line.endswith(f"must be {rule}")
    res = cli_run(["profiles", "show", str(path)], code=2)  # printed the argv, exit 0, before
    assert f"{field} = " in _one_error_line(res.output)


def test_the_bounds_themselves_are_values():
    base = {"name": "x", "description": "d", "model": "m", "served_model_name": "s"}
    prof = profiles.from_dict(
        {**base, "max_num_seqs": 4096, "max_model_len": 1 << 20, "max_num_queued_reqs": 65536},
        "x.toml",
    )
    assert (prof.max_num_seqs, prof.max_model_len, prof.queue_bound) == (4096, 1 << 20, 65536)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--vllm-cache-dir", "/proc/self"),
        ("--model-dir", "/sys/kernel"),
        ("--model-dir", "/dev"),
        ("--hf-cache-dir", "/dev/shm/hf"),
    ],
)
def test_a_kernel_tree_is_no_model_or_cache_folder(tmp_path, option, value, cli_run):
    root = tmp_path / "root"
    profile = "l4x4-31b-mtp" if option == "--hf-cache-dir" else "cpu-tiny-mtp"
    argv = ["instance", "install", "a1", "--profile", profile, option, value, "--root", str(root)]
    res = cli_run(argv, code=2)
    top = "/" + value.split("/")[1]
    assert f"is under {top}, the kernel's" in _one_error_line(res.output)
    assert not root.exists()  # nothing half-written


# --- doubled text (D9) and the missing key (D10) -----------------------------------------------


def _installed(tmp_path: Path, host: str = "127.0.0.1") -> Path:
    root = tmp_path / "root"
    argv = ["instance", "install", "a1", "--profile", "cpu-tiny-mtp", "--host", host]
    argv += ["--model-dir", "/srv/models", "--root", str(root)]
    from plugins.cli import invoke

    invoke(argv)
    return root


def test_doctor_says_each_model_problem_once(tmp_path):
    root = _installed(tmp_path)
    report = doctor.run(f"http://127.0.0.1:{free_port()}", instance="a1", root=root)
    check = report.get("instance.models")
    line = check.summary + " " + json.dumps(check.evidence)
    assert check.status == "fail"
    assert line.count("target ") == 1 and line.count("drafter ") == 1, line
    assert "fix: fix:" not in report.text() and report.text().count("fix: appliance") == 1


def test_models_export_says_fix_once(tmp_path, cli_run):
    root = tmp_path / "root"
    argv = ["models", "export", "--profile", "l4x4-31b-mtp", "--to", str(tmp_path / "x")]
    res = cli_run([*argv, "--root", str(root)], code=None)
    line = _one_error_line(res.output)
    assert "fix: fix:" not in line and "fix the source first: fix" not in line
    assert "(fix the source first: appliance models pull --profile l4x4-31b-mtp" in line


@pytest.mark.parametrize(
    ("host", "status", "why"),
    [
        ("127.0.0.1", "warn", "vLLM on 127.0.0.1 accepts any caller on this host"),
        ("0.0.0.0", "fail", "the serve program refuses to start on 0.0.0.0 without one"),
    ],
)
def test_doctor_says_when_the_key_file_is_missing(tmp_path, host, status, why):
    root = _installed(tmp_path, host)
    dead = f"http://127.0.0.1:{free_port()}"
    key = Layout(root).api_key_file("a1")
    assert doctor.run(dead, instance="a1", root=root).get("instance.api_key").status == "ok"
    key.unlink()
    check = doctor.run(dead, instance="a1", root=root).get("instance.api_key")
    assert (check.status, check.evidence["path"]) == (status, str(key))
    assert check.summary == (
        f"no API key file {key}: {why} (appliance instance install a1 writes one)"
    )


# --- one warning for most of the catalog (S9) --------------------------------------------------

KV_AUTO = "[kv-auto-mtp-batching]"


def _with_kv_auto() -> str:
    """A shipped profile whose one finding is the kv-auto-mtp-batching warning."""
    return next(
        name
        for name, p in sorted(profiles.all_profiles().items())
        if [f.code for f in pv.check(p)] == [KV_AUTO.strip("[]")]
    )


def test_a_warning_most_profiles_share_is_said_once_per_run(cli_run):
    out = cli_run(["profiles", "validate"]).output
    assert out.count(KV_AUTO) == 1
    shared = next(line for line in out.splitlines() if KV_AUTO in line)
    n = sum(1 for line in out.splitlines() if re.fullmatch(r"\S+: (ok|\d+ \w+\(s\))\*", line))
    assert n > 1 and shared.startswith(f"* {n} of {len(profiles.all_profiles())} profiles: ")
    listed = cli_run(["profiles", "list"]).output
    assert listed.count(KV_AUTO) == 1
    name = _with_kv_auto()
    row = next(line for line in listed.splitlines() if line.startswith(f"{name} "))
    assert row.split()[3] == "ok*"  # its only warning is the shared one


def test_the_canary_batched_pass_makes_the_defect_an_info(tmp_path, cli_run):
    # The defect's fix is the canary's batched pass; a GPU profile that runs it is told, not
    # warned.
    name = _with_kv_auto()
    base = profiles.shipped_text(name).replace(f'name = "{name}"', 'name = "b"')
    path = tmp_path / "b.toml"
    path.write_text(base.replace("[canary]\n", "[canary]\nbatched = true\n"))
    assert profiles.load_file(path).canary.batched
    found = pv.check(profiles.load_file(path))
    assert [f.level for f in found if f.code == KV_AUTO.strip("[]")] == ["info"]
    res = cli_run(["profiles", "validate", "-f", str(path)])
    assert res.output.splitlines()[0] == "b: ok"
    assert f"  info: {KV_AUTO}" in res.output


# --- the env file's own words (newcomer M4) ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "extra"),
    [("a1", []), ("g1", ["--profile", "cpu-tiny-mtp-2node", "--role", "both"])],
)
def test_the_env_files_comment_says_the_parsers_rule(tmp_path, name, extra, cli_run):
    # It said "no quotes" while the one parser takes a value in one pair of them.
    root = tmp_path / "root"
    profile = [] if extra else ["--profile", "cpu-tiny-mtp"]
    cli_run(
        ["instance", "install", name, *profile, *extra, "--model-dir", "/srv/m"]
        + [
            "--root",
            str(root),
        ]
    )
    text = Layout(root).env_file(name).read_text()
    comment = " ".join(
        line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")
    )
    rule = envfile.FIX.removeprefix("write ")  # "one KEY=value a line, the value bare or ..."
    assert rule.lower() in comment.lower(), comment
    assert "no quotes" not in comment
    assert envfile.parse(b"VLLM_IMAGE='gemma4-vllm:0.32.0-mtp-cpu'\n") == {
        "VLLM_IMAGE": "gemma4-vllm:0.32.0-mtp-cpu"
    }
