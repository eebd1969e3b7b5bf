"""The engine: slots, the pinned pool, the copy engine, layouts, snapshots and ``ModelState``.

Imports nothing from ``backends/``, ``checkpoint/`` or ``rl/`` (a test reads
the imports to keep it so): backends reach the engine through the contract in
``source.py``; everything above the engine builds on ``ModelState``.
"""
