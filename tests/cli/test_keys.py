"""The ``instride`` command: every command has --help; info, ls, wait, cat, gc work."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import instride
from instride.cli import build_parser, main, timeout_arg


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out.extend(_commands(sub, (*prefix, name)))
    return out


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _commands(build_parser())
    names = {c[0] for c in commands}
    assert {"info", "ls", "wait", "cat", "gc", "serve"} <= names
    for cmd in commands:
        with pytest.raises(SystemExit) as info:
            main([*cmd, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "usage: instride" in out
        assert "%%" not in out, cmd  # (a description argparse does not %-format: "idle %%")


def _cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True,
                          text=True, timeout=60, **kw)  # type: ignore[call-overload]


def test_info_ls_cat_wait(managed_dir: Path) -> None:
    info = json.loads(_cli("info", "--json").stdout)
    assert info["mode"] == "local"
    assert info["dir"] == str(managed_dir)
    assert info["version"] == instride.__version__
    with instride.open("runs/a.txt", "w") as fh:
        fh.write("alpha")
    with instride.open("runs/b.txt", "w") as fh:
        fh.write("beta")
    with instride.open("other/c.txt", "w") as fh:
        fh.write("c")
    assert _cli("ls", "runs/").stdout.split() == ["runs/a.txt", "runs/b.txt"]
    assert len(_cli("ls").stdout.split()) == 3
    assert _cli("cat", "runs/b.txt").stdout == "beta"
    assert _cli("wait", "runs/a.txt").stdout.strip() == str(managed_dir / "runs" / "a.txt")


@pytest.mark.root
def test_info_says_which_native_paths_run(managed_dir: Path) -> None:
    """The compiled paths built by the install are loaded (``make test`` builds the UCX engine
    too); the idle helper's prefault is on where the process may raise the helper (root), and
    says why it is off where it may not (run without CAP_SYS_NICE through setpriv, as an
    unprivileged user would be)."""
    if os.geteuid() != 0:
        pytest.fail("this test needs root (to run a process with and without CAP_SYS_NICE)")
    assert resource.getrlimit(resource.RLIMIT_NICE)[0] == 0  # (else the reason differs)
    info = json.loads(_cli("info", "--json").stdout)
    assert (info["native"], info["tcp_engine"], info["ucx_engine"]) == ("loaded",) * 3
    assert info["prefault"].startswith("on")
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to run a process without CAP_SYS_NICE"
    res = subprocess.run([setpriv, "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice",
                          sys.executable, "-m", "instride", "info", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    off = json.loads(res.stdout)["prefault"]
    assert off.startswith("off") and "CAP_SYS_NICE" in off and "RLIMIT_NICE 0" in off


def test_wait_blocks_until_published(managed_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "instride", "wait", "late/key", "--timeout", "30"],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert proc.poll() is None
    with instride.open("late/key", "wb") as fh:
        fh.write(b"1")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.strip().endswith("late/key")


@pytest.mark.parametrize("command", ["wait", "cat"])
def test_explicit_inf_overrides_instride_timeout(managed_dir: Path, command: str) -> None:
    """``--timeout inf`` means no limit, whatever INSTRIDE_TIMEOUT says (not given: it decides)."""
    env = dict(os.environ, INSTRIDE_TIMEOUT="0.5")
    res = _cli(command, "never/set", env=env)  # (the setting applies without --timeout)
    assert res.returncode == 3, res.stderr
    proc = subprocess.Popen([sys.executable, "-m", "instride", command, "late/inf", "--timeout",
                             "inf"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, proc.communicate()
        with instride.open("late/inf", "wb") as fh:
            fh.write(b"here")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.strip().endswith("late/inf") if command == "wait" else out == "here"


def test_timeout_option_values() -> None:
    """``timeout_arg``: seconds as given; an explicit no limit is ``inf``, never ``None``
    (the default of every ``--timeout``, "not given")."""
    assert timeout_arg("0") == 0.0 and timeout_arg("2.5") == 2.5
    for text in ("inf", "forever", "none", "INF"):
        assert timeout_arg(text) == math.inf
    for text in ("-1", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            timeout_arg(text)


def test_stream_reader_takes_an_explicit_inf(managed_dir: Path) -> None:
    """The stream commands (analyze, export, archive) hand ``--timeout inf`` to a Stream as
    ``math.inf``: it waits for a frame published later (no limit, no overflow)."""
    import threading

    import numpy as np

    client = instride.Client(instride.Settings.from_env())

    def produce() -> None:
        time.sleep(1.0)
        with instride.Stream("late-stream", mode="w", client=client) as s:
            s.append(np.zeros((2, 3), dtype=np.float32))

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        frames = list(instride.Stream("late-stream", client=client, timeout=timeout_arg("inf")))
    finally:
        producer.join(30)
        client.close()
    assert len(frames) == 1


def test_errors_are_reported_not_tracebacks(managed_dir: Path) -> None:
    res = _cli("wait", "nothing/here", "--timeout", "0.2")
    assert res.returncode == 3  # timeout
    assert "timed out" in res.stderr and "nothing/here" in res.stderr
    assert "Traceback" not in res.stderr
    res = _cli("cat", "../../etc/passwd")
    assert res.returncode == 4  # invalid input
    assert "invalid key" in res.stderr


def test_output_errors_are_a_quiet_exit_or_a_message(managed_dir: Path) -> None:
    """A reader that went away (`instride ls | head -1`): exit 1 quietly, as CPython recommends;
    any other error writing the output (`instride cat K > /dev/full`): a message, exit 1."""
    for i in range(3):
        with instride.open(f"out/k{i}", "wb") as fh:
            fh.write(b"x" * 1000)
    r, w = os.pipe()
    os.close(r)  # (the reader is gone before the first write: EPIPE for sure)
    try:
        for args in (("ls",), ("cat", "out/k0"), ("wait", "out/k1")):
            res = subprocess.run([sys.executable, "-m", "instride", *args], stdout=w,
                                 stderr=subprocess.PIPE, text=True, timeout=60)
            assert (res.returncode, res.stderr) == (1, ""), args
    finally:
        os.close(w)
    with open("/dev/full", "wb") as full:
        for args in (("ls",), ("cat", "out/k0")):
            res = subprocess.run([sys.executable, "-m", "instride", *args], stdout=full,
                                 stderr=subprocess.PIPE, text=True, timeout=60)
            assert res.returncode == 1, args
            assert "No space left on device" in res.stderr and "Traceback" not in res.stderr


def test_bad_setting_is_a_clear_error(managed_dir: Path) -> None:
    import os

    env = dict(os.environ, INSTRIDE_TIMEOUT="soon")
    res = _cli("info", env=env)
    assert res.returncode == 2  # usage: a bad setting (README's exit statuses)
    assert "INSTRIDE_TIMEOUT" in res.stderr


def test_main_leaves_sigterm_as_it_found_it(managed_dir: Path) -> None:
    """The command turns SIGTERM into its cleanup while it runs; a caller in the same process
    gets the default back afterwards (it kept the command's handler)."""
    import signal

    from instride.cli import main

    # (the default to begin with: an imd:// reader of an earlier test in this process, MDAnalysis's
    # or imdclient's, may have set its own)
    found = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert main(["info"]) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, found)


