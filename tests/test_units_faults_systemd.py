"""The unit keeps the engine serving, and gives up on a crash loop, under real systemd.

The shared instance (tests/plugins/systemd_instance.py: cpu-tiny-mtp in a booted nspawn machine,
the host's Docker) is used as an operator's box is:

- the engine core dies (SIGKILL to the ``VLLM::EngineCore`` process inside the container, seen
  from the host): vLLM's API server then shuts down and exits 0 (vllm#48966), and the unit must
  come back by itself and serve, with counters restarted from zero, which the counter arithmetic
  reports as a reset;
- an image that crashes right after becoming healthy (tests/plugins/docker_engine.py) loops
  until systemd's start limit, ends ``failed``, and the state metrics say so; the instance is
  then put back on the MTP image for the tests after these.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from plugins.docker_engine import CRASH_AFTER_S, CRASH_EXIT
from plugins.systemd_instance import MTP_IMAGE, SystemdInstance

from appliance import specdecode, state_metrics
from appliance.host.layout import Layout
from appliance.host.systemd import Systemd
from appliance.units import timing

pytestmark = [pytest.mark.systemd, pytest.mark.docker, pytest.mark.engine]

MODEL = "gemma4-tiny"
ENGINE_CORE_TITLE = "VLLM::EngineCore"


def engine_core_pids(container: str) -> list[int]:
    """Host pids of the container's vLLM engine core processes (``docker top``)."""
    out = subprocess.run(
        ["docker", "top", container, "-eo", "pid,args"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    pids = []
    for line in out.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        if args.strip() == ENGINE_CORE_TITLE:
            pids.append(int(pid))
    return pids


def api_server_pid(container: str) -> int:
    """The container's first process (vLLM's API server, under the entry point's exec)."""
    out = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Pid}}", container],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.strip())


def unit_journal(inst: SystemdInstance, since: str) -> str:
    """systemd's and the unit's journal lines since ``since`` (a journalctl --since value)."""
    return inst.machine.run(
        "journalctl", "--no-pager", "-o", "cat", "-u", inst.unit, "--since", since, check=False
    ).stdout


def machine_now(inst: SystemdInstance) -> str:
    return inst.machine.run("date", "+%Y-%m-%d %H:%M:%S").stdout.strip()


def test_an_engine_core_that_dies_is_restarted_and_serves_again(systemd_instance):
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    resp = inst.chat("before the crash", max_tokens=16)
    assert resp.status_code == 200, resp.text
    before = specdecode.parse(inst.metrics())
    assert before.total(MODEL) is not None and before.total(MODEL).drafts > 0
    invocation, restarts = inst.show("InvocationID"), int(inst.show("NRestarts") or 0)
    since = machine_now(inst)

    cores = engine_core_pids(inst.container)
    assert len(cores) == 1, cores
    api = api_server_pid(inst.container)
    assert api not in cores  # the engine core, not the API server
    os.kill(cores[0], signal.SIGKILL)

    # The API server notices, shuts down "gracefully" and exits 0: with Restart=on-failure the
    # unit stayed down here (inactive, Result=success). Now systemd restarts it.
    deadline = time.monotonic() + 120
    while inst.show("InvocationID") == invocation and inst.show("SubState") == "running":
        assert time.monotonic() < deadline, unit_journal(inst, since)[-3000:]
        time.sleep(0.5)
    journal = unit_journal(inst, since)
    state = (inst.show("ActiveState"), inst.show("SubState"), inst.show("Result"))
    assert state[0] != "inactive", (state, journal[-3000:])
    inst.wait_restarted(invocation)
    journal = unit_journal(inst, since)
    print(f"\nafter SIGKILL of {ENGINE_CORE_TITLE} {cores[0]}: unit {state}")
    # The old engine's end: the API server exited 0 (no "Failed with result"), and systemd
    # restarted it anyway.
    assert "Scheduled restart job" in journal, journal[-3000:]
    assert "Failed with result" not in journal, journal[-3000:]
    assert not re.search(r"Main process exited, code=exited, status=[1-9]", journal), journal
    assert int(inst.show("NRestarts")) == restarts + 1
    assert inst.machine.is_active(inst.unit) == "active"

    # It serves again, with counters that started again from zero.
    fresh = specdecode.parse(inst.metrics())
    resp = inst.chat("after the crash", max_tokens=16)
    assert resp.status_code == 200, resp.text
    after = specdecode.parse(inst.metrics())
    f = fresh.total(MODEL)
    assert f is None or (f.drafts, f.draft_tokens, f.accepted) == (0, 0, 0), f
    since_restart = specdecode.delta(fresh, after, MODEL)
    assert since_restart.status == "ok" and since_restart.drafts > 0, since_restart
    assert after.total(MODEL).drafts == since_restart.drafts  # counted from zero
    # Across the crash the public arithmetic reports a reset, never a (negative or stale) delta.
    across = specdecode.delta(before, after, MODEL)
    assert across.status == "reset" and across.drafts is None and across.acceptance is None


