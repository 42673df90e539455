#!/usr/bin/env bash
# Make the TLS certificates of an etcd cluster and its clients (elasticd nodes).
#
#   deploy/etcd/make-certs.sh OUT_DIR [SERVER_NAME_OR_IP ...]
#
# Two CAs, so that a certificate for one port is worthless on the other:
#   client side: ca.pem (+ca-key.pem) signs one server cert per name for the client port
#     (server-<name>.pem, server-<name>-key.pem; valid for that name plus 127.0.0.1 and
#     localhost) and client.pem/client-key.pem (CN=elasticd) for the elasticd nodes;
#   peer side: peer-ca.pem (+peer-ca-key.pem) signs one peer cert per name
#     (peer-<name>.pem, peer-<name>-key.pem; CN=elasticd-etcd-peer, which the members
#     also require with --peer-cert-allowed-cn). Members trust only peer-ca.pem on the
#     peer port, so a node's client certificate cannot join or read the raft traffic.
# Only ca.pem, client.pem and client-key.pem go to elasticd nodes; the peer files stay on
# the etcd members. Keys are 0600. Re-running keeps existing CAs so old certificates stay
# valid.
set -euo pipefail
out=${1:?usage: make-certs.sh OUT_DIR [SERVER_NAME_OR_IP ...]}
shift
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(127.0.0.1)
days=${CERT_DAYS:-825}
mkdir -p "$out"
umask 077

make_ca() {  # make_ca FILE_STEM SUBJECT_CN
  if [ ! -f "$out/$1.pem" ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=$2" \
      -keyout "$out/$1-key.pem" -out "$out/$1.pem" 2>/dev/null
  fi
}
make_ca ca elasticd-etcd-ca
make_ca peer-ca elasticd-etcd-peer-ca

sign() {  # sign NAME SUBJECT_CN SAN EXT_USAGE [CA_STEM]
  local name=$1 cn=$2 san=$3 usage=$4 ca=${5:-ca}
  local ext
  ext=$(mktemp)
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nkeyUsage=digitalSignature,keyEncipherment\n' \
    "$san" "$usage" >"$ext"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" \
    -keyout "$out/$name-key.pem" -out "$out/$name.csr" 2>/dev/null
  openssl x509 -req -in "$out/$name.csr" -CA "$out/$ca.pem" -CAkey "$out/$ca-key.pem" \
    -CAcreateserial -days "$days" -extfile "$ext" -out "$out/$name.pem" 2>/dev/null
  rm -f "$out/$name.csr" "$ext"
}

for n in "${names[@]}"; do
  if [[ $n =~ ^[0-9.]+$ ]]; then san="IP:$n,IP:127.0.0.1,DNS:localhost"
  else san="DNS:$n,IP:127.0.0.1,DNS:localhost"; fi
  # clientAuth too: etcd's own gRPC gateway dials the client port with this certificate.
  sign "server-$n" "$n" "$san" "serverAuth,clientAuth"
  # Peers dial each other, so a peer cert is both server and client on the peer port.
  sign "peer-$n" elasticd-etcd-peer "$san" "serverAuth,clientAuth" peer-ca
done
sign client elasticd "DNS:elasticd" clientAuth
chmod 0644 "$out"/*.pem
chmod 0600 "$out"/*-key.pem
echo "certificates in $out: ca.pem, server-<name>.pem, client.pem; peer-ca.pem, peer-<name>.pem (+ keys)"
