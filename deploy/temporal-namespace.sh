#!/bin/sh
# Create the Temporal namespace Kiln uses (idempotent). Kiln's search attributes are then created
# by `python -m workers ensure-search-attributes` (the `kiln-init` service) from the one list in
# kiln/core/search_attributes.py; every worker checks them again at start.
set -eu
ns="${KILN_TEMPORAL_NAMESPACE:-default}"
addr="${TEMPORAL_ADDRESS:-temporal:7233}"
until temporal operator cluster health --address "$addr"; do sleep 2; done
temporal operator namespace describe --address "$addr" -n "$ns" >/dev/null 2>&1 \
  || temporal operator namespace create --address "$addr" -n "$ns" --retention 7d
echo "namespace $ns ready"
