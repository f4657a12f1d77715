"""Cutovers as state metrics: rebuilt from env files and histories, read back by Prometheus'
own parser, with the labels of the image from the real Docker engine."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.cutover import history, metrics
from appliance.cutover.history import Entry
from appliance.host.layout import Layout

pytestmark = pytest.mark.docker


def _samples(path) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_textfile_has_the_running_image_and_event_counts(
    mtp_instance, preflight_images, cutover_docker
):
    layout = Layout(mtp_instance.root)
    hist = layout.history_file("i1")
    for outcome in ("ok", "rolled_back", "ok"):
        e = Entry.begin("i1", "cutover", "a:1", "b:2")
        history.append(hist, e)
        e.outcome, e.finished = outcome, e.started + 1
        history.append(hist, e)
    interrupted = Entry.begin("i1", "rollback", "b:2", "a:1")
    history.append(hist, interrupted)  # never finished: not an event of the contract
    path = metrics.write(layout, cutover_docker)
    assert path == layout.state_dir / "metrics" / "gemma4_appliance.prom"
    got = _samples(path)
    info = (
        "gemma4_appliance_image_info",
        (
            ("gpus", ""),  # a CPU instance: no device set
            ("image", preflight_images["pre-mtp"]),
            ("instance", "i1"),
            ("mtp", "false"),
            ("vllm_version", "0.19.0"),
        ),
    )
    assert got[info] == 1
    ev = "gemma4_appliance_cutover_events_total"
    assert got[(ev, (("instance", "i1"), ("kind", "cutover"), ("outcome", "ok")))] == 2
    assert got[(ev, (("instance", "i1"), ("kind", "cutover"), ("outcome", "rolled_back")))] == 1
    assert not any(k[0] == ev and ("kind", "rollback") in k[1] for k in got)
    assert (
        got[("gemma4_appliance_last_cutover_timestamp_seconds", (("instance", "i1"),))]
        == e.finished
    )
