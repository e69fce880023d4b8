"""The Slurm backend's client side in this process, against the real Slurm of tests/slurm_cluster.py:
what status, list, logs and cancel make of jobs Slurm ran (small shell jobs, so each case takes
seconds), and what submit writes and hands to sbatch. tests/jobs/test_slurm.py runs trainings
through the CLI."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from fsdpkit.errors import Conflict, UserError
from fsdpkit.jobs.backends.slurm import SlurmBackend, SlurmUnreachable, script
from fsdpkit.jobs.resolved import load_job

from conftest import unavailable


@pytest.fixture
def slurm_env(slurm, monkeypatch):
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    return slurm


def sbatch(tmp_path: Path, name: str, command: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp_path}/%x-%j.out",
                          "--nodes=1", f"--wrap={command}"], capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def settled(name: str, states: tuple[str, ...], seconds: float = 60):
    backend = SlurmBackend()
    deadline = time.monotonic() + seconds
    while (st := backend.status(name)).state not in states:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    return st


def test_a_finished_job_s_state_exit_and_output_as_the_controller_holds_them(slurm_env, tmp_path):
    job_id = sbatch(tmp_path, "fine", "echo first; echo second")
    st = settled("fine", ("Succeeded",))
    assert (st.name, st.backend, st.message, st.attempt) == ("fine", "slurm", "COMPLETED exit 0:0", 0)
    assert st.details == {"job_id": job_id, "stdout": f"{tmp_path}/fine-{job_id}.out"}
    assert list(SlurmBackend().logs("fine")) == ["first", "second"]
    assert SlurmBackend().cancel("fine") == [f"slurm/fine (job {job_id})"]   # finished: nothing to stop


def test_a_failed_job_says_its_exit_and_slurm_s_reason(slurm_env, tmp_path):
    sbatch(tmp_path, "broken", "exit 3")
    st = settled("broken", ("Failed",))
    assert st.message == "FAILED exit 3:0 (NonZeroExitCode)"


def test_the_newest_job_of_a_name_is_the_one_shown_and_the_list_is_oldest_first(slurm_env, tmp_path):
    first = sbatch(tmp_path, "twice", "exit 1")
    second = sbatch(tmp_path, "twice", "sleep 1")
    st = settled("twice", ("Succeeded",))
    assert st.details["job_id"] == second
    listing = SlurmBackend().jobs()
    assert [(s.name, s.details["job_id"]) for s in listing.jobs if s.name == "twice"] == [("twice", first),
                                                                                          ("twice", second)]
    assert listing.unread == {}
    assert int(first) < int(second)


def test_cancel_stops_a_running_job_and_a_dry_run_stops_nothing(slurm_env, tmp_path):
    job_id = sbatch(tmp_path, "long", "echo started; sleep 120")
    settled("long", ("Running",))
    backend = SlurmBackend()
    assert backend.cancel("long", dry_run=True) == [f"slurm/long (job {job_id})"]
    time.sleep(1)
    assert backend.status("long").state == "Running"
    assert backend.cancel("long") == [f"slurm/long (job {job_id})"]
    st = settled("long", ("Cancelled",), 30)
    # SIGTERM, as Slurm records it: the step killed by signal 15 (0:15), or its shell gone first with
    # 128 + 15 (143:0); which one depends on who the signal reaches first (both seen on one machine).
    assert st.message.startswith(("CANCELLED exit 0:15", "CANCELLED exit 143:0")), st.message


def test_a_name_slurm_does_not_hold_is_one_line_naming_the_missing_accounting(slurm_env):
    with pytest.raises(UserError) as e:
        SlurmBackend().status("never-submitted")
    assert str(e.value) == ("no Slurm job named 'never-submitted' held by the controller (it lets finished jobs go "
                            "after MinJobAge), and this cluster keeps no accounting to look further back")


def test_without_sacct_a_name_the_controller_does_not_hold_says_so(slurm_env, tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "scontrol").symlink_to(shutil.which("scontrol"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(UserError) as e:
        SlurmBackend().status("never-submitted")
    assert str(e.value) == ("no Slurm job named 'never-submitted' held by the controller, and sacct is not on PATH "
                            "to look further back")


def test_a_controller_nobody_answers_is_named_by_status_list_and_logs(slurm_env, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm_env.unreachable_conf(tmp_path / "slurm.conf")))
    for call in (lambda b: b.status("x"), lambda b: b.jobs(), lambda b: list(b.logs("x"))):
        with pytest.raises(SlurmUnreachable) as e:
            call(SlurmBackend())
        assert str(e.value) == (
            "scontrol could not reach the Slurm controller (slurm_load_jobs error: Unable to contact slurm controller "
            "(connect failure)); check that slurmctld runs and that this is a login node of the cluster (SLURM_CONF)")


def test_a_machine_with_slurm_s_commands_and_no_configuration_says_where_to_run_not_scontrol_s_fatal(
        tmp_path, monkeypatch):
    """Slurm's commands installed, no slurm.conf (not a login node): status, list and cancel say so
    with what to do, as an unreachable controller (exit 3); a SLURM_CONF naming no file is said
    at once, where Slurm's commands would retry reading it for a minute."""
    if shutil.which("scontrol") is None:
        unavailable("scontrol is not installed here: apt-get install slurm-wlm")
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a Slurm configuration (/etc/slurm/slurm.conf)")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    for call in (lambda b: b.status("x"), lambda b: b.jobs(), lambda b: b.cancel("x")):
        with pytest.raises(SlurmUnreachable) as e:
            call(SlurmBackend())
        assert str(e.value) == (
            "scontrol found no Slurm configuration on this machine (scontrol: fatal: Could not establish a "
            "configuration source); run this on a login node of the cluster, or set SLURM_CONF to its slurm.conf")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "gone" / "slurm.conf"))
    with pytest.raises(SlurmUnreachable) as e:   # ours, before scontrol's minute of retries
        SlurmBackend().status("x")
    assert str(e.value) == (f"SLURM_CONF is {tmp_path / 'gone' / 'slurm.conf'}, which is not a file here; point it "
                            "at the cluster's slurm.conf, or unset it on a login node")


