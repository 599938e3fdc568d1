"""Does SGLang's engine import as the GPU box would import it? Run on a CPU machine before carrying a stage.

SGLang imports some modules only on CUDA (``if is_cuda(): from flashinfer import ...``), so importing it on a
machine without a GPU misses exactly what the box will ask for (2026-12-07: the stage lacked flashinfer, and the
engine did not start on the H100; docs/sglang.md). Here torch says it has one sm90 device, and ``sgl_kernel``
(carried, but it needs the driver's ``libcuda.so.1`` to load) is stood in for by modules that take any name; then
the engine's modules are imported. Prints ``OK`` or ``MISSING <module> while importing <engine module>`` with the
import chain, exit 3 (another error: exit 4).

    <python 3.12 with the box's torch> bench/sglang_import_check.py SITE_DIR [SITE_DIR ...] [--modules a,b]

with the unpacked SGLang stage (and the vLLM stage it sits beside) as SITE_DIRs, in front of that interpreter's own
packages (which should be only what the box has).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import sys
import traceback
import types

ENGINE_MODULES = (
    "sglang",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen2",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.model_loader.loader",
)
STOOD_IN = ("sgl_kernel",)  # needs the GPU driver to load: any name imports from it


class _AnyValue:
    """What a stood-in module hands out: attributes, calls, items and base classes of anything."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyValue()

    def __call__(self, *args, **kwargs):
        return _AnyValue()

    def __getitem__(self, key):
        return _AnyValue()

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)


class _AnyModule(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyValue()


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname, path, target=None):
        if any(fullname == p or fullname.startswith(p + ".") for p in self.packages):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _AnyModule(spec.name)

    def exec_module(self, module):
        pass


def pretend_sm90_device() -> None:
    import torch

    class Properties:
        major, minor, name, total_memory, multi_processor_count = 9, 0, "NVIDIA H100 80GB HBM3", 80 << 30, 132

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_name = lambda *args, **kwargs: Properties.name
    torch.cuda.get_device_properties = lambda *args, **kwargs: Properties()


def check(modules: tuple[str, ...], stood_in: tuple[str, ...] = STOOD_IN) -> int:
    pretend_sm90_device()
    sys.meta_path.insert(0, _StandIn(stood_in))
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            print(f"MISSING {error.name} while importing {name}")
            traceback.print_exc(limit=-6)
            return 3
        except Exception as error:  # the finding is the message: say it, with where
            print(f"ERROR {type(error).__name__} while importing {name}: {str(error)[:500]}")
            traceback.print_exc(limit=-6)
            return 4
    print("OK")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sites", nargs="*", help="site folders put in front of this interpreter's packages")
    parser.add_argument("--modules", default=",".join(ENGINE_MODULES), help="comma-separated modules to import")
    parser.add_argument("--stand-in", default=",".join(STOOD_IN), help="packages any name imports from")
    args = parser.parse_args(argv)
    sys.path[:0] = args.sites
    return check(tuple(args.modules.split(",")), tuple(filter(None, args.stand_in.split(","))))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
