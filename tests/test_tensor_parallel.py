"""Tensor parallelism on the CPU's virtual devices (conftest makes 4): a model split over 2 or 4
devices gives the greedy tokens it gives whole, token for token in float32; its arrays are
really split; a size the heads cannot take is a clear error. Mixtures of experts split inside
their experts or, under expert parallelism, by expert."""

import jax
import pytest
from test_time_to_result import prompt_bucket_pair
from tiny_models import TINY, save_tiny

import jaxspec
import jaxspec.model.layout
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.cache import KVCache
from jaxspec.decoding.method import DecodeMethod
from jaxspec.model.checkpoint import convert_hf_checkpoint
from jaxspec.model.config import load_config
from jaxspec.serving.runner import run

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.multi_device]
HF = CHECKPOINTS / "hf"
PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef mean(xs):\n    ", "class Stack:\n    def push(self, x):"]


def _tokens(outs):
    return [c.token_ids for c in outs]


def _shard_shape(a):
    return a.addressable_shards[0].data.shape


@pytest.fixture(scope="module")
def split_pair(tmp_path_factory):
    """The embedded target converted and restored straight into 2 shards; the draft whole."""
    converted = convert_hf_checkpoint(HF / "code-target-16m", tmp_path_factory.mktemp("tp") / "code-target-16m")
    return jaxspec.load(converted, dtype="float32", tensor_parallel=2), jaxspec.load(HF / "code-draft-4m", dtype="float32")


def test_embedded_pair_split_two_ways_decodes_the_same_tokens(real_pair, split_pair):
    target, draft = real_pair
    split, _ = split_pair
    kw = dict(max_new_tokens=32)
    assert _tokens(jaxspec.generate(PROMPTS, split, **kw)) == _tokens(jaxspec.generate(PROMPTS, target, **kw))
    whole = jaxspec.generate(PROMPTS[:2], target, draft, num_draft_tokens=3, **kw)
    spec = jaxspec.generate(PROMPTS[:2], split, draft, num_draft_tokens=3, **kw)
    assert _tokens(spec) == _tokens(whole)
    assert [c.stats.accepted_per_position for c in spec] == [c.stats.accepted_per_position for c in whole]
    tree = jaxspec.generate(PROMPTS[:1], split, draft, tree="binary-3", **kw)
    assert _tokens(tree) == _tokens(jaxspec.generate(PROMPTS[:1], target, draft, tree="binary-3", **kw))
    lookup = dict(num_draft_tokens=4, ngram_branches=2, warn_below_acceptance=0.0, **kw)
    ngram = jaxspec.generate(PROMPTS[:2], split, "ngram", **lookup)
    assert _tokens(ngram) == _tokens(whole)
    assert [c.stats.accepted_per_position for c in ngram] == [
        c.stats.accepted_per_position for c in jaxspec.generate(PROMPTS[:2], target, "ngram", **lookup)]


def test_an_eagle3_head_drafts_for_a_split_target(real_pair, split_pair, tmp_path):
    """The head whole on each device; the split target hands it features gathered whole."""
    from jaxspec.model.eagle import random_eagle_folder

    target, split = real_pair[0], split_pair[0]
    head = jaxspec.load(random_eagle_folder(tmp_path / "head", target.config, draft_vocab_size=1024, seed=3),
                        dtype="float32")
    kw = dict(num_draft_tokens=3, max_new_tokens=16, warn_below_acceptance=0.0)
    whole = jaxspec.generate(PROMPTS[:2], target, head, **kw)
    spec = jaxspec.generate(PROMPTS[:2], split, head, **kw)
    assert _tokens(spec) == _tokens(whole) == _tokens(jaxspec.generate(PROMPTS[:2], target, max_new_tokens=16))
    assert [c.stats.accepted_per_position for c in spec] == [c.stats.accepted_per_position for c in whole]
    tree = jaxspec.generate(PROMPTS[:2], split, head, tree="sparse", **kw)
    assert _tokens(tree) == _tokens(whole)


def test_a_split_target_shares_one_loop_across_prompt_buckets(real_pair, split_pair, monkeypatch):
    """The accelerators' static path: the shared loop is compiled from the prefill's output
    shardings, and K=3 on the split target gives the whole target's tokens."""
    target, draft = real_pair
    split, _ = split_pair
    requests = prompt_bucket_pair(target.tokenizer)
    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        got = run(split, requests, 2, DecodeMethod.of(draft, 3), draft, scheduler="static",
                  groups=[[0, 1], [2, 3]], graphs=jaxspec.GraphCache())
    assert got.metrics.graphs_compiled == 3
    whole = jaxspec.generate([list(r.token_ids) for r in requests], target, draft, num_draft_tokens=3, max_new_tokens=40)
    assert [c.token_ids for c in got] == [c.token_ids for c in whole]


