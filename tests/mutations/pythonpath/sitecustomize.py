"""A deliberate bug, put into echoic from outside its code (tests/mutations/test_mutations.py).

Python imports `sitecustomize` at start-up from the first folder on sys.path that
has one; the harness puts this folder first on PYTHONPATH, so every process of a
mutated run loads it: the child pytest and the processes it starts in turn (`echoic
train`, mpirun's ranks), which inherit the environment. ECHOIC_MUTATION names the
mutation. When the module it breaks is imported, the named function is replaced by
the mutant, before anything else can import the name; each call of the mutant
appends "NAME ran in pid PID" to the file ECHOIC_MUTATION_LOG, which shows the
harness that the bug ran and in which process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


def _ran(name: str) -> None:
    with open(os.environ["ECHOIC_MUTATION_LOG"], "a") as f:
        f.write(f"{name} ran in pid {os.getpid()}\n")


def _noop_rng_restore(module: ModuleType, original: Callable) -> Callable:
    def set_rng_state(state: dict[str, Any]) -> None:
        _ran("noop-rng-restore")  # and the RNG states stay as they are

    return set_rng_state


def _rendezvous_returns_none(module: ModuleType, original: Callable) -> Callable:
    def _mpi_rendezvous(env: Any) -> None:
        _ran("rendezvous-returns-none")  # as if mpi4py were missing: the fallback address

    return _mpi_rendezvous


def _persistent_launch_fails(module: ModuleType, original: Callable) -> Callable:
    def recurrences(cell, problems, clip=float("inf"), backend="reference", config=None):
        if backend == "reference":
            return original(cell, problems, clip, backend, config)
        _ran("persistent-launch-fails")  # run_layer catches this and falls back to cuDNN
        raise module.PersistentKernelError("mutation: every persistent launch fails")

    return recurrences


# name -> (module, function in it, mutant factory(module, original function))
MUTATIONS: dict[str, tuple[str, str, Callable]] = {
    "noop-rng-restore": ("echoic.training.checkpoint", "set_rng_state", _noop_rng_restore),
    "rendezvous-returns-none": (
        "echoic.training.distributed",
        "_mpi_rendezvous",
        _rendezvous_returns_none,
    ),
    "persistent-launch-fails": (
        "echoic.model.nn.persistent.function",
        "recurrences",
        _persistent_launch_fails,
    ),
}


class _Mutator(MetaPathFinder):
    """Finds the target module with the other finders and patches it once it has run."""

    def __init__(self, module: str, function: str, make: Callable) -> None:
        self.module, self.function, self.make = module, function, make

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            original = getattr(module, self.function)
            setattr(module, self.function, self.make(module, original))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_name = os.environ.get("ECHOIC_MUTATION")
if _name:
    if _name not in MUTATIONS:
        raise SystemExit(f"ECHOIC_MUTATION={_name}: not one of {sorted(MUTATIONS)}")
    sys.meta_path.insert(0, _Mutator(*MUTATIONS[_name]))
