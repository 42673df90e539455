#!/usr/bin/env bash
# Turn on etcd authentication for one elasticd job: a root user, and for the job a user
# `elasticd-<JOB>` whose role `elasticd-<JOB>` may read and write only that job's keys
# (/elasticd/<JOB>/). One job's nodes (and its workers, should they get hold of the
# credentials) cannot read or break another job's rendezvous. Run it once per job.
#
#   ETCD_ROOT_PASSWORD=... ELASTICD_ETCD_PASSWORD=... deploy/etcd/setup-auth.sh ENDPOINTS TLS_DIR JOB
#   e.g. deploy/etcd/setup-auth.sh 10.0.0.11:2379,10.0.0.12:2379,10.0.0.13:2379 ./etcd-out/tls llm-7b
#
# ENDPOINTS: comma-separated HOST:PORT of the members (TLS). TLS_DIR: ca.pem, client.pem and
# client-key.pem from make-certs.sh / cluster.sh. JOB: the job id ([job] id in the config).
# ELASTICD_ETCD_PASSWORD: the password of user elasticd-<JOB>; the job's nodes then set
# [etcd] user = "elasticd-<JOB>". Optional environment: ETCDCTL (the etcdctl binary;
# default: etcdctl on PATH), ELASTICD_KEY_PREFIX (the [etcd] key_prefix; /elasticd).
#
# No user is named after the client certificate's CN (elasticd): with client-cert-auth a
# request with the certificate and no password would act as that user, so the certificate
# alone grants nothing once auth is on.
#
# Idempotent: run it again to rotate either password; users and roles that exist are kept.
# Passwords go to etcdctl on stdin or in its environment, never on a command line that
# `ps` would show to other users.
set -euo pipefail
usage="usage: ETCD_ROOT_PASSWORD=... ELASTICD_ETCD_PASSWORD=... setup-auth.sh ENDPOINTS TLS_DIR JOB"
endpoints=${1:?$usage}
tls=${2:?$usage}
job=${3:?$usage}
: "${ETCD_ROOT_PASSWORD:?$usage}" "${ELASTICD_ETCD_PASSWORD:?$usage}"
etcdctl=${ETCDCTL:-etcdctl}
root=${ELASTICD_KEY_PREFIX:-/elasticd}
# The same rule as elasticd's job ids (rendezvous/keys.py): it becomes a key prefix and a name.
if [[ ! $job =~ ^[a-z0-9][a-z0-9._-]{0,127}$ ]]; then
  echo "setup-auth.sh: job id '$job' is not valid: use 1-128 characters of a-z, 0-9, '.', '_'" \
    "or '-', starting with a letter or digit" >&2
  exit 2
fi
# The trailing slash keeps job "a" out of job "a-2"'s keys (/elasticd/a/ vs /elasticd/a-2/).
prefix="${root%/}/$job/"
name="elasticd-$job"
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
exists role "$name" || ctl role add "$name" >/dev/null
ctl role grant-permission --prefix=true "$name" readwrite "$prefix" >/dev/null
set_user "$name" "$ELASTICD_ETCD_PASSWORD"
ctl user grant-role "$name" "$name" >/dev/null
ctl auth enable >/dev/null
if exists user elasticd; then
  # Left by the earlier version of this script: one user for every job, and the user the
  # client certificate's CN maps to. Not removed here, so running jobs keep working.
  echo "setup-auth.sh: warning: user 'elasticd' (all of ${root%/}/, and what the client" \
    "certificate alone acts as) still exists; once every job has its own user, remove it:" \
    "etcdctl user delete elasticd" >&2
fi
echo "etcd auth enabled at $endpoints: user $name may read and write $prefix only"
