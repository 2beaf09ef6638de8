"""Load the Triton path of hip-attn 1.2.9 (the InfiniteHiP authors' release) beside kvpot, unmodified.

`import hip_attn` runs the package's `__init__`, which imports every version of the library (v1.0, v1.1, the
patched Llama, the paged sglang path) and with them nvtx, flash_attn, sgl_kernel, cupy, cuda-python, a C++
extension compiled at import, and tilelang; its JIT wrapper then asserts `triton.__version__ == "3.4.0"`. The
attention kvpot compares with (`hip_attn.v1_2.attention_extend.dual_stage_quadratic_hip_attention`: the scan
stages and the block-sparse attention, resident KV) needs none of them. `load_hip` therefore, without touching
hip-attn's files:

1. **Skips the package `__init__`s.** `hip_attn` and `hip_attn.v1_2` are put in `sys.modules` as bare packages
   (a module whose `__path__` is the package's folder: Python's import system then finds the submodules there
   without running `__init__.py`, PEP 302/451). Only the modules the attention imports run.
2. **Placeholders for what only other paths use**, installed only when the real module is missing: `tilelang`
   (the optional TileLang backend, `attention_extend_bsa_tilelang`), `cv2` and `matplotlib` (debug images),
   `numba` (debug renderers and the SM count of the online-offload scan), `cupy` and `cuda` (the UVM offload
   cache), and hip-attn's own `hip_attn.v1_1.offload_runner.tensor_from_pointer` (compiles a C++ extension at
   import; the offload runner only). Every attribute of a placeholder is a `Placeholder` that raises
   `KvpotError` naming the module when it is called, so a path that does need one fails loudly instead of
   computing something else. `numba.njit(...)` is called at import as a decorator: it returns a decorator
   whose function raises when called.
3. **The JIT wrapper.** `hip_attn.v1_2.triton_jit.triton_jit` builds hip-attn's `JITFunction` subclass (a
   faster binder written against Triton 3.4.0's internals, hence the assertion). Under any other Triton the
   module is replaced by one whose `triton_jit` returns the installed Triton's own `triton.jit` (and
   `triton.autotune` with the same configs and keys where hip-attn autotunes): the same kernel source compiled
   by the same compiler; only the launcher differs (launch overhead, not results). Under Triton 3.4.0 hip-attn's
   own wrapper is used unchanged. hip-attn's wrapper also refuses `TRITON_INTERPRET=1` ("interpret should
   avoided"), and `attention_extend_bsa` calls `torch.cuda.get_device_name()` at import (its autotune configs):
   on a CPU hip-attn cannot even be imported (tried with Triton 3.6.0 and CPU PyTorch: every placeholder above
   held, the import stopped there), so this loader refuses both up front. `load_hip_interpreted` runs it there
   all the same, slowly, for checks at tiny shapes (it says what it changes in this process).

`HipModules.replaced` records every substitution, and the harness writes it to its JSON.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

from kvpot.errors import KvpotError

PINNED_TRITON = "3.4.0"  # what hip_attn/v1_2/triton_jit.py asserts
# module -> why kvpot's harness can run without it (installed as a placeholder only when missing)
OPTIONAL = {
    "tilelang": "the TileLang attention backend (attention_extend_bsa_tilelang), not the Triton one compared",
    "cv2": "debug images (HIP_DEBUG=1)",
    "matplotlib": "debug plots (HIP_DEBUG=1)",
    "numba": "debug renderers and the SM count of the online-offload scan",
    "cupy": "the UVM offload cache",
    "cuda": "the UVM offload cache (cuda-python)",
}
# hip-attn's own modules replaced by placeholders unless offload=True asks for them
OFFLOAD_ONLY = {
    "hip_attn.v1_1.offload_runner.tensor_from_pointer":
        "compiles a C++ extension at import; used by the UVM offload cache only",
}


class Placeholder:
    """Stands for an attribute of a module hip-attn imports but the compared path never calls."""

    def __init__(self, name: str, why: str):
        self._name, self._why = name, why

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}", self._why)

    def __call__(self, *args, **kwargs):
        raise KvpotError(f"hip-reference: {self._name} was called, but kvpot loaded hip-attn without it "
                         f"({self._why}). Install it to run this path.")

    def __repr__(self) -> str:
        return f"<placeholder {self._name}>"


class PlaceholderModule(types.ModuleType):
    """A module of `Placeholder` attributes (a package too, so `import a.b.c` and `from a import *` work)."""

    def __init__(self, name: str, why: str):
        super().__init__(name)
        self.__path__ = []  # a package: submodules resolve through the finder below
        self.__all__ = []
        self._why = why

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in ("njit", "jit"):  # numba's decorators run at import: the decorated function raises when called
            return _raising_decorator(f"{self.__name__}.{attr}", self._why)
        return Placeholder(f"{self.__name__}.{attr}", self._why)


def _raising_decorator(name: str, why: str):
    def factory(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used bare: @numba.njit
            return Placeholder(f"{name}({args[0].__name__})", why)
        return lambda fn: Placeholder(f"{name}({fn.__name__})", why)
    return factory


class _PlaceholderFinder:
    """Answers submodule imports under a placeholder package (`import tilelang.language`) with placeholders."""

    def __init__(self, roots: dict[str, str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".")[0]
        if root in self.roots and fullname != root:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return PlaceholderModule(spec.name, self.roots[spec.name.split(".")[0]])

    def exec_module(self, module):
        pass


@dataclass
class HipModules:
    """The loaded hip-attn entry points and what was substituted to load them."""

    attention: object  # dual_stage_quadratic_hip_attention(q, k, v, args, cached_metadata) -> (out, metadata)
    args: type  # HiPAttentionArgs
    scan_stage: type  # ScanStage
    metadata: type  # HiPAttentionOutputMetadata
    version: str
    triton: str
    replaced: dict[str, str] = field(default_factory=dict)  # module -> why


def _package_dir() -> Path:
    spec = importlib.util.find_spec("hip_attn")
    if spec is None or not spec.submodule_search_locations:
        raise KvpotError("hip-reference needs hip-attn 1.2.9's files: pip install --no-deps hip-attn==1.2.9 "
                         "(or its wheel), or put the unpacked wheel on PYTHONPATH.")
    return Path(next(iter(spec.submodule_search_locations)))


def _bare_package(name: str, folder: Path) -> None:
    module = types.ModuleType(name)
    module.__path__ = [str(folder)]
    module.__package__ = name
    sys.modules[name] = module


def _plain_jit_module() -> types.ModuleType:
    """`hip_attn.v1_2.triton_jit` with the installed Triton's own `jit` (see the module docstring, 3.)."""
    import triton

    module = types.ModuleType("hip_attn.v1_2.triton_jit")

    def triton_jit(walk_dependency=None, version=None, repr=None, launch_metadata=None, do_not_specialize=None,
                   do_not_specialize_on_alignment=None, debug=None, noinline=None, do_autotune=None, configs=None,
                   key=None, restore_value=None):
        options = {name: value for name, value in (
            ("version", version), ("repr", repr), ("launch_metadata", launch_metadata),
            ("do_not_specialize", do_not_specialize), ("do_not_specialize_on_alignment", do_not_specialize_on_alignment),
            ("debug", debug), ("noinline", noinline)) if value is not None}

        def decorator(fn):
            return triton.jit(fn, **options)
        autotune = (configs is not None) if do_autotune is None else do_autotune  # hip-attn's rule
        if autotune:
            return lambda fn: triton.autotune(configs=configs, key=key, restore_value=restore_value)(decorator(fn))
        return decorator

    module.triton_jit = triton_jit
    return module


