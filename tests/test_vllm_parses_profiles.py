"""Every shipped profile's `vllm serve` arguments, read by vLLM itself.

No GPU profile's command line had ever been read by vLLM: a misspelt flag or a wrong
speculative-config key would first fail on a GPU host at start. Here the arguments the
appliance renders (the args file's records, plus the address the serve program adds and a
multi-node group's node flags) go through the real ``vllm serve`` parser of the vLLM in this
environment (0.32), then ``AsyncEngineArgs.from_cli_args``, and the speculative config's keys
and values through vLLM's own ``SpeculativeConfig`` field types: building the whole config needs
the drafter's weights, its fields do not. Each image's own vLLM is not checked here.

Importing vLLM takes ~20 s: once per module (the ``vllm_serve`` fixture).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import hypothesis
import pytest
from hypothesis import strategies as st

from appliance import profiles
from appliance.bench import tune
from appliance.multinode import node_args
from appliance.oci import labels
from appliance.profiles import validate
from appliance.serve.container import drain_args, queue_args, speculative_args
from appliance.serve.docker import DRAIN_S
from appliance.units import engine_args

SHIPPED = sorted(profiles.all_profiles())
# An MTP image of the vLLM here: the serve program gives it the MTP and per-request flags.
MTP_IMAGE_LABELS = {labels.MTP: labels.TRUE, labels.VLLM_VERSION: "0.32.0"}


@dataclasses.dataclass(frozen=True)
class VllmServe:
    """vLLM's serve parser and the types it hands the arguments to."""

    parser: object
    engine_args: type
    validate: object
    speculative_fields: dict

    def parse(self, argv: list[str]):
        """(the parsed namespace, the engine arguments) of ``vllm serve ARGV``, as vLLM's serve
        command makes them."""
        ns = self.parser.parse_args(argv)
        self.validate(ns)
        ns.model = ns.model_tag  # what `vllm serve` does with the positional model
        return ns, self.engine_args.from_cli_args(ns)

    def speculative_problems(self, config: dict) -> list[str]:
        """Each key of ``config`` that is no field of vLLM's SpeculativeConfig, or whose value
        that field's type (with its constraints) refuses."""
        import pydantic

        problems = []
        for key, value in config.items():
            info = self.speculative_fields.get(key)
            if info is None:
                problems.append(f"unknown key {key!r}")
                continue
            kind = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
            try:
                pydantic.TypeAdapter(kind).validate_python(value)
            except pydantic.ValidationError as exc:
                problems.append(f"{key} = {value!r}: {exc.errors()[0]['msg']}")
        return problems


@pytest.fixture(scope="module")
def vllm_serve() -> VllmServe:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    return VllmServe(
        parser,
        AsyncEngineArgs,
        validate_parsed_serve_args,
        dict(SpeculativeConfig.__pydantic_fields__),
    )


def _argvs(profile: profiles.Profile) -> dict[str, list[str]]:
    """The engine's argv per node role, as the serve program runs it on an MTP image of the
    vLLM here (0.32: the queue bound's flag too)."""
    address = ["--host", profile.host, "--port", str(profile.port)]
    if profile.multinode is None:
        runs = {"single": engine_args.serve_args(profile, [])}
    else:
        runs = {role: node_args(profile, role, 1, "g") for role in ("head", "worker")}
    return {
        role: [
            *args.serve,
            *address,
            *speculative_args(args, MTP_IMAGE_LABELS)[0],
            *queue_args(args, MTP_IMAGE_LABELS)[0],
            *drain_args(MTP_IMAGE_LABELS)[0],
        ]
        for role, args in runs.items()
    }


