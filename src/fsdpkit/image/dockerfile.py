"""`fsdpkit image init`: a Dockerfile for the user's project on a known-good PyTorch + CUDA + EFA
base. fsdpkit goes in as a package (a wheel `image init` builds from the fsdpkit that runs it, or
the released version from the package index), the project's requirements go in under a constraints
file that pins the base's torch (no requirement can quietly replace it), then the project itself."""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.errors import UserError


@dataclass(frozen=True)
class Base:
    key: str
    image: str
    torch: str        # the torch the image ships
    cuda: str         # "12.6"
    python: str
    efa: bool         # EFA installer (libfabric) and aws-ofi-nccl present
    note: str
    adds_efa: bool = False          # the Dockerfile installs EFA and aws-ofi-nccl, which the base lacks
    packages: tuple[str, ...] = ()  # pinned, without dependencies: the base already holds what they need


# Public registries only: an account-specific registry would tie the file to one account.
BASES: dict[str, Base] = {b.key: b for b in [
    Base("dlc-2.6", "public.ecr.aws/deep-learning-containers/pytorch-training:2.6.0-gpu-py312-cu126-ubuntu22.04-ec2",
         "2.6.0", "12.6", "3.12", True, "AWS Deep Learning Container: EFA, aws-ofi-nccl, tested on p4d/p5"),
    Base("dlc-2.5", "public.ecr.aws/deep-learning-containers/pytorch-training:2.5.1-gpu-py311-cu124-ubuntu22.04-ec2",
         "2.5.1", "12.4", "3.11", True, "AWS Deep Learning Container (previous release)"),
    Base("pytorch-2.6", "pytorch/pytorch:2.6.0-cuda12.6-cudnn9-runtime", "2.6.0", "12.6", "3.11", False,
         "official PyTorch image: no EFA; NCCL uses TCP between nodes (fine for one node or g-series)"),
    # VERL's images are built per release (tag verl0.5 for v0.5.x) and hold its dependencies, not verl
    # itself; they have no EFA, so this adds it the way VERL's docker/aws/Dockerfile.extention.awsefa does.
    Base("verl-0.5", "verlai/verl:app-verl0.5-transformers4.55.4-vllm0.10.0-mcore0.13.0-te2.2", "2.7.1", "12.6",
         "3.10", False, "VERL 0.5's application image (vLLM 0.10, Megatron core 0.13, Transformer Engine 2.2) with "
         "EFA, aws-ofi-nccl and verl 0.5.0 added", adds_efa=True, packages=("verl==0.5.0",)),
]}
DEFAULT_BASE = "dlc-2.6"
# Images with aws-ofi-nccl by their name (AWS's Deep Learning Containers, nccl-tests on EFA), and
# well-known images without it (NGC's and VERL's: multi-node NCCL there runs on TCP sockets).
_WITH_OFI = ("deep-learning-containers", "pytorch-training", "nccl-tests", "efa")
_WITHOUT_OFI = ("verlai/verl:", "pytorch/pytorch:", "nvcr.io/nvidia/pytorch:")


def has_ofi_nccl(image: str | None) -> bool | None:
    """Whether `image` carries aws-ofi-nccl, NCCL's EFA plugin: known for fsdpkit's bases and the
    images above, None for any other (an `image init` build pushed under the user's own name)."""
    if not image:
        return None
    for b in BASES.values():
        if b.image == image:
            return b.efa
    if image.startswith(_WITHOUT_OFI):
        return False
    return True if any(k in image for k in _WITH_OFI) else None

# In the project: the fsdpkit wheel `image init` built, copied into the image.
WHEEL_DIR = ".fsdpkit"
HYPERPOD_AGENT = "hyperpod-elastic-agent==1.1.3"   # HyperPodPyTorchJob starts workers through its hyperpodrun
EFA_INSTALLER = "1.40.0"
OFI_NCCL = "1.14.2"

# libfabric and the EFA provider from AWS's installer (no kernel module: the node has it), then
# aws-ofi-nccl built against the image's own CUDA. NCCL_NET=OFI picks the plugin (fsdpkit sets it).
EFA_LAYER = f"""\
# EFA for NCCL between nodes: libfabric from the EFA installer, aws-ofi-nccl built for this image's CUDA.
ARG EFA_INSTALLER_VERSION={EFA_INSTALLER}
ARG AWS_OFI_NCCL_VERSION={OFI_NCCL}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3003,DL3008
RUN apt-get update && apt-get install -y --no-install-recommends curl libhwloc-dev autoconf automake libtool && \\
    cd /tmp && \\
    curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${{EFA_INSTALLER_VERSION}}.tar.gz" && \\
    tar -xf "aws-efa-installer-${{EFA_INSTALLER_VERSION}}.tar.gz" && cd aws-efa-installer && \\
    ./efa_installer.sh -y -g --skip-kmod --skip-limit-conf --no-verify && \\
    cd /tmp && curl -fsSL "https://github.com/aws/aws-ofi-nccl/archive/refs/tags/v${{AWS_OFI_NCCL_VERSION}}.tar.gz" \\
    | tar -xz && cd "aws-ofi-nccl-${{AWS_OFI_NCCL_VERSION}}" && ./autogen.sh && \\
    ./configure --prefix=/opt/amazon/efa --with-libfabric=/opt/amazon/efa --with-cuda=/usr/local/cuda \\
    --with-mpi=/opt/amazon/openmpi --enable-platform-aws && make -j"$(nproc)" install && \\
    rm -rf /tmp/aws-efa-installer* /tmp/aws-ofi-nccl-* /var/lib/apt/lists/* && ldconfig
ENV LD_LIBRARY_PATH=/opt/amazon/efa/lib:/opt/amazon/openmpi/lib:${{LD_LIBRARY_PATH}}
"""

