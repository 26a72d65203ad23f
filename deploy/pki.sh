#!/usr/bin/env bash
# Key material for a corrflow deployment on Flower: a CA, the SuperLink's TLS certificate, and one ECDSA key pair
# per SuperNode (the key a SuperNode authenticates with; its fingerprint is the device's corrflow identity).
#
#   deploy/pki.sh [--force] [--days N] [--san SAN]... OUT_DIR [SUPERNODE_NAME]...
#
#   OUT_DIR/ca.key, ca.crt                      certificate authority (keep ca.key offline)
#   OUT_DIR/superlink.key, superlink.crt        SuperLink TLS key and certificate (SANs from --san)
#   OUT_DIR/supernodes/NAME, NAME.pub           SuperNode key pair (OpenSSH format, as Flower reads it)
#
# --san takes OpenSSL subjectAltName entries (DNS:link.example.org, IP:10.0.0.5); the default is
# DNS:localhost and IP:127.0.0.1. Every file is created owner-only (umask 077). Existing files are kept unless
# --force is given, so the script can be re-run to add SuperNodes. Requires openssl and ssh-keygen.
set -euo pipefail
umask 077

usage() { sed -n '5,6p' "$0" | sed 's/^# *//' >&2; exit "${1:-2}"; }

force=0
days=825
sans=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --force) force=1; shift ;;
    --days) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "pki.sh: --days needs a positive integer" >&2; exit 2; }
            days="$2"; shift 2 ;;
    --san) [[ $# -ge 2 && "$2" =~ ^(DNS|IP): ]] || { echo "pki.sh: --san needs DNS:<name> or IP:<address>" >&2; exit 2; }
           sans+=("$2"); shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) echo "pki.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || usage
out="$1"; shift
[[ ${#sans[@]} -gt 0 ]] || sans=("DNS:localhost" "IP:127.0.0.1")
for tool in openssl ssh-keygen; do
  command -v "$tool" >/dev/null || { echo "pki.sh: $tool is required" >&2; exit 2; }
done
for name in "$@"; do
  [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || { echo "pki.sh: SuperNode name '$name': letters, digits, _ . - only" >&2; exit 2; }
done
mkdir -p "$out/supernodes"

# fresh PATH: 0 if PATH must be (re)made, after removing it when --force is given
fresh() {
  if [[ -e "$1" ]]; then
    if [[ $force -eq 1 ]]; then rm -f "$1"; return 0; fi
    echo "kept     $1 (exists; --force replaces it)"
    return 1
  fi
  return 0
}

made_ca=0
if fresh "$out/ca.key"; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$out/ca.key"
  rm -f "$out/ca.crt"
  made_ca=1
  echo "created  $out/ca.key"
fi
if [[ $made_ca -eq 1 ]] || fresh "$out/ca.crt"; then
  openssl req -new -x509 -key "$out/ca.key" -sha256 -days "$days" -subj "/O=corrflow/CN=corrflow deployment CA" \
    -out "$out/ca.crt"
  rm -f "$out/superlink.crt"   # signed by the old CA otherwise
  echo "created  $out/ca.crt"
fi

san_line=$(IFS=,; echo "${sans[*]}")
if fresh "$out/superlink.key"; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$out/superlink.key"
  rm -f "$out/superlink.crt"
  echo "created  $out/superlink.key"
fi
if [[ ! -e "$out/superlink.crt" ]] || fresh "$out/superlink.crt"; then
  ext=$(mktemp)
  csr=$(mktemp)
  trap 'rm -f "$ext" "$csr"' EXIT
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    "$san_line" > "$ext"
  openssl req -new -key "$out/superlink.key" -subj "/O=corrflow/CN=superlink" -out "$csr"
  openssl x509 -req -in "$csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial -days "$days" -sha256 \
    -extfile "$ext" -out "$out/superlink.crt" 2>/dev/null
  rm -f "$out/ca.srl"
  echo "created  $out/superlink.crt (subjectAltName $san_line)"
fi

here=$(cd "$(dirname "$0")" && pwd)
for name in "$@"; do
  key="$out/supernodes/$name"
  if fresh "$key"; then
    rm -f "$key.pub"
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "corrflow-supernode-$name" -f "$key"
    chmod 600 "$key"
    echo "created  $key (private: copy to the device only, mode 0600)"
    fp=$("$here/fingerprint.sh" "$key.pub"); echo "created  $key.pub (corrflow identity ${fp%% *})"
  fi
done
