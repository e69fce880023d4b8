"""Kubernetes' name rules (fsdpkit.kube_names) as apimachinery's validation applies them, and every
name a user gives fsdpkit to write into an object checked before anything is printed: one line,
exit 2, no object on stdout."""

from __future__ import annotations

import pytest

from fsdpkit.kube_names import problem

from conftest import cli_here
from job_specs import write_spec

LABELS_OK = ["a", "0", "a1", "a-1", "a--1--2--b", "team-a", "a" * 63]
LABELS_BAD = ["", "A", "aBc", "Team_A", "-a", "a-", "a_b", "a.b", "a b", " a", "a" * 64]
SUBDOMAINS_OK = [*LABELS_OK, "a.b", "1.a.2", "a-1.b-2", ".".join(["a" * 63] * 3) + "." + "a" * 61]
SUBDOMAINS_BAD = ["", "A.b", "a..b", ".a", "a.", "a.-b", "a_b", "my role", "a" * 254]
VALUES_OK = ["", "a", "A", "High_Priority.1", "1.2", "a-B_c", "a" * 63]
VALUES_BAD = ["-", "_a", "a_", ".a", "a.", "Bad Queue!", "High Priority", "a/b", "a" * 64]


@pytest.mark.parametrize(("rule", "good", "bad"), [("label", LABELS_OK, LABELS_BAD),
                                                   ("subdomain", SUBDOMAINS_OK, SUBDOMAINS_BAD),
                                                   ("label value", VALUES_OK, VALUES_BAD)])
def test_each_rule_takes_what_kubernetes_takes_and_refuses_the_rest(rule, good, bad):
    assert [v for v in good if problem(v, rule) is not None] == []
    assert [v for v in bad if problem(v, rule) is None] == []


@pytest.mark.parametrize(("argv", "says"), [
    (["--namespace", "Team_A"], "--namespace: 'Team_A' is not a valid DNS-1123 label: use "),
    (["--namespace", "a" * 64], "--namespace: '" + "a" * 64 + "' is 64 characters, over a DNS-1123 label's 63: use "),
    (["--namespace", ""], "--namespace: '' is empty: use "),
    (["--namespace", "team.a"], "--namespace: 'team.a' is not a valid DNS-1123 label: use "),
    (["--namespace", "team-a", "--service-account", "a:b:c"], "--service-account: 'a:b:c' is not NAME or "
                                                               "NAMESPACE:NAME"),
    (["--namespace", "team-a", "--service-account", "Other:sa"], "--service-account's namespace: 'Other' is not a "
                                                                  "valid DNS-1123 label: use "),
    (["--namespace", "team-a", "--service-account", "Team User"], "--service-account: 'Team User' is not a valid "
                                                                   "DNS-1123 subdomain: use "),
    (["--namespace", "team-a", "--name", "my role"], "--name: 'my role' is not a valid DNS-1123 subdomain: use "),
], ids=["underscore", "64-characters", "empty", "dotted", "service-account-a:b:c", "service-account-namespace",
        "service-account-name", "role-name-with-a-space"])
def test_cluster_rbac_refuses_a_name_the_api_server_would(argv, says):
    r = cli_here("cluster", "rbac", *argv, "--user", "team-user")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    [line] = r.stderr.splitlines()
    assert line.startswith(f"error: {says}"), line
    assert cli_here("cluster", "rbac", "--namespace", "team-a", "--service-account", "other-ns:team-user",
                    "--name", "fsdpkit.team").returncode == 0


@pytest.mark.parametrize(("field", "value", "says"), [
    ("queue", "Bad Queue!", "queue: 'Bad Queue!' is not a valid DNS-1123 subdomain"),
    ("queue", "Team_A", "queue: 'Team_A' is not a valid DNS-1123 subdomain"),
    ("priority_class", "High Priority", "priority_class: 'High Priority' is not a valid DNS-1123 subdomain"),
    ("priority_class", "a" * 64, "priority_class: '" + "a" * 64 + "' is 64 characters, over a label value's 63"),
    ("namespace", "Team_A", "namespace: 'Team_A' is not a valid DNS-1123 label"),
    ("storage.storage_class", "FSx SC", "storage.storage_class: 'FSx SC' is not a valid DNS-1123 subdomain"),
])
def test_a_spec_s_names_are_refused_before_anything_is_rendered(tmp_path, field, value, says):
    spec = str(write_spec(tmp_path))
    r = cli_here("job", "render", spec, "--set", f"{field}={value}")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    [line] = r.stderr.splitlines()
    assert line.startswith(f"error: {says}: use "), line
    ok = cli_here("job", "render", spec, "--set", f"{field}=team-a.high")
    assert ok.returncode == (2 if field == "namespace" else 0), ok.stderr   # a namespace has no dots
    if field.startswith("storage."):   # an existing claim's name too
        r = cli_here("job", "render", spec, "--set", "storage.size=", "--set", "storage.claim=My Claim")
        assert r.returncode == 2 and r.stderr.startswith("error: storage.claim: 'My Claim' is not a valid DNS-1123 "
                                                         "subdomain: use "), r.stderr
