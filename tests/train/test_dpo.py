"""DPO: the loss and reward metrics against TRL's DPOTrainer on the same model, batch and reference
log-probabilities; the packed preference rows the trainer reads."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from importlib import resources

import numpy as np
import pytest
import torch

from fsdpkit.errors import UserError
from fsdpkit.train import trainer
from fsdpkit.train.checkpoint import catalog
from fsdpkit.train.config import parse_args
from fsdpkit.train.data import BatchStream, HFTokenizer, LocalFiles, get_tokenizer
from fsdpkit.train.data.chat_template import ChatTemplate, template_of
from fsdpkit.train.data.pipeline import data_pipeline
from fsdpkit.train.data.preference import Pair, Preference, encode_pair, pack_pairs, preference_of
from fsdpkit.train.data.stream import IGNORE
from fsdpkit.train.dpo import METRICS, Answers, answers, means, preference_loss
from fsdpkit.train.export import load_full_model
from fsdpkit.train.model.hf import load_hf_into
from fsdpkit.train.model.lora import adapters_disabled
from fsdpkit.train.objective import DPO
from fsdpkit.train.parallel.shard import build_model
from fsdpkit.train.runtime.dist import Runtime

from conftest import read_metrics, require, run_cli
from finetune_fixtures import make_tokenizer, tiny_qwen
from our_model import load_ours

# Three pairs as token ids (prompt, chosen, rejected) and the reference's log-probability of each answer.
PAIRS = [([5, 6, 7], [8, 9, 30], [10, 31]), ([11, 12], [13, 40], [14, 15, 16, 41]), ([17, 18, 19, 20], [21], [22])]
REFERENCE = [(-9.5, -7.25), (-6.0, -11.0), (-3.5, -3.0)]


def trl_outcome(trl, model, tok, kind: str, beta: float, tmp_path):
    """TRL's loss and metrics on PAIRS with REFERENCE as its precomputed reference."""
    from datasets import Dataset

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[kind], report_to="none",
                         use_cpu=True)
    trainer = trl.DPOTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=Dataset.from_list([{"prompt": "p", "chosen": "c", "rejected": "r"}]))
    trainer.precompute_ref_logps = True   # take the reference's log-probabilities from the batch, as given
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    batch = DataCollatorForPreference(pad_token_id=0)([
        {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "ref_chosen_logps": rc, "ref_rejected_logps": rr}
        for (p, c, r), (rc, rr) in zip(PAIRS, REFERENCE, strict=True)])
    model.eval()
    with torch.no_grad():
        loss = trainer._compute_loss(model, batch, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["eval"].items() if k in METRICS}


def ours(model, kind: str, beta: float, width: int):
    """fsdpkit's loss and metrics on the same pairs packed into rows of `width` + 1 tokens."""
    pairs = [Pair(np.array(p), np.array(c), np.array(r), f"pair {i}") for i, (p, c, r) in enumerate(PAIRS)]
    rows = np.stack(list(pack_pairs(pairs, width + 1, 0, lambda *_: None)))
    t = torch.from_numpy(rows)
    tokens, mask, seqs = t[:, 0], t[:, 1].bool(), t[:, 2]
    targets = torch.where(mask[:, 1:] & (seqs[:, 1:] == seqs[:, :-1]), tokens[:, 1:], IGNORE)
    with torch.no_grad():
        policy = answers(model.token_logps(tokens[:, :-1], targets, seqs[:, :-1]), targets, seqs[:, :-1])
    ref = Answers(*(torch.zeros_like(policy.chosen) for _ in range(4)), policy.present)
    ref.chosen[policy.present] = torch.tensor([rc for rc, _ in REFERENCE])
    ref.rejected[policy.present] = torch.tensor([rr for _, rr in REFERENCE])
    out = preference_loss(policy, ref, beta, kind)
    assert int(out.pairs) == len(PAIRS)
    return float(out.loss), dict(zip(METRICS, (out.sums / out.pairs).tolist(), strict=True)), rows