def stream_once(inst: SystemdInstance, max_tokens: int, first: threading.Event) -> dict:
    """One streamed chat completion read to its end: its status, finish reason, the server's
    token count, how many chunks carried a choice, and any error; ``first`` is set once a token
    arrived."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to a thousand."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # vLLM's extension: the request runs to max_tokens
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict = {"max_tokens": max_tokens, "status": None, "finish": None, "tokens": None}
    out |= {"chunks": 0, "error": None}
    headers = {"Authorization": f"Bearer {inst.api_key}"}
    try:
        with httpx.stream(
            "POST", f"{inst.url}/v1/chat/completions", json=body, headers=headers, timeout=300
        ) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                for choice in chunk.get("choices") or ():
                    out["chunks"] += 1
                    first.set()
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def keep_streaming(
    inst: SystemdInstance, max_tokens: int, first: threading.Event, until: threading.Event
) -> list[dict]:
    """Streamed requests one after another until one is turned away (the server is stopping)
    or ``until`` is set: a client that always has a request in flight. Every outcome, in
    order."""
    outcomes: list[dict] = []
    try:
        while not until.is_set():
            outcomes.append(stream_once(inst, max_tokens, first))
            if outcomes[-1]["chunks"] == 0:
                break
    finally:
        first.set()  # never leave the caller waiting on a client that failed
    return outcomes


def test_stop_is_not_restarted_and_logs_the_drain(systemd_instance):
    """An operator's `systemctl stop` (and so every restart, cutover and roll) lets the requests
    in flight finish: with vLLM's default the SIGTERM aborts them, and the 0.32 CPU engine then
    hangs on their open streams until docker kills it. Restart=always restarts any exit, but never a
    stop, and a stop ends `inactive` (not `failed`, which fires Gemma4InstanceFailed) whether
    vLLM drained within its grace or docker killed it after (the serve program's stop line says
    which). The unit is left stopped: the crash loop below starts it on its own image (an engine
    start saved), and any later test starts it again with ``ensure``."""
    inst = systemd_instance
    inst.ensure(MTP_IMAGE)
    since = machine_now(inst)
    # Clients that always have a request in flight, so the stop's SIGTERM lands on running
    # requests whenever it comes. Each asks for its own length (up to most of the tiny model's
    # context, 512): requests of one length end together, and their clients' next requests are
    # all still being rendered, not yet running, for a moment (seen: nothing in flight).
    lengths = (400, 340, 280, 220)
    firsts, until = [threading.Event() for _ in lengths], threading.Event()
    with ThreadPoolExecutor(len(lengths)) as pool:
        calls = [
            pool.submit(keep_streaming, inst, n, f, until)
            for n, f in zip(lengths, firsts, strict=True)
        ]
        try:
            for f in firsts:
                assert f.wait(120), "a client got no token in 120 s"
            # The unit's own worst case: ExecStop, the SIGTERM to what is left and ExecStopPost
            # each get TimeoutStopSec; the blocking stop returns once systemd ended its stop job.
            bound = 3 * timing.STOP_TIMEOUT_S + 60
            stopped = inst.machine.systemctl("stop", inst.unit, check=False, timeout=bound)
        finally:
            until.set()  # a client still sending after the stop (or a failure here) ends now
        outcomes = [o for c in calls for o in c.result()]
    journal = unit_journal(inst, since)
    result = {p: inst.show(p) for p in ("ActiveState", "SubState", "Result")}
    result |= {p: inst.show(p) for p in ("ExecMainCode", "ExecMainStatus")}
    # The serve program's stop line: drained in time, or killed after the grace.
    drained = rf"container {inst.container} stopped after \d+ s"
    killed = rf"vLLM did not drain within \d+ s: docker killed container {inst.container}"
    lines = re.findall(f"{drained}|{killed}", journal)
    # vLLM's own line: how many requests were still running at the SIGTERM.
    running = re.findall(r"draining in-flight requests count=(\d+)", journal)
    whole = {"status": 200, "finish": "length", "error": None}
    done = [
        o for o in outcomes if {k: o[k] for k in whole} == whole and o["tokens"] == o["max_tokens"]
    ]
    cut = [o for o in outcomes if o["chunks"] and o not in done]  # started, then cut short
    # The whole tail, not the assertion's repr (cut short in a run's report): an intermittent
    # exit 1 after a 1 s drain was seen once in a full run (issue 43's note, 2026-12-05).
    print(f"\nstop: {result}; {lines}; in flight {running}; {len(done)} whole, cut {cut}")
    print(f"turned away: {[o for o in outcomes if not o['chunks']]}\n{journal[-6000:]}")
    assert stopped.returncode == 0, (stopped.stderr, result, journal[-3000:])
    # Every request that started ran to its end: none cut short by the stop.
    assert not cut and len(done) >= len(lengths), (cut, outcomes)
    assert "aborting in-flight requests" not in journal, journal[-3000:]
    assert running and int(running[0]) >= 1, ("nothing in flight at the SIGTERM", journal[-3000:])
    assert len(lines) == 1, (result, journal[-3000:])
    # No restart scheduled (one to come would show as SubState auto-restart), and not failed.
    assert (result["ActiveState"], result["SubState"], result["Result"]) == (
        "inactive",
        "dead",
        "success",
    ), (result, lines, journal[-3000:])


def test_a_crash_loop_ends_failed_at_the_start_limit_and_reaches_the_state_metrics(
    systemd_instance, crash_image
):
    """Every start of the crash image succeeds (the unit goes active on /health), then the
    engine exits 3: the rendered unit's own RestartSec and StartLimitBurst, no test override."""
    inst = systemd_instance
    burst = int(inst.show("StartLimitBurst"))
    assert burst == timing.START_LIMIT_BURST
    since = machine_now(inst)
    inst.set_image(crash_image)
    try:
        inst.machine.systemctl("reset-failed", inst.unit, check=False)
        inst.machine.systemctl("restart", "--no-block", inst.unit)
        restart_sec = timing.RESTART_SEC
        deadline = time.monotonic() + (burst + 1) * (restart_sec + CRASH_AFTER_S + 60)
        while (active := inst.show("ActiveState")) != "failed":
            assert time.monotonic() < deadline, (active, unit_journal(inst, since)[-4000:])
            time.sleep(1)
        journal = unit_journal(inst, since)
        print(f"\ncrash loop: {inst.show('Result')} after {inst.show('NRestarts')} restarts")
        # systemd 252 keeps the first failure's result (the engine's exit) when the restart
        # after it is refused at the start limit: the journal line says it was the limit.
        result = inst.show("Result")
        assert result in ("exit-code", "start-limit-hit"), journal[-3000:]
        # burst starts ran (the first by hand); the restart after the last was refused.
        assert int(inst.show("NRestarts")) >= burst - 1
        # Every start got to healthy before the engine died: a crash after start-up.
        # From the crash image's first start: --since has whole seconds, so the previous
        # image's last lines can come along.
        crashing = journal[journal.index(f"image {crash_image}:") :]
        assert crashing.count("vLLM healthy on") == burst, crashing[-4000:]
        assert journal.count(f"status={CRASH_EXIT}/") >= burst, journal[-4000:]
        assert "Start request repeated too quickly" in journal, journal[-3000:]
        # systemd does not try again by itself: no restart is scheduled (until RestartSec runs
        # out, one to come shows as ActiveState activating, SubState auto-restart).
        assert (inst.show("ActiveState"), inst.show("SubState")) == ("failed", "failed")

        # The state metrics read it from systemctl show, and the alert's series is 1.
        status = state_metrics.unit_status(Systemd(tuple(inst.machine.enter_argv())), inst.unit)
        assert (status.active, status.result) == ("failed", result), status
        # What a timer runs between cutovers: the textfile node_exporter serves gets the state.
        refresh = inst.appliance("status", inst.instance, "--write-metrics")
        # Exit 1: the instance is not serving, and status says so by its code as well.
        assert refresh.returncode == 1, refresh.stdout + refresh.stderr
        assert "(gemma4-vllm@systest.service: failed)" in refresh.stdout, refresh.stdout
        text = Layout(inst.root).metrics_textfile().read_text()
        line = (
            f'{state_metrics.UNIT_STATE}{{instance="{inst.instance}",result="{result}",'
            'state="failed"} 1.0'
        )
        assert line in text.splitlines(), text
        assert re.search(rf'{state_metrics.UNIT_STATE}{{instance="{inst.instance}",result="",'
                         r'state="active"} 0\.0', text)  # fmt: skip
    finally:
        # What the operator does: fix the image, reset-failed, start. Later tests need it.
        inst.set_image(MTP_IMAGE)
        inst.restart()
    assert inst.machine.is_active(inst.unit) == "active"
    assert inst.chat("after the crash loop", max_tokens=4).status_code == 200
