#!/usr/bin/env bash
# Make a CA and TLS certificates for an etcd cluster and its clients (elasticd nodes).
#
#   deploy/etcd/make-certs.sh OUT_DIR [SERVER_NAME_OR_IP ...]
#
# Writes OUT_DIR/{ca.pem,ca-key.pem}, one server cert per name (server-<name>.pem,
# server-<name>-key.pem, valid for that name plus 127.0.0.1 and localhost, usable
# for both client and peer traffic), and client.pem/client-key.pem (CN=elasticd,
# the etcd user name when --client-cert-auth maps certificates to users).
# Keys are 0600. Re-running keeps an existing CA so old certificates stay valid.
set -euo pipefail
out=${1:?usage: make-certs.sh OUT_DIR [SERVER_NAME_OR_IP ...]}
shift
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(127.0.0.1)
days=${CERT_DAYS:-825}
mkdir -p "$out"
umask 077

if [ ! -f "$out/ca.pem" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=elasticd-etcd-ca" \
    -keyout "$out/ca-key.pem" -out "$out/ca.pem" 2>/dev/null
fi

sign() {  # sign NAME SUBJECT_CN SAN EXT_USAGE
  local name=$1 cn=$2 san=$3 usage=$4
  local ext
  ext=$(mktemp)
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nkeyUsage=digitalSignature,keyEncipherment\n' \
    "$san" "$usage" >"$ext"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" \
    -keyout "$out/$name-key.pem" -out "$out/$name.csr" 2>/dev/null
  openssl x509 -req -in "$out/$name.csr" -CA "$out/ca.pem" -CAkey "$out/ca-key.pem" \
    -CAcreateserial -days "$days" -extfile "$ext" -out "$out/$name.pem" 2>/dev/null
  rm -f "$out/$name.csr" "$ext"
}

for n in "${names[@]}"; do
  if [[ $n =~ ^[0-9.]+$ ]]; then san="IP:$n,IP:127.0.0.1,DNS:localhost"
  else san="DNS:$n,IP:127.0.0.1,DNS:localhost"; fi
  sign "server-$n" "$n" "$san" "serverAuth,clientAuth"
done
sign client elasticd "DNS:elasticd" clientAuth
chmod 0644 "$out"/*.pem
chmod 0600 "$out"/*-key.pem
echo "certificates in $out: ca.pem, server-<name>.pem, client.pem (+ keys)"
