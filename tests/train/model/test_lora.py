"""LoRA under FSDP2: only the adapters train, are checkpointed and resume exactly; the exported
adapter loads in PEFT and the merged export in transformers, computing fsdpkit's logits."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint import catalog
from fsdpkit.train.config import parse_args
from fsdpkit.train.export import load_full_model
from fsdpkit.train.model.config import LoraShape
from fsdpkit.train.model.hf import load_hf_into
from fsdpkit.train.model.lora import LoRALinear, adapter_tensors, add_adapters, is_adapter, merge_adapters
from fsdpkit.train.optim import build_optimizer, clipped_step
from fsdpkit.train.parallel.shard import build_model
from fsdpkit.train.runtime.dist import Runtime

from conftest import losses, require, run_cli

transformers = require("transformers")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A Qwen2.5-shaped model made by transformers (biased q/k/v, tied head)."""
    path = tmp_path_factory.mktemp("qwen") / "hf"
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(path)
    return path


def chat_data(path) -> str:
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a + b}."}]} for a in range(20) for b in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def lora_flags(qwen_dir, data: str, run, ckpt, *extra: str) -> list[str]:
    return ["train", "--init-from-hf", str(qwen_dir), "--lora", "1", "--lora-rank", "4", "--lr", "5e-3",
            "--dataset", data, "--data-format", "chat", "--chat-template", "chatml", "--seq-len", "64",
            "--train-batch-size", "2", "--nproc", "2", "--tensorboard", "0", "--logging-freq", "1",
            "--validation-freq", "0", "--validation-batches", "1", "--progress", "off", "--run-dir", str(run),
            "--checkpoint-dir", str(ckpt), "--max-steps", "6", *extra]


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_two_rank_lora_run_saves_only_adapters_resumes_exactly_and_exports_for_peft(qwen_dir, tmp_path):
    peft = require("peft")
    data = chat_data(tmp_path / "chat.jsonl")
    base_bytes = sha(qwen_dir / "model.safetensors")
    whole = run_cli(*lora_flags(qwen_dir, data, tmp_path / "whole", tmp_path / "ck-whole", "--checkpoint-every",
                                "3"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    # Resumed from step 3: steps 4 to 6 as the uninterrupted run had them, and the same adapters.
    shutil.copytree(tmp_path / "ck-whole" / "step-00000003", tmp_path / "ck-half" / "step-00000003")
    rest = run_cli(*lora_flags(qwen_dir, data, tmp_path / "half", tmp_path / "ck-half", "--resume", "auto"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout
    assert losses(tmp_path / "half") == losses(tmp_path / "whole")[3:]
    assert losses(tmp_path / "whole")[-1] < losses(tmp_path / "whole")[0]
    # Resuming adapters as a whole model, other adapters, or a whole model as adapters: one line
    # naming the difference, and the checkpoint directory's lock file as it was.
    lock = (tmp_path / "ck-half" / ".fsdpkit.lock").read_bytes()
    full = tmp_path / "ck-full" / "step-00000003"
    shutil.copytree(tmp_path / "ck-whole" / "step-00000003", full)
    meta = json.loads((full / "fsdpkit.json").read_text())
    del meta["model"]["lora"]
    (full / "fsdpkit.json").write_text(json.dumps(meta))
    flags = lora_flags(qwen_dir, data, tmp_path / "refused", tmp_path / "ck-half", "--resume", "auto")
    for argv, says in (
            # The adapters' own options dropped too: with them, --lora 0 is refused for those (tests/cli).
            ([*flags[:flags.index("--lora-rank")], *flags[flags.index("--lora-rank") + 2:], "--lora", "0"],
             "holds LoRA adapters (rank 4), and this run trains the whole model; resume it with --lora 1"),
            ([*flags, "--lora-rank", "8", "--lora-targets", "q_proj"],
             "holds a model of another shape: lora_rank 4 (this run: 8), lora_targets q_proj,k_proj,v_proj,o_proj,"
             "gate_proj,up_proj,down_proj (this run: q_proj); resume with the same model settings"),
            (lora_flags(qwen_dir, data, tmp_path / "refused", tmp_path / "ck-full", "--resume", "auto"),
             "holds a whole model, and this run trains LoRA adapters; export it")):
        r = run_cli(*argv)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
        assert says in r.stderr, r.stderr
    assert (tmp_path / "ck-half" / ".fsdpkit.lock").read_bytes() == lock and not (tmp_path / "refused").exists()
    info = catalog.resolve(str(tmp_path / "ck-whole"))
    assert info.step == 6 and info.meta["model"]["lora"]["rank"] == 4
    for ck in (info, catalog.resolve(str(tmp_path / "ck-half"))):
        # What the checkpoint holds: adapters and their optimizer state, no byte of the base.
        keys = [k for k in FileSystemReader(str(ck.path)).read_metadata().state_dict_metadata
                if k.startswith(("model.", "optim.state."))]   # not the optimizer's hyperparameters
        assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys
    a, b = (load_full_model(catalog.resolve(str(tmp_path / d))).state_dict() for d in ("ck-whole", "ck-half"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sha(qwen_dir / "model.safetensors") == base_bytes
    # The run says how much of the model trains, in PEFT's words and figures for the same adapters.
    config = peft.LoraConfig(r=4, lora_alpha=info.meta["model"]["lora"]["alpha"], target_modules=list(
        info.meta["model"]["lora"]["targets"]))
    trainable, total = peft.get_peft_model(transformers.Qwen2ForCausalLM.from_pretrained(qwen_dir),
                                           config).get_nb_trainable_parameters()
    assert trainable < total // 10
    assert (f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
            in whole.stdout), whole.stdout

    out = tmp_path / "adapter"
    r = run_cli("export", str(tmp_path / "ck-whole"), str(out), "--to", "peft", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "fsdpkit_export.json"]
    ours = load_full_model(info).eval()
    base = transformers.Qwen2ForCausalLM.from_pretrained(qwen_dir, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    tokens = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(tokens)
        torch.testing.assert_close(logits, theirs(input_ids=tokens).logits, rtol=0, atol=1e-5)
        plain = transformers.Qwen2ForCausalLM.from_pretrained(qwen_dir, attn_implementation="eager").eval()
        assert (logits - plain(tokens).logits).abs().max() > 1e-3  # the adapters do change the model
    # Merged into the base: a plain transformers model with the same function (W + s B A rounds
    # differently from W x + s B (A x): hence 1e-4).
    merged = tmp_path / "merged"
    assert run_cli("export", str(tmp_path / "ck-whole"), str(merged)).returncode == 0
    with torch.no_grad():
        torch.testing.assert_close(
            logits, transformers.Qwen2ForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()(
                tokens).logits, rtol=0, atol=1e-4)


def test_lora_trains_the_adapters_alone_and_the_base_bytes_stay_as_loaded(qwen_dir, tmp_path):
    cfg = parse_args(["--init-from-hf", str(qwen_dir), "--lora", "1", "--lora-rank", "4", "--lora-targets",
                      "q_proj,v_proj", "--weight-decay", "0.1", "--lr", "1e-2", "--seq-len", "32"])
    model = build_model(cfg.shape, cfg.parallel, 32, 0, Runtime(0, 1, 0, 1, torch.device("cpu")), cfg.lora_shape)
    load_hf_into(model, qwen_dir, cfg.shape)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{m}.lora_{x}.weight" for m in adapted for x in "AB"}
    optimizer = build_optimizer(model, cfg.optim)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trained)
    tokens = torch.randint(0, 258, (2, 33), generator=torch.Generator().manual_seed(0))
    before = model.loss(tokens[:, :-1], tokens[:, 1:])[0].item()
    for _ in range(5):
        model.loss(tokens[:, :-1], tokens[:, 1:])[1].backward()
        clipped_step(optimizer, 1.0)
        optimizer.zero_grad(set_to_none=True)
    assert model.loss(tokens[:, :-1], tokens[:, 1:])[0].item() < before
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if "lora_B" in n)


def test_lora_is_refused_where_it_cannot_work(qwen_dir):
    with pytest.raises(UserError, match="pass --init-from-hf"):
        parse_args(["--lora", "1"])
    with pytest.raises(UserError, match=r"lora_targets.*unknown LoRA target 'qkv'"):
        parse_args(["--init-from-hf", str(qwen_dir), "--lora", "1", "--lora-targets", "qkv"])


# -- the layer itself, in this process: the arithmetic an adapted projection and its merge do ---------
def _adapted(bias: bool = False, dropout: float = 0.0) -> LoRALinear:
    """A 3 -> 2 projection with a rank-2 adapter of alpha 3 (scale 1.5), every weight set by hand."""
    base = torch.nn.Linear(3, 2, bias=bias)
    layer = LoRALinear(base, LoraShape(2, 3.0, dropout, ("q_proj",)))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, -1.0, 1.0]]))
        layer.lora_A.weight.copy_(torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]]))
        layer.lora_B.weight.copy_(torch.tensor([[1.0, 0.0], [2.0, -1.0]]))
        if bias:
            layer.bias.copy_(torch.tensor([0.5, -0.5]))
    return layer


