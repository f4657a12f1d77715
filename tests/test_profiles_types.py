"""A profile with a value of the wrong type anywhere is one line naming the field, never a
traceback: `profiles validate --file` on TOMLs an operator wrote."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance import profiles
from appliance.errors import UsageError

SHIPPED = Path(profiles.__file__).parent / "data" / "l4x4x2-31b-mtp.toml"
BASE = tomllib.loads(SHIPPED.read_text())  # every table present
# Values TOML can hold: one of them is the wrong type for any field.
VALUES = st.one_of(
    st.text(max_size=5),
    st.integers(-3, 70000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(min_size=1, max_size=3), st.integers(), max_size=2),
)


def _fields():
    out = [(None, f.name) for f in dataclasses.fields(profiles.Profile)]
    tables = {
        "speculative": profiles.Speculative,
        "hardware": profiles.Hardware,
        "canary": profiles.Canary,
        "multinode": profiles.Multinode,
    }
    for table, cls in tables.items():
        out += [(table, f.name) for f in dataclasses.fields(cls)]
    return out


@given(st.sampled_from(_fields()), VALUES)
def test_any_field_of_any_type_is_a_profile_or_one_line(where, value):
    table, name = where
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    (data[table] if table else data)[name] = value
    try:
        profiles.from_dict(data, where="p.toml")
    except UsageError as exc:
        line = str(exc)
        assert "\n" not in line and line.startswith("p.toml")
        assert name in line or table in line


@pytest.mark.parametrize(
    ("toml", "line"),
    [
        (
            "tensor_parallel_size = 'four'",
            "x.toml: tensor_parallel_size = 'four': Input should be a valid integer",
        ),
        (
            "[hardware]\ngpus = true",
            "x.toml [hardware]: gpus = True: Input should be a valid integer",
        ),
        (
            "[canary]\nenabled = 'yes'",
            "x.toml [canary]: enabled = 'yes': Input should be a valid boolean",
        ),
        ("env = {A = 1}", "x.toml: env.A = 1: Input should be a valid string"),
        ("hardware = 3", "x.toml [hardware]: expected a table, got 3"),
    ],
)
def test_profiles_validate_file_names_the_field(tmp_path, toml, line, cli_run):
    path = tmp_path / "x.toml"
    path.write_text(
        'name = "x"\ndescription = "d"\nmodel = "m"\nserved_model_name = "s"\n' + toml + "\n"
    )
    res = cli_run(["profiles", "validate", "--file", str(path)], code=2)
    assert res.output == f"Error: {line}\n"


def test_a_missing_field_is_named(tmp_path, cli_run):
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\ndescription = "d"\nmodel = "m"\n')
    res = cli_run(["profiles", "validate", "--file", str(path)], code=2)
    assert res.output == "Error: x.toml: missing field(s) served_model_name\n"


def test_profiles_list_and_show_have_json(cli_run):
    rows = json.loads(cli_run(["profiles", "list", "--json"]).output)["profiles"]
    assert sorted(r["name"] for r in rows) == sorted(profiles.all_profiles())
    tiny = next(r for r in rows if r["name"] == "cpu-tiny-mtp")
    assert (tiny["mtp"], tiny["num_speculative_tokens"], tiny["errors"]) == (True, 2, 0)
    shown = json.loads(cli_run(["profiles", "show", "cpu-tiny", "--json"]).output)
    assert shown["argv"] == [
        "vllm",
        "serve",
        *profiles.get("cpu-tiny").serve_args(devmodel="$DEVMODEL"),
    ]
    assert shown["findings"] == []
