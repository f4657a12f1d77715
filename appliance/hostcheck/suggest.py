"""``appliance profiles suggest``: the shipped profiles that fit this host's GPUs, best first.

nvidia-smi says what the host has (:mod:`.nvidia`); each GPU profile is asked what ``host
check`` asks of the GPUs (:func:`.nvidia.gpu_findings`: count, memory, compute capability,
driver), and then whether its weights, drafter and KV cache fit the memory nvidia-smi reports
(:func:`appliance.profiles.validate.estimated_fit`; the GB10 reports none: the table's figure).
Where nvidia-smi does not say the compute capability, the table's figure for the GPU it names
stands in. Best first: the profiles made for this GPU, then the larger Gemma 4 size, a seed
host's measured profile, MTP, the precision nearer the trained weights, the longer context, the
more sequences; each fitting one's line ends with its memory fit and what it leaves to spare.
``host check`` without a profile and ``install`` of a new instance without one take the first
and say so.

Each fitting profile is judged on the devices of its kind (:func:`.nvidia.choose`, a mixed host
per kind, MIG slices as slices) and says how many instances of it those hold: the packing (on
8x H100, four of ``h100x2-31b-mtp`` or eight of ``h100-31b-mtp``). Where an MTP profile fits
more than once, the same devices as one data-parallel instance follow it (``NAME-dpN``:
``--data-parallel-size N``, one endpoint, one unit): vLLM 0.32 runs a dense Gemma 4's ranks as
independent engines behind one API server, each exactly its one-instance MTP engine, so the
memory per GPU is NAME's (adr/0022). Not for a mixture of experts (26B-A4B), whose experts vLLM
shards over every rank's GPUs, nor for MIG slices: the text says so in a note.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .. import profiles
from ..errors import UsageError
from ..profiles import Profile, all_profiles, catalog
from ..profiles import validate as pv
from .nvidia import Device, Gpu, Query, choose, gpu_findings, query

HOW = "appliance profiles suggest"


@dataclass(frozen=True)
class Candidate:
    """One shipped GPU profile on this host: whether it fits, and why in one line; where it
    fits, how many instances of it the host's devices of its kind hold (its packing)."""

    name: str
    fits: bool
    why: str
    rank: tuple = ()
    instances: int = 0
    devices: tuple[str, ...] = ()  # the first instance's device set (docker --gpus device=)

    def line(self) -> str:
        return f"{self.name}: {self.why}"


@dataclass(frozen=True)
class Suggestion:
    """What nvidia-smi found, the profiles that fit (best first) and the others with why."""

    query: Query
    gpu: catalog.Gpu | None  # the table's GPU of the best's kind (None: not in the table)
    fitting: tuple[Candidate, ...] = ()
    others: tuple[Candidate, ...] = field(default=())
    notes: tuple[str, ...] = ()  # why a fitting profile has no data-parallel form here

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return self.query.gpus

    @property
    def best(self) -> str | None:
        return self.fitting[0].name if self.fitting else None

    def host(self) -> str:
        return self.query.host()

    def text(self) -> str:
        lines = [f"GPUs: {self.host()}"]
        if self.fitting:
            lines.append(f"fit, best first ({len(self.fitting)}):")
            lines += [f"  {c.line()}" for c in self.fitting]
        else:
            lines.append("no shipped profile fits these GPUs")
        lines.append(f"do not fit ({len(self.others)}):")
        lines += [f"  {c.line()}" for c in self.others]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "gpus": [dataclasses.asdict(g) for g in self.gpus],
            "slices": [dataclasses.asdict(s) for s in self.query.slices],
            "gpu": self.gpu.key if self.gpu else None,
            "best": self.best,
            "fitting": [
                {
                    "name": c.name,
                    "why": c.why,
                    "instances": c.instances,
                    "devices": list(c.devices),
                }
                for c in self.fitting
            ],
            "others": [{"name": c.name, "why": c.why} for c in self.others],
            "notes": list(self.notes),
        }


def _host_gpus(q: Query) -> tuple[Gpu, ...]:
    if q.missing or q.error is not None or not q.gpus:
        raise UsageError(
            f"no NVIDIA GPU here to suggest a profile for ({q.error or 'nvidia-smi lists none'})",
            fix="give the profile: --profile NAME (appliance profiles list)",
        )
    return q.gpus