DOCKERIGNORE = """\
.git
.venv
runs
**/__pycache__
*.pyc
checkpoints
*.safetensors
.pytest_cache
"""


def with_extra(fsdpkit: str, extra: str) -> str:
    """pip's argument for `fsdpkit` (a wheel's path, or `fsdpkit==X`) with extras (comma-separated),
    quoted for the shell (brackets are a glob)."""
    name, sep, version = fsdpkit.partition("==")
    return f'"{name}[{extra}]{sep}{version}"'


def render(base_key: str = DEFAULT_BASE, requirements: str | None = "requirements.txt",
           fsdpkit: str = "fsdpkit", hyperpod_agent: bool = False, tiered: bool = False, qlora: bool = False) -> str:
    """The Dockerfile. `fsdpkit` is what pip installs for fsdpkit: a wheel in the project
    (`.fsdpkit/fsdpkit-X-py3-none-any.whl`) or a requirement (`fsdpkit==X`); `requirements` the
    project's requirements file, or None. `tiered` adds the `tiered` extra, the writer of HyperPod's
    in-memory checkpoints (`checkpoint.tiered`: without it a stop's save goes to shared storage, in
    a grace period planned for node memory); `qlora` the `qlora` extra, torchao's NF4 tensor (a job
    with train.base_dtype nf4 needs it)."""
    if base_key not in BASES:
        raise UserError(f"--base: {base_key!r} is not known; choose one of: {', '.join(BASES)}")
    b = BASES[base_key]
    lines = [
        "# Generated by `fsdpkit image init`; `fsdpkit image check` looks for conflicts.",
        f"# Base: {b.note}. torch {b.torch}, CUDA {b.cuda}, Python {b.python}.",
        f"FROM {b.image}",
        "",
        "ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1",
        "WORKDIR /workspace",
        "",
        "# Pin the base image's torch: no requirement below may replace it with another build.",
        "RUN python -c \"import torch; print('torch==' + torch.__version__.split('+')[0])\" "
        "> /etc/pip-constraints.txt && cat /etc/pip-constraints.txt",
        "ENV PIP_CONSTRAINT=/etc/pip-constraints.txt",
        "",
        *([f"# What the base holds the dependencies of: {', '.join(b.packages)}.",
           f"RUN pip install --no-cache-dir --no-deps {' '.join(b.packages)}", ""] if b.packages else []),
        *([EFA_LAYER] if b.adds_efa else []),
        "# fsdpkit's trainer (fsdpkit-torchrun, python -m fsdpkit.train), as a package"
        + (" with HyperPod's tiered checkpoint writer (amzn-sagemaker-checkpointing)" if tiered else "")
        + ((" and" if tiered else " with") + " torchao's NF4 for QLoRA" if qlora else "")
        + (", and HyperPod's elastic agent (hyperpodrun starts HyperPodPyTorchJob workers)." if hyperpod_agent
           else "."),
    ]
    wheel = fsdpkit.rsplit("/", 1)[-1] if fsdpkit.endswith(".whl") else None
    target = f"/tmp/{wheel}" if wheel else fsdpkit
    extras = ",".join(e for e, wanted in (("tiered", tiered), ("qlora", qlora)) if wanted)
    install = (f"RUN pip install --no-cache-dir {with_extra(target, extras) if extras else target}"
               + (f" {HYPERPOD_AGENT}" if hyperpod_agent else ""))
    lines += [f"COPY {fsdpkit} /tmp/{wheel}", f"{install} && rm /tmp/{wheel}"] if wheel else [install]
    if requirements:
        lines += ["", "# The project's requirements.", f"COPY {requirements} /tmp/requirements.txt",
                  "RUN pip install --no-cache-dir -r /tmp/requirements.txt"]
    lines += ["", "# The project itself, and a check that this image can train.", "COPY . /workspace",
              "RUN fsdpkit selftest --level standard", "", 'CMD ["fsdpkit", "selftest", "--level", "quick"]', ""]
    return "\n".join(lines)
