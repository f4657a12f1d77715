"""The live-acceptance sampler (appliance.judge.traffic_acceptance) and gate
(appliance.cutover.live) on real captures of vLLM's counters, without an engine.

tests/data/metrics-vllm-0.32-mtp-traffic-{copy,random}.txt are successive reads of the filtered
/metrics of the session's cpu-tiny-mtp engines (copy and random drafters) under two clients'
chat completions, half a second apart. A small HTTP server on 127.0.0.1 replays them, one read
per GET: the sampler reads them as it reads an engine, and the windows it makes are the ones the
engine's traffic made. The gate on live engines is tests/test_live_acceptance_engine.py.
"""

from __future__ import annotations

import dataclasses
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.cutover import gates, live
from appliance.cutover.context import Context
from appliance.cutover.history import Gate
from appliance.engine_api import specdecode
from appliance.judge import noninferiority, traffic_acceptance

DATA = Path(__file__).parent / "data"
READ = re.compile(r"^# read \d+ at \+[0-9.]+ s\n", re.MULTILINE)
FAST = traffic_acceptance.Settings(window_s=0.01, min_draft_tokens=8)
RULE = noninferiority.Rule(min_samples=6, min_calls=6)


def reads(which: str) -> list[str]:
    """The successive expositions of one capture."""
    text = (DATA / f"metrics-vllm-0.32-mtp-traffic-{which}.txt").read_text()
    return [part for part in READ.split(text) if "vllm:" in part]


class Replay:
    """A real HTTP server on 127.0.0.1 answering ``/metrics/`` with the next exposition of
    ``pages`` on each GET (the last one again once they run out), as an engine's counters move
    between reads. Only for replaying captures: the live engines are the engine tier's."""

    def __init__(self, pages: list[str]) -> None:
        self.pages, self.served = pages, 0
        replay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                i = min(replay.served, len(replay.pages) - 1)
                replay.served += 1
                body = replay.pages[i].encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def replay() -> Iterator:
    servers: list[Replay] = []

    def start(pages: list[str]) -> str:
        servers.append(Replay(pages))
        return servers[-1].url

    yield start
    for s in servers:
        s.close()


def _sample(url: str, windows: int | None = None, **kw) -> traffic_acceptance.Traffic:
    until = (lambda t: len(t.windows) >= windows) if windows else (lambda t: False)
    return traffic_acceptance.sample(url, until=until, limit_s=30.0, settings=FAST, **kw)


def test_the_captures_windows_are_the_counters_movement_between_reads(replay):
    pages = reads("copy")
    traffic = _sample(replay(pages), windows=len(pages) - 1)
    assert traffic.speculative and traffic.busy and traffic.failed_reads == 0
    first, last = specdecode.parse(pages[0]), specdecode.parse(pages[-1])
    whole = specdecode.delta(first, last)
    summed = traffic.summed()
    # Every draft between the first read and the last is in exactly one window.
    assert (summed.drafts, summed.draft_tokens, summed.accepted) == (
        whole.drafts,
        whole.draft_tokens,
        whole.accepted,
    )
    assert all(w.delta.draft_tokens >= FAST.min_draft_tokens for w in traffic.windows)
    assert traffic.calls >= len(traffic.windows) // 2  # short calls: most windows end some


def test_copy_against_random_captures_is_worse_and_copy_against_itself_is_not(replay):
    copy = _sample(replay(reads("copy")), windows=20)
    rand = _sample(replay(reads("random")), windows=20)
    assert min(w.acceptance for w in copy.windows) > 0.9
    assert max(w.acceptance for w in rand.windows) < 0.2
    j = noninferiority.judge(copy.side(), rand.side(), RULE, "windows")
    assert j.decision == noninferiority.WORSE, j.summary()
    halves = copy.windows[:10], copy.windows[10:]
    sides = [traffic_acceptance.Traffic(h).side() for h in halves]
    j = noninferiority.judge(*sides, RULE, "windows")
    assert j.decision == noninferiority.NOT_WORSE, j.summary()


def test_a_restart_between_two_reads_starts_a_new_window(replay):
    pages = reads("copy")
    restarted = reads("random")  # another engine's counters: a new *_created, lower counts
    traffic = _sample(replay([*pages[:6], *restarted[:6]]), windows=8)
    # No window spans the restart: five windows on each side of it, none across.
    assert len(traffic.windows) == 8
    assert [w.acceptance > 0.5 for w in traffic.windows] == [True] * 5 + [False] * 3


def test_an_engine_without_speculative_counters_is_said_at_once(replay):
    plain = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
    plain += 'vllm:num_requests_running{engine="0",model_name="gemma4-tiny"} 0.0\n'
    traffic = _sample(replay([plain]))
    assert not traffic.speculative and traffic.windows == ()


def test_an_idle_engine_is_no_traffic_after_idle_s(replay):
    traffic = _sample(replay([reads("copy")[0]]), idle_s=0.05)
    assert (traffic.windows, traffic.busy) == ((), False)


def test_an_unreachable_engine_counts_failed_reads_and_makes_no_window():
    traffic = traffic_acceptance.sample(
        "http://127.0.0.1:9", until=lambda t: False, limit_s=0.1, settings=FAST
    )
    assert traffic.windows == () and traffic.failed_reads >= 1


# --- the gate ------------------------------------------------------------------------------


SETTINGS = live.Settings(
    rule=RULE, sampling=FAST, before_windows=12, before_s=30.0, idle_s=0.5, after_s=30.0
)


def _ctx(said: list[str]) -> Context:
    return Context(progress=said.append)


