"""Serving profiles: named, typed records that turn into the exact ``vllm serve`` arguments.

Profiles ship as TOML files in ``appliance/profiles/data``. A profile never guesses: every flag
it passes is a field here, so ``appliance profiles show PROFILE`` prints the whole command and a
reviewer can diff two hosts' profiles field by field.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated

import pydantic

from .. import records
from ..engine_api import versions
from ..errors import UsageError
from ..host.layout import Layout
from ..host.values import HOST_PATTERN

# Placeholder for the tiny dev model directory in CPU profiles; filled in at serve time.
DEVMODEL = "{devmodel}"

# A driver version as nvidia-smi prints it ("575.51.03"), or empty (not stated).
DriverVersion = Annotated[str, pydantic.StringConstraints(pattern=r"^(\d+(\.\d+)*)?$")]

# The engine's queue bound (vLLM's --max-num-queued-reqs, in vLLM since 0.29, PR #49445) counts
# requests in flight, running and waiting (vllm/config/scheduler.py, max_num_queued_reqs). Twice
# max_num_seqs: a full batch running and one more waiting, so a request that is let in waits at
# most about one request's time; past it vLLM answers 503 at once (gotchas/queue-bound.md).
QUEUE_PER_SEQUENCE = 2

# The range of every bounded field: a value outside it is one line naming the field and the
# range (records.Rule). `profiles validate`, `install` and every other reader build profiles
# through this record, so they refuse the same values with the same words.
PROFILE_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # safe in a path, a unit and a shell word
Name = records.ranged(
    str,
    "letters, digits and '._-' (at most 64), starting with a letter or digit",
    pattern=f"^{PROFILE_NAME}$",
)
# Upper bounds far beyond any host, so a typo (an extra digit, 1e26) is refused when the file is
# read, naming the field, not when vLLM allocates for it after the model load.
Sequences = records.ranged(int, "within 1..4096", ge=1, le=4096)
Tokens = records.ranged(int, "within 1..1048576", ge=1, le=1 << 20)
Queued = records.ranged(int, "within 1..65536", ge=1, le=65536)
Parallel = records.ranged(int, "within 1..64", ge=1, le=64)
Gpus = records.ranged(int, "within 0..64", ge=0, le=64)
Gib = records.ranged(float, "within 0..16384", ge=0, le=16384)
SpecTokens = records.ranged(int, "within 1..64", ge=1, le=64)
# vLLM's request seed is an int64 (vllm/entrypoints/openai/chat_completion/protocol.py: seed).
Seed = records.ranged(int, "within 0..2**63-1", ge=0, le=2**63 - 1)
Port = records.ranged(int, "within 1..65535", ge=1, le=65535)
Share = records.ranged(float, "within 0..1", ge=0, le=1)  # the canary's thresholds' range
Utilisation = records.ranged(float, "above 0 and at most 1", gt=0, le=1)
Host = records.ranged(str, "an IP address or host name", pattern=f"^(?:{HOST_PATTERN})$")
Version = records.ranged(str, "a version such as 0.32.0", pattern=r"^\d+(\.\d+){1,3}$")
Capability = records.ranged(
    str, "a compute capability such as 8.9, or empty", pattern=r"^(\d+\.\d+)?$"
)
# vLLM's ModelDType (vllm/config/model.py) and --per-request-spec-decode-metrics choices.
Dtype = records.one_of("auto", "half", "float16", "bfloat16", "float", "float32")
PerRequestMetrics = records.one_of("none", "summary", "detailed")


@dataclass(frozen=True)
class Speculative:
    """The ``--speculative-config`` of a profile."""

    method: str = "mtp"
    model: str = ""
    num_speculative_tokens: SpecTokens = 2
    revision: str | None = None  # the drafter's pinned hub revision (a commit), when pinned
    # vLLM's dynamic speculative decoding: ``(first batch size, last batch size, k)`` ranges,
    # k capped at num_speculative_tokens (``appliance bench tune`` writes it; the validator checks
    # it as vLLM's scheduler does). TOML gives arrays; they are kept as tuples (hashable, frozen).
    num_speculative_tokens_per_batch_size: tuple[tuple[int, ...], ...] | None = None

    def to_json(self, devmodel: str | None = None) -> str:
        body: dict = {
            "method": self.method,
            "model": _fill(self.model, devmodel),
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.num_speculative_tokens_per_batch_size is not None:
            body["num_speculative_tokens_per_batch_size"] = [
                list(entry) for entry in self.num_speculative_tokens_per_batch_size
            ]
        return json.dumps(body, separators=(",", ":"))


@dataclass(frozen=True)
class Hardware:
    """What the host must have for this profile."""

    device: records.one_of("cuda", "cpu") = "cuda"
    gpus: Gpus = 0
    gpu_name: str = ""
    gpu_memory_gib: Gib = 0.0
    compute_capability: Capability = ""  # e.g. "8.9" for the L4
    mig: bool = False  # one unit instance per MIG slice, each given its own device
    mig_profile: str = ""  # e.g. "1g.24gb"
    # The oldest NVIDIA driver the profile's image runs on ("575.51.03"; empty: not stated).
    # `appliance host check` refuses an older one before install (appliance/hostcheck).
    min_driver: DriverVersion = ""


@dataclass(frozen=True)
class Canary:
    """The optional ``[canary]`` table: whether a cutover runs the output canary, its thresholds
    and run settings, an operator's JSONL (``prompts``; a relative path is under
    ``/etc/gemma4-vllm``) that extends the shipped set, or replaces it (``replace``), and whether
    it also runs the set batched (every case at once, judged against the answers alone)."""

    enabled: bool = False
    min_parity: Share = 1.0
    max_pass_rate_drop: Share = 0.0
    max_acceptance_drop: Share = 0.1
    max_tokens: Tokens = 64
    seed: Seed = 0
    prompts: str = ""
    replace: bool = False
    batched: bool = False


@dataclass(frozen=True)
class Multinode:
    """The optional ``[multinode]`` table: one model served across ``nodes`` hosts with vLLM's own
    multi-node (``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``, workers
    ``--headless``). ``master_addr``/``master_port``: the head's rendezvous address on the
    cluster network; ``nccl_socket_ifname``/``gloo_socket_ifname``: the cluster network's
    interface, exported on every node (``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``). Every
    node runs the group's one ``VLLM_IMAGE`` (appliance/multinode)."""

    nodes: records.ranged(int, "within 2..64 (drop [multinode] for one host)", ge=2, le=64) = 2
    master_addr: str = ""
    master_port: Port = 29500
    nccl_socket_ifname: str = ""
    gloo_socket_ifname: str = ""


