"""Progress bars for long work (image builds, bulk creation), via rich.

A base module, not part of the CLI: the CLI's image commands and the
rollout demo both draw these bars, and rollout sits below cli."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class ProgressFn(Protocol):
    def __call__(self, task: str, done: float, total: float | None) -> None: ...


@contextmanager
def progress_bar(disable: bool = False) -> Iterator[ProgressFn]:
    """Yields a callback(task, done, total); each task name gets its own bar."""
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=disable,
        transient=False,
    )
    tasks: dict[str, TaskID] = {}

    def update(task: str, done: float, total: float | None) -> None:
        if task not in tasks:
            tasks[task] = bar.add_task(task, total=total)
        bar.update(tasks[task], completed=done, total=total)

    with bar:
        yield update
