"""Writers that hold a file open, for the tests of publications that must refuse a file still
being written (the preload library's rename into the managed directory, ``Client.publish``):
real processes, and the look at ``/proc/locks`` that tells when one waits for a read lease."""

from __future__ import annotations

#: A Python script: opens argv[1] for writing (argv[2] "writer": a descriptor; "mapping": a
#: shared writable mapping, the descriptor closed), appends b" more" through it, says "open",
#: and keeps it until a line comes on stdin.
HOLDER = r'''
import mmap, os, sys
path, how = sys.argv[1:3]
fd = os.open(path, os.O_RDWR | os.O_APPEND)
os.write(fd, b" more")
if how == "mapping":
    held = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
print("open", flush=True)
sys.stdin.readline()
'''


def lease_breaking(ino: int) -> bool:
    """Whether a lease on inode ``ino`` is being broken: a writer's open waits for it."""
    with open("/proc/locks") as fh:
        return any(f":{ino} " in line and "BREAKING" in line for line in fh)
