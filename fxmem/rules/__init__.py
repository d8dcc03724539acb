"""Registries of the rules that vary by op, optimizer and device, each built in exactly one place.

A key is in one of three states (as in fvcore's handle tables): handled by a registered rule,
ignored with a written reason, or missing. Per-call overrides are merged over a copy of the defaults;
the global registries are never mutated after import.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from fxmem.errors import DuplicateRuleError, InputSpecError

__all__ = ["Ignored", "Missing", "Registry", "TorchRelease", "torch_release"]

TorchRelease = tuple[int, int]
"""(major, minor) of a torch release: rules that changed between releases follow the one the GPU job runs."""


def torch_release(version: str | None = None) -> TorchRelease:
    """(major, minor) of ``version`` ("2.11", "2.11.0+cu130"; None: the torch fxmem runs with).

    >>> torch_release("2.11.0+cu130")
    (2, 11)
    """
    match = re.match(r"(\d+)\.(\d+)", version if version is not None else torch.__version__)
    if match is None:
        raise InputSpecError(f"torch version {version!r} is not a release number; give it as MAJOR.MINOR, e.g. --torch-version 2.11.")
    return int(match.group(1)), int(match.group(2))


K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


@dataclass(frozen=True)
class Ignored:
    """A known key that needs no rule, with the reason shown to users who ask."""

    reason: str


@dataclass(frozen=True)
class Missing:
    """A key nobody registered."""


class Registry(Generic[K, R]):
    """Maps keys to rules; registering a key twice is an error, not a silent override."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._rules: dict[K, R] = {}
        self._ignored: dict[K, Ignored] = {}

    def register(self, *keys: K) -> Callable[[R], R]:
        def decorate(rule: R) -> R:
            for key in keys:
                self._check_new(key)
                self._rules[key] = rule
            return rule

        return decorate

    def ignore(self, *keys: K, reason: str) -> None:
        for key in keys:
            self._check_new(key)
            self._ignored[key] = Ignored(reason)

    def lookup(self, key: K) -> R | Ignored | Missing:
        if key in self._rules:
            return self._rules[key]
        return self._ignored.get(key, Missing())

    def keys(self) -> list[K]:
        return [*self._rules, *self._ignored]

    def rules(self) -> Mapping[K, R]:
        return dict(self._rules)

    def merged(self, other: Registry[K, R]) -> Registry[K, R]:
        """A new registry: ``other``'s entries over a copy of this one's."""
        out: Registry[K, R] = Registry(self.name)
        out._rules = {**self._rules, **other._rules}
        out._ignored = {k: v for k, v in {**self._ignored, **other._ignored}.items() if k not in other._rules}
        return out

    def _check_new(self, key: K) -> None:
        if key in self._rules or key in self._ignored:
            existing = self._rules.get(key, self._ignored.get(key))
            raise DuplicateRuleError(
                f"{self.name} registry: {key!r} is already registered ({existing!r}); "
                "pass a per-call RuleSet to override it instead of registering it twice."
            )
