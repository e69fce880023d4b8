"""The checkpointer in this process, one rank, on a two-layer model with AdamW state: what a save
leaves on disk (the complete name, fsdpkit.json, the kept ones), what verify says of each kind of
damage, what resume loads (the exact tensors, the next older checkpoint past a damaged one) and what
it refuses, in words. tests/train/checkpoint/test_checkpoint.py runs the same code under torchrun."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint.catalog import resolve
from fsdpkit.train.checkpoint.checkpointer import (
    Checkpointer,
    DamagedCheckpoint,
    check_shape,
    prune,
    resume,
    set_aside,
    verify,
)
from fsdpkit.train.model.presets import PRESETS
from fsdpkit.train.runtime.dist import Runtime

RT = Runtime(0, 1, 0, 1, torch.device("cpu"))
SHAPE = json.loads(json.dumps(dataclasses.asdict(PRESETS["tiny"])))
META = {"samples": 64, "model": SHAPE}


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its AdamW after one step, every value decided by `seed`."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param {k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        out |= {f"optim {i} {k}": torch.as_tensor(v).clone() for k, v in state.items()}
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def saved(directory: Path, steps: list[int], keep_last: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of `steps`, each of the model as trained with the step as its seed."""
    ck = Checkpointer(directory, RT, keep_last=keep_last)
    out = {}
    for step in steps:
        model, optimizer = trained(step)
        assert ck.save(step, model, optimizer, META) == directory / f"step-{step:08d}"
        out[step] = tensors(model, optimizer)
    return out


def test_a_save_is_complete_under_its_step_s_name_with_its_record_and_keep_last_keeps_the_newest(tmp_path):
    saved(tmp_path, [1, 2, 3], keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    assert json.loads((tmp_path / "step-00000003" / "fsdpkit.json").read_text()) == {
        "step": 3, "world_size": 1, "samples": 64, "model": SHAPE}
    assert {p.name for p in (tmp_path / "step-00000003").iterdir()} == {".metadata", "__0_0.distcp", "fsdpkit.json"}
    # keep_last 0 keeps every one; a save of a step that exists replaces it.
    saved(tmp_path / "all", [1, 2, 3, 2])
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]


def test_a_new_checkpointer_clears_the_half_written_saves_a_killed_run_left(tmp_path):
    (tmp_path / ".step-00000005.tmp").mkdir(parents=True)
    (tmp_path / ".step-00000005.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "notes").mkdir()
    Checkpointer(tmp_path, RT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_verify_names_what_is_wrong_with_a_checkpoint(tmp_path):
    saved(tmp_path, [3])
    ck = tmp_path / "step-00000003"
    assert verify(ck) is None
    data = ck / "__0_0.distcp"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:-1])
    assert verify(ck) == f"__0_0.distcp is truncated ({size - 1} of {size} bytes)"
    data.unlink()
    assert verify(ck) == "__0_0.distcp is missing"
    (ck / ".metadata").write_bytes(b"garbage")
    assert verify(ck).startswith("its index (.metadata) cannot be read (")
    (ck / "fsdpkit.json").write_text(json.dumps({"step": 7}))
    assert verify(ck) == "fsdpkit.json names step 7, the directory step 3"


