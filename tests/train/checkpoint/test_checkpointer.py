"""The checkpointer in this process, one rank, on a two-layer model with AdamW state: what a save
leaves on disk (the complete name, fsdpkit.json, the kept ones), what verify says of each kind of
damage, what resume loads (the exact tensors, the next older checkpoint past a damaged one) and what
it refuses, in words; a save in the background, a save that fails, and the memory tier's turn at
resume. tests/train/checkpoint/test_checkpoint.py runs the same code under torchrun."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint.catalog import resolve
from fsdpkit.train.checkpoint.checkpointer import (
    Checkpointer,
    DamagedCheckpoint,
    SaveFailed,
    _tensor_bytes,
    check_shape,
    describe_error,
    prune,
    resume,
    save_failure,
    set_aside,
    trained_state,
    training_state,
    verify,
)
from fsdpkit.train.checkpoint.one_process import ASSUMED_ONE_PROCESS
from fsdpkit.train.checkpoint.tiered import MemoryTier
from fsdpkit.train.model.presets import PRESETS
from fsdpkit.train.runtime.dist import Runtime

from conftest import require
from memory_store import MemoryStore

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
    # fsdpkit.json as people read it: indented.
    assert (tmp_path / "step-00000003" / "fsdpkit.json").read_text() == json.dumps(
        {"step": 3, "world_size": 1, "data_ranks": 1, "samples": 64, "model": SHAPE}, indent=2)
    assert {p.name for p in (tmp_path / "step-00000003").iterdir()} == {".metadata", "__0_0.distcp", "fsdpkit.json"}
    # keep_last 0 keeps every one; a save of a step that exists replaces it.
    saved(tmp_path / "all", [1, 2, 3, 2])
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]


def test_one_process_saves_and_resumes_say_nothing_of_it_and_dcp_elsewhere_still_does(tmp_path):
    """Without a process group DCP warns that it assumes one process: around the checkpointer's save
    and resume that is the intent, and nothing is said; the silence is theirs only, so a DCP call
    of anyone else's in the same interpreter still warns."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        saved(tmp_path / "ck", [1])
        assert resume(str(tmp_path / "ck"), *trained(5), SHAPE, RT).step == 1
        dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(tmp_path / "theirs"))
    assert [str(w.message) for w in seen if ASSUMED_ONE_PROCESS in str(w.message)] == [
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a single "
        "process."]


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
    aside = ck.rename(tmp_path / "step-00000003.damaged")
    assert verify(aside) == "fsdpkit.json names step 7, the directory step None"


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
    # A whole checkpoint named directly: that one, whatever is newer beside it.
    model, optimizer = trained(99)
    info = resume(str(tmp_path / "step-00000001"), model, optimizer, SHAPE, RT)
    assert info is not None and info.step == 1 and same(tensors(model, optimizer), states[1])
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
    assert str(e.value) == (f"{where} holds a whole model, and this run trains LoRA adapters; export it and start "
                            "from that with --init-from-hf and another --checkpoint-dir, or resume it without --lora")
    # A LoRA checkpoint: the adapters' own settings are named as their flags are.
    record = tmp_path / "step-00000001" / "fsdpkit.json"
    record.write_text(json.dumps({"step": 1, "model": {**SHAPE, "lora": lora}}))
    info = resolve(str(tmp_path))
    with pytest.raises(UserError) as e:
        check_shape(info, SHAPE)
    assert str(e.value) == (f"{where} holds LoRA adapters (rank 8), and this run trains the whole model; resume it "
                            "with --lora 1 and the same adapter settings, or export it (adapters merged) and start "
                            "from that with --init-from-hf and another --checkpoint-dir")
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
    # The padding row (a config's pad_token_id) is no shape: a checkpoint of before it was read, or
    # of another padding token, resumes, that row frozen from then on.
    check_shape(resolve(str(tmp_path)), {**SHAPE, "pad_token_id": 5})
    record.write_text(json.dumps({"step": 1, "model": {**SHAPE, "pad_token_id": 0}}))
    check_shape(resolve(str(tmp_path)), {**SHAPE, "pad_token_id": 5})


