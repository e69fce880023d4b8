"""`fsdpkit image check`: PyTorch / CUDA / EFA conflicts in a Dockerfile and its requirements files,
each with the fix; `fix` rewrites the files so that the check finds none.

Conflict classes:
- torch-family: torchvision / torchaudio pinned to a release built for another torch;
- cuda-wheel: a torch wheel (index URL or +cuXYZ local version) for another CUDA than the base;
- torch-replacer: an unpinned install of a package that pulls its own torch (vllm, xformers, ...)
  without the constraints file that holds torch in place;
- efa: a base image without EFA / aws-ofi-nccl, where multi-node NCCL would fall back to TCP;
- torch-pin: a requirement (or a constraints file it names) pinning another torch than the base's,
  which the image's constraints file holds: the build fails;
- cuda-lib-pin: a pin of NCCL or Triton other than the version the base's torch release requires;
- agent-torch: HyperPod's elastic agent on a torch it does not run on (1.1.3 requires torch < 2.12, whose
  torchrun has no --shutdown-timeout of its own: on a newer one hyperpodrun cannot even parse its flags).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fsdpkit.image.dockerfile import BASES, DEFAULT_BASE, has_ofi_nccl

# torch 2.N pairs with torchvision 0.(N+15) and torchaudio 2.N.
REPLACERS = ("vllm", "xformers", "deepspeed", "flash-attn", "flash_attn", "torchao", "bitsandbytes")
_PIN = re.compile(r"^\s*(torch|torchvision|torchaudio)\s*==\s*([0-9][0-9a-z.+]*)", re.I)
_ANY_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*==\s*([0-9][0-9A-Za-z.+!]*)")
_CONSTRAINT = re.compile(r"^\s*(?:-c|--constraint)[\s=]+(\S+)")
# What the torch wheel of each release requires of the NCCL and Triton pip installs beside it (its
# Requires-Dist on PyPI, Linux x86-64): pinning other versions replaces what torch was built with.
TORCH_COMPANIONS: dict[str, dict[str, str]] = {
    "2.4": {"nvidia-nccl-cu12": "2.20.5", "triton": "3.0.0"},
    "2.5": {"nvidia-nccl-cu12": "2.21.5", "triton": "3.1.0"},
    "2.6": {"nvidia-nccl-cu12": "2.21.5", "triton": "3.2.0"},
    "2.7": {"nvidia-nccl-cu12": "2.26.2"},
    "2.8": {"nvidia-nccl-cu12": "2.27.3", "triton": "3.4.0"},
    "2.9": {"nvidia-nccl-cu12": "2.27.5", "triton": "3.5.0"},
    "2.10": {"nvidia-nccl-cu12": "2.27.5", "triton": "3.6.0"},
    "2.11": {"nvidia-nccl-cu13": "2.28.9", "triton": "3.6.0"},
    "2.13": {"nvidia-nccl-cu13": "2.29.7", "triton": "3.7.1"},
    "2.14": {"nvidia-nccl-cu13": "2.30.7"},
}
_CUDA_TAG = re.compile(r"(?:cu|cuda)(\d{2})(\d)")
_CUDA_DOTTED = re.compile(r"cuda(\d{2})\.(\d)")


@dataclass
class Conflict:
    kind: str
    file: str
    line: int
    detail: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _minor(v: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", v.split("+")[0])
    return int(parts[0]), int(parts[1])


def expected_pair(torch_version: str) -> dict[str, str]:
    major, minor = _minor(torch_version)
    return {"torchvision": f"0.{minor + 15}", "torchaudio": f"{major}.{minor}"}


def _base_cuda(image: str) -> str | None:
    for b in BASES.values():
        if b.image == image:
            return b.cuda
    m = _CUDA_DOTTED.search(image) or _CUDA_TAG.search(image)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _base_torch(image: str) -> str | None:
    for b in BASES.values():
        if b.image == image:
            return b.torch
    m = re.search(r"(?:pytorch(?:-training)?:|torch)(\d+\.\d+\.\d+)", image)
    return m.group(1) if m else None


def _has_efa(image: str, lines: list[str]) -> bool:
    """The base carries EFA and aws-ofi-nccl, or the Dockerfile installs them (the EFA installer)."""
    return bool(has_ofi_nccl(image)) or any("efa_installer.sh" in ln for ln in lines)


def _cuda_of(text: str) -> str | None:
    m = _CUDA_TAG.search(text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _with_constraints(requirements: Sequence[Path]) -> list[Path]:
    """The requirements files and the constraints files they name (`-c FILE`), each once."""
    out: list[Path] = []
    todo = list(requirements)
    while todo:
        req = todo.pop(0)
        if req in out or not req.is_file():
            continue
        out.append(req)
        todo += [req.parent / m.group(1) for ln in req.read_text().splitlines() if (m := _CONSTRAINT.match(ln))]
    return out


def _pin_conflicts(sources: list[tuple[str, int, str]], dockerfile: Path, base_torch: str | None) -> list[Conflict]:
    """Pins in the requirements (and constraints) that cannot hold on the base: another torch than
    the one the image's constraints file keeps; another NCCL or Triton than that torch requires."""
    if not base_torch:
        return []
    companions = TORCH_COMPANIONS.get(".".join(re.findall(r"\d+", base_torch)[:2]), {})
    out = []
    for file, no, ln in sources:
        if file == str(dockerfile) or not (m := _ANY_PIN.match(ln)):
            continue
        name, version = m.group(1).lower().replace("_", "-"), m.group(2)
        if name == "torch" and version.split("+")[0] != base_torch:
            out.append(Conflict("torch-pin", file, no, f"torch=={version}, but the base's torch is {base_torch} "
                                "and the image's constraints file holds it there: the build fails",
                                f"remove the pin (the image keeps torch {base_torch}), or choose a base with "
                                f"torch {version.split('+')[0]}"))
        elif name in companions and version != companions[name]:
            out.append(Conflict("cuda-lib-pin", file, no, f"{name}=={version}, but the base's torch {base_torch} "
                                f"is built for {name}=={companions[name]}",
                                f"remove the pin: torch {base_torch} brings {name} {companions[name]}"))
    return out