def test_info_does_not_show_the_redis_password(managed_dir: Path) -> None:
    """``instride info`` masked the token but printed the Redis URL with its password."""
    from tests.conftest import free_port

    url = f"redis://:s3cretpw@127.0.0.1:{free_port()}/0"
    run = _cli("info", "--json", env=dict(os.environ, INSTRIDE_REDIS_URL=url))
    assert run.returncode == 0, run.stderr
    assert "s3cretpw" not in run.stdout + run.stderr
    assert json.loads(run.stdout)["redis_url"].startswith("redis://***@127.0.0.1")


def test_sighup_stops_a_command_with_its_cleanup(managed_dir: Path) -> None:
    """An ssh session or terminal that closes sends SIGHUP: its default action killed the
    command at once, with no cleanup (a `bench study` or `cluster up` left its servers,
    namespaces and mounts). It now stops as for SIGTERM, with status 129; nohup's ignored
    SIGHUP stays ignored."""
    import signal

    waiter = subprocess.Popen([sys.executable, "-m", "instride", "wait", "hup/never",
                               "--timeout", "60"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # (waiting)
    waiter.send_signal(signal.SIGHUP)
    _, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 129, err
    ignored = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN);"
         " from instride.cli import main; sys.exit(main(['wait', 'hup/never', '--timeout', '3']))"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    ignored.send_signal(signal.SIGHUP)
    _, err = ignored.communicate(timeout=30)
    assert ignored.returncode == 3, err  # (its timeout, not the signal)


def test_gc_refuses_a_negative_or_nan_min_age(managed_dir: Path) -> None:
    """``gc --min-age -1`` and ``nan`` ran as if the option were 0."""
    for bad in ("-1", "nan"):
        res = _cli("gc", "--min-age", bad)
        assert res.returncode == 2 and "--min-age" in res.stderr, res.stderr
