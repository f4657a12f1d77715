#!/bin/bash
# The generation gate of a Gemma 4 model served across nodes (appliance/multinode): installed as
# /usr/local/libexec/gemma4-vllm/node, next to the serve script the head and worker units run.
#
#   node GROUP wait-generates  return once the head answers /health 200 AND one generation
#                              (the head unit's ExecStartPost)
#   node GROUP probe           one generation through the head; exit 1 when it fails
#                              (gemma4-vllm-probe@GROUP.service)
#
# Why generate: after a worker's death vLLM's head keeps answering /health 200 until a request
# fails (500, EngineDeadError); only then does its engine exit. /health alone cannot tell a
# head whose workers are gone from a healthy one.
#
# It reads VLLM_HOST and VLLM_PORT from the environment systemd loads from
# /etc/gemma4-vllm/GROUP.env, the served model name from GROUP-head.args (the record after
# `serve --served-model-name`), and the key from GROUP-head.api-key; none of it runs as code.
set -euo pipefail

readonly EX_CONFIG=78
GROUP=""

log() { printf '%s\n' "gemma4-vllm-node@${GROUP:-?}: $*" >&2; }
die_config() { log "$*"; exit "$EX_CONFIG"; }

usage() {
  printf 'usage: %s GROUP wait-generates|probe\n' "$0" >&2
  exit 2
}

read_config() {
  local kind value prev=""
  [[ "${VLLM_HOST:-}" =~ ^[A-Za-z0-9:][A-Za-z0-9.:-]*$ ]] || die_config "VLLM_HOST is not set or not an address"
  [[ "${VLLM_PORT:-}" =~ ^[1-9][0-9]{0,4}$ ]] || die_config "VLLM_PORT is not set or not a port"
  case "$VLLM_HOST" in
    0.0.0.0 | ::) HOST=127.0.0.1 ;;
    *) HOST="$VLLM_HOST" ;;
  esac
  MODEL=""
  [[ -r "$ARGS_FILE" ]] || die_config "cannot read $ARGS_FILE"
  while read -r kind value || [[ -n "$kind" ]]; do
    if [[ "$kind" == serve ]]; then
      if [[ "$prev" == --served-model-name ]]; then MODEL="$value"; fi
      prev="$value"
    fi
  done < "$ARGS_FILE"
  [[ "$MODEL" =~ ^[A-Za-z0-9._/:-]+$ ]] || die_config "$ARGS_FILE names no usable --served-model-name"
  KEY=""
  if [[ -e "$KEY_FILE" ]]; then
    KEY="$(<"$KEY_FILE")" || die_config "cannot read $KEY_FILE"
    KEY="${KEY//[[:space:]]/}"
    [[ "$KEY" =~ ^[A-Za-z0-9._~+/=-]+$ ]] || die_config "$KEY_FILE is empty or holds other characters"
  fi
}

# status_of METHOD PATH [BODY]: the HTTP status code, empty when nothing answers (bash's
# /dev/tcp: the host has no curl).
status_of() {
  local method="$1" path="$2" body="${3:-}" auth=""
  if [[ -n "$KEY" && "$path" == /v1/* ]]; then auth="Authorization: Bearer $KEY"$'\r\n'; fi
  (
    exec 3<>"/dev/tcp/${HOST}/${VLLM_PORT}"
    printf '%s %s HTTP/1.0\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' \
      "$method" "$path" "$HOST" "$auth" "${#body}" "$body" >&3
    IFS=' ' read -r -t 120 _ code _ <&3
    printf '%s\n' "$code"
  ) 2>/dev/null || true
}

generate() {
  status_of POST /v1/completions "{\"model\":\"$MODEL\",\"prompt\":\"ok\",\"max_tokens\":2,\"temperature\":0}"
}

wait_generates() {
  local start=$SECONDS next_note=60 code
  until [[ "$(status_of GET /health)" == 200 ]]; do
    if [[ -n "${MAINPID:-}" ]] && ! kill -0 "$MAINPID" 2>/dev/null; then
      log "the head's engine exited (main process $MAINPID) before /health answered"
      exit 1
    fi
    if ((SECONDS - start >= next_note)); then
      log "waiting for the head's /health on ${HOST}:${VLLM_PORT} ($((SECONDS - start)) s): are the workers up?"
      next_note=$((next_note + 60))
    fi
    sleep 2
  done
  code="$(generate)"
  if [[ "$code" != 200 ]]; then
    log "the head answers /health, but a generation got '${code:-no answer}': a worker is gone (the head's engine exits now)"
    exit 1
  fi
  log "the head generates on ${HOST}:${VLLM_PORT} after $((SECONDS - start)) s"
}

probe() {
  local code
  code="$(generate)"
  if [[ "$code" != 200 ]]; then
    log "a generation through the head got '${code:-no answer}': a node is gone; the head's engine exits and its unit restarts it once every node is back"
    exit 1
  fi
}

main() {
  (($# == 2)) || usage
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$ ]] || usage
  GROUP="$1"
  local etc="${APPLIANCE_ROOT:-}"
  etc="${etc%/}/etc/gemma4-vllm"
  readonly ARGS_FILE="$etc/$GROUP-head.args"
  readonly KEY_FILE="$etc/$GROUP-head.api-key"
  read_config
  case "$2" in
    wait-generates) wait_generates ;;
    probe) probe ;;
    *) usage ;;
  esac
}

main "$@"