# hyperpod-elastic-agent releases -> the torch (major, minor) they run below (their Requires-Dist).
AGENT_TORCH_BELOW = {"1.1.3": (2, 12)}


def _agent_conflicts(sources: list[tuple[str, int, str]], base_torch: str | None, base: tuple[str, int]
                     ) -> list[Conflict]:
    """The agent pinned anywhere against the base's torch; reported at the FROM line, which the fix changes."""
    if not base_torch:
        return []
    for file, no, ln in sources:
        m = re.search(r"hyperpod-elastic-agent==([0-9.]+)", ln)
        if m and (below := AGENT_TORCH_BELOW.get(m.group(1))) and _minor(base_torch) >= below:
            return [Conflict("agent-torch", *base, f"hyperpod-elastic-agent {m.group(1)} ({file}:{no}) needs torch "
                             f"< {below[0]}.{below[1]}, and the base's torch is {base_torch}: pip cannot install "
                             "it, and its hyperpodrun would not parse its own flags",
                             f"base the image on one with an older torch (fsdpkit image init --base {DEFAULT_BASE} "
                             "--hyperpod)")]
    return []


def check(dockerfile: Path, requirements: Sequence[Path] = ()) -> list[Conflict]:
    lines = dockerfile.read_text().splitlines()
    found: list[Conflict] = []
    image = next((ln.split()[1] for ln in lines if ln.strip().upper().startswith("FROM ")), "")
    cuda, base_torch = _base_cuda(image), _base_torch(image)
    has_constraints = any("PIP_CONSTRAINT" in ln or "-c /etc/pip-constraints.txt" in ln for ln in lines)
    pins: dict[str, tuple[str, str, int]] = {}
    sources = [(str(dockerfile), i + 1, ln) for i, ln in enumerate(lines)]
    for req in _with_constraints(requirements):
        sources += [(str(req), i + 1, ln) for i, ln in enumerate(req.read_text().splitlines())]
    for file, no, ln in sources:
        for w in re.split(r"[\s\"']+", ln):
            if m := _PIN.match(w):
                pins[m.group(1).lower()] = (m.group(2), file, no)
        found += _line_conflicts(file, no, ln, str(dockerfile), image, cuda, has_constraints)
    found += _pin_conflicts(sources, dockerfile, base_torch)
    from_line = 1 + next((i for i, ln in enumerate(lines) if ln.strip().upper().startswith("FROM ")), 0)
    found += _agent_conflicts(sources, base_torch, (str(dockerfile), from_line))
    found += _family_conflicts(pins, base_torch)
    if image and not _has_efa(image, lines):
        found.append(Conflict("efa", str(dockerfile), 1 + next(i for i, ln in enumerate(lines)
                                                               if ln.strip().upper().startswith("FROM ")),
                              f"{image} has no EFA / aws-ofi-nccl: multi-node NCCL would use TCP sockets",
                              "base on an AWS Deep Learning Container (fsdpkit image init --base dlc-2.6)"))
    return found