@dataclass(frozen=True)
class Profile:
    """One serving configuration of Gemma 4 on vLLM."""

    name: Name
    description: str
    model: str
    served_model_name: str
    drafter_matches: str = ""  # target the drafter was trained for, when not ``model``
    revision: str | None = None  # the target's pinned hub revision (a commit), when pinned
    # Where the values come from: "measured: HOST" or "unverified: WHY" (a seed's shape that its
    # source never ran); empty: computed (appliance/profiles/fit.py). `profiles show` prints it.
    provenance: str = ""
    # Disk the target and drafter take in the Hugging Face cache, in GiB (0: not stated); the
    # host check compares it with the free space there.
    weights_gib: Gib = 0.0
    dtype: Dtype = "auto"
    tensor_parallel_size: Parallel = 1
    pipeline_parallel_size: Parallel = 1
    # Ranks of the whole model behind one endpoint (vLLM's --data-parallel-size), each on
    # tensor_parallel_size x pipeline_parallel_size GPUs (adr/0022; NAME-dpN derives one).
    data_parallel_size: Parallel = 1
    max_model_len: Tokens | None = None
    max_num_batched_tokens: Tokens | None = None
    max_num_seqs: Sequences | None = None
    # The queue bound, when not QUEUE_PER_SEQUENCE x max_num_seqs (see :attr:`queue_bound`).
    max_num_queued_reqs: Queued | None = None
    gpu_memory_utilization: Utilisation | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    enforce_eager: bool = False
    language_model_only: bool = False
    host: Host = "127.0.0.1"
    port: Port = 8000
    speculative: Speculative | None = None
    per_request_spec_decode_metrics: PerRequestMetrics | None = None  # vLLM >= 0.32
    min_vllm: Version = "0.19.0"
    hardware: Hardware = field(default_factory=Hardware)
    canary: Canary = field(default_factory=Canary)
    multinode: Multinode | None = None  # one model across several hosts (appliance/multinode)
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()

    @property
    def mtp(self) -> bool:
        """True when the profile asks for Gemma 4 MTP speculative decoding."""
        return self.speculative is not None and self.speculative.method == "mtp"

    @property
    def uses_devmodel(self) -> bool:
        return DEVMODEL in self.model

    @property
    def queue_bound(self) -> int | None:
        """Requests the engine holds at most, running and waiting, before it answers 503: the
        explicit ``max_num_queued_reqs``, else ``QUEUE_PER_SEQUENCE`` x ``max_num_seqs`` x the
        data-parallel ranks (the bound is the API server's, over every rank: ``check_admission``
        in vllm/v1/engine/async_llm.py); None (vLLM's unbounded queue) when the profile states
        neither, since vLLM's own ``max_num_seqs`` then depends on the device it finds."""
        if self.max_num_queued_reqs is not None:
            return self.max_num_queued_reqs
        if self.max_num_seqs is not None:
            return QUEUE_PER_SEQUENCE * self.max_num_seqs * self.data_parallel_size
        return None

    def serve_args(
        self,
        *,
        devmodel: str | Path | None = None,
        host: str | None = None,
        port: int | None = None,
        speculative: bool = True,
    ) -> list[str]:
        """The argument list after ``vllm serve`` (model first, then flags, in fixed order).

        ``speculative=False`` drops the MTP flags: what the serve program does on an image whose
        labels say it cannot run Gemma 4 MTP.
        """
        dm = str(devmodel) if devmodel is not None else None
        if self.uses_devmodel and dm is None:
            raise UsageError(f"profile {self.name} needs the tiny dev model directory")
        args = [_fill(self.model, dm), "--served-model-name", self.served_model_name]
        args += ["--host", host or self.host, "--port", str(port or self.port)]
        args += ["--dtype", self.dtype]
        if self.tensor_parallel_size != 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size != 1:
            args += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.data_parallel_size != 1:
            # One API server in front of every rank (vLLM's default is one per rank): the
            # process the stop gate, the drain and the key on stdin were built and tested on.
            args += [
                "--data-parallel-size",
                str(self.data_parallel_size),
                "--api-server-count",
                "1",
            ]
        for flag, value in (
            ("--max-model-len", self.max_model_len),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--gpu-memory-utilization", self.gpu_memory_utilization),
            ("--kv-cache-dtype", self.kv_cache_dtype),
            ("--quantization", self.quantization),
        ):
            if value is not None:
                args += [flag, str(value)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.language_model_only:
            args.append("--language-model-only")
        if speculative:
            args += self.speculative_args(devmodel=dm)
            args += self.per_request_metrics_args()
        args += list(self.extra_args)
        return args

    def speculative_args(self, *, devmodel: str | Path | None = None) -> list[str]:
        """The ``--speculative-config`` flag alone (empty without speculative decoding)."""
        if self.speculative is None:
            return []
        dm = str(devmodel) if devmodel is not None else None
        return ["--speculative-config", self.speculative.to_json(dm)]

    def queue_args(self) -> list[str]:
        """``--max-num-queued-reqs`` (vLLM >= 0.29) when the profile has a :attr:`queue_bound`.

        Apart from :meth:`serve_args`, like the MTP flags: an older vLLM refuses the flag, so the
        serve program passes it only to an image whose labelled vLLM has it."""
        bound = self.queue_bound
        return [] if bound is None else ["--max-num-queued-reqs", str(bound)]

    def per_request_metrics_args(self) -> list[str]:
        """``--per-request-spec-decode-metrics`` (vLLM >= 0.32), only with speculative decoding."""
        if self.speculative is None or not self.per_request_spec_decode_metrics:
            return []
        return ["--per-request-spec-decode-metrics", self.per_request_spec_decode_metrics]


def _fill(value: str, devmodel: str | None) -> str:
    return value.replace(DEVMODEL, devmodel) if devmodel is not None else value


_SCHEDULE = "num_speculative_tokens_per_batch_size"

_TABLES = {
    "speculative": Speculative,
    "hardware": Hardware,
    "canary": Canary,
    "multinode": Multinode,
}


def from_dict(data: dict, where: str = "profile") -> Profile:
    """Build a :class:`Profile` from parsed TOML; an unknown or missing field, or a value of
    the wrong type, is one UsageError naming the file, the table and the field."""
    data = dict(data)
    spec = data.get("speculative")
    schedule = spec.get(_SCHEDULE) if isinstance(spec, dict) else None
    if isinstance(schedule, list):
        # Arrays to tuples, as extra_args below: a wrong entry stays for the type check to name.
        data["speculative"] = {
            **spec,
            _SCHEDULE: tuple(tuple(e) if isinstance(e, list) else e for e in schedule),
        }
    for key, cls in _TABLES.items():
        if key in data:
            data[key] = records.build(cls, data[key], f"{where} [{key}]")
    if isinstance(data.get("extra_args"), list):
        data["extra_args"] = tuple(data["extra_args"])
    return records.build(Profile, data, where)


def load_file(path: Path | str) -> Profile:
    """Load one profile from a TOML file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read profile {path}: {exc}") from exc
    return from_dict(data, where=str(path.name))


# Hand-made profiles (the CPU ones, MIG, multi-node) and the ones `appliance dev generate` writes
# from the table (appliance/profiles/catalog.py): both ship, a name in one folder only.
FOLDERS = ("data", "generated")


@functools.cache
def _shipped() -> dict[str, tuple[Profile, str, str]]:
    """Every shipped profile, its TOML text and its folder, by name."""
    out: dict[str, tuple[Profile, str, str]] = {}
    for folder in FOLDERS:
        entries = resources.files(__package__).joinpath(folder)
        for entry in sorted(entries.iterdir(), key=str):
            if not entry.name.endswith(".toml"):
                continue
            text = entry.read_text()
            prof = from_dict(tomllib.loads(text), where=f"{folder}/{entry.name}")
            if prof.name in out:
                raise UsageError(f"profile {prof.name} ships twice ({out[prof.name][2]}, {folder})")
            out[prof.name] = (prof, text, folder)
    return out


def reload() -> None:
    """Read the shipped profiles again (after ``appliance dev generate`` rewrote some)."""
    _shipped.cache_clear()


def all_profiles() -> dict[str, Profile]:
    """Every shipped profile, by name."""
    return {name: prof for name, (prof, _, _) in _shipped().items()}


def examples() -> dict[str, Profile]:
    """The shipped profiles whose units are committed as reviewed examples (systemd/): the
    hand-made ones and the seed hosts' generated ones (the other generated profiles differ
    from those in figures only)."""
    from .generated import reference_names

    keep = reference_names()
    return {
        name: prof
        for name, (prof, _, folder) in _shipped().items()
        if folder == "data" or name in keep
    }


def shipped_text(name: str) -> str:
    """The TOML text of shipped profile ``name`` (a copy to edit keeps its comments)."""
    get(name)  # an unknown name: the usage error listing the known ones
    if name not in _shipped():
        return _data_parallel_text(name)
    return _shipped()[name][1]


# --- one data-parallel instance of a shipped profile (adr/0022) --------------------------------

# NAME-dpN: shipped profile NAME run as N data-parallel ranks behind one endpoint.
DATA_PARALLEL = re.compile(r"^(?P<base>.+)-dp(?P<ranks>[1-9][0-9]*)$")
# The release whose source was read for Gemma 4 MTP under data parallel (adr/0022).
DATA_PARALLEL_MIN_VLLM = "0.32.0"


def data_parallel_refusal(base: Profile) -> str | None:
    """Why ``base`` has no data-parallel form (None: ``NAME-dpN`` derives one)."""
    from . import catalog

    hw = base.hardware
    if hw.device != "cuda":
        return f"{base.name} runs on the {hw.device} engine, one engine per instance"
    if hw.mig:
        return f"{base.name} is a MIG profile: one instance per slice"
    if base.multinode is not None:
        return f"{base.name} spreads one model over {base.multinode.nodes} hosts"
    if base.data_parallel_size != 1:
        return f"{base.name} is data-parallel already"
    known = catalog.of_profile(base.model, base.drafter_matches, base.quantization)
    if known is None:
        return f"the table does not know {base.model}: no fit to give each rank"
    if known[0].moe:
        return (
            f"Gemma 4 {known[0].label} is a mixture of experts: under data parallel vLLM shards "
            "its experts over every rank's GPUs and steps the ranks together, which the fit "
            "does not count (adr/0022)"
        )
    return None


def _data_parallel_text(name: str) -> str:
    """The TOML of ``NAME-dpN``: shipped NAME's, comments kept, with N ranks on N x its GPUs."""
    import tomlkit

    found = DATA_PARALLEL.match(name)
    assert found is not None, name
    base, ranks = _shipped()[found["base"]][0], int(found["ranks"])
    doc = tomlkit.parse(_shipped()[base.name][1])
    doc["name"] = name
    doc["description"] = f"{base.description}; {ranks} data-parallel ranks, one endpoint"
    doc["provenance"] = (
        f"derived: {ranks} data-parallel ranks of {base.name} ({base.provenance or 'computed'}); "
        "data parallel not measured on any host here"
    )
    doc["data_parallel_size"] = ranks
    if versions.older(base.min_vllm, DATA_PARALLEL_MIN_VLLM):
        doc["min_vllm"] = DATA_PARALLEL_MIN_VLLM
    doc["hardware"]["gpus"] = base.hardware.gpus * ranks
    head = (
        f"# {name}: {base.name} as {ranks} data-parallel ranks behind one endpoint, derived by\n"
        "# appliance/profiles (adr/0022): each rank holds the whole model on its own GPUs, with\n"
        f"# {base.name}'s memory per GPU; vLLM spreads the requests over the ranks.\n"
    )
    return head + tomlkit.dumps(doc)


