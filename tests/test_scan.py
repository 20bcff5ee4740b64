"""Scanned layers (``model.scan_layers``): the stacked layout runs the same math as the unrolled one (logits,
gradients, KV-cache decoding, LoRA, MoE statistics), loads and saves per-layer Hugging Face folders, and training
resumes across a change of layout."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign.models import LlamaConfig, create_model, load_hf, lora, save_hf
from jaxalign.models.llama import (
    StackedLayers,
    layer_plan,
    recording_router_stats,
    router_aux_loss,
    stack_layers,
    unstack_layers,
)
from jaxalign.sampling import generate, sample

BASE = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4, num_kv_heads=2)
GEMMA2 = BASE.replace(architecture="gemma2", norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                      hidden_act="gelu_tanh", query_pre_attn_scalar=16, attn_softcap=50.0, final_softcap=30.0,
                      sliding_window=4, sliding_window_layers=(True, False) * 3, tie_word_embeddings=True)
GEMMA3 = BASE.replace(architecture="gemma3_text", num_layers=7, norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                      hidden_act="gelu_tanh", qk_norm=True, sliding_window=4, local_rope_theta=10000.0,
                      rope_theta=1e6, sliding_window_layers=(True, True, False) * 2 + (True,))
MOE = BASE.replace(architecture="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=24, moe_layers=(False,) + (True,) * 5, router_aux_loss_coef=0.01)
FAMILIES = {"llama": BASE, "gemma2": GEMMA2, "gemma3": GEMMA3, "moe": MOE}


def pair(config, **changes):
    """The same random model unrolled and scanned (the draws do not depend on the layout)."""
    return (create_model(config.replace(scan_layers=False, **changes), seed=0),
            create_model(config.replace(scan_layers=True, **changes), seed=0))


def batch(config, b=2, t=11):
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, config.vocab_size)
    return tokens, jnp.ones((b, t), bool).at[0, :3].set(False)  # a left-padded row


def pure(model_or_state):
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    return nnx.to_pure_dict(state)


def assert_trees_close(a, b, atol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


@pytest.mark.parametrize(("config", "plan"), [
    (BASE, (0, 1, 6)), (GEMMA2, (0, 2, 3)), (GEMMA3, (0, 3, 2)), (MOE, (1, 1, 5)),
    (BASE.replace(sliding_window=4, sliding_window_layers=(False, False) + (True,) * 4), (2, 1, 4)),
    (BASE.replace(sliding_window=4, sliding_window_layers=(True, False, False, True, False, True)), (2, 2, 2)),
    (BASE.replace(sliding_window=4, sliding_window_layers=(True, False, False, True, True, False)), (1, 1, 2)),
    (BASE.replace(sliding_window=4, sliding_window_layers=(True,) * 5 + (False,)), (0, 1, 5)),
    (BASE.replace(num_layers=3, scan_layers=True, sliding_window=4, sliding_window_layers=(True, False, True)),
     (3, 0, 0)),
    (GEMMA3.replace(num_layers=26, sliding_window_layers=((True,) * 5 + (False,)) * 4 + (True, True)), (0, 6, 4)),
    (BASE.replace(scan_layers=False), (6, 0, 0)), (BASE.replace(num_layers=4), (4, 0, 0)),
    (BASE.replace(num_layers=4, scan_layers=True), (0, 1, 4))])
def test_layer_plan_cuts_the_repeating_blocks(config, plan):
    assert layer_plan(config) == plan
    model = create_model(config, seed=0)
    assert isinstance(model.layers, StackedLayers) == bool(plan[2])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_equals_unrolled_logits_and_gradients(family):
    config = FAMILIES[family]
    unrolled, scanned = pair(config)
    assert_trees_close(pure(unrolled), unstack_layers(scanned.config, pure(scanned)), atol=0)
    tokens, mask = batch(config)

    def loss(model):
        with recording_router_stats() as sink:
            logits = model(tokens, mask)
        aux = router_aux_loss(sink, model)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0]) + (0.0 if aux is None else aux), \
            (logits, aux)

    (_, (logits_u, aux_u)), grads_u = nnx.value_and_grad(loss, has_aux=True)(unrolled)
    (_, (logits_s, aux_s)), grads_s = nnx.value_and_grad(loss, has_aux=True)(scanned)
    np.testing.assert_allclose(logits_s, logits_u, atol=1e-5, rtol=0)
    if family == "moe":
        np.testing.assert_allclose(aux_s, aux_u, atol=1e-6)
    assert_trees_close(unstack_layers(scanned.config, pure(grads_s)), pure(grads_u), atol=1e-5)


@pytest.mark.parametrize("policy", ["nothing", "dots"])
def test_scanned_remat_and_packing_give_the_unrolled_gradients(policy):
    unrolled, scanned = pair(GEMMA2, remat=True, remat_policy=policy)
    tokens, _ = batch(GEMMA2, t=12)
    segments = jnp.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])

    def loss(model):
        return jnp.mean(model(tokens, segment_ids=segments).astype(jnp.float32) ** 2)

    grads_u = pure(nnx.grad(loss)(unrolled))
    grads_s = unstack_layers(scanned.config, pure(nnx.grad(loss)(scanned)))
    assert_trees_close(grads_s, grads_u, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3", "moe"])
def test_scanned_kv_cache_decodes_like_the_unrolled_model(family):
    config = FAMILIES[family]
    unrolled, scanned = pair(config)
    prompts = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = np.array([[0, 0, 1, 1, 1, 1], [1] * 6])
    kwargs = dict(max_new_tokens=8, prompt_mask=mask)
    expected = generate(unrolled, prompts, **kwargs)
    for layers in ("scanned", "unrolled"):  # the scan itself, and its weights unstacked for the decode loop
        np.testing.assert_array_equal(generate(scanned, prompts, layers=layers, **kwargs), expected)
    sampled = dict(kwargs, temperature=1.0, seed=3, num_samples=2)  # the prefill cache repeated per sample
    a, b = sample(scanned, prompts, layers="scanned", **sampled), sample(unrolled, prompts, **sampled)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logps, b.logps, atol=1e-5)


def test_decoding_model_unrolls_on_cpu_and_gpu_and_casts_weights_only(monkeypatch):
    from jaxalign.sampling import decoding_model

    _, scanned = pair(FAMILIES["llama"])
    decoded = decoding_model(scanned)  # auto: the CPU unrolls
    assert not decoded.config.scans and isinstance(decoded.layers, nnx.List)
    with monkeypatch.context() as patch:  # the backend only decides "auto"; measured faster on CPU and GPU
        patch.setattr(jax, "default_backend", lambda: "gpu")
        assert not decoding_model(scanned).config.scans
        patch.setattr(jax, "default_backend", lambda: "tpu")
        assert decoding_model(scanned) is scanned
    assert_trees_close(pure(decoded), unstack_layers(scanned.config, pure(scanned)), atol=0)
    assert decoding_model(scanned, layers="scanned") is scanned
    half = decoding_model(scanned, layers="scanned", weights="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(pure(half))} == {jnp.dtype(jnp.bfloat16)}
    assert half.config.dtype == scanned.config.dtype  # weight-only: the compute dtype stays
    with_adapters = lora.attach(pair(FAMILIES["llama"])[1], lora.LoRAConfig(rank=2, targets=("q_proj",)), nnx.Rngs(0))
    assert decoding_model(with_adapters) is with_adapters  # auto leaves adapters scanned
    with pytest.raises(ValueError, match="merge them first"):
        decoding_model(with_adapters, layers="unrolled")
    with pytest.raises(ValueError, match="expected one of"):
        decoding_model(scanned, weights="int4")


def test_layout_converters_are_inverse_and_handle_abstract_leaves():
    _, scanned = pair(GEMMA3)
    tree = pure(scanned)
    per_layer = unstack_layers(GEMMA3, tree)
    assert sorted(per_layer["layers"]) == list(range(GEMMA3.num_layers))
    assert_trees_close(stack_layers(GEMMA3, per_layer), tree, atol=0)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    shapes = unstack_layers(GEMMA3, abstract)
    assert shapes["layers"][4]["self_attn"]["q_proj"].shape == per_layer["layers"][4]["self_attn"]["q_proj"].shape
    # optimizer-state-like containers holding layer trees are converted too; other leaves pass through
    wrapped = unstack_layers(GEMMA3, {"mu": tree, "count": jnp.zeros(())})
    assert sorted(wrapped["mu"]["layers"]) == list(range(GEMMA3.num_layers))


def train_state(model):
    import optax

    from jaxalign.train.step import init_state

    params = pure(model)
    state = init_state(params, optax.adam(1e-3), 0, None)  # moments made non-zero: a layout mix-up would show
    return state._replace(opt_state=jax.tree.map(lambda x: x + 0.5 if x.ndim else x, state.opt_state))


def saved_paths(folder, step):
    """The ``/``-joined paths of the state tree checkpoint ``step`` holds on disk (its Orbax metadata)."""
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().metadata(folder / "checkpoints" / str(step) / "state").item_metadata.tree
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("family", ["gemma3", "moe"])  # a block with a tail layer; a dense head layer
def test_checkpoints_are_written_per_layer_and_restore_either_way(family, tmp_path):
    from jaxalign.train.checkpoints import Checkpoints

    config = FAMILIES[family]
    unrolled, scanned = pair(config)
    live = train_state(scanned)
    with Checkpoints(tmp_path / "s", 2, scanned.config) as saves:
        saves.save(live, 3, {"data": {}}, wait=True)
    paths = saved_paths(tmp_path / "s", 3)
    assert not any("blocks" in p for p in paths)
    layers = {int(p.split("/layers/")[1].split("/")[0]) for p in paths if "/layers/" in p}
    assert layers == set(range(config.num_layers))  # the parameters and both Adam moments, per layer
    # the same files as an unrolled run's
    with Checkpoints(tmp_path / "u", 2, unrolled.config) as saves:
        saves.save(train_state(unrolled), 3, {"data": {}}, wait=True)
    assert saved_paths(tmp_path / "u", 3) == paths
    # restored exactly into the scanned layout (stacked again) and into the unrolled one
    with Checkpoints(tmp_path / "s", 2, scanned.config) as saves:
        back, meta = saves.restore_latest(jax.tree.map(jnp.zeros_like, live))
    assert meta["step"] == 3 and jax.tree.structure(back) == jax.tree.structure(live)
    assert_trees_close(back, live, atol=0)
    with Checkpoints(tmp_path / "s", 2, unrolled.config) as saves:
        back, _ = saves.restore_latest(train_state(unrolled))
    assert_trees_close(back, unstack_layers(config, live), atol=0)


def test_stacked_checkpoints_of_earlier_runs_still_resume(tmp_path):
    """Checkpoints written in the stacked layout (``train.checkpoint_layout=as_run``, earlier versions, a
    multi-process run) restore too."""
    from jaxalign.train.checkpoints import Checkpoints

    _, scanned = pair(BASE)
    live = train_state(scanned)
    with Checkpoints(tmp_path, 2, scanned.config, per_layer=False) as saves:
        saves.save(live, 1, {"data": {}}, wait=True)
    assert any("blocks" in p for p in saved_paths(tmp_path, 1))
    with Checkpoints(tmp_path, 2, scanned.config) as saves:
        back, _ = saves.restore_latest(jax.tree.map(jnp.zeros_like, live))
    assert_trees_close(back, live, atol=0)
    assert not (tmp_path / "broken-checkpoints").exists()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "moe"])  # blocks only; with a tail layer; with a head
def test_hf_folders_stay_per_layer_either_way(family, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family]
    unrolled, scanned = pair(config)
    save_hf(scanned, tmp_path / "scanned")
    save_hf(unrolled, tmp_path / "unrolled")
    from safetensors.numpy import load_file

    a, b = load_file(tmp_path / "scanned" / "model.safetensors"), load_file(tmp_path / "unrolled" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert f"model.layers.{config.num_layers - 1}.self_attn.q_proj.weight" in a
    loaded = load_hf(tmp_path / "unrolled", config_overrides={"scan_layers": True})
    assert isinstance(loaded.layers, StackedLayers)
    assert_trees_close(pure(loaded), pure(scanned), atol=0)
    tokens, mask = batch(config)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "scanned"), local_files_only=True,
                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(torch.tensor(np.asarray(tokens)), attention_mask=torch.tensor(np.asarray(mask))).logits
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(loaded(tokens, mask))[real], expected.numpy()[real], atol=1e-4)


def test_scanned_model_loads_sharded_on_the_mesh(mesh8, tmp_path):
    unrolled, _ = pair(BASE)
    save_hf(unrolled, tmp_path / "hf")
    sharded = load_hf(tmp_path / "hf", mesh=mesh8, config_overrides={"scan_layers": True})
    q = sharded.layers.blocks[0].self_attn.q_proj[...]
    assert q.shape[0] == BASE.num_layers and tuple(q.sharding.spec)[:2] == (None, "fsdp")
    tokens, mask = batch(BASE)
    with jax.set_mesh(mesh8):
        logits = jax.jit(lambda t, m: sharded(t, m))(tokens, mask)
    np.testing.assert_allclose(logits, unrolled(tokens, mask), atol=1e-5)
    # a checkpoint of the sharded scanned state is written per layer and restores with the same shardings
    from jaxalign.train.checkpoints import Checkpoints

    live = train_state(sharded)
    with Checkpoints(tmp_path / "run", 2, sharded.config) as saves:
        saves.save(live, 1, {"data": {}}, wait=True)
        assert not any("blocks" in p for p in saved_paths(tmp_path / "run", 1))
        back, _ = saves.restore_latest(jax.tree.map(jnp.zeros_like, live))
    assert_trees_close(back, live, atol=0)
    assert all(b.sharding == x.sharding for b, x in zip(jax.tree.leaves(back), jax.tree.leaves(live), strict=True))


def test_lora_on_a_scanned_model_matches_the_unrolled_one(tmp_path):
    config = LlamaConfig(**{**BASE.__dict__, "scan_layers": None})
    adapters = lora.LoRAConfig(rank=2, alpha=4.0, dropout=0.25, targets=("q_proj", "v_proj", "down_proj"))
    unrolled, scanned = (lora.attach(m, adapters, nnx.Rngs(7)) for m in pair(config))
    a_u, a_s = pure(nnx.state(unrolled, nnx.LoRAParam)), pure(nnx.state(scanned, nnx.LoRAParam))
    assert_trees_close(unstack_layers(scanned.config, a_s), a_u, atol=0)
    # a non-zero B so the adapters change the output; dropout keys drawn per layer as in the unrolled model
    for model in (unrolled, scanned):
        for _, _, _, adapter in lora._adapters_of(model):
            adapter.lora_b.set_value(adapter.lora_b.get_value() + 0.05)
        lora.set_dropout_key(model, jax.random.key(4))
    tokens, mask = batch(config)
    np.testing.assert_allclose(scanned(tokens, mask), unrolled(tokens, mask), atol=1e-5)
    merged_u, merged_s = lora.merge_weights(unrolled), lora.merge_weights(scanned)
    assert isinstance(merged_s.layers, StackedLayers)
    assert_trees_close(unstack_layers(scanned.config, pure(merged_s)), pure(merged_u), atol=1e-6)
    lora.save_peft(scanned, adapters, tmp_path / "s")
    lora.save_peft(unrolled, adapters, tmp_path / "u")
    from safetensors.numpy import load_file

    s, u = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("s", "u"))
    assert sorted(s) == sorted(u) and all(np.array_equal(s[k], u[k]) for k in s)


@pytest.mark.slow
def test_training_resumes_across_a_change_of_layer_layout(tmp_path, capsys):
    from jaxalign.train import load_config, train
    from jaxalign.train.build import restore_model

    small = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=48",
             "--config.model.shape.num_layers=6", "--config.model.shape.num_heads=2",
             "--config.model.shape.num_kv_heads=1", "--config.data.toy_size=64", "--config.data.toy_eval_size=8",
             "--config.data.max_length=40", "--config.train.batch_size=8", "--config.train.eval_every=0",
             "--config.eval.batches=1", "--config.eval.generate=0", "--config.logging.tensorboard=False",
             "--config.logging.plot=False", "--config.optim.schedule=constant", "--config.optim.warmup_steps=1",
             "--config.train.save_every=2"]

    def run(folder, steps, scan):
        return train(load_config("sft", [*small, f"--config.workdir={folder}", f"--config.train.steps={steps}",
                                         f"--config.model.scan_layers={scan}"]))

    run(tmp_path / "whole", 4, "true")
    run(tmp_path / "cut", 2, "true")
    run(tmp_path / "cut", 4, "false")  # resumes the scanned run's step-2 checkpoint with the layers unrolled
    assert json.loads((tmp_path / "cut" / "model_config.json").read_text())["scan_layers"] is False
    whole, _, step_whole = restore_model(tmp_path / "whole")
    cut, _, step_cut = restore_model(tmp_path / "cut")
    assert step_whole == step_cut == 4
    assert isinstance(whole.layers, StackedLayers) and not isinstance(cut.layers, StackedLayers)
    assert_trees_close(unstack_layers(whole.config, pure(whole)), pure(cut), atol=1e-5)
    capsys.readouterr()
    run(tmp_path / "cut", 6, "true")  # and the per-layer step-4 checkpoint resumes scanned
    assert "at step 4" in capsys.readouterr().out
    assert restore_model(tmp_path / "cut")[2] == 6 and not (tmp_path / "cut" / "broken-checkpoints").exists()


@pytest.mark.slow
def test_lora_run_on_a_scanned_model_exports_merged_and_peft(tmp_path):
    """The LoRA path of a real (scanned) model: adapters created stacked, trained with dropout, both exports load
    in transformers / PEFT with our logits."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from jaxalign.cli import main
    from jaxalign.train.build import restore_model

    args = ["train", "--config", "dpo", "--config.model.shape.hidden_size=32",
            "--config.model.shape.intermediate_size=48", "--config.model.shape.num_layers=6",
            "--config.model.shape.num_heads=2", "--config.model.shape.num_kv_heads=1", "--config.data.toy_size=64",
            "--config.data.max_length=40", "--config.train.batch_size=8", "--config.train.steps=2",
            "--config.eval.generate=0", "--config.data.eval=", "--config.logging.tensorboard=False",
            "--config.logging.plot=False", "--config.lora.enabled=True", "--config.lora.rank=2",
            "--config.lora.dropout=0.1", "--config.optim.lr=1e-2", f"--config.workdir={tmp_path / 'run'}"]
    assert main(args) == 0
    trained, _, _ = restore_model(tmp_path / "run")
    assert isinstance(trained.layers, StackedLayers)
    assert trained.layers.blocks[0].self_attn.q_proj_lora.lora_a[...].shape[0] == 6
    tokens = np.array([[1, 50, 60, 70, 2, 9]])
    ours = np.asarray(trained(jnp.asarray(tokens)))
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "peft"), "--adapter"]) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
        np.testing.assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), ours, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "peft" / "base"), local_files_only=True).eval()
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        np.testing.assert_allclose(adapted(torch.tensor(tokens)).logits.numpy(), ours, atol=1e-4)