def test_prune_keeps_every_checkpoint_at_zero_and_only_rank_0_deletes(tmp_path):
    saved(tmp_path, [1, 2, 3])
    prune(tmp_path, 0, RT)
    prune(tmp_path, 1, Runtime(1, 2, 1, 2, torch.device("cpu")))
    assert len(list(tmp_path.iterdir())) == 3
    prune(tmp_path, 1, RT)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]


def test_a_save_of_a_step_that_exists_replaces_it_with_the_new_tensors(tmp_path):
    states = saved(tmp_path, [2])
    again = saved(tmp_path, [2]) | {}
    model, optimizer = trained(7)
    Checkpointer(tmp_path, RT).save(2, model, optimizer, {**META, "samples": 9})
    assert json.loads((tmp_path / "step-00000002" / "fsdpkit.json").read_text())["samples"] == 9
    loaded = trained(99)
    resume(str(tmp_path), *loaded, SHAPE, RT)
    assert same(tensors(*loaded), tensors(model, optimizer)) and not same(tensors(*loaded), states[2] | again[2])


def test_only_rank_0_clears_half_written_saves_and_only_those(tmp_path):
    for name in (".step-00000005.tmp", ".step-5.tmp", "step-00000004", ".step-00000006.tmp.keep", "step-7.tmp"):
        (tmp_path / name).mkdir()
    Checkpointer(tmp_path, Runtime(1, 2, 1, 2, torch.device("cpu")))
    assert len(list(tmp_path.iterdir())) == 5
    Checkpointer(tmp_path, RT)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000006.tmp.keep", "step-00000004", "step-7.tmp"]


