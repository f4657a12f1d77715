"""One way to name an engine: an installed instance's URL, profile and key, or a URL.

Instances are installed for real (``appliance install`` under a test root) on a port that is not
vLLM's default; no engine is needed to see where each command would go.
"""

from __future__ import annotations

import json

import pytest

from appliance import canary, units
from appliance.instance import endpoint
from appliance.profiles import get

PORT = 8123  # not vLLM's 8000 nor the reference profile's 8050: it can only come from the file


@pytest.fixture
def root(tmp_path):
    units.install(get("cpu-tiny-mtp"), "tiny", root=tmp_path, options=units.Options(port=PORT))
    return tmp_path


def test_an_instance_gives_its_url_profile_and_key(root):
    ep = endpoint.resolve(instance="tiny", root=root)
    assert ep.url == f"http://127.0.0.1:{PORT}"
    assert ep.profile.name == "cpu-tiny-mtp"
    key_file = root / "etc/gemma4-vllm/tiny.api-key"
    assert ep.api_key.source == f"file {key_file}"
    assert ep.secret == key_file.read_text().strip()


def test_what_the_command_line_says_wins_over_the_instance(root):
    ep = endpoint.resolve(
        instance="tiny", url="http://127.0.0.1:9", profile_name="cpu-tiny", root=root
    )
    assert (ep.url, ep.profile.name, ep.instance) == ("http://127.0.0.1:9", "cpu-tiny", "tiny")


def test_the_instance_wins_over_an_exported_url(root):
    ep = endpoint.resolve(instance="tiny", env_url="http://127.0.0.1:9", root=root)
    assert ep.url == f"http://127.0.0.1:{PORT}"
    assert endpoint.resolve(env_url="http://127.0.0.1:9").url == "http://127.0.0.1:9"
    assert endpoint.resolve().url == endpoint.DEFAULT_URL
    assert endpoint.resolve(default=None).url is None


def test_an_instance_not_installed_is_one_line_and_exit_2(tmp_path, cli_run):
    for argv in (
        ["instance", "doctor", "nosuch"],
        ["bench", "run", "nosuch"],
        ["canary", "record", "nosuch", "--out", str(tmp_path / "r.json")],
    ):
        res = cli_run([*argv, "--root", str(tmp_path)], code=2)
        assert res.output == (
            f"Error: no instance nosuch: no {tmp_path}/etc/gemma4-vllm/nosuch.env (`appliance "
            "status` lists the installed instances; `appliance instance install nosuch --profile "
            "PROFILE` installs it; or give --url)\n"
        )
    assert not (tmp_path / "r.json").exists()


def test_two_different_names_are_refused(root, cli_run):
    res = cli_run(
        ["instance", "doctor", "tiny", "--instance", "other", "--root", str(root)], code=2
    )
    assert res.output == "Error: two instances named: 'tiny' and --instance 'other'\n"


def test_doctor_by_name_probes_the_instances_own_port(root, cli_run):
    # The tree named as a machine run from this host (its systemd entered), so its port is its
    # own here. Nothing listens there: the report names the port it tried, from the env file.
    machine = {"APPLIANCE_SYSTEMD_PREFIX": "/nonexistent/appliance-test/enter-machine"}
    argv = ["instance", "doctor", "tiny", "--root", str(root), "--json"]
    res = cli_run(argv, env=machine, code=None)
    body = json.loads(res.output)
    assert res.exit_code == 1
    reach = next(c for c in body["checks"] if c["name"] == "engine.reachable")
    assert reach["status"] == "fail" and f"127.0.0.1:{PORT}" in reach["summary"]
    assert f":{endpoint.DEFAULT_URL.rsplit(':', 1)[1]}" not in res.output
    # A bare tree: the port is not asked, and said so (never healthy).
    res = cli_run(argv, env={"APPLIANCE_SYSTEMD_PREFIX": None}, code=None)
    reach = next(c for c in json.loads(res.output)["checks"] if c["name"] == "engine.reachable")
    assert reach["status"] == "warn" and reach["summary"].startswith("not asked: --root ")
    assert reach["evidence"]["url"] == f"http://127.0.0.1:{PORT}"


@pytest.mark.engine
def test_doctor_canary_and_bench_reach_an_installed_instance_by_name(mtp_engine, tmp_path, cli_run):
    """The session's engine installed as instance ``tiny`` on its own (random, non-default) port:
    each command, given only the name, talks to it with the instance's profile and key. The
    tree is named as a machine run from this host (APPLIANCE_SYSTEMD_PREFIX), whose ports are
    this host's: a bare tree's port is not asked (test_tree_asks_nothing.py)."""
    units.install(
        get("cpu-tiny-mtp"), "tiny", root=tmp_path, options=units.Options(port=mtp_engine.port)
    )
    where = ["tiny", "--root", str(tmp_path)]
    machine = {"APPLIANCE_SYSTEMD_PREFIX": "/nonexistent/appliance-test/enter-machine"}
    res = cli_run(
        ["instance", "doctor", *where, "--json"], env={"VLLM_API_KEY": None, **machine}, code=None
    )
    checks = {c["name"]: c for c in json.loads(res.output)["checks"]}
    assert checks["engine.reachable"]["evidence"]["url"] == mtp_engine.url, res.output
    assert checks["vllm.version"]["status"] == "ok"
    assert checks["model.served"]["status"] == "ok"  # the instance's profile was the one checked
    assert checks["mtp.counters"]["evidence"]["state"] == "active"

    out = tmp_path / "rec.json"
    res = cli_run(["canary", "record", *where, "--out", str(out), "--max-tokens", "8"], env=machine)
    rec = canary.load(out)
    assert (rec.url, rec.profile, len(rec.outputs)) == (mtp_engine.url, "cpu-tiny-mtp", 14)

    art = tmp_path / "bench.json"
    bench = ["bench", "run", *where, "--limit", "1", "--max-tokens", "8", "--runs", "1"]
    bench += ["--warmups", "0"]
    # The old spelling of --out still writes the artifact, and says the new one.
    res = cli_run([*bench, "--json-output", str(art)], env={"VLLM_API_KEY": None, **machine})
    assert f"warning: --json-output is deprecated: write --out {art}" in res.output
    body = json.loads(art.read_text())
    assert body["endpoints"][0]["url"] == mtp_engine.url
    assert body["environment"]["profile"]["name"] == "cpu-tiny-mtp"