def test_resume_loads_the_exact_tensors_of_the_newest_and_sets_a_damaged_one_aside(tmp_path, caplog):
    states = saved(tmp_path, [1, 2, 3])
    model, optimizer = trained(99)
    info = resume(str(tmp_path), model, optimizer, SHAPE, RT)
    assert info is not None and info.step == 3 and same(tensors(model, optimizer), states[3])
    # The newest damaged: set aside (never deleted) and the next older loaded, with a warning saying so.
    (tmp_path / "step-00000003" / "__0_0.distcp").unlink()
    model, optimizer = trained(99)
    with caplog.at_level(logging.WARNING):
        info = resume(str(tmp_path), model, optimizer, SHAPE, RT)
    assert info is not None and info.step == 2 and same(tensors(model, optimizer), states[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002", "step-00000003.damaged"]
    assert f"checkpoint {tmp_path / 'step-00000003'} is damaged (__0_0.distcp is missing); set aside as " \
           "step-00000003.damaged, trying the next older one" in caplog.text
    # A checkpoint named directly must load: damaged, it is refused in one line, nothing set aside.
    (tmp_path / "step-00000002" / "__0_0.distcp").unlink()
    with pytest.raises(DamagedCheckpoint) as e:
        resume(str(tmp_path / "step-00000002"), *trained(99), SHAPE, RT)
    assert str(e.value) == (f"resume_from_checkpoint: {tmp_path / 'step-00000002'} is damaged and cannot be read "
                            "(__0_0.distcp is missing)")
    assert (tmp_path / "step-00000002").is_dir()
    # Nothing to resume from: None, and the model as it was.
    model, optimizer = trained(99)
    before = tensors(model, optimizer)
    assert resume(str(tmp_path / "empty"), model, optimizer, SHAPE, RT) is None
    assert same(tensors(model, optimizer), before)


def test_a_damaged_checkpoint_set_aside_twice_gets_a_new_name_each_time(tmp_path):
    for n in range(3):
        (tmp_path / "step-00000004").mkdir()
        moved = set_aside(tmp_path / "step-00000004", RT)
        assert moved.name == ["step-00000004.damaged", "step-00000004.damaged.1", "step-00000004.damaged.2"][n]
    assert not (tmp_path / "step-00000004").exists()


def test_resume_refuses_another_shape_and_says_what_differs_in_flag_words(tmp_path):
    saved(tmp_path, [1])
    info = resolve(str(tmp_path))
    assert info is not None
    check_shape(info, SHAPE)   # the same shape: nothing to say
    where = f"resume_from_checkpoint: {tmp_path / 'step-00000001'}"
    with pytest.raises(UserError) as e:
        check_shape(info, {**SHAPE, "n_layers": 6, "dim": 256})
    assert str(e.value) == (f"{where} holds a model of another shape: dim 128 (this run: 256), n_layers 4 (this run: "
                            "6); resume with the same model settings, or point --checkpoint-dir elsewhere")
    lora = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    with pytest.raises(UserError) as e:
        check_shape(info, {**SHAPE, "lora": lora})
    assert str(e.value).startswith(f"{where} holds a whole model, and this run trains LoRA adapters; export it")
    # A LoRA checkpoint: the adapters' own settings are named as their flags are.
    record = tmp_path / "step-00000001" / "fsdpkit.json"
    record.write_text(json.dumps({"step": 1, "model": {**SHAPE, "lora": lora}}))
    info = resolve(str(tmp_path))
    with pytest.raises(UserError) as e:
        check_shape(info, SHAPE)
    assert str(e.value).startswith(f"{where} holds LoRA adapters (rank 8), and this run trains the whole model; "
                                   "resume it with --lora 1")
    with pytest.raises(UserError) as e:
        check_shape(info, {**SHAPE, "lora": {**lora, "rank": 4, "targets": ["q_proj"]}})
    assert str(e.value) == (f"{where} holds a model of another shape: lora_rank 8 (this run: 4), lora_targets "
                            "q_proj,v_proj (this run: q_proj); resume with the same model settings, or point "
                            "--checkpoint-dir elsewhere")


def test_a_checkpoint_recorded_before_a_shape_field_existed_has_its_default(tmp_path):
    saved(tmp_path, [1])
    record = tmp_path / "step-00000001" / "fsdpkit.json"
    older = {k: v for k, v in SHAPE.items() if k not in ("qkv_bias", "qk_norm")}
    record.write_text(json.dumps({"step": 1, "model": older}))
    check_shape(resolve(str(tmp_path)), SHAPE)


def test_prune_keeps_every_checkpoint_at_zero_and_only_rank_0_deletes(tmp_path):
    saved(tmp_path, [1, 2, 3])
    prune(tmp_path, 0, RT)
    prune(tmp_path, 1, Runtime(1, 2, 1, 2, torch.device("cpu")))
    assert len(list(tmp_path.iterdir())) == 3
    prune(tmp_path, 1, RT)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
