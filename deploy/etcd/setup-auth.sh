#!/usr/bin/env bash
# Turn on etcd authentication for elasticd: a root user, and an `elasticd` user whose
# role may read and write only the keys under /elasticd/ (every job's prefix).
#
#   ETCD_ROOT_PASSWORD=... ELASTICD_ETCD_PASSWORD=... deploy/etcd/setup-auth.sh ENDPOINTS TLS_DIR
#   e.g. deploy/etcd/setup-auth.sh 10.0.0.11:2379,10.0.0.12:2379,10.0.0.13:2379 ./etcd-out/tls
#
# ENDPOINTS: comma-separated HOST:PORT of the members (TLS). TLS_DIR: ca.pem, client.pem and
# client-key.pem from make-certs.sh / cluster.sh. Optional environment: ETCDCTL (the etcdctl
# binary; default: etcdctl on PATH), ELASTICD_KEY_PREFIX (the [etcd] key_prefix; /elasticd).
#
# Idempotent: run it again to rotate either password; users and roles that exist are kept.
# Passwords go to etcdctl on stdin or in its environment, never on a command line that
# `ps` would show to other users.
set -euo pipefail
usage="usage: ETCD_ROOT_PASSWORD=... ELASTICD_ETCD_PASSWORD=... setup-auth.sh ENDPOINTS TLS_DIR"
endpoints=${1:?$usage}
tls=${2:?$usage}
: "${ETCD_ROOT_PASSWORD:?$usage}" "${ELASTICD_ETCD_PASSWORD:?$usage}"
etcdctl=${ETCDCTL:-etcdctl}
root=${ELASTICD_KEY_PREFIX:-/elasticd}
prefix="${root%/}/"   # the trailing slash keeps /elasticd-other/ out of the grant
for f in ca.pem client.pem client-key.pem; do
  [ -r "$tls/$f" ] || { echo "setup-auth.sh: $tls/$f is missing or unreadable" >&2; exit 2; }
done

# With client-cert-auth on, a request without a user name is made as the certificate's CN
# ("elasticd"), which may not administer anything once auth is on: always act as root.
# Before auth is enabled the server ignores these credentials, so the script can be re-run.
export ETCDCTL_API=3 ETCDCTL_USER=root ETCDCTL_PASSWORD=$ETCD_ROOT_PASSWORD
ctl() {  # etcdctl logs a warning per retried call (e.g. "auth not enabled"): show on failure only
  local err rc=0
  err=$(mktemp)
  "$etcdctl" --endpoints="$endpoints" --cacert="$tls/ca.pem" --cert="$tls/client.pem" \
    --key="$tls/client-key.pem" --dial-timeout=5s --command-timeout=10s "$@" 2>"$err" || rc=$?
  [ "$rc" -eq 0 ] || cat "$err" >&2
  rm -f "$err"
  return "$rc"
}
exists() {  # exists user|role NAME
  ctl "$1" get "$2" >/dev/null 2>&1
}
set_user() {  # set_user NAME PASSWORD: create it, or change its password
  if exists user "$1"; then
    printf '%s\n' "$2" | ctl user passwd "$1" --interactive=false >/dev/null
  else
    printf '%s\n' "$2" | ctl user add "$1" --interactive=false >/dev/null
  fi
}

if ! ctl user list >/dev/null; then
  echo "setup-auth.sh: cannot act as root at $endpoints: is the cluster up, and is" \
    "ETCD_ROOT_PASSWORD the root password (if auth is already on)?" >&2
  exit 1
fi
set_user root "$ETCD_ROOT_PASSWORD"
ctl user grant-role root root >/dev/null
exists role elasticd || ctl role add elasticd >/dev/null
ctl role grant-permission --prefix=true elasticd readwrite "$prefix" >/dev/null
set_user elasticd "$ELASTICD_ETCD_PASSWORD"
ctl user grant-role elasticd elasticd >/dev/null
ctl auth enable >/dev/null
echo "etcd auth enabled at $endpoints: user elasticd may read and write $prefix only"
