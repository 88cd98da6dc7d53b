"""Settings as values: the decode method and a batch job's settings check themselves, each bad
value named with what is allowed, before any model is loaded or any work done."""

import pytest

from jaxspec import cli
from jaxspec.batch import JobSettings
from jaxspec.decoding.method import DEFAULT_NUM_DRAFT, DecodeMethod
from jaxspec.errors import InputError
from jaxspec.ngram import Ngram


@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=0), r"batch_size must be an integer >= 1; got 0"),
    (dict(batch_size=True), r"batch_size must be an integer >= 1; got True"),
    (dict(refill_at=0), r"refill_at must be an integer >= 1; got 0"),
    (dict(workers=0), r"workers must be an integer >= 1; got 0"),
    (dict(gpus_per_worker=-1), r"gpus_per_worker must be a number >= 0; got -1"),
    (dict(scheduler="dynamic"), r"scheduler must be one of static, continuous; got 'dynamic'"),
    (dict(num_draft_tokens=33), r"num_draft_tokens must be an integer in \[1, 32\]; got 33"),
    (dict(auto_ks=(2, 0)), r"auto_ks entry must be an integer in \[1, 32\]; got 0"),
    (dict(auto_ngram_ks="4"), r"auto_ngram_ks must be a list of integers"),
    (dict(auto_trees=("bushy",)), r"tree 'bushy' is unknown; named trees: chain-3"),
    (dict(auto_sample=1.5), r"auto_sample as a fraction must be in \(0, 1\]; got 1.5"),
    (dict(auto_sample="all"), r"auto_sample must be a fraction in \(0, 1\] or a count >= 1"),
    (dict(auto_repeats=0), r"auto_repeats must be an integer >= 1; got 0"),
    (dict(auto_min_speedup=0), r"auto_min_speedup must be a number > 0; got 0"),
    (dict(warn_below_acceptance=1.5), r"warn_below_acceptance must be in \[0, 1\]; got 1.5"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1; got 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\] \(1 = off\); got 0"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*32\); got -1"),
    (dict(progress="yes"), r"progress must be True or False; got 'yes'"),
    (dict(plot_path=3), r"plot_path must be a path, True \(the default path\) or None"),
])
def test_job_settings_refuse_bad_values(kw, match):
    with pytest.raises(InputError, match=match):
        JobSettings(**kw)


def test_batch_cli_refuses_bad_settings_before_loading_models(tmp_path, capsys, monkeypatch):
    """--gpus-per-worker -1 once reached Ray and ended in its raw ValueError."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "x"}\n')
    monkeypatch.setattr(cli, "load", lambda *a, **kw: pytest.fail("loaded a model before checking the settings"))
    code = cli.main(["batch", str(src), str(tmp_path / "out.jsonl"), "--workers", "2", "--gpus-per-worker", "-1"])
    assert code == 2 and "gpus_per_worker must be a number >= 0; got -1.0" in capsys.readouterr().err


def test_decode_methods_name_and_check_themselves():
    assert DecodeMethod().name == "plain" and DecodeMethod("plain", 5).k == 0
    assert DecodeMethod("draft", 3).name == "speculative K=3"
    assert DecodeMethod("draft", tree="binary-3").k == 3 and DecodeMethod("draft", tree="binary-3").name == "tree binary-3"
    assert DecodeMethod("draft", tree=[-1, 0, 0]).tree == (-1, 0, 0)  # a list becomes a hashable, checked tuple
    assert DecodeMethod("ngram", 4, settings=Ngram(branches=3)).name == "ngram K=4 x3"
    assert DecodeMethod("ngram", 4).settings == Ngram()
    assert len({DecodeMethod("draft", 3), DecodeMethod("draft", 3), DecodeMethod("ngram", 3)}) == 2
    for kw, match in [
        (dict(kind="medusa"), "decode method kind must be one of plain, draft, ngram, eagle, suffix; got 'medusa'"),
        (dict(kind="draft", k=0), r"num_draft_tokens must be an integer in \[1, 32\]; got 0"),
        (dict(kind="plain", tree="sparse"), "tree needs a draft model"),
        (dict(kind="ngram", k=2, tree="sparse"), "tree is for a draft model or an EAGLE-3 head; ngram builds its own"),
        (dict(kind="draft", k=2, tree=(0, 1)), r"tree\[0\] must be -1"),
    ]:
        with pytest.raises(InputError, match=match):
            DecodeMethod(**kw)
    with pytest.raises(InputError, match='draft must be a model from jaxspec.load, "ngram", "suffix" or None; got 3'):
        DecodeMethod.of(3)


def test_one_default_k_everywhere():
    parser = cli.build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    cli_ks = [a.default for name in ("generate", "batch") for a in subparsers[name]._actions if a.dest == "num_draft_tokens"]
    assert cli_ks == [DEFAULT_NUM_DRAFT] * 2  # declared once each, from one place
    assert DecodeMethod("draft").k == JobSettings().num_draft_tokens == DEFAULT_NUM_DRAFT == 3