@pytest.mark.parametrize(("kind", "beta"), [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.3), ("hinge", 0.2)])
def test_loss_and_rewards_equal_trl_s_on_the_same_model_batch_and_reference(tmp_path, kind, beta):
    transformers, trl = require("transformers"), require("trl")
    folder = tiny_qwen(tmp_path / "m", transformers)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    their_loss, their_metrics = trl_outcome(trl, theirs_model, tok, kind, beta, tmp_path)
    model = load_ours(folder)
    for width in (40, 16):   # all pairs in one row, and one pair a row
        loss, metrics, rows = ours(model, kind, beta, width)
        assert len(rows) == (1 if width == 40 else 3)
        assert loss == pytest.approx(their_loss, abs=1e-5)
        assert metrics == pytest.approx(their_metrics, abs=1e-5)
        assert set(their_metrics) == set(METRICS)
    assert 0 < their_metrics["rewards/accuracies"] < 1   # a batch where both outcomes occur


def test_pairs_pack_whole_each_answer_numbered_and_padding_last():
    pairs = [Pair(np.array(p), np.array(c), np.array(r), f"pair {i}") for i, (p, c, r) in enumerate(PAIRS)]
    rows = list(pack_pairs(pairs, 17, 99, lambda *_: None))
    # Pair 0 (5 + 5 tokens) and pair 1 (4 + 6) do not both fit in 17: each row holds what fits whole.
    assert [r[0].tolist() for r in rows] == [
        [5, 6, 7, 8, 9, 30, 5, 6, 7, 10, 31] + [99] * 6,
        [11, 12, 13, 40, 11, 12, 14, 15, 16, 41] + [99] * 7,
        [17, 18, 19, 20, 21, 17, 18, 19, 20, 22] + [99] * 7,
    ]
    assert rows[0][1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1] + [0] * 6
    assert rows[0][2].tolist() == [1] * 6 + [2] * 5 + [0] * 6
    two = list(pack_pairs(pairs[:1] + pairs[2:], 21, 0, lambda *_: None))
    assert len(two) == 1 and two[0][2].tolist() == [1] * 6 + [2] * 5 + [3] * 5 + [4] * 5
    refused: list[tuple[str, int]] = []
    kept = list(pack_pairs(pairs, 10, 0, lambda pair, row: refused.append((pair.where, row))))
    assert refused == [("pair 0", 10)] and [r[0][:10].tolist() for r in kept] == [
        [11, 12, 13, 40, 11, 12, 14, 15, 16, 41], [17, 18, 19, 20, 21, 17, 18, 19, 20, 22]]   # the pairs after it go on
    # Exactly a row: no padding; two pairs that fill a row exactly share it.
    exact = list(pack_pairs(pairs[1:2], 10, 0, lambda *_: None))
    assert len(exact) == 1 and exact[0][2].tolist() == [1] * 4 + [2] * 6
    shared = list(pack_pairs([pairs[0], pairs[2]], 21, 0, lambda *_: None))
    assert len(shared) == 1 and (shared[0][2] > 0).all()


