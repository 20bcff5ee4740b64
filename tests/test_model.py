"""The decoder: logit parity with transformers, packing, KV cache, sharding."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign.models import KVCache, LlamaConfig, create_model, load_hf, positions_from_mask
from jaxalign.parallel import shard_batch

B, T = 3, 12


def padded_batch(side: str, vocab: int = 128, seed: int = 0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(3, vocab, (B, T))
    mask = np.ones((B, T), np.int32)
    lengths = [T, T - 4, T - 7]
    for row, length in enumerate(lengths):
        if side == "right":
            mask[row, length:] = 0
        else:
            mask[row, : T - length] = 0
    tokens = np.where(mask == 1, tokens, 0)
    return tokens, mask


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
                                  "qwen3_moe"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_logit_parity_with_transformers(arch, side, tmp_path):
    from torch_reference import make_reference, torch_logits

    reference = make_reference(arch, tmp_path)
    model = load_hf(tmp_path)
    tokens, mask = padded_batch(side)
    expected = torch_logits(reference, tokens, mask)
    got = np.asarray(jax.jit(lambda m, t, a: m(t, a))(model, jnp.asarray(tokens), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(got - expected)[real].max() <= 1e-4


def test_config_features_reach_the_model(tmp_path):
    from torch_reference import make_reference

    make_reference("mistral", tmp_path / "mistral")
    make_reference("qwen2", tmp_path / "qwen2")
    make_reference("llama", tmp_path / "llama")
    make_reference("qwen3", tmp_path / "qwen3")
    mistral, qwen, llama, qwen3 = (load_hf(tmp_path / n).config for n in ("mistral", "qwen2", "llama", "qwen3"))
    assert mistral.sliding_window == 5 and mistral.head_dim == 24
    assert mistral.rope_scaling.rope_type == "linear"
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert llama.rope_scaling.rope_type == "llama3" and llama.num_kv_heads == 2
    assert qwen3.qk_norm and qwen3.qkv_bias and qwen3.o_bias and qwen3.head_dim == 24
    assert qwen3.sliding_window == 5 and qwen3.sliding_window_layers == (False, True)
    assert not (qwen.qk_norm or llama.qk_norm or mistral.qk_norm)
    make_reference("gemma3_text", tmp_path / "gemma3")
    gemma3 = load_hf(tmp_path / "gemma3").config
    assert gemma3.qk_norm and gemma3.norm_offset == 1 and gemma3.embed_scale and gemma3.sandwich_norms
    assert gemma3.local_rope_theta == 1e4 and gemma3.rope_theta == 1e6 and gemma3.rope_scaling.factor == 2.0
    assert gemma3.sliding_window_layers == (True, False) and gemma3.hidden_act == "gelu_tanh"
    assert gemma3.tie_word_embeddings and gemma3.query_pre_attn_scalar == 24


@pytest.fixture(scope="module")
def tiny_model(tiny_config):
    return create_model(tiny_config, seed=1)


@pytest.fixture(scope="module")
def forward():
    return jax.jit(lambda model, tokens, mask: model(tokens, mask))


def test_inputs_embeds_match_tokens(tiny_model, forward):
    tokens, mask = padded_batch("right")
    from_tokens = forward(tiny_model, jnp.asarray(tokens), jnp.asarray(mask))
    embeds = tiny_model.embed(jnp.asarray(tokens))
    from_embeds = tiny_model(inputs_embeds=embeds, attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(from_embeds, from_tokens, atol=1e-5)
    with pytest.raises(ValueError, match="exactly one"):
        tiny_model(jnp.asarray(tokens), inputs_embeds=embeds)


def test_return_hidden(tiny_model, tiny_config):
    tokens, mask = padded_batch("right")
    out = tiny_model(jnp.asarray(tokens), jnp.asarray(mask), return_hidden=True)
    assert out.hidden.shape == (B, T, tiny_config.hidden_size)
    np.testing.assert_allclose(tiny_model.unembed(out.hidden), out.logits, atol=1e-6)


def test_positions_from_mask():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    # right padding keeps counting (transformers' arange positions); left padding gets 0
    np.testing.assert_array_equal(positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    segments = jnp.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 0, 0]])
    np.testing.assert_array_equal(positions_from_mask(segments > 0, segments),
                                  [[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 0, 1]])


def test_packed_forward_equals_separate(tiny_model, forward):
    rng = np.random.RandomState(3)
    first, second = rng.randint(3, 128, 7), rng.randint(3, 128, 4)
    packed = np.zeros((1, 14), np.int32)
    packed[0, :7], packed[0, 7:11] = first, second
    segments = np.zeros((1, 14), np.int32)
    segments[0, :7], segments[0, 7:11] = 1, 2
    logits = tiny_model(jnp.asarray(packed), segment_ids=jnp.asarray(segments))
    alone_first = forward(tiny_model, jnp.asarray(first[None]), jnp.ones((1, 7), jnp.int32))
    alone_second = forward(tiny_model, jnp.asarray(second[None]), jnp.ones((1, 4), jnp.int32))
    np.testing.assert_allclose(logits[0, :7], alone_first[0], atol=1e-5)
    np.testing.assert_allclose(logits[0, 7:11], alone_second[0], atol=1e-5)


@pytest.mark.parametrize("window,impl", [(0, "xla"), (4, "xla"), (4, "dot_product")])
def test_kv_cache_decoding_matches_full_forward(tiny_config, window, impl):
    config = tiny_config.replace(sliding_window=window, sliding_window_layers=(True, False) if window else (),
                                 attention_impl=impl)
    model = create_model(config, seed=2)
    tokens, mask = padded_batch("left")
    full = model(jnp.asarray(tokens), jnp.asarray(mask))
    prefill = 5

    @jax.jit
    def step(model, tokens, mask, cache):
        out = model(tokens, mask, cache=cache)
        return out.logits, out.cache

    cache = KVCache.init(config, B, T)
    logits, cache = step(model, jnp.asarray(tokens[:, :prefill]), jnp.asarray(mask[:, :prefill]), cache)
    pieces = [logits]
    for t in range(prefill, T):
        logits, cache = step(model, jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(mask[:, t:t + 1]), cache)
        pieces.append(logits)
    decoded = np.concatenate([np.asarray(p) for p in pieces], axis=1)
    real = mask.astype(bool)
    assert np.abs(decoded - np.asarray(full))[real].max() <= 1e-5
    assert int(cache.index) == T
    np.testing.assert_array_equal(cache.lengths, mask.sum(1))


def test_kv_cache_layout(tiny_config):
    """Per-layer arrays for a model run layer by layer, one stack for a scanned one; keys transposed
    (``[B, kv, head_dim, S]``) for the XLA attention, as ``[B, kv, S, head_dim]`` for dot_product_attention."""
    kv, hd = tiny_config.num_kv_heads, tiny_config.head_dim
    cache = KVCache.init(tiny_config, 3, 8)
    assert isinstance(cache.keys, tuple) and len(cache.keys) == tiny_config.num_layers
    assert cache.keys[0].shape == (3, kv, hd, 8) and cache.values[0].shape == (3, kv, 8, hd)
    stacked = KVCache.init(tiny_config.replace(scan_layers=True), 3, 8)
    assert stacked.keys.shape == (tiny_config.num_layers, 3, kv, hd, 8)
    plain = KVCache.init(tiny_config.replace(attention_impl="dot_product"), 3, 8)
    assert plain.keys[0].shape == plain.values[0].shape == (3, kv, 8, hd)


def test_cache_rejects_packing(tiny_model, tiny_config):
    cache = KVCache.init(tiny_config, 1, 8)
    with pytest.raises(ValueError, match="segment_ids"):
        tiny_model(jnp.ones((1, 2), jnp.int32), segment_ids=jnp.ones((1, 2), jnp.int32), cache=cache)


def test_sharded_forward_equals_unsharded(tiny_config, mesh8, tiny_model):
    tokens, mask = padded_batch("right")
    tokens, mask = np.concatenate([tokens, tokens[:1]]), np.concatenate([mask, mask[:1]])  # batch 4
    expected = np.asarray(tiny_model(jnp.asarray(tokens), jnp.asarray(mask)))
    with jax.set_mesh(mesh8):
        sharded = create_model(tiny_config, seed=1, mesh=mesh8)
        logits = jax.jit(lambda m, t, a: m(t, a))(sharded, shard_batch(tokens, mesh8), shard_batch(mask, mesh8))
    assert np.abs(np.asarray(logits) - expected).max() <= 1e-5
    spec = lambda x: tuple(x.sharding.spec)
    layer = sharded.layers[0]
    assert spec(layer.self_attn.q_proj[...]) == ("fsdp", "tensor", None)
    assert spec(layer.mlp.down_proj[...]) == ("tensor", "fsdp")
    assert spec(sharded.embed_tokens[...]) == ("tensor", "fsdp")
    assert len(layer.mlp.gate_proj[...].addressable_shards) == 8
    shard_shape = layer.mlp.gate_proj[...].addressable_shards[0].data.shape
    assert shard_shape == (tiny_config.hidden_size // 2, tiny_config.intermediate_size // 2)
    assert spec(logits) == (("data", "fsdp"), None, "tensor")


def test_uneven_heads_fall_back_to_replication(mesh8):
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=3,
                         num_kv_heads=1, head_dim=16)
    with jax.set_mesh(mesh8):
        model = create_model(config, mesh=mesh8)
    assert tuple(model.layers[0].self_attn.q_proj[...].sharding.spec) == ("fsdp", None, None)


def test_param_count_matches_config(tiny_config):
    model = create_model(tiny_config)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == tiny_config.num_params()
    tied = tiny_config.replace(tie_word_embeddings=True, qkv_bias=True)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(create_model(tied), nnx.Param)))
    assert count == tied.num_params()


def test_bf16_compute_path(tiny_config):
    model = create_model(tiny_config.replace(dtype="bfloat16"), seed=1)
    tokens, mask = padded_batch("right")
    logits = model(jnp.asarray(tokens), jnp.asarray(mask))
    assert logits.dtype == jnp.bfloat16
    reference = create_model(tiny_config, seed=1)(jnp.asarray(tokens), jnp.asarray(mask))
    assert np.abs(np.asarray(logits, np.float32) - np.asarray(reference)).max() < 0.1


def test_config_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="architecture"):
        LlamaConfig(architecture="gpt2")
    with pytest.raises(ValueError, match="rope_type"):
        from jaxalign.models import RopeScaling

        RopeScaling("yarn")


def test_dot_product_attention_impl_matches(tiny_config):
    tokens, mask = padded_batch("left")
    reference = create_model(tiny_config, seed=1)(jnp.asarray(tokens), jnp.asarray(mask))
    other = create_model(tiny_config.replace(attention_impl="dot_product"), seed=1)
    np.testing.assert_allclose(other(jnp.asarray(tokens), jnp.asarray(mask))[mask == 1],
                               np.asarray(reference)[mask == 1], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_soft_capped_log_probs_fused_equal_plain(temperature, tmp_path):
    """The trainer's log-probs of a Gemma 2 model (final soft-cap 3): the fused vocabulary-tiled head equals the
    whole logits, values and gradients, also at an RL sampling temperature (which divides the capped logits)."""
    from torch_reference import make_reference

    from jaxalign.objectives.common import policy_token_logps

    make_reference("gemma2", tmp_path)
    model = load_hf(tmp_path)
    tokens, mask = padded_batch("right")
    loss_mask = mask.copy()
    loss_mask[:, :3] = 0

    def total(model, chunk):
        logps = policy_token_logps(model, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(loss_mask),
                                   chunk_size=chunk, temperature=temperature)
        return logps.sum(), logps

    (_, plain_logps), plain_grads = nnx.value_and_grad(total, has_aux=True)(model, 0)
    (_, fused_logps), fused_grads = nnx.value_and_grad(total, has_aux=True)(model, 16)
    np.testing.assert_allclose(fused_logps, plain_logps, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
    direct = jax.nn.log_softmax(logits[:, :-1] / temperature, -1)
    expected = np.take_along_axis(np.asarray(direct), tokens[:, 1:, None], -1)[..., 0] * loss_mask[:, 1:]
    np.testing.assert_allclose(plain_logps[:, 1:], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_router_load_balancing_loss_equals_transformers(arch, tmp_path):
    """The load-balancing loss over every sparse layer, padding excluded: transformers' ``aux_loss``
    (``output_router_logits=True``) on the same padded batch; and the train step adds
    ``router_aux_loss_coef`` times it (its gradient reaches the routers)."""
    import torch
    from torch_reference import make_reference

    from jaxalign.models.llama import recording_router_stats, router_aux_loss

    reference = make_reference(arch, tmp_path)
    model = load_hf(tmp_path)
    tokens, mask = padded_batch("right")
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                             output_router_logits=True).aux_loss.item()
    with recording_router_stats() as routed:
        model(jnp.asarray(tokens), jnp.asarray(mask))
    assert float(router_aux_loss(routed, model)) == pytest.approx(expected, rel=1e-5)
    assert model.config.router_aux_loss_coef == reference.config.router_aux_loss_coef == 0.001

    def aux_of(model):
        with recording_router_stats() as routed:
            model(jnp.asarray(tokens), jnp.asarray(mask))
        return router_aux_loss(routed, model)

    grads = nnx.grad(aux_of)(model)
    assert float(jnp.abs(grads.layers[0].mlp.router[...]).max()) > 0


def test_experts_shard_over_an_expert_mesh_axis(tmp_path, mesh8):
    """Qwen3-MoE on a (data 2, expert 2, tensor 2) mesh: each device holds 2 of the 4 experts of every sparse
    layer (split over the expert axis), and the sharded forward (and its load-balancing loss) equals the
    single-device one."""
    from torch_reference import make_reference

    from jaxalign.models.llama import recording_router_stats, router_aux_loss
    from jaxalign.parallel import make_mesh

    make_reference("qwen3_moe", tmp_path)
    tokens, mask = padded_batch("left")
    plain = load_hf(tmp_path)
    with recording_router_stats() as routed:
        expected = plain(jnp.asarray(tokens), jnp.asarray(mask))
    expected_aux = router_aux_loss(routed, plain)
    mesh = make_mesh({"data": 2, "expert": 2, "tensor": 2})
    with jax.set_mesh(mesh):
        model = load_hf(tmp_path, mesh=mesh)
        kernel = model.layers[0].mlp.experts_gate[...]
        assert kernel.sharding.spec[0] == "expert" and kernel.sharding.spec[2] == "tensor"
        assert kernel.addressable_shards[0].data.shape[0] == 2  # 2 of the 4 experts per device

        @jax.jit
        def forward(model, tokens, mask):
            with recording_router_stats() as routed:
                logits = model(tokens, mask)
            return logits, router_aux_loss(routed, model)

        got, aux = forward(model, shard_batch(tokens, mesh), shard_batch(mask, mesh))
    np.testing.assert_allclose(np.asarray(got)[mask.astype(bool)], np.asarray(expected)[mask.astype(bool)],
                               atol=1e-5)
    np.testing.assert_allclose(aux, expected_aux, rtol=1e-5)


@pytest.mark.slow
def test_a_mixture_of_experts_trains_logs_its_aux_loss_and_exports(tmp_path):
    """SFT on a Qwen3-MoE checkpoint (toy tokenizer): the load-balancing loss is logged as ``moe/aux_loss``, the
    loss falls, the export loads in transformers with the run's logits; LoRA on the experts is refused with a
    message, LoRA on attention trains."""
    import torch
    from test_train import small_config
    from torch_reference import make_reference, torch_logits
    from transformers import AutoModelForCausalLM

    from jaxalign.train import train
    from jaxalign.train.export import export

    make_reference("qwen3_moe", tmp_path / "base", vocab_size=320)
    flags = [f"--config.model.path={tmp_path / 'base'}", "--config.tokenizer=toy", "--config.train.steps=6",
             "--config.train.log_every=3", "--config.optim.lr=3e-3", "--config.eval.generate=0"]
    train(small_config("sft", tmp_path / "run", *flags))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["split"] == "train"]
    assert all(r["moe/aux_loss"] > 0 for r in steps) and steps[-1]["loss"] < steps[0]["loss"]
    out = export(tmp_path / "run", tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokens, mask = padded_batch("right", vocab=320)
    with torch.no_grad():
        expected = torch_logits(reference, tokens, mask)
    got = np.asarray(load_hf(out)(jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(got - expected)[mask.astype(bool)].max() <= 1e-4
    with pytest.raises(ValueError, match="cannot adapt the experts of the mixture-of-experts layers"):
        train(small_config("sft", tmp_path / "lora_bad", *flags, "--config.lora.enabled=True"))
    train(small_config("sft", tmp_path / "lora", *flags, "--config.lora.enabled=True",
                       "--config.lora.target_modules=q_proj,k_proj,v_proj,o_proj", "--config.train.steps=2"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_router_picks_the_experts_transformers_picks(arch, tmp_path):
    """Every sparse layer's top-k experts for every token of a padded batch: exactly transformers' (its router
    logits, ``output_router_logits=True``), and the router logits themselves to 1e-5."""
    import torch
    from torch_reference import make_reference

    from jaxalign.models.llama import MoE

    reference = make_reference(arch, tmp_path)
    model = load_hf(tmp_path)
    tokens, mask = padded_batch("left")
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                           output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    sparse = [i for i in range(model.config.num_layers) if model.config.is_moe(i)]
    assert len(theirs) == len(sparse)
    captured = {}
    original = MoE.__call__

    def spy(self, x):
        out, logits = original(self, x)
        captured[id(self)] = logits
        return out, logits

    MoE.__call__ = spy
    try:
        model(jnp.asarray(tokens), jnp.asarray(mask))
    finally:
        MoE.__call__ = original
    for layer, expected in zip(sparse, theirs, strict=True):
        logits = np.asarray(captured[id(model.layers[layer].mlp)])
        np.testing.assert_allclose(logits, expected.numpy(), atol=1e-5)
        picked = np.sort(np.asarray(jax.lax.top_k(jax.nn.softmax(logits), k)[1]), axis=-1)
        expected_picked = np.sort(torch.topk(torch.softmax(expected.float(), -1), k).indices.numpy(), axis=-1)
        np.testing.assert_array_equal(picked, expected_picked)


def test_moe_layer_memory_grows_linearly_in_tokens():
    """The compiled MoE layer's temporary memory at 512 and 1024 tokens (8 experts, top 2): doubling the tokens
    at most doubles it (linear in tokens, no capacity padding). On the CPU, XLA lowers ``ragged_dot`` through a
    masked ``[experts, rows, d]`` copy of the sorted rows (docs: linear still, but E times the rows)."""
    from jaxalign.models.llama import MoE

    config = LlamaConfig(architecture="mixtral", num_experts=8, num_experts_per_tok=2, hidden_size=64,
                         intermediate_size=128)
    layer = MoE(config, nnx.Rngs(0))

    def temp_bytes(tokens):
        x = jax.ShapeDtypeStruct((1, tokens, 64), jnp.float32)
        compiled = jax.jit(lambda layer, x: layer(x)[0]).lower(layer, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(512), temp_bytes(1024)
    print(f"MoE layer temporaries: {small} bytes at 512 tokens, {large} at 1024")
    assert 1.5 * small <= large <= 2.1 * small


def test_causal_blocks_only_for_long_self_attention():
    from jaxalign.models.llama import causal_blocks

    assert [causal_blocks(t, t) for t in (64, 128, 255, 256, 320, 384, 452, 512, 4096)] == [1, 1, 1, 4, 5, 6, 7, 8, 8]
    assert causal_blocks(256, 512) == 1  # a KV cache's slots: not self-attention over the row


@pytest.mark.parametrize("case", ["padded", "packed", "gemma2"])
def test_causal_blocked_attention_equals_the_dense_product(case, monkeypatch):
    """At 256+ tokens the "xla" self-attention runs in causal query blocks (``causal_blocks``); the logits at every
    real token and every parameter's gradient equal the dense product's (the path below 256 tokens)."""
    from jaxalign.models import llama

    length = 290  # 4 blocks: 3 of 73 rows and one of 71
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    if case == "gemma2":  # soft-capped scores and a sliding window on every other layer
        config = config.replace(attn_softcap=20.0, sliding_window=100, sliding_window_layers=(True, False))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(3, 128, (3, length)))
    mask = np.ones((3, length), np.int32)
    mask[1, 250:] = 0
    mask[2, :37] = 0  # left padding: these queries see no key
    segments = None
    if case == "packed":
        segments = np.zeros((3, length), np.int32)
        for row, cuts in enumerate([(0, 70, 200, 290), (0, 130, 250), (37, 100, 290)]):
            for segment, (start, end) in enumerate(itertools.pairwise(cuts), 1):
                segments[row, start:end] = segment
        segments = jnp.asarray(segments)
    model = create_model(config, seed=0)
    graphdef, params = nnx.split(model)
    real = jnp.asarray(mask, bool)

    def loss_and_logits(params):
        logits = nnx.merge(graphdef, params)(tokens, jnp.asarray(mask), segment_ids=segments)
        weights = real[..., None]
        return (jax.nn.log_softmax(logits) * weights).sum() / weights.sum(), logits

    (loss, blocked), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(params)
    monkeypatch.setattr(llama, "causal_blocks", lambda length, slots: 1)
    (dense_loss, dense), dense_grads = jax.value_and_grad(loss_and_logits, has_aux=True)(params)
    np.testing.assert_allclose(np.asarray(blocked)[mask == 1], np.asarray(dense)[mask == 1], atol=1e-5)
    assert abs(float(loss) - float(dense_loss)) <= 1e-5 * abs(float(dense_loss))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()) + 1e-9)


def test_causal_blocks_on_a_mesh_equal_one_device(tiny_config, mesh8):
    """The query blocks' hand-written backward under data, fsdp and tensor sharding (heads split over the tensor
    axis): the loss and every gradient at 256 tokens equal one device's."""
    rng = np.random.RandomState(3)
    tokens = rng.randint(3, 128, (4, 256))
    mask = np.ones((4, 256), np.int32)
    mask[1, 200:] = 0

    def loss_and_grads(model, tokens, mask):
        graphdef, params = nnx.split(model)

        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens, mask)
            return (jax.nn.log_softmax(logits) * mask[..., None]).sum() / mask.sum()

        return jax.value_and_grad(loss)(params)

    want, want_grads = jax.jit(loss_and_grads)(create_model(tiny_config, seed=1), jnp.asarray(tokens),
                                               jnp.asarray(mask))
    with jax.set_mesh(mesh8):
        sharded = create_model(tiny_config, seed=1, mesh=mesh8)
        got, grads = jax.jit(loss_and_grads)(sharded, shard_batch(tokens, mesh8), shard_batch(mask, mesh8))
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * float(jnp.abs(w).max()))


