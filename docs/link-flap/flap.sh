#!/bin/sh
# docs/link-flap/flap.sh CASE...: the link-flap study, run on host B inside harness/two-host:
#   harness/two-host -- docs/link-flap/flap.sh a b c d a b c d
# a: rping -c mid-transfer, B's link down, rping SIGKILLed while down (kernel teardown), link up
# b: rping -c connected and idle (SIGSTOPped), link down, up, port ACTIVE, then SIGKILL
# d: the crate's streaming client mid-transfer (A drops its ACKs so WRs stay in flight), SIGSTOPped,
#    link down, send errors while down, link up, port ACTIVE, then SIGKILL (teardown deferred)
# c: no connection at all: link down, up
# After each: can B connect (rping) to a fresh server on A? If not, rxe0 is re-created.
set -u
W=/work/wt-flap
P=$W/harness/peer
A=$RDMA_PEER_ADDR
T=/sys/kernel/tracing
CLIENT=$W/target/debug/examples/perf_client
[ -e $T/events/ib_mad ] || mount -t tracefs nodev $T
st() { cat /sys/class/infiniband/rxe0/ports/1/state; }
wait_state() { i=0; while ! st | grep -q "$1"; do i=$((i+1)); [ $i -gt 1200 ] && { echo "port not $1 after 60 s: $(st)"; return 1; }; sleep 0.05; done; }
cnt() { cat /sys/class/infiniband/rxe0/ports/1/hw_counters/$1; }
trace_on() { echo 1 > $T/events/ib_mad/enable; : > $T/trace; }
trace_check() {
  f=$(grep ib_mad_send_done_handler $T/trace | grep QP1 | grep -c "SEND WC Status 2 ")
  all=$(grep ib_mad_send_done_handler $T/trace | grep -c QP1)
  echo "  qp1 send-done lines: $all, failed (status 2): $f"
  echo 0 > $T/events/ib_mad/enable
}
n=0
wait_listen() { i=0; while ! $P run -- sh -c "rdma res show cm_id | grep -q 'src-addr $A:$1 '" >/dev/null 2>&1; do i=$((i+1)); [ $i -gt 200 ] && { echo "no listener on A:$1"; return 1; }; done; }
can_connect() {
  n=$((n+1)); port=$((7900+n))
  $P start srv$n.$$ -- rping -s -a $A -p $port -C 3 -v
  wait_listen $port
  t0=$(date +%s.%N)
  if timeout 40 rping -c -a $A -p $port -C 3 -v > /tmp/cc.out 2>&1; then r=ok; else r="FAIL rc=$?"; fi
  t1=$(date +%s.%N)
  echo "  connect after: $r ($(echo "$t1 - $t0" | bc) s) $(tail -1 /tmp/cc.out)"
  $P kill srv$n.$$ KILL >/dev/null 2>&1
  [ "$r" = ok ]
}
repair() { rdma link delete rxe0 && rdma link add rxe0 type rxe netdev eth0 && wait_state ACTIVE; echo "  repaired (rxe0 re-created)"; }
after() { trace_check; if ! can_connect; then repair; can_connect || echo "  STILL FAILING after repair"; fi; }

case_a() {
  n=$((n+1)); port=$((7900+n))
  $P start asrv$n.$$ -- rping -s -a $A -p $port -v
  wait_listen $port
  rping -c -a $A -p $port -v > /tmp/a.out 2>&1 & pid=$!
  i=0; while [ "$(grep -c 'ping data' /tmp/a.out)" -lt 50 ]; do i=$((i+1)); [ $i -gt 1200 ] && { echo "rping not pinging"; break; }; sleep 0.05; done
  trace_on; e0=$(cnt send_err)
  ip link set eth0 down; wait_state DOWN
  if kill -0 $pid 2>/dev/null; then alive=alive; else alive="already exited"; fi
  kill -KILL $pid 2>/dev/null; wait $pid; rc=$?
  # let QP1's send (if any) complete while down: wait for a send-done line, bounded
  i=0; while ! grep -q ib_mad_send_done_handler $T/trace; do i=$((i+1)); [ $i -gt 100 ] && break; sleep 0.05; done
  echo "  rping at SIGKILL: $alive (rc $rc); send_err +$(( $(cnt send_err) - e0 ))"
  ip link set eth0 up; wait_state ACTIVE
  $P kill asrv$n.$$ KILL >/dev/null 2>&1
  after
}
case_b() {
  n=$((n+1)); port=$((7900+n))
  $P start bsrv$n.$$ -- rping -s -a $A -p $port -v
  wait_listen $port
  rping -c -a $A -p $port -v > /tmp/b.out 2>&1 & pid=$!
  i=0; while [ "$(grep -c 'ping data' /tmp/b.out)" -lt 50 ]; do i=$((i+1)); [ $i -gt 1200 ] && { echo "rping not pinging"; break; }; sleep 0.05; done
  kill -STOP $pid
  i=0; while ! grep -q '^State:.*T' /proc/$pid/status; do i=$((i+1)); [ $i -gt 200 ] && break; sleep 0.05; done
  trace_on; e0=$(cnt send_err)
  ip link set eth0 down; wait_state DOWN
  ip link set eth0 up; wait_state ACTIVE
  echo "  idle while down: send_err +$(( $(cnt send_err) - e0 ))"
  kill -KILL $pid; wait $pid
  $P kill bsrv$n.$$ KILL >/dev/null 2>&1
  after
}
case_d() {
  n=$((n+1)); port=$((7900+n))
  $P start dsrv$n.$$ -- $W/target/debug/examples/perf_server -a $A -p $port --timeout 30
  wait_listen $port
  $CLIENT -a $A -p $port --mode write --size 65536 --iters 10000000 --timeout 30 > /tmp/d.out 2>&1 & pid=$!
  i=0; while ! grep -q 'Connection established' /tmp/d.out; do i=$((i+1)); [ $i -gt 1200 ] && { echo "client not connected"; break; }; sleep 0.05; done
  # A drops everything it sends (its ACKs): B's WRITEs stay in flight, retried by rxe
  $P run -- tc qdisc replace dev eth0 root netem loss 100% >/dev/null
  kill -STOP $pid
  i=0; while ! grep -q '^State:.*T' /proc/$pid/status; do i=$((i+1)); [ $i -gt 200 ] && break; sleep 0.05; done
  trace_on; e0=$(cnt send_err)
  ip link set eth0 down; wait_state DOWN
  # wait (bounded) until rxe has tried to send on the down link (the in-flight WRITEs' retries)
  i=0; while [ $(cnt send_err) -eq $e0 ]; do i=$((i+1)); [ $i -gt 200 ] && break; sleep 0.05; done
  echo "  mid-transfer while down: send_err +$(( $(cnt send_err) - e0 ))"
  ip link set eth0 up; wait_state ACTIVE
  $P run -- tc qdisc del dev eth0 root >/dev/null
  kill -KILL $pid; wait $pid
  $P kill dsrv$n.$$ KILL >/dev/null 2>&1
  after
}
case_c() {
  trace_on
  ip link set eth0 down; wait_state DOWN
  ip link set eth0 up; wait_state ACTIVE
  after
}
dmesg -n 8 2>/dev/null; echo "kernel $(uname -r)"
can_connect || echo "baseline connect failed"
for c in "$@"; do
  echo "== case $c ($(date -u +%T))"
  case_$c
done
echo "== end ($(date -u +%T))"
