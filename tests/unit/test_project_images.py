"""A project's commits through a gateway (control/project_images.py): the
tag is under its own names, and no label is one the platform finds its own
layers by. Before, a commit labelled oci.chain_id=<a public base layer's
chain id> was taken by the node's next pull of any image on that base, for
every project."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.api.models import CommitRequest, CreateSandbox
from corral.control import project_images
from corral.errors import ImageNotFound, InvalidArgument
from corral.images.store import ImageStore

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "label",
    ["oci.chain_id", "oci.manifest", "oci.image", "build.key", "build.line", "e2b.source",
     "e2b.snapshots", "e2b.template", "toolchains.source"],
)  # fmt: skip
def test_a_commit_through_a_gateway_carries_no_platform_lookup_label(label: str) -> None:
    req = CommitRequest(tag="projects/acme/x:1", labels={label: "sha256:" + "a" * 64})
    with pytest.raises(InvalidArgument, match="the platform finds its own layers by them") as err:
        project_images.check_commit("acme", req, "acme")
    assert err.value.field == f"labels.{label}"


def test_a_commit_with_its_own_labels_under_its_own_name_passes() -> None:
    req = CommitRequest(tag="projects/acme/x:1", labels={"team": "rl", "ocifoo": "1"})
    project_images.check_commit("acme", req, "acme")
    # What an E2B snapshot says of itself: no node looks a layer up by it.
    snapshot = {k: "1" for k in ("e2b.snapshot", "e2b.name", "e2b.sandbox", "e2b.spec")}
    project_images.check_commit(
        "acme", CommitRequest(tag="projects/acme/snapshots:s", labels=snapshot), "acme"
    )
    # A parent project's commit of its child's sandbox: the layer would be
    # the child's (its node labels it so) under the parent's name.
    with pytest.raises(InvalidArgument, match="must be a sandbox of the committing") as err:
        project_images.check_commit("acme", CommitRequest(tag="projects/acme/x:1"), "job", "s1")
    assert (err.value.field, err.value.value) == ("sandbox_id", "s1")
    with pytest.raises(InvalidArgument) as err:
        project_images.check_commit("acme", CommitRequest(tag="python:3.12"), "acme")
    assert err.value.field == "tag"


@pytest.mark.parametrize(
    "image",
    ["127.0.0.1:5000/x:1", "localhost:5000/x:1", "localhost/x:1", "10.0.0.5:5000/x:1",
     "192.168.1.2/x:1", "169.254.169.254/latest:1", "[::1]:5000/x:1", "[fd00::1]/x:1",
     "registry.internal/x:1", "reg.cluster.local/x:1", "0.0.0.0:80/x:1",
     # As a resolver reads them: any case, a number that is not a dotted quad.
     "LOCALHOST:5000/x:1", "Metadata.Google.Internal/x:1", "127.1:5000/x:1",
     "2130706433:5000/x:1", "0x7f.1:5000/x:1"],
)  # fmt: skip
def test_a_create_through_a_gateway_pulls_from_no_registry_inside_the_network(image: str) -> None:
    """The node pulls as root from inside the cluster's network: through a
    gateway, such a reference would make every node a proxy into it."""
    with pytest.raises(InvalidArgument, match="loopback, private or link-local") as err:
        project_images.check_create("acme", CreateSandbox(image=image))
    assert err.value.field == "image"


@pytest.mark.parametrize(
    "image", ["docker.io/library/debian:bookworm", "ghcr.io/a/b:1", "8.8.8.8:5000/x:1", "img:1"]
)
def test_a_public_registry_or_a_local_name_passes(image: str) -> None:
    project_images.check_create("acme", CreateSandbox(image=image))


def test_an_operator_list_of_registries_is_the_only_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_REGISTRIES", "ghcr.io, 10.0.0.5:5000")
    project_images.check_create("acme", CreateSandbox(image="10.0.0.5:5000/x:1"))  # listed
    project_images.check_create("acme", CreateSandbox(image="ghcr.io/a/b:1"))
    with pytest.raises(InvalidArgument, match="this cluster pulls from") as err:
        project_images.check_create("acme", CreateSandbox(image="docker.io/library/debian:12"))
    assert err.value.field == "image"


def test_a_pull_or_build_never_takes_a_projects_commit_for_its_layer(tmp_path: Path) -> None:
    """However it is labelled (a label from before the gateway refused
    them, or a layer the same as the platform's), a layer named under
    projects/ is never what a pull or a build looks up."""
    store = ImageStore(tmp_path / "images")
    (tmp_path / "m").write_bytes(b"m" * 100)
    (tmp_path / "b").write_bytes(b"b" * 100)
    store.add(tmp_path / "m", tmp_path / "b", chunk_size=4096, kind="toolkit",
              tag="projects/rival/x:1", labels={"oci.chain_id": "sha256:" + "c" * 64})  # fmt: skip
    assert store.find_by_label("oci.chain_id", "sha256:" + "c" * 64) is None


def test_a_layer_another_project_committed_is_not_there_for_this_one(tmp_path: Path) -> None:
    """A node labels a commit through a gateway with its project: another
    project naming it by digest is told what it would be told of a layer
    the node lacks, word for word; its own project, an embedded caller and
    the operator's unlabelled layers pass. A commit from before the label
    is judged by its names, when named by digest."""
    store = ImageStore(tmp_path / "images")

    def add(content: bytes, **kw: Any) -> Any:
        (tmp_path / "m").write_bytes(b"m" * 100)
        (tmp_path / "b").write_bytes(content)
        return store.add(tmp_path / "m", tmp_path / "b", chunk_size=4096, kind="toolkit", **kw)

    theirs = add(b"b" * 100, tag="projects/rival/x:1", labels={"corral.project": "rival"})
    operators = add(b"c" * 100, tag="tools:1")
    # Committed before nodes labelled commits.
    old = add(b"d" * 100, tag="projects/rival/old:1", labels={"corral.source": "commit:s"})
    for project in ("rival", None):
        assert store.for_project(theirs, project, "toolkit[0]") is theirs
    for project in ("acme", "rival", None):
        assert store.for_project(operators, project, "image", by_name=True) is operators
    with pytest.raises(ImageNotFound) as err:
        store.for_project(theirs, "acme", "toolkit[0]")
    with pytest.raises(ImageNotFound) as missing:
        store.digest_of("sha256:" + "e" * 64, "toolkit[0]")
    assert str(err.value).replace(theirs.digest, "D") == str(missing.value).replace(
        "sha256:" + "e" * 64, "D"
    )
    assert err.value.details == {"field": "toolkit[0]", "ref": theirs.digest}
    assert store.for_project(old, "acme", "image") is old  # by name: a create's check
    with pytest.raises(ImageNotFound):
        store.for_project(old, "acme", "image", by_name=True)
    assert store.for_project(old, "rival", "image", by_name=True) is old
    store.tag(old.digest, "tools:2")  # the operator's too: the operator's
    assert store.for_project(old, "acme", "image", by_name=True) is old
