"""Hugging Face interop: start from HF safetensors (sharded over ranks), export back, load in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FAST, run_cli

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from fsdpkit.train import checkpoint  # noqa: E402
from fsdpkit.train.export import load_full_model  # noqa: E402

pytestmark = pytest.mark.slow

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1e6, sliding_window=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(rope_theta=1e6, num_local_experts=4,
                                                             num_experts_per_tok=2)),
}
NPROC = {"llama": "2", "mistral": "1", "mixtral": "1"}  # llama: the import is sharded over 2 ranks


def make_hf_checkpoint(family: str, path) -> None:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    getattr(transformers, model_cls)(config).save_pretrained(path)


def hf_tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def train_from(hf_dir, tmp_path, name: str, nproc: str, *flags: str) -> checkpoint.CheckpointInfo:
    ckpt = tmp_path / f"{name}-ckpt"
    r = run_cli("train", *FAST, "--init_from_hf", str(hf_dir), "--train_batch_size", "4", "--nproc", nproc,
                "--tensorboard", "0", "--run_dir", str(tmp_path / f"{name}-run"), "--checkpoint_dir", str(ckpt),
                "--checkpoint_freq", "100", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "initialised from Hugging Face weights" in r.stdout
    return checkpoint.resolve(str(ckpt))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_round_trip_and_transformers_parity(family, tmp_path, cli):
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint(family, hf_dir)
    nproc = NPROC[family]

    # Import, one step at lr 0 (weights unchanged), export: the same tensors, bit for bit.
    info = train_from(hf_dir, tmp_path, "same", nproc, "--max_steps", "1", "--lr", "0", "--weight_decay", "0")
    r = cli("export", str(info.path), str(tmp_path / "out-same"), "--to", "hf", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["data"]["step"] == 1
    original, exported = hf_tensors(hf_dir), hf_tensors(tmp_path / "out-same")
    for f in (tmp_path / "out-same").iterdir():   # shared like any file the user writes, not owner-only
        assert f.stat().st_mode & 0o044 == 0o044, (f.name, oct(f.stat().st_mode))
    assert set(exported) == set(original)
    for key, value in original.items():
        assert torch.equal(exported[key], value), key

    # Import, train, export: transformers loads the result and computes our logits.
    info = train_from(hf_dir, tmp_path, "trained", nproc, "--max_steps", "3", "--lr", "0.01")
    out = tmp_path / "out-trained"
    assert cli("export", str(tmp_path / "trained-ckpt"), str(out)).returncode == 0
    ours = load_full_model(info).eval()
    theirs = getattr(transformers, FAMILIES[family][1]).from_pretrained(out, attn_implementation="eager").eval()
    assert not torch.equal(ours.model.layers[0].self_attn.q_proj.weight, original[
        "model.layers.0.self_attn.q_proj.weight"])  # it did train
    tokens = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_export_refuses_non_empty_target_and_missing_checkpoint(tmp_path, cli):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    r = cli("export", str(tmp_path), str(tmp_path / "taken"))
    assert r.returncode == 2 and r.stderr.startswith("error: export: no complete checkpoint")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_init_from_hf_shape_mismatch_is_clear(tmp_path, cli):
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint("mistral", hf_dir)
    r = cli("train", *FAST, "--init_from_hf", str(hf_dir), "--n_layers", "3", "--max_steps", "1",
            "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "init_from_hf" in r.stderr
    assert not (tmp_path / "run").exists()