def data_parallel(base: str, ranks: int) -> Profile:
    """Shipped profile ``base`` as ``ranks`` data-parallel ranks behind one endpoint
    (``BASE-dpRANKS``); a UsageError where it has no such form."""
    name = f"{base}-dp{ranks}"
    shipped = _shipped()
    if base not in shipped:
        get(base)  # the unknown-profile error, with close matches
    why = data_parallel_refusal(shipped[base][0])
    if why is not None:
        raise UsageError(
            f"no profile {name}: {why}", fix=f"use {base}, one instance per device set"
        )
    gpus = shipped[base][0].hardware.gpus * ranks
    if ranks < 2 or gpus > 64:
        raise UsageError(
            f"no profile {name}: {ranks} rank(s) of {shipped[base][0].hardware.gpus} GPU(s)",
            fix="2 ranks or more, 64 GPUs at most",
        )
    return from_dict(tomllib.loads(_data_parallel_text(name)), where=name)


def is_file_ref(value: str) -> bool:
    """Whether a ``--profile`` value names a TOML file of the operator's, not a shipped
    profile (shipped names have no ``/`` and no ``.toml``)."""
    return "/" in value or value.endswith(".toml")


def lookup(value: str) -> Profile:
    """A shipped profile by name, or the operator's profile file ``value`` names."""
    return load_file(value) if is_file_ref(value) else get(value)


