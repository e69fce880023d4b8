"""What an export writes about where it came from (fsdpkit.train.export)."""

from __future__ import annotations

from pathlib import Path

from fsdpkit.train.checkpoint.catalog import CheckpointInfo
from fsdpkit.train.export import base_of, peft_config
from fsdpkit.train.model.config import LoraShape


def test_a_peft_adapter_names_its_base_by_an_absolute_path_when_the_run_gave_a_relative_one(tmp_path, monkeypatch):
    (tmp_path / "models" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    info = CheckpointInfo(tmp_path / "ck" / "step-00000002", 2,
                          {"config": {"checkpoint": {"init_from_hf": "models/base"}}})
    lora = LoraShape(rank=4, alpha=8.0, dropout=0.0, targets=("q_proj",))
    config = peft_config(lora, {}, base_of(info))
    assert config["base_model_name_or_path"] == str(tmp_path / "models" / "base")
    assert Path(config["base_model_name_or_path"]).is_absolute()
