# harness/pair.sh: sourced (not run) by the scripts that start a server in the background and
# then its client (demo-pair, bench-async, bench-lat, bench-rate, bench-tools, bench-ud). Every
# wait on the server is bounded, and a server whose client failed is stopped, never waited for:
# a server that serves one client waits for it forever when the client gave up.
#
#   pair_listen PID LOG TEXT [SECONDS]  wait until the server's LOG has a line containing TEXT
#                                       (its "listening" line); fail, saying why and showing the
#                                       log's end, when the server exits first or SECONDS pass
#                                       (the server is then stopped)
#   pair_reap PID [SECONDS]             wait for the server to exit; its exit status, or 124 and
#                                       the server killed when SECONDS pass
#   pair_stop PID                       stop the server (TERM, then KILL after 2 s) and reap it
# env: PAIR_LISTEN_TIMEOUT (default 60): pair_listen's bound. The server has been measured taking
#      over 20 s to listen in a loaded guest.
#      PAIR_REAP_TIMEOUT (default 30): pair_reap's bound.
#      PAIR_NAME (default: the sourcing script's name): the prefix of the messages.

pair_name() { echo "${PAIR_NAME:-$(basename "$0")}"; }

pair_alive() { kill -0 "$1" 2>/dev/null; }

pair_stop() {
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < 20; i++)); do pair_alive "$pid" || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return 0
}

pair_listen() {
  local pid=$1 log=$2 text=$3 secs=${4:-${PAIR_LISTEN_TIMEOUT:-60}} i
  for ((i = 0; i < secs * 10; i++)); do
    grep -qF -- "$text" "$log" 2>/dev/null && return 0
    if ! pair_alive "$pid"; then
      # It may have printed the line and exited between the two checks.
      grep -qF -- "$text" "$log" 2>/dev/null && return 0
      local rc=0; wait "$pid" 2>/dev/null || rc=$?
      echo "$(pair_name): the server exited (status $rc) before it printed '$text'; the end of its log ($log):" >&2
      tail -n 20 "$log" >&2
      return 1
    fi
    sleep 0.1
  done
  pair_stop "$pid"
  echo "$(pair_name): the server did not print '$text' within $secs s (PAIR_LISTEN_TIMEOUT): stopped; the end of its log ($log):" >&2
  tail -n 20 "$log" >&2
  return 1
}

pair_reap() {
  local pid=$1 secs=${2:-${PAIR_REAP_TIMEOUT:-30}} i
  for ((i = 0; i < secs * 10; i++)); do
    if ! pair_alive "$pid"; then
      wait "$pid"
      return
    fi
    sleep 0.1
  done
  echo "$(pair_name): the server did not exit within $secs s after its client: killed" >&2
  pair_stop "$pid"
  return 124
}