def operators_file(path: Path | str) -> tuple[Profile, bytes]:
    """An operator's profile file to install: read once (the bytes installed are the bytes
    checked), its name not a shipped one's (which of the two would a name mean?)."""
    path = Path(path)
    try:
        data = path.read_bytes()
        parsed = tomllib.loads(data.decode())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read profile {path}: {exc}") from exc
    prof = from_dict(parsed, where=str(path))
    if prof.name in all_profiles():
        raise UsageError(
            f"{path}: name {prof.name!r} is the name of a shipped profile",
            fix='give your profile its own name (name = "...") in the file',
        )
    return prof, data


def installed(root: Path | str, instance: str, name: str) -> Profile:
    """The profile instance ``instance`` serves, by the name its env file gives: the operator's
    copy installed next to it (``ENV_DIR/INSTANCE.profile.toml``) when there is one, else the
    shipped profile of that name."""
    copy = Layout(Path(root)).profile_copy(instance)
    if not copy.exists():
        return get(name)
    prof = load_file(copy)
    if prof.name != name:
        raise UsageError(
            f"{copy} is profile {prof.name!r}, the env file names {name!r}",
            fix=f"re-run appliance instance install {instance} --profile with the one you mean",
        )
    return prof


def get(name: str) -> Profile:
    """A shipped profile by name; an unknown name is a usage error naming the closest ones
    (``appliance profiles list`` lists them all)."""
    profiles = all_profiles()
    if name not in profiles and (dp := DATA_PARALLEL.match(name)) and dp["base"] in profiles:
        return data_parallel(dp["base"], int(dp["ranks"]))
    if name not in profiles:
        close = difflib.get_close_matches(name, sorted(profiles), n=3, cutoff=0.6)
        near = f"did you mean {', '.join(close)}? " if close else ""
        raise UsageError(
            f"unknown profile {name!r}",
            fix=f"{near}`appliance profiles list` lists the shipped ones; a file of yours: "
            "--profile PATH.toml",
        )
    return profiles[name]
