"""`jaxspec bench --shape`: named shapes build the engine's real layout with random weights, and
the benchmark runs end to end (tiny shape, CPU) and writes the rows it prints."""

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers

import jaxspec
from jaxspec.bench.profile import kernel_name, kernel_table, kernel_times
from jaxspec.bench.shapes import SHAPES, random_model, shape_config, step_weight_bytes
from jaxspec.cli import main as cli_main
from jaxspec.errors import InputError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(InputError, match=r"shape 'llama9-1t' is unknown; named shapes: .*llama3-8b"):
        shape_config("llama9-1t")


def test_named_shapes_are_the_real_configs():
    c = shape_config("llama3-8b")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (4096, 32, 32, 8, 128256)
    assert c.rope.rope_type == "llama3" and c.eos_token_ids == ()
    assert shape_config("llama3.2-1b").tie_word_embeddings and shape_config("qwen2.5-7b").qkv_bias


@pytest.mark.parametrize("name", ["tiny"])
def test_random_weights_have_the_layout_of_a_loaded_checkpoint(tmp_path, name):
    import torch

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**SHAPES[name])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded, made = jaxspec.load(tmp_path, dtype="float32"), random_model(name, "float32")
    assert jax.tree.structure(made.weights) == jax.tree.structure(loaded.weights)
    for a, b in zip(jax.tree.leaves(made.weights), jax.tree.leaves(loaded.weights)):
        assert a.shape == b.shape and a.dtype == b.dtype


# Timing: ms per step and per round are decode time less a separately timed prefill (the best of
# at least 5 calls since one slow call pushed a step below zero in CI at repeats 1).
def _tiny_bench(tmp_path, *args) -> dict:
    """`jaxspec bench --shape tiny` at one short row per setting, plus args: its JSON result."""
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--shape", "tiny", "--no-hf", "--prompt-lens", "32", "--new-tokens", "8",
                     "--batch-sizes", "1", "--repeats", "1", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.timing
def test_bench_runs_end_to_end_on_a_tiny_shape(tmp_path, capsys):
    result = _tiny_bench(tmp_path, "--draft-shape", "tiny", "--parts", "plain,forward,spec", "--verify-sizes", "1",
                         "--spec-k", "1")
    rows = {(r["part"], r.get("role"), r.get("size")): r for r in result["rows"]}
    assert set(rows) == {("plain", None, None), ("forward", "target", "t=1"), ("forward", "target", "t=2"),
                         ("forward", "draft", "t=1"), ("forward", "draft", "t=2"), ("draft_step", None, None),
                         ("spec", None, None)}
    plain = rows[("plain", None, None)]
    assert plain["ms_per_step"] > 0 and plain["floor_ms"] > 0 and plain["batch"] == 1
    assert plain["bytes_per_step"] > sum(a.nbytes for a in jax.tree.leaves(random_model("tiny").weights.layers))
    spec = rows[("spec", None, None)]
    assert 1 <= spec["rounds"] <= 7 and spec["ms_per_round"] > 0
    assert np.isclose(spec["draft_ms"] + spec["verify_ms"],
                      rows[("forward", "draft", "t=2")]["ms"] + rows[("forward", "target", "t=2")]["ms"])
    assert result["ceilings"]["copy_bandwidth_jax"] > 0 and result["ceilings"]["bf16_matmul_flops"] > 0
    assert "| spec round | K=1" in capsys.readouterr().out


@pytest.mark.timing
def test_the_eagle_part_times_a_head_at_the_targets_width(tmp_path, capsys):
    result = _tiny_bench(tmp_path, "--parts", "plain,eagle", "--eagle-k", "2", "--eagle-draft-vocab", "128",
                         "--trees", "binary-3", "--eagle-tokens-per-round", "2=2.5,binary-3=3.25")
    rows = {(r["part"], r.get("method")): r for r in result["rows"]}
    assert set(rows) == {("plain", None), ("head_step", None), ("spec", "eagle K=2"), ("projection", "eagle K=2"),
                         ("spec", "eagle tree binary-3"), ("projection", "eagle tree binary-3")}
    step, spec, tree = rows["head_step", None], rows["spec", "eagle K=2"], rows["spec", "eagle tree binary-3"]
    assert step["draft_vocab"] == 128 and step["ms"] > 0 and step["floor_ms"] > 0
    assert 1 <= spec["rounds"] <= 7 and spec["draft_ms"] > step["ms"]
    assert 1 <= tree["rounds"] <= 7 and tree["draft_ms"] > step["ms"] and tree["verify_ms"] > 0
    assert rows["projection", "eagle K=2"]["tokens_per_round"] == 2.5
    assert rows["projection", "eagle tree binary-3"]["tokens_per_round"] == 3.25
    assert "| head step |" in capsys.readouterr().out