def test_a_job_the_controller_let_go_is_read_from_accounting(slurm_accounting, tmp_path, monkeypatch):
    kept = sbatch(tmp_path, "kept", "echo done")
    lost = sbatch(tmp_path, "lost", "exit 3")
    again = sbatch(tmp_path, "lost", "exit 4")
    stopped = sbatch(tmp_path, "stopped", "sleep 120")
    settled("kept", ("Succeeded",))
    settled("lost", ("Failed",))
    settled("stopped", ("Running",))
    SlurmBackend().cancel("stopped")
    settled("stopped", ("Cancelled",))
    slurm_accounting.restart_controller()

    backend = SlurmBackend()
    assert backend.jobs().jobs == []   # the controller holds none of them now
    got = {n: backend.status(n) for n in ("kept", "lost", "stopped")}
    assert {n: (s.state, s.message, s.details) for n, s in got.items()} == {
        "kept": ("Succeeded", "COMPLETED exit 0:0", {"job_id": kept}),
        "lost": ("Failed", "FAILED exit 4:0", {"job_id": again}),     # the newest of the name
        "stopped": ("Cancelled", "CANCELLED by 0 exit 0:0", {"job_id": stopped}),
    }
    assert int(lost) < int(again)
    with pytest.raises(UserError) as e:
        list(backend.logs("kept"))
    assert str(e.value) == (f"cannot find the output file of Slurm job {kept} (the controller no longer holds it; "
                            "its --output is set in the spec's slurm.output)")
    with pytest.raises(UserError) as e:
        backend.status("never-submitted")
    assert str(e.value) == ("no Slurm job named 'never-submitted' in the controller or in accounting's last 30 days "
                            "(see `fsdpkit job list --backend slurm`)")

    monkeypatch.setenv("SLURM_CONF", str(slurm_accounting.unreachable_conf(tmp_path / "slurm.conf",
                                                                           "AccountingStoragePort")))
    with pytest.raises(SlurmUnreachable) as e:
        SlurmBackend().status("kept")
    assert str(e.value) == ("the Slurm controller holds no job named 'kept' and sacct could not read accounting "
                            "(sacct: error: Problem talking to the database: Connection refused); "
                            "check that slurmdbd runs")


