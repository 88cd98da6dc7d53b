"""The accelerator layout (layers unrolled over separate arrays, gate/up fused) computes what the
CPU layout (layers stacked and scanned, gate/up apart) does. CI has no GPU, so the GPU path is
checked here by switching the layout on the CPU."""

import jax
import numpy as np
import pytest

import jaxspec
import jaxspec.model.layout
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.cache import KVCache
from jaxspec.model.forward import forward
from jaxspec.model.weights import LayerWeights

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HF = CHECKPOINTS / "hf"


@pytest.fixture(scope="module")
def gpu_layout_pair():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jaxspec.model.layout, "scan_layers", lambda: False)
        mp.setattr(jaxspec.model.layout, "fuse_mlp", lambda: True)
        pair = (jaxspec.load(HF / "code-target-16m", dtype="float32"),
                jaxspec.load(HF / "code-draft-4m", dtype="float32"))
        yield pair


def test_layouts_are_what_they_say(real_pair, gpu_layout_pair):
    cpu, gpu = real_pair[0], gpu_layout_pair[0]
    c = cpu.config
    assert isinstance(cpu.weights.layers, LayerWeights) and cpu.weights.layers.wqkv.shape[0] == c.num_layers
    assert isinstance(cpu.weights.layers.w_gate_up, tuple)
    assert isinstance(gpu.weights.layers, tuple) and len(gpu.weights.layers) == c.num_layers
    assert gpu.weights.layers[0].w_gate_up.shape == (c.hidden_size, 2, c.intermediate_size)
    # The same numbers, rearranged: layer 3's fused q/k/v and gate/up.
    np.testing.assert_array_equal(gpu.weights.layers[3].wqkv, cpu.weights.layers.wqkv[3])
    np.testing.assert_array_equal(gpu.weights.layers[3].w_gate_up[:, 0], cpu.weights.layers.w_gate_up[0][3])
    np.testing.assert_array_equal(gpu.weights.layers[3].w_gate_up[:, 1], cpu.weights.layers.w_gate_up[1][3])


def _logits(model, tokens, stacked):
    cache = KVCache.create(model.config, tokens.shape[0], 64, model.dtype, stacked=stacked)
    assert isinstance(cache.k, tuple) != stacked
    logits, _ = jax.jit(forward, static_argnames="config")(model.weights, model.config, tokens, cache)
    return np.asarray(logits)


def test_logits_match(real_pair, gpu_layout_pair):
    tokens = np.random.default_rng(0).integers(1, 8000, (2, 24)).astype(np.int32)
    cpu, gpu = _logits(real_pair[0], tokens, True), _logits(gpu_layout_pair[0], tokens, False)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-5)


def test_one_row_pass_matches_a_two_row_pass(real_pair, gpu_layout_pair):
    """The accelerator layout pads one-row products with a zero row (model._project): the padded
    pass gives what the same row gives beside another in the CPU layout (also a two-row product)."""
    tokens = np.array([[1234], [77]], np.int32)
    two_rows = _logits(real_pair[0], tokens, True)
    one_row = _logits(gpu_layout_pair[0], tokens[:1], False)
    np.testing.assert_allclose(one_row[0], two_rows[0], rtol=1e-5, atol=1e-5)


# Plain decoding runs the same forward (test_logits_match) and the same prefill (both here).
@pytest.mark.parametrize("kw", [{"num_draft_tokens": 3}, {"attention": "pallas", "tree": "binary-3"}],
                         ids=["K=3", "tree-pallas"])
def test_greedy_output_matches(real_pair, gpu_layout_pair, humaneval20, kw):
    prompts = humaneval20[:3]
    n = 12 if kw.get("attention") == "pallas" else 32  # the kernel runs in interpret mode here
    rows = 4 if kw.get("tree") else 1  # one row: the chain's one-token draft passes pad a row
    outs = []
    for target, draft in (real_pair, gpu_layout_pair):  # the caches follow the weights' layout
        outs.append(jaxspec.generate(prompts, target, draft, max_new_tokens=n, max_batch_size=rows,
                                     warn_below_acceptance=0.0, **kw))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert a.stats == b.stats


@pytest.mark.parametrize("k, n, padded", [(1024, 1024, True), (2048, 4864, True), (2048, 5120, False),
                                          (4096, 4096, False)])
def test_one_row_products_are_padded_only_where_xla_would_rewrite_them(k, n, padded, monkeypatch):
    """XLA's GPU simplifier turns a one-row product into multiply + reduce kernels only when its
    operands hold under 10M elements (forward.XLA_DOT_REWRITE_BELOW): those are padded with a
    zero row behind a barrier, larger ones (the 8B's projections, Qwen3-30B-A3B's q/k/v at
    2048 x 5120) are left to XLA's GEMM as they are. (JAXSPEC_PAD_ONE_ROW=all pads every one,
    the 4096 x 4096 product too.)"""
    from jaxspec.model import forward

    def barrier(rows):  # whether the accelerator layout's product of `rows` rows is padded behind a barrier
        x, w = jax.ShapeDtypeStruct((1, rows, k), np.float32), jax.ShapeDtypeStruct((k, n), np.float32)
        text = jax.jit(lambda x, w: forward._project("btd,df->btf", x, w, True)).lower(x, w).as_text()
        return "optimization_barrier" in text

    monkeypatch.setattr(forward, "PAD_ONE_ROW", "small")
    assert barrier(1) == padded and not barrier(2)
    monkeypatch.setattr(forward, "PAD_ONE_ROW", "all")
    assert barrier(1)
