"""Emulated nodes on one machine: Linux network namespaces joined by a bridge.

Each emulated node has its own network namespace and address, its own managed directory and
its own data server (``instride serve``); one Redis server serves the whole cluster. Programs
run on a node with that node's ``INSTRIDE_*`` environment, so the code that runs in local mode
runs in cluster mode unchanged. Needs root, iproute2 and redis-server.

Examples
--------
>>> from instride.emulate import EmulatedCluster                      # doctest: +SKIP
>>> with EmulatedCluster(nodes=2) as c:
...     c.run(1, ["python", "producer.py"])
...     c.run(2, ["python", "consumer.py"])

See ``docs/cluster.md`` and ``instride cluster --help``.
"""

from __future__ import annotations

from .emulated import EmulatedCluster, Node, list_clusters, state_path
from .netns import ClusterError

__all__ = ["ClusterError", "EmulatedCluster", "Node", "list_clusters", "state_path"]
