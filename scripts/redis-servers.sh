#!/usr/bin/env bash
# Redis servers for the tests, on free loopback ports in a temporary directory:
#   * a standalone server, no auth                -> KVBM_TEST_REDIS_URL
#   * a standalone server with requirepass        -> KVBM_TEST_REDIS_AUTH_URL  (redis://:pass@…)
#     and an ACL user `kvbm` on the same server,  -> KVBM_TEST_REDIS_ACL_URL   (redis://kvbm:pass@…)
#     allowed only the commands and keys the tier uses
#   * a 3-node Redis Cluster (3 primaries, no replicas)
#                                                 -> KVBM_TEST_REDIS_CLUSTER_URL (redis+cluster://h:p,h:p,h:p)
#   * a 3-node cluster on TLS only (clients and cluster bus) wanting client certificates, the
#     same CA
#                                                 -> KVBM_TEST_REDIS_TLS_CLUSTER_URL (rediss+cluster://…)
#   * a TLS-only server whose certificate a private test CA signed
#                                                 -> KVBM_TEST_REDIS_TLS_URL   (rediss://…)
#   * a TLS-only server that also wants a client certificate from that CA (tls-auth-clients yes)
#                                                 -> KVBM_TEST_REDIS_MTLS_URL  (rediss://…)
#     with the PEM files in                       -> KVBM_TEST_REDIS_TLS_DIR: ca.pem, client.pem,
#     client.key, other-ca.pem (a CA that signed nothing here), other-client.pem/.key (a client
#     certificate from that other CA)
# No persistence (`--save ""`, no AOF). Needs redis-server and redis-cli built with TLS (Debian's
# are: apt-get install redis-server) and openssl.
#
# Two ways to use it:
#   source scripts/redis-servers.sh      # starts them, exports the URLs, stops them on EXIT
#   scripts/redis-servers.sh CMD ARGS…   # starts them, runs CMD with the URLs, stops them
# `kvbm_redis_stop` stops them early.

# A free loopback port P whose P+10000 (a cluster node's bus port) is free too; P <= 55535. Ports
# handed out before (recorded in $KVBM_REDIS_DIR/ports, with their bus ports) are never handed out
# again, even while their server is still starting.
kvbm_redis_free_port() {
  KVBM_REDIS_PORTS_FILE="${KVBM_REDIS_DIR:?}/ports" python3 - <<'PY'
import os, random, socket
path = os.environ["KVBM_REDIS_PORTS_FILE"]
try:
    taken = {int(w) for w in open(path).read().split()}
except FileNotFoundError:
    taken = set()
def free(p):
    if p in taken:
        return False
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        s.close()
for _ in range(1000):
    p = random.randint(20000, 45000)
    if free(p) and free(p + 10000):
        with open(path, "a") as f:
            f.write(f"{p} {p + 10000}\n")
        print(p)
        break
else:
    raise SystemExit("no free port pair found")
PY
}