def test_scheduler_bench_compares_both_cases_record_by_record(tmp_path):
    """`bench --parts continuous`: static and continuous rows in both lengths cases, each
    continuous row with every record's tokens equal to the static scheduler's (float32: in bf16 the
    default mode promises no equality between batch layouts, docs/deterministic.md)."""
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--shape", "tiny", "--dtype", "float32", "--no-hf", "--parts", "continuous",
                     "--batch-sizes", "4",
                     "--prompt-lens", "16", "--refill-at", "1,3", "--job-records-per-slot", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lengths"], r["scheduler"], r["refill_at"]) for r in rows] == [
        (case, s, r) for case in ("seen", "hidden") for s, r in (("static", None), ("continuous", 1), ("continuous", 3))]
    assert all(r["records"] == 8 and r["records_per_s"] > 0 for r in rows)
    assert all(r["same_as_static"] == 8 and r["vs_static"] > 0 for r in rows if r["scheduler"] == "continuous")
    assert len({r["new_tokens"] for r in rows}) == 1  # every row decoded the same job


def test_scheduler_bench_refuses_an_unknown_lengths_case_up_front(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--shape", "tiny", "--parts", "continuous", "--lengths", "seen,eos"])
    assert "argument --lengths: comma-separated seen and/or hidden; got 'seen,eos'" in capsys.readouterr().err


def test_a_quantized_shape_reads_about_half_the_bytes_per_step():
    """`bench --shape ... --quantize`: the floor it reports counts 8-bit weights and their scales."""
    plain, int8 = (step_weight_bytes(random_model("tiny", "bfloat16", quantize=q)) for q in (None, "int8"))
    assert 0.5 < int8 / plain < 0.6


@pytest.mark.timing
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_humaneval_bench_runs_the_embedded_head_beside_the_draft_model(tmp_path, temperature):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "2", "--k", "2",
                     "--eagle-k", "2", "--trees", "sparse", "--ngram-k", "2", "--no-hf", "--repeats", "1",
                     "--temperature", str(temperature), "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "spec K=2", "tree sparse", "eagle K=2", "eagle tree sparse", "ngram K=2"}
    assert all(r["temperature"] == temperature and 2 <= r["new_tokens"] <= 16 for r in rows.values())
    assert temperature or all(r["new_tokens"] == 16 for r in rows.values())  # greedy: no EOS within 8
    assert rows["eagle K=2"]["tokens_per_step"] >= 1 and rows["eagle tree sparse"]["acceptance_rate"] is not None
    # greedy rows must equal plain decoding; sampled rows are not compared token for token
    assert {r["same_as_plain"] for r in rows.values()} == ({2} if temperature == 0 else {2, None})


def test_kernel_profile_names_group_numbered_copies_and_tabulate():
    assert kernel_name("loop_add_fusion_12") == kernel_name("loop_add_fusion") == "loop_add_fusion"
    assert kernel_name("gemm_fusion_dot.3") == "gemm_fusion_dot" and kernel_name("matmul_float") == "matmul_float"
    table = kernel_table([("gemm", 30.0, 2.0), ("add", 1.5, 3.0)], top=1)
    assert "| gemm | 30.0 | 2.0 |" in table and "add" not in table and "| all (2 names) | 31.5 | 5.0 |" in table
    assert kernel_times(lambda: jax.block_until_ready(jax.numpy.ones(4) * 2), 1, 1) == []  # the CPU has no device plane


def test_matmul_bits_script_finds_no_setting_that_changes_a_bit_in_interpret_mode(capsys):
    path = Path(__file__).parents[1] / "scripts" / "gpu_probes" / "matmul_bits.py"
    spec = importlib.util.spec_from_file_location("matmul_bits", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--shape", "tiny", "--rows", "1", "--projections", "wo", "--interpret"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| wo |")]
    assert len(rows) == 2 * 11 and all("| 0 / " in line for line in rows)


