"""The source series the dashboards and rules read, by name, in one place.

vLLM names come from a real vLLM 0.32 ``/metrics`` page (tests/data/metrics-vllm-0.32-mtp.txt);
the agent's come from the metric contract (appliance/agent/metrics.py registers them); the
appliance state metrics from :mod:`appliance.observability.state_metrics`. The tests check each one
exists.
"""

from __future__ import annotations

from .promql import Selector

# vLLM engine (labels: engine, model_name; instance/job added by the scrape).
DRAFTS = Selector("vllm:spec_decode_num_drafts_total")
DRAFT_TOKENS = Selector("vllm:spec_decode_num_draft_tokens_total")
ACCEPTED = Selector("vllm:spec_decode_num_accepted_tokens_total")
ACCEPTED_PER_POS = Selector("vllm:spec_decode_num_accepted_tokens_per_pos_total")
GENERATION_TOKENS = Selector("vllm:generation_tokens_total")
TTFT = Selector("vllm:time_to_first_token_seconds")
TPOT = Selector("vllm:request_time_per_output_token_seconds")
ITL = Selector("vllm:inter_token_latency_seconds")
E2E = Selector("vllm:e2e_request_latency_seconds")
RUNNING = Selector("vllm:num_requests_running")
WAITING = Selector("vllm:num_requests_waiting")
KV_CACHE = Selector("vllm:kv_cache_usage_perc")  # a fraction 0..1 despite the name
REQUEST_SUCCESS = Selector("vllm:request_success_total")  # label finished_reason
# Requests turned away with 503 at the queue bound (vLLM >= 0.29; labels model_name, reason).
ADMISSION_REJECTIONS = Selector("vllm:admission_rejections_total")

# The MTP telemetry agent (labels: role, model; calls also source, outcome; errors kind).
AGENT_ACCEPTANCE = Selector("gemma4_agent_call_acceptance")
AGENT_TOKENS_PER_STEP = Selector("gemma4_agent_call_tokens_per_step")
AGENT_DRAFTED = Selector("gemma4_agent_drafted_tokens_total")
AGENT_ACCEPTED = Selector("gemma4_agent_accepted_tokens_total")
AGENT_CALLS = Selector("gemma4_agent_calls_total")
AGENT_DURATION = Selector("gemma4_agent_call_duration_seconds")
AGENT_ERRORS = Selector("gemma4_agent_errors_total")

# Appliance state (textfile collector; labels as in appliance.observability.state_metrics).
IMAGE_INFO = Selector("gemma4_appliance_image_info")
CUTOVER_EVENTS = Selector("gemma4_appliance_cutover_events_total")
LAST_CUTOVER = Selector("gemma4_appliance_last_cutover_timestamp_seconds")
LAST_CANARY = Selector("gemma4_appliance_last_canary_timestamp_seconds")
UNIT_STATE = Selector("gemma4_appliance_unit_state")
ACCEPTANCE_BASELINE = Selector("gemma4_appliance_acceptance_baseline")
ENV_FILE_READABLE = Selector("gemma4_appliance_env_file_readable")

# node_exporter's textfile collector (collector/textfile.go): the mtime of each *.prom file it
# read, labelled `file` (the file's path; its base name in releases before 1.5).
TEXTFILE_MTIME = Selector("node_textfile_mtime_seconds")
# The textfile directory Debian's node_exporter has compiled in, where its
# prometheus-node-exporter-collectors write: the state textfile is linked into it, so that
# node_exporter serves both (before 1.9 it takes --collector.textfile.directory once).
DEBIAN_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
NODE_EXPORTER = frozenset({TEXTFILE_MTIME.metric})

# Series Prometheus makes itself for every target.
UP = Selector("up")
SYNTHETIC = frozenset({"up"})

# Scrape job names, shared by the scrape config and the alerts that select on them.
JOB_ENGINE = "vllm"
JOB_AGENT = "gemma4-agent"
JOB_STATE = "gemma4-appliance-state"
