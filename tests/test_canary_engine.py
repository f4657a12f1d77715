"""The canary against the real CPU engines (vLLM 0.32, one tiny target): MTP on vs off within
one version is lossless at temperature 0 with either drafter; a changed answer fails; a
malformed set sends nothing; the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from appliance import canary, profiles
from appliance.canary import cases
from appliance.engine_api.vllm_client import VLLMClient

pytestmark = pytest.mark.engine

POLICY = canary.plan(profiles.get("cpu-tiny-mtp")).policy  # 100% parity, no task drop
# The tiny target repeats its last input token: 16 tokens show what 64 would (the cpu-tiny-mtp
# profile's canary runs 16 too), at a quarter of the engine's time (the random drafter's record
# took two minutes at 64 on a loaded host).
SETTINGS = canary.Settings(max_tokens=16)


def _record(engine, settings: canary.Settings = SETTINGS) -> canary.Record:
    rec = canary.run(
        cases.shipped(), engine.url, engine.profile.served_model_name, settings=settings
    )
    print(f"{engine.profile.name}: {rec.cost()}")  # the cost, for the gotcha (pytest -s)
    return rec


@pytest.fixture(scope="module")
def rec_baseline(baseline_engine) -> canary.Record:
    return _record(baseline_engine)


@pytest.fixture(scope="module")
def rec_mtp(mtp_engine) -> canary.Record:
    return _record(mtp_engine)


def _requests_done(url: str) -> float:
    text = VLLMClient(url).metrics_text()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    )


def test_record_keeps_token_ids_usage_and_version(rec_baseline):
    assert rec_baseline.vllm_version == "0.32.0"
    assert rec_baseline.settings == canary.Settings(max_tokens=16, seed=0)
    assert len(rec_baseline.outputs) == len(cases.shipped().cases)
    for o in rec_baseline.outputs:
        assert o.token_ids is not None and len(o.token_ids) == o.completion_tokens > 0
        assert o.text
    assert rec_baseline.tasks == cases.shipped().tasks
    assert rec_baseline.seconds > 0


def test_mtp_on_is_lossless_with_the_copy_drafter(rec_baseline, rec_mtp):
    c = canary.compare(rec_baseline, rec_mtp, POLICY)
    assert c.verdict == "pass", c.summary()
    assert (c.identical, c.parity, c.median_first_divergence) == (c.outputs, 1.0, None)
    assert not c.by_text and not c.version_changed
    assert c.passed_before == c.passed_after


def test_mtp_on_is_lossless_with_the_random_drafter(rec_baseline, rec_random):
    # Acceptance ~0: every token comes from the target's own verification, none from a draft.
    c = canary.compare(rec_baseline, rec_random, POLICY)
    assert c.verdict == "pass", c.summary()
    assert c.parity == 1.0


def test_a_changed_answer_fails_on_one_version(rec_mtp, mtp_engine):
    # Same engine, same prompts, a shorter answer: what a changed generation config does.
    short = _record(mtp_engine, settings=canary.Settings(max_tokens=8))
    c = canary.compare(rec_mtp, short, POLICY)
    assert not c.ok
    assert "on one vLLM version (0.32.0)" in c.summary()
    assert "settings differ (max_tokens 16, seed 0 vs max_tokens 8, seed 0)" in c.summary()
    # Every answer that ran past 8 tokens diverges exactly where the shorter one stops.
    long_ones = [o.id for o in rec_mtp.outputs if o.completion_tokens > 8]
    assert long_ones and set(long_ones) <= set(c.differing)
    assert c.median_first_divergence == 8.0


def test_a_different_system_prompt_is_compared_case_by_case(rec_mtp, mtp_engine, tmp_path):
    # The shipped ids with a system message in front: a changed chat input under the same ids.
    ops = tmp_path / "system.jsonl"
    ops.write_text(
        "".join(
            json.dumps(
                {
                    "id": c.id,
                    "kind": c.kind,
                    "messages": [{"role": "system", "content": "Answer in French."}, *c.messages],
                    **({"check": c.check.to_dict()} if c.check else {}),
                }
            )
            + "\n"
            for c in cases.shipped().cases
        )
    )
    cset = cases.resolve((ops,), replace=True)
    changed = canary.run(
        cset, mtp_engine.url, mtp_engine.profile.served_model_name, settings=SETTINGS
    )
    c = canary.compare(rec_mtp, changed, POLICY)
    assert "the cases' prompts or checks differ between the records" in c.warnings
    # The tiny target greedily repeats its last input token: whether the system message changes
    # an answer depends on the chat template's tail, so the verdict must follow the ids.
    assert c.ok == (c.identical == c.outputs)
    assert c.differing == tuple(
        o.id
        for o, n in zip(rec_mtp.outputs, changed.outputs, strict=True)
        if o.token_ids != n.token_ids
    )


def test_an_edited_record_fails_compare_in_the_cli(rec_mtp, tmp_path, cli_run):
    before = canary.save(rec_mtp, tmp_path / "before.json")
    first = rec_mtp.outputs[0]
    ids = list(first.token_ids)
    ids[3] = ids[3] + 1
    edited = dataclasses.replace(
        rec_mtp, outputs=(dataclasses.replace(first, token_ids=tuple(ids)), *rec_mtp.outputs[1:])
    )
    after = canary.save(edited, tmp_path / "after.json")
    r = cli_run(["canary", "compare", str(before), str(after), "--json"], code=1)
    figures = json.loads(r.output)
    assert figures["differing"] == [first.id]
    assert figures["median_first_divergence"] == 3
    assert figures["verdict"] == "fail"


def test_malformed_set_sends_no_request_to_the_engine(baseline_engine, tmp_path, cli_run):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "fine", "prompt": "hello"}\n{"id": "x", "kind": "task", "prompt": "y"}\n'
    )
    out = tmp_path / "rec.json"
    done = _requests_done(baseline_engine.url)
    r = cli_run(
        [
            "canary",
            "record",
            "--url",
            baseline_engine.url,
            "--out",
            str(out),
            "--canary-file",
            str(bad),
        ],
        code=2,
    )
    assert r.output.strip() == f"Error: {bad} line 2: a 'task' needs a 'check'"
    assert not out.exists()
    assert _requests_done(baseline_engine.url) == done


def test_cli_record_and_compare_end_to_end(baseline_engine, mtp_random_engine, tmp_path, cli_run):
    # An installed instance's files under --root: its key file is read by the one rule (the
    # engine has no key and ignores the header) and its env file names the image recorded.
    etc = tmp_path / "root/etc/gemma4-vllm"
    etc.mkdir(parents=True)
    (etc / "tiny.api-key").write_text("s3cret-key\r\n")
    (etc / "tiny.env").write_text("VLLM_IMAGE=gemma4-vllm:0.32.0-mtp\n")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["canary", "record", "--profile", "cpu-tiny-mtp", "--root", str(tmp_path / "root")]
    r = cli_run([*base, "--url", baseline_engine.url, "--out", str(a)])
    max_tokens = profiles.get("cpu-tiny-mtp").canary.max_tokens  # the profile's run settings
    assert re.search(
        rf"canary: 14 prompts in [\d.]+ s \([\d.]+ s per prompt, max_tokens {max_tokens}\)",
        r.output,
    ), r.output
    r = cli_run(
        [*base, "--url", mtp_random_engine.url, "--out", str(b), "--instance", "tiny", "--json"]
    )
    assert canary.load(b).image == "gemma4-vllm:0.32.0-mtp"
    # --json: one object on stdout, the run's figures from the record (its answers are b's).
    shown = json.loads(r.stdout)
    saved = {**canary.load(b).figures(), "out": str(b), "batched": None}
    assert shown == json.loads(json.dumps(saved)), r.stdout
    assert (shown["prompts"], shown["image"], shown["profile"]) == (
        14,
        "gemma4-vllm:0.32.0-mtp",
        "cpu-tiny-mtp",
    )
    assert canary.load(a).image is None
    r = cli_run(["canary", "compare", str(a), str(b), "--profile", "cpu-tiny-mtp"])
    assert r.output.startswith("canary passed [14/14 outputs token-identical (100%, min 100%)")

    # An empty key file is refused before anything is sent or written.
    (etc / "tiny.api-key").write_text("\n")
    c = tmp_path / "c.json"
    r = cli_run(
        [*base, "--url", baseline_engine.url, "--out", str(c), "--instance", "tiny"], code=2
    )
    assert "is empty" in r.output
    assert not c.exists()


@pytest.fixture(scope="module")
def rec_random(mtp_random_engine) -> canary.Record:
    return _record(mtp_random_engine)


def test_the_random_drafter_keeps_every_answer_and_fails_on_acceptance(rec_mtp, rec_random):
    """The regression the answers cannot show: the same target, a drafter whose drafts
    are never accepted; greedy verification keeps every answer token-identical."""
    for rec in (rec_mtp, rec_random):
        assert {o.spec.source for o in rec.outputs} == {"request"}  # vLLM 0.32's own block
    c = canary.compare(rec_mtp, rec_random, POLICY)
    assert c.parity == 1.0 and not c.ok
    assert "draft acceptance fell" in c.summary() and "the same answers" in c.summary()
    assert c.acceptance.before.acceptance - c.acceptance.after.acceptance > 0.5, c.summary()
    back = canary.compare(rec_random, rec_mtp, POLICY)
    assert back.ok and "median change +" in back.summary(), back.summary()


def test_without_per_request_metrics_the_figures_come_from_the_counters(mtp_counters_engine):
    rec = _record(mtp_counters_engine)
    assert {o.spec.source for o in rec.outputs} == {"counters"}
    assert all(o.spec.drafts > 0 for o in rec.outputs)


def test_answers_under_batching_equal_the_answers_alone(mtp_engine, rec_mtp, tmp_path, cli_run):
    """The batched pass (issue 46): the 14 cases again, all sent at once, so the engine decodes
    them in one batch with MTP; each answer must equal the same engine's answer alone. The
    defect it is for (vLLM #46088: answers mixed across a batch with --kv-cache-dtype auto and
    MTP) is a GPU one; test_canary.py shows the verdict on such a record."""
    out = tmp_path / "batched.json"
    args = ["canary", "record", "--url", mtp_engine.url, "--profile", "cpu-tiny-mtp"]
    r = cli_run([*args, "--out", str(out), "--batched"])
    assert "batched answers pass: 14/14 token-identical to the answers alone" in r.output
    rec = canary.load(out)
    assert [o.id for o in rec.batched] == [o.id for o in rec.outputs]
    assert all(o.completion_tokens == rec.settings.max_tokens for o in rec.batched)
    # Every batched answer made with drafts, exact per request under the batch.
    assert {o.spec.source for o in rec.batched if o.spec} == {"request"}
    assert canary.compare(rec_mtp, rec, POLICY).verdict == "pass"
    print(f"\nbatched canary: {rec.cost()}")
