"""What a candidate kernel's source may reach: the namespaces an attribute chain may pass through, the names,
attributes and fragments that reach files, processes, timing or global state, and the static resolution of a
chain step against the real modules (``validators.source`` walks the syntax tree; the module docstring there says
why an allow-list). Kept apart so that the policy reads as one list, and changes as one."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

# The module namespaces an attribute chain may pass through. None: every public member that is not a module,
# was defined in the namespace's own package and is not TorchScript machinery (a module only when it is listed
# here too); a set: those members only.
NAMESPACES: dict[str, frozenset[str] | None] = {
    "torch": None,
    "torch.nn": frozenset({"functional"}),  # only the route to functional: modules, init, parallel... are not kernels
    "torch.nn.functional": None,
    "torch.linalg": None,
    "torch.special": None,
    "torch.fft": None,
    # Read-only device queries, the caller's stream, and the context managers that launch on a given stream or
    # device. Never Stream/Event/ExternalStream or graphs (work the caller's stream does not wait for, or replays
    # later), memory, allocator, RNG or settings (process-wide state), cudart, jiterator, nvtx or ipc.
    "torch.cuda": frozenset({"is_available", "is_bf16_supported", "current_device", "device_count",
                             "get_device_name", "get_device_capability", "get_device_properties",
                             "current_stream", "default_stream", "stream", "device", "synchronize"}),
    "triton": frozenset({"jit", "autotune", "Config", "heuristics", "cdiv", "next_power_of_2", "language"}),
    "triton.language": None,
    "triton.language.math": None,
    "triton.language.extra": frozenset({"libdevice", "cuda"}),  # its `modules` is sys.modules
    "triton.language.extra.libdevice": None,
    "triton.language.extra.cuda": frozenset({"libdevice"}),  # not globaltimer, smid or gdc
    "triton.language.extra.cuda.libdevice": None,
    "math": None,
}
ALLOWED_MODULES: frozenset[str] = frozenset(NAMESPACES) | {"__future__"}
ALLOWED_DECORATORS: frozenset[str] = frozenset({"triton.jit", "triton.autotune", "triton.heuristics"})
CONSTANT_TYPES = (bool, int, float, complex, str, bytes, type(None))

# Names (as identifiers or attributes) that reach files, processes, the interpreter or introspection.
FORBIDDEN_NAMES: frozenset[str] = frozenset({
    "open", "os", "sys", "subprocess", "socket", "eval", "exec", "compile", "__import__", "importlib",
    "ctypes", "builtins", "globals", "locals", "vars", "breakpoint", "input", "exit", "quit",
    "setattr", "delattr",  # attribute assignment by any spelling is monkeypatching
    "help", "license", "copyright", "credits",  # interactive helpers that read files and start pagers
    "io", "FileIO", "pickle", "marshal", "shutil", "tempfile", "pathlib", "gc", "inspect", "threading",
})
# Builtins that walk from an object to its class, the class's bases and their members.
CLASS_WALK_NAMES: frozenset[str] = frozenset({"type", "super", "dir", "object"})
# Frames, code objects and tracebacks: a generator's gi_frame.f_back reaches the caller's locals.
INTROSPECTION_PREFIXES: tuple[str, ...] = ("gi_", "cr_", "ag_", "f_", "tb_", "co_")
# Attributes that load or save code or data, reach the network or other processes, or time kernels. Checked on
# any object, resolved or not. Not here: data_ptr (an address) and pin_memory (pinned host memory), which reach
# nothing outside the process and can fake nothing.
FORBIDDEN_APIS: dict[str, str] = {
    **{name: "reads the allocator's statistics, where the copies a spot check takes would show it is being checked"
       for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
                    "memory_stats", "mem_get_info", "memory_snapshot", "memory_summary")},
    "load": "deserialises objects from a file (only triton.language.load is allowed)",
    "loads": "deserialises objects, which runs any code a pickle names",
    "save": "writes objects to a file",
    "dump": "writes objects to a file",
    "dumps": "serialises objects for another process",
    "from_file": "maps a file into a tensor",
    "tofile": "writes a file",
    "fromfile": "reads a file",
    "numpy": "leaves torch for numpy, whose arrays read and write files (tofile, dump, load)",
    "storage": "exposes raw storage, which maps files and is shared between processes",
    "untyped_storage": "exposes raw storage, which maps files and is shared between processes",
    "share_memory_": "moves a tensor into shared memory that other processes can map",
    "as_subclass": "makes a tensor an instance of another class, whose methods can answer the validator",
    "import_ir_module": "loads TorchScript code",
    "import_ir_module_from_buffer": "loads TorchScript code",
    "get_device_module": "returns a module (torch.cuda with its memory, streams and settings) out of static sight",
    "prepare_multiprocessing_environment": "prepares other processes",
    "Stream": "starts a stream the caller does not wait for, so work escapes the measurement",
    "ExternalStream": "starts a stream the caller does not wait for, so work escapes the measurement",
    "Event": "times or orders work across streams, which belongs to the validator",
    "hub": "downloads and runs code",
    "cpp_extension": "compiles and loads native code",
    "load_library": "loads native code",
    "library": "registers operators that replace torch's own",
    "py_impl": "registers operators that replace torch's own",
    "CUDAPluggableAllocator": "loads a native allocator",
    "change_current_allocator": "replaces the allocator",
    "cudart": "exposes the raw CUDA runtime",
    "multiprocessing": "starts processes",
    "distributed": "opens network connections",
    "package": "reads and writes code archives",
    "onnx": "writes files",
    "profiler": "interferes with measurement",
    "testing": "holds timing and comparison shortcuts that belong to the validator",
    "runtime": "reaches Triton's driver, cache and benchmarking internals",
    "compiler": "reaches compiler internals and caches",
    "tools": "reaches Triton's tooling",
    "knobs": "changes Triton's global configuration",
    "backends": "holds global numerics switches (TF32, reduced-precision reductions)",
    "fork": "runs work on another thread that can outlive the call",
    "futures": "runs work on another thread that can outlive the call",
    "format": "walks attributes named inside a string ('{0.__globals__}'), out of static sight",
    "format_map": "walks attributes named inside a string ('{0.__globals__}'), out of static sight",
}
# Fragments of attribute names with the same verdict (whatever the prefix): (fragment, case-sensitive, why).
FORBIDDEN_FRAGMENTS: tuple[tuple[str, bool, str], ...] = (
    ("file", False, "reads or writes files"),
    ("Storage", True, "is a storage class, which maps files and shares memory between processes"),
    ("profiler", False, "interferes with measurement"),
    ("multiprocessing", False, "starts processes"),
)
# Attributes that change process-wide state: RNG, default dtype/device/stream, determinism, hooks.
GLOBAL_STATE_NAMES: frozenset[str] = frozenset({
    "manual_seed", "manual_seed_all", "seed", "seed_all", "random", "fork_rng", "get_rng_state",
    "get_rng_state_all", "use_deterministic_algorithms", "default_generator",
})
GLOBAL_STATE_PREFIXES: tuple[str, ...] = ("set_", "register_")
TRITON_LANGUAGE = "triton.language"
ATTRIBUTE_BUILTINS = ("getattr", "hasattr")


MISSING = object()  # a chain step that does not resolve


class _Modules:
    """The real modules behind ``NAMESPACES``, imported on first use (and only those: no name from a candidate
    is ever imported). None where one cannot be imported here, e.g. triton on a machine without it."""

    def __init__(self) -> None:
        self.loaded: dict[str, ModuleType | None] = {}

    def get(self, name: str) -> ModuleType | None:
        if name not in NAMESPACES:
            return None
        if name not in self.loaded:
            try:
                self.loaded[name] = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a missing or broken package: nothing through it can be resolved
                self.loaded[name] = None
        return self.loaded[name]


MODULES = _Modules()


def origin_of(value: Any) -> str:
    """The module a class or function was defined in (for other objects, their type's)."""
    holder = value if inspect.isclass(value) or inspect.isroutine(value) else type(value)
    origin = getattr(holder, "__module__", None)
    return origin if isinstance(origin, str) else ""


def is_machinery(value: Any) -> bool:
    """TorchScript, serialisation and file-reader classes torch exports from its C++ bindings."""
    return inspect.isclass(value) and type(value).__name__ == "pybind11_type"


def member(owner: Any, attr: str) -> Any:
    """``owner.attr`` without running any code (no __getattr__, no properties), or MISSING; a submodule listed
    in ``NAMESPACES`` is imported first, as the candidate's own import of it would."""
    if inspect.ismodule(owner):
        listed = MODULES.get(f"{owner.__name__}.{attr}")
        if listed is not None:
            return listed
    try:
        return inspect.getattr_static(owner, attr, MISSING)
    except Exception:  # noqa: BLE001 - an object that cannot be inspected resolves to nothing
        return MISSING


def member_problem(namespace: ModuleType, value: Any) -> str | None:
    """Why a non-module member of an open namespace is out of bounds, or None."""
    if isinstance(value, CONSTANT_TYPES) or (isinstance(value, tuple) and all(isinstance(v, CONSTANT_TYPES)
                                                                              for v in value)):
        return None
    if is_machinery(value):
        return "part of torch's TorchScript and serialisation machinery"
    package = namespace.__name__.split(".")[0]
    origin = origin_of(value)
    if origin.split(".")[0] != package:
        return f"defined in {origin or 'an unknown module'}, not in {package}"
    return None
