"""The one YAML loader: what it refuses (a key twice, an alias bomb, a cycle, a huge file) and what
it reads as YAML 1.2 does."""

from __future__ import annotations

import pytest
import yaml

from fsdpkit import yamlfile
from fsdpkit.errors import UserError


def test_a_key_given_twice_is_refused_where_it_is_given_again():
    with pytest.raises(yaml.YAMLError) as e:
        yamlfile.load("optim:\n  lr: 0.001\n  warmup_steps: 5\n  lr: 0.1\n")
    assert yamlfile.describe_yaml_error(e.value) == "line 4, column 3: 'lr' is given twice in one mapping (keep one)"
    # The same key in two mappings, and a merge key overridden locally, are fine.
    assert yamlfile.load("a: {k: 1}\nb: {k: 2}\n") == {"a": {"k": 1}, "b": {"k": 2}}
    assert yamlfile.load("base: &b {k: 1, j: 2}\nx:\n  <<: *b\n  k: 3\n")["x"] == {"k": 3, "j": 2}


def test_aliases_that_would_expand_past_the_cap_are_refused_and_shared_ones_are_not():
    levels = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
    with pytest.raises(yaml.YAMLError, match="aliases expand to more than 200,000 nodes"):
        yamlfile.load(levels)
    three = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(3))
    assert len(yamlfile.load(three)["d"]) == 9  # 9**4 nodes: well under the cap
    with pytest.raises(yaml.YAMLError):
        yamlfile.load("a: &a [1, *a]\n")  # a node that contains itself


def test_booleans_and_numbers_as_yaml_1_2_reads_them():
    doc = yamlfile.load("a: yes\nb: on\nc: true\nd: False\ne: 2:4\nf: 0x1f\n")
    assert doc == {"a": "yes", "b": "on", "c": True, "d": False, "e": "2:4", "f": 31}


def test_a_file_over_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# padding\n" * (yamlfile.MAX_BYTES // 10 + 1))
    reads = []
    monkeypatch.setattr(type(big), "read_text", lambda self, *a, **k: reads.append(self) or "")
    with pytest.raises(UserError, match=r"big.yaml is 4.0 MiB; fsdpkit reads YAML files of up to 4 MiB"):
        yamlfile.load_mapping(big, "job spec", "fields")
    assert reads == []
    with pytest.raises(yaml.YAMLError, match="up to 4 MiB"):
        yamlfile.load("x" * (yamlfile.MAX_BYTES + 1))