@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_causal_block_attention_backward_equals_the_derivative_of_the_softmax(cap):
    """The hand-written backward of one query block against JAX's derivative of the same product (softmax of the
    masked, scaled, soft-capped scores), at every query: also one that sees no key (uniform over the keys)."""
    from jaxalign.models.llama import _MASK_VALUE, causal_block_attention, softcap

    rng = np.random.RandomState(0)
    batch, kv, groups, rows, keys, hd = 2, 2, 3, 5, 12, 8
    q = jnp.asarray(rng.randn(batch, kv, groups, rows, hd), jnp.float32)
    k, v = (jnp.asarray(rng.randn(batch, kv, keys, hd), jnp.float32) for _ in range(2))
    mask = jnp.asarray(np.tril(np.ones((rows, keys), bool), keys - rows)[None] & (rng.rand(batch, 1, keys) > 0.2))
    mask = mask.at[1, 2].set(False)  # this query sees no key
    weights = jnp.asarray(rng.randn(batch, kv, groups, rows, hd), jnp.float32)

    def reference(q, k, v):
        scores = softcap(jnp.einsum("bkgqd,bksd->bkgqs", q, k) * 0.3, cap)
        probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, _MASK_VALUE), axis=-1)
        return jnp.einsum("bkgqs,bksd->bkgqd", probs, v)

    def loss(fn):
        return jax.value_and_grad(lambda *x: (fn(*x) * weights).sum(), argnums=(0, 1, 2))(q, k, v)

    value, grads = loss(lambda q, k, v: causal_block_attention(q, k, v, mask, 0.3, cap))
    want_value, want_grads = loss(reference)
    assert abs(float(value) - float(want_value)) <= 1e-5 * abs(float(want_value))
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("side", ["right", "left"])
def test_logit_parity_with_transformers_in_causal_blocks(side, tmp_path):
    """The blocked path (256 tokens: 4 query blocks) against transformers' eager attention."""
    from torch_reference import make_reference, torch_logits

    reference = make_reference("qwen3", tmp_path, max_position_embeddings=512)
    model = load_hf(tmp_path)
    rng = np.random.RandomState(1)
    tokens = rng.randint(3, 128, (2, 256))
    mask = np.ones((2, 256), np.int32)
    if side == "right":
        mask[1, 190:] = 0
    else:
        mask[1, :66] = 0
    tokens = np.where(mask == 1, tokens, 0)
    expected = torch_logits(reference, tokens, mask)
    got = np.asarray(jax.jit(lambda m, t, a: m(t, a))(model, jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(got - expected)[mask == 1].max() <= 1e-4
