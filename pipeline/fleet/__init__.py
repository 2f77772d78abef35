"""A fleet of sessions on Ray: one front door, many nodes, one placement group per session.

``charstream serve --cluster`` runs the front door (``frontdoor.py``); each admitted session gets
a placement group on one node (``layout.py``) and a ``SessionHost`` actor there (``host.py``)
running the session and its own egress server, so media flows between the page and that node.
``health.py`` turns the sessions' average fps into the fleet-health figures, ``commands.py`` is
``charstream fleet status|drain``, ``cluster.py`` starts a local multi-node cluster (tests, the
load test in ``bench.py``). Ray is an optional extra (``pip install 'charstream[fleet]'``);
``config.py`` and ``layout.py`` import without it.
"""