def test_an_adapted_projection_computes_w_x_plus_alpha_over_r_times_b_a_x():
    layer = _adapted()
    x = torch.tensor([[1.0, 2.0, 3.0]])
    # W x = [7, 1]; A x = [3, 7]; B A x = [3, -1]; x 1.5 = [4.5, -1.5].
    assert layer.scale == 1.5 and isinstance(layer.dropout, torch.nn.Identity)
    assert torch.equal(layer(x), torch.tensor([[11.5, -0.5]]))
    assert torch.equal(_adapted(bias=True)(x), torch.tensor([[12.0, -1.0]]))
    # W + 1.5 B A = [[1, 0, 2], [0, -1, 1]] + 1.5 [[1, 1, 0], [2, 0, -1]].
    merged = merge_adapters({f"l.{k}": v for k, v in layer.state_dict().items()}, LoraShape(2, 3.0, 0.0, ("q_proj",)))
    assert torch.equal(merged["l.weight"], torch.tensor([[2.5, 1.5, 2.0], [3.0, -1.0, -0.5]]))
    assert torch.equal(x @ merged["l.weight"].T, layer(x))
    # Dropout applies to the adapter's input only: in training the base's output is still W x.
    dropped = _adapted(dropout=0.5)
    assert dropped.dropout.p == 0.5 and dropped.lora_A.weight.shape == (2, 3) and dropped.lora_B.weight.shape == (2, 2)
    torch.manual_seed(0)
    with torch.no_grad():
        dropped.lora_B.weight.zero_()
    assert torch.equal(dropped.train()(x), torch.tensor([[7.0, 1.0]]))
    assert torch.equal(_adapted(dropout=0.5).eval()(x), layer(x))


