"""A project's commits through a gateway (control/project_images.py): the
tag is under its own names, and no label is one the platform finds its own
layers by. Before, a commit labelled oci.chain_id=<a public base layer's
chain id> was taken by the node's next pull of any image on that base, for
every project."""

from __future__ import annotations

import pytest

from corral.api.models import CommitRequest
from corral.control import project_images
from corral.errors import InvalidArgument

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "label",
    ["oci.chain_id", "oci.manifest", "oci.image", "build.key", "build.line", "e2b.source",
     "e2b.snapshot"],
)  # fmt: skip
def test_a_commit_through_a_gateway_carries_no_platform_lookup_label(label: str) -> None:
    req = CommitRequest(tag="projects/acme/x:1", labels={label: "sha256:" + "a" * 64})
    with pytest.raises(InvalidArgument, match="the platform finds its own layers by them") as err:
        project_images.check_commit("acme", req)
    assert err.value.field == f"labels.{label}"


def test_a_commit_with_its_own_labels_under_its_own_name_passes() -> None:
    req = CommitRequest(tag="projects/acme/x:1", labels={"team": "rl", "ocifoo": "1"})
    project_images.check_commit("acme", req)
    with pytest.raises(InvalidArgument) as err:
        project_images.check_commit("acme", CommitRequest(tag="python:3.12"))
    assert err.value.field == "tag"
