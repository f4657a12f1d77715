#!/bin/bash
# The serve script of every gemma4-vllm@<instance>.service: one file for all instances.
# Hand-written; `appliance install` copies it to /usr/local/libexec/gemma4-vllm/serve from
# appliance/units/serve.sh. ADR 0009.
#
#   serve INSTANCE run           run the engine container in the foreground (the unit's main process)
#   serve INSTANCE wait-healthy  return once vLLM's /health answers 200 (ExecStartPost)
#   serve INSTANCE stop          stop the container, letting vLLM drain (ExecStop)
#   serve INSTANCE remove        remove a leftover container (ExecStartPre, ExecStopPost)
#   serve INSTANCE print         print the docker command `run` would exec, and exit
#
# Per instance it reads three things, and runs none of them as code:
# - the environment systemd loads from /etc/gemma4-vllm/INSTANCE.env (EnvironmentFile=), which
#   is the operator's: VLLM_IMAGE, APPLIANCE_PROFILE, VLLM_HOST, VLLM_PORT, VLLM_GPUS and the
#   host paths MODEL_DIR, HF_CACHE_DIR, VLLM_CACHE_DIR. Each value is checked here before it
#   reaches docker.
# - /etc/gemma4-vllm/INSTANCE.args, which `appliance install` generates from the profile: one
#   "KIND VALUE" record a line, read with `read -r` into arrays (never sourced or evaluated).
# - /etc/gemma4-vllm/INSTANCE.api-key (0600): checked, never read into this script, and given
#   to the container on its stdin, whose entry point hands it to vLLM (read_api_key below), so
#   the key is never on a command line, in `print`'s output, the journal, `bash -x` output or
#   `docker inspect`.
#
# Before it starts the engine, `run` checks that the models the args file names are on this host
# and look complete (check_models below: exit 78 with one line naming the model and the command
# that fixes it), so a missing or half-downloaded model is a configuration error instead of a
# failure deep inside vLLM's model loading and a restart loop.
#
# The image's labels decide whether the Gemma 4 MTP speculative config is passed: an image not
# labelled io.gemma4-appliance.mtp=true is served without it, so pointing VLLM_IMAGE at a
# pre-MTP image is a safe rollback.
#
# APPLIANCE_ROOT, when set, prefixes /etc/gemma4-vllm (an instance installed with
# `appliance install --root DIR`, for review and tests); the unit never sets it.
set -euo pipefail

readonly EX_CONFIG=78  # the unit does not restart on this: a restart cannot fix configuration
readonly ARGS_FORMAT=1
readonly STOP_GRACE_S=60  # vLLM drains in-flight requests on SIGTERM (the unit allows 90 s)
readonly REMOVE_WAIT_S=30  # how long `remove` waits for Docker to finish an auto-removal
# Image labels (ADR 0003, appliance/labels.py; a test keeps these equal to it).
readonly LABEL_MTP=io.gemma4-appliance.mtp
readonly LABEL_VLLM_VERSION=io.gemma4-appliance.vllm.version
readonly LABEL_VERSION=org.opencontainers.image.version
readonly LABEL_INSTANCE=io.gemma4-appliance.instance
readonly LABEL_API_KEY_STDIN=io.gemma4-appliance.api-key-stdin
readonly MAX_API_KEY_BYTES=4096  # a generated key is 43 characters
# The first vLLM release with --per-request-spec-decode-metrics; older engines reject the flag.
readonly PER_REQUEST_METRICS_MIN_VLLM=0.32.0
# Where a CPU profile's tiny model pair is mounted (the args name /models/target, /models/drafter).
readonly CONTAINER_MODEL_DIR=/models
# Go template for `docker image inspect --format`: one "key=value" line per image label.
# shellcheck disable=SC2016  # $k and $v are the template's variables, not the shell's
readonly LABELS_FORMAT='{{range $k, $v := .Config.Labels}}{{$k}}={{$v}}{{"\n"}}{{end}}'

INSTANCE=""

log() { printf '%s\n' "gemma4-vllm@${INSTANCE:-?}: $*" >&2; }
die_config() { log "$*"; exit "$EX_CONFIG"; }

usage() {
  printf 'usage: %s INSTANCE run|print|wait-healthy|stop|remove\n' "$0" >&2
  exit 2
}

