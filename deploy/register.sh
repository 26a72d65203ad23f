#!/usr/bin/env bash
# Register SuperNode public keys with a running SuperLink (started with --enable-supernode-auth):
#
#   deploy/register.sh CONNECTION KEY.pub...
#
# CONNECTION is a SuperLink connection in $FLWR_HOME/config.toml (see deploy/flwr-config.toml). Each key is
# registered under its file name (sn1.pub -> sn1); the SuperLink answers with the node id it assigned, which the
# SuperNode keeps across restarts. Prints "<name> <node id> <corrflow identity>" per key.
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: register.sh CONNECTION KEY.pub..." >&2; exit 2; }
conn="$1"; shift
here=$(cd "$(dirname "$0")" && pwd)
flwr_bin="${FLWR:-flwr}"
for pub in "$@"; do
  name=$(basename "$pub" .pub)
  identity=$("$here/fingerprint.sh" "$pub")
  answer=$("$flwr_bin" supernode register "$pub" "$conn" --name "$name" 2>&1) || {
    echo "register.sh: registering $pub failed:" >&2; echo "$answer" >&2; exit 1; }
  node_id=$(grep -oE 'SuperNode [0-9]+' <<<"$answer" | head -n 1 | cut -d' ' -f2 || true)
  [[ -n "$node_id" ]] || { echo "register.sh: no node id in the answer for $pub:" >&2; echo "$answer" >&2; exit 1; }
  echo "$name $node_id ${identity%% *}"
done
