"""Tree speculation: topologies, lossless greedy output, and the sampling distribution."""

import numpy as np
import pytest
from test_speculative_distribution import (
    SETTINGS,
    chi2_pvalue,
    exact_joint,
    sampled_joint,
)
from test_speculative_distribution import pair as tiny_pair  # noqa: F401  (fixture)
from tiny_models import TINY, save_tiny

import jaxspec
from jaxspec.decoding.trees import (
    NAMED_TREES,
    ancestor_mask,
    balanced_tree,
    chain,
    depths,
    resolve_tree,
    tree_from_choices,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MAX_NEW = 48


def test_topologies():
    assert chain(3) == (-1, 0, 1, 2)
    assert balanced_tree(2, 2) == (-1, 0, 0, 1, 1, 2, 2)
    assert tree_from_choices([(0,), (1,), (0, 0)]) == (-1, 0, 0, 1)
    np.testing.assert_array_equal(depths((-1, 0, 0, 1)), [0, 1, 1, 2])
    mask = ancestor_mask((-1, 0, 0, 1))
    assert mask[3].tolist() == [True, True, False, True]  # node 3 sees root, its parent 1, itself
    assert mask[2].tolist() == [True, False, True, False]
    assert len(NAMED_TREES["sparse"]) == 13


@pytest.mark.parametrize(
    "tree, match",
    [
        ((0, 0), r"tree\[0\] must be -1"),
        ((-1, 0, 2), r"tree\[2\] = 2: a node's parent must be an earlier node"),
        ("bushy", "tree 'bushy' is unknown; named trees: chain-3"),
        ((-1,), "tree must have 2 to 64 nodes"),
        (chain(64), "tree must have 2 to 64 nodes"),
    ],
)
def test_bad_trees_are_refused(tree, match):
    with pytest.raises(jaxspec.InputError, match=match):
        resolve_tree(tree)


def test_tree_without_a_draft_is_refused(real_pair):
    with pytest.raises(jaxspec.InputError, match="tree needs a draft model"):
        jaxspec.generate(["x"], real_pair[0], tree="sparse")


def test_choice_paths_need_their_parents():
    with pytest.raises(jaxspec.InputError, match=r"tree choice \(1, 0\) lacks its parent path \(1,\)"):
        tree_from_choices([(0,), (1, 0)])


@pytest.fixture(scope="module")
def prompts(humaneval20):
    return humaneval20


@pytest.fixture(scope="module")
def plain(real_pair, prompts):
    return jaxspec.generate(prompts, real_pair[0], max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("tree, batch_size, n", [("binary-3", 8, 20), ("sparse", 1, 6)])
def test_tree_greedy_equals_target_on_humaneval(real_pair, prompts, plain, tree, batch_size, n):
    target, draft = real_pair
    prompts, plain = prompts[:n], plain[:n]
    outs = jaxspec.generate(prompts, target, draft, tree=tree, max_new_tokens=MAX_NEW, max_batch_size=batch_size)
    for i, (a, b) in enumerate(zip(outs, plain)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert a.finish_reason == b.finish_reason
    # Trees commit more per target pass than a chain of their depth.
    chain_out = jaxspec.generate(prompts, target, draft, num_draft_tokens=len(outs[0].stats.accepted_per_position),
                                 max_new_tokens=MAX_NEW, max_batch_size=batch_size)
    assert outs.metrics.tokens_per_step > chain_out.metrics.tokens_per_step


def test_tree_with_draft_equal_to_target_accepts_every_level(real_pair, prompts):
    target, _ = real_pair
    outs = jaxspec.generate(prompts[:3], target, target, tree="binary-3", max_new_tokens=40)
    for out in outs:
        assert out.stats.per_position_acceptance == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("family", ["qwen3", "mistral_swa"])
def test_tree_greedy_for_tiny_pairs(tmp_path, family):
    kind, overrides = TINY[family]
    target = jaxspec.load(save_tiny(tmp_path / "t", kind, overrides, seed=1), dtype="float32")
    draft = jaxspec.load(save_tiny(tmp_path / "d", kind, {**overrides, "num_hidden_layers": 1}, seed=2),
                         dtype="float32")
    prompts = [[5, 9, 33, 7], list(range(3, 40))]
    ref = jaxspec.generate(prompts, target, max_new_tokens=30)
    for d in (draft, target):
        outs = jaxspec.generate(prompts, target, d, tree="sparse", max_new_tokens=30)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize("setting", SETTINGS[:2], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_tree_sampling_matches_target_distribution(tiny_pair, setting):  # noqa: F811
    """Binary tree of depth 2: tokens 2 and 3 come from one tree round (i.i.d. children,
    recursive rejection); their joint must be the target's."""
    target, draft = tiny_pair
    counts = sampled_joint(target, draft, setting, tree=balanced_tree(2, 2))
    assert chi2_pvalue(counts, exact_joint(target, setting)) > 1e-4