# version_ge A B: true when version A >= version B.
version_ge() {
  [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" == "$2" ]]
}

# ---- the instance's files ---------------------------------------------------------------------

# read_args: the records of the args file into SERVE_ARGS, MTP_ARGS, PER_REQUEST_ARGS,
# DOCKER_OPTS, REQUIRED, MODELS and DRAFTER_TYPES. Each value is one argument as written, quotes
# and $ included.
read_args() {
  local kind value format=""
  SERVE_ARGS=() MTP_ARGS=() PER_REQUEST_ARGS=() DOCKER_OPTS=() REQUIRED=() ARGS_PROFILE=""
  MODELS=() DRAFTER_TYPES=()
  [[ -r "$ARGS_FILE" ]] \
    || die_config "cannot read $ARGS_FILE (written by \`appliance install $INSTANCE\`)"
  while read -r kind value || [[ -n "$kind" ]]; do
    case "$kind" in
      '' | '#'*) ;;
      format) format="$value" ;;
      profile) ARGS_PROFILE="$value" ;;
      serve) SERVE_ARGS+=("$value") ;;
      mtp) MTP_ARGS+=("$value") ;;
      per-request) PER_REQUEST_ARGS+=("$value") ;;
      docker) DOCKER_OPTS+=("$value") ;;
      require) REQUIRED+=("$value") ;;
      model) MODELS+=("$value") ;;
      drafter-type) DRAFTER_TYPES+=("$value") ;;
      *) die_config "$ARGS_FILE: unknown record '$kind': re-run \`appliance install\`" ;;
    esac
  done < "$ARGS_FILE"
  [[ "$format" == "$ARGS_FORMAT" ]] \
    || die_config "$ARGS_FILE has format '$format', this script reads $ARGS_FORMAT: re-run \`appliance install\`"
  [[ -n "$ARGS_PROFILE" && ${#SERVE_ARGS[@]} -gt 0 ]] \
    || die_config "$ARGS_FILE names no profile or no arguments: re-run \`appliance install\`"
}

# check_endpoint: VLLM_HOST and VLLM_PORT from the env file, and the address /health is asked on.
check_endpoint() {
  [[ -n "${VLLM_HOST:-}" ]] || die_config "VLLM_HOST is not set in $ENV_FILE"
  [[ "$VLLM_HOST" =~ ^[A-Za-z0-9:][A-Za-z0-9.:-]*$ ]] \
    || die_config "VLLM_HOST=$VLLM_HOST in $ENV_FILE is not an IP address or host name"
  [[ -n "${VLLM_PORT:-}" ]] || die_config "VLLM_PORT is not set in $ENV_FILE"
  if [[ ! "$VLLM_PORT" =~ ^[1-9][0-9]{0,4}$ ]] || ((VLLM_PORT > 65535)); then
    die_config "VLLM_PORT=$VLLM_PORT in $ENV_FILE is not a TCP port (1-65535)"
  fi
  case "$VLLM_HOST" in
    0.0.0.0 | ::) HEALTH_HOST=127.0.0.1 ;;  # bound to every address: ask on loopback
    *) HEALTH_HOST="$VLLM_HOST" ;;
  esac
}

# check_path NAME: the env file's NAME, when set, is an absolute path with no spaces or shell
# characters (it becomes a mount).
check_path() {
  local value="${!1:-}"
  [[ -z "$value" || "$value" =~ ^/[A-Za-z0-9._/@+-]*$ ]] \
    || die_config "$1=$value in $ENV_FILE is not a plain absolute path"
}