def installed_version(package_dir: Path) -> str:
    """hip-attn's version from the wheel's dist-info beside the package, if there is one."""
    for info in package_dir.parent.glob("hip_attn-*.dist-info"):
        return info.name[len("hip_attn-"):-len(".dist-info")]
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("hip-attn")
    except PackageNotFoundError:  # unpacked without its dist-info
        return "unknown"


# hip-attn as loaded in this process (by offload flag): its package modules stand in `sys.modules` without an import
# spec once loaded, so a second load would not find its files (each `hipattn` prompt's engine asks for it)
_LOADED: dict[bool, HipModules] = {}


def load_hip(offload: bool = False) -> HipModules:
    """hip-attn's v1.2 attention, loaded once per process as the module docstring says. Raises KvpotError naming
    what is missing."""
    if offload in _LOADED:
        return _LOADED[offload]
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise KvpotError("hip-reference: hip-attn refuses TRITON_INTERPRET=1 (its triton_jit raises 'interpret "
                         "should avoided'); its kernels need a CUDA GPU (load_hip_interpreted runs them on a CPU, "
                         "slowly, for checks).")
    triton = _triton()
    folder = _package_dir()
    import torch

    if not torch.cuda.is_available():  # tried on a CPU: the import reached torch.cuda.get_device_name() and failed
        raise KvpotError("hip-reference: hip-attn needs a CUDA GPU: it asks the GPU's name at import (the autotune "
                         "configs of attention_extend_bsa) and its kernels refuse Triton's interpreter.")
    if offload not in _LOADED:
        _LOADED[offload] = _load(triton, folder, offload, {})
    return _LOADED[offload]