def test_a_quantized_target_split_two_ways_decodes_its_whole_tokens(split_pair, tmp_path):
    """8-bit values split as their projections, scales by the output axes they keep."""
    whole = jaxspec.load(HF / "code-target-16m", dtype="float32", quantize="int8")
    split = jaxspec.load(HF / "code-target-16m", dtype="float32", quantize="int8", tensor_parallel=2)
    converted = convert_hf_checkpoint(HF / "code-target-16m", tmp_path / "int8", quantize="int8")
    restored = jaxspec.load(converted, dtype="float32", tensor_parallel=2)  # 8 bits straight into 2 shards
    assert restored.quantize == "int8"
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), restored.weights, split.weights)))
    assert _shard_shape(split.weights.layers.wqkv.scale)[1] == split.config.num_kv_heads // 2
    kw = dict(max_new_tokens=24)
    assert _tokens(jaxspec.generate(PROMPTS, split, **kw)) == _tokens(jaxspec.generate(PROMPTS, whole, **kw))
    draft = split_pair[1]
    assert _tokens(jaxspec.generate(PROMPTS[:2], split, draft, num_draft_tokens=3, **kw)) == _tokens(
        jaxspec.generate(PROMPTS[:2], whole, **kw))


def test_restored_shards_are_split(split_pair):
    split, draft = split_pair
    c, w = split.config, split.weights
    assert split.tensor_parallel == 2 and w.mesh.size == 2
    # The CPU layout: layers stacked; q/k/v by kv heads, o and down by rows, gate/up by columns.
    assert w.layers.wqkv.shape[2] == c.num_kv_heads and _shard_shape(w.layers.wqkv)[2] == c.num_kv_heads // 2
    assert _shard_shape(w.layers.wo)[1] == c.num_heads // 2
    assert _shard_shape(w.layers.w_down)[1] == c.intermediate_size // 2
    assert all(_shard_shape(a)[2] == c.intermediate_size // 2 for a in w.layers.w_gate_up)
    assert _shard_shape(w.embed) == (c.vocab_size // 2, c.hidden_size)  # vocabulary-parallel (tied head)
    assert _shard_shape(w.layers.attn_norm) == w.layers.attn_norm.shape  # norms whole
    cache = KVCache.create(c, 2, 64, split.dtype, mesh=w.mesh)
    assert _shard_shape(cache.k)[3] == c.num_kv_heads // 2
    assert draft.mesh is None  # generate() replicates it over the target's devices


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_tp")
    return {
        # 4 query heads over 2 kv heads: split 2 ways by kv heads, 4 ways with each repeated twice.
        "gqa": save_tiny(root / "gqa", "llama", {}),
        # one kv head, tied head: every split repeats it.
        "mqa": save_tiny(root / "mqa", "llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
        "qwen3": save_tiny(root / "qwen3", "qwen3", dict(head_dim=32)),
        # biases, and a vocabulary (386) that 4 does not divide: embedding and head stay whole.
        "qwen2": save_tiny(root / "qwen2", "qwen2", dict(vocab_size=386)),
        # a mixture of experts: each expert's ffn columns split (tensor parallel inside the experts)
        "mixtral": save_tiny(root / "mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": save_tiny(root / "qwen3_moe", *TINY["qwen3_moe"]),
        "qwen3_moe_dense_layer": save_tiny(root / "qwen3_moe_dense_layer", *TINY["qwen3_moe_dense_layer"]),
    }


@pytest.mark.parametrize("name", ["gqa", "mqa", "qwen3", "qwen2", "mixtral"])
def test_tiny_models_split_two_and_four_ways(tiny_dirs, name):
    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    whole = jaxspec.load(tiny_dirs[name], dtype="float32")
    want = _tokens(jaxspec.generate(prompts, whole, max_new_tokens=24))
    for tp in (2, 4):
        split = jaxspec.load(tiny_dirs[name], dtype="float32", tensor_parallel=tp)
        assert _tokens(jaxspec.generate(prompts, split, max_new_tokens=24)) == want, f"tensor_parallel {tp}"
        n = split.config.num_kv_heads
        assert n == max(whole.config.num_kv_heads, tp)  # repeated past their count
        assert _shard_shape(split.weights.layers.wqkv)[2] == n // tp
        if whole.config.is_moe:  # [L, E, f', d]: each expert's columns split
            assert _shard_shape(split.weights.layers.experts_down)[2] == whole.config.moe_intermediate_size // tp
        vocab_split = whole.config.vocab_size % tp == 0
        assert _shard_shape(split.weights.embed)[0] == whole.config.vocab_size // (tp if vocab_split else 1)


def test_8bit_experts_split_two_ways_decode_their_whole_tokens(tiny_dirs, tmp_path):
    """Each expert's 8-bit values split by ffn columns as its float ones are, the gate/up scales
    with their columns, the down scales whole; a converted int8 checkpoint restores straight into
    the same 2 shards."""
    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    whole = jaxspec.load(tiny_dirs["mixtral"], dtype="float32", quantize="int8")
    split = jaxspec.load(tiny_dirs["mixtral"], dtype="float32", quantize="int8", tensor_parallel=2)
    converted = convert_hf_checkpoint(tiny_dirs["mixtral"], tmp_path / "int8", quantize="int8")
    restored = jaxspec.load(converted, dtype="float32", tensor_parallel=2)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), restored.weights, split.weights)))
    gate_up, down = split.weights.layers.experts_gate_up, split.weights.layers.experts_down
    f = whole.config.moe_intermediate_size
    assert _shard_shape(gate_up.values)[3] == _shard_shape(gate_up.scale)[3] == f // 2  # [L, E, 2, f, d], [L, E, 2, f]
    assert _shard_shape(down.values)[3] == f // 2 and _shard_shape(down.scale) == down.scale.shape  # [L, E, d, f]
    kw = dict(max_new_tokens=24)
    assert _tokens(jaxspec.generate(prompts, split, **kw)) == _tokens(jaxspec.generate(prompts, whole, **kw))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_experts_split_by_expert_decode_the_tokens_of_one_device(tiny_dirs, name, monkeypatch):
    """Expert parallelism over 2 and 4 devices (each E/N whole experts, attention split by heads):
    each device holds its own experts, and every expert path (each forced for every call, the
    kernel in interpret mode) gives the greedy tokens one device gives on that path, float32."""
    import numpy as np

    import jaxspec.model.forward as forward

    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    whole = jaxspec.load(tiny_dirs[name], dtype="float32")
    split = [jaxspec.load(tiny_dirs[name], dtype="float32", tensor_parallel=tp, expert_parallel=True) for tp in (2, 4)]
    e, f = whole.config.num_experts, whole.config.moe_intermediate_size
    for model in split:
        assert model.expert_parallel and model.tensor_parallel in (2, 4)
        held = e // model.tensor_parallel
        devices = list(model.mesh.devices.flat)
        for shard in model.weights.layers.experts_gate_up.addressable_shards:  # [L, E, d, 2, f]: whole experts
            first = devices.index(shard.device) * held
            assert shard.index[1] == slice(first, first + held) and shard.data.shape[-1] == f
            np.testing.assert_array_equal(shard.data, whole.weights.layers.experts_gate_up[:, first:first + held])
        assert _shard_shape(model.weights.layers.wqkv)[2] == model.config.num_kv_heads // model.tensor_parallel
    for path in forward.EXPERT_PATHS:
        monkeypatch.setattr(forward, "FORCED_EXPERT_PATH", path)
        for model in [whole, *split]:
            model.graphs.clear()  # the path is picked while a graph is traced
        jax.clear_caches()
        want = _tokens(jaxspec.generate(prompts, whole, max_new_tokens=16))
        for model in split:
            got = _tokens(jaxspec.generate(prompts, model, max_new_tokens=16))
            assert got == want, f"{path}, tensor_parallel {model.tensor_parallel}"


