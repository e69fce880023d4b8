"""QLoRA: LoRA over a frozen base stored in NF4 (fsdpkit.train.model.nf4), under FSDP2 on CPU ranks.

What it must show (issue 50): a 2-rank QLoRA run trains a tiny Llama and a tiny Qwen and resumes
exactly; the sharded base is byte for byte torchao's `to_nf4` of each whole weight, at NF4's bytes
a parameter; the logits before training are the reference's (torchao's dequantized weights in
transformers) and bitsandbytes' 4-bit model's within NF4's tolerance; `export --to peft` loads in
PEFT on the full-precision base and on a bitsandbytes 4-bit base; the merged export is the base as
trained (quantized once, read back) plus the adapters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fsdpkit.errors import UserError
from fsdpkit.train.config import parse_args
from fsdpkit.train.model import nf4
from fsdpkit.train.model.config import check_nf4_layout
from fsdpkit.train.model.hf import load_hf_into
from fsdpkit.train.model.lora import adapters_disabled
from fsdpkit.train.parallel.shard import build_model
from fsdpkit.train.runtime.dist import Runtime
from fsdpkit.train.trainer import _objective

from conftest import ROOT, losses, require, run_cli

transformers = require("transformers")
torchao_nf4 = require("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

pytestmark = pytest.mark.slow

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# NF4 of fp32 parameters: 4-bit codes, an int8 scaler per 64 elements, an fp32 factor per 256 scalers.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# Large enough that every projection's half holds whole NF4 blocks (64 x 256 elements) over 2 ranks.
SHAPE = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict:
    """A tiny Llama (untied head) and a tiny Qwen 2 (biased q/k/v, tied head), saved by transformers."""
    root = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(root / "llama")
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)).save_pretrained(
        root / "qwen")
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a + b}."}]} for a in range(20) for b in range(10)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"llama": root / "llama", "qwen": root / "qwen", "data": root / "chat.jsonl"}


def qlora_flags(base, data, run, ckpt, *extra: str) -> list[str]:
    return ["train", "--init-from-hf", str(base), "--lora", "1", "--base-dtype", "nf4", "--lora-rank", "4",
            "--lr", "5e-3", "--dataset", str(data), "--data-format", "chat", "--chat-template", "chatml",
            "--seq-len", "64", "--train-batch-size", "2", "--nproc", "2", "--tensorboard", "0", "--logging-freq",
            "1", "--validation-freq", "0", "--progress", "off", "--run-dir", str(run), "--checkpoint-dir",
            str(ckpt), "--max-steps", "12", *extra]


def hf_class(base):
    return transformers.Qwen2ForCausalLM if base.name == "qwen" else transformers.LlamaForCausalLM


def dequantized_reference(base):
    """transformers' model with every projection replaced by torchao's NF4 of it, read back."""
    model = hf_class(base).from_pretrained(base, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
                m.weight.copy_(torchao_nf4.to_nf4(m.weight.detach().clone(), 64, 256).get_original_weight())
    return model


def bnb_4bit(base):
    """The same weights as bitsandbytes' NF4 (double quantization), through transformers, on the CPU."""
    require("bitsandbytes")
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    return hf_class(base).from_pretrained(base, quantization_config=config, device_map="cpu",
                                          dtype=torch.float32, attn_implementation="eager").eval()