def load_hip_interpreted() -> HipModules:
    """hip-attn's attention under Triton's interpreter on a CPU (TRITON_INTERPRET=1, set before Triton is imported):
    for checking what the harness sends at tiny shapes (benchmarks/hip-reference-h100/interpret.py), not for
    measuring. hip-attn's own files run unchanged; what this process changes, recorded in `replaced`:

    - without CUDA, `torch.cuda.get_device_name` (asked at import for autotune configs), `current_device` and
      `set_device` (called around each scan stage) answer as for one device, `is_current_stream_capturing` False;
    - Triton 3.6's interpreter takes `int()` of a one-element array (a scalar argument used as a `range` bound),
      an error under NumPy 2: its tensors' `__index__` reads the element instead;
    - compiled Triton runs `for i in range(CONSTEXPR)` with a tensor `i`, the interpreter with a Python int:
      `hip_attn.v1_2.attention_decode_bsa`'s kernels (which call `i.to(...)`) get a `range` of interpreter
      scalars."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise KvpotError("hip-reference: load_hip_interpreted needs TRITON_INTERPRET=1 in the environment before "
                         "Triton is imported.")
    triton = _triton()
    folder = _package_dir()
    import builtins

    import numpy
    import torch
    import triton.runtime.interpreter as interpreter

    replaced: dict[str, str] = {}
    if not torch.cuda.is_available():
        torch.cuda.get_device_name = lambda *args, **kwargs: "cpu (Triton interpreter)"
        torch.cuda.current_device = lambda: 0
        torch.cuda.set_device = lambda *args, **kwargs: None
        torch.cuda.is_current_stream_capturing = lambda: False
        replaced["torch.cuda (device name, current_device, set_device, is_current_stream_capturing)"] = (
            "no CUDA: answered as for one device, never capturing")
    if not getattr(interpreter, "_kvpot_index_patch", False) and int(numpy.__version__.split(".")[0]) >= 2:
        patch = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interpreter._patch_lang_tensor = patch_lang_tensor
        interpreter._kvpot_index_patch = True
        replaced["triton.runtime.interpreter tensor.__index__"] = "int() of a one-element array fails on NumPy 2"
    hip = _load(triton, folder, False, replaced, plain_jit=True)
    decode = importlib.import_module("hip_attn.v1_2.attention_decode_bsa")

    def scalar_range(*bounds):
        for i in builtins.range(*(int(b) for b in bounds)):
            yield interpreter._implicit_cvt(i)
    decode.range = scalar_range
    replaced["hip_attn.v1_2.attention_decode_bsa range"] = "the interpreter's loop variables as Triton scalars"
    return hip


def _triton():
    try:
        import triton
    except ImportError:
        raise KvpotError("hip-reference needs Triton (it comes with CUDA builds of PyTorch); hip-attn's kernels "
                         "are Triton kernels.") from None
    return triton


def _load(triton, folder: Path, offload: bool, replaced: dict[str, str], plain_jit: bool = False) -> HipModules:
    if not isinstance(sys.modules.get("hip_attn"), types.ModuleType) or "hip_attn.v1_2" not in sys.modules:
        _bare_package("hip_attn", folder)
        _bare_package("hip_attn.v1_2", folder / "v1_2")
        replaced["hip_attn (package __init__)"] = "imports every hip-attn version and their dependencies"
        replaced["hip_attn.v1_2 (package __init__)"] = "imports the paged sglang path (flash_attn, sgl_kernel)"
    roots = {}
    for name, why in OPTIONAL.items():
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = PlaceholderModule(name, why)
            roots[name] = why
            replaced[name] = why
    if roots:
        sys.meta_path.insert(0, _PlaceholderFinder(roots))
    if not offload:
        for name, why in OFFLOAD_ONLY.items():
            sys.modules.setdefault(name, PlaceholderModule(name, why))
            replaced[name] = why
    if triton.__version__ != PINNED_TRITON or plain_jit:
        sys.modules["hip_attn.v1_2.triton_jit"] = _plain_jit_module()
        replaced["hip_attn.v1_2.triton_jit"] = (f"asserts triton == {PINNED_TRITON} (installed {triton.__version__}) "
                                                "and refuses the interpreter: kernels run by the installed "
                                                "triton.jit / triton.autotune")
    try:
        extend = importlib.import_module("hip_attn.v1_2.attention_extend")
        metadata = importlib.import_module("hip_attn.v1_2.attention_metadata")
    except ImportError as err:
        raise KvpotError(f"hip-reference: hip-attn's attention could not be imported: {err}. Install the missing "
                         f"module (hip-attn's own requirements: pip show hip-attn).") from err
    return HipModules(extend.dual_stage_quadratic_hip_attention, metadata.HiPAttentionArgs, metadata.ScanStage,
                      metadata.HiPAttentionOutputMetadata, installed_version(folder), triton.__version__, replaced)
