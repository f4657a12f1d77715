"""How many sequences a profile runs at once, and why: ``profiles show`` prints the trade of
context for concurrent callers (appliance/profiles/validate.py ``sequences``), and the reference
``l4x4-31b-mtp`` keeps ``max_num_seqs = 1`` with its reason where an operator reads it (the
profile's own comment and provenance, ``profiles show``, INDEX.md; issue 54's decision).
"""

from __future__ import annotations

import json
import re

import pytest

from appliance import profiles
from appliance.profiles import validate as pv

REFERENCE = "l4x4-31b-mtp"


def test_the_reference_keeps_one_sequence_and_show_says_why(cli_run):
    res = cli_run(["profiles", "show", REFERENCE])
    argv = res.stdout.split()
    assert argv[argv.index("--max-num-seqs") + 1] == "1"
    assert argv[-2:] == ["--max-num-queued-reqs", "2"]
    lines = res.stderr.splitlines()
    assert (
        "sequences: max_num_seqs 1, queue bound 2; the fit holds at once 1 of 32768 tokens, 2 "
        "of 16384 tokens, 4 of 8192 tokens (full-length sequences)"
    ) in lines
    assert (
        "values measured: 4x L4, the seed ADR's production host (k=2, 4096 batched tokens, 32K, "
        "one stream at a time; vLLM 0.21); max_num_seqs 1, kept: one 32K sequence is what it "
        "holds (vLLM 0.21 counted 45,336 tokens of KV cache there, 1.38 of 32,768)"
    ) in lines
    body = json.loads(cli_run(["profiles", "show", REFERENCE, "--json"]).stdout)
    assert body["sequences"] == [
        {"max_model_len": 32768, "fit": 1},
        {"max_model_len": 16384, "fit": 2},
        {"max_model_len": 8192, "fit": 4},
    ]


def test_the_reference_profiles_comment_agrees_with_the_fit():
    """The profile's comment names the counts at 16K and 8K; the fit is what says them."""
    text = profiles.shipped_text(REFERENCE)
    said = re.search(r"how many fit at 16K and 8K \((\d+) and (\d+),", " ".join(text.split()))
    assert said is not None, text[:1500]
    counts = dict(pv.sequences(profiles.get(REFERENCE)))
    assert (int(said[1]), int(said[2])) == (counts[16384], counts[8192])
    # And the measured ratio it quotes: the ADR's KV cache over one 32K request.
    assert f"{45336 / 32768:.2f} of 32,768" in profiles.get(REFERENCE).provenance
    assert "max_num_seqs = 1, kept (issue 54)" in text
    index = (profiles.resources.files(profiles.__package__) / "generated/INDEX.md").read_text()
    assert "max_num_seqs 1, kept: one 32K sequence is what it holds" in index


@pytest.mark.parametrize("name", sorted(profiles.all_profiles()))
def test_every_profiles_stated_sequences_fit_at_its_full_context(name):
    prof = profiles.get(name)
    counts = pv.sequences(prof)
    if not counts or prof.max_num_seqs is None:
        return  # no fit known (CPU, a model the table lacks): nothing to hold it to
    (length, fit), *shorter = counts
    assert length == prof.max_model_len and fit >= prof.max_num_seqs, counts
    # A shorter context never holds fewer.
    assert all(k >= fit for _, k in shorter), counts