def _line_conflicts(file: str, no: int, ln: str, dockerfile: str, image: str, cuda: str | None,
                    has_constraints: bool) -> list[Conflict]:
    """A torch wheel for another CUDA, or an unpinned package that replaces torch, on one line."""
    found = []
    if re.search(r"download\.pytorch\.org/whl/cu\d+", ln) or re.search(r"torch==[^\s]*\+cu\d+", ln):
            wheel_cuda = _cuda_of(ln.split("whl/")[-1] if "whl/" in ln else ln.split("+")[-1])
            if cuda and wheel_cuda and wheel_cuda != cuda:
                found.append(Conflict("cuda-wheel", file, no, f"a torch wheel for CUDA {wheel_cuda} on a CUDA {cuda} "
                                      f"base ({image})", f"use the cu{cuda.replace('.', '')} wheels, or drop the "
                                      "torch install and keep the base image's"))
    if ("pip install" in ln or file != dockerfile) and "-c " not in ln and not has_constraints:
        for w in re.split(r"[\s\"']+", ln):
            name = re.split(r"[<>=!~\[]", w)[0].lower()
            if name in REPLACERS and not re.search(r"[<>=~]", w):
                found.append(Conflict("torch-replacer", file, no, f"unpinned {name} pulls its own torch and can "
                                      "replace the base image's", "install it with -c /etc/pip-constraints.txt "
                                      "(a file pinning torch to the base's version), or pin a release built "
                                      "for that torch"))
    return found


def _family_conflicts(pins: dict[str, tuple[str, str, int]], base_torch: str | None) -> list[Conflict]:
    """torchvision, torchaudio and friends pinned for another torch than the one installed."""
    found = []
    torch_v = pins.get("torch", (base_torch, None, 0))[0]
    if torch_v:
        for pkg, want in expected_pair(torch_v).items():
            if pkg in pins and not pins[pkg][0].startswith(want + ".") and pins[pkg][0] != want:
                v, file, no = pins[pkg]
                found.append(Conflict("torch-family", file, no, f"{pkg}=={v} is built for another torch than "
                                      f"{torch_v}", f"pin {pkg}=={want}.* (the release for torch {torch_v})"))
    return found


@dataclass(frozen=True)
class Change:
    """One line `fix` changed: where, as it was (None: a line it added) and as it is now (None: removed)."""

    file: str
    line: int
    before: str | None
    after: str | None


def fix(dockerfile: Path, requirements: Sequence[Path] = ()) -> list[Change]:
    """Rewrite the files so `check` finds nothing; returns each line changed. Fixes can uncover
    others (a new base has another CUDA), so passes repeat until the check is clean."""
    files = [dockerfile, *_with_constraints(requirements)]
    before = {p: p.read_text() for p in files}
    for _ in range(4):
        if not check(dockerfile, requirements):
            break
        _fix_pass(dockerfile, requirements)
    return [change for p in files for change in _changes(str(p), before[p], p.read_text())]


def _changes(file: str, old: str, new: str) -> list[Change]:
    """The lines that differ between two texts of a file, numbered as in the new one (a removed
    line by where it stood)."""
    a, b = old.splitlines(), new.splitlines()
    out: list[Change] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            old_line = a[i1 + k] if i1 + k < i2 else None
            new_line = b[j1 + k] if j1 + k < j2 else None
            out.append(Change(file, (j1 + k if new_line is not None else j1) + 1, old_line, new_line))
    return out