def test_a_moe_with_a_dense_layer_splits_both_ways(tiny_dirs, tmp_path):
    """Layer 1 dense between sparse ones: tensor parallel (the dense MLP's and each expert's
    columns split) and expert parallel (whole experts a device, the dense MLP's columns split),
    from the folder and from a converted checkpoint, give one device's tokens."""
    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    folder = tiny_dirs["qwen3_moe_dense_layer"]
    want = _tokens(jaxspec.generate(prompts, jaxspec.load(folder, dtype="float32"), max_new_tokens=16))
    converted = convert_hf_checkpoint(folder, tmp_path / "ckpt")
    c = load_config(folder)
    for source, tp, ep in ((folder, 4, False), (folder, 4, True), (converted, 2, True)):
        split = jaxspec.load(source, dtype="float32", tensor_parallel=tp, expert_parallel=ep)
        dense, sparse = split.weights.layers[1], split.weights.layers[2]
        assert _shard_shape(dense.w_down)[0] == c.intermediate_size // tp
        assert _shard_shape(sparse.experts_down)[:2] == ((c.num_experts // tp, c.moe_intermediate_size) if ep else
                                                         (c.num_experts, c.moe_intermediate_size // tp))
        got = _tokens(jaxspec.generate(prompts, split, max_new_tokens=16))
        assert got == want, f"{source.name}, tensor_parallel {tp}, expert_parallel {ep}"


def test_a_converted_checkpoint_restores_each_devices_own_experts(tiny_dirs, tmp_path):
    """The checkpoint stores one tensor per expert: under expert parallelism each is restored on
    its expert's device alone, and the weights equal the HF folder's; speculative decoding on
    them (drafting for itself) gives one device's plain tokens."""
    from jaxspec.model.sharding import make_mesh
    from jaxspec.model.weights import field_shardings

    converted = convert_hf_checkpoint(tiny_dirs["mixtral"], tmp_path / "mixtral")
    model = jaxspec.load(converted, dtype="float32", tensor_parallel=4, expert_parallel=True)
    mesh = make_mesh(2)
    shardings = field_shardings(model.config, mesh, (), expert_parallel=True)
    assert shardings["layers.e_down3"].device_set == {mesh.devices.flat[1]}  # experts 2 and 3: the second device
    assert shardings["layers.wq"].spec == field_shardings(model.config, mesh)["layers.wq"].spec  # attention as before
    from_hf = jaxspec.load(tiny_dirs["mixtral"], dtype="float32", tensor_parallel=4, expert_parallel=True)
    same = jax.tree.map(lambda a, b: bool((a == b).all()) and a.sharding == b.sharding, model.weights, from_hf.weights)
    assert all(jax.tree.leaves(same))
    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    plain = _tokens(jaxspec.generate(prompts, jaxspec.load(tiny_dirs["mixtral"], dtype="float32"), max_new_tokens=24))
    spec = jaxspec.generate(prompts, model, model, num_draft_tokens=3, max_new_tokens=24)
    assert _tokens(spec) == plain
    assert spec.metrics.acceptance_rate > 0.9  # verify passes of 4 tokens, routed to many experts at once


def test_8bit_experts_split_by_expert_decode_their_whole_tokens(tiny_dirs, tmp_path):
    """int8 experts split by expert, quantized as they load and restored from a converted
    checkpoint (each expert's values and scales on its device): the whole model's weights and
    greedy tokens."""
    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    whole = jaxspec.load(tiny_dirs["mixtral"], dtype="float32", quantize="int8")
    converted = convert_hf_checkpoint(tiny_dirs["mixtral"], tmp_path / "int8", quantize="int8")
    for split in (jaxspec.load(tiny_dirs["mixtral"], dtype="float32", quantize="int8", tensor_parallel=2,
                               expert_parallel=True),
                  jaxspec.load(converted, dtype="float32", tensor_parallel=2, expert_parallel=True)):
        assert split.expert_parallel and split.quantize == "int8"
        mine, theirs = jax.tree.leaves(split.weights), jax.tree.leaves(whole.weights)
        assert len(mine) == len(theirs) and all(bool((a == b).all()) for a, b in zip(mine, theirs))
        values = split.weights.layers.experts_gate_up.values  # [L, E, 2, f, d]: whole experts, E/2 a device
        assert _shard_shape(values)[1] == whole.config.num_experts // 2 and _shard_shape(values)[3:] == values.shape[3:]
        kw = dict(max_new_tokens=16)
        assert _tokens(jaxspec.generate(prompts, split, **kw)) == _tokens(jaxspec.generate(prompts, whole, **kw))


def test_expert_counts_the_devices_cannot_split_are_clear_errors(tmp_path):
    """Two experts over four devices: refused naming num_experts and the splits that work (4
    splits the heads and each expert's columns, so tensor parallel inside the experts takes it);
    an fp8 folder's per-channel scales split by expert: refused, naming it."""
    two = save_tiny(tmp_path / "two", "mixtral", dict(num_local_experts=2, num_experts_per_tok=2, num_hidden_layers=1))
    with pytest.raises(jaxspec.InputError, match=r"tensor_parallel 4 cannot split two: .*num_experts 2 "
                                                 r"\(expert_parallel\)\. .*an equal share of each of the rest\. "
                                                 r"Allowed on these 4 devices: \[1, 2\]"):
        jaxspec.load(two, tensor_parallel=4, expert_parallel=True)
    assert not jaxspec.load(two, tensor_parallel=4).expert_parallel
    from test_quantize import fp8_folder

    fp8 = fp8_folder(tmp_path, per_channel=True, source=two)
    with pytest.raises(jaxspec.InputError, match=r"expert_parallel: fp8-fp8-channel is an fp8 folder with per-channel"):
        jaxspec.load(fp8, tensor_parallel=2, expert_parallel=True)


def test_gpu_layout_and_pallas_kernel_per_shard(tiny_dirs):
    """The accelerators' layout (layers unrolled, gate/up fused), speculative with the fused
    Pallas kernel running on each shard (interpret mode), against the whole model."""
    prompts = [[5, 17, 33, 9, 101, 7], [3, 250, 41]]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jaxspec.model.layout, "scan_layers", lambda: False)
        mp.setattr(jaxspec.model.layout, "fuse_mlp", lambda: True)
        whole = jaxspec.load(tiny_dirs["gqa"], dtype="float32")
        split = jaxspec.load(tiny_dirs["gqa"], dtype="float32", tensor_parallel=2)
        draft = jaxspec.load(tiny_dirs["mqa"], dtype="float32", tensor_parallel=2)  # split too
        assert isinstance(split.weights.layers, tuple)
        assert _shard_shape(split.weights.layers[0].w_gate_up)[2] == whole.config.intermediate_size // 2
        kw = dict(max_new_tokens=20, num_draft_tokens=3, attention="pallas")
        assert _tokens(jaxspec.generate(prompts, split, draft, **kw)) == _tokens(
            jaxspec.generate(prompts, whole, jaxspec.load(tiny_dirs["mqa"], dtype="float32"), **kw))


def test_sizes_the_heads_cannot_take_are_clear_errors():
    with pytest.raises(jaxspec.InputError, match=r"tensor_parallel 4 cannot split code-target-16m: num_heads 6, "
                                                 r"num_kv_heads 2.*Allowed on these 4 devices: \[1, 2\]"):
        jaxspec.load(HF / "code-target-16m", tensor_parallel=4)
    with pytest.raises(jaxspec.InputError, match="tensor_parallel 8 needs 8 devices; 4 are visible"):
        jaxspec.load(HF / "code-target-16m", tensor_parallel=8)
    with pytest.raises(jaxspec.InputError, match="tensor_parallel must be an integer >= 1; got 0"):
        jaxspec.load(HF / "code-target-16m", tensor_parallel=0)


def test_a_draft_split_wider_than_its_target_is_a_clear_error(real_pair, split_pair):
    target, _ = real_pair
    split, _ = split_pair
    with pytest.raises(jaxspec.InputError, match="model .code-target-16m. is on 2 device"):
        jaxspec.generate(PROMPTS[:1], target, split, max_new_tokens=4)


def test_two_processes_under_jax_distributed_decode_as_one(real_pair):
    """`jaxspec generate --coordinator ...` in two local processes (one CPU device each, gloo
    collectives): the target split over both; process 0 prints the tokens one process gives.
    (Plain decoding: the draft beside a split target is checked in one process above.)"""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxspec.cli", "generate", PROMPTS[0], "--max-new-tokens", "24", "--json",
           "--target", str(HF / "code-target-16m"), "--dtype", "float32",
           "--tensor-parallel", "2", "--coordinator", f"localhost:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    printed = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    assert not any(line.startswith("{") for line in outs[1][0].splitlines())  # only process 0 prints
    want = jaxspec.generate(PROMPTS[:1], real_pair[0], max_new_tokens=24)
    assert [x["token_ids"] for x in printed] == _tokens(want)


def _lower_split_forward(monkeypatch, platform: str, device_kind: str, shape: str, expert_parallel: bool = False):
    """(config, StableHLO text) of a forward pass of the named shape split over an abstract mesh
    of two GPUs, in the GPU layout with its Pallas kernels."""
    import jax.numpy as jnp
    from jax.sharding import (
        AbstractDevice,
        AbstractMesh,
        NamedSharding,
        PartitionSpec,
        use_abstract_mesh,
    )

    from jaxspec.bench.shapes import layer_shapes, shape_config
    from jaxspec.model.cache import cache_specs
    from jaxspec.model.forward import forward
    from jaxspec.model.weights import LayerWeights, Weights, weight_specs

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the GPU layout, kernel compiled
    c = shape_config(shape)
    mesh = AbstractMesh((2,), ("tp",), abstract_device=AbstractDevice(device_kind, None, platform))
    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    layers = tuple(LayerWeights(**{name: sds(shape) for name, shape in
                                   layer_shapes(c, True, i in c.sparse_layers).items()}) for i in range(c.num_layers))
    weights = Weights(embed=sds((c.vocab_size, c.hidden_size)), layers=layers, final_norm=sds((c.hidden_size,)),
                      lm_head=sds((c.hidden_size, c.vocab_size)), mesh=mesh, expert_parallel=expert_parallel)
    cache_shape = sds((2, 128, c.num_kv_heads, c.head_dim))
    cache = KVCache(k=(cache_shape,) * c.num_layers, v=(cache_shape,) * c.num_layers,
                    lengths=jax.ShapeDtypeStruct((2,), jnp.int32))
    tokens = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    # Shapes placed as the engine places arrays (JAX 0.11 checks them against shard_map's specs).
    placed = lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, p))  # noqa: E731
    weights = jax.tree.map(placed, weights, weight_specs(weights, c))
    cache = jax.tree.map(placed, cache, cache_specs(cache))
    tokens = placed(tokens, PartitionSpec())
    with use_abstract_mesh(mesh):
        traced = jax.jit(forward, static_argnames=("config", "attention")).trace(
            weights, c, tokens, cache, attention="pallas")
        return c, traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
def test_split_forward_lowers_for_two_gpus_ahead_of_time(monkeypatch, platform, device_kind):
    """No GPU needed: a forward pass split over an abstract mesh of two MI300X (or H200) lowers,
    with the fused Pallas kernel as a Triton call on each shard and the layer's all-reduces."""
    c, text = _lower_split_forward(monkeypatch, platform, device_kind, "tiny")
    assert text.count("__gpu$xla.gpu.triton") == c.num_layers  # one kernel per layer, per shard
    assert "all_reduce" in text and "all_gather" in text


def test_experts_split_by_expert_lower_for_two_gpus_ahead_of_time(monkeypatch):
    """Expert parallelism on two (abstract) H200s: each runs the expert kernel over its own 8 of
    the 16 experts (8 tokens' 32 pairs, few_tokens_layout: a block per distinct expert held, at
    most 8; all 16 would make 16), and the experts' outputs join in the all-reduce."""
    _, text = _lower_split_forward(monkeypatch, "cuda", "NVIDIA H200", "tiny-moe", expert_parallel=True)
    assert 'name = "expert_matmul_gated"' in text and 'name = "expert_matmul"' in text
    assert text.count("grid_x = 8 : i32") == 2 and "all_reduce" in text


def test_batch_job_split_two_ways(tmp_path, real_pair):
    """`jaxspec batch --tensor-parallel 2`: the target split, the draft whole on both devices,
    the same tokens as the whole pair."""
    import json

    from jaxspec.cli import main as cli_main

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    argv = ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--target", str(HF / "code-target-16m"),
            "--draft", str(HF / "code-draft-4m"), "--dtype", "float32", "--max-new-tokens", "24",
            "--num-draft-tokens", "3", "--tensor-parallel", "2", "--no-progress", "--no-plot"]
    assert cli_main(argv) == 0
    lines = {x["id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    target, draft = real_pair
    want = jaxspec.generate(PROMPTS, target, draft, num_draft_tokens=3, max_new_tokens=24)
    assert [lines[i]["token_ids"] for i in range(len(PROMPTS))] == _tokens(want)


def test_distributed_flags_are_checked(tmp_path, capsys):
    from jaxspec.cli import main as cli_main

    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    batch = ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--coordinator", "localhost:1",
             "--num-processes", "2", "--process-id", "0"]
    assert cli_main(batch) == 2
    assert "a batch job runs in one process" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    assert cli_main(["generate", "x", "--coordinator", "localhost:1"]) == 2
    assert "--coordinator needs --num-processes N and --process-id I" in capsys.readouterr().err
    assert cli_main(["generate", "x", "--process-id", "1"]) == 2
    assert "--num-processes and --process-id need --coordinator HOST:PORT" in capsys.readouterr().err
