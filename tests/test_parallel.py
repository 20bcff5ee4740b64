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


def test_make_mesh_warns_when_cpu_devices_outnumber_the_xla_thread_pool(monkeypatch):
    import warnings

    monkeypatch.setenv("PJRT_NPROC", "8")  # 8 devices, 8 threads: one collective's participants fill the pool
    with pytest.warns(UserWarning, match="Set PJRT_NPROC=24"):
        make_mesh({"data": -1})
    monkeypatch.setenv("PJRT_NPROC", "16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_mesh({"data": -1})
        make_mesh({"data": 1}, devices=jax.devices()[:1])  # one device: nothing to share


LOOP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
x = jax.device_put(jnp.ones((64, 256, 256)), NamedSharding(mesh, P("data", "fsdp", "tensor")))
w = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("fsdp", "tensor")))

@jax.jit
def step(x, w):  # a resharding (all-to-all) and a mean (all-reduce) per step
    y = jax.lax.with_sharding_constraint(jnp.einsum("btd,de->bte", x, w), NamedSharding(mesh, P("tensor", "data")))
    return y / (1 + jnp.abs(y).mean()), {"loss": y.mean()}

window = {}
for _ in range(STEPS):  # no blocking: Python runs ahead and programs queue behind each collective
    x, metrics = step(x, w)
    window = metrics if not window else jax.tree.map(jnp.add, window, metrics)
print("finished", float(window["loss"]))
"""


@pytest.mark.slow
def test_a_loop_of_collective_steps_on_8_cpu_devices_finishes():
    """The program that hung every time on a 2-core AMD EPYC with XLA's default pool (8 threads for 8 devices:
    7 participants at the rendezvous, then the abort) finishes with the pool conftest.py sets (PJRT_NPROC)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               "--xla_cpu_collective_call_terminate_timeout_seconds=60 --xla_cpu_collective_timeout_seconds=60")
    assert int(env["PJRT_NPROC"]) >= 16
    done = subprocess.run([sys.executable, "-c", LOOP.replace("STEPS", "600")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-2000:]
