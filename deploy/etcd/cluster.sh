#!/usr/bin/env bash
# Write the TLS certificates and one etcd environment file per member of an etcd cluster.
#
#   deploy/etcd/cluster.sh OUT_DIR NAME=HOST[:CLIENT_PORT:PEER_PORT] ...
#   e.g. deploy/etcd/cluster.sh ./etcd-out etcd-a=10.0.0.11 etcd-b=10.0.0.12 etcd-c=10.0.0.13
#
# Writes OUT_DIR/tls/ (make-certs.sh: ca.pem, server-<HOST>.pem per member, client.pem for
# elasticd; peer-ca.pem and peer-<HOST>.pem per member for the peer port) and OUT_DIR/<NAME>.env, the EnvironmentFile of deploy/systemd/etcd-member.service
# on that member (install it as /etc/etcd/etcd.env). etcd reads every flag from ETCD_*
# variables, so the unit's ExecStart stays the same on every member.
#
# Environment (all optional):
#   ETCD_TLS_DIR        where the members will find their certificates   (/etc/etcd/tls)
#   ETCD_DATA_DIR       the member's data dir (the unit's StateDirectory) (/var/lib/etcd)
#   ETCD_CLUSTER_TOKEN  unique per cluster, so two clusters never merge    (random)
#
# Client and peer traffic are TLS with client-certificate auth, each with its own CA: a
# client needs a certificate of tls/ca.pem, a peer one of tls/peer-ca.pem with
# CN=elasticd-etcd-peer, so an elasticd node's client certificate is refused on the peer
# port. Re-running keeps the CAs.
set -euo pipefail
usage="usage: cluster.sh OUT_DIR NAME=HOST[:CLIENT_PORT:PEER_PORT] ... (3 members recommended)"
out=${1:?$usage}
shift
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tls_dir=${ETCD_TLS_DIR:-/etc/etcd/tls}
data_dir=${ETCD_DATA_DIR:-/var/lib/etcd}
token=${ETCD_CLUSTER_TOKEN:-elasticd-etcd-$(openssl rand -hex 6)}

names=() hosts=() client_ports=() peer_ports=()
for spec in "$@"; do
  if [[ ! $spec =~ ^([a-z0-9][a-z0-9-]*)=([A-Za-z0-9.-]+)(:([0-9]+):([0-9]+))?$ ]]; then
    echo "cluster.sh: bad member '$spec'; write NAME=HOST or NAME=HOST:CLIENT_PORT:PEER_PORT" >&2
    exit 2
  fi
  names+=("${BASH_REMATCH[1]}")
  hosts+=("${BASH_REMATCH[2]}")
  client_ports+=("${BASH_REMATCH[4]:-2379}")
  peer_ports+=("${BASH_REMATCH[5]:-2380}")
done
n=${#names[@]}
if [ $((n % 2)) -eq 0 ]; then
  # An even member count tolerates no more failures than the odd count below it.
  echo "cluster.sh: warning: $n members; use an odd number (3 or 5)" >&2
fi
if [ "$(printf '%s\n' "${names[@]}" | sort -u | wc -l)" -ne "$n" ]; then
  echo "cluster.sh: member names must be unique" >&2
  exit 2
fi

mkdir -p "$out"
"$here/make-certs.sh" "$out/tls" "${hosts[@]}" >/dev/null

initial_cluster=""
endpoints=""
for i in "${!names[@]}"; do
  initial_cluster+="${initial_cluster:+,}${names[$i]}=https://${hosts[$i]}:${peer_ports[$i]}"
  endpoints+="${endpoints:+, }\"${hosts[$i]}:${client_ports[$i]}\""
done

listen_host() {  # etcd binds only to IP addresses: a DNS-named member listens on all of them
  if [[ $1 =~ ^[0-9.]+$ ]]; then echo "$1"; else echo "0.0.0.0"; fi
}

for i in "${!names[@]}"; do
  name=${names[$i]} host=${hosts[$i]} cport=${client_ports[$i]} pport=${peer_ports[$i]}
  bind=$(listen_host "$host")
  listen_client="https://$bind:$cport"
  # Also listen on loopback so etcdctl on the member itself works without the public address.
  if [ "$bind" != 127.0.0.1 ] && [ "$bind" != 0.0.0.0 ]; then
    listen_client+=",https://127.0.0.1:$cport"
  fi
  cat >"$out/$name.env" <<ENV
# etcd member $name ($host) of a $n-member cluster; written by deploy/etcd/cluster.sh.
# Install as /etc/etcd/etcd.env on $host, with ca.pem, server-$host.pem, server-$host-key.pem,
# peer-ca.pem, peer-$host.pem and peer-$host-key.pem from tls/ in $tls_dir (keys readable by
# the etcd user only).
ETCD_NAME=$name
ETCD_DATA_DIR=$data_dir
ETCD_LISTEN_CLIENT_URLS=$listen_client
ETCD_ADVERTISE_CLIENT_URLS=https://$host:$cport
ETCD_LISTEN_PEER_URLS=https://$bind:$pport
ETCD_INITIAL_ADVERTISE_PEER_URLS=https://$host:$pport
ETCD_INITIAL_CLUSTER=$initial_cluster
# Only read when the data dir is empty (first start); a restarted member ignores it.
ETCD_INITIAL_CLUSTER_STATE=new
ETCD_INITIAL_CLUSTER_TOKEN=$token
# Clients (elasticd daemons, torchrun agents, etcdctl) must present a certificate of our CA.
ETCD_CERT_FILE=$tls_dir/server-$host.pem
ETCD_KEY_FILE=$tls_dir/server-$host-key.pem
ETCD_TRUSTED_CA_FILE=$tls_dir/ca.pem
ETCD_CLIENT_CERT_AUTH=true
# Peers authenticate each other with their own CA, and must carry the peer CN: a client
# certificate (signed by ca.pem) cannot speak raft to a member.
ETCD_PEER_CERT_FILE=$tls_dir/peer-$host.pem
ETCD_PEER_KEY_FILE=$tls_dir/peer-$host-key.pem
ETCD_PEER_TRUSTED_CA_FILE=$tls_dir/peer-ca.pem
ETCD_PEER_CLIENT_CERT_AUTH=true
ETCD_PEER_CERT_ALLOWED_CN=elasticd-etcd-peer
# Rendezvous rounds and node records rewrite a few keys all the time: without compaction
# the history grows until the 2 GiB quota raises the NOSPACE alarm and etcd refuses writes.
ETCD_AUTO_COMPACTION_MODE=periodic
ETCD_AUTO_COMPACTION_RETENTION=1h
ETCD_LOGGER=zap
ETCD_LOG_LEVEL=info
ENV
  chmod 0644 "$out/$name.env"
done

cat <<MSG
wrote $out/tls/ and ${names[*]/%/.env} in $out
elasticd nodes: copy tls/ca.pem, tls/client.pem, tls/client-key.pem to /etc/elasticd/tls/ and set
  [etcd] endpoints = [$endpoints]
(never the peer-* files: they stay on the etcd members), then, once the cluster is up, per job:
  deploy/etcd/setup-auth.sh "${endpoints//[\" ]/}" $out/tls JOB
MSG
