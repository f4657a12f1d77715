"""The canary without an engine: the shipped set, checks, an operator's JSONL, profiles' policy,
record files, and compare's judgement on records (the real-engine runs are test_canary_engine)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import socket
import threading

import pytest

from appliance import canary, profiles
from appliance.canary import cases, checks
from appliance.canary.record import Output, Record, Settings, SpecFigures
from appliance.errors import EngineError, UsageError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the shipped set and checks --------------------------------------------------------------


def test_shipped_set_has_each_kind_and_checkable_tasks():
    s = cases.shipped()
    kinds = [c.kind for c in s.cases]
    for kind in ("prose", "code", "structured"):
        assert kinds.count(kind) >= 2, kind
    kinds_of_checks = {c.check.kind for c in s.cases if c.check}
    assert kinds_of_checks == {"exact", "regex", "json"}
    assert s.tasks >= 4
    assert len({c.id for c in s.cases}) == len(s.cases)


@pytest.mark.parametrize(
    ("spec", "text", "ok"),
    [
        ({"exact": "391"}, " 391.\n", True),
        ({"exact": "391"}, "The answer is 391", False),
        ({"regex": "^\\W*Paris\\b"}, "**Paris**", True),
        ({"regex": "^\\W*Paris\\b"}, "It is Paris", False),
        (
            {"json": {"city": "string", "population": "integer"}},
            '```json\n{"city": "Lyon", "population": 522000}\n```',
            True,
        ),
        (
            {"json": {"city": "string", "population": "integer"}},
            '{"city": "Lyon", "population": "522000"}',
            False,
        ),
        ({"json": {"city": "string"}}, "Lyon is a city", False),
        ({"json": ["integer"]}, "[2, 3, 5]", True),
        ({"json": ["integer"]}, "[2, 3.5, 5]", False),
        ({"json": ["integer"]}, "[]", False),
        ({"json": ["integer"]}, "[true]", False),  # a bool is not an integer here
    ],
)
def test_checks_judge_answers(spec, text, ok):
    assert checks.parse(spec).passes(text) is ok


def test_shipped_tasks_pass_on_right_answers():
    right = {
        "task-multiply": "391",
        "task-capital": "Paris",
        "task-iso-date": "2026-07-04",
        "task-json-city": '{"city": "Lyon", "population": 522250}',
        "task-json-list": "[2, 3, 5]",
    }
    by_id = {c.id: c for c in cases.shipped().cases if c.check}
    assert set(by_id) == set(right)
    for cid, answer in right.items():
        assert by_id[cid].check.passes(answer), cid
        assert not by_id[cid].check.passes("I cannot answer that."), cid


# --- an operator's JSONL ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"prompt": "hi"}', "needs a non-empty string 'id'"),
        ('{"id": "a", "prompt": "hi", "chek": {"exact": "1"}}', "unknown key(s) chek"),
        ('{"id": "a", "kind": "poetry", "prompt": "hi"}', "kind 'poetry'"),
        ('{"id": "a"}', "exactly one of 'prompt' or 'messages'"),
        ('{"id": "a", "messages": [{"role": "user"}]}', "'messages' must be"),
        ('{"id": "a", "kind": "task", "prompt": "hi"}', "a 'task' needs a 'check'"),
        ('{"id": "a", "prompt": "hi", "check": {"regex": "("}}', "does not compile"),
        ('{"id": "a", "prompt": "hi", "check": {"json": {"x": "str"}}}', "unknown type 'str'"),
        ('{"id": "a", "prompt": "hi", "check": {"json": 3}}', "a shape is a type name"),
        ('{"id": "a", "prompt": "hi", "check": {"contains": "x"}}', "unknown check 'contains'"),
        ('{"id": "prose-dawn", "prompt": "hi"}', "already in canary.jsonl"),
    ],
)
def test_malformed_operator_line_is_refused_naming_file_and_line(tmp_path, line, message):
    f = tmp_path / "ops.jsonl"
    f.write_text('{"id": "ok-1", "prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(UsageError) as err:
        cases.resolve((f,))
    text = str(err.value)
    assert "\n" not in text
    assert str(f) in text
    if "already in" not in message:
        assert "line 3" in text
    assert message in text


def test_duplicate_id_within_a_file_names_both_lines(tmp_path):
    f = tmp_path / "ops.jsonl"
    f.write_text('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n')
    with pytest.raises(UsageError, match=r"line 2: id 'x' already used on line 1"):
        cases.resolve((f,))


def test_operator_file_extends_or_replaces_the_shipped_set(tmp_path):
    f = tmp_path / "ops.jsonl"
    f.write_text(
        '{"id": "ops-sys", "messages": [{"role": "system", "content": "Be terse."}, '
        '{"role": "user", "content": "Name a colour."}]}\n'
        '{"id": "ops-n", "prompt": "2+2? Number only.", "check": {"exact": "4"}}\n'
    )
    shipped = cases.shipped()
    extended = cases.resolve((f,))
    assert [c.id for c in extended.cases] == [c.id for c in shipped.cases] + ["ops-sys", "ops-n"]
    assert extended.sources == ("canary.jsonl", str(f))
    replaced = cases.resolve((f,), replace=True)
    assert [c.id for c in replaced.cases] == ["ops-sys", "ops-n"]
    assert replaced.tasks == 1
    assert extended.digest() != shipped.digest() != replaced.digest()
    with pytest.raises(UsageError, match="needs a canary file"):
        cases.resolve((), replace=True)


# --- profiles' [canary] ----------------------------------------------------------------------


def test_canary_is_on_by_default_for_the_mtp_profiles_only():
    on = {n for n, p in profiles.all_profiles().items() if p.canary.enabled}
    mtp = {n for n, p in profiles.all_profiles().items() if p.mtp}
    assert on == mtp
    assert "cpu-tiny-mtp" in on and "l4x4-31b" not in on
    assert profiles.get("cpu-tiny-mtp").canary.min_parity == 1.0


def test_plan_reads_the_profile_and_refuses_bad_values(tmp_path):
    prof = profiles.get("l4x4-31b-mtp")
    p = canary.plan(prof, root=tmp_path)
    assert p.enabled and p.policy == canary.Policy(0.8, 0.2)
    assert p.cases.digest() == cases.shipped().digest()
    off = canary.plan(profiles.get("l4x4-31b"), root=tmp_path)
    assert not off.enabled and off.cases is None

    # A relative prompts path is the operator's file under <root>/etc/gemma4-vllm.
    ops = tmp_path / "etc/gemma4-vllm/canary-31b.jsonl"
    ops.parent.mkdir(parents=True)
    ops.write_text('{"id": "mine", "prompt": "hello"}\n')
    mine = dataclasses.replace(
        prof, canary=dataclasses.replace(prof.canary, prompts="canary-31b.jsonl", replace=True)
    )
    assert [c.id for c in canary.plan(mine, root=tmp_path).cases.cases] == ["mine"]

    bad = dataclasses.replace(prof, canary=dataclasses.replace(prof.canary, min_parity=80))
    with pytest.raises(UsageError, match=r"profile l4x4-31b-mtp \[canary\]: .*min_parity"):
        canary.plan(bad, root=tmp_path)


def test_unknown_canary_key_in_a_profile_is_refused():
    data = {"name": "x", "description": "x", "model": "m", "served_model_name": "m"}
    with pytest.raises(UsageError, match=r"\[canary\]: unknown field\(s\) min_pariti"):
        profiles.from_dict({**data, "canary": {"min_pariti": 1.0}}, where="x.toml")


# --- compare on records ----------------------------------------------------------------------


def _rec(ids: dict[str, tuple[int, ...]], *, passed=None, version="0.32.0", **kw) -> Record:
    passed = passed or {}
    outs = tuple(
        Output(
            cid,
            "task" if cid in passed else "prose",
            f"text-{t}",
            t,
            len(t),
            "length",
            0.1,
            passed.get(cid),
        )
        for cid, t in ids.items()
    )
    base = {
        "url": "http://127.0.0.1:1",
        "model": "m",
        "vllm_version": version,
        "settings": Settings(),
        "set_digest": "d",
        "sources": ("canary.jsonl",),
        "started": 0.0,
        "seconds": 1.0,
        "outputs": outs,
    }
    return Record(**(base | kw))


def test_identical_records_pass():
    a = _rec({"p": (1, 2, 3), "t": (4, 5)}, passed={"t": True})
    c = canary.compare(a, a)
    assert c.verdict == "pass" and c.ok
    assert (c.identical, c.outputs, c.parity, c.median_first_divergence) == (2, 2, 1.0, None)
    assert c.summary().startswith("canary passed [2/2 outputs token-identical (100%")


def test_parity_failure_and_median_first_divergence():
    before = _rec({"a": (1, 2, 3, 4), "b": (1, 2, 3, 4), "c": (1, 2), "d": (9,)})
    after = _rec({"a": (1, 2, 3, 4), "b": (1, 7, 3, 4), "c": (1, 2, 5), "d": (8,)})
    c = canary.compare(before, after)
    assert not c.ok and c.verdict == "fail"
    assert c.differing == ("b", "c", "d")
    # b diverges at 1, c is a strict prefix (diverges at 2), d at 0: median 1.
    assert c.median_first_divergence == 1.0
    assert c.parity == 0.25
    assert "token parity 25% below 100% on one vLLM version (0.32.0)" in c.summary()
    assert canary.compare(before, after, canary.Policy(min_parity=0.25)).ok


def test_parity_below_threshold_is_a_warning_across_vllm_versions():
    before = _rec({"a": (1, 2)}, version="0.21.0")
    after = _rec({"a": (1, 3)}, version="0.32.0")
    c = canary.compare(before, after)
    assert c.ok and c.verdict == "warn" and c.version_changed
    assert "numerics may legitimately move" in c.summary()
    assert "vLLM 0.21.0 -> 0.32.0" in c.summary()
    assert c.figures()["version_changed"] is True


def test_task_pass_rate_drop_beyond_tolerance_fails_even_across_versions():
    ids = {"t1": (1,), "t2": (2,), "t3": (3,), "t4": (4,), "t5": (5,)}
    before = _rec(
        ids, passed={"t1": True, "t2": True, "t3": True, "t4": True, "t5": False}, version="0.19.0"
    )
    after = _rec(
        ids,
        passed={"t1": True, "t2": False, "t3": False, "t4": True, "t5": False},
        version="0.21.0",
    )
    loose = canary.Policy(min_parity=0.0, max_pass_rate_drop=0.2)
    c = canary.compare(before, after, loose)
    assert not c.ok
    assert "task pass rate fell 4/5 -> 2/5 (by 40%, tolerance 20%)" in c.summary()
    assert (c.pass_rate("before"), c.pass_rate("after")) == (0.8, 0.4)
    # One task lost of five is within a 20% tolerance (exactly at it).
    after1 = _rec(ids, passed={"t1": True, "t2": True, "t3": False, "t4": True, "t5": False})
    assert canary.compare(before, after1, loose).ok


def test_records_without_token_ids_compare_by_text():
    before = _rec({"a": (1,)})
    after = _rec({"a": (1,)})
    after = dataclasses.replace(
        after, outputs=(dataclasses.replace(after.outputs[0], token_ids=None),)
    )
    c = canary.compare(before, after)
    assert c.ok and c.by_text and "identical by text" in c.summary()


def test_different_case_ids_are_refused():
    with pytest.raises(UsageError, match="only before: b; only after: c"):
        canary.compare(_rec({"a": (1,), "b": (2,)}), _rec({"a": (1,), "c": (2,)}))


# --- record files ----------------------------------------------------------------------------


def test_record_round_trips_and_bad_files_are_refused(tmp_path):
    rec = _rec({"a": (1, 2)}, passed={"a": True}, image="gemma4-vllm:mtp")
    path = canary.save(rec, tmp_path / "r.json")
    assert canary.load(path) == rec
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it
    assert path.stat().st_mode & 0o777 == 0o600  # the model's answers: the owner's alone
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UsageError, match=r"bad.json is not a canary record"):
        canary.load(tmp_path / "bad.json")
    (tmp_path / "trunc.json").write_text(path.read_text()[:40])
    with pytest.raises(UsageError, match=r"cannot read canary record .*trunc.json"):
        canary.load(tmp_path / "trunc.json")
    with pytest.raises(UsageError, match="does not exist"):
        canary.load(tmp_path / "none.json")


def test_cli_compare_exit_codes_and_json(tmp_path, cli_run):
    a = canary.save(_rec({"a": (1, 2), "b": (3,)}), tmp_path / "a.json")
    b = canary.save(_rec({"a": (1, 2), "b": (4,)}), tmp_path / "b.json")
    r = cli_run(["canary", "compare", str(a), str(a)])
    assert r.output.startswith("canary passed")
    r = cli_run(["canary", "compare", str(a), str(b)], code=1)
    assert "canary FAILED" in r.output and "differs: b" in r.output
    r = cli_run(["canary", "compare", str(a), str(b), "--min-parity", "0.5", "--json"])
    assert json.loads(r.output)["parity"] == 0.5
    r = cli_run(["canary", "compare", str(a), str(b), "--min-parity", "2"], code=2)
    assert "min_parity must be within 0..1" in r.output


# --- answers under batching against answers alone (vLLM #46088) ------------------------------


def _with_batched(rec: Record, answers: dict[str, tuple[int, ...]]) -> Record:
    """``rec`` with a batched pass whose answers are ``answers`` (the rest as alone)."""
    alone = {o.id: o.token_ids for o in rec.outputs}
    together = _rec(alone | answers).outputs
    return dataclasses.replace(rec, batched=together)


ALONE = {"a": (1, 2, 3, 4, 5, 6), "b": (7, 8, 9, 10, 11, 12), "c": (1, 13, 14, 15, 16, 17)}


def test_batched_answers_equal_to_the_answers_alone_pass():
    rec = _with_batched(_rec(ALONE), {})
    check = canary.batched(rec)
    assert (check.identical, check.outputs, check.crossed, check.ok) == (3, 3, (), True)
    assert check.summary() == "batched answers pass: 3/3 token-identical to the answers alone"
    c = canary.compare(_rec(ALONE), rec)
    assert c.ok and "under batching 3/3 as alone" in c.summary()
    assert c.figures()["batched"]["ok"] is True
    assert canary.batched(_rec(ALONE)) is None  # no batched pass: nothing to judge


def test_an_answer_taken_from_another_sequence_fails_naming_the_defect():
    # Under batching a's answer is b's: mixed; c's follows a's for two tokens only: a drift.
    rec = _with_batched(_rec(ALONE), {"a": ALONE["b"], "c": (1, 2, 99, 99, 99, 99)})
    check = canary.batched(rec, min_parity=0.0)
    assert check.differing == ("a", "c") and check.crossed == (("a", "b"),)
    (failure,) = check.failures()
    assert failure == (
        "under batching a answered like b (vLLM #46088: --kv-cache-dtype auto with MTP: answers "
        "mixed across the sequences of a batch)"
    )
    c = canary.compare(_rec(ALONE), rec, canary.Policy(min_parity=0.0))
    assert c.verdict == "fail" and failure in c.summary()


def test_batched_answers_that_drift_are_judged_by_the_parity_floor():
    # c diverges late under batching (a GPU's numerics can): below 100%, not a mix-up.
    rec = _with_batched(_rec(ALONE), {"c": (1, 13, 14, 15, 99, 99)})
    check = canary.batched(rec)
    assert (check.differing, check.crossed, check.ok) == (("c",), (), False)
    assert check.failures() == [
        "under batching 2/3 answers equal the same engine's answers alone (67%, min 100%): c differ"
    ]
    assert canary.batched(rec, min_parity=0.6).ok
    assert canary.compare(_rec(ALONE), rec, canary.Policy(min_parity=0.6)).ok


def test_a_profile_turns_the_batched_pass_on_for_its_canary():
    prof = profiles.get("rtx5090x2-31b-fp8-mtp")  # max_num_seqs = 1
    assert not canary.plan(prof).batched  # off unless the profile says so
    on = dataclasses.replace(prof, canary=dataclasses.replace(prof.canary, batched=True))
    plan = canary.plan(on)
    assert (plan.batched, plan.at_once) == (True, 1)
    table = profiles.from_dict(
        {"name": "x", "description": "d", "model": "m", "served_model_name": "s"}
        | {"canary": {"enabled": True, "batched": True}}
    )
    assert canary.plan(table).batched


def test_a_records_figures_are_the_run_without_its_answers_and_read_back_alike(tmp_path):
    """What `canary record --json` prints beside the file (the run itself: the engine tier's
    test_cli_record_and_compare_end_to_end): every field of the record but the answers, with
    how many prompts, checked tasks and passes; the same from the saved file."""
    rec = _with_batched(_rec(ALONE, passed={"a": True, "b": False}), {})
    figures = rec.figures()
    assert not {"outputs", "batched"} & set(figures)
    assert (figures["prompts"], figures["tasks"], figures["passed"]) == (3, 2, 1)
    assert figures["settings"] == dataclasses.asdict(rec.settings)
    path = canary.save(rec, tmp_path / "r.json")
    assert json.dumps(canary.load(path).figures()) == json.dumps(figures)


def test_a_record_keeps_its_batched_pass_and_an_older_one_loads_without(tmp_path):
    rec = _with_batched(_rec(ALONE), {"c": (1, 13, 14, 15, 99, 99)})
    path = canary.save(rec, tmp_path / "r.json")
    assert canary.load(path) == rec
    data = json.loads(path.read_text())
    del data["batched"]  # a record written before the batched pass
    path.write_text(json.dumps(data))
    assert canary.load(path).batched == ()


# --- refused before anything is sent ---------------------------------------------------------


def test_malformed_set_is_refused_before_any_connection(tmp_path, cli_run):
    # Nothing listens on the port: had the command connected first, the error would be the
    # engine's ("cannot reach"), not the set's.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n')
    out = tmp_path / "out.json"
    url = f"http://127.0.0.1:{_free_port()}"
    r = cli_run(
        ["canary", "record", "--url", url, "--out", str(out), "--canary-file", str(bad)], code=2
    )
    assert r.output.strip().splitlines() == [f"Error: {bad} line 2: invalid JSON (Expecting value)"]
    assert not out.exists()
    # The same URL with a good set does try to connect: the ordering above is what was tested.
    r = cli_run(["canary", "record", "--url", url, "--out", str(out)], code=1)
    assert "cannot reach" in r.output
    assert not out.exists()


# --- the canary's time bound -----------------------------------------------------------------


class _HungEngine(http.server.BaseHTTPRequestHandler):
    """Answers vLLM's /version and /v1/models, then never answers a completion: a hung engine
    (a real one cannot be made to hang on demand without stopping it for every other test)."""

    release = threading.Event()

    def do_GET(self):
        body = {"/version": {"version": "0.32.0"}, "/v1/models": {"data": [{"id": "m"}]}}
        data = json.dumps(body.get(self.path, {})).encode()
        self.send_response(200 if self.path in body else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        _HungEngine.release.wait(60)

    def log_message(self, *args):
        pass


def test_a_canary_on_a_hung_engine_fails_within_its_bound_naming_it():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HungEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(EngineError) as err:
            canary.run(cases.shipped(), url, "m", within=1.0)
    finally:
        _HungEngine.release.set()
        server.shutdown()
    n = len(cases.shipped().cases)
    assert str(err.value).startswith(f"the canary did not finish within 1 s (0 of {n} prompts")
    assert "--canary-timeout" in str(err.value)


# --- acceptance: how the answers were made ----------------------------------------------------


def _drafted(rec: Record, accepted: dict[str, int], k: int = 2, drafts: int = 10) -> Record:
    """``rec`` with per-prompt figures: ``drafts`` steps of ``k`` draft tokens each, of which
    ``accepted[id]`` were accepted (split over the positions front first)."""
    outs = []
    for o in rec.outputs:
        n = accepted[o.id]
        per_pos = tuple(min(drafts, max(0, n - i * drafts)) for i in range(k))
        spec = SpecFigures(drafts, drafts * k, n, per_pos, "request")
        outs.append(dataclasses.replace(o, spec=spec))
    return dataclasses.replace(rec, outputs=tuple(outs))


IDS = {f"p{i}": (i, i + 1) for i in range(5)}


def test_same_answers_with_fewer_accepted_drafts_fail_naming_acceptance():
    before = _drafted(_rec(IDS), dict.fromkeys(IDS, 16))  # 80%
    after = _drafted(_rec(IDS), dict.fromkeys(IDS, 8))  # 40%
    c = canary.compare(before, after)
    assert c.parity == 1.0 and not c.ok
    assert "draft acceptance fell 80% -> 40% (median drop 40% over 5 prompts, tolerance 10%)" in (
        c.summary()
    )
    assert "tokens per step 2.60 -> 1.80" in c.summary()
    figs = c.figures()["acceptance"]
    before_figs, after_figs = figs["before"], figs["after"]
    assert (before_figs["acceptance"], after_figs["acceptance"]) == (0.8, 0.4)
    assert figs["median_change"] == -0.4 and (figs["samples"], figs["unit"]) == (5, "prompts")
    assert before_figs["per_position"] == [1.0, 0.6] and after_figs["per_position"] == [0.8, 0.0]
    # The reverse is a rise: it passes, and the summary says by how much.
    back = canary.compare(after, before)
    assert back.verdict == "pass" and "(median change +40%" in back.summary()


def test_one_odd_prompt_does_not_decide_and_a_small_drift_is_within_tolerance():
    before = _drafted(_rec(IDS), dict.fromkeys(IDS, 16))
    odd = _drafted(_rec(IDS), {**dict.fromkeys(IDS, 16), "p0": 0})
    assert canary.compare(before, odd).ok
    drift = _drafted(_rec(IDS), dict.fromkeys(IDS, 15))  # 80% -> 75%
    assert canary.compare(before, drift).ok
    assert not canary.compare(before, drift, canary.Policy(max_acceptance_drop=0.04)).ok


def test_records_without_figures_compare_on_answers_only_and_say_so():
    c = canary.compare(_rec(IDS), _drafted(_rec(IDS), dict.fromkeys(IDS, 16)))
    assert c.verdict == "pass" and c.acceptance is None
    assert "acceptance not compared (a record has no speculative-decoding figures)" in c.summary()


def test_a_profile_sets_the_acceptance_tolerance_and_the_cli_can_override_it(tmp_path, cli_run):
    before = _drafted(_rec(IDS), dict.fromkeys(IDS, 16))
    after = _drafted(_rec(IDS), dict.fromkeys(IDS, 13))  # a 15-point drop
    paths = []
    for name, rec in (("b", before), ("a", after)):
        paths.append(str(canary.save(rec, tmp_path / f"{name}.json")))
    res = cli_run(["canary", "compare", *paths, "--profile", "cpu-tiny-mtp"], code=1)
    assert "draft acceptance fell 80% -> 65%" in res.output
    res = cli_run(["canary", "compare", *paths, "--max-acceptance-drop", "0.2", "--json"])
    assert json.loads(res.output)["acceptance"]["median_change"] == -0.15
    res = cli_run(["canary", "compare", *paths, "--max-acceptance-drop", "2"], code=2)
    assert "max_acceptance_drop must be within 0..1" in res.output


# --- the acceptance baseline: a cutover from an image without MTP ------------------------------

MTP_IMAGE = "gemma4-vllm:0.32.0-mtp"


def _mtp(accepted: int, **kw) -> Record:
    """A record of IDS on the MTP image whose every prompt accepted ``accepted`` of 20."""
    rec = _rec(IDS, image=MTP_IMAGE, started=1_790_000_000.0, **kw)
    return _drafted(rec, dict.fromkeys(IDS, accepted))


def test_a_cutover_from_no_mtp_fails_on_a_drop_below_the_instance_baseline():
    kept = canary.Baseline.of(_mtp(16))  # 80%, 2.60 tokens per step
    old = _rec(IDS, version="0.19.0", image="gemma4-vllm:pre-mtp")  # no MTP: no figures
    res = canary.judge(old, _mtp(8), canary.Policy(), kept)  # 40%: same answers
    assert not res.ok and res.comparison.verdict == "fail"
    line = res.summary()
    assert line.startswith(
        "canary FAILED: draft acceptance fell 80% -> 40% (median drop 40% over 5 prompts, "
        "tolerance 10%) against the acceptance baseline gemma4-vllm:0.32.0-mtp of "
        "2026-09-21T14:13:20Z"
    ), line
    assert "this record becomes" not in line
    figs = res.figures()
    assert figs["verdict"] == "fail" and figs["acceptance"] is None  # before drafted nothing
    assert figs["baseline"]["baseline"] == {
        "image": MTP_IMAGE,
        "vllm_version": "0.32.0",
        "recorded": 1_790_000_000.0,
        "acceptance": 0.8,
        "tokens_per_step": 2.6,
        "prompts": 5,
    }
    assert figs["baseline"]["change"]["after"]["acceptance"] == 0.4
    assert figs["baseline"]["failures"] == list(res.comparison.failures)
    # A small drift holds, and the passing record is the next baseline.
    res = canary.judge(old, _mtp(15), canary.Policy(), kept)
    assert res.ok and res.comparison.verdict == "pass"
    assert res.summary().endswith(
        "against the acceptance baseline gemma4-vllm:0.32.0-mtp of 2026-09-21T14:13:20Z: "
        "acceptance 80% -> 75% over 5 prompts (median change -5%, tokens per step 2.60 -> 2.50)"
        "; this record becomes the new baseline"
    )


def test_the_first_mtp_cutover_has_no_baseline_passes_on_answers_and_becomes_it(tmp_path):
    old = _rec(IDS, version="0.19.0")
    res = canary.judge(old, _mtp(16), canary.Policy(), None)
    assert res.ok and res.figures()["baseline"] == {
        "baseline": None,
        "change": None,
        "failures": [],
    }
    assert res.summary().endswith(
        "; no acceptance baseline yet: this record becomes the instance's baseline "
        "(acceptance 80%, tokens per step 2.60)"
    )
    # Kept atomically, owner-only, read back with the same figures.
    path = tmp_path / "canary" / "i1.baseline.json"
    assert canary.baseline.keep(res.after, path) is not None
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["i1.baseline.json"]
    kept = canary.baseline.load(path)
    assert (kept.acceptance, kept.tokens_per_step, kept.record.image) == (0.8, 2.6, MTP_IMAGE)
    # A record that drafted nothing never replaces it.
    assert canary.baseline.keep(old, path) is None
    assert canary.baseline.load(path).acceptance == 0.8
    assert canary.baseline.load(tmp_path / "none.json") is None


def test_an_mtp_before_record_is_the_reference_not_the_baseline():
    # Before drafted: the paired compare judges; a far better baseline is not consulted.
    res = canary.judge(_mtp(12), _mtp(11), canary.Policy(), canary.Baseline.of(_mtp(20)))
    assert res.ok and res.baseline is None and res.figures()["baseline"] is None
    assert "acceptance baseline" not in res.summary()


def test_a_broken_baseline_file_is_refused_naming_it_and_the_field(tmp_path):
    path = tmp_path / "i1.baseline.json"
    canary.save(_mtp(16), path)
    data = json.loads(path.read_text())
    data["outputs"][0]["spec"]["accepted"] = "many"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as exc:
        canary.baseline.load(path)
    msg = str(exc.value)
    assert msg.startswith(f"acceptance baseline {path}: outputs.0.spec.accepted = 'many'"), msg
    assert msg.endswith(
        f"(remove {path}: the next cutover whose canary passes with MTP keeps a new one)"
    )
    canary.save(_rec(IDS), path)  # a record, but one that drafted nothing
    with pytest.raises(UsageError, match="no prompt has speculative-decoding figures"):
        canary.baseline.load(path)


def test_a_record_taken_before_the_cutover_must_be_of_its_image_set_and_settings(tmp_path):
    """A group's head judges the new image against answers recorded before its workers moved
    (`appliance multinode cutover --canary-before`): only a record of the image it leaves, with
    the set and settings its own canary would run, compares like one recorded in the cutover."""
    plan = canary.plan(profiles.get("cpu-tiny-mtp-2node"), enabled=True)
    good = _rec({"a": (1, 2)}, set_digest=plan.cases.digest(), settings=plan.settings, image="x:1")
    path = tmp_path / "before.json"
    canary.save(good, path)
    assert canary.recorded(plan, path, "x:1") == good
    with pytest.raises(UsageError, match="is of image x:1, the nodes run x:2"):
        canary.recorded(plan, path, "x:2")
    canary.save(dataclasses.replace(good, set_digest="other"), path)
    with pytest.raises(UsageError, match="ran another canary set or settings"):
        canary.recorded(plan, path, "x:1")
    other = dataclasses.replace(good, settings=Settings(max_tokens=plan.settings.max_tokens + 1))
    canary.save(other, path)
    with pytest.raises(UsageError, match="ran another canary set or settings"):
        canary.recorded(plan, path, "x:1")
