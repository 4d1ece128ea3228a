#!/bin/sh
# Create (or upgrade) Temporal's two PostgreSQL databases with the schema shipped in the
# temporalio/admin-tools image. Idempotent: `create` of an existing database is tolerated and
# `update-schema` only applies missing versions. Run by the `temporal-schema` compose service.
set -eu
: "${POSTGRES_PWD:?POSTGRES_PWD is required}"
export SQL_PASSWORD="$POSTGRES_PWD"
tool() { temporal-sql-tool --plugin postgres12 --ep postgres -u temporal -p 5432 "$@"; }
for db in temporal temporal_visibility; do
  dir=temporal
  [ "$db" = temporal_visibility ] && dir=visibility
  tool --db "$db" create || echo "database $db exists"
  tool --db "$db" setup-schema -v 0.0 || echo "schema of $db already set up"
  tool --db "$db" update-schema -d "/etc/temporal/schema/postgresql/v12/$dir/versioned"
done
echo "temporal schema ready"
