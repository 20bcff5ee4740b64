"""Parallelism: meshes from config, the logical-axis rules table, sharding helpers."""

from jaxalign.parallel.mesh import (
    DEFAULT_RULES,
    MESH_AXES,
    active_rules,
    batch_sharding,
    constrain,
    format_rules,
    logical_sharding,
    logical_to_spec,
    make_mesh,
    mesh_sizes,
    parse_rules,
    shard_batch,
    use_rules,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "active_rules",
    "batch_sharding",
    "constrain",
    "format_rules",
    "logical_sharding",
    "logical_to_spec",
    "make_mesh",
    "mesh_sizes",
    "parse_rules",
    "shard_batch",
    "use_rules",
]
