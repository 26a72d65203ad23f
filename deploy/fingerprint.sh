#!/usr/bin/env bash
# corrflow's identity of an authenticated SuperNode, from its OpenSSH public key file:
#
#   deploy/fingerprint.sh KEY.pub...      prints "key-<24 hex>  KEY.pub" per key
#
# Flower stores a registered SuperNode's key as PEM SubjectPublicKeyInfo bytes (`flwr supernode register` loads the
# OpenSSH key and re-serialises it); the corrflow ServerApp names the device "key-" + the first 24 hex digits of
# SHA-256 over exactly those bytes. `ssh-keygen -e -m PKCS8` writes the same PEM text.
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: fingerprint.sh KEY.pub..." >&2; exit 2; }
for pub in "$@"; do
  [[ -r "$pub" ]] || { echo "fingerprint.sh: cannot read $pub" >&2; exit 2; }
  pem=$(ssh-keygen -e -m PKCS8 -f "$pub") || { echo "fingerprint.sh: $pub is not an OpenSSH public key" >&2; exit 2; }
  [[ "$pem" == "-----BEGIN PUBLIC KEY-----"* ]] || { echo "fingerprint.sh: $pub: unexpected key format" >&2; exit 2; }
  digest=$(printf '%s\n' "$pem" | sha256sum)
  printf 'key-%s  %s\n' "${digest:0:24}" "$pub"
done
