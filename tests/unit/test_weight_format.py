"""The default weight type of a conversion: bf16 where the CPU has AVX-512 BF16, else f16, and
the type a caller names stays; convert and the HF-dir conversion of serve say which."""

import pytest

from ultrafast import weight_format
from ultrafast.weight_format import cpu_flags, fast_outtype, resolve_outtype

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
bogomips\t: 4792.80

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_flags_come_from_the_first_cpu(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_flags(path) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == set()  # no /proc: the portable choice


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "bf16"),
        ({"avx2", "avx512f", "avx512_vnni"}, "f16"),  # AVX-512 without BF16
        ({"asimd", "bf16"}, "f16"),  # arm's bf16 flag is not the rule's
        (set(), "f16"),
    ],
)
def test_rule(flags, expected):
    outtype, why = fast_outtype(flags)
    assert outtype == expected and why.startswith("auto:")


def test_a_named_type_stays_and_a_bad_one_is_refused():
    for name in ("f32", "f16", "bf16", "q8_0"):
        assert resolve_outtype(name, flags={"avx512_bf16"}) == (name, "as requested")
    assert resolve_outtype("auto", flags={"avx512_bf16"})[0] == "bf16"
    assert resolve_outtype("auto", flags={"avx2"})[0] == "f16"
    with pytest.raises(ValueError, match="q4_0"):
        resolve_outtype("q4_0")


def test_convert_says_which_type_it_used(monkeypatch, tmp_path, capsys):
    import ultrafast.convert
    from ultrafast.cli import main

    seen = {}

    def fake_convert(model_dir, out, outtype):
        seen["outtype"] = outtype
        return out

    monkeypatch.setattr(ultrafast.convert, "convert_hf_to_gguf", fake_convert)
    monkeypatch.setattr(weight_format, "cpu_flags", lambda: {"avx512_bf16"})
    assert main(["convert", str(tmp_path), str(tmp_path / "m.gguf")]) == 0
    assert seen["outtype"] == "bf16"
    assert "weight type: bf16 (auto: this CPU has AVX-512 BF16)" in capsys.readouterr().out
    monkeypatch.setattr(weight_format, "cpu_flags", lambda: {"avx2"})
    assert main(["convert", str(tmp_path), str(tmp_path / "m.gguf"), "--outtype", "q8_0"]) == 0
    assert (
        seen["outtype"] == "q8_0" and "weight type: q8_0 (as requested)" in capsys.readouterr().out
    )


def test_serving_an_hf_dir_converts_to_the_rules_type(monkeypatch, tmp_path, caplog):
    import logging

    import ultrafast.convert
    from ultrafast import model_files
    from ultrafast.model_files import ModelFiles, gguf_for

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_files, "_logged", set())

    def fake_convert(model_dir, out, outtype):
        out.write_text(outtype)
        return out

    monkeypatch.setattr(ultrafast.convert, "convert_hf_to_gguf", fake_convert)
    files = ModelFiles("m", hf, None, hf, None)
    for flags, expected in (({"avx512_bf16"}, "bf16"), ({"avx2"}, "f16")):
        monkeypatch.setattr(weight_format, "cpu_flags", lambda flags=flags: flags)
        with caplog.at_level(logging.INFO, logger="ultrafast.model_files"):
            path = gguf_for(files, "auto")
        assert path.name.endswith(f"-{expected}.gguf") and path.read_text() == expected
        assert f"runs as a {expected} GGUF (auto:" in caplog.text
    assert gguf_for(files, "q8_0").read_text() == "q8_0"


def test_engine_and_serve_default_to_auto():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import engine_options
    from ultrafast.config import EngineConfig

    assert EngineConfig.gguf_type == "auto"
    assert engine_options(parse_args(["serve", "--gguf-type", "q8_0"]))["gguf_type"] == "q8_0"
    assert engine_options(parse_args(["serve"]))["gguf_type"] == "auto"
