"""jaxspec.SamplingParams: vLLM's names and defaults, checked fields, and one value carried from
generate, batch records and the CLI down to the device batch."""

import dataclasses
import json

import numpy as np
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.batch import JobSettings, run_job
from jaxspec.defaults import CHECKPOINTS
from jaxspec.sampling_params import GREEDY, ROW_FIELDS, SamplingParams, row_values
from jaxspec.serving.requests import Request

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_defaults_are_vllms():
    """Code written for vLLM's SamplingParams means the same here: SamplingParams() samples."""
    s = SamplingParams()
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.max_tokens) == (1.0, 1.0, 0, 0.0, None, 16)
    assert not s.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's other spelling of "off"


@pytest.mark.parametrize("kw, match", [
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] \(1 = off\); got 1.5"),
    (dict(min_p=2), r"min_p must be in \[0, 1\] \(0 = off\); got 2"),
    (dict(top_k=-2), r"top_k must be an integer >= -1 \(0 or -1 = off\); got -2"),
    (dict(temperature=-1), r"temperature must be a finite number >= 0"),
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1; got 0"),
    (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\)"),
])
def test_bad_values_name_the_field(kw, match):
    with pytest.raises(jaxspec.InputError, match=match):
        SamplingParams(**kw)


def test_updates_name_the_key_as_given():
    assert GREEDY.updated({"max_new_tokens": 5}).max_tokens == 5
    with pytest.raises(jaxspec.InputError, match=r"record: max_new_tokens must be an integer >= 1; got 0"):
        GREEDY.updated({"max_new_tokens": 0}, "record: ")
    with pytest.raises(jaxspec.InputError, match=r"top_q is not a sampling setting; known: .*min_p"):
        GREEDY.updated({"top_q": 0.5})


def test_a_request_without_a_seed_draws_one():
    a, b = Request((1, 2), SamplingParams()), Request((1, 2), SamplingParams())
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert Request((1, 2), SamplingParams(seed=7)).seed == 7


def test_device_rows_come_from_the_fields_declarations():
    rows = row_values([SamplingParams(temperature=0.5, top_k=4, min_p=0.1)], 3)
    assert set(rows) == set(ROW_FIELDS) >= {"temperature", "top_p", "top_k", "min_p"}
    assert rows["min_p"].dtype == np.float32 and rows["top_k"].dtype == np.int32
    np.testing.assert_allclose(rows["min_p"], [0.1, 0, 0])  # padding rows: neutral values
    np.testing.assert_array_equal(rows["temperature"], [0.5, 0, 0])


@pytest.fixture(scope="module")
def model():
    return jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")


def test_generate_takes_sampling_values_and_keywords_alike(model):
    prompts = ["def add(a, b):", "x = "]
    by_value = jaxspec.generate(prompts, model, sampling=SamplingParams(temperature=0.8, min_p=0.05, max_tokens=6,
                                                                        seed=3))
    by_keywords = jaxspec.generate(prompts, model, temperature=0.8, min_p=0.05, max_new_tokens=6, seed=3)
    assert [o.token_ids for o in by_value] == [o.token_ids for o in by_keywords]
    per_prompt = jaxspec.generate(prompts, model, sampling=[SamplingParams(temperature=0, max_tokens=4),
                                                            SamplingParams(temperature=0.8, min_p=0.05, max_tokens=6, seed=3)])
    assert len(per_prompt[0].token_ids) == 4 and per_prompt[1].token_ids == by_value[1].token_ids
    over = jaxspec.generate(prompts, model, sampling=SamplingParams(max_tokens=6, seed=3), temperature=0.8, min_p=0.05)
    assert [o.token_ids for o in over] == [o.token_ids for o in by_value]  # keywords over the value's fields


