"""Which of fsdpkit's extras brings each optional module, so a command that reaches one not
installed (the training-only install `make run` makes has none of the cloud side) is one line
naming what to install, wherever in the command the import happens, not a ModuleNotFoundError.

The table is held to the installed packages' metadata by tests/test_extras.py: every module the
source imports that the core dependencies do not bring is here, each under an extra that brings it."""

from __future__ import annotations

from fsdpkit.errors import UserError

# Top-level import name -> the extra that installs it: each module fsdpkit imports that the core
# dependencies do not bring, and each extra's own packages.
EXTRA_OF = {
    **dict.fromkeys(("kubernetes", "boto3", "botocore", "prometheus_api_client", "requests", "urllib3"), "cloud"),
    **dict.fromkeys(("datasets", "pyarrow", "zstandard"), "data"),
    **dict.fromkeys(("mcp", "mcp_types", "jsonschema"), "mcp"),
    **dict.fromkeys(("amzn_sagemaker_checkpointing", "s3torchconnector", "tenacity"), "tiered"),
    "matplotlib": "report", "wandb": "wandb", "mlflow": "mlflow", "lm_eval": "eval", "torchao": "qlora",
}


def missing_extra(e: ModuleNotFoundError, verb: str) -> UserError | None:
    """The one-line error for a module an extra installs; None for any other missing module (a
    broken install is not the user's flag to fix, and keeps its traceback)."""
    top = (e.name or "").split(".")[0]
    if (extra := EXTRA_OF.get(top)) is None:
        return None
    return UserError(f"{verb}: needs the {top} module, which fsdpkit's {extra} extra installs: "
                     f"pip install 'fsdpkit[{extra}]'")
