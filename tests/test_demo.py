"""`appliance demo --json`: the main job, end to end, as a fresh clone runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.dev import demo as demo_lib
from appliance.engine import local

APPLIANCE = str(Path(sys.executable).with_name("appliance"))


def test_a_child_picks_engine_ports_from_the_range_its_parent_hands_down():
    """Each stream of the suite picks ports from its half of the range (tests/conftest.py) and
    hands it to the commands it starts through the environment: `appliance demo` in the other
    stream's half could take a port that stream holds between two starts of a unit."""
    pick = "from appliance.engine import local; print(local.PORT_RANGE, local.free_port())"
    env = {**os.environ, local.PORT_RANGE_ENV: "23000-24000"}
    out = subprocess.run(
        [sys.executable, "-c", pick], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[:2] == ["(23000,", "24000)"] and 23000 <= int(out[2]) < 24000, out


# Its own engine only: the machines stream runs it (tests/conftest.py), early.
@pytest.mark.engine
@pytest.mark.own_engines
def test_demo_json_records_add_up_to_the_engines_counter_deltas(tmp_path):
    """One embedded engine, as the README's command starts it: the JSON record on stdout, the
    HTML report beside it (its figures against the record: tests/test_reports.py)."""
    page = tmp_path / "demo.html"
    out = subprocess.run(
        [APPLIANCE, "demo", "--json", "--calls", "4", "--max-tokens", "48", "--report", str(page)],
        capture_output=True,
        check=False,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    calls = report["calls"]
    assert [c["stream"] for c in calls] == [False, True, False, True]
    engine = report["engine_counters_delta"]
    assert engine["status"] == "ok" and engine["drafts"] > 0
    for c in calls:
        assert c["output_tokens"] == 48  # from usage, streamed or not
        f = c["figures"]  # the agent's record of the call, as it holds it
        assert f["source"] == "request" and f["shared"] is False
        assert f["acceptance"] >= 0.9
        assert f["tokens_per_step"] == pytest.approx(1 + f["accepted"] / f["drafts"])
    for key in ("drafts", "draft_tokens", "accepted"):
        assert sum(c["figures"][key] for c in calls) == engine[key] == report["totals"][key]
    assert report["totals"]["acceptance"] == engine["acceptance"]  # over the sums, one formula
    assert "drafted" not in json.dumps(report)  # vLLM's names, the same from counter to JSON
    assert "healthy after" in out.stderr
    text = page.read_text()
    assert 'id="chart-call-acceptance"' in text
    assert 'data-path="calls.1.figures.tokens_per_step"' in text
    assert [p.name for p in tmp_path.iterdir()] == ["demo.html"]  # no temp file left behind


@pytest.mark.engine
def test_demo_table_shows_per_call_rows_and_totals(mtp_engine):
    """The table the README's command prints (without --json), on the session's engine: the
    command's own engine start is shown above."""
    lines = demo_lib.format_table(demo_lib.run(mtp_engine.url, calls=2, max_tokens=16)).splitlines()
    assert lines[1].split()[:5] == ["call", "mode", "out_tok", "drafts", "draft_tok"]
    assert lines[2].split()[:3] == ["1", "plain", "16"]
    assert lines[3].split()[:3] == ["2", "stream", "16"]
    assert lines[4].startswith(" all")
    assert lines[5].startswith("engine counters over the demo: ok")
