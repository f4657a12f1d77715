"""The records the appliance writes to disk (history lines, canary records, soak readings, model
copy manifests, bench artifacts) read back typed: a wrong type anywhere is one line naming the
file and the field, and the CLI command that reads it exits 2; files in the old shape load."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance import canary
from appliance.bench import report
from appliance.bench.prompts import Prompt, PromptSet
from appliance.bench.runner import BenchConfig, Endpoint, EndpointResult, RunRecord
from appliance.canary.record import Output, Record, Settings
from appliance.cutover import history, recovery
from appliance.cutover.history import Entry, Gate
from appliance.engine_api import specdecode
from appliance.errors import UsageError
from appliance.fleet import soak
from appliance.host.layout import Layout
from appliance.models import cache
from appliance.models import manifest as mf
from appliance.reports import html

COMMIT = "a" * 40
SHA = "b" * 64


# --- one valid record of each kind, in its JSON form -----------------------------------------


def _entry() -> dict:
    e = Entry.begin("i1", "cutover", "gemma4-vllm:pre-mtp", "gemma4-vllm:mtp")
    e.outcome, e.finished, e.error = "rolled_back", e.started + 42.5, "health failed"
    e.gates = [Gate("unit", True, 0.5, "active"), Gate("health", False, 40.25, "503")]
    e.rollback_gates = [Gate("unit", True, 1.5)]
    e.canary = {"parity": 1.0}
    e.interrupted = "SIGTERM"
    return json.loads(e.to_json())


def _canary() -> dict:
    outs = (
        Output("p1", "prose", "text", (1, 2, 3), 3, "length", 0.5),
        Output("t1", "task", "391", (7,), 1, "stop", 0.25, True),
    )
    rec = Record(
        url="http://127.0.0.1:1",
        model="m",
        vllm_version="0.32.0",
        settings=Settings(),
        set_digest="d",
        sources=("canary.jsonl",),
        started=1.5,
        seconds=1.0,
        outputs=outs,
        image="gemma4-vllm:mtp",
        profile="cpu-tiny-mtp",
    )
    return rec.to_dict()


def _reading() -> dict:
    counters = specdecode.Counters(10.0, 20.0, 15.0, (8.0, 7.0), 1700000000.5)
    return soak.Reading(counters, 5.0, 1.0, 1700000100.5).to_dict()


def _manifest() -> dict:
    f = mf.FileEntry("config.json", 3, SHA, COMMIT, cache.TreeEntry(3, COMMIT))
    m = mf.ModelEntry("target", "google/gemma-4-E2B-it", "main", COMMIT, (f,))
    return json.loads(mf.Manifest("cpu-tiny-mtp", (m,)).to_json())


def _artifact() -> dict:
    config = BenchConfig(
        (PromptSet("short", (Prompt("hi", ({"role": "user", "content": "hi"},)),)),)
    )
    ep = Endpoint("endpoint", "http://127.0.0.1:1", "m", 2048, "0.32.0", True)
    run = RunRecord(
        "endpoint", "short", "hi", 64, 1, 0.1, 0.01, 0.7, [0.01], 61, 5, 30, 87.1, SHA, "counters"
    )
    result = EndpointResult(ep, [run], specdecode.Delta("absent"))
    return report.artifact("single", config, report.environment(), result)


# --- how each kind is read back from a file ---------------------------------------------------


def _history(path: Path, data) -> object:
    path.write_text(json.dumps(data) + "\n")
    (entry,) = history.entries(path)
    return entry


def _canary_load(path: Path, data) -> object:
    path.write_text(json.dumps(data))
    return canary.load(path)


def _soak_load(path: Path, data) -> object:
    path.write_text(json.dumps(data))
    return soak.loads(path.read_text(), str(path))


def _manifest_load(path: Path, data) -> object:
    path.write_text(json.dumps(data))
    return mf.parse(path.read_bytes(), str(path))


def _artifact_load(path: Path, data) -> object:
    path.write_text(json.dumps(data))
    return report.load(path)


@dataclass(frozen=True)
class Kind:
    name: str
    valid: Callable[[], dict]
    load: Callable[[Path, object], object]  # writes the file, returns what the product read
    required: str  # a field without a default
    opaque: tuple[tuple, ...] = ()  # untyped on purpose (dict): not checked below these


KINDS = [
    Kind("history", _entry, _history, "id", opaque=(("canary",),)),
    Kind("canary", _canary, _canary_load, "url"),
    Kind("soak", _reading, _soak_load, "requests"),
    Kind("manifest", _manifest, _manifest_load, "models"),
    Kind("artifact", _artifact, _artifact_load, "config", opaque=(("single",),)),
]


def _leaves(node, path=(), opaque=()):
    """Every (path, value) of ``node`` that is not None, inner objects and arrays included."""
    if node is None:
        return
    if path:
        yield path, node
    if path in opaque:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k), opaque)
    elif isinstance(node, list):
        if path and path[-1] == "endpoints":  # each endpoint's dict is the runner's, untyped
            return
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i), opaque)


# A JSON value of another kind than the one the field holds: always wrong (no None: optional
# fields take it; no int for a float: JSON's 1 is a valid number).
_FINITE = st.floats(allow_nan=False, allow_infinity=False)
_OTHER = {
    str: st.one_of(st.integers(), _FINITE, st.booleans(), st.lists(st.integers(), max_size=2)),
    bool: st.one_of(st.text(max_size=4), st.integers(), _FINITE, st.just([])),
    int: st.one_of(st.text(max_size=4), st.booleans(), _FINITE),  # strict: 3.0 is no int
    float: st.one_of(st.text(max_size=4), st.booleans(), st.just([1.0]), st.just({})),
    list: st.one_of(st.text(max_size=4), st.integers(), st.booleans(), st.just({"a": 1})),
    dict: st.one_of(st.text(max_size=4), st.integers(), st.booleans(), st.just([1])),
}


@st.composite
def _corrupt(draw):
    kind = draw(st.sampled_from(KINDS))
    data = json.loads(json.dumps(kind.valid()))  # as in the file: arrays, not tuples
    path, value = draw(st.sampled_from(list(_leaves(data, opaque=kind.opaque))))
    wrong = draw(_OTHER[type(value)])
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = wrong
    return kind, path, wrong, data


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_corrupt())
def test_a_wrong_type_anywhere_is_one_line_naming_the_file_and_field(tmp_path, case):
    kind, path, wrong, data = case
    file = tmp_path / f"{kind.name}.json"
    with pytest.raises(UsageError) as caught:
        kind.load(file, data)
    line = str(caught.value)
    assert "\n" not in line and str(file) in line, line
    field = ".".join(map(str, path))
    assert field in line, (field, wrong, line)


def _plain(value):
    """``value`` as JSON has it: a record by its own writer where it has one (``to_json``),
    else dataclasses and pydantic models as objects."""
    if hasattr(value, "to_json"):
        return json.loads(value.to_json())
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    elif hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    return json.loads(json.dumps(value, default=_plain))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_valid_record_loads(tmp_path, kind):
    """The property above starts from these: each loads, and carries its required field's value
    as written."""
    data = kind.valid()
    record = kind.load(tmp_path / "ok.json", copy.deepcopy(data))
    assert _plain(record)[kind.required] == data[kind.required]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_record_missing_a_field_names_it(tmp_path, kind):
    data = kind.valid()
    del data[kind.required]
    with pytest.raises(UsageError, match=f"missing field {kind.required}$"):
        kind.load(tmp_path / "x.json", data)


# --- the messages, pinned ---------------------------------------------------------------------


def test_the_lines(tmp_path):
    hist = tmp_path / "h.jsonl"
    with pytest.raises(UsageError) as got:
        _history(hist, {**_entry(), "started": [1]})
    assert str(got.value) == f"{hist} line 1: started = [1]: Input should be a valid number"

    rec = tmp_path / "r.json"
    with pytest.raises(UsageError) as got:
        _canary_load(rec, {**_canary(), "outputs": 5})
    assert (
        str(got.value)
        == f"{rec} is not a canary record: outputs = 5: Input should be a valid array"
    )

    before = tmp_path / "before.json"
    with pytest.raises(UsageError) as got:
        _soak_load(before, {**_reading(), "schema": True})
    assert str(got.value).startswith(f"{before} is not a soak reading: schema = True, not 1")

    data = _manifest()
    data["models"][0]["files"][0]["size"] = "big"
    man = tmp_path / "manifest.json"
    with pytest.raises(UsageError) as got:
        _manifest_load(man, data)
    assert str(got.value).startswith(
        f"{man} is not a model copy manifest: models.0.files.0.size = 'big': "
        "Input should be a valid integer"
    )

    art = tmp_path / "a.json"
    with pytest.raises(UsageError) as got:
        _artifact_load(art, {**_artifact(), "sweep": {}})
    assert str(got.value) == (
        f"{art} is not a bench artifact: Value error, a single artifact must not have 'sweep'"
    )


def test_a_crash_cut_history_line_is_skipped_but_a_wrong_typed_one_is_not(tmp_path):
    path = tmp_path / "h.jsonl"
    good = _entry()
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:50] + "\n")
    assert [e.id for e in history.entries(path)] == [good["id"]]
    path.write_text(
        json.dumps(good)
        + "\n"
        + json.dumps({**good, "gates": [{"name": "unit", "ok": "yes", "seconds": 1.0}]})
    )
    with pytest.raises(UsageError, match=r"h.jsonl line 2: gates.0.ok = 'yes'"):
        history.entries(path)
    # The cutover and the rollback read past it: a damaged history never blocks the way back.
    assert [e.id for e in history.entries(path, strict=False)] == [good["id"]]


def test_a_wrong_typed_history_line_does_not_stop_the_rollbacks_look_for_a_killed_cutover(
    tmp_path,
):
    layout = Layout(tmp_path)
    path = layout.history_file("i1")
    path.parent.mkdir(parents=True)
    killed = {**_entry(), "outcome": "started"}
    path.write_text(json.dumps({**_entry(), "started": [1]}) + "\n" + json.dumps(killed) + "\n")
    found = recovery.interrupted_entry(layout, "i1")
    assert found is not None and found.id == killed["id"]


# --- files written by the code before the typed records --------------------------------------

OLD_HISTORY = (  # the first history's shape: no canary, no interrupted
    '{"error":null,"finished":1700000042.0,"from_image":"a:1","gates":[{"detail":"active",'
    '"name":"unit","ok":true,"seconds":0.1}],"id":"0123456789ab","instance":"i1",'
    '"kind":"cutover","outcome":"ok","pid":42,"rollback_gates":[],"started":1700000000.0,'
    '"to_image":"b:2"}'
)
OLD_CANARY = {
    "format": "appliance-canary-record/1",
    "image": None,
    "model": "m",
    "outputs": [
        {
            "completion_tokens": 2,
            "finish_reason": "length",
            "id": "p1",
            "kind": "prose",
            "passed": None,
            "seconds": 0.1,
            "text": "ab",
            "token_ids": [5, 6],
        }
    ],
    "profile": None,
    "seconds": 1.0,
    "set_digest": "d",
    "settings": {"max_tokens": 64, "seed": 0, "temperature": 0.0},
    "sources": ["canary.jsonl"],
    "started": 0.0,
    "url": "http://127.0.0.1:1",
    "vllm_version": "0.32.0",
}
OLD_READING = """{
  "schema": 1,
  "at": 1700000000.25,
  "requests": 12.0,
  "errors": 0.0,
  "counters": {
    "drafts": 10.0,
    "draft_tokens": 20.0,
    "accepted": 15.0,
    "accepted_per_pos": [8.0, 7.0],
    "created": 1699999000.0
  }
}
"""
OLD_MANIFEST = {
    "format": 1,
    "profile": "cpu-tiny-mtp",
    "models": [
        {
            "role": "drafter",
            "repo_id": "google/gemma-4-E2B-it-assistant",
            "revision": "main",
            "commit": COMMIT,
            "files": [
                {
                    "path": "model.safetensors",
                    "size": 7,
                    "sha256": SHA,
                    "blob": SHA,
                    "hub": {"size": 7, "blob_id": COMMIT, "lfs_sha256": SHA, "lfs_size": 7},
                }
            ],
        }
    ],
}


def test_records_in_the_old_shape_still_load(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text(OLD_HISTORY + "\n")
    [e] = history.entries(path)
    assert (e.outcome, e.gates, e.canary, e.interrupted) == (
        "ok",
        [Gate("unit", True, 0.1, "active")],
        None,
        None,
    )

    rec = canary.load(_write(tmp_path / "r.json", json.dumps(OLD_CANARY)))
    assert rec.outputs[0].token_ids == (5, 6) and rec.settings == Settings()

    reading = soak.loads(OLD_READING)
    assert reading.counters == specdecode.Counters(10.0, 20.0, 15.0, (8.0, 7.0), 1699999000.0)
    assert json.loads(soak.dumps(reading)) == json.loads(OLD_READING)  # the shape it writes

    man = mf.parse(json.dumps(OLD_MANIFEST), "copy")
    f = man.models[0].files[0]
    assert f.tree == cache.TreeEntry(7, COMMIT, SHA) and man.profile == "cpu-tiny-mtp"
    assert json.loads(man.to_json()) == OLD_MANIFEST  # written back byte for byte as JSON
    no_profile = {k: v for k, v in OLD_MANIFEST.items() if k != "profile"}
    assert mf.parse(json.dumps(no_profile), "copy").profile == ""


def test_a_bench_artifact_round_trips_with_its_shape(tmp_path):
    body = _artifact()
    assert sorted(body) == ["config", "definitions", "endpoints", "environment", "kind", "single"]
    path = report.write_artifact(tmp_path / "a.json", body)
    assert report.load(path).to_dict() == json.loads(path.read_text())
    assert html.load_artifact(path) == json.loads(path.read_text())
    with pytest.raises(UsageError, match=r"a.json is not a bench artifact: extra = 1: Extra"):
        _artifact_load(path, {**body, "extra": 1})


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the commands that read them: exit 2, one line, no traceback ------------------------------


def _one_error_line(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output  # a crash is a traceback: cli_run re-raises it
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_history_command_on_a_wrong_typed_line(tmp_path, cli_run):
    path = Layout(tmp_path).history_file("i1")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**_entry(), "started": [1]}) + "\n")
    result = cli_run(["history", "i1", "--root", str(tmp_path)], code=None)
    _one_error_line(result, f"{path} line 1", "started = [1]")


def test_canary_compare_on_a_wrong_typed_record(tmp_path, cli_run):
    good = _write(tmp_path / "a.json", json.dumps(_canary()))
    bad = _write(tmp_path / "b.json", json.dumps({**_canary(), "outputs": 5}))
    result = cli_run(["canary", "compare", str(good), str(bad)], code=None)
    _one_error_line(result, f"{bad} is not a canary record", "outputs = 5")


def test_fleet_soak_on_a_wrong_typed_reading(tmp_path, cli_run):
    data = _reading()
    data["counters"]["drafts"] = "many"
    before = _write(tmp_path / "before.json", json.dumps(data))
    # An installed NAME: the unknown one is refused before its reading is read.
    cli_run(["instance", "install", "-p", "cpu-tiny-mtp", "i1", "--root", str(tmp_path)])
    argv = ["fleet", "soak", "i1", "--before", str(before), "--root", str(tmp_path)]
    result = cli_run(argv, code=None)
    _one_error_line(result, str(before), "counters.drafts = 'many'")


def test_models_import_on_a_wrong_typed_manifest(tmp_path, cli_run):
    data = _manifest()
    data["models"][0]["files"][0]["size"] = "big"
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    _write(copy_dir / mf.NAME, json.dumps(data))
    hub = tmp_path / "hub"
    argv = ["models", "import", "--profile", "l4x4-31b-mtp", "--hf-cache-dir", str(hub)]
    result = cli_run([*argv, "--from", str(copy_dir)], code=None)
    _one_error_line(result, str(copy_dir / mf.NAME), "models.0.files.0.size = 'big'")


def test_python_api_readers_take_parsed_data_too():
    assert Entry.from_dict(_entry()).gates[1] == Gate("health", False, 40.25, "503")
    with pytest.raises(UsageError, match="history entry: pid = 'x'"):
        Entry.from_dict({**_entry(), "pid": "x"})
    assert canary.record.from_dict(_canary()).outputs[1].passed is True
    with pytest.raises(UsageError, match=r"canary record: outputs.1.passed = 1"):
        data = copy.deepcopy(_canary())
        data["outputs"][1]["passed"] = 1
        canary.record.from_dict(data)
    data = copy.deepcopy(_canary())
    data["settings"]["max_tokens"] = 0  # the right type, refused by the record's own check
    with pytest.raises(UsageError, match="^canary record: canary max_tokens must be at least 1"):
        canary.record.from_dict(data)
    assert soak.Reading.from_dict(_reading()).requests == 5.0
    with pytest.raises(UsageError, match=r"reading: schema = \[0, 1, 2, [0-9, ]*\.\.\., not 1 \("):
        soak.Reading.from_dict({**_reading(), "schema": list(range(40))})
