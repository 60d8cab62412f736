"""cpu_info: the CPU model and its matrix features, read from /proc/cpuinfo's text."""

from ultrafast.cpu_info import cpu_model, describe_cpu, matrix_features

XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx2
"""


def test_model_and_matrix_features_per_cpu(tmp_path):
    xeon, epyc = tmp_path / "xeon", tmp_path / "epyc"
    xeon.write_text(XEON)
    epyc.write_text(EPYC)
    assert cpu_model(xeon) == "Intel(R) Xeon(R) Platinum 8481C"
    row = describe_cpu(xeon)
    assert row["cpu_amx"] and row["cpu_avx512_bf16"] and row["cpu_vnni"] and row["cores"] >= 1
    assert describe_cpu(epyc)["cpu_model"] == "AMD EPYC 7B13"
    assert matrix_features({"avx2", "avx_vnni"}) == {
        "amx": False,
        "avx512_bf16": False,
        "vnni": True,
        "avx512": False,
        "avx2": True,
    }
