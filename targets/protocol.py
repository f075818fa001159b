"""The Target protocol: what a workload must expose for sg-opt to tune it.

This module is the only one a user's own target needs to import. It holds the typed knob space
(every value the agent may change, with its domain, reason and numerics class), kernel slots
(replaceable kernels with a torch reference, an input generator and a FLOP/byte model), and the
Session a target builds for one configuration.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch

from targets.digest import sequence_digest  # noqa: F401  (the digest a Session's param_digest returns)
from targets.tuning import Headroom, QualityMetric, Rule  # noqa: F401  (what a target may add: Target.rules, ...)

NumericsClass = Literal["exact", "reorder", "precision", "model"]
Category = Literal["precision", "kernel", "embedding", "data", "host", "compile", "memory", "distributed", "model"]
KnobKind = Literal["choice", "bool", "int", "float"]

NUMERICS_CLASSES: tuple[str, ...] = ("exact", "reorder", "precision", "model")
CATEGORIES: tuple[str, ...] = ("precision", "kernel", "embedding", "data", "host", "compile", "memory",
                                "distributed", "model")


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message is one sentence meant for them."""


def user_cache_dir() -> Path:
    """Where sg-opt keeps what it measured or built once and reuses (``$XDG_CACHE_HOME/sg-opt``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sg-opt"


def _same_type(value: Any, choice: Any) -> bool:
    """Whether ``value`` may stand for ``choice`` of a choice knob: a bool only for a bool, an int for an int or
    a float, a float only for a float."""
    if isinstance(value, bool) or isinstance(choice, bool):
        return isinstance(value, bool) and isinstance(choice, bool)
    if isinstance(choice, float):
        return isinstance(value, (int, float))
    return type(value) is type(choice) or not isinstance(value, (int, float))


@dataclass(frozen=True)
class Knob:
    """One tunable value: its type and domain, default, category, numerics class and why it matters."""

    name: str
    kind: KnobKind
    default: Any
    why: str
    category: Category
    numerics: NumericsClass
    choices: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    active_when: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (knob, values): it has an effect only then
    user_setting: bool = False  # a limit of the user's environment (e.g. a memory budget): never tuned
    value_numerics: tuple[tuple[Any, NumericsClass], ...] = ()  # (value, class): values that promise otherwise
    single_process: tuple[Any, ...] = ()  # values a run on several ranks has no path for: refused there

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"knob {self.name}: unknown category {self.category!r}")
        for numerics in (self.numerics, *(numerics for _, numerics in self.value_numerics)):
            if numerics not in NUMERICS_CLASSES:
                raise ValueError(f"knob {self.name}: unknown numerics class {numerics!r}")
        for value in (self.default, *(value for value, _ in self.value_numerics), *self.single_process):
            self.validate(value)
        if self.default in self.single_process:
            raise ValueError(f"knob {self.name}: its default must run on several ranks")

    def numerics_of(self, value: Any) -> NumericsClass:
        """The numerics class a change to `value` promises: the knob's, unless value_numerics names the value."""
        return next((numerics for v, numerics in self.value_numerics if v == value), self.numerics)

    def numerics_text(self) -> str:
        """The knob's class, with the values that promise another (for listings and prompts)."""
        others = ", ".join(f"{v}: {n}" for v, n in self.value_numerics)
        return f"{self.numerics} ({others})" if others else self.numerics

    def is_active(self, config: Mapping[str, Any]) -> bool:
        """Whether the knob has any effect under a resolved config (a tile size of an unused kernel has none)."""
        return all(config.get(name) in values for name, values in self.active_when)

    def runs_on(self, value: Any, ranks: int) -> bool:
        """Whether a run on `ranks` processes has a path for this value (``single_process``)."""
        return ranks == 1 or value not in self.single_process

    def values(self, ranks: int = 1) -> tuple[Any, ...]:
        """The values of a bool or choice knob that a run on `ranks` processes can take (empty for a range)."""
        values = (True, False) if self.kind == "bool" else self.choices
        return tuple(v for v in values if self.runs_on(v, ranks))

    def domain(self, ranks: int = 1) -> str:
        """The domain as a short human-readable string (what a run on `ranks` processes can take)."""
        if self.kind == "bool" or self.choices:
            return " | ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in self.values(ranks))
        return f"[{self.low}, {self.high}]"

    def validate(self, value: Any) -> Any:
        """Return the value coerced to the knob's type, or raise ConfigError saying why not."""
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            raise ConfigError(f"knob {self.name} takes true or false, not {value!r}")
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"knob {self.name} takes an integer, not {value!r}")
        elif self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"knob {self.name} takes a number, not {value!r}")
            value = float(value)
        if self.choices:
            # equal is not enough: true == 1 and 2.0 == 2, yet a worker would get a bool or a float
            same = [choice for choice in self.choices if choice == value and _same_type(value, choice)]
            if not same:
                raise ConfigError(f"knob {self.name} must be one of {self.domain()}, not {value!r}")
            return same[0]
        if self.low is not None and value < self.low or self.high is not None and value > self.high:
            raise ConfigError(f"knob {self.name} must lie in {self.domain()}, not {value!r}")
        return value

    def parse(self, text: str) -> Any:
        """Parse a command-line string (``--set name=text``) into a valid value."""
        text = text.strip()
        try:
            if self.kind == "bool":
                lowered = text.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                value: Any = lowered in ("true", "1", "yes", "on")
            elif self.kind == "int":
                value = int(text)
            elif self.kind == "float":
                value = float(text)
            else:
                value = text
                for choice in self.choices:  # choices may be ints in a "choice" knob
                    if str(choice) == text:
                        value = choice
        except ValueError:
            raise ConfigError(f"knob {self.name} cannot take {text!r}: its domain is {self.domain()}") from None
        return self.validate(value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "default": self.default, "domain": self.domain(),
            "category": self.category, "numerics": self.numerics, "why": self.why,
            "choices": list(self.choices), "low": self.low, "high": self.high,
            "single_process": list(self.single_process),
        }


