"""Serving compiled models: requests packed into the shared layout, behind Ray Serve.

A door beside ``api`` and ``export``. The Ray-free part checks and packs requests
(``schema.py``: fields and the per-request check; ``id_ranges.py``: the embedding tables' rows
each id field must stay in, read from the graph; ``packing.py``: one shared-layout call for
many requests and its outputs split back; ``served.py``: a compiled model or saved program as a
served model; ``protocol.py``: the HTTP JSON protocol); ``deployment.py`` is the Ray Serve
deployment and ``launch.py`` starts or joins Ray for ``rocs serve``. Ray is imported only by
those two and ``ray_private.py`` (the private modules of Ray that ``launch`` reaches into, and the
Ray range they are tested with; the ``serve`` extra: ``pip install 'rocs-compiler[serve]'``). See
docs/serving.md.
"""