check_env() {
  [[ -n "${VLLM_IMAGE:-}" ]] || die_config "VLLM_IMAGE is not set (expected in $ENV_FILE)"
  # The full reference grammar is checked by `appliance`; this keeps a hand edit from putting
  # spaces or shell characters in front of docker.
  [[ "$VLLM_IMAGE" =~ ^[A-Za-z0-9][A-Za-z0-9._/:@-]*$ ]] \
    || die_config "VLLM_IMAGE=$VLLM_IMAGE in $ENV_FILE is not a valid image reference"
  [[ "${APPLIANCE_PROFILE:-}" == "$ARGS_PROFILE" ]] \
    || die_config "APPLIANCE_PROFILE=${APPLIANCE_PROFILE:-} in $ENV_FILE, but $ARGS_FILE is profile $ARGS_PROFILE: run \`appliance install $INSTANCE --profile ${APPLIANCE_PROFILE:-PROFILE}\`"
  check_endpoint
  local key
  for key in "${REQUIRED[@]}"; do
    # A fixed set: the name is expanded indirectly below, so it must never come from a file.
    case "$key" in
      VLLM_GPUS | MODEL_DIR | HF_CACHE_DIR | VLLM_CACHE_DIR) ;;
      *) die_config "$ARGS_FILE requires '$key', which this script does not know" ;;
    esac
    [[ -n "${!key:-}" ]] || die_config "$key is not set in $ENV_FILE"
  done
  for key in MODEL_DIR HF_CACHE_DIR VLLM_CACHE_DIR; do
    check_path "$key"
  done
  if [[ -n "${MODEL_DIR:-}" && ! -d "$MODEL_DIR" ]]; then
    case "$MODEL_DIR/" in
      # The unit runs with PrivateTmp=yes: the host's /tmp and /var/tmp are not what it sees.
      /tmp/* | /var/tmp/*)
        die_config "MODEL_DIR=$MODEL_DIR in $ENV_FILE is not a directory (the unit has a private /tmp and /var/tmp: keep models elsewhere, e.g. /var/lib/gemma4-vllm/models)"
        ;;
    esac
    die_config "MODEL_DIR=$MODEL_DIR in $ENV_FILE is not a directory"
  fi
  [[ "${VLLM_GPUS:-all}" =~ ^(all|[0-9]+|device=[A-Za-z0-9:,/_-]+)$ ]] \
    || die_config "VLLM_GPUS=$VLLM_GPUS in $ENV_FILE: expected all, a count or device=..."
}

# read_api_key: how the key reaches vLLM, in KEY_ARGS and KEY_STDIN, by appliance/apikey.py's
# rule (surrounding whitespace, CRLF included, is not part of the key; empty is an error;
# letters, digits and ._~+/=- only). An image labelled io.gemma4-appliance.api-key-stdin=true
# gets the key FILE as the stdin of `docker run -i` (KEY_STDIN), and its entry point reads it
# (docker/entrypoint.sh): the key is never read here, not into a variable (`bash -x` prints
# those), not into docker's arguments or the container's config (`docker inspect` shows --env
# values to anyone with the socket). Its bytes travel over the Docker socket: a bind mount's
# source would be resolved on dockerd's filesystem, which is not this script's under nspawn or a
# remote DOCKER_HOST (a missing source becomes an empty directory). The file is only checked,
# through pipes. An image without the label (built by an older appliance: the rollback target
# after an upgrade) gets the old path: the key in this script's environment, passed by name as
# --env VLLM_API_KEY, so `docker inspect` shows it; a journal line says so.
# gotchas/api-key-scope.md.
read_api_key() {
  KEY_ARGS=() KEY_STDIN=/dev/null
  if [[ ! -e "$API_KEY_FILE" ]]; then
    case "$VLLM_HOST" in
      127.0.0.1 | ::1 | localhost)
        log "no API key file $API_KEY_FILE: vLLM on ${VLLM_HOST}:${VLLM_PORT} accepts any caller on this host"
        return 0
        ;;
      *) die_config "no API key file $API_KEY_FILE: refusing to serve on $VLLM_HOST without one" ;;
    esac
  fi
  [[ -f "$API_KEY_FILE" && -r "$API_KEY_FILE" ]] \
    || die_config "cannot read API key file $API_KEY_FILE (a regular file, readable by root)"
  local size
  size="$(stat -L -c %s -- "$API_KEY_FILE")" || die_config "cannot read API key file $API_KEY_FILE"
  ((size <= MAX_API_KEY_BYTES)) \
    || die_config "API key file $API_KEY_FILE has $size bytes: a key is at most $MAX_API_KEY_BYTES"
  # The rule, on the file's bytes through pipes: every whitespace byte becomes a space, the ends
  # are trimmed, what is left must be one run of safe characters. Nothing here holds the key.
  LC_ALL=C tr -s '\r\n\t\v\f ' ' ' < "$API_KEY_FILE" | LC_ALL=C grep -q '[^ ]' \
    || die_config "API key file $API_KEY_FILE is empty"
  LC_ALL=C tr '\r\n\t\v\f' '     ' < "$API_KEY_FILE" | LC_ALL=C sed -e 's/^ *//' -e 's/ *$//' \
    | LC_ALL=C grep -qx '[A-Za-z0-9._~+/=-]*' \
    || die_config "API key file $API_KEY_FILE holds characters outside letters, digits and ._~+/=-"
  if [[ "$(image_label "$LABEL_API_KEY_STDIN")" == true ]]; then
    KEY_ARGS=(--interactive --env GEMMA4_API_KEY_STDIN=1)
    KEY_STDIN="$API_KEY_FILE"
    return 0
  fi
  log "image $VLLM_IMAGE is not labelled $LABEL_API_KEY_STDIN=true (built by an older appliance): the API key goes to the container as --env VLLM_API_KEY, visible in \`docker inspect\`; rebuild the image with \`appliance image build\` to keep it out"
  # The old path still keeps the key out of `bash -x`: tracing is off while it is read.
  local trace=0
  if [[ $- == *x* ]]; then trace=1; fi
  { set +x; } 2>/dev/null
  VLLM_API_KEY="$(LC_ALL=C tr '\r\n\t\v\f' '     ' < "$API_KEY_FILE" | LC_ALL=C sed -e 's/^ *//' -e 's/ *$//')"
  export VLLM_API_KEY
  if ((trace)); then set -x; fi
  KEY_ARGS=(--env VLLM_API_KEY)
}

