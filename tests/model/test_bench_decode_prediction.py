"""`ultrafast bench decode` on the demo model: the predicted-outputs variant and a GGUF alone."""

from __future__ import annotations

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.convert import convert_hf_to_gguf
from ultrafast_harness.bench.decode import edit_prediction, markdown, run_decode_bench


def test_edit_prediction_replaces_the_seeded_fraction_and_keeps_the_rest():
    tokens = list(range(100))
    edited = edit_prediction(tokens, 0.1, seed=3)
    assert sum(a != b for a, b in zip(tokens, edited, strict=True)) == 10
    assert edited == edit_prediction(tokens, 0.1, seed=3)  # seeded: the same every run
    assert edit_prediction(tokens, 0.0) == tokens
    with pytest.raises(ValueError, match="edit rate"):
        edit_prediction(tokens, 1.5)


def test_prediction_variant_matches_plain_greedy_and_reports_acceptance():
    report = run_decode_bench(
        str(DEMO_MODEL_DIR),
        num_new=24,
        prompt_tokens=16,
        rounds=1,
        threads=1,
        peers=("ultrafast-ggml",),
        speculation=("prediction",),
    )
    result = report["results"]["ultrafast-ggml-spec-prediction"]
    assert result["matches_plain"] is True  # drafts never change greedy tokens
    assert result["acceptance"] is not None and result["acceptance"] > 0
    assert report["prediction"]["edit_rate"] == 0.1
    table = markdown(report)
    assert "| ultrafast-ggml-spec-prediction |" in table
    assert "10% of its tokens replaced" in table and "equals plain greedy" in table


def test_unknown_spec_variant_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown --spec"):
        run_decode_bench(str(DEMO_MODEL_DIR), speculation=("magic",), peers=())


def test_gguf_alone_skips_transformers_with_a_note(tmp_path):
    gguf = convert_hf_to_gguf(DEMO_MODEL_DIR, tmp_path / "demo-f32.gguf", outtype="f32")
    report = run_decode_bench(
        str(gguf),
        num_new=8,
        prompt_tokens=8,
        rounds=1,
        threads=1,
        peers=("ultrafast-ggml", "ultrafast-torch", "transformers"),
    )
    assert set(report["results"]) == {"ultrafast-ggml", "ultrafast-torch"}
    assert any("transformers skipped" in note for note in report["notes"])
    assert "transformers skipped" in markdown(report)


def test_cli_reads_the_prediction_edit_rate_and_refuses_bad_ones(tmp_path, capsys):
    from ultrafast.cli import main, parse_args

    args = parse_args(["bench", "decode", "--spec", "prediction", "--prediction-edit-rate", "0.25"])
    assert args.suite == "decode" and args.prediction_edit_rate == 0.25
    with pytest.raises(SystemExit) as done:
        parse_args(["bench", "decode", "--prediction-edit-rate", "2"])
    assert done.value.code == 2 and "not a fraction" in capsys.readouterr().err
    out = str(tmp_path / "r.json")
    assert main(["bench", "decode", "--spec", "ngram,magic", "--out", out]) == 2
    assert "unknown --speculation ['magic']" in capsys.readouterr().err
