"""The embedded default stack: a Temporal dev server and a SeaweedFS S3 server on loopback.

``kiln serve`` starts (and stops, by PID) the two servers when no external Temporal or S3 is
configured. Nothing is ever downloaded: a missing binary is a clear error naming the package.

- ``processes``: start, wait for, and stop child processes; free-port helpers;
- ``temporal``: the Temporal dev server;
- ``isolation``: who may reach it (its own user+network namespace, where the machine allows);
- ``netns_relay``: the owner-only gate that runs inside that namespace (standard library only);
- ``seaweedfs``: the SeaweedFS S3 server;
- ``stack``: both together, as ``kiln serve`` runs them.
"""

from kiln.devstack.common import GRPC_OFFSET, DevStackError
from kiln.devstack.seaweedfs import s3_healthy, start_seaweedfs, weed_binary
from kiln.devstack.stack import DevStack, StartError, start_devstack
from kiln.devstack.temporal import start_temporal, temporal_binary, temporal_healthy
from kiln.core.search_attributes import SEARCH_ATTRIBUTES

__all__ = [
    "GRPC_OFFSET",
    "SEARCH_ATTRIBUTES",
    "DevStack",
    "DevStackError",
    "StartError",
    "s3_healthy",
    "start_devstack",
    "start_seaweedfs",
    "start_temporal",
    "temporal_binary",
    "temporal_healthy",
    "weed_binary",
]