def test_the_batch_stream_s_targets_are_each_answer_s_tokens_within_its_own_sequence(tmp_path):
    tok = HFTokenizer(str(tiny_qwen(tmp_path / "m", require("transformers"))))
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    records = [{"prompt": f"What is {i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
               for i in range(6)]
    (data / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = LocalFiles(str(tmp_path / "data"), "train", 0, data_format="preference")
    stream = BatchStream(source, tok, 63, 2, shuffle_buffer=0, epochs=1, preference=True)
    batch = next(iter(stream))
    assert batch.docs is not None
    pair = encode_pair(preference_of(records[0], "r"), tok.encode, None, tok.eos_id)
    assert pair.chosen[-1] == pair.rejected[-1] == tok.eos_id   # a text answer ends with EOS, as TRL's does
    n_prompt, n_chosen = len(pair.prompt), len(pair.chosen)
    row, targets, seqs = batch.inputs[0], batch.targets[0], batch.docs[0]
    kept = (targets != IGNORE).nonzero().flatten().tolist()
    # The chosen answer's tokens are the targets of the positions before them, and no prompt token is one.
    first = list(range(n_prompt - 1, n_prompt + n_chosen - 1))
    assert kept[:n_chosen] == first
    assert targets[first].tolist() == pair.chosen.tolist()
    assert row[: n_prompt].tolist() == pair.prompt.tolist()
    assert set(seqs[kept].tolist()) <= set(range(1, 64)) and seqs[0] == 1


def test_preference_records_in_trl_s_forms_and_bad_ones_are_none():
    text = preference_of({"prompt": "Q", "chosen": "A", "rejected": "B"}, "r")
    assert text == Preference("Q", "A", "B", None, "r") and not text.conversational
    user, good, bad = ({"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                       {"role": "assistant", "content": "B"})
    tools = [{"type": "function", "function": {"name": "f"}}]
    explicit = preference_of({"prompt": [user], "chosen": [good], "rejected": [bad], "tools": tools}, "e")
    assert explicit == Preference([user], [good], [bad], tools, "e") and explicit.conversational
    implicit = preference_of({"chosen": [user, good], "rejected": [user, bad]}, "i")
    assert implicit == Preference([user], [good], [bad], None, "i")
    # The prompt is every message both open with, up to the last of the shorter one.
    turn = [user, good, {"role": "user", "content": "Again?"}]
    longer = preference_of({"chosen": [*turn, good], "rejected": [*turn, bad, bad]}, "l")
    assert longer == Preference(turn, [good], [bad, bad], None, "l")
    assert preference_of({"chosen": [user, good], "rejected": [user, good]}, "s") == Preference(
        [user], [good], [good], None, "s")
    assert preference_of({"prompt": "Q", "chosen": "A", "rejected": "B", "tools": []}).tools is None
    for record in ({"prompt": "Q", "chosen": "A"}, {"prompt": 3, "chosen": "A", "rejected": "B"},
                   {"prompt": [user], "chosen": [user], "rejected": [bad]},
                   {"chosen": [good], "rejected": [bad]},
                   {"prompt": [user], "chosen": "A", "rejected": [bad]},
                   {"prompt": [user], "chosen": [good], "rejected": [bad], "tools": "f"}, "text"):
        assert preference_of(record) is None, record


def test_pairs_whose_answers_are_the_same_are_left_out_named_and_counted(tmp_path, diagnostics):
    """A pair whose chosen and rejected answers are one answer (both empty included) has DPO's loss
    ln 2 and no gradient whatever the model: left out with a warning naming it, as a bad record."""
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    same = [{"prompt": "a", "chosen": "x", "rejected": "x"}, {"prompt": "b", "chosen": "", "rejected": ""}]
    good = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(3)]
    (data / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [same[0], *good, same[1]]))
    source = LocalFiles(str(tmp_path / "data"), "train", 0, data_format="preference", verbose=True)
    stream = BatchStream(source, get_tokenizer("bytes"), 15, 1, shuffle_buffer=0, epochs=1, preference=True)
    prompts = [bytes(b[0][b[2] == 1][b[1][b[2] == 1] == 0].tolist()).decode() for b in stream.blocks()]
    assert prompts == ["q0", "q1", "q2"]
    assert (source.bad_records, source.same_answers) == (2, 2)
    assert diagnostics == [f"warning: dataset: skipped {n} bad record(s); latest {data / 'p.jsonl'}:{line}: its "
                           "chosen and rejected answers are the same, which DPO cannot learn from (it learns their "
                           "difference)" for n, line in ((1, 1), (2, 5))]


def test_a_pair_longer_than_a_row_is_refused_naming_the_record(tmp_path):
    tok = HFTokenizer(str(tiny_qwen(tmp_path / "m", require("transformers"))))
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "Why? " * 30, "chosen": "Yes.", "rejected": "No."}) + "\n")
    stream = BatchStream(LocalFiles(str(tmp_path / "data"), "train", 0, data_format="preference"), tok, 15, 1,
                         shuffle_buffer=0, epochs=1, preference=True)
    pair = encode_pair(preference_of({"prompt": "Why? " * 30, "chosen": "Yes.", "rejected": "No."}), tok.encode,
                       None, tok.eos_id)
    with pytest.raises(UserError) as e:
        next(iter(stream))
    assert str(e.value) == (f"dataset: {data / 'p.jsonl'}:1: its prompt and two answers take {pair.tokens} tokens, "
                            "more than a row of 16 (seq_len + 1); raise --seq-len, or leave such records out")