# ---- the models --------------------------------------------------------------------------------
#
# check_models: every model the args file names is on this host and looks complete, else exit 78
# with one line naming each problem's model and the command that fixes it. A `model` record is
# `ROLE hub REPO_ID [REVISION]` (the Hugging Face cache in HF_CACHE_DIR, as the hub client lays it
# out: hub/models--ORG--NAME/{refs/main,snapshots/COMMIT,blobs,trees/COMMIT.json}) or `ROLE dir
# NAME` (MODEL_DIR/NAME, the tiny CPU models). This is the cheap part of `appliance models verify
# --quick` in bash (the host may have no Python), with its messages: the model directory and
# config.json, a tokenizer for the target, every shard a *.safetensors.index.json lists, a
# single-file model's weights, no download left half-done, each file's size where the hub's
# listing (trees/COMMIT.json) gives it, each safetensors file as long as its header says, and a
# drafter whose config.json names an allowed model_type and the target's width. It reads no
# weight data: `appliance models verify I` is the full check (every file's hash).

readonly MAX_SAFETENSORS_HEADER=104857600  # appliance/models/verify.py's _MAX_HEADER

MODEL_PROBLEMS=()

# problem ROLE NAME WHAT
problem() { MODEL_PROBLEMS+=("$1 $2: $3"); }

# file_size PATH: the size of PATH (links followed).
file_size() { stat -L -c %s -- "$1"; }

# safetensors_problem PATH: why a safetensors file cannot be whole (its header gives its exact
# length), or nothing.
safetensors_problem() {
  local path="$1" size n end max=0
  size="$(file_size "$path")"
  if ((size < 8)); then
    printf 'is truncated (%s bytes)\n' "$size"
    return 0
  fi
  n="$(od -An -N8 -tu8 --endian=little -- "$path" | tr -d ' ')"
  if [[ ! "$n" =~ ^[0-9]+$ ]] || ((n > size - 8 || n > MAX_SAFETENSORS_HEADER)); then
    printf 'is truncated or not safetensors (%s bytes)\n' "$size"
    return 0
  fi
  # "data_offsets":[BEGIN,END] per tensor: the data ends at the largest END.
  while read -r end; do
    if ((end > max)); then max=$end; fi
  done < <(head -c "$((8 + n))" -- "$path" \
    | grep -aoE '"data_offsets" *: *\[ *[0-9]+ *, *[0-9]+ *\]' \
    | grep -oE '[0-9]+ *\]$' | tr -d ' ]')
  if ((size < 8 + n + max)); then
    printf 'is truncated (%s of %s bytes)\n' "$size" "$((8 + n + max))"
  fi
}