def test_cli_flags_build_the_values(tmp_path):
    args = cli.build_parser().parse_args(["batch", "in.jsonl", "out.jsonl", "--min-p", "0.1", "--temperature", "0.7",
                                          "--max-new-tokens", "9", "--deterministic", "--warn-below-acceptance", "0.3"])
    s = cli.job_settings(args)
    assert s.sampling == dataclasses.replace(GREEDY, min_p=0.1, temperature=0.7, max_tokens=9)
    assert s.options.deterministic and s.options.warn_below_acceptance == 0.3
    args = cli.build_parser().parse_args(["generate", "x", "--max-tokens", "5", "--top-k", "-1"])
    assert cli.sampling_from_cli(args) == dataclasses.replace(GREEDY, max_tokens=5)


def test_batch_records_carry_any_sampling_field(model, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "a", "prompt": "def f(x):", "max_tokens": 3, "logprobs": 1, "prompt_logprobs": 0},
             {"id": "b", "prompt": "def g(y):", "min_p": 2},
             {"id": "c", "prompt": "def h(z):", "temperature": 0.9, "min_p": 0.1, "seed": 4}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_job(src, out, model, None, JobSettings(max_new_tokens=5, batch_size=2, metrics_log=None, plot_path=None,
                                               progress=False))
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(got["a"]["token_ids"]) == 3 and len(got["a"]["logprobs"]) == 3 and "logprobs" not in got["c"]
    assert got["a"]["prompt_logprobs"][0] is None and all(len(e) == 1 for e in got["a"]["prompt_logprobs"][1:])
    assert "min_p must be in [0, 1] (0 = off); got 2" in got["b"]["error"]
    want = jaxspec.generate(["def h(z):"], model, temperature=0.9, min_p=0.1, seed=4, max_new_tokens=5)
    assert got["c"]["token_ids"] == want[0].token_ids


def test_stop_token_ids_are_checked_against_the_vocabulary(model):
    with pytest.raises(jaxspec.InputError, match=r"stop_token_ids entry must be an integer >= 0; got -1"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(jaxspec.InputError, match=r"stop_token_ids contains token id 8192 outside the vocabulary"):
        jaxspec.generate(["x"], model, stop_token_ids=[8192])
    args = cli.build_parser().parse_args(["generate", "x", "--stop-token-ids", "5,9"])
    assert cli.sampling_from_cli(args).stop_token_ids == (5, 9)


def test_generation_config_eos_ids_stop_rows_too(tmp_path):
    """A chat model's end-of-turn id is often only in generation_config.json: it ends rows too."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(CHECKPOINTS / "hf" / "code-draft-4m", folder)
    free = jaxspec.generate(["def add(a, b):"], jaxspec.load(folder, dtype="float32"), max_new_tokens=12)
    stop = free[0].token_ids[5]
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], stop]}))
    m = jaxspec.load(folder, dtype="float32")
    assert stop in m.config.eos_token_ids and gen["eos_token_id"] in m.config.eos_token_ids
    out = jaxspec.generate(["def add(a, b):"], m, max_new_tokens=12)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[0].token_ids[:6], "stop", None)


def test_n_samples_per_prompt_in_prompt_order(model):
    outs = jaxspec.generate(["def f(x):", "y = "], model, sampling=SamplingParams(n=3, max_tokens=6, seed=4))
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    first = [o.token_ids for o in outs[:3]]
    assert len({tuple(t) for t in first}) == 3  # distinct streams
    again = jaxspec.generate(["def f(x):"], model, sampling=SamplingParams(n=3, max_tokens=6, seed=4))
    assert [o.token_ids for o in again] == first  # seeded: reproducible
    with pytest.raises(jaxspec.InputError, match=r"n must be an integer >= 1; got 0"):
        SamplingParams(n=0)


def test_generate_command_compares_with_plain_decoding(capsys):
    target = str(CHECKPOINTS / "hf" / "code-draft-4m")
    argv = ["generate", "def f(x):", "--target", target, "--draft", "ngram", "--compare-plain", "--max-new-tokens", "6",
            "--stop-token-ids", "5", "--repetition-penalty", "1.2"]
    assert cli.main(argv) == 0
    assert "output identical to plain decoding for 1 of 1 completion(s)" in capsys.readouterr().out
