"""The plain decoding loop: one compiled graph per bucket, exact stopping, per-request seeds."""

import dataclasses

import jax
import pytest

import jaxspec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def target(real_pair):
    return real_pair[0]


class CompileCounter:
    """Counts XLA backend compilations while active."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_prompts_in_one_bucket_compile_nothing_new(target):
    # Start from no compiled graphs (a cache of our own), whatever other tests compiled before.
    graphs = jaxspec.GraphCache()
    jax.clear_caches()
    ids = target.tokenizer.encode("def fibonacci(n):\n    ")
    first = jaxspec.generate([ids + [10] * 11, ids], target, max_new_tokens=20, graphs=graphs)  # <= 32 tokens, batch 2
    assert (first.metrics.graphs_compiled, first.metrics.graph_cache_hits) == (1, 0)
    with CompileCounter() as counter:
        outs = jaxspec.generate([ids + [10] * 3, ids + [10] * 20], target, max_new_tokens=20, graphs=graphs)
        outs2 = jaxspec.generate([ids + [10] * 16, ids + [10]], target, max_new_tokens=17, graphs=graphs)
    assert counter.count == 0
    assert outs.metrics.graphs_compiled == 0 and outs2.metrics.graphs_compiled == 0
    assert outs.metrics.graph_cache_hits == 1 and graphs.hits == 2
    assert [o.stats.new_tokens for o in outs] == [20, 20]
    # A longer prompt lands in the next bucket: exactly one new decode graph.
    with CompileCounter() as counter:
        outs3 = jaxspec.generate([ids + [10] * 40], target, max_new_tokens=20, graphs=graphs)
    assert outs3.metrics.graphs_compiled == 1
    assert counter.count >= 1


def test_the_graph_cache_is_bounded(target):
    """Least recently used graphs go first once the cache is full; a hit keeps a graph in."""
    graphs = jaxspec.GraphCache(max_graphs=2)
    ids = target.tokenizer.encode("def f(x):")
    call = lambda n: jaxspec.generate([ids + [10] * n], target, max_new_tokens=4, graphs=graphs)  # noqa: E731
    call(1), call(20), call(1)  # prompt buckets 16, 32, then 16 again (a hit)
    assert (graphs.misses, graphs.hits, graphs.evictions, len(graphs)) == (2, 1, 0, 2)
    assert call(40).metrics.graphs_compiled == 1  # bucket 64 evicts bucket 32, the least recently used
    assert graphs.evictions == 1 and call(1).metrics.graph_cache_hits == 1
    assert call(20).metrics.graphs_compiled == 1
    with pytest.raises(jaxspec.InputError, match="max_graphs must be an integer >= 1; got 0"):
        jaxspec.GraphCache(0)


def test_stops_on_eos_and_max_new_tokens_exactly(target):
    prompts = ["def add(a, b):", "import os\nimport sys\n\n\nclass Config:"]
    free = jaxspec.generate(prompts, target, max_new_tokens=24)
    assert [len(o.token_ids) for o in free] == [24, 24]
    assert all(o.finish_reason == "length" for o in free)
    # Declare the 5th token of row 0 an EOS: row 0 must stop right there, row 1 must not change
    # unless the same token shows up in it (then it stops at its first occurrence).
    stop = free[0].token_ids[4]
    config = dataclasses.replace(target.config, eos_token_ids=(stop,))
    stopping = dataclasses.replace(target, config=config)
    outs = jaxspec.generate(prompts, stopping, max_new_tokens=24)
    first = free[0].token_ids.index(stop)
    assert outs[0].token_ids == free[0].token_ids[: first + 1] and outs[0].finish_reason == "stop"
    expected1 = free[1].token_ids
    if stop in expected1:
        expected1 = expected1[: expected1.index(stop) + 1]
    assert outs[1].token_ids == expected1
    assert outs[1].finish_reason == ("stop" if len(expected1) < 24 or expected1[-1] == stop else "length")


def test_seeded_sampling_does_not_depend_on_batch_mates(target):
    prompt = "def parse_args(argv):"
    kw = dict(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95)
    alone = jaxspec.generate([prompt], target, seed=[7], **kw)[0].token_ids
    mates = ["import re", "class Stack:\n    def __init__(self):\n        self.items = []\n", prompt]
    together = jaxspec.generate(mates, target, seed=[1, 2, 7], **kw)
    assert together[2].token_ids == alone
    again = jaxspec.generate([prompt, prompt], target, seed=[7, 8], **kw)
    assert again[0].token_ids == alone
    assert again[1].token_ids != alone  # another seed draws another stream


def test_sampling_varies_with_seed_and_greedy_ignores_it(target):
    prompt = ["def main():"]
    kw = dict(max_new_tokens=16, temperature=1.0)
    draws = {tuple(jaxspec.generate(prompt, target, seed=s, **kw)[0].token_ids) for s in range(4)}
    assert len(draws) > 1
    greedy = {tuple(jaxspec.generate(prompt, target, seed=s, max_new_tokens=16)[0].token_ids) for s in range(2)}
    assert len(greedy) == 1


def test_completion_text_decodes_token_ids(target):
    out = jaxspec.generate(["def square(x):"], target, max_new_tokens=16)[0]
    assert out.text == target.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.stats.new_tokens == 16 and out.stats.tokens_per_step == 1.0
    assert out.stats.acceptance_rate is None
