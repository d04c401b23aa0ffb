"""The test harness of the suites that run real sandboxes: objects for what
a test drives, by concept.

- node.Node: one node (embedded and HTTP clients, its `corral serve`
  process, its records, a forged crash, what it holds on the host);
- cluster.Cluster: PostgreSQL, node servers and a gateway on this machine;
- processes: `corral serve` (Server), the gateway's process, run_sync;
- leftovers: what a node holds, found from outside its records;
- blobd.Blobd: the HTTP object store;
- capabilities: the probes behind the requires_* markers;
- images, pixels: the shared layer store; reading screenshots.
"""

from .blobd import Blobd
from .cluster import Cluster
from .images import IMAGE, IMAGES, oci_layout, require_image
from .leftovers import zombies_of_this_process
from .node import Node, agent_of, close_everything
from .pixels import png_pixels
from .processes import GatewayProcess, Server, free_port, run_sync

__all__ = [
    "IMAGE",
    "IMAGES",
    "Blobd",
    "Cluster",
    "GatewayProcess",
    "Node",
    "Server",
    "agent_of",
    "close_everything",
    "free_port",
    "oci_layout",
    "png_pixels",
    "require_image",
    "run_sync",
    "zombies_of_this_process",
]
