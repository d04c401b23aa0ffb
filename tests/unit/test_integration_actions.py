"""What the framework adapters make of a model's tool calls and text
(corral.integrations.actions), and how a task config is checked
(EpisodeSpec.from_config): tables of good and bad input."""

from __future__ import annotations

from typing import Any

import pytest

from corral.errors import InvalidArgument
from corral.integrations.actions import (
    ActionError,
    Edit,
    Read,
    Shell,
    Submit,
    Write,
    from_arguments,
    from_text,
)
from corral.integrations.episode import EpisodeSpec, clip

GOOD_ARGS: list[tuple[Any, Any]] = [
    ({"command": "ls -la"}, Shell("ls -la")),
    ({"command": "sleep 1", "timeout": 5}, Shell("sleep 1", 5.0)),
    ('{"command": "ls"}', Shell("ls")),  # the JSON text of an object
    ({"path": "a.py"}, Read("a.py")),
    ({"path": "a.py", "content": ""}, Write("a.py", "")),
    ({"path": "/abs/a.py", "old": "x", "new": ""}, Edit("/abs/a.py", "x", "")),
    ({"submit": True}, Submit()),
]

BAD_ARGS: list[tuple[Any, str]] = [
    ("{not json", "must be a JSON object"),
    ('"rm -rf /"', "must be a JSON object"),  # valid JSON, but a string
    ("rm -rf /", "must be a JSON object"),
    ([1, 2], "must be a JSON object, got list"),
    (None, "must be a JSON object, got NoneType"),
    ({}, "unrecognised fields []"),
    ({"cmd": "ls"}, "unrecognised fields ['cmd']"),
    ({"command": 7}, "`command` must be a string, got int"),
    ({"command": "   "}, "`command` is empty"),
    ({"command": "ls", "cwd": "/"}, "unknown field `cwd` beside `command`"),
    ({"command": "ls", "timeout": -1}, "`timeout` must be a positive number"),
    ({"command": "ls", "timeout": True}, "`timeout` must be a positive number"),
    ({"path": ""}, "`path` must be 1-4096 characters"),
    ({"path": "a\0b"}, "no NUL byte"),
    ({"path": 3}, "`path` must be a string"),
    ({"path": "a", "content": 3}, "`content` must be a string"),
    ({"path": "a", "old": "", "new": "x"}, "`old` is empty"),
    ({"path": "a", "old": "x"}, "unrecognised fields ['old', 'path']"),
    ({"submit": False}, 'send exactly {"submit": true}'),
    ({"submit": True, "command": "ls"}, 'send exactly {"submit": true}'),
]


@pytest.mark.parametrize(("args", "want"), GOOD_ARGS)
def test_tool_arguments_parse(args: Any, want: Any) -> None:
    assert from_arguments(args) == want


@pytest.mark.parametrize(("args", "message"), BAD_ARGS)
def test_bad_tool_arguments_are_observations_naming_the_field(args: Any, message: str) -> None:
    got = from_arguments(args)
    assert isinstance(got, ActionError), got
    assert got.message.startswith("error:") and message in got.message, got.message


TEXT: list[tuple[str, Any]] = [
    ("I'll look.\n<bash>ls -la</bash> then more", Shell("ls -la")),
    (
        "<bash>\nfor i in 1 2; do\n echo $i\ndone\n</bash>",
        Shell("for i in 1 2; do\n echo $i\ndone"),
    ),
    ('<write path="x/y.py">print(1)\n</write>', Write("x/y.py", "print(1)\n")),
    (
        '<edit path="a.py">\n<old>a - b</old>\n<new>a + b</new>\n</edit>',
        Edit("a.py", "a - b", "a + b"),
    ),
    ('<read path="a.py"/>', Read("a.py")),
    ("All done <submit/>", Submit()),
    ("<submit />", Submit()),
    ("<bash>one</bash><bash>two</bash>", Shell("one")),  # the first action only
]


@pytest.mark.parametrize(("text", "want"), TEXT)
def test_text_actions_parse(text: str, want: Any) -> None:
    assert from_text(text) == want


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("I think the bug is in add()", "no action found"),
        ("<bash>ls", "no action found"),  # unclosed
        ("<bash>   </bash>", "`command` is empty"),
        ('<edit path="a"><old></old><new>x</new></edit>', "`old` is empty"),
        ('<read path=""/>', "`path` must be 1-4096"),
    ],
)
def test_bad_text_actions_are_observations(text: str, message: str) -> None:
    got = from_text(text)
    assert isinstance(got, ActionError) and message in got.message, got


def test_a_spec_splits_sandbox_and_episode_fields() -> None:
    spec = EpisodeSpec.from_config(
        {
            "image": "img:1",
            "cpu": 0.5,
            "labels": {"a": "b"},
            "test": "pytest",
            "setup": "make",
            "max_steps": 5,
        }
    )
    assert spec.sandbox == {"image": "img:1", "cpu": 0.5, "labels": {"a": "b"}}
    assert (spec.test, spec.setup, spec.max_steps) == ("pytest", ("make",), 5)


BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({}, "image"),
    ({"image": "i:1", "imgae": "x"}, "imgae"),
    ({"image": "i:1", "max_steps": 0}, "max_steps"),
    ({"image": "i:1", "max_steps": "5"}, "max_steps"),
    ({"image": "i:1", "command_timeout": 0}, "command_timeout"),
    ({"image": "i:1", "observation_limit": 10}, "observation_limit"),
    ({"image": "i:1", "workdir": "rel"}, "workdir"),
    ({"image": "i:1", "test": ["pytest"]}, "test"),
    ({"image": "i:1", "setup": [1]}, "setup"),
    ({"image": "i:1", "cpu": -1}, "cpu"),  # create()'s own check, at config time
    ({"image": "i:1", "memory": "lots"}, "memory"),
]


@pytest.mark.parametrize(("config", "field"), BAD_SPECS)
def test_a_bad_spec_is_refused_by_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        EpisodeSpec.from_config(config, prefix="cfg.")
    assert field in err.value.details.get("field", ""), err.value


def test_clip_keeps_head_and_tail_within_the_limit() -> None:
    text = "HEAD" + "x" * 10_000 + "TAIL"
    out = clip(text, 300)
    assert len(out) <= 300 and out.startswith("HEAD") and out.endswith("TAIL")
    assert "characters cut" in out and clip("short", 300) == "short"
