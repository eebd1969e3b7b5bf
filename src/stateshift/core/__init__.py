"""The engine: slots, the pinned pool, the copy engine, layouts, snapshots and ``ModelState``.

Imports nothing from ``backends/``, ``checkpoint/`` or ``rl/`` (a test reads
the imports to keep it so): backends reach the engine through the contract in
``source.py``; everything above the engine builds on ``ModelState``.

``ModelState`` (``state.py``) is the user's facade over an internal ``Core``
(``engine.py``, whose docstring lists the internal API the libraries use
through ``core_of(state)``); the verbs (``verbs.py``, ``swap.py``) move slots
between tiers (``tiers.py``: device, host, dropped; ``disk_tier.py``: disk).
"""
