# Sourced by scripts/setup.sh. `quiet CMD…` runs CMD without showing its output (pip's and
# setuptools' banners) unless KILN_VERBOSE=1; when CMD fails, its whole output is shown on stderr
# and quiet returns CMD's exit status, so a failing step is never hidden.
quiet() {
  if [ "${KILN_VERBOSE:-0}" = "1" ]; then
    "$@"
    return
  fi
  local log status=0
  log="$(mktemp)"
  "$@" >"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    cat "$log" >&2
    echo "setup: '$*' failed (exit $status)" >&2
  fi
  rm -f "$log"
  return "$status"
}