def test_a_background_save_becomes_visible_at_wait_or_at_the_next_save_with_the_exact_tensors(tmp_path):
    ck = Checkpointer(tmp_path, RT, async_mode=True)
    model, optimizer = trained(1)
    assert ck.save(1, model, optimizer, META) == tmp_path / "step-00000001"
    assert not (tmp_path / "step-00000001").exists()   # written in the background, not yet complete
    second = trained(2)
    ck.save(2, *second, META)
    assert [c.name for c in tmp_path.iterdir() if not c.name.startswith(".")] == ["step-00000001"]
    ck.wait()
    ck.wait()   # nothing pending: nothing to do
    assert sorted(c.name for c in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    assert json.loads((tmp_path / "step-00000002" / "fsdpkit.json").read_text()) == {
        "step": 2, "world_size": 1, "data_ranks": 1, "samples": 64, "model": SHAPE}
    loaded = trained(99)
    assert resume(str(tmp_path), *loaded, SHAPE, RT).step == 2
    assert same(tensors(*loaded), tensors(*second))
    assert ck.blocked_s > 0


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_save_that_cannot_be_written_fails_in_one_line_naming_the_step_and_directory(tmp_path, async_mode):
    ck = Checkpointer(tmp_path, RT, async_mode=async_mode)
    (tmp_path / ".step-00000003.tmp").write_text("a file where the save's directory goes")
    with pytest.raises(SaveFailed) as e:
        ck.save(3, *trained(1), META)
        ck.wait()
    message = str(e.value)
    assert message.startswith(f"checkpoint: saving step 3 to {tmp_path} failed: ")
    assert "FileExistsError" in message or "File exists" in message, message
    assert message.endswith("; free space there or point --checkpoint-dir at a larger file system, then resume "
                            "with --resume-from-checkpoint auto")
    assert "\n" not in message and (e.value.code, e.value.exit_code) == ("failed", 1)
    assert not (tmp_path / "step-00000003").exists()


@pytest.mark.parametrize(("code", "words"), [
    (errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded"),
    (errno.EACCES, "permission denied"), (errno.EPERM, "permission denied"), (errno.EROFS, "read-only file system"),
])
def test_an_os_error_anywhere_in_a_save_s_failure_is_named_with_its_file(tmp_path, code, words):
    direct = OSError(code, os.strerror(code), "/fsx/ckpt/x.distcp")
    assert save_failure(direct, tmp_path, 0) == f"{words} (/fsx/ckpt/x.distcp)"
    # Without a file name, the checkpoint directory; as the cause or context of what DCP raised.
    try:
        try:
            raise OSError(code, os.strerror(code))
        except OSError as inner:
            raise RuntimeError("zip writer failed") from inner
    except RuntimeError as outer:
        assert save_failure(outer, tmp_path, 0) == f"{words} ({tmp_path})"
    try:
        try:
            raise OSError(code, os.strerror(code), "f")
        except OSError:
            raise ValueError("while cleaning up") from None
    except ValueError as hidden:
        # Raised while handling it, even with `from None` (a library hiding the disk's own error).
        assert save_failure(hidden, tmp_path, 0) == f"{words} (f)"


def dcp_failure(error: BaseException) -> CheckpointException:
    """What DCP raises: one failure per rank, each the exception and its traceback."""
    return CheckpointException("save failed on rank 1", {1: (error, None)})


def test_a_rank_s_failure_inside_dcp_s_error_is_found_and_described():
    assert save_failure(dcp_failure(OSError(errno.ENOSPC, "full", "/fsx/__1_0.distcp")), Path("/"), 0) == \
        "no space left on device (/fsx/__1_0.distcp)"
    assert describe_error(dcp_failure(ValueError("bad shard\nsecond line"))) == "ValueError: bad shard"
    assert describe_error(CheckpointException("x", {0: ValueError("plain")})) == "ValueError: plain"
    wrapped = types.SimpleNamespace(exc=(ValueError("wrapped"), None))   # what older torch wraps a failure in
    assert describe_error(CheckpointException("x", {0: wrapped})) == "ValueError: wrapped"
    assert save_failure(CheckpointException("x", {0: wrapped}), Path("/"), 0) == "ValueError: wrapped"
    bare = OSError(errno.EDQUOT, "quota", "/fsx/q")
    assert save_failure(CheckpointException("x", {0: bare}), Path("/"), 0) == "disk quota exceeded (/fsx/q)"
    assert save_failure(CheckpointException("x", {0: types.SimpleNamespace(exc=bare)}), Path("/"), 0) == \
        "disk quota exceeded (/fsx/q)"
    assert describe_error(KeyError("")) == "KeyError: ''"
    assert describe_error(RuntimeError()) == "RuntimeError"
    assert describe_error(RuntimeError("  \n  ")) == "RuntimeError"
    assert describe_error(RuntimeError("first\nsecond")) == "RuntimeError: first"


def test_the_search_for_an_os_error_follows_fifty_errors_and_survives_a_cycle(tmp_path):
    def chain(depth: int) -> BaseException:
        err: BaseException = OSError(errno.EROFS, "ro", "deep")
        for i in range(depth):
            wrapper = RuntimeError(f"level {i}")
            wrapper.__cause__ = err
            err = wrapper
        return err

    assert save_failure(chain(49), tmp_path, 0) == "read-only file system (deep)"
    assert save_failure(chain(50), tmp_path, 0) == "RuntimeError: level 49"
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert save_failure(a, tmp_path, 0) == "RuntimeError: a"


def test_a_disk_with_less_room_than_this_rank_s_share_is_named_with_its_sizes(tmp_path):
    st = os.statvfs(tmp_path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    needed = free + 2**20
    assert save_failure(RuntimeError("zip writer"), tmp_path, needed) == (
        f"no space left on device ({tmp_path}: {free / 2**20:,.1f} MiB free of {total / 2**20:,.1f} MiB; "
        f"this rank's share of the checkpoint is {needed / 2**20:,.1f} MiB)")
    assert save_failure(RuntimeError("zip writer"), tmp_path, free) == "RuntimeError: zip writer"
    assert save_failure(RuntimeError("zip writer"), tmp_path / "gone", needed) == "RuntimeError: zip writer"


def test_a_frozen_weight_is_left_out_under_each_of_its_names():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[1].weight = model[0].weight   # tied, as an embedding and its head
    model[0].weight.requires_grad_(False)
    assert sorted(trained_state(model)) == ["0.bias", "1.bias"]


def test_a_rank_s_share_counts_every_tensor_it_writes():
    model, optimizer = trained(1)
    # 23 parameters of four bytes (92), AdamW's two moments of each (184), a four-byte step per tensor (16).
    assert _tensor_bytes(training_state(model, optimizer)) == 292
    assert _tensor_bytes({"a": [torch.zeros(3, dtype=torch.bfloat16), (torch.zeros(2, dtype=torch.int64), 5)],
                          "b": "text"}) == 22


@pytest.fixture
def tier(tmp_path, monkeypatch):
    require("amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem")
    store = MemoryStore()
    for k, v in store.env.items():
        monkeypatch.setenv(k, v)
    tier = MemoryTier.open(tmp_path / "job" / "checkpoints", RT)
    assert tier is not None
    yield tier, store
    store.close()


def test_resume_takes_the_memory_tier_only_where_its_newest_is_newer_than_shared_storage_s(tmp_path, tier, caplog):
    memory, store = tier
    directory = tmp_path / "job" / "checkpoints"
    ck = Checkpointer(directory, RT, tier=memory)
    states = {}
    for step, durable in ((2, True), (4, False)):
        model, optimizer = trained(step)
        where = ck.save(step, model, optimizer, META, durable=durable)
        states[step] = tensors(model, optimizer)
        expected = directory / "step-00000002" if durable else f"memory:{memory.namespace}/step-00000004"
        assert str(where) == str(expected)
    loaded = trained(99)
    info = resume(str(directory), *loaded, SHAPE, RT, tier=memory)
    assert (str(info.path), info.step, info.meta["world_size"]) == (f"memory:{memory.namespace}/step-00000004", 4, 1)
    assert same(tensors(*loaded), states[4])
    # Shared storage as new as the tier (or newer) wins: its copy is the durable one.
    model, optimizer = trained(4)
    ck.save(4, model, optimizer, META)
    loaded = trained(99)
    assert resume(str(directory), *loaded, SHAPE, RT, tier=memory).path == directory / "step-00000004"
    # A tier that lists a step it cannot give back: shared storage's newest, said once.
    store.complete_steps = lambda namespace: [8]
    loaded = trained(99)
    with caplog.at_level(logging.WARNING):
        assert resume(str(directory), *loaded, SHAPE, RT, tier=memory).path == directory / "step-00000004"
    assert same(tensors(*loaded), tensors(model, optimizer))
    assert caplog.text.count(f"the in-memory store ({memory.namespace}) failed reading step 8") == 1


def test_a_memory_checkpoint_of_another_shape_is_refused_as_a_shared_one_is(tmp_path, tier):
    memory, _ = tier
    ck = Checkpointer(tmp_path / "job" / "checkpoints", RT, tier=memory)
    ck.save(6, *trained(6), META, durable=False)
    with pytest.raises(UserError) as e:
        resume(str(tmp_path / "job" / "checkpoints"), *trained(99), {**SHAPE, "dim": 256}, RT, tier=memory)
    assert str(e.value) == (f"resume_from_checkpoint: memory:{memory.namespace}/step-00000006 holds a model of "
                            "another shape: dim 128 (this run: 256); resume with the same model settings, or point "
                            "--checkpoint-dir elsewhere")
