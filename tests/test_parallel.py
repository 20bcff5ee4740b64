"""Meshes from config and the logical-axis rules."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec

from jaxalign.parallel import DEFAULT_RULES, logical_to_spec, make_mesh, use_rules


def test_make_mesh_fill_and_axis_types():
    mesh = make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(make_mesh([("fsdp", -1)], devices=jax.devices()[:4]).shape) == {"fsdp": 4}


@pytest.mark.parametrize(("shape", "message"), [
    ({"data": 3, "fsdp": 3}, "needs 9 devices but 8 are available"),
    ({"data": -1, "fsdp": 3}, "does not divide the 8 available devices"),
    ({"data": -1, "fsdp": -1}, "at most one mesh axis may be -1"),
    ({"data": 0, "fsdp": 8}, "positive or -1"),
])
def test_make_mesh_errors(shape, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(shape)


def test_rules_map_logical_axes(mesh8):
    assert logical_to_spec(("embed", "mlp")) == PartitionSpec("fsdp", "tensor")
    # without a mesh, the table as it is; on a mesh, its axes only (the expert axis exists for MoE runs)
    assert logical_to_spec(("batch", "length", "vocab")) == PartitionSpec(("data", "fsdp", "expert"), None, "tensor")
    assert logical_to_spec(("batch", "length", "vocab"), (8, 4, 16), mesh8) == PartitionSpec(("data", "fsdp"), None,
                                                                                               "tensor")
    # a mesh axis is used once per array: the second `tensor` claimant is replicated
    assert logical_to_spec(("heads", "mlp")) == PartitionSpec("tensor", None)
    # dimensions a mesh axis does not divide stay replicated
    assert logical_to_spec(("embed", "heads"), (64, 9), mesh8) == PartitionSpec("fsdp", None)
    assert logical_to_spec(("batch", None), (2, 5), mesh8) == PartitionSpec("data", None)


def test_custom_rules_context():
    rules = (*DEFAULT_RULES[:2], ("embed", None), *DEFAULT_RULES[3:])
    with use_rules(rules):
        assert logical_to_spec(("embed", "mlp")) == PartitionSpec(None, "tensor")
    assert logical_to_spec(("embed", "mlp")) == PartitionSpec("fsdp", "tensor")