def _script(name: str, monkeypatch, folder: str = "gpu_probes"):
    """scripts/<folder>/<name>.py as a module (folder "": scripts/<name>.py), its folder importable
    as when it runs."""
    scripts = Path(__file__).parents[1] / "scripts" / folder
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_matmul_sweep_script_times_the_one_row_kernel_in_interpret_mode(capsys, tmp_path, monkeypatch):
    module = _script("matmul_sweep", monkeypatch)
    out = tmp_path / "sweep.jsonl"
    module.main(["--shape", "tiny", "--interpret", "--kernel", "matvec", "--rows", "1", "--formats", "fp8",
                 "--projections", "wo", "--block-n", "8", "--block-k", "64", "--split-k", "1", "2", "--layouts", "nk",
                 "--repeats", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["kernel"] for r in records} == {"xla", "matvec"}
    assert sorted(r["split_k"] for r in records if r["kernel"] == "matvec") == [1, 2]
    assert all(r["s"] > 0 for r in records)


def test_the_mosaic_splitk_script_lowers_for_cuda_ahead_of_time(monkeypatch, capsys):
    """The Mosaic GPU measurement script (Hopper only) still lowers with this JAX, without a GPU."""
    module = _script("mosaic_splitk_sweep", monkeypatch)
    assert module.main(["--lower"]) == 0
    assert capsys.readouterr().out.splitlines() == ["int8: lowered for CUDA", "fp8: lowered for CUDA"]


def test_the_greedy_tokens_script_prints_plain_and_speculative_tokens(monkeypatch, capsys):
    module = _script("greedy_tokens", monkeypatch, folder="")
    assert module.main(["--shape", "tiny", "--draft-shape", "tiny", "--quantize", "none", "--new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out) == {"bf16-plain", "bf16-spec"}
    assert [len(row) for row in out["bf16-plain"]] == [6, 6]
    assert "bf16-spec: equals plain" in captured.err  # lossless: the draft changes no token


def test_moe_floors_count_the_experts_read_and_same_routing_reads_one_tokens_experts():
    from jaxspec.bench.experts import active_weight_bytes, unique_experts, with_routing

    model = random_model("tiny-moe", "float32")
    c = model.config
    assert active_weight_bytes(model, c.num_experts) == step_weight_bytes(model)
    assert step_weight_bytes(model) - active_weight_bytes(model, c.experts_per_token) == \
        c.num_layers * (c.num_experts - c.experts_per_token) * 3 * c.hidden_size * c.moe_intermediate_size * 4
    tokens = np.random.default_rng(0).integers(1, c.vocab_size, (4, 4))
    assert unique_experts(model, tokens, 8) > 2 * c.experts_per_token  # random routers spread 16 tokens
    assert unique_experts(with_routing(model, "same"), tokens, 8) == c.experts_per_token


def test_a_random_head_for_a_qwen3_moe_target_is_a_llama_layer_that_drafts():
    """The published EAGLE-3 heads are Llama layers whatever the target (eagle_config): no q/k
    norms and no experts, at the target's width."""
    from jaxspec.bench.shapes import random_head

    target = random_model("tiny-moe", "float32")
    head = random_head(target.config, 128, dtype="float32")
    assert head.config.layer.model_type == "llama" and not head.config.layer.qk_norm
    assert not head.config.layer.is_moe and head.config.target_hidden_size == target.config.hidden_size
    outs = jaxspec.generate([[5, 17, 33, 9]], target, head, num_draft_tokens=2, max_new_tokens=6)
    assert outs[0].token_ids == jaxspec.generate([[5, 17, 33, 9]], target, max_new_tokens=6)[0].token_ids


def test_an_moe_targets_forward_rows_count_the_experts_its_distinct_tokens_read(tmp_path, capsys):
    """A verify pass's t tokens are distinct (t copies of one token would read one token's experts),
    and the row reports the experts they read with the floor of those bytes."""
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--shape", "tiny-moe", "--dtype", "float32", "--no-hf", "--parts", "forward",
                     "--prompt-lens", "16", "--verify-sizes", "1,4", "--repeats", "1", "--json", str(out)]) == 0
    rows = {r["size"]: r for r in json.loads(out.read_text())["rows"] if r["part"] == "forward"}
    c = shape_config("tiny-moe")
    assert rows["t=1"]["experts_per_layer"] == c.experts_per_token
    assert c.experts_per_token < rows["t=4"]["experts_per_layer"] <= c.num_experts
    assert 0 < rows["t=1"]["floor_ms"] < rows["t=4"]["floor_ms"] and rows["t=4"]["of_floor"] > 0
    assert f"{rows['t=4']['experts_per_layer']:.1f} experts/layer |" in capsys.readouterr().out


def test_the_full_depth_script_scales_the_targets_layers_and_keeps_the_drafts_time(monkeypatch):
    module = _script("moe_full_depth", monkeypatch)
    run = json.loads((Path(__file__).parents[1] / "docs/bench/h200-moe-projection-random-2026-12-06.json").read_text())
    rows = {r["method"]: r for r in module.full_depth_rows(run)}
    assert set(rows) == {"K=3", "eagle K=3"}
    spec = next(r for r in run["rows"] if r.get("method") == "K=3" and r["part"] == "spec")
    plain = next(r["ms_per_step"] for r in run["rows"] if r["part"] == "plain")
    k3 = rows["K=3"]
    assert k3["layers"] == 48 and k3["draft_ms"] == spec["draft_ms"] and 4 * plain < k3["plain_ms"] < 6 * plain
    assert np.isclose(k3["projected_full_depth"], k3["tokens_per_round"] * k3["plain_ms"] / (k3["draft_ms"] + k3["verify_ms"]))
    # the whole 28-layer draft against 8 of the target's 48 layers understated it
    assert k3["projected_full_depth"] > k3["projected_8_layers"]


def test_a_forward_loop_compiles_once_however_often_it_runs():
    """The cache goes in as the loop hands it back (committed to its device): before, the second
    call compiled again (at --repeats 1, in the timed call)."""
    from jaxspec.bench.scale import _forward_loop, forward_loop

    run = forward_loop(random_model("tiny", "float32"), 1, 40, np.tril(np.ones((3, 3), bool)), "xla", 2)
    before = _forward_loop._cache_size()
    for _ in range(3):
        run()
    assert _forward_loop._cache_size() == before + 1


def test_the_moe_costs_script_prints_every_row_kind_on_a_tiny_shape(monkeypatch, capsys):
    """The device probe of docs/moe.md, run as a check on the CPU (kernels in interpret mode): a
    row of each kind, the kernel's output equal to the float32 reference, both routers timed."""
    module = _script("moe_costs", monkeypatch)
    monkeypatch.setattr("sys.argv", ["moe_costs", "--shape", "tiny-moe", "--dtype", "float32", "--batches", "1",
                                     "--ks", "1", "--tokens", "2", "--repeats", "1", "--op-steps", "1"])
    assert module.main() == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in rows] == ["machine", "layer", "step", "verify", "verify", "expert_op"]
    op = rows[-1]
    assert op["kernel_auto_4_3_rel_err"] < 1e-5 and op["router_us"] > 0 and op["router_kernel_us"] > 0
    assert op["router_kernel_1_program_us"] > 0 and op["router_kernel_128_programs_us"] > 0 and not any(
        name.endswith("_error") for name in op)
    assert rows[2]["unique_experts_per_layer"] == 4 and rows[4]["unique_experts_per_layer"] > 4


def test_the_moe_profile_script_sums_a_pass_s_kernels_and_counts_its_experts(monkeypatch, capsys):
    """The device probe behind docs/moe.md's kernel-by-kernel table, run on the CPU (the host's XLA
    threads stand in for the device's streams): kernel rows with their JAX operations, and a
    pass row per token count with its experts (one token: its k)."""
    module = _script("moe_profile", monkeypatch)
    monkeypatch.setattr("sys.argv", ["moe_profile", "--shape", "tiny-moe", "--dtype", "float32", "--tokens", "1,3",
                                     "--steps", "2", "--prompt-len", "8"])
    assert module.main() == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    passes = [r for r in rows if r["kind"] == "pass"]
    kernels = [r for r in rows if r["kind"] == "kernel"]
    assert [p["tokens"] for p in passes] == [1, 3] and all(p["busy_us"] > 0 and p["launches_per_pass"] > 0
                                                            for p in passes)
    assert passes[0]["experts_per_layer"] == 4 and passes[1]["experts_per_layer"] > 4
    assert kernels and all(k["us_per_pass"] >= 0 for k in kernels) and any(k["op"] for k in kernels)
