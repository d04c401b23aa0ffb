"""Node configuration: where state lives and what the node admits.

Every field can come from the environment (``CORRAL_<FIELD>``) so that the
embedded client, ``corral serve`` and the CLI agree on one node without
passing flags around.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from corral.errors import InvalidArgument
from corral.units import parse_size

_NODE = re.compile(r"^[a-z0-9]{1,16}$")
_STORE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
# Named package sources a network policy can turn on; configuration, not code.
ECOSYSTEMS: dict[str, list[str]] = {
    "pypi": ["pypi.org", "files.pythonhosted.org"],
    "npm": ["registry.npmjs.org", "registry.yarnpkg.com"],
    "debian": ["deb.debian.org", "security.debian.org"],
    "github": ["github.com", "codeload.github.com", "*.githubusercontent.com"],
    "huggingface": ["huggingface.co", "*.huggingface.co", "*.hf.co"],
}
# AF_UNIX paths are limited to 107 bytes; the longest one we make is
# <data>/run/<node>-<16 chars>.sock.
MAX_DATA_DIR = 107 - len("/run/") - 16 - 1 - 16 - len(".sock")


def _repo_platform_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "build" / "platform"


# Promising more than this many times what a node has is a typo, not a policy.
MAX_OVERCOMMIT = 1000.0


# E2B's "base": Corral's Python image with E2B's user (install.sh builds
# it) and its base template's tools (images/e2b_tools.py), sized as E2B's
# own base template (512 MiB), and "base-microvm" the
# same in a microVM. "code-interpreter-v1"
# (e2b-code-interpreter's default): Jupyter and Corral's code-interpreter
# server on port 49999 (images/interpreter.py), started before the create
# answers.
DEFAULT_E2B_TEMPLATES = {
    "base": "debian-python:bookworm toolkit=e2b-user:bookworm,e2b-tools:bookworm memory=512MiB",
    # The same in a microVM: its own kernel (QEMU; KVM where the host has it).
    "base-microvm": "debian-python:bookworm toolkit=e2b-user:bookworm,e2b-tools:bookworm "
    "memory=512MiB kind=microvm",
    "code-interpreter-v1": "debian-python:bookworm "
    "toolkit=e2b-user:bookworm,e2b-tools:bookworm,e2b-ci-langs:bookworm,"
    "e2b-code-interpreter:bookworm memory=1GiB "
    "start=/opt/corral/interpreter/start",
}


@dataclass(frozen=True)
class NodeConfig:
    data_dir: Path = Path("/var/lib/corral")
    node: str = "local"
    # "corral": Corral's own runtime (native/corral-run, from the OCI config
    # through runtimes/container/runplan.py): the container crun makes,
    # without crun's own start, fork and exit (docs/container-runtime.md).
    # "crun" or "runc": theirs, from the same config.
    oci_runtime: str = "corral"
    # Where corral-init and corral-nsexec were built (make -C native).
    platform_src: Path = field(default_factory=_repo_platform_dir)
    max_sandboxes: int = 4096
    # Sandboxes are mostly idle (DSec: ~90% use < 5% of what they ask for),
    # so admission lets promised memory exceed the host's by this factor.
    memory_overcommit: float = 8.0
    # The same for CPUs, if set: the cores promised (each sandbox's `cpu`)
    # may be this many times the node's. None (the default): CPU is judged
    # by what the host measures only (pressure_limits), since CPU is
    # compressible: overcommitted, it slows sandboxes, it kills none, and
    # thousands of idle one-core sandboxes on a few cores is the point.
    cpu_overcommit: float | None = None
    # Promises are not use: admission also asks the host (docs/admission.md).
    # It refuses while the kernel's free memory (MemAvailable) is under
    # memory_reserve, or while a pressure stall average over 10 s (PSI, in
    # percent) is at or over its limit: cpu's `some` (a runnable task waited),
    # memory's and io's `full` (every task stalled at once). Memory only by
    # default: CPU and disk are compressible and their stalls come and go
    # with any burst (a node restoring a preempted job's sandboxes stalls
    # its CPU for seconds), where a memory stall means the host is short.
    memory_reserve: int = 1024**3
    pressure_limits: dict[str, float] = field(default_factory=lambda: {"memory": 25.0})
    scratch_size: int = 64 * 1024**3
    # The same rule for writable space: the disk promised to sandboxes may
    # exceed the scratch pool by this factor, and no one sandbox may ask for
    # more than the pool. Each is held to its own quota, and an agent's
    # sandbox writes megabytes where it is promised gibibytes: 128 lets a
    # 64 GiB pool hold 4,096 sandboxes of the SDK's default 2 GiB.
    disk_overcommit: float = 128.0
    # Warm sandboxes (docs/warm-pool.md): containers started ahead of
    # demand, per image stack, that a create claims in milliseconds. At
    # most this many at once over all stacks; 0: off.
    warm_pool: int = 0
    # CPU classes (docs/cpu-classes.md): background sandboxes and commands
    # yield to interactive ones (an idle cgroup, SCHED_IDLE) and, while
    # background work runs, keep to cores of their own. Off: every sandbox
    # is weighed alike by its `cpu`.
    cpu_classes: bool = True
    # Cores kept for interactive work whenever background work runs.
    cpu_interactive_cores: int = 1
    # Interactive sandboxes keep off the background cores too (caches of
    # their own), instead of using every core and preempting background
    # work there. Measured both ways on 2 cores (bench/cpuclasses.py).
    cpu_confine_interactive: bool = True
    # Per-sandbox ceilings on block I/O to the scratch pool, bytes/s (0: none):
    # one sandbox streaming to disk leaves the device to its neighbours too.
    disk_read_bps: int = 128 * 1024**2
    disk_write_bps: int = 128 * 1024**2
    # Kernel counters charged per user namespace (each sandbox's own share;
    # the host-wide account is raised to hold every sandbox's at once; 0:
    # no share, every sandbox draws on the one account).
    inotify_instances: int = 128
    inotify_watches: int = 16384
    # AIO events a sandbox may set up over its life (the pool, fs.aio-max-nr,
    # is the host's: raised to hold every sandbox's budget at once).
    aio_events: int = 65536
    max_file_bytes: int = 256 * 1024**2
    # What the platform logs about one sandbox (its command log) is capped:
    # an endless printer costs at most this, and the cap hit is recorded.
    log_quota: int = 1024**2
    reaper_interval: float = 1.0
    # The seccomp allow-list. Off only to measure what it costs.
    seccomp: bool = True
    # Sandbox root is not host root: each sandbox gets its own block of 65536
    # host ids (a user namespace, layers seen through idmapped mounts).
    userns: bool = True
    liveness_interval: float = 5.0  # how often dead inits and loaders are looked for
    # A VM guest whose agent has not answered a ping for this long is hung
    # (its kernel, or its PID 1 starved): failed, with its console attached.
    # Generous: a TCG guest under load answers in seconds, not milliseconds.
    vm_hang_timeout: float = 30.0
    # A container's exec server must answer this soon after its runtime has
    # started it, or the create fails. An emulated host (the v2 guest under
    # TCG, tests/framework/v2host.py) may need more.
    ready_timeout: float = 30.0
    # Idle sandboxes stop holding memory without the trainer doing anything:
    # a running sandbox unused for suspend_after seconds is suspended (frozen
    # where its kind can be, docs/preemption.md), and one frozen for
    # suspend_to_disk_after more is saved to disk where its kind can be.
    # The next request resumes it. 0: off.
    suspend_after: float = 0.0
    suspend_to_disk_after: float = 0.0
    # A container goes to disk only with no command running (a command's
    # connection cannot be checkpointed): a suspend waits this long for
    # them to end before it is refused.
    checkpoint_wait: float = 10.0
    # A swap file the node makes and enables (<data>/swap, this many bytes)
    # so frozen sandboxes' memory can leave RAM; 0: the host's own swap, if
    # any. Running sandboxes never swap (their memory+swap is their memory).
    swap_size: int = 0
    # Pages the swap file takes go through zswap first (compressed in RAM,
    # lz4 where the kernel has it): a reclaimed sandbox's cold memory costs
    # a third of itself and faults back in microseconds. A host setting:
    # once on, left on (other nodes of the host may be using it).
    zswap: bool = True
    # A running sandbox with no command for this many seconds gives its
    # memory back (host/cgroups.py reclaim: page cache dropped, anonymous
    # memory to swap); its next command faults back what it touches. 0: off.
    reclaim_after: float = 0.0
    # A full VM's base layer on virtio-pmem with DAX: one copy of its pages
    # on the host for all VMs, not one per guest page cache. Off: virtio-blk.
    vm_pmem: bool = True
    # Guests report the pages they free, and the host takes them back.
    vm_free_page_reporting: bool = True
    # Under TCG, the cache of translated guest code per VM, MiB. QEMU's own
    # default (1 GiB) fills with a boot's and a session's one-off code and
    # stays resident: ~110 MiB per VM after a Python session here. 64 MiB
    # keeps that session's speed (bench/results/vmidle.md). 0: QEMU's.
    vm_tcg_cache_mib: int = 64
    # An idle guest's kernel keeps its periodic work off and a microVM under
    # TCG has no PIT ticking (runtimes/vm/qemu.py IDLE_CMDLINE): an idle
    # microVM costs 0.1% of a host core instead of 0.5-0.6% (bench/results/
    # vmidle.md). Off: the guest kernel's and QEMU's own defaults. A VM
    # suspended to disk resumes on the command line it was made with.
    vm_quiet_idle: bool = True
    # Full VM desktops start from a saved drawn desktop of the same spec
    # instead of booting (node/templates.py): at most this many templates
    # kept on disk (each about the guest's used memory). 0: always boot.
    vm_templates: int = 4
    # The kernel merges identical guest pages across VMs (KSM; QEMU marks
    # guest RAM mergeable): 27% less host memory per idle microVM here
    # (bench/results/ksm.md), for ksmd's CPU. Off by default: a host
    # setting, and page merging is a timing side channel between guests
    # (a write to a merged page is slower), which hostile sandboxes can use.
    vm_ksm: bool = False
    # Layers are read through the node's lazy loader (FUSE), chunk by chunk.
    lazy: bool = True
    chunk_cache_size: int = 20 * 1024**3
    lazy_readahead: int = 4  # chunks fetched per miss
    lazy_deadline: float = 20.0  # seconds a read may spend retrying the store
    # A loader that holds its lock but has not answered for this long is
    # hung: killed, and the node's sandboxes reading through it failed. Past
    # lazy_deadline with room: one read retrying a slow store may hold it.
    lazy_hang_timeout: float = 60.0
    # Layers may be shared by several nodes of one machine (tests, the
    # multi-node setup); None means <data_dir>/images.
    images: Path | None = None
    # The key that signs saved VM states; None: <images dir>/../state.key.
    state_key: Path | None = None
    # Object stores a sandbox may be saved to and restored from, by name: a
    # request names one, never a path or URL (the node opens them as root).
    # "local" is always there: <images dir>/../saved, shared by the nodes
    # that share images. Values: a directory, http(s):// of `corral blobd`,
    # s3://bucket/prefix. A store's bearer key goes to that store only.
    stores: dict[str, str] = field(default_factory=dict)
    store_keys: dict[str, str] = field(default_factory=dict)
    # Shared blob stores (a directory, http(s):// of `corral blobd`, s3://)
    # this node pulls an image it lacks from on first use, in this order:
    # the manifests at once, the data chunk by chunk (docs/image-distribution.md).
    # The operator's CORRAL_BLOB_KEY goes to the http ones.
    image_sources: list[str] = field(default_factory=list)
    # Registry pulls a create asks for go out only through the node's egress
    # guard (images/egress.py): never to an address inside the cluster's
    # network, whatever a name resolves to. On for cluster nodes, whose
    # creates come from tenants; off for an embedded node, whose user is its
    # operator (and may pull from a registry on their own network).
    pull_guard: bool = False
    # E2B templates (api/compat/e2b): a template id to what a sandbox of it
    # starts from, "IMAGE [workspace=REF] [toolkit=REF,REF] [memory=SIZE]
    # [cpu=N] [disk=SIZE]". A template id
    # that is not here but names an image of the store is that image.
    e2b_templates: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_E2B_TEMPLATES))
    # Sandbox networking (only for sandboxes given a policy).
    network_pool: str = "10.200.0.0/16"
    dns_port: int = 10053
    network_deny: list[str] = field(default_factory=list)  # e.g. the control plane
    ecosystems: dict[str, list[str]] = field(default_factory=lambda: dict(ECOSYSTEMS))
    dns_hosts: dict[str, str] = field(default_factory=dict)  # names answered locally
    dns_upstream: str | None = None  # None: the host's resolver
    # Function calls: the image they run on unless a call names one, and
    # the warm workers per image (each serves one call at a time).
    fncall_image: str = "fncall:bookworm"
    # Over fncall_image for the calls that name no image of their own: the
    # Python packages code problems import (images/fncall_python.py), the
    # other languages' toolchains and the scripts that run them
    # (images/toolchains.py). Loaded lazily: a call reads only its own.
    fncall_toolkit: list[str] = field(
        default_factory=lambda: [
            "fncall-python:bookworm",
            "fncall-langs:bookworm",
            "fncall-runners:bookworm",
        ]
    )
    fncall_workers: int = field(default_factory=lambda: max(4, 2 * (os.cpu_count() or 1)))
    fncall_cpu: float = 1.0
    fncall_pids: int = 256
    fncall_tmpfs: int = 512 * 1024**2  # size of each of the call's /tmp and /work
    fncall_workers_total: int = 0  # across images; 0: twice fncall_workers
    fncall_warm: int = 0  # workers `corral serve` starts for fncall_image before any call
    # The most memory a call may ask for: workers are admitted at this
    # ceiling, and each call's own limit is set under it.
    fncall_max_memory: int = 2 * 1024**3
    # Where `corral serve` sends its OpenTelemetry traces (OTLP over HTTP,
    # e.g. http://collector:4318); None: OTEL_EXPORTER_OTLP_ENDPOINT if set,
    # else no tracing at all (docs/tracing.md).
    otlp_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not _NODE.match(self.node):
            raise InvalidArgument("node", "must be 1-16 characters of [a-z0-9]", self.node)
        if len(str(self.data_dir)) > MAX_DATA_DIR:
            raise InvalidArgument(
                "data_dir",
                f"must be at most {MAX_DATA_DIR} characters (control sockets live under it)",
                str(self.data_dir),
            )
        if not self.data_dir.is_absolute():
            raise InvalidArgument("data_dir", "must be an absolute path", str(self.data_dir))
        for name in ("memory_overcommit", "disk_overcommit", "cpu_overcommit"):
            ratio = getattr(self, name)
            if ratio is None and name == "cpu_overcommit":
                continue
            if not isinstance(ratio, int | float) or not 1.0 <= ratio <= MAX_OVERCOMMIT:
                raise InvalidArgument(
                    name, f"must be a ratio between 1 and {MAX_OVERCOMMIT:g}", ratio
                )
        for name in self.stores:
            if not _STORE.match(name):
                raise InvalidArgument("stores", "names must match [a-z0-9][a-z0-9_-]{0,31}", name)
        if not isinstance(self.image_sources, list):
            raise InvalidArgument(
                "image_sources", "must be a list of store URLs", self.image_sources
            )
        for i, url in enumerate(self.image_sources):
            if not isinstance(url, str) or not url.startswith(
                ("/", "http://", "https://", "s3://")
            ):
                raise InvalidArgument(
                    f"image_sources[{i}]",
                    "must be an absolute directory, http(s):// or s3:// URL",
                    url,
                )
        for i, net in enumerate(self.network_deny):
            try:
                ipaddress.ip_network(net, strict=False)
            except (TypeError, ValueError):
                raise InvalidArgument(
                    f"network_deny[{i}]", "must be an address or a network (CIDR)", net
                ) from None
        for name in self.store_keys:
            if name not in self.object_stores:
                raise InvalidArgument("store_keys", "must name one of the stores", name)
        if self.oci_runtime not in ("crun", "runc", "corral"):
            raise InvalidArgument(
                "oci_runtime", "must be 'crun', 'runc' or 'corral'", self.oci_runtime
            )
        if not 1 <= self.ready_timeout <= 600:
            raise InvalidArgument(
                "ready_timeout", "must be seconds from 1 to 600", self.ready_timeout
            )
        for name in ("suspend_after", "suspend_to_disk_after", "checkpoint_wait", "reclaim_after"):
            after = getattr(self, name)
            if not 0 <= after <= 30 * 86400:
                raise InvalidArgument(name, "must be 0 (off) or seconds up to 30 days", after)
        if not isinstance(self.pressure_limits, dict):
            raise InvalidArgument(
                "pressure_limits", "must map cpu, memory or io to a percent", self.pressure_limits
            )
        for res, limit in self.pressure_limits.items():
            if res not in ("cpu", "memory", "io"):
                raise InvalidArgument(
                    "pressure_limits", "keys must be 'cpu', 'memory' or 'io'", res
                )
            if not isinstance(limit, int | float) or not 0 < limit <= 100:
                raise InvalidArgument(
                    f"pressure_limits.{res}",
                    "must be a percent of stalled time above 0 and at most 100",
                    limit,
                )
        if not 0 <= self.memory_reserve <= 1 << 50:
            raise InvalidArgument(
                "memory_reserve", "must be 0 (off) or bytes up to 1 PiB", self.memory_reserve
            )
        if not (self.vm_tcg_cache_mib == 0 or 8 <= self.vm_tcg_cache_mib <= 4096):
            raise InvalidArgument(
                "vm_tcg_cache_mib",
                "must be 0 (QEMU's default) or MiB from 8 to 4096",
                self.vm_tcg_cache_mib,
            )
        if not 0 <= self.vm_templates <= 64:
            raise InvalidArgument(
                "vm_templates", "must be 0 (off) or a count up to 64", self.vm_templates
            )
        if not 0 <= self.warm_pool <= self.max_sandboxes:
            raise InvalidArgument(
                "warm_pool",
                f"must be 0 (off) or a count up to max_sandboxes ({self.max_sandboxes})",
                self.warm_pool,
            )
        if not 1 <= self.cpu_interactive_cores <= 4096:
            raise InvalidArgument(
                "cpu_interactive_cores",
                "must be a number of cores from 1 to 4096",
                self.cpu_interactive_cores,
            )
        if not 0 <= self.swap_size <= 1 << 40:
            raise InvalidArgument(
                "swap_size", "must be 0 (off) or bytes up to 1 TiB", self.swap_size
            )

    @classmethod
    def from_env(cls, **overrides: object) -> NodeConfig:
        """Defaults, then CORRAL_* variables, then explicit overrides."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get(f"CORRAL_{f.name.upper()}")
            if raw is None:
                continue
            if f.name in ("data_dir", "platform_src", "images", "state_key"):
                values[f.name] = Path(raw)
            elif f.name in (
                "scratch_size",
                "max_file_bytes",
                "chunk_cache_size",
                "log_quota",
                "fncall_tmpfs",
                "fncall_max_memory",
                "memory_reserve",
            ):
                values[f.name] = parse_size(raw, f"CORRAL_{f.name.upper()}")
            elif f.name in (
                "ecosystems",
                "dns_hosts",
                "network_deny",
                "stores",
                "store_keys",
                "image_sources",
                "e2b_templates",
                "fncall_toolkit",
                "pressure_limits",
            ):
                values[f.name] = json.loads(raw)
            elif f.name in (
                "max_sandboxes",
                "lazy_readahead",
                "dns_port",
                "fncall_workers",
                "fncall_workers_total",
                "fncall_pids",
                "fncall_warm",
                "inotify_instances",
                "inotify_watches",
                "aio_events",
                "cpu_interactive_cores",
                "warm_pool",
                "vm_tcg_cache_mib",
                "vm_templates",
            ):
                values[f.name] = int(raw)
            elif f.name in ("disk_read_bps", "disk_write_bps", "swap_size"):
                values[f.name] = parse_size(raw, f"CORRAL_{f.name.upper()}")
            elif f.name in (
                "memory_overcommit",
                "disk_overcommit",
                "cpu_overcommit",
                "reaper_interval",
                "lazy_deadline",
                "lazy_hang_timeout",
                "liveness_interval",
                "vm_hang_timeout",
                "ready_timeout",
                "suspend_after",
                "suspend_to_disk_after",
                "checkpoint_wait",
                "reclaim_after",
                "fncall_cpu",
            ):
                values[f.name] = float(raw)
            elif f.name in (
                "lazy", "seccomp", "userns", "vm_pmem", "vm_free_page_reporting", "cpu_classes",
                "zswap", "cpu_confine_interactive", "vm_ksm", "vm_quiet_idle", "pull_guard",
            ):  # fmt: skip
                values[f.name] = raw.lower() not in ("0", "false", "no", "off")
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "data_dir" in values:
            values["data_dir"] = Path(str(values["data_dir"])).resolve()
        return replace(cls(), **values)  # type: ignore[arg-type]

    # Paths below the data dir. One place names them all.
    @property
    def db_path(self) -> Path:
        return self.data_dir / "state.db"

    @property
    def images_dir(self) -> Path:
        return self.images or self.data_dir / "images"

    @property
    def object_stores(self) -> dict[str, str]:
        """The named stores saves may use (see `stores`)."""
        return {"local": str(self.images_dir.parent / "saved"), **self.stores}

    @property
    def state_key_path(self) -> Path:
        """The key saved VM states are signed with: beside the image store,
        so the nodes that share images share it (node/signing.py)."""
        return self.state_key or self.images_dir.parent / "state.key"

    @property
    def disks_dir(self) -> Path:
        """Users' own VM disks (images/disks.py): beside the image store,
        so the nodes that share images share them."""
        return self.images_dir.parent / "disks"

    @property
    def sandboxes_dir(self) -> Path:
        return self.data_dir / "sandboxes"

    @property
    def spare_dirs(self) -> Path:
        """Closed sandboxes' directories, emptied, for new ones (node/sandboxdirs.py)."""
        return self.data_dir / "sandboxes.spare"

    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def crun_root(self) -> Path:
        return self.data_dir / "run" / "oci"

    @property
    def unified_dir(self) -> Path:
        """Hybrid cgroup hosts: where crun's cgroup2 directories go
        (host/cgroups.py Cgroups.unified), on the run tmpfs."""
        return self.data_dir / "run" / "unified"

    @property
    def bundles_dir(self) -> Path:
        """Containers' OCI bundles, on the run tmpfs (host/runfs.py)."""
        return self.data_dir / "run" / "bundles"

    @property
    def scratch_dir(self) -> Path:
        return self.data_dir / "scratch"

    @property
    def scratch_image(self) -> Path:
        return self.data_dir / "scratch.btrfs"

    @property
    def mounts_dir(self) -> Path:
        return self.data_dir / "m"

    @property
    def platform_dir(self) -> Path:
        return self.data_dir / "platform"

    @property
    def fncall_worker(self) -> str:
        """The pool's key of the default workers: IMAGE[+TOOLKIT,...]."""
        if not self.fncall_toolkit:
            return self.fncall_image
        return f"{self.fncall_image}+{','.join(self.fncall_toolkit)}"

    @property
    def cgroup_parent(self) -> str:
        return f"corral/{self.node}"


def e2b_templates() -> dict[str, str]:
    """E2B's templates for a process without a node's config (a gateway):
    CORRAL_E2B_TEMPLATES (JSON), else a node's default."""
    raw = os.environ.get("CORRAL_E2B_TEMPLATES")
    if raw:
        found = json.loads(raw)
        if not isinstance(found, dict):
            raise ValueError("CORRAL_E2B_TEMPLATES must be a JSON object of strings")
        return {str(k): str(v) for k, v in found.items()}
    return dict(DEFAULT_E2B_TEMPLATES)
