"""Device meshes and the logical-axis rules table.

Parameters and activations name their dimensions with *logical* axes (``embed``, ``mlp``, ``heads``,
``vocab``, ``batch``...). One rules table maps each logical axis to zero or more *mesh* axes
(``data``, ``fsdp``, ``tensor``, and ``expert`` for mixtures of experts), so the model code never mentions a mesh
axis and the same model runs on one CPU, eight GPUs or a TPU pod by configuration alone (the MaxText pattern).

Meshes are built with ``AxisType.Auto`` axes: classic GSPMD propagation, so an FSDP/TP matmul needs no
per-op ``out_sharding``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),  # an expert axis splits the batch too outside the experts
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
    ("act_embed", None),
    ("layers", None),
    ("lora_rank", None),
    ("expert", "expert"),  # a mixture of experts' expert dimension (absent from meshes without an expert axis)
)



def format_rules(rules: Rules) -> str:
    """A rules table as the config's text form: ``"batch=data+fsdp,vocab=tensor,head_dim=,..."`` (an empty
    right-hand side = replicated)."""
    def target(axes) -> str:
        return "" if axes is None else axes if isinstance(axes, str) else "+".join(axes)

    return ",".join(f"{name}={target(axes)}" for name, axes in rules)


def parse_rules(text: str) -> Rules:
    """The rules table of ``mesh.rules``: ``DEFAULT_RULES`` with each ``logical=mesh[+mesh...]`` entry of ``text``
    replacing (or adding) that logical axis' mapping; ``""`` = the defaults."""
    table = dict(DEFAULT_RULES)
    for entry in filter(None, (e.strip() for e in (text or "").split(","))):
        name, sep, target = entry.partition("=")
        axes = tuple(a.strip() for a in target.split("+") if a.strip())
        if not sep or not name.strip():
            raise ValueError(f"entry {entry!r}: expected LOGICAL=MESH_AXIS[+MESH_AXIS] (empty = replicated)")
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"entry {entry!r}: unknown mesh axis {', '.join(unknown)}; the axes are "
                             f"{', '.join(MESH_AXES)}")
        table[name.strip()] = None if not axes else axes[0] if len(axes) == 1 else axes
    return tuple(table.items())


_ACTIVE_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("jaxalign_rules", default=DEFAULT_RULES)


def mesh_sizes(shape: Mapping[str, int] | Sequence[tuple[str, int]] | None, num_devices: int) -> dict[str, int]:
    """``{axis: size}`` with the one ``-1`` axis filled so that the sizes multiply to ``num_devices``."""
    if shape is None:
        shape = {"data": -1, "fsdp": 1, "tensor": 1}
    items = list(shape.items()) if isinstance(shape, Mapping) else [tuple(item) for item in shape]
    names = [name for name, _ in items]
    sizes = [int(size) for _, size in items]
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axis names must be unique, got {names}")
    n_fill = sum(size == -1 for size in sizes)
    if n_fill > 1:
        raise ValueError(f"at most one mesh axis may be -1 (fill), got {dict(items)}")
    if any(size == 0 or size < -1 for size in sizes):
        raise ValueError(f"mesh axis sizes must be positive or -1, got {dict(items)}")
    fixed = math.prod(size for size in sizes if size != -1)
    if n_fill:
        if num_devices % fixed:
            raise ValueError(
                f"mesh {dict(items)}: the fixed axes multiply to {fixed}, which does not divide the "
                f"{num_devices} available devices")
        sizes = [num_devices // fixed if size == -1 else size for size in sizes]
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(names, sizes, strict=True))} needs {math.prod(sizes)} devices but "
            f"{num_devices} are available; set one axis to -1 to fill")
    return dict(zip(names, sizes, strict=True))


def make_mesh(
    shape: Mapping[str, int] | Sequence[tuple[str, int]] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a mesh with Auto axes from ``{axis_name: size}``; one size may be ``-1`` (fill).

    ``make_mesh()`` puts every device on ``data``. ``make_mesh({"data": 2, "fsdp": -1, "tensor": 2})`` on
    8 devices gives a (2, 2, 2) mesh. Sizes must multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(shape, len(devices))
    warn_if_host_pool_small(devices)
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes),
                         devices=devices)


def host_pool_threads() -> int:
    """Threads of XLA:CPU's execution pool as XLA sizes it before counting devices: ``PJRT_NPROC``, else
    ``NPROC``, else the cores this process may run on."""
    for name in ("PJRT_NPROC", "NPROC"):
        if os.environ.get(name, "").strip().isdigit():
            return int(os.environ[name])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warn_if_host_pool_small(devices: Sequence[jax.Device]) -> None:
    """Several CPU devices in one process (``--xla_force_host_platform_device_count``) share one XLA thread pool of
    max(cores, devices) threads; programs queued behind one with collectives can take the threads its participants
    need, and the process hangs, then aborts (seen with 8 devices on 2 cores). Twice the devices leaves room."""
    cpu = [d for d in devices if d.platform == "cpu" and d.process_index == jax.process_index()]
    if len(cpu) > 1 and host_pool_threads() < 2 * len(cpu):
        warnings.warn(f"{len(cpu)} CPU devices share XLA:CPU's thread pool of {max(host_pool_threads(), len(cpu))} "
                      f"threads: collectives can deadlock. Set PJRT_NPROC={3 * len(cpu)} in the environment before "
                      "starting Python (docs/reliability.md, 'Several CPU devices in one process')", stacklevel=3)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[None]:
    """Makes ``rules`` the active logical-axis rules for ``constrain`` inside the block."""
    token = _ACTIVE_RULES.set(tuple(rules))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def active_rules() -> Rules:
    return _ACTIVE_RULES.get()


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh=None,
    rules: Rules | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a ``PartitionSpec`` through the rules table.

    A mesh axis is used at most once per array (the first dimension that claims it wins). When ``shape``
    and ``mesh`` are given, mesh axes that do not divide a dimension are dropped, so that dimension is
    replicated instead of failing (e.g. SmolLM2's 9 heads on a 2-way tensor axis).
    """
    table = dict(active_rules() if rules is None else rules)
    sizes = dict(mesh.shape) if mesh is not None else {}
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        kept: list[str] = []
        for axis in axes:
            if axis in used or (mesh is not None and axis not in sizes):
                continue
            splits = math.prod(sizes[a] for a in (*kept, axis)) if mesh is not None else 1
            if shape is not None and shape[dim] % splits:
                continue
            kept.append(axis)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def logical_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                     rules: Rules | None = None) -> NamedSharding:
    """``NamedSharding`` for an array of ``shape`` whose dimensions carry ``logical_axes``."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; a no-op outside a ``jax.set_mesh`` context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules | None = None) -> NamedSharding:
    """Sharding for a ``[batch, ...]`` input: batch over the data-parallel axes, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh, rules))


def shard_batch(x: np.ndarray | jax.Array, mesh: Mesh, rules: Rules | None = None) -> jax.Array:
    """Places a host batch on ``mesh`` split along its first dimension (single-process helper)."""
    x = np.asarray(x)
    spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh, rules)
    return jax.device_put(x, NamedSharding(mesh, spec))
