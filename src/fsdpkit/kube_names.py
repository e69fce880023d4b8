"""Kubernetes' own rules for the names and label values fsdpkit writes into objects
(k8s.io/apimachinery/pkg/util/validation: IsDNS1123Label, IsDNS1123Subdomain, IsValidLabelValue),
checked before anything is rendered: a bad one is the user's field named in one line, not an object
printed that the API server refuses."""

from __future__ import annotations

import re

from fsdpkit.errors import UserError

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(rf"^{_LABEL}$")
DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_MAX, SUBDOMAIN_MAX = 63, 253

# Each rule: its pattern, its longest value, its name and what it asks for.
_RULES = {
    "label": (DNS1123_LABEL, LABEL_MAX, "DNS-1123 label",
              f"at most {LABEL_MAX} lowercase letters, digits and '-', starting and ending with a letter or digit"),
    "subdomain": (DNS1123_SUBDOMAIN, SUBDOMAIN_MAX, "DNS-1123 subdomain",
                  f"at most {SUBDOMAIN_MAX} lowercase letters, digits, '-' and '.', each part between dots "
                  "starting and ending with a letter or digit"),
    "label value": (LABEL_VALUE, LABEL_MAX, "label value",
                    f"at most {LABEL_MAX} letters, digits, '-', '_' and '.', starting and ending with a letter or "
                    "digit"),
}


def problem(value: str, rule: str) -> str | None:
    """What is wrong with `value` under `rule` ("label", "subdomain", "label value"), or None."""
    pattern, most, name, _ = _RULES[rule]
    if not value and rule != "label value":
        return "is empty"
    if len(value) > most:
        return f"is {len(value)} characters, over a {name}'s {most}"
    return None if pattern.match(value) else f"is not a valid {name}"


def check(field: str, value: str, *rules: str) -> None:
    """A one-line UserError naming `field` where `value` breaks one of `rules` (each of which it
    must meet: a queue's name is a subdomain and travels as a label value)."""
    for rule in rules:
        if (wrong := problem(value, rule)) is not None:
            shown = repr(value) if len(value) <= 80 else repr(value[:77]) + "..."
            raise UserError(f"{field}: {shown} {wrong}: use {_RULES[rule][3]}")
