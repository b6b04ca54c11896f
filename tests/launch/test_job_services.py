"""``instride job`` without a cluster: bad settings, the state directory's trust checks, the
task prolog script, the teardown under signals and failing Slurm client commands.

The life-cycle tests run the real node agent and data server on this machine through a
launcher whose per-node command is the agent itself (one node: this one).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from instride.errors import ConfigError
from instride.launch import LaunchError, services
from instride.launch import slurm as slurm_launcher
from instride.launch.agent import _start_time, check_stale, check_state_dir, cleanup_node
from instride.launch.base import JobServices, node_env_script, node_name
from instride.launch.slurm import SlurmServices

from ..conftest import free_port
from .conftest import PY, tree

NOBODY = 65534


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "INSTRIDE_"))}
    env.update(extra)
    return env


# ---------------------------------------------------------------------- bad settings
@pytest.mark.parametrize("url", ["foo", "redis://h:notaport/0", "redis://h:99999/0",
                                 "http://x/0", "redis://h:6379/abc", "unix:///tmp/r.sock",
                                 "redis://:6379/0"])
def test_malformed_redis_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="bad setting INSTRIDE_REDIS_URL"):
        services("slurm", env=_env(SLURM_JOB_ID="1", INSTRIDE_REDIS_URL=url))


def test_malformed_redis_url_exits_2_without_showing_the_password() -> None:
    env = _env(SLURM_JOB_ID="1", INSTRIDE_REDIS_URL="redis://:s3cret@h:notaport/0")
    proc = subprocess.run([PY, "-m", "instride", "job", "--", "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "bad setting INSTRIDE_REDIS_URL='redis://***@h:notaport/0'" in proc.stderr
    assert "s3cret" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", [math.nan, math.inf, -5.0, 0.0])
def test_ready_timeout_must_be_finite_and_positive(value: float) -> None:
    with pytest.raises(ConfigError, match="--ready-timeout"):
        services("slurm", env=_env(SLURM_JOB_ID="1"), ready_timeout=value)


def test_ready_timeout_nan_exits_2() -> None:
    proc = subprocess.run([PY, "-m", "instride", "job", "--ready-timeout", "nan", "--", "true"],
                          env=_env(SLURM_JOB_ID="1"), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "bad setting --ready-timeout=nan" in proc.stderr


def test_heterogeneous_slurm_job_is_refused() -> None:
    svc = services("slurm", env=_env(SLURM_JOB_ID="7", SLURM_HET_SIZE="2",
                                     SLURM_JOB_NODELIST="node1", SLURMD_NODENAME="node1"))
    with pytest.raises(LaunchError, match="heterogeneous job .2 components.: not supported"):
        svc.detect()


# ---------------------------------------------------------------------- the state directory
def test_state_dir_open_to_others_or_a_link_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o700)
    open_dir.chmod(0o755)
    with pytest.raises(LaunchError, match=f"state directory {open_dir} is open to other "
                                          "users .mode 755."):
        check_stale("n1", "1", open_dir)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "private")
    (tmp_path / "private").mkdir(mode=0o700)
    with pytest.raises(LaunchError, match=f"state directory {link} is a symbolic link"):
        check_stale("n1", "1", link)
    created = tmp_path / "a" / "states"
    assert check_state_dir(created, create=True) == os.geteuid()
    assert created.stat().st_mode & 0o777 == 0o700
    proc = subprocess.run([PY, "-m", "instride", "job", "--cleanup", "--state-dir",
                           str(open_dir)], env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2  # (a bad option: ConfigError)
    assert f"the state directory {open_dir} is open to other users" in proc.stderr


@pytest.mark.root
def test_state_dir_of_another_user_is_refused_to_agents(tmp_path: Path) -> None:
    states = tmp_path / "states"
    states.mkdir(mode=0o700)
    os.chown(states, NOBODY, NOBODY)
    (states / "n1.json").write_text('{"job": "1", "pid": 1, "start": 1}')
    with pytest.raises(LaunchError, match=f"state directory {states} belongs to uid {NOBODY}"):
        check_stale("n1", "2", states)
    assert (states / "n1.json").exists()  # nothing read or removed


@pytest.fixture
def foreign_service(tmp_path: Path) -> Iterator[dict[str, object]]:
    """A state directory of user 65534 whose record names that user's live process (the agent)
    and a live process of root (as the server): what an Epilog, as root, finds."""
    states = tmp_path / "states"
    states.mkdir(mode=0o700)
    # (where the user can reach it, as a user's own managed directory is: root removes it
    # with the user's rights only)
    reachable = Path(tempfile.mkdtemp(prefix="isl-", dir="/tmp"))
    reachable.chmod(0o1777)  # (as /tmp: the user removes what it made there)
    managed = reachable / "managed"
    (managed / ".instride").mkdir(parents=True)
    users = subprocess.Popen(["sleep", "300"], user=NOBODY)
    roots = subprocess.Popen(["sleep", "300"])
    try:
        record = {"job": "42", "node": "n1", "dir": str(managed), "top": str(managed),
                  "pid": users.pid, "start": _start_time(users.pid),
                  "server_pid": roots.pid, "server_start": _start_time(roots.pid)}
        (states / "n1.json").write_text(json.dumps(record))
        for path in (states, states / "n1.json", managed, managed / ".instride"):
            os.chown(path, NOBODY, NOBODY)
        yield {"states": states, "managed": managed, "user": users, "root": roots}
    finally:
        for proc in (users, roots):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        shutil.rmtree(reachable, ignore_errors=True)


@pytest.mark.root
def test_root_cleanup_stops_only_what_the_directory_owner_owns(
    foreign_service: dict[str, object]
) -> None:
    states, managed = foreign_service["states"], foreign_service["managed"]
    user, root = foreign_service["user"], foreign_service["root"]
    assert isinstance(states, Path) and isinstance(managed, Path)
    assert isinstance(user, subprocess.Popen) and isinstance(root, subprocess.Popen)
    # another job's service is not touched
    assert cleanup_node("n1", states, grace=5.0, job="41") is None
    assert user.poll() is None and (states / "n1.json").exists()
    env = _env(SLURMD_NODENAME="n1")
    proc = subprocess.run([PY, "-m", "instride", "job", "--cleanup", "--only-job", "42",
                           "--state-dir", str(states)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "stopped the service of job 42" in proc.stdout
    assert user.wait(10) == -signal.SIGTERM
    assert root.poll() is None  # recorded, alive, but not the directory owner's: untouched
    assert not managed.exists() and tree(states) == []


@pytest.mark.root
def test_root_cleanup_removes_with_the_owners_rights_only(
    foreign_service: dict[str, object]
) -> None:
    """Root removes a user's managed directory with that user's rights: what the user could
    not remove (root's files inside it; with a path component swapped for a link between the
    checks and the removal, someone else's directory) stays."""
    states, managed = foreign_service["states"], foreign_service["managed"]
    assert isinstance(states, Path) and isinstance(managed, Path)
    roots = managed / "root-only"
    roots.mkdir()
    (roots / "kept").write_text("root's")  # (a root-owned directory: the user cannot empty it)
    assert cleanup_node("n1", states, grace=5.0, job="42") is not None
    assert (roots / "kept").read_text() == "root's"
    assert tree(states) == []


@pytest.mark.root
def test_root_cleanup_removes_the_record_only_from_the_owners_directory(
    foreign_service: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root removed the node's record by path after its checks: a user who meanwhile renamed
    their state directory and put a link to another directory in its place had root remove a
    file of the record's name there (someone else's). The record is removed beneath the
    directory's descriptor now, only from a directory of the owner."""
    from instride.launch import agent

    states = foreign_service["states"]
    assert isinstance(states, Path)
    victim = tmp_path / "roots"
    victim.mkdir(mode=0o700)
    (victim / "n1.json").write_text("root's")
    leftovers = agent._remove_leftovers

    def swapped(record: dict, owner: int) -> None:  # (the user, while root stops the service)
        leftovers(record, owner)
        states.rename(tmp_path / "moved")
        states.symlink_to(victim)

    monkeypatch.setattr(agent, "_remove_leftovers", swapped)
    assert cleanup_node("n1", states, grace=5.0, job="42") is not None
    assert (victim / "n1.json").read_text() == "root's"
    assert (tmp_path / "moved" / "n1.json").exists()  # (the link named another directory)


@pytest.mark.root
def test_root_cleanup_refuses_a_record_of_another_owner(
    foreign_service: dict[str, object]
) -> None:
    states, user = foreign_service["states"], foreign_service["user"]
    assert isinstance(states, Path) and isinstance(user, subprocess.Popen)
    os.chown(states / "n1.json", 0, 0)  # planted by someone else than the directory's owner
    with pytest.raises(LaunchError, match=f"service record {states / 'n1.json'} belongs to "
                                          f"uid 0, not to the owner of {states}"):
        cleanup_node("n1", states)
    assert user.poll() is None
    os.chown(states / "n1.json", NOBODY, NOBODY)
    os.chmod(states, 0o770)
    with pytest.raises(LaunchError, match="open to other users"):
        cleanup_node("n1", states)
    assert user.poll() is None


# ---------------------------------------------------------------------- the task prolog script
def _node_env(args: Sequence[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(node_env_script()), *args], env=_env(**env),
                          capture_output=True, text=True, timeout=60)


def _write_node_env(root: Path, node: str, host: str) -> None:
    d = root / node / "j1" / ".instride"
    d.mkdir(parents=True)
    (d / "node.env").write_text(f"# host {host}\nexport INSTRIDE_DIR={d.parent}\n"
                                f"export INSTRIDE_ADDR=10.0.0.1:7437\nexport INSTRIDE_NODE={node}\n")


def test_node_env_without_a_service_unsets_the_inherited_settings(tmp_path: Path) -> None:
    job = {"INSTRIDE_JOB_DIR": f"{tmp_path}/%n/j%j", "INSTRIDE_JOB_ID": "1",
           "INSTRIDE_DIR": "/batch/host", "INSTRIDE_ADDR": "10.0.0.9:7437",
           "INSTRIDE_NODE": "batchhost"}
    prolog = _node_env([], **job)
    assert prolog.returncode == 0
    lines = prolog.stdout.splitlines()
    assert lines[0].startswith("print instride: no instride service on ")
    assert lines[1:] == ["unset INSTRIDE_DIR", "unset INSTRIDE_ADDR", "unset INSTRIDE_NODE"]
    wrapped = _node_env(["sh", "-c", "echo ${INSTRIDE_DIR-unset} ${INSTRIDE_NODE-unset}"],
                        **job)
    assert wrapped.stdout == "unset unset\n"
    assert "no instride service on" in wrapped.stderr


def test_node_env_takes_no_file_of_another_user(tmp_path: Path) -> None:
    """A node.env naming this host in a directory of another user (a shared /dev/shm: made
    first by them, with settings of theirs) was taken; only the user's own is."""
    host = os.uname().nodename
    node = host.split(".")[0]
    _write_node_env(tmp_path, node, host)
    job = {"INSTRIDE_JOB_DIR": f"{tmp_path}/%n/j%j", "INSTRIDE_JOB_ID": "1"}
    assert _node_env(["sh", "-c", "echo $INSTRIDE_NODE"], **job).stdout == f"{node}\n"
    for path in (tmp_path / node / "j1", tmp_path / node / "j1" / ".instride" / "node.env"):
        os.chown(path, 4242, 4242)
        wrapped = _node_env(["sh", "-c", "echo ${INSTRIDE_NODE-unset}"], **job)
        assert wrapped.stdout == "unset\n", (path, wrapped.stdout)
        os.chown(path, os.getuid(), os.getgid())


def test_a_working_directory_with_a_space_is_no_trouble(scratch: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's working directory went into Redis's configuration unquoted: a TMPDIR with a
    space made Redis refuse to start (LaunchError)."""
    import tempfile

    spaced = tmp_path / "with space"
    spaced.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spaced))
    svc = _local(scratch, tmp_path)
    assert svc.run(["true"]) == 0
    _assert_torn_down(svc, scratch, tmp_path)


def test_node_env_finds_this_host_whatever_slurmd_nodename_says(tmp_path: Path) -> None:
    host = os.uname().nodename
    _write_node_env(tmp_path, host.split(".")[0], host)
    _write_node_env(tmp_path, "node1", "node1-host")  # the node SLURMD_NODENAME names
    job = {"INSTRIDE_JOB_DIR": f"{tmp_path}/%n/j%j", "INSTRIDE_JOB_ID": "1",
           "SLURMD_NODENAME": "node1"}
    wrapped = _node_env(["sh", "-c", "echo $INSTRIDE_NODE"], **job)
    assert wrapped.stdout == f"{host.split('.')[0]}\n", wrapped.stderr
    prolog = _node_env([], **job)
    assert prolog.stdout.splitlines() == [
        f"export INSTRIDE_DIR={tmp_path / host.split('.')[0] / 'j1'}",
        "export INSTRIDE_ADDR=10.0.0.1:7437", f"export INSTRIDE_NODE={host.split('.')[0]}"]


# ---------------------------------------------------------------------- signals, teardown
class LocalServices(JobServices):
    """This machine as the only node; the per-node command runs as is (no launcher)."""

    name = "local"

    def __init__(self, agent: Sequence[str] | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.agent = agent
        self.seen: dict[str, object] = {}

    def detect(self) -> None:
        self.job_id = "t" + secrets.token_hex(3)
        self.nodes = [node_name(self.base_env)]
        self.this_node, self.this_addr = self.nodes[0], "127.0.0.1"

    def per_node(self, argv: Sequence[str]) -> list[str]:
        return list(self.agent or argv)

    def registered(self) -> bool:
        self.seen.update(agents=self._agents, redis=self._redis, workdir=self.workdir)
        return super().registered()


def _local(scratch: Path, tmp_path: Path, cls: type[LocalServices] = LocalServices,
           **kwargs: object) -> LocalServices:
    return cls(dir_pattern=f"{scratch}/%n/j%j", port=free_port(),
               env=_env(INSTRIDE_JOB_STATE_DIR=str(tmp_path / "states")), **kwargs)


def _assert_torn_down(svc: LocalServices, scratch: Path, tmp_path: Path) -> None:
    agents, redis, workdir = svc.seen["agents"], svc.seen["redis"], svc.seen["workdir"]
    assert isinstance(agents, subprocess.Popen) and isinstance(redis, subprocess.Popen)
    assert agents.poll() is not None and redis.poll() is not None
    assert isinstance(workdir, Path) and not workdir.exists()
    assert tree(scratch) == [] and tree(tmp_path / "states") == []


def test_signal_while_the_services_start_stops_the_start(scratch: Path, tmp_path: Path) -> None:
    class Interrupted(LocalServices):
        calls = 0

        def registered(self) -> bool:
            Interrupted.calls += 1
            if Interrupted.calls == 3:  # in the wait for the agents: like scancel
                os.kill(os.getpid(), signal.SIGTERM)
            return super().registered()

    svc = _local(scratch, tmp_path, Interrupted, agent=["sleep", "300"])
    assert svc.run([PY, "-c", "raise SystemExit(9)"]) == 128 + signal.SIGTERM
    _assert_torn_down(svc, scratch, tmp_path)
    assert svc.seen["agents"].returncode == -signal.SIGTERM  # type: ignore[attr-defined]


def test_a_job_cancelled_while_its_services_start_says_so(scratch: Path, tmp_path: Path) -> None:
    """scancel signals every process of the step: an agent that ended of it before the start
    looked at the signal made the job fail with ServerStartError (status 6) instead of ending
    as cancelled (128 + 15)."""
    class Cancelled(LocalServices):
        calls = 0

        def registered(self) -> bool:
            super().registered()  # (what the test's teardown check looks at)
            Cancelled.calls += 1
            if Cancelled.calls == 3:  # the signal, and the agents gone of it at once
                os.kill(os.getpid(), signal.SIGTERM)
                assert self._agents is not None
                self._agents.kill()
                self._agents.wait()
            return False

        def _check_signal(self) -> None:  # (the start looks at the agents first: the race)
            if self._agents is None or self._agents.poll() is None:
                super()._check_signal()

    svc = _local(scratch, tmp_path, Cancelled, agent=["sleep", "300"])
    assert svc.run([PY, "-c", "raise SystemExit(9)"]) == 128 + signal.SIGTERM
    _assert_torn_down(svc, scratch, tmp_path)


def test_signals_around_the_command_end_never_skip_the_teardown(
    scratch: Path, tmp_path: Path
) -> None:
    """SIGTERM as the command exits and again during the teardown: everything still stops."""
    class SignalledTeardown(LocalServices):
        def signal_agents(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            super().signal_agents()

    svc = _local(scratch, tmp_path, SignalledTeardown)
    before = signal.getsignal(signal.SIGTERM)
    rc = svc.run(["sh", "-c", "kill -TERM $PPID"])
    assert rc in (0, 128 + signal.SIGTERM)
    _assert_torn_down(svc, scratch, tmp_path)
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


def test_a_services_launcher_that_cannot_run_is_a_launch_error(scratch: Path,
                                                                 tmp_path: Path) -> None:
    """No ``srun`` (or ``mpiexec``) to start the services with: a typed error naming it (it
    was an untyped ``OSError``), and what had started (Redis, the work directory) is gone."""
    svc = _local(scratch, tmp_path, agent=[str(tmp_path / "no-srun")])
    with pytest.raises(LaunchError, match="cannot start the services: .*no-srun"):
        svc.run(["true"])
    assert svc._redis is None and svc.workdir is None
    assert tree(scratch) == [] and tree(tmp_path / "states") == []


def test_agents_give_their_server_the_jobs_ready_timeout(scratch: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ready-timeout`` bounds each node's data server start too (it was a fixed 30 s)."""
    from instride.launch.agent import SERVER_READY_TIMEOUT, _server_ready_timeout

    svc = _local(scratch, tmp_path, ready_timeout=300.0)
    assert svc.agent_env()["INSTRIDE_JOB_READY_TIMEOUT"] == "300.0"
    monkeypatch.setenv("INSTRIDE_JOB_READY_TIMEOUT", "300.0")
    assert _server_ready_timeout() == 300.0
    for bad in ("nan", "-1", "soon"):
        monkeypatch.setenv("INSTRIDE_JOB_READY_TIMEOUT", bad)
        assert _server_ready_timeout() == SERVER_READY_TIMEOUT


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_what_the_command_left_running_is_stopped(scratch: Path, tmp_path: Path) -> None:
    """A script that ends with programs still running in its background (two levels deep):
    they are stopped before the services they use (they used to run on, orphaned)."""
    pids = tmp_path / "pids"
    script = (f"sleep 311 & echo $! > {pids}; sh -c 'sleep 312 & echo $! >> {pids}; wait' & "
              f"while [ $(wc -l < {pids}) -lt 2 ]; do sleep 0.05; done; exit 3")
    svc = _local(scratch, tmp_path)
    assert svc.run(["sh", "-c", script]) == 3
    _assert_torn_down(svc, scratch, tmp_path)
    left = [int(x) for x in pids.read_text().split()]
    assert len(left) == 2 and not any(_alive(p) for p in left), left


def test_a_redis_that_ends_under_the_command_stops_it(scratch: Path, tmp_path: Path) -> None:
    """The job's Redis killed while the command runs (the OOM killer): the command is stopped
    and the job fails with ``ServiceLostError`` naming it (exit status 6), the services torn
    down. The command ran on to its end, its consumers retrying for ever, the job's status its
    own. The managed directory is the user's alone (0700; it had the umask's 0755)."""
    import threading

    from instride.launch.base import ServiceLostError

    mode = tmp_path / "mode"
    svc = _local(scratch, tmp_path)

    def kill_redis() -> None:
        while svc._child is None or not mode.exists():
            time.sleep(0.02)
        assert svc._redis is not None
        os.kill(svc._redis.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_redis, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(ServiceLostError, match="Redis") as info:
        svc.run(["sh", "-c", f"stat -c %a $INSTRIDE_DIR > {mode}; sleep 120"])
    assert time.monotonic() - started < 60  # (not the command's 120 s)
    assert "exited with status -9" in str(info.value)  # (exit status 6: see the CLI's table)
    killer.join(5)
    assert mode.read_text().strip() == "700"
    _assert_torn_down(svc, scratch, tmp_path)


def test_a_node_that_reports_its_service_lost_stops_the_command(scratch: Path,
                                                                 tmp_path: Path) -> None:
    """A node's data server that dies ends its agent, which reports it (the job's ERRORS hash)
    — but MPICH's mpiexec lets the other agents run on, so the services step never ended and
    the loss went unnoticed: the command ran on without that node. The report is looked at
    (here written as an agent writes it, while the agents run on, as under MPICH)."""
    import threading

    from instride.launch.base import ERRORS, ServiceLostError, redis_client

    svc = _local(scratch, tmp_path)
    started = tmp_path / "started"

    def report() -> None:
        while svc._child is None or not started.exists():
            time.sleep(0.02)
        client = redis_client(svc.redis_url or "")
        try:
            client.hset(ERRORS.format(job=svc.job_id), "nodeX",
                        "error|the data server ended on its own (status -9)")
        finally:
            client.close()

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    t0 = time.monotonic()
    with pytest.raises(ServiceLostError, match="nodeX.*ended on its own"):
        svc.run(["sh", "-c", f"touch {started}; sleep 120"])
    assert time.monotonic() - t0 < 60
    reporter.join(5)
    _assert_torn_down(svc, scratch, tmp_path)


def test_a_services_step_that_never_ends_still_lets_redis_and_the_directory_go(
        scratch: Path, tmp_path: Path) -> None:
    """The services step does not end even after SIGKILL (a ``srun`` stuck on a hung file
    system): the teardown still stops Redis and removes its working directory, then raises
    (Redis ran on, and the directory stayed, until ``instride job`` itself exited)."""
    svc = _local(scratch, tmp_path)
    svc.up()
    agents, redis_proc, workdir = svc._agents, svc._redis, svc.workdir
    assert agents is not None and redis_proc is not None and workdir is not None

    class Stuck:  # (the services step as seen through a hung srun: no wait ever ends)
        pid, returncode = agents.pid, None

        def wait(self, timeout: float | None = None) -> int:
            raise subprocess.TimeoutExpired("srun", timeout or 0)

        def poll(self) -> None:
            return None

        def send_signal(self, sig: int) -> None:
            pass

        terminate = kill = lambda self: None  # noqa: E731

    svc._agents = Stuck()  # type: ignore[assignment]
    try:
        with pytest.raises(LaunchError, match="did not end even after SIGKILL"):  # (typed:
            svc.down()  # a bare TimeoutExpired's traceback before)
        assert redis_proc.poll() is not None and not workdir.exists()
    finally:
        svc._agents = agents  # (the real one, stopped now)
        svc.down()
    _assert_torn_down(svc, scratch, tmp_path)


KILLED_JOB = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
tempfile.tempdir = sys.argv[4]  # (the job's working directory is made in it)
from tests.launch.test_job_services import _local
_local(Path(sys.argv[2]), Path(sys.argv[3])).run(["sh", "-c", sys.argv[5]])
"""


def test_a_job_killed_outright_leaves_no_process_and_no_directory(scratch: Path,
                                                                 tmp_path: Path) -> None:
    """``instride job`` SIGKILLed (no teardown of its own) while its command runs a program in
    the background and another in a session of its own: both are stopped (found by the job's
    cookie in their environment) and the job's working directory is removed. Only the command
    itself got a signal (its parent-death signal); the rest ran on, the directory stayed."""
    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    tmp.mkdir()
    script = (f"sleep 314 & echo $! >> {pids}; setsid sh -c 'echo $$ >> {pids}; exec sleep 313' &"
              " wait")
    root = str(Path(__file__).resolve().parents[2])
    job = subprocess.Popen([PY, "-c", KILLED_JOB, root, str(scratch), str(tmp_path), str(tmp),
                            script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
            time.sleep(0.05)
        assert os.listdir(tmp), "the job made no working directory"
    finally:
        job.kill()
        job.wait()
    left = [int(x) for x in pids.read_text().split()]
    deadline = time.monotonic() + 20
    while (any(_alive(p) for p in left) or os.listdir(tmp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not any(_alive(p) for p in left), left
        assert os.listdir(tmp) == []
    finally:
        for p in left:  # (only what is still there: a number gone may be another's soon)
            if _alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)


COUNTING = """
import os, signal, sys, time
log = sys.argv[1]
def count(signum, frame):
    with open(log, "a") as fh:
        fh.write(f"{signum}\\n")
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, count)
open(log + ".ready", "w").close()
while not os.path.exists(log):
    time.sleep(0.02)
time.sleep(1.5)  # (a second copy of the signal, if any, comes well within this)
sys.exit(3)
"""

TERMINAL_JOB = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.launch.test_job_services import _local
svc = _local(Path(sys.argv[2]), Path(sys.argv[3]))
os._exit(svc.run([sys.executable, "-c", sys.argv[4], sys.argv[5]]))
"""


def _in_a_terminal(scratch: Path, tmp_path: Path, send: str) -> tuple[int, list[int]]:
    """Run a job whose command counts the signals it gets in a terminal of its own (a pty,
    the job in its foreground process group, as typed at a shell); once the command runs,
    ``send``: ``"ctrl-c"`` types Ctrl-C, ``"int"``/``"term"`` signal ``instride job``'s
    process alone (``kill PID`` from elsewhere, a batch system). Return the job's exit status
    and the signals the command got."""
    import pty
    import select

    log = tmp_path / "signals"
    ready = Path(f"{log}.ready")
    root = str(Path(__file__).resolve().parents[2])
    pid, terminal = pty.fork()
    if pid == 0:  # (in the terminal: session leader, its foreground process group)
        try:
            os.execv(PY, [PY, "-c", TERMINAL_JOB, root, str(scratch), str(tmp_path), COUNTING,
                          str(log)])
        finally:
            os._exit(127)
    output = b""
    sent, done, status = False, 0, 0
    try:
        deadline = time.monotonic() + 60
        while True:
            if select.select([terminal], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):  # (EIO: the terminal's last process ended)
                    output += os.read(terminal, 4096)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, output.decode(errors="replace")
            if ready.exists() and not sent:
                sent = True
                if send == "ctrl-c":
                    os.write(terminal, b"\x03")  # (the terminal signals its foreground group)
                else:
                    os.kill(pid, signal.SIGINT if send == "int" else signal.SIGTERM)
    finally:
        if not sent or not done:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(terminal)
    got = [int(x) for x in log.read_text().split()] if log.exists() else []
    return os.waitstatus_to_exitcode(status), got


@pytest.mark.parametrize(("send", "expected"), [("ctrl-c", signal.SIGINT),
                                                ("int", signal.SIGINT),
                                                ("term", signal.SIGTERM)])
def test_the_command_gets_a_signal_once(scratch: Path, tmp_path: Path, send: str,
                                         expected: int) -> None:
    """Ctrl-C in a terminal signals its whole foreground process group: the command had it
    from the terminal and again from ``instride job`` — and ``mpiexec``/``srun`` take a second
    Ctrl-C within a second as "abort now", without their cleanup. It gets it once; a signal
    sent to ``instride job`` alone (``kill``, a batch system's SIGTERM) is still passed on."""
    rc, got = _in_a_terminal(scratch, tmp_path, send)
    assert got == [expected], got
    assert rc == 3  # (the command's own status: it ended of its own accord)
    assert tree(scratch) == [] and tree(tmp_path / "states") == []


def test_a_command_that_ignores_the_signal_is_killed(scratch: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM passed on to a command that ignores it: SIGKILL after the grace (the job and its
    services used to wait for it for ever); what it started, ignoring SIGTERM too, as well."""
    from instride.launch import base

    monkeypatch.setattr(base, "STOP_GRACE", 1.0)
    pids = tmp_path / "pids"
    svc = _local(scratch, tmp_path)
    rc = svc.run(["sh", "-c", f"trap '' TERM; sleep 600 & echo $! > {pids}; kill -TERM $PPID; "
                  "wait"])
    assert rc == 128 + signal.SIGKILL
    _assert_torn_down(svc, scratch, tmp_path)
    assert not _alive(int(pids.read_text()))


# ---------------------------------------------------------------------- Slurm client failures
@pytest.mark.parametrize(("tool", "script", "why"), [
    ("squeue", "exec sleep 300", "did not answer within 0.5 s"),
    ("scancel", "exec sleep 300", "did not answer within 0.5 s"),
    ("scancel", None, "cannot run"),
    ("scancel", "echo 'scancel: error: Access/permission denied' >&2; exit 1",
     "exited with status 1 scancel: error: Access/permission denied"),
])
def test_slurm_teardown_survives_a_hanging_or_broken_client(
    tool: str, script: str | None, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"squeue": "echo '5.0 instride-services'", "scancel": "exit 0"}
    fakes[tool] = script or ""
    for name, body in fakes.items():
        shebang = "#!/bin/sh" if script or name != tool else "#!/nonexistent/sh"
        (bin_dir / name).write_text(f"{shebang}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm_launcher, "CLIENT_TIMEOUT", 0.5)
    svc = SlurmServices(env=_env(SLURM_JOB_ID="5"))
    svc.job_id = "5"
    agents = subprocess.Popen(["sleep", "300"])
    redis = subprocess.Popen(["sleep", "300"])
    svc._agents, svc._redis = agents, redis
    workdir = svc.workdir = Path(tempfile.mkdtemp(dir=tmp_path))
    svc.down()
    assert agents.returncode == -signal.SIGTERM  # srun signalled directly instead
    assert redis.returncode == -signal.SIGTERM
    assert not workdir.exists()
    err = capsys.readouterr().err
    assert f"instride job: warning: `{bin_dir / tool}" in err and why in err
