"""Tiny tasks for the tests (also used by the CLI test as a task file)."""

from __future__ import annotations

from typing import Any

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import Solver, generate

WORDS = ["lamp", "tea", "stairs", "green", "brass", "dusk", "light", "sea"]
HOOKS = ["blocks.1.hook_out", "hook_embed", "blocks.0.attn.hook_pattern"]
STEER = {"blocks.0.hook_out": {"op": "add", "value": 3.0}}


def samples(n: int = 8) -> list[Sample]:
    return [Sample(input=f"Repeat: {w}", target=w, id=f"s{i}") for i, w in enumerate(WORDS[:n])]


def make_task(
    solver: Solver | list[Solver] | None = None, n: int = 8, epochs: int = 1, **kw: Any
) -> Task:
    return Task(
        dataset=samples(n), solver=solver or generate(), scorer=includes(), epochs=epochs, **kw
    )


@task
def capture_task(output_dir: str = "acts", steer: bool = True) -> Task:
    from tl_driver_inspect import capture_activations, intervene

    solvers = [intervene(STEER)] if steer else []
    return make_task([*solvers, capture_activations(HOOKS, output_dir=output_dir)], epochs=2)
