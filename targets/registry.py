"""Finds a target by built-in name, ``module:attr`` path, or ``sg_opt.targets`` entry point."""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points

from targets.protocol import ConfigError, Target

BUILTIN: dict[str, str] = {"haste-rec": "targets.haste_rec.target:TARGET"}
ENTRY_POINT_GROUP = "sg_opt.targets"


def _load(path: str, shown: str) -> Target:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"target {shown!r} is not a known name nor of the form module:attr")
    if os.getcwd() not in sys.path:  # module:attr names a user's module in the current directory, as
        sys.path.insert(0, os.getcwd())  # `python -m` would find it (workers get the same via PYTHONPATH)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"target {shown!r}: cannot import module {module_name!r} ({exc})") from None
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"target {shown!r}: module {module_name!r} has no attribute {attr!r}")
    if callable(target) and not isinstance(target, Target):
        target = target()
    if not isinstance(target, Target):
        raise ConfigError(f"target {shown!r} is a {type(target).__name__}, not a targets.protocol.Target")
    return target


def entry_point_targets() -> dict[str, str]:
    """Targets installed by other distributions under the ``sg_opt.targets`` group."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve_target(spec: str) -> Target:
    """A target from a built-in name, an installed entry point name, or ``module:attr``."""
    if spec in BUILTIN:
        return _load(BUILTIN[spec], spec)
    installed = entry_point_targets()
    if spec in installed:
        return _load(installed[spec], spec)
    if ":" in spec:
        return _load(spec, spec)
    known = sorted(set(BUILTIN) | set(installed))
    raise ConfigError(f"unknown target {spec!r}; known targets: {', '.join(known)} (or give module:attr)")


def known_targets() -> list[str]:
    return sorted(set(BUILTIN) | set(entry_point_targets()))