def test_the_gate_fails_worse_and_keeps_every_number(replay):
    said: list[str] = []
    before = live.before(_ctx(said), replay(reads("copy")), SETTINGS)
    # The copy drafter's windows all accept 100%: the before-side settles at the least evidence
    # (6 windows and 6 calls here) instead of reading its 12.
    assert len(before.windows) == 6 and {w.acceptance for w in before.windows} == {1.0}
    so_far = [Gate("health", True, 3.0)]
    with pytest.raises(gates.GateFailed) as failed:
        live.after(_ctx(said), replay(reads("random")), before, SETTINGS, so_far, 60.0)
    assert failed.value.gate == "live-acceptance"
    gate = failed.value.gates[-1]
    assert gate is so_far[-1] and not gate.ok and gate.seconds >= 3.0
    assert gate.detail.startswith("draft acceptance on the live traffic is worse: mean ")
    assert "against margin -0.050, n 6 windows" in gate.detail
    # It decided as soon as the after-side had its least evidence, not later.
    assert re.search(r"\(\d+ calls\) before, 6 windows", gate.detail), gate.detail


def test_the_gate_passes_not_worse_on_the_same_traffic(replay):
    said: list[str] = []
    pages = reads("copy")
    before = live.before(_ctx(said), replay(pages[:14]), SETTINGS)
    so_far: list[Gate] = []
    j = live.after(_ctx(said), replay(pages[14:]), before, SETTINGS, so_far, 60.0)
    assert j.decision == noninferiority.NOT_WORSE
    assert so_far[-1].ok and so_far[-1].detail.startswith("not worse: ")


def test_no_traffic_before_is_nothing_to_judge(replay):
    said: list[str] = []
    assert live.before(_ctx(said), replay([reads("copy")[0]]), SETTINGS) is None
    assert said[-1] == "live acceptance: nothing to judge (no traffic); the canary decides"


def test_too_little_traffic_before_is_nothing_to_judge(replay):
    said: list[str] = []
    few = dataclasses.replace(SETTINGS, before_s=0.5)
    assert live.before(_ctx(said), replay(reads("copy")[:4]), few) is None
    # Four pages make three windows at most; how many of them half a second reads is the host's.
    said_windows = re.match(
        r"live acceptance: nothing to judge \(too little traffic \((\d) windows", said[-1]
    )
    assert said_windows and int(said_windows[1]) <= 3, said[-1]


def test_after_without_traffic_is_undecided_and_passes(replay):
    said: list[str] = []
    before = live.before(_ctx(said), replay(reads("copy")), SETTINGS)
    so_far: list[Gate] = []
    quiet = dataclasses.replace(SETTINGS, after_s=0.3)
    j = live.after(_ctx(said), replay([reads("random")[0]]), before, quiet, so_far, 60.0)
    assert j.decision == noninferiority.NOT_ENOUGH
    assert so_far[-1].ok
    assert "the canary decides: not enough calls yet (after has 0 of 6 windows" in so_far[-1].detail


def test_off_says_so_and_records_nothing():
    said: list[str] = []
    assert live.before(_ctx(said), "http://127.0.0.1:9", None) is None
    assert said == ["live acceptance: off"]


# --- the options ---------------------------------------------------------------------------


def test_settings_from_the_command_line():
    assert live.settings(False, 0.2) is None
    assert live.settings(True) is live.DEFAULT
    assert live.settings(True, 0.2).rule.margin == 0.2
    assert live.settings(True, 0.2).rule.min_calls == live.DEFAULT.rule.min_calls
    both = live.settings(True, 0.1, 0.5)
    assert (both.rule.margin, both.sampling.window_s) == (0.1, 0.5)
    assert both.before_windows == live.DEFAULT.before_windows


@pytest.mark.parametrize(
    "option, value, says",
    [
        *[("--live-acceptance-margin", v, "margin must be within 0..1") for v in ("nan", "1.5")],
        ("--live-acceptance-margin", "-0.1", "margin must be within 0..1"),
        *[("--live-acceptance-window", v, "must last at least 0.2 s") for v in ("0.1", "nan")],
    ],
)
@pytest.mark.parametrize("check", [[], ["--check"]])
def test_a_bad_value_is_one_error_line_before_anything_is_read(
    tmp_path, cli_run, option, value, says, check
):
    r = cli_run(
        ["cutover", "i1", "gemma4-vllm:0.32.0-mtp-cpu", "--root", str(tmp_path)]
        + [option, value, *check],
        code=2,
    )
    [line] = r.output.strip().splitlines()
    assert line.startswith("Error: ") and says in line, line
    assert not any(tmp_path.iterdir())


def test_the_options_are_on_cutover_only(cli_run):
    assert "--live-acceptance / --no-live-acceptance" in cli_run(["cutover", "--help"]).output
    assert "--live-acceptance-margin" in cli_run(["cutover", "--help"]).output
    assert "--live-acceptance-window" in cli_run(["cutover", "--help"]).output
    assert "--live-acceptance" not in cli_run(["rollback", "--help"]).output


def test_a_new_image_that_does_not_draft_records_nothing(replay):
    """A move to an image serving without speculative decoding (a rollback to pre-MTP): its
    side has no acceptance, so the old image's traffic is not recorded."""
    said: list[str] = []
    server = replay(reads("copy"))
    assert live.before(_ctx(said), server, SETTINGS, new_drafts=False) is None
    [line] = said
    assert line == (
        "live acceptance: nothing to judge (the new image serves without speculative "
        "decoding); the canary decides"
    )
