"""The operator's side: command lines, the ``broker`` admin command, the dashboard and the
composition root that picks a store and runners. Nothing imports this package; the console
scripts start in :mod:`broker.ops.launch`.
"""
