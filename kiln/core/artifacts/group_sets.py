"""Group sets: the stored groups of a collection, referenced through S3 index objects.

A collection's group objects are listed, in group order, in one index object per chunk
(``kiln.group-index.v1``: ``{"schema", "groups": [{uri, sha256, bytes}, …]}``), and the
``GroupSet`` record names those indexes. Training, bundles and publication read the groups back
through here, so their inputs stay the same size whatever the number of groups.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import canonical_json
from kiln.core.errors import ArtifactIntegrityFailed
from kiln.core.records import GroupSet, StoredObject

GROUP_INDEX_SCHEMA = "kiln.group-index.v1"


def write_group_index(store: S3Store, groups: list[StoredObject]) -> StoredObject:
    """Store one chunk's group references (content-addressed: a retry writes the same object)."""
    document = {"schema": GROUP_INDEX_SCHEMA, "groups": [group.model_dump() for group in groups]}
    return StoredObject.of(store.put_blob(canonical_json(document)))


def group_set(store: S3Store, chunks: list[list[StoredObject]]) -> GroupSet:
    """The set of several chunks' groups (each chunk one index object)."""
    return GroupSet(indexes=[write_group_index(store, chunk) for chunk in chunks], count=sum(len(c) for c in chunks))


def read_group_set(store: S3Store, groups: GroupSet) -> list[StoredObject]:
    """Every group reference of ``groups``, in order, each index verified by its digest."""
    refs: list[StoredObject] = []
    for index in groups.indexes:
        document = json.loads(store.get_bytes(index.ref()))
        if not isinstance(document, dict) or document.get("schema") != GROUP_INDEX_SCHEMA:
            raise ArtifactIntegrityFailed(f"{index.uri} is not a Kiln group index")
        refs.extend(StoredObject.model_validate(item) for item in document["groups"])
    if len(refs) != groups.count:
        raise ArtifactIntegrityFailed(f"the group indexes list {len(refs)} groups; the run recorded {groups.count}")
    return refs


def read_group_documents(store: S3Store, groups: GroupSet) -> list[dict[str, Any]]:
    """Every group document of ``groups``, in order, each verified by its digest."""
    refs = [obj.ref() for obj in read_group_set(store, groups)]
    return [json.loads(data) for data in store.get_many(refs)]
