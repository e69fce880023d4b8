"""Hugging Face hub access, checked on the submitting machine: a gated repository (licence
acceptance) needs a token, and finding out inside the pods costs minutes after submit."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import cast

from fsdpkit.errors import UserError
from fsdpkit.jobs.spec import JobSpec, flat_options
from fsdpkit.train.model.presets import RECIPES

# Organisations whose model repositories are gated on the hub (Meta's Llama, Mistral AI's models,
# Google's Gemma): downloading even a tokenizer needs a token of an account that accepted the licence.
GATED_PREFIXES = ("meta-llama/", "mistralai/", "google/gemma")


def _ungated(name: str) -> str | None:
    """A recipe's tokenizer that needs no licence, for the same family (as a suggestion)."""
    family = "llama3" if "llama-3" in name.lower() or "llama3" in name.lower() else "llama2" if "llama" in \
        name.lower() else None
    for preset, recipe in RECIPES.items():
        tok = recipe.options.get("tokenizer")
        if family and preset.startswith(family) and tok and not tok.startswith(GATED_PREFIXES):
            return cast("str | None", tok)
    return None


def has_token(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> bool:
    """The job will carry an HF token: from the submitting shell (hf_token_env), from a Kubernetes
    Secret it references, or (local jobs) from this shell's HF_TOKEN."""
    if spec.hf_token_env and environ.get(spec.hf_token_env):
        return True
    if any(ref.env == "HF_TOKEN" for ref in spec.secrets):
        return True
    return spec.backend == "local" and bool(environ.get("HF_TOKEN"))


def check_hub_access(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> None:
    """A UserError, before anything is submitted, for a job whose tokenizer is a gated hub repository
    it will have no token for."""
    if spec.command is not None:
        return
    tokenizer = str(flat_options(spec.train).get("tokenizer") or "")
    if not tokenizer.startswith(GATED_PREFIXES) or has_token(spec, environ):
        return
    how = (f"export {spec.hf_token_env} in this shell" if spec.hf_token_env else
           "set hf_token_env: HF_TOKEN in the spec and export HF_TOKEN")
    other = _ungated(tokenizer)
    instead = f", or use the ungated {other}" if other else ""
    raise UserError(f"train.tokenizer: {tokenizer!r} is gated on the Hugging Face hub and the job would have no token "
                    f"for it: {how} (a token whose account accepted the model's licence){instead}")
