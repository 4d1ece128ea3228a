#!/bin/sh
# Start SeaweedFS closed: S3 answers only Kiln's key pair (an explicit identity file written here,
# mode 0600, from the required secrets); master, volume and filer bind to the container's loopback
# (only S3, 8333, listens on the compose network), and filer/volume reads and writes also need a
# JWT signed with keys generated at every start (security.toml).
set -eu
: "${KILN_S3_ACCESS_KEY:?KILN_S3_ACCESS_KEY is required}"
: "${KILN_S3_SECRET_KEY:?KILN_S3_SECRET_KEY is required}"
case "$KILN_S3_ACCESS_KEY$KILN_S3_SECRET_KEY" in
  *'"'* | *'\'*) echo 'error: KILN_S3_ACCESS_KEY/KILN_S3_SECRET_KEY must not contain " or \' >&2; exit 1 ;;
esac
umask 077
conf="${SEAWEEDFS_CONF_DIR:-/run/seaweedfs}"
mkdir -p "$conf"
cat > "$conf/s3.json" <<JSON
{"identities": [{"name": "kiln",
  "credentials": [{"accessKey": "$KILN_S3_ACCESS_KEY", "secretKey": "$KILN_S3_SECRET_KEY"}],
  "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
JSON
key() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
{
  for section in jwt.signing jwt.signing.read jwt.filer_signing jwt.filer_signing.read; do
    printf '[%s]\nkey = "%s"\nexpires_after_seconds = 60\n\n' "$section" "$(key)"
  done
} > "$conf/security.toml"
cd "$conf"  # weed reads ./security.toml
unset KILN_S3_SECRET_KEY AWS_SECRET_ACCESS_KEY
exec weed server -dir="${SEAWEEDFS_DATA_DIR:-/data}" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -s3 -s3.port=8333 -s3.ip.bind=0.0.0.0 -s3.config="$conf/s3.json" \
  -master.volumeSizeLimitMB=1024 -webdav=false
