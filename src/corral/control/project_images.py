"""Whose images a name is, through a gateway.

A node's image store is shared by every project placed on it. On a
cluster a project's own images (its commits) are named under
projects/<project>/, which only it may write, or read by name; every other
name is the operator's (pulled, built, shipped to the blob store), which no
project may write. Without this, a commit tagged "python:3.12" put one
project's files under every other project's next create on that node.
Checked by name, before any lookup: an answer says nothing of what exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from corral import labels as platform_labels
from corral.addresses import inside_host
from corral.api.models import CommitRequest, CreateSandbox, FnCallRequest
from corral.errors import InvalidArgument
from corral.images.egress import allowed_registries
from corral.images.layer import RegistryRef

PREFIX = platform_labels.PROJECT_IMAGES
DISK = "disk:"  # images/disks.py's PREFIX (not imported: the gateway needs no qemu-img)


own = platform_labels.own_images


# Labels a node looks layers up by, to reuse one instead of making it again
# (an OCI layer by its chain id, a built step by its cache key, an E2B
# template by its source): a node's store is shared by every project on it,
# so a project's commit carrying one would be taken for the platform's own
# next time any project pulls or builds that. Through a gateway they are
# the platform's.
PLATFORM_LABELS = ("oci.", "build.", "e2b.", "toolchains.")
# But for what E2B's snapshots say of themselves (api/compat/e2b/snapshots.py),
# which a node never looks a layer up by: a gateway lists a project's own
# layers only, so these find nothing of anyone else's.
SNAPSHOT_LABELS = ("e2b.snapshot", "e2b.sandbox", "e2b.spec", "e2b.name")


def check_commit(project: str, req: CommitRequest, owner: str, sandbox_id: str = "") -> None:
    """A commit's tag is under the committing project's own names, and its
    labels are none the platform looks layers up by. `owner`: the project
    of the sandbox, which must be the committing one: its node labels the
    layer with the sandbox's project (ImageStore.for_project), so a parent
    project committing a child's sandbox would name a layer it cannot use."""
    if owner != project:
        raise InvalidArgument(
            "sandbox_id",
            f"must be a sandbox of the committing project {project!r} (it is {owner!r}'s: "
            "commit it with that project's key)",
            sandbox_id,
        )
    for key in req.labels:
        if key.startswith(PLATFORM_LABELS) and key not in SNAPSHOT_LABELS:
            raise InvalidArgument(
                f"labels.{key}",
                "must not start with "
                + ", ".join(f"'{p}'" for p in PLATFORM_LABELS)
                + " through a gateway (the platform finds its own layers by them)",
                key,
            )
    tag = req.tag
    if not tag.startswith(own(project)):
        raise InvalidArgument(
            "tag",
            f"must start with '{own(project)}' through a gateway (a node's images are shared "
            "by every project; other names are the operator's)",
            tag,
        )


def check_registry(field: str, ref: str) -> None:
    """A reference to an OCI registry, which the node then pulls from as
    root: never one on the cluster's own network (a loopback, private or
    link-local address, a local name), which would make every node a proxy
    into it; and, if the operator lists registries (CORRAL_REGISTRIES, a
    comma-separated list of HOST[:PORT]), one of those."""
    try:
        remote = RegistryRef.parse(ref, field)
    except InvalidArgument:
        return  # not a registry's: the node's own check names the rule
    if remote is None:
        return
    allowed = allowed_registries()
    if allowed:
        if remote.host not in allowed:
            raise InvalidArgument(
                field, f"must name a registry this cluster pulls from ({', '.join(allowed)})", ref
            )
        return
    inner = inside_host(remote.host)
    if inner:
        raise InvalidArgument(
            field,
            "must not name a registry on a loopback, private or link-local address or a local "
            "name through a gateway (the node would fetch it from inside the cluster's network)",
            ref,
        )


def check_refs(project: str, refs: Sequence[tuple[str, str | None]]) -> None:
    """Each (field, reference) names the operator's images or `project`'s,
    never another project's, and no registry inside the cluster's network.
    A VM's own disk (disk:NAME, images/disks.py) is named and owned the same
    way as an image."""
    for field, given in refs:
        if given:
            check_registry(field, given)
        ref = given.removeprefix(DISK) if given else given
        if ref and ref.startswith(PREFIX) and not ref.startswith(own(project)):
            raise InvalidArgument(
                field,
                f"must not name another project's images or disks (yours: {own(project)}...)",
                given,
            )


def check_create(project: str, req: CreateSandbox) -> None:
    """A create's image, workspace and toolkits."""
    toolkits = ((f"toolkit.{i}", t) for i, t in enumerate(req.toolkit))
    check_refs(project, [("image", req.image), ("workspace", req.workspace), *toolkits])


def check_call(project: str, req: FnCallRequest) -> FnCallRequest:
    """A function call's image, as a create's; the request a node gets
    names the project, whatever the caller said, and the node runs it on no
    layer another project committed (ImageStore.for_project)."""
    check_refs(project, [("image", req.image)])
    return req.model_copy(update={"project": project})
