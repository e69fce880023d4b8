"""Hugging Face interop: start from HF safetensors (sharded over ranks), export back, load in transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from conftest import FAST, require, run_cli

transformers = require("transformers")
from safetensors.torch import load_file  # noqa: E402

from fsdpkit.train import trainer  # noqa: E402
from fsdpkit.train.checkpoint import catalog  # noqa: E402
from fsdpkit.train.config import parse_args  # noqa: E402
from fsdpkit.train.export import load_full_model  # noqa: E402
from fsdpkit.train.model.config import count_params, params_text  # noqa: E402
from fsdpkit.train.runtime.dist import Runtime  # noqa: E402

pytestmark = pytest.mark.slow

# A padding token as transformers' configs name one (its embedding row takes no gradient): not 0, and
# neither of the byte tokenizer's bos/eos (256, 257).
PAD = 5
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1e6, sliding_window=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(rope_theta=1e6, num_local_experts=4,
                                                             num_experts_per_tok=2)),
    # Qwen 2.5: biased q/k/v, tied head. Qwen 3: per-head q/k norms, heads wider than hidden / heads.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e6, head_dim=16, rms_norm_eps=1e-6)),
    # Qwen3-MoE: Qwen 3's attention, every layer sparse, top-k weights renormalised (as published).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1e6, head_dim=16, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True)),
}
# llama, qwen2, mixtral (FSDP's shards of every expert) and qwen3_moe (expert parallel: 2 of its 4
# experts whole a rank): the import is sharded over 2 ranks
NPROC = {"llama": "2", "mistral": "1", "mixtral": "2", "qwen2": "2", "qwen3": "1", "qwen3_moe": "2"}
LAYOUT = {"qwen3_moe": ("--expert-parallel", "2")}
# Trained weights are exported by the same code for every family (the round trip above it holds
# each family's names and config.json): a dense family and a mixture of experts show it.
TRAINED = {"llama", "qwen3_moe"}


def make_hf_checkpoint(family: str, path) -> None:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    getattr(transformers, model_cls)(config).save_pretrained(path)


def hf_tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def train_from(hf_dir, tmp_path, name: str, nproc: str, *flags: str) -> catalog.CheckpointInfo:
    ckpt = tmp_path / f"{name}-ckpt"
    r = run_cli("train", *FAST, "--init_from_hf", str(hf_dir), "--train_batch_size", "4", "--nproc", nproc,
                "--tensorboard", "0", "--run_dir", str(tmp_path / f"{name}-run"), "--checkpoint_dir", str(ckpt),
                "--checkpoint_freq", "100", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "initialised from Hugging Face weights" in r.stdout
    if flags[flags.index("--max_steps") + 1] == "1":   # its one loss said as one, not "X -> X"
        assert "fsdpkit: done after 1 steps; loss " in r.stdout and " (one logging window: --logging-freq below 10 " \
            "logs more); metrics in " in r.stdout, r.stdout
    return catalog.resolve(str(ckpt))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_padding_row_takes_no_gradient_and_the_gradient_norm_is_transformers(family, tmp_path):
    """The model as the trainer builds it from a config naming pad_token_id, and transformers' from
    the same files, on one batch holding the padding token: the padding row's gradient is zero
    (under a tied head, the head's share of it alone: llama here) as transformers' and the gradient
    norms agree (taken whole, the row dominated it)."""
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint(family, hf_dir)
    cfg = parse_args(["--init-from-hf", str(hf_dir), "--seq-len", "40", "--tokenizer", "bytes"])
    ours = trainer._starting_model(cfg, Runtime(0, 1, 0, 1, torch.device("cpu")), None)
    theirs = getattr(transformers, FAMILIES[family][1]).from_pretrained(hf_dir, attn_implementation="eager")
    tokens = torch.randint(0, 258, (2, 41), generator=torch.Generator().manual_seed(3))
    tokens[1, 25:] = PAD   # a padded tail, and padding among the inputs of the other row
    tokens[0, ::7] = PAD
    x, y = tokens[:, :-1], tokens[:, 1:]
    ours.loss(x, y)[0].backward()
    logits = theirs(x).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    rows = [m.model.embed_tokens.weight.grad[PAD] for m in (ours, theirs)]
    torch.testing.assert_close(rows[0], rows[1], rtol=0, atol=1e-6)
    if family == "qwen3_moe":   # untied: the embedding alone, whose padding row takes nothing
        assert torch.equal(rows[0], torch.zeros_like(rows[0]))
    else:
        assert rows[0].abs().sum() > 0
    norms = [torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]))
             for m in (ours, theirs)]
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_round_trip_and_transformers_parity(family, tmp_path, cli):
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint(family, hf_dir)
    nproc = NPROC[family]

    # Import, one step at lr 0 (weights unchanged), export: the same tensors, bit for bit.
    info = train_from(hf_dir, tmp_path, "same", nproc, "--max_steps", "1", "--lr", "0", "--weight_decay", "0",
                      *LAYOUT.get(family, ()))
    r = cli("export", str(info.path), str(tmp_path / "out-same"), "--to", "hf", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["data"]["step"] == 1
    # Minutes on a large model: each stage said as it starts, on stderr beside the envelope.
    params = params_text(count_params(load_full_model(info).cfg))
    assert r.stderr.splitlines()[-2:] == [f"export: reading step 1 of {info.path} ({params} parameters) into CPU "
                                          f"memory", f"export: writing {tmp_path / 'out-same'} (fp32)"], r.stderr
    original, exported = hf_tensors(hf_dir), hf_tensors(tmp_path / "out-same")
    tokens = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    model_cls = getattr(transformers, FAMILIES[family][1])
    with torch.no_grad():  # Hugging Face -> fsdpkit: the imported model computes transformers' logits
        torch.testing.assert_close(load_full_model(info).eval()(tokens),
                                   model_cls.from_pretrained(hf_dir, attn_implementation="eager").eval()(tokens).logits,
                                   rtol=0, atol=1e-5)
    for f in (tmp_path / "out-same").iterdir():   # shared like any file the user writes, not owner-only
        assert f.stat().st_mode & 0o044 == 0o044, (f.name, oct(f.stat().st_mode))
    assert set(exported) == set(original)
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    # config.json as imported, field for field (pad_token_id, Qwen3-MoE's dense intermediate_size,
    # transformers' own spellings), but for what the run changed: its tokenizer's ids.
    source = json.loads((hf_dir / "config.json").read_text())
    ids = {k: v for k, v in json.loads(r.stdout)["data"].items() if k in ("bos_token_id", "eos_token_id")}
    assert ids == {"bos_token_id": 256, "eos_token_id": 257}
    assert json.loads((tmp_path / "out-same" / "config.json").read_text()) == {**source, **ids}
    # The export's config.json is the family's: transformers builds the same model from it.
    with torch.no_grad():
        torch.testing.assert_close(model_cls.from_pretrained(tmp_path / "out-same", attn_implementation="eager")
                                   .eval()(tokens).logits, load_full_model(info).eval()(tokens), rtol=0, atol=1e-5)
    if family not in TRAINED:
        return

    # Import, train, export: transformers loads the result and computes our logits.
    info = train_from(hf_dir, tmp_path, "trained", nproc, "--max_steps", "3", "--lr", "0.01", *LAYOUT.get(family, ()))
    out = tmp_path / "out-trained"
    assert cli("export", str(tmp_path / "trained-ckpt"), str(out)).returncode == 0
    assert json.loads((out / "config.json").read_text()) == {**source, **ids}
    ours = load_full_model(info).eval()
    theirs = model_cls.from_pretrained(out, attn_implementation="eager").eval()
    assert not torch.equal(ours.model.layers[0].self_attn.q_proj.weight, original[
        "model.layers.0.self_attn.q_proj.weight"])  # it did train
    with torch.no_grad():  # fsdpkit -> Hugging Face
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_export_refuses_non_empty_target_and_missing_checkpoint(tmp_path, cli):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    # The target is checked first: before minutes of loading a large model.
    r = cli("export", str(tmp_path), str(tmp_path / "taken"))
    assert r.returncode == 2 and r.stderr == f"error: export: {tmp_path / 'taken'} exists and is not empty; " \
                                             "choose a new directory\n"
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    r = cli("export", str(tmp_path), str(tmp_path / "new"))
    assert r.returncode == 2 and r.stderr.startswith("error: export: no complete checkpoint")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_init_from_hf_shape_mismatch_is_clear(tmp_path, cli, nproc):
    """Found while loading weights, so under --nproc 2 in both torchrun workers: it still reaches
    the user once, as one line with exit code 2; torchrun's ChildFailedError report goes to
    RUN_DIR/launcher.log, not the terminal."""
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint("mistral", hf_dir)
    r = cli("train", *FAST, "--init_from_hf", str(hf_dir), "--n_layers", "3", "--max_steps", "1",
            "--nproc", nproc, "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "init_from_hf" in r.stderr
    if nproc == "1":
        assert not (tmp_path / "run").exists()
    else:
        assert "ChildFailedError" not in r.stderr and "exitcode  : 2" in (tmp_path / "run" / "launcher.log").read_text()


REFUSED = {
    "attention_bias": ({"attention_bias": True}, "uses attention_bias"),
    "mlp_bias": ({"mlp_bias": True}, "uses mlp_bias"),
    "rope_yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
    "rope_dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is not supported"),
    "architecture": ({"architectures": ["LlamaForSequenceClassification"]},
                     "architecture LlamaForSequenceClassification is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    # A value of the wrong kind, or none, is named before any tensor is made from it.
    "dim_text": ({"hidden_size": "sixty-four"}, "config.json's hidden_size is 'sixty-four'; expected an integer >= 1"),
    "heads_zero": ({"num_attention_heads": 0}, "config.json's num_attention_heads is 0; expected an integer >= 1"),
    "layers_float": ({"num_hidden_layers": 2.5}, "config.json's num_hidden_layers is 2.5; expected an integer >= 1"),
    "vocab_missing": ({"vocab_size": None}, "config.json has no vocab_size"),
    "pad_past_vocab": ({"pad_token_id": 300}, "config.json's pad_token_id is 300; expected a token id below its "
                                              "vocab_size (300)"),
    "eps_bool": ({"rms_norm_eps": True}, "config.json's rms_norm_eps is True; expected a number >= 0"),
    "rope_factor_text": ({"rope_scaling": {"rope_type": "linear", "factor": "4x"}},
                         "config.json's rope_scaling's factor is '4x'; expected a number >= 1"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_init_from_hf_refuses_what_the_model_cannot_represent(case, tmp_path, cli):
    """Loading such a checkpoint would drop part of it (biases) or change its function (RoPE,
    activation) and still train: one line and exit 2 instead, before anything is written."""
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint("llama", hf_dir)
    change, message = REFUSED[case]
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    r = cli("train", *FAST, "--init_from_hf", str(hf_dir), "--max_steps", "1", "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr
    assert not (tmp_path / "run").exists()


def test_init_from_hf_refuses_weights_its_config_has_no_place_for(tmp_path, cli):
    """Qwen 2 weights (biased q/k/v) with a Llama config.json: the six bias tensors would be dropped
    and the run would train on; one line naming them instead, nothing written."""
    hf_dir = tmp_path / "hf"
    make_hf_checkpoint("qwen2", hf_dir)
    make_hf_checkpoint("llama", tmp_path / "llama")
    llama = json.loads((tmp_path / "llama" / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**llama, "rope_scaling": None, "rope_theta": 1e6}))
    r = cli("train", *FAST, "--init_from_hf", str(hf_dir), "--max_steps", "1", "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        f"error: init_from_hf: {hf_dir} holds 6 tensor(s) the model has no place for "
        "(model.layers.0.self_attn.k_proj.bias, model.layers.0.self_attn.q_proj.bias, "
        "model.layers.0.self_attn.v_proj.bias and 3 more); its config.json describes another model than its "
        "weights: use the config.json they were saved with"]
    assert not (tmp_path / "run").exists()


def test_linear_rope_scaling_matches_transformers(tmp_path):
    from fsdpkit.train.model.hf import load_hf_into
    from fsdpkit.train.model.hf_config import model_config_from_hf
    from fsdpkit.train.model.transformer import Transformer

    config = transformers.LlamaConfig(**COMMON, rope_theta=10000.0,
                                      rope_scaling={"rope_type": "linear", "factor": 4.0})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(tmp_path / "hf")
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 4.0
    ours = Transformer(cfg, rope_len=64)
    ours.init_buffers()
    load_hf_into(ours, tmp_path / "hf", cfg)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)
        # Dropping the scaling (what the import did before) changes the logits: the test sees it.
        plain = Transformer(dataclasses.replace(cfg, rope_scaling=None), rope_len=64)
        plain.init_buffers()
        load_hf_into(plain, tmp_path / "hf", cfg)
        assert not torch.allclose(plain.eval()(tokens), theirs(tokens).logits, atol=1e-3)


def test_export_carries_the_runs_tokenizer_and_its_token_ids(tmp_path, cli):
    texts = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert cli("tokenizer", "train", "--dataset", str(tmp_path / "docs.jsonl"), "--vocab_size", "300",
               "--out", str(tmp_path / "tok")).returncode == 0
    runs = {"bpe": ["--tokenizer", str(tmp_path / "tok"), "--vocab_size", "300", "--dataset",
                    str(tmp_path / "docs.jsonl")], "bytes": []}
    for name, flags in runs.items():
        r = cli("train", *FAST, *flags, "--max_steps", "1", "--train_batch_size", "2", "--tensorboard", "0",
                "--run_dir", str(tmp_path / f"{name}-run"), "--checkpoint_dir", str(tmp_path / f"{name}-ckpt"))
        assert r.returncode == 0, r.stderr[-2000:]
        r = cli("export", str(tmp_path / f"{name}-ckpt"), str(tmp_path / f"{name}-hf"))
        assert r.returncode == 0, r.stderr[-2000:]
    config = json.loads((tmp_path / "bytes-hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    assert not (tmp_path / "bytes-hf" / "tokenizer.json").exists()

    out = tmp_path / "bpe-hf"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    from fsdpkit.train.data.tokenizers import HFTokenizer

    ours = HFTokenizer(str(tmp_path / "tok"))
    assert theirs.encode(texts[3], add_special_tokens=False) == ours.encode(texts[3]).tolist()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.eos_id == theirs.eos_token_id

    # The tokenizer gone (a hub one not cached on an offline machine): the weights are still
    # exported, and the missing tokenizer is said, not silently left out.
    shutil.rmtree(tmp_path / "tok")
    r = cli("export", str(tmp_path / "bpe-ckpt"), str(tmp_path / "no-tok"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: export: the run's tokenizer is not in the export: tokenizer:" in r.stderr
    assert (tmp_path / "no-tok" / "model.safetensors").is_file()
    assert not (tmp_path / "no-tok" / "tokenizer.json").exists()
