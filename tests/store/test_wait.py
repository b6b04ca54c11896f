"""Waiting (instride.store.wait): inotify wake-ups, no lost wake-up, no busy wait, timeouts
that name the key."""

from __future__ import annotations

import os
import textwrap
import threading
import time
from pathlib import Path

import pytest

import instride
from instride.errors import ConsumeTimeout
from tests.conftest import finish, spawn_py


def test_no_wakeup_is_lost_under_racing_publications(client: instride.Client) -> None:
    # Consumers start waiting at the same moment their key is published, many times over:
    # a publication between the existence check and arming the watch must never be missed.
    errors: list[BaseException] = []

    def consume(key: str) -> None:
        try:
            client.consume(key, timeout=10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for i in range(200):
        key = f"race/k{i}"
        t = threading.Thread(target=consume, args=(key,))
        t.start()
        with client.open(key, "wb") as fh:
            fh.write(b"x")
        t.join(15)
        assert not t.is_alive()
    assert errors == []


def test_timeout_names_key_and_seconds(client: instride.Client) -> None:
    start = time.monotonic()
    with pytest.raises(ConsumeTimeout) as info:
        client.consume("never/there", timeout=0.3)
    assert time.monotonic() - start < 5
    assert isinstance(info.value, TimeoutError)
    assert info.value.key == "never/there"
    assert info.value.waited >= 0.3
    assert "never/there" in str(info.value) and "0.3" in str(info.value)


def test_a_timeout_is_kept_to_the_microsecond_not_rounded_up_to_a_millisecond(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid-polling reader sleeps until its poll window opens, a fraction of a millisecond
    before the frame is due: a wait counted in whole milliseconds, rounded up, slept through
    the window. The C sleep is now given the remaining time in µs (here ~249,000 of 250,000: a
    count of whole milliseconds would be 250), and a wait never ends early."""
    from instride.store import wait as wait_mod

    lib = wait_mod.library()
    assert lib is not None, "libinstride_local.so is missing: reinstall instride"
    asked: list[int] = []

    class Spy:  # the library, with the timeouts of isl_wait noted on the way
        def __getattr__(self, name: str) -> object:
            return getattr(lib, name)

        def isl_wait(self, *args: object) -> int:
            asked.append(int(args[5]))  # type: ignore[call-overload]
            return int(lib.isl_wait(*args))

    monkeypatch.setattr(wait_mod, "library", lambda: Spy())
    path = [tmp_path / "never"]
    start = time.monotonic()
    with pytest.raises(ConsumeTimeout):
        wait_mod.wait_any(path, 0.25, label="never")
    assert time.monotonic() - start >= 0.25
    assert asked, "the wait did not sleep in C"
    first = asked[0]
    # µs left (a count of whole ms would be 250; the margin: a loaded machine, before the wait)
    assert 150_000 <= first <= 250_000, asked


def test_waiting_does_not_busy_wait(managed_dir: Path) -> None:
    proc = spawn_py(textwrap.dedent(
        """
        import resource, instride
        try:
            instride.consume("idle/key", timeout=2.0)
        except instride.ConsumeTimeout:
            pass
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print(ru.ru_utime + ru.ru_stime)
        """
    ))
    rc, out, err = finish(proc)
    assert rc == 0, err
    # Interpreter start-up and imports cost CPU; two seconds of polling would cost ~2 s.
    assert float(out) < 1.0


def test_publication_between_check_and_watch_is_not_missed(
    client: instride.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Deterministic version of the race: the file is published exactly after the first
    # existence check and before the inotify watch is armed. Only the re-check after arming
    # can see it (no event will ever come).
    from instride.store import wait as local

    original = local._watcher.watch
    published = []

    def publish_then_arm(directory: Path, keep: int = 0) -> None:
        if not published:
            with client.open("race/exact", "wb") as fh:
                fh.write(b"1")
            published.append(True)
        original(directory, keep)

    monkeypatch.setattr(local._watcher, "watch", publish_then_arm)
    start = time.monotonic()
    assert client.consume("race/exact", timeout=5) == client.root / "race" / "exact"
    assert time.monotonic() - start < 2  # found by the re-check, not by the timeout
    assert published


def _wait_cpu_seconds(key: str, timeout: float, spin: str = "0") -> float:
    """CPU seconds a fresh process spends in one consume of ``key`` that times out."""
    proc = spawn_py(textwrap.dedent(
        f"""
        import os, resource, instride
        os.environ["INSTRIDE_SPIN"] = "{spin}"
        c = instride.Client()
        before = resource.getrusage(resource.RUSAGE_SELF)
        try:
            c.consume("{key}", timeout={timeout})
        except instride.ConsumeTimeout:
            pass
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        """
    ))
    rc, out, err = finish(proc)
    assert rc == 0, err
    return float(out)


def test_wait_does_not_burn_cpu(managed_dir: Path) -> None:
    assert _wait_cpu_seconds("idle/cpu", 1.5) < 0.1  # a polling loop would use most of 1.5 s


def test_spinning_wait_sees_the_file_and_keeps_the_timeout(managed_dir: Path) -> None:
    from instride.store import wait_any

    d = managed_dir / "spin"
    d.mkdir()
    key = d / "k"
    threading.Timer(0.05, key.write_bytes, args=(b"x",)).start()
    assert wait_any([key], 10.0, label="spin/k", spin=5.0) == key
    # the spin comes out of the timeout: a missing file still fails on time, through inotify
    start = time.monotonic()
    with pytest.raises(ConsumeTimeout):
        wait_any([d / "never"], 0.3, label="spin/never", spin=0.1)
    assert 0.25 < time.monotonic() - start < 3.0
    # a file that comes after the spin is over is found by the sleeping wait
    late = d / "late"
    threading.Timer(0.3, late.write_bytes, args=(b"x",)).start()
    assert wait_any([late], 10.0, label="spin/late", spin=0.05) == late


def test_instride_spin_makes_a_consumer_busy_poll(managed_dir: Path) -> None:
    """INSTRIDE_SPIN=s: a consumer spends its wait on the CPU (measured with getrusage)."""
    # the 0.4 s of polling (all of it on an idle machine; a share of it when other processes
    # take the cores), against a few ms for a sleeping wait measured beside it
    spinning = _wait_cpu_seconds("spin/cpu", 0.6, spin="0.4")
    sleeping = _wait_cpu_seconds("spin/cpu", 0.6)
    assert spinning > max(0.08, 5 * sleeping), (spinning, sleeping)


@pytest.fixture(params=["c", "python"])
def wait_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both implementations of the sleeping wait: C (libinstride_local.so) and Python."""
    from instride import native
    from instride.store import wait

    if request.param == "python":
        monkeypatch.setattr(wait, "library", lambda: None)
    else:  # built by pip install with the package: its absence is a failure, not a skip
        assert native.library() is not None, "libinstride_local.so is missing: reinstall instride"
    return str(request.param)


def _consume_in_thread(client: instride.Client, key: str) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["path"] = client.consume(key, timeout=10)
        except BaseException as exc:  # reported by the caller
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_wake_up_returns_the_published_key(client: instride.Client, wait_impl: str) -> None:
    t, result = _consume_in_thread(client, "woken/k")
    time.sleep(0.2)  # asleep in the wait by now
    with client.open("woken/other", "wb") as fh:  # an event of another file: not a wake-up
        fh.write(b"o")
    with client.open("woken/k", "wb") as fh:
        fh.write(b"k")
    t.join(15)
    assert result == {"path": client.root / "woken" / "k"}


def test_a_link_appearing_during_a_wait_is_refused(
    client: instride.Client, tmp_path: Path, wait_impl: str
) -> None:
    # the check right after the wake-up sees a symbolic link where the key should be
    from instride.errors import UnsafePathError

    target = tmp_path / "elsewhere"
    target.write_bytes(b"x")
    (client.root / "links").mkdir()
    t, result = _consume_in_thread(client, "links/k")
    time.sleep(0.2)
    (client.root / "links" / "k").symlink_to(target)
    t.join(15)
    assert not t.is_alive()
    assert isinstance(result.get("error"), UnsafePathError), result
    assert "symbolic link" in str(result["error"])


def test_a_watched_directory_removed_and_made_again_still_wakes(
    client: instride.Client, wait_impl: str
) -> None:
    # the watch goes away with its directory (IN_IGNORED): the wait arms a new one
    d = client.root / "again"
    d.mkdir()
    t, result = _consume_in_thread(client, "again/k")
    time.sleep(0.2)
    d.rmdir()
    time.sleep(0.2)
    d.mkdir(exist_ok=True)  # (the wait may have made it again already, to watch it)
    time.sleep(0.2)
    with client.open("again/k", "wb") as fh:
        fh.write(b"k")
    t.join(15)
    assert result == {"path": d / "k"}


def test_a_signal_handler_runs_during_a_wait(client: instride.Client, wait_impl: str) -> None:
    # the C sleep returns on EINTR, so Python runs the handler (Ctrl-C) at once
    import signal

    class Alarm(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Alarm

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        start = time.monotonic()
        with pytest.raises(Alarm):
            client.consume("sig/never", timeout=30)
        assert time.monotonic() - start < 10  # the handler's exception, not the timeout
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not (client.root / "sig").exists()  # the failed wait removed what it made


def test_a_wait_on_more_directories_than_the_watch_cap_sleeps(client: instride.Client) -> None:
    """``wait_any`` over 65 keys in 65 directories (one more than the watches kept): arming
    the last evicted the first, whose removal woke the wait to arm it again, without end —
    a core spun for the whole wait. It sleeps now."""
    import resource

    keys = [f"many{i}/k" for i in range(65)]
    got: list[object] = []

    def wait() -> None:  # (a thread of its own: its watches are its own, none from before;
        before = resource.getrusage(resource.RUSAGE_THREAD)  # see the round 38 note)
        t0 = time.monotonic()
        got.append(client.wait_any(keys, timeout=30))
        after = resource.getrusage(resource.RUSAGE_THREAD)
        got.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        got.append(time.monotonic() - t0)

    waiter = threading.Thread(target=wait)
    timer = threading.Timer(1.5, lambda: client.open(keys[0], "wb").close())
    waiter.start()
    timer.start()
    waiter.join(60)
    timer.cancel()
    assert got[0] == keys[0]
    cpu, wall = got[1], got[2]
    assert isinstance(cpu, float) and isinstance(wall, float)
    assert wall >= 1.4 and cpu < 0.5 * wall, (cpu, wall)  # (it spun: cpu ~ wall)


def test_a_wide_wait_in_a_thread_holding_watches_of_removed_directories_sleeps(
        client: instride.Client) -> None:
    """A thread that watched 80 directories (64 watches kept), half of them removed since,
    then waits on 65 keys in new directories: the removed ones' ``IN_IGNORED`` (more than a
    native wait lists at once) made it drop every watch and arm them again, and each removal
    queued another ``IN_IGNORED``: a core spun for the whole wait (the round 38 note). Its
    own evictions' ``IN_IGNORED`` are no news either."""
    import resource

    old = [client.root / f"old{i}" for i in range(80)]
    for d in old:
        d.mkdir()
    keys = [f"wide{i}/k" for i in range(65)]
    got: list[object] = []

    def wait() -> None:
        for i in range(80):  # (each wait arms a watch on its directory, which stays held)
            with pytest.raises(ConsumeTimeout):
                client.wait_any([f"old{i}/nothing"], timeout=0.002)
        for d in old[:40]:
            d.rmdir()
        before = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.monotonic()
        got.append(client.wait_any(keys, timeout=30))
        after = resource.getrusage(resource.RUSAGE_THREAD)
        got.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        got.append(time.monotonic() - t0)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while waiter.is_alive() and not (client.root / "wide64").is_dir():
        time.sleep(0.01)  # (the wide wait is armed once its last directory is there)
    time.sleep(1.5)
    client.open(keys[-1], "wb").close()
    waiter.join(60)
    assert not waiter.is_alive()
    assert got[0] == keys[-1]
    cpu, wall = got[1], got[2]
    assert isinstance(cpu, float) and isinstance(wall, float)
    assert wall >= 1.4 and cpu < 0.5 * wall, (cpu, wall)  # (it spun: cpu ~ wall)


def test_a_watched_directory_removed_before_its_watch_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter makes the key's directory, then watches it; another waiter's failed wait
    removes that directory, empty, in between: the watch failed with a bare
    FileNotFoundError and the wait with it, where it must wait (publishers make the
    directory again in that race; waiters now do too)."""
    import shutil

    from inotify_simple import INotify

    from instride.store.wait import _Watcher

    real, calls = INotify.add_watch, []

    def removed_first(self: INotify, path: object, mask: int) -> int:
        calls.append(path)
        if len(calls) == 1:  # (as the other waiter's rmdir, between mkdir and add_watch)
            shutil.rmtree(path)
        return real(self, path, mask)

    monkeypatch.setattr(INotify, "add_watch", removed_first)
    watcher = _Watcher()
    watcher.watch(tmp_path / "racy")
    assert len(calls) == 2 and (tmp_path / "racy") in watcher.wds


def test_a_second_interrupt_during_the_clean_up_still_removes_the_watched_dirs(
        managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait interrupted (Ctrl-C) removes the directories it made to watch; a second
    interrupt that came during that removal (a double Ctrl-C; GNU ``timeout`` signals the
    child, then its whole process group) stopped it, and the rest stayed behind. The
    removal goes on now, and the interrupt is raised once it is done."""
    from instride.store import wait

    def interrupted(_root: str, _keys: list[str], full: list[str], *_args: object) -> int:
        os.makedirs(os.path.dirname(full[0]))  # (made to watch, as the wait does)
        raise KeyboardInterrupt  # (the first signal)

    drops: list[Path] = []
    drop = wait._watcher.drop

    def drop_once_interrupted(directory: Path) -> None:
        drops.append(directory)
        if len(drops) == 2:  # (the second signal, in the middle of the removal)
            raise KeyboardInterrupt
        drop(directory)

    monkeypatch.setattr(wait, "_sleep", interrupted)
    monkeypatch.setattr(wait._watcher, "drop", drop_once_interrupted)
    client = instride.Client(instride.Settings.from_env({"INSTRIDE_DIR": str(managed_dir)}))
    with pytest.raises(KeyboardInterrupt):
        client.consume("a/b/c/key", timeout=30)
    assert not (managed_dir / "a").exists()


def test_a_wait_while_a_directory_above_is_renamed_gets_the_key(managed_dir: Path) -> None:
    """``run`` renamed away while a consumer waits for ``run/sub/k``, a new ``run/sub`` made
    and the key published there: the watch had gone with the old directory, and the wait
    slept until its timeout. It looks every second whether its directory moved."""
    (managed_dir / "run" / "sub").mkdir(parents=True)
    client = instride.Client(instride.Settings.from_env({"INSTRIDE_DIR": str(managed_dir)}))
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(client.consume("run/sub/k", timeout=20)))
    waiter.start()
    time.sleep(0.3)  # (waiting)
    (managed_dir / "run").rename(managed_dir / "run_old")
    (managed_dir / "run" / "sub").mkdir(parents=True, exist_ok=True)  # (the wait's look may too)
    with client.open("run/sub/k", "wb") as fh:
        fh.write(b"k")
    waiter.join(10)
    assert not waiter.is_alive() and got == [managed_dir / "run" / "sub" / "k"]