@pytest.mark.parametrize("name", SHIPPED)
def test_vllm_reads_every_shipped_profiles_arguments(vllm_serve, name):
    profile = profiles.get(name)
    for role, argv in _argvs(profile).items():
        ns, ea = vllm_serve.parse(argv)
        # Each value reached the engine argument it was meant for.
        assert ea.model == argv[0], role
        assert ea.served_model_name == [profile.served_model_name]
        assert ea.tensor_parallel_size == profile.tensor_parallel_size
        assert ea.pipeline_parallel_size == profile.pipeline_parallel_size
        assert ea.max_model_len == profile.max_model_len
        assert ea.max_num_seqs == profile.max_num_seqs
        # vLLM's admission bound (vllm/config/scheduler.py max_num_queued_reqs, PR #49445).
        assert ea.max_num_queued_reqs == profile.queue_bound
        # How long in-flight requests finish after the stop's SIGTERM (PR #36666).
        assert ea.shutdown_timeout == DRAIN_S
        assert ea.quantization == profile.quantization
        assert ea.kv_cache_dtype == (profile.kv_cache_dtype or "auto")
        assert ea.enforce_eager == profile.enforce_eager
        if profile.multinode is not None:
            rank = 0 if role == "head" else 1
            assert (ea.nnodes, ea.node_rank) == (profile.multinode.nodes, rank)
            assert ea.master_addr == profile.multinode.master_addr
            assert ns.headless == (role == "worker")
        if not profile.mtp:
            assert ea.speculative_config is None
            continue
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert ea.speculative_config == spec
        assert vllm_serve.speculative_problems(spec) == []


def test_a_misspelt_flag_is_refused(vllm_serve, capsys):
    # The reference profile's own rendering, with one flag misspelt in its extra_args.
    bad = dataclasses.replace(
        profiles.get("l4x4-31b-mtp"), extra_args=("--tensor-parallel-sise", "2")
    )
    (argv,) = _argvs(bad).values()
    with pytest.raises(SystemExit) as exc:
        vllm_serve.parse(argv)
    assert exc.value.code == 2
    assert "unrecognized arguments: --tensor-parallel-sise 2" in capsys.readouterr().err
    # The check can pass: the same profile, spelt right.
    (argv,) = _argvs(profiles.get("l4x4-31b-mtp")).values()
    assert vllm_serve.parse(argv)[1].tensor_parallel_size == 4


def test_a_wrong_speculative_config_key_or_value_is_refused(vllm_serve):
    spec = json.loads(profiles.get("l4x4-31b-mtp").speculative.to_json())
    assert vllm_serve.speculative_problems(spec) == []
    misspelt = {**spec, "num_speculative_token": 2}
    del misspelt["num_speculative_tokens"]
    assert vllm_serve.speculative_problems(misspelt) == ["unknown key 'num_speculative_token'"]
    (problem,) = vllm_serve.speculative_problems({**spec, "method": "mpt"})
    assert problem.startswith("method = 'mpt': ")
    (problem,) = vllm_serve.speculative_problems({**spec, "num_speculative_tokens": 0})
    assert problem.startswith("num_speculative_tokens = 0: ")  # vLLM's gt=0 constraint


# --- the k schedule (num_speculative_tokens_per_batch_size) ------------------------------------
# vLLM's config types the schedule (SpeculativeConfig's field) and its scheduler checks the
# ranges at engine start (validate_and_normalize_dynamic_sd_schedule, via the dense lookup it
# builds): the validator must refuse exactly what those refuse, or an accepted profile is an
# engine that never comes up, or a refused one a schedule the operator could have run.

_ENTRIES = st.tuples(st.integers(-2, 12), st.integers(-2, 12), st.integers(-1, 4))
_SHAPES = st.lists(st.lists(st.integers(-1, 12), min_size=1, max_size=4), max_size=3)


