"""The application layer: the ``densematch`` command and what it alone needs.

Files in, files out: the command (:mod:`.cli`), one pair of files to one result (:mod:`.tasks`),
the batch runner (:mod:`.batch`), reading and writing (:mod:`.io`), pictures (:mod:`.viz`), the
demo and the quick benchmark (:mod:`.demo`), features of plain images (:mod:`.features`) and
cases with known answers (:mod:`.synthetic`). Everything here is built on the public API; the
core (the rest of densematch) never imports it (tests/test_architecture.py checks).
"""