# check_listing ROLE NAME SNAPSHOT TREE: every file of the hub's listing is in the snapshot with
# its size. The listing is JSON that the hub client (indent 1) or `appliance models import`
# (indent 2) writes one key a line: {"format_version": 1, "files": {PATH: {"size": N, ...}}};
# an entry on one line ({"size": N first) is read too. A name with escapes, or a listing in
# another format, is left to `appliance models verify`. Sets REPORTED[file] for each failed file.
check_listing() {
  local role="$1" name="$2" snapshot="$3" tree="$4" line rel="" size=""
  local -r sp='[[:space:]]*' key='"([^"\\]*)"'
  [[ -r "$tree" ]] && grep -qE "^${sp}\"format_version\":${sp}1,?$" -- "$tree" || return 0
  while IFS= read -r line; do
    size=""
    if [[ "$line" =~ ^${sp}${key}:${sp}\{${sp}\"size\":${sp}([0-9]+) ]]; then
      rel="${BASH_REMATCH[1]}" size="${BASH_REMATCH[2]}"
    elif [[ "$line" =~ ^${sp}${key}:${sp}\{$ ]]; then
      rel="${BASH_REMATCH[1]}"
    elif [[ "$line" =~ ^${sp}\"[^\"]*\\ ]]; then
      rel=""  # a name with escapes
    elif [[ -n "$rel" && "$line" =~ ^${sp}\"size\":${sp}([0-9]+),?$ ]]; then
      size="${BASH_REMATCH[1]}"
    fi
    [[ -n "$rel" && -n "$size" ]] || continue
    if [[ ! -e "$snapshot/$rel" ]]; then
      problem "$role" "$name" "file $rel missing"
      REPORTED["$rel"]=1
    elif [[ "$(file_size "$snapshot/$rel")" != "$size" ]]; then
      problem "$role" "$name" "file $rel has $(file_size "$snapshot/$rel") of $size bytes (truncated or replaced)"
      REPORTED["$rel"]=1
    fi
    rel=""
  done < "$tree"
}

# check_model_files ROLE NAME DIR: config, tokenizer, weights and their lengths of one model.
check_model_files() {
  local role="$1" name="$2" dir="$3" index shard file why weights=0
  if [[ ! -e "$dir/config.json" && -z "${REPORTED[config.json]:-}" ]]; then
    problem "$role" "$name" "config.json missing"
  fi
  if [[ "$role" == target && ! -e "$dir/tokenizer.json" && ! -e "$dir/tokenizer.model" \
    && -z "${REPORTED[tokenizer.json]:-}${REPORTED[tokenizer.model]:-}" ]]; then
    problem "$role" "$name" "no tokenizer (tokenizer.json or tokenizer.model)"
  fi
  for index in "$dir"/*.safetensors.index.json; do
    [[ -e "$index" ]] || continue
    weights=1
    while read -r shard; do
      if [[ -z "${REPORTED[$shard]:-}" && ! -e "$dir/$shard" ]]; then
        problem "$role" "$name" "weight shard $shard missing (listed in the weight index)"
        REPORTED["$shard"]=1
      fi
    done < <(grep -oE '"[^"\\/]+\.safetensors"' -- "$index" | tr -d '"' | sort -u)
  done
  for file in "$dir"/*.safetensors; do
    if [[ -n "${REPORTED[${file##*/}]:-}" ]]; then
      weights=1
      continue
    fi
    [[ -e "$file" ]] || continue  # no match, or a link to a blob that is gone
    weights=1
    why="$(safetensors_problem "$file")"
    [[ -z "$why" ]] || problem "$role" "$name" "file ${file##*/} $why"
  done
  ((weights)) || problem "$role" "$name" "no weight files (*.safetensors)"
}

# check_hub_model ROLE REPO_ID REVISION: one model in the Hugging Face cache. Sets MODEL_PATH.
check_hub_model() {
  local role="$1" repo_id="$2" revision="$3" hub="$HF_CACHE_DIR/hub" repo commit main partial
  repo="$hub/models--${repo_id//\//--}"
  if [[ ! -d "$repo" ]]; then
    problem "$role" "$repo_id" "not in the model cache $hub"
    return 0
  fi
  main="$(head -c 64 -- "$repo/refs/main" 2>/dev/null || true)"
  [[ "$main" =~ ^[0-9a-f]{40}$ ]] || main=""
  if [[ "$revision" =~ ^[0-9a-f]{40}$ ]]; then
    commit="$revision"
  elif [[ -n "$revision" ]]; then
    commit="$(head -c 64 -- "$repo/refs/$revision" 2>/dev/null || true)"
    [[ "$commit" =~ ^[0-9a-f]{40}$ ]] || commit=""
  else
    commit="$main"
  fi
  if [[ -z "$commit" ]]; then
    problem "$role" "$repo_id" "no refs/${revision:-main} in $repo: the download never finished"
    return 0
  fi
  if [[ "$main" != "$commit" ]]; then
    # vLLM, offline and without --revision, loads whatever refs/main names.
    problem "$role" "$repo_id" "refs/main names ${main:-nothing}, the profile pins $commit"
    return 0
  fi
  # The hub client downloads into blobs/ETAG.incomplete and renames when done.
  for partial in "$repo"/blobs/*.incomplete; do
    if [[ -e "$partial" ]]; then
      problem "$role" "$repo_id" "a download was interrupted (blobs/${partial##*/} left)"
      break
    fi
  done
  if [[ ! -d "$repo/snapshots/$commit" ]]; then
    problem "$role" "$repo_id" "snapshot ${commit:0:12} missing from $repo"
    return 0
  fi
  MODEL_PATH="$repo/snapshots/$commit"
  check_listing "$role" "$repo_id" "$MODEL_PATH" "$repo/trees/$commit.json"
  check_model_files "$role" "$repo_id" "$MODEL_PATH"
}

# config_values FILE KEY: every value of "KEY": "..." or "KEY": N in a JSON config, one a line.
config_values() {
  grep -oE "\"$2\" *: *(\"[^\"]*\"|[0-9]+)" -- "$1" 2>/dev/null | sed -E 's/^[^:]*: *"?//; s/"$//' || true
}

# check_drafter TARGET_DIR DRAFTER_NAME DRAFTER_DIR: a Gemma 4 MTP drafter built for the target's
# width. A config names model_type once per sub-config: one allowed type is enough here (the
# full check reads the top level), and the drafter's backbone width must be one of the target's
# hidden sizes.
check_drafter() {
  local target_dir="$1" name="$2" dir="$3" kind allowed found="" first="" backbone widths
  [[ -s "$dir/config.json" && ${#DRAFTER_TYPES[@]} -gt 0 ]] || return 0
  while read -r kind; do
    first="${first:-$kind}"
    for allowed in "${DRAFTER_TYPES[@]}"; do
      if [[ "$kind" == "$allowed" ]]; then found="$kind"; fi
    done
  done < <(config_values "$dir/config.json" model_type)
  if [[ -z "$found" ]]; then
    allowed="${DRAFTER_TYPES[*]:0:2}"
    problem drafter "$name" "is a ${first:-untyped} model, not a Gemma 4 MTP drafter (${allowed// / \/ }): wrong drafter repo in the profile or the cache"
    return 0
  fi
  [[ -n "$target_dir" && -s "$target_dir/config.json" ]] || return 0
  backbone="$(config_values "$dir/config.json" backbone_hidden_size | head -n 1)"
  widths="$(config_values "$target_dir/config.json" hidden_size | sort -un)"
  if [[ -n "$backbone" && -n "$widths" ]] && ! grep -qxF -- "$backbone" <<< "$widths"; then
    problem drafter "$name" "drafts for a backbone of width $backbone, the target $TARGET_NAME has ${widths//$'\n'/ or }: the drafter belongs to another Gemma 4 size"
  fi
}

check_models() {
  if ((${#MODELS[@]} == 0)); then
    log "$ARGS_FILE names no models (written by an older appliance): not checked at start; re-run \`appliance install $INSTANCE\` to check them"
    return 0
  fi
  local value role layout name revision rest fix="" target_dir="" drafter_name="" drafter_dir=""
  local -a checked=()
  local -A REPORTED=()
  MODEL_PROBLEMS=() TARGET_NAME=""
  for value in "${MODELS[@]}"; do
    read -r role layout name revision rest <<< "$value"
    # The names become paths: each part starts with a letter or digit (template.py's rule).
    [[ "$role" =~ ^(target|drafter)$ && -z "$rest" \
      && "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$ \
      && "$revision" =~ ^([A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*)?$ ]] \
      || die_config "$ARGS_FILE: bad model record '$value': re-run \`appliance install\`"
    REPORTED=() MODEL_PATH=""
    case "$layout" in
      hub)
        [[ -n "${HF_CACHE_DIR:-}" ]] || die_config "HF_CACHE_DIR is not set in $ENV_FILE"
        check_hub_model "$role" "$name" "$revision"
        fix="fix: appliance models pull $INSTANCE; air-gapped: appliance models import $INSTANCE --from COPY"
        ;;
      dir)
        [[ -n "${MODEL_DIR:-}" && -z "$revision" ]] || die_config "MODEL_DIR is not set in $ENV_FILE"
        MODEL_PATH="$MODEL_DIR/$name"
        if [[ -d "$MODEL_PATH" ]]; then
          check_model_files "$role" "$MODEL_PATH" "$MODEL_PATH"
        else
          problem "$role" "$MODEL_PATH" "directory missing"
          MODEL_PATH=""
        fi
        name="$MODEL_PATH"
        fix="fix: appliance devmodel build DIR (a new or empty directory), then MODEL_DIR=DIR in $ENV_FILE"
        ;;
      *) die_config "$ARGS_FILE: bad model record '$value': re-run \`appliance install\`" ;;
    esac
    checked+=("$role $name")
    if [[ "$role" == target ]]; then
      target_dir="$MODEL_PATH" TARGET_NAME="$name"
    else
      drafter_dir="$MODEL_PATH" drafter_name="$name"
    fi
  done
  if [[ -n "$drafter_dir" ]]; then
    check_drafter "$target_dir" "$drafter_name" "$drafter_dir"
  fi
  local n=${#MODEL_PROBLEMS[@]} shown tail=""
  if ((n == 0)); then
    log "models present: $(printf '%s, ' "${checked[@]}" | sed 's/, $//') (quick check; \`appliance models verify $INSTANCE\` hashes them)"
    return 0
  fi
  shown="$(printf '%s; ' "${MODEL_PROBLEMS[@]:0:3}")"
  if ((n > 3)); then tail="; and $((n - 3)) more"; fi
  die_config "models not ready: ${shown%; }$tail ($fix)"
}

# ---- the docker command ------------------------------------------------------------------------

# image_label KEY: the value of the image's label KEY, empty when absent.
image_label() {
  local line
  while IFS= read -r line; do
    if [[ "${line%%=*}" == "$1" ]]; then
      printf '%s\n' "${line#*=}"
      return 0
    fi
  done <<< "$IMAGE_LABELS"
}

# docker_command [run]: DOCKER_ARGS for the instance; with `run`, the models are checked first
# (`print` shows the command whether or not the models are there yet).
docker_command() {
  read_args
  check_env
  if [[ "${1:-}" == run ]]; then
    check_models
  fi
  # Never pulled: the image must already be on this host (built, loaded or tagged there).
  IMAGE_LABELS="$(docker image inspect --format "$LABELS_FORMAT" "$VLLM_IMAGE")" \
    || die_config "image $VLLM_IMAGE is not on this host (the unit never pulls): build or load it, or fix VLLM_IMAGE in $ENV_FILE"
  local mtp vllm_version image_version
  mtp="$(image_label "$LABEL_MTP")"
  vllm_version="$(image_label "$LABEL_VLLM_VERSION")"
  image_version="$(image_label "$LABEL_VERSION")"
  log "image $VLLM_IMAGE: version ${image_version:-unlabelled}, vLLM ${vllm_version:-unlabelled}, Gemma 4 MTP ${mtp:-unlabelled}"

  local -a spec_args=()
  if ((${#MTP_ARGS[@]} == 0)); then
    log "profile $ARGS_PROFILE has no speculative decoding"
  elif [[ "$mtp" == true ]]; then
    spec_args=("${MTP_ARGS[@]}")
    if [[ -n "$vllm_version" ]] && version_ge "$vllm_version" "$PER_REQUEST_METRICS_MIN_VLLM"; then
      spec_args+=("${PER_REQUEST_ARGS[@]}")
    fi
    log "serving with Gemma 4 MTP speculative decoding (${MTP_ARGS[*]})"
  else
    log "image is not labelled $LABEL_MTP=true: serving without speculative decoding"
  fi

  read_api_key

  local -a gpu_args=() volume_args=()
  if [[ -n "${VLLM_GPUS:-}" ]]; then
    # docker reads --gpus as CSV: a device list with commas must be one quoted field.
    if [[ "$VLLM_GPUS" == *,* ]]; then
      gpu_args=(--gpus "\"$VLLM_GPUS\"")
    else
      gpu_args=(--gpus "$VLLM_GPUS")
    fi
  fi
  if [[ -n "${MODEL_DIR:-}" ]]; then
    volume_args+=(--volume "$MODEL_DIR:$CONTAINER_MODEL_DIR:ro")
  fi
  if [[ -n "${HF_CACHE_DIR:-}" ]]; then
    # Read-write: the hub's offline lookups may still write lock files into the cache.
    volume_args+=(--volume "$HF_CACHE_DIR:/root/.cache/huggingface")
  fi
  if [[ -n "${VLLM_CACHE_DIR:-}" ]]; then
    volume_args+=(--volume "$VLLM_CACHE_DIR:/root/.cache/vllm")
  fi

  DOCKER_ARGS=(
    run --rm --name "$CONTAINER" --pull never
    --label "$LABEL_INSTANCE=$INSTANCE"
    # Host networking: vLLM binds VLLM_HOST on the host itself, so loopback means loopback.
    --network host
    "${DOCKER_OPTS[@]}"
    "${gpu_args[@]}"
    "${volume_args[@]}"
    "${KEY_ARGS[@]}"
    "$VLLM_IMAGE"
    "${SERVE_ARGS[@]}" --host "$VLLM_HOST" --port "$VLLM_PORT" "${spec_args[@]}"
  )
}

# ---- health ------------------------------------------------------------------------------------

# health_status: the status line of GET /health, over bash's /dev/tcp (no curl on the host).
health_status() {
  (
    exec 3<>"/dev/tcp/${HEALTH_HOST}/${VLLM_PORT}"
    printf 'GET /health HTTP/1.0\r\nHost: %s\r\n\r\n' "$HEALTH_HOST" >&3
    IFS= read -r -t 10 line <&3
    printf '%s\n' "${line%$'\r'}"
  ) 2>/dev/null || true
}

wait_healthy() {
  check_endpoint
  local start=$SECONDS next_note=60 probe_hint=""
  case "$HEALTH_HOST" in
    127.* | ::1 | localhost) ;;
    # The unit's IPAddressAllow=localhost blocks the probe to any other address.
    *) probe_hint="; the unit lets the probe reach only loopback: add a drop-in with IPAddressAllow=$HEALTH_HOST" ;;
  esac
  until [[ "$(health_status)" =~ ^HTTP/1\.[01]\ 200 ]]; do
    # systemd lets ExecStartPost run on after the main process exited: without this, an engine
    # that dies at start (a broken image) held the unit "activating" until TimeoutStartSec.
    if [[ -n "${MAINPID:-}" ]] && ! kill -0 "$MAINPID" 2>/dev/null; then
      log "the engine exited (main process $MAINPID) before vLLM /health answered"
      exit 1
    fi
    if ((SECONDS - start >= next_note)); then
      log "waiting for vLLM /health on ${HEALTH_HOST}:${VLLM_PORT} ($((SECONDS - start)) s)${probe_hint}"
      next_note=$((next_note + 60))
    fi
    sleep 2
  done
  log "vLLM healthy on ${HEALTH_HOST}:${VLLM_PORT} after $((SECONDS - start)) s"
}

# ---- stop and remove ---------------------------------------------------------------------------

# gone OUTPUT: true when docker's error OUTPUT says the container does not exist.
gone() { [[ "$1" == *"No such container"* ]]; }

# stop_container (ExecStop): stop the container, giving vLLM STOP_GRACE_S to drain in-flight
# requests before docker kills it. A container already gone is fine (the engine exited by itself
# and --rm removed it); any other failure is logged and fails the stop, which systemd records.
stop_container() {
  local out start=$SECONDS
  if out="$(docker stop -t "$STOP_GRACE_S" "$CONTAINER" 2>&1 >/dev/null)"; then
    if ((SECONDS - start >= STOP_GRACE_S)); then
      log "vLLM did not drain within ${STOP_GRACE_S} s: docker killed container $CONTAINER"
    else
      log "container $CONTAINER stopped after $((SECONDS - start)) s"
    fi
    return 0
  fi
  if gone "$out"; then
    log "container $CONTAINER already gone"
    return 0
  fi
  log "docker stop $CONTAINER failed: ${out//$'\n'/ }"
  return 1
}

# remove_container (ExecStartPre, ExecStopPost): remove a container left behind by a crash or a
# killed daemon. A container Docker is still auto-removing (--rm: "removal ... already in
# progress") is waited for; a daemon that does not answer, or a removal that fails, is logged and
# fails the start.
remove_container() {
  local out deadline=$((SECONDS + REMOVE_WAIT_S))
  while docker container inspect --format '{{.Id}}' "$CONTAINER" >/dev/null 2>&1; do
    if out="$(docker rm --force "$CONTAINER" 2>&1 >/dev/null)" || gone "$out"; then
      return 0
    fi
    if [[ "$out" != *"already in progress"* ]]; then
      log "docker rm $CONTAINER failed: ${out//$'\n'/ }"
      return 1
    fi
    if ((SECONDS >= deadline)); then
      log "container $CONTAINER is still being removed after ${REMOVE_WAIT_S} s: ${out//$'\n'/ }"
      return 1
    fi
    sleep 1
  done
  # Only "no such container" is fine: a daemon that does not answer fails the start.
  if ! out="$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)"; then
    log "the Docker daemon does not answer: ${out//$'\n'/ }"
    return 1
  fi
}

main() {
  (($# == 2)) || usage
  # Instance names as appliance/units/template.py checks them: a container and unit name.
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$ ]] || usage
  INSTANCE="$1"
  local etc="${APPLIANCE_ROOT:-}"
  etc="${etc%/}/etc/gemma4-vllm"
  readonly CONTAINER="gemma4-vllm-$INSTANCE"
  readonly ENV_FILE="$etc/$INSTANCE.env"
  readonly ARGS_FILE="$etc/$INSTANCE.args"
  readonly API_KEY_FILE="$etc/$INSTANCE.api-key"
  case "$2" in
    run)
      docker_command run
      exec docker "${DOCKER_ARGS[@]}" < "$KEY_STDIN"
      ;;
    print)
      docker_command
      printf '%q ' docker "${DOCKER_ARGS[@]}"
      if [[ "$KEY_STDIN" != /dev/null ]]; then printf '< %q' "$KEY_STDIN"; fi
      printf '\n'
      ;;
    wait-healthy)
      wait_healthy
      ;;
    stop)
      stop_container
      ;;
    remove)
      remove_container
      ;;
    *)
      usage
      ;;
  esac
}

main "$@"