@dataclass(frozen=True)
class Constraint:
    """A rule across knobs (e.g. host placement needs sparse or fused gradients)."""

    message: str
    holds: Callable[[Mapping[str, Any]], bool]


@dataclass(frozen=True)
class KnobSpace:
    """The knobs of a target plus the constraints between them."""

    knobs: tuple[Knob, ...]
    constraints: tuple[Constraint, ...] = ()

    def __post_init__(self) -> None:
        names = [k.name for k in self.knobs]
        if len(names) != len(set(names)):
            raise ValueError("knob names must be unique")

    def __getitem__(self, name: str) -> Knob:
        for knob in self.knobs:
            if knob.name == name:
                return knob
        raise ConfigError(f"unknown knob {name!r}; known knobs: {', '.join(k.name for k in self.knobs)}")

    def __iter__(self) -> Iterator[Knob]:
        return iter(self.knobs)

    def defaults(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs}

    def resolve(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Defaults overlaid with validated overrides; raises ConfigError on any bad name or value."""
        config = self.defaults()
        for name, value in (overrides or {}).items():
            config[name] = self[name].validate(value)
        for constraint in self.constraints:
            if not constraint.holds(config):
                raise ConfigError(constraint.message)
        return config

    def tunable(self, ranks: int = 1) -> list[Knob]:
        """The knobs a proposer may change: all but the user's own settings (limits such as budgets), the
        distributed knobs (a sharding plan) only for a run on several ranks: one process ignores them, and on
        several ranks no knob left with a single value there (``Knob.single_process``)."""
        return [knob for knob in self if not knob.user_setting and (ranks > 1 or knob.category != "distributed")
                and (ranks == 1 or not knob.single_process or len(knob.values(ranks)) > 1)]

    def check_ranks(self, config: Mapping[str, Any], ranks: int) -> None:
        """A ConfigError naming the first value of a resolved config that a run on `ranks` processes has no path
        for (``Knob.single_process``), rather than a run that would quietly measure something else. A
        torch.distributed session checks itself with any `ranks` above 1, whatever its world size."""
        for knob in self:
            if not knob.runs_on(config[knob.name], ranks):
                raise ConfigError(f"{knob.name} = {config[knob.name]!r} runs on one process only, not in a "
                                  f"torch.distributed job (--ranks); there it takes {knob.domain(ranks)}")

    def diff(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of a config that differ from the defaults."""
        return {k: v for k, v in config.items() if self[k].default != v}


@dataclass(frozen=True)
class FlopsBytes:
    """The work of one kernel call: floating-point operations and the fewest bytes it must move."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class PhaseWork:
    """The least work one phase of a step must do, for the roofline floor of the whole step.

    ``flops`` run at the matmul ceiling of ``dtype``; ``bytes`` are device memory reads + writes
    at the copy ceiling; ``bus_bytes`` cross between host and device at the measured bus bandwidth.
    A session that can say this offers ``work_model(bus_bytes_per_step) -> {phase: PhaseWork}``.
    """

    flops: float = 0.0
    bytes: float = 0.0
    bus_bytes: float = 0.0
    dtype: str = "float32"


@dataclass(frozen=True)
class KernelSlot:
    """A named, replaceable kernel with its torch reference, inputs and cost model.

    ``make_inputs(shape, dtype, device, generator)`` draws fresh random inputs for a shape dict;
    ``reference(*inputs)`` is the ground truth; ``cost(shape, dtype)`` feeds the roofline;
    ``signature`` is the fixed call signature every implementation must accept.
    """

    name: str
    signature: str
    reference: Callable[..., Any]
    make_inputs: Callable[..., tuple[Any, ...]]
    cost: Callable[[Mapping[str, int], torch.dtype], FlopsBytes]
    shapes: tuple[Mapping[str, int], ...] = ()
    why: str = ""
    # Whether training ever calls a replacement: False for a slot kept for kernel work alone (benchmarks, the
    # fine profile), which a proposer must not be offered.
    in_training: bool = True
    used_when: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (knob, values): training calls a replacement only then

    def unused_reason(self, config: Mapping[str, Any]) -> str | None:
        """Why training under a resolved config would not call a replacement of this slot, or None."""
        if not self.in_training:
            return f"training never calls kernel slot {self.name}; it is there for kernel work only"
        unmet = [f"{knob} {' or '.join(map(str, values))} (it is {config.get(knob)})"
                 for knob, values in self.used_when if config.get(knob) not in values]
        if unmet:
            return f"training calls a replacement of kernel slot {self.name} only with {' and '.join(unmet)}"
        return None


@runtime_checkable
class Session(Protocol):
    """One built configuration of a target, ready to train.

    Optional: ``work_model(bus_bytes_per_step)`` (each phase's least work, for the roofline floor),
    ``perturb(relative, seed)`` (multiply every dense parameter by 1 +- relative, signs drawn from
    seed: how the agent measures how far the workload carries a rounding-sized difference), and
    ``banked_steps`` (an int: how many steps' input the session can prepare ahead while it is not stepping,
    e.g. batches queued by loader workers; every timed window first runs that many steps untimed, see
    ``targets.worker.banked_steps``), and ``build_parts`` (a dict of seconds per named part of its build,
    ``BuildClock``'s).
    """

    phase_names: tuple[str, ...]
    timer: "PhaseTimer"
    record_grad_norms: bool  # when True, step() records the gradient norms that grad_norms() returns

    def step(self) -> torch.Tensor:
        """Run one training step; return its loss as a detached 0-dim tensor (not synchronised)."""

    def probe(self) -> dict[str, list[float]]:
        """Deterministic outputs on a fixed probe batch, without changing any state."""

    def grad_norms(self) -> dict[str, float]:
        """Gradient norms of the last step, per parameter group (recorded while record_grad_norms is on)."""

    def param_digest(self) -> dict[str, Any]:
        """A digest of all trainable state: sha256 of the bytes plus per-group norms."""

    def quality(self) -> dict[str, float]:
        """Quality metrics on the held-out split (e.g. P@1, P@5, PSP@5)."""

    def counters(self) -> dict[str, float]:
        """Workload counters worth reporting (cache hits, misses, bytes moved...)."""


@dataclass
class Target:
    """A workload sg-opt can optimize: a knob space, kernel slots, sizes and a builder."""

    name: str
    description: str
    knob_space: KnobSpace
    sizes: tuple[str, ...]
    build: Callable[..., Session]  # build(config, size, kernels, device, seed[, data=path]) -> Session
    kernel_slots: tuple[KernelSlot, ...] = ()
    phases: tuple[str, ...] = ()
    default_size: str = ""
    data_formats: tuple[str, ...] = ()  # file formats build(..., data=path) reads; empty: synthetic only
    # Optional: build_ranked(config, size, kernels, device, seed, job[, data=path]) -> Session, this rank's
    # session of a torch.distributed job (job: a targets.ranks.RankContext, its process group joined). Every
    # Session method is then collective, and step() returns the global loss. None: the target runs on one rank.
    build_ranked: Callable[..., Session] | None = None
    # Optional: check_config(config, size), a resolved config's checks that need no build (a ConfigError where it
    # cannot run at that size on one process with the size's own data, e.g. over a memory budget), so that such a
    # candidate is rejected before a worker starts. None: the build finds out.
    check_config: Callable[[Mapping[str, Any], str], None] | None = None
    # Tuning knowledge of the target's own (targets.tuning): rules over its knobs, tried with the core's generic
    # ones (a target's rule wins over a generic one with the same patch); headroom(category, knobs) -> Headroom or
    # None (None: the core's generic figure); target_findings: (phase, category) pairs found only where the
    # target's headroom returns one for them under the incumbent's knobs.
    rules: tuple[Rule, ...] = ()
    headroom: Callable[[str, Mapping[str, Any]], Headroom | None] | None = None
    target_findings: tuple[tuple[str, str], ...] = ()
    # How a model change (numerics class model) is judged: held-out metrics that Session.quality() returns, each
    # with its direction and band, after quality_steps training steps (an int, or size -> int).
    quality_metrics: tuple[QualityMetric, ...] = ()
    quality_steps: int | Callable[[str], int] = 200
    # The fine profile's view of the kernel slots in a built session: slot -> shape dict, the dtype they run in,
    # and slot -> the phase whose work each does. None: the fine profile skips this target.
    slot_shapes: Callable[[Session], Mapping[str, Mapping[str, int]]] | None = None
    slot_dtype: Callable[[Session], torch.dtype] | None = None
    slot_phases: Mapping[str, str] = field(default_factory=dict)

    def steps_for_quality(self, size: str) -> int:
        """Training steps of a quality run at `size`: what the target asks for, at least one."""
        steps = self.quality_steps(size) if callable(self.quality_steps) else self.quality_steps
        return max(1, int(steps))

    def slot(self, name: str) -> KernelSlot:
        for slot in self.kernel_slots:
            if slot.name == name:
                return slot
        raise ConfigError(f"target {self.name} has no kernel slot {name!r}")

    def check_ranks(self, ranks: int) -> int:
        """ranks itself when the target can run on that many processes; else a ConfigError."""
        if ranks < 1:
            raise ConfigError(f"ranks must be at least 1, not {ranks}")
        if ranks > 1 and self.build_ranked is None:
            raise ConfigError(f"target {self.name} runs on one process only (it has no build_ranked); "
                              f"drop --ranks {ranks}")
        return ranks

    def check_size(self, size: str) -> str:
        if size not in self.sizes:
            raise ConfigError(f"target {self.name} has no size {size!r}; sizes: {', '.join(self.sizes)}")
        return size


@dataclass
class PhaseTimer:
    """Names the phases of a step for the profiler and, when asked, times them on the host clock.

    Each phase is a ``record_function`` range, so torch.profiler attributes time to it. When
    ``timing`` is on, the device is synchronised at each boundary so the host clock measures the
    phase's real duration; leave it off when timing whole steps, since it perturbs overlap.
    """

    device: torch.device
    timing: bool = False
    totals: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            if not self.timing:
                yield
                return
            self._sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._sync()
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def take(self) -> dict[str, float]:
        """Return the accumulated seconds per phase and start afresh."""
        totals, self.totals = self.totals, {}
        return totals


@dataclass
class BuildClock:
    """Seconds each part of a session's build took, in order, on the host clock, the device synchronised at each
    mark so that a part's queued kernels count in it. A session keeps them as ``build_parts``; a timing worker
    sends them with its start-up: on an H200 (2026-12-04) a host-table config's timing worker's build took 11-15 s,
    before every measurement whose workers were not started ahead."""

    device: torch.device
    parts: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def mark(self, part: str) -> None:
        """The time since the previous mark (or since the clock began) is `part`'s."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now