def _fix_pass(dockerfile: Path, requirements: Sequence[Path]) -> None:
    conflicts = check(dockerfile, requirements)
    changed: set[str] = set()
    text = {p: p.read_text() for p in [dockerfile, *_with_constraints(requirements)]}
    lines = text[dockerfile].splitlines()
    image = next((ln.split()[1] for ln in lines if ln.strip().upper().startswith("FROM ")), "")
    for c in conflicts:
        path = Path(c.file)
        if c.kind == "torch-replacer" and path != dockerfile:
            # A requirements file cannot carry -c for one line; the Dockerfile installs it constrained.
            rows_df = text[dockerfile].splitlines()
            rows_df = [r.replace("pip install -r", "pip install -c /etc/pip-constraints.txt -r", 1) for r in rows_df]
            text[dockerfile] = "\n".join(rows_df) + "\n"
            changed.add(str(dockerfile))
            continue
        rows = text[path].splitlines()
        rows[c.line - 1] = _fixed_row(c, rows[c.line - 1], text, image)
        text[path] = "\n".join(rows) + "\n"
        changed.add(str(path))
    if any(c.kind == "torch-replacer" for c in conflicts):
        text[dockerfile] = _writes_constraints(text[dockerfile])
    for p, t in text.items():
        if str(p) in changed:
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(t)
            tmp.replace(p)


def _fixed_row(c: Conflict, row: str, text: dict[Path, str], image: str) -> str:
    """The line of a conflict as `--fix` rewrites it, by its kind; `text` is every file's, for the
    torch version pinned anywhere."""
    if c.kind == "torch-family":
        torch_v = next((m.group(2) for p in text for m in map(_PIN.match, re.split(r"[\s\"']+", text[p]))
                        if m and m.group(1).lower() == "torch"), _base_torch(image))
        assert torch_v is not None  # check() reports this kind only where torch's version is known
        want = expected_pair(torch_v)

        def pinned(m: re.Match[str]) -> str:
            return f"{m.group(1)}=={want[m.group(1).lower()]}.*"
        # The pin whole, a wildcard included: a row with both packages comes here once for each.
        return re.sub(r"(torchvision|torchaudio)\s*==\s*[0-9][0-9a-z.+*]*", pinned, row)
    if c.kind == "cuda-wheel":
        cuda = _base_cuda(image)
        assert cuda is not None  # check() reports this kind only where the base's CUDA is known
        tag = "cu" + cuda.replace(".", "")
        return re.sub(r"\+cu\d+", f"+{tag}", re.sub(r"whl/cu\d+", f"whl/{tag}", row))
    if c.kind == "torch-replacer":
        return row.replace("pip install", "pip install -c /etc/pip-constraints.txt", 1)
    if c.kind in ("torch-pin", "cuda-lib-pin"):
        return f"# {row}  # removed by `fsdpkit image check --fix`: {c.detail.split(', but ')[1].split(':')[0]}"
    if c.kind in ("efa", "agent-torch"):
        return re.sub(r"^(\s*FROM\s+)\S+", lambda m: m.group(1) + BASES[DEFAULT_BASE].image, row, flags=re.I)
    return row


def _writes_constraints(dockerfile: str) -> str:
    """A Dockerfile whose installs the fix constrained, with the constraints file they refer to
    written first from the base image's own torch (where nothing writes it yet)."""
    if "/etc/pip-constraints.txt" not in dockerfile or "pip-constraints.txt\" " in dockerfile or \
            "> /etc/pip-constraints.txt" in dockerfile:
        return dockerfile
    rows = dockerfile.splitlines()
    at = next(i for i, ln in enumerate(rows) if ln.strip().upper().startswith("FROM ")) + 1
    rows.insert(at, "RUN python -c \"import torch; print('torch==' + torch.__version__.split('+')[0])\" "
                    "> /etc/pip-constraints.txt")
    return "\n".join(rows) + "\n"
