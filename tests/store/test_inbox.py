"""A stream reader's inbox: reusable receive buffers in anonymous memory files."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from instride.store.inbox import KEEP_FREE, NAME, Inbox, InboxBuffer


def test_a_buffer_has_its_pages_allocated_before_it_is_mapped() -> None:
    buf = InboxBuffer()
    try:
        size = 644 * 1024 + 123  # (not a whole number of pages)
        mem = buf.writable(size)
        st = os.fstat(buf.fd)
        assert st.st_size >= size and len(mem) >= size
        # allocated, not a sparse file only sized: a store cannot fault for want of a page
        assert st.st_blocks * 512 >= size
        mem[size - 1] = 7
        assert buf.view(size)[size - 1] == 7
    finally:
        buf.close()


def test_a_buffer_grows_never_shrinks_and_its_view_is_read_only() -> None:
    buf = InboxBuffer()
    try:
        buf.writable(1 << 20)[:4] = b"abcd"
        small = buf.view(4)
        assert bytes(small) == b"abcd"
        buf.writable(4096)  # a smaller frame: the mapping stays as large
        assert os.fstat(buf.fd).st_size == 1 << 20
        with pytest.raises(TypeError):
            small[0] = 1  # (a frame's arrays are read-only views)
        big = buf.writable(3 << 20)
        assert len(big) == 3 << 20 and bytes(buf.view(4)) == b"abcd"
    finally:
        buf.close()


def test_no_memory_for_a_buffer_is_an_oserror_naming_it() -> None:
    # A file-size limit makes the allocation fail (EFBIG) as a lack of memory would: an
    # error the reader can catch, naming the buffer, and no signal.
    code = textwrap.dedent(
        """
        import resource, signal
        from instride.store.inbox import InboxBuffer
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        buf = InboxBuffer()
        try:
            buf.writable(1 << 20)
        except OSError as exc:
            print(exc.errno, exc.filename)
        else:
            print("no error")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == f"{errno.EFBIG} {NAME}", out.stderr


def test_an_inbox_reuses_released_buffers_and_keeps_few_free() -> None:
    inbox = Inbox()
    try:
        first, release = inbox.take()
        release()
        again, release_again = inbox.take()
        assert again is first  # released: reused for the next frame
        held = [inbox.take() for _ in range(KEEP_FREE + 3)]
        assert len({id(b) for b, _ in held} | {id(again)}) == KEEP_FREE + 4  # one per frame held
        for _, rel in held:
            rel()
        release_again()
        release_again()  # (a second release does nothing)
        free = [b for b in inbox._buffers if not b.held]  # noqa: SLF001
        assert len(free) == KEEP_FREE
    finally:
        inbox.close()


def test_a_forked_child_never_receives_into_its_parents_buffers() -> None:
    """A buffer is a shared mapping of a memory file, and a forked child inherits it: the
    child's copy of a reader that moved on (its copy of the frame released) received its next
    frame into the very memory the parent's frame's arrays view — the parent saw its frame's
    bytes change under it. A child receives into buffers of its own."""
    inbox = Inbox()
    try:
        parents, release = inbox.take()
        parents.writable(4)[:4] = b"AAAA"
        frame = parents.view(4)  # the parent holds this frame
        spare, release_spare = inbox.take()
        spare.writable(4)[:4] = b"SSSS"
        release_spare()  # free: the parent's next frame goes here
        pid = os.fork()
        if pid == 0:  # the child moves on: its copy of the frame released, two frames taken
            code = 1
            try:
                release()
                for _ in range(2):
                    buf, _rel = inbox.take()
                    buf.writable(4)[:4] = b"BBBB"
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bytes(frame) == b"AAAA"
        assert bytes(spare.view(4)) == b"SSSS"
        release()
    finally:
        inbox.close()
