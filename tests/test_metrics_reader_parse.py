"""The parse of a page whose lines were seen before (specdecode.parse_seen: each looked up whole,
issue 56 §2), as the reader uses it: the same Reading as specdecode.parse_with on every page,
read once and again, and the same typed error where parse_with refuses one."""

from __future__ import annotations

import pytest
from hypothesis import given
from test_specdecode_parse import CAPTURES, TOTALS, pages

from appliance.engine_api import metrics_reader
from appliance.engine_api import specdecode as sd


def _reading(text: str) -> tuple:
    r = metrics_reader.parse(200, text.encode())
    return r.snapshot, (r.generation_tokens, r.finished_requests)


def _twice(text: str) -> tuple:
    """The page read with its lines unseen, then seen: both must equal parse_with's."""
    sd._SEEN.clear()
    first = _reading(text)
    assert _reading(text) == first
    return first


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_real_captures_read_as_parse_with_reads_them(path):
    text = path.read_text()
    assert _twice(text) == sd.parse_with(text, TOTALS)
    assert sd.parse_seen(text, TOTALS) is not None  # read by the lookup, not handed on


@given(pages())
def test_generated_pages_read_as_parse_with_reads_them(page):
    assert _twice(page) == sd.parse_with(page, TOTALS)


HEAD = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"


@pytest.mark.parametrize(
    "lines",
    [
        # A timestamp after the value, a line without labels, "}" without "{", an escape.
        ['vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3 1700000000000'],
        ["vllm:generation_tokens_total 7", "vllm:request_success_total 2"],
        ["vllm:num_requests_running} 5", 'vllm:spec_decode_num_drafts_total{engine="0"} 4'],
        ['vllm:spec_decode_num_drafts_total{engine="0",model_name="a\\"b"} 4'],
        # The same label set twice (the last one counts), and a series the snapshot skips.
        [
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3',
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5',
            'vllm:cache_config_info{engine="0",x="}"} 1',
        ],
        # Positions out of order and sums over label sets.
        [
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 1',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 3',
            'vllm:generation_tokens_total{engine="0"} 7',
            'vllm:generation_tokens_total{engine="1"} 8',
            'vllm:num_requests_running{engine="1"} 2',
        ],
    ],
)
def test_lines_the_lookup_leaves_to_parse_with_read_as_parse_with_reads_them(lines):
    page = HEAD + "\n".join(lines) + "\n"
    assert _twice(page) == sd.parse_with(page, TOTALS)


@pytest.mark.parametrize(
    "line",
    [
        'vllm:spec_decode_num_drafts_total{engine="0"} x',
        'vllm:spec_decode_num_drafts_total{engine="0"}',
        "vllm:spec_decode_num_drafts_total{engine} 3",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="a"} 3',
        'vllm:generation_tokens_total{engine="0"} three',
    ],
)
def test_a_line_parse_with_refuses_is_refused_seen_or_not(line):
    good = 'vllm:spec_decode_num_drafts_total{engine="0"} 3\n'
    _twice(HEAD + good)  # the good line seen before
    for page in (HEAD + line + "\n", HEAD + good + line + "\n"):
        with pytest.raises(sd.MetricsParseError):
            sd.parse_with(page, TOTALS)
        with pytest.raises(metrics_reader.MetricsReadError) as err:
            metrics_reader.parse(200, page.encode())
        assert err.value.kind == "parse"


def test_a_page_without_the_running_gauge_is_not_vllms():
    page = 'vllm:spec_decode_num_drafts_total{engine="0"} 3\n'
    with pytest.raises(metrics_reader.MetricsReadError) as err:
        _reading(page)
    assert err.value.kind == "parse"
