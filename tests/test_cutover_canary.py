"""The output canary as a cutover gate, without an engine: refused before anything is touched,
kept in history, shown by ``appliance history``, and carried by the state metrics.

The cutover with real engines (seed replay across vLLM versions, MTP switched on within one
version, an image that changes the answers) is in tests/test_cutover_systemd.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from plugins.cutover import InstanceTree, write_env
from prometheus_client.parser import text_string_to_metric_families

from appliance import units
from appliance.canary import baseline, compare
from appliance.canary.record import Output, Record, Settings, SpecFigures
from appliance.cutover import history, metrics
from appliance.cutover.history import Entry, Gate
from appliance.engine.local import free_port
from appliance.errors import UsageError
from appliance.host.layout import Layout
from appliance.observability import state_metrics
from appliance.profiles import get as get_profile


def _tree(tmp_path) -> InstanceTree:
    env = write_env(tmp_path, "i1", "gemma4-vllm:0.32.0-mtp", "cpu-tiny-mtp")
    return InstanceTree(tmp_path, "i1", env)


def test_malformed_canary_line_refuses_the_cutover_before_anything_is_touched(tmp_path, cli_run):
    tree = _tree(tmp_path)
    bad = tmp_path / "ops.jsonl"
    bad.write_text('{"id": "ops-1", "prompt": "fine"}\n{"id": "ops-2", "prompt": \n')
    before = tree.snapshot()
    # The image is not on any host: the canary's set is refused first, without asking Docker.
    r = cli_run(
        ["cutover", "i1", "gemma4-vllm:not-built", "--root", str(tmp_path), "--canary-file", bad],
        code=2,
    )
    [line] = r.output.strip().splitlines()
    assert line.startswith("Error: ") and str(bad) in line and "line 2" in line, line
    assert tree.snapshot() == before  # no lock, no history line, no env write
    assert not (tmp_path / "var").exists()


def test_canary_cli_options_are_on_cutover_only(cli_run):
    assert "--canary / --no-canary" in cli_run(["cutover", "--help"]).output
    assert "--canary" not in cli_run(["rollback", "--help"]).output


def _record(version: str, ids: tuple[int, ...], passed: bool, seconds: float) -> Record:
    outs = (
        Output("prose-1", "prose", "x", ids, len(ids), "length", seconds / 2),
        Output("task-1", "task", "391", (7,), 1, "stop", seconds / 2, passed),
    )
    return Record(
        url="http://127.0.0.1:1",
        model="gemma4-tiny",
        vllm_version=version,
        settings=Settings(),
        set_digest="d",
        sources=("canary.jsonl",),
        started=0.0,
        seconds=seconds,
        outputs=outs,
    )


def _figures(before: Record, after: Record) -> dict:
    from appliance.canary.gate import Result

    return Result(before, after, compare(before, after)).figures()


def test_history_keeps_the_canary_and_the_history_command_shows_it(tmp_path, cli_run):
    layout = Layout(tmp_path)
    path = layout.history_file("i1")
    e = Entry.begin("i1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:0.32.0-mtp")
    history.append(path, e)
    figures = _figures(
        _record("0.19.0", (1, 2, 3), True, 4.2), _record("0.32.0", (1, 2, 9), True, 2.8)
    )
    e.canary, e.outcome, e.finished = figures, "ok", e.started + 60
    e.gates = [Gate("unit", True, 1.0), Gate("canary", True, 12.0, figures["summary"])]
    history.append(path, e)
    [got] = history.entries(path)
    assert got.canary == json.loads(json.dumps(figures))
    assert got.canary["verdict"] == "warn" and got.canary["version_changed"] is True
    assert got.canary["parity"] == 0.5 and got.canary["median_first_divergence"] == 2
    # An entry written before the canary existed reads as "not run".
    old = json.loads(e.to_json())
    del old["canary"]
    assert Entry.from_dict(old).canary is None

    r = cli_run(["history", "i1", "--root", str(tmp_path)])
    assert "canary ok 12.0s" in r.output
    assert (
        "    canary: canary passed with warnings: token parity 50% below 100% across vLLM "
        "0.19.0 -> 0.32.0 (numerics may legitimately move)"
    ) in r.output
    assert "cost 4.2 s before, 2.8 s after (1.40 s per prompt)" in r.output


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_state_metrics_carry_the_last_canary(tmp_path):
    tree = _tree(tmp_path)
    layout = Layout(tree.root)
    path = layout.history_file("i1")
    fail = _figures(_record("0.32.0", (1, 2), True, 3.0), _record("0.32.0", (5, 2), False, 2.0))
    for figures, outcome in ((fail, "rolled_back"), (None, "ok")):
        e = Entry.begin("i1", "cutover", "a:1", "b:2")
        e.canary, e.outcome, e.finished = figures, outcome, e.started + 5
        history.append(path, e)
        if figures:
            failed_at = e.finished
    # The last entry ran no canary (--no-canary): the series show the last one that did.
    got = _samples(metrics.write(layout).read_text())
    i1 = (("instance", "i1"),)
    assert got[("gemma4_appliance_canary_ok", i1)] == 0
    assert got[("gemma4_appliance_canary_parity", i1)] == 0.5
    assert got[("gemma4_appliance_canary_pass_rate", (*i1, ("side", "before")))] == 1.0
    assert got[("gemma4_appliance_canary_pass_rate", (*i1, ("side", "after")))] == 0.0
    assert got[("gemma4_appliance_canary_seconds", (*i1, ("side", "after")))] == 2.0
    ts = (
        "gemma4_appliance_last_canary_timestamp_seconds",
        (
            ("identical", "1/2"),
            ("instance", "i1"),
            ("tasks", "1/1->0/1"),
            ("verdict", "fail"),
            ("vllm", "0.32.0"),
        ),
    )
    assert got[ts] == failed_at


def test_an_instance_without_a_canary_has_no_canary_series(tmp_path):
    s = state_metrics.InstanceState("i", "img", "0.32.0", True)
    text = (state_metrics.write_textfile(tmp_path / "a.prom", [s])).read_text()
    assert "gemma4_appliance_canary_ok{" not in text
    assert "gemma4_appliance_image_info{" in text


@pytest.mark.docker
def test_an_old_engine_that_cannot_answer_the_canary_refuses_the_cutover_untouched(
    mtp_instance, preflight_images, restart_refused, cli_run
):
    env = mtp_instance.env_path
    env.write_bytes(
        env.read_bytes().replace(b"VLLM_PORT=8000", f"VLLM_PORT={free_port()}".encode())
    )
    before = env.read_bytes()
    r = cli_run(
        ["cutover", "i1", preflight_images["mtp"], "--root", str(mtp_instance.root)],
        env=restart_refused,
        code=1,
    )
    error = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1, r.output
    assert (
        f"the output canary cannot record the serving image {preflight_images['pre-mtp']}"
        in error[0]
    )
    assert "--no-canary" in error[0]
    layout = Layout(mtp_instance.root)
    assert env.read_bytes() == before
    assert not layout.history_file("i1").exists()  # not even a begin line
    assert not layout.rollback_slot("i1").exists()


# --- the acceptance baseline in status and the state metrics ----------------------------------


def _mtp_record(accepted: int, drafts: int = 10, k: int = 2) -> Record:
    """Both cases drafted ``drafts`` steps of ``k`` tokens and accepted ``accepted`` of them."""
    rec = _record("0.32.0", (1, 2, 3), True, 2.0)
    spec = SpecFigures(drafts, drafts * k, accepted, (accepted,), "request")
    outs = tuple(dataclasses.replace(o, spec=spec) for o in rec.outputs)
    return dataclasses.replace(rec, outputs=outs, image="gemma4-vllm:0.32.0-mtp", started=1.79e9)


def _installed(tmp_path, *names: str) -> Layout:
    for port, name in enumerate(names, start=9):  # two instances never share a port
        units.install(
            get_profile("cpu-tiny"), name, root=tmp_path, options=units.Options(port=port)
        )
    return Layout(tmp_path)


def test_status_shows_each_instance_baseline_or_none(tmp_path, cli_run):
    layout = _installed(tmp_path, "a1", "b2", "c3")
    assert baseline.keep(_mtp_record(15), layout.canary_baseline("a1")) is not None
    layout.canary_baseline("c3").write_text("{}")
    res = cli_run(["status", "--json", "--root", str(tmp_path)], code=1)  # none serves here
    a1, b2, c3 = json.loads(res.output)["instances"]
    assert a1["baseline"] == {
        "image": "gemma4-vllm:0.32.0-mtp",
        "vllm_version": "0.32.0",
        "recorded": 1.79e9,
        "acceptance": 0.75,
        "tokens_per_step": 2.5,
        "prompts": 2,
    }
    assert (a1["baseline_error"], b2["baseline"], b2["baseline_error"]) == (None, None, None)
    assert c3["baseline"] is None
    assert c3["baseline_error"].startswith(f"acceptance baseline {layout.canary_baseline('c3')}")
    res = cli_run(["status", "--root", str(tmp_path)], code=1)
    lines = [ln for ln in res.output.splitlines() if ln.startswith("  baseline:")]
    assert lines[:2] == [
        (
            "  baseline:   acceptance 75%, tokens per step 2.50 (gemma4-vllm:0.32.0-mtp, "
            "vLLM 0.32.0, recorded 2026-09-21T14:13:20Z)"
        ),
        "  baseline:   none",
    ]
    assert "format = None, not 'appliance-canary-record/1'" in lines[2]


def test_state_metrics_carry_the_baseline_per_instance(tmp_path):
    layout = _installed(tmp_path, "a1", "b2", "c3")
    baseline.keep(_mtp_record(15), layout.canary_baseline("a1"))
    layout.canary_baseline("c3").write_text("not json")  # status says why; metrics go out
    got = _samples(metrics.write(layout).read_text())
    a1 = (("instance", "a1"),)
    assert got[("gemma4_appliance_acceptance_baseline", a1)] == 0.75
    assert got[("gemma4_appliance_tokens_per_step_baseline", a1)] == 2.5
    baselines = {k for k in got if k[0].endswith("_baseline")}
    assert baselines == {
        ("gemma4_appliance_acceptance_baseline", a1),
        ("gemma4_appliance_tokens_per_step_baseline", a1),
    }
    assert sum(k[0] == "gemma4_appliance_image_info" for k in got) == 3  # c3's too


@pytest.mark.parametrize(("field", "value"), [("acceptance", 1.5), ("tokens_per_step", 0.5)])
def test_a_baseline_state_out_of_range_is_refused_naming_the_field(field, value):
    figures = {"acceptance": 0.5, "tokens_per_step": 2.0, field: value}
    with pytest.raises(UsageError, match=f"baseline {field} must be"):
        state_metrics.BaselineState(**figures)
