"""Prometheus metrics of this process (exported by `corral serve` at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)

SANDBOXES_CREATED = Counter(
    "corral_sandboxes_created_total", "Sandboxes created", ["kind"], registry=REGISTRY
)
SANDBOXES_CLOSED = Counter(
    "corral_sandboxes_closed_total", "Sandboxes closed", ["kind", "reason"], registry=REGISTRY
)
SANDBOX_CREATE_FAILURES = Counter(
    "corral_sandbox_create_failures_total", "Creates that failed", ["code"], registry=REGISTRY
)
NODE_FULL = Counter(
    "corral_node_full_total",
    "Creates this node refused for want of room (slots, memory, cpu, disk) or as overloaded",
    ["reason"],
    registry=REGISTRY,
)
SANDBOXES_ACTIVE = Gauge(
    "corral_sandboxes_active", "Sandboxes alive on this node", registry=REGISTRY
)
CREATE_SECONDS = Histogram(
    "corral_sandbox_create_seconds",
    "Create to ready",
    ["kind"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
EXEC_SECONDS = Histogram(
    "corral_exec_seconds", "Command duration", buckets=_LATENCY, registry=REGISTRY
)
EXEC_TOTAL = Counter("corral_exec_total", "Commands run", ["outcome"], registry=REGISTRY)
OUTPUT_DROPPED = Counter(
    "corral_output_dropped_bytes_total", "Command output beyond its cap", registry=REGISTRY
)
FILE_OPS = Counter("corral_file_ops_total", "File operations", ["op"], registry=REGISTRY)
VM_OPS = Histogram(
    "corral_vm_op_seconds",
    "VM state operations (suspend, resume, fork, save, restore), request to done",
    ["op"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
SUSPEND_OPS = Histogram(
    "corral_suspend_seconds",
    "Suspends and resumes of any kind of sandbox, by depth (freeze, disk)",
    ["kind", "op", "mode"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
RECLAIMED_BYTES = Counter(
    "corral_suspend_reclaimed_bytes_total",
    "Memory given back to the host by freezing sandboxes",
    registry=REGISTRY,
)
ROLLOUT_STEPS = Counter(
    "corral_rollout_steps_total",
    "Rollout steps appended to a log (logged), or appended again as a retry (retried)",
    ["outcome"],
    registry=REGISTRY,
)
KEYED_EXECS = Counter(
    "corral_keyed_exec_total",
    "Commands with a key: run, replayed from the record, joined while running, ambiguous",
    ["outcome"],
    registry=REGISTRY,
)
RESEEDS = Counter(
    "corral_copy_reseeds_total",
    "Kernel CRNGs re-keyed for a sandbox's copies: the host's (containers), a guest's (VMs)",
    ["kernel", "outcome"],
    registry=REGISTRY,
)
VM_STATE_BYTES = Counter(
    "corral_vm_state_bytes_total",
    "Bytes of VM state written (suspend, fork, save)",
    ["op"],
    registry=REGISTRY,
)
VM_FAILURES = Counter(
    "corral_vm_guest_failures_total",
    "Guests failed by the node: hung (silent past vm_hang_timeout)",
    ["reason"],
    registry=REGISTRY,
)
DISPLAY_OPS = Counter(
    "corral_display_ops_total", "Full-VM display operations", ["op"], registry=REGISTRY
)
LOADER_FAILURES = Counter(
    "corral_lazy_loader_failures_total",
    "Times the node's lazy loader was found dead",
    registry=REGISTRY,
)
RECLAIMED = Counter(
    "corral_resources_reclaimed_total",
    "Leftovers reclaimed by recovery or gc",
    ["kind"],
    registry=REGISTRY,
)

FNCALLS = Counter(
    "corral_fncalls_total",
    "Function calls by language and status",
    ["language", "status"],
    registry=REGISTRY,
)
FNCALL_WORKERS = Gauge(
    "corral_fncall_workers",
    "Function-call workers of this process by image and state",
    ["image", "state"],
    registry=REGISTRY,
)
FNCALL_SECONDS = Histogram(
    "corral_fncall_seconds",
    "Function call, request to verdict",
    buckets=_LATENCY,
    registry=REGISTRY,
)


def exposition() -> bytes:
    return bytes(generate_latest(REGISTRY))


# The gateway (control/gateway.py): a cluster's view, not one node's.
GATEWAY_CREATES = Counter(
    "corral_gateway_creates_total",
    "Creates through this gateway by outcome (ready, found: an idempotency key's "
    "sandbox returned again, or the error code)",
    ["outcome"],
    registry=REGISTRY,
)
GATEWAY_CREATE_SECONDS = Histogram(
    "corral_gateway_create_seconds",
    "Create through the gateway, request to ready",
    buckets=_LATENCY,
    registry=REGISTRY,
)
IMAGE_FETCHES = Counter(
    "corral_image_fetches_total",
    "Images fetched on first use (a registry pull, or a blob store's manifests), by outcome",
    ["outcome"],
    registry=REGISTRY,
)
GATEWAY_DIRECT = Counter(
    "corral_gateway_direct_tokens_total",
    "Direct-path tokens issued (api/direct.py)",
    registry=REGISTRY,
)
GATEWAY_BURST = Counter(
    "corral_gateway_burst_total",
    "Creates sent to a burst target, by target and outcome",
    ["target", "outcome"],
    registry=REGISTRY,
)
GATEWAY_ELSEWHERE = Counter(
    "corral_gateway_create_elsewhere_total",
    "Creates moved to another node because theirs was full or unreachable",
    ["reason"],
    registry=REGISTRY,
)
GATEWAY_NODES = Gauge(
    "corral_gateway_nodes", "Cluster members by state, as last read", ["state"], registry=REGISTRY
)
GATEWAY_NODES_LOST = Counter(
    "corral_gateway_nodes_lost_total", "Nodes this gateway marked lost", registry=REGISTRY
)
GATEWAY_RECONCILED = Counter(
    "corral_gateway_reconciled_total",
    "Disagreements between a node and the store, repaired, by action",
    ["action"],
    registry=REGISTRY,
)
MEMORY_RECLAIMED = Counter(
    "corral_memory_reclaimed_bytes_total",
    "Memory idle sandboxes gave back (reclaim_after): page cache dropped, the rest to swap",
    registry=REGISTRY,
)
