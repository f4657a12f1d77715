"""The output canary: does the new image answer like the old one?

Speculative decoding is lossless in exact arithmetic, so at temperature 0 an MTP image should
say what its baseline said; a changed chat template, tokenizer, dtype, attention backend or vLLM
version can quietly change it. The canary runs a small fixed set greedily against one endpoint,
keeps every answer with its token ids, and later compares a second run against it.

One job per module: ``checks`` (exact / regex / JSON-shape checks), ``cases`` (the shipped set
and an operator's JSONL), ``record`` (run a set through ``VLLMClient.generate`` with token
ids, one at a time and, optionally, all at once; save and load records), ``compare`` (pass rate
and token parity under a policy, answers under batching against answers alone), ``policy`` (a
profile's ``[canary]`` table), ``gate`` (before/after for the cutover), ``baseline`` (an
instance's last passing record that drafted, for a cutover from an image without MTP).
"""

from __future__ import annotations

from .baseline import Baseline
from .cases import CanarySet, Case
from .compare import Batched, Comparison, Policy, batched, compare
from .gate import CanaryFailed, Result, after, before, judge, recorded
from .policy import Plan, plan
from .record import DEFAULT_WITHIN_S as DEFAULT_TIMEOUT
from .record import Record, Settings, load, run, save

__all__ = [
    "DEFAULT_TIMEOUT",
    "Baseline",
    "Batched",
    "CanaryFailed",
    "CanarySet",
    "Case",
    "Comparison",
    "Plan",
    "Policy",
    "Record",
    "Result",
    "Settings",
    "after",
    "batched",
    "before",
    "compare",
    "judge",
    "load",
    "plan",
    "recorded",
    "run",
    "save",
]