def preference_data(folder) -> str:
    """Sums of two digits: the right answer chosen, a wrong one rejected (train and validation)."""
    for split, n, seed in (("train", 2000, 1), ("validation", 200, 2)):
        rng = np.random.default_rng(seed)
        rows = []
        for a, b, off in zip(rng.integers(0, 10, n), rng.integers(0, 10, n), rng.integers(1, 6, n), strict=True):
            rows.append({"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{(a + b + off) % 19}"})
        (folder / split).mkdir(parents=True, exist_ok=True)
        (folder / split / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def dpo_flags(data: str, run, ckpt, *extra: str) -> list[str]:
    return ["train", "--objective", "dpo", "--data-format", "preference", "--dataset", data, "--seq-len", "64",
            "--train-batch-size", "8", "--lr", "1e-3", "--nproc", "2", "--tensorboard", "0", "--logging-freq", "5",
            "--validation-freq", "0", "--validation-batches", "1", "--progress", "off", "--run-dir", str(run),
            "--checkpoint-dir", str(ckpt), "--max-steps", "50", *extra]


def rows_of(run) -> list[dict]:
    """Each logged window: its step, loss and DPO metrics."""
    return [{k: r[k] for k in ("step", "loss", *METRICS)} for r in read_metrics(run)]


@pytest.mark.slow
def test_a_two_rank_dpo_run_raises_reward_accuracy_and_resumes_exactly(tmp_path):
    data = preference_data(tmp_path / "data")
    whole = run_cli(*dpo_flags(data, tmp_path / "whole", tmp_path / "ck-whole", "--checkpoint-every", "25",
                               "--validate-at-start", "1"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    rows = rows_of(tmp_path / "whole")
    accuracy = [r["rewards/accuracies"] for r in rows]
    assert accuracy[0] < 0.6 and accuracy[-1] > 0.9, accuracy
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"] and rows[-1]["loss"] < rows[0]["loss"]
    assert set(METRICS) <= set(rows[0])
    # Validation at the last step: the DPO loss and TRL's metrics over the held-out pairs.
    val = read_metrics(tmp_path / "whole", "val")[-1]
    assert val["step"] == 50 and {f"val_{name}" for name in METRICS} <= set(val)
    # --validate-at-start: the held-out pairs before the first step, where the policy is its reference (ln 2).
    start = read_metrics(tmp_path / "whole", "val")[0]
    assert start["step"] == 0 and start["val_loss"] == pytest.approx(math.log(2), abs=1e-6), start
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert (summary["start_val_loss"], summary["final_val_loss"]) == (start["val_loss"], val["val_loss"])
    assert (f"; loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, validation {start['val_loss']:.4f} -> "
            f"{val['val_loss']:.4f}; metrics in ") in whole.stdout
    assert val["val_rewards/accuracies"] > 0.8 and val["val_loss"] < rows[0]["loss"]
    last = read_metrics(tmp_path / "whole")[-1]
    assert (f"Batch 50 Loss: {last['loss']:.5f}, " in whole.stdout and f", rewards: accuracy "
            f"{last['rewards/accuracies']:.3f}, margin {last['rewards/margins']:.4f}\n" in whole.stdout)
    # Resumed at step 25 (the reference rebuilt as it started): every later window as the uninterrupted run had it.
    shutil.copytree(tmp_path / "ck-whole" / "step-00000025", tmp_path / "ck-half" / "step-00000025")
    rest = run_cli(*dpo_flags(data, tmp_path / "half", tmp_path / "ck-half", "--resume", "auto"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout
    assert rows_of(tmp_path / "half") == rows[5:]
    assert [r["step"] for r in read_metrics(tmp_path / "half", "val")] == [50]   # the start is not measured again


def block_pair(block: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """(prompt, chosen, rejected) of a block holding one pair (pack_pairs' layout)."""
    tokens, answer, seqs = block
    prompt, chosen = tokens[(seqs == 1) & (answer == 0)], tokens[(seqs == 1) & (answer == 1)]
    return tuple(prompt.tolist()), tuple(chosen.tolist()), tuple(tokens[(seqs == 2) & (answer == 1)].tolist())


@pytest.mark.slow
def test_a_dpo_run_follows_trl_s_dpo_trainer_step_for_step_on_the_same_pairs_in_the_same_order(tmp_path):
    """20 steps of fsdpkit's DPO and of TRL's DPOTrainer from the same model, over the same pairs in
    the order fsdpkit's stream drew them (four a step, one a row), with the same optimizer, schedule,
    clipping and beta: each step's loss within 1e-4 and the final weights equal to float tolerance."""
    transformers, trl = require("transformers"), require("trl")
    from datasets import Dataset

    torch.manual_seed(0)
    folder = tiny_qwen(tmp_path / "m", transformers)
    records = [{"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{(a + b + 1 + a % 3) % 19}"}
               for a in range(10) for b in range(10)]
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train" / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = HFTokenizer(str(folder))
    by_tokens = {}
    for r in records:
        pair = encode_pair(preference_of(r), tok.encode, None, tok.eos_id)
        by_tokens[tuple(tuple(t.tolist()) for t in (pair.prompt, pair.chosen, pair.rejected))] = (r, pair.tokens)
    sizes = [n for _, n in by_tokens.values()]
    row = max(sizes)
    assert len(by_tokens) == len(records) and 2 * min(sizes) > row   # a row holds one pair, never two
    steps, batch = 20, 4
    flags = ["--objective", "dpo", "--data-format", "preference", "--dataset", str(tmp_path / "data"),
             "--init-from-hf", str(folder), "--tokenizer", str(folder), "--seq-len", str(row - 1),
             "--train-batch-size", str(batch), "--max-steps", str(steps), "--lr", "1e-3", "--warmup-steps", "0",
             "--lr-decay-style", "constant", "--weight-decay", "0", "--beta2", "0.999", "--grad-clip", "1.0",
             "--dpo-beta", "0.1", "--dpo-loss", "sigmoid"]
    run, ckpt = tmp_path / "run", tmp_path / "ck"
    r = run_cli("train", *flags, "--nproc", "1", "--logging-freq", "1", "--validation-freq", "0", "--tensorboard",
                "0", "--progress", "off", "--run-dir", str(run), "--checkpoint-dir", str(ckpt))
    assert r.returncode == 0, r.stderr[-3000:]
    ours = [m["loss"] for m in read_metrics(run)]
    assert len(ours) == steps

    # The order the run drew its pairs in: its stream, built from its configuration as the trainer builds it.
    cfg = parse_args(flags)
    pipe = data_pipeline(cfg.data, cfg.seed, cfg.data.train_split, verbose=False)
    stream = BatchStream(pipe.source, pipe.tokenizer, cfg.data.seq_len, batch, 0, 1, cfg.seed, epochs=cfg.data.epochs,
                         chat=pipe.chat, preference=pipe.preference)
    order = [by_tokens[block_pair(block)][0] for _, block in itertools.islice(stream.rank_blocks(), steps * batch)]
    assert len({json.dumps(o) for o in order}) == steps * batch and order != records[:steps * batch]  # shuffled

    losses: list[float] = []

    class Recorded(trl.DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, beta=0.1, loss_type=["sigmoid"],
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch_fused",
        per_device_train_batch_size=batch, max_steps=steps, train_sampling_strategy="sequential", save_strategy="no",
        logging_steps=1, disable_tqdm=True, bf16=False)  # TRL defaults to bf16 autocast, fsdpkit on a CPU is fp32
    theirs = Recorded(model=transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
                      args=args, processing_class=transformers.AutoTokenizer.from_pretrained(str(folder)),
                      train_dataset=Dataset.from_list(order))
    theirs.train()
    assert len(losses) == steps
    assert max(abs(a - b) for a, b in zip(ours, losses, strict=True)) < 1e-4, list(zip(ours, losses, strict=True))
    # Each step's gradient norm before clipping, as the Trainer logs it.
    norms = [(m["grad_norm"], h["grad_norm"]) for m, h in zip(read_metrics(run), [
        h for h in theirs.state.log_history if "loss" in h], strict=True)]
    assert all(a == pytest.approx(b, rel=1e-5) for a, b in norms), norms
    assert ours[-1] < ours[0] - 0.03, ours   # it learned: the steps compared are not all ln 2
    trained = load_full_model(catalog.resolve(str(ckpt))).state_dict()
    for name, value in theirs.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_lora_dpo_s_reference_is_the_base_with_adapters_off_and_full_dpo_s_a_frozen_copy_of_the_start(tmp_path):
    """No second model under LoRA (the reference holds no parameter of its own); without LoRA a
    frozen copy with exactly the starting weights, whatever the policy has become."""
    transformers = require("transformers")
    folder = tiny_qwen(tmp_path / "m", transformers)
    data = preference_data(tmp_path / "data")
    rt = Runtime(0, 1, 0, 1, torch.device("cpu"))
    common = ["--objective", "dpo", "--data-format", "preference", "--dataset", data, "--init-from-hf", str(folder),
              "--seq-len", "64", "--tokenizer", str(folder)]
    lora_cfg = parse_args([*common, "--lora", "1", "--lora-rank", "4"])
    lora = trainer._objective(lora_cfg, rt, None)
    assert isinstance(lora, DPO) and lora.reference is None
    policy = build_model(lora_cfg.shape, lora_cfg.parallel, 64, 0, rt, lora_cfg.lora_shape)
    load_hf_into(policy, folder, lora_cfg.shape)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.01)   # adapters that change the model
    tokens = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    base = load_ours(folder)
    with torch.no_grad():
        adapted = policy(tokens)
        with adapters_disabled(policy):
            off = policy(tokens)
        assert torch.equal(policy(tokens), adapted)   # back on after the block
    torch.testing.assert_close(off, base(tokens), rtol=0, atol=1e-5)
    assert (adapted - off).abs().max() > 1e-3

    full_cfg = parse_args(common)
    full = trainer._objective(full_cfg, rt, None)
    assert isinstance(full, DPO) and full.reference is not None
    assert not any(p.requires_grad for p in full.reference.parameters()) and not full.reference.training
    start = dict(base.state_dict())
    assert all(torch.equal(t, start[k]) for k, t in full.reference.state_dict().items())
    assert sum(p.numel() for p in full.reference.parameters()) == sum(p.numel() for p in base.parameters())


@pytest.mark.slow
def test_a_two_rank_lora_dpo_run_learns_the_preference_against_its_base(tmp_path):
    transformers = require("transformers")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(tmp_path / "qwen")
    data = preference_data(tmp_path / "data")
    r = run_cli(*dpo_flags(data, tmp_path / "run", tmp_path / "ck", "--init-from-hf", str(tmp_path / "qwen"),
                           "--lora", "1", "--lora-rank", "8", "--lr", "5e-3", "--max-steps", "40"))
    assert r.returncode == 0, r.stderr[-3000:]
    accuracy = [row["rewards/accuracies"] for row in rows_of(tmp_path / "run")]
    assert accuracy[0] < 0.6 and accuracy[-1] > 0.75, accuracy


@pytest.mark.parametrize("form", ["text", "messages", "implicit"])
def test_pairs_are_tokenised_as_trl_s_dpo_trainer_tokenises_them(tmp_path, form):
    """The same records through TRL's own preprocessing (DPOTrainer's dataset preparation) and
    through encode_pair: the same prompt, chosen and rejected token ids."""
    transformers, trl = require("transformers"), require("trl")
    from datasets import Dataset

    folder = tiny_qwen(tmp_path / "m", transformers)
    system = {"role": "system", "content": "You are terse."}
    records = []
    for a, b in ((2, 3), (10, 7), (4, 4)):
        question = {"role": "user", "content": f"What is {a} plus {b}?"}
        right = {"role": "assistant", "content": f"It is {a + b}."}
        wrong = {"role": "assistant", "content": f"It is {a + b + 1}, I think."}
        records.append({"text": {"prompt": f"What is {a} plus {b}?", "chosen": f" {a + b}.", "rejected": " no."},
                        "messages": {"prompt": [system, question], "chosen": [right], "rejected": [wrong],
                                     "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]},
                        "implicit": {"chosen": [system, question, right], "rejected": [system, question, wrong]}}[form])
    # The tokenizer's own folder (no model config beside it: transformers then takes its tokenizer.json as it
    # is), with Qwen 2.5's template as the model ships it (it renders the tools).
    qwen = (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    tok_folder = make_tokenizer(tmp_path / "tok", qwen)
    theirs = trl.DPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(str(folder)),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True),
        processing_class=transformers.AutoTokenizer.from_pretrained(str(tok_folder)),
        train_dataset=Dataset.from_list(records)).train_dataset
    tok = HFTokenizer(str(tok_folder))
    template = template_of(None, tok.config, tok.directory)
    for i, record in enumerate(records):
        pair = encode_pair(preference_of(record, f"r{i}"), tok.encode, template, tok.eos_id)
        assert (pair.prompt.tolist(), pair.chosen.tolist(), pair.rejected.tolist()) == (
            theirs[i]["prompt_ids"], theirs[i]["chosen_ids"], theirs[i]["rejected_ids"])
        assert len(pair.chosen) and len(pair.rejected) and len(pair.prompt)
        if "tools" in record:
            assert "add" in tok.decode(pair.prompt)   # the tool's schema is in the prompt


def test_a_template_that_refuses_a_preference_names_its_record():
    refuses = ChatTemplate("{{ raise_exception('no system turns here') }}", {}, "r.jinja")
    p = preference_of({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
                       "rejected": [{"role": "assistant", "content": "b"}]}, "prefs.jsonl:7")
    with pytest.raises(UserError) as e:
        encode_pair(p, lambda text: np.array([1]), refuses, 0)
    assert str(e.value) == "chat_template: r.jinja refused prefs.jsonl:7: no system turns here"


def test_each_answer_s_log_probabilities_are_summed_by_its_sequence_number():
    """Hand-made rows: a full row of one-token answers (the most pairs a row holds), a padded row."""
    seqs = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 1, 2, 2, 0, 0]])
    targets = torch.tensor([[7, 7, 7, 7, 7, 7], [IGNORE, 7, IGNORE, 7, IGNORE, IGNORE]])
    logps = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [-9.0, -1.5, -9.0, -2.5, -9.0, -9.0]])
    got = answers(logps, targets, seqs)
    assert got.chosen.tolist() == [[-1.0, -3.0, -5.0], [-1.5, 0.0, 0.0]]
    assert got.rejected.tolist() == [[-2.0, -4.0, -6.0], [-2.5, 0.0, 0.0]]
    assert got.chosen_tokens.tolist() == got.rejected_tokens.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert got.present.tolist() == [[True, True, True], [True, False, False]]
    # A row one token longer holds one more pair (numbers up to width + 1) without spilling into the next row.
    wide = answers(torch.full((2, 7), -1.0), torch.full((2, 7), 7), torch.tensor([[1, 2, 3, 4, 5, 6, 7]] * 2))
    assert wide.chosen.shape == (2, 4) and wide.chosen.tolist() == [[-1.0, -1.0, -1.0, -1.0]] * 2
    assert wide.present.tolist() == [[True, True, True, False]] * 2


