"""The MTP probe: against the real CPU engines, a dead port and a broken page; and the check of
doctor, the cutover gate and bench give the same verdict and figures on one engine."""

from __future__ import annotations

import json

import pytest
from plugins.cli import invoke
from plugins.http_servers import Route

from appliance.cutover import gates
from appliance.engine.local import free_port
from appliance.engine_api import probe
from appliance.engine_api.vllm_client import VLLMClient
from appliance.errors import EngineError

MODEL = "gemma4-tiny"
# The probe's figures under vLLM's names: every report that carries a verdict carries these.
FIGURES = (
    "state",
    "source",
    "drafts",
    "draft_tokens",
    "accepted",
    "accepted_per_pos",
    "acceptance",
    "tokens_per_step",
    "per_position",
    "completion_tokens",
)


def _expect(url: str, mtp: bool) -> gates.Expect:
    return gates.Expect(unit="gemma4-vllm@tiny.service", base_url=url, served_model=MODEL, mtp=mtp)


def test_dead_server_is_unreadable_with_the_reason():
    url = f"http://127.0.0.1:{free_port()}"
    with VLLMClient(url) as client:
        p = probe.run(client, MODEL)
    assert (p.state, p.stage, p.working) == ("unreadable", "before", False)
    assert p.error.startswith(f"cannot reach {url}")
    assert p.figures is None and p.generation is None
    ev = p.evidence()
    assert ev["state"] == "unreadable" and ev["stage"] == "before" and ev["drafts"] is None
    with pytest.raises(EngineError, match="cannot reach"):
        p.raise_for_failure()
    # The gate reads the same failure as a failed generation gate, before any token.
    assert gates.judge(_expect(url, True), p) == [
        ("generation", False, f"cannot read /metrics: {p.error}")
    ]


def test_page_that_is_not_vllms_is_unparsable_and_a_refused_generation_fails(routed_http_server):
    # A fake server: a real vLLM always serves its own /metrics page and generates; only
    # something else on the port (or a broken proxy in front) answers like this.
    url = routed_http_server({"/metrics/": Route(200, b"# just some page\nfoo 1\n", "text/plain")})
    with VLLMClient(url) as client:
        p = probe.run(client, MODEL)
    assert (p.state, p.stage) == ("unparsable", "before")
    url = routed_http_server(
        {"/metrics/": Route(200, b"vllm:num_requests_running 0\n", "text/plain")}
    )
    with VLLMClient(url) as client:
        p = probe.run(client, MODEL)
    # The page is vLLM's; POST is not served (501): the generation failed, after the first read.
    assert (p.state, p.stage) == ("failed", "generation")
    assert "/v1/chat/completions answered 501" in p.error
    assert gates.judge(_expect(url, False), p) == [("generation", False, p.error)]


@pytest.mark.engine
def test_active_on_the_copy_drafter_with_per_request_figures(mtp_engine):
    with VLLMClient(mtp_engine.url) as client:
        p = probe.run(client, MODEL)
    assert (p.state, p.source, p.working, p.per_request) == ("active", "request", True, True)
    assert p.completion_tokens == probe.MAX_TOKENS
    f, c = p.figures, p.counters
    # The response's own block and the counters' movement say the same on an idle server.
    assert (f.drafts, f.draft_tokens, f.accepted, f.accepted_per_pos) == (
        c.drafts,
        c.draft_tokens,
        c.accepted,
        c.accepted_per_pos,
    )
    assert f.drafts > 0 and f.acceptance >= 0.9 and f.tokens_per_step > 2.0
    ev = p.evidence()
    assert ev["draft_tokens"] == f.draft_tokens and "drafted" not in ev
    assert ev["per_position"] == list(f.per_position) and len(ev["accepted_per_pos"]) == 2
    assert p.summary().startswith(f"MTP active: drafts {f.drafts}, draft tokens {f.draft_tokens}")
    # Without a generation: one read, the counters are there.
    with VLLMClient(mtp_engine.url) as client:
        assert probe.run(client, MODEL, generate=False).state == "present"


@pytest.mark.engine
def test_absent_without_speculative_decoding(baseline_engine):
    with VLLMClient(baseline_engine.url) as client:
        p = probe.run(client, MODEL)
    assert (p.state, p.source, p.working, p.per_request) == ("absent", "absent", False, False)
    assert p.completion_tokens == probe.MAX_TOKENS
    ev = p.evidence()
    # No speculative decoding is not zero acceptance: the figures are absent, not 0.
    assert ev["drafts"] is None and ev["acceptance"] is None and ev["tokens_per_step"] is None
    tokens = ("generation", True, f"{probe.MAX_TOKENS} tokens")
    assert gates.judge(_expect(baseline_engine.url, True), p) == [
        tokens,
        (
            "mtp",
            False,
            "counters did not move: the engine exposes no speculative-decoding counters",
        ),
    ]
    assert gates.judge(_expect(baseline_engine.url, False), p) == [
        tokens,
        ("mtp", True, "not expected for this image (speculative decoding off)"),
    ]


def _doctor_evidence(url: str) -> dict:
    res = invoke(
        ["instance", "doctor", "--json", "--url", url, "--profile", "cpu-tiny-mtp"],
        env={"VLLM_API_KEY": None},
        code=None,
    )
    body = json.loads(res.output)
    return next(c for c in body["checks"] if c["name"] == "mtp.counters")["evidence"]


def _bench_evidence(url: str, tmp_path) -> dict:
    out = tmp_path / "bench.json"
    res = invoke(
        [
            "bench",
            "run",
            "--url",
            url,
            "--prompts",
            "prose",
            "--limit",
            "1",
            "--max-tokens",
            "8",
            "--runs",
            "1",
            "--warmups",
            "0",
            "--out",
            str(out),
        ],
        env={"VLLM_API_KEY": None},
    )
    assert "MTP probe: MTP active: drafts" in res.output
    return json.loads(out.read_text())["endpoints"][0]["mtp"]


@pytest.mark.engine
def test_doctor_gate_and_bench_agree_on_one_engine(mtp_counters_engine, tmp_path):
    """One engine, three callers, one verdict, the same figures.

    The engine sends no per-request block, so every figure comes from the counter delta under the
    one attribution rule (nothing else runs: source ``counters``). The probe's generation is
    greedy and the same for all three, so the figures are equal, not only alike.
    """
    url = mtp_counters_engine.url
    doctor_ev = _doctor_evidence(url)
    with VLLMClient(url, timeout=10.0) as client:
        gate_probe, outcomes = gates.probe_gates(client, _expect(url, True), 120.0)
    gate_ev = gate_probe.evidence()
    bench_ev = _bench_evidence(url, tmp_path)

    seen = [{k: ev[k] for k in FIGURES} for ev in (doctor_ev, gate_ev, bench_ev)]
    assert seen[0] == seen[1] == seen[2], seen
    assert seen[0]["state"] == "active" and seen[0]["source"] == "counters"
    assert seen[0]["drafts"] > 0 and seen[0]["acceptance"] >= 0.9
    f = gate_probe.figures
    assert [o[:2] for o in outcomes] == [("generation", True), ("mtp", True)]
    assert outcomes[1][2].startswith(
        f"drafts +{f.drafts}, draft tokens +{f.draft_tokens}, accepted +{f.accepted}"
    )
