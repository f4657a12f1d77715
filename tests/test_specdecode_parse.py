"""The narrow /metrics parse: the same readings as prometheus_client's parser, on real captures
and on generated pages (hypothesis), with the agent's totals summed in the same pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from appliance.engine_api import metrics_reader
from appliance.engine_api import specdecode as sd

DATA = Path(__file__).parent / "data"
CAPTURES = sorted(DATA.glob("metrics-vllm-*.txt"))
TOTALS = (metrics_reader.GENERATION_TOKENS + "_total", metrics_reader.REQUEST_SUCCESS + "_total")


def reference_totals(text: str) -> tuple[float | None, ...]:
    """The totals by prometheus_client's parser: each named sample's values summed."""
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in TOTALS:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return tuple(sums.get(name) for name in TOTALS)


def test_there_are_captures():
    assert len(CAPTURES) >= 4


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_real_captures_read_as_prometheus_client_reads_them(path):
    text = path.read_text()
    snap, totals = sd.parse_with(text, TOTALS)
    assert snap == sd.parse_exposition(text)
    assert snap.series  # the captures are MTP engines': not an empty reading
    assert totals == reference_totals(text)


def test_the_filtered_page_reads_as_the_whole_page():
    """What the engine sends for the reader's name[] filters, cut from the whole-page capture
    as prometheus_client's exposition does (whole families, HELP and TYPE lines kept)."""
    text = (DATA / "metrics-vllm-0.32-mtp.txt").read_text()
    wanted = {name.removesuffix("_total") for _, name in metrics_reader.PARAMS}
    kept, keep = [], False
    for line in text.splitlines():
        if line.startswith("# HELP "):
            keep = line.split(" ", 3)[2].removesuffix("_total") in wanted
        if keep:
            kept.append(line)
    filtered = "\n".join(kept) + "\n"
    assert len(filtered) < len(text) / 4
    assert sd.parse_with(filtered, TOTALS) == sd.parse_with(text, TOTALS)


def test_the_reader_returns_the_totals_of_the_page():
    text = (DATA / "metrics-vllm-0.32-mtp.txt").read_text()
    reading = metrics_reader.parse(200, text.encode())
    assert (reading.generation_tokens, reading.finished_requests) == reference_totals(text)
    assert reading.snapshot == sd.parse_exposition(text)


def test_escaped_label_values_are_read_by_the_full_parser():
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a\\"b,c}"} 1.0\n'
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a\\"b,c}"} 4.0\n'
    )
    snap, _ = sd.parse_with(page, TOTALS)
    assert snap == sd.parse_exposition(page)
    assert snap.series[('a"b,c}', "0")].drafts == 4.0


@pytest.mark.parametrize("name", [",", ",,", ",a", ", x", "a,", "a,b", "=", "}", "a=,b", " , "])
def test_label_values_with_commas_and_signs_read_as_prometheus_client_reads_them(name):
    """A value that opens with a comma puts '",' right after its own opening quote (a split on
    '",' took it for the end of the value before: hypothesis found model_name=",")."""
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{name}"}} 1.0\n'
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        f'vllm:spec_decode_num_drafts_total{{model_name="{name}", engine="0",}} 4.0\n'
    )
    snap, _ = sd.parse_with(page, TOTALS)
    assert snap == sd.parse_exposition(page)
    assert snap.series[(name, "0")].drafts == 4.0


@pytest.mark.parametrize(
    "line",
    [
        'vllm:spec_decode_num_drafts_total{engine="0" 3',
        'vllm:spec_decode_num_drafts_total{engine="0"} x',
        "vllm:spec_decode_num_drafts_total{engine} 3",
        "vllm:spec_decode_num_drafts_total",
        'vllm:generation_tokens_total{engine="0"} three',
    ],
)
def test_a_broken_sample_line_is_a_parse_error(line):
    page = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n" + line + "\n"
    with pytest.raises(sd.MetricsParseError):
        sd.parse_with(page, TOTALS)
    with pytest.raises(metrics_reader.MetricsReadError) as err:
        metrics_reader.parse(200, page.encode())
    assert err.value.kind == "parse"


FAMILIES = (
    (sd.DRAFTS, "counter"),
    (sd.DRAFT_TOKENS, "counter"),
    (sd.ACCEPTED, "counter"),
    (sd.ACCEPTED_PER_POS, "counter"),
    (sd.DRAFTS + "_created", "gauge"),
    (sd.RUNNING, "gauge"),
    (metrics_reader.GENERATION_TOKENS, "counter"),
    (metrics_reader.REQUEST_SUCCESS, "counter"),
    ("vllm:spec_decode_num_draft_tokens_created", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
)
# Printable ASCII and some letters beyond: prometheus_client's parser splits lines as
# str.splitlines does, on \x85 and the like too, which no engine writes unescaped.
label_value = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters='"\\')
    | st.sampled_from("éü/ß"),
    max_size=8,
)
value = st.one_of(
    st.integers(0, 10**9).map(float),
    st.floats(0, 1e12, allow_nan=False),
)


@st.composite
def pages(draw):
    lines = []
    for family, kind in draw(st.permutations(FAMILIES)):
        if not draw(st.booleans()) and family != sd.RUNNING:
            continue
        lines.append(f"# HELP {family} some help, with {{braces}} and 'quotes'")
        sample = family + "_total" if kind == "counter" else family
        lines.append(f"# TYPE {sample} {kind}")
        for _ in range(draw(st.integers(0, 3))):
            labels = {"engine": draw(st.sampled_from(["0", "1"])), "model_name": draw(label_value)}
            if family == sd.ACCEPTED_PER_POS:
                labels["position"] = str(draw(st.integers(0, 3)))
            if family == metrics_reader.REQUEST_SUCCESS:
                labels["finished_reason"] = draw(st.sampled_from(["stop", "length", "abort"]))
            pairs = [f'{k}="{v}"' for k, v in draw(st.permutations(list(labels.items())))]
            sep = draw(st.sampled_from([",", ", "]))
            lines.append(f"{sample}{{{sep.join(pairs)}}} {draw(value)!r}")
    return "\n".join(lines) + "\n"


@given(pages())
def test_generated_pages_read_as_prometheus_client_reads_them(page):
    snap, totals = sd.parse_with(page, TOTALS)
    assert snap == sd.parse_exposition(page)
    assert totals == reference_totals(page)
