"""Finds a target by ``sg_opt.targets`` entry point name or ``module:attr`` path.

The bundled trainer is found like any other: through the entry point sg-opt's own distribution registers
(pyproject.toml), so no generic module names it.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points

from targets.protocol import ConfigError, Target

ENTRY_POINT_GROUP = "sg_opt.targets"
OWN_DISTRIBUTION = "sg-opt"  # the distribution whose registered target is the commands' default


def _load(path: str, shown: str) -> Target:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"target {shown!r} is not a known name nor of the form module:attr")
    if os.getcwd() not in sys.path:  # module:attr names a user's module in the current directory, as
        sys.path.insert(0, os.getcwd())  # `python -m` would find it (workers get the same via PYTHONPATH)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"target {shown!r}: cannot import module {module_name!r} ({exc})") from exc
    except Exception as exc:  # the module's own code failed: its error in one sentence, the traceback under -v
        raise ConfigError(f"target {shown!r}: importing module {module_name!r} failed with "
                          f"{type(exc).__name__}: {_first_line(exc)}{_where(exc)}") from exc
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


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["(no message)"])[0][:300]


def _where(exc: BaseException) -> str:
    """' (at file.py:12)': the innermost frame of the failed import, the user's line most likely."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})" if tb is not None else ""


def entry_point_targets() -> dict[str, str]:
    """Targets installed under the ``sg_opt.targets`` group (sg-opt's own among them)."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def default_target() -> str:
    """The target the commands take when none is named: the one sg-opt's own distribution registers."""
    own = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)
                 if ep.dist is not None and ep.dist.name == OWN_DISTRIBUTION)
    return own[0] if own else ""


def resolve_target(spec: str) -> Target:
    """A target from an installed entry point name or ``module:attr``."""
    installed = entry_point_targets()
    if spec in installed:
        return _load(installed[spec], spec)
    if ":" in spec:
        return _load(spec, spec)
    known = sorted(installed)
    raise ConfigError(f"unknown target {spec!r}; known targets: {', '.join(known) or 'none installed'} "
                      f"(or give module:attr)")


def known_targets() -> list[str]:
    return sorted(entry_point_targets())