# kvbm_redis_wait PORT [AUTH ARGS…]: until it answers PING (10 s at most).
kvbm_redis_wait() {
  local port=$1; shift
  for _ in $(seq 100); do
    if redis-cli -h 127.0.0.1 -p "$port" --no-auth-warning "$@" ping 2>/dev/null | grep -q PONG; then
      return 0
    fi
    sleep 0.1
  done
  echo "redis-servers.sh: redis-server on port $port did not start; its log:" >&2
  cat "$KVBM_REDIS_DIR"/*"$port"*.log >&2 2>/dev/null || true
  return 1
}

# kvbm_redis_server NAME PORT [EXTRA CONFIG LINES…]: starts one server in the background (a child
# of this shell, so that it is reaped when stopped).
kvbm_redis_server() {
  local name=$1 port=$2; shift 2
  local dir="$KVBM_REDIS_DIR/$name-$port"
  mkdir -p "$dir"
  {
    echo "port $port"
    echo "bind 127.0.0.1"
    echo "daemonize no"
    echo "dir $dir"
    echo "logfile $KVBM_REDIS_DIR/$name-$port.log"
    echo 'save ""'
    echo "appendonly no"
    printf '%s\n' "$@"
  } > "$dir/redis.conf"
  redis-server "$dir/redis.conf" >/dev/null 2>&1 &
  echo $! > "$dir/redis.pid"
}

# kvbm_redis_certs DIR: a test CA, a server certificate for 127.0.0.1/localhost, a client
# certificate, and a second CA with its own client certificate (EC P-256, PKCS#8 keys, 2 days).
kvbm_redis_certs() {
  local d=$1 log="$1/openssl.log" ca name
  # Every step is checked (`set -e` does nothing in a function called left of `||`); openssl's
  # messages go to openssl.log and are shown on failure.
  for ca in ca other-ca; do
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$ca.key" >>"$log" 2>&1 &&
      openssl req -x509 -new -key "$d/$ca.key" -days 2 -subj "/CN=kvbm test $ca" -out "$d/$ca.pem" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        >>"$log" 2>&1 || { cat "$log" >&2; return 1; }
  done
  # kvbm_redis_leaf NAME CA SUBJECT EXTENSIONS
  kvbm_redis_leaf() {
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$1.key" >>"$log" 2>&1 &&
      openssl req -new -key "$d/$1.key" -subj "/CN=$3" -out "$d/$1.csr" >>"$log" 2>&1 &&
      printf '%s\n' "$4" >"$d/$1.ext" &&
      openssl x509 -req -in "$d/$1.csr" -CA "$d/$2.pem" -CAkey "$d/$2.key" -CAcreateserial \
        -days 2 -extfile "$d/$1.ext" -out "$d/$1.pem" >>"$log" 2>&1 || { cat "$log" >&2; return 1; }
  }
  kvbm_redis_leaf server ca "127.0.0.1" "subjectAltName=IP:127.0.0.1,DNS:localhost
basicConstraints=CA:FALSE
extendedKeyUsage=serverAuth,clientAuth" || return 1
  kvbm_redis_leaf client ca "kvbm-client" "basicConstraints=CA:FALSE
extendedKeyUsage=clientAuth" || return 1
  kvbm_redis_leaf other-client other-ca "kvbm-other-client" "basicConstraints=CA:FALSE
extendedKeyUsage=clientAuth" || return 1
  for name in ca other-ca server client other-client; do
    [ -s "$d/$name.pem" ] && [ -s "$d/$name.key" ] || {
      echo "redis-servers.sh: openssl made no $name.pem / $name.key" >&2
      return 1
    }
  done
  chmod 600 "$d"/*.key
}

kvbm_redis_stop() {
  [ -n "${KVBM_REDIS_DIR:-}" ] && [ -d "$KVBM_REDIS_DIR" ] || return 0
  local pidfile pid
  for pidfile in "$KVBM_REDIS_DIR"/*/redis.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile" 2>/dev/null) || continue
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  done
  # Servers started from a subshell (the clusters) are not our children: wait until they are gone
  # (5 s at most) so that nothing outlives the caller.
  for pidfile in "$KVBM_REDIS_DIR"/*/redis.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile" 2>/dev/null) || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  rm -rf "$KVBM_REDIS_DIR"
  unset KVBM_REDIS_DIR
}

# kvbm_redis_cluster NAME [REDIS-CLI ARGS… [-- EXTRA CONFIG LINES…]]: a 3-node cluster (3
# primaries); prints its nodes as h:p,h:p,h:p once every node sees the whole slot map. With
# config lines, the nodes listen on TLS only (`port 0`, `tls-port`).
kvbm_redis_cluster() {
  local name=$1; shift
  local cli=() conf=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do cli+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  conf=("$@")
  local ports=() p
  for _ in 1 2 3; do
    p=$(kvbm_redis_free_port)
    if [ ${#conf[@]} -gt 0 ]; then
      kvbm_redis_server "$name" "$p" "port 0" "tls-port $p" "${conf[@]}" "cluster-enabled yes" \
        "cluster-config-file nodes.conf" "cluster-node-timeout 2000" || return 1
    else
      kvbm_redis_server "$name" "$p" "cluster-enabled yes" "cluster-config-file nodes.conf" \
        "cluster-node-timeout 2000" || return 1
    fi
    ports+=("$p")
  done
  for p in "${ports[@]}"; do kvbm_redis_wait "$p" "${cli[@]}" || return 1; done
  local log="$KVBM_REDIS_DIR/$name-create.log"
  timeout 60 redis-cli "${cli[@]}" --cluster create "127.0.0.1:${ports[0]}" "127.0.0.1:${ports[1]}" \
    "127.0.0.1:${ports[2]}" --cluster-replicas 0 --cluster-yes >"$log" 2>&1 || {
    echo "redis-servers.sh: redis-cli --cluster create ($name) failed:" >&2
    cat "$log" >&2
    return 1
  }
  # Every node must see the whole slot map before the tests use it.
  local ok
  for _ in $(seq 100); do
    ok=0
    for p in "${ports[@]}"; do
      redis-cli -h 127.0.0.1 -p "$p" "${cli[@]}" cluster info 2>/dev/null | grep -q 'cluster_state:ok' && ok=$((ok + 1))
    done
    [ "$ok" -eq 3 ] && break
    sleep 0.1
  done
  if [ "$ok" -ne 3 ]; then
    echo "redis-servers.sh: the cluster ($name) did not reach cluster_state:ok" >&2
    return 1
  fi
  echo "127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
}

kvbm_redis_start() {
  if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "redis-servers.sh: redis-server/redis-cli not found (apt-get install redis-server)" >&2
    return 1
  fi
  if ! command -v openssl >/dev/null; then
    echo "redis-servers.sh: openssl not found (apt-get install openssl)" >&2
    return 1
  fi
  KVBM_REDIS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvbm-redis.XXXXXX")
  export KVBM_REDIS_DIR
  local pass=kvbm-test-pass upass=kvbm-user-pass
  local p_plain p_auth
  p_plain=$(kvbm_redis_free_port)
  kvbm_redis_server standalone "$p_plain" || return 1
  p_auth=$(kvbm_redis_free_port)
  # `kvbm`: every command on the keys the tier uses and nothing else (the least a deployment
  # needs; docs/deployment.md).
  kvbm_redis_server auth "$p_auth" "requirepass $pass" \
    "user kvbm on >$upass resetkeys ~kvbm:* resetchannels -@all +ping +exists +getrange +set +select +cluster|slots" \
    || return 1
  local tls="$KVBM_REDIS_DIR/tls" p_tls p_mtls
  mkdir -p "$tls"
  kvbm_redis_certs "$tls" || { echo "redis-servers.sh: openssl could not make the test certificates" >&2; return 1; }
  p_tls=$(kvbm_redis_free_port)
  # Also on 127.0.0.2, a loopback address its certificate does not name (a host-name mismatch).
  kvbm_redis_server tls "$p_tls" "port 0" "tls-port $p_tls" "tls-cert-file $tls/server.pem" \
    "tls-key-file $tls/server.key" "tls-ca-cert-file $tls/ca.pem" "tls-auth-clients no" \
    "bind 127.0.0.1 127.0.0.2" || return 1
  p_mtls=$(kvbm_redis_free_port)
  kvbm_redis_server mtls "$p_mtls" "port 0" "tls-port $p_mtls" "tls-cert-file $tls/server.pem" \
    "tls-key-file $tls/server.key" "tls-ca-cert-file $tls/ca.pem" "tls-auth-clients yes" || return 1
  kvbm_redis_wait "$p_plain" || return 1
  kvbm_redis_wait "$p_auth" -a "$pass" || return 1
  kvbm_redis_wait "$p_tls" --tls --cacert "$tls/ca.pem" || return 1
  kvbm_redis_wait "$p_mtls" --tls --cacert "$tls/ca.pem" --cert "$tls/client.pem" --key "$tls/client.key" || return 1
  local plain_nodes tls_nodes
  plain_nodes=$(kvbm_redis_cluster cluster) || return 1
  # The TLS cluster wants client certificates (tls-auth-clients yes); its nodes also talk TLS on
  # the cluster bus (tls-cluster yes), with the server certificate as their client certificate.
  tls_nodes=$(kvbm_redis_cluster tlscluster --tls --cacert "$tls/ca.pem" --cert "$tls/client.pem" \
    --key "$tls/client.key" -- "tls-cluster yes" "tls-cert-file $tls/server.pem" \
    "tls-key-file $tls/server.key" "tls-ca-cert-file $tls/ca.pem" "tls-auth-clients yes") || return 1
  export KVBM_TEST_REDIS_URL="redis://127.0.0.1:$p_plain/0"
  export KVBM_TEST_REDIS_AUTH_URL="redis://:$pass@127.0.0.1:$p_auth/0"
  export KVBM_TEST_REDIS_ACL_URL="redis://kvbm:$upass@127.0.0.1:$p_auth/0"
  export KVBM_TEST_REDIS_CLUSTER_URL="redis+cluster://$plain_nodes"
  export KVBM_TEST_REDIS_TLS_CLUSTER_URL="rediss+cluster://$tls_nodes"
  export KVBM_TEST_REDIS_TLS_URL="rediss://127.0.0.1:$p_tls/0"
  export KVBM_TEST_REDIS_MTLS_URL="rediss://127.0.0.1:$p_mtls/0"
  export KVBM_TEST_REDIS_TLS_DIR="$tls"
  echo "redis-servers.sh: standalone $KVBM_TEST_REDIS_URL, auth on port $p_auth, cluster $KVBM_TEST_REDIS_CLUSTER_URL, TLS $KVBM_TEST_REDIS_TLS_URL, mutual TLS $KVBM_TEST_REDIS_MTLS_URL, TLS cluster $KVBM_TEST_REDIS_TLS_CLUSTER_URL"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  # Sourced: start, and stop on the caller's exit.
  kvbm_redis_start || { kvbm_redis_stop; return 1; }
  trap kvbm_redis_stop EXIT
else
  set -euo pipefail
  trap kvbm_redis_stop EXIT
  kvbm_redis_start
  if [ $# -gt 0 ]; then
    "$@"
  else
    echo "usage: source $0, or $0 CMD ARGS… (servers stop when CMD ends)" >&2
  fi
fi
