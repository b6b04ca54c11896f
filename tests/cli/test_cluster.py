"""``instride cluster up/exec/status/down`` from the command line, in separate processes."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from instride.cli import main
from instride.emulate import EmulatedCluster
from instride.emulate import emulated as em
from instride.emulate import netns as nn
from instride.errors import ConfigError

PY = sys.executable


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "instride", "cluster", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("sub", [[], ["up"], ["down"], ["exec"], ["status"]])
def test_help_on_every_subcommand(sub: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cluster", *sub, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: instride cluster")


@pytest.mark.root
def test_cli_round_trip(tmp_path: Path) -> None:
    name = "t" + secrets.token_hex(5)
    prefix = EmulatedCluster(nodes=1, name=name).prefix
    base = tmp_path / "base"
    try:
        up = cli("up", "--nodes", "2", "--name", name, "--no-serve", "--base-dir", str(base),
                 "--env", "INSTRIDE_TIMEOUT=7")
        assert up.returncode == 0, up.stderr
        assert "node2" in up.stdout and (base / "node2").is_dir()

        code = ("import os; print(os.environ['INSTRIDE_NODE'], os.environ['INSTRIDE_DIR'], "
                "os.environ['INSTRIDE_TIMEOUT'], os.environ['INSTRIDE_REDIS_URL'])")
        ex = cli("exec", "2", "--name", name, "--", PY, "-c", code)
        assert ex.returncode == 0, ex.stderr
        node, directory, timeout, url = ex.stdout.split()
        assert (node, directory, timeout) == ("node2", str(base / "node2"), "7")
        assert url.startswith("redis://10.213.")
        assert cli("exec", "1", "--name", name, "--", "sh", "-c", "exit 3").returncode == 3
        # killed by a signal: 128 + N, as a shell (and `instride job`) reports it
        assert cli("exec", "1", "--name", name, "--", "sh", "-c", "kill -9 $$").returncode == 137
        # SIGTERM to `instride cluster exec` reaches the command, which ends as it chooses (it
        # used to be SIGKILLed from here: no trap ran, its children ran on)
        # (the background program's output away from our pipe: its end is what we read to)
        script = ("trap 'kill $!; echo trapped; exit 5' TERM; sleep 300 >/dev/null 2>&1 & "
                  "echo ready; wait")
        ex = subprocess.Popen([PY, "-m", "instride", "cluster", "exec", "1", "--name", name,
                               "--", "sh", "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert ex.stdout is not None and ex.stdout.readline().strip() == "ready"
            ex.send_signal(signal.SIGTERM)
            assert ex.communicate(timeout=60)[0].strip() == "trapped" and ex.returncode == 5
        finally:
            if ex.poll() is None:
                ex.kill()
                ex.wait()

        st = cli("status", "--name", name, "--json")
        assert st.returncode == 0, st.stderr
        info = json.loads(st.stdout)
        assert info["status"] == "up" and info["redis"]["listening"] is True
        assert [n["ip"] for n in info["nodes"]] == [
            url.split("//")[1].rsplit(".", 1)[0] + f".{10 + i}" for i in (1, 2)
        ]
        assert name in cli("status").stdout
        # a corrupt state file is reported, naming it; the other clusters are still shown
        corrupt = em.state_path("x" + secrets.token_hex(5))
        corrupt.write_text("{not json")
        try:
            every = cli("status")
            assert every.returncode == 1 and name in every.stdout
            assert f"corrupt state file {corrupt}" in every.stderr
            gone = cli("down", "--name", corrupt.stem)
            assert gone.returncode == 1 and f"corrupt state file {corrupt}" in gone.stderr
            assert corrupt.exists(), "what it lists is unknown: left for a person"
        finally:
            corrupt.unlink()

        bad = cli("exec", "3", "--name", name, "--", "true")
        assert bad.returncode == 2 and "nodes 1..2" in bad.stderr
    finally:
        down = cli("down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert [ns for ns in nn.list_netns() if ns.startswith(prefix)] == []
    assert not (base / "node1").exists()
    again = cli("down", "--name", name)
    assert again.returncode == 0 and f"no cluster {name}" in again.stderr
    missing = cli("status", "--name", name)
    assert missing.returncode == 1 and "no cluster named" in missing.stderr


@pytest.mark.parametrize("var", ["INSTRIDE_SOCKET", "INSTRIDE_REDIS_URL", "INSTRIDE_DIR",
                                 "INSTRIDE_ADDR"])
def test_node_variables_are_refused_in_env(var: str, capsys: pytest.CaptureFixture[str]) -> None:
    # they would make nodes share one socket, or a --no-redis cluster talk to a Redis
    assert main(["cluster", "up", "--no-redis", "--no-serve", "--env", f"{var}=/x"]) == 2
    assert f"bad setting env='{var}=/x': {var} is set by the cluster" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=var):
        EmulatedCluster(nodes=1, env={var: "v"})
    assert EmulatedCluster(nodes=1, env={"INSTRIDE_TIMEOUT": "7"}).nodes[0].env[
        "INSTRIDE_TIMEOUT"] == "7"


@pytest.mark.root
def test_exec_runs_a_command_that_has_its_own_double_dash(tmp_path: Path) -> None:
    """With --name before NODE, argparse drops the `--` after NODE: the first `--` of the
    command itself was then taken for exec's own, and the command refused (exit 2)."""
    name = "t" + secrets.token_hex(5)
    prefix = EmulatedCluster(nodes=1, name=name).prefix
    try:
        up = cli("up", "--nodes", "1", "--name", name, "--no-serve", "--no-redis",
                 "--base-dir", str(tmp_path / "base"))
        assert up.returncode == 0, up.stderr
        for before in (["--name", name, "1"], ["1", "--name", name]):
            ex = cli("exec", *before, "--", "echo", "a", "--", "b")
            assert (ex.returncode, ex.stdout) == (0, "a -- b\n"), ex.stderr
            ex = cli("exec", *before, "--", "sh", "-c", 'echo "$0" "$@"', "--", "x")
            assert (ex.returncode, ex.stdout) == (0, "-- x\n"), ex.stderr
        ex = cli("exec", "--name", name, "1", "--", PY, "-m", "instride", "run", "--", "true")
        assert ex.returncode == 0, ex.stderr
    finally:
        down = cli("down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert [ns for ns in nn.list_netns() if ns.startswith(prefix)] == []


def test_down_with_a_bad_name_is_a_usage_error() -> None:
    """A bad --name given to `down` exited 1 (as a failed teardown), not 2 as for status."""
    down = cli("down", "--name", "bad/name")
    assert down.returncode == 2 and "bad/name" in down.stderr, down.stderr


@pytest.mark.root
def test_up_with_a_file_as_base_dir_is_a_usage_error(tmp_path: Path) -> None:
    """`up --base-dir FILE` exited 1 with a bare "[Errno 20] Not a directory"."""
    name = "t" + secrets.token_hex(5)
    prefix = EmulatedCluster(nodes=1, name=name).prefix
    afile = tmp_path / "afile"
    afile.write_text("")
    for base in (afile, afile / "below"):
        up = cli("up", "--nodes", "1", "--name", name, "--no-serve", "--no-redis",
                 "--base-dir", str(base))
        assert up.returncode == 2, (up.stdout, up.stderr)
        assert "base_dir" in up.stderr and "not a directory" in up.stderr
        assert [ns for ns in nn.list_netns() if ns.startswith(prefix)] == []
        assert not em.state_path(name).exists()