def _vllm_refuses(schedule) -> bool:
    """Whether vLLM's scheduler refuses ``schedule`` at engine start, as it calls the check:
    only for a non-empty one (an empty schedule is skipped: static k)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    if not schedule:
        return False
    try:
        build_dynamic_sd_schedule_lookup([list(e) for e in schedule], 64, 3)
    except ValueError:
        return True
    return False


def _appliance_refuses(schedule) -> bool:
    return validate.schedule_problem(tuple(tuple(e) for e in schedule)) is not None


@hypothesis.settings(max_examples=300)
@hypothesis.given(st.one_of(st.lists(_ENTRIES, min_size=1, max_size=4), _SHAPES))
def test_the_schedule_is_refused_exactly_where_vllms_scheduler_refuses_it(vllm_serve, schedule):
    assert _appliance_refuses(schedule) == _vllm_refuses(schedule), schedule


@st.composite
def _valid_schedules(draw):
    """Ranges from batch size 1, with gaps and a tail past 64 or short of it, in any order."""
    starts = [1, *sorted(draw(st.lists(st.integers(2, 70), max_size=3, unique=True)))]
    ends = [*(s - 1 for s in starts[1:]), 80]
    entries = [(s, draw(st.integers(s, e)), draw(st.integers(0, 5))) for s, e in zip(starts, ends)]
    return draw(st.permutations(entries))


@hypothesis.settings(max_examples=200)
@hypothesis.given(_valid_schedules(), st.integers(1, 4))
def test_tunes_k_per_batch_size_is_the_lookup_vllms_scheduler_builds(vllm_serve, schedule, k):
    """``appliance tune --verify`` reads each level against the k vLLM's scheduler drafts there
    (vllm/v1/core/sched/scheduler.py: ``dynamic_sd_lookup[batch size]`` every step)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    assert not _appliance_refuses(schedule)
    lookup = build_dynamic_sd_schedule_lookup([list(e) for e in schedule], 64, k)
    assert [tune.k_at(tuple(schedule), k, b) for b in range(1, 65)] == lookup[1:]


@pytest.mark.parametrize(
    "schedule",
    [
        [[1, 4, 2], [5, 64, 1]],  # what tune writes
        [[5, 64, 1], [1, 4, 2]],  # unsorted: vLLM sorts
        [[1, 2, 3], [9, 16, 1]],  # a gap: vLLM carries 3 through 3..8
        [[1, 1, 3], [2, 64, 0]],  # k = 0: no drafting from 2 on
    ],
)
def test_a_profile_with_a_schedule_reaches_vllms_config(vllm_serve, schedule):
    prof = profiles.get("l4x4-31b-mtp")
    spec = dataclasses.replace(
        prof.speculative,
        num_speculative_tokens_per_batch_size=tuple(tuple(e) for e in schedule),
    )
    prof = dataclasses.replace(prof, speculative=spec)
    assert "speculative-schedule" not in {f.code for f in validate.errors(validate.check(prof))}
    (argv,) = _argvs(prof).values()
    ea = vllm_serve.parse(argv)[1]
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert ea.speculative_config["num_speculative_tokens_per_batch_size"] == schedule
    assert vllm_serve.speculative_problems(config) == []
    assert not _vllm_refuses(schedule)


@pytest.mark.parametrize(
    "schedule, why",
    [
        ([[2, 64, 1]], "must start at 1"),
        ([[1, 8, 2], [8, 64, 1]], "overlap"),
        ([[1, 8]], "not 3 numbers"),
        ([[1, 8, -1]], "k must be >= 0"),
        ([[4, 1, 2]], "starts after it ends"),
    ],
)
def test_a_schedule_vllm_refuses_is_a_validation_error(vllm_serve, schedule, why):
    assert _vllm_refuses(schedule)
    prof = profiles.get("cpu-tiny-mtp")
    spec = dataclasses.replace(
        prof.speculative,
        num_speculative_tokens_per_batch_size=tuple(tuple(e) for e in schedule),
    )
    (finding,) = [
        f
        for f in validate.check(dataclasses.replace(prof, speculative=spec))
        if f.code == "speculative-schedule"
    ]
    assert finding.level == "error" and why in finding.message
    # The field's type is vLLM's too: a schedule of pairs fails its pydantic check there.
    if any(len(e) != 3 for e in schedule):
        assert vllm_serve.speculative_problems({"num_speculative_tokens_per_batch_size": schedule})