def _memory_gib(devices: tuple[Device, ...], host: catalog.Gpu | None) -> float | None:
    """The smallest device's memory as nvidia-smi reports it (a slice: its profile's); the
    table's figure for a GPU whose memory it does not report (the GB10's unified memory)."""
    sizes = [d.memory_mib for d in devices]
    if sizes and None not in sizes:
        return min(sizes) / 1024
    return host.memory_gib if host is not None else None


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def candidate(prof: Profile, q: Query) -> Candidate:
    """Whether shipped profile ``prof`` fits the devices of ``q`` it would get (of its kind:
    :func:`.nvidia.choose`, what ``host check --profile`` judges), and why, in one line."""
    hw = prof.hardware
    if prof.multinode is not None:
        return Candidate(prof.name, False, f"spans {prof.multinode.nodes} hosts (a group)")
    blockers = [f for f in gpu_findings(prof, q) if f.status == "blocker"]
    if blockers:
        return Candidate(prof.name, False, f"{blockers[0].name}: {blockers[0].message}")
    kind, used = choose(prof, q)
    host = catalog.identify(kind[0].name)
    told = [d.compute_cap for d in used]
    # Where nvidia-smi did not say (an older driver's columns): the table's figure for the GPU.
    if (
        hw.compute_capability
        and None in told
        and host is not None
        and _capability(host.capability) < _capability(hw.compute_capability)
    ):
        return Candidate(
            prof.name,
            False,
            f"needs compute capability {hw.compute_capability}, the {host.name} has "
            f"{host.capability}",
        )
    estimate = pv.estimated_fit(prof, _memory_gib(used, host), kind[0].name)
    if estimate is not None and not estimate.fits:
        return Candidate(prof.name, False, f"does not fit this memory: {estimate.line()}")
    made = catalog.gpu_of(hw.gpu_name, hw.gpu_memory_gib)
    mine = host is not None and made is not None and made.key == host.key
    known = catalog.of_profile(prof.model, prof.drafter_matches, prof.quantization)
    size = known[0].size_rank if known else 0
    precision = known[1].precision_rank if known else 0
    rank = (
        mine,
        size,
        prof.provenance.startswith("measured"),  # a seed host's, measured there
        prof.mtp,  # the appliance's reason to be, before the precision (a baseline is last)
        precision,
        prof.max_model_len or 0,
        prof.max_num_seqs or 1,
    )
    need = max(hw.gpus, 1)
    instances = len(kind) // need
    each = f"{need} MIG {hw.mig_profile} slice" if hw.mig else f"{need} GPU(s)"
    uses = f"{instances} instance(s) of {each} on {len(kind)} {kind[0].kind}"
    made_for = "" if mine else f", made for {hw.gpu_name or 'any GPU'}"
    fit = f"; {estimate.line()}" if estimate is not None else ""
    refs = tuple(d.ref for d in used)
    if prof.data_parallel_size > 1:
        per = need // prof.data_parallel_size
        uses += (
            f"; each rank a whole copy on {per} GPU(s), an independent engine behind one API "
            "server: adr/0022"
        )
    why = f"{prof.description} ({uses}{made_for}){fit}"
    return Candidate(prof.name, True, why, rank, instances, refs)


def _data_parallel(c: Candidate, prof: Profile, q: Query) -> tuple[Candidate | None, str | None]:
    """The one data-parallel instance of fitting ``prof`` on the devices its ``c.instances``
    would take; or why it has none (None, None: not asked: it fits once, is not MTP, or was made
    for another GPU)."""
    made_here = bool(c.rank and c.rank[0])
    if c.instances < 2 or not prof.mtp or not made_here or prof.name not in all_profiles():
        return None, None
    why = profiles.data_parallel_refusal(prof)
    if why is not None:
        return None, why
    dp = candidate(profiles.data_parallel(prof.name, c.instances), q)
    return (dp if dp.fits else None), None


def suggest(q: Query | None = None, shipped: dict[str, Profile] | None = None) -> Suggestion:
    """The shipped GPU profiles that fit this host (nvidia-smi, or ``q``), best first: each
    judged on the devices of its kind (a mixed host per kind, MIG slices as slices)."""
    q = q if q is not None else query()
    _host_gpus(q)
    by_name = shipped or all_profiles()
    found = [candidate(p, q) for p in by_name.values() if p.hardware.device == "cuda"]
    fitting, refused = [], {}
    # Each data-parallel form right after its profile: the same devices, one endpoint.
    for c in sorted((c for c in found if c.fits), key=lambda c: c.rank, reverse=True):
        dp, why = _data_parallel(c, by_name[c.name], q)
        fitting += [c] if dp is None else [c, dp]
        if why is not None:
            refused.setdefault(why, []).append(c.name)
    notes = [f"no data-parallel form of {', '.join(n)}: {why}" for why, n in refused.items()]
    others = sorted((c for c in found if not c.fits), key=lambda c: c.name)
    host = None
    if fitting:
        kind, _ = choose(by_name[fitting[0].name], q)
        host = catalog.identify(kind[0].name)
    elif q.devices:
        host = catalog.identify(q.devices[0].name)
    return Suggestion(q, host, tuple(fitting), tuple(others), tuple(notes))


def best(q: Query | None = None) -> tuple[str, str]:
    """The best profile for this host and the line that says it was chosen; a UsageError when
    there is no GPU or nothing fits."""
    s = suggest(q)
    if s.best is None:
        raise UsageError(
            f"no shipped profile fits {s.host()}",
            fix=f"`{HOW}` says why for each; give --profile with a profile of yours",
        )
    return s.best, f"no --profile: the suggested profile for {s.host()} is {s.best} ({HOW})"
