"""Side-by-side benchmark of the broker and its peers (``make bench``; see ``bench/__main__.py``).

Only the standard library is imported at package level: every system's own virtual
environment imports ``bench.harness`` and ``bench.jobs``.
"""
