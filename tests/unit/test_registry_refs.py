"""Registry references (images/layer.py RegistryRef): what names a
registry, Docker Hub's shorthand, local names, and bad references."""

from __future__ import annotations

import pytest

from corral.errors import InvalidArgument
from corral.images.layer import Ref, RegistryRef


@pytest.mark.parametrize(
    ("text", "local"),
    [
        ("127.0.0.1:5000/team/app:1", "127.0.0.1_5000/team/app:1"),
        ("ghcr.io/org/img", "ghcr.io/org/img:latest"),
        ("localhost/x:2", "localhost/x:2"),
        ("registry.example.com/a/b/c:v1.2", "registry.example.com/a/b/c:v1.2"),
        (f"quay.io/x@sha256:{'a' * 64}", f"quay.io/x:sha256-{'a' * 64}"),
    ],
)
def test_a_registry_reference_has_a_local_name(text: str, local: str) -> None:
    ref = RegistryRef.parse(text)
    assert ref is not None and f"{ref.local_name}:{ref.local_tag}" == local
    assert str(Ref.parse(text)) == local  # either spelling resolves to the pulled image


@pytest.mark.parametrize("text", ["debian-python:bookworm", "library/x:1", "ws-six:1.16.0"])
def test_a_local_name_is_not_a_registry_reference(text: str) -> None:
    assert RegistryRef.parse(text) is None


@pytest.mark.parametrize(
    ("text", "pulled"),
    [
        ("debian:bookworm", "docker.io/library/debian:bookworm"),
        ("python", "docker.io/library/python:latest"),
        ("org/img:1", "docker.io/org/img:1"),
        ("ghcr.io/org/img:1", "ghcr.io/org/img:1"),
    ],
)
def test_pull_reads_docker_hubs_shorthand(text: str, pulled: str) -> None:
    assert str(RegistryRef.for_pull(text)) == pulled


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1:5000/Team/App:1", "ghcr.io/org/img@sha256:xyz", "ghcr.io/org/img:bad tag",
     "ghcr.io//img:1"],
)  # fmt: skip
def test_a_bad_registry_reference_names_its_field(text: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        RegistryRef.parse(text, "image")
    assert err.value.details["field"] == "image"