def test_without_slurm_s_commands_every_verb_says_to_run_on_a_login_node(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    for call in (lambda b: b.status("x"), lambda b: b.jobs(), lambda b: list(b.logs("x"))):
        with pytest.raises(UserError) as e:
            call(SlurmBackend())
        assert str(e.value) == "scontrol is not on PATH: run this on a Slurm login node"


def job(tmp_path: Path, name: str = "sub"):
    return load_job(None, [("name", name), ("backend", "slurm"), ("nodes", 1), ("procs_per_node", 1),
                           ("storage", {"shared_path": str(tmp_path / "shared")}),
                           ("slurm", {"script_dir": str(tmp_path / "scripts"), "output": str(tmp_path / "%x-%j.out")}),
                           ("train", {"max_steps": 1, "seq_len": 64, "validation_freq": 0, "tensorboard": False})])


def test_a_dry_run_shows_the_script_and_writes_nothing(tmp_path):
    resolved = job(tmp_path)
    result = SlurmBackend().submit(resolved, dry_run="client").to_dict()
    assert result == {"name": "sub", "dry_run": "client", "script": str(tmp_path / "scripts" / "sub.sbatch"),
                      "text": script(resolved)}
    assert not (tmp_path / "scripts").exists()


def test_without_sbatch_the_script_is_written_and_the_answer_says_where_to_run_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    resolved = job(tmp_path)
    result = SlurmBackend().submit(resolved).to_dict()
    path = tmp_path / "scripts" / "sub.sbatch"
    assert result == {"name": "sub", "dry_run": False, "script": str(path), "submitted": False,
                      "hint": f"sbatch is not on PATH here; copy {path} to the cluster and run: sbatch sub.sbatch"}
    assert path.read_text() == script(resolved)
    assert not path.with_suffix(".sbatch.tmp").exists()
    with pytest.raises(Conflict) as e:
        SlurmBackend().submit(resolved)
    assert str(e.value) == f"{path} already exists; pass --replace to overwrite it, or pick another name"
    path.write_text("an older script")
    SlurmBackend().submit(resolved, replace=True)
    assert path.read_text() == script(resolved)


def test_a_submit_sbatch_takes_answers_its_job_id_and_one_it_refuses_puts_the_earlier_script_back(
        slurm_env, tmp_path):
    resolved = job(tmp_path)
    backend = SlurmBackend()
    result = backend.submit(resolved).to_dict()
    path = tmp_path / "scripts" / "sub.sbatch"
    assert result == {"name": "sub", "dry_run": False, "script": str(path), "submitted": True,
                      "job_id": result["job_id"]}
    assert result["job_id"].isdigit() and backend.status("sub").details["job_id"] == result["job_id"]
    backend.cancel("sub")
    # A script sbatch refuses (a directive it does not know): nothing submitted, the earlier script kept.
    bad = load_job(None, [("name", "sub"), ("backend", "slurm"), ("nodes", 1),
                          ("storage", {"shared_path": str(tmp_path / "shared")}),
                          ("slurm", {"script_dir": str(tmp_path / "scripts"), "partition": "no-such-partition"})])
    with pytest.raises(UserError) as e:
        backend.submit(bad, replace=True)
    # sbatch's last line, as sbatch says it.
    assert str(e.value) == ("sbatch refused sub.sbatch: sbatch: error: Batch job submission failed: Invalid partition "
                            "name specified")
    assert path.read_text() == script(resolved)
    other = load_job(None, [("name", "fresh"), ("backend", "slurm"), ("nodes", 1),
                            ("storage", {"shared_path": str(tmp_path / "shared")}),
                            ("slurm", {"script_dir": str(tmp_path / "scripts"), "partition": "no-such-partition"})])
    with pytest.raises(UserError):
        backend.submit(other)
    assert not (tmp_path / "scripts" / "fresh.sbatch").exists()


def test_a_script_folder_that_does_not_exist_yet_is_made_and_a_controller_nobody_answers_is_named(
        slurm_env, tmp_path, monkeypatch):
    resolved = load_job(None, [("name", "deep"), ("backend", "slurm"), ("nodes", 1),
                               ("storage", {"shared_path": str(tmp_path / "shared")}),
                               ("slurm", {"script_dir": str(tmp_path / "a" / "b" / "scripts")})])
    conf = slurm_env.unreachable_conf(tmp_path / "slurm.conf")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(SlurmUnreachable) as e:
        SlurmBackend().submit(resolved)
    assert str(e.value).startswith("sbatch could not reach the Slurm controller (sbatch: error: ")
    assert str(e.value).endswith("); check that slurmctld runs and that this is a login node of the cluster "
                                 "(SLURM_CONF)")
    assert (e.value.code, e.value.exit_code) == ("unreachable", 3)
    assert list((tmp_path / "a" / "b" / "scripts").iterdir()) == []   # made, and the script gone again

