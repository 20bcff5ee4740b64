"""jaxalign: alignment methods as pure, jit-compiled JAX functions over sharded Flax NNX models.

Subpackages load on first attribute access, so ``import jaxalign`` stays cheap.
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("compilation_cache", "cpi", "data", "losses", "models", "objectives", "parallel", "sampling", "train")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        module = importlib.import_module(f"jaxalign.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'jaxalign' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_SUBPACKAGES])
