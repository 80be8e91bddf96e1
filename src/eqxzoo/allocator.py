"""The memory allocator of a long-running command: glibc malloc on transparent huge pages.

XLA:CPU allocates each step's temporaries afresh, and glibc maps every allocation above
32 MB with a new ``mmap``: the reference step of ``python -m pipelines.bench`` touched
300 MB of fresh memory a step, 76,800 minor page faults of 4 KiB. Where the kernel gives
transparent huge pages on request (``madvise``, the common default) and glibc has the
``glibc.malloc.hugetlb`` tunable (2.35 and later), ``hugetlb=1`` asks for 2 MiB pages for
those mappings: 1,200 faults a step, the step 8-14% faster. A tunable is read only when the
process starts, so the command runs itself again with it (`rerun_with_huge_pages`); this
module imports nothing heavy, so that costs a fraction of a second.
"""

import os
import sys
from pathlib import Path

TUNABLES_ENV = "GLIBC_TUNABLES"
HUGE_PAGES = "glibc.malloc.hugetlb=1"
# "system": the process's allocator as it starts (no re-run).
OPT_OUT_ENV = "EQXZOO_ALLOCATOR"
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_GLIBC = (2, 35)


def huge_pages_on_request() -> bool:
    """Whether ``glibc.malloc.hugetlb=1`` changes anything here: glibc new enough to read
    it, and transparent huge pages given on ``madvise`` (``always``: every mapping has them
    already; ``never``: none can)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        glibc = tuple(int(part) for part in version.split(".")[:2])
        mode = TRANSPARENT_HUGE_PAGES.read_text()
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and glibc >= MIN_GLIBC and "[madvise]" in mode


def rerun_with_huge_pages(command: str) -> None:
    """Run this process's command line again under ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
    (`os.execv`: this call returns only where it does nothing), saying so on the first line
    of standard output. Nothing happens where the tunable would change nothing, where
    ``GLIBC_TUNABLES`` is set already (the user's choice, or the re-run itself), or with
    ``EQXZOO_ALLOCATOR=system``. Only for a command's entry point, never inside a library
    call: it replaces the process."""
    if TUNABLES_ENV in os.environ or os.environ.get(OPT_OUT_ENV) == "system":
        return
    if not huge_pages_on_request():
        return
    print(
        f"{command}: running again on glibc malloc with transparent huge pages "
        f"({TUNABLES_ENV}={HUGE_PAGES}; {OPT_OUT_ENV}=system runs without)",
        flush=True,
    )
    os.environ[TUNABLES_ENV] = HUGE_PAGES
    os.execv(sys.executable, sys.orig_argv)