def test_adapters_go_on_the_target_projections_only_and_only_they_train():
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.q_proj, model.attn.k_proj = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    model.q_proj = torch.nn.Linear(3, 3)                       # a target at the top level too
    model.attn.o_proj = LoRALinear(torch.nn.Linear(2, 2), LoraShape(1, 1.0, 0.0, ("o_proj",)))  # not a plain Linear
    adapted = add_adapters(model, LoraShape(2, 4.0, 0.0, ("q_proj", "o_proj")))
    assert adapted == ["q_proj", "attn.q_proj"]
    assert type(model.attn.k_proj) is torch.nn.Linear and type(model.attn.q_proj) is LoRALinear
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trained == ["attn.o_proj.lora_A.weight", "attn.o_proj.lora_B.weight", "attn.q_proj.lora_A.weight",
                       "attn.q_proj.lora_B.weight", "q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    assert is_adapter("a.q_proj.lora_A.weight") and is_adapter("a.q_proj.lora_B.weight")
    assert not is_adapter("a.q_proj.weight") and not is_adapter("a.lora_A_weight")
    # The merge: W + scale B A for each adapted weight, the adapters dropped, the rest as it was.
    layer = _adapted(bias=True)
    state = {f"l.{k}": v for k, v in layer.state_dict().items()} | {"norm.weight": torch.tensor([2.0])}
    merged = merge_adapters(state, LoraShape(2, 3.0, 0.0, ("q_proj",)))
    assert sorted(merged) == ["l.bias", "l.weight", "norm.weight"]
    assert torch.equal(merged["l.weight"], torch.tensor([[2.5, 1.5, 2.0], [3.0, -1.0, -0.5]]))  # as unbiased
    assert torch.equal(merged["l.bias"], layer.bias)
    assert torch.equal(merged["norm.weight"], torch.tensor([2.0]))
    half = merge_adapters({k: v.to(torch.bfloat16) for k, v in state.items()}, LoraShape(2, 3.0, 0.0, ("q_proj",)))
    assert half["l.weight"].dtype == torch.bfloat16
    assert sorted(adapter_tensors(state)) == ["base_model.model.l.lora_A.weight", "base_model.model.l.lora_B.weight"]
