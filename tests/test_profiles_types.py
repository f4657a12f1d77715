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


# --- ranges (issue 45 §3, newcomer review D5) -------------------------------------------------
# Each value is the right type but outside what the field can mean: `profiles validate` said
# "ok" to all five and `install` wrote three of them. One rule now, in the record: both refuse
# with one line naming the field and its range, and install writes nothing.

_BASE = {
    "name": '"x"',
    "description": '"d"',
    "model": '"m"',
    "served_model_name": '"s"',
}
CPU = {"hardware": '{ device = "cpu" }'}  # a valid profile but for the value under test


def _profile_file(tmp_path: Path, table: str = "", **top: str) -> Path:
    path = tmp_path / "x.toml"
    lines = [f"{k} = {v}" for k, v in {**_BASE, **top}.items()]
    path.write_text("\n".join(lines) + "\n" + table)
    return path


@pytest.mark.parametrize(
    ("top", "table", "line"),
    [
        (
            {"gpu_memory_utilization": "1.7"},
            "",
            ": gpu_memory_utilization = 1.7: must be above 0 and at most 1",
        ),
        ({"max_model_len": "0"}, "", ": max_model_len = 0: must be within 1..1048576"),
        ({"port": "70000"}, "", ": port = 70000: must be within 1..65535"),
        (
            {"name": '"my profile!"'},
            "",
            (
                ": name = 'my profile!': must be letters, digits and '._-' (at most 64), "
                "starting with a letter or digit"
            ),
        ),
        (
            {},
            "[canary]\nmin_parity = 8\n",
            " [canary]: min_parity = 8: must be within 0..1",
        ),
    ],
)
def test_a_value_outside_its_range_is_refused_by_validate_and_install_alike(
    tmp_path, top, table, line, cli_run
):
    path = _profile_file(tmp_path, table, **CPU, **top)
    res = cli_run(["profiles", "validate", "--file", str(path)], code=None)
    assert (res.exit_code, res.output) == (2, f"Error: x.toml{line}\n")
    root = tmp_path / "root"
    argv = ["instance", "install", "t1", "--profile", str(path), "--root", str(root)]
    res = cli_run(argv, code=None)
    assert (res.exit_code, res.output) == (2, f"Error: {path}{line}\n")  # the file as given
    assert not root.exists()


@pytest.mark.parametrize(
    ("top", "table", "line"),
    [
        ({"tensor_parallel_size": "0"}, "", "tensor_parallel_size = 0: must be within 1..64"),
        ({"max_num_seqs": "-4"}, "", "max_num_seqs = -4: must be within 1..4096"),
        ({"gpu_memory_utilization": "0.0"}, "", "must be above 0 and at most 1"),
        ({"dtype": '"bf16"'}, "", "dtype = 'bf16': must be one of auto, half, float16, "),
        ({}, '[hardware]\ncompute_capability = "9"\n', "compute_capability = '9': must be"),
        ({}, '[hardware]\ndevice = "gpu"\n', "[hardware]: device = 'gpu': must be one of"),
        ({}, "[speculative]\nnum_speculative_tokens = 0\n", "must be within 1..64"),
        ({}, "[canary]\nmax_tokens = 0\n", "[canary]: max_tokens = 0: must be within 1..1048576"),
        ({}, "[canary]\nmax_pass_rate_drop = 1.5\n", "must be within 0..1"),
        ({}, "[multinode]\nmaster_port = 0\n", "master_port = 0: must be within 1..65535"),
        ({"host": '"-h"'}, "", "host = '-h': must be an IP address or host name"),
        ({"min_vllm": '"new"'}, "", "min_vllm = 'new': must be a version"),
        # Upper bounds too (issue 55 §3; the top-level ones: tests/test_bad_input.py).
        ({}, "[hardware]\ngpus = 65\n", "[hardware]: gpus = 65: must be within 0..64"),
        ({}, "[hardware]\ngpu_memory_gib = 1e26\n", "gpu_memory_gib = 1e+26: must be within"),
        ({}, "[canary]\nmax_tokens = 1048577\n", "max_tokens = 1048577: must be within 1.."),
        ({}, "[canary]\nseed = 9223372036854775808\n", "[canary]: seed = 9223372036854775808"),
        ({}, "[speculative]\nnum_speculative_tokens = 65\n", "must be within 1..64"),
        ({}, "[multinode]\nnodes = 65\n", "[multinode]: nodes = 65: must be within 2..64"),
    ],
)
def test_every_bounded_field_names_its_range(tmp_path, top, table, line):
    path = _profile_file(tmp_path, table, **top)
    with pytest.raises(UsageError) as exc:
        profiles.load_file(path)
    assert line in str(exc.value) and "\n" not in str(exc.value)


def test_the_shipped_values_are_inside_the_ranges():
    # The edges themselves are values: utilisation 1.0, one sequence, the last port.
    base = {"name": "x", "description": "d", "model": "m", "served_model_name": "s"}
    prof = profiles.from_dict(
        {**base, "gpu_memory_utilization": 1.0, "max_num_seqs": 1, "port": 65535}, "x.toml"
    )
    assert (prof.gpu_memory_utilization, prof.port) == (1.0, 65535)
