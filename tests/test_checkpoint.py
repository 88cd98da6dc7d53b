"""HF -> Orbax conversion: round trip, and a clear error for every kind of broken folder."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import load_file, save_file

import jaxspec
from jaxspec.cli import main as cli_main
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.checkpoint import convert_hf_checkpoint, read_hf_weights

HF_DRAFT = CHECKPOINTS / "hf" / "code-draft-4m"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def hf_copy(tmp_path):
    """A writable copy of the embedded draft model in HF format."""
    dst = tmp_path / "hf"
    shutil.copytree(HF_DRAFT, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = dict(load_file(str(path)))
    edit(tensors)
    save_file(tensors, str(path))


def test_convert_round_trip(tmp_path):
    out = convert_hf_checkpoint(HF_DRAFT, tmp_path / "conv")
    assert (out / "jaxspec.json").is_file() and (out / "tokenizer.json").is_file()
    direct = jaxspec.load(HF_DRAFT, dtype="float32")
    converted = jaxspec.load(out, dtype="float32")
    assert jax.tree.structure(direct.weights) == jax.tree.structure(converted.weights)
    for a, b in zip(jax.tree.leaves(direct.weights), jax.tree.leaves(converted.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert converted.tokenizer.encode("def f():") == direct.tokenizer.encode("def f():")


def test_convert_dtype_and_cli(tmp_path):
    assert cli_main(["convert", str(HF_DRAFT), "--out", str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    marker = json.loads((tmp_path / "f32" / "jaxspec.json").read_text())
    assert marker["dtype"] == "float32"
    m = jaxspec.load(tmp_path / "f32", dtype="bfloat16")
    assert m.weights.embed.dtype == jnp.bfloat16


def test_missing_config(hf_copy):
    (hf_copy / "config.json").unlink()
    with pytest.raises(jaxspec.ConfigError, match="no config.json in"):
        jaxspec.load(hf_copy)


def test_unknown_model_type(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jaxspec.ConfigError, match="model_type 'gpt2' is not supported; supported: llama, mistral"):
        jaxspec.load(hf_copy)


def test_unsupported_rope_type(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jaxspec.ConfigError, match="rope_type 'yarn' is not supported"):
        jaxspec.load(hf_copy)


def test_missing_tensor(hf_copy):
    _edit_tensors(hf_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(jaxspec.CheckpointError, match=r"missing tensor\(s\) .*model.layers.1.mlp.up_proj.weight"):
        jaxspec.load(hf_copy)


def test_unexpected_tensor(hf_copy):
    _edit_tensors(hf_copy, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": jnp.zeros(256)}))
    with pytest.raises(jaxspec.CheckpointError, match=r"unexpected tensor\(s\) .*q_proj.bias"):
        jaxspec.load(hf_copy)


def test_misshaped_tensor(hf_copy):
    _edit_tensors(hf_copy, lambda t: t.update({"model.norm.weight": jnp.ones(255, jnp.bfloat16)}))
    with pytest.raises(jaxspec.CheckpointError,
                       match=r"tensor model.norm.weight in model.safetensors has shape \(255,\); the config implies \(256,\)"):
        jaxspec.load(hf_copy)


def test_corrupt_file(hf_copy):
    path = hf_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(jaxspec.CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        jaxspec.load(hf_copy)


def test_pickles_are_refused(hf_copy):
    (hf_copy / "model.safetensors").rename(hf_copy / "pytorch_model.bin")
    with pytest.raises(jaxspec.CheckpointError, match="pickle files are never loaded"):
        jaxspec.load(hf_copy)


def test_sharded_checkpoint(hf_copy, tmp_path):
    """Weights split over two shards with an index load the same as one file."""
    tensors = dict(load_file(str(hf_copy / "model.safetensors")))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(hf_copy / fname))
    (hf_copy / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    config = jaxspec.load_config(hf_copy)
    sharded = read_hf_weights(hf_copy, config)
    single = read_hf_weights(HF_DRAFT, config)
    assert sharded.keys() == single.keys()
    for k in single:
        np.testing.assert_array_equal(sharded[k].astype(np.float32), single[k].astype(np.float32))
    (hf_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(jaxspec.CheckpointError, match="shard model-00002-of-00002.safetensors listed in"):
        jaxspec.load(hf_copy)


def test_missing_folder(tmp_path):
    with pytest.raises(jaxspec.CheckpointError, match="does not exist"):
        jaxspec.load(tmp_path / "nope")


def test_multi_shard_checkpoint_is_read_into_one_copy(tmp_path):
    """A HF checkpoint in 3 shards (with its index) reads into the same weights, and the host
    arrays of the read (numpy's allocations, which tracemalloc traces; safetensors hands each
    tensor over in a JAX buffer, freed once copied) peak at the fields plus one tensor in flight:
    each field is allocated once, stacked over layers, and filled tensor by tensor."""
    import tracemalloc

    from jaxspec.model.config import load_config

    src = CHECKPOINTS / "hf" / "code-target-16m"
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shutil.copytree(src, tmp_path / "sharded", ignore=shutil.ignore_patterns("model.safetensors"))
    weight_map = {}
    for i in range(3):
        part = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in names[i::3]}, str(tmp_path / "sharded" / part))
        weight_map |= {n: part for n in names[i::3]}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = load_config(src)
    model_bytes = sum(np.asarray(t).nbytes for t in tensors.values())
    largest = max(np.asarray(t).nbytes for t in tensors.values())
    del tensors

    tracemalloc.start()
    try:
        fields = read_hf_weights(tmp_path / "sharded", config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= model_bytes + 2 * largest, (peak, model_bytes)
    whole = read_hf_weights(src, config)
    assert fields.keys() == whole.keys()
    for name in fields:
        np.testing.assert_array_equal(fields[name], whole[name])


def _hub_cache(root, repo_id: str, source) -> None:
    """A Hugging Face hub cache holding `source`'s files as repo_id's main revision (the layout
    huggingface_hub writes: blobs are plain files here, which it reads the same)."""
    commit = "0" * 40
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_models_load_by_hub_id_from_the_cache(tmp_path, monkeypatch):
    _hub_cache(tmp_path / "hub", "jaxspec/code-draft-4m", HF_DRAFT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_id = jaxspec.load("jaxspec/code-draft-4m", dtype="float32")
    by_folder = jaxspec.load(HF_DRAFT, dtype="float32")
    assert by_id.name == "jaxspec/code-draft-4m" and by_id.config == by_folder.config
    for a, b in zip(jax.tree.leaves(by_id.weights), jax.tree.leaves(by_folder.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(jaxspec.CheckpointError, match="model 'nobody/nothing' is no folder here and not in the Hugging Face cache .HF_HUB_OFFLINE"):
        jaxspec.load("nobody/nothing")
    assert cli_main(["generate", "def f(x):", "--target", "jaxspec/code-draft-4m", "--max-new-tokens", "4"]) == 0
