#!/bin/bash
# scorestack-triton's entry point: start tritonserver with its admin APIs restricted to the admin key,
# without the key on any command line (`ps`, /proc/<pid>/cmdline, `docker inspect`) or in
# tritonserver's environment -- the handoff `scorestack serve` uses (serve/security.py key_handoff).
#
#   entrypoint.sh [tritonserver] [TRITONSERVER OPTIONS...]
#
# The key: the file named by $SCORESTACK_ADMIN_KEY_FILE (a compose secret or a Kubernetes Secret
# mounted as a file), else $SCORESTACK_ADMIN_KEY (then removed from the environment; but a
# container's environment shows in `docker inspect`: prefer the file). tritonserver gets a random
# placeholder where the key goes in --grpc-restricted-protocol / --http-restricted-api, and the key
# on fd 3 (a pipe), which the library preloaded into it (serve/keyshim.c, built into this image)
# reads before tritonserver parses its options. No key configured: refuses to start, unless
# SCORESTACK_ALLOW_OPEN_ADMIN=1 (as `scorestack serve --allow-open-admin`): then the admin APIs
# are open to anyone who reaches the ports.
set -euo pipefail

# The same APIs and header as serve/security.py (RESTRICTED_APIS, ADMIN_KEY_HEADER);
# tests/test_deploy.py runs this script and checks the flags against AdminKey.triton_args().
RESTRICTED_APIS="model-repository,shared-memory,statistics,trace,logging"
HEADER="scorestack-admin-key"
KEY_FD=3
SHIM="${SCORESTACK_KEYSHIM:-/opt/scorestack/keyshim.so}"

fail() {
    printf 'scorestack-triton: %s\n' "$*" >&2
    exit 78  # EX_CONFIG, as the preloaded library
}

# The arguments are tritonserver's options; a leading "tritonserver" word (or its path, as the
# image's own entrypoint.d puts it in front in Vertex AI mode) is accepted and dropped.
case "${1-}" in
    tritonserver|*/tritonserver) shift ;;
esac
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    fail "the arguments are tritonserver's options (--model-repository=... ...), not a command: '$1'; to run something else, override the entry point (docker run --entrypoint ...)"
fi
for arg in "$@"; do
    case "$arg" in
        --grpc-restricted-protocol*|--http-restricted-api*)
            fail "drop '${arg%%=*}' from the command: the restricted APIs and their key are set here, from SCORESTACK_ADMIN_KEY_FILE (a key on the command line is visible to ps and docker inspect)" ;;
    esac
done

key_file="${SCORESTACK_ADMIN_KEY_FILE-}"
if [ -n "$key_file" ] && [ -n "${SCORESTACK_ADMIN_KEY-}" ]; then
    fail "both SCORESTACK_ADMIN_KEY and SCORESTACK_ADMIN_KEY_FILE are set; set only one (prefer the file)"
fi
if [ -n "$key_file" ]; then
    if [ ! -e "$key_file" ]; then
        fail "SCORESTACK_ADMIN_KEY_FILE=$key_file does not exist: mount the admin key there (a compose secret or a Kubernetes Secret volume)"
    fi
    if [ ! -r "$key_file" ]; then
        fail "SCORESTACK_ADMIN_KEY_FILE=$key_file is not readable by uid $(id -u) (groups $(id -G)): make it readable by that user or one of those groups (e.g. chmod 640 and a group the container runs with)"
    fi
    key="$(<"$key_file")"
    from="$key_file"
elif [ -n "${SCORESTACK_ADMIN_KEY-}" ]; then
    key="$SCORESTACK_ADMIN_KEY"
    from="SCORESTACK_ADMIN_KEY"
elif [ "${SCORESTACK_ALLOW_OPEN_ADMIN-}" = "1" ]; then
    printf '%s\n' "scorestack-triton: WARNING: no admin key (SCORESTACK_ALLOW_OPEN_ADMIN=1): the model-repository, shared-memory, statistics, trace and logging APIs are open to anyone who reaches the ports" >&2
    unset SCORESTACK_ALLOW_OPEN_ADMIN
    exec tritonserver "$@"
else
    fail "no admin key: set SCORESTACK_ADMIN_KEY_FILE to a file holding it (a compose secret or a Kubernetes Secret mounted as a file), or SCORESTACK_ADMIN_KEY; make one with: python3 -c \"import secrets; print(secrets.token_urlsafe(32))\". To serve with the admin APIs open, set SCORESTACK_ALLOW_OPEN_ADMIN=1"
fi
# Neither tritonserver nor its backend stubs need the key or where it came from.
unset SCORESTACK_ADMIN_KEY SCORESTACK_ADMIN_KEY_FILE SCORESTACK_ALLOW_OPEN_ADMIN SCORESTACK_KEYSHIM

# As serve/security.py AdminKey: surrounding whitespace dropped; at least 16 URL-safe characters
# (Triton splits its flag on ':' and '=', and gRPC metadata must be printable ASCII).
key="${key#"${key%%[![:space:]]*}"}"
key="${key%"${key##*[![:space:]]}"}"
if [ "${#key}" -lt 16 ] || [[ "$key" =~ [^A-Za-z0-9_.~-] ]]; then
    fail "admin key from $from: must be at least 16 URL-safe characters (letters, digits, '-', '_', '.', '~'); make one with: python3 -c \"import secrets; print(secrets.token_urlsafe(32))\""
fi
# Without the library Triton would be restricted to the placeholder, which ps shows: never start so.
if [ ! -r "$SHIM" ]; then
    fail "the admin-key handoff library $SHIM is missing or unreadable: rebuild the image (deploy/triton/Dockerfile)"
fi
# ld.so skips a preload it cannot load (with a warning) and runs the program anyway: check that it
# loads, on a program whose arguments hold no placeholder, which the library refuses (exit 78).
if probe="$(LD_PRELOAD="$SHIM" SCORESTACK_ADMIN_KEY_FD=4 SCORESTACK_ADMIN_KEY_PLACEHOLDER=scorestack-probe /bin/true 4< <(printf 'probe') 2>&1)"; then
    fail "the admin-key handoff library $SHIM does not load (${probe:-no reason given}): rebuild the image (deploy/triton/Dockerfile)"
fi
case "$probe" in
    *"no argument holds the placeholder"*) ;;
    *) fail "the admin-key handoff library $SHIM failed its check: $probe" ;;
esac

placeholder="scorestack-key-placeholder-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
if [ "${#placeholder}" -ne 59 ]; then
    fail "could not make a random placeholder from /dev/urandom"
fi
# The key on fd 3 through a pipe: printf is a builtin (no process, so no command line holds it);
# the library reads to EOF, drops the trailing newline, and closes the fd.
exec 3< <(printf '%s\n' "$key")
key=""

export LD_PRELOAD="${SHIM}${LD_PRELOAD:+:$LD_PRELOAD}"
export SCORESTACK_ADMIN_KEY_FD="$KEY_FD"
export SCORESTACK_ADMIN_KEY_PLACEHOLDER="$placeholder"
spec="${RESTRICTED_APIS}:${HEADER}=${placeholder}"
exec tritonserver "$@" "--grpc-restricted-protocol=${spec}" "--http-restricted-api=${spec}"