def test_the_dpo_objective_is_the_loss_of_the_policy_s_and_the_reference_s_answers(tmp_path):
    """Through the objective the trainer calls: with LoRA the reference is the same model with its
    adapters off; the outcome equals preference_loss on answers computed by hand from each."""
    transformers = require("transformers")
    folder = tiny_qwen(tmp_path / "m", transformers)
    tok = HFTokenizer(str(folder))
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    (data / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "chosen": f"{2 * i}",
                                                      "rejected": f"{2 * i + 1}"}) + "\n" for i in range(8)))
    batch = next(iter(BatchStream(LocalFiles(str(tmp_path / "data"), "train", 0, data_format="preference"), tok, 47,
                                  2, shuffle_buffer=0, epochs=1, preference=True)))
    rt = Runtime(0, 1, 0, 1, torch.device("cpu"))
    cfg = parse_args(["--init-from-hf", str(folder), "--lora", "1", "--lora-rank", "4", "--seq-len", "48"])
    model = build_model(cfg.shape, cfg.parallel, 48, 0, rt, cfg.lora_shape)
    load_hf_into(model, folder, cfg.shape)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    step = DPO(None, 0.25, "sigmoid")(model, batch, torch.device("cpu"))
    with torch.no_grad():
        policy = answers(model.token_logps(batch.inputs, batch.targets, batch.docs), batch.targets, batch.docs)
        with adapters_disabled(model):
            ref = answers(model.token_logps(batch.inputs, batch.targets, batch.docs), batch.targets, batch.docs)
    expected = preference_loss(policy, ref, 0.25, "sigmoid")
    assert step.loss.item() == pytest.approx(expected.loss.item(), abs=1e-6) and step.loss is step.total
    assert step.sums is not None and step.sums.tolist() == pytest.approx([*expected.sums.tolist(),
                                                                          expected.pairs.item()], abs=1e-5)
    assert int(step.sums[-1]) == int(policy.present.sum()) > 4 and step.loss.requires_grad
    assert abs(step.sums[3].item()) > 1e-4   # the adapters make the policy differ from its reference


def test_metrics_are_their_sums_over_the_pairs_counted():
    assert means(torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0, -6.0, 4.0])) == {
        "rewards/chosen": 0.25, "rewards/rejected": -0.5, "rewards/accuracies": 0.75, "rewards/margins": 1.0,
        "logps/chosen": -1.25, "logps/rejected": -1.5}
    assert means(torch.zeros(7)) == dict.fromkeys(METRICS, 0.0)   # no pair: zeros, not a division by zero