TOKENS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_a_two_rank_qlora_run_trains_and_resumes_exactly(bases, kind, tmp_path):
    base, data = bases[kind], bases["data"]
    whole = run_cli(*qlora_flags(base, data, tmp_path / "whole", tmp_path / "ck-whole", "--checkpoint-every", "6"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    # The start-up line reports the base's bytes as this rank holds them: NF4's.
    assert f"base projections in nf4: {NF4_BYTES:.3f} bytes a parameter" in whole.stdout, whole.stdout
    first = losses(tmp_path / "whole")
    assert len(first) == 12 and sum(first[-3:]) / 3 < first[0] - 1.0, first
    meta = json.loads((tmp_path / "ck-whole" / "step-00000012" / "fsdpkit.json").read_text())
    assert meta["model"]["lora"]["base_dtype"] == "nf4"
    if kind == "qwen":
        return   # resuming is the same code for both families: the llama case shows it
    shutil.copytree(tmp_path / "ck-whole" / "step-00000006", tmp_path / "ck-half" / "step-00000006")
    rest = run_cli(*qlora_flags(base, data, tmp_path / "half", tmp_path / "ck-half", "--resume", "auto"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout and losses(tmp_path / "half") == first[6:]
    # Adapters trained on an NF4 base resume on that base only: one line naming the difference.
    r = run_cli(*qlora_flags(base, data, tmp_path / "refused", tmp_path / "ck-half", "--resume", "auto",
                             "--base-dtype", "auto"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "holds a model of another shape: lora_base_dtype nf4 (this run: auto)" in r.stderr


def test_a_lora_checkpoint_from_before_base_dtype_resumes_as_auto(bases, tmp_path):
    """Checkpoints written before the field existed record no base_dtype: their base was the
    parameters' dtype, so they resume under auto and are refused under nf4."""
    flags = qlora_flags(bases["llama"], bases["data"], tmp_path / "run", tmp_path / "ck", "--max-steps", "2",
                        "--base-dtype", "auto", "--nproc", "1")   # the last of a repeated flag wins
    assert run_cli(*flags).returncode == 0
    meta_path = tmp_path / "ck" / "step-00000002" / "fsdpkit.json"
    meta = json.loads(meta_path.read_text())
    assert meta["model"]["lora"].pop("base_dtype") == "auto"
    meta_path.write_text(json.dumps(meta))
    again = run_cli(*flags, "--max-steps", "3", "--resume", "auto", "--run-dir", str(tmp_path / "r2"))
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-2000:]
    r = run_cli(*flags, "--max-steps", "4", "--resume", "auto", "--base-dtype", "nf4", "--run-dir",
                str(tmp_path / "r3"))
    assert r.returncode == 2 and "lora_base_dtype auto (this run: nf4)" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def sharded(bases, tmp_path_factory) -> dict:
    """The llama base under QLoRA on 2 ranks, as nf4_worker.py reports it."""
    out = tmp_path_factory.mktemp("sharded")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "train" / "model" / "nf4_worker.py"), str(out), "--init-from-hf",
           str(bases["llama"]), "--lora", "1", "--base-dtype", "nf4", "--lora-rank", "4", "--seq-len", "64"]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {**json.loads((out / "result.json").read_text()), "logits": torch.load(out / "logits.pt")}


def test_the_sharded_base_is_torchao_s_nf4_of_each_whole_weight_at_nf4_s_bytes(sharded):
    names = {f"model.layers.{i}.{part}.{p}.weight" for i in range(2) for part, ps in
             (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:])) for p in ps}
    assert sharded["same"] == dict.fromkeys(names, True)
    # Each rank holds half of every projection, at NF4's bytes a parameter exactly.
    elements = 2 * (256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 512 * 256) // 2
    assert sharded["elements"] == elements and sharded["stored"] == elements * NF4_BYTES
    assert sorted(sharded["trained"]) == sorted(f"{n.removesuffix('.weight')}.lora_{x}.weight"
                                                for n in names for x in "AB")


def test_logits_before_training_are_the_nf4_reference_s_and_near_bitsandbytes(bases, sharded):
    base = bases["llama"]
    cfg = parse_args(["--init-from-hf", str(base), "--lora", "1", "--base-dtype", "nf4", "--seq-len", "64"])
    one = build_model(cfg.shape, cfg.parallel, 64, 0, Runtime(0, 1, 0, 1, torch.device("cpu")), cfg.lora_shape)
    load_hf_into(one, base, cfg.shape)
    ours = logits_of(one)
    # Sharded over 2 ranks or whole on one, the same model.
    torch.testing.assert_close(sharded["logits"], ours, rtol=0, atol=1e-5)
    # torchao's dequantized weights in transformers: the function QLoRA trains from, to float rounding.
    torch.testing.assert_close(ours, logits_of(dequantized_reference(base)), rtol=0, atol=1e-5)
    # bitsandbytes quantizes the scalers its own way (8-bit dynamic codes): its NF4 model is far
    # closer to ours than either is to the full-precision model (measured: 0.07 of it).
    full = logits_of(hf_class(base).from_pretrained(base, attn_implementation="eager").eval())
    theirs = logits_of(bnb_4bit(base))
    assert (ours - theirs).abs().max() < 0.15 * (ours - full).abs().max()
    assert (ours - full).abs().max() > 0.05   # quantization does change the model


def test_the_peft_export_loads_on_the_full_and_the_4bit_base_and_the_merged_export_is_the_base_as_trained(
        bases, tmp_path):
    peft = require("peft")
    base = bases["llama"]
    r = run_cli(*qlora_flags(base, bases["data"], tmp_path / "run", tmp_path / "ck", "--max-steps", "8"))
    assert r.returncode == 0, r.stderr[-3000:]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert run_cli("export", str(tmp_path / "ck"), str(adapter), "--to", "peft").returncode == 0
    assert run_cli("export", str(tmp_path / "ck"), str(merged)).returncode == 0
    trained = logits_of(hf_class(base).from_pretrained(merged, attn_implementation="eager").eval())
    on_full = logits_of(peft.PeftModel.from_pretrained(
        hf_class(base).from_pretrained(base, attn_implementation="eager"), adapter).eval())
    on_4bit = logits_of(peft.PeftModel.from_pretrained(bnb_4bit(base), adapter).eval())
    plain = logits_of(dequantized_reference(base))
    assert (trained - plain).abs().max() > 0.05   # the adapters changed the model
    # On bitsandbytes' 4-bit base the adapters compute the model as trained, within NF4's tolerance
    # (the two NF4s' difference); on the full base, the same adapters over unquantized weights.
    assert (on_4bit - trained).abs().max() < 0.15 * (on_full - trained).abs().max() + 1e-4
    assert (on_full - trained).abs().max() > 0.05
    # The merged weights: W quantized once and read back, plus scale * B A, exactly so.
    a = load_file(str(adapter / "adapter_model.safetensors"))
    w = load_file(str(base / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    key = "base_model.model.model.layers.0.mlp.down_proj"
    expected = (nf4.dequantized(w.float()) + 8.0 * (a[f"{key}.lora_B.weight"].float()
                                                   @ a[f"{key}.lora_A.weight"].float()))
    got = load_file(str(merged / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].float()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_nf4_is_refused_where_it_cannot_hold_the_base(bases):
    with pytest.raises(UserError, match=r"nf4 stores the frozen base of a LoRA run \(QLoRA\); pass --lora 1"):
        parse_args(["--base-dtype", "nf4"])
    with pytest.raises(UserError, match="experts are grouped 3-D weights it cannot hold"):
        parse_args(["--init-from-hf", str(bases["llama"]), "--lora", "1", "--base-dtype", "nf4", "--n-experts", "4"])
    cfg = parse_args(["--init-from-hf", str(bases["llama"]), "--lora", "1", "--base-dtype", "nf4"])
    # 512 x 256 rows over 4 ranks: 128 x 256 = 2 blocks each; k_proj's 128 x 256 over 4: half a block.
    check_nf4_layout(cfg.shape, 2)
    with pytest.raises(UserError, match=r"nf4 stores k_proj \(128 x 256\) in blocks of 16384 elements, and over 4 "
                                        r"shard rank\(s\) each rank's rows \(32 x 256\) are no whole number of them; "
                                        r"use a rank count that divides them so, or --base-dtype auto"):
        check_nf4_layout(cfg.shape, 4)
    with pytest.raises(UserError, match=r"q_proj \(256 x 256\).*over 3 shard rank\(s\)"):
        check_nf4_layout(cfg.shape, 3)
    # One process holds the whole base; FSDP's one-rank shard groups (HSDP, a replica a rank) do not.
    check_nf4_layout(cfg.shape, 1)
    with pytest.raises(UserError, match=r"^base_dtype: nf4 needs its shards spread over 2 or more ranks; with 2 ranks "
                                        r"in 2 replicas each holds the whole base: lower --dp-replicate"):
        check_nf4_layout(cfg.shape, 1, 2)


def test_a_qlora_run_without_torchao_is_one_line_before_any_process_starts(bases, tmp_path):
    code = ("import sys\nsys.modules['torchao'] = None   # as if it were not installed\n"
            "from fsdpkit.cli.main import main\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *qlora_flags(bases["llama"], bases["data"], tmp_path / "run",
                                                                  tmp_path / "ck")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr == ("error: base_dtype: nf4 needs torchao >= 0.18 (pip install "
                                              "'fsdpkit[qlora]', or torchao in the training image)\n"), r.stderr[-2000:]
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()


def test_torchao_is_not_loaded_by_a_run_that_does_not_ask_for_nf4():
    """Importing it costs seconds and logs warnings in every worker: only QLoRA pays for it."""
    code = ("import sys\nfrom fsdpkit.train import trainer\nfrom fsdpkit.train.model import nf4\n"
            "assert not any(m.startswith('torchao') for m in sys.modules), sorted(sys.modules)\n"
            "import torch\nassert not nf4.is_nf4(torch.zeros(2))\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]


def test_dpo_s_reference_over_an_nf4_base_is_that_base_with_its_adapters_off(bases):
    """DPO with QLoRA holds no second model: its reference is the policy with the adapters off,
    which computes the NF4 base (what the adapters trained against), not the full-precision one."""
    base = bases["llama"]
    cfg = parse_args(["--init-from-hf", str(base), "--lora", "1", "--base-dtype", "nf4", "--seq-len", "64",
                      "--objective", "dpo", "--data-format", "preference"])
    model = build_model(cfg.shape, cfg.parallel, 64, 0, Runtime(0, 1, 0, 1, torch.device("cpu")), cfg.lora_shape)
    load_hf_into(model, base, cfg.shape)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    policy = logits_of(model)
    with adapters_disabled(model):
        reference = logits_of(model)
    torch.testing.assert_close(reference, logits_of(dequantized_reference(base)), rtol=0, atol=1e-5)
    assert (policy - reference).abs().max() > 0.05
    assert _objective(cfg, Runtime(0, 1, 0, 1, torch.device("cpu")), None).reference is None


def test_compiled_qlora_steps_equal_eager_ones(bases, tmp_path):
    """On GPUs blocks are compiled by default: the NF4 weights go through torch.compile (its CPU twin
    here) and the steps are the eager run's."""
    runs = {}
    for compiled in ("0", "1"):
        r = run_cli(*qlora_flags(bases["llama"], bases["data"], tmp_path / compiled, tmp_path / f"ck{compiled}",
                                 "--max-steps", "2", "--compile", compiled))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Warning" not in r.stderr, r.stderr[-3000:]   # torchao's and torch.compile's notes kept quiet
        runs[compiled] = losses(tmp_path / compiled)
    assert runs["1"] == pytest.approx(runs["0"], abs=1e-5)
